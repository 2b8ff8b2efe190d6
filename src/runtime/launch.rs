//! Launching agreed work: a vote's responses become fused batches (`fusion::planner`), each
//! with its codec (`compress`), run on the set's own communicator or handed to a channel, on
//! host memory or on the GPU (where `collective::execute` picks the algorithm), and completed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::collective::cost::{Algorithm, CostModel, Link, Policy};
use crate::collective::execute::DeviceHow;
use crate::collective::hierarchical::{self, Levels, node_members};
use crate::collective::replay::{ReplayKey, batch_fingerprint};
use crate::collective::{self, ActivitySink, Algorithms, Allreduce, TensorIo, gossip};
use crate::compress::{self, Codec, Codecs, Feedback, Wire};
use crate::config::AlgorithmChoice;
use crate::dtype::DataType;
use crate::error::{Error, Result, Stall};
use crate::fusion::FusionBuffer;
use crate::fusion::planner::plan_segments;
use crate::hashing::HashMap;
use crate::message::ReduceOp;
use crate::message::{OpKind, Request, Response};
use crate::negotiate::set::PlanBatch;
use crate::runtime::Runtime;
use crate::runtime::channel::{self, Job};
use crate::runtime::entry::{InputMem, OutputMem, TensorEntry};
use crate::runtime::gpu;
use crate::runtime::handle::Handle;
use crate::runtime::job::JobSettings;
use crate::runtime::sets::SetState;
use crate::runtime::timeline::Timeline;
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;
use crate::transport::nccl;

/// A set's two levels for hierarchical collectives: this node's ranks, and this node rank on
/// every node; and how each allreduce chooses between them and the flat collective.
pub(crate) struct Hierarchy {
    local: MpiComm,
    cross: MpiComm,
    /// The set ranks of each node (`hierarchical::node_members`).
    nodes: Vec<Vec<usize>>,
    /// How allreduces choose.
    policy: Policy,
    /// Allgathers go hierarchical.
    allgather: bool,
}

impl Hierarchy {
    /// Collective over `comm` (a set's or a channel's communicator), where `node` names this
    /// rank's node. `None` when the algorithm is flat, or when the set's nodes do not hold the
    /// same number of ranks, or it has one node or one rank per node and hierarchical is not
    /// asked for (all agreed: every rank
    /// decides from the same allgather); rank 0 of the set logs the choice once when `log`.
    /// With `auto`, the model's parameters are measured here and rank 0's are used everywhere.
    pub fn open(
        comm: &MpiComm,
        node: i32,
        settings: &JobSettings,
        log: bool,
    ) -> Result<Option<Hierarchy>> {
        let choice = settings.algorithm;
        if choice == AlgorithmChoice::Flat && !settings.hierarchical_allgather {
            return Ok(None);
        }
        let local = comm.split(node)?;
        let cross = comm.split(local.rank() as i32)?;
        let sizes = comm.allgather_i64(local.size() as i64)?;
        let nodes = node_members(&comm.allgather_i64(node as i64)?);
        let even = sizes.iter().all(|s| *s == sizes[0]);
        let say = log && comm.rank() == 0;
        if !even {
            if say && choice == AlgorithmChoice::Hierarchical {
                tracing::warn!(
                    "hierarchical allreduce: the set's nodes hold {sizes:?} ranks; it needs the same number on each; using the flat one"
                );
            }
            return Ok(None);
        }
        // one node, or one rank per node: the flat collective does the same work, unless the
        // hierarchical one is asked for (as Horovod runs it then; on GPUs: NCCL inside the node,
        // MPI across)
        if (cross.size() == 1 || local.size() == 1) && choice != AlgorithmChoice::Hierarchical {
            return Ok(None);
        }
        let policy = match choice {
            AlgorithmChoice::Auto => Policy::Auto(measure(comm, &local, &cross, &nodes)?),
            AlgorithmChoice::Hierarchical => Policy::Hierarchical,
            AlgorithmChoice::Flat => Policy::Flat,
        };
        if say {
            let (nodes, per) = (cross.size(), local.size());
            match &policy {
                Policy::Auto(m) => tracing::info!(
                    "allreduce algorithm auto over {nodes} nodes of {per} ranks: a call inside a node {:.1} us + {:.2} GB/s, across nodes {:.1} us + {:.2} GB/s; a small allreduce flat {:.1} us, hierarchical {:.1} us; hierarchical from {}",
                    m.local.alpha * 1e6,
                    1e-9 / m.local.beta,
                    m.cross.alpha * 1e6,
                    1e-9 / m.cross.beta,
                    m.flat_alpha * 1e6,
                    m.hier_alpha * 1e6,
                    m.crossover()
                        .map_or("no size".to_string(), |b| format!("{b} bytes"))
                ),
                _ => tracing::info!(
                    "hierarchical collectives over {nodes} nodes of {per} ranks: allreduce {:?}, allgather {}",
                    policy,
                    settings.hierarchical_allgather
                ),
            }
        }
        Ok(Some(Hierarchy {
            local,
            cross,
            nodes,
            policy,
            allgather: settings.hierarchical_allgather,
        }))
    }

    /// How this set picks each allreduce's algorithm.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn levels(&self) -> Levels<'_> {
        Levels {
            local: &self.local,
            cross: &self.cross,
            nodes: &self.nodes,
        }
    }
}

/// Bytes of the probe's large message.
const PROBE_BYTES: usize = 1 << 20;

/// The cost model of the set, measured: each level's small allreduce (a few bytes: the latency
/// of a call, the median of `CALLS`, as a step meets it, scheduling included) and allreduce of
/// `PROBE_BYTES` (bandwidth, the best of a few), and the whole set's small allreduce, flat and
/// hierarchical (whose three calls in a row cost more than their parts where a node's ranks
/// share few cores); rank 0's figures everywhere.
fn measure(
    comm: &MpiComm,
    local: &MpiComm,
    cross: &MpiComm,
    nodes: &[Vec<usize>],
) -> Result<CostModel> {
    // a rank whose own measurement differs must still choose as the others do: with this
    // test fault, rank N sees its node's level a thousand times slower
    let skewed = crate::config::test_fault("slow_probe", comm.rank() as i32);
    // seconds of each of `rounds` calls of `call`, after two untimed ones (MPI connects a
    // level's ranks on first use), sorted
    let timed = |rounds: usize, call: &mut dyn FnMut() -> Result<()>| -> Result<Vec<f64>> {
        for _ in 0..2 {
            call()?;
        }
        let mut times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            call()?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times)
    };
    // a small call's latency as steps meet it (the median); every latency probe moves the
    // same few bytes, 8 for each rank of the node (each gets a part of the reduce-scatter)
    let small = 8 * local.size();
    let latency = |level: &MpiComm| -> Result<f64> {
        let mut buf = vec![0u8; small];
        let times = timed(CALLS, &mut || {
            level.allreduce(None, &mut buf, DataType::U8, ReduceOp::Max)
        })?;
        Ok(times[CALLS / 2])
    };
    let link = |level: &MpiComm, slow: bool| -> Result<Link> {
        let n = level.size();
        let alpha = latency(level)?;
        // bandwidth as the link gives it at best
        let mut buf = vec![0u8; PROBE_BYTES];
        let best = timed(3, &mut || {
            level.allreduce(None, &mut buf, DataType::U8, ReduceOp::Max)
        })?[0];
        let moved = 2.0 * (n - 1) as f64 / n as f64 * PROBE_BYTES as f64;
        let beta = ((best - alpha) / moved).max(1e-13);
        // as if this rank saw a network a thousand times slower
        let k = if slow { 1000.0 } else { 1.0 };
        Ok(Link {
            alpha: alpha * k,
            beta: beta * k,
        })
    };
    let (l, c) = (link(local, skewed)?, link(cross, false)?);
    // flat and hierarchical in alternating blocks of calls, so that both meet the same
    // conditions; a block's mean, since one call's time depends on how late this rank came
    let levels = Levels {
        local,
        cross,
        nodes,
    };
    let mut buf = vec![0u8; small];
    let (mut flat, mut hier) = (Vec::new(), Vec::new());
    for round in 0..BLOCKS + 1 {
        let t = Instant::now();
        for _ in 0..BLOCK_CALLS {
            comm.allreduce(None, &mut buf, DataType::U8, ReduceOp::Max)?;
        }
        let t_flat = t.elapsed().as_secs_f64() / BLOCK_CALLS as f64;
        let t = Instant::now();
        for _ in 0..BLOCK_CALLS {
            hierarchical::allreduce(&levels, &mut buf, DataType::U8, ReduceOp::Max)?;
        }
        // the first block untimed: MPI connects on first use
        if round > 0 {
            flat.push(t_flat);
            hier.push(t.elapsed().as_secs_f64() / BLOCK_CALLS as f64);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (flat, hier) = (median(flat), median(hier));
    let mine: Vec<u8> = [l.alpha, l.beta, c.alpha, c.beta, flat, hier]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let got = comm.broadcast_bytes(mine, 0)?;
    let v: Vec<f64> = got
        .chunks_exact(8)
        .map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            f64::from_le_bytes(a)
        })
        .collect();
    if v.len() != 6 {
        return Err(Error::Internal(
            "the cost model came as the wrong size".into(),
        ));
    }
    Ok(CostModel {
        local: Link {
            alpha: v[0],
            beta: v[1],
        },
        cross: Link {
            alpha: v[2],
            beta: v[3],
        },
        flat_alpha: v[4],
        hier_alpha: v[5],
        per_node: local.size(),
        nodes: cross.size(),
    })
}

/// Small allreduces timed per level for the model's latencies.
const CALLS: usize = 21;

/// Blocks of small flat and hierarchical allreduces timed for the two algorithms' latencies,
/// and calls per block.
const BLOCKS: usize = 5;
const BLOCK_CALLS: usize = 8;

/// What a process set's communicators carry from one step to the next, whichever runs a
/// tensor's batch.
#[derive(Default)]
pub(crate) struct Carried {
    /// The `u8` codec's residuals.
    pub feedback: Feedback,
    /// Gossiped tensors' rounds.
    pub rounds: gossip::Rounds,
    /// Compressed gossip's public copies.
    pub replicas: gossip::Replicas,
}

/// Where batches run: a communicator with its host fusion buffer and its NCCL streams (and, for
/// hierarchical collectives, its two levels). Each set has one, and so has each of its channels.
pub(crate) struct Executor {
    pub data: MpiComm,
    pub fusion: FusionBuffer,
    /// GPU batches run here (opened by the first one).
    pub gpu: Option<gpu::NcclStreams>,
    hierarchy: Option<Hierarchy>,
    /// Flat allreduces of at least this many bytes run the ring (0: never; agreed).
    ring_min_bytes: usize,
    /// How f32 allreduces travel (agreed).
    compression: Codecs,
    /// Allreduces with NaN or Inf in their result fail (agreed).
    pub nan_check: bool,
    /// What the set's communicators carry from step to step.
    pub carried: Arc<Carried>,
    /// Every this many rounds a gossip is an exact average (0: never; agreed).
    gossip_sync_every: u32,
}

impl Executor {
    pub fn new(
        data: MpiComm,
        hierarchy: Option<Hierarchy>,
        ring_min_bytes: usize,
        settings: &JobSettings,
        carried: Arc<Carried>,
    ) -> Executor {
        Executor {
            data,
            fusion: FusionBuffer::default(),
            gpu: None,
            hierarchy,
            ring_min_bytes,
            compression: settings.compression,
            nan_check: settings.nan_check,
            carried,
            gossip_sync_every: settings.gossip_sync_every,
        }
    }

    /// The codec of a batch led by `head` (agreed: the planner fused one codec per batch).
    pub fn codec(&self, head: &Response) -> Codec {
        self.compression.of(head)
    }

    /// Runs a batch; a GPU batch is only enqueued, and what it recorded comes back.
    pub fn run(
        &mut self,
        rt: &Runtime,
        resps: &[&Response],
        entries: &mut [TensorEntry],
        replay: Option<ReplayKey>,
        sink: ActivitySink,
    ) -> Result<Option<gpu::Recorded>> {
        let head = resps[0];
        // decided from agreed values only: the batch's size, the set's policy and settings
        let bytes = batch_bytes(resps);
        let hierarchical_allreduce =
            |h: &&Hierarchy| h.policy.choose(bytes) == Algorithm::Hierarchical;
        if gpu::on_device(head) {
            let codec = self.codec(head);
            // on GPUs, allreduces NCCL reduces go hierarchical (the others stage on the host),
            // but for u8's, whose blocks cannot be summed on the way (agreed: from the codec)
            let levels = (self.hierarchy.as_ref())
                .filter(|_| head.kind == OpKind::Allreduce && nccl::reduces(head.dtype))
                .filter(|_| codec != Codec::U8)
                .filter(hierarchical_allreduce)
                .map(|h| gpu::NodeLevels {
                    local: &h.local,
                    cross: &h.cross,
                });
            if levels.is_some() {
                rt.metrics.add_hierarchical_batch();
            }
            // every codec on allreduces (agreed: from the codec and the kind); GPU gossip
            // travels uncompressed
            let codec = match head.kind {
                OpKind::Allreduce => codec,
                _ => Codec::None,
            };
            rt.metrics.add_wire(codec, head.dtype, bytes as u64);
            let how = DeviceHow {
                nan_check: self.nan_check && head.kind == OpKind::Allreduce,
                codec,
                gossip: (head.kind == OpKind::Gossip).then(|| gossip::Schedule {
                    rounds: self.carried.rounds.advance(resps, &self.carried.replicas),
                    sync_every: self.gossip_sync_every,
                    codec: Codec::None,
                    replicas: &self.carried.replicas,
                }),
            };
            return gpu::run_device_batch(
                rt,
                &mut self.gpu,
                &self.data,
                levels,
                &how,
                resps,
                entries,
                replay,
                sink,
            )
            .map(Some);
        }
        let allreduce = match self.hierarchy.as_ref().filter(hierarchical_allreduce) {
            Some(h) => Allreduce::Hierarchical(h.levels()),
            _ if self.ring_min_bytes > 0 && bytes >= self.ring_min_bytes => Allreduce::Ring,
            _ => Allreduce::Native,
        };
        let codec = self.codec(head);
        let how = Algorithms {
            allgather: (self.hierarchy.as_ref())
                .filter(|h| h.allgather)
                .map(Hierarchy::levels),
            allreduce,
            gossip: (head.kind == OpKind::Gossip).then(|| gossip::Schedule {
                rounds: self.carried.rounds.advance(resps, &self.carried.replicas),
                sync_every: self.gossip_sync_every,
                codec,
                replicas: &self.carried.replicas,
            }),
        };
        let hierarchical = match head.kind {
            OpKind::Allreduce => matches!(how.allreduce, Allreduce::Hierarchical(_)),
            OpKind::Allgather => how.allgather.is_some(),
            _ => false,
        };
        if hierarchical {
            rt.metrics.add_hierarchical_batch();
        }
        let wire = Wire {
            codec,
            feedback: &self.carried.feedback,
        };
        rt.metrics.add_wire(wire.codec, head.dtype, bytes as u64);
        // host memory is ready when enqueued
        sink(Some("WAIT_FOR_DATA"));
        let mut ios: Vec<&mut dyn TensorIo> =
            entries.iter_mut().map(|e| e as &mut dyn TensorIo).collect();
        match head.kind {
            OpKind::Barrier => {
                sink(Some("MPI_BARRIER"));
                let r = self.data.barrier();
                sink(None);
                r
            }
            OpKind::Join | OpKind::AddProcessSet | OpKind::RemoveProcessSet => Ok(()),
            _ => collective::execute::host(
                &self.data,
                &how,
                &mut self.fusion,
                wire,
                resps,
                &mut ios,
                sink,
            ),
        }?;
        if self.nan_check && head.kind == OpKind::Allreduce {
            check_finite(resps, &mut ios)?;
        }
        Ok(None)
    }
}

/// `compress::check_finite` over a host batch's outputs.
fn check_finite(resps: &[&Response], ios: &mut [&mut dyn TensorIo]) -> Result<()> {
    let outputs: Vec<&[u8]> = ios.iter_mut().map(|io| &*io.split_io().1).collect();
    compress::check_finite(
        resps[0].dtype,
        resps.iter().map(|r| r.name.as_str()).zip(outputs),
    )
}

/// The bytes of a batch's tensors (agreed: from the responses).
fn batch_bytes(resps: &[&Response]) -> usize {
    resps
        .iter()
        .map(|r| r.num_elements().max(0) as usize * r.dtype.size())
        .sum()
}

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
    finisher: Option<gpu::Finisher>,
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
            // a fused GPU allreduce may be replayed from a graph (decided from agreed data)
            let replay = (settings.gpu_graphs
                && head.error.is_none()
                && head.kind == OpKind::Allreduce
                && gpu::on_device(head))
            .then(|| ReplayKey {
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
                        .run(rt, &resps, &mut entries, replay, &mut sink)
                        .inspect_err(|e| {
                            let on = if gpu::on_device(head) { "GPU " } else { "" };
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
        if self.finisher.is_none() {
            match gpu::Finisher::spawn(rt.clone()) {
                Ok(f) => self.finisher = Some(f),
                Err(e) => {
                    tracing::error!("{e}; waiting for the GPU on the background thread");
                    let mut recorded = recorded;
                    let outcome = recorded
                        .event
                        .synchronize()
                        .and_then(|()| recorded.outcome());
                    gpu::complete(entries, outcome, Some(&recorded));
                    return;
                }
            }
        }
        let Some(f) = &self.finisher else { return };
        // a checked batch's outcome is known only once it is done
        if rt.config.async_completion && recorded.nan.is_none() {
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
    let codec = set.executor.codec(&resps[0]);
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
        collective::allreduce_flagged(
            &set.executor.data,
            resps,
            Wire {
                codec,
                feedback: &set.executor.carried.feedback,
            },
            ios,
            &mut set.executor.fusion,
            batch.raise,
            wait,
            &mut sink,
        )
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
    let bytes: usize = resps
        .iter()
        .map(|r| r.num_elements() as usize * r.dtype.size())
        .sum();
    rt.metrics.add_batch(entries.len() as u64, bytes as u64);
    rt.metrics.add_wire(codec, resps[0].dtype, bytes as u64);
    let outcome = match set.executor.nan_check {
        true => {
            let refs: Vec<&Response> = resps.iter().collect();
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
