//! The background thread: MPI setup, then one cycle after another — take new submissions,
//! negotiate per process set, fuse, execute, complete — until every rank agrees to stop.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use crate::collective::replay::{ReplayKey, batch_fingerprint};
use crate::collective::{self, TensorIo};
use crate::config::NegotiationMode;
use crate::error::{Error, Result, SHUT_DOWN_MESSAGE};
use crate::fusion::autotune::{Autotuner, Params};
use crate::fusion::planner::plan_segments;
use crate::hashing::HashMap;
use crate::message::{OpKind, Response};
use crate::negotiate::learn::{GroupLearner, LearnContext, PlanLearner};
use crate::negotiate::offline::{EscapePolicy, Next, OfflineQueue};
use crate::negotiate::online::{Negotiator, StallPolicy};
use crate::negotiate::plan::{agree_on_plan, agreed_plan_file};
use crate::runtime::channel::{self, Channel, Job};
use crate::runtime::entry::{InputMem, OutputMem, PendingEntries, TensorEntry};
use crate::runtime::gpu;
use crate::runtime::timeline::Timeline;
use crate::runtime::{Command, Communicator, InitOptions, Runtime, Topology};
use crate::transport::Transport;
use crate::transport::mpi::{MpiComm, Watchdog, finalize_mpi, init_mpi, rank_list};

/// One process set this rank belongs to.
struct SetState {
    id: i32,
    ctrl: MpiComm,
    data: MpiComm,
    negotiator: Negotiator,
    entries: PendingEntries,
    fusion: Vec<u8>,
    /// With more than one channel: the workers batches are handed to, and the next batch's
    /// number (identical on every rank).
    channels: Vec<Channel>,
    batch_seq: u64,
    /// GPU batches run here (opened by the set's first one).
    gpu: Option<gpu::NcclStreams>,
    /// Advanced by every vote in which some rank's GPU tensors moved (`collective::replay`).
    graph_epoch: u64,
}

/// Settings that change which collectives run, taken from rank 0 so that a rank launched with a
/// different environment cannot make the ranks disagree.
#[derive(Clone, Copy, Debug, PartialEq)]
struct JobSettings {
    fusion_threshold: usize,
    fusion_direct_bytes: usize,
    cache_capacity: usize,
    mpi_max_count: usize,
    /// 0: nodes from MPI_COMM_TYPE_SHARED.
    local_size_override: usize,
    negotiation: NegotiationMode,
    /// Offline mode: agreeing steps before a plan freezes (decides when a collective runs).
    plan_warmup_steps: usize,
    /// Channels per set (1 unless every rank has MPI_THREAD_MULTIPLE).
    channels: usize,
    /// Autotune's sampling window in cycles; 0: autotune off (every rank broadcasts rank 0's
    /// choice at the same cycles, so this must be agreed).
    autotune_window: usize,
    /// Fused GPU allreduces may be replayed from CUDA graphs.
    gpu_graphs: bool,
}

impl JobSettings {
    /// Rank 0's values everywhere. Call on a communicator still at the default MPI count limit,
    /// so that this broadcast itself is split identically on every rank.
    fn from_rank0(world: &MpiComm, cfg: &crate::config::Config) -> Result<JobSettings> {
        let mine = [
            cfg.fusion_threshold,
            cfg.fusion_direct_bytes,
            cfg.cache_capacity,
            cfg.mpi_max_count,
            cfg.local_size_override.unwrap_or(0),
            cfg.negotiation.code(),
            cfg.plan_warmup_steps,
            cfg.channels,
            if cfg.autotune { cfg.autotune_window } else { 0 },
            usize::from(cfg.gpu_graphs),
        ];
        let bytes: Vec<u8> = mine
            .iter()
            .flat_map(|v| (*v as u64).to_le_bytes())
            .collect();
        let got = world.broadcast_bytes(bytes, 0)?;
        let v: Vec<usize> = got
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        if v[..] != mine[..] {
            tracing::warn!(
                "HOROVOD_FUSION_THRESHOLD / FERROVOD_FUSION_DIRECT_BYTES / HOROVOD_CACHE_CAPACITY / FERROVOD_MPI_MAX_COUNT / FERROVOD_LOCAL_SIZE / FERROVOD_NEGOTIATION / FERROVOD_PLAN_WARMUP_STEPS / FERROVOD_CHANNELS / HOROVOD_AUTOTUNE / FERROVOD_GPU_GRAPHS differ from rank 0's; using rank 0's values {v:?}"
            );
        }
        Ok(JobSettings {
            fusion_threshold: v[0],
            fusion_direct_bytes: v[1],
            cache_capacity: v[2],
            mpi_max_count: v[3],
            local_size_override: v[4],
            negotiation: NegotiationMode::from_code(v[5]),
            plan_warmup_steps: v[6],
            channels: v[7],
            autotune_window: v[8],
            gpu_graphs: v[9] != 0,
        })
    }
}

/// Offline negotiation of the global set (`FERROVOD_NEGOTIATION=offline`).
enum Offline {
    /// Another negotiation mode.
    Off,
    /// Negotiating online while learning a plan from the agreed responses.
    Learning(PlanLearner),
    /// Running the plan without control collectives.
    Frozen(OfflineQueue),
}

struct Background {
    rt: Arc<Runtime>,
    settings: JobSettings,
    world: MpiComm,
    /// Sets this rank is a member of.
    member: BTreeMap<i32, SetState>,
    /// Every set's ranks (identical on all ranks).
    all_sets: BTreeMap<i32, Vec<i32>>,
    next_set_id: i32,
    timeline: Option<Timeline>,
    want_shutdown: bool,
    /// A command other than a submission came since the last vote.
    kicked: bool,
    /// Why the job is stopping, when it is not a plain shutdown request.
    reason: Option<String>,
    offline: Offline,
    /// A collective was abandoned after a stall: MPI must not be finalized (it would wait for
    /// it), and the job ends when this process exits.
    mpi_unclean: bool,
    /// Batches handed to channels and not back yet: their tensors, to fail them if a channel
    /// never returns at shutdown.
    in_channels: HashMap<u64, Vec<Pending>>,
    next_job: u64,
    /// The cycle time in force (autotune may change it).
    cycle_time: std::time::Duration,
    autotune: Option<Autotune>,
    /// Online mode: learns the step's batches so that the vote carries one bit per batch.
    groups: Option<GroupLearner>,
    /// Completes GPU tensors once their events fire (started with the first GPU batch).
    finisher: Option<gpu::Finisher>,
    /// Ends the job when a blocking MPI call outlives the stall shutdown time.
    _watchdog: Watchdog,
}

/// Autotune's state: the tuner (rank 0 decides), and the current window.
struct Autotune {
    tuner: Autotuner,
    cycles: usize,
    window_start: Instant,
    bytes_at_start: u64,
    log: Option<std::fs::File>,
}

/// A tensor a channel holds.
struct Pending {
    handle: Option<Arc<crate::runtime::handle::Handle>>,
    index: usize,
}

pub(crate) fn run(
    rt: Arc<Runtime>,
    opts: InitOptions,
    rx: Receiver<Command>,
    ready: Sender<Result<()>>,
) {
    super::ON_BACKGROUND_THREAD.with(|f| f.set(true));
    let (mpi_ours, multiple) = match init_mpi(!rt.config.mpi_threads_disable) {
        Ok(v) => v,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut bg = match Background::start(rt.clone(), &opts, multiple) {
        Ok(bg) => bg,
        Err(e) => {
            if mpi_ours {
                finalize_mpi();
            }
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    // A panic in the loop must still fail this rank's pending operations rather than leave
    // their waiters hanging.
    let reason = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bg.run_loop(&rx))) {
        Ok(reason) => reason,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let topo = rt.topology.get().cloned().unwrap_or_default();
            if topo.size > 1 {
                // the other ranks may already wait in a collective this rank agreed to run:
                // no shutdown can be agreed any more
                crate::transport::mpi::abort_job(&format!(
                    "ferrovod: internal error on rank {}: the background thread panicked ({what}); aborting the job so that no rank waits for this one",
                    topo.rank
                ));
            }
            Some(format!(
                "internal error: ferrovod's background thread panicked ({what})"
            ))
        }
    };
    bg.stop(&rx, reason);
    let unclean = bg.mpi_unclean;
    drop(bg);
    if unclean {
        // The other ranks still there gave up at the same time and are reporting the same
        // stall; when this process exits, mpirun ends the job and may cut their reports short.
        // Shutting down (the exit handler) waits this long first.
        std::thread::sleep(UNCLEAN_EXIT_GRACE);
    }
    tracing::debug!("shutdown: runtime state freed");
    if mpi_ours && !unclean {
        finalize_mpi();
        tracing::debug!("shutdown: MPI finalized");
    } else if unclean {
        tracing::error!(
            "a collective never completed: MPI is left unfinalized, so that mpirun ends the job when this process exits"
        );
    }
}

fn make_set(
    id: i32,
    comm: MpiComm,
    ranks: Vec<i32>,
    rt: &Arc<Runtime>,
    settings: &JobSettings,
) -> Result<SetState> {
    let cfg = &rt.config;
    let set_rank = comm.rank();
    let ctrl = comm.dup()?.bounded(
        cfg.stall_limit(),
        cfg.stall_warn,
        ranks.clone(),
        format!("process set {id}"),
    )?;
    Ok(SetState {
        id,
        ctrl,
        negotiator: Negotiator::new(
            set_rank,
            ranks,
            settings.cache_capacity,
            settings.negotiation,
            StallPolicy {
                enabled: cfg.stall_check,
                warn_after: cfg.stall_warn,
                shutdown_after: cfg.stall_shutdown,
            },
        ),
        entries: PendingEntries::default(),
        fusion: Vec::new(),
        gpu: None,
        graph_epoch: 0,
        channels: if settings.channels > 1 {
            let done = rt
                .inbox
                .lock()
                .expect("inbox")
                .clone()
                .ok_or_else(Error::shut_down)?;
            let turn = Arc::new(channel::LaunchTurn::default());
            (0..settings.channels)
                .map(|k| Channel::spawn(k, comm.dup()?, done.clone(), rt.clone(), turn.clone()))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        },
        batch_seq: 0,
        data: comm,
    })
}

impl Background {
    fn start(rt: Arc<Runtime>, opts: &InitOptions, multiple: bool) -> Result<Background> {
        let world = match &opts.comm {
            Communicator::World => MpiComm::world()?,
            Communicator::Fortran(h) => MpiComm::from_fortran(*h)?,
            Communicator::Ranks(ranks) => {
                let all = MpiComm::world()?;
                let n = all.size() as i32;
                if ranks.is_empty() || ranks.iter().any(|r| *r < 0 || *r >= n) {
                    return Err(Error::InvalidArgument(format!(
                        "init ranks {ranks:?} must be ranks of MPI_COMM_WORLD (size {n})"
                    )));
                }
                all.subset(ranks)?.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {} of MPI_COMM_WORLD is not in the ranks given to init {ranks:?}",
                        all.rank()
                    ))
                })?
            }
        };
        let mut settings = JobSettings::from_rank0(&world, &rt.config)?;
        let world = world.with_max_count(settings.mpi_max_count);
        let local = world.split_local(Some(settings.local_size_override).filter(|n| *n > 0))?;
        let cross = world.split(local.rank() as i32)?;
        let local_sizes = world.allgather_i64(local.size() as i64)?;
        if settings.channels > 1 && world.allgather_i64(multiple as i64)?.contains(&0) {
            tracing::warn!("FERROVOD_CHANNELS needs MPI_THREAD_MULTIPLE on every rank; using 1");
            settings.channels = 1;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        crate::runtime::handle::set_polling(
            rt.config
                .poll
                .unwrap_or(cores / local.size().max(1) >= MIN_CORES_TO_POLL),
        );
        let topo = Topology {
            rank: world.rank() as i32,
            size: world.size() as i32,
            local_rank: local.rank() as i32,
            local_size: local.size() as i32,
            cross_rank: cross.rank() as i32,
            cross_size: cross.size() as i32,
            is_homogeneous: local_sizes.iter().all(|s| *s == local_sizes[0]),
            mpi_threads_supported: multiple,
        };
        let _ = rt.topology.set(topo.clone());

        // static process sets must be the same everywhere
        let digest = format!("{:?}", opts.process_sets);
        let hash = digest.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let hashes = world.allgather_i64(hash as i64)?;
        if hashes.iter().any(|h| *h != hashes[0]) {
            return Err(Error::InvalidArgument(
                "Different ranks tried to set up mismatching numbers of process sets".into(),
            ));
        }
        let size = topo.size;
        let world_ranks: Vec<i32> = (0..size).collect();
        let mut bg = Background {
            settings,
            member: BTreeMap::new(),
            all_sets: BTreeMap::new(),
            next_set_id: 1,
            timeline: None,
            want_shutdown: false,
            kicked: false,
            reason: None,
            offline: Offline::Off,
            mpi_unclean: false,
            in_channels: HashMap::default(),
            next_job: 0,
            cycle_time: rt.config.cycle_time,
            autotune: None,
            groups: (settings.negotiation == NegotiationMode::Online)
                .then(|| GroupLearner::new(settings.plan_warmup_steps)),
            world: world.dup()?,
            rt: rt.clone(),
            finisher: None,
            _watchdog: Watchdog::start(rt.config.stall_limit(), world.dup()?, multiple),
        };
        bg.member
            .insert(0, make_set(0, world, world_ranks.clone(), &rt, &settings)?);
        bg.all_sets.insert(0, world_ranks);
        for ranks in &opts.process_sets {
            // identical lists on every rank (checked above): every rank fails alike
            let sorted = super::process_set_ranks(ranks, Some(size))?;
            bg.create_set(sorted)?;
        }
        *rt.sets.write().expect("sets") = bg.all_sets.clone();
        if settings.negotiation == NegotiationMode::Offline {
            bg.offline = bg.initial_offline()?;
        }
        if settings.autotune_window > 0 {
            if settings.negotiation == NegotiationMode::Offline {
                tracing::warn!("HOROVOD_AUTOTUNE is not used with offline negotiation");
            } else {
                bg.autotune = Some(Autotune {
                    tuner: Autotuner::new(
                        Params {
                            fusion_threshold: settings.fusion_threshold,
                            cycle_time: rt.config.cycle_time,
                        },
                        rt.config.autotune_warmup,
                        3,
                    ),
                    cycles: 0,
                    window_start: Instant::now(),
                    bytes_at_start: 0,
                    log: (topo.rank == 0)
                        .then(|| rt.config.autotune_log.as_ref())
                        .flatten()
                        .and_then(|p| std::fs::File::create(p).ok()),
                });
            }
        }
        if topo.rank == 0
            && let Some(path) = &rt.config.timeline
        {
            match Timeline::create(path, rt.config.timeline_mark_cycles) {
                Ok(t) => bg.timeline = Some(t),
                Err(e) => tracing::error!("cannot write timeline {path}: {e}"),
            }
        }
        Ok(bg)
    }

    /// Creates the set (collective over the world); an existing identical set is reused.
    fn create_set(&mut self, ranks: Vec<i32>) -> Result<i32> {
        if let Some((id, _)) = self.all_sets.iter().find(|(_, r)| **r == ranks) {
            return Ok(*id);
        }
        let id = self.next_set_id;
        self.next_set_id += 1;
        if let Some(comm) = self.world.subset(&ranks)? {
            let set = make_set(id, comm, ranks.clone(), &self.rt, &self.settings)?;
            self.member.insert(id, set);
        }
        self.all_sets.insert(id, ranks);
        Ok(id)
    }

    /// Whether to vote now rather than at the timer: a shutdown, a finished channel batch,
    /// offline mode's own queue, or a submission that could let a vote agree on more (a
    /// burst into a learned group votes once, when the group is complete here).
    fn vote_wanted(&self) -> bool {
        self.kicked
            || self.want_shutdown
            || matches!(self.offline, Offline::Frozen(_))
            || self.member.values().any(|s| s.negotiator.wants_vote())
    }

    fn receive(&mut self, cmd: Command) {
        // a GPU batch coming back from its channel was only launched: nothing to vote on yet
        let launched_on_gpu = matches!(&cmd, Command::BatchDone(d) if d.recorded.is_some());
        if !matches!(cmd, Command::Submit { .. }) && !launched_on_gpu {
            self.kicked = true;
        }
        match cmd {
            Command::Shutdown => self.want_shutdown = true,
            Command::BatchDone(done) => self.batch_done(done),
            Command::Submit { set, entries } => {
                let Some(state) = self.member.get_mut(&set) else {
                    let err = Error::InvalidArgument(
                        "Process set provided does not exist, or has not been registered.".into(),
                    );
                    for e in entries {
                        e.complete(Err(err.clone()), None);
                    }
                    return;
                };
                let now = Instant::now();
                if set == 0
                    && let Offline::Frozen(q) = &mut self.offline
                {
                    for e in entries {
                        q.submit(crate::message::Request::clone(&e.request));
                        state.entries.insert(e);
                    }
                    return;
                }
                for e in entries {
                    if let Some(t) = self.timeline.as_mut() {
                        t.begin(
                            &e.request.name,
                            &format!("NEGOTIATE_{}", e.request.kind.name()),
                        );
                    }
                    state.negotiator.submit(e.request.clone(), now);
                    state.entries.insert(e);
                }
            }
        }
    }

    /// Cycles until every rank agrees to stop; returns the reason.
    fn run_loop(&mut self, rx: &Receiver<Command>) -> Option<String> {
        let mut next_cycle = Instant::now();
        let mut retry = std::time::Duration::ZERO;
        let mut last_counters = crate::runtime::metrics::MetricsSnapshot::default();
        let mut last_counter_time = Instant::now() - std::time::Duration::from_secs(1);
        // until when to poll for submissions rather than sleep
        let mut poll_until = Instant::now();
        loop {
            // until the next vote is due, or a command makes one worth holding now
            while Instant::now() < next_cycle {
                match next_command(rx, next_cycle, poll_until) {
                    Ok(Some(cmd)) => {
                        self.receive(cmd);
                        if crate::runtime::handle::polling() {
                            poll_until = Instant::now() + POLL_AFTER_SUBMIT;
                        }
                    }
                    Ok(None) | Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.want_shutdown = true,
                }
                while let Ok(cmd) = rx.try_recv() {
                    self.receive(cmd);
                }
                if self.vote_wanted() {
                    break;
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.receive(cmd);
            }
            if let Some(reason) = self.rt.take_gpu_failure() {
                tracing::error!("{reason}");
                self.reason.get_or_insert(reason);
                self.want_shutdown = true;
            }
            if self.vote_wanted() {
                // a vote for something new: if it agrees on nothing (another rank is not
                // there yet), retry soon rather than after the backed-off delay
                retry = std::time::Duration::ZERO;
            }
            self.kicked = false;
            next_cycle = Instant::now() + self.cycle_time;
            if let Some(t) = self.timeline.as_mut() {
                t.mark_cycle();
            }
            let ids: Vec<i32> = self.member.keys().copied().collect();
            let mut progressed = false;
            for id in ids {
                let Some(set) = self.member.get_mut(&id) else {
                    continue;
                };
                let want = id == 0 && self.want_shutdown;
                if id == 0 && matches!(self.offline, Offline::Frozen(_)) {
                    if let Err(e) = self.run_offline(want) {
                        return self.leave(format!("ferrovod offline negotiation failed: {e}"));
                    }
                    continue;
                }
                let started = Instant::now();
                super::probe::mark("vote", set.entries.len());
                let abort = want && self.rt.gpu_aborting();
                let moved = self.rt.gpu_moved();
                let outcome = set.negotiator.cycle(&set.ctrl, want, abort, moved, started);
                super::probe::mark("voted", outcome.as_ref().map_or(0, |o| o.responses.len()));
                if let Ok(o) = &outcome {
                    self.rt.metrics.add_negotiation(
                        o.control_collectives.into(),
                        o.control_bytes,
                        started.elapsed(),
                    );
                }
                if outcome.is_err() {
                    // a control collective may still be posted, or the others wait in one
                    // this rank left: finalizing would wait for ever
                    self.mpi_unclean = true;
                }
                let stop = match &outcome {
                    Err(e @ Error::ShutDown(_)) => Some(e.to_string()),
                    Err(e) => Some(format!("ferrovod negotiation failed: {e}")),
                    Ok(o) => o.shutdown.clone().filter(|r| r != SHUT_DOWN_MESSAGE),
                };
                let plain_shutdown = matches!(&outcome, Ok(o) if o.shutdown.is_some());
                if matches!(&outcome, Ok(o) if o.abort_gpu) {
                    self.rt.abort_gpu_work();
                }
                if let Some(reason) = stop.as_ref() {
                    tracing::error!("{reason}");
                    self.reason.get_or_insert_with(|| reason.clone());
                }
                if id == 0 && (stop.is_some() || plain_shutdown) {
                    return self.reason.clone();
                }
                if stop.is_some() {
                    // Only this set's members know: stop using the set, and shut everyone
                    // down through the global set's next vote.
                    self.want_shutdown = true;
                    self.drop_set(id, Error::ShutDown(self.reason.clone().unwrap_or_default()));
                    continue;
                }
                let Ok(outcome) = outcome else { continue };
                if outcome.gpu_moved {
                    set.graph_epoch += 1;
                }
                if id == 0 && !matches!(self.offline, Offline::Off) {
                    self.learn(&outcome.responses);
                }
                if !outcome.responses.is_empty() {
                    progressed = true;
                    super::probe::mark("agreed", outcome.responses.len());
                    self.execute(id, &outcome.responses, &outcome.groups);
                }
                // after the launch: it shapes only later votes (at the same point everywhere)
                if id == 0 {
                    self.learn_groups(&outcome.responses);
                }
                if id == 0
                    && let Err(e) = self.autotune_cycle()
                {
                    return self.leave(format!("ferrovod autotune failed: {e}"));
                }
                if id == 0
                    && let Err(e) = self.maybe_freeze()
                {
                    return self.leave(format!("ferrovod offline negotiation failed: {e}"));
                }
            }
            // Tensors still wait here: vote again soon rather than a cycle time later — at once
            // after a vote that ran batches, else after a delay doubling from 20 us up to the
            // cycle time. A vote that ran just before the other ranks' tensors arrived cost a
            // whole cycle time per round of back-to-back GPU allreduces; ranks whose waiting
            // tensors never match back off to the cycle time.
            // (tensors waiting only in groups still incomplete here wait for the group: a
            // vote could not agree on them, and the cycle timer keeps votes going)
            let frozen = matches!(self.offline, Offline::Frozen(_));
            let waiting = self.member.iter().any(|(id, s)| match (*id, frozen) {
                (0, true) => !s.entries.is_empty(),
                _ => s.negotiator.could_agree() || s.negotiator.has_sent(),
            });
            retry = revote_delay(waiting, progressed, retry, self.cycle_time);
            if waiting {
                next_cycle = Instant::now() + retry;
            }
            if let Some(t) = self.timeline.as_mut() {
                // counters when they changed, at most every 10 ms
                let m = self.rt.metrics.snapshot();
                let changed = m.control_collectives != last_counters.control_collectives
                    || m.data_collectives != last_counters.data_collectives;
                if changed && last_counter_time.elapsed() >= std::time::Duration::from_millis(10) {
                    t.counters(&m);
                    last_counters = m;
                    last_counter_time = Instant::now();
                }
                t.flush();
            }
        }
    }

    /// Ends the loop on this rank alone, without an agreed shutdown: the others may wait in a
    /// collective this rank left, so MPI is not finalized (they end at their stall limit).
    fn leave(&mut self, reason: String) -> Option<String> {
        self.mpi_unclean = true;
        tracing::error!("{reason}");
        self.reason.get_or_insert(reason);
        self.reason.clone()
    }

    /// Counts a global-set cycle; at the end of each window, rank 0 scores it and every rank
    /// takes rank 0's next settings (one broadcast per window, only while tuning).
    fn autotune_cycle(&mut self) -> Result<()> {
        let window = self.settings.autotune_window;
        let me = self.world.rank() as i32;
        let Some(at) = self.autotune.as_mut() else {
            return Ok(());
        };
        if at.tuner.done() {
            return Ok(());
        }
        if crate::config::test_fault("autotune", me) {
            return Err(Error::Internal("test fault: autotune".into()));
        }
        at.cycles += 1;
        if at.cycles % window != 0 {
            return Ok(());
        }
        let Some(set) = self.member.get_mut(&0) else {
            return Ok(());
        };
        let now = Instant::now();
        let mut mine = Vec::new();
        if set.ctrl.rank() == 0 {
            let bytes = self.rt.metrics.snapshot().data_bytes;
            let moved = bytes - at.bytes_at_start;
            let secs = now.duration_since(at.window_start).as_secs_f64();
            let before = at.tuner.current();
            let next = if moved > 0 && secs > 0.0 {
                let score = moved as f64 / secs;
                if let Some(f) = at.log.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(
                        f,
                        "{},{:.3},{:.0}",
                        before.fusion_threshold,
                        before.cycle_time.as_secs_f64() * 1e3,
                        score
                    );
                }
                at.tuner.record(score)
            } else {
                before
            };
            mine.extend((next.fusion_threshold as u64).to_le_bytes());
            mine.extend((next.cycle_time.as_nanos() as u64).to_le_bytes());
            mine.push(u8::from(at.tuner.done()));
        }
        let started = Instant::now();
        let got = set.ctrl.broadcast_bytes(mine, 0)?;
        self.rt
            .metrics
            .add_negotiation(1, got.len() as u64, started.elapsed());
        let word =
            |k: usize| u64::from_le_bytes(got[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        self.settings.fusion_threshold = word(0) as usize;
        self.cycle_time = std::time::Duration::from_nanos(word(1));
        if got[16] == 1 {
            // tuning is over on every rank at the same window: no more broadcasts
            tracing::info!(
                "autotune: fusion threshold {} B, cycle time {:?}",
                self.settings.fusion_threshold,
                self.cycle_time
            );
            self.autotune = None;
            return Ok(());
        }
        at.window_start = Instant::now();
        at.bytes_at_start = self.rt.metrics.snapshot().data_bytes;
        Ok(())
    }

    /// What shapes learned batches, and whether the global set may learn now.
    /// `refuse_joined`: a joined rank stops learning too (plans; groups do not mind).
    fn learn_context(&self, refuse_joined: bool) -> LearnContext {
        let joined = refuse_joined
            && self
                .member
                .get(&0)
                .is_some_and(|s| s.negotiator.any_joined());
        LearnContext {
            fusion_threshold: self.settings.fusion_threshold,
            direct_bytes: self.settings.fusion_direct_bytes,
            alone: self.all_sets.len() == 1 && !joined,
        }
    }

    /// Online mode: once `FERROVOD_PLAN_WARMUP_STEPS` steps agree, the global set votes for
    /// each of the step's fusion batches with one bit (identically on every rank: learned from
    /// agreed responses). Dissolved groups are learned again.
    fn learn_groups(&mut self, responses: &[Arc<Response>]) {
        let ctx = self.learn_context(false);
        let (Some(g), Some(set)) = (self.groups.as_mut(), self.member.get_mut(&0)) else {
            return;
        };
        let negotiator = &set.negotiator;
        let held = |name: &str| negotiator.in_group(name);
        if let Some(groups) = g.observe(responses, ctx, held, negotiator.groups()) {
            set.negotiator
                .set_groups(groups, self.rt.config.plan_escape);
        }
    }

    fn escape_policy(&self) -> EscapePolicy {
        let cfg = &self.rt.config;
        EscapePolicy {
            out_of_order: cfg.plan_escape,
            foreign: (cfg.cycle_time * 5).max(std::time::Duration::from_millis(5)),
        }
    }

    /// Offline mode at init: the plan file's plan if every rank loaded the same one, else
    /// learning.
    fn initial_offline(&self) -> Result<Offline> {
        let path = self.rt.config.plan_file.as_deref();
        match agreed_plan_file(&self.world, path)? {
            Some(plan) if self.all_sets.len() == 1 => {
                tracing::info!(
                    "offline negotiation: running the plan from {} ({} tensors in {} batches)",
                    path.unwrap_or(""),
                    plan.num_tensors(),
                    plan.batches.len()
                );
                Ok(Offline::Frozen(OfflineQueue::new(
                    plan,
                    self.escape_policy(),
                )))
            }
            found => {
                if found.is_some() {
                    tracing::warn!(
                        "offline negotiation: the plan file cannot run while other process sets exist; learning online"
                    );
                }
                Ok(Offline::Learning(PlanLearner::new(
                    self.settings.plan_warmup_steps,
                )))
            }
        }
    }

    /// Feeds the global set's agreed responses to the plan being learned (identically on every
    /// rank, so every rank arms and freezes at the same response).
    fn learn(&mut self, responses: &[Arc<Response>]) {
        // offline mode needs the global set alone and no joined rank
        let ctx = self.learn_context(true);
        if let Offline::Learning(learner) = &mut self.offline {
            learner.observe(responses, ctx);
        }
    }

    /// Freezes an armed plan once its step has run: all ranks compare plan hashes (one
    /// allgather), then the global set runs the plan. Rank 0 writes `FERROVOD_PLAN_FILE`.
    fn maybe_freeze(&mut self) -> Result<()> {
        let Offline::Learning(learner) = &mut self.offline else {
            return Ok(());
        };
        let Some(plan) = learner.take_ready() else {
            return Ok(());
        };
        if crate::config::test_fault("freeze", self.world.rank() as i32) {
            return Err(Error::Internal("test fault: freeze".into()));
        }
        let policy = self.escape_policy();
        let Some(set) = self.member.get_mut(&0) else {
            return Ok(());
        };
        let started = Instant::now();
        let agreed = agree_on_plan(&set.ctrl, &plan, self.rt.config.plan_file.as_deref())?;
        self.rt
            .metrics
            .add_negotiation(1, 8 * set.ctrl.size() as u64, started.elapsed());
        if !agreed {
            // the learner already starts over (take_ready)
            return Ok(());
        }
        tracing::info!(
            "offline negotiation: plan frozen ({} tensors in {} batches)",
            plan.num_tensors(),
            plan.batches.len()
        );
        let mut q = OfflineQueue::new(plan, policy);
        for req in set.negotiator.take_waiting() {
            if let Some(t) = self.timeline.as_mut() {
                t.end(&req.name, None);
            }
            q.submit(req);
        }
        if set.negotiator.has_sent() {
            // a request waits for a coordinator round: only online negotiation can finish it
            q.request_escape();
        }
        self.offline = Offline::Frozen(q);
        Ok(())
    }

    /// Runs every plan batch that is ready (or that this rank must escape from). When a flag
    /// comes back raised, hands all pending work back to online negotiation.
    fn run_offline(&mut self, want_shutdown: bool) -> Result<()> {
        let warmup = self.settings.plan_warmup_steps;
        let cfg = &self.rt.config;
        let stall = StallPolicy {
            enabled: cfg.stall_check,
            warn_after: cfg.stall_warn,
            shutdown_after: cfg.stall_shutdown,
        };
        loop {
            let Offline::Frozen(q) = &mut self.offline else {
                return Ok(());
            };
            if want_shutdown {
                q.request_escape();
            }
            let (batch, raise, have) = match q.next(Instant::now()) {
                Next::Run { batch, escape } => (batch, escape, true),
                Next::Dummy { batch } => (batch, true, false),
                Next::Wait => return Ok(()),
            };
            let resps = q.plan().batches[batch].clone();
            if crate::config::test_fault("offline", self.world.rank() as i32) {
                return Err(Error::Internal("test fault: offline".into()));
            }
            let Some(set) = self.member.get_mut(&0) else {
                return Ok(());
            };
            let mut entries: Vec<TensorEntry> = if have {
                resps
                    .iter()
                    .filter_map(|r| set.entries.remove(&r.name))
                    .collect()
            } else {
                Vec::new()
            };
            let names: Vec<String> = resps.iter().map(|r| r.name.clone()).collect();
            let timeline = &mut self.timeline;
            if have && let Some(t) = timeline.as_mut() {
                for n in &names {
                    t.begin(n, "ALLREDUCE");
                }
            }
            let escaped = {
                // a rank without the batch's tensors has no spans to mark
                let traced: &[String] = if have { &names } else { &[] };
                let mut sink = Timeline::activities(timeline, traced);
                let mut ios: Vec<&mut dyn TensorIo> =
                    entries.iter_mut().map(|e| e as &mut dyn TensorIo).collect();
                let ios = if have { Some(&mut ios[..]) } else { None };
                let mut warned = false;
                let mut slow = |waited: std::time::Duration| {
                    if stall.enabled && waited >= stall.warn_after && !warned {
                        warned = true;
                        tracing::warn!(
                            "offline negotiation: plan batch {batch} ({}) has waited {} s for other ranks; a rank has not submitted these tensors or stopped submitting",
                            names.join(", "),
                            waited.as_secs()
                        );
                    }
                };
                let wait = collective::Wait {
                    limit: (stall.enabled && stall.shutdown_after > std::time::Duration::ZERO)
                        .then_some(stall.shutdown_after),
                    slow: &mut slow,
                };
                collective::allreduce_flagged(
                    &set.data,
                    &resps,
                    ios,
                    &mut set.fusion,
                    raise,
                    wait,
                    &mut sink,
                )
            };
            if have && let Some(t) = timeline.as_mut() {
                for (n, r) in names.iter().zip(&resps) {
                    let shape = format!("{:?}", r.shape);
                    t.end(n, Some((r.dtype.name(), &shape)));
                }
            }
            let escaped = match escaped {
                Ok(collective::Flagged::Done { raised }) => raised,
                Ok(collective::Flagged::TimedOut) => {
                    self.mpi_unclean = true;
                    let missing = set
                        .ctrl
                        .missing_ranks()
                        .map_or_else(|| "unknown".to_string(), |m| rank_list(&m));
                    let e = Error::ShutDown(format!(
                        "Stalled: offline plan batch {batch} ({}) waited longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={} for other ranks; a rank has not submitted these tensors, stopped submitting, or stopped responding. Missing ranks: {missing}. Shutting down.",
                        names.join(", "),
                        stall.shutdown_after.as_secs()
                    ));
                    for e2 in entries {
                        e2.complete(Err(e.clone()), None);
                    }
                    return Err(e);
                }
                Err(e) => {
                    for e2 in entries {
                        e2.complete(Err(e.clone()), None);
                    }
                    return Err(e);
                }
            };
            if !escaped {
                let bytes: usize = resps
                    .iter()
                    .map(|r| r.num_elements() as usize * r.dtype.size())
                    .sum();
                self.rt
                    .metrics
                    .add_batch(entries.len() as u64, bytes as u64);
                q.complete_batch();
                for e in entries {
                    e.complete(Ok(()), None);
                }
                continue;
            }
            // someone raised the flag: this batch did not count; everyone goes online
            for e in entries {
                set.entries.insert(e);
            }
            let Offline::Frozen(q) = std::mem::replace(
                &mut self.offline,
                Offline::Learning(PlanLearner::new(warmup)),
            ) else {
                unreachable!("frozen above");
            };
            tracing::info!(
                "offline negotiation: left the plan at batch {batch}; negotiating online"
            );
            let now = Instant::now();
            for req in q.into_requests() {
                if let Some(t) = self.timeline.as_mut() {
                    t.begin(&req.name, &format!("NEGOTIATE_{}", req.kind.name()));
                }
                set.negotiator.submit(Arc::new(req), now);
            }
            return Ok(());
        }
    }

    fn execute(&mut self, id: i32, responses: &[Arc<Response>], groups: &[usize]) {
        let a = self.settings;
        let batches = plan_segments(responses, groups, a.fusion_threshold, a.fusion_direct_bytes);
        for batch in batches {
            let resps: Vec<&Response> = batch.members.iter().map(|i| &*responses[*i]).collect();
            let head = resps[0];
            if matches!(head.kind, OpKind::AddProcessSet | OpKind::RemoveProcessSet)
                && head.error.is_none()
            {
                self.change_process_set(head);
                continue;
            }
            let me = self.world.rank() as i32;
            if head.kind == OpKind::Allreduce && crate::config::test_fault("panic", me) {
                panic!("test fault: panic before an agreed batch");
            }
            if head.kind == OpKind::Allreduce && crate::config::test_fault("stop_in_batch", me) {
                // as a hung rank: the whole process stops, mid-step
                crate::config::stop_this_process();
            }
            let Some(set) = self.member.get_mut(&id) else {
                return;
            };
            // the channel is chosen before anything local can skip the batch, so that the
            // numbering stays identical on every rank
            let channel = (!set.channels.is_empty()
                && head.error.is_none()
                && channel::runs_on_channel(head.kind))
            .then(|| {
                let seq = set.batch_seq;
                set.batch_seq += 1;
                ((seq % set.channels.len() as u64) as usize, seq)
            });
            let mut entries: Vec<TensorEntry> = Vec::with_capacity(resps.len());
            for r in &resps {
                match set.entries.remove(&r.name) {
                    Some(e) => entries.push(e),
                    // Every agreed collective is run by every rank: a rank without the tensor
                    // (it has joined) contributes zeros to allreduce and takes part in barrier.
                    None if r.error.is_none()
                        && matches!(r.kind, OpKind::Allreduce | OpKind::Barrier) =>
                    {
                        let bytes = match r.kind {
                            OpKind::Allreduce => r.num_elements() as usize * r.dtype.size(),
                            _ => 0,
                        };
                        let req = crate::message::Request {
                            rank: set.data.rank() as i32,
                            kind: r.kind,
                            dtype: r.dtype,
                            name: r.name.clone(),
                            shape: r.shape.clone(),
                            root: r.root,
                            device: r.device,
                            reduce_op: r.reduce_op,
                            prescale: r.prescale,
                            postscale: r.postscale,
                        };
                        entries.push(TensorEntry::new(
                            req,
                            InputMem::Owned(vec![0u8; bytes]),
                            OutputMem::InPlace,
                        ));
                    }
                    None => {}
                }
            }
            if entries.len() != resps.len() {
                // Only error responses (nothing runs) or kinds the coordinator refuses while a
                // rank has joined can lack a local tensor; anything else is a bug, reported here.
                if head.error.is_none() {
                    tracing::error!(
                        "internal error: no local tensor for agreed {} '{}'",
                        head.kind.name(),
                        head.name
                    );
                }
                let err = match &head.error {
                    Some(m) => Error::Precondition(m.clone()),
                    None => Error::Internal("missing local tensor for an agreed response".into()),
                };
                for e in entries {
                    e.complete(Err(err.clone()), None);
                }
                continue;
            }
            // a fused GPU allreduce may be replayed from a graph (decided from agreed data)
            let replay = (a.gpu_graphs
                && head.error.is_none()
                && head.kind == OpKind::Allreduce
                && gpu::on_device(head))
            .then(|| ReplayKey {
                batch: batch_fingerprint(&resps),
                epoch: set.graph_epoch,
            });
            let timeline = &mut self.timeline;
            // only the timeline needs the names
            let names: Vec<String> = match timeline {
                Some(_) => resps.iter().map(|r| r.name.clone()).collect(),
                None => Vec::new(),
            };
            if let Some(t) = timeline.as_mut() {
                for n in &names {
                    t.end(n, None);
                    t.begin(n, head.kind.name());
                }
            }
            if let Some((k, seq)) = channel {
                let id_job = self.next_job;
                self.next_job += 1;
                self.in_channels.insert(
                    id_job,
                    entries
                        .iter()
                        .map(|e| Pending {
                            handle: e.handle.clone(),
                            index: e.index,
                        })
                        .collect(),
                );
                set.channels[k].send(Job {
                    id: id_job,
                    seq,
                    set: id,
                    resps: resps.iter().map(|r| (*r).clone()).collect(),
                    entries,
                    replay,
                });
                continue;
            }
            let outcome = match &head.error {
                Some(msg) => Err(Error::Precondition(msg.clone())),
                None => {
                    let bytes: usize = entries
                        .iter()
                        .filter(|e| !matches!(e.request.kind, OpKind::Barrier | OpKind::Join))
                        .map(|e| e.request.num_elements() as usize * e.request.dtype.size())
                        .sum();
                    self.rt
                        .metrics
                        .add_batch(entries.len() as u64, bytes as u64);
                    run_batch(
                        &self.rt,
                        set,
                        &resps,
                        &mut entries,
                        replay,
                        timeline,
                        &names,
                    )
                }
            };
            if let Some(t) = timeline.as_mut() {
                for (n, r) in names.iter().zip(&resps) {
                    let shape = format!("{:?}", r.shape);
                    t.end(n, Some((r.dtype.name(), &shape)));
                }
            }
            let outcome = match outcome {
                Ok(Some(recorded)) => {
                    self.finish_device(entries, recorded);
                    continue;
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            let value = matches!(head.kind, OpKind::Join).then_some(head.result);
            for e in entries {
                e.complete(outcome.clone(), value);
            }
        }
    }

    /// GPU tensors complete when their batch's event fires (on the finisher thread), or at
    /// once with asynchronous completion (the handle's event is then what consumers wait on).
    fn finish_device(&mut self, mut entries: Vec<TensorEntry>, recorded: gpu::Recorded) {
        if self.finisher.is_none() {
            match gpu::Finisher::spawn(self.rt.clone()) {
                Ok(f) => self.finisher = Some(f),
                Err(e) => {
                    tracing::error!("{e}; waiting for the GPU on the background thread");
                    let outcome = recorded.event.synchronize();
                    gpu::complete(entries, outcome, Some(&recorded));
                    return;
                }
            }
        }
        let Some(f) = &self.finisher else { return };
        if self.rt.config.async_completion {
            let memory: Vec<_> = entries
                .iter_mut()
                .flat_map(|e| e.take_device_memory())
                .collect();
            gpu::complete(entries, Ok(()), Some(&recorded));
            if !memory.is_empty() {
                f.send(gpu::Finish::Release { recorded, memory });
            }
            return;
        }
        f.send(gpu::Finish::Complete { recorded, entries });
    }

    /// A channel's batch came back: account for it and complete its tensors.
    fn batch_done(&mut self, done: channel::Done) {
        self.in_channels.remove(&done.id);
        if done.outcome.is_ok() {
            let bytes: usize = done
                .resps
                .iter()
                .map(|r| r.num_elements() as usize * r.dtype.size())
                .sum();
            self.rt
                .metrics
                .add_batch(done.entries.len() as u64, bytes as u64);
        } else if let Err(e) = &done.outcome {
            tracing::error!("set {}: channel batch failed: {e}", done.set);
        }
        if let Some(t) = self.timeline.as_mut() {
            for r in &done.resps {
                let shape = format!("{:?}", r.shape);
                t.end(&r.name, Some((r.dtype.name(), &shape)));
            }
        }
        if let (Ok(()), Some(recorded)) = (&done.outcome, done.recorded) {
            self.finish_device(done.entries, recorded);
            return;
        }
        for e in done.entries {
            e.complete(done.outcome.clone(), None);
        }
    }

    /// Closes every channel and waits (at most 30 s) for the batches they still hold; tensors
    /// of batches that never come back fail with `err`.
    fn drain_channels(&mut self, rx: &Receiver<Command>, err: &Error) {
        for set in self.member.values_mut() {
            for c in &mut set.channels {
                c.close();
            }
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        while !self.in_channels.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Command::BatchDone(done)) => self.batch_done(done),
                Ok(other) => self.receive(other),
                Err(_) => break,
            }
        }
        if self.in_channels.is_empty() {
            for set in self.member.values_mut() {
                for c in &mut set.channels {
                    c.join();
                }
            }
            return;
        }
        tracing::error!(
            "{} channel batches did not complete at shutdown; failing their tensors",
            self.in_channels.len()
        );
        self.mpi_unclean = true;
        for (_, pending) in self.in_channels.drain() {
            for p in pending {
                if let Some(h) = p.handle {
                    h.complete_one(p.index, Err(err.clone()), None);
                }
            }
        }
    }

    fn change_process_set(&mut self, resp: &Response) {
        let entry = self
            .member
            .get_mut(&0)
            .and_then(|s| s.entries.remove(&resp.name));
        let outcome: Result<i32> = match resp.kind {
            OpKind::AddProcessSet => {
                let ranks: Vec<i32> = resp.shape.iter().map(|r| *r as i32).collect();
                match self.all_sets.iter().find(|(_, r)| **r == ranks) {
                    Some((id, _)) => Err(Error::InvalidArgument(format!(
                        "A process set with ranks {ranks:?} already exists (id {id})."
                    ))),
                    None => self.create_set(ranks),
                }
            }
            _ => {
                let id = resp.shape.first().copied().unwrap_or(0) as i32;
                if id == 0 || !self.all_sets.contains_key(&id) {
                    Err(Error::InvalidArgument(format!(
                        "Process set {id} does not exist, or has not been registered."
                    )))
                } else {
                    self.all_sets.remove(&id);
                    self.drop_set(id, Error::Aborted(format!("process set {id} was removed")));
                    Ok(id)
                }
            }
        };
        *self.rt.sets.write().expect("sets") = self.all_sets.clone();
        if let Some(e) = entry {
            match outcome {
                Ok(id) => e.complete(Ok(()), Some(id)),
                Err(err) => e.complete(Err(err), None),
            }
        }
    }

    /// Stops using set `id` on this rank, failing its pending tensors with `err`.
    fn drop_set(&mut self, id: i32, err: Error) {
        if let Some(mut set) = self.member.remove(&id) {
            // every member drops the set at the same point, so its channels' queues finish
            for c in &mut set.channels {
                c.close();
                c.join();
            }
            for e in set.entries {
                e.complete(Err(err.clone()), None);
            }
        }
    }

    /// Fails everything still pending and refuses new work.
    fn stop(&mut self, rx: &Receiver<Command>, reason: Option<String>) {
        *self.rt.shutdown_reason.lock().expect("reason") = reason.clone();
        self.rt.loop_ended.store(true, Ordering::SeqCst);
        let inbox = self.rt.inbox.lock().expect("inbox").take();
        drop(inbox);
        while let Ok(cmd) = rx.try_recv() {
            self.receive(cmd);
        }
        let err = match reason {
            Some(r) => Error::ShutDown(r),
            None => Error::shut_down(),
        };
        self.drain_channels(rx, &err);
        tracing::debug!("shutdown: channels drained");
        if self.mpi_unclean {
            // a rank stopped responding: NCCL communicators are aborted, not destroyed (that
            // may wait for the missing rank)
            self.rt.abort_gpu_work();
        }
        // before the finisher: NCCL streams whose work cannot finish (another rank failed)
        // abort it when dropped, so that the finisher's waits end. All at once: one set's abort
        // may wait for the device, which another's stuck kernels keep busy.
        std::thread::scope(|s| {
            for set in self.member.values_mut() {
                if let Some(streams) = set.gpu.take() {
                    s.spawn(move || drop(streams));
                }
            }
        });
        tracing::debug!("shutdown: GPU lanes closed");
        if let Some(mut f) = self.finisher.take() {
            f.close();
        }
        tracing::debug!("shutdown: GPU completions finished");
        for set in std::mem::take(&mut self.member).into_values() {
            for e in set.entries {
                e.complete(Err(err.clone()), None);
            }
        }
        if let Some(t) = self.timeline.take() {
            t.close();
        }
    }
}

/// How long a runtime that gave up on missing ranks waits before its shutdown returns.
const UNCLEAN_EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Cores per local rank from which waiting threads poll by default: a submitting thread, the
/// background thread and the GPU finisher each may hold one.
const MIN_CORES_TO_POLL: usize = 4;

/// How long the background thread polls (when polling is on) for the next submission after one arrived, instead
/// of sleeping: a framework submits a step's gradients in a burst, and waking a sleeping
/// thread costs every submitter a system call, longer than the rest of an enqueue
/// (BENCHMARKS.md, "Figures moved out of comments").
const POLL_AFTER_SUBMIT: std::time::Duration = std::time::Duration::from_micros(200);

/// The next command before `deadline`: polled (yielding the core between polls) until
/// `poll_until`, then waited for asleep. `Ok(None)`: none came.
fn next_command(
    rx: &Receiver<Command>,
    deadline: Instant,
    poll_until: Instant,
) -> std::result::Result<Option<Command>, RecvTimeoutError> {
    loop {
        match rx.try_recv() {
            Ok(cmd) => return Ok(Some(cmd)),
            Err(crossbeam::channel::TryRecvError::Disconnected) => {
                return Err(RecvTimeoutError::Disconnected);
            }
            Err(crossbeam::channel::TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        if now >= poll_until {
            return match rx.recv_timeout(deadline - now) {
                Ok(cmd) => Ok(Some(cmd)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(e) => Err(e),
            };
        }
        std::thread::yield_now();
    }
}

/// How soon to vote again while tensors wait (`waiting`): at once after a vote that ran
/// batches, else after the last delay doubled, from 20 us up to the cycle time. Zero (the
/// cycle timer rules) when nothing waits.
fn revote_delay(
    waiting: bool,
    progressed: bool,
    last: std::time::Duration,
    cycle: std::time::Duration,
) -> std::time::Duration {
    if !waiting || progressed {
        return std::time::Duration::ZERO;
    }
    (last * 2)
        .max(std::time::Duration::from_micros(20))
        .min(cycle)
}

/// Runs a batch; a GPU batch is only enqueued, and what it recorded comes back.
fn run_batch(
    rt: &Runtime,
    set: &mut SetState,
    resps: &[&Response],
    entries: &mut [TensorEntry],
    replay: Option<ReplayKey>,
    timeline: &mut Option<Timeline>,
    names: &[String],
) -> Result<Option<gpu::Recorded>> {
    let mut sink = Timeline::activities(timeline, names);
    let head = resps[0];
    if gpu::on_device(head) {
        return gpu::run_device_batch(
            rt,
            &mut set.gpu,
            &set.data,
            resps,
            entries,
            replay,
            &mut sink,
        )
        .map(Some)
        .inspect_err(|e| tracing::error!("set {}: GPU {} failed: {e}", set.id, head.kind.name()));
    }
    // host memory is ready when enqueued
    sink(Some("WAIT_FOR_DATA"));
    let mut ios: Vec<&mut dyn TensorIo> =
        entries.iter_mut().map(|e| e as &mut dyn TensorIo).collect();
    match head.kind {
        OpKind::Barrier => {
            sink(Some("MPI_BARRIER"));
            let r = set.data.barrier();
            sink(None);
            r
        }
        OpKind::Join | OpKind::AddProcessSet | OpKind::RemoveProcessSet => Ok(()),
        _ => collective::execute::host(&set.data, &mut set.fusion, resps, &mut ios, &mut sink),
    }
    .map(|()| None)
    .inspect_err(|e| tracing::error!("set {}: {} failed: {e}", set.id, head.kind.name()))
}

#[cfg(test)]
mod tests {
    use super::{next_command, revote_delay};
    use crate::runtime::Command;
    use crossbeam::channel::{RecvTimeoutError, unbounded};
    use std::time::{Duration, Instant};

    #[test]
    fn next_command_polls_then_sleeps_until_the_deadline() {
        let ms = Duration::from_millis;
        let (tx, rx) = unbounded();
        // nothing comes: none at the deadline, after polling part of the time
        let t = Instant::now();
        assert!(matches!(next_command(&rx, t + ms(3), t + ms(1)), Ok(None)));
        assert!(t.elapsed() >= ms(3));
        // a command that comes while polling, and one that comes while asleep
        for poll in [ms(500), Duration::ZERO] {
            let tx2 = tx.clone();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(ms(2));
                tx2.send(Command::Shutdown).unwrap();
            });
            let t = Instant::now();
            let got = next_command(&rx, t + ms(5000), t + poll);
            assert!(matches!(got, Ok(Some(Command::Shutdown))), "poll {poll:?}");
            assert!(t.elapsed() < ms(4000));
            sender.join().unwrap();
        }
        // a command already there is returned even past the deadline
        tx.send(Command::Shutdown).unwrap();
        let past = Instant::now() - ms(1);
        assert!(matches!(next_command(&rx, past, past), Ok(Some(_))));
        drop(tx);
        assert!(matches!(
            next_command(&rx, Instant::now() + ms(5), Instant::now()),
            Err(RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn revote_backs_off_to_the_cycle_time_and_resets_on_progress() {
        let ms = Duration::from_millis(1);
        let us = Duration::from_micros;
        let mut d = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..8 {
            d = revote_delay(true, false, d, ms);
            seen.push(d);
        }
        assert_eq!(
            &seen[..7],
            &[us(20), us(40), us(80), us(160), us(320), us(640), ms]
        );
        assert_eq!(revote_delay(true, true, d, ms), Duration::ZERO);
        assert_eq!(revote_delay(false, false, d, ms), Duration::ZERO);
        // a zero cycle time (HOROVOD_CYCLE_TIME=0) never waits
        assert_eq!(
            revote_delay(true, false, us(20), Duration::ZERO),
            Duration::ZERO
        );
    }
}
