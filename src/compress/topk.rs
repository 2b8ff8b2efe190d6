//! Top-k sparsification with error feedback and momentum correction (Deep Gradient
//! Compression, Lin et al., 2018): each rank sends only the k values of largest magnitude of
//! its gradient (plus what it held back before), as (index, value) pairs that every rank
//! gathers and adds up; what was not sent stays in a local residual and is added to the next
//! step's gradient. With momentum correction the residual accumulates the momentum-corrected
//! gradient, and the momentum of what was sent is cleared (factor masking), as the paper does.
//!
//! `select` is the local phase before the exchange, `decode` the one after; `k` is a function
//! of agreed data (the tensor's length and the job's ratio), so every rank sends the same
//! number of pairs and the exchange is an allgather of equal sizes.

use crate::error::{Error, Result};
use crate::store;

/// Bytes of one pair on the wire: a little-endian u32 index, then the f32 value.
pub(crate) const PAIR_BYTES: usize = 8;

/// Pairs sent for a tensor of `len` values at `ratio` (0 < ratio <= 1): at least one, at most
/// all of them.
pub fn k_of(len: usize, ratio: f64) -> Result<usize> {
    if !(ratio > 0.0 && ratio <= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "top-k ratio {ratio} is not in (0, 1]"
        )));
    }
    if len > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "top-k indexes at most {} values, the tensor has {len}",
            u32::MAX
        )));
    }
    Ok(((len as f64 * ratio).ceil() as usize).clamp(len.min(1), len))
}

/// What one tensor keeps between steps: the values not sent yet and, with momentum
/// correction, the momentum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Memory {
    pub residual: Vec<f32>,
    pub momentum: Vec<f32>,
}

impl Memory {
    pub fn new(len: usize) -> Memory {
        Memory {
            residual: vec![0.0; len],
            momentum: vec![0.0; len],
        }
    }
}

/// Each tensor's `Memory`, per tensor name, bounded as `store` says (unnamed tensors keep
/// none).
pub type TopkMemory = store::Named<Memory>;

impl TopkMemory {
    /// `name`'s memory, taken out (zeros if none, or if the tensor's size changed).
    pub fn take(&self, name: &str, len: usize) -> Memory {
        self.take_or(
            name,
            |m| m.residual.len() == len && m.momentum.len() == len,
            || Memory::new(len),
        )
    }
}

/// The local phase: with momentum `m` > 0, u = m u + `grad` (else u = `grad`); v = the
/// residual plus u; the `k` entries of largest |v| (ties to the lower index, so the choice is the same
/// wherever the values are) are returned as (index, value) in index order, and removed from
/// v, which becomes the residual; the momentum of the sent entries is cleared.
pub fn select(grad: &[f32], mem: &mut Memory, k: usize, momentum: f32) -> Vec<(u32, f32)> {
    let n = grad.len();
    if momentum > 0.0 {
        for (u, g) in mem.momentum.iter_mut().zip(grad) {
            *u = momentum * *u + g;
        }
        for (v, u) in mem.residual.iter_mut().zip(&mem.momentum) {
            *v += u;
        }
    } else {
        for (v, g) in mem.residual.iter_mut().zip(grad) {
            *v += g;
        }
    }
    let order = largest(&mem.residual, k.min(n));
    let pairs: Vec<(u32, f32)> = order
        .iter()
        .map(|&i| (i, mem.residual[i as usize]))
        .collect();
    for &(i, _) in &pairs {
        mem.residual[i as usize] = 0.0;
        if momentum > 0.0 {
            mem.momentum[i as usize] = 0.0;
        }
    }
    pairs
}

/// The indices of the `k` entries of largest magnitude of `v`, ascending; ties to the lower
/// index, NaN larger than any number. A magnitude's ordering is that of its bit pattern with
/// the sign cleared (NaN's lies above infinity's), so a histogram of the patterns' top 16 bits
/// finds the bucket that holds the k-th largest in one pass; only that bucket is sorted.
fn largest(v: &[f32], k: usize) -> Vec<u32> {
    let key = |x: f32| x.to_bits() & 0x7fff_ffff;
    if k == 0 {
        return Vec::new();
    }
    let mut counts = vec![0usize; 1 << 16];
    v.iter().for_each(|x| counts[(key(*x) >> 16) as usize] += 1);
    // the bucket of the k-th largest, and how many lie above it
    let (mut bucket, mut above) = (counts.len(), 0);
    while bucket > 0 {
        bucket -= 1;
        if above + counts[bucket] >= k {
            break;
        }
        above += counts[bucket];
    }
    let mut picked = Vec::with_capacity(k);
    let mut edge = Vec::with_capacity(counts[bucket]);
    for (i, x) in v.iter().enumerate() {
        let b = (key(*x) >> 16) as usize;
        if b > bucket {
            picked.push(i as u32);
        } else if b == bucket {
            edge.push(i as u32);
        }
    }
    // within the bucket: larger first, then the lower index
    let need = k - above;
    if need < edge.len() {
        edge.select_nth_unstable_by(need - 1, |a, b| {
            key(v[*b as usize]).cmp(&key(v[*a as usize])).then(a.cmp(b))
        });
    }
    picked.extend_from_slice(&edge[..need]);
    picked.sort_unstable();
    picked
}

/// The pairs as bytes for the exchange.
pub fn encode(pairs: &[(u32, f32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pairs.len() * PAIR_BYTES);
    for (i, v) in pairs {
        out.extend_from_slice(&i.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The phase after the exchange: `out` = `scale` × the sum of every rank's pairs (`gathered`:
/// each rank's encoded pairs, in rank order, so every rank adds in the same order and gets the
/// same values). A malformed part (not whole pairs, an index beyond `out`) is an error.
pub fn decode(gathered: &[&[u8]], out: &mut [f32], scale: f32) -> Result<()> {
    out.iter_mut().for_each(|v| *v = 0.0);
    for (rank, bytes) in gathered.iter().enumerate() {
        if bytes.len() % PAIR_BYTES != 0 {
            return Err(Error::Internal(format!(
                "top-k pairs from rank {rank}: {} bytes is not a whole number of pairs",
                bytes.len()
            )));
        }
        for pair in bytes.chunks_exact(PAIR_BYTES) {
            let i = u32::from_le_bytes(pair[..4].try_into().expect("4 bytes")) as usize;
            let v = f32::from_le_bytes(pair[4..].try_into().expect("4 bytes"));
            let len = out.len();
            let slot = out.get_mut(i).ok_or_else(|| {
                Error::Internal(format!(
                    "top-k pair from rank {rank} names value {i} of a tensor of {len}"
                ))
            })?;
            *slot += v;
        }
    }
    out.iter_mut().for_each(|v| *v *= scale);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        // distinct magnitudes in a scrambled order, some negative
        (0..n)
            .map(|i| {
                let h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    /// The choice written plainly in f64: indices sorted by magnitude, largest first, ties to
    /// the lower index; the first k, in index order.
    fn reference_top(v: &[f64], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|a, b| {
            v[*b]
                .abs()
                .partial_cmp(&v[*a].abs())
                .unwrap()
                .then(a.cmp(b))
        });
        let mut top: Vec<usize> = idx.into_iter().take(k).collect();
        top.sort();
        top
    }

    #[test]
    fn k_is_agreed_from_the_length_and_a_valid_ratio() {
        assert_eq!(k_of(1000, 0.01).unwrap(), 10);
        assert_eq!(k_of(1001, 0.01).unwrap(), 11); // rounded up
        assert_eq!(k_of(10, 1e-9).unwrap(), 1); // at least one
        assert_eq!(k_of(10, 1.0).unwrap(), 10);
        assert_eq!(k_of(0, 0.5).unwrap(), 0);
        for bad in [0.0, -0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(k_of(10, bad).is_err(), "{bad}");
        }
        assert!(k_of(u32::MAX as usize + 1, 0.5).is_err());
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn the_largest_magnitudes_go_and_the_rest_waits_in_the_residual() {
        let n = 200;
        let mut mem = Memory::new(n);
        let mut carried = vec![0.0f64; n];
        for t in 0..5 {
            let g = values(n, t);
            let v: Vec<f64> = g.iter().zip(&carried).map(|(g, e)| *g as f64 + e).collect();
            let pairs = select(&g, &mut mem, 7, 0.0);
            let want = reference_top(&v, 7);
            assert_eq!(pairs.iter().map(|p| p.0 as usize).collect::<Vec<_>>(), want);
            // sent + residual = input + last residual
            for i in 0..n {
                let sent = pairs
                    .iter()
                    .find(|p| p.0 as usize == i)
                    .map_or(0.0, |p| p.1);
                let total = sent as f64 + mem.residual[i] as f64;
                assert!((total - v[i]).abs() < 1e-5, "step {t} value {i}");
            }
            carried = mem.residual.iter().map(|e| *e as f64).collect();
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn momentum_correction_accumulates_and_masks_what_was_sent() {
        let g = [1.0f32, -3.0, 0.5, 2.0];
        let mut mem = Memory::new(4);
        let pairs = select(&g, &mut mem, 1, 0.9);
        assert_eq!(pairs, vec![(1, -3.0)]);
        assert_eq!(mem.momentum, vec![1.0, 0.0, 0.5, 2.0]);
        assert_eq!(mem.residual, vec![1.0, 0.0, 0.5, 2.0]);
        // next step: u = 0.9 u + g, v = residual + u
        let pairs = select(&g, &mut mem, 1, 0.9);
        let u = [1.9f32, -3.0, 0.95, 3.8];
        assert_eq!(pairs.len(), 1);
        assert!(
            pairs[0].0 == 3 && (pairs[0].1 - 5.8).abs() < 1e-6,
            "{pairs:?}"
        );
        for i in 0..4 {
            let want_u = if i == 3 { 0.0 } else { u[i] };
            assert!((mem.momentum[i] - want_u).abs() < 1e-6);
        }
        assert!((mem.residual[0] - 2.9).abs() < 1e-6 && mem.residual[3] == 0.0);
    }

    #[test]
    fn ties_go_to_the_lower_index_and_nan_is_sent() {
        let mut mem = Memory::new(5);
        let pairs = select(&[1.0, -2.0, 2.0, 2.0, 0.0], &mut mem, 2, 0.0);
        assert_eq!(pairs, vec![(1, -2.0), (2, 2.0)]);
        let mut mem = Memory::new(3);
        let pairs = select(&[1.0, f32::NAN, 5.0], &mut mem, 1, 0.0);
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].0, 1);
    }

    #[test]
    fn the_gathered_pairs_sum_alike_and_bad_bytes_are_refused() {
        let a = encode(&[(0, 1.0), (3, 2.0)]);
        let b = encode(&[(3, 4.0), (4, -1.0)]);
        let mut out = vec![9.0f32; 5];
        decode(&[&a, &b], &mut out, 0.5).unwrap();
        assert_eq!(out, vec![0.5, 0.0, 0.0, 3.0, -0.5]);
        assert!(decode(&[&a[..5]], &mut out, 1.0).is_err());
        let far = encode(&[(5, 1.0)]);
        assert!(decode(&[&far], &mut out, 1.0).is_err());
    }
}
