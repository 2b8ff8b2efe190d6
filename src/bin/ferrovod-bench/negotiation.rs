//! `ferrovod-bench negotiation`: what agreeing on ready tensors costs per training step, in each
//! negotiation mode, on simulated steps of real models' gradient sets.
//!
//! A step submits every gradient of the model in backward order, spacing the submissions over
//! a simulated backward pass (`--backward-ms`, each gap proportional to the gradient's size),
//! then waits for all of them. Tensor sizes are divided by `--scale` so that 16 oversubscribed
//! ranks on a small machine still measure negotiation rather than memory bandwidth; the count,
//! order and names of tensors are the model's. Each mode runs `--warmup` steps (offline mode
//! learns its plan there) and then `--steps` measured steps; the per-step counters come from
//! ferrovod's metrics (`fv_read_metrics`).
//!
//! Cost model (printed with the table): a control collective of b bytes among p ranks costs
//! about `alpha * log2(p) + beta * b` (recursive doubling / binomial tree); alpha is fitted from
//! a small MPI_Allreduce timed in the same run, beta from MPI's bandwidth for the vote sizes
//! (negligible next to alpha). A mode's negotiation cost per step at p ranks is then
//! `collectives_per_step * alpha * log2(p)` plus its bytes term; offline mode issues none, and
//! its escape flag (one element per fused batch) rides inside the data collectives.

use std::time::{Duration, Instant};

use ferrovod::config::{Config, NegotiationMode};
use ferrovod::runtime::metrics::MetricsSnapshot;
use ferrovod::runtime::{self, InitOptions};
use ferrovod::transport::Transport;
use ferrovod::transport::mpi::MpiComm;
use ferrovod::{DataType, ReduceOp};

pub struct Options {
    pub steps: usize,
    pub warmup: usize,
    pub backward_ms: f64,
    pub scale: usize,
    pub json: bool,
}

struct Model {
    name: &'static str,
    grads: Vec<(String, usize)>,
}

#[derive(Clone, Copy, Default)]
struct PerStep {
    control_collectives: f64,
    control_bytes: f64,
    negotiation_ms: f64,
    data_collectives: f64,
    step_ms: f64,
}

const MODES: [NegotiationMode; 3] = [
    NegotiationMode::Horovod,
    NegotiationMode::Online,
    NegotiationMode::Offline,
];

fn simulate(model: &Model, o: &Options, rank: usize) -> PerStep {
    let rt = runtime::runtime().unwrap();
    let total: usize = model.grads.iter().map(|(_, n)| n).sum();
    let mut bufs: Vec<Option<Vec<u8>>> = model
        .grads
        .iter()
        .map(|(_, n)| Some(vec![0u8; 4 * (n / o.scale).max(1)]))
        .collect();
    let mut start = MetricsSnapshot::default();
    let mut step_times = Vec::new();
    for step in 0..o.warmup + o.steps {
        if step == o.warmup {
            start = rt.metrics.snapshot();
        }
        let t = Instant::now();
        let mut handles = Vec::with_capacity(bufs.len());
        for (k, (name, n)) in model.grads.iter().enumerate().rev() {
            let gap = o.backward_ms * 1e-3 * *n as f64 / total as f64;
            if gap > 20e-6 {
                std::thread::sleep(Duration::from_secs_f64(gap));
            }
            let mut data = bufs[k].take().unwrap();
            data[..4].copy_from_slice(&((rank + step) as f32).to_le_bytes());
            handles.push((k, super::enqueue_f32(name, data)));
        }
        for (k, h) in handles {
            bufs[k] = Some(super::take_f32(h));
        }
        if step >= o.warmup {
            step_times.push(t.elapsed().as_secs_f64());
        }
        let size = rt.topology().size as usize;
        let got = f32::from_le_bytes(bufs[0].as_ref().unwrap()[..4].try_into().unwrap());
        let want = (0..size).map(|r| (r + step) as f32).sum::<f32>();
        assert_eq!(got, want, "{} step {step}: wrong sum", model.name);
    }
    let end = rt.metrics.snapshot();
    let s = o.steps as f64;
    step_times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    PerStep {
        control_collectives: (end.control_collectives - start.control_collectives) as f64 / s,
        control_bytes: (end.control_bytes - start.control_bytes) as f64 / s,
        negotiation_ms: (end.negotiation_ns - start.negotiation_ns) as f64 / 1e6 / s,
        data_collectives: (end.data_collectives - start.data_collectives) as f64 / s,
        step_ms: step_times[step_times.len() / 2] * 1e3,
    }
}

/// Median time of a small in-place MPI_Allreduce (the vote's size), in seconds.
/// Median seconds of `f` over 180 calls after 20 warm-up calls, the ranks starting together.
fn median_latency(comm: &MpiComm, mut f: impl FnMut()) -> f64 {
    let mut times = Vec::new();
    comm.barrier().unwrap();
    for i in 0..200 {
        let t = Instant::now();
        f();
        if i >= 20 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[times.len() / 2]
}

fn small_allreduce_latency(comm: &MpiComm, bytes: usize) -> f64 {
    let mut buf = vec![0u8; bytes.max(8)];
    median_latency(comm, || {
        comm.allreduce(None, &mut buf, DataType::U8, ReduceOp::Max)
            .unwrap()
    })
}

/// A one-word vote as the negotiator issues it (`and_words`).
fn vote_latency(comm: &MpiComm) -> f64 {
    let mut words = [u64::MAX];
    median_latency(comm, || comm.and_words(&mut words).unwrap())
}

pub fn run(o: &Options, load: impl Fn(&str) -> Vec<(String, usize)>) {
    let world = MpiComm::world().expect("MPI_Comm_dup");
    let me = world.rank();
    let np = world.size();
    let models = [
        Model {
            name: "resnet50",
            grads: load("resnet50_grads.tsv"),
        },
        Model {
            name: "bert-base",
            grads: load("bert_base_grads.tsv"),
        },
    ];
    // before any ferrovod thread exists: the per-message cost the model extrapolates
    let latency = small_allreduce_latency(&world, 32);
    let vote = vote_latency(&world);
    let base = Config::from_env();
    let mut results: Vec<(usize, NegotiationMode, PerStep)> = Vec::new();
    for (m, model) in models.iter().enumerate() {
        for mode in MODES {
            let mut cfg = base.clone();
            cfg.negotiation = mode;
            cfg.plan_file = None;
            runtime::init(InitOptions {
                config: Some(cfg),
                ..Default::default()
            })
            .expect("ferrovod init");
            let r = simulate(model, o, me);
            results.push((m, mode, r));
            runtime::shutdown();
            world.barrier().unwrap();
        }
    }
    if me != 0 {
        return;
    }
    let log2 = |p: f64| p.log2().max(1.0);
    let alpha = latency / log2(np as f64);
    println!(
        "# negotiation: np={np} | cycle {:?} | simulated backward {} ms/step | tensor sizes / {} | {} warm-up + {} measured steps | small allreduce {:.1} us (alpha = {:.2} us per log2 p) | one-word vote {:.1} us",
        base.cycle_time,
        o.backward_ms,
        o.scale,
        o.warmup,
        o.steps,
        latency * 1e6,
        alpha * 1e6,
        vote * 1e6
    );
    println!(
        "# {:>10} {:>8} {:>8} {:>14} {:>14} {:>13} {:>10} {:>9} {:>11} {:>11}",
        "model",
        "tensors",
        "mode",
        "ctrl_coll/stp",
        "ctrl_B/step",
        "nego_ms/step",
        "data_coll",
        "step_ms",
        "model@1k_ms",
        "model@10k_ms"
    );
    for (m, mode, r) in &results {
        let at = |p: f64| r.control_collectives * alpha * log2(p) * 1e3;
        println!(
            "  {:>10} {:>8} {:>8} {:>14.1} {:>14.0} {:>13.3} {:>10.1} {:>9.2} {:>11.2} {:>11.2}",
            models[*m].name,
            models[*m].grads.len(),
            mode.name(),
            r.control_collectives,
            r.control_bytes,
            r.negotiation_ms,
            r.data_collectives,
            r.step_ms,
            at(1000.0),
            at(10000.0)
        );
    }
    let horovod = |m: usize| {
        results
            .iter()
            .find(|(mm, mode, _)| *mm == m && *mode == NegotiationMode::Horovod)
            .map(|(_, _, r)| *r)
            .unwrap()
    };
    println!("# ratios to the horovod mode (negotiation ms per step):");
    for (m, mode, r) in &results {
        println!(
            "#   {:>10} {:>8}: {:.3}",
            models[*m].name,
            mode.name(),
            r.negotiation_ms / horovod(*m).negotiation_ms.max(1e-9)
        );
    }
    if o.json {
        for (m, mode, r) in &results {
            println!(
                "{{\"bench\":\"negotiation\",\"model\":\"{}\",\"mode\":\"{}\",\"np\":{np},\"control_collectives_per_step\":{:.3},\"control_bytes_per_step\":{:.1},\"negotiation_ms_per_step\":{:.4},\"step_ms\":{:.3},\"alpha_us\":{:.3}}}",
                models[*m].name,
                mode.name(),
                r.control_collectives,
                r.control_bytes,
                r.negotiation_ms,
                r.step_ms,
                alpha * 1e6
            );
        }
    }
    for (m, mode, r) in &results {
        if *m == 0 {
            println!(
                "negotiation {} np={np}: control_collectives_per_step={:.2} negotiation_ms_per_step={:.3}",
                mode.name(),
                r.control_collectives,
                r.negotiation_ms
            );
        }
    }
}
