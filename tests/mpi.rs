//! Multi-rank tests. Run by `cargo test`, this program launches itself under
//! `mpirun -np N` once per scenario; under mpirun (OMPI_COMM_WORLD_SIZE set) it runs the named
//! scenario as one rank. Every rank checks its results against values it computes itself:
//! element i of rank r is a closed-form f(i, r), so sums and gathers have closed forms too.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovod::error::SHUT_DOWN_MESSAGE;
use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::handle::{Handle, TensorResult};
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::{DataType, Error, OpKind, ReduceOp};

#[path = "support/gpu.rs"]
mod gpu;

/// (scenario, ranks, extra environment, expect success)
type Scenario = (
    &'static str,
    usize,
    &'static [(&'static str, &'static str)],
    bool,
);

const STALL_FAST: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
];

const STALL_FAST_HOROVOD: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "horovod"),
];

const STOP_IN_BATCH: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_batch:1"),
];

const NCCL_INIT_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "nccl_init:1"),
];

const GPU_ALLTOALL_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "gpu_alltoall:1"),
];

const AUTOTUNE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("HOROVOD_AUTOTUNE", "1"),
    ("FERROVOD_TEST_FAULT", "autotune:1"),
];

const FREEZE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_TEST_FAULT", "freeze:1"),
];

const OFFLINE_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_TEST_FAULT", "offline:1"),
];

const STOP_IN_ROUND: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "stop_in_round:1"),
];

const OFFLINE_STOP: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_PLAN_ESCAPE_MS", "200"),
];

const NEGOTIATION_FAULT: &[(&str, &str)] = &[
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
    ("FERROVOD_TEST_FAULT", "negotiation_error:1"),
];

#[rustfmt::skip]
const OFFLINE: &[(&str, &str)] = &[
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
];

const OFFLINE_STALL: &[(&str, &str)] = &[
    ("FERROVOD_NEGOTIATION", "offline"),
    ("FERROVOD_PLAN_WARMUP_STEPS", "2"),
    ("FERROVOD_PLAN_ESCAPE_MS", "200"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2"),
];

const SCENARIOS: &[Scenario] = &[
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
        // a step agreed over a few long cycles learns at most ~20 groups: the vote fits one
        // word (per-cycle batches of a step spread over 1 ms cycles could need 40 bits or more)
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
    ("offline_steps", 2, OFFLINE, true),
    ("random_order", 3, OFFLINE, true),
    ("offline_steps", 4, OFFLINE, true),
    ("offline_save", 3, OFFLINE, true),
    ("offline_load", 3, OFFLINE, true),
    ("offline_stale_plan", 2, OFFLINE, true),
    ("offline_diverge", 2, OFFLINE, true),
    ("offline_skip", 2, OFFLINE_STALL, true),
    ("offline_stall", 2, OFFLINE_STALL, false),
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
    ("mismatches", 2, &[], true),
    ("mismatches", 4, &[], true),
    ("bad_arguments", 2, &[], true),
    ("stall", 2, STALL_FAST, true),
    ("stall_cached", 2, STALL_FAST, true),
    ("stall_in_set", 3, STALL_FAST, true),
    ("alloc_failure", 2, &[], true),
    ("callbacks", 2, &[], true),
    ("shutdown_pending", 2, &[], true),
    ("rank_exits", 2, &[], true),
    ("rank_killed", 2, &[], false),
    // a rank that hangs (stops) rather than dies: in a vote, inside a data collective
    ("rank_stopped", 2, STALL_FAST, false),
    ("rank_stopped", 3, STALL_FAST, false),
    ("rank_stopped", 3, STALL_FAST_HOROVOD, false),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH, false),
    ("rank_stopped_in_batch", 3, STOP_IN_BATCH, false),
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
    ("large_counts", 2, &[], true),
];

/// With `FERROVOD_TEST_GPU=1` (GPU machines): the same checks on GPU memory, each rank on GPU
/// `local_rank`, against the same host-computed references. `np` above the GPU count is
/// skipped (NCCL needs a GPU per rank).
const GPU_SCENARIOS: &[Scenario] = &[
    // failure paths of GPU batches: none may hang
    ("rank_stopped", 2, STALL_FAST, false),
    ("rank_stopped_in_batch", 2, STOP_IN_BATCH, false),
    ("fault_nccl_init", 2, NCCL_INIT_FAULT, false),
    ("gpu_alltoall_fault", 2, GPU_ALLTOALL_FAULT, false),
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
    (
        "gpu_failure",
        2,
        &[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "2"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "4"),
        ],
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
    ("gpu_streams", 2, &[], true),
    (
        "gpu_streams",
        2,
        &[("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")],
        true,
    ),
];

fn gpu_mode() -> bool {
    std::env::var("FERROVOD_TEST_GPU").is_ok_and(|v| v == "1")
}

fn main() {
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
    for (name, np, env, expect_ok) in scenarios {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        if *np > gpus {
            println!("scenario {name} np={np} ... skipped ({gpus} GPUs)");
            continue;
        }
        ran += 1;
        let start = Instant::now();
        let dir =
            std::env::temp_dir().join(format!("ferrovod-test-{}-{name}-{np}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new("mpirun");
        cmd.args([
            "-np",
            &np.to_string(),
            "--oversubscribe",
            "--allow-run-as-root",
        ])
        .args(["--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"])
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
        if *name == "timeline" {
            let path = dir.join("timeline.json");
            cmd.env("HOROVOD_TIMELINE", &path)
                .args(["-x", "HOROVOD_TIMELINE"]);
        }
        for (k, v) in *env {
            cmd.env(k, v).args(["-x", k]);
        }
        // failure scenarios must end soon after their stall limit: a hang is the failure
        let limit = match *name {
            "rank_stopped"
            | "rank_stopped_in_batch"
            | "fault_panic"
            | "fault_negotiation"
            | "fault_decode"
            | "fault_nccl_init"
            | "gpu_alltoall_fault" => 60,
            _ => 300,
        };
        let out = run_with_timeout(cmd, Duration::from_secs(limit));
        let secs = start.elapsed().as_secs_f64();
        let (ok, why) = match &out {
            None => (false, "timed out (hang)".to_string()),
            Some((status, stdout, stderr)) => {
                let passes = stdout.matches("RANK-PASSED").count();
                if *expect_ok {
                    let good = status.success() && passes == *np;
                    (
                        good,
                        format!(
                            "exit {status}, {passes}/{np} ranks passed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
                        ),
                    )
                } else {
                    // a scenario that prints a marker must print it before the job fails,
                    // on as many ranks as it says
                    let (marker, count) = match *name {
                        "offline_stall" => ("OFFLINE-STALL-REPORTED", 1),
                        "rank_stopped" | "fault_negotiation" => ("STALL-REPORTED", np - 1),
                        _ => ("", 0),
                    };
                    let reported = match *name {
                        // host: the watchdog's report; GPU: each survivor's error
                        "rank_stopped_in_batch" => {
                            stderr.matches("Missing ranks: 1.").count() >= np - 1
                                || stdout.matches("STALL-REPORTED").count() >= np - 1
                        }
                        "fault_panic" => stderr.contains("background thread panicked"),
                        "fault_negotiation" => stdout.contains("FAULT-REPORTED rank=1"),
                        "fault_nccl_init" => stderr.contains("in ncclCommInitRank"),
                        "gpu_alltoall_fault" => stderr.contains("Stalled ranks"),
                        _ => true,
                    };
                    (
                        !status.success() && stdout.matches(marker).count() >= count && reported,
                        format!("expected the job to fail, exit {status}\n{stdout}\n{stderr}"),
                    )
                }
            }
        };
        let extra = if ok && *name == "timeline" {
            check_timeline(&dir.join("timeline.json"))
        } else {
            Ok(())
        };
        let _ = std::fs::remove_dir_all(&dir);
        match (ok, extra) {
            (true, Ok(())) => println!("scenario {name} np={np} ... ok ({secs:.1}s)"),
            (true, Err(e)) => {
                println!("scenario {name} np={np} ... FAILED: {e}");
                failed.push(format!("{name} np={np}"));
            }
            (false, _) => {
                println!("scenario {name} np={np} ... FAILED ({secs:.1}s): {why}");
                failed.push(format!("{name} np={np}"));
            }
        }
    }
    println!("{ran} scenarios, {} failed", failed.len());
    if !failed.is_empty() {
        eprintln!("failed: {failed:?}");
        std::process::exit(1);
    }
}

fn run_with_timeout(
    mut cmd: Command,
    limit: Duration,
) -> Option<(std::process::ExitStatus, String, String)> {
    let mut child = cmd.spawn().expect("mpirun");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).ok();
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).ok();
        s
    });
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((status, t_out.join().unwrap(), t_err.join().unwrap()));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The timeline must be strict JSON (checked with Python's parser) and hold the events.
fn check_timeline(path: &std::path::Path) -> Result<(), String> {
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
    ] {
        if !text.contains(needle) {
            return Err(format!("timeline lacks {needle}"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rank side

fn rank() -> usize {
    runtime::runtime().unwrap().topology().rank as usize
}

fn size() -> usize {
    runtime::runtime().unwrap().topology().size as usize
}

fn run_rank(name: &str) {
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
        "topology" => topology(),
        "alloc_failure" => alloc_failure(),
        "callbacks" => callbacks(),
        "shutdown_pending" => shutdown_pending(),
        "rank_exits" => rank_exits(),
        "rank_killed" => rank_killed(),
        "rank_stopped" => rank_stopped(),
        "rank_stopped_in_batch" => rank_stopped_in_batch(),
        "fault_panic" => fault_panic(),
        "fault_negotiation" => fault_negotiation(),
        "fault_decode" => fault_decode(),
        "fault_nccl_init" => fault_nccl_init(),
        "gpu_alltoall_fault" => gpu_alltoall_fault(),
        "preinitialized_mpi" => preinitialized_mpi(),
        "init_subset" => init_subset(),
        "timeline" => timeline(),
        "large_counts" => large_counts(),
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
        "gpu_failure" => gpu_failure(),
        "gpu_kernels" => gpu_kernels(),
        "gpu_graphs" => gpu_graphs(),
        other => panic!("unknown scenario {other}"),
    }
}

fn pass() {
    println!("RANK-PASSED");
}

/// Shutting down stops every rank (Horovod's semantics), so ranks first wait for each other.
fn finish_job() {
    run(OpSpec::new(OpKind::Barrier, vec![])).expect("final barrier");
    runtime::shutdown();
    pass();
}

fn init() {
    runtime::init(Default::default()).expect("init");
}

/// Encodes values (small integers or exact binary fractions) as `dtype`.
fn encode(dtype: DataType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DataType::U8 => out.push(v as u8),
            DataType::Bool => out.push(u8::from(v != 0.0)),
            DataType::I8 => out.extend((v as i8).to_le_bytes()),
            DataType::U16 => out.extend((v as u16).to_le_bytes()),
            DataType::I16 => out.extend((v as i16).to_le_bytes()),
            DataType::I32 => out.extend((v as i32).to_le_bytes()),
            DataType::I64 => out.extend((v as i64).to_le_bytes()),
            DataType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
            DataType::BF16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
            DataType::F32 => out.extend((v as f32).to_le_bytes()),
            DataType::F64 => out.extend(v.to_le_bytes()),
        }
    }
    out
}

fn decode(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DataType::U8 | DataType::Bool => c[0] as f64,
            DataType::I8 => c[0] as i8 as f64,
            DataType::U16 => u16::from_le_bytes([c[0], c[1]]) as f64,
            DataType::I16 => i16::from_le_bytes([c[0], c[1]]) as f64,
            DataType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
            DataType::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            DataType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

/// Element i of rank r: a small positive integer (exact in every dtype, also when summed).
fn val(i: usize, r: usize) -> f64 {
    ((i * 7 + r * 3) % 11 + 1) as f64
}

/// Factors for products: 1 or 2, so products over 4 ranks stay within int8.
fn factor(i: usize, r: usize) -> f64 {
    (1 + (i + r) % 2) as f64
}

fn bit(i: usize, r: usize) -> f64 {
    ((i + r) % 2) as f64
}

fn tensor(name: &str, dtype: DataType, shape: &[i64], vals: &[f64], later: bool) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        input: InputMem::Owned(encode(dtype, vals)),
        output: if later {
            OutputMem::Later
        } else {
            OutputMem::InPlace
        },
        splits: None,
    }
}

fn submit(spec: OpSpec) -> Result<Arc<Handle>, Error> {
    if gpu_mode() && spec.device == ferrovod::message::CPU_DEVICE {
        return gpu::submit(spec);
    }
    runtime::runtime()?.enqueue(spec)
}

fn finish(h: Arc<Handle>) -> Result<Vec<TensorResult>, Error> {
    let r = h.wait(Some(Duration::from_secs(120)));
    let rt = runtime::runtime()?;
    rt.handles.release(h.id)?;
    let op = gpu::take(h.id);
    r?;
    let n = (0..).take_while(|i| h.result(*i).is_some()).count();
    let mut results: Vec<TensorResult> = (0..n).map(|i| h.result(i).unwrap()).collect();
    if let Some(op) = op {
        op.download_into(&h, &mut results);
    }
    Ok(results)
}

fn run(spec: OpSpec) -> Result<Vec<TensorResult>, Error> {
    finish(submit(spec)?)
}

fn output(r: &TensorResult, dtype: DataType) -> Vec<f64> {
    decode(dtype, r.output.as_ref().expect("library-owned output"))
}

/// Rounds reference values to what `dtype` can hold.
fn quantize(dtype: DataType, vals: &[f64]) -> Vec<f64> {
    decode(dtype, &encode(dtype, vals))
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Truncation toward zero after scaling, as integer tensors are scaled.
fn scaled(dtype: DataType, v: f64) -> f64 {
    if dtype.is_float() { v } else { v.trunc() }
}

struct Ctx {
    /// Ranks of the process set, in set order.
    ranks: Vec<usize>,
    set: i32,
    tag: String,
}

fn allreduce_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let shape = [3i64, 5];
    let count = 15;
    let mut ops = vec![
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];
    if dtype != DataType::Bool {
        ops.push(ReduceOp::Average);
    }
    for op in ops {
        let src = |i: usize, r: usize| match (dtype, op) {
            (DataType::Bool, _) => bit(i, r),
            (_, ReduceOp::Product) => factor(i, r),
            _ => val(i, r),
        };
        let mine: Vec<f64> = (0..count).map(|i| src(i, me)).collect();
        let want: Vec<f64> = (0..count)
            .map(|i| {
                let xs = ctx.ranks.iter().map(|r| src(i, *r));
                match op {
                    ReduceOp::Sum if dtype == DataType::Bool => xs.fold(0.0, f64::max),
                    ReduceOp::Sum => xs.sum(),
                    ReduceOp::Average => scaled(dtype, xs.sum::<f64>() * (1.0 / n as f64)),
                    ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                    ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                    ReduceOp::Product if dtype == DataType::Bool => xs.fold(1.0, f64::min),
                    ReduceOp::Product => xs.product(),
                    ReduceOp::Adasum => unreachable!(),
                }
            })
            .collect();
        // in place (library-owned), and out of place into a separate output
        for out_of_place in [false, true] {
            let name = format!("{}.ar.{dtype}.{op:?}.{out_of_place}", ctx.tag);
            let mut t = tensor(&name, dtype, &shape, &mine, false);
            if out_of_place {
                t.output = OutputMem::Owned(vec![0u8; count * dtype.size()]);
            }
            let mut spec = OpSpec::new(OpKind::Allreduce, vec![t]);
            spec.reduce_op = op;
            spec.process_set = ctx.set;
            let res = run(spec).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(res[0].shape, shape.to_vec());
            assert_close(&output(&res[0], dtype), &quantize(dtype, &want), &name);
        }
    }
    if dtype.is_float() || matches!(dtype, DataType::I32 | DataType::I64) {
        // prescale 0.5 then postscale 4: twice the sum (exact for these values)
        let mine: Vec<f64> = (0..count).map(|i| 2.0 * val(i, me)).collect();
        let want: Vec<f64> = (0..count)
            .map(|i| ctx.ranks.iter().map(|r| 4.0 * val(i, *r)).sum())
            .collect();
        let name = format!("{}.ar.scaled.{dtype}", ctx.tag);
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(&name, dtype, &shape, &mine, false)],
        );
        spec.prescale = 0.5;
        spec.postscale = 4.0;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_close(&output(&res[0], dtype), &want, &name);
    }
}

fn allgather_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    // set rank p contributes p + 1 rows of 2 columns
    let rows = |p: usize| p + 1;
    let row_vals = |p: usize, r: usize| -> Vec<f64> {
        (0..rows(p) * 2)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, r)
                } else {
                    val(i, r)
                }
            })
            .collect()
    };
    let want: Vec<f64> = ctx
        .ranks
        .iter()
        .enumerate()
        .flat_map(|(p, r)| row_vals(p, *r))
        .collect();
    let total_rows: usize = (0..ctx.ranks.len()).map(rows).sum();
    let single = format!("{}.ag.{dtype}", ctx.tag);
    let mut spec = OpSpec::new(
        OpKind::Allgather,
        vec![tensor(
            &single,
            dtype,
            &[rows(pos) as i64, 2],
            &row_vals(pos, me),
            true,
        )],
    );
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    assert_eq!(res[0].shape, vec![total_rows as i64, 2]);
    assert_close(&output(&res[0], dtype), &want, &single);

    // grouped: three tensors fused into one allgather
    let names: Vec<String> = (0..3)
        .map(|k| format!("{}.gag.{dtype}.{k}", ctx.tag))
        .collect();
    let tensors = names
        .iter()
        .map(|n| tensor(n, dtype, &[rows(pos) as i64, 2], &row_vals(pos, me), true))
        .collect();
    let mut spec = OpSpec::new(OpKind::Allgather, tensors);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, r) in res.iter().enumerate() {
        assert_close(&output(r, dtype), &want, &names[k]);
    }
}

fn broadcast_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    for root in [ctx.ranks[0], *ctx.ranks.last().unwrap()] {
        let vals: Vec<f64> = (0..6)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, me)
                } else {
                    val(i, me)
                }
            })
            .collect();
        let want: Vec<f64> = (0..6)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, root)
                } else {
                    val(i, root)
                }
            })
            .collect();
        for out_of_place in [false, true] {
            let name = format!("{}.bc.{dtype}.{root}.{out_of_place}", ctx.tag);
            let mut t = tensor(&name, dtype, &[2, 3], &vals, false);
            if out_of_place {
                t.output = OutputMem::Owned(vec![0u8; 6 * dtype.size()]);
            }
            let mut spec = OpSpec::new(OpKind::Broadcast, vec![t]);
            spec.root_rank = root as i32;
            spec.process_set = ctx.set;
            let res = run(spec).unwrap();
            assert_close(&output(&res[0], dtype), &want, &name);
        }
    }
}

fn alltoall_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    let code = |from: usize, to: usize, k: usize| ((from * 5 + to * 3 + k) % 13 + 1) as f64;
    let code = |from, to, k| {
        if dtype == DataType::Bool {
            code(from, to, k) % 2.0
        } else {
            code(from, to, k)
        }
    };
    // with splits: set rank p sends (p + q) % 3 rows of one column to set rank q
    let splits = |p: usize| -> Vec<i32> { (0..n).map(|q| ((p + q) % 3) as i32).collect() };
    let mut vals = Vec::new();
    for (q, s) in splits(pos).iter().enumerate() {
        vals.extend((0..*s as usize).map(|k| code(pos, q, k)));
    }
    let dim0 = vals.len() + 1; // one extra trailing row that is not sent
    vals.push(0.0);
    let name = format!("{}.a2a.{dtype}", ctx.tag);
    let mut t = tensor(&name, dtype, &[dim0 as i64, 1], &vals, true);
    t.splits = Some(splits(pos));
    let mut spec = OpSpec::new(OpKind::Alltoall, vec![t]);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    let want_splits: Vec<i32> = (0..n).map(|p| splits(p)[pos]).collect();
    let want: Vec<f64> = (0..n)
        .flat_map(|p| (0..splits(p)[pos] as usize).map(move |k| code(p, pos, k)))
        .collect();
    assert_eq!(
        res[0].received_splits, want_splits,
        "{name}: received splits"
    );
    assert_eq!(res[0].shape, vec![want.len() as i64, 1]);
    assert_close(&output(&res[0], dtype), &want, &name);

    // even split, two columns
    let vals: Vec<f64> = (0..n)
        .flat_map(|q| (0..2).map(move |k| code(pos, q, k)))
        .collect();
    let name = format!("{}.a2a.even.{dtype}", ctx.tag);
    let mut spec = OpSpec::new(
        OpKind::Alltoall,
        vec![tensor(&name, dtype, &[n as i64, 2], &vals, true)],
    );
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    let want: Vec<f64> = (0..n)
        .flat_map(|p| (0..2).map(move |k| code(p, pos, k)))
        .collect();
    assert_eq!(res[0].received_splits, vec![1; n]);
    assert_close(&output(&res[0], dtype), &want, &name);
}

fn reducescatter_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    let dim0 = 2 * n + 1; // uneven: the first rank gets one extra row
    let cols = 2;
    let mine: Vec<f64> = (0..dim0 * cols).map(|i| val(i, me)).collect();
    let first_row: usize = (0..pos).map(|p| dim0 / n + usize::from(p < dim0 % n)).sum();
    let my_rows = dim0 / n + usize::from(pos < dim0 % n);
    for op in [ReduceOp::Sum, ReduceOp::Average] {
        let want: Vec<f64> = (first_row * cols..(first_row + my_rows) * cols)
            .map(|i| {
                let s: f64 = ctx.ranks.iter().map(|r| val(i, *r)).sum();
                if op == ReduceOp::Average {
                    scaled(dtype, s * (1.0 / n as f64))
                } else {
                    s
                }
            })
            .collect();
        let name = format!("{}.rs.{dtype}.{op:?}", ctx.tag);
        let mut spec = OpSpec::new(
            OpKind::Reducescatter,
            vec![tensor(
                &name,
                dtype,
                &[dim0 as i64, cols as i64],
                &mine,
                true,
            )],
        );
        spec.reduce_op = op;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_eq!(res[0].shape, vec![my_rows as i64, cols as i64], "{name}");
        let want = quantize(dtype, &want);
        assert_close(&output(&res[0], dtype), &want, &name);
        // grouped: two tensors of different lengths fused into one reduce-scatter
        let names = [format!("{name}.g0"), format!("{name}.g1")];
        let other: Vec<f64> = (0..n * cols).map(|i| val(i + 100, me)).collect();
        let mut spec = OpSpec::new(
            OpKind::Reducescatter,
            vec![
                tensor(&names[0], dtype, &[dim0 as i64, cols as i64], &mine, true),
                tensor(&names[1], dtype, &[n as i64, cols as i64], &other, true),
            ],
        );
        spec.reduce_op = op;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_close(&output(&res[0], dtype), &want, &names[0]);
        let want1: Vec<f64> = (pos * cols..(pos + 1) * cols)
            .map(|i| {
                let s: f64 = ctx.ranks.iter().map(|r| val(i + 100, *r)).sum();
                if op == ReduceOp::Average {
                    scaled(dtype, s * (1.0 / n as f64))
                } else {
                    s
                }
            })
            .collect();
        assert_close(&output(&res[1], dtype), &quantize(dtype, &want1), &names[1]);
    }
}

fn grouped_allreduce_checks(ctx: &Ctx) {
    let me = rank();
    // many small tensors of two dtypes in one group: fused per dtype, completed together
    let mut tensors = Vec::new();
    let mut wants = Vec::new();
    for k in 0..12 {
        let dtype = if k % 3 == 0 {
            DataType::F64
        } else {
            DataType::F32
        };
        let len = 1 + k * 3;
        let mine: Vec<f64> = (0..len).map(|i| val(i + k, me)).collect();
        let want: Vec<f64> = (0..len)
            .map(|i| ctx.ranks.iter().map(|r| val(i + k, *r)).sum())
            .collect();
        tensors.push(tensor(
            &format!("{}.gar.{k}", ctx.tag),
            dtype,
            &[len as i64],
            &mine,
            false,
        ));
        wants.push((dtype, want));
    }
    let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, (r, (dtype, want))) in res.iter().zip(&wants).enumerate() {
        assert_close(&output(r, *dtype), want, &format!("grouped allreduce {k}"));
    }
    // large and small tensors in one batch, scaled, some out of place: on GPUs the large ones
    // (from 1 MiB) are reduced where they are and the small ones through the fusion buffer
    let n = ctx.ranks.len() as f64;
    let lens = [300_000usize, 5, 17, 262_144, 9, 400_000];
    let mut tensors = Vec::new();
    let mut wants = Vec::new();
    for (k, len) in lens.iter().enumerate() {
        let mine: Vec<f64> = (0..*len).map(|i| 2.0 * val(i + k, me)).collect();
        let want: Vec<f64> = (0..*len)
            .map(|i| 4.0 * ctx.ranks.iter().map(|r| val(i + k, *r)).sum::<f64>() / n)
            .collect();
        let mut t = tensor(
            &format!("{}.gar.mixed.{k}", ctx.tag),
            DataType::F32,
            &[*len as i64],
            &mine,
            false,
        );
        if k % 2 == 1 {
            t.output = OutputMem::Owned(vec![0u8; len * 4]);
        }
        tensors.push(t);
        wants.push(want);
    }
    let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
    spec.reduce_op = ReduceOp::Average;
    spec.prescale = 0.5;
    spec.postscale = 4.0;
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, (r, want)) in res.iter().zip(&wants).enumerate() {
        let what = format!("grouped mixed-size allreduce {k}");
        assert_close(
            &output(r, DataType::F32),
            &quantize(DataType::F32, want),
            &what,
        );
    }
}

fn barrier_check(ctx: &Ctx) {
    let mut spec = OpSpec::new(OpKind::Barrier, vec![]);
    spec.process_set = ctx.set;
    run(spec).unwrap();
}

fn all_ops(ctx: &Ctx) {
    for dtype in DataType::ALL {
        allreduce_checks(ctx, dtype);
        allgather_checks(ctx, dtype);
        broadcast_checks(ctx, dtype);
        alltoall_checks(ctx, dtype);
        if dtype != DataType::Bool {
            reducescatter_checks(ctx, dtype);
        }
    }
    grouped_allreduce_checks(ctx);
    barrier_check(ctx);
}

/// Every op × dtype on the world, then on two disjoint process sets running at once.
fn collectives() {
    init();
    let n = size();
    let me = rank();
    all_ops(&Ctx {
        ranks: (0..n).collect(),
        set: 0,
        tag: "world".into(),
    });
    // static-like sets added dynamically: lower and upper half, disjoint, used concurrently
    let rt = runtime::runtime().unwrap();
    let half = n.div_ceil(2);
    let lower: Vec<i32> = (0..half as i32).collect();
    let upper: Vec<i32> = (half as i32..n as i32).collect();
    let mut ids = Vec::new();
    for ranks in [&lower, &upper] {
        if ranks.is_empty() {
            continue;
        }
        let h = rt.add_process_set(ranks).unwrap();
        h.wait(None).unwrap();
        ids.push((h.value(), ranks.clone()));
    }
    let (id, ranks) = ids
        .iter()
        .find(|(_, r)| r.contains(&(me as i32)))
        .unwrap()
        .clone();
    assert_eq!(rt.process_set_ranks(id), Some(ranks.clone()));
    all_ops(&Ctx {
        ranks: ranks.iter().map(|r| *r as usize).collect(),
        set: id,
        tag: format!("set{id}"),
    });
    finish_job();
}

/// Simple deterministic generator, seeded per rank.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Each rank submits the same tensors in its own random order with random pauses, for several
/// steps; results must be identical and correct everywhere.
fn random_order() {
    init();
    random_order_steps();
    finish_job();
}

/// Rank 1 starts with a different fusion threshold, direct threshold and cache capacity: the
/// ranks must still agree (rank 0's values win) and compute correct sums.
fn env_differs() {
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("1") {
        // SAFETY: set before any thread of this process reads the environment.
        unsafe {
            std::env::set_var("HOROVOD_CACHE_CAPACITY", "0");
            std::env::set_var("HOROVOD_FUSION_THRESHOLD", "100");
            std::env::set_var("FERROVOD_FUSION_DIRECT_BYTES", "0");
        }
    }
    init();
    random_order_steps();
    finish_job();
}

fn random_order_steps() {
    let n = size();
    let me = rank();
    let mut rng = Lcg(0x9e37_79b9 + me as u64 * 7919);
    let count = 40;
    for step in 0..5 {
        let mut order: Vec<usize> = (0..count).collect();
        for i in (1..count).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
        let mut handles = Vec::new();
        for &k in &order {
            if rng.next().is_multiple_of(8) {
                std::thread::sleep(Duration::from_micros(rng.next() % 3000));
            }
            let len = 1 + (k * 37) % 300;
            let dtype = [DataType::F32, DataType::F64, DataType::I32, DataType::BF16][k % 4];
            let mine: Vec<f64> = (0..len).map(|i| val(i + k + step, me)).collect();
            let name = format!("grad.{k}");
            let h = submit(OpSpec::new(
                OpKind::Allreduce,
                vec![tensor(&name, dtype, &[len as i64], &mine, false)],
            ))
            .unwrap();
            handles.push((k, len, dtype, h));
        }
        for (k, len, dtype, h) in handles {
            let res = finish(h).unwrap();
            let want: Vec<f64> = (0..len)
                .map(|i| (0..n).map(|r| val(i + k + step, r)).sum())
                .collect();
            assert_close(
                &output(&res[0], dtype),
                &want,
                &format!("step {step} tensor {k}"),
            );
        }
    }
}

/// The counters: data bytes and tensors exactly what was submitted; every cycle issued its
/// mode's votes (two in the horovod mode, one otherwise), plus coordinator rounds for new names.
fn metrics() {
    init();
    let rt = runtime::runtime().unwrap();
    let horovod = std::env::var("FERROVOD_NEGOTIATION").as_deref() == Ok("horovod");
    let me = rank();
    let before = rt.metrics.snapshot();
    let (steps, count, len) = (4, 12, 50usize);
    for step in 0..steps {
        let handles: Vec<_> = (0..count)
            .map(|k| {
                let mine: Vec<f64> = (0..len).map(|i| val(i + k + step, me)).collect();
                submit(OpSpec::new(
                    OpKind::Allreduce,
                    vec![tensor(
                        &format!("m{k}"),
                        DataType::F32,
                        &[len as i64],
                        &mine,
                        false,
                    )],
                ))
                .unwrap()
            })
            .collect();
        for h in handles {
            finish(h).unwrap();
        }
    }
    let after = rt.metrics.snapshot();
    let d = |f: fn(&runtime::metrics::MetricsSnapshot) -> u64| f(&after) - f(&before);
    assert_eq!(d(|m| m.tensors), (steps * count) as u64);
    assert_eq!(d(|m| m.data_bytes), (steps * count * len * 4) as u64);
    let batches = d(|m| m.data_collectives);
    assert!(
        (1..=(steps * count) as u64).contains(&batches),
        "{batches} batches"
    );
    assert!(d(|m| m.fused_batches) <= batches);
    let cycles = d(|m| m.cycles);
    let votes = if horovod { 2 } else { 1 };
    let control = d(|m| m.control_collectives);
    // each cycle votes; the first sight of the 12 names adds coordinator rounds (gather + bcast)
    assert!(
        control >= votes * cycles,
        "{control} control collectives in {cycles} cycles"
    );
    assert!(
        control <= votes * cycles + 2 * cycles,
        "{control} in {cycles} cycles"
    );
    assert!(
        control > votes * cycles,
        "new names need a coordinator round"
    );
    assert!(d(|m| m.control_bytes) >= 8 * control);
    assert!(d(|m| m.negotiation_ns) > 0);
    finish_job();
}

/// The tensors of one simulated step: (name, length, dtype).
fn step_tensors(count: usize, extra: &[&str], grow: usize) -> Vec<(String, usize, DataType)> {
    let mut names: Vec<(String, usize, DataType)> = (0..count)
        .map(|k| {
            let len = if k % 7 == 3 {
                20_000
            } else {
                1 + (k * 37) % 300
            } + grow * (k % 2);
            let dtype = [DataType::F32, DataType::F64, DataType::I32, DataType::BF16][k % 4];
            (format!("p.{k}"), len, dtype)
        })
        .collect();
    for (i, x) in extra.iter().enumerate() {
        names.push((x.to_string(), 5 + i, DataType::F32));
    }
    names
}

/// Submits tensor `k` of `names` for `step` (rank r's element i is `val(i + k + step, r)`).
fn submit_step_tensor(names: &[(String, usize, DataType)], k: usize, step: usize) -> Arc<Handle> {
    let (name, len, dtype) = &names[k];
    let mine: Vec<f64> = (0..*len).map(|i| val(i + k + step, rank())).collect();
    submit(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(name, *dtype, &[*len as i64], &mine, false)],
    ))
    .unwrap()
}

/// Submits every tensor of a `count`-tensor step but those in `skip`, in index order.
fn submit_step(count: usize, step: usize, skip: &[usize]) -> Vec<(usize, Arc<Handle>)> {
    let names = step_tensors(count, &[], 0);
    (0..count)
        .filter(|k| !skip.contains(k))
        .map(|k| (k, submit_step_tensor(&names, k, step)))
        .collect()
}

/// One training-like step: `count` allreduces (mixed dtypes, some fused, some large enough to
/// run alone) submitted in a per-rank random order with jitter, all checked against sums each
/// rank computes itself. `extra` adds tensors after the usual ones; `grow` lengthens every odd tensor.
fn offline_step(rng: &mut Lcg, step: usize, count: usize, extra: &[&str], grow: usize) {
    let n = size();
    let names = step_tensors(count, extra, grow);
    let mut order: Vec<usize> = (0..count).collect();
    for i in (1..count).rev() {
        order.swap(i, rng.next() as usize % (i + 1));
    }
    order.extend(count..names.len());
    let mut handles = Vec::new();
    for &k in &order {
        if rng.next().is_multiple_of(6) {
            std::thread::sleep(Duration::from_micros(rng.next() % 2000));
        }
        handles.push((k, submit_step_tensor(&names, k, step)));
    }
    for (k, h) in handles {
        let (_, len, dtype) = &names[k];
        let res = finish(h).unwrap();
        let want: Vec<f64> = (0..*len)
            .map(|i| (0..n).map(|r| val(i + k + step, r)).sum())
            .collect();
        assert_close(
            &output(&res[0], *dtype),
            &want,
            &format!("step {step} tensor {k}"),
        );
    }
}

fn control_collectives() -> u64 {
    runtime::runtime()
        .unwrap()
        .metrics
        .snapshot()
        .control_collectives
}

/// Random orders and jitter: identical, correct results; once the plan is frozen (after two
/// agreeing steps), steps issue no control collective at all.
fn offline_steps() {
    init();
    let mut rng = Lcg(0x51ed + rank() as u64 * 31);
    for step in 0..5 {
        offline_step(&mut rng, step, 24, &[], 0);
    }
    let before = control_collectives();
    for step in 5..15 {
        offline_step(&mut rng, step, 24, &[], 0);
    }
    assert_eq!(
        control_collectives() - before,
        0,
        "steady-state steps negotiated"
    );
    finish_job();
}

fn plan_path() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("FERROVOD_TEST_SHARED").unwrap()).join("plan.bin")
}

fn init_with_plan_file() {
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.plan_file = Some(plan_path().to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
}

/// Learns a plan and writes it (rank 0) to the shared plan file, for `offline_load`.
fn offline_save() {
    init_with_plan_file();
    let mut rng = Lcg(7 + rank() as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    let before = control_collectives();
    offline_step(&mut rng, 6, 16, &[], 0);
    assert_eq!(control_collectives(), before, "frozen");
    if rank() == 0 {
        let bytes = std::fs::read(plan_path()).expect("plan file written");
        let plan = ferrovod::negotiate::plan::Plan::decode(&bytes).unwrap();
        assert_eq!(plan.num_tensors(), 16);
    }
    finish_job();
}

/// A new run with the saved plan: no control collective from the very first step.
fn offline_load() {
    init_with_plan_file();
    let before = control_collectives();
    let mut rng = Lcg(99 + rank() as u64);
    for step in 0..4 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    assert_eq!(
        control_collectives(),
        before,
        "the loaded plan ran without negotiation"
    );
    finish_job();
}

/// A plan file from another model: the first tensor is not in it, offline mode falls back to
/// online negotiation, results stay right, and a new plan is learned and frozen.
fn offline_stale_plan() {
    let other: Vec<ferrovod::message::Response> = (0..3)
        .map(|k| {
            let req = ferrovod::message::Request {
                rank: 0,
                kind: OpKind::Allreduce,
                dtype: DataType::F32,
                name: format!("other.model.{k}"),
                shape: vec![10],
                root: 0,
                device: ferrovod::message::CPU_DEVICE,
                reduce_op: ReduceOp::Sum,
                prescale: 1.0,
                postscale: 1.0,
            };
            ferrovod::message::Response::from_request(&req)
        })
        .collect();
    let stale = ferrovod::negotiate::plan::Plan::from_step(&other, 1 << 20, 1 << 20);
    let path = plan_path().with_file_name("stale.bin");
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0") {
        std::fs::write(&path, stale.encode()).unwrap();
    }
    // MPI is not initialised yet: the other ranks wait for the file itself
    while !path.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.plan_file = Some(path.to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
    let mut rng = Lcg(3 + rank() as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 12, &[], 0);
    }
    let before = control_collectives();
    offline_step(&mut rng, 6, 12, &[], 0);
    assert_eq!(control_collectives(), before, "a new plan was frozen");
    if rank() == 0 {
        let plan = ferrovod::negotiate::plan::Plan::decode(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(plan.num_tensors(), 12, "the stale plan file was replaced");
    }
    finish_job();
}

/// After the plan froze: a new tensor, a changed shape and another kind of collective each
/// fall back to online negotiation with correct results, and the plan is learned again.
fn offline_diverge() {
    init();
    let me = rank();
    let mut rng = Lcg(11 + me as u64);
    let mut step = 0;
    let warm = |rng: &mut Lcg, step: &mut usize| {
        for _ in 0..4 {
            offline_step(rng, *step, 10, &[], 0);
            *step += 1;
        }
        let before = control_collectives();
        offline_step(rng, *step, 10, &[], 0);
        *step += 1;
        assert_eq!(control_collectives(), before, "frozen at step {step}");
    };
    warm(&mut rng, &mut step);
    // a tensor the plan does not hold
    let before = control_collectives();
    offline_step(&mut rng, step, 10, &["brand.new"], 0);
    step += 1;
    assert!(control_collectives() > before, "fell back to online");
    warm(&mut rng, &mut step);
    // a changed shape
    offline_step(&mut rng, step, 10, &[], 3);
    step += 1;
    warm(&mut rng, &mut step);
    // a broadcast between steps
    let mine = [me as f64 + 1.0, 2.0];
    let res = run(OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("between.steps", DataType::F64, &[2], &mine, false)],
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F64), &[1.0, 2.0], "broadcast");
    warm(&mut rng, &mut step);
    finish_job();
}

/// After the plan froze, rank 1 skips one tensor of a step: it escapes after
/// FERROVOD_PLAN_ESCAPE_MS, online negotiation takes over, and the stall inspector ends the
/// job with an error naming the tensor on every rank, within the stall timeout.
fn offline_skip() {
    init();
    let me = rank();
    let mut rng = Lcg(5 + me as u64);
    for step in 0..5 {
        offline_step(&mut rng, step, 8, &[], 0);
    }
    let start = Instant::now();
    let skip: &[usize] = if me == 1 { &[2] } else { &[] };
    let handles = submit_step(8, 0, skip);
    let mut errors = Vec::new();
    for (_, h) in handles {
        if let Err(e) = finish(h) {
            errors.push(e.to_string());
        }
    }
    if errors.is_empty() {
        // rank 1 holds no stalled tensor: its next operation fails with the job's stall report
        errors.push(
            run(OpSpec::new(OpKind::Barrier, vec![]))
                .unwrap_err()
                .to_string(),
        );
    }
    let msg = &errors[0];
    assert!(
        msg.contains("Missing ranks:") && msg.contains("p.2"),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    runtime::shutdown();
    pass();
}

/// After the plan froze, rank 1 stops submitting altogether (it holds nothing, so it cannot
/// escape): rank 0 waits inside a plan batch, warns, and after the stall shutdown time fails its
/// tensors with the stall report; it leaves MPI unfinalized, so the job ends instead of hanging
/// when rank 0 exits. The harness expects the job to fail and rank 0's report in the output.
fn offline_stall() {
    init();
    let me = rank();
    let mut rng = Lcg(17 + me as u64);
    for step in 0..5 {
        offline_step(&mut rng, step, 8, &[], 0);
    }
    if me == 1 {
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let start = Instant::now();
    let errors: Vec<String> = submit_step(8, 0, &[])
        .into_iter()
        .filter_map(|(_, h)| finish(h).err().map(|e| e.to_string()))
        .collect();
    assert!(!errors.is_empty());
    assert!(
        errors[0].contains("Stalled: offline plan batch"),
        "{}",
        errors[0]
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    println!("OFFLINE-STALL-REPORTED");
}

/// Autotune changes the fusion threshold and cycle time while steps run: every result stays
/// right, and rank 0's log records every setting tried (a header-less CSV, one line per
/// scored window: threshold, cycle ms, bytes/s).
fn autotune() {
    let log =
        std::path::PathBuf::from(std::env::var("FERROVOD_TEST_DIR").unwrap()).join("tune.csv");
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.autotune_log = Some(log.to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
    let mut rng = Lcg(23 + rank() as u64);
    for step in 0..120 {
        offline_step(&mut rng, step, 12, &[], 0);
    }
    if rank() == 0 {
        let text = std::fs::read_to_string(&log).unwrap();
        let thresholds: std::collections::BTreeSet<&str> =
            text.lines().map(|l| l.split(',').next().unwrap()).collect();
        // every threshold of the grid was tried
        assert!(thresholds.len() >= 7, "{text}");
    }
    finish_job();
}

/// Online mode learns the step's batches and then votes one bit per batch: 40 cached tensors
/// agree with a single 8-byte word per cycle instead of two words of per-tensor bits. A step
/// that lacks one tensor on every rank dissolves its group after FERROVOD_PLAN_ESCAPE_MS and
/// the rest still complete, per tensor; all results stay right.
fn online_groups() {
    init();
    let me = rank();
    let mut rng = Lcg(41 + me as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 40, &[], 0);
    }
    let rt = runtime::runtime().unwrap();
    let before = rt.metrics.snapshot();
    for step in 6..10 {
        offline_step(&mut rng, step, 40, &[], 0);
    }
    let after = rt.metrics.snapshot();
    let votes = after.control_collectives - before.control_collectives;
    let bytes = after.control_bytes - before.control_bytes;
    assert!(votes > 0);
    assert_eq!(
        bytes,
        8 * votes,
        "one word per vote once the batches are groups"
    );
    // every rank leaves out p.3 this step: its group dissolves, the others complete
    let n = size();
    let names = step_tensors(40, &[], 0);
    for (k, h) in submit_step(40, 0, &[3]) {
        let (_, len, dtype) = names[k].clone();
        let res = finish(h).unwrap();
        let want: Vec<f64> = (0..len)
            .map(|i| (0..n).map(|r| val(i + k, r)).sum())
            .collect();
        assert_close(&output(&res[0], dtype), &want, &format!("tensor {k}"));
    }
    for step in 11..14 {
        offline_step(&mut rng, step, 40, &[], 0);
    }
    finish_job();
}

/// Once a step's tensors vote as one group, a step whose tensors come one by one (300 us
/// apart) is voted on when the group is complete here, not at every submission: with a 50 ms
/// cycle time, a few votes for 40 tensors (one per submission before the group was learned).
fn group_votes() {
    init();
    let n = size();
    let count = 40;
    let me = rank();
    let mine =
        |k: usize, step: usize| -> Vec<f64> { (0..100).map(|i| val(i + k + step, me)).collect() };
    let spec = |k: usize, step: usize| {
        tensor(
            &format!("gv.{k}"),
            DataType::F32,
            &[100],
            &mine(k, step),
            false,
        )
    };
    let check = |k: usize, step: usize, res: &TensorResult| {
        let want: Vec<f64> = (0..100)
            .map(|i| (0..n).map(|r| val(i + k + step, r)).sum())
            .collect();
        assert_close(
            &output(res, DataType::F32),
            &want,
            &format!("step {step} tensor {k}"),
        );
    };
    // learned from steps submitted in one piece: one batch, so one group
    for step in 0..4 {
        let res = run(OpSpec::new(
            OpKind::Allreduce,
            (0..count).map(|k| spec(k, step)).collect(),
        ))
        .unwrap();
        for (k, r) in res.iter().enumerate() {
            check(k, step, r);
        }
    }
    let before_paced = control_collectives();
    let mut votes = Vec::new();
    for step in 4..7 {
        let before = control_collectives();
        let handles: Vec<_> = (0..count)
            .map(|k| {
                std::thread::sleep(Duration::from_micros(300));
                submit(OpSpec::new(OpKind::Allreduce, vec![spec(k, step)])).unwrap()
            })
            .collect();
        for (k, h) in handles.into_iter().enumerate() {
            check(k, step, &finish(h).unwrap()[0]);
        }
        votes.push(control_collectives() - before);
    }
    assert!(control_collectives() > before_paced);
    assert!(
        votes.iter().all(|v| *v <= 6),
        "votes per paced step of {count} tensors: {votes:?}"
    );
    finish_job();
}

/// Once the batches vote as groups, rank 1 submits nothing for a step: rank 0's groups are
/// ready but never agreed; after the stall warning time rank 0 dissolves them, its tensors go
/// stale one by one, and the stall inspector shuts the job down on both ranks with a report.
fn online_groups_stall() {
    init();
    let me = rank();
    let mut rng = Lcg(43 + me as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    let start = Instant::now();
    let msg = if me == 0 {
        let errors: Vec<String> = submit_step(16, 0, &[])
            .into_iter()
            .filter_map(|(_, h)| finish(h).err().map(|e| e.to_string()))
            .collect();
        assert_eq!(errors.len(), 16, "every tensor of the step fails");
        errors[0].clone()
    } else {
        std::thread::sleep(Duration::from_secs(6));
        run(OpSpec::new(OpKind::Barrier, vec![]))
            .unwrap_err()
            .to_string()
    };
    assert!(
        msg.contains("Missing ranks:") && msg.contains("p."),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    runtime::shutdown();
    pass();
}

/// Cached names whose shape or op changes, and more names than the cache holds.
fn cache_changes() {
    init();
    let n = size();
    let me = rank();
    for step in 0..6 {
        let len = if step < 3 { 4 } else { 6 }; // shape change invalidates the cached entry
        let op = if step % 2 == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        for k in 0..10 {
            let mine: Vec<f64> = (0..len).map(|i| val(i + k, me)).collect();
            let mut spec = OpSpec::new(
                OpKind::Allreduce,
                vec![tensor(
                    &format!("c{k}"),
                    DataType::F32,
                    &[len as i64],
                    &mine,
                    false,
                )],
            );
            spec.reduce_op = op;
            let res = run(spec).unwrap();
            let want: Vec<f64> = (0..len)
                .map(|i| {
                    let xs = (0..n).map(|r| val(i + k, r));
                    if op == ReduceOp::Sum {
                        xs.sum()
                    } else {
                        xs.fold(0.0, f64::max)
                    }
                })
                .collect();
            assert_close(
                &output(&res[0], DataType::F32),
                &want,
                &format!("step {step} c{k}"),
            );
        }
    }
    finish_job();
}

/// Rank 0 keeps reducing after the others joined: joined ranks contribute zeros; join returns
/// the last rank to join; allgather with a joined rank is an error on the ranks that submit it.
fn join() {
    init();
    let n = size();
    let me = rank();
    // warm the cache with one name so joined ranks vote for a cached tensor too
    let first: Vec<f64> = (0..5).map(|i| val(i, me)).collect();
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("j.cached", DataType::F32, &[5], &first, false)],
    ))
    .unwrap();
    if me == 0 {
        for step in 0..3 {
            for name in ["j.cached", "j.new"] {
                let mine: Vec<f64> = (0..5).map(|i| val(i + step, me)).collect();
                let res = run(OpSpec::new(
                    OpKind::Allreduce,
                    vec![tensor(name, DataType::F32, &[5], &mine, false)],
                ))
                .unwrap();
                assert_close(
                    &output(&res[0], DataType::F32),
                    &mine,
                    "joined ranks add zeros",
                );
            }
        }
        // a barrier among the ranks that have not joined: joined ranks take part too
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        let err = run(OpSpec::new(
            OpKind::Allgather,
            vec![tensor("j.ag", DataType::F32, &[1], &[1.0], true)],
        ))
        .unwrap_err();
        assert!(
            matches!(err, Error::Precondition(ref m) if m.starts_with("Allgather is not supported with Join")),
            "{err}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // rank 0 submits a last allreduce and its join back to back, so both can be agreed in one
    // cycle: the joined ranks must still contribute to the allreduce
    let last = (me == 0).then(|| {
        let mine: Vec<f64> = (0..4).map(|i| val(i, me)).collect();
        let h = submit(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("j.last", DataType::F32, &[4], &mine, false)],
        ))
        .unwrap();
        (h, mine)
    });
    let h = submit(OpSpec::new(OpKind::Join, vec![])).unwrap();
    if let Some((g, mine)) = last {
        assert_close(
            &output(&finish(g).unwrap()[0], DataType::F32),
            &mine,
            "allreduce agreed with the join",
        );
    }
    h.wait(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(h.value(), 0, "rank 0 joins last");
    // after the join everyone works normally again
    let mine: Vec<f64> = (0..3).map(|i| val(i, me)).collect();
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("after", DataType::F64, &[3], &mine, false)],
    ))
    .unwrap();
    let want: Vec<f64> = (0..3).map(|i| (0..n).map(|r| val(i, r)).sum()).collect();
    assert_close(&output(&res[0], DataType::F64), &want, "after join");
    finish_job();
}

fn process_sets() {
    // a rank listed twice is refused, as fv_add_process_set refuses it (not deduplicated),
    // before anything collective starts: init can be retried
    let err = runtime::init(runtime::InitOptions {
        process_sets: vec![vec![0, 2], vec![1, 1, 3]],
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("must be distinct ranks"), "{err}");
    // static sets at init: {0, 2} and {1, 3}, plus a duplicate that maps to the same id
    runtime::init(runtime::InitOptions {
        process_sets: vec![vec![0, 2], vec![1, 3], vec![2, 0]],
        ..Default::default()
    })
    .unwrap();
    let rt = runtime::runtime().unwrap();
    let me = rank();
    assert_eq!(rt.process_set_ids(), vec![0, 1, 2]);
    assert_eq!(rt.process_set_ranks(1), Some(vec![0, 2]));
    let mine_set = if me.is_multiple_of(2) { 1 } else { 2 };
    assert_eq!(rt.process_set_rank(mine_set).unwrap(), (me / 2) as i32);
    assert_eq!(rt.process_set_rank(3 - mine_set).unwrap(), -1);
    // concurrent, same tensor name in both sets
    let mine: Vec<f64> = (0..4).map(|i| val(i, me)).collect();
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("shared.name", DataType::F32, &[4], &mine, false)],
    );
    spec.process_set = mine_set;
    let res = run(spec).unwrap();
    let peers = [me % 2, me % 2 + 2];
    let want: Vec<f64> = (0..4)
        .map(|i| peers.iter().map(|r| val(i, *r)).sum())
        .collect();
    assert_close(
        &output(&res[0], DataType::F32),
        &want,
        "static set allreduce",
    );
    // not a member
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("x", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = 3 - mine_set;
    let err = submit(spec).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("Allreduce: Rank {me} is not a member of the provided process set.")
    );
    // dynamic add, duplicate add, remove, removal of the global set
    let h = rt.add_process_set(&[0, 1, 2]).unwrap();
    h.wait(None).unwrap();
    let id = h.value();
    assert_eq!(id, 3);
    let dup = rt.add_process_set(&[0, 1, 2]).unwrap();
    let err = dup.wait(None).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    if me < 3 {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("dyn", DataType::I64, &[4], &mine, false)],
        );
        spec.process_set = id;
        let res = run(spec).unwrap();
        let want: Vec<f64> = (0..4).map(|i| (0..3).map(|r| val(i, r)).sum()).collect();
        assert_close(&output(&res[0], DataType::I64), &want, "dynamic set");
    }
    let h = rt.remove_process_set(id).unwrap();
    h.wait(None).unwrap();
    assert_eq!(rt.process_set_ranks(id), None);
    assert!(rt.remove_process_set(0).is_err());
    assert!(rt.remove_process_set(id).is_err());
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("gone", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = id;
    assert_eq!(
        submit(spec).unwrap_err().to_string(),
        "Allreduce: Process set provided does not exist, or has not been registered."
    );
    finish_job();
}

/// Cross-rank mismatches fail on every rank with the same message naming the tensor.
fn mismatches() {
    init();
    let me = rank();
    let last = size() - 1;
    let expect = |spec: OpSpec, start: &str, name: &str| {
        let err = run(spec).unwrap_err();
        match &err {
            Error::Precondition(m) => {
                assert!(m.starts_with(start), "rank {me}: {m}");
                assert!(m.contains(&format!("tensor '{name}'")), "rank {me}: {m}");
            }
            other => panic!("rank {me}: expected a precondition error, got {other:?}"),
        }
    };
    // shape
    let len = if me == last { 3 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "m.shape",
                DataType::F32,
                &[len],
                &vec![1.0; len as usize],
                false,
            )],
        ),
        "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [2], but another rank sent a tensor of shape [3].",
        "m.shape",
    );
    // dtype
    let dtype = if me == last {
        DataType::I32
    } else {
        DataType::F32
    };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("m.dtype", dtype, &[2], &[1.0, 2.0], false)],
        ),
        "Mismatched data types: One rank had type float32, but another rank had type int32.",
        "m.dtype",
    );
    // op kind
    let kind = if me == last {
        OpKind::Allgather
    } else {
        OpKind::Allreduce
    };
    expect(
        OpSpec::new(
            kind,
            vec![tensor(
                "m.op",
                DataType::F32,
                &[2],
                &[1.0, 2.0],
                kind == OpKind::Allgather,
            )],
        ),
        "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.",
        "m.op",
    );
    // root
    let mut spec = OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("m.root", DataType::F32, &[2], &[1.0, 2.0], false)],
    );
    spec.root_rank = if me == last { 1 } else { 0 };
    expect(
        spec,
        "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1.",
        "m.root",
    );
    // reduction op
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.redop", DataType::F32, &[2], &[1.0, 2.0], false)],
    );
    spec.reduce_op = if me == last {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    expect(
        spec,
        "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction op 4.",
        "m.redop",
    );
    // allgather trailing dimension
    let cols = if me == last { 3 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allgather,
            vec![tensor(
                "m.ag",
                DataType::F32,
                &[1, cols],
                &vec![1.0; cols as usize],
                true,
            )],
        ),
        "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 2, but another rank sent a tensor with dimension 1 equal to 3.",
        "m.ag",
    );
    // a mismatch on a cached name (second use with a changed shape on one rank)
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.cached", DataType::F32, &[2], &[1.0, 2.0], false)],
    ))
    .unwrap();
    let len = if me == last { 4 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "m.cached",
                DataType::F32,
                &[len],
                &vec![1.0; len as usize],
                false,
            )],
        ),
        "Mismatched ALLREDUCE tensor shapes",
        "m.cached",
    );
    // the job is still healthy afterwards
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.ok", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    assert_close(
        &output(&res[0], DataType::F32),
        &[size() as f64],
        "after mismatches",
    );
    finish_job();
}

/// Enqueue-time errors: on the calling rank, immediately, nothing enqueued.
fn bad_arguments() {
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert_eq!(err, Error::NotInitialized);
    init();
    let me = rank();
    let n = size();
    let invalid = |spec: OpSpec, want: &str| {
        let err = submit(spec).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::Aborted(_)),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(want),
            "rank {me}: got '{err}', want '{want}'"
        );
    };
    // duplicate name while the first is in flight: "dup.<r>" cannot complete before the others
    // submit it, which they do only after the barrier that rank r reaches after its attempt
    let dup = |r: usize| {
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                &format!("dup.{r}"),
                DataType::F32,
                &[1],
                &[1.0],
                false,
            )],
        )
    };
    let mine = submit(dup(me)).unwrap();
    invalid(
        dup(me),
        "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is currently being processed.",
    );
    run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    let others: Vec<_> = (0..n)
        .filter(|r| *r != me)
        .map(|r| submit(dup(r)).unwrap())
        .collect();
    for h in std::iter::once(mine).chain(others) {
        finish(h).unwrap();
    }
    // same name twice inside one group
    invalid(
        OpSpec::new(
            OpKind::Allreduce,
            vec![
                tensor("g", DataType::F32, &[1], &[1.0], false),
                tensor("g", DataType::F32, &[1], &[1.0], false),
            ],
        ),
        "same name",
    );
    let mut spec = OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("b", DataType::F32, &[1], &[1.0], false)],
    );
    spec.root_rank = n as i32;
    invalid(
        spec,
        &format!("broadcast received invalid root rank {n} for provided process set"),
    );
    let mut t = tensor("a2a", DataType::F32, &[4], &[1.0; 4], true);
    t.splits = Some(vec![1; n + 1]);
    invalid(
        OpSpec::new(OpKind::Alltoall, vec![t]),
        "Number of entries in splits does not equal number of workers.",
    );
    let mut t = tensor("a2a", DataType::F32, &[4], &[1.0; 4], true);
    t.splits = Some(vec![3; n]);
    invalid(
        OpSpec::new(OpKind::Alltoall, vec![t]),
        "Sum of splits entries is greater than the first dimension of tensor.",
    );
    invalid(
        OpSpec::new(
            OpKind::Alltoall,
            vec![tensor(
                "a2a",
                DataType::F32,
                &[n as i64 + 1],
                &vec![1.0; n + 1],
                true,
            )],
        ),
        "splits not provided, but first dimension of tensor is not an even multiple of the number of workers.",
    );
    let mut spec = OpSpec::new(
        OpKind::Reducescatter,
        vec![tensor("rs", DataType::F32, &[4], &[1.0; 4], true)],
    );
    spec.reduce_op = ReduceOp::Max;
    invalid(
        spec,
        "Reducescatter currently only supports AVERAGE and SUM.",
    );
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ad", DataType::F32, &[1], &[1.0], false)],
    );
    spec.reduce_op = ReduceOp::Adasum;
    invalid(spec, "Adasum");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("bavg", DataType::Bool, &[1], &[1.0], false)],
    );
    spec.reduce_op = ReduceOp::Average;
    invalid(spec, "cannot be averaged");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ps", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = 42;
    invalid(spec, "Process set provided does not exist");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("dev", DataType::F32, &[1], &[1.0], false)],
    );
    spec.device = 0;
    if ferrovod::transport::cuda::cuda_present() {
        invalid(spec, "must be given as device memory");
    } else {
        // the documented error of a GPU request where CUDA cannot be loaded
        let err = submit(spec).unwrap_err();
        assert!(matches!(err, Error::Precondition(_)), "{err:?}");
        assert!(
            err.to_string()
                .contains("GPU device 0 requested, but CUDA is not available on this machine"),
            "rank {me}: got '{err}'"
        );
    }
    let mut t = tensor("size", DataType::F32, &[3], &[1.0; 2], false);
    t.shape = vec![3];
    invalid(
        OpSpec::new(OpKind::Allreduce, vec![t]),
        "has 8 bytes but its shape and dtype need 12",
    );
    invalid(
        OpSpec::new(
            OpKind::Allgather,
            vec![tensor("ag", DataType::F32, &[1], &[1.0], false)],
        ),
        "allocated after negotiation",
    );
    invalid(OpSpec::new(OpKind::Allreduce, vec![]), "no tensors");
    // the job is still healthy afterwards
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ok", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    assert_close(
        &output(&res[0], DataType::F32),
        &[n as f64],
        "after bad arguments",
    );
    finish_job();
}

/// Each rank submits a tensor the other never does: the stall becomes an error on all ranks.
fn stall() {
    init();
    let me = rank();
    let name = format!("only.on.rank{me}");
    let start = Instant::now();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(&name, DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), "{msg}");
    assert!(msg.contains("Missing ranks:"), "{msg}");
    assert!(
        msg.contains("only.on.rank0") && msg.contains("only.on.rank1"),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    // new work is refused with the same reason
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(err.to_string().contains("Missing ranks:"));
    runtime::shutdown();
    pass();
}

/// A name both ranks used before (so it is cached) that only rank 0 submits again, while rank 1
/// submits nothing: only the cached path can see it. Rank 0's vote goes stale, is sent to the
/// coordinator, and the stall ends in an error on both ranks.
fn stall_cached() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("cached.once", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    let start = Instant::now();
    let err = if me == 0 {
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("cached.once", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    } else {
        while !rt.is_shut_down() && start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err()
    };
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("Missing ranks:\n1: [cached.once]"), "{msg}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    runtime::shutdown();
    pass();
}

/// A stall inside process set {0, 1}: rank 2, outside the set, must not be left waiting in the
/// global vote; every rank ends with an error.
fn stall_in_set() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    let h = rt.add_process_set(&[0, 1]).unwrap();
    h.wait(None).unwrap();
    let set = h.value();
    let start = Instant::now();
    if me == 0 {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("set.only0", DataType::F32, &[1], &[1.0], false)],
        );
        spec.process_set = set;
        let err = run(spec).unwrap_err();
        assert!(
            err.to_string().contains("Missing ranks:\n1: [set.only0]"),
            "{err}"
        );
    }
    // the whole job stops through the global set's next vote
    while !rt.is_shut_down() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    runtime::shutdown();
    pass();
}

/// FERROVOD_LOCAL_SIZE=2 on 4 ranks emulates two hosts of two ranks each.
fn topology() {
    init();
    let rt = runtime::runtime().unwrap();
    let t = rt.topology().clone();
    let r = t.rank;
    assert_eq!((t.size, t.local_size, t.cross_size), (4, 2, 2));
    assert_eq!((t.local_rank, t.cross_rank), (r % 2, r / 2));
    assert!(t.is_homogeneous);
    assert!(t.mpi_threads_supported);
    finish_job();
}

struct FailingAllocator;

impl ferrovod::runtime::entry::OutputAllocator for FailingAllocator {
    fn allocate(
        &mut self,
        _index: usize,
        _shape: &[i64],
        bytes: usize,
    ) -> Result<ferrovod::transport::memory::HostBuffer, Error> {
        Err(Error::Aborted(format!(
            "test allocator refuses {bytes} bytes"
        )))
    }
}

/// An output allocation that fails on one rank fails that rank's tensor only: the rank still
/// takes part in the collective, so the others complete with correct values instead of hanging.
fn alloc_failure() {
    init();
    let me = rank();
    for kind in [OpKind::Allgather, OpKind::Reducescatter, OpKind::Alltoall] {
        let name = format!("alloc.{}", kind.name());
        let mut spec = OpSpec::new(
            kind,
            vec![tensor(&name, DataType::F32, &[2], &[1.0, 2.0], true)],
        );
        if me == 1 {
            spec.allocator = Some(Arc::new(std::sync::Mutex::new(FailingAllocator)));
        }
        match run(spec) {
            Ok(res) => {
                assert_eq!(me, 0);
                let want: Vec<f64> = match kind {
                    OpKind::Allgather => vec![1.0, 2.0, 1.0, 2.0],
                    OpKind::Reducescatter => vec![2.0], // row 0 summed over both ranks
                    _ => vec![1.0, 1.0],
                };
                assert_close(&output(&res[0], DataType::F32), &want, &name);
            }
            Err(e) => {
                assert_eq!(me, 1, "{e}");
                // output sizes: allgather 2 ranks x 2 floats, reducescatter 1 row, alltoall 2 rows
                let bytes = match kind {
                    OpKind::Allgather => 16,
                    OpKind::Reducescatter => 4,
                    _ => 8,
                };
                assert_eq!(
                    e,
                    Error::Aborted(format!("test allocator refuses {bytes} bytes"))
                );
            }
        }
    }
    finish_job();
}

/// Completion callbacks run on the background thread: they see the status, and waiting there
/// for an unfinished operation is refused instead of deadlocking.
fn callbacks() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    // B is pending on rank 0 until rank 1 submits it after A.
    let b = if me == 0 {
        Some(
            submit(OpSpec::new(
                OpKind::Allreduce,
                vec![tensor("cb.b", DataType::F32, &[1], &[1.0], false)],
            ))
            .unwrap(),
        )
    } else {
        None
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let b2 = b.clone();
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("cb.a", DataType::F32, &[1], &[2.0], false)],
    );
    spec.callback = Some(Box::new(move |_, r: &Result<(), Error>| {
        let inner = b2.map(|b| b.wait(None));
        tx.send((r.clone(), inner)).unwrap();
    }));
    let a = submit(spec).unwrap();
    let (status, inner) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!(status, Ok(()));
    if me == 0 {
        let err = inner.unwrap().unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot wait for an operation from a ferrovod callback"),
            "{err}"
        );
    }
    assert_close(
        &output(&finish(a).unwrap()[0], DataType::F32),
        &[4.0],
        "cb.a",
    );
    let b = match b {
        Some(b) => b,
        None => submit(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("cb.b", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap(),
    };
    assert_close(
        &output(&finish(b).unwrap()[0], DataType::F32),
        &[2.0],
        "cb.b",
    );
    assert!(
        rt.handles.is_empty(),
        "handles leaked: {}",
        rt.handles.len()
    );
    finish_job();
}

/// One rank shuts down while the other has an operation pending.
fn shutdown_pending() {
    init();
    if rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
        runtime::shutdown();
    } else {
        let err = run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err();
        assert_eq!(err, Error::ShutDown(SHUT_DOWN_MESSAGE.into()));
        let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
        assert_eq!(err.to_string(), SHUT_DOWN_MESSAGE);
        runtime::shutdown();
    }
    pass();
}

/// A rank whose program ends without calling shutdown: the exit handler that fv_init registers
/// tells the others, whose pending operation fails instead of hanging.
fn rank_exits() {
    // SAFETY: NULL options are documented.
    assert_eq!(
        unsafe { ferrovod::capi::fv_init(std::ptr::null()) },
        ferrovod::Status::Ok
    );
    if rank() == 1 {
        pass();
        std::thread::sleep(Duration::from_millis(200));
        std::process::exit(0);
    }
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    assert_eq!(err, Error::ShutDown(SHUT_DOWN_MESSAGE.into()));
    pass();
}

/// A rank that dies: mpirun ends the job (non-zero exit) rather than leaving rank 0 hanging.
fn rank_killed() {
    init();
    if rank() == 1 {
        std::thread::sleep(Duration::from_millis(200));
        std::process::abort();
    }
    let _ = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// A few steps every rank runs together.
fn steps_together(n: usize) {
    for step in 0..n {
        let out = run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "together",
                DataType::F32,
                &[1],
                &[1.0 + step as f64],
                false,
            )],
        ))
        .expect("a step before the fault");
        let want = (size() as f64) * (1.0 + step as f64);
        assert_eq!(output(&out[0], DataType::F32), vec![want]);
    }
}

/// Prints the marker a failing scenario's harness counts, then ends this process as a
/// framework's uncaught exception does: shutdown (the C API's exit handler), exit without
/// finalizing MPI; mpirun ends the job.
fn report_and_exit(marker: &str, msg: &str) -> ! {
    use std::io::Write;
    println!("{marker} rank={}: {msg}", rank());
    std::io::stdout().flush().unwrap();
    runtime::shutdown();
    std::process::exit(1);
}

/// A rank that hangs instead of dying (kill -STOP, as a stuck file system or GPU does): the
/// others wait in a negotiation vote, report the stall naming it once the stall shutdown time
/// has passed, and end.
fn rank_stopped() {
    init();
    let start;
    let err = if std::env::var("FERROVOD_TEST_FAULT").is_ok_and(|f| f.starts_with("stop_in_round"))
    {
        // rank 1 stops inside the first coordinator round: the first step fails
        start = Instant::now();
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("in.round", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    } else {
        steps_together(3);
        if rank() == 1 {
            let _ = Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
            unreachable!("a stopped rank is killed by mpirun");
        }
        start = Instant::now();
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("after.stop", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    };
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("Missing ranks: 1."), "{msg}");
    assert!(
        msg.contains("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2"),
        "{msg}"
    );
    // the limit (2 s) plus the presence probe (3 s) plus a margin
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
    report_and_exit("STALL-REPORTED", &msg);
}

/// Rank 1 stops itself after agreeing to run a batch: the others wait inside the blocking
/// data collective, which no error can interrupt; the watchdog names rank 1 and aborts the
/// job (checked by the harness on stderr).
///
/// On GPUs rank 0 launched the batch's NCCL call and waits for its completion event while it
/// votes: the vote's limit (or the completion's) fails the operation, the NCCL communicators are
/// aborted, and rank 0 ends as a framework would on the error.
fn rank_stopped_in_batch() {
    init();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            "stopped.in.batch",
            DataType::F32,
            &[1],
            &[1.0],
            false,
        )],
    ))
    .unwrap_err();
    // host memory: the watchdog aborted the job before this
    assert!(gpu_mode(), "the blocking collective returned: {err}");
    let msg = err.to_string();
    assert!(
        msg.contains("Missing ranks: 1.") || msg.contains("GPU collective did not finish within"),
        "{msg}"
    );
    report_and_exit("STALL-REPORTED", &msg);
}

/// Rank 1's background thread panics before a batch every rank agreed to run: it aborts the
/// job at once with a message (the others may already wait inside the batch's collective).
fn fault_panic() {
    init();
    let _ = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("panics", DataType::F32, &[1], &[1.0], false)],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// Rank 1's vote fails locally: its operation gets the error; its background thread is gone,
/// so the others report it missing after the stall shutdown time.
fn fault_negotiation() {
    init();
    // steps until the fault (at once, or once an offline plan froze) fails one
    let mut failed = None;
    for step in 0..12 {
        let v = 1.0 + step as f64;
        match run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("fault.step", DataType::F32, &[1], &[v], false)],
        )) {
            Ok(out) => assert_eq!(output(&out[0], DataType::F32), vec![size() as f64 * v]),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let msg = failed.expect("the fault failed no step").to_string();
    if rank() == 1 {
        assert!(msg.contains("test fault:"), "{msg}");
        use std::io::Write;
        println!("FAULT-REPORTED rank=1: {msg}");
        std::io::stdout().flush().unwrap();
        // alive, but no longer negotiating: the others must not wait for ever
        std::thread::sleep(Duration::from_secs(120));
    }
    assert!(msg.contains("Missing ranks: 1."), "{msg}");
    report_and_exit("STALL-REPORTED", &msg);
}

/// Rank 0 cannot decode a request list: it answers the round with a shutdown instead of
/// leaving the others waiting in its broadcast. Every rank gets the reason; MPI stays usable.
fn fault_decode() {
    init();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("fault.decode", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("test fault: decode"), "{msg}");
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(err.to_string().contains("test fault: decode"), "{err}");
    runtime::shutdown();
    pass();
}

/// GPU: rank 1 fails just before creating its NCCL communicator; rank 0 waits in
/// ncclCommInitRank, which nothing interrupts: the watchdog names the wait and ends the job.
fn fault_nccl_init() {
    init();
    let _ = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("nccl.init", DataType::F32, &[4], &[1.0; 4], false)],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// GPU: rank 1's alltoall fails before the split exchange over MPI that rank 0 waits in.
fn gpu_alltoall_fault() {
    init();
    let rows = size() as i64;
    let _ = run(OpSpec::new(
        OpKind::Alltoall,
        vec![tensor(
            "a2a.fault",
            DataType::F32,
            &[rows],
            &vec![1.0; rows as usize],
            true,
        )],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// MPI initialised by the program (as mpi4py does); ferrovod runs on two halves of the world
/// given as communicators, and leaves MPI for the program to finalise.
fn preinitialized_mpi() {
    use mpi::ffi;
    // SAFETY: plain MPI calls on a fresh process.
    let half_comm = unsafe {
        let mut provided = 0;
        ffi::MPI_Init_thread(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            ffi::RSMPI_THREAD_MULTIPLE,
            &mut provided,
        );
        let mut r = 0;
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut r);
        let mut half = std::mem::zeroed();
        ffi::MPI_Comm_split(ffi::RSMPI_COMM_WORLD, r % 2, r, &mut half);
        half
    };
    // SAFETY: a valid communicator.
    let handle = unsafe { ffi::MPI_Comm_c2f(half_comm) };
    runtime::init(runtime::InitOptions {
        comm: runtime::Communicator::Fortran(handle),
        ..Default::default()
    })
    .unwrap();
    let world_rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(size(), 2);
    assert_eq!(rank(), world_rank / 2);
    let mine = vec![world_rank as f64];
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("half", DataType::F64, &[1], &mine, false)],
    ))
    .unwrap();
    let peers: f64 = (0..4)
        .filter(|r| r % 2 == world_rank % 2)
        .map(|r| r as f64)
        .sum();
    assert_close(
        &output(&res[0], DataType::F64),
        &[peers],
        "allreduce on a sub-communicator",
    );
    runtime::shutdown();
    // MPI must still be usable: ferrovod did not finalise it
    // SAFETY: MPI is initialised by this program.
    unsafe {
        let mut flag = 0;
        ffi::MPI_Finalized(&mut flag);
        assert_eq!(flag, 0, "ferrovod finalised MPI it did not initialise");
        let mut half = half_comm;
        ffi::MPI_Comm_free(&mut half);
        ffi::MPI_Barrier(ffi::RSMPI_COMM_WORLD);
        ffi::MPI_Finalize();
    }
    pass();
}

/// init with a subset of MPI_COMM_WORLD: members run collectives among themselves; the rank
/// outside gets a clear error.
fn init_subset() {
    let world_rank: i32 = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let r = runtime::init(runtime::InitOptions {
        comm: runtime::Communicator::Ranks(vec![0, 2]),
        ..Default::default()
    });
    if world_rank == 1 {
        let err = r.unwrap_err();
        assert!(
            err.to_string()
                .contains("is not in the ranks given to init"),
            "{err}"
        );
        assert!(!runtime::is_initialized());
        pass();
        return;
    }
    r.unwrap();
    assert_eq!(size(), 2);
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            "sub",
            DataType::F32,
            &[1],
            &[world_rank as f64],
            false,
        )],
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F32), &[2.0], "subset allreduce");
    finish_job();
}

fn timeline() {
    init();
    let me = rank();
    for step in 0..3 {
        let tensors = (0..4)
            .map(|k| {
                tensor(
                    &format!("timeline.grad.{k}"),
                    DataType::F32,
                    &[8],
                    &[(me + step) as f64; 8],
                    false,
                )
            })
            .collect();
        run(OpSpec::new(OpKind::Allreduce, tensors)).unwrap();
    }
    run(OpSpec::new(
        OpKind::Allgather,
        vec![tensor(
            "timeline.ag",
            DataType::F32,
            &[2],
            &[1.0, 2.0],
            true,
        )],
    ))
    .unwrap();
    finish_job();
}

/// Element counts beyond 2^31: a u8 allreduce of 2^31 + 3 elements and an allgather whose
/// output exceeds 2^31 bytes.
fn large_counts() {
    init();
    let me = rank();
    let n = size();
    let count = (1usize << 31) + 3;
    let data: Vec<u8> = (0..count).map(|i| ((i % 5) + me) as u8).collect();
    let spec = OpSpec::new(
        OpKind::Allreduce,
        vec![TensorSpec {
            name: "big".into(),
            dtype: DataType::U8,
            shape: vec![count as i64],
            input: InputMem::Owned(data),
            output: OutputMem::InPlace,
            splits: None,
        }],
    );
    let out = run(spec).unwrap().remove(0).output.unwrap();
    let want = |i: usize| (0..n).map(|r| (i % 5) + r).sum::<usize>() as u8;
    for i in (0..count).step_by(4099).chain(count - 8..count) {
        assert_eq!(out[i], want(i), "element {i}");
    }
    drop(out);
    let rows = (1usize << 30) + 7 * me; // two ranks: > 2^31 bytes gathered
    let data: Vec<u8> = (0..rows).map(|i| ((i + me) % 251) as u8).collect();
    let spec = OpSpec::new(
        OpKind::Allgather,
        vec![TensorSpec {
            name: "big.ag".into(),
            dtype: DataType::U8,
            shape: vec![rows as i64],
            input: InputMem::Owned(data),
            output: OutputMem::Later,
            splits: None,
        }],
    );
    let res = run(spec).unwrap().remove(0);
    let out = res.output.unwrap();
    let rows_of = |r: usize| (1usize << 30) + 7 * r;
    assert_eq!(out.len(), (0..n).map(rows_of).sum::<usize>());
    let mut off = 0;
    for r in 0..n {
        for i in (0..rows_of(r))
            .step_by(7919)
            .chain(rows_of(r) - 3..rows_of(r))
        {
            assert_eq!(out[off + i], ((i + r) % 251) as u8, "rank {r} row {i}");
        }
        off += rows_of(r);
    }
    finish_job();
}

/// A rank whose GPU batch fails after every rank agreed to run it (here: its fusion buffer
/// cannot grow, its GPU memory being taken): it aborts its NCCL communicators and shuts the
/// job down; the vote tells the other rank, whose NCCL call waits for it, to abort its own at
/// once rather than after the grace time (4 s here). Both get an error, nobody hangs, later
/// work is refused, and MPI finalizes.
fn gpu_failure() {
    init();
    let me = rank();
    // what is under test is that nothing hangs: fail fast rather than at the harness's limit
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("gpu_failure: rank {me} still running after 60 s");
        std::process::exit(3);
    });
    let n = size();
    // opens the lane (small fusion buffer)
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        (0..2)
            .map(|k| tensor(&format!("warm.{k}"), DataType::F32, &[4], &[1.0; 4], false))
            .collect(),
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F32), &[n as f64; 4], "warm-up");
    // 200 tensors of 512 KiB: fused through a 100 MiB fusion buffer
    let count = 128 << 10;
    let specs: Vec<TensorSpec> = (0..200)
        .map(|k| {
            tensor(
                &format!("big.{k}"),
                DataType::F32,
                &[count as i64],
                &vec![1.0; count],
                false,
            )
        })
        .collect();
    let gpu = gpu::this_gpu();
    // rank 1 leaves less free than the inputs (copied to the GPU at submission) and the
    // fusion buffer need together
    let _hog = (me == 1).then(|| {
        let (free, _) = gpu.memory_info().unwrap();
        gpu.alloc(free - (160 << 20)).unwrap()
    });
    let start = Instant::now();
    let err = run(OpSpec::new(OpKind::Allreduce, specs)).unwrap_err();
    let msg = err.to_string();
    if me == 1 {
        assert!(
            msg.contains("GPU collective failed on this rank")
                && msg.contains("NCCL communicators were aborted"),
            "{msg}"
        );
    } else {
        assert!(
            matches!(err, Error::Aborted(_)) && msg.contains("GPU collective was aborted"),
            "{err:?}"
        );
    }
    // the grace time is the stall shutdown time, 4 s
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    let later = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("later", DataType::F32, &[1], &[1.0], false)],
    ));
    assert!(matches!(later, Err(Error::ShutDown(_))), "{later:?}");
    // MPI's finalize waits for both ranks (rank 0 ends its wait after the grace time)
    runtime::shutdown();
    pass();
}

/// GPU inputs produced asynchronously on the caller's stream (a kernel still running at
/// enqueue): ferrovod's stream must wait for it on the device, through the recorded stream
/// or the caller's event; the handle's event (also through the C API) orders a consumer.
fn gpu_streams() {
    use ferrovod::transport::cuda::{ForeignEvent, ForeignStream};
    init();
    let me = rank();
    let n = size();
    let gpu = gpu::this_gpu();
    let count = 16 << 20; // 64 MiB of f32: the producer kernel is still running at enqueue
    let host = encode(DataType::F32, &vec![(me + 1) as f64; count]);
    let upload = gpu.new_stream().unwrap();
    let producer = gpu.new_stream().unwrap();
    let consumer = gpu.new_stream().unwrap();
    let want = 2.0 * (n * (n + 1) / 2) as f64;
    for (k, by_event) in [false, true, false, true].into_iter().enumerate() {
        let data = gpu.alloc(host.len()).unwrap();
        gpu.upload(&upload, &host, data.range()).unwrap();
        // the producer doubles the values; nothing waits for it on the host
        gpu.scale(
            &producer,
            data.range(),
            data.range(),
            count,
            DataType::F32,
            2.0,
        )
        .unwrap();
        let name = format!("gpu.stream.{k}");
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![TensorSpec {
                name: name.clone(),
                dtype: DataType::F32,
                shape: vec![count as i64],
                input: InputMem::Device(data.range().first(host.len()).expect("allocated for it")),
                output: OutputMem::InPlace,
                splits: None,
            }],
        );
        spec.device = gpu.ordinal;
        let ready = gpu.new_event().unwrap();
        if by_event {
            ready.record(&producer).unwrap();
            // SAFETY: a live event of this GPU, kept until the operation completes
            spec.ready_event = Some(unsafe { ForeignEvent::from_raw(ready.raw().cast()) });
        } else {
            // SAFETY: a live stream of this GPU
            spec.ready_stream = Some(unsafe { ForeignStream::from_raw(producer.raw().cast()) });
        }
        let h = runtime::runtime().unwrap().enqueue(spec).unwrap();
        h.wait(Some(Duration::from_secs(120))).unwrap();
        // the C API hands out the same completion event
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        let status = ferrovod::capi::fv_handle_event(h.id, &mut raw);
        assert_eq!(status, ferrovod::error::Status::Ok);
        assert!(!raw.is_null(), "{name}: no completion event");
        assert_eq!(raw, h.event().unwrap().raw().cast());
        // a GPU consumer orders its reads after the event, without a host wait
        // SAFETY: the handle's live event
        consumer
            .wait_foreign(unsafe { ForeignEvent::from_raw(raw) })
            .unwrap();
        let mut got = vec![0u8; host.len()];
        gpu.download(&consumer, data.range(), &mut got).unwrap();
        runtime::runtime().unwrap().handles.release(h.id).unwrap();
        let got = decode(DataType::F32, &got);
        let bad = got.iter().position(|v| *v != want);
        assert!(
            bad.is_none(),
            "{name}: element {bad:?} is {:?}, want {want}",
            bad.map(|i| got[i])
        );
    }
    finish_job();
}

/// Fused GPU allreduces replayed from CUDA graphs: a step of tensors (two large enough to be
/// reduced in place, three packed) repeated with new values, each step checked against the
/// host's sums. One rank moving a tensor to new memory (rank 1 at step 8), then every rank
/// (step 11), must not replay a graph with the old addresses; the batches are replayed again
/// once the tensors stay put.
fn gpu_graphs() {
    init();
    let me = rank();
    let n = size();
    let rt = runtime::runtime().unwrap();
    let gpu = gpu::this_gpu();
    let stream = gpu.new_stream().unwrap();
    let counts = [600_000usize, 300, 1000, 400_000, 7];
    let mut mems: Vec<_> = counts.iter().map(|c| gpu.alloc(c * 4).unwrap()).collect();
    let value =
        |r: usize, step: usize, t: usize, i: usize| ((r + 1) * (step + 1) + t + i % 5) as f64;
    let mut replayed_after_moves = 0;
    for step in 0..20 {
        // the new memory is taken while the old is still held: a new address
        if step == 8 && me == 1 {
            mems[2] = gpu.alloc(counts[2] * 4).unwrap();
        }
        if step == 11 {
            mems[0] = gpu.alloc(counts[0] * 4).unwrap();
        }
        let before = rt.metrics.snapshot().graph_launches;
        for (t, (m, c)) in mems.iter().zip(counts).enumerate() {
            let vals: Vec<f64> = (0..c).map(|i| value(me, step, t, i)).collect();
            gpu.upload(&stream, &encode(DataType::F32, &vals), m.range())
                .unwrap();
        }
        stream.synchronize().unwrap();
        let handles: Vec<_> = mems
            .iter()
            .zip(counts)
            .enumerate()
            .map(|(t, (m, c))| {
                let mut spec = OpSpec::new(
                    OpKind::Allreduce,
                    vec![TensorSpec {
                        name: format!("graphs.{t}"),
                        dtype: DataType::F32,
                        shape: vec![c as i64],
                        input: InputMem::Device(m.range().first(c * 4).expect("allocated for it")),
                        output: OutputMem::InPlace,
                        splits: None,
                    }],
                );
                spec.device = gpu.ordinal;
                spec.reduce_op = ReduceOp::Sum;
                rt.enqueue(spec).unwrap()
            })
            .collect();
        for h in handles {
            h.wait(Some(Duration::from_secs(60))).unwrap();
            if let Some(ev) = h.event() {
                ev.synchronize().unwrap();
            }
            rt.handles.release(h.id).unwrap();
        }
        if step > 11 {
            replayed_after_moves += rt.metrics.snapshot().graph_launches - before;
        }
        for (t, (m, c)) in mems.iter().zip(counts).enumerate() {
            let mut got = vec![0u8; c * 4];
            gpu.download(&stream, m.range(), &mut got).unwrap();
            let got = decode(DataType::F32, &got);
            for (i, g) in got.iter().enumerate() {
                let want: f64 = (0..n).map(|r| value(r, step, t, i)).sum();
                assert_eq!(*g, want, "step {step}, tensor {t}, element {i}");
            }
        }
    }
    assert!(
        replayed_after_moves > 0,
        "no batch was replayed from a graph once the tensors stayed put"
    );
    finish_job();
}

/// The NVRTC kernels against host references: casts f32↔f16/bf16 bit for bit against `half`,
/// scaling of every dtype against the host path's scaling, and batched copies of many
/// misaligned ranges.
fn gpu_kernels() {
    use ferrovod::transport::cuda::Copy;
    init();
    let gpu = gpu::this_gpu();
    let s = gpu.new_stream().unwrap();
    let mut rng = Lcg(12345);
    let mut vals: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.0,
        65520.0,
        1e-8,
        6.1e-5,
        3.0e-8,
        1.0 / 3.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e30,
        -1e-30,
        f32::MAX,
        f32::MIN_POSITIVE,
    ];
    for _ in 0..4000 {
        // random bit patterns, NaNs aside
        let v = f32::from_bits(rng.next() as u32 ^ ((rng.next() as u32) << 16));
        if !v.is_nan() {
            vals.push(v);
        }
    }
    let n = vals.len();
    let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let d32 = gpu.alloc(n * 4).unwrap();
    let d16 = gpu.alloc(n * 2).unwrap();
    let back = gpu.alloc(n * 4).unwrap();
    gpu.upload(&s, &src, d32.range()).unwrap();
    for half_type in [DataType::F16, DataType::BF16] {
        gpu.cast(&s, d32.range(), DataType::F32, d16.range(), half_type, n)
            .unwrap();
        gpu.cast(&s, d16.range(), half_type, back.range(), DataType::F32, n)
            .unwrap();
        let mut h16 = vec![0u8; n * 2];
        let mut h32 = vec![0u8; n * 4];
        gpu.download(&s, d16.range(), &mut h16).unwrap();
        gpu.download(&s, back.range(), &mut h32).unwrap();
        for (i, v) in vals.iter().enumerate() {
            let got = u16::from_le_bytes([h16[2 * i], h16[2 * i + 1]]);
            let (want, wide) = match half_type {
                DataType::F16 => {
                    let h = half::f16::from_f32(*v);
                    (h.to_bits(), h.to_f32())
                }
                _ => {
                    let h = half::bf16::from_f32(*v);
                    (h.to_bits(), h.to_f32())
                }
            };
            assert_eq!(got, want, "{half_type} cast of {v:e} (element {i})");
            let w = f32::from_le_bytes(h32[4 * i..4 * i + 4].try_into().unwrap());
            assert_eq!(w.to_bits(), wide.to_bits(), "{half_type} widening of {v:e}");
        }
    }
    // scaling: every scalable dtype, against the host path's own scaling
    for dtype in DataType::ALL {
        if dtype == DataType::Bool {
            continue;
        }
        let count = 1000;
        let xs: Vec<f64> = (0..count)
            .map(|i| {
                let v = (i % 97) as f64
                    - if dtype.is_float() || !matches!(dtype, DataType::U8 | DataType::U16) {
                        48.0
                    } else {
                        0.0
                    };
                if dtype.is_float() { v * 1.37 } else { v }
            })
            .collect();
        let bytes = encode(dtype, &xs);
        let dev = gpu.alloc(bytes.len()).unwrap();
        let out = gpu.alloc(bytes.len()).unwrap();
        gpu.upload(&s, &bytes, dev.range()).unwrap();
        for factor in [0.37, 2.5, -1.25] {
            if factor < 0.0 && matches!(dtype, DataType::U8 | DataType::U16) {
                continue;
            }
            gpu.scale(&s, dev.range(), out.range(), count, dtype, factor)
                .unwrap();
            let mut got = vec![0u8; bytes.len()];
            gpu.download(&s, out.range(), &mut got).unwrap();
            let mut want = bytes.clone();
            ferrovod::collective::reduce::scale(&mut want, dtype, factor).unwrap();
            assert_eq!(
                decode(dtype, &got),
                decode(dtype, &want),
                "scale {dtype} by {factor}"
            );
        }
    }
    // batched copies: 300 ranges (several launches), odd lengths and misaligned offsets, some
    // over several 64 KiB slices
    let len = 8 << 20;
    let host_src: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let dsrc = gpu.alloc(len).unwrap();
    let ddst = gpu.alloc(len).unwrap();
    gpu.upload(&s, &host_src, dsrc.range()).unwrap();
    gpu.memset_zero(&s, ddst.range()).unwrap();
    let mut want = vec![0u8; len];
    let mut copies = Vec::new();
    let mut at = 0usize;
    for k in 0..300 {
        let n = if k % 50 == 0 {
            0
        } else if k % 37 == 0 {
            (rng.next() % (300 << 10)) as usize + (64 << 10)
        } else if k % 41 == 0 {
            128 << 10
        } else {
            (rng.next() % 3000) as usize + (k % 17)
        };
        let mut from = (rng.next() as usize) % (len - n);
        if k % 41 == 0 {
            // both ends 16-byte aligned: the kernel's wide path
            from -= from % 16;
            at = at.next_multiple_of(16);
        }
        if at + n > len {
            break;
        }
        want[at..at + n].copy_from_slice(&host_src[from..from + n]);
        copies.push(
            Copy::new(
                dsrc.range().sub(from, n).unwrap(),
                ddst.range().sub(at, n).unwrap(),
                n,
            )
            .unwrap(),
        );
        at += n + (k % 5);
    }
    gpu.copy_batch(&s, &copies).unwrap();
    let mut got = vec![0u8; len];
    gpu.download(&s, ddst.range(), &mut got).unwrap();
    let bad = got.iter().zip(&want).position(|(g, w)| g != w);
    assert!(bad.is_none(), "batched copy differs at byte {bad:?}");
    finish_job();
}
