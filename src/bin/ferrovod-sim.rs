//! ferrovod-sim: the scale model (`ferrovod::sim`) against the steps measured here, then what
//! it predicts at sizes no machine here has.
//!
//! ```text
//! target/release/ferrovod-sim calibrate        # the measured configurations, simulated
//! ```
//!
//! The gradient shape sets come from `../shared/data` (or `FERROVOD_DATA_DIR`).

use ferrovod::collective::cost::{Link, Policy};
use ferrovod::compress::{Codecs, Compression};
use ferrovod::sim::network::{Algorithm, Fabric, Topology};
use ferrovod::sim::step::{self, Gradient, Host, Job, Negotiation};

fn usage(msg: &str) -> ! {
    eprintln!("ferrovod-sim: {msg}\nusage: ferrovod-sim calibrate");
    std::process::exit(2)
}

/// A shape set, in backward order (the order its gradients are produced and submitted).
fn backward(file: &str) -> Vec<Gradient> {
    let candidates = [
        std::env::var("FERROVOD_DATA_DIR")
            .map(|d| format!("{d}/{file}"))
            .unwrap_or_default(),
        format!("../shared/data/{file}"),
        format!("{}/../shared/data/{file}", env!("CARGO_MANIFEST_DIR")),
    ];
    let path = candidates
        .into_iter()
        .find(|p| !p.is_empty() && std::path::Path::new(p).exists())
        .unwrap_or_else(|| usage(&format!("{file} not found; set FERROVOD_DATA_DIR")));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| usage(&format!("{path}: {e}")));
    let mut g = step::shapes(&text).unwrap_or_else(|e| usage(&format!("{path}: {e}")));
    g.reverse();
    g
}

/// 1 Gbit/s through the emulated hosts' token buckets, which meter whole frames: TCP/IP and
/// Ethernet headers add 1.047 × the payload at MTU 1500 (BENCHMARKS.md, the link's limits).
const GBIT_BETA: f64 = 8e-9 * 1.047;

/// The emulated hosts of this machine (`scripts/hosts/`): one link of 1 Gbit/s per host, and
/// the ranks of one host over MPI's shared memory, all on two cores.
fn emulated(nodes: usize, per_node: usize, pack: f64) -> Job {
    Job {
        topology: Topology { nodes, per_node },
        fabric: Fabric {
            inside: Link {
                alpha: 5e-6,
                beta: 1.0 / 3e9,
            },
            nic: Link {
                alpha: 60e-6,
                beta: GBIT_BETA,
            },
        },
        host: Host {
            submit: 2e-6,
            wake: 0.0,
            round: 30e-6,
            call: 50e-6,
            pack,
            codec: 0.0,
            lanes: 1,
        },
        negotiation: Negotiation::Online,
        threshold: 128 << 20,
        // across hosts every tensor is fused up to the threshold (`planner::direct_bytes`)
        direct_bytes: usize::MAX,
        codecs: Codecs::default(),
        policy: Policy::Flat,
        // one rank per host: the ring over point-to-point transfers; several: MPI's allreduce,
        // which the model takes for a ring too
        flat: Algorithm::Ring,
        on_gpu: false,
    }
}

/// One node of H200s over NVLink: the link as the measured one NCCL allreduce of the set's
/// bytes at this size paces it (a ring: 2 (p − 1)/p of the bytes in `one` seconds, less 2 (p −
/// 1) calls of `alpha`), two NCCL streams, kernels for the copies.
fn nvlink(ranks: usize, one: f64, bytes: f64, wake: f64) -> Job {
    let alpha = 2e-6;
    let steps = 2.0 * (ranks - 1) as f64;
    let beta = (one - steps * alpha) / (steps / ranks as f64 * bytes);
    let link = Link { alpha, beta };
    Job {
        topology: Topology {
            nodes: 1,
            per_node: ranks,
        },
        fabric: Fabric {
            inside: link,
            nic: link,
        },
        host: Host {
            submit: 1.0e-6,
            wake,
            round: 5e-6,
            call: 10e-6,
            pack: 0.0,
            codec: 0.0,
            lanes: 2,
        },
        negotiation: Negotiation::Online,
        threshold: 128 << 20,
        direct_bytes: usize::MAX,
        codecs: Codecs::default(),
        policy: Policy::Flat,
        flat: Algorithm::Ring,
        on_gpu: true,
    }
}

/// A measured configuration: what it is, the measured step (seconds), where the figure comes
/// from, and the job that models it.
struct Measured {
    name: &'static str,
    seconds: f64,
    source: &'static str,
    job: Job,
    /// Whether this row's figure set a parameter of the model (else the model predicts it).
    fits: Option<&'static str>,
}

/// The value of `f`'s parameter (in `lo..hi`, `f` growing with it) at which `f` gives `want`.
fn solve(want: f64, mut lo: f64, mut hi: f64, f: impl Fn(f64) -> f64) -> f64 {
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if f(mid) < want {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

fn calibrate() {
    let resnet = backward("resnet50_grads.tsv");
    let bytes: f64 = resnet.iter().map(|g| g.values() as f64 * 4.0).sum();
    let at_once = vec![0.0; resnet.len()];
    let end = |job: &Job| step::step(job, &resnet, &at_once).end;
    // emulated hosts: the per-byte cost of packing and unpacking the fused batch on the host
    // (two cores shared by the ranks and the emulated links) fitted to the 2 × 1 step
    let two_by_one = 0.9118;
    let pack = solve(two_by_one, 0.0, 1e-8, |p| end(&emulated(2, 1, p)));
    // GPUs: the delay before the first round (the loop's wake-up and the first launch)
    // fitted to the np 2 step, the link of each size from its one NCCL allreduce
    let (one2, one4) = (416.2e-6, 506.5e-6);
    let wake = solve(475.5e-6, 0.0, 400e-6, |w| end(&nvlink(2, one2, bytes, w)));
    let fp16 = |mut j: Job| {
        j.codecs = Codecs {
            setting: Compression::Fp16,
            ..Codecs::default()
        };
        j
    };
    let hierarchical = |mut j: Job| {
        j.policy = Policy::Hierarchical;
        j
    };
    let rows = [
        Measured {
            name: "hosts=2x1 1Gbit resnet50 none",
            seconds: two_by_one,
            source: "1.115 x 817.8 ms, 19c3413",
            job: emulated(2, 1, pack),
            fits: Some("host packing per byte"),
        },
        Measured {
            name: "hosts=4x1 1Gbit resnet50 none",
            seconds: 1.3401,
            source: "1340.1 ms, 130c73f",
            job: emulated(4, 1, pack),
            fits: None,
        },
        Measured {
            name: "hosts=2x2 1Gbit resnet50 hierarchical",
            seconds: 0.8855,
            source: "885.5 ms, d86af8f",
            job: hierarchical(emulated(2, 2, pack)),
            fits: None,
        },
        Measured {
            name: "hosts=2x1 1Gbit resnet50 fp16",
            seconds: 0.52 * two_by_one,
            source: "0.52 x the f32 step, 302be2b",
            job: fp16(emulated(2, 1, pack)),
            fits: None,
        },
        Measured {
            name: "gpu np=2 resnet50 (4 x H200)",
            seconds: 475.5e-6,
            source: "475.5 us, b4da6e8",
            job: nvlink(2, one2, bytes, wake),
            fits: Some("first round's delay"),
        },
        Measured {
            name: "gpu np=4 resnet50 (4 x H200)",
            seconds: 620.3e-6,
            source: "620.3 us, b4da6e8",
            job: nvlink(4, one4, bytes, wake),
            fits: None,
        },
    ];
    println!(
        "# the ResNet-50 gradient set ({} tensors, {:.1} MB), submitted at once in backward order",
        resnet.len(),
        bytes / 1e6
    );
    println!(
        "# fitted: host packing {:.3} ns/B, GPU first round's delay {:.1} us",
        pack * 1e9,
        wake * 1e6
    );
    println!(
        "| configuration | measured | simulated | simulated / measured | role | measured at |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    let mut worst: f64 = 0.0;
    for r in &rows {
        let s = step::step(&r.job, &resnet, &at_once);
        let ratio = s.end / r.seconds;
        if r.fits.is_none() {
            worst = worst.max((ratio - 1.0).abs());
        }
        let (m, sim, unit) = match r.seconds < 0.01 {
            true => (r.seconds * 1e6, s.end * 1e6, "us"),
            false => (r.seconds * 1e3, s.end * 1e3, "ms"),
        };
        println!(
            "| {} | {m:.1} {unit} | {sim:.1} {unit} | {ratio:.3} | {} | {} |",
            r.name,
            r.fits
                .map_or("predicted".to_string(), |f| format!("fits {f}")),
            r.source
        );
    }
    println!("calibration worst predicted error = {:.1} %", worst * 100.0);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("calibrate") => calibrate(),
        Some(other) => usage(&format!("unknown mode {other:?}")),
        None => usage("a mode is needed"),
    }
}
