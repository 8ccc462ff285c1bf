//! One cbindgen configuration (`artifact/cbindgen.toml`) run on the shipped crate
//! (`artifact/`, which re-exports this one) feeds both the committed header `include/tpu_sync.h`
//! and the Python cffi declarations that maturin generates. The committed header must equal a
//! fresh generation, and maturin's variant of it (its cffi overrides applied) must declare
//! exactly the same functions. `make header` (sets `TPU_SYNC_WRITE_HEADER=1`) rewrites the
//! header.

use std::collections::BTreeSet;

fn generate(mut config: cbindgen::Config, artifact: &str) -> String {
    config.language = cbindgen::Language::C;
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(artifact)
        .with_config(config)
        .generate()
        .expect("cbindgen generation")
        .write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

/// Names of the functions a header declares (`tpu_sync_*(`).
fn functions(header: &str) -> BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = BTreeSet::new();
    for line in header.lines().filter(|l| !l.trim_start().starts_with('*')) {
        let mut rest = line;
        while let Some(i) = rest.find("tpu_sync_") {
            let start = &rest[i..];
            let len = start.find(|c: char| !ident(c)).unwrap_or(start.len());
            let before_ok = rest[..i].chars().last().is_none_or(|c| !ident(c));
            if before_ok && start[len..].starts_with('(') {
                out.insert(start[..len].to_string());
            }
            rest = &start[len..];
        }
    }
    out
}

#[test]
fn committed_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let artifact = format!("{dir}/artifact");
    let config =
        cbindgen::Config::from_file(format!("{artifact}/cbindgen.toml")).expect("cbindgen.toml");
    assert!(
        !std::path::Path::new(&format!("{dir}/cbindgen.toml")).exists(),
        "one cbindgen configuration only: artifact/cbindgen.toml"
    );
    let fresh = generate(config.clone(), &artifact);
    let path = format!("{dir}/include/tpu_sync.h");
    if std::env::var_os("TPU_SYNC_WRITE_HEADER").is_some() {
        std::fs::write(&path, &fresh).expect("write header");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "{path} is out of date with the Rust sources: run `make header` and commit the result"
    );
    assert!(fresh.contains(&format!(
        "#define TPU_SYNC_ABI_VERSION {}",
        tpu_sync_ffi::TPU_SYNC_ABI_VERSION
    )));

    // What maturin generates for cffi from the same configuration (its enforced settings, see
    // maturin's `cffi_binding.rs`): the same functions as the committed header.
    let mut cffi = config;
    cffi.no_includes = true;
    cffi.sys_includes = Vec::new();
    cffi.defines = Default::default();
    cffi.include_guard = None;
    cffi.pragma_once = false;
    cffi.cpp_compat = false;
    let python = generate(cffi, &artifact);
    let (c, py) = (functions(&fresh), functions(&python));
    assert_eq!(c, py, "the header and the cffi declarations differ");
    for f in [
        "tpu_sync_callbacks_disable",
        "tpu_sync_endpoint_reject",
        "tpu_sync_endpoint_pull_wait",
        "tpu_sync_transfer_report",
        "tpu_sync_abi_version",
    ] {
        assert!(c.contains(f), "{f} missing from the header");
    }
    assert!(c.len() > 60, "only {} functions found", c.len());
}
