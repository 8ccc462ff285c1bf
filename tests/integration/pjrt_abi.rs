//! Checks every hand-written PJRT struct declaration against the `pjrt_c_api.h` that the installed
//! plugin ships: `sizeof`, `offsetof` of each field and `<type>_STRUCT_SIZE`, compiled by the C
//! compiler as static assertions.

use crate::common;

use std::fmt::Write;
use std::process::Command;

fn c_field(ty: &str, field: &str) -> String {
    let f = field.trim_start_matches("r#");
    match (ty, f) {
        ("PJRT_NamedValue", "value") => "int64_value".into(),
        ("PJRT_Buffer_MemoryLayout", "layout") => "tiled".into(),
        _ => f.to_string(),
    }
}

#[test]
fn rust_declarations_match_the_installed_header() {
    let include = common::pjrt_include();
    assert!(
        include.join("pjrt_c_api.h").is_file(),
        "no pjrt_c_api.h in {}",
        include.display()
    );
    let table = tpu_sync::pjrt::sys::layout_table();
    assert!(
        table.len() > 60,
        "expected the full set of declared structs, got {}",
        table.len()
    );
    let mut c = String::from("#include <stddef.h>\n#include \"pjrt_c_api.h\"\n");
    let mut checks = 0;
    for s in &table {
        writeln!(
            c,
            "_Static_assert(sizeof({0}) == {1}, \"sizeof({0}) is not {1}\");",
            s.name, s.size
        )
        .unwrap();
        writeln!(
            c,
            "_Static_assert({0}_STRUCT_SIZE == {1}, \"{0}_STRUCT_SIZE is not {1}\");",
            s.name, s.struct_size
        )
        .unwrap();
        checks += 2;
        for (f, off) in &s.fields {
            let cf = c_field(s.name, f);
            writeln!(
                c,
                "_Static_assert(offsetof({0}, {1}) == {2}, \"offsetof({0}, {1}) is not {2}\");",
                s.name, cf, off
            )
            .unwrap();
            checks += 1;
        }
    }
    let dir = std::env::temp_dir().join(format!("tpu-sync-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("abi_check.c");
    std::fs::write(&src, &c).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-fsyntax-only", "-Werror"])
        .arg(format!("-I{}", include.display()))
        .arg(&src)
        .output()
        .expect("run the C compiler");
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "{} of {checks} layout checks compiled with errors:\n{}",
        cc,
        String::from_utf8_lossy(&out.stderr)
    );
    // The check itself must be able to fail: a wrong offset is rejected by the compiler.
    let bad = "#include <stddef.h>\n#include \"pjrt_c_api.h\"\n_Static_assert(offsetof(PJRT_Api, PJRT_Buffer_CopyRawToHost) == 8, \"x\");\n";
    let src = std::env::temp_dir().join(format!("tpu-sync-abi-bad-{}.c", std::process::id()));
    std::fs::write(&src, bad).unwrap();
    let out = Command::new(&cc)
        .args(["-std=c11", "-fsyntax-only"])
        .arg(format!("-I{}", include.display()))
        .arg(&src)
        .output()
        .unwrap();
    std::fs::remove_file(&src).ok();
    assert!(!out.status.success(), "a wrong offset must fail to compile");
}
