//! Top-k's allreduce (`compress::topk` holds its local phases), written once over either
//! memory (`Pairs`: the host's here, the GPU's in `device::sparse`): each tensor of the batch selects its k pairs, every rank's pairs of the whole batch are gathered in one
//! allgather (the same bytes from every rank: k is agreed), and each tensor sums the pairs of
//! every rank in rank order.

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::topk::{self, Gradient, TopkMemory};
use crate::compress::{Reduction, TopK};
use crate::error::{Error, Result};
use crate::message::Response;
use crate::transport::Transport;

/// Top-k's phases over one memory (host or GPU): what `run` orders.
pub trait Pairs {
    /// Tensor `tensor`'s `k` pairs selected (its residual and momentum updated, kept), written
    /// `at` bytes into this rank's part of the exchange.
    fn select(&mut self, tensor: usize, k: usize, at: usize) -> Result<()>;
    /// Every rank's part (`each` bytes, the batch's pairs) gathered to every rank.
    fn gather(&mut self, each: usize) -> Result<()>;
    /// Tensor `tensor`'s output: the sum of its `k` pairs from every rank, in rank order, found
    /// `at` bytes into each rank's part.
    fn decode(&mut self, tensor: usize, k: usize, at: usize) -> Result<()>;
}

/// Each tensor's pairs this step (`TopK::k_at`: the same on every rank, from agreed sizes and
/// the per-name counts).
pub fn pairs_per_tensor(
    params: TopK,
    warmup: u64,
    store: &TopkMemory,
    resps: &[&Response],
    lens: &[usize],
) -> Result<Vec<usize>> {
    (resps.iter().zip(lens))
        .map(|(r, len)| {
            let step = store.steps(&r.name, *len);
            params.k_at(*len, step, warmup).ok_or_else(|| {
                Error::Internal(format!(
                    "tensor '{}' of {len} values cannot travel as top-k at ratio {}",
                    r.name,
                    params.ratio()
                ))
            })
        })
        .collect()
}

/// A batch's step, the same over either memory: every tensor selects, one allgather of the
/// batch's pairs, every tensor sums them.
pub fn run(p: &mut dyn Pairs, ks: &[usize], act: ActivitySink) -> Result<()> {
    act(Some("TOPK_SELECT"));
    let mut at = 0;
    for (i, k) in ks.iter().enumerate() {
        p.select(i, *k, at)?;
        at += k * topk::PAIR_BYTES;
    }
    act(Some("TOPK_ALLGATHER"));
    p.gather(at)?;
    act(Some("TOPK_SUM"));
    let mut at = 0;
    for (i, k) in ks.iter().enumerate() {
        p.decode(i, *k, at)?;
        at += k * topk::PAIR_BYTES;
    }
    act(None);
    Ok(())
}

/// Allreduces a batch of f32 sums or averages in host memory (`red`: top-k's `Reduction`) as
/// each rank's largest values at `params`' ratio (a larger share over each named tensor's first
/// `warmup` allreduces: `TopK::k_at`), each tensor's residual and momentum kept in `store`.
#[allow(clippy::too_many_arguments)] // the batch, its codec's settings and state, who hears
pub fn allreduce(
    t: &dyn Transport,
    red: &Reduction,
    params: TopK,
    warmup: u64,
    store: &TopkMemory,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    act: ActivitySink,
) -> Result<()> {
    let lens: Vec<usize> = ios.iter().map(|io| io.input().len() / 4).collect();
    let ks = pairs_per_tensor(params, warmup, store, resps, &lens)?;
    let each = ks.iter().sum::<usize>() * topk::PAIR_BYTES;
    let mut host = Host {
        t,
        red,
        momentum: params.momentum(),
        store,
        resps,
        ios,
        send: Vec::with_capacity(each),
        gathered: Vec::new(),
        each,
        cleared: Vec::new(),
    };
    run(&mut host, &ks, act)
}

/// Host memory: `compress::topk`'s phases over the tensors' bytes, MPI's allgather.
struct Host<'a, 'b> {
    t: &'a dyn Transport,
    red: &'a Reduction,
    momentum: f32,
    store: &'a TopkMemory,
    resps: &'a [&'a Response],
    ios: &'a mut [&'b mut dyn TensorIo],
    send: Vec<u8>,
    gathered: Vec<u8>,
    each: usize,
    /// Per tensor selected so far: whether its output holds zeros already.
    cleared: Vec<bool>,
}

impl Pairs for Host<'_, '_> {
    fn select(&mut self, tensor: usize, k: usize, _at: usize) -> Result<()> {
        let (r, io) = (self.resps[tensor], &mut self.ios[tensor]);
        let mut memory = self.store.take(&r.name, io.input().len() / 4);
        memory.steps = memory.steps.saturating_add(1);
        // in-place tensors: the gradient is zeroed as it is read (`Gradient::Cleared`)
        let grad = match io.split_io() {
            (Some(input), _) => Gradient::Kept(input),
            (None, out) => Gradient::Cleared(out),
        };
        self.cleared.push(matches!(grad, Gradient::Cleared(_)));
        let pre = self.red.pre as f32;
        topk::select(grad, pre, &mut memory, k, self.momentum, &mut self.send);
        self.store.put(&r.name, memory);
        Ok(())
    }

    fn gather(&mut self, each: usize) -> Result<()> {
        debug_assert_eq!(each, self.each);
        let n = self.t.size();
        self.gathered = vec![0u8; each * n];
        (self.t).allgatherv(Some(&self.send), &mut self.gathered, &vec![each; n])
    }

    fn decode(&mut self, tensor: usize, k: usize, at: usize) -> Result<()> {
        let (each, bytes) = (self.each, k * topk::PAIR_BYTES);
        let parts: Vec<&[u8]> = (0..self.t.size())
            .map(|r| &self.gathered[r * each + at..r * each + at + bytes])
            .collect();
        let out = self.ios[tensor].split_io().1;
        topk::decode(&parts, out, self.red.post as f32, self.cleared[tensor])
    }
}
