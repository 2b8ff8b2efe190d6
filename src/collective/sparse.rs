//! Top-k's allreduce (`compress::topk` holds its local phases): each tensor of the batch
//! selects its k pairs, every rank's pairs are gathered by an allgather (the same bytes from
//! every rank: k is agreed), and each tensor sums the pairs of every rank in rank order. On
//! GPUs (`device::sparse`, over `Pairs`) the batch travels in one allgather on the lane's
//! stream; in host memory it travels in pieces, each selected while the one before travels.

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::topk::{self, Gradient, TopkMemory};
use crate::compress::{Reduction, TopK};
use crate::error::{Error, Result};
use crate::message::Response;
use crate::transport::Transport;

/// Top-k's phases over GPU memory (`device::sparse`): what `run` orders. The host's `allreduce`
/// runs the same phases piece by piece on two threads instead.
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

/// A batch's step on GPUs: every tensor selects, one allgather of the
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

/// Pieces a host batch's exchange is cut into, at most: the selection of one piece runs while
/// the one before it travels.
const PIECES: usize = 4;
/// The least pairs' bytes a piece carries: below this an allgather of its own costs more in
/// latency than the overlap gains.
const MIN_PIECE_BYTES: usize = 256 << 10;

/// The batch's tensors cut into consecutive pieces of about equal pairs' bytes (tensor counts,
/// in order; one piece for a small batch): a pure function of the agreed `ks`, so every rank
/// makes the same allgathers.
pub fn pieces(ks: &[usize]) -> Vec<usize> {
    let total: usize = ks.iter().sum::<usize>() * topk::PAIR_BYTES;
    let n = (total / MIN_PIECE_BYTES)
        .clamp(1, PIECES)
        .min(ks.len().max(1));
    let mut counts = Vec::with_capacity(n);
    let (mut taken, mut bytes) = (0, 0);
    for (i, k) in ks.iter().enumerate() {
        bytes += k * topk::PAIR_BYTES;
        taken += 1;
        // a piece ends once the batch's bytes so far reach its share of the total
        let piece_ends = bytes * n >= total * (counts.len() + 1) && counts.len() + 1 < n;
        if piece_ends && i + 1 < ks.len() {
            counts.push(taken);
            taken = 0;
        }
    }
    counts.push(taken);
    counts
}

/// Allreduces a batch of f32 sums or averages in host memory (`red`: top-k's `Reduction`) as
/// each rank's largest values at `params`' ratio (a larger share over each named tensor's first
/// `warmup` allreduces: `TopK::k_at`), each tensor's residual and momentum kept in `store`.
/// The batch travels in `pieces`: a helper thread selects piece after piece while this thread
/// gathers and sums the ones already selected, so the selection hides behind the link.
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
    let select = Select {
        red,
        momentum: params.momentum(),
        store,
    };
    let counts = pieces(&ks);
    let expected = counts.len();
    act(Some("TOPK_SELECT"));
    if expected == 1 {
        let outcome = exchange(t, red, select.piece(resps, ios, &ks), act);
        act(None);
        return outcome;
    }
    let ks = &ks[..];
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<Piece>();
        let selector = s.spawn(move || {
            let (mut resps, mut ios, mut ks) = (resps, ios, ks);
            for n in counts {
                let (r, rest_r) = resps.split_at(n);
                let (io, rest_io) = std::mem::take(&mut ios).split_at_mut(n);
                let (k, rest_k) = ks.split_at(n);
                (resps, ios, ks) = (rest_r, rest_io, rest_k);
                // the receiver stops taking pieces only after an error of its own
                if tx.send(select.piece(r, io, k)).is_err() {
                    break;
                }
            }
        });
        let mut outcome = Ok(());
        let mut got = 0;
        for piece in rx.iter() {
            got += 1;
            outcome = exchange(t, red, piece, act);
            if outcome.is_err() {
                break;
            }
            if got < expected {
                act(Some("TOPK_SELECT"));
            }
        }
        drop(rx);
        let joined = selector.join();
        act(None);
        outcome?;
        match joined {
            Ok(()) if got == expected => Ok(()),
            _ => Err(Error::Internal(
                "top-k's selection stopped before the batch's last piece".into(),
            )),
        }
    })
}

/// What selecting needs besides the tensors: shared by the helper thread.
#[derive(Clone, Copy)]
struct Select<'a> {
    red: &'a Reduction,
    momentum: f32,
    store: &'a TopkMemory,
}

/// Some consecutive tensors of a batch, selected: this rank's pairs of them, ready to travel.
struct Piece<'a, 'b> {
    ios: &'a mut [&'b mut dyn TensorIo],
    ks: &'a [usize],
    send: Vec<u8>,
    /// Per tensor: whether its output holds zeros already (an in-place gradient, cleared as
    /// it was read: `Gradient::Cleared`).
    cleared: Vec<bool>,
}

impl Select<'_> {
    /// Selects the `ks[i]` pairs of each tensor `ios[i]` (named `resps[i]`), updating and
    /// keeping its residual and momentum.
    fn piece<'a, 'b>(
        &self,
        resps: &[&Response],
        ios: &'a mut [&'b mut dyn TensorIo],
        ks: &'a [usize],
    ) -> Piece<'a, 'b> {
        let bytes = ks.iter().sum::<usize>() * topk::PAIR_BYTES;
        let (mut send, mut cleared) = (Vec::with_capacity(bytes), Vec::with_capacity(ks.len()));
        for ((r, io), k) in resps.iter().zip(ios.iter_mut()).zip(ks) {
            let mut memory = self.store.take(&r.name, io.input().len() / 4);
            memory.steps = memory.steps.saturating_add(1);
            let grad = match io.split_io() {
                (Some(input), _) => Gradient::Kept(input),
                (None, out) => Gradient::Cleared(out),
            };
            cleared.push(matches!(grad, Gradient::Cleared(_)));
            let pre = self.red.pre as f32;
            topk::select(grad, pre, &mut memory, *k, self.momentum, &mut send);
            self.store.put(&r.name, memory);
        }
        Piece {
            ios,
            ks,
            send,
            cleared,
        }
    }
}

/// A selected piece's allgather (MPI's), then each of its tensors' sum of every rank's pairs.
fn exchange(t: &dyn Transport, red: &Reduction, p: Piece, act: ActivitySink) -> Result<()> {
    act(Some("TOPK_ALLGATHER"));
    let (n, each) = (t.size(), p.send.len());
    let mut gathered = vec![0u8; each * n];
    t.allgatherv(Some(&p.send), &mut gathered, &vec![each; n])?;
    act(Some("TOPK_SUM"));
    let mut at = 0;
    for ((io, k), cleared) in p.ios.iter_mut().zip(p.ks).zip(p.cleared) {
        let bytes = k * topk::PAIR_BYTES;
        let parts: Vec<&[u8]> = (0..n)
            .map(|r| &gathered[r * each + at..r * each + at + bytes])
            .collect();
        topk::decode(&parts, io.split_io().1, red.post as f32, cleared)?;
        at += bytes;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces cover the batch in order, none empty, at most `PIECES`.
    fn check(ks: &[usize]) -> Vec<usize> {
        let counts = pieces(ks);
        assert_eq!(
            counts.iter().sum::<usize>(),
            ks.len(),
            "{ks:?} -> {counts:?}"
        );
        assert!(
            counts.len() <= PIECES && counts.iter().all(|c| *c > 0),
            "{counts:?}"
        );
        counts
    }

    #[test]
    fn a_small_batch_travels_whole() {
        assert_eq!(check(&[10, 20, 30]), vec![3]);
        let just_under = MIN_PIECE_BYTES / topk::PAIR_BYTES * 2 - 1;
        assert_eq!(check(&[just_under]), vec![1]);
        assert_eq!(check(&[just_under / 2, just_under / 2]), vec![2]);
    }

    #[test]
    fn a_large_batch_splits_into_equal_shares() {
        // 40 tensors of 64 Ki pairs (512 KiB each): four pieces of ten
        assert_eq!(check(&[1 << 16; 40]), vec![10; 4]);
        // two pieces' worth: two pieces
        let k = MIN_PIECE_BYTES / topk::PAIR_BYTES;
        assert_eq!(check(&[k / 2; 4]), vec![2, 2]);
        // one tensor holding most of the bytes ends its piece; the rest share what is left
        let counts = check(&[1 << 20, 10, 10, 1 << 18, 1 << 18, 1 << 18, 1 << 18]);
        assert_eq!(counts[0], 1, "{counts:?}");
    }

    #[test]
    fn a_single_tensor_is_one_piece_whatever_its_size() {
        assert_eq!(check(&[1 << 24]), vec![1]);
    }

    #[test]
    fn resnet50s_set_makes_four_pieces() {
        // the shapes' sizes in resnet50_grads.tsv order are not needed: any 161 tensors whose
        // pairs outweigh four minimum pieces make four
        let ks: Vec<usize> = (0..161).map(|i| 1000 + (i * 7919) % 40_000).collect();
        assert_eq!(check(&ks).len(), PIECES);
    }
}
