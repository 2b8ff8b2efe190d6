//! `ferrovod-bench decentralized`: communication time per training step of a model's gradient
//! set (every gradient submitted in backward order, then waited for; no compute) under each of
//! the ways ranks can talk, alternating in one job:
//!
//! - `allreduce`: an average over all ranks every step (the baseline);
//! - `gossip`: each rank averages with one peer per step (`OpKind::Gossip`), every
//!   `FERROVOD_GOSSIP_SYNC_EVERY`-th step an exact average (default 10);
//! - `gossip-fp16`: the same with fp16 differences against per-peer copies;
//! - `multistep4`: an accumulating allreduce that communicates every 4th step.
//!
//! Measured steps are a multiple of 20: any 20 consecutive steps hold 5 communicating multistep
//! steps and 2 exact gossip averages, so every mode's mean holds whole periods. Each mode keeps
//! its better mean of two rounds.

use std::time::Instant;

use ferrovod::message::{Compression, Multistep};
use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::{DataType, OpKind, ReduceOp};

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Allreduce,
    Gossip,
    GossipFp16,
    Multistep4,
}

impl Mode {
    const ALL: [Mode; 4] = [
        Mode::Allreduce,
        Mode::Gossip,
        Mode::GossipFp16,
        Mode::Multistep4,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Allreduce => "allreduce",
            Mode::Gossip => "gossip",
            Mode::GossipFp16 => "gossip-fp16",
            Mode::Multistep4 => "multistep4",
        }
    }

    fn spec(self, name: &str, data: Vec<u8>) -> OpSpec {
        let kind = match self {
            Mode::Gossip | Mode::GossipFp16 => OpKind::Gossip,
            _ => OpKind::Allreduce,
        };
        let mut spec = OpSpec::new(
            kind,
            vec![TensorSpec {
                name: format!("{}.{name}", self.name()),
                shape: vec![(data.len() / 4) as i64],
                dtype: DataType::F32,
                input: InputMem::Owned(data),
                output: OutputMem::InPlace,
                splits: None,
            }],
        );
        if kind == OpKind::Allreduce {
            spec.reduce_op = ReduceOp::Average;
        }
        spec.compression = Some(match self {
            Mode::GossipFp16 => Compression::Fp16,
            _ => Compression::None,
        });
        spec.multistep = Some(match self {
            Mode::Multistep4 => Multistep {
                every: 4,
                warmup: 0,
                accumulate: true,
            },
            _ => Multistep::EVERY_CALL,
        });
        spec
    }
}

/// Mean seconds per step of `steps` steps of `mode` after `warmup`, buffers reused.
fn run_mode(
    mode: Mode,
    grads: &[(String, usize)],
    bufs: &mut [Vec<u8>],
    warmup: usize,
    steps: usize,
) -> f64 {
    let rt = runtime::runtime().unwrap();
    let mut total = 0.0;
    for step in 0..warmup + steps {
        let t = Instant::now();
        let handles: Vec<_> = (grads.iter().enumerate().rev())
            .map(|(k, (name, _))| {
                let data = std::mem::take(&mut bufs[k]);
                (k, rt.enqueue(mode.spec(name, data)).unwrap())
            })
            .collect();
        for (k, h) in handles {
            h.wait(None).unwrap();
            bufs[k] = h.take_output(0).unwrap();
            rt.handles.release(h.id).unwrap();
        }
        if step >= warmup {
            total += t.elapsed().as_secs_f64();
        }
    }
    total / steps as f64
}

pub fn run(grads: &[(String, usize)], warmup: usize, steps: usize, only: Option<&str>) {
    let modes: Vec<Mode> = match only {
        None => Mode::ALL.to_vec(),
        Some(list) => (list.split(','))
            .map(|m| {
                (Mode::ALL.into_iter().find(|x| x.name() == m.trim()))
                    .unwrap_or_else(|| panic!("unknown mode {m}"))
            })
            .collect(),
    };
    let steps = steps.div_ceil(20).max(1) * 20;
    runtime::init(Default::default()).expect("ferrovod init");
    let rt = runtime::runtime().unwrap();
    let (me, size) = (rt.topology().rank, rt.topology().size);
    drop(rt);
    let mut bufs: Vec<Vec<u8>> = (grads.iter())
        .map(|(_, n)| {
            (0..*n)
                .flat_map(|i| ((i % 7) as f32 + me as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let mut best = vec![f64::MAX; modes.len()];
    for _round in 0..2 {
        for (m, mode) in modes.iter().enumerate() {
            best[m] = best[m].min(run_mode(*mode, grads, &mut bufs, warmup, steps));
        }
    }
    let total: usize = grads.iter().map(|(_, n)| n).sum();
    runtime::shutdown();
    if me != 0 {
        return;
    }
    println!(
        "# decentralized: {} gradient tensors, {:.1} MiB per step, np={size}, {steps} steps after {warmup} (mean per step, better of two rounds)",
        grads.len(),
        (total * 4) as f64 / (1 << 20) as f64
    );
    for (m, mode) in modes.iter().enumerate() {
        println!("  {:>12} {:>10.1} ms", mode.name(), best[m] * 1e3);
    }
    if modes[0] == Mode::Allreduce {
        for (m, mode) in modes.iter().enumerate().skip(1) {
            println!(
                "resnet50 {}/allreduce = {:.2}",
                mode.name(),
                best[m] / best[0]
            );
        }
    }
}
