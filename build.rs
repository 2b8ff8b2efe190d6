//! Compiles the small MPI constants shim with mpicc and regenerates include/ferrovod.h.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/mpi_consts.c");
    println!("cargo:rerun-if-changed=src/capi.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let mut build = cc::Build::new();
    build.file("src/transport/mpi_consts.c");
    if std::process::Command::new("mpicc")
        .arg("--version")
        .output()
        .is_ok()
    {
        build.compiler("mpicc");
    } else {
        build.include("/usr/lib/x86_64-linux-gnu/openmpi/include");
    }
    build.compile("ferrovod_mpi_consts");

    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let out = std::path::Path::new(&crate_dir)
        .join("target")
        .join("ferrovod.h");
    match cbindgen::generate(&crate_dir) {
        Ok(bindings) => {
            bindings.write_to_file(&out);
        }
        Err(e) => println!("cargo:warning=cbindgen failed: {e}"),
    }
}
