//! The C API (`fv_*`). Every function checks its arguments, converts them, calls the safe Rust
//! runtime and returns an `fv_status`; panics are caught here and never cross into C. The
//! message of a failed call is kept per thread (`fv_last_error`) and, for operations, per
//! handle (`fv_handle_error`).
//!
//! Threads: every function may be called from any thread. Callbacks (`fv_done_fn`,
//! `fv_alloc_fn`) run on one of ferrovod's threads (the background thread, a channel's thread,
//! or the GPU finisher), never on the caller's, and must not block on other ferrovod
//! operations.
#![allow(non_camel_case_types)]
// C callers cannot mark calls unsafe; every pointer is null-checked before use and the
// contracts are documented on each function instead.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::dtype::DataType;
use crate::error::{Error, Result, Status};
use crate::message::{Compression, Multistep, OpKind, ReduceOp};
use crate::runtime::completions::{COMPLETIONS, Completion};
use crate::runtime::entry::{InputMem, OutputAllocator, OutputMem};
use crate::runtime::handle::HandleId;
use crate::runtime::{self, Communicator, InitOptions, OpSpec, TensorSpec};
use crate::transport::cuda::{ForeignEvent, ForeignStream};
use crate::transport::memory::HostBuffer;

/// Identifies an enqueued operation until `fv_release`.
pub type fv_handle = u64;

/// Called once when an operation completes, with its handle and status, on one of ferrovod's
/// threads (background, channel or GPU finisher). It is also called for operations that a
/// shutdown fails, after the runtime is gone: inside the callback, the `fv_handle_*` queries of
/// its own handle still answer. It must not block on other ferrovod operations.
pub type fv_done_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, handle: fv_handle, status: i32)>;

/// Allocates the output of tensor `index` once its shape is known (allgather, alltoall,
/// reducescatter). Must return memory of at least `bytes` bytes that stays valid until the
/// operation completes, or NULL to fail the operation.
pub type fv_alloc_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        index: i32,
        ndim: i32,
        shape: *const i64,
        bytes: u64,
    ) -> *mut c_void,
>;

/// One tensor of an operation.
#[repr(C)]
pub struct fv_tensor {
    /// Rendezvous name: the same logical tensor must have the same name on every rank.
    pub name: *const c_char,
    /// An `fv_dtype` value.
    pub dtype: i32,
    pub ndim: i32,
    pub shape: *const i64,
    /// Input data (host memory), valid and unmodified until completion.
    pub input: *const c_void,
    /// Allreduce/broadcast: where the result goes (may equal `input` for in place; NULL means
    /// in place). Allgather/reducescatter: NULL (see `fv_op.alloc`), or the result's memory
    /// when every rank's tensor has this shape: the set's size times the input's bytes
    /// (allgather), or the input's bytes over the set's size, whose first dimension the size
    /// must divide (reducescatter). Given for every tensor of the operation or for none, and
    /// then without `fv_op.alloc`; it overlaps no other tensor's memory, nor its own input but
    /// in a GPU allgather in place (the input is this rank's piece). A result of another size,
    /// agreed because ranks' shapes differed, fails the tensor on this rank, as an allocator's
    /// failure does. Alltoall: must be NULL.
    pub output: *mut c_void,
    /// Alltoall: rows sent to each rank of the process set (NULL: split evenly).
    pub splits: *const i32,
    pub nsplits: i32,
}

/// An operation: `num_tensors` tensors enqueued atomically and completed together.
#[repr(C)]
pub struct fv_op {
    /// An `fv_op_kind` value.
    pub kind: i32,
    /// An `fv_reduce_op` value (allreduce, reducescatter).
    pub reduce_op: i32,
    pub prescale: f64,
    pub postscale: f64,
    /// Broadcast root, a global rank.
    pub root_rank: i32,
    /// Process set id (0: all ranks).
    pub process_set: i32,
    /// -1: host memory.
    pub device: i32,
    pub tensors: *const fv_tensor,
    pub num_tensors: i32,
    /// Optional completion callback (on a ferrovod thread, see `fv_done_fn`).
    pub done: fv_done_fn,
    pub done_user_data: *mut c_void,
    /// Optional output allocator; without one, ferrovod allocates and `fv_handle_output` reads.
    /// GPU allgather/alltoall/reducescatter need one, returning device memory.
    pub alloc: fv_alloc_fn,
    pub alloc_user_data: *mut c_void,
    /// GPU ops: the caller's `CUstream` whose work so far produces the inputs (NULL: none).
    /// ferrovod records an event on it during `fv_enqueue` and its own stream waits for that
    /// event on the device; the host never waits.
    pub stream: *mut c_void,
    /// GPU ops: or an already recorded `CUevent` the inputs are ready at (NULL: none; takes
    /// precedence over `stream`). With neither, the inputs must be ready at enqueue.
    pub ready_event: *mut c_void,
    /// Allreduce and gossip: an `fv_compression` value (0: as the job's
    /// `FERROVOD_COMPRESSION` says; gossip sends compressed differences against copies kept
    /// per peer). Every rank must ask for the same; other ops ignore it.
    pub compression: i32,
    /// Allreduce: communicate on every `multistep`-th call of each tensor only (0: as the
    /// job's `FERROVOD_MULTISTEP` says; 1: every call). A call that does not communicate
    /// completes before `fv_enqueue` returns (its callback runs on the calling thread) and
    /// `fv_handle_value` reports 0 for it, 1 for a call that communicated.
    pub multistep: i32,
    /// Allreduce: an `fv_multistep_mode` value: what the calls between communications do.
    pub multistep_mode: i32,
    /// Allreduce: the first `multistep_warmup` calls of each tensor all communicate
    /// (post-local SGD).
    pub multistep_warmup: i32,
    /// Send and receive (host memory; the peer is `root_rank`, or -1 for a receive that takes
    /// the first message with its tag from any rank, whose global rank `fv_handle_value` then
    /// gives): the k-th send to a rank with a tag meets that rank's k-th receive from this one
    /// with the same tag, in the same process set. From 0 to the bound `fv_p2p_max_tag` gives.
    pub tag: i32,
    /// Seconds the operation may wait for the set's other ranks to submit it; past them the job
    /// shuts down with a "Timed out" error on every rank (a torch group's timeout). It can only
    /// shorten the stall shutdown time (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`) for this
    /// operation. 0: no timeout of its own. Negative, NaN and infinite values are refused.
    pub timeout: f64,
}

/// What a multistep allreduce does with the calls between its communications
/// (`fv_op.multistep_mode`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MultistepMode {
    /// Their inputs are summed, and the communicating call reduces the sum (gradients:
    /// Horovod's `backward_passes_per_step`). The output of a call that does not
    /// communicate is left as it was.
    Accumulate = 0,
    /// Only the communicating call's input is reduced (parameters: local SGD, model
    /// averaging).
    Latest = 1,
}

/// The core's multistep for an op's fields (None: the job's); an error for bad values.
fn multistep(op: &fv_op) -> Result<Option<Multistep>> {
    if op.multistep < 0 || op.multistep_warmup < 0 {
        return Err(Error::InvalidArgument(format!(
            "multistep {} and multistep_warmup {} must not be negative",
            op.multistep, op.multistep_warmup
        )));
    }
    let accumulate = match op.multistep_mode {
        m if m == MultistepMode::Accumulate as i32 => true,
        m if m == MultistepMode::Latest as i32 => false,
        m => {
            return Err(Error::InvalidArgument(format!(
                "unknown multistep mode {m}"
            )));
        }
    };
    Ok((op.multistep > 0).then_some(Multistep {
        every: op.multistep as u32,
        warmup: op.multistep_warmup as u32,
        accumulate,
    }))
}

/// The operation's own timeout (`fv_op.timeout`; None for 0); an error for values that are no
/// length of time.
fn op_timeout(seconds: f64) -> Result<Option<std::time::Duration>> {
    if seconds == 0.0 {
        return Ok(None);
    }
    if seconds.is_nan() || seconds < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "timeout {seconds} must be a positive number of seconds (0: none)"
        )));
    }
    std::time::Duration::try_from_secs_f64(seconds)
        .map(Some)
        .map_err(|_| {
            Error::InvalidArgument(format!("timeout {seconds} s is too large to be a time"))
        })
}

/// How an allreduce's f32 values travel (`fv_op.compression`); only f32 sums and averages are
/// compressed, other allreduces travel as they are whatever is asked. PowerSGD and top-k take
/// an operation's own parameter in the value's bits 8 to 30 (`FV_COMPRESSION_TOPK | (50000 <<
/// 8)`: top-k of 5 %); 0 there is the job's.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpCompression {
    /// As the job's `FERROVOD_COMPRESSION` says.
    Default = 0,
    None = 1,
    /// IEEE half precision on the wire.
    Fp16 = 2,
    /// bfloat16 on the wire.
    Bf16 = 3,
    /// f32 below `FERROVOD_COMPRESSION_MIN_BYTES`, half precision from it.
    Mixed = 4,
    /// 8-bit min-max quantization with error feedback (residuals kept per tensor name).
    U8 = 5,
    /// PowerSGD: matrices as two low-rank factors with error feedback (state kept per tensor
    /// name); bits 8 and up: the rank, 1 to 1024 (0: the job's `FERROVOD_POWERSGD_RANK`).
    Powersgd = 6,
    /// Top-k: the largest magnitudes only, as (index, value) pairs, with error feedback; bits 8
    /// and up: the ratio in millionths, 1 to 1000000 (0: the job's `FERROVOD_TOPK_RATIO`).
    Topk = 7,
}

/// The core's compression for a C value (None: the job's); an error for unknown values and
/// parameters out of range.
fn compression(value: i32) -> Result<Option<Compression>> {
    let bad = |why: String| Error::InvalidArgument(format!("compression {value}: {why}"));
    let unknown = || Error::InvalidArgument(format!("unknown compression {value}"));
    if value < 0 {
        return Err(unknown());
    }
    let (c, param) = (value & 0xff, (value >> 8) as u32);
    use OpCompression as C;
    let known = [
        C::Default,
        C::None,
        C::Fp16,
        C::Bf16,
        C::Mixed,
        C::U8,
        C::Powersgd,
        C::Topk,
    ];
    let k = (known.into_iter().find(|k| *k as i32 == c)).ok_or_else(unknown)?;
    let asked = match k {
        C::Default if param > 0 => {
            return Err(bad("the job's compression takes no parameter".into()));
        }
        C::Default => None,
        C::None => Some(Compression::None),
        C::Fp16 => Some(Compression::Fp16),
        C::Bf16 => Some(Compression::Bf16),
        C::Mixed => Some(Compression::Mixed),
        C::U8 => Some(Compression::U8),
        C::Powersgd => Some(Compression::PowerSgd(0)),
        C::Topk => Some(Compression::TopK(0)),
    };
    asked.map(|c| c.with_param(param).map_err(bad)).transpose()
}

/// Options for `fv_init`; pass NULL for all ranks of MPI_COMM_WORLD.
#[repr(C)]
pub struct fv_init_options {
    /// If non-NULL: use only these ranks of MPI_COMM_WORLD (all processes pass the same list).
    pub ranks: *const i32,
    pub num_ranks: i32,
    /// If non-zero: use the communicator whose Fortran handle is `fortran_comm`.
    pub use_fortran_comm: i32,
    pub fortran_comm: i32,
    /// Static process sets: `process_set_sizes[i]` ranks each, concatenated in
    /// `process_set_ranks`. They get ids 1, 2, ... in order.
    pub process_set_ranks: *const i32,
    pub process_set_sizes: *const i32,
    pub num_process_sets: i32,
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Thread-locals may be gone while a thread exits (a callback from a destructor): then the
/// message is dropped rather than panicking outside any boundary.
fn set_last_error(msg: String) {
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = msg);
}

/// Runs `f` behind a panic boundary and turns its result into a status.
fn guard(f: impl FnOnce() -> Result<()>) -> Status {
    // the caller's current CUDA context (its framework's current device) as it was
    let _keep = crate::transport::cuda::KeepContext::new(false);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last_error(String::new());
            Status::Ok
        }
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            e.status()
        }
        Err(_) => {
            set_last_error("internal error: a panic was caught at the C API boundary".into());
            Status::Internal
        }
    }
}

fn null(what: &str) -> Error {
    Error::InvalidArgument(format!("{what} must not be NULL"))
}

/// Writes `v` through `out` after a null check.
fn put<T>(out: *mut T, v: T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and, per the API contract, valid for one write.
    unsafe { out.write(v) };
    Ok(())
}

/// # Safety
/// `ptr` must be NULL or point to `len` readable elements.
unsafe fn slice<'a, T>(ptr: *const T, len: i32, what: &str) -> Result<&'a [T]> {
    if len < 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: negative length {len}"
        )));
    }
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null, caller guarantees `len` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len as usize) })
}

/// Copies `s` into a C buffer (truncating, always NUL-terminated); `needed` gets the full size
/// including the terminator.
fn copy_str(s: &str, buf: *mut c_char, len: usize, needed: *mut usize) -> Result<()> {
    if !needed.is_null() {
        // SAFETY: non-null out-parameter.
        unsafe { needed.write(s.len() + 1) };
    }
    if buf.is_null() || len == 0 {
        return Ok(());
    }
    let n = s.len().min(len - 1);
    // SAFETY: buf holds `len` bytes; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast(), n);
        buf.add(n).write(0);
    }
    Ok(())
}

/// Copies the message of the calling thread's last failed call into `buf` (NUL-terminated,
/// truncated to `len`); `needed` (optional) receives the full length including the NUL.
#[unsafe(no_mangle)]
pub extern "C" fn fv_last_error(buf: *mut c_char, len: usize, needed: *mut usize) -> Status {
    match catch_unwind(AssertUnwindSafe(|| {
        let msg = LAST_ERROR
            .try_with(|e| e.borrow().clone())
            .unwrap_or_default();
        copy_str(&msg, buf, len, needed)
    })) {
        Ok(_) => Status::Ok,
        Err(_) => Status::Internal,
    }
}

extern "C" fn shutdown_at_exit() {
    let _ = catch_unwind(runtime::shutdown);
}

/// Starts ferrovod (MPI if not yet initialised, communicators, the background thread). Calling
/// it again while running does nothing. MPI initialised elsewhere (e.g. by mpi4py) is used as
/// is and not finalised by ferrovod. Registers an exit handler that shuts ferrovod down, so a
/// rank that exits tells the others instead of leaving them hanging.
///
/// # Safety
/// `opts` is NULL or points to a valid `fv_init_options` whose arrays hold the stated counts.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_init(opts: *const fv_init_options) -> Status {
    guard(|| {
        let mut init = InitOptions::default();
        if !opts.is_null() {
            // SAFETY: non-null, valid per the contract.
            let o = unsafe { &*opts };
            if o.use_fortran_comm != 0 {
                init.comm = Communicator::Fortran(o.fortran_comm);
            } else if !o.ranks.is_null() {
                // SAFETY: `num_ranks` readable elements per the contract.
                init.comm =
                    Communicator::Ranks(unsafe { slice(o.ranks, o.num_ranks, "ranks") }?.to_vec());
            }
            // SAFETY: as above.
            let sizes =
                unsafe { slice(o.process_set_sizes, o.num_process_sets, "process_set_sizes") }?;
            let total = (sizes.iter())
                .try_fold(0i32, |t, s| t.checked_add((*s).max(0)))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the {} process_set_sizes add up to more ranks than an int holds",
                        sizes.len()
                    ))
                })?;
            // SAFETY: as above.
            let ranks = unsafe { slice(o.process_set_ranks, total, "process_set_ranks") }?;
            let mut off = 0usize;
            for &s in sizes {
                if s <= 0 {
                    return Err(Error::InvalidArgument(
                        "a process set must have at least one rank".into(),
                    ));
                }
                init.process_sets
                    .push(ranks[off..off + s as usize].to_vec());
                off += s as usize;
            }
        }
        runtime::init(init)?;
        static REGISTER: std::sync::Once = std::sync::Once::new();
        REGISTER.call_once(|| {
            // SAFETY: registering a plain extern "C" function with no captured state.
            unsafe { libc::atexit(shutdown_at_exit) };
        });
        Ok(())
    })
}

/// Shuts ferrovod down on this rank and, through the next negotiation, on all ranks; pending
/// operations fail with FV_STATUS_SHUT_DOWN. Safe to call more than once.
#[unsafe(no_mangle)]
pub extern "C" fn fv_shutdown() -> Status {
    guard(|| {
        runtime::shutdown();
        Ok(())
    })
}

/// 1 if initialised (and not yet shut down by `fv_shutdown`), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn fv_is_initialized() -> i32 {
    catch_unwind(runtime::is_initialized).map_or(0, i32::from)
}

fn topology_value(out: *mut i32, field: impl FnOnce(&runtime::Topology) -> i32) -> Status {
    guard(|| {
        let rt = runtime::runtime()?;
        put(out, field(rt.topology()), "out")
    })
}

/// The largest tag a send or receive (`fv_op.tag`) may carry: half MPI's tag bound.
#[unsafe(no_mangle)]
pub extern "C" fn fv_p2p_max_tag(out: *mut i32) -> Status {
    guard(|| {
        let rt = runtime::runtime()?;
        put(out, rt.p2p_max_tag(), "out")
    })
}

/// This process's rank in ferrovod's world.
#[unsafe(no_mangle)]
pub extern "C" fn fv_rank(out: *mut i32) -> Status {
    topology_value(out, |t| t.rank)
}

/// Number of ranks.
#[unsafe(no_mangle)]
pub extern "C" fn fv_size(out: *mut i32) -> Status {
    topology_value(out, |t| t.size)
}

/// Rank among the processes on this node.
#[unsafe(no_mangle)]
pub extern "C" fn fv_local_rank(out: *mut i32) -> Status {
    topology_value(out, |t| t.local_rank)
}

/// Number of processes on this node.
#[unsafe(no_mangle)]
pub extern "C" fn fv_local_size(out: *mut i32) -> Status {
    topology_value(out, |t| t.local_size)
}

/// Index of this node among the nodes hosting this local rank.
#[unsafe(no_mangle)]
pub extern "C" fn fv_cross_rank(out: *mut i32) -> Status {
    topology_value(out, |t| t.cross_rank)
}

/// Number of nodes hosting this local rank.
#[unsafe(no_mangle)]
pub extern "C" fn fv_cross_size(out: *mut i32) -> Status {
    topology_value(out, |t| t.cross_size)
}

/// 1 if every node runs the same number of processes.
#[unsafe(no_mangle)]
pub extern "C" fn fv_is_homogeneous(out: *mut i32) -> Status {
    topology_value(out, |t| i32::from(t.is_homogeneous))
}

/// 1 if MPI provides MPI_THREAD_MULTIPLE.
#[unsafe(no_mangle)]
pub extern "C" fn fv_mpi_threads_supported(out: *mut i32) -> Status {
    topology_value(out, |t| i32::from(t.mpi_threads_supported))
}

/// Counters since init of what negotiation and data movement cost this process (see
/// `fv_read_metrics`).
#[repr(C)]
pub struct fv_metrics {
    /// Background-loop cycles run.
    pub cycles: u64,
    /// Collectives issued only to agree which tensors are ready (votes, coordinator rounds).
    pub control_collectives: u64,
    /// Bytes of those control messages this rank sent or received.
    pub control_bytes: u64,
    /// Nanoseconds spent negotiating, including waiting there for other ranks.
    pub negotiation_ns: u64,
    /// Collectives that moved tensor data (one per executed batch).
    pub data_collectives: u64,
    /// Tensor bytes this rank handed to them.
    pub data_bytes: u64,
    /// Batches that packed more than one tensor.
    pub fused_batches: u64,
    /// Tensors completed by data collectives.
    pub tensors: u64,
    /// GPU batches launched by replaying a captured CUDA graph.
    pub graph_launches: u64,
    /// Bytes of tensor data this rank put into data collectives as each codec carried them:
    /// uncompressed, as IEEE half precision, as bfloat16.
    pub wire_uncompressed: u64,
    pub wire_fp16: u64,
    pub wire_bf16: u64,
    /// ... and as 8-bit blocks (values only, without the blocks' minimum and step).
    pub wire_u8: u64,
    /// ... and as PowerSGD's two factors.
    pub wire_powersgd: u64,
    /// ... and as top-k's (index, value) pairs.
    pub wire_topk: u64,
}

/// Reads the counters into `*out`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_read_metrics(out: *mut fv_metrics) -> Status {
    guard(|| {
        let m = runtime::runtime()?.metrics.snapshot();
        put(
            out,
            fv_metrics {
                cycles: m.cycles,
                control_collectives: m.control_collectives,
                control_bytes: m.control_bytes,
                negotiation_ns: m.negotiation_ns,
                data_collectives: m.data_collectives,
                data_bytes: m.data_bytes,
                fused_batches: m.fused_batches,
                tensors: m.tensors,
                graph_launches: m.graph_launches,
                wire_uncompressed: m.wire_uncompressed,
                wire_fp16: m.wire_fp16,
                wire_bf16: m.wire_bf16,
                wire_u8: m.wire_u8,
                wire_powersgd: m.wire_powersgd,
                wire_topk: m.wire_topk,
            },
            "out",
        )
    })
}

/// The canonical error code (`absl::StatusCode`: TensorFlow's, gRPC's) of a status, so that a
/// framework op written in C++ reports each status as every other binding does; `status`
/// values that are no `fv_status` give 2 (unknown).
#[unsafe(no_mangle)]
pub extern "C" fn fv_status_code(status: i32) -> i32 {
    // no boundary needed: a table lookup, no code that can panic
    Status::ALL
        .iter()
        .find(|s| **s as i32 == status)
        .map_or(Status::Unknown.canonical_code(), |s| s.canonical_code())
}

/// The library version, a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn fv_version() -> *const c_char {
    // no boundary needed: a static's address, no code that can panic
    static V: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    V.as_ptr().cast()
}

/// Whether a backend is available: "mpi" → 1; "nccl" → NCCL's version code (e.g. 22803, as
/// Horovod's `nccl_built()` returns) and "cuda" → 1 where the CUDA driver and NCCL libraries
/// load (GPU support is always compiled in, loaded at run time), else 0; "gloo", "rocm", "ddl",
/// "ccl" and unknown names → 0.
///
/// # Safety
/// `what` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_built_with(what: *const c_char) -> i32 {
    if what.is_null() {
        return 0;
    }
    // SAFETY: NUL-terminated per the contract.
    let name = unsafe { CStr::from_ptr(what) }.to_bytes();
    catch_unwind(|| {
        if name.eq_ignore_ascii_case(b"mpi") {
            return 1;
        }
        // GPU support is compiled in; it is usable where the libraries load
        let gpu = crate::transport::cuda::cuda_present() && crate::transport::nccl::nccl_present();
        if !gpu {
            return 0;
        }
        if name.eq_ignore_ascii_case(b"nccl") {
            return crate::transport::nccl::version().unwrap_or(0);
        }
        i32::from(name.eq_ignore_ascii_case(b"cuda"))
    })
    .unwrap_or(0)
}

/// `sizeof` of the C API's struct named `name` ("fv_tensor", "fv_op", "fv_init_options",
/// "fv_metrics") as this library lays it out; 0 for other names. Bindings that declare the
/// structs themselves (ctypes) check their layout against it when they load.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_struct_size(name: *const c_char) -> usize {
    if name.is_null() {
        return 0;
    }
    // SAFETY: NUL-terminated per the contract.
    let name = unsafe { CStr::from_ptr(name) }.to_bytes();
    catch_unwind(|| match name {
        b"fv_tensor" => std::mem::size_of::<fv_tensor>(),
        b"fv_op" => std::mem::size_of::<fv_op>(),
        b"fv_init_options" => std::mem::size_of::<fv_init_options>(),
        b"fv_metrics" => std::mem::size_of::<fv_metrics>(),
        _ => 0,
    })
    .unwrap_or(0)
}

/// `*event` = the `CUevent` recorded on ferrovod's stream after a GPU operation's work, for a
/// GPU consumer to wait on (`cuStreamWaitEvent`) instead of the host; NULL for host operations
/// or before the work is enqueued. By default a GPU operation completes (poll, wait, callback)
/// once that event has fired; with `HOROVOD_ENABLE_ASYNC_COMPLETION=1` it completes as soon as
/// the work is enqueued, and consumers must wait on this event. Valid until `fv_release`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_event(h: fv_handle, event: *mut *mut c_void) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            let raw = hd.event().map_or(std::ptr::null_mut(), |e| e.raw().cast());
            put(event, raw, "event")
        })
    })
}

/// Makes the caller's CUDA `stream` (of GPU `device`) wait on the device for operation `h`
/// without the calling thread waiting for the ranks to agree on it: `*placed` = 1 when the
/// wait is placed (the stream runs on once the operation's work has run, or at once if it
/// fails); 0 when the operation has been enqueued already (wait on `fv_handle_event`), when
/// its launch may still open NCCL connections (its process set's first GPU batches: opening one
/// may wait for the whole device, the waiting stream with it) or when the stream cannot wait so
/// (the legacy default stream, a blocking stream); the caller then waits on the host. The caller must not submit an operation whose input is ready only on such a
/// stream before `h` completes: it could be fused with `h`, whose launch would then wait on
/// the stream that waits for it. A wait outstanding past the stall limit ends the process
/// with the reason (a CUDA call that waits for the whole device, such as lazy kernel loading,
/// deadlocks with it).
///
/// # Safety
/// `stream` is a live `CUstream` of this process on `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_stream_wait(
    h: fv_handle,
    device: i32,
    stream: *mut c_void,
    placed: *mut i32,
) -> Status {
    guard(|| {
        if placed.is_null() {
            return Err(Error::InvalidArgument("placed is NULL".into()));
        }
        if device < 0 {
            return Err(Error::InvalidArgument(format!(
                "fv_stream_wait: device {device} is not a GPU"
            )));
        }
        let _keep = crate::transport::cuda::KeepContext::new(true);
        let handle = known_handle(h)?;
        let done = if handle.is_done() || stream.is_null() {
            false
        } else {
            let gpu = crate::transport::cuda::gpu(device)?;
            // SAFETY: a live stream on `device`, per the contract.
            let stream = unsafe { ForeignStream::from_raw(stream) };
            runtime::runtime()?.wait_on_device(&handle, &gpu, stream)?
        };
        put(placed, i32::from(done), "placed")
    })
}

struct SendPtr(*mut c_void);
// SAFETY: the pointer is only handed back to the caller's own callback, as documented.
unsafe impl Send for SendPtr {}

struct CAllocator {
    f: unsafe extern "C" fn(*mut c_void, i32, i32, *const i64, u64) -> *mut c_void,
    user: SendPtr,
}

impl OutputAllocator for CAllocator {
    fn allocate(&mut self, index: usize, shape: &[i64], bytes: usize) -> Result<HostBuffer> {
        // SAFETY: the caller's allocator, called with a valid shape array.
        let p = unsafe {
            (self.f)(
                self.user.0,
                index as i32,
                shape.len() as i32,
                shape.as_ptr(),
                bytes as u64,
            )
        };
        if p.is_null() && bytes > 0 {
            return Err(Error::Aborted(format!(
                "output allocation of {bytes} bytes for tensor {index} failed"
            )));
        }
        // SAFETY: the allocator contract promises `bytes` writable bytes until completion.
        Ok(unsafe { HostBuffer::from_raw(p.cast(), bytes) })
    }
}

/// The outputs an allgather's or reducescatter's caller gave (`fv_tensor.output`), each with the
/// bytes its result takes when every rank's shape is this one.
struct GivenOutputs {
    outputs: Vec<(SendPtr, usize)>,
}

impl OutputAllocator for GivenOutputs {
    fn allocate(&mut self, index: usize, _shape: &[i64], bytes: usize) -> Result<HostBuffer> {
        let (p, len) = self
            .outputs
            .get(index)
            .map(|(p, len)| (p.0, *len))
            .ok_or_else(|| Error::Internal(format!("no given output for tensor {index}")))?;
        if bytes != len {
            return Err(Error::Aborted(format!(
                "the agreed result of tensor {index} takes {bytes} bytes, but its given output holds {len}: ranks gave different shapes"
            )));
        }
        // SAFETY: the caller keeps `len` writable bytes at its output until completion.
        Ok(unsafe { HostBuffer::from_raw(p.cast(), len) })
    }
}

/// `Some` when the caller gave the outputs of an allgather or reducescatter (all or none).
fn given_outputs(raw: &[fv_tensor], spec: &OpSpec, kind: OpKind) -> Result<Option<GivenOutputs>> {
    let given = raw.iter().filter(|t| !t.output.is_null()).count();
    if given == 0 {
        return Ok(None);
    }
    if given != raw.len() {
        return Err(Error::InvalidArgument(
            "give the output of every tensor of the operation, or of none".into(),
        ));
    }
    let rt = runtime::runtime()?;
    let ranks = rt.process_set_ranks(spec.process_set).ok_or_else(|| {
        Error::InvalidArgument(
            "Process set provided does not exist, or has not been registered.".into(),
        )
    })?;
    let size = ranks.len();
    let me = ranks.iter().position(|r| *r == rt.topology().rank);
    let mut outputs = Vec::with_capacity(raw.len());
    for (t, ts) in raw.iter().zip(&spec.tensors) {
        let bytes = ts.shape.iter().product::<i64>() as usize * ts.dtype.size();
        let len = match kind {
            OpKind::Allgather => bytes.checked_mul(size).ok_or_else(|| {
                Error::InvalidArgument(format!("tensor '{}': size overflows", ts.name))
            })?,
            _ => {
                let dim0 = ts.shape.first().copied().unwrap_or(1);
                if dim0 % size as i64 != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "tensor '{}': a given output needs a first dimension the set's {size} ranks divide, not {dim0}; pass NULL and an allocator",
                        ts.name
                    )));
                }
                bytes / size
            }
        };
        // in place is an allgather's on GPUs only, NCCL's way: the input is this rank's piece
        let (i, o) = (t.input as usize, t.output as usize);
        let shared = spans_overlap(i, bytes, o, len);
        let in_place = kind == OpKind::Allgather
            && spec.device >= 0
            && me.is_some_and(|m| Some(i) == bytes.checked_mul(m).and_then(|at| o.checked_add(at)));
        if shared && !in_place {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}': the given output overlaps the input",
                ts.name
            )));
        }
        outputs.push((SendPtr(t.output), len));
    }
    // across tensors: `fv_enqueue`'s `check_no_aliasing`, with these among what it writes
    Ok(Some(GivenOutputs { outputs }))
}

/// Whether two byte ranges of length `len` starting at `a` and `b` share a byte.
fn overlaps(a: usize, b: usize, len: usize) -> bool {
    spans_overlap(a, len, b, len)
}

/// Whether `la` bytes from `a` and `lb` bytes from `b` share a byte.
fn spans_overlap(a: usize, la: usize, b: usize, lb: usize) -> bool {
    la > 0 && lb > 0 && a < b.saturating_add(lb) && b < a.saturating_add(la)
}

/// The tensors of one grouped operation must not share memory that any of them writes: one
/// tensor's result would overwrite another's input or result, in an order nobody chose.
fn check_no_aliasing(specs: &[TensorSpec], given: &[(usize, usize)]) -> Result<()> {
    // (start, end, tensor, written), from the buffers `tensor_spec` sized and the given
    // outputs (`given[i]`: tensor i's start and length)
    let mut ranges: Vec<(usize, usize, usize, bool)> = (given.iter().enumerate())
        .map(|(i, (start, len))| (*start, start.saturating_add(*len), i, true))
        .collect();
    for (i, s) in specs.iter().enumerate() {
        let in_place = matches!(s.output, OutputMem::InPlace);
        if let InputMem::Borrowed(b) = &s.input {
            let start = b.as_ptr() as usize;
            ranges.push((start, start.saturating_add(b.len()), i, in_place));
        }
        if let OutputMem::Borrowed(b) = &s.output {
            let start = b.as_ptr() as usize;
            ranges.push((start, start.saturating_add(b.len()), i, true));
        }
    }
    ranges.retain(|(start, end, _, _)| start < end);
    ranges.sort_unstable();
    for (k, a) in ranges.iter().enumerate() {
        for b in ranges[k + 1..].iter().take_while(|b| b.0 < a.1) {
            if a.2 != b.2 && (a.3 || b.3) {
                return Err(Error::InvalidArgument(format!(
                    "tensors '{}' and '{}' of one grouped operation share memory that the operation writes",
                    specs[a.2.min(b.2)].name,
                    specs[a.2.max(b.2)].name
                )));
            }
        }
    }
    Ok(())
}

/// # Safety
/// `t` points to a valid `fv_tensor`.
unsafe fn tensor_spec(t: &fv_tensor, kind: OpKind) -> Result<TensorSpec> {
    if t.name.is_null() {
        return Err(null("tensor name"));
    }
    // SAFETY: NUL-terminated per the contract.
    let name = unsafe { CStr::from_ptr(t.name) }
        .to_str()
        .map_err(|_| Error::InvalidArgument("tensor name is not UTF-8".into()))?
        .to_string();
    let dtype = DataType::from_i32(t.dtype).ok_or_else(|| {
        Error::InvalidArgument(format!("tensor '{name}': unknown dtype {}", t.dtype))
    })?;
    // SAFETY: `ndim` readable elements per the contract.
    let shape = unsafe { slice(t.shape, t.ndim, "shape") }?.to_vec();
    if shape.iter().any(|d| *d < 0) {
        return Err(Error::InvalidArgument(format!(
            "tensor '{name}': negative dimension"
        )));
    }
    let bytes = shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, d| acc.checked_mul(*d as u64))
        .ok_or_else(|| Error::InvalidArgument(format!("tensor '{name}': size overflows")))?
        as usize;
    if t.input.is_null() && bytes > 0 {
        return Err(null("tensor input"));
    }
    // SAFETY: the caller keeps `bytes` bytes at `input` valid until completion.
    let input = unsafe { HostBuffer::from_raw(t.input as *mut u8, bytes) };
    let later = matches!(
        kind,
        OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
    );
    let output = if later {
        if !t.output.is_null() && kind == OpKind::Alltoall {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}': the output of this operation is allocated after negotiation; pass NULL and an allocator"
            )));
        }
        OutputMem::Later
    } else if t.output.is_null() || std::ptr::eq(t.output, t.input) {
        OutputMem::InPlace
    } else if overlaps(t.input as usize, t.output as usize, bytes) {
        return Err(Error::InvalidArgument(format!(
            "tensor '{name}': output overlaps input without being the same buffer"
        )));
    } else {
        // SAFETY: the caller keeps `bytes` writable bytes at `output` valid until completion.
        OutputMem::Borrowed(unsafe { HostBuffer::from_raw(t.output.cast(), bytes) })
    };
    let splits = if t.splits.is_null() {
        None
    } else {
        // SAFETY: `nsplits` readable elements per the contract.
        Some(unsafe { slice(t.splits, t.nsplits, "splits") }?.to_vec())
    };
    Ok(TensorSpec {
        name,
        dtype,
        shape,
        input: InputMem::Borrowed(input),
        output,
        splits,
    })
}

/// Enqueues an operation and returns at once. On FV_STATUS_OK the operation completes later:
/// `done` (if given) is called, and the handle (if `out` is non-NULL) can be polled or waited
/// on, then must be released. With `out` NULL the handle is released after `done` returns.
///
/// # Safety
/// `op` points to a valid `fv_op`; its tensors' memory stays valid until completion.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_enqueue(op: *const fv_op, out: *mut fv_handle) -> Status {
    guard(|| {
        if op.is_null() {
            return Err(null("op"));
        }
        // SAFETY: non-null, valid per the contract.
        let op = unsafe { &*op };
        // a GPU operation may open its GPU: the caller's context is kept from the first one on
        let _keep =
            crate::transport::cuda::KeepContext::new(op.device != crate::message::CPU_DEVICE);
        let kind = OpKind::from_i32(op.kind)
            .filter(|k| !matches!(k, OpKind::AddProcessSet | OpKind::RemoveProcessSet))
            .ok_or_else(|| Error::InvalidArgument(format!("unknown operation kind {}", op.kind)))?;
        let reduce_op = ReduceOp::from_i32(op.reduce_op)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown reduce op {}", op.reduce_op)))?;
        // SAFETY: `num_tensors` readable elements per the contract.
        let tensors = unsafe { slice(op.tensors, op.num_tensors, "tensors") }?;
        let tensors = tensors
            .iter()
            // SAFETY: each element is a valid fv_tensor.
            .map(|t| unsafe { tensor_spec(t, kind) })
            .collect::<Result<Vec<_>>>()?;
        let mut spec = OpSpec::new(kind, tensors);
        spec.reduce_op = reduce_op;
        spec.prescale = op.prescale;
        spec.postscale = op.postscale;
        spec.compression = compression(op.compression)?;
        spec.multistep = multistep(op)?;
        spec.timeout = op_timeout(op.timeout)?;
        spec.root_rank = op.root_rank;
        spec.tag = op.tag;
        spec.process_set = op.process_set;
        spec.device = op.device;
        // SAFETY: live CUDA handles of the caller's, per `fv_op`'s contract.
        spec.ready_stream =
            (!op.stream.is_null()).then(|| unsafe { ForeignStream::from_raw(op.stream) });
        // SAFETY: as above.
        spec.ready_event =
            (!op.ready_event.is_null()).then(|| unsafe { ForeignEvent::from_raw(op.ready_event) });
        if !op.prescale.is_finite() || !op.postscale.is_finite() {
            return Err(Error::InvalidArgument(
                "prescale and postscale must be finite".into(),
            ));
        }
        if let Some(f) = op.alloc {
            spec.allocator = Some(Arc::new(Mutex::new(CAllocator {
                f,
                user: SendPtr(op.alloc_user_data),
            })));
        }
        // given outputs (`given_outputs`) are memory the operation writes
        let mut written: Vec<(usize, usize)> = Vec::new();
        if matches!(kind, OpKind::Allgather | OpKind::Reducescatter) {
            // SAFETY: as above, the caller's `num_tensors` valid tensors.
            let raw = unsafe { slice(op.tensors, op.num_tensors, "tensors") }?;
            if let Some(given) = given_outputs(raw, &spec, kind)? {
                if op.alloc.is_some() {
                    return Err(Error::InvalidArgument(
                        "pass the outputs or an allocator, not both".into(),
                    ));
                }
                written = (given.outputs.iter())
                    .map(|(p, len)| (p.0 as usize, *len))
                    .collect();
                spec.allocator = Some(Arc::new(Mutex::new(given)));
            }
        }
        if spec.tensors.len() > 1 {
            check_no_aliasing(&spec.tensors, &written)?;
        }
        let auto_release = out.is_null();
        if auto_release && op.done.is_none() {
            return Err(Error::InvalidArgument(
                "either a handle out-pointer or a done callback is required".into(),
            ));
        }
        let user = SendPtr(op.done_user_data);
        let done = op.done;
        if done.is_some() || auto_release {
            spec.callback = Some(Box::new(move |id: HandleId, r: &Result<()>| {
                let status = match r {
                    Ok(()) => Status::Ok,
                    Err(e) => e.status(),
                } as i32;
                let user = user;
                if let Some(f) = done {
                    // SAFETY: the caller's callback with its own user data.
                    unsafe { f(user.0, id, status) };
                }
                if auto_release && let Ok(rt) = runtime::runtime() {
                    let _ = rt.handles.release(id);
                }
            }));
        }
        let rt = runtime::runtime()?;
        let h = rt.enqueue(spec)?;
        if !auto_release {
            put(out, h.id, "out")?;
        }
        Ok(())
    })
}

fn with_handle<R>(
    h: fv_handle,
    f: impl FnOnce(&runtime::handle::Handle) -> Result<R>,
) -> Result<R> {
    if let Some(handle) = runtime::handle::in_callback(h) {
        return f(&handle);
    }
    f(&*known_handle(h)?)
}

/// Handle `h` of any runtime of this process (it outlives a shutdown until released); before
/// any init, not initialized.
fn known_handle(h: fv_handle) -> Result<std::sync::Arc<runtime::handle::Handle>> {
    runtime::handle::HANDLES
        .get(h)
        .map_err(|e| match runtime::is_initialized() {
            false if runtime::handle::HANDLES.is_empty() => Error::NotInitialized,
            _ => e,
        })
}

/// `*done` = 1 if the operation has completed (successfully or not), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn fv_poll(h: fv_handle, done: *mut i32) -> Status {
    guard(|| with_handle(h, |hd| put(done, i32::from(hd.poll().is_some()), "done")))
}

/// Waits for completion; returns the operation's status, or FV_STATUS_TIMEOUT after
/// `timeout_seconds` (negative: wait forever). The message is available from
/// `fv_handle_error` and `fv_last_error`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_wait(h: fv_handle, timeout_seconds: f64) -> Status {
    guard(|| {
        let timeout = wait_limit(timeout_seconds)?;
        known_handle(h)?.wait(timeout)
    })
}

/// A done callback (`fv_op.done`) that runs none of the caller's code on ferrovod's thread: it
/// queues (user data, handle, status) for `fv_next_completion`. For bindings whose callbacks
/// would take a lock that ferrovod's thread must not wait for (Python's GIL). The queue keeps
/// each completion until it is taken or forgotten (`fv_forget_completion`). One queue per
/// process, for one consumer: whoever takes from it takes every operation's completion that
/// named this callback.
#[unsafe(no_mangle)]
pub extern "C" fn fv_queue_completion(user_data: *mut c_void, handle: fv_handle, status: i32) {
    let user_data = user_data as usize;
    // a callback must not unwind into ferrovod's thread
    let _ = catch_unwind(|| {
        COMPLETIONS.push(Completion {
            user_data,
            handle,
            status,
        })
    });
}

/// Takes the oldest completion `fv_queue_completion` queued: its user data, handle and status.
/// Waits up to `timeout_seconds` (negative: for ever) and returns FV_STATUS_TIMEOUT if none came.
#[unsafe(no_mangle)]
pub extern "C" fn fv_next_completion(
    timeout_seconds: f64,
    user_data: *mut *mut c_void,
    handle: *mut fv_handle,
    status: *mut i32,
) -> Status {
    guard(|| {
        if user_data.is_null() || handle.is_null() || status.is_null() {
            return Err(null("fv_next_completion's outputs"));
        }
        let c = COMPLETIONS
            .pop(wait_limit(timeout_seconds)?)
            .ok_or(Error::Timeout)?;
        put(user_data, c.user_data as *mut c_void, "user_data")?;
        put(handle, c.handle, "handle")?;
        put(status, c.status, "status")
    })
}

/// For a thread that waits for operation `h` and completes it itself: its queued completion is
/// not wanted. `*dropped` = 1 if it will never come out of `fv_next_completion` (it was still
/// queued, or has not come yet); 0 if the operation had finished and its completion is not in
/// the queue: taken already, or on its way (then it comes out). Only for an operation whose
/// done callback is `fv_queue_completion`, and before its handle is released (after, it is an
/// unknown handle).
#[unsafe(no_mangle)]
pub extern "C" fn fv_forget_completion(h: fv_handle, dropped: *mut i32) -> Status {
    guard(|| {
        if dropped.is_null() {
            return Err(null("dropped"));
        }
        let hd = known_handle(h)?;
        let gone = COMPLETIONS.forget(h, || hd.is_done());
        put(dropped, i32::from(gone), "dropped")
    })
}

/// `fv_wait`'s timeout: negative or +inf waits for ever, as does one too large for a
/// `Duration`; NaN is refused.
fn wait_limit(seconds: f64) -> Result<Option<Duration>> {
    if seconds.is_nan() {
        return Err(Error::InvalidArgument(
            "fv_wait: timeout_seconds is NaN".into(),
        ));
    }
    if seconds < 0.0 {
        return Ok(None);
    }
    Ok(Duration::try_from_secs_f64(seconds).ok())
}

/// Forgets a handle (and any output ferrovod allocated for it). Unknown handles are an error.
#[unsafe(no_mangle)]
pub extern "C" fn fv_release(h: fv_handle) -> Status {
    guard(|| known_handle(h).and_then(|_| runtime::handle::HANDLES.release(h)))
}

/// Copies the error message of a completed operation (empty if it succeeded).
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_error(
    h: fv_handle,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            let msg = match hd.poll() {
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "operation {h} is still in progress"
                    )));
                }
                Some(Ok(())) => String::new(),
                Some(Err(e)) => e.to_string(),
            };
            copy_str(&msg, buf, len, needed)
        })
    })
}

fn tensor_index(index: i32) -> Result<usize> {
    usize::try_from(index)
        .map_err(|_| Error::InvalidArgument(format!("tensor index {index} is negative")))
}

fn completed_ok(hd: &runtime::handle::Handle, h: fv_handle) -> Result<()> {
    match hd.poll() {
        None => Err(Error::InvalidArgument(format!(
            "operation {h} is still in progress"
        ))),
        Some(r) => r,
    }
}

/// For an operation without an allocator: the output ferrovod allocated for tensor `index`
/// (valid until `fv_release`) and its size in bytes.
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_output(
    h: fv_handle,
    index: i32,
    data: *mut *const c_void,
    bytes: *mut u64,
) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            completed_ok(hd, h)?;
            let (p, n) = hd
                .with_result(tensor_index(index)?, |r| {
                    r.output
                        .as_ref()
                        .map(|v| (v.as_ptr() as *const c_void, v.len() as u64))
                })
                .flatten()
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "operation {h} has no library-owned output {index}"
                    ))
                })?;
            put(data, p, "data")?;
            put(bytes, n, "bytes")
        })
    })
}

/// The output shape of tensor `index`: up to `max` dimensions into `shape`, the rank into
/// `*ndim`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_shape(
    h: fv_handle,
    index: i32,
    shape: *mut i64,
    max: i32,
    ndim: *mut i32,
) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            completed_ok(hd, h)?;
            let dims = hd
                .result(tensor_index(index)?)
                .ok_or_else(|| Error::InvalidArgument(format!("no tensor {index}")))?
                .shape;
            put(ndim, dims.len() as i32, "ndim")?;
            for (i, d) in dims.iter().take(max.max(0) as usize).enumerate() {
                // SAFETY: `shape` holds `max` elements per the contract; i < max.
                put(unsafe { shape.add(i) }, *d, "shape")?;
            }
            Ok(())
        })
    })
}

/// Alltoall: the rows received from each rank (up to `max` into `out`, the count into `*n`).
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_received_splits(
    h: fv_handle,
    index: i32,
    out: *mut i32,
    max: i32,
    n: *mut i32,
) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            completed_ok(hd, h)?;
            let s = hd
                .result(tensor_index(index)?)
                .ok_or_else(|| Error::InvalidArgument(format!("no tensor {index}")))?
                .received_splits;
            put(n, s.len() as i32, "n")?;
            for (i, v) in s.iter().take(max.max(0) as usize).enumerate() {
                // SAFETY: `out` holds `max` elements per the contract; i < max.
                put(unsafe { out.add(i) }, *v, "out")?;
            }
            Ok(())
        })
    })
}

/// Join: the last rank that joined. Add process set: the new set's id. Allreduce: 1 if it
/// communicated, 0 for a multistep call that did not.
#[unsafe(no_mangle)]
pub extern "C" fn fv_handle_value(h: fv_handle, out: *mut i32) -> Status {
    guard(|| {
        with_handle(h, |hd| {
            completed_ok(hd, h)?;
            put(out, hd.value(), "out")
        })
    })
}

/// Registers a process set of the given global ranks. Collective: every rank must call it
/// with the same ranks. Blocks until all ranks agreed; `*id` receives the new id.
///
/// # Safety
/// `ranks` holds `n` readable elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fv_add_process_set(ranks: *const i32, n: i32, id: *mut i32) -> Status {
    guard(|| {
        if id.is_null() {
            return Err(null("id"));
        }
        // SAFETY: `n` readable elements per the contract.
        let ranks = unsafe { slice(ranks, n, "ranks") }?;
        let rt = runtime::runtime()?;
        let h = rt.add_process_set(ranks)?;
        let r = h.wait(None);
        let _ = rt.handles.release(h.id);
        r?;
        put(id, h.value(), "id")
    })
}

/// Removes a process set. Collective: every rank must call it. Blocks until done.
#[unsafe(no_mangle)]
pub extern "C" fn fv_remove_process_set(id: i32) -> Status {
    guard(|| {
        let rt = runtime::runtime()?;
        let h = rt.remove_process_set(id)?;
        let r = h.wait(None);
        let _ = rt.handles.release(h.id);
        r
    })
}

/// The ids of all process sets (0 first): up to `max` into `out`, the count into `*n`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_process_set_ids(out: *mut i32, max: i32, n: *mut i32) -> Status {
    guard(|| {
        let ids = runtime::runtime()?.process_set_ids();
        put(n, ids.len() as i32, "n")?;
        for (i, v) in ids.iter().take(max.max(0) as usize).enumerate() {
            // SAFETY: `out` holds `max` elements; i < max.
            put(unsafe { out.add(i) }, *v, "out")?;
        }
        Ok(())
    })
}

/// The member ranks of set `id`: up to `max` into `out`, the count into `*n`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_process_set_ranks(id: i32, out: *mut i32, max: i32, n: *mut i32) -> Status {
    guard(|| {
        let ranks = runtime::runtime()?.process_set_ranks(id).ok_or_else(|| {
            Error::InvalidArgument(
                "Process set provided does not exist, or has not been registered.".into(),
            )
        })?;
        put(n, ranks.len() as i32, "n")?;
        for (i, v) in ranks.iter().take(max.max(0) as usize).enumerate() {
            // SAFETY: `out` holds `max` elements; i < max.
            put(unsafe { out.add(i) }, *v, "out")?;
        }
        Ok(())
    })
}

/// Number of ranks in set `id`.
#[unsafe(no_mangle)]
pub extern "C" fn fv_process_set_size(id: i32, out: *mut i32) -> Status {
    guard(|| {
        let ranks = runtime::runtime()?.process_set_ranks(id).ok_or_else(|| {
            Error::InvalidArgument(
                "Process set provided does not exist, or has not been registered.".into(),
            )
        })?;
        put(out, ranks.len() as i32, "out")
    })
}

/// This rank's position in set `id`, or -1 if it is not a member.
#[unsafe(no_mangle)]
pub extern "C" fn fv_process_set_rank(id: i32, out: *mut i32) -> Status {
    guard(|| {
        let r = runtime::runtime()?.process_set_rank(id)?;
        put(out, r, "out")
    })
}

#[cfg(test)]
mod tests {
    /// The committed header must match what cbindgen generates from this file.
    /// `FERROVOD_UPDATE_HEADER=1 cargo test committed_header` rewrites it.
    #[test]
    fn committed_header_is_current() {
        let generated = include_str!(concat!(env!("OUT_DIR"), "/ferrovod.h"));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/ferrovod.h");
        if std::env::var_os("FERROVOD_UPDATE_HEADER").is_some() {
            std::fs::write(path, generated).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == generated,
            "include/ferrovod.h is stale: run `FERROVOD_UPDATE_HEADER=1 cargo test committed_header`"
        );
    }

    #[test]
    fn op_timeouts() {
        use super::op_timeout;
        use std::time::Duration;
        assert_eq!(op_timeout(0.0).unwrap(), None);
        assert_eq!(op_timeout(1.5).unwrap(), Some(Duration::from_millis(1500)));
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e30] {
            let err = op_timeout(bad).unwrap_err().to_string();
            assert!(err.contains("timeout"), "{bad}: {err}");
        }
    }

    #[test]
    fn wait_limits() {
        use super::wait_limit;
        use std::time::Duration;
        assert!(wait_limit(f64::NAN).is_err());
        assert_eq!(wait_limit(-1.0).unwrap(), None);
        assert_eq!(wait_limit(f64::INFINITY).unwrap(), None);
        assert_eq!(wait_limit(1e20).unwrap(), None);
        assert_eq!(wait_limit(0.5).unwrap(), Some(Duration::from_millis(500)));
    }

    #[test]
    fn header_names_only_c_identifiers() {
        let h = include_str!(concat!(env!("OUT_DIR"), "/ferrovod.h"));
        assert!(!h.contains("_ALL {"), "a Rust-only list reached the header");
    }

    #[test]
    fn tensor_indices_are_not_negative() {
        use super::tensor_index;
        assert_eq!(tensor_index(3).unwrap(), 3);
        assert!(tensor_index(-1).is_err());
    }

    #[test]
    fn a_compression_value_carries_powersgds_and_topks_own_parameter() {
        use super::OpCompression;
        use crate::message::Compression as M;
        let (psgd, topk) = (OpCompression::Powersgd as i32, OpCompression::Topk as i32);
        assert_eq!(super::compression(0).unwrap(), None);
        assert_eq!(super::compression(topk).unwrap(), Some(M::TopK(0)));
        assert_eq!(
            super::compression(topk | (50_000 << 8)).unwrap(),
            Some(M::TopK(50_000))
        );
        assert_eq!(
            super::compression(psgd | (2 << 8)).unwrap(),
            Some(M::PowerSgd(2))
        );
        // out of range, on a codec without one, on the job's, unknown codes, negative values
        for bad in [
            topk | (1_000_001 << 8),
            psgd | (1025 << 8),
            OpCompression::Fp16 as i32 | (1 << 8),
            1 << 8,
            8,
            -1,
            i32::MIN,
        ] {
            let e = super::compression(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("compression {bad}")), "{e}");
        }
    }

    #[test]
    fn overlap_of_byte_ranges() {
        use super::overlaps;
        assert!(overlaps(100, 100, 8));
        assert!(overlaps(100, 104, 8));
        assert!(overlaps(104, 100, 8));
        assert!(!overlaps(100, 108, 8));
        assert!(!overlaps(108, 100, 8));
        assert!(!overlaps(100, 100, 0));
        assert!(!overlaps(usize::MAX - 4, 0, 8));
    }

    #[test]
    fn calls_before_init_and_null_pointers_are_rejected() {
        use super::*;
        let mut v = 0;
        assert_eq!(fv_rank(&mut v), Status::NotInitialized);
        let mut buf = [0 as c_char; 128];
        let mut needed = 0usize;
        assert_eq!(
            fv_last_error(buf.as_mut_ptr(), buf.len(), &mut needed),
            Status::Ok
        );
        // SAFETY: buf is NUL-terminated by fv_last_error.
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(msg, "Horovod has not been initialized; use hvd.init().");
        assert_eq!(needed, msg.len() + 1);
        // SAFETY: null is a documented input.
        assert_eq!(
            unsafe { fv_enqueue(std::ptr::null(), std::ptr::null_mut()) },
            Status::InvalidArgument
        );
        assert_eq!(fv_poll(1, std::ptr::null_mut()), Status::NotInitialized);
        assert_eq!(fv_is_initialized(), 0);
        assert_eq!(fv_shutdown(), Status::Ok);
        // SAFETY: valid NUL-terminated strings and null.
        unsafe {
            assert_eq!(fv_built_with(c"mpi".as_ptr()), 1);
            assert_eq!(fv_built_with(c"nccl".as_ptr()), 0);
            assert_eq!(fv_built_with(std::ptr::null()), 0);
        }
    }
}
