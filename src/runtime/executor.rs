//! Where a set's batches run: its communicator with the host fusion buffer and NCCL streams,
//! and its two levels where it has them (`Hierarchy`, measured for the cost model). A batch's
//! plan (`collective::plan`) is chosen here from agreed data, and the batch run by it, on host
//! memory (`collective::execute::host`) or enqueued on the GPU (`runtime::gpu`).

use std::sync::Arc;
use std::time::Instant;

use crate::collective::cost::{CostModel, Link, Policy};
use crate::collective::execute::DeviceHow;
use crate::collective::hierarchical::{self, Levels, node_members};
use crate::collective::plan::{self, BatchPlan, Memory, Route, batch_bytes};
use crate::collective::replay::ReplayKey;
use crate::collective::{self, ActivitySink, Algorithms, Allreduce, TensorIo, gossip};
use crate::compress::{self, Codec, Codecs, Feedback, Wire};
use crate::config::AlgorithmChoice;
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::fusion::{FusionBuffer, planner};
use crate::message::ReduceOp;
use crate::message::{OpKind, Response};
use crate::runtime::Runtime;
use crate::runtime::entry::TensorEntry;
use crate::runtime::gpu;
use crate::runtime::job::JobSettings;
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

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

    /// What a batch's plan reads of the two levels.
    fn plan_levels(&self) -> plan::Levels {
        plan::Levels {
            policy: self.policy,
            allgather: self.allgather,
        }
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
    /// PowerSGD's residuals and factors.
    pub powersgd: crate::compress::powersgd::PowerMemory,
    /// Top-k's residuals and momenta.
    pub topk: crate::compress::topk::TopkMemory,
    /// Gossiped tensors' rounds.
    pub rounds: gossip::Rounds,
    /// Compressed gossip's public copies.
    pub replicas: gossip::Replicas,
}

impl Carried {
    /// How a batch of `codec` travels: the codec with the state it carries.
    fn wire(&self, codec: Codec, starts: (u64, u64), threads: usize) -> Wire<'_> {
        Wire {
            codec,
            feedback: &self.feedback,
            powersgd: &self.powersgd,
            powersgd_start: starts.0,
            topk: &self.topk,
            topk_warmup: starts.1,
            threads,
        }
    }
}

/// Where batches run: a communicator with its host fusion buffer and its NCCL streams (and, for
/// hierarchical collectives, its two levels). Each set has one, and so has each of its channels.
pub(crate) struct Executor {
    pub data: MpiComm,
    pub fusion: FusionBuffer,
    /// GPU batches run here (opened by the first one).
    pub gpu: Option<gpu::NcclStreams>,
    hierarchy: Option<Hierarchy>,
    /// What each batch's plan reads (agreed).
    settings: plan::Settings,
    /// The job's codecs, for the frozen plan's batches (whose files keep no codec).
    codecs: Codecs,
    /// What the set's communicators carry from step to step.
    pub carried: Arc<Carried>,
    /// Every this many rounds a gossip is an exact average (0: never; agreed).
    gossip_sync_every: u32,
    /// PowerSGD's uncompressed first allreduces of each tensor, and top-k's warm-up steps
    /// (agreed).
    starts: (u64, u64),
    /// Threads a codec's local arithmetic may use (local, `Config::compression_threads`).
    threads: usize,
    /// The NCCL connections its GPU batches made, as callers read them.
    pub connected: Arc<gpu::Connected>,
}

impl Executor {
    pub fn new(
        data: MpiComm,
        hierarchy: Option<Hierarchy>,
        ring_min_bytes: usize,
        spans_nodes: bool,
        settings: &JobSettings,
        carried: Arc<Carried>,
        threads: usize,
    ) -> Executor {
        let plan_settings = plan::Settings {
            ring_min_bytes,
            nan_check: settings.nan_check,
            graphs: settings.gpu_graphs,
            gossip_pairs: spans_nodes || !settings.gossip_exact_inside_node,
        };
        let levels = hierarchy.as_ref().map(Hierarchy::plan_levels);
        Executor {
            data,
            fusion: FusionBuffer::default(),
            gpu: None,
            hierarchy,
            settings: plan_settings,
            codecs: settings.compression,
            carried,
            gossip_sync_every: settings.gossip_sync_every,
            starts: (settings.powersgd_start, settings.topk_warmup),
            threads,
            connected: Arc::new(gpu::Connected::new(
                plan_settings,
                levels,
                settings.compression,
            )),
        }
    }

    /// How a batch of `codec` travels: the codec with the state it carries.
    pub fn wire(&self, codec: Codec) -> Wire<'_> {
        self.carried.wire(codec, self.starts, self.threads)
    }

    /// The plan of a batch whose values travel as `codec` (agreed: from its responses, the
    /// job's settings and the set's levels).
    pub fn plan(&self, resps: &[&Response], codec: Codec) -> BatchPlan {
        let levels = self.hierarchy.as_ref().map(Hierarchy::plan_levels);
        let bytes = batch_bytes(resps);
        plan::choose(resps[0], bytes, codec, &self.settings, levels.as_ref())
    }

    /// The plan of a batch of the frozen offline plan: it was fused by the fusion planner when
    /// the plan was learned, and its codec is the one the planner resolves for its head.
    pub fn plan_frozen(&self, resps: &[&Response]) -> BatchPlan {
        self.plan(resps, planner::codec(resps[0], &self.codecs))
    }

    /// Runs a batch by its plan (`Executor::plan`); a GPU batch is only enqueued, and what it
    /// recorded comes back.
    pub fn run(
        &mut self,
        rt: &Runtime,
        plan: BatchPlan,
        resps: &[&Response],
        entries: &mut [TensorEntry],
        replay: Option<ReplayKey>,
        sink: ActivitySink,
    ) -> Result<Option<gpu::Recorded>> {
        let head = resps[0];
        if plan.route == Route::Hierarchical {
            rt.metrics.add_hierarchical_batch();
        }
        rt.metrics
            .add_wire(&self.wire(plan.codec), resps.iter().copied());
        let codec = plan.codec;
        if head.kind == OpKind::Gossip && plan.route != Route::Pairs {
            // the exact average, run as an allreduce batch: no rounds (`plan::choose`)
            say_exact_gossip(self.data.rank());
        }
        let gossip = (plan.route == Route::Pairs).then(|| gossip::Schedule {
            rounds: self.carried.rounds.advance(resps, &self.carried.replicas),
            sync_every: self.gossip_sync_every,
            codec,
            replicas: &self.carried.replicas,
        });
        let hierarchy = self
            .hierarchy
            .as_ref()
            .filter(|_| plan.route == Route::Hierarchical);
        if plan.memory == Memory::Device {
            let levels = hierarchy.map(|h| gpu::NodeLevels {
                local: &h.local,
                cross: &h.cross,
            });
            let how = DeviceHow {
                plan,
                gossip,
                wire: self.carried.wire(codec, self.starts, self.threads),
            };
            return gpu::run_device_batch(
                rt,
                &mut self.gpu,
                &self.connected,
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
        let how = host_algorithms(&plan, head.kind, hierarchy, gossip);
        let wire = self.carried.wire(codec, self.starts, self.threads);
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
        if plan.nan_check {
            check_finite(resps, &mut ios)?;
        }
        Ok(None)
    }

    /// Runs one batch of the offline plan with its escape flag (`collective::allreduce_flagged`)
    /// over the route its plan (`Executor::plan`) chooses, as an online batch would run.
    #[allow(clippy::too_many_arguments)] // the batch, its plan, its flag, how long, who hears
    pub fn run_flagged(
        &mut self,
        rt: &Runtime,
        resps: &[Response],
        plan: &BatchPlan,
        ios: Option<&mut [&mut dyn TensorIo]>,
        raise: bool,
        wait: collective::Wait,
        sink: ActivitySink,
    ) -> Result<collective::Flagged> {
        let refs: Vec<&Response> = resps.iter().collect();
        let hierarchy = self.hierarchy.as_ref();
        let how = host_algorithms(plan, resps[0].kind, hierarchy, None);
        let (data, wire) = (
            &self.data,
            self.carried.wire(plan.codec, self.starts, self.threads),
        );
        // counted where it runs: a batch whose flag travels with it never takes the hierarchy
        let mut run =
            |fusion: &mut FusionBuffer, ios: &mut [&mut dyn TensorIo], act: ActivitySink| {
                if let Allreduce::Hierarchical(_) = how.allreduce {
                    rt.metrics.add_hierarchical_batch();
                }
                collective::execute::host(data, &how, fusion, wire, &refs, ios, act)
            };
        let flag = match plan::flag_alone(plan) {
            true => collective::Flag::Alone(&mut run),
            false => collective::Flag::WithData,
        };
        collective::allreduce_flagged(
            data,
            resps,
            wire,
            ios,
            &mut self.fusion,
            raise,
            flag,
            wait,
            sink,
        )
    }
}

/// The host algorithms a plan names, over the set's levels where its route is hierarchical.
fn host_algorithms<'a>(
    plan: &BatchPlan,
    kind: OpKind,
    hierarchy: Option<&'a Hierarchy>,
    gossip: Option<gossip::Schedule<'a>>,
) -> Algorithms<'a> {
    let hierarchy = hierarchy.filter(|_| plan.route == Route::Hierarchical);
    Algorithms {
        allgather: hierarchy
            .filter(|_| kind == OpKind::Allgather)
            .map(Hierarchy::levels),
        allreduce: match (plan.route, hierarchy) {
            (Route::Hierarchical, Some(h)) => Allreduce::Hierarchical(h.levels()),
            (Route::Ring, _) => Allreduce::Ring,
            _ => Allreduce::Native,
        },
        gossip,
    }
}

/// Says once per process, on a set's rank 0, that gossip runs as exact averages.
fn say_exact_gossip(rank: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    if rank == 0 {
        SAID.call_once(|| {
            tracing::info!(
                "gossip on GPUs inside one node runs as exact averages (NCCL's allreduce of the set): there it takes about as long as one exchange with a peer"
            )
        });
    }
}

/// `compress::check_finite` over a host batch's outputs.
pub(crate) fn check_finite(resps: &[&Response], ios: &mut [&mut dyn TensorIo]) -> Result<()> {
    let outputs: Vec<&[u8]> = ios.iter_mut().map(|io| &*io.split_io().1).collect();
    compress::check_finite(
        resps[0].dtype,
        resps.iter().map(|r| r.name.as_str()).zip(outputs),
    )
}
