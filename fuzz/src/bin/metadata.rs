//! Fuzz target: `rixl::fuzzing::metadata` (see that function for what it checks).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        rixl::fuzzing::metadata(data);
    });
}
