//! The settings that change which collectives run, taken from rank 0 at start-up so that a rank
//! launched with a different environment cannot make the ranks disagree.

use crate::config::NegotiationMode;
use crate::error::Result;
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

/// Settings that change which collectives run, taken from rank 0 so that a rank launched with a
/// different environment cannot make the ranks disagree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct JobSettings {
    pub fusion_threshold: usize,
    pub fusion_direct_bytes: usize,
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
}

impl JobSettings {
    /// Rank 0's values everywhere. Call on a communicator still at the default MPI count limit,
    /// so that this broadcast itself is split identically on every rank.
    pub fn from_rank0(world: &MpiComm, cfg: &crate::config::Config) -> Result<JobSettings> {
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
