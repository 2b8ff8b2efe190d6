//! Top-k's allreduce (`compress::topk` holds its local phases) over a `Transport`: each tensor
//! of the batch selects its k pairs, every rank's pairs of the whole batch are gathered in one
//! allgather (the same bytes from every rank: k is agreed), and each tensor sums the pairs of
//! every rank in rank order.

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::topk::{self, Gradient, TopkMemory};
use crate::compress::{Reduction, TopK};
use crate::error::{Error, Result};
use crate::message::Response;
use crate::transport::Transport;

/// Allreduces a batch of f32 sums or averages (`red`: top-k's `Reduction`) as each rank's
/// largest values at `params`' ratio (a larger share over each named tensor's first `warmup`
/// allreduces: `TopK::k_at`), each tensor's residual and momentum kept in `store`.
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
    act(Some("TOPK_SELECT"));
    let ks = resps
        .iter()
        .zip(ios.iter())
        .map(|(r, io)| {
            let len = io.input().len() / 4;
            let step = store.steps(&r.name, len);
            params.k_at(len, step, warmup).ok_or_else(|| {
                Error::Internal(format!(
                    "tensor '{}' of {len} values cannot travel as top-k at ratio {}",
                    r.name,
                    params.ratio()
                ))
            })
        })
        .collect::<Result<Vec<usize>>>()?;
    let each = ks.iter().sum::<usize>() * topk::PAIR_BYTES;
    let mut send = Vec::with_capacity(each);
    // in-place tensors: the gradient is zeroed as it is read (`Gradient::Cleared`)
    let mut cleared = Vec::with_capacity(ios.len());
    for ((r, io), k) in resps.iter().zip(ios.iter_mut()).zip(&ks) {
        let mut memory = store.take(&r.name, io.input().len() / 4);
        memory.steps = memory.steps.saturating_add(1);
        let grad = match io.split_io() {
            (Some(input), _) => Gradient::Kept(input),
            (None, out) => Gradient::Cleared(out),
        };
        cleared.push(matches!(grad, Gradient::Cleared(_)));
        topk::select(
            grad,
            red.pre as f32,
            &mut memory,
            *k,
            params.momentum(),
            &mut send,
        );
        store.put(&r.name, memory);
    }
    act(Some("TOPK_ALLGATHER"));
    let mut gathered = vec![0u8; each * t.size()];
    t.allgatherv(Some(&send), &mut gathered, &vec![each; t.size()])?;
    act(Some("TOPK_SUM"));
    let mut at = 0;
    for ((io, k), cleared) in ios.iter_mut().zip(ks).zip(cleared) {
        let bytes = k * topk::PAIR_BYTES;
        let parts: Vec<&[u8]> = (0..t.size())
            .map(|r| &gathered[r * each + at..r * each + at + bytes])
            .collect();
        at += bytes;
        topk::decode(&parts, io.split_io().1, red.post as f32, cleared)?;
    }
    act(None);
    Ok(())
}
