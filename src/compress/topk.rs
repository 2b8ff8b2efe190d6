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

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::store;
use crate::transport::cuda::StateMem;

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
    /// Allreduces of the tensor so far (for the warm-up's share: `TopK::k_at`).
    pub steps: u64,
    /// A GPU tensor's residual and momentum (its host vectors then stay empty).
    pub device: Option<OnDevice>,
}

/// A GPU tensor's residual and momentum (f32 each, `len` values), in device memory that
/// ferrovod allocated on GPU `ordinal`, zeros at first (`StateMem`: batches on other streams
/// wait for the last one that used it; freed in stream order when the store drops it).
#[derive(Clone)]
pub struct OnDevice {
    pub len: usize,
    pub ordinal: i32,
    pub buffers: Arc<[StateMem; 2]>,
}

impl OnDevice {
    pub fn residual(&self) -> &StateMem {
        &self.buffers[0]
    }

    pub fn momentum(&self) -> &StateMem {
        &self.buffers[1]
    }
}

impl std::fmt::Debug for OnDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OnDevice({} values on GPU {})", self.len, self.ordinal)
    }
}

impl PartialEq for OnDevice {
    fn eq(&self, other: &OnDevice) -> bool {
        Arc::ptr_eq(&self.buffers, &other.buffers)
    }
}

impl Memory {
    pub fn new(len: usize) -> Memory {
        Memory {
            residual: vec![0.0; len],
            momentum: vec![0.0; len],
            steps: 0,
            device: None,
        }
    }
}

/// Each tensor's `Memory`, per tensor name, bounded as `store` says (unnamed tensors keep
/// none).
pub type TopkMemory = store::Named<Memory>;

impl TopkMemory {
    /// `name`'s memory, taken out (zeros if none, or if the tensor's size changed).
    pub fn take(&self, name: &str, len: usize) -> Memory {
        self.take_or(name, |m| fits(m, len), || Memory::new(len))
    }

    /// `name`'s allreduces so far, as `take` would find them (the same on every rank: the
    /// ranks reduce the same names in the same order); none for unnamed tensors, which keep
    /// no memory, so no warm-up either.
    pub fn steps(&self, name: &str, len: usize) -> u64 {
        let of_len = |m: &&Memory| fits(m, len) || m.device.as_ref().is_some_and(|d| d.len == len);
        match crate::store::is_unnamed(name) {
            true => u64::MAX,
            false => self.peek(name, |m| m.filter(of_len).map_or(0, |m| m.steps)),
        }
    }

    /// `name`'s memory as a tensor of `len` values on GPU `ordinal`, taken out: None where it
    /// has none there yet (the caller allocates it, zeroed), or if the tensor's size or GPU
    /// changed.
    pub fn take_device(&self, name: &str, len: usize, ordinal: i32) -> Option<Memory> {
        let on =
            |m: &Memory| (m.device.as_ref()).is_some_and(|d| d.len == len && d.ordinal == ordinal);
        let m = self.take_or(name, on, Memory::default);
        m.device.is_some().then_some(m)
    }
}

/// Whether `m` is the memory of a tensor of `len` values (else the tensor starts afresh).
fn fits(m: &Memory, len: usize) -> bool {
    m.device.is_none() && m.residual.len() == len && m.momentum.len() == len
}

/// Where a tensor's gradient lies (little-endian f32 bytes): apart from the output, or in the
/// output's own buffer (an in-place allreduce). `select` zeroes the latter block by block
/// once it has read it, while it is in cache, so that `decode` adds onto zeros without a
/// pass of its own over the tensor.
pub enum Gradient<'a> {
    Kept(&'a [u8]),
    Cleared(&'a mut [u8]),
}

impl Gradient<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Gradient::Kept(g) => g,
            Gradient::Cleared(g) => g,
        }
    }
}

/// The local phase: `grad` is the gradient, taken times `scale`.
/// With momentum `m` > 0, u = m u + grad (else u = grad); v = the residual plus u; the `k`
/// entries of largest |v| (ties to the lower index, so the choice is the same wherever the
/// values are) are appended to `send` as pairs (`PAIR_BYTES` each) in index order, and removed
/// from v, which becomes the residual; the momentum of the sent entries is cleared.
pub fn select(
    mut grad: Gradient,
    scale: f32,
    mem: &mut Memory,
    k: usize,
    momentum: f32,
    send: &mut Vec<u8>,
) {
    let value = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * scale;
    let n = mem.residual.len();
    let k = k.min(n);
    // a large tensor: a sample of v gives a floor that at least k values are likely to reach;
    // the values at or above it are collected as v is formed, and the k are chosen among them
    let floor = (n >= DIRECT_BELOW && k > 0).then(|| {
        let grad = grad.bytes();
        let v_at = |i: usize| {
            let g = value(&grad[4 * i..4 * i + 4]);
            if momentum > 0.0 {
                mem.residual[i] + (momentum * mem.momentum[i] + g)
            } else {
                mem.residual[i] + g
            }
        };
        sampled_floor(n, k, v_at)
    });
    let mut reached = Vec::new();
    const BLOCK: usize = 4096;
    let mut blocks = mem
        .residual
        .chunks_mut(BLOCK)
        .zip(mem.momentum.chunks_mut(BLOCK));
    let mut block = |b: usize, gs: &[u8]| {
        let (vs, us) = blocks
            .next()
            .expect("a block of v per block of the gradient");
        accumulate(vs, us, gs, scale, momentum);
        if let Some(floor) = floor {
            reaching(vs, (b * BLOCK) as u32, floor, &mut reached);
        }
    };
    match &mut grad {
        Gradient::Kept(g) => g
            .chunks(BLOCK * 4)
            .enumerate()
            .for_each(|(b, gs)| block(b, gs)),
        Gradient::Cleared(g) => {
            for (b, gs) in g.chunks_mut(BLOCK * 4).enumerate() {
                block(b, gs);
                gs.fill(0);
            }
        }
    }
    let order = match floor {
        None => choose(&mem.residual, (0..n as u32).collect(), k),
        Some(_) if reached.len() >= k => choose(&mem.residual, reached, k),
        // the sample's floor was too high: count them all
        Some(_) => from_histogram(&mem.residual, k, &histogram(&mem.residual)),
    };
    send.reserve(order.len() * PAIR_BYTES);
    for &i in &order {
        let slot = &mut mem.residual[i as usize];
        send.extend_from_slice(&i.to_le_bytes());
        send.extend_from_slice(&slot.to_le_bytes());
        *slot = 0.0;
        if momentum > 0.0 {
            mem.momentum[i as usize] = 0.0;
        }
    }
}

/// v += u where u = `momentum` × u + g (`momentum` > 0), else v += g; g = `scale` × the
/// little-endian f32 values of `grad`.
#[inline(never)]
fn accumulate(v: &mut [f32], u: &mut [f32], grad: &[u8], scale: f32, momentum: f32) {
    let g = grad.chunks_exact(4);
    let value = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * scale;
    if momentum > 0.0 {
        for ((v, u), g) in v.iter_mut().zip(u.iter_mut()).zip(g) {
            *u = momentum * *u + value(g);
            *v += *u;
        }
    } else {
        for (v, g) in v.iter_mut().zip(g) {
            *v += value(g);
        }
    }
}

/// Appends `base` + i for every `v[i]` whose key reaches `floor`; groups of values none of
/// which reaches it (nearly all) cost one vector comparison, the others no branch per value.
#[inline(never)]
fn reaching(v: &[f32], base: u32, floor: u32, out: &mut Vec<u32>) {
    const GROUP: usize = 16;
    let mut push = |at: usize, group: &[f32]| {
        for (j, x) in group.iter().enumerate() {
            if key(*x) >= floor {
                out.push(base + (at + j) as u32);
            }
        }
    };
    let groups = v.chunks_exact(GROUP);
    let rest = groups.remainder();
    for (c, group) in groups.enumerate() {
        let group: &[f32; GROUP] = group.try_into().expect("a whole group");
        if group
            .iter()
            .fold(0u32, |n, x| n | u32::from(key(*x) >= floor))
            != 0
        {
            push(c * GROUP, group);
        }
    }
    push(v.len() - rest.len(), rest);
}

/// Below this many values `select` chooses among all indices directly; above, a histogram
/// narrows the choice to one bucket first.
const DIRECT_BELOW: usize = 1 << 16;

/// A magnitude's ordering is that of its bit pattern with the sign cleared (NaN's lies above
/// infinity's).
fn key(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// Larger magnitude first, then the lower index.
fn before(v: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    key(v[b as usize]).cmp(&key(v[a as usize])).then(a.cmp(&b))
}

/// Of `idx` (ascending indices of `v`, every one of the `k` largest among them), the `k` of
/// largest magnitude, ascending; ties to the lower index, NaN larger than any number.
fn choose(v: &[f32], mut idx: Vec<u32>, k: usize) -> Vec<u32> {
    if k >= idx.len() {
        return idx;
    }
    if k == 0 {
        return Vec::new();
    }
    // one word per candidate whose order is the choice's (the key, then the lower index), so
    // that the selection compares words instead of looking the values up; the k-th largest
    // word then picks the chosen in index order
    let word = |i: u32| (u64::from(key(v[i as usize])) << 32) | u64::from(u32::MAX - i);
    let mut words: Vec<u64> = idx.iter().map(|i| word(*i)).collect();
    let (_, kth, _) = words.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    let kth = *kth;
    idx.retain(|i| word(*i) >= kth);
    idx
}

/// One value in at least this many is sampled for `sampled_floor`, and about `SAMPLES` in all.
const SAMPLE_STRIDE: usize = 64;
const SAMPLES: usize = 4096;

/// A key that at least `k` of the `n` values (`v_at(i)`, i < n) likely reach: the key an evenly
/// spaced sample reaches at 1.25 times k's share, plus a margin. Only speed depends on it: `select`
/// counts exactly where too few reach it.
fn sampled_floor(n: usize, k: usize, v_at: impl Fn(usize) -> f32) -> u32 {
    let mut sample: Vec<u32> = (0..n)
        .step_by((n / SAMPLES).max(SAMPLE_STRIDE))
        .map(|i| key(v_at(i)))
        .collect();
    let m = sample.len();
    let want = (5 * k * m).div_ceil(4 * n) + 8;
    if want >= m {
        return 0;
    }
    let (_, nth, _) = sample.select_nth_unstable_by(want - 1, |a, b| b.cmp(a));
    *nth
}

/// How many of `v`'s keys fall in each bucket of their top 16 bits.
fn histogram(v: &[f32]) -> Vec<u32> {
    let mut counts = vec![0u32; 1 << 16];
    v.iter().for_each(|x| counts[(key(*x) >> 16) as usize] += 1);
    counts
}

/// The same choice as `choose` among all indices, for large tensors: `counts`, a histogram of the keys'
/// top 16 bits, finds the bucket that holds the k-th largest; only that bucket is sorted.
fn from_histogram(v: &[f32], k: usize, counts: &[u32]) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    // the bucket of the k-th largest, and how many lie above it
    let (mut bucket, mut above) = (counts.len(), 0);
    while bucket > 0 {
        bucket -= 1;
        if above + counts[bucket] as usize >= k {
            break;
        }
        above += counts[bucket] as usize;
    }
    let mut picked = Vec::with_capacity(k);
    let mut edge = Vec::with_capacity(counts[bucket] as usize);
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
        edge.select_nth_unstable_by(need - 1, |a, b| before(v, *a, *b));
    }
    picked.extend_from_slice(&edge[..need]);
    picked.sort_unstable();
    picked
}

/// The phase after the exchange: `out` (little-endian f32 bytes) = the sum over every rank's
/// pairs of `scale` × the value (`gathered`: each rank's encoded pairs, in rank order, so every
/// rank adds in the same order and gets the same values); `cleared`: `out` holds zeros
/// already (`Gradient::Cleared`). A malformed part (not whole pairs, an index beyond `out`)
/// is an error.
pub fn decode(gathered: &[&[u8]], out: &mut [u8], scale: f32, cleared: bool) -> Result<()> {
    if !cleared {
        out.fill(0);
    }
    let len = out.len() / 4;
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
            let slot: &mut [u8; 4] = out
                .get_mut(i * 4..i * 4 + 4)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "top-k pair from rank {rank} names value {i} of a tensor of {len}"
                    ))
                })?;
            *slot = (f32::from_le_bytes(*slot) + v * scale).to_le_bytes();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn encode(pairs: &[(u32, f32)]) -> Vec<u8> {
        pairs
            .iter()
            .flat_map(|(i, v)| i.to_le_bytes().into_iter().chain(v.to_le_bytes()))
            .collect()
    }

    /// `select` at scale 1, its pairs decoded.
    fn pick(g: &[f32], mem: &mut Memory, k: usize, momentum: f32) -> Vec<(u32, f32)> {
        let mut send = vec![0xAB]; // appended to, not replaced
        select(Gradient::Kept(&bytes(g)), 1.0, mem, k, momentum, &mut send);
        assert_eq!(send.remove(0), 0xAB);
        send.chunks_exact(PAIR_BYTES)
            .map(|p| {
                (
                    u32::from_le_bytes(p[..4].try_into().unwrap()),
                    f32::from_le_bytes(p[4..].try_into().unwrap()),
                )
            })
            .collect()
    }

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
            let pairs = pick(&g, &mut mem, 7, 0.0);
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
        let pairs = pick(&g, &mut mem, 1, 0.9);
        assert_eq!(pairs, vec![(1, -3.0)]);
        assert_eq!(mem.momentum, vec![1.0, 0.0, 0.5, 2.0]);
        assert_eq!(mem.residual, vec![1.0, 0.0, 0.5, 2.0]);
        // next step: u = 0.9 u + g, v = residual + u
        let pairs = pick(&g, &mut mem, 1, 0.9);
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
        let pairs = pick(&[1.0, -2.0, 2.0, 2.0, 0.0], &mut mem, 2, 0.0);
        assert_eq!(pairs, vec![(1, -2.0), (2, 2.0)]);
        let mut mem = Memory::new(3);
        let pairs = pick(&[1.0, f32::NAN, 5.0], &mut mem, 1, 0.0);
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].0, 1);
    }

    #[test]
    fn the_gathered_pairs_sum_alike_and_bad_bytes_are_refused() {
        let a = encode(&[(0, 1.0), (3, 2.0)]);
        let b = encode(&[(3, 4.0), (4, -1.0)]);
        let mut out = bytes(&[9.0f32; 5]);
        decode(&[&a, &b], &mut out, 0.5, false).unwrap();
        assert_eq!(floats(&out), vec![0.5, 0.0, 0.0, 3.0, -0.5]);
        assert!(decode(&[&a[..5]], &mut out, 1.0, false).is_err());
        let far = encode(&[(5, 1.0)]);
        assert!(decode(&[&far], &mut out, 1.0, false).is_err());
    }

    #[test]
    fn an_in_place_gradient_is_cleared_as_read_and_sums_alike() {
        // both sides of the sampled floor's size, with momentum and without
        for (n, momentum) in [(1000, 0.0), (DIRECT_BELOW + 12_345, 0.9)] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.01)
                .collect();
            let k = n / 50;
            let (mut kept, mut cleared) = (Memory::new(n), Memory::new(n));
            for step in 0..2 {
                let g = bytes(&v.iter().map(|x| x * (step + 1) as f32).collect::<Vec<_>>());
                let (mut a, mut b) = (Vec::new(), Vec::new());
                select(Gradient::Kept(&g), 0.5, &mut kept, k, momentum, &mut a);
                let mut buffer = g.clone();
                select(
                    Gradient::Cleared(&mut buffer),
                    0.5,
                    &mut cleared,
                    k,
                    momentum,
                    &mut b,
                );
                assert_eq!(a, b, "n {n} step {step}");
                assert_eq!(kept, cleared);
                assert!(buffer.iter().all(|x| *x == 0), "the buffer is cleared");
                // the sum onto the cleared buffer is the sum onto one filled first
                let other = encode(&[(0, 1.0), (n as u32 - 1, 2.0)]);
                let mut filled = bytes(&vec![7.0f32; n]);
                decode(&[&a, &other], &mut filled, 2.0, false).unwrap();
                decode(&[&b, &other], &mut buffer, 2.0, true).unwrap();
                assert_eq!(filled, buffer);
                assert!(floats(&buffer).iter().filter(|x| **x != 0.0).count() >= k);
            }
        }
    }

    fn largest_by_histogram(v: &[f32], k: usize) -> Vec<u32> {
        from_histogram(v, k, &histogram(v))
    }

    #[test]
    fn the_histogram_and_the_direct_choice_agree() {
        // many ties (few distinct magnitudes), NaN and both signs, at several k
        let n = DIRECT_BELOW + 4097;
        let v: Vec<f32> = (0..n)
            .map(|i| match i % 997 {
                0 => f32::NAN,
                j => ((j % 37) as f32 - 18.0) * 0.25,
            })
            .collect();
        for k in [1, 2, 37, 1000, n / 3, n - 1, n] {
            let all = choose(&v, (0..n as u32).collect(), k);
            assert_eq!(largest_by_histogram(&v, k), all, "k {k}");
            // and select's way, through the sampled floor
            let mut mem = Memory::new(n);
            let pairs = pick(&v, &mut mem, k, 0.0);
            assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), all, "k {k}");
        }
        let w: Vec<f64> = v.iter().map(|x| *x as f64).collect();
        let top = largest_by_histogram(&v, 500);
        assert_eq!(top.len(), 500);
        // all the NaNs first, then the largest magnitudes at the lower indices
        let nan = (0..n).filter(|i| i % 997 == 0).count();
        let rest: Vec<usize> = reference_top(
            &w.iter()
                .map(|x| if x.is_nan() { 0.0 } else { *x })
                .collect::<Vec<_>>(),
            500 - nan,
        );
        let mut want: Vec<u32> = (0..n).filter(|i| i % 997 == 0).map(|i| i as u32).collect();
        want.extend(rest.iter().map(|i| *i as u32));
        want.sort();
        assert_eq!(top, want);
    }

    #[test]
    fn the_gradient_is_scaled_on_the_way_in() {
        let mut mem = Memory::new(3);
        let mut send = Vec::new();
        select(
            Gradient::Kept(&bytes(&[2.0, -8.0, 1.0])),
            0.5,
            &mut mem,
            1,
            0.0,
            &mut send,
        );
        assert_eq!(send, encode(&[(1, -4.0)]));
        assert_eq!(mem.residual, vec![1.0, 0.0, 0.5]);
    }

    #[test]
    fn a_floor_too_high_falls_back_to_counting() {
        // the sampled values (every SAMPLE_STRIDE-th, for this n) are the large ones, so the sample's floor
        // is reached by far fewer than k values
        let n = 2 * DIRECT_BELOW;
        let v: Vec<f32> = (0..n)
            .map(|i| {
                if i % SAMPLE_STRIDE == 0 {
                    100.0
                } else {
                    (i % 7) as f32
                }
            })
            .collect();
        let k = n / 4;
        let floor = sampled_floor(n, k, |i| v[i]);
        assert!(v.iter().filter(|x| key(**x) >= floor).count() < k);
        let mut mem = Memory::new(n);
        let pairs = pick(&v, &mut mem, k, 0.0);
        let w: Vec<f64> = v.iter().map(|x| *x as f64).collect();
        let want: Vec<u32> = reference_top(&w, k).iter().map(|i| *i as u32).collect();
        assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), want);
    }
}
