//! Compiles the small MPI constants shim with mpicc and generates the C header into OUT_DIR;
//! a unit test in src/capi.rs checks that the committed include/ferrovod.h matches it.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/mpi_consts.c");
    // cbindgen reads every module (a new pub const anywhere can reach the header)
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let mut build = cc::Build::new();
    build.file("src/transport/mpi_consts.c");
    let have_mpicc = std::process::Command::new("mpicc")
        .arg("--version")
        .output()
        .is_ok();
    if have_mpicc {
        build.compiler("mpicc");
    } else {
        build.include("/usr/lib/x86_64-linux-gnu/openmpi/include");
    }
    build.compile("ferrovod_mpi_consts");

    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    cbindgen::generate(&crate_dir)
        .expect("cbindgen failed on src/capi.rs")
        .write_to_file(std::path::Path::new(&out_dir).join("ferrovod.h"));
}
