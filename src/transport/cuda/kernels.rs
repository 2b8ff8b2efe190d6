//! Kernel launches: batched copies and the stages' elementwise kernels, compiled by NVRTC
//! once per process.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUdeviceptr};

use super::*;

/// One range of a batched copy, laid out as the kernel reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Copy {
    pub(super) src: CUdeviceptr,
    pub(super) dst: CUdeviceptr,
    pub(super) len: u64,
}

impl Copy {
    /// (source, destination, bytes), for unit tests of layouts.
    #[cfg(test)]
    pub(crate) fn parts(&self) -> (u64, u64, u64) {
        (self.src, self.dst, self.len)
    }

    /// `len` bytes from `src` to `dst`, both of which must hold them.
    pub fn new(src: DeviceRange, dst: DeviceRange, len: usize) -> Result<Copy> {
        src.holds(len, "copy source")?;
        dst.holds(len, "copy destination")?;
        Ok(Copy {
            src: src.ptr(),
            dst: dst.ptr(),
            len: len as u64,
        })
    }
}

/// Ranges per batched-copy launch: the descriptors travel as the kernel's parameter (3 KiB of
/// the 4 KiB every CUDA device takes), so that a ResNet-50 bucket's 111 small tensors take one
/// launch to pack and one to unpack (BENCHMARKS.md, "Figures moved out of comments").
pub(super) const COPY_BATCH: usize = 128;

#[repr(C)]
pub(super) struct CopyBatch {
    pub(super) d: [Copy; COPY_BATCH],
    pub(super) n: i32,
}

/// `n` elements of a batched kernel: read at `src`, written at `dst`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Span {
    pub(super) src: CUdeviceptr,
    pub(super) dst: CUdeviceptr,
    pub(super) n: u64,
}

impl Span {
    /// `n` elements from `src` to `dst`, which must hold them at `kernel`'s element sizes.
    pub fn new(src: DeviceRange, dst: DeviceRange, n: usize, kernel: &Elementwise) -> Result<Span> {
        src.holds(n.saturating_mul(kernel.src_size), "kernel source")?;
        dst.holds(n.saturating_mul(kernel.dst_size), "kernel destination")?;
        Ok(Span {
            src: src.ptr(),
            dst: dst.ptr(),
            n: n as u64,
        })
    }
}

/// Spans per batched launch (the parameter, as `CopyBatch`, stays under 4 KiB).
pub(crate) const SPAN_BATCH: usize = 128;

/// A batched kernel's parameter, as CUDA C declares it:
/// `struct Span { const void* src; void* dst; u64 n; };
/// struct SpanBatch { Span d[128]; int n; float factor; unsigned* counts;
/// unsigned start[129]; };`
#[repr(C)]
pub(super) struct SpanBatch {
    pub(super) d: [Span; SPAN_BATCH],
    pub(super) n: i32,
    pub(super) factor: f32,
    /// One u32 per span for kernels that count (0: none asked).
    pub(super) counts: u64,
    /// Span k's blocks of the 1-D grid: `start[k]..start[k + 1]`.
    pub(super) start: [u32; SPAN_BATCH + 1],
}

/// Blocks of 256 threads for a span of `n` elements: about 4 elements a thread, at most 512
/// blocks (a grid-stride loop does the rest), none for an empty span.
pub(super) fn span_blocks(n: u64) -> u32 {
    match n {
        0 => 0,
        n => n.div_ceil(256 * 4).min(512) as u32,
    }
}

/// Ranges and integers per `launch_ranges` kernel.
pub(crate) const RANGES: usize = 8;

/// A `launch_ranges` kernel's parameter, as CUDA C declares it:
/// `struct Ranges { u64 at[8]; u64 len[8]; u64 arg[8]; };`
#[repr(C)]
pub(super) struct Ranges {
    pub(super) at: [u64; RANGES],
    pub(super) len: [u64; RANGES],
    pub(super) arg: [u64; RANGES],
}

#[derive(Clone, Copy)]
pub(super) struct Function(pub(super) sys::CUfunction);

// SAFETY: a function handle of a module that lives as long as the process.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

/// The last parameter of an elementwise kernel, if any.
#[derive(Clone, Copy, Debug)]
pub enum Extra {
    None,
    /// A `double`.
    Factor(f64),
    /// An `int`.
    Op(i32),
}

/// Elementwise kernels in CUDA C without headers (NVRTC needs no include path), supplied by the
/// stage that computes with them. Contract: each kernel in `kernels` is
/// `extern "C" __global__ void name(const S* src, D* dst, unsigned long long n[, extra])` and
/// touches elements `0..n` of `src` and `dst` only; or, launched by `Gpu::launch_batched`,
/// `extern "C" __global__ void name(const SpanBatch b)`, where block row `blockIdx.y < b.n`
/// touches elements `0..n` of span `b.d[blockIdx.y]` only; or, launched by `Gpu::launch_ranges`,
/// `extern "C" __global__ void name(const Ranges a)`, touching bytes of the ranges in `a` only.
pub struct KernelLibrary {
    /// A name for NVRTC's messages.
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// One kernel of a library, with the element sizes it reads and writes.
#[derive(Clone, Copy)]
pub struct Elementwise {
    pub library: &'static KernelLibrary,
    pub name: &'static str,
    pub src_size: usize,
    pub dst_size: usize,
}

impl Elementwise {
    /// A `launch_ranges` kernel of `library` (its memory is its ranges, not elements).
    pub const fn ranges(library: &'static KernelLibrary, name: &'static str) -> Elementwise {
        Elementwise {
            library,
            name,
            src_size: 0,
            dst_size: 0,
        }
    }
}

/// A compiled, loaded module (never unloaded: its functions live as long as the process).
pub(super) struct Module(pub(super) sys::CUmodule);

impl Module {
    pub(super) fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let c = std::ffi::CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
        // SAFETY: a loaded module and a NUL-terminated name.
        unsafe { result::module::get_function(self.0, c) }
            .map_err(|e| driver(&format!("kernel {name}"), e))
    }
}

/// Compiles `source` for the context's GPU and loads it.
pub(super) fn compile(ctx: &Arc<CudaContext>, name: &str, source: &str) -> Result<Module> {
    // SAFETY: only tries to dlopen the NVRTC library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Precondition(
            "CUDA is present but NVRTC (libnvrtc.so) could not be loaded; ferrovod compiles its GPU kernels with it".into(),
        ));
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| driver("device attribute", e))?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some(name.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| Error::Backend(format!("NVRTC could not compile {name}: {e:?}")))?;
    let image = std::ffi::CString::new(ptx.to_src())
        .map_err(|_| Error::Internal("PTX with a NUL byte".into()))?;
    ctx.bind_to_thread()
        .map_err(|e| driver("context bind", e))?;
    // SAFETY: a NUL-terminated PTX image; the module is never unloaded.
    let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
        .map_err(|e| driver("module load", e))?;
    Ok(Module(module))
}

/// The batched copy, in CUDA C without headers.
pub(super) const COPY_SOURCE: &str = r#"
typedef unsigned long long u64;
struct CopyDesc { const unsigned char* src; unsigned char* dst; u64 len; };
struct CopyBatch { CopyDesc d[128]; int n; };

extern "C" __global__ void fv_batched_copy(const CopyBatch b) {
  if ((int)blockIdx.y >= b.n) return;
  const CopyDesc c = b.d[blockIdx.y];
  u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  u64 step = (u64)gridDim.x * blockDim.x;
  u64 head = 0;
  if ((((u64)c.src | (u64)c.dst) & 15) == 0) {
    u64 n16 = c.len / 16;
    const uint4* s = (const uint4*)c.src;
    uint4* d = (uint4*)c.dst;
    for (u64 i = tid; i < n16; i += step) d[i] = s[i];
    head = n16 * 16;
  } else if ((((u64)c.src | (u64)c.dst) & 3) == 0) {
    u64 n4 = c.len / 4;
    const unsigned* s = (const unsigned*)c.src;
    unsigned* d = (unsigned*)c.dst;
    for (u64 i = tid; i < n4; i += step) d[i] = s[i];
    head = n4 * 4;
  }
  for (u64 i = head + tid; i < c.len; i += step) c.dst[i] = c.src[i];
}
"#;
