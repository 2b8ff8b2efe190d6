//! Configuration, read from the environment once at init and passed down from there.

use std::time::Duration;

/// Default for `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`. Horovod's default (0) waits forever;
/// ferrovod turns a stall into an error on every rank after ten minutes.
pub const DEFAULT_STALL_SHUTDOWN_SECONDS: u64 = 600;

/// How ranks agree on which tensors are ready (`FERROVOD_NEGOTIATION`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NegotiationMode {
    /// Horovod's scheme, kept as the baseline: per cycle a bitwise-AND allreduce of cache hits
    /// and a bitwise-OR allreduce of invalid bits and status flags, plus a coordinator round
    /// (gather requests, broadcast responses) when a name is new.
    Horovod,
    /// One bitwise-AND allreduce per cycle carries hits, invalid bits and flags; the
    /// coordinator only for first sight of a name. The default.
    Online,
    /// Online while a plan is learned (or loaded from `FERROVOD_PLAN_FILE`), then no control
    /// collective at all: each planned batch runs when its tensors are ready locally.
    Offline,
}

/// `FERROVOD_ALGORITHM`: how a set's allreduces cross nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlgorithmChoice {
    /// Per batch, from a cost model measured at init (`collective::cost`). The default.
    Auto,
    /// Every rank at once.
    Flat,
    /// Inside each node, across nodes, inside each node again (Horovod's
    /// `HOROVOD_HIERARCHICAL_ALLREDUCE=1` asks for this when `FERROVOD_ALGORITHM` is unset).
    Hierarchical,
}

impl AlgorithmChoice {
    pub fn parse(s: &str) -> Option<AlgorithmChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(AlgorithmChoice::Auto),
            "flat" => Some(AlgorithmChoice::Flat),
            "hierarchical" => Some(AlgorithmChoice::Hierarchical),
            _ => None,
        }
    }

    pub fn code(self) -> usize {
        self as usize
    }

    pub fn from_code(c: usize) -> AlgorithmChoice {
        match c {
            1 => AlgorithmChoice::Flat,
            2 => AlgorithmChoice::Hierarchical,
            _ => AlgorithmChoice::Auto,
        }
    }
}

impl NegotiationMode {
    pub fn parse(s: &str) -> Option<NegotiationMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "horovod" => Some(NegotiationMode::Horovod),
            "online" => Some(NegotiationMode::Online),
            "offline" => Some(NegotiationMode::Offline),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            NegotiationMode::Horovod => "horovod",
            NegotiationMode::Online => "online",
            NegotiationMode::Offline => "offline",
        }
    }

    /// Code agreed across ranks (rank 0's value wins).
    pub fn code(self) -> usize {
        self as usize
    }

    pub fn from_code(code: usize) -> NegotiationMode {
        match code {
            0 => NegotiationMode::Horovod,
            2 => NegotiationMode::Offline,
            _ => NegotiationMode::Online,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// `HOROVOD_CYCLE_TIME` (milliseconds, fractional allowed; default 1).
    pub cycle_time: Duration,
    /// `HOROVOD_FUSION_THRESHOLD` in bytes (default 128 MiB).
    pub fusion_threshold: usize,
    /// `FERROVOD_FUSION_DIRECT_BYTES`: tensors at least this large skip the fusion buffer and
    /// are reduced in place. Unset: `fusion::planner::direct_bytes` decides per process set.
    pub fusion_direct_bytes: Option<usize>,
    /// `HOROVOD_CACHE_CAPACITY` (default 1024; 0 disables the response cache).
    pub cache_capacity: usize,
    /// `HOROVOD_STALL_CHECK_DISABLE`.
    pub stall_check: bool,
    /// `HOROVOD_STALL_CHECK_TIME_SECONDS` (default 60).
    pub stall_warn: Duration,
    /// `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (default 600; 0 = never).
    pub stall_shutdown: Duration,
    /// `HOROVOD_MPI_THREADS_DISABLE=1` asks MPI for MPI_THREAD_SINGLE.
    pub mpi_threads_disable: bool,
    /// `HOROVOD_TIMELINE`: Chrome-trace file written by rank 0.
    pub timeline: Option<String>,
    /// `HOROVOD_TIMELINE_MARK_CYCLES`.
    pub timeline_mark_cycles: bool,
    /// `FERROVOD_LOCAL_SIZE`: treat blocks of this many consecutive ranks as one node.
    pub local_size_override: Option<usize>,
    /// `FERROVOD_MPI_MAX_COUNT`: largest count per MPI call before a transfer is split
    /// (default 2^30; lowering it lets tests run the split paths with small tensors).
    pub mpi_max_count: usize,
    /// `FERROVOD_NEGOTIATION`: horovod | online (default) | offline.
    pub negotiation: NegotiationMode,
    /// `FERROVOD_PLAN_FILE`: offline mode loads its plan from here when the file exists, and
    /// rank 0 writes the plan it learns here.
    pub plan_file: Option<String>,
    /// `FERROVOD_PLAN_WARMUP_STEPS` (default 5): identical steps seen before a plan is frozen.
    pub plan_warmup_steps: usize,
    /// `FERROVOD_PLAN_ESCAPE_MS` (default 1000): how long a rank holding tensors of later
    /// batches waits for the next batch before leaving offline mode.
    pub plan_escape: Duration,
    /// `FERROVOD_CHANNELS` (or Perseus's `PERSEUS_ALLREDUCE_STREAMS`; default 1): fused batches
    /// that may be in flight at once, each on its own duplicated communicator.
    pub channels: usize,
    /// `HOROVOD_AUTOTUNE`: tune the fusion threshold and cycle time from measured throughput.
    pub autotune: bool,
    /// `HOROVOD_AUTOTUNE_LOG`: CSV of every setting tried and its score (rank 0).
    pub autotune_log: Option<String>,
    /// `HOROVOD_AUTOTUNE_WARMUP_SAMPLES` (default 3): windows discarded before tuning starts.
    pub autotune_warmup: usize,
    /// `FERROVOD_AUTOTUNE_WINDOW_CYCLES` (default 200): negotiation cycles per sampling window.
    pub autotune_window: usize,
    /// `HOROVOD_ENABLE_ASYNC_COMPLETION`: GPU operations complete as soon as their work is
    /// enqueued; consumers wait on the handle's event on the device instead of the host.
    pub async_completion: bool,
    /// `HOROVOD_NUM_NCCL_STREAMS` (default 2; Horovod's is 1): NCCL communicators and
    /// CUDA streams per process set (or host channel), the "NCCL streams"; consecutive GPU
    /// batches alternate between them and run at once (BENCHMARKS.md has what two gained).
    /// Rank 0's value decides.
    pub nccl_streams: usize,
    /// `FERROVOD_GPU_GRAPHS` (1 or 0, default 1): a fused GPU allreduce that repeats with its
    /// tensors at the same addresses is launched as one captured CUDA graph. Rank 0's value
    /// decides (NCCL needs every rank to capture alike).
    pub gpu_graphs: bool,
    /// `FERROVOD_ALGORITHM` (or `HOROVOD_HIERARCHICAL_ALLREDUCE`).
    pub algorithm: AlgorithmChoice,
    /// `HOROVOD_HIERARCHICAL_ALLGATHER`: allgathers inside each node, across nodes' first
    /// ranks, then a broadcast inside each node.
    pub hierarchical_allgather: bool,
    /// `FERROVOD_RING_MIN_BYTES`: flat host allreduces of at least this many bytes run the ring
    /// over point-to-point transfers instead of MPI's own (0: never). Unset: chosen per set
    /// (`collective::cost::ring_min_bytes`).
    pub ring_min_bytes: Option<usize>,
    /// `FERROVOD_COMPRESSION` (or AIACC's `PERSEUS_ALLREDUCE_DTYPE`): how f32 allreduces travel.
    pub compression: crate::message::Compression,
    /// `FERROVOD_COMPRESSION_MIN_BYTES`: under `mixed`, tensors below this size stay f32
    /// (unset: `compress::MIXED_MIN_BYTES`).
    pub compression_min_bytes: Option<usize>,
    /// `FERROVOD_POWERSGD_RANK`: under `powersgd`, the factors' columns.
    pub powersgd_rank: usize,
    /// `FERROVOD_POWERSGD_START`: under `powersgd`, each named tensor's first allreduces that
    /// travel uncompressed.
    pub powersgd_start: u64,
    /// `FERROVOD_TOPK_WARMUP_STEPS`: under `topk`, each named tensor's first allreduces that
    /// send a larger share (DGC's warm-up).
    pub topk_warmup: u64,
    /// `FERROVOD_COMPRESSION_THREADS`: threads a codec's local arithmetic (PowerSGD's
    /// products) may use per rank; 0: the cores this process may use shared among its node's
    /// ranks, at most 8. Local: the results are the same bits for any value.
    pub compression_threads: usize,
    /// `FERROVOD_TOPK_RATIO` and `FERROVOD_TOPK_MOMENTUM`: under `topk`, the share of each
    /// tensor's values sent and the momentum correction's factor.
    pub topk_ratio: f64,
    pub topk_momentum: f64,
    /// AIACC's `PERSEUS_ALLREDUCE_NANCHECK`: allreduces whose result holds NaN or Inf fail
    /// (`compress::check_finite`).
    pub nan_check: bool,
    /// `FERROVOD_MULTISTEP` (default 1): allreduces that do not set their own multistep
    /// communicate every this many calls of a tensor and sum its inputs in between.
    pub multistep: u32,
    /// `FERROVOD_GOSSIP_SYNC_EVERY` (default 10; 0: never): every this many rounds of a
    /// gossiped tensor is an exact average instead.
    pub gossip_sync_every: u32,
    /// `FERROVOD_GOSSIP_EXACT_INSIDE_NODE` (1 or 0, default 1): GPU gossip of a process set
    /// whose ranks share one node runs as exact averages (NCCL's allreduce), which take about
    /// as long there as one exchange with a peer. 0 keeps the pairwise exchanges. Rank 0's
    /// value decides.
    pub gossip_exact_inside_node: bool,
    /// `FERROVOD_POLL` (1 or 0; default: where each local rank has at least 4 cores): waiting
    /// threads poll briefly before they sleep (see `runtime::handle::set_polling`).
    pub poll: Option<bool>,
}

fn env_str(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

fn flag(v: Option<&str>) -> bool {
    v.is_some_and(|v| {
        let v = v.trim().to_ascii_lowercase();
        !(v == "0" || v == "false" || v == "no" || v == "off")
    })
}

/// The longest duration any setting may hold: every deadline and period derived from one
/// (several cycle times, a stall limit added to now) stays far inside what the clock holds.
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;

/// The settings' source: a lookup of a variable's value (unset and blank are `None`), and the
/// warnings for values refused, each with the default used instead.
struct Source<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
}

impl Source<'_> {
    fn str(&self, key: &str) -> Option<String> {
        (self.get)(key).filter(|v| !v.trim().is_empty())
    }

    fn bool(&self, key: &str) -> bool {
        flag(self.str(key).as_deref())
    }

    /// A duration given in `unit` (seconds per unit, e.g. 0.001 for milliseconds), at most
    /// `max` units (and `MAX_SECONDS`). Negative, NaN, infinite or too large values are refused
    /// with a warning, and `default` (in units) is used.
    fn duration(&self, key: &str, default: f64, unit: f64, max: f64) -> Duration {
        duration_of(key, self.str(key).as_deref(), default, unit, max)
    }

    /// A whole number in `[lo, hi]`; anything else is refused with a warning naming the range,
    /// and `default` is used.
    fn num<T>(&self, key: &str, default: T, lo: T, hi: T) -> T
    where
        T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display,
    {
        self.opt_num(key, lo, hi).unwrap_or(default)
    }

    /// `num` for a setting without a default: `None` when unset or refused (warned).
    fn opt_num<T>(&self, key: &str, lo: T, hi: T) -> Option<T>
    where
        T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display,
    {
        let v = self.str(key)?;
        match v.trim().parse::<T>() {
            Ok(n) if n >= lo && n <= hi => Some(n),
            _ => {
                tracing::warn!(
                    "ignoring {key}={v}: expected a whole number from {lo} to {hi}; using the default"
                );
                None
            }
        }
    }
}

fn duration_of(key: &str, raw: Option<&str>, default: f64, unit: f64, max: f64) -> Duration {
    let fallback = Duration::from_secs_f64(default * unit);
    let Some(raw) = raw else {
        return fallback;
    };
    let max = max.min(MAX_SECONDS / unit);
    match raw.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=max).contains(&v) => Duration::from_secs_f64(v * unit),
        _ => {
            tracing::warn!(
                "ignoring {key}={raw}: expected a number from 0 to {max}; using {default}"
            );
            fallback
        }
    }
}

/// Stall settings (Horovod's `HOROVOD_STALL_*`), agreed from rank 0 at init.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StallPolicy {
    pub enabled: bool,
    pub warn_after: Duration,
    pub shutdown_after: Duration,
}

impl StallPolicy {
    pub fn from_config(cfg: &Config) -> StallPolicy {
        StallPolicy {
            enabled: cfg.stall_check,
            warn_after: cfg.stall_warn,
            shutdown_after: cfg.stall_shutdown,
        }
    }

    /// How long a wait for other ranks may last (None: for ever, as the user asked).
    pub fn limit(&self) -> Option<Duration> {
        (self.enabled && self.shutdown_after > Duration::ZERO).then_some(self.shutdown_after)
    }
}

/// Sizes in bytes: up to 2^50 (a petabyte), beyond any buffer.
const MAX_BYTES: usize = 1 << 50;

impl Config {
    /// How long a wait for other ranks may last before this rank gives up on them: the stall
    /// shutdown time, unless stall checks or the shutdown are disabled (then for ever, as the
    /// user asked).
    pub fn stall_limit(&self) -> Option<Duration> {
        (self.stall_check && self.stall_shutdown > Duration::ZERO).then_some(self.stall_shutdown)
    }

    pub fn from_env() -> Config {
        Config::from_lookup(&|key| env_str(key))
    }

    /// The settings from `get` (a variable's value by name): each parsed here, once, against
    /// its valid range; a value outside it is refused with a warning and the default used.
    /// Never panics, whatever the values.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Config {
        let src = Source { get };
        let warn = src.duration("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0, 1.0, MAX_SECONDS);
        let mut shutdown = src.duration(
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
            DEFAULT_STALL_SHUTDOWN_SECONDS as f64,
            1.0,
            MAX_SECONDS,
        );
        if shutdown > Duration::ZERO && shutdown < warn {
            tracing::warn!(
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS ({shutdown:?}) is less than HOROVOD_STALL_CHECK_TIME_SECONDS ({warn:?}); using the check time"
            );
            shutdown = warn;
        }
        let max_count = crate::message::MPI_MAX_COUNT;
        Config {
            cycle_time: src.duration("HOROVOD_CYCLE_TIME", 1.0, 1e-3, MAX_CYCLE_MS),
            fusion_threshold: src.num("HOROVOD_FUSION_THRESHOLD", 128 << 20, 0, MAX_BYTES),
            fusion_direct_bytes: src.opt_num("FERROVOD_FUSION_DIRECT_BYTES", 0, MAX_BYTES),
            cache_capacity: src.num("HOROVOD_CACHE_CAPACITY", 1024, 0, 1 << 20),
            stall_check: !src.bool("HOROVOD_STALL_CHECK_DISABLE"),
            stall_warn: warn,
            stall_shutdown: shutdown,
            mpi_threads_disable: src.bool("HOROVOD_MPI_THREADS_DISABLE"),
            timeline: src.str("HOROVOD_TIMELINE").filter(|t| t != "DYNAMIC"),
            timeline_mark_cycles: src.bool("HOROVOD_TIMELINE_MARK_CYCLES"),
            local_size_override: src.opt_num("FERROVOD_LOCAL_SIZE", 1, 1 << 20),
            mpi_max_count: src.num(
                "FERROVOD_MPI_MAX_COUNT",
                max_count,
                MIN_MPI_COUNT,
                max_count,
            ),
            negotiation: match src.str("FERROVOD_NEGOTIATION") {
                None => NegotiationMode::Online,
                Some(v) => NegotiationMode::parse(&v).unwrap_or_else(|| {
                    tracing::warn!(
                        "ignoring FERROVOD_NEGOTIATION={v}: expected horovod, online or offline"
                    );
                    NegotiationMode::Online
                }),
            },
            plan_file: src.str("FERROVOD_PLAN_FILE"),
            plan_warmup_steps: src.num("FERROVOD_PLAN_WARMUP_STEPS", 5, 1, 1 << 20),
            plan_escape: src.duration("FERROVOD_PLAN_ESCAPE_MS", 1000.0, 1e-3, 3.6e6),
            channels: src.num(
                "FERROVOD_CHANNELS",
                src.num("PERSEUS_ALLREDUCE_STREAMS", 1, 1, 64),
                1,
                64,
            ),
            autotune: src.bool("HOROVOD_AUTOTUNE"),
            autotune_log: src.str("HOROVOD_AUTOTUNE_LOG"),
            autotune_warmup: src.num("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, 0, 1 << 20),
            autotune_window: src.num("FERROVOD_AUTOTUNE_WINDOW_CYCLES", 200, 1, 1 << 30),
            async_completion: src.bool("HOROVOD_ENABLE_ASYNC_COMPLETION"),
            nccl_streams: src.num("HOROVOD_NUM_NCCL_STREAMS", 2, 1, 8),
            gpu_graphs: src.str("FERROVOD_GPU_GRAPHS").is_none() || src.bool("FERROVOD_GPU_GRAPHS"),
            algorithm: match src.str("FERROVOD_ALGORITHM") {
                Some(v) => AlgorithmChoice::parse(&v).unwrap_or_else(|| {
                    tracing::warn!(
                        "FERROVOD_ALGORITHM={v} is not auto, flat or hierarchical; using auto"
                    );
                    AlgorithmChoice::Auto
                }),
                None if src.bool("HOROVOD_HIERARCHICAL_ALLREDUCE") => AlgorithmChoice::Hierarchical,
                None => AlgorithmChoice::Auto,
            },
            ring_min_bytes: src.opt_num("FERROVOD_RING_MIN_BYTES", 0, MAX_BYTES),
            compression: compression_from(&src),
            compression_min_bytes: src.opt_num("FERROVOD_COMPRESSION_MIN_BYTES", 0, MAX_BYTES),
            powersgd_rank: src.num(
                "FERROVOD_POWERSGD_RANK",
                crate::message::POWERSGD_RANK,
                1,
                crate::message::POWERSGD_MAX_RANK as usize,
            ),
            powersgd_start: src.num("FERROVOD_POWERSGD_START", 0, 0, 1 << 40),
            topk_warmup: src.num("FERROVOD_TOPK_WARMUP_STEPS", 0, 0, 1 << 40),
            compression_threads: src.num("FERROVOD_COMPRESSION_THREADS", 0, 0, 256),
            topk_ratio: src.num("FERROVOD_TOPK_RATIO", 0.01, 1e-6, 1.0),
            topk_momentum: src.num("FERROVOD_TOPK_MOMENTUM", 0.0, 0.0, 0.999),
            nan_check: src.bool("PERSEUS_ALLREDUCE_NANCHECK"),
            multistep: src.num("FERROVOD_MULTISTEP", 1, 1, 1 << 20),
            gossip_sync_every: src.num("FERROVOD_GOSSIP_SYNC_EVERY", 10, 0, 1 << 20),
            gossip_exact_inside_node: src.str("FERROVOD_GOSSIP_EXACT_INSIDE_NODE").is_none()
                || src.bool("FERROVOD_GOSSIP_EXACT_INSIDE_NODE"),
            hierarchical_allgather: src.bool("HOROVOD_HIERARCHICAL_ALLGATHER"),
            poll: src.str("FERROVOD_POLL").map(|_| src.bool("FERROVOD_POLL")),
        }
    }
}

/// The longest cycle time (ms): a cycle is the negotiation's heartbeat; ten seconds is
/// already far past any use.
pub const MAX_CYCLE_MS: f64 = 10_000.0;

/// The smallest `FERROVOD_MPI_MAX_COUNT`: a segment must hold a whole element of any dtype.
pub const MIN_MPI_COUNT: usize = 16;

/// `FERROVOD_COMPRESSION`, else `PERSEUS_ALLREDUCE_DTYPE` (AIACC's: 0 fp16, 1 none, 2 mixed),
/// else none.
fn compression_from(src: &Source) -> crate::message::Compression {
    use crate::message::Compression;
    match (
        src.str("FERROVOD_COMPRESSION"),
        src.str("PERSEUS_ALLREDUCE_DTYPE"),
    ) {
        (Some(v), _) => Compression::parse(&v).unwrap_or_else(|| {
            tracing::warn!(
                "FERROVOD_COMPRESSION={v} is not none, fp16, bf16, mixed, u8, powersgd or topk; using none"
            );
            Compression::None
        }),
        (None, Some(v)) => Compression::from_perseus(&v).unwrap_or_else(|| {
            tracing::warn!(
                "PERSEUS_ALLREDUCE_DTYPE={v} is not 0 (fp16), 1 (none) or 2 (mixed); using none"
            );
            Compression::None
        }),
        (None, None) => Compression::None,
    }
}

/// Fault injection for the tests of failure paths: `FERROVOD_TEST_FAULT=<point>:<rank>` makes
/// `point` fail on that global rank. Points: `panic` (the background thread panics before a
/// batch it agreed to run), `stop_in_batch` (the process stops itself with SIGSTOP there, as a
/// hung rank), `slow_in_batch` (the rank spends the stall limit and two seconds inside the
/// batch, as a slow link would), `negotiation_error` (a vote fails locally before it is sent), `decode` (rank
/// 0 cannot decode a request list), `stop_in_round` (stops itself between the vote and the
/// coordinator round), `autotune`, `freeze` and `offline` (autotune, freezing an offline plan
/// or running one fails locally), `nccl_init` (a rank fails before creating its NCCL
/// communicator), `nccl_peers` (a rank cannot prepare its NCCL send/recv connections), `gpu_alltoall` (a GPU alltoall fails before its host-MPI split exchange),
/// `gpu_staged` (a GPU reducescatter of a dtype NCCL cannot reduce fails before its host-MPI
/// reduction), `slow_probe` (the rank's measurement of its node's level for the allreduce cost
/// model reads a thousand times slower; rank 0's figures must still rule). Ranks are global ranks (set ranks for the last three, the same in the tests'
/// global set).
/// Not for production use.
pub fn test_fault(point: &str, rank: i32) -> bool {
    static FAULT: std::sync::OnceLock<Option<(String, i32)>> = std::sync::OnceLock::new();
    FAULT
        .get_or_init(|| {
            let v = env_str("FERROVOD_TEST_FAULT")?;
            let (p, r) = v.rsplit_once(':')?;
            Some((p.to_string(), r.parse().ok()?))
        })
        .as_ref()
        .is_some_and(|(p, r)| p == point && *r == rank)
}

/// For the stopping test faults: stops this whole process (SIGSTOP), as a hung rank. The stop
/// is asynchronous, so the calling thread then waits for ever rather than go on meanwhile.
pub fn stop_this_process() -> ! {
    let _ = std::process::Command::new("kill")
        .args(["-STOP", &std::process::id().to_string()])
        .status();
    loop {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Installs the log subscriber once (`HOROVOD_LOG_LEVEL`, default warning), unless the host
/// program already installed one.
pub fn init_logging() {
    let level = env_str("HOROVOD_LOG_LEVEL")
        .map(|l| match l.to_ascii_lowercase().as_str() {
            "fatal" => "error".to_string(),
            "warning" => "warn".to_string(),
            other => other.to_string(),
        })
        .unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(format!("ferrovod={level}"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("ferrovod=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_refuse_what_cannot_be_a_duration() {
        let d = |raw| duration_of("X", raw, 2.0, 1e-3, MAX_CYCLE_MS);
        assert_eq!(d(None), Duration::from_millis(2));
        assert_eq!(d(Some("5")), Duration::from_millis(5));
        assert_eq!(d(Some(" 0.5 ")), Duration::from_micros(500));
        assert_eq!(d(Some("10000")), Duration::from_secs(10));
        for bad in ["inf", "-inf", "NaN", "-1", "1e300", "1e22", "10001", "abc"] {
            assert_eq!(d(Some(bad)), Duration::from_millis(2), "{bad}");
        }
        assert_eq!(
            duration_of("X", Some("1e20"), 60.0, 1.0, MAX_SECONDS),
            Duration::from_secs(60)
        );
    }

    fn config_of(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, String)> = (vars.iter())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |key| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()))
    }

    #[test]
    fn every_setting_outside_its_range_gets_its_default() {
        let d = config_of(&[]);
        let bad = config_of(&[
            ("HOROVOD_CYCLE_TIME", "1e22"),
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1e19"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-3"),
            ("FERROVOD_PLAN_ESCAPE_MS", "nan"),
            ("FERROVOD_MPI_MAX_COUNT", "4"),
            ("HOROVOD_FUSION_THRESHOLD", "-1"),
            ("FERROVOD_CHANNELS", "1000"),
            ("FERROVOD_MULTISTEP", "0"),
            ("FERROVOD_LOCAL_SIZE", "0"),
            ("HOROVOD_NUM_NCCL_STREAMS", "99999999999999999999999"),
        ]);
        assert_eq!(bad.cycle_time, d.cycle_time);
        assert_eq!(bad.stall_warn, d.stall_warn);
        assert_eq!(bad.stall_shutdown, d.stall_shutdown);
        assert_eq!(bad.plan_escape, d.plan_escape);
        assert_eq!(bad.mpi_max_count, d.mpi_max_count);
        assert_eq!(bad.fusion_threshold, d.fusion_threshold);
        assert_eq!(bad.channels, d.channels);
        assert_eq!(bad.multistep, d.multistep);
        assert_eq!(bad.local_size_override, None);
        assert_eq!(bad.nccl_streams, d.nccl_streams);
        let good = config_of(&[
            ("HOROVOD_CYCLE_TIME", "2.5"),
            ("FERROVOD_MPI_MAX_COUNT", "1048576"),
            ("FERROVOD_CHANNELS", "4"),
        ]);
        assert_eq!(good.cycle_time, Duration::from_micros(2500));
        assert_eq!(good.mpi_max_count, 1 << 20);
        assert_eq!(good.channels, 4);
    }
}
