//! The background thread: MPI setup, then one cycle after another — take new submissions, and
//! for each process set: negotiate (`negotiate::set`), launch what was agreed
//! (`runtime::launch`: fusion, compression, the collective), complete — until every rank agrees
//! to stop. This file schedules; the stages decide.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use crate::collective::TensorIo;
use crate::collective::p2p::Finished;
use crate::config::NegotiationMode;
use crate::error::{Error, Result, SHUT_DOWN_MESSAGE};
use crate::fusion::autotune::{self, Params};
use crate::message::{OpKind, Response};
use crate::negotiate::learn::LearnContext;
use crate::negotiate::online::CycleOutcome;
use crate::negotiate::set::Step;
use crate::runtime::entry::TensorEntry;
use crate::runtime::job::{JobSettings, open_job};
use crate::runtime::launch::{Launcher, run_plan_batch};
use crate::runtime::schedule::{POLL_AFTER_SUBMIT, next_command, revote_delay};
use crate::runtime::sets::Sets;
use crate::runtime::submit::unknown_set;
use crate::runtime::timeline::Timeline;
use crate::runtime::{Command, InitOptions, Runtime};
use crate::transport::Transport;
use crate::transport::mpi::{MpiComm, Watchdog, finalize_mpi, init_mpi};

mod stop;

struct Background {
    rt: Arc<Runtime>,
    settings: JobSettings,
    world: MpiComm,
    sets: Sets,
    launcher: Launcher,
    timeline: Option<Timeline>,
    want_shutdown: bool,
    /// A command other than a submission came since the last vote.
    kicked: bool,
    /// Why the job is stopping, when it is not a plain shutdown request.
    reason: Option<String>,
    /// A collective was abandoned after a stall: MPI must not be finalized (it would wait for
    /// it), and the job ends when this process exits.
    mpi_unclean: bool,
    /// The cycle time in force (autotune may change it).
    cycle_time: std::time::Duration,
    autotune: Option<autotune::Windows>,
    /// How soon to test sends and receives in flight again: 20 us after one moved, doubling
    /// up to 1 ms while none does (an idle receive does not keep a core busy).
    p2p_delay: std::time::Duration,
    /// Ends the job when a blocking MPI call outlives the stall shutdown time.
    _watchdog: Watchdog,
}

/// Says how Open MPI's TCP transport moves large messages; where ranks span nodes and it uses
/// `put` (MPI started before ferrovod, or the job asked for it), at info level with the remedy.
fn log_tcp_transport(rt: &Runtime) {
    let Some(put) = crate::transport::mpi::tcp_put_in_force() else {
        return;
    };
    let nodes = rt.topology.get().map_or(1, |t| t.cross_size);
    if put && nodes > 1 {
        tracing::info!(
            "Open MPI's TCP transport sends large messages with put: two ranks exchanging at once may take turns on the link; OMPI_MCA_btl_tcp_flags={} before MPI starts avoids it",
            crate::transport::mpi::OMPI_TCP_FLAGS
        );
    } else {
        tracing::debug!(
            "Open MPI's TCP transport sends large messages {}",
            if put {
                "with put"
            } else {
                "in fragments (no put)"
            }
        );
    }
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
    log_tcp_transport(&rt);
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

impl Background {
    fn start(rt: Arc<Runtime>, opts: &InitOptions, multiple: bool) -> Result<Background> {
        let job = open_job(&rt, &opts.comm, multiple)?;
        let (world, settings, topo) = (job.world, job.settings, job.topology);

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
        let bg_world = world.dup()?;
        let watchdog = Watchdog::start(settings.stall.limit(), world.dup()?, multiple);
        let mut sets = Sets::new(world, job.nodes, &rt, &settings)?;
        for ranks in &opts.process_sets {
            // identical lists on every rank (checked above): every rank fails alike
            let sorted = super::process_set_ranks(ranks, Some(size))?;
            sets.create(&bg_world, sorted, &rt, &settings)?;
        }
        sets.publish(&rt);
        let alone = sets.all.len() == 1;
        if let Some(global) = sets.member.get_mut(&0) {
            // offline mode: the plan file's plan, if every rank loaded the same one
            let plan_file = rt.config.plan_file.as_deref();
            // over the unbounded world: a rank stuck here is the watchdog's (a bounded wait that
            // gave up would leave its request posted while start-up fails and finalizes MPI)
            global.negotiation.load_plan(&bg_world, plan_file, alone)?;
        }
        let mut bg = Background {
            settings,
            sets,
            launcher: Launcher::new(topo.rank),
            timeline: None,
            want_shutdown: false,
            kicked: false,
            reason: None,
            mpi_unclean: false,
            cycle_time: rt.config.cycle_time,
            autotune: None,
            p2p_delay: P2P_POLL_MIN,
            world: bg_world,
            rt: rt.clone(),
            _watchdog: watchdog,
        };
        if settings.autotune_window > 0 {
            if settings.negotiation == NegotiationMode::Offline {
                tracing::warn!("HOROVOD_AUTOTUNE is not used with offline negotiation");
            } else {
                let log = (topo.rank == 0)
                    .then(|| rt.config.autotune_log.as_ref())
                    .flatten()
                    .and_then(|p| std::fs::File::create(p).ok());
                let start = Params {
                    fusion_threshold: settings.fusion_threshold,
                    cycle_time: rt.config.cycle_time,
                };
                bg.autotune = Some(autotune::Windows::new(
                    start,
                    rt.config.autotune_warmup,
                    settings.autotune_window,
                    log,
                ));
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

    /// Whether to vote now rather than at the timer: a shutdown, a finished channel batch,
    /// a frozen plan's own queue, or a submission that could let a vote agree on more (a
    /// burst into a learned group votes once, when the group is complete here).
    fn vote_wanted(&self) -> bool {
        self.kicked
            || self.want_shutdown
            || self
                .sets
                .member
                .values()
                .any(|s| s.negotiation.wants_step())
    }

    fn receive(&mut self, cmd: Command) {
        // a GPU batch coming back from its channel was only launched: nothing to vote on yet
        let launched_on_gpu = matches!(&cmd, Command::BatchDone(d) if d.recorded.is_some());
        if !matches!(cmd, Command::Submit { .. }) && !launched_on_gpu {
            self.kicked = true;
        }
        match cmd {
            Command::Shutdown => self.want_shutdown = true,
            Command::BatchDone(done) => {
                self.launcher.batch_done(&self.rt, done, &mut self.timeline)
            }
            Command::PointToPoint { set, tag, entries } => self.submit_p2p(set, tag, entries),
            Command::Submit { set, entries } => {
                let Some(state) = self.sets.member.get_mut(&set) else {
                    let err = Error::InvalidArgument(
                        "Process set provided does not exist, or has not been registered.".into(),
                    );
                    for e in entries {
                        e.complete(Err(err.clone()), None);
                    }
                    return;
                };
                let now = Instant::now();
                for e in entries {
                    if state.negotiation.submit(&e.request, e.timeout, now)
                        && let Some(t) = self.timeline.as_mut()
                    {
                        t.begin(
                            &e.request.name,
                            &format!("NEGOTIATE_{}", e.request.kind.name()),
                        );
                    }
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
                let p2p_busy = self.sets.member.values().any(|s| s.p2p.busy());
                let until = match p2p_busy {
                    true => next_cycle.min(Instant::now() + self.p2p_delay),
                    false => next_cycle,
                };
                match next_command(rx, until, poll_until) {
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
                if let Err(reason) = self.progress_p2p() {
                    return self.leave(reason);
                }
                if self.vote_wanted() {
                    break;
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.receive(cmd);
            }
            // once per cycle too: votes that take longer than a cycle (a slow rank) run back
            // to back without the wait above, and a peer's transfer must not wait on them
            if let Err(reason) = self.progress_p2p() {
                return self.leave(reason);
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
            let ids: Vec<i32> = self.sets.member.keys().copied().collect();
            let mut progressed = false;
            for id in ids {
                match self.step_set(id) {
                    ControlFlow::Continue(p) => progressed |= p,
                    ControlFlow::Break(reason) => return reason,
                }
            }
            // Tensors still wait here: vote again soon rather than a cycle time later — at once
            // after a vote that ran batches, else after a delay doubling from 20 us up to the
            // cycle time. A vote that ran just before the other ranks' tensors arrived cost a
            // whole cycle time per round of back-to-back GPU allreduces; ranks whose waiting
            // tensors never match back off to the cycle time.
            // (tensors waiting only in groups still incomplete here wait for the group: a
            // vote could not agree on them, and the cycle timer keeps votes going)
            let waiting =
                (self.sets.member.values()).any(|s| s.negotiation.waiting(!s.entries.is_empty()));
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

    /// One set's part of a cycle: its negotiation's next steps, run. Continues with whether a
    /// vote agreed on something; breaks with the reason the loop ends.
    fn step_set(&mut self, id: i32) -> ControlFlow<Option<String>, bool> {
        let want = id == 0 && self.want_shutdown;
        loop {
            let Some(set) = self.sets.member.get_mut(&id) else {
                return ControlFlow::Continue(false);
            };
            let started = Instant::now();
            crate::probe::mark("vote", set.entries.len());
            let abort = want && self.rt.gpu_aborting();
            let moved = self.rt.gpu_moved();
            let batch = match set.negotiation.next(&set.ctrl, want, abort, moved, started) {
                Ok(Step::Idle) => return ControlFlow::Continue(false),
                Ok(Step::Voted(outcome)) => return self.voted(id, Ok(outcome), started),
                Err(e) => return self.voted(id, Err(e), started),
                Ok(Step::Plan(batch)) => batch,
            };
            let escaped = match run_plan_batch(&self.rt, set, &batch, &mut self.timeline) {
                Ok(escaped) => escaped,
                Err(e) => {
                    let why = format!("ferrovod offline negotiation failed: {e}");
                    return ControlFlow::Break(self.leave(why));
                }
            };
            let online = set.negotiation.plan_batch_ran(escaped, Instant::now());
            if escaped {
                // someone raised the flag: everyone negotiates online from the next cycle
                tracing::info!(
                    "offline negotiation: left the plan at batch {}; negotiating online",
                    batch.index
                );
                if let Some(t) = self.timeline.as_mut() {
                    for req in online {
                        t.begin(&req.name, &format!("NEGOTIATE_{}", req.kind.name()));
                    }
                }
                return ControlFlow::Continue(false);
            }
        }
    }

    /// After a vote of set `id`: stops on a failure or an agreed shutdown, else launches what
    /// was agreed and lets the global set learn, tune and freeze from it.
    fn voted(
        &mut self,
        id: i32,
        outcome: Result<CycleOutcome>,
        started: Instant,
    ) -> ControlFlow<Option<String>, bool> {
        crate::probe::mark("voted", outcome.as_ref().map_or(0, |o| o.responses.len()));
        if let Ok(o) = &outcome {
            self.rt.metrics.add_negotiation(
                o.control_collectives.into(),
                o.control_bytes,
                started.elapsed(),
            );
        }
        if outcome.is_err() {
            // a control collective may still be posted, or the others wait in one this rank
            // left: finalizing would wait for ever
            self.mpi_unclean = true;
        }
        let stop = match &outcome {
            Err(e @ (Error::ShutDown(_) | Error::Stalled(_))) => Some(e.to_string()),
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
            return ControlFlow::Break(self.reason.clone());
        }
        if stop.is_some() {
            // Only this set's members know: stop using the set, and shut everyone down through
            // the global set's next vote.
            self.want_shutdown = true;
            let err = Error::ShutDown(self.reason.clone().unwrap_or_default());
            self.sets.drop_set(id, err);
            return ControlFlow::Continue(false);
        }
        let Ok(outcome) = outcome else {
            return ControlFlow::Continue(false);
        };
        let alone_before = self.sets.all.len() == 1;
        let Some(set) = self.sets.member.get_mut(&id) else {
            return ControlFlow::Continue(false);
        };
        if outcome.gpu_moved {
            set.graph_epoch += 1;
        }
        let progressed = !outcome.responses.is_empty();
        if progressed {
            crate::probe::mark("agreed", outcome.responses.len());
            let changes = self.launcher.launch(
                &self.rt,
                &self.settings,
                set,
                &outcome.responses,
                &outcome.groups,
                &mut self.timeline,
            );
            for change in changes {
                (self.sets).change(&self.world, &change, &self.rt, &self.settings);
            }
        }
        if id != 0 {
            return ControlFlow::Continue(progressed);
        }
        // after the launch: learning shapes only later votes (at the same point everywhere)
        self.learn(&outcome.responses, alone_before, outcome.groups_dissolved);
        if let Err(e) = self.autotune_cycle() {
            return ControlFlow::Break(self.leave(format!("ferrovod autotune failed: {e}")));
        }
        if let Err(e) = self.freeze() {
            let why = format!("ferrovod offline negotiation failed: {e}");
            return ControlFlow::Break(self.leave(why));
        }
        ControlFlow::Continue(progressed)
    }

    /// Hands sends and receives to their set's point-to-point state; a set this rank is not
    /// in fails them.
    fn submit_p2p(&mut self, set: i32, tag: i32, entries: Vec<TensorEntry>) {
        self.p2p_delay = P2P_POLL_MIN;
        let Some(state) = self.sets.member.get_mut(&set) else {
            for e in entries {
                e.complete(Err(unknown_set()), None);
            }
            return;
        };
        let now = Instant::now();
        for e in entries {
            let req = e.request.clone();
            // a receive's negative peer: any rank
            let peer = usize::try_from(req.root).ok();
            let name = req.name.clone();
            let bytes = e.input().len();
            match (req.kind, peer) {
                (OpKind::Send, Some(peer)) => {
                    let data = e.input().to_vec();
                    if let Err((e, err)) = state.p2p.send(e, name, peer, tag, data, now) {
                        e.complete(Err(err), None);
                    }
                }
                _ => state.p2p.recv(e, name, peer, tag, bytes, now),
            }
        }
    }

    /// Moves every set's sends and receives along, completing what finished. Err: one waited
    /// past the stall limit, or MPI failed under them; the rank stops (a transfer given up on
    /// could still be matched later, out of turn).
    fn progress_p2p(&mut self) -> std::result::Result<(), String> {
        let now = Instant::now();
        let mut moved = false;
        for set in self.sets.member.values_mut() {
            if !set.p2p.busy() {
                continue;
            }
            let (finished, m) = set.p2p.progress(now).map_err(|e| match e {
                Error::Stalled(_) => e.to_string(),
                e => format!("ferrovod point-to-point transfer failed: {e}"),
            })?;
            moved |= m;
            for f in finished {
                match f {
                    Finished::Sent(e, outcome) => e.complete(outcome, None),
                    Finished::Received(mut e, Ok((bytes, source))) => {
                        e.split_io().1.copy_from_slice(&bytes);
                        // the handle's value: the global rank the message came from
                        e.complete(Ok(()), Some(source))
                    }
                    Finished::Received(e, Err(err)) => e.complete(Err(err), None),
                }
            }
        }
        self.p2p_delay = match moved {
            true => P2P_POLL_MIN,
            false => (self.p2p_delay * 2).min(P2P_POLL_MAX),
        };
        Ok(())
    }

    /// Ends the loop on this rank alone, without an agreed shutdown: the others may wait in a
    /// collective this rank left, so MPI is not finalized (they end at their stall limit).
    fn leave(&mut self, reason: String) -> Option<String> {
        self.mpi_unclean = true;
        tracing::error!("{reason}");
        self.reason.get_or_insert(reason);
        self.reason.clone()
    }

    /// The global set learns groups or a plan from a vote's responses; `alone_before`: it was
    /// the only set when they were agreed (learning needs it alone throughout).
    fn learn(&mut self, responses: &[Arc<Response>], alone_before: bool, dissolved: bool) {
        let ctx = LearnContext {
            fusion_threshold: self.settings.fusion_threshold,
            direct_bytes: self.sets.member.get(&0).map_or(0, |s| s.direct_bytes),
            codecs: self.settings.compression,
            alone: alone_before && self.sets.all.len() == 1,
        };
        if let Some(set) = self.sets.member.get_mut(&0) {
            set.negotiation.observe(responses, ctx, dissolved);
        }
    }

    /// Counts a global-set cycle for autotune; at a window's end every rank takes rank 0's next
    /// settings (one broadcast per window, only while tuning).
    fn autotune_cycle(&mut self) -> Result<()> {
        let (Some(windows), Some(set)) = (self.autotune.as_mut(), self.sets.member.get(&0)) else {
            return Ok(());
        };
        let started = Instant::now();
        let metrics = &self.rt.metrics;
        let me = self.world.rank() as i32;
        let Some(d) = windows.cycle(&set.ctrl, || metrics.snapshot().data_bytes, me)? else {
            return Ok(());
        };
        metrics.add_negotiation(1, d.control_bytes, started.elapsed());
        self.settings.fusion_threshold = d.params.fusion_threshold;
        self.cycle_time = d.params.cycle_time;
        if d.done {
            // tuning is over on every rank at the same window: no more broadcasts
            tracing::info!(
                "autotune: fusion threshold {} B, cycle time {:?}",
                self.settings.fusion_threshold,
                self.cycle_time
            );
            self.autotune = None;
        }
        Ok(())
    }

    /// Offline mode: freezes a learned plan once its step has run (all ranks compare it).
    fn freeze(&mut self) -> Result<()> {
        let me = self.world.rank() as i32;
        let Some(set) = self.sets.member.get_mut(&0) else {
            return Ok(());
        };
        let plan_file = self.rt.config.plan_file.as_deref();
        let Some(f) = set.negotiation.freeze_if_ready(&set.ctrl, plan_file, me)? else {
            return Ok(());
        };
        let c = f.control;
        self.rt
            .metrics
            .add_negotiation(c.collectives, c.bytes, c.elapsed);
        if let Some(t) = self.timeline.as_mut() {
            for name in &f.handed_to_plan {
                t.end(name, None);
            }
        }
        Ok(())
    }
}

/// The bounds of `Background::p2p_delay`.
const P2P_POLL_MIN: std::time::Duration = std::time::Duration::from_micros(20);
const P2P_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// How long a runtime that gave up on missing ranks waits before its shutdown returns.
const UNCLEAN_EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
