//! Fuzz target: `rixl::fuzzing::side_channel` (see that function for what it checks).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        rixl::fuzzing::side_channel(data);
    });
}
