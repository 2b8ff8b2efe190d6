//! The runtime: process-wide state, the queue into the background thread, handles, and the
//! Rust API the C API wraps. One runtime per process.

pub mod background;
pub(crate) mod channel;
pub mod completions;
pub mod entry;
pub(crate) mod executor;
pub(crate) mod finisher;
pub(crate) mod gpu;
pub mod handle;
pub(crate) mod in_flight;
pub(crate) mod job;
pub(crate) mod launch;
pub mod metrics;
pub(crate) mod schedule;
pub(crate) mod sets;
mod submit;
pub mod timeline;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;

use crossbeam::channel::{Sender, unbounded};

use crate::config::Config;
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{CPU_DEVICE, Compression, Multistep, OpKind, ReduceOp};
use entry::{InputMem, OutputMem, SharedAllocator, TensorEntry};
use handle::{DoneCallback, HandleTable};
use submit::{open_gpu, unknown_set};

/// Where this process sits in the job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Topology {
    pub rank: i32,
    pub size: i32,
    pub local_rank: i32,
    pub local_size: i32,
    pub cross_rank: i32,
    pub cross_size: i32,
    pub is_homogeneous: bool,
    pub mpi_threads_supported: bool,
}

/// Which ranks form ferrovod's world.
#[derive(Clone, Debug, Default)]
pub enum Communicator {
    #[default]
    World,
    /// These ranks of MPI_COMM_WORLD (every process must pass the same list).
    Ranks(Vec<i32>),
    /// An existing communicator, by Fortran handle (`MPI_Comm_c2f`, mpi4py's `py2f()`).
    Fortran(i32),
}

#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    pub comm: Communicator,
    /// Settings to use instead of the environment's (Rust callers such as the benchmark, which
    /// compares configurations within one process).
    pub config: Option<Config>,
    /// Static process sets (ranks of ferrovod's world), registered as ids 1, 2, ... in order;
    /// a duplicate list gets the id of its first occurrence.
    pub process_sets: Vec<Vec<i32>>,
}

/// One tensor of an operation.
pub struct TensorSpec {
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub input: InputMem,
    pub output: OutputMem,
    /// Alltoall: rows sent to each rank of the process set.
    pub splits: Option<Vec<i32>>,
}

/// An operation to enqueue: one or more tensors (grouped ops) completed together.
pub struct OpSpec {
    pub kind: OpKind,
    pub reduce_op: ReduceOp,
    pub prescale: f64,
    pub postscale: f64,
    /// Allreduce: how its values travel (None: as the job's `FERROVOD_COMPRESSION` says).
    pub compression: Option<Compression>,
    /// Allreduce: which calls communicate (None: as the job's `FERROVOD_MULTISTEP` says).
    pub multistep: Option<Multistep>,
    /// Broadcast root, or a send's or receive's peer, as a rank of ferrovod's world.
    pub root_rank: i32,
    /// Send and receive: the k-th send with a tag meets the peer's k-th receive with it.
    pub tag: i32,
    pub process_set: i32,
    pub device: i32,
    pub tensors: Vec<TensorSpec>,
    pub allocator: Option<SharedAllocator>,
    pub callback: Option<DoneCallback>,
    /// GPU tensors: the caller's stream whose work so far produced the inputs; ferrovod
    /// records an event on it at enqueue and its own stream waits for that event.
    pub ready_stream: Option<crate::transport::cuda::ForeignStream>,
    /// GPU tensors: or the caller's already recorded event.
    pub ready_event: Option<crate::transport::cuda::ForeignEvent>,
    /// How long the operation may wait for the set's other ranks to submit it before the job
    /// shuts down with a timeout error on every rank (a torch group's `timeout`). It shortens
    /// the stall shutdown time for this operation, never lengthens it. None: the stall limit.
    pub timeout: Option<std::time::Duration>,
}

impl OpSpec {
    pub fn new(kind: OpKind, tensors: Vec<TensorSpec>) -> OpSpec {
        OpSpec {
            kind,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: None,
            root_rank: 0,
            tag: 0,
            process_set: 0,
            device: CPU_DEVICE,
            tensors,
            allocator: None,
            callback: None,
            ready_stream: None,
            ready_event: None,
            timeout: None,
        }
    }
}

pub(crate) enum Command {
    Submit {
        set: i32,
        entries: Vec<TensorEntry>,
    },
    /// Sends and receives (`OpKind::Send`, `OpKind::Recv`): not negotiated.
    PointToPoint {
        set: i32,
        tag: i32,
        entries: Vec<TensorEntry>,
    },
    Shutdown,
    /// A channel finished a batch.
    BatchDone(channel::Done),
}

pub struct Runtime {
    pub config: Config,
    topology: OnceLock<Topology>,
    pub handles: &'static HandleTable,
    inbox: Mutex<Option<Sender<Command>>>,
    /// Process set id → member ranks; identical on every rank.
    sets: RwLock<BTreeMap<i32, Vec<i32>>>,
    /// The NCCL connections of the sets this rank is a member of (`wait_on_device`),
    /// published with `sets`.
    connected: RwLock<BTreeMap<i32, sets::SetConnected>>,
    /// Names of tensors submitted and not yet complete, per process set.
    in_flight: Mutex<in_flight::InFlight>,
    /// GPU tensors submitted at new addresses and not yet launched (`in_flight::MovedMark`).
    gpu_moved: Arc<std::sync::atomic::AtomicUsize>,
    loop_ended: AtomicBool,
    shutdown_reason: Mutex<Option<String>>,
    /// A GPU batch failed after agreement (set by the background or a channel thread): the
    /// background thread turns it into a shutdown of the job.
    gpu_failure: Mutex<Option<String>>,
    gpu_failed: AtomicBool,
    /// Some rank's GPU batch failed after agreement (this one, or another through the vote):
    /// GPU lanes abort at shutdown instead of waiting for work that cannot finish.
    gpu_abort: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub metrics: metrics::Metrics,
    /// The GPU this process's device operations use (the first one asked for).
    gpu_device: OnceLock<i32>,
    /// How the global set picks each allreduce's algorithm (set at init).
    pub(crate) allreduce_policy: OnceLock<crate::collective::cost::Policy>,
    /// The job's `FERROVOD_MULTISTEP` (set at init, agreed).
    pub(crate) job_multistep: OnceLock<u32>,
    /// The job's stall settings (set at init, agreed).
    stall: OnceLock<crate::config::StallPolicy>,
    /// The job's `HOROVOD_NUM_NCCL_STREAMS` (set at init, agreed: every rank must open as many
    /// NCCL communicators per set, or the first GPU collective fails).
    pub(crate) nccl_streams: OnceLock<usize>,
    /// The largest tag a send or receive may use (from MPI's tag bound, set at init).
    pub(crate) p2p_max_tag: OnceLock<i32>,
    /// Multistep allreduces' call counts and sums.
    steps: crate::compress::multistep::Steps,
}

static RUNTIME: Mutex<Option<Arc<Runtime>>> = Mutex::new(None);

thread_local! {
    static ON_BACKGROUND_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the caller is ferrovod's background thread (i.e. inside a completion callback or an
/// output allocator), where waiting for other operations or joining the thread would deadlock.
pub fn on_background_thread() -> bool {
    ON_BACKGROUND_THREAD.with(|f| f.get())
}

fn lock_global() -> std::sync::MutexGuard<'static, Option<Arc<Runtime>>> {
    RUNTIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// The running runtime, or `NotInitialized`.
pub fn runtime() -> Result<Arc<Runtime>> {
    lock_global().clone().ok_or(Error::NotInitialized)
}

pub fn is_initialized() -> bool {
    lock_global().is_some()
}

/// A process set's ranks, sorted: distinct, at least one, each in [0, size) (the size is
/// checked where it is known). One rule for sets given at init and added later.
pub(crate) fn process_set_ranks(ranks: &[i32], size: Option<i32>) -> Result<Vec<i32>> {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let in_range = |r: &i32| *r >= 0 && size.is_none_or(|n| *r < n);
    if sorted.is_empty() || sorted.len() != ranks.len() || !sorted.iter().all(in_range) {
        let bound = size.map_or("size".to_string(), |n| n.to_string());
        return Err(Error::InvalidArgument(format!(
            "process set ranks {ranks:?} must be distinct ranks in [0, {bound})"
        )));
    }
    Ok(sorted)
}

/// Starts the runtime (MPI, communicators, background thread). A second call while running is
/// a no-op, as in Horovod.
pub fn init(opts: InitOptions) -> Result<()> {
    if on_background_thread() {
        return Err(Error::InvalidArgument(
            "init cannot be called from a ferrovod callback".into(),
        ));
    }
    // A runtime whose loop ended (another rank shut down) is joined before starting anew;
    // never while holding the global lock, which its callbacks may need.
    let old = {
        let mut global = lock_global();
        match global.as_ref() {
            Some(rt) if !rt.loop_ended.load(Ordering::SeqCst) => return Ok(()),
            _ => global.take(),
        }
    };
    if let Some(old) = old {
        old.join_thread();
    }
    // checked before anything collective starts (the size is not known yet), so that a
    // caller can correct it and retry
    for ranks in &opts.process_sets {
        process_set_ranks(ranks, None)?;
    }
    let mut global = lock_global();
    if global.is_some() {
        return Ok(()); // another thread initialised meanwhile
    }
    crate::config::init_logging();
    let config = opts.config.clone().unwrap_or_else(Config::from_env);
    let (tx, rx) = unbounded();
    let rt = Arc::new(Runtime {
        config: config.clone(),
        topology: OnceLock::new(),
        handles: &handle::HANDLES,
        inbox: Mutex::new(Some(tx)),
        sets: RwLock::new(BTreeMap::new()),
        connected: RwLock::new(BTreeMap::new()),
        in_flight: Mutex::new(in_flight::InFlight::default()),
        gpu_moved: Arc::default(),
        loop_ended: AtomicBool::new(false),
        shutdown_reason: Mutex::new(None),
        gpu_failure: Mutex::new(None),
        gpu_failed: AtomicBool::new(false),
        gpu_abort: Arc::new(AtomicBool::new(false)),
        thread: Mutex::new(None),
        metrics: metrics::Metrics::default(),
        gpu_device: OnceLock::new(),
        allreduce_policy: OnceLock::new(),
        job_multistep: OnceLock::new(),
        p2p_max_tag: OnceLock::new(),
        stall: OnceLock::new(),
        nccl_streams: OnceLock::new(),
        steps: Default::default(),
    });
    let (ready_tx, ready_rx) = crossbeam::channel::bounded(1);
    let rt2 = rt.clone();
    let thread = std::thread::Builder::new()
        .name("ferrovod-background".into())
        .spawn(move || background::run(rt2, opts, rx, ready_tx))
        .map_err(|e| Error::Internal(format!("cannot start background thread: {e}")))?;
    match ready_rx.recv() {
        Ok(Ok(())) => {
            *rt.thread.lock().expect("thread slot") = Some(thread);
            *global = Some(rt);
            Ok(())
        }
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(Error::Internal(
                "background thread exited during initialization".into(),
            ))
        }
    }
}

/// Stops the runtime on this rank and, through the next negotiation, on every rank; pending
/// operations fail with the shut-down error. Idempotent.
pub fn shutdown() {
    if on_background_thread() {
        // called from a callback: ask for the shutdown; the thread cannot join itself
        if let Some(rt) = lock_global().as_ref() {
            let _ = rt.send(Command::Shutdown);
        }
        return;
    }
    let rt = lock_global().take();
    if let Some(rt) = rt {
        let _ = rt.send(Command::Shutdown);
        rt.join_thread();
    }
}

impl Runtime {
    /// The algorithm the global set's allreduce of `bytes` uses: flat where there is no
    /// choice (one node, uneven nodes, `FERROVOD_ALGORITHM=flat`), else as asked for or as the
    /// cost model measured at init says. Identical on every rank.
    pub fn allreduce_algorithm(&self, bytes: usize) -> crate::collective::cost::Algorithm {
        (self.allreduce_policy.get()).map_or(crate::collective::cost::Algorithm::Flat, |p| {
            p.choose(bytes)
        })
    }

    /// The stall settings every rank uses: rank 0's, once init agreed them.
    pub(crate) fn stall(&self) -> crate::config::StallPolicy {
        (self.stall.get().copied())
            .unwrap_or_else(|| crate::config::StallPolicy::from_config(&self.config))
    }

    /// The largest tag a send or receive may carry (MPI guarantees 32767 as the tag bound).
    pub fn p2p_max_tag(&self) -> i32 {
        self.p2p_max_tag.get().copied().unwrap_or(16383)
    }

    pub fn topology(&self) -> &Topology {
        self.topology
            .get()
            .expect("topology is set before init returns")
    }

    fn join_thread(&self) {
        let t = self.thread.lock().expect("thread slot").take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }

    /// Whether the background loop has stopped (locally or because another rank shut down).
    pub fn is_shut_down(&self) -> bool {
        self.loop_ended.load(Ordering::SeqCst)
    }

    fn shut_down_error(&self) -> Error {
        match self.shutdown_reason.lock().expect("reason").clone() {
            Some(r) => Error::ShutDown(r),
            None => Error::shut_down(),
        }
    }

    /// Hands `cmd` to the background thread; after shutdown it comes back.
    fn send(&self, cmd: Command) -> std::result::Result<(), Command> {
        let inbox = self.inbox.lock().expect("inbox");
        match inbox.as_ref() {
            Some(tx) => tx.send(cmd).map_err(|e| e.into_inner()),
            None => Err(cmd),
        }
    }

    pub fn process_set_ranks(&self, id: i32) -> Option<Vec<i32>> {
        self.sets.read().expect("sets").get(&id).cloned()
    }

    pub fn process_set_ids(&self) -> Vec<i32> {
        self.sets.read().expect("sets").keys().copied().collect()
    }

    /// This rank's position in set `id`, or -1 if it is not a member.
    pub fn process_set_rank(&self, id: i32) -> Result<i32> {
        let ranks = self.process_set_ranks(id).ok_or_else(unknown_set)?;
        let me = self.topology().rank;
        Ok(ranks.iter().position(|r| *r == me).map_or(-1, |p| p as i32))
    }

    /// Whether a GPU tensor submitted at new addresses is not launched yet (read by the
    /// background thread after taking submissions in, before it votes).
    pub(crate) fn gpu_moved(&self) -> bool {
        self.gpu_moved.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    /// This process's GPU for work it has no tensor of its own in (a joined rank): the one its
    /// operations used, else local rank modulo the GPUs present (the usual one-GPU-per-rank
    /// placement), which then becomes the process's GPU.
    pub(crate) fn process_gpu(&self) -> Result<Arc<crate::transport::cuda::Gpu>> {
        let ordinal = match self.gpu_device.get() {
            Some(d) => *d,
            None => {
                let count = crate::transport::cuda::device_count()?.max(1) as i32;
                *self
                    .gpu_device
                    .get_or_init(|| self.topology().local_rank % count)
            }
        };
        open_gpu(ordinal)
    }

    /// The GPU of a device operation (opened on first use; without CUDA, the documented
    /// error) and the event its inputs are ready at. One GPU per process, as NCCL needs.
    fn open_device(
        &self,
        what: &str,
        spec: &OpSpec,
    ) -> Result<(Arc<crate::transport::cuda::Gpu>, Option<entry::ReadyEvent>)> {
        let other_gpu = |first: i32| {
            Error::InvalidArgument(format!(
                "{what}: GPU device {} requested, but this process already uses GPU {first}; ferrovod drives one GPU per process",
                spec.device
            ))
        };
        // checked before opening, so a wrong ordinal never initialises another GPU
        if let Some(first) = self.gpu_device.get()
            && *first != spec.device
        {
            return Err(other_gpu(*first));
        }
        let gpu = open_gpu(spec.device)?;
        let first = *self.gpu_device.get_or_init(|| spec.device);
        if first != spec.device {
            return Err(other_gpu(first));
        }
        let later = matches!(
            spec.kind,
            OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
        );
        if later && spec.allocator.is_none() {
            return Err(Error::InvalidArgument(format!(
                "{what}: GPU outputs are allocated by the caller; pass an output allocator"
            )));
        }
        let ready = if let Some(ev) = spec.ready_event {
            Some(entry::ReadyEvent::Foreign(ev))
        } else if let Some(stream) = spec.ready_stream {
            Some(entry::ReadyEvent::Owned(Arc::new(gpu.mark_stream(stream)?)))
        } else {
            None
        };
        Ok((gpu, ready))
    }

    /// Records the first GPU failure after agreement (see `take_gpu_failure`).
    pub(crate) fn report_gpu_failure(&self, reason: &str) {
        self.gpu_failure
            .lock()
            .expect("gpu failure")
            .get_or_insert_with(|| reason.to_string());
        self.gpu_failed.store(true, Ordering::SeqCst);
        self.gpu_abort.store(true, Ordering::SeqCst);
    }

    /// Every rank learnt through the vote that a GPU batch failed after agreement.
    pub(crate) fn abort_gpu_work(&self) {
        self.gpu_abort.store(true, Ordering::SeqCst);
    }

    /// Whether GPU work is to be aborted rather than waited for (see `abort_gpu_work`).
    pub(crate) fn gpu_aborting(&self) -> bool {
        self.gpu_abort.load(Ordering::SeqCst)
    }

    /// The flag behind `gpu_aborting`, for lanes dropped on other threads.
    pub(crate) fn gpu_abort_flag(&self) -> Arc<AtomicBool> {
        self.gpu_abort.clone()
    }

    /// The GPU failure reported since the last call, if any (cheap when there is none).
    pub(crate) fn take_gpu_failure(&self) -> Option<String> {
        if !self.gpu_failed.swap(false, Ordering::SeqCst) {
            return None;
        }
        self.gpu_failure.lock().expect("gpu failure").take()
    }
}
