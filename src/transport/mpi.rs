//! The MPI backend: process-wide MPI setup and a `Transport` over one communicator. All MPI
//! calls of the runtime are made from its background thread.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use mpi::ffi;

use crate::dtype::DataType;
use crate::elementwise::{reduce_bf16, reduce_f16};
use crate::error::{Error, Result, Stall};
use crate::message::ReduceOp;
use crate::transport::{Segment, Transport};

unsafe extern "C" {
    static FERROVOD_MPI_IN_PLACE: *mut c_void;
    static FERROVOD_MPI_BYTE: ffi::MPI_Datatype;
}

/// Largest element count passed to one MPI call (MPI counts are C ints); larger transfers are
/// split into several calls.
pub const MAX_COUNT: usize = 1 << 30;

/// Tag of the presence probe (on private communicators only).
const PROBE_TAG: usize = 7;

/// How long a rank that gave up waiting listens for the others' presence probes: ranks stuck
/// in the same wait reach their limit within a second of each other (the watchdog looks
/// every 200 ms).
const PROBE_GRACE: Duration = Duration::from_secs(3);

/// What a rank missing from a collective may be doing.
const STALL_HINT: &str = "A missing rank is stopped, hung, or blocked elsewhere.";

/// Blocking MPI calls in progress, one slot per thread that has made one: when each started
/// and what it is. The watchdog reads them.
static BLOCKED: Mutex<Vec<Option<(Instant, &'static str)>>> = Mutex::new(Vec::new());

thread_local! {
    static BLOCKED_SLOT: usize = {
        let mut slots = BLOCKED.lock().unwrap_or_else(|e| e.into_inner());
        slots.push(None);
        slots.len() - 1
    };
}

/// Marks this thread as inside a blocking call that waits for other ranks (MPI, NCCL's
/// communicator creation, a stream the other ranks' work holds up) until dropped; an outer
/// mark, if any, is kept (calls split into several nest).
pub(crate) struct Blocked(usize, Option<(Instant, &'static str)>);

pub(crate) fn blocked(what: &'static str) -> Blocked {
    let slot = BLOCKED_SLOT.with(|s| *s);
    let mut slots = BLOCKED.lock().unwrap_or_else(|e| e.into_inner());
    let outer = slots[slot];
    slots[slot] = Some(outer.unwrap_or((Instant::now(), what)));
    Blocked(slot, outer)
}

impl Drop for Blocked {
    fn drop(&mut self) {
        BLOCKED.lock().unwrap_or_else(|e| e.into_inner())[self.0] = self.1;
    }
}

/// The longest-running blocking MPI call: when it started, and which.
fn longest_blocked() -> Option<(Instant, &'static str)> {
    BLOCKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .flatten()
        .min_by_key(|(t, _)| *t)
        .copied()
}

/// Ends the whole job from this process: MPI_Abort on MPI_COMM_WORLD, after `message` is on
/// stderr. For failures that leave the ranks unable to agree on a shutdown.
pub fn abort_job(message: &str) -> ! {
    eprintln!("{message}");
    tracing::error!("{message}");
    if mpi_initialized() {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    }
    std::process::exit(1)
}

/// A thread that ends the job when a blocking call that waits for other ranks (a data
/// collective a rank never joins: it is stopped, or hung) has waited longer than the stall
/// shutdown time while some rank is missing from it. The waiting thread cannot be
/// interrupted, so the watchdog asks every rank whether it is inside such a call too (each
/// watchdog answers its peers' questions: `Responder`). A collective that outlasts the limit
/// with every rank inside it is slow, not stalled (a large transfer on a slow link): the
/// watchdog says so and asks again after another limit. A rank that does not answer, or
/// answers that it is elsewhere, is missing: the watchdog names it and aborts the job.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<MpiComm>>,
}

/// Tags of the watchdog's presence questions and answers (on its private communicator).
const ASK_TAG: usize = 8;
const ANSWER_TAG: usize = 9;

/// Answers: inside a blocking call that waits for other ranks, or running elsewhere.
const INSIDE: u8 = 1;
const ELSEWHERE: u8 = 2;

/// How often the watchdog looks at the blocked calls and its peers' questions.
const WATCH_TICK: Duration = Duration::from_millis(100);

/// The watchdog's side of the presence questions: one receive from any rank always posted,
/// answered with whether this process is inside a blocking call, and the answers' sends
/// until they complete. Only with MPI_THREAD_MULTIPLE (it runs beside the blocked call).
struct Responder {
    question: Box<[u8; 4]>,
    req: ffi::MPI_Request,
    /// Answers in flight: (request, [round, answer]).
    sends: Vec<(ffi::MPI_Request, Box<[u8; 5]>)>,
}

impl Responder {
    fn new(comm: &MpiComm) -> Result<Responder> {
        let mut r = Responder {
            question: Box::new([0; 4]),
            // SAFETY: zeroed is a valid placeholder for a request out-parameter.
            req: unsafe { std::mem::zeroed() },
            sends: Vec::new(),
        };
        r.listen(comm)?;
        Ok(r)
    }

    fn listen(&mut self, comm: &MpiComm) -> Result<()> {
        // SAFETY: the question buffer is heap memory owned by self, which completes or cancels
        // the receive before it goes (Drop) and is never moved out of its box.
        let rc = unsafe {
            ffi::MPI_Irecv(
                self.question.as_mut_ptr().cast(),
                4,
                byte_type(),
                ffi::RSMPI_ANY_SOURCE,
                ASK_TAG as c_int,
                comm.comm,
                &mut self.req,
            )
        };
        check(rc, "MPI_Irecv")
    }

    /// Answers every question that has arrived; frees the answers that have gone.
    fn serve(&mut self, comm: &MpiComm) -> Result<()> {
        loop {
            let mut done: c_int = 0;
            // SAFETY: zeroed is a valid MPI_Status to be written.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: req is the active receive posted by `listen`.
            check(
                unsafe { ffi::MPI_Test(&mut self.req, &mut done, &mut status) },
                "MPI_Test",
            )?;
            if done == 0 {
                break;
            }
            let mut answer = Box::new([0u8; 5]);
            answer[..4].copy_from_slice(&self.question[..]);
            answer[4] = if longest_blocked().is_some() {
                INSIDE
            } else {
                ELSEWHERE
            };
            let req = comm.post(
                Direction::Send,
                answer.as_mut_ptr().cast(),
                5,
                status.MPI_SOURCE as usize,
                ANSWER_TAG,
            )?;
            self.sends.push((req, answer));
            self.listen(comm)?;
        }
        self.sends.retain_mut(|(req, _)| {
            let mut done: c_int = 0;
            // SAFETY: an active send of this process; its buffer lives in the same entry.
            let rc = unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            rc == 0 && done == 0
        });
        Ok(())
    }

    /// Ends the posted receive (before the communicator goes); answers still in flight keep
    /// their buffers, leaked (only where the job is ending with a peer gone).
    fn close(mut self) {
        // SAFETY: req is this process's posted receive; a cancelled request completes locally.
        unsafe {
            ffi::MPI_Cancel(&mut self.req);
            ffi::MPI_Wait(&mut self.req, ffi::RSMPI_STATUS_IGNORE);
        }
        for (mut req, buf) in self.sends.drain(..) {
            // SAFETY: an active send; freeing it lets it complete on its own, so its buffer
            // must outlive this: leaked.
            unsafe { ffi::MPI_Request_free(&mut req) };
            Box::leak(buf);
        }
    }
}

impl MpiComm {
    /// Asks every other rank whether it is inside a blocking call (`Responder` answers),
    /// answering their questions meanwhile; returns the ranks that are not, or that do not
    /// answer within `grace`. Requests left unanswered are cancelled.
    fn ranks_outside(&self, round: u32, grace: Duration, me: &mut Responder) -> Vec<usize> {
        let question: &'static [u8; 4] = Box::leak(Box::new(round.to_le_bytes()));
        let mut asks = Vec::new();
        for p in (0..self.size).filter(|p| *p != self.rank) {
            let mut answer = Box::new([0u8; 5]);
            let sent = self.post(
                Direction::Send,
                question.as_ptr().cast_mut().cast(),
                4,
                p,
                ASK_TAG,
            );
            let recv = self.post(
                Direction::Recv,
                answer.as_mut_ptr().cast(),
                5,
                p,
                ANSWER_TAG,
            );
            asks.push((p, sent.ok(), recv.ok(), answer, None::<u8>));
        }
        let start = Instant::now();
        while start.elapsed() < grace && asks.iter().any(|a| a.4.is_none() && a.2.is_some()) {
            let _ = me.serve(self);
            for (p, _, recv, answer, got) in asks.iter_mut().filter(|a| a.4.is_none()) {
                let Some(r) = recv.as_mut() else { continue };
                let mut done: c_int = 0;
                // SAFETY: r is an active receive into `answer`, which lives in the same entry.
                let rc = unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                if rc != 0 {
                    *recv = None;
                } else if done != 0 {
                    if answer[..4] == round.to_le_bytes() {
                        *got = Some(answer[4]);
                    } else if let Ok(again) = self.post(
                        // an answer to an earlier round: listen again
                        Direction::Recv,
                        answer.as_mut_ptr().cast(),
                        5,
                        *p,
                        ANSWER_TAG,
                    ) {
                        *r = again;
                    } else {
                        *recv = None;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut outside = Vec::new();
        for (p, sent, recv, answer, got) in asks {
            if got != Some(INSIDE) {
                outside.push(p);
            }
            // SAFETY: requests still active are cancelled and completed locally (a cancelled
            // receive no longer writes); the buffers of those that cannot be are leaked.
            unsafe {
                if let (Some(mut r), None) = (recv, got) {
                    ffi::MPI_Cancel(&mut r);
                    ffi::MPI_Wait(&mut r, ffi::RSMPI_STATUS_IGNORE);
                }
                if let Some(mut r) = sent {
                    ffi::MPI_Request_free(&mut r);
                }
            }
            drop(answer);
        }
        outside
    }
}

impl Watchdog {
    /// `probe`: a private duplicate of the world communicator (made on every rank).
    /// `concurrent`: MPI_THREAD_MULTIPLE, so the watchdog may ask and answer while another
    /// thread waits inside MPI.
    pub fn start(limit: Option<Duration>, probe: MpiComm, concurrent: bool) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferrovod-watchdog".into())
            .spawn(move || {
                let mut responder = match concurrent {
                    true => Responder::new(&probe).ok(),
                    false => None,
                };
                let mut round = 0u32;
                // the call last found slow with every rank inside it, and when to ask again
                let mut slow: Option<(Instant, Duration)> = None;
                while !flag.load(Ordering::Relaxed) {
                    // woken at once when the runtime stops
                    std::thread::park_timeout(WATCH_TICK);
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(r) = responder.as_mut() {
                        let _ = r.serve(&probe);
                    }
                    let (Some(limit), Some((since, what))) = (limit, longest_blocked()) else {
                        continue;
                    };
                    let waited = since.elapsed();
                    let due = match slow {
                        Some((call, next)) if call == since => next,
                        _ => limit,
                    };
                    if waited < due {
                        continue;
                    }
                    tracing::debug!("watchdog: {what} has waited {waited:?}; asking the ranks");
                    round = round.wrapping_add(1);
                    let missing: Option<Vec<i32>> = responder.as_mut().map(|r| {
                        (probe.ranks_outside(round, PROBE_GRACE, r).into_iter())
                            .map(|r| r as i32)
                            .collect()
                    });
                    if missing.as_ref().is_some_and(|m| m.is_empty()) {
                        tracing::warn!(
                            "rank {}: {what} has run for {} s with every rank inside a collective: slow, not stalled; still waiting",
                            probe.rank,
                            waited.as_secs()
                        );
                        slow = Some((since, waited + limit));
                        continue;
                    }
                    let msg = Stall {
                        rank: probe.rank as i32,
                        limit,
                        waiting_in: what.to_string(),
                        missing,
                        hint: STALL_HINT,
                    };
                    eprintln!("ferrovod: {msg} Aborting the job.");
                    // the other waiting ranks report too before the abort reaches them
                    std::thread::sleep(Duration::from_secs(1));
                    abort_job("ferrovod: aborting the job after a stalled MPI call");
                }
                if let Some(r) = responder {
                    r.close();
                }
                probe
            })
            .expect("spawn the watchdog thread");
        Watchdog {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // the probe communicator is freed here, on the thread that owns MPI
            drop(t.join());
        }
    }
}

/// Waits for every request (completed ones are null and return at once).
fn wait_all(reqs: &mut [ffi::MPI_Request]) -> Result<()> {
    // SAFETY: every request was posted by `post_all` (or is already null).
    check(
        unsafe {
            ffi::MPI_Waitall(
                reqs.len() as c_int,
                reqs.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        },
        "MPI_Waitall",
    )
}

fn in_place() -> *mut c_void {
    // SAFETY: a constant initialised at load time by the C shim.
    unsafe { FERROVOD_MPI_IN_PLACE }
}

fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: a constant initialised at load time by the C shim.
    unsafe { FERROVOD_MPI_BYTE }
}

fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING (256) bytes or more.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    Err(Error::Backend(format!(
        "{what} failed: {}",
        String::from_utf8_lossy(&buf)
    )))
}

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
/// travel in fragments with room for the replies between them (BENCHMARKS.md, session 23).
pub const OMPI_TCP_FLAGS: &str = "send,inplace,need-ack,need-csum,hetero-rdma";

/// Sets `OMPI_MCA_btl_tcp_flags` to `OMPI_TCP_FLAGS` before MPI starts, unless the job chose
/// its own (`mpirun --mca btl_tcp_flags`, which arrives the same way) or this is not Open MPI 4
/// or 5, whose flag names these are.
///
/// # Safety
/// As `std::env::set_var`: no other thread may read or write the environment while it runs.
unsafe fn tcp_without_put() {
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

/// Waits for `req` by polling with backoff (spin, then yield, then 100 us sleeps), so a rank
/// waiting for slower peers gives its core to the framework's threads instead of spinning
/// inside MPI. Returns false if `limit` passed first (the request is then still active);
/// `slow` is told how long it has waited, about once a second.
fn wait_polled(
    req: &mut ffi::MPI_Request,
    limit: Option<std::time::Duration>,
    slow: &mut dyn FnMut(std::time::Duration),
) -> Result<bool> {
    let start = std::time::Instant::now();
    let mut next_report = std::time::Duration::from_secs(1);
    loop {
        let mut done: c_int = 0;
        // SAFETY: req is an active request of this process.
        let rc = unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        check(rc, "MPI_Test")?;
        if done != 0 {
            return Ok(true);
        }
        let waited = start.elapsed();
        if limit.is_some_and(|l| waited >= l) {
            return Ok(false);
        }
        if waited >= next_report {
            slow(waited);
            next_report += std::time::Duration::from_secs(1);
        }
        if waited < std::time::Duration::from_micros(50) {
            std::hint::spin_loop();
        } else if waited < std::time::Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

fn native_type(dtype: DataType) -> ffi::MPI_Datatype {
    // SAFETY: reading constants initialised by rsmpi's shim.
    unsafe {
        match dtype {
            DataType::U8 | DataType::Bool => ffi::RSMPI_UINT8_T,
            DataType::I8 => ffi::RSMPI_INT8_T,
            DataType::U16 | DataType::F16 | DataType::BF16 => ffi::RSMPI_UINT16_T,
            DataType::I16 => ffi::RSMPI_INT16_T,
            DataType::I32 => ffi::RSMPI_INT32_T,
            DataType::I64 => ffi::RSMPI_INT64_T,
            DataType::F32 => ffi::RSMPI_FLOAT,
            DataType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

macro_rules! half_op {
    ($fname:ident, $t:ty, $kernel:ident, $op:expr) => {
        unsafe extern "C" fn $fname(
            invec: *mut c_void,
            inoutvec: *mut c_void,
            len: *mut c_int,
            _dt: *mut ffi::MPI_Datatype,
        ) {
            let align = std::mem::align_of::<$t>();
            // SAFETY: MPI passes two buffers of `*len` elements of the 16-bit carrier type,
            // which has the size of `$t`; slices are made over them only where they are
            // aligned for `$t`, otherwise the elements are copied bytewise.
            unsafe {
                let n = (*len).max(0) as usize;
                if invec as usize % align == 0 && inoutvec as usize % align == 0 {
                    let x = std::slice::from_raw_parts(invec as *const $t, n);
                    let acc = std::slice::from_raw_parts_mut(inoutvec as *mut $t, n);
                    $kernel(acc, x, $op);
                } else {
                    let bytes = n * std::mem::size_of::<$t>();
                    let mut x = vec![<$t>::ZERO; n];
                    let mut acc = vec![<$t>::ZERO; n];
                    std::ptr::copy_nonoverlapping(invec as *const u8, x.as_mut_ptr().cast(), bytes);
                    std::ptr::copy_nonoverlapping(
                        inoutvec as *const u8,
                        acc.as_mut_ptr().cast(),
                        bytes,
                    );
                    $kernel(&mut acc, &x, $op);
                    std::ptr::copy_nonoverlapping(acc.as_ptr().cast(), inoutvec as *mut u8, bytes);
                }
            }
        }
    };
}

half_op!(f16_sum, f16, reduce_f16, ReduceOp::Sum);
half_op!(f16_min, f16, reduce_f16, ReduceOp::Min);
half_op!(f16_max, f16, reduce_f16, ReduceOp::Max);
half_op!(f16_prod, f16, reduce_f16, ReduceOp::Product);
half_op!(bf16_sum, bf16, reduce_bf16, ReduceOp::Sum);
half_op!(bf16_min, bf16, reduce_bf16, ReduceOp::Min);
half_op!(bf16_max, bf16, reduce_bf16, ReduceOp::Max);
half_op!(bf16_prod, bf16, reduce_bf16, ReduceOp::Product);

struct HalfOps([ffi::MPI_Op; 8]);
// SAFETY: MPI_Op handles are process-wide values, valid from any thread.
unsafe impl Send for HalfOps {}
// SAFETY: as above; they are never mutated after creation.
unsafe impl Sync for HalfOps {}

static HALF_OPS: OnceLock<HalfOps> = OnceLock::new();

fn half_ops() -> &'static HalfOps {
    HALF_OPS.get_or_init(|| {
        let fns: [ffi::MPI_User_function; 8] = [
            Some(f16_sum),
            Some(f16_min),
            Some(f16_max),
            Some(f16_prod),
            Some(bf16_sum),
            Some(bf16_min),
            Some(bf16_max),
            Some(bf16_prod),
        ];
        // SAFETY: MPI is initialised whenever a communicator exists; each call writes one op.
        HalfOps(fns.map(|f| unsafe {
            let mut op = std::mem::zeroed::<ffi::MPI_Op>();
            ffi::MPI_Op_create(f, 1, &mut op);
            op
        }))
    })
}

fn mpi_op(dtype: DataType, op: ReduceOp) -> Result<ffi::MPI_Op> {
    let idx = op.elementwise_index()?;
    // SAFETY: reading constants initialised by rsmpi's shim.
    Ok(unsafe {
        match dtype {
            DataType::F16 => half_ops().0[idx],
            DataType::BF16 => half_ops().0[4 + idx],
            // bool as 0/1 bytes: sum and max are OR, min and product are AND
            DataType::Bool if idx == 0 || idx == 2 => ffi::RSMPI_BOR,
            DataType::Bool => ffi::RSMPI_BAND,
            _ => [
                ffi::RSMPI_SUM,
                ffi::RSMPI_MIN,
                ffi::RSMPI_MAX,
                ffi::RSMPI_PROD,
            ][idx],
        }
    })
}

/// A pointer for an MPI buffer argument. An empty slice's pointer is dangling (0x1), which is
/// Open MPI's MPI_IN_PLACE; give MPI a real address instead.
fn ptr(s: &[u8]) -> *const c_void {
    static EMPTY: u8 = 0;
    if s.is_empty() {
        std::ptr::addr_of!(EMPTY).cast()
    } else {
        s.as_ptr().cast()
    }
}

fn ptr_mut(s: &mut [u8]) -> *mut c_void {
    ptr(s) as *mut c_void
}

fn displacements(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |acc, c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect()
}

fn fits(counts: &[usize], limit: usize) -> bool {
    counts.iter().sum::<usize>() <= limit
}

fn ints(v: &[usize]) -> Vec<c_int> {
    v.iter().map(|x| *x as c_int).collect()
}

#[derive(Clone, Copy)]
enum Direction {
    Send,
    Recv,
}

/// One MPI communicator, owned (freed on drop).
pub struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    /// Largest count per MPI call (`MAX_COUNT`, lowered in tests to exercise the split paths).
    max_count: usize,
    /// Control communicators only: how long their collectives wait for the other ranks.
    bound: Option<Box<Bound>>,
}

/// The limit on a control communicator's waits, and what names the ranks that never came.
struct Bound {
    /// None: wait for ever (stall checks disabled on this rank).
    limit: Option<Duration>,
    warn: Duration,
    /// A private duplicate, used only to find out who is still there.
    probe: MpiComm,
    /// The global rank of each member.
    global: Vec<i32>,
    what: String,
}

// SAFETY: a communicator handle may be used from any thread; the runtime uses each from one
// thread at a time.
unsafe impl Send for MpiComm {}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if mpi_initialized() {
            // SAFETY: the communicator is ours and no operation on it is in flight.
            unsafe { ffi::MPI_Comm_free(&mut self.comm) };
        }
    }
}

impl MpiComm {
    /// Bitwise reduction of the vote words: non-blocking, then polled with backoff, so that a
    /// rank waiting for slower peers yields its core (often shared with the framework's
    /// threads) instead of spinning inside MPI. The request works on a buffer of its own,
    /// leaked if MPI fails so that MPI can never write to freed memory.
    fn bitwise_words(&self, words: &mut [u64], op: ffi::MPI_Op, what: &str) -> Result<()> {
        let buf: Box<[u64]> = words.into();
        // SAFETY: `buf` holds `buf.len()` words and is owned by `control` until the request
        // completes (leaked if it does not).
        let buf = self.control(what, "a negotiation vote", buf, |buf, req| unsafe {
            ffi::MPI_Iallreduce(
                in_place(),
                buf.as_mut_ptr().cast(),
                buf.len() as c_int,
                ffi::RSMPI_UINT64_T,
                op,
                self.comm,
                req,
            )
        })?;
        words.copy_from_slice(&buf);
        Ok(())
    }

    /// Makes this a control communicator: its collectives give up after `limit` (the stall
    /// shutdown time) with an error that names the ranks that never joined, found through a
    /// private duplicate made here (collective: every member calls this, whatever its limit).
    pub fn bounded(
        mut self,
        limit: Option<Duration>,
        warn: Duration,
        global: Vec<i32>,
        what: String,
    ) -> Result<MpiComm> {
        let probe = MpiComm::dup_raw(self.comm)?;
        self.bound = Some(Box::new(Bound {
            limit,
            warn,
            probe,
            global,
            what,
        }));
        Ok(self)
    }

    /// Waits for a control collective's request within the communicator's bound. After the
    /// limit the request stays posted (its buffers must be leaked by the caller) and the
    /// error names the ranks that did not answer a presence probe.
    fn wait_control(&self, req: &mut ffi::MPI_Request, what: &str) -> Result<()> {
        let Some(b) = self.bound.as_deref() else {
            // not a control communicator: the watchdog bounds this wait
            let _blocked = blocked("an MPI collective (non-blocking, waited for)");
            wait_polled(req, None, &mut |_| {})?;
            return Ok(());
        };
        let me = b.global.get(self.rank).copied().unwrap_or(-1);
        let mut warned = false;
        let mut slow = |waited: Duration| {
            if !warned && waited >= b.warn {
                warned = true;
                tracing::warn!(
                    "rank {me} has waited {} s in {what} of {} for ranks that have not joined it; a rank may be stopped or hung",
                    waited.as_secs(),
                    b.what
                );
            }
        };
        if wait_polled(req, b.limit, &mut slow)? {
            return Ok(());
        }
        Err(Error::Stalled(Box::new(Stall {
            rank: me,
            limit: b.limit.unwrap_or_default(),
            waiting_in: format!("{what} of {}", b.what),
            missing: self.missing_ranks(),
            hint: STALL_HINT,
        })))
    }

    /// For a control communicator: the global ranks that do not answer a presence probe (see
    /// `absent_ranks`), once a wait on the set's other communicators gave up on them. Every
    /// rank still there must be giving up too (they reach the same limit together).
    pub fn missing_ranks(&self) -> Option<Vec<i32>> {
        let b = self.bound.as_deref()?;
        Some(
            b.probe
                .absent_ranks(PROBE_GRACE)
                .into_iter()
                .map(|r| b.global.get(r).copied().unwrap_or(r as i32))
                .collect(),
        )
    }

    /// Ranks of this communicator that do not answer within `grace`: every rank that calls
    /// this sends each other rank one byte and listens for theirs. Ranks stuck in the same
    /// wait call it at about the same time; a stopped or hung rank never answers. The
    /// requests are left posted (the job is ending).
    fn absent_ranks(&self, grace: Duration) -> Vec<usize> {
        static PRESENT: u8 = 1;
        let got: &'static mut [u8] = Box::leak(vec![0u8; self.size].into_boxed_slice());
        let mut recvs = Vec::new();
        for p in (0..self.size).filter(|p| *p != self.rank) {
            // the send buffer is static; each receive has its own leaked byte
            let sent = self.post(
                Direction::Send,
                (&raw const PRESENT).cast_mut().cast(),
                1,
                p,
                PROBE_TAG,
            );
            let recv = self.post(Direction::Recv, (&raw mut got[p]).cast(), 1, p, PROBE_TAG);
            // a rank whose probe cannot even be posted counts as absent
            recvs.push((p, sent.and(recv).ok(), false));
        }
        let start = Instant::now();
        loop {
            for (_, req, present) in recvs.iter_mut() {
                if let (Some(r), false) = (req.as_mut(), *present) {
                    let mut done: c_int = 0;
                    // SAFETY: r is an active request of this process (tested until it completes).
                    let rc = unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                    *present = rc == 0 && done != 0;
                }
            }
            let absent: Vec<usize> = recvs
                .iter()
                .filter(|(_, _, present)| !present)
                .map(|(p, _, _)| *p)
                .collect();
            if absent.is_empty() || start.elapsed() >= grace {
                return absent;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Posts one non-blocking control collective with `start` over `bufs` (the buffers the
    /// request reads and writes, which this owns meanwhile) and waits for it within the
    /// communicator's bound (`waiting_in` names it in the stall report). Returns the buffers;
    /// when the wait gives up they are leaked, since the request may still use them. They
    /// must be heap memory (`Vec`, `Box`): an inline array would move with `bufs`.
    fn control<B>(
        &self,
        call: &str,
        waiting_in: &str,
        mut bufs: B,
        start: impl FnOnce(&mut B, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<B> {
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        check(start(&mut bufs, &mut req), call)?;
        match self.wait_control(&mut req, waiting_in) {
            Ok(()) => Ok(bufs),
            Err(e) => {
                std::mem::forget(bufs);
                Err(e)
            }
        }
    }

    fn wrap(comm: ffi::MPI_Comm) -> Result<MpiComm> {
        let mut rank: c_int = 0;
        let mut size: c_int = 0;
        // SAFETY: comm is a valid communicator; ERRORS_RETURN makes failures codes, not aborts.
        unsafe {
            check(ffi::MPI_Comm_rank(comm, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(comm, &mut size), "MPI_Comm_size")?;
            ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
        }
        Ok(MpiComm {
            comm,
            rank: rank as usize,
            size: size as usize,
            max_count: MAX_COUNT,
            bound: None,
        })
    }

    /// Splits transfers above `n` elements into several MPI calls (and uses the split paths for
    /// v-collectives above `n` bytes). Communicators derived from this one inherit it.
    pub fn with_max_count(mut self, n: usize) -> MpiComm {
        self.max_count = n.clamp(1, MAX_COUNT);
        self
    }

    fn inherit(&self, c: MpiComm) -> MpiComm {
        c.with_max_count(self.max_count)
    }

    fn dup_raw(comm: ffi::MPI_Comm) -> Result<MpiComm> {
        // SAFETY: zeroed is a valid placeholder for the out-parameter.
        let mut out = unsafe { std::mem::zeroed::<ffi::MPI_Comm>() };
        // SAFETY: comm is valid; collective over its members.
        check(unsafe { ffi::MPI_Comm_dup(comm, &mut out) }, "MPI_Comm_dup")?;
        MpiComm::wrap(out)
    }

    /// A private duplicate of MPI_COMM_WORLD.
    pub fn world() -> Result<MpiComm> {
        // SAFETY: constant.
        MpiComm::dup_raw(unsafe { ffi::RSMPI_COMM_WORLD })
    }

    /// A private duplicate of a communicator given by its Fortran handle (`MPI_Comm_c2f`,
    /// mpi4py's `comm.py2f()`).
    pub fn from_fortran(handle: i32) -> Result<MpiComm> {
        // SAFETY: f2c of an invalid handle yields MPI_COMM_NULL (checked) rather than UB in Open MPI.
        let comm = unsafe { ffi::MPI_Comm_f2c(handle) };
        // SAFETY: constant.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::InvalidArgument(format!(
                "MPI communicator handle {handle} is not valid"
            )));
        }
        MpiComm::dup_raw(comm)
    }

    pub fn dup(&self) -> Result<MpiComm> {
        MpiComm::dup_raw(self.comm).map(|c| self.inherit(c))
    }

    /// The sub-communicator of the given ranks (of this communicator), or None on ranks not in
    /// it. Collective over all of this communicator.
    pub fn subset(&self, ranks: &[i32]) -> Result<Option<MpiComm>> {
        // SAFETY: group handles are created and freed here; comm is valid.
        unsafe {
            let mut group = std::mem::zeroed::<ffi::MPI_Group>();
            check(ffi::MPI_Comm_group(self.comm, &mut group), "MPI_Comm_group")?;
            let mut sub = std::mem::zeroed::<ffi::MPI_Group>();
            let rc = ffi::MPI_Group_incl(group, ranks.len() as c_int, ranks.as_ptr(), &mut sub);
            ffi::MPI_Group_free(&mut group);
            check(rc, "MPI_Group_incl")?;
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            let rc = ffi::MPI_Comm_create(self.comm, sub, &mut out);
            ffi::MPI_Group_free(&mut sub);
            check(rc, "MPI_Comm_create")?;
            if out == ffi::RSMPI_COMM_NULL {
                return Ok(None);
            }
            MpiComm::wrap(out).map(|c| Some(self.inherit(c)))
        }
    }

    /// Ranks sharing a node (MPI_COMM_TYPE_SHARED), or blocks of `block` consecutive ranks
    /// when a node size is forced (to emulate several hosts on one machine).
    pub fn split_local(&self, block: Option<usize>) -> Result<MpiComm> {
        // SAFETY: comm is valid; collective over its members.
        unsafe {
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            let rc = match block {
                Some(b) => ffi::MPI_Comm_split(
                    self.comm,
                    (self.rank / b.max(1)) as c_int,
                    self.rank as c_int,
                    &mut out,
                ),
                None => ffi::MPI_Comm_split_type(
                    self.comm,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    self.rank as c_int,
                    ffi::RSMPI_INFO_NULL,
                    &mut out,
                ),
            };
            check(rc, "MPI_Comm_split_type")?;
            MpiComm::wrap(out).map(|c| self.inherit(c))
        }
    }

    /// Ranks with the same `color`, ordered by rank.
    pub fn split(&self, color: i32) -> Result<MpiComm> {
        // SAFETY: comm is valid; collective over its members.
        unsafe {
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            check(
                ffi::MPI_Comm_split(self.comm, color, self.rank as c_int, &mut out),
                "MPI_Comm_split",
            )?;
            MpiComm::wrap(out).map(|c| self.inherit(c))
        }
    }

    /// Posts a non-blocking send or receive of `len` bytes at `buf` to/from `peer`.
    /// The caller keeps the memory valid until the request completes.
    fn post(
        &self,
        dir: Direction,
        buf: *mut c_void,
        len: usize,
        peer: usize,
        tag: usize,
    ) -> Result<ffi::MPI_Request> {
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        let (n, peer, tag) = (len as c_int, peer as c_int, tag as c_int);
        // SAFETY: buf is valid for len bytes until the request completes (caller's contract).
        let rc = unsafe {
            match dir {
                Direction::Send => {
                    ffi::MPI_Isend(buf, n, byte_type(), peer, tag, self.comm, &mut req)
                }
                Direction::Recv => {
                    ffi::MPI_Irecv(buf, n, byte_type(), peer, tag, self.comm, &mut req)
                }
            }
        };
        check(rc, "MPI_Isend/MPI_Irecv")?;
        Ok(req)
    }

    /// Posts every transfer `(direction, buffer, bytes, peer, tag)` at once and waits for all of
    /// them. If posting fails part way, the requests already posted are cancelled and completed
    /// before returning, so none of them outlives the buffers.
    ///
    /// # Safety
    /// Each buffer must be valid for its length (writable for receives) until this returns, and
    /// no two receives may overlap.
    unsafe fn transfer_all(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.transfer_all_while(transfers, &mut || Ok(())) }
    }

    /// `transfer_all`, running `meanwhile` after the transfers are posted and before waiting
    /// for them (its MPI calls on other communicators progress them). The transfers complete
    /// even when `meanwhile` fails; its error is returned first.
    ///
    /// # Safety
    /// As `transfer_all`; `meanwhile` must not touch the buffers.
    unsafe fn transfer_all_while(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        let mut reqs = unsafe { self.post_all(transfers) }?;
        let local = meanwhile();
        local.and(wait_all(&mut reqs))
    }

    /// Posts every transfer of `transfers` (as `transfer_all`); if posting fails part way, the
    /// requests already posted are cancelled and completed before the error returns.
    ///
    /// # Safety
    /// As `transfer_all`: the buffers stay valid until the requests complete.
    unsafe fn post_all(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
    ) -> Result<Vec<ffi::MPI_Request>> {
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(transfers.len());
        for &(dir, buf, len, peer, tag) in transfers {
            match self.post(dir, buf, len, peer, tag) {
                Ok(req) => reqs.push(req),
                Err(e) => {
                    for req in reqs.iter_mut() {
                        // SAFETY: each request was posted above and is still active.
                        unsafe {
                            ffi::MPI_Cancel(req);
                            ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(reqs)
    }

    /// A sendrecv's two peers, checked against the communicator's ranks.
    fn peers_exist(&self, to: usize, from: usize) -> Result<()> {
        if to >= self.size || from >= self.size {
            return Err(Error::InvalidArgument(format!(
                "sendrecv with rank {to}/{from} on a communicator of {} ranks",
                self.size
            )));
        }
        Ok(())
    }

    /// The largest of every rank's `v`.
    fn max_u64(&self, v: u64) -> Result<u64> {
        let _blocked = blocked("MPI_Allreduce(MAX)");
        let mut out = v;
        // SAFETY: one u64 in place.
        check(
            unsafe {
                ffi::MPI_Allreduce(
                    in_place(),
                    (&mut out as *mut u64).cast(),
                    1,
                    ffi::RSMPI_UINT64_T,
                    ffi::RSMPI_MAX,
                    self.comm,
                )
            },
            "MPI_Allreduce(MAX)",
        )?;
        Ok(out)
    }

    /// Allgather of one i64 per rank: a control collective (bounded on control communicators,
    /// watched elsewhere).
    pub fn allgather_i64(&self, v: i64) -> Result<Vec<i64>> {
        let bufs = (v.to_le_bytes().to_vec(), vec![0u8; 8 * self.size]);
        // SAFETY: 8 bytes from every rank into the second buffer; both are owned by `control`
        // until the request completes.
        let (_, out) = self.control(
            "MPI_Iallgather",
            "a negotiation round",
            bufs,
            |(mine, out), req| unsafe {
                ffi::MPI_Iallgather(
                    ptr(mine),
                    8,
                    byte_type(),
                    ptr_mut(out),
                    8,
                    byte_type(),
                    self.comm,
                    req,
                )
            },
        )?;
        Ok(out
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    fn bcast_chunked(&self, data: &mut [u8], root: usize) -> Result<()> {
        let _blocked = blocked("MPI_Bcast");
        for chunk in data.chunks_mut(self.max_count) {
            // SAFETY: chunk is valid for chunk.len() bytes; collective over the communicator.
            check(
                unsafe {
                    ffi::MPI_Bcast(
                        ptr_mut(chunk),
                        chunk.len() as c_int,
                        byte_type(),
                        root as c_int,
                        self.comm,
                    )
                },
                "MPI_Bcast",
            )?;
        }
        Ok(())
    }
}

impl Transport for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn allreduce(
        &self,
        send: Option<&[u8]>,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Allreduce");
        let esz = dtype.size();
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        let step = self.max_count * esz;
        for (i, chunk) in data.chunks_mut(step).enumerate() {
            let src = match send {
                Some(s) => ptr(&s[i * step..i * step + chunk.len()]),
                None => in_place() as *const c_void,
            };
            // SAFETY: src (or MPI_IN_PLACE) and chunk cover chunk.len()/esz elements of `ty`.
            check(
                unsafe {
                    ffi::MPI_Allreduce(
                        src,
                        ptr_mut(chunk),
                        (chunk.len() / esz) as c_int,
                        ty,
                        mop,
                        self.comm,
                    )
                },
                "MPI_Allreduce",
            )?;
        }
        Ok(())
    }

    fn and_words(&self, words: &mut [u64]) -> Result<()> {
        // SAFETY: reading a constant initialised by rsmpi's shim.
        self.bitwise_words(words, unsafe { ffi::RSMPI_BAND }, "MPI_Iallreduce(BAND)")
    }

    fn or_words(&self, words: &mut [u64]) -> Result<()> {
        // SAFETY: reading a constant initialised by rsmpi's shim.
        self.bitwise_words(words, unsafe { ffi::RSMPI_BOR }, "MPI_Iallreduce(BOR)")
    }

    fn allreduce_owned_within(
        &self,
        mut data: Vec<u8>,
        dtype: DataType,
        op: ReduceOp,
        limit: Option<std::time::Duration>,
        slow: &mut dyn FnMut(std::time::Duration),
    ) -> Result<Option<Vec<u8>>> {
        let esz = dtype.size();
        if data.len() / esz > self.max_count {
            // split transfers stay blocking
            self.allreduce(None, &mut data, dtype, op)?;
            return Ok(Some(data));
        }
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        // SAFETY: data covers len/esz elements of `ty` and outlives the request: it is returned
        // only once the request completed, and leaked otherwise.
        let rc = unsafe {
            ffi::MPI_Iallreduce(
                in_place(),
                ptr_mut(&mut data),
                (data.len() / esz) as c_int,
                ty,
                mop,
                self.comm,
                &mut req,
            )
        };
        check(rc, "MPI_Iallreduce")?;
        match wait_polled(&mut req, limit, slow) {
            Ok(true) => Ok(Some(data)),
            Ok(false) => {
                std::mem::forget(data);
                Ok(None)
            }
            Err(e) => {
                std::mem::forget(data);
                Err(e)
            }
        }
    }

    fn allgatherv(&self, send: Option<&[u8]>, recv: &mut [u8], counts: &[usize]) -> Result<()> {
        let _blocked = blocked("MPI_Allgatherv");
        let displs = displacements(counts);
        if !fits(counts, self.max_count) {
            if let Some(s) = send {
                recv[displs[self.rank]..displs[self.rank] + s.len()].copy_from_slice(s);
            }
            for r in 0..self.size {
                self.bcast_chunked(&mut recv[displs[r]..displs[r] + counts[r]], r)?;
            }
            return Ok(());
        }
        let (src, n) = match send {
            Some(s) => (ptr(s), s.len() as c_int),
            None => (in_place() as *const c_void, 0),
        };
        // SAFETY: recv holds sum(counts) bytes; counts and displacements fit in C ints.
        check(
            unsafe {
                ffi::MPI_Allgatherv(
                    src,
                    n,
                    byte_type(),
                    ptr_mut(recv),
                    ints(counts).as_ptr(),
                    ints(&displs).as_ptr(),
                    byte_type(),
                    self.comm,
                )
            },
            "MPI_Allgatherv",
        )
    }

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<()> {
        self.bcast_chunked(data, root)
    }

    fn alltoallv(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let _blocked = blocked("MPI_Alltoallv");
        let sd = displacements(send_counts);
        let rd = displacements(recv_counts);
        // Each rank sees only its own counts, so the choice of path is agreed first.
        let mine = send_counts
            .iter()
            .sum::<usize>()
            .max(recv_counts.iter().sum()) as u64;
        if self.max_u64(mine)? <= self.max_count as u64 {
            // SAFETY: buffers hold the summed counts; all values fit in C ints.
            return check(
                unsafe {
                    ffi::MPI_Alltoallv(
                        ptr(send),
                        ints(send_counts).as_ptr(),
                        ints(&sd).as_ptr(),
                        byte_type(),
                        ptr_mut(recv),
                        ints(recv_counts).as_ptr(),
                        ints(&rd).as_ptr(),
                        byte_type(),
                        self.comm,
                    )
                },
                "MPI_Alltoallv",
            );
        }
        // Large: chunked point-to-point, all posted at once
        let mut transfers = Vec::new();
        for r in 0..self.size {
            let incoming = recv[rd[r]..rd[r] + recv_counts[r]].chunks_mut(self.max_count);
            for (k, c) in incoming.enumerate() {
                transfers.push((Direction::Recv, ptr_mut(c), c.len(), r, k));
            }
            let outgoing = send[sd[r]..sd[r] + send_counts[r]].chunks(self.max_count);
            for (k, c) in outgoing.enumerate() {
                transfers.push((Direction::Send, ptr(c) as *mut c_void, c.len(), r, k));
            }
        }
        // SAFETY: every range lies in `send` or `recv`, which outlive the call.
        unsafe { self.transfer_all(&transfers) }
    }

    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Reduce_scatter");
        let esz = dtype.size();
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        let elems: Vec<usize> = counts.iter().map(|c| c / esz).collect();
        if fits(&elems, self.max_count) {
            // SAFETY: send holds sum(counts) bytes, recv counts[rank] bytes.
            return check(
                unsafe {
                    ffi::MPI_Reduce_scatter(
                        ptr(send),
                        ptr_mut(recv),
                        ints(&elems).as_ptr(),
                        ty,
                        mop,
                        self.comm,
                    )
                },
                "MPI_Reduce_scatter",
            );
        }
        // Large: reduce each rank's segment to it, in chunks.
        let displs = displacements(counts);
        let step = self.max_count * esz;
        for r in 0..self.size {
            let seg = &send[displs[r]..displs[r] + counts[r]];
            for (k, c) in seg.chunks(step).enumerate() {
                let dst = if r == self.rank {
                    recv[k * step..].as_mut_ptr().cast()
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: c and (on the root) dst cover c.len()/esz elements.
                check(
                    unsafe {
                        ffi::MPI_Reduce(
                            ptr(c),
                            dst,
                            (c.len() / esz) as c_int,
                            ty,
                            mop,
                            r as c_int,
                            self.comm,
                        )
                    },
                    "MPI_Reduce",
                )?;
            }
        }
        Ok(())
    }

    fn gather_bytes(&self, send: &[u8], root: usize) -> Result<Vec<Vec<u8>>> {
        let is_root = self.rank == root;
        let lens = vec![0u8; if is_root { 8 * self.size } else { 0 }];
        // SAFETY: 8 bytes from each rank into `lens` (root only); both buffers are owned by
        // `control` until the request completes.
        let (_, lens) = self.control(
            "MPI_Igather",
            "a negotiation round",
            ((send.len() as u64).to_le_bytes().to_vec(), lens),
            |(mine, lens), req| unsafe {
                ffi::MPI_Igather(
                    ptr(mine),
                    8,
                    byte_type(),
                    ptr_mut(lens),
                    8,
                    byte_type(),
                    root as c_int,
                    self.comm,
                    req,
                )
            },
        )?;
        let counts: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let displs = displacements(&counts);
        let total: usize = counts.iter().sum();
        if send.len() > c_int::MAX as usize || total > c_int::MAX as usize {
            // every rank's own length is checked; the root also checks the sum
            return Err(Error::Backend(format!(
                "a negotiation message of {} bytes (gathered: {total}) exceeds MPI's {} byte limit",
                send.len(),
                c_int::MAX
            )));
        }
        let bufs = (
            send.to_vec(),
            vec![0u8; total],
            ints(&counts),
            ints(&displs),
        );
        // SAFETY: root's buffer holds the sum of the gathered lengths (checked to fit a C
        // int); every buffer is owned by `control` until the request completes.
        let (_, all, _, _) = self.control(
            "MPI_Igatherv",
            "a negotiation round",
            bufs,
            |(data, all, c, d), req| unsafe {
                ffi::MPI_Igatherv(
                    ptr(data),
                    data.len() as c_int,
                    byte_type(),
                    ptr_mut(all),
                    c.as_ptr(),
                    d.as_ptr(),
                    byte_type(),
                    root as c_int,
                    self.comm,
                    req,
                )
            },
        )?;
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(c, d)| all[*d..d + c].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        // SAFETY: 8 bytes, owned by `control` until the request completes.
        let len = self.control(
            "MPI_Ibcast",
            "a negotiation round",
            (data.len() as u64).to_le_bytes().to_vec(),
            |len, req| unsafe {
                ffi::MPI_Ibcast(ptr_mut(len), 8, byte_type(), root as c_int, self.comm, req)
            },
        )?;
        let n = u64::from_le_bytes(len[..].try_into().expect("8 bytes")) as usize;
        let mut data = data;
        data.resize(n, 0);
        for at in (0..n).step_by(self.max_count.max(1)) {
            let chunk = self.max_count.min(n - at);
            // SAFETY: data[at..at + chunk] is valid; `data` is owned by `control` until the
            // request completes.
            data = self.control(
                "MPI_Ibcast",
                "a negotiation round",
                data,
                |data, req| unsafe {
                    ffi::MPI_Ibcast(
                        data.as_mut_ptr().add(at).cast(),
                        chunk as c_int,
                        byte_type(),
                        root as c_int,
                        self.comm,
                        req,
                    )
                },
            )?;
        }
        Ok(data)
    }

    fn sendrecv_while(
        &self,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Isend/MPI_Irecv");
        self.peers_exist(to, from)?;
        let mut transfers = Vec::new();
        for (k, c) in recv.chunks_mut(self.max_count).enumerate() {
            transfers.push((Direction::Recv, ptr_mut(c), c.len(), from, k));
        }
        for (k, c) in send.chunks(self.max_count).enumerate() {
            transfers.push((Direction::Send, ptr(c) as *mut c_void, c.len(), to, k));
        }
        // SAFETY: every range lies in `send` or `recv`, which outlive the call; `meanwhile`
        // cannot reach them while they are borrowed here.
        unsafe { self.transfer_all_while(&transfers, meanwhile) }
    }

    fn sendrecv_segments(
        &self,
        send: &mut [u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        segment: usize,
        on: &mut dyn FnMut(Segment) -> Result<()>,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Isend/MPI_Irecv");
        self.peers_exist(to, from)?;
        // the caller's segments are whole elements: cut no other way
        if segment == 0 || segment > self.max_count {
            return Err(Error::InvalidArgument(format!(
                "sendrecv segments of {segment} bytes (1 to {} on this communicator)",
                self.max_count
            )));
        }
        let mut parts: Vec<&mut [u8]> = recv.chunks_mut(segment).collect();
        let receives: Vec<_> = (parts.iter_mut().enumerate())
            .map(|(k, c)| (Direction::Recv, ptr_mut(c), c.len(), from, k))
            .collect();
        // SAFETY: each receive's range is one part of `recv`, which outlives the call; a part
        // is read below only once its receive has completed.
        let mut reqs = unsafe { self.post_all(&receives) }?;
        // each send goes as soon as it is ready, so the first travels while the rest are filled
        let mut failed = None;
        for (k, c) in send.chunks_mut(segment).enumerate() {
            if let Err(e) = on(Segment::Send(k, &mut *c)) {
                failed = Some(e);
                break;
            }
            // SAFETY: `c` lies in `send`, which outlives the call and is not touched again.
            match unsafe { self.post_all(&[(Direction::Send, ptr_mut(c), c.len(), to, k)]) } {
                Ok(posted) => reqs.extend(posted),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            // this rank stops half way: its receives may never all be matched
            for req in &mut reqs[..parts.len()] {
                // SAFETY: a receive posted above.
                unsafe { ffi::MPI_Cancel(req) };
            }
            let _ = wait_all(&mut reqs);
            return Err(e);
        }
        let mut outcome = Ok(());
        for (k, part) in parts.iter().enumerate() {
            // SAFETY: request k is part k's receive, posted above.
            let waited = check(
                unsafe { ffi::MPI_Wait(&mut reqs[k], ffi::RSMPI_STATUS_IGNORE) },
                "MPI_Wait",
            );
            outcome = waited.and_then(|_| on(Segment::Received(k, part)));
            if outcome.is_err() {
                break;
            }
        }
        // the rest complete before the buffers go, whatever failed
        outcome.and(wait_all(&mut reqs))
    }

    fn barrier(&self) -> Result<()> {
        let _blocked = blocked("MPI_Barrier");
        // SAFETY: comm is valid.
        check(unsafe { ffi::MPI_Barrier(self.comm) }, "MPI_Barrier")
    }

    fn max_transfer_bytes(&self) -> usize {
        self.max_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MPI may hand a user operation unaligned buffers: the f16 sum must read them bytewise
    /// and give the same result as on aligned ones.
    #[test]
    fn half_ops_take_unaligned_buffers() {
        let a: Vec<f16> = [1.0f32, 2.5, -3.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let b: Vec<f16> = [0.5f32, 0.5, 4.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let mut inb = vec![0u8; 7];
        let mut io = vec![0u8; 7];
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            inb[1 + 2 * k..3 + 2 * k].copy_from_slice(&x.to_le_bytes());
            io[1 + 2 * k..3 + 2 * k].copy_from_slice(&y.to_le_bytes());
        }
        let mut len: c_int = 3;
        // SAFETY: both buffers hold 3 f16 values from offset 1 (odd: unaligned for f16).
        unsafe {
            f16_sum(
                inb.as_mut_ptr().add(1).cast(),
                io.as_mut_ptr().add(1).cast(),
                &mut len,
                std::ptr::null_mut(),
            )
        };
        let got: Vec<f32> = (0..3)
            .map(|k| f16::from_le_bytes([io[1 + 2 * k], io[2 + 2 * k]]).to_f32())
            .collect();
        assert_eq!(got, vec![1.5, 3.0, 1.0]);
    }
}
