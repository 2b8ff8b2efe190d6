//! ferrovod-sim: the scale model (`ferrovod::sim`) against the steps measured here, then what
//! it predicts at sizes no machine here has.
//!
//! ```text
//! target/release/ferrovod-sim calibrate        # the measured configurations, simulated
//! target/release/ferrovod-sim predict [--json] # 8 to 10,240 GPUs, 8 a node
//! ```
//!
//! The gradient shape sets come from `../shared/data` (or `FERROVOD_DATA_DIR`).

use ferrovod::collective::cost::{CostModel, Link, Policy};
use ferrovod::collective::gossip;
use ferrovod::compress::{Codecs, Compression};
use ferrovod::config::Config;
use ferrovod::sim::network::{Algorithm, Fabric, Topology};
use ferrovod::sim::step::{self, Gradient, Host, Job, Negotiation};

fn usage(msg: &str) -> ! {
    eprintln!("ferrovod-sim: {msg}\nusage: ferrovod-sim calibrate|predict");
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
/// Across hosts tensors under 16 MiB are fused up to the threshold (`planner::direct_bytes`);
/// with one rank per host flat allreduces run the ring over point-to-point transfers, with
/// several MPI's allreduce, which the model takes for a ring too (`Job::new`'s defaults).
fn emulated(nodes: usize, per_node: usize, pack: f64) -> Job {
    let fabric = Fabric {
        inside: Link {
            alpha: 5e-6,
            beta: 1.0 / 3e9,
        },
        nic: Link {
            alpha: 60e-6,
            beta: GBIT_BETA,
        },
    };
    let host = Host {
        submit: 2e-6,
        wake: 0.0,
        round: 30e-6,
        call: 50e-6,
        pack,
        codec: 0.0,
        lanes: 1,
    };
    Job::new(Topology { nodes, per_node }, fabric, host, false)
}

/// One node of H200s over NVLink: the link as the measured one NCCL allreduce of the set's
/// bytes at this size paces it (a ring: 2 (p − 1)/p of the bytes in `one` seconds, less 2 (p −
/// 1) calls of `alpha`), two NCCL streams, kernels for the copies.
fn nvlink(ranks: usize, one: f64, bytes: f64, wake: f64) -> Job {
    let alpha = 2e-6;
    let steps = 2.0 * (ranks - 1) as f64;
    let beta = (one - steps * alpha) / (steps / ranks as f64 * bytes);
    let link = Link { alpha, beta };
    let topology = Topology {
        nodes: 1,
        per_node: ranks,
    };
    let fabric = Fabric {
        inside: link,
        nic: link,
    };
    let host = Host {
        submit: 1.0e-6,
        wake,
        round: 5e-6,
        call: 10e-6,
        pack: 0.0,
        codec: 0.0,
        lanes: 2,
    };
    // flat GPU allreduces are NCCL's own (its ring inside one node)
    Job {
        flat: Algorithm::Nccl,
        ..Job::new(topology, fabric, host, true)
    }
}

/// Measured on 4 × H200 (BENCHMARKS.md, b4da6e8): one NCCL allreduce of the ResNet-50 set at
/// np 2 and np 4, and ferrovod's step of the set at np 2.
const NP2_ONE_ALLREDUCE: f64 = 416.2e-6;
const NP4_ONE_ALLREDUCE: f64 = 506.5e-6;
const NP2_STEP: f64 = 475.5e-6;

/// The ResNet-50 set in backward order, and its bytes.
fn resnet() -> (Vec<Gradient>, f64) {
    let g = backward("resnet50_grads.tsv");
    let bytes = g.iter().map(|g| g.values() as f64 * 4.0).sum();
    (g, bytes)
}

/// The GPU's delay before the first round, fitted to ferrovod's measured np 2 step of the set
/// submitted at once.
fn first_round_delay(resnet: &[Gradient], bytes: f64) -> f64 {
    let at_once = vec![0.0; resnet.len()];
    solve(NP2_STEP, 0.0, 400e-6, |w| {
        step::step(&nvlink(2, NP2_ONE_ALLREDUCE, bytes, w), resnet, &at_once).end
    })
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
    let (resnet, bytes) = resnet();
    let at_once = vec![0.0; resnet.len()];
    let end = |job: &Job| step::step(job, &resnet, &at_once).end;
    // emulated hosts: the per-byte cost of packing and unpacking the fused batch on the host
    // (two cores shared by the ranks and the emulated links) fitted to the 2 × 1 step
    let two_by_one = 0.9118;
    let pack = solve(two_by_one, 0.0, 1e-8, |p| end(&emulated(2, 1, p)));
    // GPUs: the delay before the first round (the loop's wake-up and the first launch)
    // fitted to the np 2 step, the link of each size from its one NCCL allreduce
    let (one2, one4) = (NP2_ONE_ALLREDUCE, NP4_ONE_ALLREDUCE);
    let wake = first_round_delay(&resnet, bytes);
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
    let mut training = Vec::new();
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
            seconds: NP2_STEP,
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
    // training at np 4: the model alone's step, measured, as the compute
    let bert = backward("bert_base_grads.tsv");
    for (name, grads, alone, measured, source) in [
        (
            "gpu np=4 resnet50-train fp32 ferrovod/no-comm",
            &resnet,
            RESNET_STEP,
            0.981,
            "0.981, b4da6e8",
        ),
        (
            "gpu np=4 bert-base-train fp32 ferrovod/no-comm",
            &bert,
            BERT_STEP,
            0.976,
            "0.976, b4da6e8",
        ),
    ] {
        let job = nvlink(4, one4, bytes, wake);
        let e = efficiency(&job, grads, alone);
        training.push((name, measured, e, source));
    }
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
    for (name, measured, simulated, source) in &training {
        let ratio = simulated / measured;
        worst = worst.max((ratio - 1.0).abs());
        println!(
            "| {name} | {measured:.3} | {simulated:.3} | {ratio:.3} | predicted (the model alone's step measured) | {source} |"
        );
    }
    println!("calibration worst predicted error = {:.1} %", worst * 100.0);
}

/// The model alone's step on one H200, batch 64 (ResNet-50) and 32 (BERT-base, sequence 128),
/// fp32: 7710.4 images/s and 1800.3 sequences/s over 4 GPUs (BENCHMARKS.md, b4da6e8).
const RESNET_STEP: f64 = 64.0 * 4.0 / 7710.4;
const BERT_STEP: f64 = 32.0 * 4.0 / 1800.3;

/// A kernel's least time in the backward pass, per gradient.
const PER_TENSOR: f64 = 20e-6;

/// The simulated step of a training job whose model alone takes `alone` seconds a step (a
/// third forward, two thirds backward), and the model alone's share of it (the scaling
/// efficiency against one GPU).
fn training_step(job: &Job, grads: &[Gradient], alone: f64) -> (f64, step::Step) {
    let ready = step::ready_times(grads, alone / 3.0, 2.0 * alone / 3.0, PER_TENSOR);
    let s = step::step(job, grads, &ready);
    (s.end.max(alone), s)
}

fn efficiency(job: &Job, grads: &[Gradient], alone: f64) -> f64 {
    alone / training_step(job, grads, alone).0
}

/// A node of 8 H200s over NVLink (the link of the np 4 calibration) with one NIC of `gbit`
/// Gbit/s (NCCL's network: 10 us a message, 1.05 x the bytes on the wire).
fn cluster(nodes: usize, gbit: f64, bytes: f64, wake: f64) -> Job {
    let node = nvlink(4, NP4_ONE_ALLREDUCE, bytes, wake);
    let topology = Topology { nodes, per_node: 8 };
    let fabric = Fabric {
        inside: node.fabric.inside,
        nic: Link {
            alpha: 10e-6,
            beta: 8e-9 / gbit * 1.05,
        },
    };
    // the library's settings for this placement; flat (NCCL's allreduce) unless a mode says
    // otherwise
    Job {
        flat: Algorithm::Nccl,
        policy: Policy::Flat,
        ..Job::new(topology, fabric, node.host, true)
    }
}

/// Rounds of gossip's schedule a gossip step is averaged over.
const GOSSIP_ROUNDS: u64 = 40;

/// Gossip's training step, averaged over `GOSSIP_ROUNDS` rounds of the library's schedule
/// (every tensor of a step is in the same round): every `FERROVOD_GOSSIP_SYNC_EVERY`-th round
/// (by default) is an exact average, run as the hierarchical allreduce; each other round is an
/// exchange with the round's peer (`gossip::peer`).
fn gossip_step(job: &Job, grads: &[Gradient], alone: f64) -> f64 {
    let every = Config::from_lookup(&|_| None).gossip_sync_every;
    let total: f64 = (0..GOSSIP_ROUNDS)
        .map(|round| {
            let mut j = *job;
            if gossip::syncs(round, every) {
                // the exact average: the set's flat allreduce (NCCL's), as `gossip::mix` runs it
                (j.flat, j.policy) = (Algorithm::Nccl, Policy::Flat);
            } else {
                j.flat = Algorithm::Exchange(round);
            }
            training_step(&j, grads, alone).0
        })
        .sum();
    total / GOSSIP_ROUNDS as f64
}

/// A mode of the prediction tables: its name and how it sets the job up.
type Mode = (&'static str, fn(Job) -> Job);

/// The modes of the prediction tables.
fn modes() -> Vec<Mode> {
    vec![
        ("flat", |j| j),
        ("hierarchical", |mut j| {
            j.policy = Policy::Hierarchical;
            j
        }),
        ("auto", |mut j| {
            let t = j.topology;
            let model =
                CostModel::from_messages(j.fabric.inside, j.fabric.nic, t.per_node, t.nodes);
            j.policy = Policy::Auto(model);
            j
        }),
        ("hier+halving", |mut j| {
            j.policy = Policy::Hierarchical;
            j.hierarchical = Algorithm::HierarchicalHalving;
            j
        }),
        ("fp16", |mut j| {
            j.policy = Policy::Hierarchical;
            j.codecs = Codecs {
                setting: Compression::Fp16,
                ..Codecs::default()
            };
            j
        }),
        ("u8", |mut j| {
            // flat on GPUs (`plan::choose`): its blocks cannot be summed on the way, so it
            // runs ferrovod's own reduce-scatter and allgather (a ring), not NCCL's allreduce
            j.flat = Algorithm::Ring;
            j.codecs = Codecs {
                setting: Compression::U8,
                ..Codecs::default()
            };
            j
        }),
        // each round's exchange in `gossip_step`
        ("gossip", |mut j| {
            j.flat = Algorithm::Exchange(0);
            j
        }),
        ("multistep4", |mut j| {
            j.policy = Policy::Hierarchical;
            j
        }),
        ("offline", |mut j| {
            j.policy = Policy::Hierarchical;
            j.negotiation = Negotiation::Offline;
            j
        }),
    ]
}

/// `json`: also one JSON object per cell, after the tables (`benchmarks/results/`).
fn predict(json: bool) {
    let mut rows: Vec<String> = Vec::new();
    let (resnet, bytes) = resnet();
    let bert = backward("bert_base_grads.tsv");
    // the calibrated delay before the first round (`calibrate`)
    let wake = first_round_delay(&resnet, bytes);
    let sizes = [8usize, 64, 512, 4096, 10240];
    let modes = modes();
    for (model, grads, alone) in [
        ("resnet50", &resnet, RESNET_STEP),
        ("bert-base", &bert, BERT_STEP),
    ] {
        for gbit in [100.0, 25.0] {
            println!(
                "\n# {model}, fp32, the model alone {:.1} ms a step; 8 GPUs a node, {gbit:.0} Gbit/s a node: scaling efficiency % (step ms)",
                alone * 1e3
            );
            let names: Vec<&str> = modes.iter().map(|m| m.0).collect();
            println!("| ranks | {} |", names.join(" | "));
            println!("| --- |{}", " --- |".repeat(names.len()));
            for n in sizes {
                let base = cluster(n / 8, gbit, bytes, wake);
                let cells: Vec<String> = (modes.iter())
                    .map(|(name, make)| {
                        let job = make(base);
                        let (stepped, _) = training_step(&job, grads, alone);
                        // multistep: one step in four communicates
                        let t = match *name {
                            "multistep4" => (3.0 * alone + stepped) / 4.0,
                            "gossip" => gossip_step(&job, grads, alone),
                            _ => stepped,
                        };
                        if json {
                            rows.push(format!(
                                "{{\"model\":\"{model}\",\"gbit\":{gbit},\"ranks\":{n},\"mode\":\"{name}\",\"step_ms\":{:.3},\"efficiency\":{:.4}}}",
                                t * 1e3,
                                alone / t
                            ));
                        }
                        format!("{:.0} ({:.1})", 100.0 * alone / t, t * 1e3)
                    })
                    .collect();
                println!("| {n} | {} |", cells.join(" | "));
            }
        }
    }
    println!(
        "\n# negotiation per ResNet-50 training step at 100 Gbit/s, hierarchical: rounds, bytes a rank sends and receives for them, step ms"
    );
    println!("| ranks | online | offline | Horovod's protocol |");
    println!("| --- | --- | --- | --- |");
    for n in sizes {
        let cells: Vec<String> = [
            Negotiation::Online,
            Negotiation::Offline,
            Negotiation::Horovod,
        ]
        .iter()
        .map(|neg| {
            let mut j = cluster(n / 8, 100.0, bytes, wake);
            j.policy = Policy::Hierarchical;
            j.negotiation = *neg;
            if *neg == Negotiation::Horovod {
                // Horovod's loop runs a cycle every HOROVOD_CYCLE_TIME (1 ms by default)
                j.host.wake = 1e-3;
            }
            let (t, s) = training_step(&j, &resnet, RESNET_STEP);
            format!(
                "{} rounds, {:.0} B, {:.1} ms",
                s.rounds,
                s.control_bytes,
                t * 1e3
            )
        })
        .collect();
        println!("| {n} | {} |", cells.join(" | "));
    }
    if json {
        for r in &rows {
            println!("JSON {r}");
        }
    }
}

/// One node of the job at a quarter of its NIC's rate, and one node lost.
fn faults() {
    let (resnet, bytes) = resnet();
    let wake = first_round_delay(&resnet, bytes);
    println!(
        "# ResNet-50 fp32, 8 GPUs a node, 100 Gbit/s: step ms without / with one node's NIC at a quarter of its rate (every collective waits for the slowest node)"
    );
    let modes = modes();
    let shown = ["hierarchical", "hier+halving", "fp16", "multistep4"];
    println!("| ranks | {} |", shown.join(" | "));
    println!("| --- |{}", " --- |".repeat(shown.len()));
    for n in [64usize, 512, 4096] {
        let cells: Vec<String> = (modes.iter())
            .filter(|(name, _)| shown.contains(name))
            .map(|(name, make)| {
                let base = make(cluster(n / 8, 100.0, bytes, wake));
                let mut slow = base;
                slow.fabric.nic.beta *= 4.0;
                let step_of = |j: &Job| {
                    let t = training_step(j, &resnet, RESNET_STEP).0;
                    match *name {
                        "multistep4" => (3.0 * RESNET_STEP + t) / 4.0,
                        _ => t,
                    }
                };
                format!("{:.1} / {:.1}", step_of(&base) * 1e3, step_of(&slow) * 1e3)
            })
            .collect();
        println!("| {n} | {} |", cells.join(" | "));
    }
    let shutdown = ferrovod::config::DEFAULT_STALL_SHUTDOWN_SECONDS as f64;
    println!(
        "# one node lost: the other ranks' waits are bounded by HOROVOD_STALL_SHUTDOWN_TIME_SECONDS ({shutdown:.0} s by default), so every rank has an error at most that plus one step after the loss; Horovod's default (0) waits forever"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("calibrate") => calibrate(),
        Some("predict") => {
            predict(args.iter().any(|a| a == "--json"));
            println!();
            faults();
        }
        Some(other) => usage(&format!("unknown mode {other:?}")),
        None => usage("a mode is needed"),
    }
}
