//! PowerSGD on GPU memory: `lowrank::run`'s phases as kernels on the lane's stream, the
//! factors summed by the device transport. Each tensor's residual, Q and redraw count live in
//! device memory owned by the set's `PowerMemory` (unnamed tensors': scratch in the fusion
//! buffer, for the one call); P and Q of the batch's tensors sit side by side in the fusion
//! buffer, so each is summed in one allreduce. Nothing waits on the host.

use super::*;
use crate::collective::lowrank::{self, Factors};
use crate::compress::Wire;
use crate::compress::powersgd::{self, DeviceFactors, PowerMemory, Shape};
use crate::store;
use crate::transport::cuda::{Elementwise, KernelLibrary, StateMem};

/// An f32 sum or average whose matrices travel as PowerSGD's factors of `rank` columns (the
/// host's algorithm, `lowrank::run`), with the state `wire` carries.
pub fn allreduce_powersgd(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    wire: &Wire,
    rank: usize,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let red = Encoding::of(Codec::PowerSgd(rank), resps[0], t.size())?;
    let warming = lowrank::warming(resps, rank, wire.powersgd_start, wire.powersgd);
    let mut gpu = OnGpu {
        t,
        lane,
        pre: red.pre as f32,
        post: red.post,
        rank,
        store: wire.powersgd,
        resps,
        ios,
        steps: Vec::new(),
        p: DeviceRange::empty(),
        q: DeviceRange::empty(),
        partials: DeviceRange::empty(),
    };
    lowrank::run(&mut gpu, &warming, act)
}

/// One tensor's step: its index in the batch, matrix view, memory (whose factors hold its
/// residual, then M, and its Q), where its residual, Q and redraw count are this call, and its
/// places in the batch's P and in its sum of Q.
struct Step {
    tensor: usize,
    shape: Shape,
    memory: powersgd::Memory,
    residual: DeviceRange,
    q: DeviceRange,
    draws: DeviceRange,
    p: DeviceRange,
    q_sum: DeviceRange,
}

struct OnGpu<'a, 'b, 'l> {
    t: &'a dyn DeviceTransport,
    lane: &'a mut Lane<'l>,
    pre: f32,
    /// The factor on the approximation of the ranks' average.
    post: f64,
    rank: usize,
    store: &'a PowerMemory,
    resps: &'a [&'a Response],
    ios: &'a mut [&'b mut dyn DeviceIo],
    steps: Vec<Step>,
    /// Every tensor's P, then every Q, side by side (fusion buffer).
    p: DeviceRange,
    q: DeviceRange,
    /// Q's partial sums over bands of M's rows (`MIDDLE_BANDS`), for one tensor at a time.
    partials: DeviceRange,
}

/// Bands of rows whose products with P are summed apart before they are added in order: the
/// columns of a tall matrix would otherwise leave most of the GPU idle.
const MIDDLE_BANDS: usize = 64;

/// Rows per band of a matrix of `rows` rows (at least 64, so that a band's sum is worth a
/// block), and the bands.
fn bands(rows: usize) -> (usize, usize) {
    let per = rows.div_ceil(MIDDLE_BANDS).max(64);
    (per, rows.div_ceil(per).max(1))
}

/// Places of `lens` byte lengths one after the other, each at a multiple of 16, and the end.
fn places(lens: &[usize]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let places = (lens.iter())
        .map(|len| {
            let place = at;
            at += len.next_multiple_of(16);
            place
        })
        .collect();
    (places, at)
}

impl OnGpu<'_, '_, '_> {
    /// The ranks' sum of `range`'s f32 values, in place, in one allreduce.
    fn sum(&self, range: DeviceRange) -> Result<()> {
        let n = range.len() / 4;
        let one = [(range, range, n)];
        (self.t).allreduce_many(&one, DataType::F32, ReduceOp::Sum, self.lane.stream)
    }

    fn shape(&self, i: usize) -> Result<Shape> {
        lowrank::shape(self.resps[i], self.rank, self.ios[i].input().len() / 4)
    }
}

impl Factors for OnGpu<'_, '_, '_> {
    fn sum_warming(&mut self, tensors: &[usize]) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        let mut sums = Vec::with_capacity(tensors.len());
        for i in tensors {
            let (input, output) = (self.ios[*i].input(), self.ios[*i].output());
            let n = input.len() / 4;
            kernels::scale(
                gpu,
                stream,
                input,
                output,
                n,
                DataType::F32,
                self.pre as f64,
            )?;
            sums.push((output, output, n));
        }
        self.t
            .allreduce_many(&sums, DataType::F32, ReduceOp::Sum, stream)?;
        // `post` is the factor on the ranks' average: on the sum, post / ranks, in f32 as the
        // host's first steps apply it
        let factor = self.post_on_sum();
        for (out, _, n) in &sums {
            kernels::scale(
                gpu,
                stream,
                *out,
                *out,
                *n,
                DataType::F32,
                f64::from(factor),
            )?;
        }
        for i in tensors {
            let r = self.resps[*i];
            let shape = self.shape(*i)?;
            let mut memory = self.store.take_device(&r.name, &shape, gpu.ordinal);
            memory.steps += 1;
            self.store.put(&r.name, memory);
        }
        Ok(())
    }

    fn start(&mut self, tensors: &[usize]) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        let shapes = (tensors.iter())
            .map(|i| self.shape(*i))
            .collect::<Result<Vec<_>>>()?;
        // the fusion buffer: every P, every Q, the partial sums of the largest Q, and the
        // state of the unnamed tensors, which keep none
        let unnamed: Vec<bool> = (tensors.iter())
            .map(|i| store::is_unnamed(&self.resps[*i].name))
            .collect();
        let p_len: usize = shapes.iter().map(Shape::p_len).sum();
        let q_len: usize = shapes.iter().map(Shape::q_len).sum();
        let partials = (shapes.iter())
            .map(|s| bands(s.rows).1 * s.q_len())
            .max()
            .unwrap_or(0);
        let mut lens = vec![p_len * 4, q_len * 4, partials * 4];
        for (s, _) in shapes.iter().zip(&unnamed).filter(|(_, u)| **u) {
            lens.extend([s.len() * 4, s.q_len() * 4, 8]);
        }
        let (at, total) = places(&lens);
        let whole = self.lane.fusion(total)?;
        let part = |k: usize| whole.sub(at[k], lens[k]);
        (self.p, self.q, self.partials) = (part(0)?, part(1)?, part(2)?);
        let mut scratch = 3;
        let (mut p_at, mut q_at) = (0, 0);
        for ((i, shape), unnamed) in tensors.iter().zip(shapes).zip(unnamed) {
            let r = self.resps[*i];
            let mut memory = self.store.take_device(&r.name, &shape, gpu.ordinal);
            memory.steps = memory.steps.saturating_add(1);
            let (residual, q, draws, fresh) = match memory.device.as_mut() {
                _ if unnamed => {
                    let places = (part(scratch)?, part(scratch + 1)?, part(scratch + 2)?);
                    scratch += 3;
                    (places.0, places.1, places.2, true)
                }
                Some(d) => {
                    let fresh = d.factors.is_none();
                    if fresh {
                        d.factors = Some(DeviceFactors(std::sync::Arc::new([
                            StateMem::new(gpu, stream, shape.len() * 4)?,
                            StateMem::new(gpu, stream, shape.q_len() * 4)?,
                            StateMem::new(gpu, stream, 8)?,
                        ])));
                    }
                    let f = d.factors.as_ref().expect("allocated above");
                    // the last batch that used them may have run on another stream
                    for m in f.0.iter() {
                        m.before_use(stream)?;
                    }
                    (
                        f.residual().range(),
                        f.q().range(),
                        f.draws().range(),
                        fresh,
                    )
                }
                None => return Err(Error::Internal("a GPU tensor's PowerSGD memory".into())),
            };
            if fresh {
                // a first step: no residual, no redraw, and Q drawn from the tensor's seed
                gpu.memset_zero(stream, residual)?;
                gpu.memset_zero(stream, draws)?;
                first_q(gpu, stream, q, &shape, memory.seed)?;
            }
            let p = self.p.sub(p_at * 4, shape.p_len() * 4)?;
            let q_sum = self.q.sub(q_at * 4, shape.q_len() * 4)?;
            (p_at, q_at) = (p_at + shape.p_len(), q_at + shape.q_len());
            let input = self.ios[*i].input();
            let pre = self.pre;
            launch(
                gpu,
                stream,
                "fv_psgd_start",
                &[input, residual, q, p],
                &shape,
                &[pre.to_bits() as u64],
                shape.rows,
            )?;
            self.steps.push(Step {
                tensor: *i,
                shape,
                memory,
                residual,
                q,
                draws,
                p,
                q_sum,
            });
        }
        Ok(())
    }

    fn sum_p(&mut self) -> Result<()> {
        self.sum(self.p)
    }

    fn middle(&mut self) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        for s in &self.steps {
            let (sh, p, q) = (&s.shape, s.p, s.q_sum);
            orthogonalize(gpu, stream, p, sh.rows, sh.rank)?;
            let (per, bands) = bands(sh.rows);
            let partials = self.partials.first(bands * sh.q_len() * 4)?;
            let args = [per as u64];
            let grid = ((sh.cols.div_ceil(256)).min(1024) as u32, bands as u32);
            launch_grid(
                gpu,
                stream,
                "fv_psgd_middle",
                &[s.residual, p, partials],
                sh,
                &args,
                grid,
            )?;
            let args = [bands as u64];
            let items = sh.q_len();
            launch(
                gpu,
                stream,
                "fv_psgd_add_bands",
                &[partials, q],
                sh,
                &args,
                items.div_ceil(256),
            )?;
        }
        Ok(())
    }

    fn sum_q(&mut self) -> Result<()> {
        self.sum(self.q)
    }

    fn finish(&mut self) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        let scale = 1.0 / self.t.size().max(1) as f32;
        let mut done = Vec::with_capacity(self.steps.len());
        for s in std::mem::take(&mut self.steps) {
            let (sh, p, q_sum) = (s.shape, s.p, s.q_sum);
            // Q = the ranks' average, kept (a vanished column drawn again), then P Qᵀ
            let args = [scale.to_bits() as u64, s.memory.seed];
            launch_grid(
                gpu,
                stream,
                "fv_psgd_keep_q",
                &[q_sum, s.q, s.draws],
                &sh,
                &args,
                (1, 1),
            )?;
            let out = self.ios[s.tensor].output();
            let args = [(self.post as f32).to_bits() as u64];
            let blocks = sh.len().div_ceil(256 * 4);
            launch(
                gpu,
                stream,
                "fv_psgd_finish",
                &[s.residual, p, q_sum, out],
                &sh,
                &args,
                blocks,
            )?;
            done.push((s.tensor, s.memory));
        }
        // the batches after this one wait for it before they use the tensors' state
        let used = std::sync::Arc::new(gpu.new_event()?);
        used.record(stream)?;
        for (tensor, memory) in done {
            let factors = memory.device.as_ref().and_then(|d| d.factors.as_ref());
            for m in factors.iter().flat_map(|f| f.0.iter()) {
                m.used(&used);
            }
            // unnamed tensors keep nothing (`PowerMemory::put`)
            self.store.put(&self.resps[tensor].name, memory);
        }
        Ok(())
    }
}

impl OnGpu<'_, '_, '_> {
    /// The factor on the summed first steps: `post` is the one on the ranks' average.
    fn post_on_sum(&self) -> f32 {
        (self.post / self.t.size() as f64) as f32
    }
}

/// Q's first values from `seed`, as `powersgd::Memory::new` draws them, orthonormalised.
fn first_q(gpu: &Gpu, stream: &Stream, q: DeviceRange, s: &Shape, seed: u64) -> Result<()> {
    let blocks = s.q_len().div_ceil(256);
    launch(gpu, stream, "fv_psgd_first_q", &[q], s, &[seed], blocks)?;
    orthogonalize(gpu, stream, q, s.cols, s.rank)
}

/// Gram-Schmidt on the columns of a `rows` × `cols` matrix, as `powersgd::orthogonalize`.
fn orthogonalize(
    gpu: &Gpu,
    stream: &Stream,
    a: DeviceRange,
    rows: usize,
    cols: usize,
) -> Result<()> {
    a.holds(rows * cols * 4, "PowerSGD factor")?;
    // the kernel keeps each column's norm in a block's shared memory (the rank's range)
    if cols > 1024 {
        return Err(Error::Internal(format!(
            "PowerSGD factors of {cols} columns (at most 1024)"
        )));
    }
    let kernel = Elementwise::ranges(&LIBRARY, "fv_psgd_orthogonalize");
    gpu.launch_ranges(stream, kernel, &[a], &[rows as u64, cols as u64], (1, 1))
}

/// Launches `name` on `blocks` blocks (capped; its loops stride over the rest) with the
/// matrix's rows, cols and rank before `args`.
fn launch(
    gpu: &Gpu,
    stream: &Stream,
    name: &'static str,
    ranges: &[DeviceRange],
    s: &Shape,
    args: &[u64],
    blocks: usize,
) -> Result<()> {
    let grid = (blocks.clamp(1, 4096) as u32, 1);
    launch_grid(gpu, stream, name, ranges, s, args, grid)
}

fn launch_grid(
    gpu: &Gpu,
    stream: &Stream,
    name: &'static str,
    ranges: &[DeviceRange],
    s: &Shape,
    args: &[u64],
    grid: (u32, u32),
) -> Result<()> {
    let mut all = vec![s.rows as u64, s.cols as u64, s.rank as u64];
    all.extend_from_slice(args);
    gpu.launch_ranges(
        stream,
        Elementwise::ranges(&LIBRARY, name),
        ranges,
        &all,
        grid,
    )
}

/// PowerSGD's kernels, for loading (`Gpu::load`).
pub static LIBRARY: KernelLibrary = KernelLibrary {
    name: "ferrovod_powersgd.cu",
    source: SOURCE,
    kernels: &[
        "fv_psgd_first_q",
        "fv_psgd_orthogonalize",
        "fv_psgd_start",
        "fv_psgd_middle",
        "fv_psgd_add_bands",
        "fv_psgd_keep_q",
        "fv_psgd_finish",
    ],
};

/// The kernels in CUDA C without headers, each `name(const Ranges a)` (`Gpu::launch_ranges`)
/// on blocks of 256 threads, with arg[0..3] = the matrix's rows, cols and rank (k); matrices
/// are f32, row-major: M rows × cols, P rows × k, Q cols × k. Sums run in a fixed order, so a
/// kernel gives the same bits on every rank from the same inputs.
const SOURCE: &str = r#"
typedef unsigned long long u64;
struct Ranges { u64 at[8]; u64 len[8]; u64 arg[8]; };
#define TILE 8

__device__ __forceinline__ float fv_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
// the block's sum (in a fixed order), given to every thread; red holds 33 floats
__device__ float fv_block_sum(float v, float* red) {
  v = fv_warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
    red[32] = s;
  }
  __syncthreads();
  float s = red[32];
  __syncthreads();
  return s;
}
// the generator of powersgd.rs (SplitMix64 and Box-Muller): the i-th normal of a sequence
// from `seed` uses its draws 2i + 1 and 2i + 2
__device__ u64 fv_mix(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ float fv_normal(u64 seed, u64 i) {
  const u64 g = 0x9E3779B97F4A7C15ull;
  double u = ((double)(fv_mix(seed + (2 * i + 1) * g) >> 11) + 0.5) / 9007199254740992.0;
  double v = ((double)(fv_mix(seed + (2 * i + 2) * g) >> 11) + 0.5) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u)) * cos(2.0 * 3.141592653589793 * v));
}

// at[0]: Q; arg[3]: the seed
extern "C" __global__ void fv_psgd_first_q(const Ranges a) {
  float* q = (float*)a.at[0];
  const u64 n = a.arg[1] * a.arg[2];
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    q[i] = fv_normal(a.arg[3], i);
}

// at[0]: A, arg[0] x arg[1] (one block; at most 1024 columns): each column normalised, then
// removed from the later ones; a column the earlier ones span (left with at most 1e-4 of its
// norm before the projections) becomes zero, as powersgd.rs's `orthogonalize`
extern "C" __global__ void fv_psgd_orthogonalize(const Ranges a) {
  float* x = (float*)a.at[0];
  const u64 rows = a.arg[0], cols = a.arg[1];
  __shared__ float red[33];
  __shared__ float before[1024];
  for (u64 c = 0; c < cols; c++) {
    float ss = 0.0f;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) { const float v = x[r * cols + c]; ss += v * v; }
    const float norm = sqrtf(fv_block_sum(ss, red));
    if (threadIdx.x == 0) before[c] = norm;
  }
  __syncthreads();
  for (u64 c = 0; c < cols; c++) {
    float ss = 0.0f;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) { const float v = x[r * cols + c]; ss += v * v; }
    const float norm = sqrtf(fv_block_sum(ss, red));
    if (norm <= 1e-4f * before[c]) {
      for (u64 r = threadIdx.x; r < rows; r += blockDim.x) x[r * cols + c] = 0.0f;
      continue;
    }
    const float d = norm + 1e-8f;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) x[r * cols + c] = x[r * cols + c] / d;
    for (u64 e = c + 1; e < cols; e++) {
      float dot = 0.0f;
      for (u64 r = threadIdx.x; r < rows; r += blockDim.x) dot += x[r * cols + c] * x[r * cols + e];
      dot = fv_block_sum(dot, red);
      for (u64 r = threadIdx.x; r < rows; r += blockDim.x) x[r * cols + e] -= dot * x[r * cols + c];
    }
  }
}

// at[0]: the gradient, at[1]: the residual (M written over it), at[2]: Q, at[3]: P out;
// arg[3]: pre's bits. A block per row: M = residual + pre x gradient, P = M Q.
extern "C" __global__ void fv_psgd_start(const Ranges a) {
  const float* g = (const float*)a.at[0]; float* m = (float*)a.at[1];
  const float* q = (const float*)a.at[2]; float* p = (float*)a.at[3];
  const u64 rows = a.arg[0], cols = a.arg[1], k = a.arg[2];
  const float pre = __uint_as_float((unsigned)a.arg[3]);
  __shared__ float part[8][TILE];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    float* mr = m + r * cols;
    const float* gr = g + r * cols;
    for (u64 c0 = 0; c0 < k; c0 += TILE) {
      const int tk = (int)(k - c0 < TILE ? k - c0 : TILE);
      float acc[TILE];
      for (int c = 0; c < TILE; c++) acc[c] = 0.0f;
      for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float v;
        if (c0 == 0) { v = __fadd_rn(mr[j], __fmul_rn(gr[j], pre)); mr[j] = v; } else { v = mr[j]; }
        const float* qj = q + j * k + c0;
        for (int c = 0; c < TILE; c++) if (c < tk) acc[c] += v * qj[c];
      }
      for (int c = 0; c < TILE; c++) {
        float s = fv_warp_sum(acc[c]);
        if (lane == 0) part[warp][c] = s;
      }
      __syncthreads();
      if ((int)threadIdx.x < tk) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += part[w][threadIdx.x];
        p[r * k + c0 + threadIdx.x] = s;
      }
      __syncthreads();
    }
  }
}

// at[0]: M, at[1]: P, at[2]: Q's partial sums out, band y's at y x cols x k; arg[3]: rows
// per band (blockIdx.y). A thread per column of M: its products with P over the band's rows.
extern "C" __global__ void fv_psgd_middle(const Ranges a) {
  const float* m = (const float*)a.at[0]; const float* p = (const float*)a.at[1];
  const u64 rows = a.arg[0], cols = a.arg[1], k = a.arg[2], per = a.arg[3];
  float* out = (float*)a.at[2] + (u64)blockIdx.y * cols * k;
  const u64 r0 = (u64)blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += (u64)gridDim.x * blockDim.x) {
    for (u64 c0 = 0; c0 < k; c0 += TILE) {
      const int tk = (int)(k - c0 < TILE ? k - c0 : TILE);
      float acc[TILE];
      for (int c = 0; c < TILE; c++) acc[c] = 0.0f;
      for (u64 r = r0; r < r1; r++) {
        const float v = m[r * cols + j];
        const float* pr = p + r * k + c0;
        for (int c = 0; c < TILE; c++) if (c < tk) acc[c] += v * pr[c];
      }
      for (int c = 0; c < tk; c++) out[j * k + c0 + c] = acc[c];
    }
  }
}

// at[0]: the bands' partial sums, at[1]: Q out; arg[3]: the bands, added in order
extern "C" __global__ void fv_psgd_add_bands(const Ranges a) {
  const float* parts = (const float*)a.at[0]; float* q = (float*)a.at[1];
  const u64 n = a.arg[1] * a.arg[2], bands = a.arg[3];
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (u64 b = 0; b < bands; b++) s += parts[b * n + i];
    q[i] = s;
  }
}

// at[0]: the ranks' sum of Q (made their average in place), at[1]: the tensor's Q (the
// average kept, a column of zeros drawn again), at[2]: its redraws so far (a u64); arg[3]:
// 1 / ranks' bits, arg[4]: the tensor's seed. One block.
extern "C" __global__ void fv_psgd_keep_q(const Ranges a) {
  float* sum = (float*)a.at[0]; float* q = (float*)a.at[1];
  u64* draws = (u64*)a.at[2];
  const u64 cols = a.arg[1], k = a.arg[2];
  const float scale = __uint_as_float((unsigned)a.arg[3]);
  for (u64 i = threadIdx.x; i < cols * k; i += blockDim.x) {
    const float v = __fmul_rn(sum[i], scale);
    sum[i] = v;
    q[i] = v;
  }
  __syncthreads();
  for (u64 c = 0; c < k; c++) {
    int nonzero = 0;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) nonzero |= sum[j * k + c] != 0.0f;
    if (__syncthreads_or(nonzero)) continue;
    const u64 d = *draws + 1;
    const u64 seed = a.arg[4] ^ (d * 0xD1B54A32D192ED03ull);
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) q[j * k + c] = fv_normal(seed, j);
    __syncthreads();
    if (threadIdx.x == 0) *draws = d;
    __syncthreads();
  }
}

// at[0]: M (the residual M - P Q^T written over it), at[1]: P, at[2]: Q (the average),
// at[3]: the output (post x P Q^T); arg[3]: post's bits. A thread per value, the products
// summed in the order c = 0, 1, ..., as the host does.
extern "C" __global__ void fv_psgd_finish(const Ranges a) {
  float* m = (float*)a.at[0]; const float* p = (const float*)a.at[1];
  const float* q = (const float*)a.at[2]; float* out = (float*)a.at[3];
  const u64 cols = a.arg[1], k = a.arg[2], n = a.arg[0] * cols;
  const float post = __uint_as_float((unsigned)a.arg[3]);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    const u64 r = i / cols, j = i % cols;
    const float* pr = p + r * k; const float* qj = q + j * k;
    float s = __fmul_rn(pr[0], qj[0]);
    for (u64 c = 1; c < k; c++) s = __fadd_rn(s, __fmul_rn(pr[c], qj[c]));
    out[i] = __fmul_rn(s, post);
    m[i] = __fsub_rn(m[i], s);
  }
}
"#;
