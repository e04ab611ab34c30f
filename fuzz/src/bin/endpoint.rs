//! Fuzz target: `rixl::fuzzing::endpoint` (see that function for what it checks).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        rixl::fuzzing::endpoint(data);
    });
}
