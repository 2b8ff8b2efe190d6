//! The GPU compute kernels of the collectives — scaling (pre/postscale, averaging), elementwise
//! reduction (the ring), gossip's neighbour average — and f32↔f16/bf16 casts, one tensor at a time or batched over a fusion
//! buffer's tensors (the 16-bit codecs): CUDA C compiled once per process by NVRTC, loaded and
//! launched by `transport::cuda`. Each computes
//! as the host's `elementwise` does, so host and GPU results agree bit for bit.

use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::ReduceOp;
use crate::transport::cuda::{Elementwise, Extra, Gpu, KernelLibrary, Span, Stream};
use crate::transport::memory::DeviceRange;

/// Every kernel below, for loading (`Gpu::load`).
pub static LIBRARY: KernelLibrary = KernelLibrary {
    name: "ferrovod_compute.cu",
    source: SOURCE,
    kernels: &[
        "fv_scale_u8",
        "fv_scale_i8",
        "fv_scale_u16",
        "fv_scale_i16",
        "fv_scale_i32",
        "fv_scale_i64",
        "fv_scale_f16",
        "fv_scale_bf16",
        "fv_scale_f32",
        "fv_scale_f64",
        "fv_cast_f32_f16",
        "fv_cast_f16_f32",
        "fv_cast_f32_bf16",
        "fv_cast_bf16_f32",
        "fv_pack_f32_f16",
        "fv_unpack_f16_f32",
        "fv_pack_f32_bf16",
        "fv_unpack_bf16_f32",
        "fv_mean_f16",
        "fv_mean_bf16",
        "fv_mean_f32",
        "fv_mean_f64",
        "fv_count_non_finite_16",
        "fv_count_non_finite_bf16",
        "fv_count_non_finite_f32",
        "fv_count_non_finite_f64",
        "fv_reduce_u8",
        "fv_reduce_i8",
        "fv_reduce_u16",
        "fv_reduce_i16",
        "fv_reduce_i32",
        "fv_reduce_i64",
        "fv_reduce_f16",
        "fv_reduce_bf16",
        "fv_reduce_f32",
        "fv_reduce_f64",
        "fv_reduce_bool",
        "fv_add_f32",
        "fv_u8_bounds",
        "fv_u8_encode",
        "fv_u8_sum",
        "fv_u8_decode",
    ],
};

/// The scaling kernel of `dtype` (every dtype but bool).
fn scale_kernel(dtype: DataType) -> Option<&'static str> {
    Some(match dtype {
        DataType::U8 => "fv_scale_u8",
        DataType::I8 => "fv_scale_i8",
        DataType::U16 => "fv_scale_u16",
        DataType::I16 => "fv_scale_i16",
        DataType::I32 => "fv_scale_i32",
        DataType::I64 => "fv_scale_i64",
        DataType::F16 => "fv_scale_f16",
        DataType::BF16 => "fv_scale_bf16",
        DataType::F32 => "fv_scale_f32",
        DataType::F64 => "fv_scale_f64",
        DataType::Bool => return None,
    })
}

/// The reduction kernel of `dtype` (every dtype).
fn reduce_kernel(dtype: DataType) -> &'static str {
    match dtype {
        DataType::U8 => "fv_reduce_u8",
        DataType::I8 => "fv_reduce_i8",
        DataType::U16 => "fv_reduce_u16",
        DataType::I16 => "fv_reduce_i16",
        DataType::I32 => "fv_reduce_i32",
        DataType::I64 => "fv_reduce_i64",
        DataType::F16 => "fv_reduce_f16",
        DataType::BF16 => "fv_reduce_bf16",
        DataType::F32 => "fv_reduce_f32",
        DataType::F64 => "fv_reduce_f64",
        DataType::Bool => "fv_reduce_bool",
    }
}

/// `dst[i] = src[i] * factor` for `n` elements (src may equal dst). Integers are scaled in f64
/// and truncated, 32- and 16-bit floats in f32, as the host path does, except that for f16 the
/// factor is first rounded to f16: Horovod's GPU kernels multiply in half precision, and its
/// tests expect that rounding for CUDA tensors.
pub fn scale(
    gpu: &Gpu,
    stream: &Stream,
    src: DeviceRange,
    dst: DeviceRange,
    n: usize,
    dtype: DataType,
    factor: f64,
) -> Result<()> {
    if factor == 1.0 && src.ptr() == dst.ptr() || n == 0 {
        return Ok(());
    }
    let name = scale_kernel(dtype)
        .ok_or_else(|| Error::InvalidArgument(format!("{} cannot be scaled", dtype.name())))?;
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size: dtype.size(),
        dst_size: dtype.size(),
    };
    gpu.launch_elementwise(stream, kernel, src, dst, n, Extra::Factor(factor))
}

/// Converts `n` elements between f32 and f16/bf16 (round to nearest even).
pub fn cast(
    gpu: &Gpu,
    stream: &Stream,
    src: DeviceRange,
    from: DataType,
    dst: DeviceRange,
    to: DataType,
    n: usize,
) -> Result<()> {
    let name = match (from, to) {
        (DataType::F32, DataType::F16) => "fv_cast_f32_f16",
        (DataType::F16, DataType::F32) => "fv_cast_f16_f32",
        (DataType::F32, DataType::BF16) => "fv_cast_f32_bf16",
        (DataType::BF16, DataType::F32) => "fv_cast_bf16_f32",
        _ => {
            return Err(Error::InvalidArgument(format!(
                "no GPU cast from {} to {}",
                from.name(),
                to.name()
            )));
        }
    };
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size: from.size(),
        dst_size: to.size(),
    };
    gpu.launch_elementwise(stream, kernel, src, dst, n, Extra::None)
}

/// Packs (`into_wire`: f32 tensors into 16-bit places of a fusion buffer) or unpacks (the
/// reverse) every `(source, destination, elements)` in one batched launch per 128, multiplying
/// by `factor` in f32 on the way (before rounding when packing, after widening when unpacking).
/// Packing with `overflows` (one u32 per item) adds to item k's counter how many finite scaled
/// values left `wire`'s range (they travel as infinities), as the host's
/// `elementwise::encode_half` counts them: the 16-bit codecs' overflow report, in the same pass.
pub fn cast_batch(
    gpu: &Gpu,
    stream: &Stream,
    items: &[(DeviceRange, DeviceRange, usize)],
    wire: DataType,
    into_wire: bool,
    factor: f64,
    overflows: Option<DeviceRange>,
) -> Result<()> {
    let name = match (wire, into_wire) {
        (DataType::F16, true) => "fv_pack_f32_f16",
        (DataType::F16, false) => "fv_unpack_f16_f32",
        (DataType::BF16, true) => "fv_pack_f32_bf16",
        (DataType::BF16, false) => "fv_unpack_bf16_f32",
        _ => {
            return Err(Error::InvalidArgument(format!(
                "no GPU codec travels as {}",
                wire.name()
            )));
        }
    };
    let (src_size, dst_size) = if into_wire { (4, 2) } else { (2, 4) };
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size,
        dst_size,
    };
    let spans = items
        .iter()
        .map(|(s, d, n)| Span::new(*s, *d, *n, &kernel))
        .collect::<Result<Vec<_>>>()?;
    let counts = overflows.filter(|_| into_wire);
    gpu.launch_batched(stream, kernel, &spans, factor as f32, counts)
}

/// `dst[i] = (dst[i] + src[i]) / 2` for every `(src, dst, elements)` of a floating `dtype`, in
/// one batched launch per 128, as the host's `mean_of_two` computes it (16-bit values summed
/// in f32, the sum rounded to the dtype, then halved): gossip's neighbour average.
pub fn mean_batch(
    gpu: &Gpu,
    stream: &Stream,
    items: &[(DeviceRange, DeviceRange, usize)],
    dtype: DataType,
) -> Result<()> {
    let name = match dtype {
        DataType::F16 => "fv_mean_f16",
        DataType::BF16 => "fv_mean_bf16",
        DataType::F32 => "fv_mean_f32",
        DataType::F64 => "fv_mean_f64",
        other => {
            return Err(Error::InvalidArgument(format!(
                "{} has no mean kernel",
                other.name()
            )));
        }
    };
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size: dtype.size(),
        dst_size: dtype.size(),
    };
    let spans = items
        .iter()
        .map(|(s, d, n)| Span::new(*s, *d, *n, &kernel))
        .collect::<Result<Vec<_>>>()?;
    gpu.launch_batched(stream, kernel, &spans, 1.0, None)
}

/// Adds to the u32 counter at each `(values, counter, elements)` how many of the values are NaN
/// or infinite (floating `dtype`s), in one batched launch per 128: the NaN check of GPU
/// batches, which reads the counters once the batch is done.
pub fn count_non_finite_batch(
    gpu: &Gpu,
    stream: &Stream,
    items: &[(DeviceRange, DeviceRange, usize)],
    dtype: DataType,
) -> Result<()> {
    let name = match dtype {
        DataType::F16 => "fv_count_non_finite_16",
        DataType::BF16 => "fv_count_non_finite_bf16",
        DataType::F32 => "fv_count_non_finite_f32",
        DataType::F64 => "fv_count_non_finite_f64",
        other => {
            return Err(Error::InvalidArgument(format!(
                "{} holds no NaN or infinite values",
                other.name()
            )));
        }
    };
    count_batch(gpu, stream, name, dtype.size(), items)
}

/// Launches the counting kernel `name` over `(values, counter, elements)` items, values of
/// `size` bytes: the destination of each is one u32 counter, whatever the count of values.
fn count_batch(
    gpu: &Gpu,
    stream: &Stream,
    name: &'static str,
    size: usize,
    items: &[(DeviceRange, DeviceRange, usize)],
) -> Result<()> {
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size: size,
        dst_size: 0,
    };
    let spans = items
        .iter()
        .map(|(values, counter, n)| {
            counter.holds(4, "counter")?;
            Span::new(*values, *counter, *n, &kernel)
        })
        .collect::<Result<Vec<_>>>()?;
    gpu.launch_batched(stream, kernel, &spans, 1.0, None)
}

/// `acc[i] = op(acc[i], x[i])` for `n` elements of any dtype (Sum, Min, Max or Product),
/// computed as the host's `reduce_into` computes it.
pub fn reduce_into(
    gpu: &Gpu,
    stream: &Stream,
    acc: DeviceRange,
    x: DeviceRange,
    n: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    // the kernels' `op` parameter is the same index
    let code = op.elementwise_index()? as i32;
    let kernel = Elementwise {
        library: &LIBRARY,
        name: reduce_kernel(dtype),
        src_size: dtype.size(),
        dst_size: dtype.size(),
    };
    gpu.launch_elementwise(stream, kernel, x, acc, n, Extra::Op(code))
}

/// `dst[i] += src[i]` in f32 for every `(src, dst, elements)`, in one batched launch per 128:
/// the u8 codec's residuals added to the packed contributions.
pub fn add_batch(
    gpu: &Gpu,
    stream: &Stream,
    items: &[(DeviceRange, DeviceRange, usize)],
) -> Result<()> {
    let kernel = Elementwise {
        library: &LIBRARY,
        name: "fv_add_f32",
        src_size: 4,
        dst_size: 4,
    };
    let spans = items
        .iter()
        .map(|(s, d, n)| Span::new(*s, *d, *n, &kernel))
        .collect::<Result<Vec<_>>>()?;
    gpu.launch_batched(stream, kernel, &spans, 1.0, None)
}

/// A kernel launched by `Gpu::launch_ranges` (no element sizes).
fn ranges_kernel(name: &'static str) -> Elementwise {
    Elementwise::ranges(&LIBRARY, name)
}

/// Blocks in x for a grid-stride loop over `len` elements.
fn blocks_for(len: usize) -> u32 {
    len.div_ceil(256 * 4).clamp(1, 512) as u32
}

/// The values of the largest of `chunks` chunks of `values` values, checked to fit blocks
/// `stride` bytes apart.
fn u8_chunk_values(values: usize, chunks: usize, stride: usize) -> Result<usize> {
    let largest = values.div_ceil(chunks.max(1));
    if stride < crate::compress::quantize::block_stride(largest) {
        return Err(Error::Internal("u8 block stride too small".into()));
    }
    Ok(largest)
}

/// Bytes of the bounds of `chunks` chunks (`u8_bounds`).
pub fn u8_bounds_bytes(chunks: usize) -> usize {
    12 * chunks
}

/// Encodes `values` f32 (`x`) split into `chunks` chunks as `ring::chunk` splits them, into
/// blocks `stride` bytes apart, as the host's `quantize::encode` does bit for bit; what rounding
/// loses is written to `lost` (or, with `accumulate`, added to it). `bounds`
/// (`u8_bounds_bytes(chunks)`) is scratch: zeroed here, then each chunk's extremes.
#[allow(clippy::too_many_arguments)] // the values, their losses, the blocks and the scratch
pub fn u8_encode(
    gpu: &Gpu,
    stream: &Stream,
    x: DeviceRange,
    lost: DeviceRange,
    blocks: DeviceRange,
    bounds: DeviceRange,
    values: usize,
    chunks: usize,
    stride: usize,
    accumulate: bool,
) -> Result<()> {
    x.holds(values * 4, "u8 values")?;
    lost.holds(values * 4, "u8 losses")?;
    blocks.holds(chunks * stride, "u8 blocks")?;
    bounds.holds(u8_bounds_bytes(chunks), "u8 bounds")?;
    let largest = u8_chunk_values(values, chunks, stride)?;
    let bounds = bounds.first(u8_bounds_bytes(chunks))?;
    gpu.memset_zero(stream, bounds)?;
    let grid = (blocks_for(largest), chunks as u32);
    let (n, c, w) = (values as u64, chunks as u64, stride as u64);
    gpu.launch_ranges(
        stream,
        ranges_kernel("fv_u8_bounds"),
        &[x, bounds],
        &[n, c],
        grid,
    )?;
    gpu.launch_ranges(
        stream,
        ranges_kernel("fv_u8_encode"),
        &[x, lost, blocks, bounds],
        &[n, c, w, u64::from(accumulate)],
        grid,
    )
}

/// `sum[i]` = the sum over the `ranks` blocks at `blocks` (`stride` bytes apart, `values` values
/// each) of their decoded values, in rank order from 0.0, as the host's `decode` with `add`.
pub fn u8_sum(
    gpu: &Gpu,
    stream: &Stream,
    blocks: DeviceRange,
    sum: DeviceRange,
    ranks: usize,
    stride: usize,
    values: usize,
) -> Result<()> {
    blocks.holds(ranks * stride, "u8 received blocks")?;
    sum.holds(values * 4, "u8 sum")?;
    u8_chunk_values(values, 1, stride)?;
    let args = [ranks as u64, stride as u64, values as u64];
    let grid = (blocks_for(values), 1);
    gpu.launch_ranges(
        stream,
        ranges_kernel("fv_u8_sum"),
        &[blocks, sum],
        &args,
        grid,
    )
}

/// Decodes the `chunks` blocks of a batch of `values` values into `out` (f32), each value times
/// `factor`, as the host's `quantized::Reduced::write` does bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn u8_decode(
    gpu: &Gpu,
    stream: &Stream,
    blocks: DeviceRange,
    out: DeviceRange,
    values: usize,
    chunks: usize,
    stride: usize,
    factor: f32,
) -> Result<()> {
    blocks.holds(chunks * stride, "u8 blocks")?;
    out.holds(values * 4, "u8 output")?;
    let largest = u8_chunk_values(values, chunks, stride)?;
    let args = [
        values as u64,
        chunks as u64,
        stride as u64,
        u64::from(factor.to_bits()),
    ];
    let grid = (blocks_for(largest), chunks as u32);
    gpu.launch_ranges(
        stream,
        ranges_kernel("fv_u8_decode"),
        &[blocks, out],
        &args,
        grid,
    )
}

/// The kernels. Half conversions use PTX `cvt` (sm_53+); bfloat16 rounds to nearest even in
/// integer arithmetic, as `half` does.
const SOURCE: &str = r#"
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float b2f(unsigned short b) {
  return __uint_as_float(((unsigned)b) << 16);
}
__device__ __forceinline__ unsigned short f2b(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

#define FV_LOOP for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)

#define FV_SCALE_INT(name, T) \
extern "C" __global__ void fv_scale_##name(const T* s, T* d, u64 n, double f) { \
  FV_LOOP { d[i] = (T)((double)s[i] * f); } }
FV_SCALE_INT(u8, unsigned char)
FV_SCALE_INT(i8, signed char)
FV_SCALE_INT(u16, unsigned short)
FV_SCALE_INT(i16, short)
FV_SCALE_INT(i32, int)
FV_SCALE_INT(i64, long long)

extern "C" __global__ void fv_scale_f64(const double* s, double* d, u64 n, double f) {
  FV_LOOP { d[i] = s[i] * f; } }
extern "C" __global__ void fv_scale_f32(const float* s, float* d, u64 n, double f) {
  float g = (float)f; FV_LOOP { d[i] = s[i] * g; } }
extern "C" __global__ void fv_scale_f16(const unsigned short* s, unsigned short* d, u64 n, double f) {
  float g = h2f(f2h((float)f)); FV_LOOP { d[i] = f2h(h2f(s[i]) * g); } }
extern "C" __global__ void fv_scale_bf16(const unsigned short* s, unsigned short* d, u64 n, double f) {
  float g = (float)f; FV_LOOP { d[i] = f2b(b2f(s[i]) * g); } }

extern "C" __global__ void fv_cast_f32_f16(const float* s, unsigned short* d, u64 n) {
  FV_LOOP { d[i] = f2h(s[i]); } }
extern "C" __global__ void fv_cast_f16_f32(const unsigned short* s, float* d, u64 n) {
  FV_LOOP { d[i] = h2f(s[i]); } }
extern "C" __global__ void fv_cast_f32_bf16(const float* s, unsigned short* d, u64 n) {
  FV_LOOP { d[i] = f2b(s[i]); } }
extern "C" __global__ void fv_cast_bf16_f32(const unsigned short* s, float* d, u64 n) {
  FV_LOOP { d[i] = b2f(s[i]); } }

// batched casts of the 16-bit codecs: many tensors packed into (or unpacked from) a fusion
// buffer in one launch, scaled on the way
struct Span { const void* src; void* dst; u64 n; };
struct SpanBatch { Span d[128]; int n; float factor; unsigned* counts; unsigned start[129]; };
// one 1-D grid over the spans: span y has blocks start[y]..start[y + 1] (a short span few, so
// no block idles); each block finds its span by binary search
#define FV_SPAN_HEAD(S, D) \
  int y = 0; \
  for (int h = 64; h > 0; h >>= 1) \
    if (y + h < b.n && b.start[y + h] <= blockIdx.x) y += h; \
  const Span sp = b.d[y]; \
  const u64 first = blockIdx.x - b.start[y], blocks = b.start[y + 1] - b.start[y]; \
  const S* s = (const S*)sp.src; D* d = (D*)sp.dst; const float g = b.factor;
#define FV_SPAN(S, D, body) \
  FV_SPAN_HEAD(S, D) \
  for (u64 i = first * blockDim.x + threadIdx.x; i < sp.n; i += blocks * blockDim.x) { body; }
// the same, four elements a thread at a time through vector loads and stores (VS, VD) where
// both ends are aligned for them, the body run on each of the four; the rest one by one
#define FV_SPAN4(S, D, VS, VD, body) \
  FV_SPAN_HEAD(S, D) \
  const u64 step = blocks * blockDim.x, t = first * blockDim.x + threadIdx.x; \
  const u64 nv = ((u64)s % sizeof(VS) == 0 && (u64)d % sizeof(VD) == 0) ? sp.n / 4 : 0; \
  for (u64 j = t; j < nv; j += step) { \
    __align__(16) S s4[4]; __align__(16) D d4[4]; \
    *(VS*)s4 = ((const VS*)s)[j]; \
    { const S* s = s4; D* d = d4; \
      _Pragma("unroll") for (int i = 0; i < 4; i++) { body; } } \
    ((VD*)d)[j] = *(VD*)d4; \
  } \
  for (u64 i = 4 * nv + t; i < sp.n; i += step) { body; }
// packing counts, where asked, the finite scaled values that travel as infinities
#define FV_OVERFLOW(v, h, inf) \
  if (b.counts && (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u && ((h) & 0x7fffu) == (inf)) \
    atomicAdd(b.counts + y, 1u);
extern "C" __global__ void fv_pack_f32_f16(const SpanBatch b) {
  FV_SPAN4(float, unsigned short, float4, ushort4, { float v = s[i] * g; unsigned short h = f2h(v); d[i] = h;
    FV_OVERFLOW(v, h, 0x7c00u) }) }
extern "C" __global__ void fv_unpack_f16_f32(const SpanBatch b) {
  FV_SPAN4(unsigned short, float, ushort4, float4, d[i] = h2f(s[i]) * g) }
extern "C" __global__ void fv_pack_f32_bf16(const SpanBatch b) {
  FV_SPAN4(float, unsigned short, float4, ushort4, { float v = s[i] * g; unsigned short h = f2b(v); d[i] = h;
    FV_OVERFLOW(v, h, 0x7f80u) }) }
extern "C" __global__ void fv_unpack_bf16_f32(const SpanBatch b) {
  FV_SPAN4(unsigned short, float, ushort4, float4, d[i] = b2f(s[i]) * g) }
// the NaN check: a value is NaN or infinite when its exponent bits are all set
extern "C" __global__ void fv_count_non_finite_16(const SpanBatch b) {
  FV_SPAN(unsigned short, unsigned, if ((s[i] & 0x7c00u) == 0x7c00u) atomicAdd(d, 1u)) }
extern "C" __global__ void fv_count_non_finite_bf16(const SpanBatch b) {
  FV_SPAN(unsigned short, unsigned, if ((s[i] & 0x7f80u) == 0x7f80u) atomicAdd(d, 1u)) }
extern "C" __global__ void fv_count_non_finite_f32(const SpanBatch b) {
  FV_SPAN(unsigned, unsigned, if ((s[i] & 0x7f800000u) == 0x7f800000u) atomicAdd(d, 1u)) }
extern "C" __global__ void fv_count_non_finite_f64(const SpanBatch b) {
  FV_SPAN(u64, unsigned, if ((s[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) atomicAdd(d, 1u)) }
// gossip's neighbour average, in place over this rank's values
extern "C" __global__ void fv_mean_f16(const SpanBatch b) {
  FV_SPAN(unsigned short, unsigned short, d[i] = f2h(h2f(f2h(h2f(d[i]) + h2f(s[i]))) * 0.5f)) }
extern "C" __global__ void fv_mean_bf16(const SpanBatch b) {
  FV_SPAN(unsigned short, unsigned short, d[i] = f2b(b2f(f2b(b2f(d[i]) + b2f(s[i]))) * 0.5f)) }
extern "C" __global__ void fv_mean_f32(const SpanBatch b) {
  FV_SPAN(float, float, d[i] = (d[i] + s[i]) * 0.5f) }
extern "C" __global__ void fv_mean_f64(const SpanBatch b) {
  FV_SPAN(double, double, d[i] = (d[i] + s[i]) * 0.5) }

// d[i] = op(d[i], s[i]); op: 0 sum, 1 min, 2 max, 3 product. Integers wrap (computed unsigned),
// 16-bit floats in f32, bool's sum and max are OR, its min and product AND: as the host does.
#define FV_REDUCE_INT(name, T, U) \
extern "C" __global__ void fv_reduce_##name(const T* s, T* d, u64 n, int op) { \
  FV_LOOP { T a = d[i], b = s[i]; \
    d[i] = op == 1 ? (a < b ? a : b) : op == 2 ? (a > b ? a : b) \
         : op == 3 ? (T)((U)a * (U)b) : (T)((U)a + (U)b); } }
FV_REDUCE_INT(u8, unsigned char, unsigned)
FV_REDUCE_INT(i8, signed char, unsigned)
FV_REDUCE_INT(u16, unsigned short, unsigned)
FV_REDUCE_INT(i16, short, unsigned)
FV_REDUCE_INT(i32, int, unsigned)
FV_REDUCE_INT(i64, long long, unsigned long long)

__device__ __forceinline__ float fv_op(float a, float b, int op) {
  return op == 1 ? fminf(a, b) : op == 2 ? fmaxf(a, b) : op == 3 ? a * b : a + b;
}
extern "C" __global__ void fv_reduce_f32(const float* s, float* d, u64 n, int op) {
  FV_LOOP { d[i] = fv_op(d[i], s[i], op); } }
extern "C" __global__ void fv_reduce_f64(const double* s, double* d, u64 n, int op) {
  FV_LOOP { double a = d[i], b = s[i];
    d[i] = op == 1 ? fmin(a, b) : op == 2 ? fmax(a, b) : op == 3 ? a * b : a + b; } }
extern "C" __global__ void fv_reduce_f16(const unsigned short* s, unsigned short* d, u64 n, int op) {
  FV_LOOP { d[i] = f2h(fv_op(h2f(d[i]), h2f(s[i]), op)); } }
extern "C" __global__ void fv_reduce_bf16(const unsigned short* s, unsigned short* d, u64 n, int op) {
  FV_LOOP { d[i] = f2b(fv_op(b2f(d[i]), b2f(s[i]), op)); } }
// the u8 codec's residuals added to the packed contributions
extern "C" __global__ void fv_add_f32(const SpanBatch b) {
  FV_SPAN(float, float, d[i] = __fadd_rn(d[i], s[i])) }

// The u8 codec (compress/quantize.rs and collective/quantized.rs, bit for bit: every operation
// rounded on its own, never fused). Chunk c of N values over n chunks as ring::chunk splits
// them; block c of a batch lies c * stride bytes in: minimum, step (f32), one byte per value.
struct Ranges { u64 at[8]; u64 len[8]; u64 arg[8]; };
__device__ __forceinline__ void fv_chunk(u64 N, u64 n, u64 c, u64* start, u64* len) {
  u64 base = N / n, extra = N % n;
  *start = c * base + (c < extra ? c : extra);
  *len = base + (c < extra ? 1 : 0);
}
// a key that orders as the floats do (NaN aside)
__device__ __forceinline__ unsigned fv_key(float f) {
  unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float fv_unkey(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
#define FV_CHUNK_LOOP for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
// at[0]: arg[0] f32 values in arg[1] chunks (block row y: chunk y); at[1]: per chunk three
// zeroed u32, which become the complement of the minimum's key, the maximum's key (both by
// atomicMax) and whether a value is NaN or infinite
extern "C" __global__ void fv_u8_bounds(const Ranges a) {
  const float* x = (const float*)a.at[0]; unsigned* b = (unsigned*)a.at[1] + 3 * blockIdx.y;
  u64 start, len; fv_chunk(a.arg[0], a.arg[1], blockIdx.y, &start, &len);
  unsigned lo = 0, hi = 0, bad = 0;
  FV_CHUNK_LOOP {
    float v = x[start + i]; unsigned k = fv_key(v);
    lo = max(lo, ~k); hi = max(hi, k);
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = max(lo, __shfl_down_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_down_sync(0xffffffffu, hi, o));
    bad |= __shfl_down_sync(0xffffffffu, bad, o);
  }
  __shared__ unsigned s[3][32];
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  if (l == 0) { s[0][w] = lo; s[1][w] = hi; s[2][w] = bad; }
  __syncthreads();
  if (w != 0) return;
  unsigned warps = blockDim.x / 32;
  lo = l < warps ? s[0][l] : 0; hi = l < warps ? s[1][l] : 0; bad = l < warps ? s[2][l] : 0;
  for (int o = 16; o > 0; o >>= 1) {
    lo = max(lo, __shfl_down_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_down_sync(0xffffffffu, hi, o));
    bad |= __shfl_down_sync(0xffffffffu, bad, o);
  }
  if (l == 0 && len > 0) { atomicMax(b, lo); atomicMax(b + 1, hi); if (bad) atomicOr(b + 2, 1u); }
}
// at[0]: values, at[1]: their losses (written; added to with arg[3]), at[2]: blocks (arg[2]
// bytes apart), at[3]: fv_u8_bounds' result; arg[0] values, arg[1] chunks
extern "C" __global__ void fv_u8_encode(const Ranges a) {
  const float* x = (const float*)a.at[0]; float* lost = (float*)a.at[1];
  unsigned char* out = (unsigned char*)a.at[2] + blockIdx.y * a.arg[2];
  const unsigned* b = (const unsigned*)a.at[3] + 3 * blockIdx.y;
  u64 start, len; fv_chunk(a.arg[0], a.arg[1], blockIdx.y, &start, &len);
  const bool finite = len == 0 || b[2] == 0;
  float min = 0.0f, step = 0.0f, cap = 0.0f;
  if (!finite) { min = __int_as_float(0x7fc00000); step = min; }
  else if (len > 0) {
    // as the host's quantize::top: a range, or a top, beyond f32 stops short of FLT_MAX
    min = fv_unkey(~b[0]); cap = fv_unkey(b[1]);
    step = __fdiv_rn(__fsub_rn(cap, min), 255.0f);
    if (isinf(__fsub_rn(cap, min)) || isinf(__fadd_rn(min, __fmul_rn(255.0f, step)))) {
      step = (min < 0.0f ? 3.40282347e38f : __fsub_rn(3.40282347e38f, min)) / 256.0f;
      cap = __fadd_rn(min, __fmul_rn(255.0f, step));
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) { ((float*)out)[0] = min; ((float*)out)[1] = step; }
  const float inv = step > 0.0f ? __fdiv_rn(1.0f, step) : 0.0f;
  const float round = 12582912.0f;
  unsigned char* q = out + 8;
  FV_CHUNK_LOOP {
    float v = x[start + i], l = 0.0f;
    if (finite) {
      const float d = __fsub_rn(fminf(v, cap), min);
      // as the host's quantize::encode: a subnormal step's inverse overflows, so divide
      float sh = __fadd_rn(isinf(inv) ? __fdiv_rn(d, step) : __fmul_rn(d, inv), round);
      q[i] = (unsigned char)(__float_as_uint(sh) & 0xffu);
      l = __fsub_rn(v, __fadd_rn(min, __fmul_rn(__fsub_rn(sh, round), step)));
      // as the host's: saturated, only a range beyond f32 leaves more than FLT_MAX behind
      l = fminf(fmaxf(l, -3.40282347e38f), 3.40282347e38f);
    } else {
      q[i] = 0;
    }
    lost[start + i] = a.arg[3] ? __fadd_rn(lost[start + i], l) : l;
  }
}
// at[0]: arg[0] blocks, arg[1] bytes apart, of arg[2] values each; at[1]: their f32 sum
extern "C" __global__ void fv_u8_sum(const Ranges a) {
  const unsigned char* blocks = (const unsigned char*)a.at[0]; float* sum = (float*)a.at[1];
  const u64 len = a.arg[2];
  FV_CHUNK_LOOP {
    float o = 0.0f;
    for (u64 r = 0; r < a.arg[0]; r++) {
      const unsigned char* blk = blocks + r * a.arg[1];
      float min = ((const float*)blk)[0], step = ((const float*)blk)[1];
      o = __fadd_rn(o, __fadd_rn(min, __fmul_rn((float)blk[8 + i], step)));
    }
    sum[i] = o;
  }
}
// at[0]: blocks (arg[2] bytes apart), at[1]: arg[0] f32 values out, in arg[1] chunks, each
// times the f32 whose bits are arg[3]
extern "C" __global__ void fv_u8_decode(const Ranges a) {
  const unsigned char* blk = (const unsigned char*)a.at[0] + blockIdx.y * a.arg[2];
  float* out = (float*)a.at[1];
  u64 start, len; fv_chunk(a.arg[0], a.arg[1], blockIdx.y, &start, &len);
  const float f = __uint_as_float((unsigned)a.arg[3]);
  const float min = __fmul_rn(((const float*)blk)[0], f), step = __fmul_rn(((const float*)blk)[1], f);
  FV_CHUNK_LOOP { out[start + i] = __fadd_rn(min, __fmul_rn((float)blk[8 + i], step)); }
}
extern "C" __global__ void fv_reduce_bool(const unsigned char* s, unsigned char* d, u64 n, int op) {
  FV_LOOP { d[i] = (op == 0 || op == 2) ? (d[i] | s[i]) : (d[i] & s[i]); } }
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `SOURCE` defines `name`, directly or through its instantiating macro.
    fn defined(name: &str) -> bool {
        let (family, suffix) = name.rsplit_once('_').expect("fv_<family>_<dtype>");
        let family = family.trim_start_matches("fv_").to_uppercase();
        SOURCE.contains(&format!(" {name}("))
            || SOURCE.contains(&format!("\nFV_{family}_INT({suffix}, "))
    }

    #[test]
    fn batched_casts_match_their_parameter_and_are_loaded() {
        let decl = format!(
            "Span d[{}]; int n; float factor; unsigned* counts; unsigned start[{}];",
            crate::transport::cuda::SPAN_BATCH,
            crate::transport::cuda::SPAN_BATCH + 1
        );
        assert!(SOURCE.contains(&decl));
        for name in [
            "fv_pack_f32_f16",
            "fv_unpack_f16_f32",
            "fv_pack_f32_bf16",
            "fv_unpack_bf16_f32",
        ] {
            assert!(LIBRARY.kernels.contains(&name), "{name} is not loaded");
            assert!(
                SOURCE.contains(&format!(" {name}(const SpanBatch b)")),
                "{name}"
            );
        }
    }

    #[test]
    fn every_kernel_used_is_loaded_and_defined() {
        for dtype in DataType::ALL {
            for name in [Some(reduce_kernel(dtype)), scale_kernel(dtype)]
                .into_iter()
                .flatten()
            {
                assert!(LIBRARY.kernels.contains(&name), "{name} is not loaded");
            }
        }
        for name in LIBRARY.kernels {
            assert!(defined(name), "{name} is not defined in SOURCE");
        }
        assert!(!defined("fv_scale_bool"));
    }
}
