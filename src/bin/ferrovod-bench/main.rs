//! ferrovod-bench: allreduce through ferrovod against raw `MPI_Allreduce` on the same buffers,
//! in the same run, printed nccl-tests style. Run under mpirun:
//!
//! ```text
//! mpirun -np 2 target/release/ferrovod-bench all       # sweep + resnet50
//! mpirun -np 2 target/release/ferrovod-bench sweep --min-bytes 1024 --max-bytes 67108864
//! mpirun -np 2 target/release/ferrovod-bench resnet50 --steps 30 --json
//! mpirun -np 8 --oversubscribe target/release/ferrovod-bench negotiation   # see negotiation.rs
//! ```
//!
//! MPI is initialised by the benchmark (as mpi4py would). The run is two rounds of raw MPI
//! followed by ferrovod (initialised, measured, shut down), so ferrovod's background thread never
//! disturbs the raw measurement; each side reports its better round.

mod decentralized;
mod gpu;
mod negotiation;

use std::time::{Duration, Instant};

use mpi::topology::Communicator;
use mpi::traits::*;

use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::transport::Transport;
use ferrovod::transport::mpi::MpiComm;
use ferrovod::{DataType, OpKind, ReduceOp};

struct Args {
    mode: String,
    min_bytes: usize,
    max_bytes: usize,
    iters: Option<usize>,
    warmup: usize,
    steps: usize,
    json: bool,
    floors: bool,
    data: Option<String>,
    backward_ms: f64,
    scale: usize,
    warmup_given: bool,
    /// decentralized: the modes to run (comma-separated; all when unset).
    modes: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        mode: "all".into(),
        min_bytes: 1024,
        max_bytes: 64 << 20,
        iters: None,
        warmup: 5,
        steps: 30,
        json: false,
        floors: false,
        data: None,
        backward_ms: 20.0,
        scale: 64,
        warmup_given: false,
        modes: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let num = |s: &str| -> usize {
        let (n, mult) = match s.chars().last() {
            Some('K') | Some('k') => (&s[..s.len() - 1], 1 << 10),
            Some('M') | Some('m') => (&s[..s.len() - 1], 1 << 20),
            Some('G') | Some('g') => (&s[..s.len() - 1], 1 << 30),
            _ => (s, 1),
        };
        n.parse::<usize>()
            .unwrap_or_else(|_| usage(&format!("not a number: {s}")))
            * mult
    };
    while i < argv.len() {
        let arg = argv[i].as_str();
        let mut value = || {
            i += 1;
            argv.get(i)
                .cloned()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        match arg {
            "sweep" | "resnet50" | "all" | "negotiation" | "gpu" | "cost-model"
            | "decentralized" => a.mode = arg.to_string(),
            "--min-bytes" => a.min_bytes = num(&value()),
            "--max-bytes" => a.max_bytes = num(&value()),
            "--iters" => a.iters = Some(num(&value())),
            "--warmup" => {
                a.warmup = num(&value());
                a.warmup_given = true;
            }
            "--backward-ms" => {
                let v = value();
                a.backward_ms = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("not a number: {v}")));
            }
            "--scale" => a.scale = num(&value()).max(1),
            "--steps" => a.steps = num(&value()),
            "--data" => a.data = Some(value()),
            "--modes" => a.modes = Some(value()),
            "--json" => a.json = true,
            "--floors" => a.floors = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
        i += 1;
    }
    a
}

fn usage(err: &str) -> ! {
    if !err.is_empty() {
        eprintln!("ferrovod-bench: {err}");
    }
    eprintln!(
        "usage: mpirun -np N ferrovod-bench [all|sweep|resnet50|negotiation|gpu|cost-model|decentralized] [--min-bytes 1K] [--max-bytes 64M] [--iters N] [--warmup N] [--steps N] [--data resnet50_grads.tsv] [--backward-ms 20] [--scale 64] [--json] [--floors (gpu)] [--modes allreduce,gossip,gossip-fp16,multistep4 (decentralized)]"
    );
    std::process::exit(2)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Current and peak resident memory of this process, in bytes.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Enqueues an in-place float32 allreduce (sum) of `data` (moved in) named `name`.
fn enqueue_f32(name: &str, data: Vec<u8>) -> std::sync::Arc<runtime::handle::Handle> {
    let shape = vec![(data.len() / 4) as i64];
    enqueue_shaped(name, shape, data)
}

/// `enqueue_f32` of a tensor of `shape` (codecs such as PowerSGD read it).
fn enqueue_shaped(
    name: &str,
    shape: Vec<i64>,
    data: Vec<u8>,
) -> std::sync::Arc<runtime::handle::Handle> {
    let spec = OpSpec::new(
        OpKind::Allreduce,
        vec![TensorSpec {
            name: name.to_string(),
            shape,
            dtype: DataType::F32,
            input: InputMem::Owned(data),
            output: OutputMem::InPlace,
            splits: None,
        }],
    );
    runtime::runtime().unwrap().enqueue(spec).unwrap()
}

/// Waits for `h` and hands its buffer back.
fn take_f32(h: std::sync::Arc<runtime::handle::Handle>) -> Vec<u8> {
    h.wait(None).unwrap();
    let out = h.take_output(0).unwrap();
    runtime::runtime().unwrap().handles.release(h.id).unwrap();
    out
}

/// One ferrovod allreduce of `data` (moved in, handed back), timed.
fn ferrovod_allreduce(name: &str, data: Vec<u8>) -> (Vec<u8>, f64) {
    let t = Instant::now();
    let out = take_f32(enqueue_f32(name, data));
    (out, t.elapsed().as_secs_f64())
}

fn ferrovod_barrier() {
    let rt = runtime::runtime().unwrap();
    let h = rt.enqueue(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    h.wait(None).unwrap();
    rt.handles.release(h.id).unwrap();
}

struct Row {
    bytes: usize,
    fv: f64,
    mpi: f64,
}

fn sizes(a: &Args) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes.max(4);
    while s <= a.max_bytes {
        v.push(s);
        s *= 4;
    }
    v
}

fn iters_for(a: &Args, bytes: usize) -> usize {
    a.iters
        .unwrap_or_else(|| (256usize << 20).div_ceil(bytes).clamp(10, 200))
}

/// One raw in-place `MPI_Allreduce` (sum, float32) of `buf`, timed: through ferrovod's MPI
/// transport, which is a direct call of `MPI_Allreduce(MPI_IN_PLACE, ...)`.
fn mpi_allreduce(comm: &MpiComm, buf: &mut [u8]) -> f64 {
    let t = Instant::now();
    comm.allreduce(None, buf, DataType::F32, ReduceOp::Sum)
        .expect("MPI_Allreduce");
    t.elapsed().as_secs_f64()
}

fn f32_bytes(n: usize, modulo: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((i % modulo) as f32).to_le_bytes())
        .collect()
}

fn sweep_mpi(comm: &MpiComm, a: &Args) -> Vec<f64> {
    sizes(a)
        .into_iter()
        .map(|bytes| {
            let n = bytes / 4;
            let ones = f32_bytes(n, 13);
            let mut buf = ones.clone();
            let mut times = Vec::new();
            comm.barrier().unwrap();
            for it in 0..a.warmup + iters_for(a, bytes) {
                buf.copy_from_slice(&ones);
                let secs = mpi_allreduce(comm, &mut buf);
                if it >= a.warmup {
                    times.push(secs);
                }
            }
            let v = f32::from_le_bytes(buf[4..8].try_into().unwrap());
            assert_eq!(v, comm.size() as f32, "raw MPI sum");
            median(times)
        })
        .collect()
}

fn sweep_ferrovod(a: &Args, size: usize) -> Vec<f64> {
    sizes(a)
        .into_iter()
        .map(|bytes| {
            let n = bytes / 4;
            let ones: Vec<u8> = (0..n)
                .flat_map(|i| ((i % 13) as f32).to_le_bytes())
                .collect();
            let mut buf = ones.clone();
            let mut times = Vec::new();
            ferrovod_barrier();
            for it in 0..a.warmup + iters_for(a, bytes) {
                buf.copy_from_slice(&ones);
                let (out, secs) = ferrovod_allreduce(&format!("sweep.{bytes}"), buf);
                buf = out;
                if it >= a.warmup {
                    times.push(secs);
                }
            }
            let v = f32::from_le_bytes(buf[4..8].try_into().unwrap());
            assert_eq!(v, size as f32, "ferrovod sum");
            median(times)
        })
        .collect()
}

fn print_sweep(rows: &[Row], size: usize, json: bool) {
    let bus = 2.0 * (size as f64 - 1.0) / size as f64;
    println!("#");
    println!("# ferrovod-bench sweep: allreduce (sum), float32, np={size}; median time per call");
    println!(
        "# ferrovod: one named tensor through the runtime (negotiation + collective); mpi: in-place MPI_Allreduce on the same bytes (better of two rounds each)"
    );
    println!("#");
    println!(
        "# {:>12} {:>12} {:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>8}",
        "size(B)",
        "count",
        "type",
        "fv(us)",
        "algbw",
        "busbw",
        "mpi(us)",
        "algbw",
        "busbw",
        "fv/mpi"
    );
    for r in rows {
        let gb = |t: f64| r.bytes as f64 / t / 1e9;
        println!(
            "  {:>12} {:>12} {:>8} | {:>10.1} {:>8.2} {:>8.2} | {:>10.1} {:>8.2} {:>8.2} | {:>8.2}",
            r.bytes,
            r.bytes / 4,
            "float",
            r.fv * 1e6,
            gb(r.fv),
            gb(r.fv) * bus,
            r.mpi * 1e6,
            gb(r.mpi),
            gb(r.mpi) * bus,
            r.fv / r.mpi
        );
    }
    if json {
        for r in rows {
            let gb = |t: f64| r.bytes as f64 / t / 1e9;
            println!(
                "{{\"bench\":\"sweep\",\"np\":{size},\"bytes\":{},\"count\":{},\"dtype\":\"float32\",\"ferrovod_us\":{:.3},\"ferrovod_algbw_gbs\":{:.4},\"ferrovod_busbw_gbs\":{:.4},\"mpi_us\":{:.3},\"mpi_algbw_gbs\":{:.4},\"mpi_busbw_gbs\":{:.4},\"ratio\":{:.4}}}",
                r.bytes,
                r.bytes / 4,
                r.fv * 1e6,
                gb(r.fv),
                gb(r.fv) * bus,
                r.mpi * 1e6,
                gb(r.mpi),
                gb(r.mpi) * bus,
                r.fv / r.mpi
            );
        }
    }
}

fn find_data(a: &Args) -> String {
    match &a.data {
        Some(p) => p.clone(),
        None => find_data_file("resnet50_grads.tsv"),
    }
}

/// A gradient shape set from `../shared/data` (or `FERROVOD_DATA_DIR`).
fn find_data_file(file: &str) -> String {
    let candidates = [
        std::env::var("FERROVOD_DATA_DIR")
            .map(|d| format!("{d}/{file}"))
            .unwrap_or_default(),
        format!("../shared/data/{file}"),
        format!("shared/data/{file}"),
        format!("{}/../shared/data/{file}", env!("CARGO_MANIFEST_DIR")),
    ];
    candidates
        .into_iter()
        .find(|p| !p.is_empty() && std::path::Path::new(p).exists())
        .unwrap_or_else(|| usage(&format!("{file} not found; set FERROVOD_DATA_DIR")))
}

/// (name, element count) in forward order.
fn load_grads(path: &str) -> Vec<(String, usize)> {
    counts(&load_shapes(path))
}

/// (name, element count) of each (name, shape).
fn counts(shapes: &[(String, Vec<i64>)]) -> Vec<(String, usize)> {
    (shapes.iter())
        .map(|(name, shape)| (name.clone(), shape.iter().product::<i64>() as usize))
        .collect()
}

/// (name, shape) in forward order.
fn load_shapes(path: &str) -> Vec<(String, Vec<i64>)> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| usage(&format!("{path}: {e}")))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut parts = l.split('\t');
            let name = parts.next().unwrap().to_string();
            let shape = parts
                .next()
                .unwrap_or("1")
                .split('x')
                .map(|d| d.trim().parse::<i64>().unwrap())
                .collect();
            (name, shape)
        })
        .collect()
}

struct Resnet {
    fv_steps: Vec<f64>,
    mpi_steps: Vec<f64>,
    /// Raw MPI, one in-place MPI_Allreduce per gradient in backward order: the best a script
    /// could do by hand without fusion or negotiation.
    mpi_each_steps: Vec<f64>,
    rss_after_warmup: u64,
    rss_end: u64,
}

fn resnet_mpi(comm: &MpiComm, a: &Args, total: usize) -> Vec<f64> {
    let mut buf = f32_bytes(total, 7);
    let mut times = Vec::new();
    comm.barrier().unwrap();
    for step in 0..a.warmup + a.steps {
        let secs = mpi_allreduce(comm, &mut buf);
        if step >= a.warmup {
            times.push(secs);
        }
    }
    times
}

fn resnet_mpi_each(comm: &MpiComm, a: &Args, grads: &[(String, usize)]) -> Vec<f64> {
    let mut bufs: Vec<Vec<u8>> = grads.iter().map(|(_, n)| f32_bytes(*n, 7)).collect();
    let mut times = Vec::new();
    comm.barrier().unwrap();
    for step in 0..a.warmup + a.steps {
        let t = Instant::now();
        for b in bufs.iter_mut().rev() {
            comm.allreduce(None, b, DataType::F32, ReduceOp::Sum)
                .expect("MPI_Allreduce");
        }
        if step >= a.warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times
}

/// The gradient set through the runtime, each tensor of its own shape (`shapes`, as
/// `load_shapes`), `warmup` + `steps` steps.
/// Each gradient's value at index i: 0..6 repeating, which every codec but top-k carries at
/// the speed of any other values. Top-k's selection works in proportion to how many values tie
/// with its k-th largest, a seventh of each tensor here; for it the values spread as real
/// gradients do (a hash of the index over (-3, 3), the value at index 1 kept at 1 for the
/// check).
fn gradient_values(codec: &str) -> fn(usize) -> f32 {
    if codec == "topk" {
        |i| {
            if i == 1 {
                return 1.0;
            }
            let h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (h as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        }
    } else {
        |i| (i % 7) as f32
    }
}

fn resnet_ferrovod(
    a: &Args,
    grads: &[(String, usize)],
    shapes: &[(String, Vec<i64>)],
    size: usize,
) -> Resnet {
    // gradient buffers, reused every step (moved into the runtime and handed back)
    let codec = std::env::var("FERROVOD_COMPRESSION").unwrap_or_default();
    let value = gradient_values(codec.trim());
    let mut bufs: Vec<Option<Vec<u8>>> = grads
        .iter()
        .map(|(_, n)| Some((0..*n).flat_map(|i| value(i).to_le_bytes()).collect()))
        .collect();
    let mut times = Vec::new();
    let mut rss_after_warmup = 0;
    ferrovod_barrier();
    for step in 0..a.warmup + a.steps {
        if step == a.warmup {
            rss_after_warmup = memory().0;
        }
        let t = Instant::now();
        let mut handles = Vec::with_capacity(grads.len());
        // backward order: the last layer's gradient is ready first
        for (k, (name, _)) in grads.iter().enumerate().rev() {
            let data = bufs[k].take().unwrap();
            handles.push((k, enqueue_shaped(name, shapes[k].1.clone(), data)));
        }
        for (k, h) in handles {
            bufs[k] = Some(take_f32(h));
        }
        let secs = t.elapsed().as_secs_f64();
        if step >= a.warmup {
            times.push(secs);
        }
        // values are sums of sums: reset a sample to keep them finite and check one element
        let b = bufs[0].as_mut().unwrap();
        let v = f32::from_le_bytes(b[4..8].try_into().unwrap());
        // 8-bit blocks of values 0..6: within half a step of each rank's range and of the sum's,
        // twice that with error feedback; the other codecs carry small integers exactly
        let tol = match codec.trim() {
            "u8" => 4.0 * 6.0 * size as f32 / 510.0,
            // PowerSGD's low-rank approximation of the first layer's gradient (its values 0..6
            // repeat with period 7 along each row), top-k's largest values of it: only the
            // scale is checked
            "powersgd" | "topk" => 6.0 * size as f32,
            _ => 0.0,
        };
        assert!(
            (v - size as f32).abs() <= tol,
            "resnet50 allreduce result: {v}, want {size}"
        );
        for (k, (_, n)) in grads.iter().enumerate() {
            let b = bufs[k].as_mut().unwrap();
            for (i, c) in b.chunks_exact_mut(4).enumerate().take(*n) {
                c.copy_from_slice(&value(i).to_le_bytes());
            }
        }
    }
    Resnet {
        fv_steps: times,
        mpi_steps: Vec::new(),
        mpi_each_steps: Vec::new(),
        rss_after_warmup,
        rss_end: memory().0,
    }
}

/// `ferrovod-bench cost-model`: what the allreduce cost model (`collective::cost`) predicts for
/// large clusters of 8-GPU nodes — predictions, not measurements. Inside a node: 3 us and
/// 150 GB/s (NVLink-class); across nodes: 10 us and the network's rate.
fn cost_model_table() {
    use ferrovod::collective::cost::{CostModel, Link};
    let sizes = [
        ("ResNet-50 gradients", 102_228_128usize),
        ("1 GiB", 1 << 30),
    ];
    println!(
        "# predicted by collective::cost (not measured): 8 ranks per node; inside a node 3 us + 150 GB/s, across nodes 10 us + the network's rate"
    );
    println!(
        "| nodes | network | batch | flat (ms) | hierarchical (ms) | hierarchical / flat | crossover (bytes) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for nodes in [16usize, 128, 1024] {
        for gbit in [100.0f64, 200.0, 400.0] {
            let m = CostModel::from_messages(
                Link {
                    alpha: 3e-6,
                    beta: 1.0 / 150e9,
                },
                Link {
                    alpha: 10e-6,
                    beta: 8.0 / (gbit * 1e9),
                },
                8,
                nodes,
            );
            for (name, bytes) in sizes {
                let (f, h) = (m.flat(bytes), m.hierarchical(bytes));
                let cross = m.crossover().map_or("never".to_string(), |b| b.to_string());
                println!(
                    "| {nodes} | {gbit:.0} Gbit/s | {name} | {:.2} | {:.2} | {:.2} | {cross} |",
                    f * 1e3,
                    h * 1e3,
                    h / f
                );
            }
        }
    }
}

/// Finalises MPI when the benchmark ends, whichever way `main` returns.
struct Finalize;

impl Drop for Finalize {
    fn drop(&mut self) {
        ferrovod::transport::mpi::finalize_mpi();
    }
}

fn main() {
    let a = parse_args();
    if a.mode == "cost-model" {
        cost_model_table();
        return;
    }
    // MPI starts as ferrovod starts it (its transport settings included), so that the MPI
    // baselines run over the same transport; it is finalised when main returns
    let (_, multiple) =
        ferrovod::transport::mpi::init_mpi(true).expect("MPI initialisation failed");
    let _finalize = Finalize;
    if !multiple {
        eprintln!("warning: MPI does not provide MPI_THREAD_MULTIPLE");
    }
    let world = mpi::topology::SimpleCommunicator::world();
    if a.mode == "negotiation" {
        let opts = negotiation::Options {
            steps: a.steps,
            // offline mode learns its plan in FERROVOD_PLAN_WARMUP_STEPS (5) agreeing steps
            warmup: if a.warmup_given { a.warmup } else { 10 },
            backward_ms: a.backward_ms,
            scale: a.scale,
            json: a.json,
        };
        negotiation::run(&opts, |file| load_grads(&find_data_file(file)));
        return;
    }
    if a.mode == "decentralized" {
        let warmup = if a.warmup_given { a.warmup } else { 2 };
        decentralized::run(
            &load_grads(&find_data(&a)),
            warmup,
            a.steps,
            a.modes.as_deref(),
        );
        return;
    }
    if a.mode == "gpu" {
        let opts = gpu::Options {
            min_bytes: if a.min_bytes == 1024 {
                1 << 20
            } else {
                a.min_bytes
            },
            max_bytes: if a.max_bytes == 64 << 20 {
                1 << 30
            } else {
                a.max_bytes
            },
            reps: a.iters.unwrap_or(5),
            floors: a.floors,
        };
        gpu::run(&opts, &load_grads(&find_data(&a)));
        return;
    }
    let me = world.rank();
    let size = world.size() as usize;
    let do_sweep = a.mode == "all" || a.mode == "sweep";
    let do_resnet = a.mode == "all" || a.mode == "resnet50";
    let shapes = if do_resnet {
        load_shapes(&find_data(&a))
    } else {
        Vec::new()
    };
    let grads = counts(&shapes);
    let total: usize = grads.iter().map(|(_, n)| n).sum();

    // Two rounds of (raw MPI, then ferrovod on the same MPI). Raw MPI never runs while
    // ferrovod's background thread exists. Each side keeps its better round, so machine noise
    // favours neither.
    let raw = MpiComm::world().expect("MPI_Comm_dup");
    let mut mpi_sweep: Vec<f64> = Vec::new();
    let mut fv_sweep: Vec<f64> = Vec::new();
    let mut resnet: Option<Resnet> = None;
    let mut rss_before_init = 0;
    let better = |old: &mut Vec<f64>, new: Vec<f64>| {
        if old.is_empty() {
            *old = new;
        } else {
            old.iter_mut().zip(new).for_each(|(o, n)| *o = o.min(n));
        }
    };
    for _round in 0..2 {
        if do_sweep {
            better(&mut mpi_sweep, sweep_mpi(&raw, &a));
        }
        let mpi_each_steps = if do_resnet {
            resnet_mpi_each(&raw, &a, &grads)
        } else {
            Vec::new()
        };
        let mpi_steps = if do_resnet {
            resnet_mpi(&raw, &a, total)
        } else {
            Vec::new()
        };
        rss_before_init = memory().0;
        runtime::init(Default::default()).expect("ferrovod init");
        if do_sweep {
            better(&mut fv_sweep, sweep_ferrovod(&a, size));
        }
        if do_resnet {
            let mut r = resnet_ferrovod(&a, &grads, &shapes, size);
            r.mpi_steps = mpi_steps;
            r.mpi_each_steps = mpi_each_steps;
            resnet = Some(match resnet.take() {
                None => r,
                Some(mut old) => {
                    if median(r.fv_steps.clone()) < median(old.fv_steps.clone()) {
                        old.fv_steps = r.fv_steps;
                    }
                    if median(r.mpi_steps.clone()) < median(old.mpi_steps.clone()) {
                        old.mpi_steps = r.mpi_steps;
                    }
                    if median(r.mpi_each_steps.clone()) < median(old.mpi_each_steps.clone()) {
                        old.mpi_each_steps = r.mpi_each_steps;
                    }
                    old.rss_after_warmup = r.rss_after_warmup;
                    old.rss_end = r.rss_end;
                    old
                }
            });
        }
        ferrovod_barrier();
        runtime::shutdown();
    }
    std::thread::sleep(Duration::from_millis(10));
    let (_, peak) = memory();
    let peaks = {
        let mut all = vec![0u64; size];
        world.all_gather_into(&peak, &mut all[..]);
        all
    };
    if me != 0 {
        return;
    }
    let cfg = ferrovod::config::Config::from_env();
    println!(
        "# ferrovod {} | np={size} | cycle {:?} | fusion threshold {} B | direct >= {} | cache {}",
        ferrovod::VERSION,
        cfg.cycle_time,
        cfg.fusion_threshold,
        cfg.fusion_direct_bytes.map_or(
            "64 KiB inside a node, fused across nodes".to_string(),
            |b| format!("{b} B")
        ),
        cfg.cache_capacity
    );
    if do_sweep {
        let rows: Vec<Row> = sizes(&a)
            .into_iter()
            .zip(fv_sweep.iter().zip(&mpi_sweep))
            .map(|(bytes, (fv, mpi))| Row {
                bytes,
                fv: *fv,
                mpi: *mpi,
            })
            .collect();
        print_sweep(&rows, size, a.json);
    }
    if let Some(r) = resnet {
        let fv = median(r.fv_steps.clone());
        let mpi = median(r.mpi_steps.clone());
        let bytes = total * 4;
        let bus = 2.0 * (size as f64 - 1.0) / size as f64;
        println!("#");
        println!(
            "# resnet50: {} gradient tensors, {total} float32 values ({:.1} MiB) per step, submitted in backward order; mpi: one in-place MPI_Allreduce of the same bytes (better of two rounds each)",
            grads.len(),
            bytes as f64 / (1 << 20) as f64
        );
        println!(
            "# {:>10} {:>12} {:>10} {:>10} {:>10}",
            "engine", "step(ms)", "min(ms)", "algbw", "busbw"
        );
        for (engine, steps) in [
            ("ferrovod", &r.fv_steps),
            ("mpi", &r.mpi_steps),
            ("mpi-each", &r.mpi_each_steps),
        ] {
            let m = median(steps.clone());
            let mn = steps.iter().cloned().fold(f64::MAX, f64::min);
            let gb = bytes as f64 / m / 1e9;
            println!(
                "  {engine:>10} {:>12.2} {:>10.2} {:>10.2} {:>10.2}",
                m * 1e3,
                mn * 1e3,
                gb,
                gb * bus
            );
        }
        println!(
            "# ferrovod steps (ms, the better round): {}",
            r.fv_steps
                .iter()
                .map(|t| format!("{:.1}", t * 1e3))
                .collect::<Vec<_>>()
                .join(" ")
        );
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "# memory (rank 0): RSS before ferrovod init {:.1} MiB, after {} warm-up steps {:.1} MiB, after {} more steps {:.1} MiB (growth {:+.1} MiB)",
            mib(rss_before_init),
            a.warmup,
            mib(r.rss_after_warmup),
            a.steps,
            mib(r.rss_end),
            mib(r.rss_end) - mib(r.rss_after_warmup)
        );
        println!(
            "# peak RSS per rank (MiB, includes the benchmark's own {:.1} MiB of gradients and MPI's buffers): {}",
            mib(bytes as u64 * 2),
            peaks
                .iter()
                .map(|p| format!("{:.1}", mib(*p)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        if a.json {
            println!(
                "{{\"bench\":\"resnet50\",\"np\":{size},\"tensors\":{},\"bytes\":{bytes},\"ferrovod_step_ms\":{:.4},\"mpi_step_ms\":{:.4},\"mpi_each_step_ms\":{:.4},\"ratio\":{:.4},\"rss_growth_bytes\":{},\"peak_rss_bytes\":[{}]}}",
                grads.len(),
                fv * 1e3,
                mpi * 1e3,
                median(r.mpi_each_steps.clone()) * 1e3,
                fv / mpi,
                r.rss_end as i64 - r.rss_after_warmup as i64,
                peaks
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        let each = median(r.mpi_each_steps.clone());
        println!(
            "# mpi-each: one in-place MPI_Allreduce per gradient, backward order, no negotiation: ferrovod/mpi-each = {:.2}",
            fv / each
        );
        println!("resnet50: ferrovod/mpi = {:.2}", fv / mpi);
    }
}
