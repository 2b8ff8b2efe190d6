//! Compiles tests/c/capi_test.c with `cc` against include/ferrovod.h and libferrovod.so and
//! runs it under `mpirun -np 2` and `-np 4`.

use std::path::PathBuf;
use std::process::Command;

/// target/<profile>/deps: where this test binary lives and where `cargo test` builds the
/// library's cdylib for it (target/<profile>/libferrovod.so is only refreshed by `cargo build`).
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

#[test]
fn c_program_runs_collectives_under_mpirun() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let libdir = deps_dir();
    assert!(
        libdir.join("libferrovod.so").exists(),
        "libferrovod.so not found in {}",
        libdir.display()
    );
    let bin = std::env::temp_dir().join(format!("ferrovod-capi-test-{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/c/capi_test.c"))
        .arg("-L")
        .arg(&libdir)
        // DT_RPATH (not RUNPATH): found before LD_LIBRARY_PATH, which cargo points at
        // target/<profile>, where a stale copy of the library may sit
        .arg("-Wl,--disable-new-dtags")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .args(["-lferrovod", "-o"])
        .arg(&bin)
        .status()
        .expect("cc");
    assert!(status.success(), "compiling the C test failed");
    for np in ["2", "4"] {
        let out = Command::new("timeout")
            .args([
                "120",
                "mpirun",
                "-np",
                np,
                "--oversubscribe",
                "--allow-run-as-root",
            ])
            .args(["--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"])
            .arg(&bin)
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .expect("mpirun");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let passes = stdout.matches("C-RANK-PASSED").count();
        assert!(
            out.status.success() && passes.to_string() == np,
            "np={np}: exit {}, {passes} ranks passed\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_file(&bin);
}

/// The header names only the C API: every macro it defines carries the API's prefix, so that
/// including it cannot clash with a program's own names.
#[test]
fn header_macros_are_prefixed() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/ferrovod.h")).unwrap();
    let stray: Vec<&str> = (header.lines())
        .filter_map(|l| l.trim_start().strip_prefix("#define "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| !name.starts_with("FV_") && !name.starts_with("FERROVOD_"))
        .collect();
    assert!(
        stray.is_empty(),
        "unprefixed macros in ferrovod.h: {stray:?}"
    );
}
