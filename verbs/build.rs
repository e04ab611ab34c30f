//! Generates the ibverbs FFI with bindgen (>= 0.72, `wrap_static_fns`) and compiles the C
//! wrappers of the static-inline verbs. Works with libclang 14 (Debian 12) and 19.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR set by cargo"));
    let wrappers = out.join("verbs_static_fns");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ibv_.*|___ibv_query_port")
        .allowlist_type("ibv_.*")
        .allowlist_var("IBV_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .derive_default(true)
        .derive_debug(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .layout_tests(true)
        .generate()
        .expect("bindgen failed on <infiniband/verbs.h>: is libibverbs-dev installed?");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
    cc::Build::new()
        .file(wrappers.with_extension("c"))
        .include(env::var("CARGO_MANIFEST_DIR").expect("manifest dir"))
        .warnings(false)
        .compile("rixl_verbs_static_fns");
    println!("cargo:rustc-link-lib=ibverbs");
}
