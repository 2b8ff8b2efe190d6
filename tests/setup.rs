//! The setup scripts' checks: each requirement is found by exactly what uses it, and a missing
//! one is named with the package that provides it. Run after `scripts/setup.sh` (the test
//! command runs it first), so the unmodified check passes; each other test takes one thing away.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrovod-setup-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn check(script: &str, env: &[(&str, &Path)], path: Option<&Path>) -> Output {
    let mut cmd = Command::new("/bin/bash");
    cmd.arg(root().join("scripts").join(script))
        .arg("--check")
        .current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    cmd.output().expect("run the setup check")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn which(cmd: &str) -> PathBuf {
    let out = Command::new("bash")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{cmd} is not installed here");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The interpreter itself, not a pyenv shim (shims need the rest of PATH).
fn real_python() -> PathBuf {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[test]
fn setup_check_passes_once_set_up() {
    let out = check("setup.sh", &[], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "");
}

/// A PATH holding every command the check looks for but `mpirun`: exactly that is reported.
#[test]
fn setup_check_names_a_missing_command() {
    let bin = scratch("bin");
    let link = |name: &str, target: &Path| {
        std::os::unix::fs::symlink(target, bin.join(name)).unwrap();
    };
    for c in [
        "ls",
        "mpicc",
        "cc",
        "g++",
        "pkg-config",
        "cargo",
        "ip",
        "tc",
        "unshare",
        "cmake",
    ] {
        link(c, &which(c));
    }
    link("python3", &real_python());
    let out = check("setup.sh", &[], Some(&bin));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("command mpirun"), "{err}");
    assert!(err.contains("Debian package openmpi-bin"), "{err}");
    // and with mpirun back, nothing is missing
    link("mpirun", &which("mpirun"));
    let out = check("setup.sh", &[], Some(&bin));
    assert!(out.status.success(), "{}", stderr(&out));
    // cargo finds `cargo fuzz` through PATH and its home's bin: with neither, it is named
    let home = scratch("cargo-home");
    let out = check("setup.sh", &[("CARGO_HOME", home.as_path())], Some(&bin));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cargo install cargo-fuzz --locked"), "{err}");
    let _ = std::fs::remove_dir_all(&bin);
    let _ = std::fs::remove_dir_all(&home);
}

/// The image ships libclang-cpp.so.14 without libclang.so: bindgen cannot use it, and the
/// check must not take it for libclang.
#[test]
fn setup_check_is_not_fooled_by_libclang_cpp() {
    let dir = scratch("llvm");
    std::fs::write(dir.join("libclang-cpp.so.14"), b"").unwrap();
    std::fs::create_dir_all(dir.join("clang/14/include")).unwrap();
    std::fs::write(dir.join("clang/14/include/stddef.h"), b"").unwrap();
    let env = [("FERROVOD_SETUP_LIBCLANG_DIRS", dir.as_path())];
    let out = check("setup.sh", &env, None);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("libclang.so or libclang-<N>.so"), "{err}");
    assert!(err.contains("Debian package libclang-dev"), "{err}");
    // what libclang-dev installs: found
    std::fs::write(dir.join("libclang-14.so"), b"").unwrap();
    let out = check("setup.sh", &env, None);
    assert!(out.status.success(), "{}", stderr(&out));
    // the builtin headers are needed too
    std::fs::remove_file(dir.join("clang/14/include/stddef.h")).unwrap();
    let out = check("setup.sh", &env, None);
    assert!(
        stderr(&out).contains("clang builtin headers"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Virtual environments without the Python requirements (TensorFlow's and PyTorch's, MXNet's): each is
/// named with its pinned version and its environment, and ferrovod's own packages too.
#[test]
fn setup_python_check_names_missing_packages() {
    let dir = scratch("venv");
    let (venv, mx_venv) = (dir.join("venv"), dir.join("venv-mxnet"));
    for v in [&venv, &mx_venv] {
        let made = Command::new(real_python())
            .args(["-m", "venv", "--without-pip"])
            .arg(v)
            .status()
            .unwrap();
        assert!(made.success());
    }
    let out = check(
        "setup-python.sh",
        &[
            ("FERROVOD_VENV", venv.as_path()),
            ("FERROVOD_MXNET_VENV", mx_venv.as_path()),
        ],
        None,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let (tf, mx) = (venv.display(), mx_venv.display());
    for want in [
        format!("pytest in {tf} "),
        format!("tensorflow-cpu==2.21.0 in {tf} "),
        format!("tf_keras==2.21.0 in {tf} "),
        format!("scikit-learn in {tf} "),
        format!("torch==2.15.0 in {tf} "),
        format!("ferrovod in {tf} "),
        format!("horovod in {tf} "),
        format!("ferrovod-takeover.pth in {tf} "),
        format!("pytest in {mx} "),
        format!("mxnet==1.9.1 in {mx} "),
        format!("numpy==1.23.5 in {mx} "),
        format!("scikit-learn==1.5.2 in {mx} "),
        format!("ferrovod in {mx} "),
        format!("horovod in {mx} "),
        format!("ferrovod-takeover.pth in {mx} "),
    ] {
        assert!(err.contains(&format!("missing: {want}")), "{want}: {err}");
    }
    assert_eq!(err.lines().count(), 15, "{err}");
    // no environments at all
    let out = check(
        "setup-python.sh",
        &[
            ("FERROVOD_VENV", dir.join("absent").as_path()),
            ("FERROVOD_MXNET_VENV", dir.join("absent-mxnet").as_path()),
        ],
        None,
    );
    let err = stderr(&out);
    assert!(err.contains("missing: virtual environment"), "{err}");
    assert!(err.contains("absent-mxnet"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
