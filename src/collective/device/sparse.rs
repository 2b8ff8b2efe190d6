//! Top-k on GPU memory: `sparse::run`'s phases as kernels on the lane's stream, the pairs
//! gathered by the device transport. The selection is the host's, bit for bit: the k entries
//! of largest magnitude (the f32 bits with the sign cleared, so NaN above infinity), ties to
//! the lower index, found by a radix select of the key (four passes of 8 bits, each a
//! histogram and a pick, nothing read back by the host) and written as pairs in index order by
//! an order-keeping compaction. Each tensor's residual and momentum live in device memory owned
//! by the set's `TopkMemory` (unnamed tensors': scratch in the fusion buffer, for the one call).

use super::*;
use crate::collective::sparse::{self, Pairs};
use crate::compress::topk::{self, OnDevice};
use crate::compress::{TopK, Wire};
use crate::store;
use crate::transport::cuda::{Elementwise, KernelLibrary, StateMem};

/// An f32 sum or average whose tensors travel as their k largest entries (the host's
/// algorithm, `sparse::run`), with the state `wire` carries.
pub fn allreduce_topk(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    wire: &Wire,
    params: TopK,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let red = Encoding::of(Codec::TopK(params), resps[0], t.size())?;
    let lens: Vec<usize> = ios.iter().map(|io| io.input().len() / 4).collect();
    let ks = sparse::pairs_per_tensor(params, wire.topk_warmup, wire.topk, resps, &lens)?;
    let each = ks.iter().sum::<usize>() * topk::PAIR_BYTES;
    let blocks = lens.iter().map(|n| chunks(*n).1).max().unwrap_or(1);
    let unnamed = (resps.iter().zip(&lens))
        .filter(|(r, _)| store::is_unnamed(&r.name))
        .map(|(_, n)| *n)
        .max()
        .unwrap_or(0);
    // the fusion buffer: every rank's pairs, the selection's state, histogram and per-block
    // counts (one tensor at a time), and an unnamed tensor's residual and momentum
    let lens_of = [
        each * t.size(),
        16,
        4 * BUCKETS,
        8 * blocks,
        4 * unnamed,
        4 * unnamed,
    ];
    let mut places = Vec::with_capacity(lens_of.len());
    let mut at = 0;
    for len in lens_of {
        places.push(at);
        at += len.next_multiple_of(16);
    }
    let whole = lane.fusion(at)?;
    let part = |k: usize| whole.sub(places[k], lens_of[k]);
    let mut gpu = OnGpu {
        t,
        gpu: lane.gpu,
        stream: lane.stream,
        pre: red.pre as f32,
        post: red.post as f32,
        momentum: params.momentum(),
        store: wire.topk,
        resps,
        ios,
        pairs: part(0)?,
        each,
        state: part(1)?,
        histogram: part(2)?,
        counts: part(3)?,
        scratch: (part(4)?, part(5)?),
    };
    sparse::run(&mut gpu, &ks, act)
}

/// Buckets of a radix pass (8 bits of the key).
const BUCKETS: usize = 256;

/// Values per block of the compaction, at least (a block walks its chunk in order), and the
/// most blocks.
const CHUNK: usize = 4096;
const MOST_BLOCKS: usize = 1024;

/// Values per block and blocks of the compaction of `n` values.
fn chunks(n: usize) -> (usize, usize) {
    let blocks = n.div_ceil(CHUNK).clamp(1, MOST_BLOCKS);
    (n.div_ceil(blocks).max(1), blocks)
}

struct OnGpu<'a, 'b> {
    t: &'a dyn DeviceTransport,
    gpu: &'a std::sync::Arc<Gpu>,
    stream: &'a Stream,
    pre: f32,
    post: f32,
    momentum: f32,
    store: &'a topk::TopkMemory,
    resps: &'a [&'a Response],
    ios: &'a mut [&'b mut dyn DeviceIo],
    /// Every rank's part of the exchange, `each` bytes apart.
    pairs: DeviceRange,
    each: usize,
    /// The radix select's prefix, mask and count still to take (u32 each).
    state: DeviceRange,
    histogram: DeviceRange,
    /// Per block of the compaction: values above the threshold and at it (then where each
    /// block's start).
    counts: DeviceRange,
    /// An unnamed tensor's residual and momentum.
    scratch: (DeviceRange, DeviceRange),
}

impl Pairs for OnGpu<'_, '_> {
    fn select(&mut self, tensor: usize, k: usize, at: usize) -> Result<()> {
        let (gpu, stream) = (self.gpu, self.stream);
        let (r, io) = (self.resps[tensor], &self.ios[tensor]);
        let (input, output) = (io.input(), io.output());
        let n = input.len() / 4;
        let unnamed = store::is_unnamed(&r.name);
        let (mut memory, fresh) = match self.store.take_device(&r.name, n, gpu.ordinal) {
            Some(m) => (m, false),
            None if unnamed => (topk::Memory::default(), true),
            None => {
                let buffers = [
                    StateMem::new(gpu, stream, 4 * n)?,
                    StateMem::new(gpu, stream, 4 * n)?,
                ];
                let device = OnDevice {
                    len: n,
                    ordinal: gpu.ordinal,
                    buffers: std::sync::Arc::new(buffers),
                };
                let m = topk::Memory {
                    device: Some(device),
                    ..topk::Memory::default()
                };
                (m, true)
            }
        };
        memory.steps = memory.steps.saturating_add(1);
        let (residual, momentum) = match &memory.device {
            Some(d) => {
                // the last batch that used them may have run on another stream
                d.residual().before_use(stream)?;
                d.momentum().before_use(stream)?;
                (d.residual().range(), d.momentum().range())
            }
            None => (self.scratch.0.first(4 * n)?, self.scratch.1.first(4 * n)?),
        };
        if fresh {
            gpu.memset_zero(stream, residual)?;
            gpu.memset_zero(stream, momentum)?;
        }
        let blocks = |n: usize| n.div_ceil(256 * 4).clamp(1, 4096) as u32;
        let (pre, mom) = (self.pre.to_bits() as u64, self.momentum.to_bits() as u64);
        let ranges = [input, residual, momentum];
        launch(
            gpu,
            stream,
            "fv_topk_accumulate",
            &ranges,
            &[n as u64, pre, mom],
            blocks(n),
        )?;
        // the sum is added onto zeros (the input was read above, in stream order)
        gpu.memset_zero(stream, output)?;
        let (state, hist) = (self.state, self.histogram);
        launch(gpu, stream, "fv_topk_init", &[state, hist], &[k as u64], 1)?;
        for shift in [24u64, 16, 8, 0] {
            let args = [n as u64, shift];
            launch(
                gpu,
                stream,
                "fv_topk_histogram",
                &[residual, state, hist],
                &args,
                blocks(n),
            )?;
            launch(gpu, stream, "fv_topk_pick", &[state, hist], &[shift], 1)?;
        }
        let (chunk, count) = chunks(n);
        let counts = self.counts.first(8 * count)?;
        let args = [n as u64, chunk as u64];
        launch(
            gpu,
            stream,
            "fv_topk_count",
            &[residual, state, counts],
            &args,
            count as u32,
        )?;
        launch(gpu, stream, "fv_topk_scan", &[counts], &[count as u64], 1)?;
        let me = self.t.rank();
        let own = self.pairs.sub(me * self.each + at, k * topk::PAIR_BYTES)?;
        let args = [n as u64, chunk as u64, mom];
        let ranges = [residual, momentum, state, counts, own];
        launch(gpu, stream, "fv_topk_write", &ranges, &args, count as u32)?;
        if let Some(d) = &memory.device {
            // the batches after this one wait for it before they use the tensor's state
            let used = std::sync::Arc::new(gpu.new_event()?);
            used.record(stream)?;
            d.residual().used(&used);
            d.momentum().used(&used);
        }
        // unnamed tensors keep nothing (`TopkMemory::put`)
        self.store.put(&r.name, memory);
        Ok(())
    }

    fn gather(&mut self, each: usize) -> Result<()> {
        let counts = vec![each; self.t.size()];
        (self.t).allgatherv_in_place(self.pairs, &counts, self.stream)
    }

    fn decode(&mut self, tensor: usize, k: usize, at: usize) -> Result<()> {
        let out = self.ios[tensor].output();
        let n = out.len() / 4;
        let post = self.post.to_bits() as u64;
        let blocks = k.div_ceil(256).clamp(1, 4096) as u32;
        // rank by rank, so that every rank adds in the same order (an index appears once in
        // a rank's pairs)
        for r in 0..self.t.size() {
            let part = self.pairs.sub(r * self.each + at, k * topk::PAIR_BYTES)?;
            let args = [k as u64, n as u64, post];
            launch(
                self.gpu,
                self.stream,
                "fv_topk_add",
                &[part, out],
                &args,
                blocks,
            )?;
        }
        Ok(())
    }
}

fn launch(
    gpu: &Gpu,
    stream: &Stream,
    name: &'static str,
    ranges: &[DeviceRange],
    args: &[u64],
    blocks: u32,
) -> Result<()> {
    let kernel = Elementwise::ranges(&LIBRARY, name);
    gpu.launch_ranges(stream, kernel, ranges, args, (blocks, 1))
}

/// Top-k's kernels, for loading (`Gpu::load`).
pub static LIBRARY: KernelLibrary = KernelLibrary {
    name: "ferrovod_topk.cu",
    source: SOURCE,
    kernels: &[
        "fv_topk_accumulate",
        "fv_topk_init",
        "fv_topk_histogram",
        "fv_topk_pick",
        "fv_topk_count",
        "fv_topk_scan",
        "fv_topk_write",
        "fv_topk_add",
    ],
};

/// The kernels in CUDA C without headers, each `name(const Ranges a)` (`Gpu::launch_ranges`)
/// on blocks of 256 threads. Arithmetic rounds as the host's does (no fused multiply-adds), so
/// the residuals, pairs and sums are the host's bits. The selection's state: st[0] the key's
/// bits found so far, st[1] which bits those are, st[2] how many of the entries that match
/// them are still to take.
const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
struct Ranges { u64 at[8]; u64 len[8]; u64 arg[8]; };
#define FV_GRID(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ u32 fv_key(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// at[0]: the gradient, at[1]: the residual v, at[2]: the momentum u; arg[0]: values,
// arg[1]: the scale's bits, arg[2]: the momentum factor's bits (0: none).
// u = m u + scale g, v += u; or v += scale g
extern "C" __global__ void fv_topk_accumulate(const Ranges a) {
  const float* g = (const float*)a.at[0]; float* v = (float*)a.at[1]; float* u = (float*)a.at[2];
  const float scale = __uint_as_float((u32)a.arg[1]), m = __uint_as_float((u32)a.arg[2]);
  FV_GRID(i, a.arg[0]) {
    const float x = __fmul_rn(g[i], scale);
    if (m > 0.0f) {
      const float w = __fadd_rn(__fmul_rn(m, u[i]), x);
      u[i] = w;
      v[i] = __fadd_rn(v[i], w);
    } else {
      v[i] = __fadd_rn(v[i], x);
    }
  }
}

// at[0]: the state, at[1]: the histogram (zeroed); arg[0]: k
extern "C" __global__ void fv_topk_init(const Ranges a) {
  u32* st = (u32*)a.at[0]; u32* h = (u32*)a.at[1];
  if (threadIdx.x == 0) { st[0] = 0; st[1] = 0; st[2] = (u32)a.arg[0]; st[3] = 0; }
  h[threadIdx.x] = 0;
}

// at[0]: v, at[1]: the state, at[2]: the histogram; arg[0]: values, arg[1]: the pass's shift.
// Counts, of the entries whose key matches the bits found so far, each value of the next 8.
extern "C" __global__ void fv_topk_histogram(const Ranges a) {
  const float* v = (const float*)a.at[0]; const u32* st = (const u32*)a.at[1];
  u32* h = (u32*)a.at[2];
  const u32 prefix = st[0], mask = st[1], shift = (u32)a.arg[1];
  __shared__ u32 local[256];
  local[threadIdx.x] = 0;
  __syncthreads();
  FV_GRID(i, a.arg[0]) {
    const u32 key = fv_key(v[i]);
    if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & 255u], 1u);
  }
  __syncthreads();
  if (local[threadIdx.x]) atomicAdd(&h[threadIdx.x], local[threadIdx.x]);
}

// at[0]: the state, at[1]: the histogram (zeroed after); arg[0]: the pass's shift. The
// largest bucket at which the entries still to take are reached.
extern "C" __global__ void fv_topk_pick(const Ranges a) {
  u32* st = (u32*)a.at[0]; u32* h = (u32*)a.at[1];
  const u32 shift = (u32)a.arg[0];
  if (threadIdx.x == 0) {
    u32 above = 0, rem = st[2];
    int b = 255;
    for (; b > 0; b--) {
      if (above + h[b] >= rem) break;
      above += h[b];
    }
    st[0] |= (u32)b << shift;
    st[1] |= 255u << shift;
    st[2] = rem - above;
  }
  __syncthreads();
  h[threadIdx.x] = 0;
}

// at[0]: v, at[1]: the state, at[2]: per block, entries above the threshold and at it;
// arg[0]: values, arg[1]: values per block
extern "C" __global__ void fv_topk_count(const Ranges a) {
  const float* v = (const float*)a.at[0]; const u32* st = (const u32*)a.at[1];
  u32* counts = (u32*)a.at[2];
  const u32 t = st[0];
  const u64 n = a.arg[0], start = (u64)blockIdx.x * a.arg[1];
  const u64 end = start + a.arg[1] < n ? start + a.arg[1] : n;
  __shared__ u32 gt, eq;
  if (threadIdx.x == 0) { gt = 0; eq = 0; }
  __syncthreads();
  u32 g = 0, e = 0;
  for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    const u32 key = fv_key(v[i]);
    g += key > t; e += key == t;
  }
  if (g) atomicAdd(&gt, g);
  if (e) atomicAdd(&eq, e);
  __syncthreads();
  if (threadIdx.x == 0) { counts[2 * blockIdx.x] = gt; counts[2 * blockIdx.x + 1] = eq; }
}

// at[0]: the per-block counts, made the counts before each block; arg[0]: blocks
extern "C" __global__ void fv_topk_scan(const Ranges a) {
  u32* counts = (u32*)a.at[0];
  if (threadIdx.x != 0) return;
  u32 g = 0, e = 0;
  for (u64 b = 0; b < a.arg[0]; b++) {
    const u32 bg = counts[2 * b], be = counts[2 * b + 1];
    counts[2 * b] = g; counts[2 * b + 1] = e;
    g += bg; e += be;
  }
}

// at[0]: v, at[1]: u, at[2]: the state, at[3]: the counts before each block, at[4]: the pairs
// out; arg[0]: values, arg[1]: values per block, arg[2]: the momentum factor's bits. An entry
// is sent if its key is above the threshold, or at it and among the first st[2] at it; its
// place is the sent entries before it (index order); it leaves v, and its momentum is cleared.
extern "C" __global__ void fv_topk_write(const Ranges a) {
  float* v = (float*)a.at[0]; float* u = (float*)a.at[1];
  const u32* st = (const u32*)a.at[2]; const u32* counts = (const u32*)a.at[3];
  u32* pairs = (u32*)a.at[4];
  const u32 t = st[0], take = st[2];
  const bool mom = __uint_as_float((u32)a.arg[2]) > 0.0f;
  const u64 n = a.arg[0], start = (u64)blockIdx.x * a.arg[1];
  const u64 end = start + a.arg[1] < n ? start + a.arg[1] : n;
  const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 below = (1u << lane) - 1u;
  __shared__ u32 wg[8], we[8];
  u32 gbase = counts[2 * blockIdx.x], ebase = counts[2 * blockIdx.x + 1];
  for (u64 tile = start; tile < end; tile += blockDim.x) {
    const u64 i = tile + threadIdx.x;
    u32 key = 0;
    if (i < end) key = fv_key(v[i]);
    const bool g = i < end && key > t, e = i < end && key == t;
    const u32 bg = __ballot_sync(0xffffffffu, g), be = __ballot_sync(0xffffffffu, e);
    if (lane == 0) { wg[warp] = __popc(bg); we[warp] = __popc(be); }
    __syncthreads();
    u32 gb = gbase + __popc(bg & below), eb = ebase + __popc(be & below), tg = 0, te = 0;
    for (u32 w = 0; w < 8; w++) {
      if (w < warp) { gb += wg[w]; eb += we[w]; }
      tg += wg[w]; te += we[w];
    }
    if (g || (e && eb < take)) {
      const u32 pos = gb + (eb < take ? eb : take);
      pairs[2 * pos] = (u32)i;
      pairs[2 * pos + 1] = __float_as_uint(v[i]);
      v[i] = 0.0f;
      if (mom) u[i] = 0.0f;
    }
    gbase += tg; ebase += te;
    __syncthreads();
  }
}

// at[0]: one rank's pairs, at[1]: the output; arg[0]: pairs, arg[1]: the output's values,
// arg[2]: the factor's bits. out[index] += factor x value
extern "C" __global__ void fv_topk_add(const Ranges a) {
  const u32* pairs = (const u32*)a.at[0]; float* out = (float*)a.at[1];
  const float f = __uint_as_float((u32)a.arg[2]);
  FV_GRID(j, a.arg[0]) {
    const u32 i = pairs[2 * j];
    if (i < a.arg[1]) out[i] = __fadd_rn(out[i], __fmul_rn(__uint_as_float(pairs[2 * j + 1]), f));
  }
}
"#;
