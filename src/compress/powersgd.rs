//! PowerSGD (Vogels, Karimireddy and Jaggi, 2019): a gradient seen as a matrix M (its first
//! dimension by the rest) travels as two thin factors of `rank` columns, P = M Q and
//! Q = Mᵀ P, each summed over the ranks, instead of M itself. One step of power iteration per
//! training step, with Q carried over from the last one (warm start), keeps the factors close
//! to M's leading subspace; what the approximation misses is added to the next step's gradient
//! (error feedback), so it is delayed rather than lost.
//!
//! A step is three local phases around the two sums, so that the runtime can sum every
//! tensor's P of a batch in one allreduce and every Q in another: `start` (M = gradient +
//! residual, P = M Q), `middle` (after P is summed: orthogonalise P, Q = Mᵀ P) and `finish`
//! (after Q is summed: the average's approximation P Qᵀ / ranks, and the new residual).
//! Everything here is a function of agreed data (the shape, the rank, a seed) and of the
//! rank's own values, so the ranks' factors and approximations agree.

use std::sync::Arc;

use crate::store;
use crate::transport::cuda::StateMem;

/// A tensor's matrix view and its factors' width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub rows: usize,
    pub cols: usize,
    /// Columns of P and Q: the asked rank, at most the matrix's smaller side.
    pub rank: usize,
}

impl Shape {
    /// The matrix of a tensor of `dims` under rank `rank`: its first dimension by the rest.
    /// None (the tensor travels uncompressed): a vector or a scalar, a rank of 0, or a matrix
    /// whose factors would not be smaller than it.
    pub fn of(dims: &[i64], rank: usize) -> Option<Shape> {
        if dims.len() < 2 || rank == 0 || dims.iter().any(|d| *d <= 0) {
            return None;
        }
        let rows = dims[0] as usize;
        let cols = dims[1..]
            .iter()
            .try_fold(1usize, |acc, d| acc.checked_mul(*d as usize))?;
        let rank = rank.min(rows).min(cols);
        let factors = rows.checked_add(cols)?.checked_mul(rank)?;
        (factors < rows.checked_mul(cols)?).then_some(Shape { rows, cols, rank })
    }

    /// Values of M.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values of P (rows × rank, row-major).
    pub fn p_len(&self) -> usize {
        self.rows * self.rank
    }

    /// Values of Q (cols × rank, row-major).
    pub fn q_len(&self) -> usize {
        self.cols * self.rank
    }
}

/// What one tensor keeps from step to step: the residual of its last step and its Q.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Memory {
    pub residual: Vec<f32>,
    pub q: Vec<f32>,
    /// The agreed seed of Q's draws, and the draws so far (a column of Q that vanished is
    /// drawn again: `finish`).
    pub seed: u64,
    pub draws: u64,
    /// Allreduces of the tensor so far (those of its first steps that travelled uncompressed
    /// included: `PowerMemory::warming`).
    pub steps: u64,
    /// A GPU tensor's state (its host vectors then stay empty).
    pub device: Option<OnDevice>,
}

/// Where a GPU tensor's memory lives: its matrix view, its GPU, and from its first compressed
/// step its residual, Q and Q's redraws there (`DeviceFactors`).
#[derive(Clone, Debug, PartialEq)]
pub struct OnDevice {
    pub shape: Shape,
    pub ordinal: i32,
    pub factors: Option<DeviceFactors>,
}

/// A GPU tensor's residual (rows × cols f32), Q (cols × rank f32) and the count of Q's column
/// redraws (a u64), in device memory that ferrovod allocated (`StateMem`: batches on other
/// streams wait for the last one that used it; freed in stream order when the store drops
/// it).
#[derive(Clone)]
pub struct DeviceFactors(pub Arc<[StateMem; 3]>);

impl DeviceFactors {
    pub fn residual(&self) -> &StateMem {
        &self.0[0]
    }

    pub fn q(&self) -> &StateMem {
        &self.0[1]
    }

    pub fn draws(&self) -> &StateMem {
        &self.0[2]
    }
}

impl std::fmt::Debug for DeviceFactors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceFactors({:#x})", self.residual().range().ptr())
    }
}

impl PartialEq for DeviceFactors {
    fn eq(&self, other: &DeviceFactors) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Memory {
    /// A first step's memory: no residual, and Q with orthonormal columns drawn from `seed`
    /// (which every rank must pass alike, e.g. a fingerprint of the tensor's name).
    pub fn new(shape: &Shape, seed: u64) -> Memory {
        let mut rng = SplitMix(seed);
        let mut q: Vec<f32> = (0..shape.q_len()).map(|_| rng.normal()).collect();
        orthogonalize(&mut q, shape.cols, shape.rank);
        Memory {
            residual: vec![0.0; shape.len()],
            q,
            seed,
            draws: 0,
            steps: 0,
            device: None,
        }
    }
}

/// Each tensor's `Memory`, per tensor name: the residual and the warm-started Q of its last
/// step, bounded as `store` says (unnamed tensors keep none: each call starts afresh). Used in
/// the agreed batch order, so every rank keeps and drops the same Q.
pub type PowerMemory = store::Named<Memory>;

impl PowerMemory {
    /// Whether `name` travels uncompressed this time: one of its first `start` allreduces
    /// (counted in its memory, alike on every rank: the ranks reduce the same names in the same
    /// order). Unnamed tensors keep no count, so no first steps: they compress from the first.
    pub fn warming(&self, name: &str, shape: &Shape, start: u64) -> bool {
        let of_shape =
            |m: &&Memory| fits(m, shape) || m.device.as_ref().is_some_and(|d| d.shape == *shape);
        let steps = |m: Option<&Memory>| m.filter(of_shape).map_or(0, |m| m.steps);
        start > 0 && !store::is_unnamed(name) && self.peek(name, steps) < start
    }

    /// `name`'s memory, taken out (a first step's if none, or if the tensor's shape changed).
    pub fn take(&self, name: &str, shape: &Shape) -> Memory {
        self.take_or(
            name,
            |m| fits(m, shape),
            || Memory::new(shape, store::fingerprint(&name)),
        )
    }

    /// `name`'s memory as a tensor of `shape` on GPU `ordinal`, taken out: a fresh one (whose
    /// factors the caller allocates and starts on the GPU) if none, or if the tensor's shape
    /// or GPU changed.
    pub fn take_device(&self, name: &str, shape: &Shape, ordinal: i32) -> Memory {
        let on = |m: &Memory| {
            (m.device.as_ref()).is_some_and(|d| d.shape == *shape && d.ordinal == ordinal)
        };
        self.take_or(name, on, || Memory {
            seed: store::fingerprint(&name),
            device: Some(OnDevice {
                shape: *shape,
                ordinal,
                factors: None,
            }),
            ..Memory::default()
        })
    }
}

/// Whether `m` is the memory of a tensor of `shape` (else the tensor starts afresh).
fn fits(m: &Memory, shape: &Shape) -> bool {
    m.device.is_none() && m.residual.len() == shape.len() && m.q.len() == shape.q_len()
}

/// Phase one: M = `pre` × `grad` (little-endian f32 bytes) + the residual, written over the
/// residual in `mem` (one pass, no copy of the tensor), and P = M Q, returned to be summed over
/// the ranks.
pub fn start(grad: &[u8], pre: f32, mem: &mut Memory, s: &Shape) -> Vec<f32> {
    let mut p = vec![0.0f32; s.p_len()];
    // the factors' width as a constant where it is a usual one: the inner products unroll
    match s.rank {
        1 => start_k::<1>(grad, pre, mem, s, &mut p),
        2 => start_k::<2>(grad, pre, mem, s, &mut p),
        4 => start_k::<4>(grad, pre, mem, s, &mut p),
        8 => start_k::<8>(grad, pre, mem, s, &mut p),
        _ => start_k::<0>(grad, pre, mem, s, &mut p),
    }
    p
}

/// `start` with `K` = the rank (0: any rank, read from `s`).
fn start_k<const K: usize>(grad: &[u8], pre: f32, mem: &mut Memory, s: &Shape, p: &mut [f32]) {
    // K itself where it is one, so that each chunk's length is a constant
    let k = if K > 0 { K } else { s.rank };
    let rows = (mem.residual.chunks_exact_mut(s.cols)).zip(grad.chunks_exact(4 * s.cols));
    for ((m, g), out) in rows.zip(p.chunks_exact_mut(k)) {
        if K > 0 {
            out.copy_from_slice(&row_times_q::<K>(m, g, pre, &mem.q));
            continue;
        }
        for ((v, g), q) in m
            .iter_mut()
            .zip(g.chunks_exact(4))
            .zip(mem.q.chunks_exact(k))
        {
            *v += f32::from_le_bytes([g[0], g[1], g[2], g[3]]) * pre;
            out.iter_mut().zip(q).for_each(|(o, q)| *o += *v * q);
        }
    }
}

/// One row of M formed (`m` += `pre` × `g`) and its product with Q (`q`: cols × K). The
/// columns go four at a time into four sums, added at the end: one running sum would make
/// every product wait for the previous addition.
fn row_times_q<const K: usize>(m: &mut [f32], g: &[u8], pre: f32, q: &[f32]) -> [f32; K] {
    const LANES: usize = 4;
    let value = |g: &[u8]| f32::from_le_bytes([g[0], g[1], g[2], g[3]]) * pre;
    let mut acc = [[0.0f32; K]; LANES];
    let mut ms = m.chunks_exact_mut(LANES);
    let mut gs = g.chunks_exact(4 * LANES);
    let mut qs = q.chunks_exact(K * LANES);
    for ((m, g), q) in (&mut ms).zip(&mut gs).zip(&mut qs) {
        for lane in 0..LANES {
            m[lane] += value(&g[4 * lane..4 * lane + 4]);
            let v = m[lane];
            (0..K).for_each(|c| acc[lane][c] += v * q[K * lane + c]);
        }
    }
    let mut sum = [0.0f32; K];
    for ((v, g), q) in ms
        .into_remainder()
        .iter_mut()
        .zip(gs.remainder().chunks_exact(4))
        .zip(qs.remainder().chunks_exact(K))
    {
        *v += value(g);
        (0..K).for_each(|c| sum[c] += *v * q[c]);
    }
    for a in acc {
        (0..K).for_each(|c| sum[c] += a[c]);
    }
    sum
}

/// Phase two, once `p` holds the ranks' sum: P's columns made orthonormal (in place), and
/// Q = Mᵀ P (returned, to be summed over the ranks), M being what `start` left in `mem`.
pub fn middle(mem: &Memory, p: &mut [f32], s: &Shape) -> Vec<f32> {
    orthogonalize(p, s.rows, s.rank);
    let mut q = vec![0.0f32; s.q_len()];
    match s.rank {
        1 => middle_k::<1>(mem, p, s, &mut q),
        2 => middle_k::<2>(mem, p, s, &mut q),
        4 => middle_k::<4>(mem, p, s, &mut q),
        8 => middle_k::<8>(mem, p, s, &mut q),
        _ => middle_k::<0>(mem, p, s, &mut q),
    }
    q
}

/// `middle`'s product with `K` = the rank (0: any rank).
fn middle_k<const K: usize>(mem: &Memory, p: &[f32], s: &Shape, q: &mut [f32]) {
    if K == 0 {
        let k = s.rank;
        for (m, pr) in mem.residual.chunks_exact(s.cols).zip(p.chunks_exact(k)) {
            for (v, out) in m.iter().zip(q.chunks_exact_mut(k)) {
                out.iter_mut().zip(pr).for_each(|(o, p)| *o += v * p);
            }
        }
        return;
    }
    // four rows of M per pass over Qᵀ (rank × cols): each of its values is read and written
    // once for four values of M, and each pass goes along the rows (vector code)
    let row = |r: &[f32]| -> [f32; K] { r.try_into().expect("a row of P") };
    let n = s.cols;
    let mut qt = vec![0.0f32; q.len()];
    let mut ms = mem.residual.chunks_exact(4 * n);
    let mut ps = p.chunks_exact(4 * K);
    for (m, pr) in (&mut ms).zip(&mut ps) {
        let (m01, m23) = m.split_at(2 * n);
        let ((m0, m1), (m2, m3)) = (m01.split_at(n), m23.split_at(n));
        let (p0, p1, p2, p3) = (
            row(&pr[..K]),
            row(&pr[K..2 * K]),
            row(&pr[2 * K..3 * K]),
            row(&pr[3 * K..]),
        );
        for (c, t) in qt.chunks_exact_mut(n).enumerate() {
            let values = m0.iter().zip(m1).zip(m2).zip(m3);
            for ((((a, b), cc), d), o) in values.zip(t.iter_mut()) {
                *o += a * p0[c] + b * p1[c] + cc * p2[c] + d * p3[c];
            }
        }
    }
    let rest = ms
        .remainder()
        .chunks_exact(n)
        .zip(ps.remainder().chunks_exact(K));
    for (m, pr) in rest {
        for (c, t) in qt.chunks_exact_mut(n).enumerate() {
            t.iter_mut().zip(m).for_each(|(o, v)| *o += v * pr[c]);
        }
    }
    for (c, t) in qt.chunks_exact(n).enumerate() {
        t.iter().enumerate().for_each(|(j, v)| q[j * K + c] = *v);
    }
}

/// Phase three, once `q_sum` holds the ranks' sum: `out` (little-endian f32 bytes) = `post` ×
/// P Qᵀ with Q the ranks' average (the approximation of the average of the ranks' M), the
/// residual M − P Qᵀ written over M in `mem`, and the averaged Q kept for the next step.
pub fn finish(
    p: &[f32],
    mut q_sum: Vec<f32>,
    ranks: usize,
    post: f32,
    mem: &mut Memory,
    out: &mut [u8],
    s: &Shape,
) {
    let k = s.rank;
    let scale = 1.0 / ranks.max(1) as f32;
    q_sum.iter_mut().for_each(|v| *v *= scale);
    match k {
        1 => finish_k::<1>(p, &q_sum, post, mem, out, s),
        2 => finish_k::<2>(p, &q_sum, post, mem, out, s),
        4 => finish_k::<4>(p, &q_sum, post, mem, out, s),
        8 => finish_k::<8>(p, &q_sum, post, mem, out, s),
        _ => finish_k::<0>(p, &q_sum, post, mem, out, s),
    }
    // a column of P that vanished (M of lower rank than the factors) gave a zero column of
    // Q, which the next step's P = M Q would keep at zero for good: it is drawn again, alike
    // on every rank (the sum is agreed, and so are the seed and the draws)
    for c in 0..k {
        if (0..s.cols).all(|j| q_sum[j * k + c] == 0.0) {
            mem.draws += 1;
            let mut rng = SplitMix(mem.seed ^ mem.draws.wrapping_mul(REDRAW));
            (0..s.cols).for_each(|j| q_sum[j * k + c] = rng.normal());
        }
    }
    mem.q = q_sum;
}

/// `finish`'s product and residual with `K` = the rank (0: any rank). Each value of a row of
/// P Qᵀ is `K` products with values of Qᵀ (rank × cols) taken along the row, summed in the
/// order c = 0, 1, …: vector code along the row, where a dot product per value with a row of
/// Q (cols × rank) would not be.
fn finish_k<const K: usize>(
    p: &[f32],
    q: &[f32],
    post: f32,
    mem: &mut Memory,
    out: &mut [u8],
    s: &Shape,
) {
    // K itself where it is one, so that each chunk's length is a constant
    let k = if K > 0 { K } else { s.rank };
    let n = s.cols;
    let qt = transpose(q, k);
    let rows = (mem.residual.chunks_exact_mut(n)).zip(out.chunks_exact_mut(4 * n));
    for ((m, o), pr) in rows.zip(p.chunks_exact(k)) {
        let values = m.iter_mut().zip(o.chunks_exact_mut(4)).enumerate();
        if K == 0 {
            for (j, (v, o)) in values {
                let a = (1..k).fold(pr[0] * qt[j], |a, c| a + pr[c] * qt[c * n + j]);
                o.copy_from_slice(&(a * post).to_le_bytes());
                *v -= a;
            }
            continue;
        }
        let t: [&[f32]; K] = std::array::from_fn(|c| &qt[c * n..(c + 1) * n]);
        let pr: [f32; K] = std::array::from_fn(|c| pr[c]);
        for (j, (v, o)) in values {
            let a = (1..K).fold(pr[0] * t[0][j], |a, c| a + pr[c] * t[c][j]);
            o.copy_from_slice(&(a * post).to_le_bytes());
            *v -= a;
        }
    }
}

/// Q (cols × `k`, row-major) as `k` rows of `cols`: Qᵀ.
fn transpose(q: &[f32], k: usize) -> Vec<f32> {
    let cols = q.len() / k.max(1);
    let mut qt = vec![0.0f32; q.len()];
    for (j, qr) in q.chunks_exact(k).enumerate() {
        qr.iter()
            .enumerate()
            .for_each(|(c, v)| qt[c * cols + j] = *v);
    }
    qt
}

/// Gram-Schmidt on the `cols` columns of a row-major `rows` × `cols` matrix: each column
/// normalised, then removed from the ones after it. A column that the earlier ones (nearly)
/// span becomes zero: what is left of it is rounding, which normalised would be a direction
/// of no meaning and not orthogonal to the others (a matrix of lower rank than the factors
/// would then come back wrong).
pub fn orthogonalize(a: &mut [f32], rows: usize, cols: usize) {
    const EPS: f32 = 1e-8;
    // left of a column, relative to its norm before the projections, below which it is rounding
    const SPANNED: f32 = 1e-4;
    let norm_of = |a: &[f32], c: usize| {
        (0..rows)
            .map(|r| a[r * cols + c] * a[r * cols + c])
            .sum::<f32>()
            .sqrt()
    };
    let before: Vec<f32> = (0..cols).map(|c| norm_of(a, c)).collect();
    for c in 0..cols {
        let norm = norm_of(a, c);
        if norm <= SPANNED * before[c] {
            (0..rows).for_each(|r| a[r * cols + c] = 0.0);
            continue;
        }
        for r in 0..rows {
            a[r * cols + c] /= norm + EPS;
        }
        for d in c + 1..cols {
            let dot: f32 = (0..rows).map(|r| a[r * cols + c] * a[r * cols + d]).sum();
            for r in 0..rows {
                a[r * cols + d] -= dot * a[r * cols + c];
            }
        }
    }
}

/// What a redraw's count is multiplied by before it is mixed into the tensor's seed: the
/// generator of the `draws`-th redraw of a column starts at `seed ^ draws × REDRAW` (the GPU
/// kernels draw alike).
pub(crate) const REDRAW: u64 = 0xD1B5_4A32_D192_ED03;

/// A small generator for Q's first values: the same sequence from the same seed everywhere.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The algorithm again, in f64 and written plainly (matrices as Vec<Vec<f64>>): the
    /// reference the f32 phases are held to.
    struct Reference {
        rows: usize,
        cols: usize,
        rank: usize,
        residual: Vec<Vec<Vec<f64>>>, // per rank
        q: Vec<Vec<f64>>,             // cols × rank, agreed
    }

    // indices as the formulas write them
    #[allow(clippy::needless_range_loop)]
    impl Reference {
        fn step(&mut self, grads: &[Vec<f64>]) -> (Vec<Vec<f64>>, Vec<Vec<Vec<f64>>>) {
            let (n, m, r) = (self.rows, self.cols, self.rank);
            let ms: Vec<Vec<Vec<f64>>> = grads
                .iter()
                .zip(&self.residual)
                .map(|(g, e)| {
                    (0..n)
                        .map(|i| (0..m).map(|j| g[i * m + j] + e[i][j]).collect())
                        .collect()
                })
                .collect();
            // P = Σ_ranks M Q
            let mut p = vec![vec![0.0; r]; n];
            for mm in &ms {
                for i in 0..n {
                    for k in 0..r {
                        p[i][k] += (0..m).map(|j| mm[i][j] * self.q[j][k]).sum::<f64>();
                    }
                }
            }
            // Gram-Schmidt on P's columns
            for c in 0..r {
                let norm = (0..n).map(|i| p[i][c] * p[i][c]).sum::<f64>().sqrt();
                for row in p.iter_mut() {
                    row[c] /= norm + 1e-8;
                }
                for d in c + 1..r {
                    let dot: f64 = (0..n).map(|i| p[i][c] * p[i][d]).sum();
                    for row in p.iter_mut() {
                        row[d] -= dot * row[c];
                    }
                }
            }
            // Q = (Σ_ranks Mᵀ P) / ranks
            let mut q = vec![vec![0.0; r]; m];
            for mm in &ms {
                for j in 0..m {
                    for k in 0..r {
                        q[j][k] += (0..n).map(|i| mm[i][j] * p[i][k]).sum::<f64>();
                    }
                }
            }
            let ranks = grads.len() as f64;
            q.iter_mut().flatten().for_each(|v| *v /= ranks);
            let out: Vec<Vec<f64>> = (0..n)
                .map(|i| {
                    (0..m)
                        .map(|j| (0..r).map(|k| p[i][k] * q[j][k]).sum())
                        .collect()
                })
                .collect();
            for (e, mm) in self.residual.iter_mut().zip(&ms) {
                for i in 0..n {
                    for j in 0..m {
                        e[i][j] = mm[i][j] - out[i][j];
                    }
                }
            }
            self.q = q;
            (out, self.residual.clone())
        }
    }

    /// The phases on `ranks` simulated ranks, the sums done here as the allreduces would.
    fn step(grads: &[Vec<f32>], mems: &mut [Memory], s: &Shape) -> Vec<Vec<f32>> {
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let started: Vec<Vec<f32>> = grads
            .iter()
            .zip(mems.iter_mut())
            .map(|(g, mem)| start(&bytes(g), 1.0, mem, s))
            .collect();
        let p_sum: Vec<f32> = (0..s.p_len())
            .map(|i| started.iter().map(|p| p[i]).sum())
            .collect();
        let mut ps = vec![p_sum; grads.len()];
        let qs: Vec<Vec<f32>> = (mems.iter().zip(ps.iter_mut()))
            .map(|(mem, p)| middle(mem, p, s))
            .collect();
        let q_sum: Vec<f32> = (0..s.q_len())
            .map(|i| qs.iter().map(|q| q[i]).sum())
            .collect();
        let mut outs = Vec::new();
        for (k, mem) in mems.iter_mut().enumerate() {
            let mut out = vec![0u8; 4 * s.len()];
            finish(&ps[k], q_sum.clone(), grads.len(), 1.0, mem, &mut out, s);
            outs.push(
                out.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            );
        }
        outs
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix(seed);
        (0..n).map(|_| g.normal()).collect()
    }

    #[test]
    fn tensors_become_matrices_of_their_first_dimension_by_the_rest() {
        assert_eq!(
            Shape::of(&[64, 3, 3, 3], 4),
            Some(Shape {
                rows: 64,
                cols: 27,
                rank: 4
            })
        );
        // the rank is at most the smaller side
        assert_eq!(Shape::of(&[100, 2], 4), None); // factors (200 + 4) not below 200
        assert_eq!(Shape::of(&[1000, 100], 20).map(|s| s.rank), Some(20));
        assert_eq!(Shape::of(&[1000, 100], 200), None); // rank 100: factors 110,000 values
        assert_eq!(Shape::of(&[100, 50], 80), None);
        // vectors, scalars, empty tensors and rank 0 travel uncompressed
        for dims in [&[1000][..], &[], &[0, 10], &[10, 0, 3]] {
            assert_eq!(Shape::of(dims, 4), None, "{dims:?}");
        }
        assert_eq!(Shape::of(&[64, 64], 0), None);
        assert_eq!(Shape::of(&[i64::MAX, i64::MAX], 4), None);
    }

    #[test]
    fn three_ranks_over_three_steps_match_an_f64_reference() {
        let s = Shape::of(&[7, 2, 3], 2).unwrap();
        assert_eq!((s.rows, s.cols, s.rank), (7, 6, 2));
        let ranks = 3;
        let mut mems: Vec<Memory> = (0..ranks).map(|_| Memory::new(&s, 11)).collect();
        assert!(
            mems.windows(2).all(|w| w[0] == w[1]),
            "Q agreed from the seed"
        );
        let mut reference = Reference {
            rows: s.rows,
            cols: s.cols,
            rank: s.rank,
            residual: vec![vec![vec![0.0; s.cols]; s.rows]; ranks],
            q: (0..s.cols)
                .map(|j| {
                    (0..s.rank)
                        .map(|k| mems[0].q[j * s.rank + k] as f64)
                        .collect()
                })
                .collect(),
        };
        for t in 0..3 {
            let grads: Vec<Vec<f32>> = (0..ranks)
                .map(|k| values(s.len(), 100 * t + k as u64))
                .collect();
            let wide: Vec<Vec<f64>> = grads
                .iter()
                .map(|g| g.iter().map(|v| *v as f64).collect())
                .collect();
            let outs = step(&grads, &mut mems, &s);
            let (want, residuals) = reference.step(&wide);
            for k in 0..ranks {
                for i in 0..s.rows {
                    for j in 0..s.cols {
                        let (got, w) = (outs[k][i * s.cols + j] as f64, want[i][j]);
                        assert!(
                            (got - w).abs() < 1e-4,
                            "step {t} rank {k} ({i},{j}): {got} {w}"
                        );
                        let (e, we) = (mems[k].residual[i * s.cols + j] as f64, residuals[k][i][j]);
                        assert!((e - we).abs() < 1e-4, "residual {t} {k}: {e} {we}");
                    }
                }
                // every rank holds the same approximation and the same Q
                assert_eq!(outs[k], outs[0]);
                assert_eq!(mems[k].q, mems[0].q);
            }
        }
    }

    #[test]
    fn what_is_sent_plus_the_residual_is_the_input_plus_the_last_residual() {
        let s = Shape::of(&[20, 30], 3).unwrap();
        let mut mems = vec![Memory::new(&s, 5), Memory::new(&s, 5)];
        for t in 0..4 {
            let grads = [values(s.len(), 2 * t), values(s.len(), 2 * t + 1)];
            let before: Vec<Vec<f32>> = mems.iter().map(|m| m.residual.clone()).collect();
            let outs = step(&grads, &mut mems, &s);
            for k in 0..2 {
                for i in 0..s.len() {
                    let input = grads[k][i] + before[k][i];
                    let sent = outs[k][i] + mems[k].residual[i];
                    assert!((input - sent).abs() <= 1e-5 * (1.0 + input.abs()));
                }
            }
        }
    }

    #[test]
    fn a_matrix_of_the_factors_rank_comes_back_exactly() {
        // every rank's M is the same rank-2 matrix: one power step recovers it
        let s = Shape::of(&[12, 9], 2).unwrap();
        let (a, b) = (values(12 * 2, 1), values(9 * 2, 2));
        let m: Vec<f32> = (0..12)
            .flat_map(|i| {
                let (a, b) = (&a, &b);
                (0..9).map(move |j| a[i * 2] * b[j * 2] + a[i * 2 + 1] * b[j * 2 + 1])
            })
            .collect();
        let mut mems = vec![Memory::new(&s, 3); 4];
        let outs = step(&vec![m.clone(); 4], &mut mems, &s);
        for (got, want) in outs[0].iter().zip(&m) {
            assert!((got - want).abs() < 1e-4, "{got} {want}");
        }
        assert!(mems[0].residual.iter().all(|e| e.abs() < 1e-4));
    }

    #[test]
    fn a_matrix_of_lower_rank_than_the_factors_comes_back_exactly_step_after_step() {
        // rank 1 under factors of rank 4 (a linear layer's gradient of one sample): two
        // columns of P are rounding only
        let s = Shape::of(&[20, 16], 4).unwrap();
        let (a, b) = (values(20, 5), values(16, 6));
        let m: Vec<f32> = (0..20 * 16).map(|x| a[x / 16] * b[x % 16]).collect();
        let mut mems = vec![Memory::new(&s, 11); 3];
        for k in 0..3 {
            let outs = step(&vec![m.clone(); 3], &mut mems, &s);
            for (got, want) in outs[1].iter().zip(&m) {
                assert!((got - want).abs() < 1e-4, "step {k}: {got} {want}");
            }
            // no column of Q stays zero, and every rank's Q is the same
            for c in 0..s.rank {
                assert!((0..s.cols).any(|j| mems[0].q[j * s.rank + c] != 0.0));
            }
            assert!(mems.iter().all(|mm| mm.q == mems[0].q));
        }
    }

    #[test]
    fn memory_is_kept_per_name_reset_on_a_new_shape_and_never_kept_for_unnamed_tensors() {
        let store = PowerMemory::default();
        let s = Shape::of(&[8, 6], 2).unwrap();
        let first = store.take("w", &s);
        // the same name draws the same Q everywhere; another name another one
        assert_eq!(first, PowerMemory::default().take("w", &s));
        assert_ne!(first.q, store.take("v", &s).q);
        let mut kept = first.clone();
        kept.residual[3] = 1.5;
        store.put("w", kept.clone());
        assert_eq!(store.take("w", &s), kept);
        store.put("w", kept.clone());
        // a new shape starts afresh
        let t = Shape::of(&[6, 8], 2).unwrap();
        assert!(store.take("w", &t).residual.iter().all(|v| *v == 0.0));
        store.put("allreduce.noname.7", kept);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn the_first_steps_are_counted_per_name_and_shape_and_never_for_unnamed_tensors() {
        let store = PowerMemory::default();
        let s = Shape::of(&[8, 6], 2).unwrap();
        assert!(!store.warming("w", &s, 0), "no first steps by default");
        for step in 0..3 {
            assert!(store.warming("w", &s, 3), "step {step}");
            let mut m = store.take("w", &s);
            m.steps += 1;
            store.put("w", m);
        }
        assert!(!store.warming("w", &s, 3));
        assert!(store.warming("w", &s, 4));
        // a new shape starts its count afresh; unnamed tensors keep none and are never counted
        assert!(store.warming("w", &Shape::of(&[6, 8], 2).unwrap(), 3));
        assert!(!store.warming("allreduce.noname.3", &s, 3));
    }

    #[test]
    fn orthogonalized_columns_are_orthonormal_and_zero_columns_stay_finite() {
        let (rows, cols) = (10, 3);
        let mut a = values(rows * cols, 9);
        orthogonalize(&mut a, rows, cols);
        for c in 0..cols {
            for d in 0..cols {
                let dot: f32 = (0..rows).map(|r| a[r * cols + c] * a[r * cols + d]).sum();
                let want = if c == d { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "{c} {d}: {dot}");
            }
        }
        let mut zeros = vec![0.0f32; 12];
        orthogonalize(&mut zeros, 4, 3);
        assert!(zeros.iter().all(|v| v.is_finite() && *v == 0.0));
    }
}
