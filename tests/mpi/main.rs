//! Multi-rank tests. Run by `cargo test`, this program launches itself under
//! `mpirun -np N` once per scenario; under mpirun (OMPI_COMM_WORLD_SIZE set) it runs the named
//! scenario as one rank. Every rank checks its results against values it computes itself:
//! element i of rank r is a closed-form f(i, r), so sums and gathers have closed forms too.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovod::error::SHUT_DOWN_MESSAGE;
use ferrovod::message::Compression;
use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::handle::{Handle, TensorResult};
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::{DataType, Error, OpKind, ReduceOp};

mod collectives;
mod common;
mod decentralized;
mod gpu;
mod hosts;
mod negotiation;
mod offline;
mod p2p;
mod process_sets;
mod schedule;
mod shutdown;

use collectives::*;
use common::*;
use decentralized::*;
use gpu::{
    gpu_compressed, gpu_failure, gpu_graphs, gpu_graphs_gossip, gpu_kernels, gpu_peers_fault,
    gpu_ring, gpu_streams, gpu_thread_context, gpu_u8,
};
use hosts::*;
use negotiation::*;
use offline::*;
use p2p::*;
use process_sets::*;
use schedule::{check_schedule, schedule};
use shutdown::*;

/// (scenario, ranks, extra environment, expect success)
pub(crate) type Scenario = (
    &'static str,
    usize,
    &'static [(&'static str, &'static str)],
    bool,
);

pub(crate) const STALL_FAST: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
];

/// A stall limit far beyond an operation's own timeout (`op_timeout`).
const STALL_LONG: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60"),
];

const STALL_LONG_CACHED: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60"),
    ("FERROVOD_TEST_TIMEOUT_PATH", "cached"),
];

const STALL_LONG_CACHED_HOROVOD: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60"),
    ("FERROVOD_TEST_TIMEOUT_PATH", "cached"),
    ("FERROVOD_NEGOTIATION", "horovod"),
];

const STALL_LONG_GROUP: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60"),
    ("FERROVOD_TEST_TIMEOUT_PATH", "group"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("HOROVOD_CYCLE_TIME", "50"),
];

pub(crate) const STALL_FAST_FP16: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_COMPRESSION", "fp16"),
];

pub(crate) const STALL_FAST_HOROVOD: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "horovod"),
];

pub(crate) const STOP_IN_BATCH: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_batch:1"),
];

/// `STOP_IN_BATCH` with the batch travelling as PowerSGD's factors, and as top-k's pairs.
pub(crate) const STOP_IN_BATCH_POWERSGD: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_batch:1"),
    ("FERROVOD_COMPRESSION", "powersgd"),
];

pub(crate) const STOP_IN_BATCH_TOPK: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_batch:1"),
    ("FERROVOD_COMPRESSION", "topk"),
];

/// `STOP_IN_BATCH_POWERSGD` with the tensor in PowerSGD's uncompressed first steps: the
/// survivors wait in that sum.
pub(crate) const STOP_IN_BATCH_POWERSGD_START: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_batch:1"),
    ("FERROVOD_COMPRESSION", "powersgd"),
    ("FERROVOD_POWERSGD_START", "100"),
];

pub(crate) const SLOW_IN_BATCH: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "slow_in_batch:1"),
];

pub(crate) const NCCL_INIT_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "nccl_init:1"),
];

pub(crate) const GPU_ALLTOALL_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "gpu_alltoall:1"),
];

pub(crate) const GPU_STAGED_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "gpu_staged:1"),
];

pub(crate) const AUTOTUNE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("HOROVOD_AUTOTUNE", "1"),
    ("FERROVOD_TEST_FAULT", "autotune:1"),
];

pub(crate) const FREEZE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_TEST_FAULT", "freeze:1"),
];

pub(crate) const OFFLINE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_TEST_FAULT", "offline:1"),
];

pub(crate) const STOP_IN_ROUND: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_round:1"),
];

pub(crate) const OFFLINE_STOP: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_PLAN_ESCAPE_MS", "200"),
];

pub(crate) const NEGOTIATION_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "negotiation_error:1"),
];

#[rustfmt::skip]
pub(crate) const OFFLINE: &[(&str, &str)] = &[
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

pub(crate) const OFFLINE_STALL: &[(&str, &str)] = &[
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_PLAN_ESCAPE_MS", "200"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
];

pub(crate) const OFFLINE_STALL_FP16: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "fp16"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_PLAN_ESCAPE_MS", "200"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
];

/// Hierarchical allreduce over nodes of `FERROVOD_LOCAL_SIZE` ranks.
pub(crate) const HIERARCHICAL_LOCAL2: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_TEST_HIERARCHICAL", "1"),
];

/// Hierarchical allgather alone (allreduces flat).
pub(crate) const HIERARCHICAL_ALLGATHER_LOCAL2: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
    ("FERROVOD_ALGORITHM", "flat"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_TEST_HIERARCHICAL", "1"),
];

/// f32 sums and averages on the wire as 16-bit floats.
pub(crate) const FP16: &[(&str, &str)] = &[("FERROVOD_COMPRESSION", "fp16")];

/// The stall scenario's missing tensor is a multistep allreduce's communicating call.
const STALL_FAST_MULTISTEP: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("STALL_ON", "multistep"),
];

/// Gossip rounds without the periodic exact average.
const GOSSIP_ONLY: &[(&str, &str)] = &[("FERROVOD_GOSSIP_SYNC_EVERY", "0")];
/// GPU gossip exchanging with peers inside one node (`GOSSIP_ONLY` otherwise).
const GPU_GOSSIP_PAIRS: &[(&str, &str)] = &[
    ("FERROVOD_GOSSIP_SYNC_EVERY", "0"),
    ("FERROVOD_GOSSIP_EXACT_INSIDE_NODE", "0"),
];
pub(crate) const BF16: &[(&str, &str)] = &[("FERROVOD_COMPRESSION", "bf16")];
pub(crate) const MIXED: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "mixed"),
    ("FERROVOD_COMPRESSION_MIN_BYTES", "4096"),
];
pub(crate) const MIXED_OFFLINE: &[(&str, &str)] = &[
    ("PERSEUS_ALLREDUCE_DTYPE", "2"),
    ("FERROVOD_COMPRESSION_MIN_BYTES", "4096"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];
/// fp16 through the ring over point-to-point (every batch).
pub(crate) const FP16_RING: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "fp16"),
    ("FERROVOD_RING_MIN_BYTES", "1"),
];
/// fp16 through the hierarchical allreduce (nodes of 2 ranks).
pub(crate) const FP16_HIERARCHICAL: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "fp16"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
];

/// Every tensor fused (none reduced directly), however large.
pub(crate) const FUSE_ALL: &[(&str, &str)] = &[("FERROVOD_FUSION_DIRECT_BYTES", "1073741824")];

/// Fused batches through the ring, packed and unpacked segment by segment inside it.
pub(crate) const FUSE_ALL_RING: &[(&str, &str)] = &[
    ("FERROVOD_FUSION_DIRECT_BYTES", "1073741824"),
    ("FERROVOD_RING_MIN_BYTES", "1"),
];

/// The ring under a count limit below its 128 KiB segments.
pub(crate) const FUSE_ALL_RING_SMALL_COUNT: &[(&str, &str)] = &[
    ("FERROVOD_FUSION_DIRECT_BYTES", "1073741824"),
    ("FERROVOD_RING_MIN_BYTES", "1"),
    ("FERROVOD_MPI_MAX_COUNT", "49152"),
];

/// Durations past what a clock holds: refused with a warning, defaults used.
pub(crate) const HUGE_SETTINGS: &[(&str, &str)] = &[
    ("HOROVOD_CYCLE_TIME", "1e22"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1e19"),
    ("FERROVOD_PLAN_ESCAPE_MS", "1e300"),
];

/// One rank per node, hierarchical allreduce asked for: it runs (on GPUs: NCCL inside each node,
/// MPI across).
pub(crate) const HIERARCHICAL_ONE_PER_NODE: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "1"),
];

/// As `HIERARCHICAL_ONE_PER_NODE`, asserting that batches went hierarchical.
pub(crate) const HIERARCHICAL_ONE_PER_NODE_CHECKED: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "1"),
    ("FERROVOD_TEST_HIERARCHICAL", "1"),
];

/// One node of 2 ranks, hierarchical allreduce asked for: it runs (on GPUs: NCCL reduce-scatter
/// and allgather between the two GPUs, a one-rank step across nodes).
pub(crate) const HIERARCHICAL_ONE_NODE: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
];

/// PowerSGD on GPU tensors: alone, with its first steps uncompressed, under offline
/// negotiation.
const POWERSGD: &[(&str, &str)] = &[("FERROVOD_COMPRESSION", "powersgd")];
const POWERSGD_START: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "powersgd"),
    ("FERROVOD_POWERSGD_START", "3"),
    ("FERROVOD_POWERSGD_RANK", "2"),
];
const POWERSGD_OFFLINE: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "powersgd"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

/// Top-k: alone, with momentum correction, with DGC's warm-up, under offline negotiation.
const TOPK: &[(&str, &str)] = &[("FERROVOD_COMPRESSION", "topk")];
const TOPK_MOMENTUM: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "topk"),
    ("FERROVOD_TOPK_MOMENTUM", "0.9"),
];
/// A ratio at which the host's batch of `topk_exact` travels in pieces, its tensors fused as
/// across nodes.
const TOPK_PIECES: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "topk"),
    ("FERROVOD_FUSION_DIRECT_BYTES", "1000000000"),
    ("FERROVOD_TOPK_RATIO", "0.25"),
    ("FERROVOD_TOPK_MOMENTUM", "0.9"),
];
const TOPK_WARMUP: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "topk"),
    ("FERROVOD_TOPK_WARMUP_STEPS", "4"),
];
const TOPK_OFFLINE: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "topk"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

/// Top-k and PowerSGD over two channels, with handles that complete at enqueue.
const TOPK_CHANNELS: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "topk"),
    ("FERROVOD_CHANNELS", "2"),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1"),
];
const POWERSGD_CHANNELS: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "powersgd"),
    ("FERROVOD_CHANNELS", "2"),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1"),
];

/// Whether a scenario's ranks may share a GPU: one rank per node opens no NCCL communicator
/// over two ranks.
fn shares_gpus(name: &str, env: &[(&str, &str)]) -> bool {
    name == "hierarchical_allreduces" && env.contains(&("FERROVOD_LOCAL_SIZE", "1"))
}

/// Nodes of 2 and 1 ranks: hierarchical allreduce falls back to the flat one.
pub(crate) const HIERARCHICAL_UNEVEN: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_TEST_HIERARCHICAL", "0"),
];

/// Hierarchical collectives in process sets that span hosts (the halves of 2 hosts x 4 ranks
/// placed round-robin hold 2 ranks on each host).
pub(crate) const HIERARCHICAL_SETS: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
    ("FERROVOD_TEST_HIERARCHICAL", "1"),
    ("FERROVOD_TEST_HIERARCHICAL_SETS", "1"),
];

/// Join and offline negotiation with hierarchical collectives (2 nodes of 2 ranks).
/// The scale model's schedule checks (`schedule.rs`): two emulated nodes of one rank, whose
/// batches from 60,000 bytes run the ring; fp16 on one node, with the ring set from the same
/// size; offline and hierarchical on two nodes of two. Fused batches of at most 128 KiB, so that the threshold cuts them.
pub(crate) const SCHEDULE_RING: &[(&str, &str)] = &[
    ("FERROVOD_LOCAL_SIZE", "1"),
    ("FERROVOD_RING_MIN_BYTES", "60000"),
    ("HOROVOD_FUSION_THRESHOLD", "131072"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];
pub(crate) const SCHEDULE_FP16: &[(&str, &str)] = &[
    ("FERROVOD_COMPRESSION", "fp16"),
    ("FERROVOD_RING_MIN_BYTES", "60000"),
    ("HOROVOD_FUSION_THRESHOLD", "131072"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];
pub(crate) const SCHEDULE_OFFLINE_HIERARCHICAL: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("HOROVOD_FUSION_THRESHOLD", "131072"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

pub(crate) const HIERARCHICAL_OFFLINE: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

/// The algorithm chosen per batch from the cost model, with rank 1 measuring other figures.
pub(crate) const AUTO_SKEWED: &[(&str, &str)] = &[
    ("FERROVOD_ALGORITHM", "auto"),
    ("FERROVOD_LOCAL_SIZE", "2"),
    ("FERROVOD_TEST_FAULT", "slow_probe:1"),
];

/// The same across emulated hosts joined by a slow network.
pub(crate) const AUTO_SKEWED_HOSTS: &[(&str, &str)] = &[
    ("FERROVOD_ALGORITHM", "auto"),
    ("FERROVOD_TEST_FAULT", "slow_probe:1"),
    ("FERROVOD_TEST_SLOW_CROSS", "1"),
];

/// Hierarchical allreduce over the emulated hosts (nodes from MPI_COMM_TYPE_SHARED).
pub(crate) const HIERARCHICAL_HOSTS: &[(&str, &str)] = &[
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
    ("FERROVOD_TEST_HIERARCHICAL", "1"),
];

pub(crate) const SCENARIOS: &[Scenario] = &[
    ("collectives", 2, &[], true),
    ("collectives", 4, &[], true),
    (
        "collectives",
        3,
        &[
            ("HOROVOD_CACHE_CAPACITY", "0"),
            ("HOROVOD_FUSION_THRESHOLD", "0"),
        ],
        true,
    ),
    (
        "collectives",
        2,
        &[("FERROVOD_FUSION_DIRECT_BYTES", "0")],
        true,
    ),
    // tiny MPI call limit: every transfer takes the split paths built for >2^31 elements
    ("collectives", 3, &[("FERROVOD_MPI_MAX_COUNT", "7")], true),
    ("random_order", 2, &[], true),
    (
        "random_order",
        4,
        &[
            ("HOROVOD_CACHE_CAPACITY", "8"),
            ("HOROVOD_FUSION_THRESHOLD", "4096"),
        ],
        true,
    ),
    (
        "random_order",
        2,
        &[("HOROVOD_MPI_THREADS_DISABLE", "1")],
        true,
    ),
    (
        "random_order",
        3,
        &[("FERROVOD_NEGOTIATION", "horovod")],
        true,
    ),
    ("metrics", 2, &[], true),
    (
        "online_groups",
        3,
        // the learned groups fit one vote word however many cycles a step was agreed in (at
        // most 30 groups, neighbouring cycles merged); 40 single tensors need two words
        &[
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("FERROVOD_PLAN_ESCAPE_MS", "200"),
            ("HOROVOD_CYCLE_TIME", "50"),
        ],
        true,
    ),
    (
        "group_votes",
        2,
        &[
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("HOROVOD_CYCLE_TIME", "50"),
        ],
        true,
    ),
    // gossip steps vote in the same learned groups
    (
        "group_votes",
        3,
        &[
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("HOROVOD_CYCLE_TIME", "50"),
            ("GROUP_KIND", "gossip"),
            ("FERROVOD_GOSSIP_SYNC_EVERY", "1"),
        ],
        true,
    ),
    ("offline_steps", 2, OFFLINE, true),
    ("random_order", 3, OFFLINE, true),
    ("offline_steps", 4, OFFLINE, true),
    ("offline_save", 3, OFFLINE, true),
    ("offline_load", 3, OFFLINE, true),
    ("offline_stale_plan", 2, OFFLINE, true),
    ("offline_diverge", 2, OFFLINE, true),
    ("offline_skip", 2, OFFLINE_STALL, true),
    ("offline_stall", 2, OFFLINE_STALL, false),
    // a rank missing from a compressed batch of a frozen plan, and from an online one
    ("offline_stall", 2, OFFLINE_STALL_FP16, false),
    ("stall", 2, STALL_FAST_FP16, true),
    (
        "online_groups_stall",
        2,
        &[
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
        ],
        true,
    ),
    ("metrics", 3, &[("FERROVOD_NEGOTIATION", "horovod")], true),
    (
        "random_order",
        4,
        &[
            ("FERROVOD_CHANNELS", "3"),
            ("HOROVOD_FUSION_THRESHOLD", "2048"),
        ],
        true,
    ),
    ("collectives", 2, &[("FERROVOD_CHANNELS", "2")], true),
    (
        "autotune",
        2,
        &[
            ("HOROVOD_AUTOTUNE", "1"),
            ("FERROVOD_AUTOTUNE_WINDOW_CYCLES", "4"),
            ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "1"),
        ],
        true,
    ),
    ("join", 3, &[("FERROVOD_CHANNELS", "2")], true),
    (
        "process_sets",
        4,
        &[("PERSEUS_ALLREDUCE_STREAMS", "2")],
        true,
    ),
    (
        "offline_steps",
        2,
        &[
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("FERROVOD_CHANNELS", "2"),
        ],
        true,
    ),
    ("env_differs", 2, &[], true),
    ("cache_changes", 2, &[("HOROVOD_CACHE_CAPACITY", "4")], true),
    ("join", 2, &[], true),
    ("join", 4, &[], true),
    ("join", 3, &[("HOROVOD_CACHE_CAPACITY", "0")], true),
    ("process_sets", 4, &[], true),
    ("topology", 4, &[("FERROVOD_LOCAL_SIZE", "2")], true),
    // Open MPI's TCP transport without put, unless the job sets its own flags
    ("tcp_flags", 2, &[("FERROVOD_TEST_EXPECT_PUT", "0")], true),
    (
        "tcp_flags",
        2,
        &[
            (
                "OMPI_MCA_btl_tcp_flags",
                "send,put,inplace,need-ack,need-csum,hetero-rdma",
            ),
            ("FERROVOD_TEST_EXPECT_PUT", "1"),
        ],
        true,
    ),
    ("mismatches", 2, &[], true),
    ("mismatches", 4, &[], true),
    ("bad_arguments", 2, &[], true),
    ("stall", 2, STALL_FAST, true),
    ("stall_cached", 2, STALL_FAST, true),
    ("stall_in_set", 3, STALL_FAST, true),
    ("op_timeout", 2, STALL_LONG, true),
    ("op_timeout", 3, STALL_LONG_CACHED, true),
    ("op_timeout", 2, STALL_LONG_CACHED_HOROVOD, true),
    ("op_timeout", 3, STALL_LONG_GROUP, true),
    ("alloc_failure", 2, &[], true),
    ("callbacks", 2, &[], true),
    ("shutdown_pending", 2, &[], true),
    ("rank_exits", 2, &[], true),
    ("rank_killed", 2, STALL_FAST, false),
    ("rank_killed", 3, STALL_FAST, false),
    // a rank that hangs (stops) rather than dies: in a vote, inside a data collective
    ("rank_stopped", 2, STALL_FAST, false),
    ("rank_stopped", 3, STALL_FAST, false),
    ("rank_stopped", 3, STALL_FAST_HOROVOD, false),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH, false),
    ("rank_stopped_in_batch", 3, STOP_IN_BATCH, false),
    // a rank missing from a PowerSGD exchange, and from a top-k one
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH_POWERSGD, false),
    (
        "rank_stopped_in_batch",
        2,
        STOP_IN_BATCH_POWERSGD_START,
        false,
    ),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH_TOPK, false),
    // the stall limits are rank 0's, whatever the other ranks' environments say
    (
        "stall_env_differs",
        2,
        &[("FERROVOD_TEST_FAULT", "stop_in_batch:0")],
        false,
    ),
    // a collective that outlasts the stall limit with every rank inside it is not a stall
    ("slow_collective", 2, SLOW_IN_BATCH, true),
    ("slow_collective", 3, SLOW_IN_BATCH, true),
    // local failures after the ranks agreed
    (
        "fault_panic",
        2,
        &[("FERROVOD_TEST_FAULT", "panic:1")],
        false,
    ),
    ("fault_negotiation", 3, NEGOTIATION_FAULT, false),
    // the same for each other way the background loop can end on one rank alone
    ("fault_negotiation", 2, AUTOTUNE_FAULT, false),
    ("fault_negotiation", 3, FREEZE_FAULT, false),
    ("fault_negotiation", 2, OFFLINE_FAULT, false),
    // a rank that stops between the vote and the coordinator round (rank 0 waits in the
    // gather; with 3 ranks, rank 2 in the broadcast)
    ("rank_stopped", 2, STOP_IN_ROUND, false),
    ("rank_stopped", 3, STOP_IN_ROUND, false),
    // offline negotiation: the plan froze, then rank 1 stops
    ("rank_stopped", 2, OFFLINE_STOP, false),
    (
        "fault_decode",
        3,
        &[("FERROVOD_TEST_FAULT", "decode:0")],
        true,
    ),
    ("preinitialized_mpi", 4, &[], true),
    ("init_subset", 3, &[], true),
    (
        "timeline",
        2,
        &[("HOROVOD_TIMELINE_MARK_CYCLES", "1")],
        true,
    ),
    // the scale model's decisions against the run's timeline
    ("schedule", 2, SCHEDULE_RING, true),
    ("schedule", 3, SCHEDULE_FP16, true),
    ("schedule", 4, SCHEDULE_OFFLINE_HIERARCHICAL, true),
    ("large_counts", 2, &[], true),
    ("large_fused", 2, FUSE_ALL, true),
    ("large_fused", 3, FUSE_ALL, true),
    ("large_fused", 2, FUSE_ALL_RING, true),
    ("large_fused", 3, FUSE_ALL_RING, true),
    ("large_fused", 3, FUSE_ALL_RING_SMALL_COUNT, true),
    ("huge_settings", 2, HUGE_SETTINGS, true),
    ("compressed", 2, FP16, true),
    ("compressed", 3, FP16_RING, true),
    ("compressed", 4, FP16, true),
    ("compressed", 2, BF16, true),
    ("compressed", 3, BF16, true),
    ("compressed", 4, BF16, true),
    ("compressed", 4, FP16_HIERARCHICAL, true),
    ("mixed_compressed", 2, MIXED, true),
    ("mixed_compressed", 3, MIXED, true),
    ("mixed_compressed", 4, MIXED, true),
    ("mixed_compressed", 2, MIXED_OFFLINE, true),
    ("nan_check", 3, &[("PERSEUS_ALLREDUCE_NANCHECK", "1")], true),
    ("u8_compressed", 2, &[("FERROVOD_COMPRESSION", "u8")], true),
    (
        "powersgd_compressed",
        2,
        &[("FERROVOD_COMPRESSION", "powersgd")],
        true,
    ),
    (
        "powersgd_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_POWERSGD_RANK", "2"),
        ],
        true,
    ),
    (
        "powersgd_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    (
        "powersgd_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_POWERSGD_START", "3"),
        ],
        true,
    ),
    (
        "powersgd_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_POWERSGD_START", "3"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    (
        "topk_compressed",
        2,
        &[("FERROVOD_COMPRESSION", "topk")],
        true,
    ),
    ("topk_exact", 2, TOPK_MOMENTUM, true),
    ("topk_exact", 3, TOPK_PIECES, true),
    (
        "powersgd_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_FUSION_DIRECT_BYTES", "1000000000"),
        ],
        true,
    ),
    // the fused batch's arithmetic on three threads per rank (the same bits as on one)
    (
        "powersgd_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "powersgd"),
            ("FERROVOD_FUSION_DIRECT_BYTES", "1000000000"),
            ("FERROVOD_COMPRESSION_THREADS", "3"),
        ],
        true,
    ),
    ("codec_memory_flat", 2, &[], true),
    (
        "topk_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "topk"),
            ("FERROVOD_TOPK_RATIO", "0.05"),
        ],
        true,
    ),
    (
        "topk_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "topk"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    (
        "topk_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "topk"),
            ("FERROVOD_TOPK_WARMUP_STEPS", "4"),
        ],
        true,
    ),
    (
        "topk_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "topk"),
            ("FERROVOD_TOPK_WARMUP_STEPS", "4"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    ("u8_compressed", 3, &[("FERROVOD_COMPRESSION", "u8")], true),
    ("u8_compressed", 4, &[("FERROVOD_COMPRESSION", "u8")], true),
    ("compressed_in_sets", 4, &[], true),
    (
        "u8_compressed",
        4,
        &[("FERROVOD_COMPRESSION", "u8"), ("FERROVOD_CHANNELS", "2")],
        true,
    ),
    (
        "u8_compressed",
        2,
        &[
            ("FERROVOD_COMPRESSION", "u8"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    (
        "nan_check",
        2,
        &[
            ("PERSEUS_ALLREDUCE_NANCHECK", "1"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    ("p2p", 2, &[], true),
    ("p2p", 3, &[], true),
    ("p2p", 4, &[("FERROVOD_CHANNELS", "2")], true),
    ("p2p_mismatch", 2, &[], true),
    ("p2p_any_source", 4, &[], true),
    // votes longer than the cycle time run back to back: transfers still move between them
    (
        "p2p_any_source",
        4,
        &[("HOROVOD_CYCLE_TIME", "0.001")],
        true,
    ),
    ("p2p_stall", 2, STALL_FAST, false),
    ("p2p_bad_calls", 3, &[], true),
    ("gossip", 2, GOSSIP_ONLY, true),
    ("gossip", 3, GOSSIP_ONLY, true),
    ("gossip", 4, GOSSIP_ONLY, true),
    ("gossip", 8, GOSSIP_ONLY, true),
    (
        "gossip_sync",
        3,
        &[("FERROVOD_GOSSIP_SYNC_EVERY", "3")],
        true,
    ),
    (
        "gossip_sync",
        4,
        &[("FERROVOD_GOSSIP_SYNC_EVERY", "3")],
        true,
    ),
    ("gossip_stall", 3, STALL_FAST, true),
    ("gossip_stall", 2, STALL_FAST_MULTISTEP, true),
    (
        "gossip_compressed",
        4,
        &[
            ("FERROVOD_COMPRESSION", "fp16"),
            ("FERROVOD_GOSSIP_SYNC_EVERY", "0"),
        ],
        true,
    ),
    (
        "gossip_compressed",
        4,
        &[
            ("FERROVOD_COMPRESSION", "fp16"),
            ("FERROVOD_GOSSIP_SYNC_EVERY", "0"),
            ("FERROVOD_CHANNELS", "2"),
        ],
        true,
    ),
    (
        "gossip_compressed",
        3,
        &[
            ("FERROVOD_COMPRESSION", "u8"),
            ("FERROVOD_GOSSIP_SYNC_EVERY", "0"),
        ],
        true,
    ),
    ("multistep", 2, &[("FERROVOD_MULTISTEP", "2")], true),
    ("multistep", 3, &[("FERROVOD_MULTISTEP", "2")], true),
    ("ring", 2, &[], true),
    ("ring", 3, &[], true),
    ("ring", 4, &[], true),
    (
        "hierarchical_allreduces",
        2,
        HIERARCHICAL_ONE_PER_NODE,
        true,
    ),
    (
        "hierarchical_allreduces",
        4,
        HIERARCHICAL_ONE_PER_NODE,
        true,
    ),
    ("hierarchical_allreduces", 2, HIERARCHICAL_ONE_NODE, true),
    // hierarchical allreduce: 2 nodes of 2 ranks; 2 + 1 falls back to flat
    ("collectives", 4, HIERARCHICAL_LOCAL2, true),
    ("collectives", 3, HIERARCHICAL_UNEVEN, true),
    ("collectives", 4, HIERARCHICAL_ALLGATHER_LOCAL2, true),
    ("join", 4, HIERARCHICAL_LOCAL2, true),
    ("large_fused", 4, HIERARCHICAL_LOCAL2, true),
    ("offline_steps", 4, HIERARCHICAL_OFFLINE, true),
    // every host allreduce through the ring over point-to-point transfers
    ("collectives", 2, &[("FERROVOD_RING_MIN_BYTES", "1")], true),
    ("collectives", 3, &[("FERROVOD_RING_MIN_BYTES", "1")], true),
    ("collectives", 4, &[("FERROVOD_RING_MIN_BYTES", "1")], true),
    // auto: agreed choices, right results whichever algorithm each batch takes
    ("algorithm_agreed", 4, AUTO_SKEWED, true),
    ("collectives", 4, AUTO_SKEWED, true),
];

/// Emulated hosts of a scenario (scripts/hosts/): `n` network namespaces of `per` ranks each,
/// joined by links at `rate` (tc syntax).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hosts {
    pub n: usize,
    pub per: usize,
    pub rate: &'static str,
    /// Ranks round-robin over the hosts (`--map-by node`) rather than in blocks.
    pub round_robin: bool,
    /// The links' MTU (`FERROVOD_HOSTS_MTU`; 1500 when not set).
    pub mtu: Option<u32>,
}

/// (scenario, emulated hosts, extra environment, expect success)
pub(crate) type HostScenario = (
    &'static str,
    Hosts,
    &'static [(&'static str, &'static str)],
    bool,
);

/// Two hosts of one rank joined at 1 Gbit/s: where the link's rate is checked.
const LINK_RATE_HOSTS: Hosts = Hosts {
    n: 2,
    per: 1,
    rate: "1gbit",
    round_robin: false,
    mtu: None,
};

/// Scenarios across emulated hosts: they need root and network namespaces. Where namespaces
/// are not permitted they are skipped with one line, unless `FERROVOD_REQUIRE_HOSTS=1` (the
/// test command sets it) makes that a failure.
pub(crate) const HOST_SCENARIOS: &[HostScenario] = &[
    ("link_rate", LINK_RATE_HOSTS, &[], true),
    // jumbo frames: the rate still holds, and frames of 9000 bytes pass the token buckets
    (
        "link_rate",
        Hosts {
            mtu: Some(9000),
            ..LINK_RATE_HOSTS
        },
        &[],
        true,
    ),
    (
        "collectives",
        Hosts {
            n: 2,
            per: 2,
            rate: "10gbit",
            round_robin: false,
            mtu: None,
        },
        HIERARCHICAL_HOSTS,
        true,
    ),
    // pipelined pieces: each piece's transfers across hosts overlap the next one's node work
    (
        "large_fused",
        Hosts {
            n: 2,
            per: 2,
            rate: "10gbit",
            round_robin: false,
            mtu: None,
        },
        HIERARCHICAL_HOSTS,
        true,
    ),
    // ranks round-robin over the hosts: a node's ranks are not consecutive
    (
        "collectives",
        Hosts {
            n: 2,
            per: 2,
            rate: "10gbit",
            round_robin: true,
            mtu: None,
        },
        HIERARCHICAL_HOSTS,
        true,
    ),
    (
        "collectives",
        Hosts {
            n: 2,
            per: 4,
            rate: "10gbit",
            round_robin: true,
            mtu: None,
        },
        HIERARCHICAL_SETS,
        true,
    ),
    (
        "algorithm_agreed",
        Hosts {
            n: 2,
            per: 2,
            rate: "1gbit",
            round_robin: false,
            mtu: None,
        },
        AUTO_SKEWED_HOSTS,
        true,
    ),
    // nodes from MPI_COMM_TYPE_SHARED: one per namespace
    (
        "topology",
        Hosts {
            n: 2,
            per: 2,
            rate: "10gbit",
            round_robin: false,
            mtu: None,
        },
        &[],
        true,
    ),
];

/// With `FERROVOD_TEST_GPU=1` (GPU machines): the same checks on GPU memory, each rank on GPU
/// `local_rank`, against the same host-computed references. `np` above the GPU count is
/// skipped (NCCL needs a GPU per rank).
pub(crate) const GPU_SCENARIOS: &[Scenario] = &[
    // failure paths of GPU batches: none may hang
    ("rank_stopped", 2, STALL_FAST, false),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH, false),
    // a rank stopped inside a GPU batch of PowerSGD's factors (and its uncompressed first
    // steps) and of top-k's pairs: every rank ends with an error
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH_POWERSGD, false),
    (
        "rank_stopped_in_batch",
        2,
        STOP_IN_BATCH_POWERSGD_START,
        false,
    ),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH_TOPK, false),
    ("fault_nccl_init", 2, NCCL_INIT_FAULT, false),
    ("gpu_alltoall_fault", 2, GPU_ALLTOALL_FAULT, false),
    ("gpu_staged_fault", 2, GPU_STAGED_FAULT, false),
    ("collectives", 2, &[], true),
    ("collectives", 4, &[], true),
    (
        "collectives",
        2,
        &[
            ("HOROVOD_FUSION_THRESHOLD", "0"),
            ("HOROVOD_CACHE_CAPACITY", "0"),
        ],
        true,
    ),
    ("collectives", 2, &[("FERROVOD_CHANNELS", "2")], true),
    (
        "collectives",
        2,
        &[("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")],
        true,
    ),
    ("random_order", 2, &[], true),
    ("random_order", 4, &[("FERROVOD_CHANNELS", "3")], true),
    ("join", 2, &[], true),
    ("join", 4, &[], true),
    ("mismatches", 2, &[], true),
    ("mismatches", 4, &[], true),
    ("process_sets", 4, &[], true),
    ("gpu_kernels", 1, &[], true),
    ("gpu_ring", 2, &[], true),
    ("gpu_ring", 4, &[], true),
    // PERSEUS_ALLREDUCE_NANCHECK on GPU batches (counted by a kernel), also when handles would
    // complete at enqueue
    ("nan_check", 2, &[("PERSEUS_ALLREDUCE_NANCHECK", "1")], true),
    (
        "nan_check",
        2,
        &[
            ("PERSEUS_ALLREDUCE_NANCHECK", "1"),
            ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1"),
        ],
        true,
    ),
    // gossip over NCCL send/recv: the host scenarios on GPU tensors, the exchanges kept inside
    // the one node
    ("gossip", 2, GPU_GOSSIP_PAIRS, true),
    ("gossip", 3, GPU_GOSSIP_PAIRS, true),
    ("gossip", 4, GPU_GOSSIP_PAIRS, true),
    (
        "gossip_sync",
        2,
        &[
            ("FERROVOD_GOSSIP_SYNC_EVERY", "3"),
            ("FERROVOD_GOSSIP_EXACT_INSIDE_NODE", "0"),
        ],
        true,
    ),
    (
        "gossip_stall",
        2,
        &[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
            ("FERROVOD_GOSSIP_EXACT_INSIDE_NODE", "0"),
        ],
        true,
    ),
    // by default, GPU gossip inside one node is exact averages over NCCL's allreduce; its stall
    ("gossip_exact", 2, &[], true),
    ("gossip_exact", 4, &[], true),
    ("gossip_stall", 2, STALL_FAST, true),
    ("gpu_compressed", 2, &[], true),
    // the u8 codec on GPUs: bit for bit the host's, and the host scenario on GPU tensors (two
    // NCCL streams by default: residuals cross them)
    ("gpu_u8", 2, &[], true),
    ("gpu_u8", 4, &[], true),
    ("u8_compressed", 2, &[("FERROVOD_COMPRESSION", "u8")], true),
    ("u8_compressed", 4, &[("FERROVOD_COMPRESSION", "u8")], true),
    // PowerSGD's kernels against the f64 reference: one rank (its own approximation, every
    // phase but the sums' traffic: runs on a one-GPU machine), then 2 and 4 ranks
    ("powersgd_compressed", 1, POWERSGD, true),
    ("powersgd_compressed", 1, POWERSGD_START, true),
    ("powersgd_compressed", 2, POWERSGD, true),
    ("powersgd_compressed", 2, POWERSGD_OFFLINE, true),
    ("powersgd_compressed", 4, POWERSGD_START, true),
    // top-k's kernels: the host's selection, residuals and sums bit for bit, then the scenario
    // against the f64 reference
    ("topk_exact", 1, TOPK, true),
    ("topk_exact", 1, TOPK_MOMENTUM, true),
    ("topk_exact", 2, TOPK_MOMENTUM, true),
    ("topk_exact", 4, TOPK, true),
    ("topk_compressed", 1, TOPK_WARMUP, true),
    ("topk_compressed", 2, TOPK, true),
    ("topk_compressed", 2, TOPK_OFFLINE, true),
    // two channels whose batches take turns, and handles that complete at enqueue: a
    // tensor's state is used by batches on either channel's stream, each after the last
    ("topk_exact", 1, TOPK_CHANNELS, true),
    ("powersgd_compressed", 1, POWERSGD_CHANNELS, true),
    ("topk_exact", 2, TOPK_CHANNELS, true),
    // named and unnamed GPU tensors under both, 1,000 steps: the GPU's memory stays flat
    ("codec_memory_flat", 1, &[], true),
    ("codec_memory_flat", 2, &[], true),
    // the 16-bit codecs through the hierarchical GPU allreduce (one node of two GPUs: NCCL
    // reduce-scatter and allgather between them)
    ("compressed", 2, FP16_HIERARCHICAL, true),
    // offline negotiation with the codecs and with the NaN check, on GPU batches
    ("mixed_compressed", 2, MIXED_OFFLINE, true),
    // offline on GPU tensors: no plan holds them, so the votes carry learned groups, one word
    // per vote, as online
    ("online_groups", 1, OFFLINE, true),
    ("online_groups", 2, OFFLINE, true),
    (
        "nan_check",
        2,
        &[
            ("PERSEUS_ALLREDUCE_NANCHECK", "1"),
            ("FERROVOD_NEGOTIATION", "offline"),
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
        ],
        true,
    ),
    (
        "hierarchical_allreduces",
        2,
        HIERARCHICAL_ONE_PER_NODE,
        true,
    ),
    ("hierarchical_allreduces", 2, HIERARCHICAL_ONE_NODE, true),
    // the GPU hierarchical allreduce in pieces (the host's schedule): 2 nodes of one GPU (the
    // MPI step across), and 2 nodes of 2 GPUs (NCCL inside each node as well)
    ("large_fused", 2, HIERARCHICAL_ONE_PER_NODE_CHECKED, true),
    ("large_fused", 4, HIERARCHICAL_LOCAL2, true),
    (
        "gpu_failure",
        2,
        &[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "2"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "4"),
        ],
        true,
    ),
    // the survivor's u8 batch enqueues an alltoall to the failed rank: its send/recv
    // connections were set up beforehand, so the enqueue returns and the rank can vote
    (
        "gpu_failure",
        2,
        &[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "2"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "4"),
            ("FERROVOD_COMPRESSION", "u8"),
        ],
        true,
    ),
    (
        "gpu_peers_fault",
        2,
        &[("FERROVOD_TEST_FAULT", "nccl_peers:1")],
        true,
    ),
    (
        "gpu_graphs",
        2,
        &[("FERROVOD_PLAN_WARMUP_STEPS", "2")],
        true,
    ),
    (
        "gpu_graphs",
        2,
        &[
            ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
            ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1"),
        ],
        true,
    ),
    (
        "gpu_graphs_gossip",
        2,
        &[("FERROVOD_PLAN_WARMUP_STEPS", "2")],
        true,
    ),
    // one rank too: a one-GPU machine checks the replay
    (
        "gpu_graphs_gossip",
        1,
        &[("FERROVOD_PLAN_WARMUP_STEPS", "2")],
        true,
    ),
    (
        "gpu_graphs",
        1,
        &[("FERROVOD_PLAN_WARMUP_STEPS", "2")],
        true,
    ),
    ("gpu_streams", 2, &[], true),
    ("gpu_thread_context", 1, &[], true),
    ("gpu_thread_context", 2, &[], true),
    (
        "gpu_streams",
        2,
        &[("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")],
        true,
    ),
];

pub(crate) fn gpu_mode() -> bool {
    std::env::var("FERROVOD_TEST_GPU").is_ok_and(|v| v == "1")
}

/// Scenarios in which ranks fail, stop or stall: every rank must end with an error.
const FAILURES: &[&str] = &[
    "stall",
    "stall_cached",
    "stall_in_set",
    "op_timeout",
    "offline_stall",
    "rank_stopped",
    "rank_stopped_in_batch",
    "rank_killed",
    "stall_env_differs",
    "fault_panic",
    "fault_negotiation",
    "fault_decode",
    "fault_nccl_init",
    "gpu_alltoall_fault",
    "gpu_staged_fault",
];

/// How long a scenario may run. A failure scenario must end within its stall shutdown time
/// (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`; none: it fails at once) plus a margin for mpirun's
/// start, the presence probe and the exit grace (and NCCL's set-up on GPUs): a hang, or an end
/// that comes late, fails it.
fn time_limit(name: &str, env: &[(&str, &str)]) -> Duration {
    if !FAILURES.contains(&name) {
        return Duration::from_secs(300);
    }
    let stall: u64 = env
        .iter()
        .find(|(k, _)| *k == "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
        .map_or(0, |(_, v)| v.parse().expect("whole seconds"));
    let margin = if gpu_mode() { 40 } else { 15 };
    Duration::from_secs(stall + margin)
}

pub(crate) fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        let name = std::env::args().nth(1).expect("scenario name");
        run_rank(&name);
        return;
    }
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let exe = std::env::current_exe().unwrap();
    // shared by the scenarios of this run (a plan file written by one and read by the next)
    let shared = std::env::temp_dir().join(format!("ferrovod-test-{}-shared", std::process::id()));
    std::fs::create_dir_all(&shared).unwrap();
    let mut failed = Vec::new();
    let mut ran = 0;
    let (scenarios, gpus) = if gpu_mode() {
        let n = ferrovod::transport::cuda::device_count().expect("CUDA devices");
        println!("GPU mode: {n} GPU(s)");
        (GPU_SCENARIOS, n)
    } else {
        (SCENARIOS, usize::MAX)
    };
    let mut runs: Vec<Run> = scenarios
        .iter()
        .map(|(name, np, env, ok)| (*name, *np, None, *env, *ok))
        .collect();
    if !gpu_mode() {
        runs.extend(
            HOST_SCENARIOS
                .iter()
                .map(|(name, h, env, ok)| (*name, h.n * h.per, Some(*h), *env, *ok)),
        );
    }
    let require_hosts = std::env::var("FERROVOD_REQUIRE_HOSTS").is_ok_and(|v| v == "1");
    for (name, np, hosts, env, expect_ok) in &runs {
        let (name, np) = (*name, *np);
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let label = match hosts {
            Some(h) => format!(
                "{name} hosts={}x{} at {}{}{}",
                h.n,
                h.per,
                h.rate,
                if h.round_robin { ", round-robin" } else { "" },
                h.mtu.map_or(String::new(), |m| format!(", MTU {m}"))
            ),
            None => format!("{name} np={np}"),
        };
        if np > gpus && !shares_gpus(name, env) {
            println!("scenario {label} ... skipped ({gpus} GPUs)");
            continue;
        }
        // the emulated hosts live as long as this scenario (removed again on drop)
        let _namespaces = match hosts.map(EmulatedHosts::up) {
            Some(Err(why)) if !require_hosts => {
                println!("scenario {label} ... skipped (emulated hosts: {why})");
                continue;
            }
            Some(Err(why)) => {
                println!("scenario {label} ... FAILED: emulated hosts: {why}");
                failed.push(label);
                continue;
            }
            Some(Ok(up)) => Some(up),
            None => None,
        };
        if let Some(Err(why)) = hosts.map(mtu_in_force) {
            println!("scenario {label} ... FAILED: {why}");
            failed.push(label);
            continue;
        }
        ran += 1;
        let start = Instant::now();
        let dir =
            std::env::temp_dir().join(format!("ferrovod-test-{}-{name}-{np}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = match hosts {
            Some(h) => {
                let mut c = Command::new("bash");
                c.arg(hosts_script("mpirun.sh"))
                    .args([h.n.to_string(), h.per.to_string()]);
                if h.round_robin {
                    c.args(["--map-by", "node"]);
                }
                c
            }
            None => {
                let mut c = Command::new("mpirun");
                c.args(["-np", &np.to_string(), "--allow-run-as-root"])
                    .args(["--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"]);
                if name == "rank_killed" {
                    // the survivors run on after a death, to report it themselves
                    c.arg("--enable-recovery");
                }
                c
            }
        };
        cmd.arg("--oversubscribe")
            .args(["-x", "FERROVOD_TEST_DIR", "-x", "FERROVOD_TEST_SHARED"])
            .args(["-x", "FERROVOD_TEST_GPU", "-x", "NCCL_NVLS_ENABLE"])
            // as the launcher and the Python package do (docs/gpu.md)
            .env(
                "NCCL_RUNTIME_CONNECT",
                std::env::var("NCCL_RUNTIME_CONNECT").unwrap_or_else(|_| "0".into()),
            )
            .args(["-x", "NCCL_RUNTIME_CONNECT"])
            .arg(&exe)
            .arg(name)
            .env("FERROVOD_TEST_DIR", &dir)
            .env("FERROVOD_TEST_SHARED", &shared)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if name == "timeline" || name == "schedule" {
            let path = dir.join("timeline.json");
            cmd.env("HOROVOD_TIMELINE", &path)
                .args(["-x", "HOROVOD_TIMELINE"]);
        }
        for (k, v) in *env {
            cmd.env(k, v).args(["-x", k]);
        }
        let limit = time_limit(name, env);
        let out = run_with_timeout(cmd, limit);
        let secs = start.elapsed().as_secs_f64();
        let (ok, why) = match &out {
            Err(said) => (
                false,
                format!(
                    "did not end within {limit:?}: a hang, or an end that came too late\n{said}"
                ),
            ),
            Ok((status, stdout, stderr)) => {
                let passes = stdout.matches("RANK-PASSED").count();
                if *expect_ok {
                    // fp16: every rank's value beyond f16's range is named in its warning
                    let fp16 = env.contains(&("FERROVOD_COMPRESSION", "fp16"));
                    let warned = match name {
                        "compressed" if fp16 => {
                            stderr
                                .matches("tensor 'cmp.overflow': 1 values out of")
                                .count()
                                >= np
                        }
                        // the waiting ranks asked, and found every rank inside
                        "slow_collective" => stderr.contains("slow, not stalled"),
                        _ => true,
                    };
                    let good = status.success() && passes == np && warned;
                    (
                        good,
                        format!(
                            "exit {status}, {passes}/{np} ranks passed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
                        ),
                    )
                } else {
                    // a scenario that prints a marker must print it before the job fails,
                    // on as many ranks as it says
                    let (marker, count) = match name {
                        "offline_stall" => ("OFFLINE-STALL-REPORTED", 1),
                        "p2p_stall" => ("P2P-STALL-REPORTED", np),
                        "rank_stopped" | "fault_negotiation" => ("STALL-REPORTED", np - 1),
                        "rank_killed" => ("KILLED-REPORTED", np - 1),
                        _ => ("", 0),
                    };
                    let reported = match name {
                        // host: the watchdog's report; GPU: each survivor's error
                        "rank_stopped_in_batch" => {
                            stderr.matches("Missing ranks: 1.").count() >= np - 1
                                || stdout.matches("STALL-REPORTED").count() >= np - 1
                        }
                        "stall_env_differs" => {
                            stderr.contains("Missing ranks: 0.")
                                || stdout.contains("STALL-REPORTED rank=1")
                        }
                        "fault_panic" => stderr.contains("background thread panicked"),
                        "fault_negotiation" => stdout.contains("FAULT-REPORTED rank=1"),
                        "fault_nccl_init" => stderr.contains("in ncclCommInitRank"),
                        "gpu_alltoall_fault" | "gpu_staged_fault" => {
                            stderr.contains("Stalled ranks")
                        }
                        _ => true,
                    };
                    // with --enable-recovery mpirun's own status says nothing: the survivors'
                    // reports are what counts
                    let ended = !status.success() || name == "rank_killed";
                    (
                        ended && stdout.matches(marker).count() >= count && reported,
                        format!("expected the job to fail, exit {status}\n{stdout}\n{stderr}"),
                    )
                }
            }
        };
        let extra = if ok && name == "timeline" {
            check_timeline(&dir.join("timeline.json"))
        } else if ok && name == "schedule" {
            check_schedule(&dir.join("timeline.json"), np, env)
        } else {
            Ok(())
        };
        let _ = std::fs::remove_dir_all(&dir);
        match (ok, extra) {
            (true, Ok(())) => println!("scenario {label} ... ok ({secs:.1}s)"),
            (true, Err(e)) => {
                println!("scenario {label} ... FAILED: {e}");
                failed.push(label);
            }
            (false, _) => {
                println!("scenario {label} ... FAILED ({secs:.1}s): {why}");
                failed.push(label);
            }
        }
    }
    println!("{ran} scenarios, {} failed", failed.len());
    if !failed.is_empty() {
        eprintln!("failed: {failed:?}");
        std::process::exit(1);
    }
}

/// One run of a scenario: name, ranks, emulated hosts (None: this machine), environment,
/// expect success.
type Run = (
    &'static str,
    usize,
    Option<Hosts>,
    &'static [(&'static str, &'static str)],
    bool,
);

/// A script of `scripts/hosts/`.
fn hosts_script(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts/hosts")
        .join(name)
}

/// Emulated hosts, set up for one scenario and removed when dropped.
struct EmulatedHosts;

impl EmulatedHosts {
    /// Err: why they cannot be made here (no root, no network namespaces, no tbf).
    fn up(h: Hosts) -> Result<EmulatedHosts, String> {
        let mut up = Command::new("bash");
        up.arg(hosts_script("up.sh"))
            .args([h.n.to_string(), h.rate.to_string()]);
        if let Some(mtu) = h.mtu {
            up.env("FERROVOD_HOSTS_MTU", mtu.to_string());
        }
        let out = up.output().map_err(|e| e.to_string())?;
        if out.status.success() {
            return Ok(EmulatedHosts);
        }
        let _ = Command::new("bash").arg(hosts_script("down.sh")).status();
        let err = String::from_utf8_lossy(&out.stderr);
        Err(err.lines().last().unwrap_or("up.sh failed").to_string())
    }
}

/// Whether host 0's link has the MTU the scenario asked for (a scenario that passes at 1500
/// proves nothing about jumbo frames).
fn mtu_in_force(h: Hosts) -> Result<(), String> {
    let Some(mtu) = h.mtu else {
        return Ok(());
    };
    let link = Command::new("ip")
        .args(["-n", "fvhost0", "-o", "link", "show", "fvh0"])
        .output()
        .map_err(|e| e.to_string())?;
    let shown = String::from_utf8_lossy(&link.stdout);
    match shown.contains(&format!(" mtu {mtu} ")) {
        true => Ok(()),
        false => Err(format!("host 0's link is not at MTU {mtu}: {shown}")),
    }
}

impl Drop for EmulatedHosts {
    fn drop(&mut self) {
        let _ = Command::new("bash").arg(hosts_script("down.sh")).status();
    }
}

/// Runs `cmd` to its end, or kills it after `limit`: then Err with what its ranks had written
/// so far (a hang's last words), read without waiting for the pipes to close, since ranks
/// orphaned by the kill may still hold them.
pub(crate) fn run_with_timeout(
    mut cmd: Command,
    limit: Duration,
) -> Result<(std::process::ExitStatus, String, String), String> {
    use std::sync::{Arc, Mutex};
    let mut child = cmd.spawn().expect("mpirun");
    let reader = |pipe: Box<dyn std::io::Read + Send>| {
        let text = Arc::new(Mutex::new(Vec::new()));
        let into = text.clone();
        let thread = std::thread::spawn(move || {
            let mut pipe = pipe;
            let mut chunk = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                into.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        (text, thread)
    };
    let (out, t_out) = reader(Box::new(child.stdout.take().unwrap()));
    let (err, t_err) = reader(Box::new(child.stderr.take().unwrap()));
    let text = |t: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&t.lock().unwrap()).into_owned();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let _ = (t_out.join(), t_err.join());
            return Ok((status, text(&out), text(&err)));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            // what arrives within a moment more, then whatever is there
            std::thread::sleep(Duration::from_millis(200));
            let tail = |s: String| {
                let cut = s.len().saturating_sub(4000);
                let cut = (cut..s.len())
                    .find(|i| s.is_char_boundary(*i))
                    .unwrap_or(s.len());
                s[cut..].to_string()
            };
            return Err(format!(
                "--- stdout (last 4000 bytes) ---\n{}\n--- stderr (last 4000 bytes) ---\n{}",
                tail(text(&out)),
                tail(text(&err))
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The timeline must be strict JSON (checked with Python's parser) and hold the events.
pub(crate) fn check_timeline(path: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("timeline missing: {e}"))?;
    let out = Command::new("python3")
        .args([
            "-c",
            "import json,sys; ev=json.load(open(sys.argv[1])); print(len(ev))",
        ])
        .arg(path)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "timeline is not valid JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    for needle in [
        "NEGOTIATE_ALLREDUCE",
        "\"ALLREDUCE\"",
        "MPI_ALLREDUCE",
        "WAIT_FOR_DATA",
        "MEMCPY_IN_FUSION_BUFFER",
        "MEMCPY_OUT_FUSION_BUFFER",
        "NEGOTIATE_ALLGATHER",
        "MPI_ALLGATHER",
        "CYCLE_START",
        "timeline.grad.0",
        "\"ph\": \"C\"",
        "\"name\": \"control\"",
        "\"name\": \"VOTE\"",
        "\"name\": \"BATCH\"",
    ] {
        if !text.contains(needle) {
            return Err(format!("timeline lacks {needle}"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rank side

pub(crate) fn run_rank(name: &str) {
    match name {
        "collectives" => collectives(),
        "random_order" => random_order(),
        "env_differs" => env_differs(),
        "cache_changes" => cache_changes(),
        "join" => join(),
        "process_sets" => process_sets(),
        "mismatches" => mismatches(),
        "bad_arguments" => bad_arguments(),
        "stall" => stall(),
        "stall_cached" => stall_cached(),
        "stall_in_set" => stall_in_set(),
        "op_timeout" => op_timeout(),
        "topology" => topology(),
        "tcp_flags" => tcp_flags(),
        "link_rate" => link_rate(),
        "algorithm_agreed" => algorithm_agreed(),
        "alloc_failure" => alloc_failure(),
        "callbacks" => callbacks(),
        "shutdown_pending" => shutdown_pending(),
        "rank_exits" => rank_exits(),
        "rank_killed" => rank_killed(),
        "rank_stopped" => rank_stopped(),
        "rank_stopped_in_batch" => rank_stopped_in_batch(),
        "slow_collective" => shutdown::slow_collective(),
        "stall_env_differs" => shutdown::stall_env_differs(),
        "huge_settings" => shutdown::huge_settings(),
        "fault_panic" => fault_panic(),
        "fault_negotiation" => fault_negotiation(),
        "fault_decode" => fault_decode(),
        "fault_nccl_init" => fault_nccl_init(),
        "gpu_alltoall_fault" => gpu_alltoall_fault(),
        "gpu_staged_fault" => gpu_staged_fault(),
        "preinitialized_mpi" => preinitialized_mpi(),
        "init_subset" => init_subset(),
        "timeline" => timeline(),
        "schedule" => schedule(),
        "large_counts" => large_counts(),
        "large_fused" => large_fused(),
        "compressed" => compressed(),
        "mixed_compressed" => mixed_compressed(),
        "nan_check" => nan_check(),
        "u8_compressed" => u8_compressed(),
        "powersgd_compressed" => powersgd_compressed(),
        "topk_compressed" => topk_compressed(),
        "topk_exact" => topk_exact(),
        "codec_memory_flat" => codec_memory_flat(),
        "compressed_in_sets" => compressed_in_sets(),
        "gossip" => gossip(),
        "p2p" => p2p(),
        "p2p_mismatch" => p2p_mismatch(),
        "p2p_any_source" => p2p_any_source(),
        "p2p_stall" => p2p_stall(),
        "p2p_bad_calls" => p2p_bad_calls(),
        "gossip_sync" => gossip_sync(),
        "gossip_stall" => gossip_stall(),
        "gossip_compressed" => gossip_compressed(),
        "gossip_exact" => gossip_exact(),
        "multistep" => multistep(),
        "ring" => ring(),
        "gpu_ring" => gpu_ring(),
        "gpu_compressed" => gpu_compressed(),
        "gpu_u8" => gpu_u8(),
        "gpu_peers_fault" => gpu_peers_fault(),
        "hierarchical_allreduces" => hierarchical_allreduces(),
        "metrics" => metrics(),
        "offline_steps" => offline_steps(),
        "offline_save" => offline_save(),
        "offline_load" => offline_load(),
        "offline_stale_plan" => offline_stale_plan(),
        "offline_diverge" => offline_diverge(),
        "offline_skip" => offline_skip(),
        "offline_stall" => offline_stall(),
        "autotune" => autotune(),
        "online_groups" => online_groups(),
        "group_votes" => group_votes(),
        "online_groups_stall" => online_groups_stall(),
        "gpu_streams" => gpu_streams(),
        "gpu_thread_context" => gpu_thread_context(),
        "gpu_failure" => gpu_failure(),
        "gpu_kernels" => gpu_kernels(),
        "gpu_graphs" => gpu_graphs(),
        "gpu_graphs_gossip" => gpu_graphs_gossip(),
        other => panic!("unknown scenario {other}"),
    }
}
