//! The committed header `include/tpu_sync.h` must equal a fresh cbindgen generation.
//! `make header` (sets `TPU_SYNC_WRITE_HEADER=1`) rewrites it.

#[test]
fn committed_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config =
        cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generation")
        .write(&mut fresh);
    let path = format!("{dir}/include/tpu_sync.h");
    if std::env::var_os("TPU_SYNC_WRITE_HEADER").is_some() {
        std::fs::write(&path, &fresh).expect("write header");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "{path} is out of date with the Rust sources: run `make header` and commit the result"
    );
    let text = String::from_utf8(fresh).unwrap();
    assert!(text.contains(&format!(
        "#define TPU_SYNC_ABI_VERSION {}",
        tpu_sync_ffi::TPU_SYNC_ABI_VERSION
    )));
}
