//! Launching agreed work: a vote's responses become fused batches (`fusion::planner`), run by
//! the set's own executor (`runtime::executor`) or handed to a channel's, and completed; an
//! offline plan's batches too.

use std::sync::Arc;
use std::time::Duration;

use crate::collective::plan::{self, batch_bytes};
use crate::collective::replay::{ReplayKey, batch_fingerprint};
use crate::collective::{self, TensorIo};
use crate::compress::Codec;
use crate::error::{Error, Result, Stall};
use crate::fusion::planner::plan_segments;
use crate::hashing::HashMap;
use crate::message::{OpKind, Request, Response};
use crate::negotiate::set::PlanBatch;
use crate::runtime::Runtime;
use crate::runtime::channel::{self, Job};
use crate::runtime::entry::{InputMem, OutputMem, TensorEntry};
use crate::runtime::executor::check_finite;
use crate::runtime::handle::Handle;
use crate::runtime::job::JobSettings;
use crate::runtime::sets::SetState;
use crate::runtime::timeline::{BatchOf, Timeline};
use crate::runtime::{finisher, gpu};
use crate::transport::Transport;

/// A tensor a channel holds.
struct Pending {
    handle: Option<Arc<Handle>>,
    index: usize,
}

/// What is launched and not complete: batches on channels, GPU batches on the finisher.
pub(crate) struct Launcher {
    /// This rank (for test faults).
    me: i32,
    /// Batches handed to channels and not back yet: their tensors, to fail them if a channel
    /// never returns at shutdown.
    in_channels: HashMap<u64, Vec<Pending>>,
    next_job: u64,
    /// Completes GPU tensors once their events fire (started with the first GPU batch).
    finisher: Option<finisher::Finisher>,
}

impl Launcher {
    pub fn new(me: i32) -> Launcher {
        Launcher {
            me,
            in_channels: HashMap::default(),
            next_job: 0,
            finisher: None,
        }
    }

    /// Launches a vote's agreed responses of `set`, batch by batch in agreed order. Process set
    /// changes are not run here: they come back, in order, for the loop that owns the sets.
    pub fn launch(
        &mut self,
        rt: &Arc<Runtime>,
        settings: &JobSettings,
        set: &mut SetState,
        responses: &[Arc<Response>],
        groups: &[usize],
        timeline: &mut Option<Timeline>,
    ) -> Vec<Arc<Response>> {
        let mut set_changes = Vec::new();
        if let Some(t) = timeline.as_mut() {
            let names: Vec<&str> = responses.iter().map(|r| r.name.as_str()).collect();
            t.vote(set.id, &names, groups);
        }
        let batches = plan_segments(
            responses,
            groups,
            settings.fusion_threshold,
            set.direct_bytes,
            &settings.compression,
        );
        for batch in batches {
            let resps: Vec<&Response> = batch.members.iter().map(|i| &*responses[*i]).collect();
            let head = resps[0];
            if matches!(head.kind, OpKind::AddProcessSet | OpKind::RemoveProcessSet)
                && head.error.is_none()
            {
                set_changes.push(responses[batch.members[0]].clone());
                continue;
            }
            if head.kind == OpKind::Allreduce && crate::config::test_fault("panic", self.me) {
                panic!("test fault: panic before an agreed batch");
            }
            if head.kind == OpKind::Allreduce && crate::config::test_fault("stop_in_batch", self.me)
            {
                // as a hung rank: the whole process stops, mid-step
                crate::config::stop_this_process();
            }
            if head.kind == OpKind::Allreduce && crate::config::test_fault("slow_in_batch", self.me)
            {
                // a collective that outlasts the stall limit with every rank inside it
                let _inside = crate::transport::mpi::blocked("a slow collective (test fault)");
                let limit = rt.stall().limit().unwrap_or_default();
                std::thread::sleep(limit + std::time::Duration::from_secs(2));
            }
            if head.device >= 0 && crate::config::test_fault("slow_gpu_launch", self.me) {
                // a GPU batch the ranks agree on late (a slow peer): what a stream waiting on
                // the device for it must outwait
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
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
            let Some(mut entries) = local_entries(set, &resps) else {
                continue;
            };
            // how the batch runs, and whether a fused GPU allreduce may be replayed from a
            // graph: decided once, from agreed data
            let plan = set.executor.plan(&resps, batch.codec);
            if let Some(t) = timeline.as_mut() {
                let of = BatchOf::Vote(&batch.members);
                t.batch(of, plan.route.name(), &plan.codec.label());
            }
            let replay = (plan.replayable && head.error.is_none()).then(|| ReplayKey {
                batch: batch_fingerprint(&resps),
                epoch: set.graph_epoch,
            });
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
                let pending = entries
                    .iter()
                    .map(|e| Pending {
                        handle: e.handle.clone(),
                        index: e.index,
                    })
                    .collect();
                self.in_channels.insert(id_job, pending);
                set.channels[k].send(Job {
                    id: id_job,
                    seq,
                    set: set.id,
                    resps: resps.iter().map(|r| (*r).clone()).collect(),
                    entries,
                    plan,
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
                    rt.metrics.add_batch(entries.len() as u64, bytes as u64);
                    let mut sink = Timeline::activities(timeline, &names);
                    set.executor
                        .run(rt, plan, &resps, &mut entries, replay, &mut sink)
                        .inspect_err(|e| {
                            let on = if plan::on_device(head) { "GPU " } else { "" };
                            tracing::error!("set {}: {on}{} failed: {e}", set.id, head.kind.name())
                        })
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
                    self.finish_device(rt, entries, recorded);
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
        set_changes
    }

    /// GPU tensors complete when their batch's event fires (on the finisher thread), or at
    /// once with asynchronous completion (the handle's event is then what consumers wait on).
    fn finish_device(
        &mut self,
        rt: &Arc<Runtime>,
        mut entries: Vec<TensorEntry>,
        recorded: gpu::Recorded,
    ) {
        // ferrovod's own device memory of the batch (a joined rank's zeros, a failed
        // allocation's scratch) goes once the batch's event has fired, in stream order: nothing
        // reads it after the batch
        for m in entries.iter_mut().flat_map(|e| e.take_device_memory()) {
            recorded.gpu.retire(m, Some(recorded.event.clone()));
        }
        if self.finisher.is_none() {
            match finisher::Finisher::spawn(rt.clone()) {
                Ok(f) => self.finisher = Some(f),
                Err(e) => {
                    tracing::error!("{e}; waiting for the GPU on the background thread");
                    let mut recorded = recorded;
                    let outcome = recorded
                        .event
                        .synchronize()
                        .and_then(|()| recorded.outcome());
                    finisher::complete(entries, outcome, Some(&recorded));
                    return;
                }
            }
        }
        let Some(f) = &self.finisher else { return };
        // a checked batch's outcome is known only once it is done
        if rt.config.async_completion && recorded.nan.is_none() {
            finisher::complete(entries, Ok(()), Some(&recorded));
            return;
        }
        f.send(finisher::Finish { recorded, entries });
    }

    /// A channel's batch came back: account for it and complete its tensors.
    pub fn batch_done(
        &mut self,
        rt: &Arc<Runtime>,
        done: channel::Done,
        timeline: &mut Option<Timeline>,
    ) {
        self.in_channels.remove(&done.id);
        match &done.outcome {
            Ok(()) => {
                let bytes: usize = done
                    .resps
                    .iter()
                    .map(|r| r.num_elements() as usize * r.dtype.size())
                    .sum();
                rt.metrics
                    .add_batch(done.entries.len() as u64, bytes as u64);
            }
            Err(e) => tracing::error!("set {}: channel batch failed: {e}", done.set),
        }
        if let Some(t) = timeline.as_mut() {
            for r in &done.resps {
                let shape = format!("{:?}", r.shape);
                t.end(&r.name, Some((r.dtype.name(), &shape)));
            }
        }
        if let (Ok(()), Some(recorded)) = (&done.outcome, done.recorded) {
            self.finish_device(rt, done.entries, *recorded);
            return;
        }
        for e in done.entries {
            e.complete(done.outcome.clone(), None);
        }
    }

    /// Whether batches handed to channels have not come back.
    pub fn on_channels(&self) -> bool {
        !self.in_channels.is_empty()
    }

    /// Fails the tensors of every batch still on a channel; returns how many batches.
    pub fn fail_channel_batches(&mut self, err: &Error) -> usize {
        let n = self.in_channels.len();
        for (_, pending) in self.in_channels.drain() {
            for p in pending {
                if let Some(h) = p.handle {
                    h.complete_one(p.index, Err(err.clone()), None);
                }
            }
        }
        n
    }

    /// Waits until every GPU batch handed to the finisher has completed.
    pub fn close_finisher(&mut self) {
        if let Some(mut f) = self.finisher.take() {
            f.close();
        }
    }
}

/// The tensors of an agreed batch held here, in response order; `None` when the batch cannot
/// run here (its tensors are failed). Every agreed collective is run by every rank: a rank
/// without the tensor (it has joined) contributes zeros to allreduce and takes part in barrier.
fn local_entries(set: &mut SetState, resps: &[&Response]) -> Option<Vec<TensorEntry>> {
    let head = resps[0];
    let mut entries: Vec<TensorEntry> = Vec::with_capacity(resps.len());
    for r in resps {
        match set.entries.remove(&r.name) {
            Some(e) => entries.push(e),
            None if r.error.is_none() && matches!(r.kind, OpKind::Allreduce | OpKind::Barrier) => {
                let bytes = match r.kind {
                    OpKind::Allreduce => r.num_elements() as usize * r.dtype.size(),
                    _ => 0,
                };
                let req = Request {
                    rank: set.executor.data.rank() as i32,
                    kind: r.kind,
                    dtype: r.dtype,
                    name: r.name.clone(),
                    shape: r.shape.clone(),
                    root: r.root,
                    device: r.device,
                    reduce_op: r.reduce_op,
                    prescale: r.prescale,
                    postscale: r.postscale,
                    compression: r.compression,
                    multistep: r.multistep,
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
    if entries.len() == resps.len() {
        return Some(entries);
    }
    // Only error responses (nothing runs) or kinds the coordinator refuses while a rank has
    // joined can lack a local tensor; anything else is a bug, reported here.
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
    None
}

/// Runs a batch of the frozen plan (offline negotiation) with its escape flag, and completes
/// its tensors unless someone raised the flag (then they go back to `set.entries`). Returns
/// whether the batch escaped.
pub(crate) fn run_plan_batch(
    rt: &Runtime,
    set: &mut SetState,
    batch: &PlanBatch,
    timeline: &mut Option<Timeline>,
) -> Result<bool> {
    let me = rt.topology.get().map_or(0, |t| t.rank);
    if crate::config::test_fault("offline", me) {
        return Err(Error::Internal("test fault: offline".into()));
    }
    let stall = rt.stall();
    let resps = &batch.responses;
    let have = batch.have;
    let mut entries: Vec<TensorEntry> = match have {
        true => resps
            .iter()
            .filter_map(|r| set.entries.remove(&r.name))
            .collect(),
        false => Vec::new(),
    };
    let names: Vec<String> = resps.iter().map(|r| r.name.clone()).collect();
    if have && let Some(t) = timeline.as_mut() {
        for n in &names {
            t.begin(n, "ALLREDUCE");
        }
    }
    let refs: Vec<&Response> = resps.iter().collect();
    let bytes = batch_bytes(&refs);
    let plan = set.executor.plan_frozen(&refs);
    if have && let Some(t) = timeline.as_mut() {
        let of = BatchOf::Plan(batch.index, &names);
        t.batch(of, plan.route.name(), &plan.codec.label());
    }
    // counted before the batch runs (which counts PowerSGD's first steps) and added if it ran
    let sent: Vec<(Codec, usize)> = {
        let wire = set.executor.wire(plan.codec);
        refs.iter().map(|r| wire.sent(r)).collect()
    };
    let flagged = {
        // a rank without the batch's tensors has no spans to mark
        let traced: &[String] = if have { &names } else { &[] };
        let mut sink = Timeline::activities(timeline, traced);
        let mut ios: Vec<&mut dyn TensorIo> =
            entries.iter_mut().map(|e| e as &mut dyn TensorIo).collect();
        let ios = if have { Some(&mut ios[..]) } else { None };
        let mut warned = false;
        let mut slow = |waited: Duration| {
            if stall.enabled && waited >= stall.warn_after && !warned {
                warned = true;
                tracing::warn!(
                    "offline negotiation: plan batch {} ({}) has waited {} s for other ranks; a rank has not submitted these tensors or stopped submitting",
                    batch.index,
                    names.join(", "),
                    waited.as_secs()
                );
            }
        };
        let wait = collective::Wait {
            limit: stall.limit(),
            slow: &mut slow,
        };
        (set.executor).run_flagged(rt, resps, &plan, ios, batch.raise, wait, &mut sink)
    };
    if have && let Some(t) = timeline.as_mut() {
        for (n, r) in names.iter().zip(resps) {
            let shape = format!("{:?}", r.shape);
            t.end(n, Some((r.dtype.name(), &shape)));
        }
    }
    let escaped = match flagged {
        Ok(collective::Flagged::Done { raised }) => Ok(raised),
        Ok(collective::Flagged::TimedOut) => Err(Error::Stalled(Box::new(Stall {
            rank: me,
            limit: stall.shutdown_after,
            waiting_in: format!("offline plan batch {} ({})", batch.index, names.join(", ")),
            missing: set.ctrl.missing_ranks(),
            hint: "A missing rank has not submitted these tensors, stopped submitting, or stopped responding.",
        }))),
        Err(e) => Err(e),
    };
    let escaped = match escaped {
        Ok(raised) => raised,
        Err(e) => {
            // callers see a stall as the job's shutdown, whichever wait found it
            let theirs = match &e {
                Error::Stalled(_) => Error::ShutDown(e.to_string()),
                other => other.clone(),
            };
            for e2 in entries {
                e2.complete(Err(theirs.clone()), None);
            }
            return Err(e);
        }
    };
    if escaped {
        // this batch did not count: its tensors go online with the rest
        for e in entries {
            set.entries.insert(e);
        }
        return Ok(true);
    }
    rt.metrics.add_batch(entries.len() as u64, bytes as u64);
    for (codec, bytes) in sent {
        rt.metrics.add_wire_bytes(codec, bytes as u64);
    }
    let outcome = match plan.nan_check {
        true => {
            let mut ios: Vec<&mut dyn TensorIo> =
                entries.iter_mut().map(|e| e as &mut dyn TensorIo).collect();
            check_finite(&refs, &mut ios)
        }
        false => Ok(()),
    };
    if let Err(e) = &outcome {
        tracing::error!("set {}: offline plan batch {}: {e}", set.id, batch.index);
    }
    for e in entries {
        e.complete(outcome.clone(), None);
    }
    Ok(false)
}
