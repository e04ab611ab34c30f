//! rixl's benchmarks and tools (not a dependency of the library): `rixl-perf` (perftest's tests,
//! flags and columns over rixl), the `rixl` inspection CLI, `gpu_check`, and criterion benches of
//! the transfer core.
#![forbid(unsafe_code)]
