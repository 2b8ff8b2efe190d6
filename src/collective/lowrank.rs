//! PowerSGD's allreduce (`compress::powersgd` holds its local phases) over a `Transport`: the
//! batch's tensors each start their step, every tensor's P is summed in one f32 allreduce,
//! each tensor orthogonalises its P and computes its Q, every Q is summed in a second
//! allreduce, and each tensor finishes with the approximation of the ranks' average and its
//! new residual. Two collectives per batch, of (rows + cols) × rank values per tensor. A
//! tensor's first `start` allreduces (`PowerMemory::warming`) are summed as they are, in one
//! more f32 allreduce for the batch's tensors that are.

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::Reduction;
use crate::compress::powersgd::{self, Memory, PowerMemory, Shape};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{ReduceOp, Response};
use crate::transport::Transport;

/// One tensor's step between the phases: its matrix view, its memory (holding M from `start`
/// to `finish`) and its P.
struct Step {
    shape: Shape,
    memory: Memory,
    p: Vec<f32>,
}

/// Allreduces a batch of f32 sums or averages (`red`: PowerSGD's `Reduction`) as factors of
/// `rank` columns, each tensor's state kept in `store` under its name, except the first
/// `start` allreduces of each named tensor, which are summed as they are.
#[allow(clippy::too_many_arguments)] // the batch, its codec's settings and state, who hears
pub fn allreduce(
    t: &dyn Transport,
    red: &Reduction,
    rank: usize,
    start: u64,
    store: &PowerMemory,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    act: ActivitySink,
) -> Result<()> {
    let warming: Vec<bool> = (resps.iter().zip(ios.iter()))
        .map(|(r, io)| {
            Shape::of(&r.shape, rank).is_some_and(|s| {
                s.len() * 4 == io.input().len() && store.warming(&r.name, &s, start)
            })
        })
        .collect();
    if warming.iter().any(|w| *w) {
        act(Some("POWERSGD_ALLREDUCE_WARMING"));
        let parts = (ios.iter().zip(&warming)).filter(|(_, w)| **w);
        let values = parts.flat_map(|(io, _)| io.input().chunks_exact(4).map(f32_of));
        let pre = red.pre as f32;
        let sums = sum_values(t, values.map(|v| v * pre))?;
        // `post` is the factor on the ranks' average (the approximation's): on the sum, post /
        // ranks, which is 1 for a plain sum (exact) and what an uncompressed average applies
        let (factor, mut at) = ((red.post / t.size() as f64) as f32, 0);
        for ((r, io), _) in (resps.iter().zip(ios.iter_mut()).zip(&warming)).filter(|(_, w)| **w) {
            let (_, out) = io.split_io();
            let n = out.len() / 4;
            for (o, v) in out.chunks_exact_mut(4).zip(&sums[at..at + n]) {
                o.copy_from_slice(&(v * factor).to_le_bytes());
            }
            at += n;
            // counted: the tensor's memory is made (and its step counted) as a compressed one's
            let shape = Shape::of(&r.shape, rank).expect("a matrix");
            let mut memory = store.take(&r.name, &shape);
            memory.steps += 1;
            store.put(&r.name, memory);
        }
    }
    let compressed = (resps.iter().zip(ios.iter_mut()).zip(&warming)).filter(|(_, w)| !**w);
    let (resps, mut ios): (Vec<&Response>, Vec<&mut &mut dyn TensorIo>) =
        compressed.map(|(ri, _)| ri).unzip();
    if resps.is_empty() {
        act(None);
        return Ok(());
    }
    act(Some("POWERSGD_START"));
    let mut steps = Vec::with_capacity(resps.len());
    for (r, io) in resps.iter().zip(ios.iter()) {
        let shape = Shape::of(&r.shape, rank)
            .filter(|s| s.len() * 4 == io.input().len())
            .ok_or_else(|| {
                Error::Internal(format!(
                    "tensor '{}' of shape {:?} cannot travel as PowerSGD of rank {rank}",
                    r.name, r.shape
                ))
            })?;
        let mut memory = store.take(&r.name, &shape);
        memory.steps = memory.steps.saturating_add(1);
        let p = powersgd::start(io.input(), red.pre as f32, &mut memory, &shape);
        steps.push(Step { shape, memory, p });
    }
    act(Some("POWERSGD_ALLREDUCE_P"));
    let sums = sum(t, steps.iter().map(|s| &s.p[..]))?;
    act(Some("POWERSGD_MIDDLE"));
    let mut qs = Vec::with_capacity(steps.len());
    let mut at = 0;
    for s in steps.iter_mut() {
        let n = s.shape.p_len();
        s.p.copy_from_slice(&sums[at..at + n]);
        at += n;
        qs.push(powersgd::middle(&s.memory, &mut s.p, &s.shape));
    }
    act(Some("POWERSGD_ALLREDUCE_Q"));
    let q_sums = sum(t, qs.iter().map(|q| &q[..]))?;
    act(Some("POWERSGD_FINISH"));
    let mut at = 0;
    for ((s, r), io) in steps.into_iter().zip(resps).zip(ios.iter_mut()) {
        let Step {
            shape,
            mut memory,
            p,
        } = s;
        let q_sum = q_sums[at..at + shape.q_len()].to_vec();
        at += shape.q_len();
        let (_, out) = io.split_io();
        let post = red.post as f32;
        powersgd::finish(&p, q_sum, t.size(), post, &mut memory, out, &shape);
        // unnamed tensors keep nothing (`PowerMemory::put`)
        store.put(&r.name, memory);
    }
    act(None);
    Ok(())
}

/// The ranks' elementwise sum of the concatenated `parts`, in one f32 allreduce.
fn sum<'a>(t: &dyn Transport, parts: impl Iterator<Item = &'a [f32]>) -> Result<Vec<f32>> {
    sum_values(t, parts.flatten().copied())
}

/// The ranks' elementwise sum of `values`, in one f32 allreduce.
fn sum_values(t: &dyn Transport, values: impl Iterator<Item = f32>) -> Result<Vec<f32>> {
    let mut bytes: Vec<u8> = values.flat_map(|v| v.to_le_bytes()).collect();
    t.allreduce(None, &mut bytes, DataType::F32, ReduceOp::Sum)?;
    Ok(bytes.chunks_exact(4).map(f32_of).collect())
}

fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
