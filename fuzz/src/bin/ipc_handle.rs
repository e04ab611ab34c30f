//! Fuzz target: `rixl::fuzzing::ipc_handle` (see that function for what it checks).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        rixl::fuzzing::ipc_handle(data);
    });
}
