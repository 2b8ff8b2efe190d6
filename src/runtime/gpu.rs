//! GPU batches in the runtime: NCCL streams (each an NCCL communicator with its CUDA stream and fusion buffer) per process
//! set and channel, opened when the set's first GPU batch runs — every rank runs the same
//! batches in the same order, so the collective NCCL set-up happens at the same point on all —
//! and what a launched batch recorded for the finisher (`runtime::finisher`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::collective::device::{self, DeviceIo, Lane};
use crate::collective::execute::{self, DeviceHow, DeviceRoute};
use crate::collective::plan::{self, Connections};
use crate::collective::replay::{LaunchGraphs, ReplayKey};
use crate::collective::{self, ActivitySink, kernels};
use crate::compress::{Codec, Codecs, DeviceFeedback};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::Response;
use crate::runtime::Runtime;
use crate::runtime::entry::{ReadyEvent, TensorEntry};
use crate::transport::Transport;
use crate::transport::cuda::{DeviceMem, Event, Gpu, PinnedMem, Stream};
use crate::transport::memory::DeviceRange;
use crate::transport::mpi::MpiComm;
use crate::transport::nccl::{self, NcclComm};

/// One executor's NCCL connections on its GPU, published with what its plans read: a caller
/// may leave a stream's wait for a batch not launched yet to the device only where the batch
/// makes no connection (`Runtime::settled`), as making one may wait for the whole device, the
/// waiting stream with it. Owned by the executor and its set's entry in the runtime (dropped
/// with the set).
pub(crate) struct Connected {
    settings: plan::Settings,
    levels: Option<plan::Levels>,
    codecs: Codecs,
    /// Bits 0 to 2: flat, local, peers; from bit 8, the GPU's ordinal + 1 (0: none yet).
    made: AtomicU64,
}

impl Connected {
    pub fn new(settings: plan::Settings, levels: Option<plan::Levels>, codecs: Codecs) -> Self {
        Connected {
            settings,
            levels,
            codecs,
            made: AtomicU64::new(0),
        }
    }

    fn mark(&self, ordinal: i32, c: Connections) {
        let bits = u64::from(c.flat) | u64::from(c.local) << 1 | u64::from(c.peers) << 2;
        self.made
            .fetch_or(((ordinal as u64 + 1) << 8) | bits, Ordering::Release);
    }

    /// Whether a batch holding `head` finds every connection it may need made on its GPU.
    pub fn covers(&self, head: &Response) -> bool {
        let made = self.made.load(Ordering::Acquire);
        if head.device < 0 || made >> 8 != head.device as u64 + 1 {
            return false;
        }
        let have = Connections {
            flat: made & 1 != 0,
            local: made & 2 != 0,
            peers: made & 4 != 0,
        };
        let codec = self.codecs.of(head);
        have.covers(plan::may_need(
            head,
            codec,
            &self.settings,
            self.levels.as_ref(),
        ))
    }
}

/// Where one set's (or one channel's) GPU batches run: `HOROVOD_NUM_NCCL_STREAMS` NCCL streams, each
/// an NCCL communicator with its own stream and fusion buffer; consecutive batches take turns,
/// so a batch's copies and reduction overlap the previous batch's.
pub(crate) struct NcclStreams {
    gpu: Arc<Gpu>,
    streams: Vec<NcclStream>,
    /// Batches run on these streams so far (the same count on every rank).
    batches: usize,
    /// Set when the communicators were aborted; batches whose completion is seen after it
    /// fail (their NCCL kernels may have been stopped).
    aborted: Arc<AtomicBool>,
    /// How long dropping the streams waits for work still running before aborting them.
    grace: Duration,
    /// The runtime's "some rank's GPU work failed" flag: no grace then.
    abort_all: Arc<AtomicBool>,
    /// The u8 codec's residuals (after the streams: freed once their work is done or aborted).
    feedback: DeviceFeedback,
    /// Page-locked memory for the 16-bit codecs' overflow counters (`Overflows`).
    pinned: Arc<Mutex<Vec<PinnedMem>>>,
}

struct NcclStream {
    /// Declared first: NCCL waits, when a communicator goes, for the graphs that use it.
    graphs: LaunchGraphs,
    /// Over every rank of the set; opened by the first batch that uses it.
    comm: Option<NcclComm>,
    /// Over this node's ranks, for hierarchical allreduces; opened likewise.
    local: Option<NcclComm>,
    fusion: Option<DeviceMem>,
    /// The event after the stream's latest batch (its batches finish in order).
    last: Option<Arc<Event>>,
    // declared last: dropped after the communicator and buffer that use it
    stream: Stream,
}

/// Which of a stream's communicators.
#[derive(Clone, Copy)]
enum Level {
    /// Every rank of the set.
    Flat,
    /// This node's ranks.
    Local,
}

impl NcclStream {
    fn comm(&self, level: Level) -> Option<&NcclComm> {
        match level {
            Level::Flat => self.comm.as_ref(),
            Level::Local => self.local.as_ref(),
        }
    }

    fn comm_mut(&mut self, level: Level) -> &mut Option<NcclComm> {
        match level {
            Level::Flat => &mut self.comm,
            Level::Local => &mut self.local,
        }
    }
}

impl NcclStreams {
    /// Collective over `data`, and agreed: every rank votes on its own readiness (a GPU and
    /// its streams), so a rank that cannot open the streams fails the batch everywhere.
    fn open(
        gpu: Result<Arc<Gpu>>,
        data: &MpiComm,
        count: usize,
        grace: Duration,
        abort_all: Arc<AtomicBool>,
    ) -> Result<NcclStreams> {
        let local = gpu.and_then(|g| {
            let cuda_streams = (0..count.max(1))
                .map(|_| g.new_stream())
                .collect::<Result<Vec<_>>>()?;
            Ok((g, cuda_streams))
        });
        let mut ready = [u64::from(local.is_ok())];
        data.and_words(&mut ready)?;
        let (gpu, cuda_streams) = local?;
        if ready[0] == 0 {
            return Err(Error::Aborted(
                "GPU collectives could not start on every rank of the process set (the failing rank logs why)".into(),
            ));
        }
        let streams = cuda_streams
            .into_iter()
            .map(|stream| NcclStream {
                graphs: LaunchGraphs::default(),
                comm: None,
                local: None,
                fusion: None,
                last: None,
                stream,
            })
            .collect();
        Ok(NcclStreams {
            gpu,
            streams,
            batches: 0,
            aborted: Arc::new(AtomicBool::new(false)),
            grace,
            abort_all,
            feedback: DeviceFeedback::default(),
            pinned: Arc::default(),
        })
    }

    /// Opens each stream's communicator of `level` over `over`'s ranks unless open. Collective
    /// over `over`, and agreed: rank 0 always broadcasts the NCCL ids, one per stream (none when
    /// it failed), and every rank votes before joining, so that a rank that cannot join fails
    /// the batch everywhere instead of leaving the others waiting in NCCL's set-up.
    fn connect(&mut self, level: Level, over: &MpiComm) -> Result<()> {
        if self.streams.iter().all(|w| w.comm(level).is_some()) {
            return Ok(());
        }
        let count = self.streams.len();
        let ids = match over.rank() {
            0 => (0..count)
                .map(|_| nccl::unique_id())
                .collect::<Result<Vec<_>>>()
                .map(|ids| ids.concat())
                .unwrap_or_else(|e| {
                    tracing::error!("cannot create an NCCL unique id: {e}");
                    Vec::new()
                }),
            _ => Vec::new(),
        };
        let ids = over.broadcast_bytes(ids, 0)?;
        let bound = self.gpu.bind();
        let mut ready = [u64::from(
            bound.is_ok() && ids.len() == count * nccl::UNIQUE_ID_BYTES,
        )];
        over.and_words(&mut ready)?;
        bound?;
        if ready[0] == 0 {
            return Err(Error::Aborted(
                "NCCL communicators could not start on every rank of the process set (the failing rank logs why)".into(),
            ));
        }
        for (w, id) in self
            .streams
            .iter_mut()
            .zip(ids.chunks_exact(nccl::UNIQUE_ID_BYTES))
        {
            if crate::config::test_fault("nccl_init", over.rank() as i32) {
                return Err(Error::Internal("test fault: nccl_init".into()));
            }
            let comm = NcclComm::new(&self.gpu, id, over.rank(), over.size())?;
            *w.comm_mut(level) = Some(comm);
        }
        Ok(())
    }

    /// Sets up send/recv between every pair of ranks on each stream's flat communicator
    /// (`NcclComm::connect_peers`) before the first batch that uses it, so that no rank's
    /// enqueue can wait there for a peer that failed after agreement. Agreed like `connect`:
    /// every rank votes once its buffers are allocated, so none enters NCCL's set-up while
    /// another cannot.
    fn connect_peers(&mut self, over: &MpiComm) -> Result<()> {
        let connected = |w: &NcclStream| w.comm.as_ref().is_some_and(NcclComm::peers_connected);
        if self.streams.iter().all(connected) {
            return Ok(());
        }
        let bytes = 2 * over.size();
        let local = self.gpu.bind().and_then(|_| {
            if crate::config::test_fault("nccl_peers", over.rank() as i32) {
                return Err(Error::Internal("test fault: nccl_peers".into()));
            }
            (self.streams.iter())
                .map(|w| self.gpu.alloc_on(&w.stream, bytes))
                .collect::<Result<Vec<_>>>()
        });
        let mut ready = [u64::from(local.is_ok())];
        over.and_words(&mut ready)?;
        let bufs = local?;
        if ready[0] == 0 {
            return Err(Error::Aborted(
                "NCCL send/recv connections could not be set up on every rank of the process set (the failing rank logs why)".into(),
            ));
        }
        for (w, buf) in self.streams.iter_mut().zip(bufs) {
            let comm = (w.comm.as_mut()).ok_or_else(|| {
                Error::Internal("send/recv connections before the communicator".into())
            })?;
            comm.connect_peers(buf.range(), &w.stream)?;
            buf.free_on(&w.stream)?;
        }
        Ok(())
    }

    /// Stops every communicator of the streams and the work pending on them: after a local
    /// failure between agreement and the NCCL calls (the other ranks' calls wait for this
    /// rank's forever), or at shutdown when work still runs after the grace time.
    fn abort(&mut self) {
        self.aborted.store(true, Ordering::SeqCst);
        // One thread per communicator: NCCL's clean-up after an abort may wait for the whole
        // device, which the other streams' stuck kernels keep busy until their own abort.
        let gpu = &self.gpu;
        std::thread::scope(|s| {
            for w in &mut self.streams {
                s.spawn(move || {
                    // binding failed means a broken context; abort anyway
                    let _ = gpu.bind();
                    w.graphs.clear();
                    for c in [&mut w.comm, &mut w.local].into_iter().flatten() {
                        c.abort();
                    }
                });
            }
        });
    }
}

impl Drop for NcclStreams {
    /// Destroying a communicator waits for its pending operations, which never end if another
    /// rank failed or left before its part: wait for the last batches up to the grace time,
    /// then abort instead. After a GPU failure on any rank nothing still running can finish:
    /// abort at once.
    fn drop(&mut self) {
        // the NCCL streams' CUDA streams and buffers are freed after this, on this thread, which may be new
        let _ = self.gpu.bind();
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + self.grace;
        let finished = self.streams.iter().all(|w| match &w.last {
            None => true,
            Some(ev) => loop {
                match ev.query() {
                    Ok(true) => break true,
                    Ok(false)
                        if Instant::now() < deadline && !self.abort_all.load(Ordering::SeqCst) =>
                    {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    _ => break false,
                }
            },
        });
        let abort_all = self.abort_all.load(Ordering::SeqCst);
        if finished && !abort_all {
            return;
        }
        match abort_all {
            // destroying a communicator may wait for its peers (NCCL's own clean-up), which
            // a stopped or failed rank never answers: abort even when no work is left
            true if finished => tracing::debug!(
                "aborting the NCCL communicators: a rank failed or stopped responding"
            ),
            true => tracing::error!(
                "GPU collectives still running at shutdown after a GPU failure: aborting the NCCL communicators"
            ),
            false => tracing::error!(
                "GPU collectives still running after {} s at shutdown (another rank failed or left): aborting the NCCL communicators",
                self.grace.as_secs_f64()
            ),
        }
        self.abort();
        tracing::debug!("NCCL communicators aborted");
    }
}

/// What a device batch left behind: the event to wait for before its tensors are done.
pub(crate) struct Recorded {
    pub gpu: Arc<Gpu>,
    pub event: Arc<Event>,
    /// The streams' abort flag: a batch whose event is seen after an abort failed.
    pub aborted: Arc<AtomicBool>,
    /// `PERSEUS_ALLREDUCE_NANCHECK`: the batch's counts of non-finite results.
    pub nan: Option<Counts>,
    /// A 16-bit codec's counts of values that left its range (`wire`) while packed.
    pub overflow: Option<Overflows>,
}

impl Recorded {
    /// The batch's outcome once its event has fired.
    pub(crate) fn outcome(&mut self) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Error::Aborted(
                "the GPU collective was aborted: another rank failed or left before its part, or this rank's NCCL communicators were aborted after a failure".into(),
            ));
        }
        if let Some(overflows) = self.overflow.take() {
            overflows.report(&self.event)?;
        }
        match self.nan.take() {
            Some(nan) => {
                let counts = nan.read(&self.gpu)?;
                crate::compress::non_finite_error(counts.iter().map(|(n, c)| (n.as_str(), *c)))
            }
            None => Ok(()),
        }
    }
}

/// One u32 counter per tensor of a GPU batch, filled by kernels in stream order and read once
/// the batch is done: the NaN check's non-finite results (the same on every rank, so every
/// rank fails the same tensors).
pub(crate) struct Counts {
    counts: DeviceMem,
    names: Vec<String>,
}

impl Counts {
    /// Zeroed counters for `resps`, on `stream`; `count` fills them from `(values, counter,
    /// elements)` of each tensor's `values(io)`.
    fn launch(
        gpu: &Gpu,
        stream: &Stream,
        resps: &[&Response],
        ios: &[&mut dyn DeviceIo],
        values: impl Fn(&dyn DeviceIo) -> DeviceRange,
        count: impl FnOnce(&[(DeviceRange, DeviceRange, usize)]) -> Result<()>,
    ) -> Result<Counts> {
        let size = resps[0].dtype.size();
        let counts = gpu.alloc_on(stream, 4 * ios.len())?;
        gpu.memset_zero(stream, counts.range())?;
        let items = (ios.iter().enumerate())
            .map(|(k, io)| {
                let counter = counts.range().sub(4 * k, 4)?;
                Ok((values(&**io), counter, io.input().len() / size))
            })
            .collect::<Result<Vec<_>>>()?;
        count(&items)?;
        Ok(Counts {
            counts,
            names: resps.iter().map(|r| r.name.clone()).collect(),
        })
    }

    /// Each tensor's name and count; the batch's work must be done.
    fn read(self, gpu: &Gpu) -> Result<Vec<(String, usize)>> {
        let stream = gpu.new_stream()?;
        let mut host = vec![0u8; self.counts.len()];
        gpu.download(&stream, self.counts.range(), &mut host)?;
        // in stream order: no wait for the whole device, as dropping it would
        self.counts.free_on(&stream)?;
        let counts = host
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize);
        Ok(self.names.into_iter().zip(counts).collect())
    }
}

/// A 16-bit batch's overflow counters (one u32 per tensor, `Lane::overflows`), copied in stream
/// order into page-locked host memory that is read once the batch's event has fired: no CUDA
/// call and no wait per batch on the finisher's side (a synchronous read there cost more than
/// the codec saved: BENCHMARKS.md). The memory comes from and returns to the streams' pool.
pub(crate) struct Overflows {
    mem: Option<PinnedMem>,
    pool: Arc<Mutex<Vec<PinnedMem>>>,
    names: Vec<String>,
    wire: DataType,
}

impl Overflows {
    fn copy(
        gpu: &Gpu,
        stream: &Stream,
        area: DeviceRange,
        resps: &[&Response],
        wire: DataType,
        pool: &Arc<Mutex<Vec<PinnedMem>>>,
    ) -> Result<Overflows> {
        area.holds(4 * resps.len(), "overflow counters")?;
        let free = {
            let mut p = pool.lock().expect("pinned pool");
            let fit = p.iter().position(|m| m.len() >= area.len());
            fit.map(|i| p.swap_remove(i))
        };
        let mut mem = match free {
            Some(m) => m,
            None => gpu.alloc_pinned(area.len().next_power_of_two().max(4096))?,
        };
        gpu.copy_to_pinned(stream, area, &mut mem)?;
        Ok(Overflows {
            mem: Some(mem),
            pool: pool.clone(),
            names: resps.iter().map(|r| r.name.clone()).collect(),
            wire,
        })
    }

    /// Names each tensor that had values out of the wire type's range; `done` has fired.
    fn report(mut self, done: &Event) -> Result<()> {
        let Some(mem) = self.mem.take() else {
            return Ok(());
        };
        let bytes = mem.read(done)?;
        for (name, c) in self.names.iter().zip(bytes.chunks_exact(4)) {
            let lost = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
            collective::warn_out_of_range(name, lost, self.wire);
        }
        self.pool.lock().expect("pinned pool").push(mem);
        Ok(())
    }
}

/// A hierarchical batch's two levels: this node's ranks, and this node rank on every node.
#[derive(Clone, Copy)]
pub(crate) struct NodeLevels<'a> {
    pub local: &'a MpiComm,
    pub cross: &'a MpiComm,
}

/// Enqueues one GPU batch on the NCCL streams (opening them first if needed) over the set's
/// communicator `data`, or hierarchically over `levels`: waits on the inputs' ready events on
/// the device, runs the collective, records the completion event.
#[allow(clippy::too_many_arguments)] // the batch, where it runs, and how (codec, gossip, replay)
pub(crate) fn run_device_batch(
    rt: &Runtime,
    streams: &mut Option<NcclStreams>,
    connected: &Connected,
    data: &MpiComm,
    levels: Option<NodeLevels>,
    how: &DeviceHow,
    resps: &[&Response],
    entries: &mut [TensorEntry],
    replay: Option<ReplayKey>,
    sink: ActivitySink,
) -> Result<Recorded> {
    if streams.is_none() {
        sink(Some("NCCL_INIT"));
        // a joined rank has no tensor of its own: it uses the process's GPU
        let gpu = match entries.iter().find_map(|e| e.device.as_ref()) {
            Some(d) => Ok(d.gpu.clone()),
            None => rt.process_gpu(),
        };
        let cfg = &rt.config;
        let grace = match rt.stall().shutdown_after.is_zero() {
            true => SHUTDOWN_GRACE,
            false => rt.stall().shutdown_after.min(SHUTDOWN_GRACE),
        };
        *streams = Some(NcclStreams::open(
            gpu,
            data,
            rt.nccl_streams.get().copied().unwrap_or(cfg.nccl_streams),
            grace,
            rt.gpu_abort_flag(),
        )?);
    }
    let l = streams.as_mut().expect("opened above");
    if l.aborted.load(Ordering::SeqCst) {
        return Err(Error::Aborted(
            "this process set's NCCL communicators were aborted after an earlier GPU failure"
                .into(),
        ));
    }
    match &levels {
        Some(h) => l.connect(Level::Local, h.local)?,
        None => {
            l.connect(Level::Flat, data)?;
            if how.plan.peers {
                l.connect_peers(data)?;
            }
        }
    }
    connected.mark(l.gpu.ordinal, how.plan.connections());
    let (recorded, replayed) =
        enqueue_on_streams(l, data, levels, how, resps, entries, replay, sink)
        .map_err(|e| {
        // the other ranks' NCCL calls for this batch wait for this rank's forever: stop this
        // rank's communicators and have the job shut down (the vote tells every rank)
        tracing::debug!("GPU batch failed after agreement ({e}): aborting the NCCL communicators");
        l.abort();
        tracing::debug!("NCCL communicators aborted after the failed batch");
        let msg = format!(
            "a GPU collective failed on this rank after every rank agreed to run it ({e}); its NCCL communicators were aborted and ferrovod shuts down, as the other ranks cannot complete it"
        );
        rt.report_gpu_failure(&msg);
        Error::Aborted(msg)
    })?;
    if replayed {
        rt.metrics.add_graph_launch();
    }
    Ok(recorded)
}

/// How long shutdown waits for GPU work still running before it aborts the communicators
/// (capped further by `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The batch's part after the streams are open: every failure here leaves the ranks' NCCL calls
/// out of step. Also says whether the batch was replayed from a graph.
#[allow(clippy::too_many_arguments)]
fn enqueue_on_streams(
    l: &mut NcclStreams,
    data: &MpiComm,
    levels: Option<NodeLevels>,
    how: &DeviceHow,
    resps: &[&Response],
    entries: &mut [TensorEntry],
    replay: Option<ReplayKey>,
    sink: ActivitySink,
) -> Result<(Recorded, bool)> {
    let gpu = l.gpu.clone();
    gpu.bind()?;
    let k = l.batches % l.streams.len();
    l.batches += 1;
    if matches!(
        how.plan.codec,
        Codec::U8 | Codec::PowerSgd(_) | Codec::TopK(_)
    ) {
        // a tensor's residual was last used by a batch on any stream
        let others: Vec<Arc<Event>> = (l.streams.iter().enumerate())
            .filter(|(i, _)| *i != k)
            .filter_map(|(_, s)| s.last.clone())
            .collect();
        for e in &others {
            l.streams[k].stream.wait(e)?;
        }
    }
    let w = &mut l.streams[k];
    // codecs' state dropped since (an evicted name, a tensor of a new shape), freed after the
    // batches that used it
    gpu.free_retired(&w.stream)?;
    sink(Some("WAIT_FOR_DATA"));
    for e in entries.iter_mut() {
        if e.device.is_none() {
            // a joined rank's stand-in: zeros on this GPU
            e.device = Some(crate::runtime::entry::OnDevice {
                gpu: gpu.clone(),
                ready: None,
                scratch: None,
            });
        }
        e.move_input_to_device(&w.stream)?;
        // launched: its addresses no longer keep votes from agreeing on replays
        e.moved = None;
        // one wait per tensor: a caller's stream handle may be reused by a new stream after
        // the enqueue returned, so marks on "the same" handle need not be ordered
        match e.device.as_ref().and_then(|d| d.ready.as_ref()) {
            Some(ReadyEvent::Owned(m)) => w.stream.wait(m.event())?,
            Some(ReadyEvent::Foreign(ev)) => w.stream.wait_foreign(*ev)?,
            None => {}
        }
    }
    let n = entries.len();
    crate::probe::mark("waits enqueued", n);
    // each stage of the collective's launch (packing, NCCL, unpacking) marked as it starts
    let sink = &mut |a: Option<&'static str>| {
        if let Some(stage) = a {
            crate::probe::mark(stage, n);
        }
        sink(a)
    };
    let mut ios: Vec<&mut dyn DeviceIo> =
        entries.iter_mut().map(|e| e as &mut dyn DeviceIo).collect();
    let head = resps[0];
    let mut lane_ref = Lane {
        gpu: &gpu,
        stream: &w.stream,
        fusion: &mut w.fusion,
        graphs: &mut w.graphs,
        replay: replay.filter(|_| how.plan.replayable),
        replayed: false,
        feedback: &mut l.feedback,
        overflows: None,
    };
    let route = match (levels, &w.local, &w.comm) {
        (Some(h), Some(local), _) => DeviceRoute::Hierarchical(device::Levels {
            local,
            cross: h.cross,
        }),
        (None, _, Some(flat)) => DeviceRoute::Flat(flat),
        _ => {
            return Err(Error::Internal(
                "the batch's NCCL communicators are not open".into(),
            ));
        }
    };
    execute::device(route, data, &mut lane_ref, how, resps, &mut ios, sink)?;
    let replayed = lane_ref.replayed;
    // the packing's overflow counters, kept apart from the stream's next batch
    let overflow = match (how.plan.codec, lane_ref.overflows) {
        (Codec::Half(wire), Some(area)) => Some(Overflows::copy(
            &gpu, &w.stream, area, resps, wire, &l.pinned,
        )?),
        _ => None,
    };
    let nan = match how.plan.nan_check && head.dtype.is_float() {
        true => Some(Counts::launch(
            &gpu,
            &w.stream,
            resps,
            &ios,
            |io| io.output(),
            |items| kernels::count_non_finite_batch(&gpu, &w.stream, items, head.dtype),
        )?),
        false => None,
    };
    if how.plan.codec == Codec::U8 {
        // every earlier use of a residual is ordered before this stream's work (the waits
        // above), so the residuals this batch leaves unused for good are freed on it
        let names: Vec<&str> = resps.iter().map(|r| r.name.as_str()).collect();
        l.feedback.sweep(&w.stream, &names)?;
    }
    crate::probe::mark("collective enqueued", n);
    let event = Arc::new(gpu.new_event()?);
    event.record(&w.stream)?;
    w.last = Some(event.clone());
    crate::probe::mark("launched", entries.len());
    let recorded = Recorded {
        gpu,
        event,
        aborted: l.aborted.clone(),
        nan,
        overflow,
    };
    Ok((recorded, replayed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;
    use crate::message::{OpKind, ReduceOp};

    #[test]
    fn connected_covers_a_batch_once_its_gpus_connections_are_all_made() {
        let settings = plan::Settings {
            ring_min_bytes: 0,
            nan_check: false,
            graphs: true,
            gossip_pairs: true,
        };
        let c = Connected::new(settings, None, Codecs::default());
        let on = |device| Response::allreduce("g", DataType::F32, &[4], ReduceOp::Sum, device);
        let to_all = Response {
            kind: OpKind::Alltoall,
            ..on(1)
        };
        assert!(!c.covers(&on(1)), "nothing made yet");
        c.mark(
            1,
            Connections {
                flat: true,
                ..Connections::default()
            },
        );
        assert!(c.covers(&on(1)));
        assert!(!c.covers(&on(0)), "made on another GPU");
        assert!(!c.covers(&on(-1)), "host memory");
        assert!(!c.covers(&to_all), "an all-to-all sends to single peers");
        c.mark(
            1,
            Connections {
                peers: true,
                ..Connections::default()
            },
        );
        assert!(c.covers(&to_all));
    }
}
