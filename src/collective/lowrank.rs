//! PowerSGD's allreduce (`compress::powersgd` holds its local phases), written once over
//! either memory (`Factors`: the host's here, the GPU's in `device::lowrank`): the batch's
//! tensors each start their step, every tensor's P is summed in one f32 allreduce,
//! each tensor orthogonalises its P and computes its Q, every Q is summed in a second
//! allreduce, and each tensor finishes with the approximation of the ranks' average and its
//! new residual. Two collectives per batch, of (rows + cols) × rank values per tensor. A
//! tensor's first `start` allreduces (`PowerMemory::warming`) are summed as they are, in one
//! more f32 allreduce for the batch's tensors that are.

use crate::collective::{ActivitySink, TensorIo, parallel};
use crate::compress::powersgd::{self, Memory, PowerMemory, Shape};
use crate::compress::{Reduction, Wire};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{ReduceOp, Response};
use crate::transport::Transport;

/// PowerSGD's phases over one memory (host or GPU), for a batch's tensors (indices into its
/// responses): what `run` orders, as `quantized::Blocks` is for u8.
pub trait Factors {
    /// Sums `tensors` as they are (their first steps), each counted in its memory.
    fn sum_warming(&mut self, tensors: &[usize]) -> Result<()>;
    /// M = the gradient + the residual and P = M Q, for each of `tensors` (the rest of the
    /// batch's phases work on these).
    fn start(&mut self, tensors: &[usize]) -> Result<()>;
    /// Every tensor's P summed over the ranks, in one allreduce.
    fn sum_p(&mut self) -> Result<()>;
    /// Each P orthogonalised, and Q = Mᵀ P.
    fn middle(&mut self) -> Result<()>;
    /// Every tensor's Q summed over the ranks, in one allreduce.
    fn sum_q(&mut self) -> Result<()>;
    /// Each output = the approximation P Qᵀ of the ranks' average; the new residual and Q
    /// kept.
    fn finish(&mut self) -> Result<()>;
}

/// A batch's step, the same over either memory: the tensors in their first steps (`warming`)
/// summed as they are, the others through the factors.
pub fn run(f: &mut dyn Factors, warming: &[bool], act: ActivitySink) -> Result<()> {
    let (warm, compressed): (Vec<usize>, Vec<usize>) =
        (0..warming.len()).partition(|i| warming[*i]);
    if !warm.is_empty() {
        act(Some("POWERSGD_ALLREDUCE_WARMING"));
        f.sum_warming(&warm)?;
    }
    if !compressed.is_empty() {
        act(Some("POWERSGD_START"));
        f.start(&compressed)?;
        act(Some("POWERSGD_ALLREDUCE_P"));
        f.sum_p()?;
        act(Some("POWERSGD_MIDDLE"));
        f.middle()?;
        act(Some("POWERSGD_ALLREDUCE_Q"));
        f.sum_q()?;
        act(Some("POWERSGD_FINISH"));
        f.finish()?;
    }
    act(None);
    Ok(())
}

/// Which of a batch's tensors are in their first `start` allreduces (`PowerMemory::warming`):
/// a pure function of the agreed responses and the store, alike on every rank.
pub fn warming(resps: &[&Response], rank: usize, start: u64, store: &PowerMemory) -> Vec<bool> {
    (resps.iter())
        .map(|r| Shape::of(&r.shape, rank).is_some_and(|s| store.warming(&r.name, &s, start)))
        .collect()
}

/// The matrix view of `r` under `rank`, which the batch's codec promised (`Codecs::of`).
pub fn shape(r: &Response, rank: usize, values: usize) -> Result<Shape> {
    Shape::of(&r.shape, rank)
        .filter(|s| s.len() == values)
        .ok_or_else(|| {
            Error::Internal(format!(
                "tensor '{}' of shape {:?} cannot travel as PowerSGD of rank {rank}",
                r.name, r.shape
            ))
        })
}

/// Allreduces a batch of f32 sums or averages in host memory (`red`: PowerSGD's `Reduction`)
/// as factors of `rank` columns, each tensor's state kept in `wire.powersgd` under its name,
/// except the first `wire.powersgd_start` allreduces of each named tensor, which are summed as
/// they are; the local arithmetic on up to `wire.threads` threads.
pub fn allreduce(
    t: &dyn Transport,
    red: &Reduction,
    rank: usize,
    wire: &Wire,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    act: ActivitySink,
) -> Result<()> {
    let store = wire.powersgd;
    let warming = warming(resps, rank, wire.powersgd_start, store);
    let mut host = Host {
        t,
        red,
        rank,
        store,
        resps,
        ios,
        threads: wire.threads,
        steps: Vec::new(),
        sums: Vec::new(),
    };
    run(&mut host, &warming, act)
}

/// One tensor's step between the phases: its index in the batch, its matrix view, its memory
/// (holding M from `start` to `finish`), its P and then its Q.
struct Step {
    tensor: usize,
    shape: Shape,
    memory: Memory,
    p: Vec<f32>,
    q: Vec<f32>,
}

impl Step {
    /// The tensor's values: what each phase's arithmetic is proportional to.
    fn values(&self) -> usize {
        self.shape.len()
    }
}

/// Host memory: the phases of `compress::powersgd` over the tensors' bytes.
struct Host<'a, 'b> {
    t: &'a dyn Transport,
    red: &'a Reduction,
    rank: usize,
    store: &'a PowerMemory,
    resps: &'a [&'a Response],
    ios: &'a mut [&'b mut dyn TensorIo],
    /// Threads the phases' arithmetic may use (local: the same bits for any).
    threads: usize,
    steps: Vec<Step>,
    /// The latest sum over the ranks (every P, then every Q).
    sums: Vec<f32>,
}

impl Factors for Host<'_, '_> {
    fn sum_warming(&mut self, tensors: &[usize]) -> Result<()> {
        let pre = self.red.pre as f32;
        let values = (tensors.iter())
            .flat_map(|i| self.ios[*i].input().chunks_exact(4).map(f32_of))
            .map(|v| v * pre);
        let sums = sum_values(self.t, values)?;
        // `post` is the factor on the ranks' average (the approximation's): on the sum, post /
        // ranks, which is 1 for a plain sum (exact) and what an uncompressed average applies
        let (factor, mut at) = ((self.red.post / self.t.size() as f64) as f32, 0);
        for i in tensors {
            let (_, out) = self.ios[*i].split_io();
            let n = out.len() / 4;
            for (o, v) in out.chunks_exact_mut(4).zip(&sums[at..at + n]) {
                o.copy_from_slice(&(v * factor).to_le_bytes());
            }
            at += n;
            // counted: the tensor's memory is made (and its step counted) as a compressed one's
            let r = self.resps[*i];
            let shape = shape(r, self.rank, n)?;
            let mut memory = self.store.take(&r.name, &shape);
            memory.steps += 1;
            self.store.put(&r.name, memory);
        }
        Ok(())
    }

    fn start(&mut self, tensors: &[usize]) -> Result<()> {
        // taken in batch order, on this thread: the store's recency (its eviction) stays alike
        // on every rank
        for i in tensors {
            let (r, io) = (self.resps[*i], &self.ios[*i]);
            let shape = shape(r, self.rank, io.input().len() / 4)?;
            let mut memory = self.store.take(&r.name, &shape);
            memory.steps = memory.steps.saturating_add(1);
            self.steps.push(Step {
                tensor: *i,
                shape,
                memory,
                p: Vec::new(),
                q: Vec::new(),
            });
        }
        let pre = self.red.pre as f32;
        let ios = &*self.ios;
        let mut work: Vec<(&mut Step, &[u8])> = (self.steps.iter_mut())
            .map(|s| {
                let grad = ios[s.tensor].input();
                (s, grad)
            })
            .collect();
        parallel::for_each(
            &mut work,
            self.threads,
            |w| w.0.values(),
            |(s, grad)| {
                s.p = powersgd::start(grad, pre, &mut s.memory, &s.shape);
            },
        );
        Ok(())
    }

    fn sum_p(&mut self) -> Result<()> {
        self.sums = sum(self.t, self.steps.iter().map(|s| &s.p[..]))?;
        Ok(())
    }

    fn middle(&mut self) -> Result<()> {
        let mut at = 0;
        for s in self.steps.iter_mut() {
            let n = s.shape.p_len();
            s.p.copy_from_slice(&self.sums[at..at + n]);
            at += n;
        }
        parallel::for_each(&mut self.steps, self.threads, Step::values, |s| {
            s.q = powersgd::middle(&s.memory, &mut s.p, &s.shape);
        });
        Ok(())
    }

    fn sum_q(&mut self) -> Result<()> {
        self.sums = sum(self.t, self.steps.iter().map(|s| &s.q[..]))?;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        let (ranks, post) = (self.t.size(), self.red.post as f32);
        let mut steps = std::mem::take(&mut self.steps);
        // each compressed tensor's output, beside its step (the steps are in batch order)
        let mut outs: Vec<&mut [u8]> = Vec::with_capacity(steps.len());
        let mut wanted = steps.iter().map(|s| s.tensor).peekable();
        for (i, io) in self.ios.iter_mut().enumerate() {
            if wanted.next_if_eq(&i).is_some() {
                outs.push(io.split_io().1);
            }
        }
        let mut at = 0;
        let mut work: Vec<(&mut Step, &mut [u8], &[f32])> = Vec::with_capacity(steps.len());
        for (s, out) in steps.iter_mut().zip(outs) {
            let n = s.shape.q_len();
            work.push((s, out, &self.sums[at..at + n]));
            at += n;
        }
        let weight = |w: &(&mut Step, &mut [u8], &[f32])| w.0.values();
        parallel::for_each(&mut work, self.threads, weight, |(s, out, q_sum)| {
            let q_sum = q_sum.to_vec();
            powersgd::finish(&s.p, q_sum, ranks, post, &mut s.memory, out, &s.shape);
        });
        // kept in batch order, on this thread, as taken; unnamed tensors keep nothing
        // (`PowerMemory::put`)
        for s in steps {
            self.store.put(&self.resps[s.tensor].name, s.memory);
        }
        Ok(())
    }
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
