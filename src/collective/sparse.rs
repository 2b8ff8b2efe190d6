//! Top-k's allreduce (`compress::topk` holds its local phases) over a `Transport`: each tensor
//! of the batch selects its k pairs, every rank's pairs of the whole batch are gathered in one
//! allgather (the same bytes from every rank: k is agreed), and each tensor sums the pairs of
//! every rank in rank order.

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::topk::{self, TopkMemory};
use crate::compress::{Reduction, TopK};
use crate::error::{Error, Result};
use crate::message::Response;
use crate::transport::Transport;

/// Allreduces a batch of f32 sums or averages (`red`: top-k's `Reduction`) as each rank's
/// largest values at `params`' ratio, each tensor's residual and momentum kept in `store`.
pub fn allreduce(
    t: &dyn Transport,
    red: &Reduction,
    params: TopK,
    store: &TopkMemory,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    act: ActivitySink,
) -> Result<()> {
    act(Some("TOPK_SELECT"));
    let pre = red.pre as f32;
    let mut ks = Vec::with_capacity(resps.len());
    let mut send = Vec::new();
    for (r, io) in resps.iter().zip(ios.iter()) {
        let len = io.input().len() / 4;
        let k = params.k(len).ok_or_else(|| {
            Error::Internal(format!(
                "tensor '{}' of {len} values cannot travel as top-k at ratio {}",
                r.name,
                params.ratio()
            ))
        })?;
        let grad: Vec<f32> = (io.input().chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * pre)
            .collect();
        let mut memory = store.take(&r.name, len);
        let pairs = topk::select(&grad, &mut memory, k, params.momentum());
        send.extend_from_slice(&topk::encode(&pairs));
        store.put(&r.name, memory);
        ks.push(k);
    }
    act(Some("TOPK_ALLGATHER"));
    let each = send.len();
    let mut gathered = vec![0u8; each * t.size()];
    t.allgatherv(Some(&send), &mut gathered, &vec![each; t.size()])?;
    act(Some("TOPK_SUM"));
    let post = red.post as f32;
    let mut at = 0;
    for (io, k) in ios.iter_mut().zip(ks) {
        let bytes = k * topk::PAIR_BYTES;
        let parts: Vec<&[u8]> = (0..t.size())
            .map(|r| &gathered[r * each + at..r * each + at + bytes])
            .collect();
        at += bytes;
        let (_, out) = io.split_io();
        let mut sum = vec![0.0f32; out.len() / 4];
        topk::decode(&parts, &mut sum, post)?;
        for (o, v) in out.chunks_exact_mut(4).zip(&sum) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    act(None);
    Ok(())
}
