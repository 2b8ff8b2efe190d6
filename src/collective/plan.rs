//! What runs a batch, chosen in one place: the memory it lives in, the route its allreduce or
//! allgather takes, its codec, and on GPUs whether it needs NCCL's point-to-point connections
//! and may be replayed from a graph. A pure function of agreed data (the batch's first
//! response and size, the job's agreed settings, the set's levels and cost model), so every
//! rank chooses alike; the runtime binds communicators and streams to the plan and runs it.

use crate::collective::cost::{Algorithm, Policy};
use crate::compress::Codec;
use crate::message::{CPU_DEVICE, OpKind, Response};
use crate::transport::nccl;

/// Where a batch's tensors live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Host,
    Device,
}

/// How an allreduce (or allgather) crosses the set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The engine's own collective (MPI's, NCCL's).
    Native,
    /// The ring over point-to-point transfers (`collective::ring`).
    Ring,
    /// Inside each node, across nodes, inside each node again.
    Hierarchical,
    /// Gossip: each rank averages with one peer per round (`collective::gossip`).
    Pairs,
}

impl Route {
    /// As the timeline's schedule records it.
    pub fn name(self) -> &'static str {
        match self {
            Route::Native => "native",
            Route::Ring => "ring",
            Route::Hierarchical => "hierarchical",
            Route::Pairs => "pairs",
        }
    }
}

/// The choice for one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    pub memory: Memory,
    pub route: Route,
    /// How the values travel (`Codec::None` for kinds a codec does not apply to).
    pub codec: Codec,
    /// The results are checked for NaN and infinite values.
    pub nan_check: bool,
    /// GPU: the batch sends to single peers, whose NCCL connections must exist first.
    pub peers: bool,
    /// GPU: the batch may be captured into a graph and replayed.
    pub replayable: bool,
}

/// The job's agreed settings a choice reads.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Flat host allreduces of at least this many bytes run the ring (0: never).
    pub ring_min_bytes: usize,
    pub nan_check: bool,
    /// GPU allreduces may be captured into graphs and replayed.
    pub graphs: bool,
    /// GPU gossip exchanges with peers: the set's ranks lie on more than one node, or the job
    /// keeps the exchanges inside one (`FERROVOD_GOSSIP_EXACT_INSIDE_NODE=0`).
    pub gossip_pairs: bool,
}

/// A set with two levels: how its allreduces choose, and whether its allgathers go
/// hierarchical.
#[derive(Clone, Copy, Debug)]
pub struct Levels {
    pub policy: Policy,
    pub allgather: bool,
}

/// Whether a batch of `head`'s kind runs on GPU memory (the other kinds carry no data, or run
/// on the host whatever their device).
pub fn on_device(head: &Response) -> bool {
    head.device != CPU_DEVICE
        && matches!(
            head.kind,
            OpKind::Allreduce
                | OpKind::Allgather
                | OpKind::Reducescatter
                | OpKind::Broadcast
                | OpKind::Alltoall
                | OpKind::Gossip
        )
}

/// The bytes of a batch's tensors (agreed: from the responses), as `choose` weighs them.
pub fn batch_bytes(resps: &[&Response]) -> usize {
    resps
        .iter()
        .map(|r| r.num_elements().max(0) as usize * r.dtype.size())
        .sum()
}

/// The plan of a batch led by `head` of `bytes` bytes whose values travel as `codec` (agreed:
/// the fusion planner resolved the codec and fused batches of one kind, dtype, device and
/// codec).
pub fn choose(
    head: &Response,
    bytes: usize,
    codec: Codec,
    s: &Settings,
    levels: Option<&Levels>,
) -> BatchPlan {
    let allreduce = head.kind == OpKind::Allreduce;
    let hierarchical = levels.is_some_and(|l| l.policy.choose(bytes) == Algorithm::Hierarchical);
    let nan_check = s.nan_check && allreduce;
    if !on_device(head) {
        let route = match head.kind {
            // PowerSGD's factors are small: the transport's own allreduce sums them
            OpKind::Allreduce if matches!(codec, Codec::PowerSgd(_) | Codec::TopK(_)) => {
                Route::Native
            }
            OpKind::Allreduce if hierarchical => Route::Hierarchical,
            OpKind::Allreduce if s.ring_min_bytes > 0 && bytes >= s.ring_min_bytes => Route::Ring,
            OpKind::Allgather if levels.is_some_and(|l| l.allgather) => Route::Hierarchical,
            OpKind::Gossip => Route::Pairs,
            _ => Route::Native,
        };
        return BatchPlan {
            memory: Memory::Host,
            route,
            codec,
            nan_check,
            peers: false,
            replayable: false,
        };
    }
    // on GPUs every codec applies to allreduces only (gossip travels uncompressed); dtypes
    // NCCL cannot reduce run the ring; u8's blocks cannot be summed on the way, so they never
    // go hierarchical
    let codec = if allreduce { codec } else { Codec::None };
    let reduces = nccl::reduces(head.dtype);
    // gossip inside one node: NCCL's allreduce of the whole set takes about as long as one
    // exchange with a peer there (BENCHMARKS.md, "GPU gossip inside one node"), so every round
    // is the exact average instead
    let route = match head.kind {
        OpKind::Allreduce if !reduces => Route::Ring,
        // PowerSGD's factors and top-k's pairs are small: NCCL's own allreduce sums the
        // first, its allgather gathers the second
        OpKind::Allreduce if matches!(codec, Codec::PowerSgd(_) | Codec::TopK(_)) => Route::Native,
        OpKind::Allreduce if hierarchical && codec != Codec::U8 => Route::Hierarchical,
        OpKind::Gossip if s.gossip_pairs => Route::Pairs,
        _ => Route::Native,
    };
    let peers = match head.kind {
        OpKind::Alltoall => true,
        OpKind::Gossip => route == Route::Pairs,
        OpKind::Allreduce => codec == Codec::U8 || route == Route::Ring,
        _ => false,
    };
    BatchPlan {
        memory: Memory::Device,
        route,
        codec,
        nan_check,
        peers,
        // a hierarchical batch waits for the stream on the host, and a u8, PowerSGD or top-k
        // batch's state moves with its tensors' sizes and steps: none can be a graph; nor the
        // ring, not captured yet, nor gossip's exchanges. Gossip inside one node runs the
        // allreduce's launches, and is replayed as they are
        replayable: s.graphs
            && matches!(head.kind, OpKind::Allreduce | OpKind::Gossip)
            && route == Route::Native
            && matches!(codec, Codec::None | Codec::Half(_)),
    }
}

/// The NCCL connections a GPU batch opens before its first launch where they are not made
/// yet. Making one may wait for the whole device, and so for a caller's stream that waits on
/// the device for this very batch (`runtime::gpu::Connected`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Connections {
    /// The communicator over every rank of the set.
    pub flat: bool,
    /// The one over this node's ranks (the hierarchical route).
    pub local: bool,
    /// Send/recv between every pair of ranks.
    pub peers: bool,
}

impl Connections {
    /// Whether every connection `need` names is among these.
    pub fn covers(self, need: Connections) -> bool {
        (self.flat || !need.flat) && (self.local || !need.local) && (self.peers || !need.peers)
    }

    pub fn union(self, other: Connections) -> Connections {
        Connections {
            flat: self.flat || other.flat,
            local: self.local || other.local,
            peers: self.peers || other.peers,
        }
    }
}

impl BatchPlan {
    /// What the batch needs connected on its GPU (nothing on the host).
    pub fn connections(&self) -> Connections {
        if self.memory == Memory::Host {
            return Connections::default();
        }
        let local = self.route == Route::Hierarchical;
        Connections {
            flat: !local,
            local,
            peers: self.peers,
        }
    }
}

/// Every connection a GPU batch holding `head` may need, whatever the batch's size: its codec is
/// `head`'s own (the fusion planner fuses only tensors of one codec), but the batch's bytes,
/// which a two-level set's policy reads, depend on what it is fused with, so both levels'
/// choices count.
pub fn may_need(
    head: &Response,
    codec: Codec,
    s: &Settings,
    levels: Option<&Levels>,
) -> Connections {
    let bytes = head.fused_bytes();
    let need = |levels: Option<&Levels>| choose(head, bytes, codec, s, levels).connections();
    match levels {
        None => need(None),
        Some(l) => [Policy::Flat, Policy::Hierarchical]
            .into_iter()
            .map(|policy| need(Some(&Levels { policy, ..*l })))
            .fold(Connections::default(), Connections::union),
    }
}

/// Whether an offline-plan batch's escape flag must travel alone before the batch
/// (`collective::Flag`): u8 blocks, PowerSGD's factors and top-k's pairs cannot carry it among their values, and the ring's and the
/// hierarchical route's transfers wait under the watchdog, not under the plan's bounded wait, so
/// every rank must know the batch runs before any starts it. Native allreduces carry the flag in
/// the same bounded call.
pub fn flag_alone(plan: &BatchPlan) -> bool {
    matches!(plan.codec, Codec::U8 | Codec::PowerSgd(_) | Codec::TopK(_))
        || plan.route != Route::Native
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::cost::{CostModel, Link};
    use crate::dtype::DataType;
    use crate::message::{Compression, ReduceOp};

    fn head(kind: OpKind, dtype: DataType, device: i32) -> Response {
        Response {
            kind,
            name: "t".into(),
            dtype,
            shape: vec![1024],
            first_dims: Vec::new(),
            root: 0,
            device,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: crate::message::Multistep::EVERY_CALL,
            result: 0,
            error: None,
        }
    }

    fn settings(ring_min_bytes: usize) -> Settings {
        Settings {
            ring_min_bytes,
            nan_check: true,
            graphs: true,
            gossip_pairs: true,
        }
    }

    /// The codec the fusion planner gives `r` under the job's `compression`.
    fn codec(compression: Compression, r: &Response) -> Codec {
        let codecs = crate::compress::Codecs {
            setting: compression,
            min_bytes: 0,
            powersgd_rank: crate::compress::POWERSGD_RANK,
            topk: crate::compress::TopK {
                ratio_ppm: 10_000,
                momentum_permille: 0,
            },
        };
        codecs.of(r)
    }

    const NONE: Codec = Codec::None;

    const HIER: Levels = Levels {
        policy: Policy::Hierarchical,
        allgather: true,
    };

    #[test]
    fn host_allreduces_go_hierarchical_then_ring_then_native() {
        let r = head(OpKind::Allreduce, DataType::F32, CPU_DEVICE);
        let s = settings(4096);
        let plan = |bytes, levels| choose(&r, bytes, NONE, &s, levels).route;
        assert_eq!(plan(100, Some(&HIER)), Route::Hierarchical);
        assert_eq!(plan(100, None), Route::Native);
        assert_eq!(plan(4096, None), Route::Ring);
        let flat = Levels {
            policy: Policy::Flat,
            allgather: false,
        };
        assert_eq!(plan(4096, Some(&flat)), Route::Ring);
        let p = choose(&r, 100, NONE, &s, None);
        assert_eq!(
            (p.memory, p.nan_check, p.peers, p.replayable),
            (Memory::Host, true, false, false)
        );
        // other kinds: no NaN check; allgathers follow the set's allgather setting
        let g = head(OpKind::Allgather, DataType::F32, CPU_DEVICE);
        let gather = |levels| choose(&g, 100, NONE, &s, levels);
        assert_eq!(gather(Some(&HIER)).route, Route::Hierarchical);
        assert_eq!(gather(Some(&flat)).route, Route::Native);
        assert!(!gather(None).nan_check);
        // a ring threshold of 0 never rings
        assert_eq!(
            choose(&r, 1 << 30, NONE, &settings(0), None).route,
            Route::Native
        );
    }

    #[test]
    fn offline_flags_travel_alone_except_beside_a_native_uncompressed_or_16_bit_batch() {
        let r = head(OpKind::Allreduce, DataType::F32, CPU_DEVICE);
        let alone = |c, bytes, levels| {
            flag_alone(&choose(&r, bytes, codec(c, &r), &settings(4096), levels))
        };
        assert!(!alone(Compression::None, 100, None));
        assert!(!alone(Compression::Fp16, 100, None));
        assert!(!alone(Compression::Bf16, 100, None));
        assert!(alone(Compression::U8, 100, None));
        assert!(alone(Compression::None, 4096, None), "the ring");
        assert!(alone(Compression::None, 100, Some(&HIER)), "hierarchical");
        assert!(
            alone(Compression::Fp16, 100, Some(&HIER)),
            "hierarchical fp16"
        );
    }

    #[test]
    fn auto_follows_the_cost_model_by_size() {
        let slow_cross = CostModel {
            local: Link {
                alpha: 1e-6,
                beta: 1e-11,
            },
            cross: Link {
                alpha: 1e-5,
                beta: 1e-9,
            },
            flat_alpha: 1e-5,
            hier_alpha: 3e-5,
            per_node: 4,
            nodes: 2,
        };
        let auto = Levels {
            policy: Policy::Auto(slow_cross),
            allgather: false,
        };
        let r = head(OpKind::Allreduce, DataType::F32, CPU_DEVICE);
        let s = settings(0);
        let at = slow_cross.crossover().expect("a crossover");
        let route = |bytes| choose(&r, bytes, NONE, &s, Some(&auto)).route;
        assert_eq!(route(at / 2), Route::Native);
        assert_eq!(route(at * 2), Route::Hierarchical);
    }

    #[test]
    fn gpu_batches_pick_routes_and_connections_by_dtype_and_codec() {
        let s = settings(1);
        let f32_ar = head(OpKind::Allreduce, DataType::F32, 0);
        let p = choose(&f32_ar, 1 << 20, NONE, &s, Some(&HIER));
        assert_eq!(
            (p.memory, p.route, p.peers, p.replayable),
            (Memory::Device, Route::Hierarchical, false, false)
        );
        // the host's ring threshold is not the GPU's: NCCL's own allreduce, replayable
        let p = choose(&f32_ar, 1 << 20, NONE, &s, None);
        assert_eq!(
            (p.route, p.peers, p.replayable),
            (Route::Native, false, true)
        );
        // unless the job turned graphs off
        let off = Settings { graphs: false, ..s };
        assert!(!choose(&f32_ar, 1 << 20, NONE, &off, None).replayable);
        // dtypes NCCL cannot reduce: the ring over send/recv, even with levels
        for dtype in [DataType::U16, DataType::I16, DataType::Bool] {
            let p = choose(
                &head(OpKind::Allreduce, dtype, 0),
                64,
                NONE,
                &s,
                Some(&HIER),
            );
            assert_eq!(
                (p.route, p.peers, p.replayable),
                (Route::Ring, true, false),
                "{dtype:?}"
            );
        }
        // u8: flat, over send/recv, never a graph
        let u8s = settings(0);
        let p = choose(&f32_ar, 1 << 20, Codec::U8, &u8s, Some(&HIER));
        assert_eq!(
            (p.route, p.codec, p.peers, p.replayable),
            (Route::Native, Codec::U8, true, false)
        );
        // PowerSGD and top-k: NCCL's allreduce of the factors, allgather of the pairs, even
        // with levels; never a graph
        for codec in [
            Codec::PowerSgd(4),
            Codec::TopK(crate::compress::TopK::default()),
        ] {
            let p = choose(&f32_ar, 1 << 20, codec, &s, Some(&HIER));
            assert_eq!(
                (p.route, p.codec, p.peers, p.replayable),
                (Route::Native, codec, false, false)
            );
        }
        // codecs apply to GPU allreduces only; alltoall and gossip need peers
        for kind in [
            OpKind::Gossip,
            OpKind::Alltoall,
            OpKind::Allgather,
            OpKind::Broadcast,
        ] {
            let p = choose(
                &head(kind, DataType::F32, 0),
                1 << 20,
                Codec::U8,
                &u8s,
                Some(&HIER),
            );
            assert_eq!(p.codec, Codec::None, "{kind:?}");
            let pairs = if kind == OpKind::Gossip {
                Route::Pairs
            } else {
                Route::Native
            };
            assert_eq!(p.route, pairs, "{kind:?}");
            assert_eq!(
                p.peers,
                matches!(kind, OpKind::Gossip | OpKind::Alltoall),
                "{kind:?}"
            );
            assert!(!p.nan_check && !p.replayable, "{kind:?}");
        }
        // GPU gossip inside one node: exact averages over NCCL's allreduce, no peers; on
        // host memory gossip always pairs
        let one_node = Settings {
            gossip_pairs: false,
            ..s
        };
        let gossip = head(OpKind::Gossip, DataType::F32, 0);
        let p = choose(&gossip, 1 << 20, NONE, &one_node, None);
        assert_eq!(
            (p.route, p.peers, p.replayable),
            (Route::Native, false, true)
        );
        let no_graphs = Settings {
            graphs: false,
            ..one_node
        };
        assert!(!choose(&gossip, 1 << 20, NONE, &no_graphs, None).replayable);
        let host = head(OpKind::Gossip, DataType::F32, CPU_DEVICE);
        assert_eq!(choose(&host, 64, NONE, &one_node, None).route, Route::Pairs);
        // kinds without data stay on the host whatever their device
        let b = choose(&head(OpKind::Barrier, DataType::U8, 0), 0, NONE, &s, None);
        assert_eq!(b.memory, Memory::Host);
    }

    #[test]
    fn what_a_gpu_batch_may_need_covers_every_batch_it_can_be_in() {
        let cross = CostModel {
            local: Link {
                alpha: 1e-6,
                beta: 1e-11,
            },
            cross: Link {
                alpha: 1e-5,
                beta: 1e-9,
            },
            flat_alpha: 1e-5,
            hier_alpha: 3e-5,
            per_node: 4,
            nodes: 2,
        };
        let auto = Levels {
            policy: Policy::Auto(cross),
            allgather: false,
        };
        for pairs in [false, true] {
            let s = Settings {
                gossip_pairs: pairs,
                ..settings(0)
            };
            for kind in OpKind::ALL {
                for dtype in DataType::ALL {
                    for compression in Compression::ALL {
                        let r = head(kind, dtype, 0);
                        let c = codec(compression, &r);
                        for levels in [None, Some(&HIER), Some(&auto)] {
                            let may = may_need(&r, c, &s, levels);
                            for bytes in [4, 1 << 20, 1 << 30] {
                                let need = choose(&r, bytes, c, &s, levels).connections();
                                assert!(
                                    may.covers(need),
                                    "{kind:?} {dtype:?} {compression:?} {levels:?} {bytes}: {need:?} not in {may:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
        let s = settings(0);
        let f32_ar = head(OpKind::Allreduce, DataType::F32, 0);
        let conn = |flat, local, peers| Connections { flat, local, peers };
        assert_eq!(may_need(&f32_ar, NONE, &s, None), conn(true, false, false));
        assert_eq!(
            may_need(&f32_ar, NONE, &s, Some(&HIER)),
            conn(true, true, false)
        );
        assert_eq!(
            may_need(&f32_ar, Codec::U8, &s, Some(&HIER)),
            conn(true, false, true)
        );
        let a2a = head(OpKind::Alltoall, DataType::F32, 0);
        assert_eq!(may_need(&a2a, NONE, &s, None), conn(true, false, true));
        let gather = head(OpKind::Allgather, DataType::F32, 0);
        assert_eq!(
            may_need(&gather, NONE, &s, Some(&HIER)),
            conn(true, false, false)
        );
        let host = head(OpKind::Allreduce, DataType::F32, CPU_DEVICE);
        assert_eq!(
            may_need(&host, NONE, &s, Some(&HIER)),
            Connections::default()
        );
        assert!(conn(true, true, false).covers(conn(true, false, false)));
        assert!(!conn(true, false, false).covers(conn(false, true, false)));
    }
}
