//! Fuzz target: `rixl::fuzzing::grant_keys` (see that function for what it checks).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        rixl::fuzzing::grant_keys(data);
    });
}
