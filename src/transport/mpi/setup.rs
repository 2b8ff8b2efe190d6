//! Process-wide MPI setup: initialisation, finalisation, and Open MPI's TCP tuning (over
//! MPI_T) before MPI starts.

use std::ffi::c_int;

use mpi::ffi;

use super::*;

/// Whether MPI is initialised (and not finalised) in this process.
pub fn mpi_initialized() -> bool {
    let mut init: c_int = 0;
    let mut fin: c_int = 0;
    // SAFETY: both calls may be made at any time, before or after MPI_Init.
    unsafe {
        ffi::MPI_Initialized(&mut init);
        ffi::MPI_Finalized(&mut fin);
    }
    init != 0 && fin == 0
}

pub fn mpi_finalized() -> bool {
    let mut fin: c_int = 0;
    // SAFETY: may be called at any time.
    unsafe { ffi::MPI_Finalized(&mut fin) };
    fin != 0
}

/// Initialises MPI unless something else (e.g. mpi4py) already did. Returns whether this call
/// initialised it (and so must finalise it) and whether MPI_THREAD_MULTIPLE is available.
pub fn init_mpi(want_multiple: bool) -> Result<(bool, bool)> {
    if mpi_finalized() {
        return Err(Error::InvalidArgument(
            "MPI has already been finalized in this process; ferrovod cannot be initialized again"
                .into(),
        ));
    }
    let mut provided: c_int = 0;
    let mut ours = false;
    if !mpi_initialized() {
        // SAFETY: SYMBOLS are constants; null argc/argv is allowed by MPI.
        let required = unsafe {
            if want_multiple {
                ffi::RSMPI_THREAD_MULTIPLE
            } else {
                ffi::RSMPI_THREAD_SINGLE
            }
        };
        // SAFETY: before MPI_Init, on ferrovod's background thread while the thread that
        // initialises ferrovod waits for it, and ferrovod's other threads do not exist yet. A
        // framework's own thread reading the environment at this instant is the one hazard
        // left, the same as for any variable set in-process before MPI_Init.
        unsafe { tcp_without_put() };
        // SAFETY: MPI is not initialised; null argc/argv is allowed.
        let rc = unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                required,
                &mut provided,
            )
        };
        check(rc, "MPI_Init_thread")?;
        ours = true;
    } else {
        // SAFETY: MPI is initialised.
        unsafe { ffi::MPI_Query_thread(&mut provided) };
    }
    // SAFETY: constant.
    let multiple = provided == unsafe { ffi::RSMPI_THREAD_MULTIPLE };
    if !ours && !multiple && want_multiple {
        tracing::warn!(
            "MPI has already been initialized without multi-threading support (MPI_THREAD_MULTIPLE). ferrovod makes all MPI calls from its background thread; make sure no other thread calls MPI concurrently."
        );
    }
    Ok((ours, multiple))
}

/// Open MPI's TCP transport flags that ferrovod starts MPI with: Open MPI's defaults (4.x and
/// 5.x) without `put`. With `put`, a large message's whole payload is queued on its connection
/// at once, and the reply a receiver owes its peer before that peer may send waits behind it. Two
/// ranks that exchange at once (every ring step) then send one after the other whenever one of
/// them started a little earlier, and the step takes twice as long. Without `put`, messages
/// travel in fragments with room for the replies between them (BENCHMARKS.md, 2026-11-27,
/// Open MPI's TCP `put`).
pub const OMPI_TCP_FLAGS: &str = "send,inplace,need-ack,need-csum,hetero-rdma";

/// Sets `OMPI_MCA_btl_tcp_flags` to `OMPI_TCP_FLAGS` before MPI starts, unless the job chose
/// its own (`mpirun --mca btl_tcp_flags`, which arrives the same way) or this is not Open MPI 4
/// or 5, whose flag names these are.
///
/// # Safety
/// As `std::env::set_var`: no other thread may read or write the environment while it runs.
pub(super) unsafe fn tcp_without_put() {
    if std::env::var_os("OMPI_MCA_btl_tcp_flags").is_some() {
        return;
    }
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: MPI_Get_library_version may be called before MPI_Init; buf holds
    // MPI_MAX_LIBRARY_VERSION_STRING (8192 in Open MPI) bytes.
    if unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) } != 0 {
        return;
    }
    buf.truncate(len.max(0) as usize);
    let version = String::from_utf8_lossy(&buf);
    if !(version.starts_with("Open MPI v4.") || version.starts_with("Open MPI v5.")) {
        return;
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { std::env::set_var("OMPI_MCA_btl_tcp_flags", OMPI_TCP_FLAGS) };
}

/// Whether Open MPI's TCP transport moves large messages with `put` (its `btl_tcp_flags`, read
/// through the MPI tool interface once MPI runs); None where MPI has no such variable.
pub fn tcp_put_in_force() -> Option<bool> {
    const PUT: u32 = 0x2;
    if !mpi_initialized() {
        return None;
    }
    // Open MPI's tool interface sets the library's thread level to the one asked for here: ask
    // for the level MPI runs at, or a job at MPI_THREAD_MULTIPLE would lose its locking
    let mut level: c_int = 0;
    // SAFETY: MPI is initialised.
    unsafe { ffi::MPI_Query_thread(&mut level) };
    let mut provided: c_int = 0;
    // SAFETY: the tool interface may be started at any time, and is finalised below.
    if unsafe { ffi::MPI_T_init_thread(level, &mut provided) } != 0 {
        return None;
    }
    let name = c"btl_tcp_flags";
    let mut index: c_int = 0;
    let mut value: Option<u32> = None;
    // SAFETY: `name` is a C string; the handle is freed before the tool interface ends, and
    // the variable is one unsigned int (count checked before the read).
    unsafe {
        if ffi::MPI_T_cvar_get_index(name.as_ptr(), &mut index) == 0 {
            let mut handle: ffi::MPI_T_cvar_handle = std::ptr::null_mut();
            let mut count: c_int = 0;
            if ffi::MPI_T_cvar_handle_alloc(index, std::ptr::null_mut(), &mut handle, &mut count)
                == 0
            {
                let mut flags: u32 = 0;
                if count == 1 && ffi::MPI_T_cvar_read(handle, (&mut flags as *mut u32).cast()) == 0
                {
                    value = Some(flags);
                }
                ffi::MPI_T_cvar_handle_free(&mut handle);
            }
        }
        ffi::MPI_T_finalize();
    }
    value.map(|f| f & PUT != 0)
}

pub fn finalize_mpi() {
    if mpi_initialized() {
        // SAFETY: MPI is initialised and every communicator of ours has been freed.
        unsafe { ffi::MPI_Finalize() };
    }
}
