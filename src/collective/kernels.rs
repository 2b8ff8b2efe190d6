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
pub fn cast_batch(
    gpu: &Gpu,
    stream: &Stream,
    items: &[(DeviceRange, DeviceRange, usize)],
    wire: DataType,
    into_wire: bool,
    factor: f64,
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
    gpu.launch_batched(stream, kernel, &spans, factor as f32)
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
    gpu.launch_batched(stream, kernel, &spans, 1.0)
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
    // the destination is one counter, whatever the count of values
    let kernel = Elementwise {
        library: &LIBRARY,
        name,
        src_size: dtype.size(),
        dst_size: 0,
    };
    let spans = items
        .iter()
        .map(|(values, counter, n)| {
            counter.holds(4, "NaN counter")?;
            Span::new(*values, *counter, *n, &kernel)
        })
        .collect::<Result<Vec<_>>>()?;
    gpu.launch_batched(stream, kernel, &spans, 1.0)
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
// buffer in one launch, scaled on the way (block row y handles span y)
struct Span { const void* src; void* dst; u64 n; };
struct SpanBatch { Span d[128]; int n; float factor; };
#define FV_SPAN(S, D, body) \
  if ((int)blockIdx.y >= b.n) return; \
  const Span sp = b.d[blockIdx.y]; \
  const S* s = (const S*)sp.src; D* d = (D*)sp.dst; const float g = b.factor; \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < sp.n; i += (u64)gridDim.x * blockDim.x) { body; }
extern "C" __global__ void fv_pack_f32_f16(const SpanBatch b) {
  FV_SPAN(float, unsigned short, d[i] = f2h(s[i] * g)) }
extern "C" __global__ void fv_unpack_f16_f32(const SpanBatch b) {
  FV_SPAN(unsigned short, float, d[i] = h2f(s[i]) * g) }
extern "C" __global__ void fv_pack_f32_bf16(const SpanBatch b) {
  FV_SPAN(float, unsigned short, d[i] = f2b(s[i] * g)) }
extern "C" __global__ void fv_unpack_bf16_f32(const SpanBatch b) {
  FV_SPAN(unsigned short, float, d[i] = b2f(s[i]) * g) }
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
            "Span d[{}]; int n; float factor;",
            crate::transport::cuda::SPAN_BATCH
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
