//! The job as every rank sees it from start-up: its world communicator, where each rank sits
//! (topology), and the settings that change which collectives run, taken from rank 0 so that a
//! rank launched with a different environment cannot make the ranks disagree.

use std::time::Duration;

use crate::config::StallPolicy;
use crate::config::{AlgorithmChoice, NegotiationMode};
use crate::error::{Error, Result};
use crate::runtime::{Communicator, Runtime, Topology};
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

/// Cores per local rank from which waiting threads poll by default: a submitting thread, the
/// background thread and the GPU finisher each may hold one.
const MIN_CORES_TO_POLL: usize = 4;

/// The job as start-up found it.
pub(crate) struct Job {
    pub world: MpiComm,
    pub settings: JobSettings,
    pub topology: Topology,
    /// Each world rank's node, named by the lowest world rank on it (identical on every rank).
    pub nodes: Vec<i32>,
}

/// Opens the job's world (collective over it): rank 0's settings, the node split (hosts, or
/// `FERROVOD_LOCAL_SIZE`), the topology (published in `rt`), and whether waiting threads poll.
pub(crate) fn open_job(rt: &Runtime, comm: &Communicator, multiple: bool) -> Result<Job> {
    let world = match comm {
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
    let _ = rt.job_multistep.set(settings.multistep);
    let _ = rt.stall.set(settings.stall);
    let _ = rt.nccl_streams.set(settings.nccl_streams);
    let _ = (rt.p2p_max_tag).set(crate::collective::p2p::max_tag(world.tag_ub()));
    let world = world.with_max_count(settings.mpi_max_count);
    let local = world.split_local(Some(settings.local_size_override).filter(|n| *n > 0))?;
    let cross = world.split(local.rank() as i32)?;
    let local_sizes = world.allgather_i64(local.size() as i64)?;
    let leader = local.allgather_i64(world.rank() as i64)?.into_iter().min();
    let nodes = world
        .allgather_i64(leader.unwrap_or(world.rank() as i64))?
        .into_iter()
        .map(|n| n as i32)
        .collect();
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
    if topo.local_rank == 0 {
        // what the network offers; no RDMA data path exists, the cost model measures at init
        match crate::transport::rdma::discover() {
            Ok(ports) => {
                for p in ports {
                    tracing::info!(
                        "RDMA: {} port {}: {} {}, {} Gbit/s (not used: ferrovod has no RDMA data path)",
                        p.device,
                        p.port,
                        p.link_layer,
                        if p.active { "active" } else { "down" },
                        p.gbps
                    );
                }
            }
            Err(why) => {
                tracing::info!("RDMA: {why}; collectives use MPI over TCP and shared memory")
            }
        }
    }
    Ok(Job {
        world,
        settings,
        topology: topo,
        nodes,
    })
}

/// Settings that change which collectives run, taken from rank 0 so that a rank launched with a
/// different environment cannot make the ranks disagree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct JobSettings {
    pub fusion_threshold: usize,
    /// `FERROVOD_FUSION_DIRECT_BYTES` when set.
    pub fusion_direct_bytes: Option<usize>,
    pub cache_capacity: usize,
    pub mpi_max_count: usize,
    /// 0: nodes from MPI_COMM_TYPE_SHARED.
    pub local_size_override: usize,
    pub negotiation: NegotiationMode,
    /// Offline mode: agreeing steps before a plan freezes (decides when a collective runs).
    pub plan_warmup_steps: usize,
    /// Channels per set (1 unless every rank has MPI_THREAD_MULTIPLE).
    pub channels: usize,
    /// Autotune's sampling window in cycles; 0: autotune off (every rank broadcasts rank 0's
    /// choice at the same cycles, so this must be agreed).
    pub autotune_window: usize,
    /// Fused GPU allreduces may be replayed from CUDA graphs.
    pub gpu_graphs: bool,
    /// How allreduces cross nodes (where a set's nodes allow a choice).
    pub algorithm: AlgorithmChoice,
    /// `FERROVOD_RING_MIN_BYTES` when set.
    pub ring_min_bytes: Option<usize>,
    /// `HOROVOD_HIERARCHICAL_ALLGATHER`.
    pub hierarchical_allgather: bool,
    /// How f32 allreduces travel (`FERROVOD_COMPRESSION`, `FERROVOD_COMPRESSION_MIN_BYTES`).
    pub compression: crate::compress::Codecs,
    /// `PERSEUS_ALLREDUCE_NANCHECK`.
    pub nan_check: bool,
    /// `FERROVOD_MULTISTEP`: allreduces that do not say otherwise communicate every this many
    /// calls, accumulating between.
    pub multistep: u32,
    /// `FERROVOD_GOSSIP_SYNC_EVERY`.
    pub gossip_sync_every: u32,
    /// GPU gossip inside one node runs as exact averages.
    pub gossip_exact_inside_node: bool,
    /// `HOROVOD_NUM_NCCL_STREAMS`.
    pub nccl_streams: usize,
    /// PowerSGD's uncompressed first allreduces of each named tensor.
    pub powersgd_start: u64,
    /// Top-k's warm-up steps of each named tensor.
    pub topk_warmup: u64,
    /// `HOROVOD_STALL_CHECK_DISABLE`, `HOROVOD_STALL_CHECK_TIME_SECONDS` and
    /// `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`: one rank giving up before the others would
    /// report them missing while they still wait.
    pub stall: StallPolicy,
}

/// An optional setting's "not set" on the wire.
const UNSET: usize = usize::MAX;

impl JobSettings {
    /// Rank 0's values everywhere. Call on a communicator still at the default MPI count limit,
    /// so that this broadcast itself is split identically on every rank.
    pub fn from_rank0(world: &MpiComm, cfg: &crate::config::Config) -> Result<JobSettings> {
        let mine = [
            cfg.fusion_threshold,
            cfg.fusion_direct_bytes.unwrap_or(UNSET),
            cfg.cache_capacity,
            cfg.mpi_max_count,
            cfg.local_size_override.unwrap_or(0),
            cfg.negotiation.code(),
            cfg.plan_warmup_steps,
            cfg.channels,
            if cfg.autotune { cfg.autotune_window } else { 0 },
            usize::from(cfg.gpu_graphs),
            cfg.algorithm.code(),
            cfg.ring_min_bytes.unwrap_or(UNSET),
            usize::from(cfg.hierarchical_allgather),
            cfg.compression.code(),
            cfg.compression_min_bytes
                .unwrap_or(crate::compress::MIXED_MIN_BYTES),
            usize::from(cfg.nan_check),
            cfg.multistep as usize,
            cfg.gossip_sync_every as usize,
            usize::from(cfg.stall_check),
            cfg.stall_warn.as_nanos() as usize,
            cfg.stall_shutdown.as_nanos() as usize,
            usize::from(cfg.gossip_exact_inside_node),
            cfg.nccl_streams,
            cfg.powersgd_rank,
            crate::compress::TopK::of(cfg.topk_ratio, cfg.topk_momentum).ratio_ppm as usize,
            crate::compress::TopK::of(cfg.topk_ratio, cfg.topk_momentum).momentum_permille as usize,
            cfg.powersgd_start as usize,
            cfg.topk_warmup as usize,
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
                "HOROVOD_FUSION_THRESHOLD / FERROVOD_FUSION_DIRECT_BYTES / HOROVOD_CACHE_CAPACITY / FERROVOD_MPI_MAX_COUNT / FERROVOD_LOCAL_SIZE / FERROVOD_NEGOTIATION / FERROVOD_PLAN_WARMUP_STEPS / FERROVOD_CHANNELS (PERSEUS_ALLREDUCE_STREAMS) / HOROVOD_AUTOTUNE / FERROVOD_AUTOTUNE_WINDOW_CYCLES / FERROVOD_GPU_GRAPHS / FERROVOD_ALGORITHM / HOROVOD_HIERARCHICAL_ALLREDUCE / FERROVOD_RING_MIN_BYTES / HOROVOD_HIERARCHICAL_ALLGATHER / FERROVOD_COMPRESSION (PERSEUS_ALLREDUCE_DTYPE) / FERROVOD_COMPRESSION_MIN_BYTES / PERSEUS_ALLREDUCE_NANCHECK / FERROVOD_MULTISTEP / FERROVOD_GOSSIP_SYNC_EVERY / HOROVOD_STALL_CHECK_DISABLE / HOROVOD_STALL_CHECK_TIME_SECONDS / HOROVOD_STALL_SHUTDOWN_TIME_SECONDS / FERROVOD_GOSSIP_EXACT_INSIDE_NODE / HOROVOD_NUM_NCCL_STREAMS / FERROVOD_POWERSGD_RANK / FERROVOD_TOPK_RATIO / FERROVOD_TOPK_MOMENTUM / FERROVOD_POWERSGD_START / FERROVOD_TOPK_WARMUP_STEPS differ from rank 0's; using rank 0's values {v:?}"
            );
        }
        let (powersgd_start, topk_warmup) = first_steps(v[7], v[26] as u64, v[27] as u64);
        Ok(JobSettings {
            fusion_threshold: v[0],
            fusion_direct_bytes: (v[1] != UNSET).then_some(v[1]),
            cache_capacity: v[2],
            mpi_max_count: v[3],
            local_size_override: v[4],
            negotiation: NegotiationMode::from_code(v[5]),
            plan_warmup_steps: v[6],
            channels: v[7],
            autotune_window: v[8],
            gpu_graphs: v[9] != 0,
            algorithm: AlgorithmChoice::from_code(v[10]),
            ring_min_bytes: (v[11] != UNSET).then_some(v[11]),
            hierarchical_allgather: v[12] != 0,
            compression: crate::compress::Codecs {
                setting: crate::compress::Compression::from_code(v[13]).unwrap_or_default(),
                min_bytes: v[14],
                powersgd_rank: v[23],
                topk: crate::compress::TopK {
                    ratio_ppm: v[24] as u32,
                    momentum_permille: v[25] as u32,
                },
            },
            nan_check: v[15] != 0,
            multistep: v[16] as u32,
            gossip_sync_every: v[17] as u32,
            stall: StallPolicy {
                enabled: v[18] != 0,
                warn_after: Duration::from_nanos(v[19] as u64),
                shutdown_after: Duration::from_nanos(v[20] as u64),
            },
            gossip_exact_inside_node: v[21] != 0,
            nccl_streams: v[22],
            powersgd_start,
            topk_warmup,
        })
    }
}

/// PowerSGD's uncompressed first steps and top-k's warm-up under `channels` (all agreed). Both
/// size a batch's collectives by each tensor's count of allreduces, kept in a store that the
/// set's channels share; with several channels the ranks use that store in different orders,
/// so its evictions, and so the counts, could differ between ranks. They are off there.
fn first_steps(channels: usize, powersgd_start: u64, topk_warmup: u64) -> (u64, u64) {
    if channels > 1 && (powersgd_start > 0 || topk_warmup > 0) {
        tracing::warn!(
            "FERROVOD_POWERSGD_START and FERROVOD_TOPK_WARMUP_STEPS need FERROVOD_CHANNELS=1 (the per-tensor counts they read are not agreed across channels); they are off in this job"
        );
        return (0, 0);
    }
    (powersgd_start, topk_warmup)
}

#[cfg(test)]
mod first_steps_tests {
    use super::first_steps;

    #[test]
    fn the_codecs_first_steps_are_off_with_several_channels() {
        assert_eq!(first_steps(1, 5, 8), (5, 8));
        assert_eq!(first_steps(4, 5, 8), (0, 0));
        assert_eq!(first_steps(4, 0, 0), (0, 0));
    }
}
