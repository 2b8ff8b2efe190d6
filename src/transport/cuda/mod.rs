//! CUDA through cudarc, loaded at run time: one `libferrovod.so` runs on machines without a
//! driver (GPU requests then fail with [`no_cuda_error`]) and on GPU machines alike. Streams,
//! events and device memory are thin owners of driver handles. Kernels are compiled by NVRTC
//! for the GPU present, once per process: the batched copy here, and the elementwise kernels
//! of the stages that compute (`KernelLibrary`: their CUDA C lives with the stage, this file
//! loads and launches them).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cudarc::driver::sys::{self};
use cudarc::driver::{CudaContext, DriverError, result};

use crate::error::{Error, Result};
use crate::transport::memory::DeviceRange;

mod handles;
mod kernels;
mod signals;

pub use handles::*;
pub use kernels::*;
pub use signals::Signal;

/// The error every GPU request gets where no CUDA driver can be loaded.
pub fn no_cuda_error(device: i32) -> Error {
    Error::Precondition(format!(
        "GPU device {device} requested, but CUDA is not available on this machine (the CUDA driver library libcuda.so could not be loaded); ferrovod runs host-memory tensors only here."
    ))
}

fn driver(what: &str, e: DriverError) -> Error {
    Error::Backend(format!("CUDA {what} failed: {e:?}"))
}

/// Whether a CUDA driver library can be loaded (no other cudarc call is safe before this).
pub fn cuda_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; loads nothing into cudarc's state.
    unsafe { sys::is_culib_present() }
}

/// How many CUDA devices this process sees (0 without CUDA).
pub fn device_count() -> Result<usize> {
    if !cuda_present() {
        return Ok(0);
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| driver("device count", e))
}

/// One GPU of this process: its primary context (the one frameworks use) and the kernels.
pub struct Gpu {
    pub ordinal: i32,
    ctx: Arc<CudaContext>,
    batched_copy: Function,
    /// Elementwise kernels of the libraries loaded so far, by kernel name.
    elementwise: RwLock<HashMap<&'static str, Function>>,
    /// The libraries loaded so far (by name).
    libraries: RwLock<Vec<&'static str>>,
    /// Where `join_events` records: a stream of its own, so joins never wait behind batches.
    joiner: Mutex<Option<Stream>>,
    /// Events for `mark_stream`, reused.
    marks: Arc<MarkPool>,
    /// Dropped `StateMem`, to free in a later batch's stream order (`free_retired`).
    retired: Mutex<Vec<(DeviceMem, Option<Arc<Event>>)>>,
    /// The words callers' streams wait on (`place_signal`), opened by the first wait.
    signals: Mutex<Option<signals::Signals>>,
}

/// Device memory that outlives batches (a codec's per-name state), used by batches on several
/// streams: each waits for the event after the last batch that used it (`before_use`, `used`).
/// Dropped (its store evicting it, its tensor changing shape), it goes back to its GPU's queue
/// and is freed in a later batch's stream order, after that event (`Gpu::free_retired`): no
/// thread waits for the device, so a batch held up by a lost peer holds nothing else up.
pub struct StateMem {
    mem: Option<DeviceMem>,
    gpu: Arc<Gpu>,
    last: Mutex<Option<Arc<Event>>>,
}

impl StateMem {
    /// `len` bytes allocated in `stream`'s order (first used there).
    pub fn new(gpu: &Arc<Gpu>, stream: &Stream, len: usize) -> Result<StateMem> {
        Ok(StateMem {
            mem: Some(gpu.alloc_on(stream, len)?),
            gpu: gpu.clone(),
            last: Mutex::new(None),
        })
    }

    pub fn range(&self) -> DeviceRange {
        self.mem
            .as_ref()
            .map_or_else(DeviceRange::empty, DeviceMem::range)
    }

    /// Orders `stream` after the last batch that used this memory.
    pub fn before_use(&self, stream: &Stream) -> Result<()> {
        match self.last.lock().expect("state memory").as_ref() {
            Some(e) => stream.wait(e),
            None => Ok(()),
        }
    }

    /// The work enqueued before `event` uses this memory.
    pub fn used(&self, event: &Arc<Event>) {
        *self.last.lock().expect("state memory") = Some(event.clone());
    }
}

impl Drop for StateMem {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            let last = self.last.lock().map(|mut l| l.take()).unwrap_or(None);
            self.gpu.retire(mem, last);
        }
    }
}

/// Events for `mark_stream`, reused.
#[derive(Default)]
struct MarkPool {
    free: Mutex<Vec<Event>>,
}

/// The point a caller's stream had reached when a tensor was enqueued: an event recorded there,
/// from the GPU's pool (creating an event costs about as much as the rest of an enqueue; Horovod
/// pools them too).
pub struct StreamMark {
    event: Option<Event>,
    pool: Arc<MarkPool>,
}

impl StreamMark {
    pub fn event(&self) -> &Event {
        self.event.as_ref().expect("held until dropped")
    }
}

impl Drop for StreamMark {
    fn drop(&mut self) {
        // re-recording later is safe: waits already enqueued keep the state they saw
        if let Some(e) = self.event.take() {
            self.pool.free.lock().expect("mark pool").push(e);
        }
    }
}

static GPUS: Mutex<Option<HashMap<i32, Arc<Gpu>>>> = Mutex::new(None);

/// The GPU `ordinal`, opened (context retained, kernels compiled) on first use.
pub fn gpu(ordinal: i32) -> Result<Arc<Gpu>> {
    let mut gpus = GPUS.lock().expect("gpu table");
    let gpus = gpus.get_or_insert_with(HashMap::new);
    if let Some(g) = gpus.get(&ordinal) {
        g.bind()?;
        return Ok(g.clone());
    }
    if !cuda_present() {
        return Err(no_cuda_error(ordinal));
    }
    if ordinal < 0 {
        return Err(Error::InvalidArgument(format!(
            "invalid GPU device {ordinal}"
        )));
    }
    let count = CudaContext::device_count().map_err(|e| driver("device count", e))?;
    if ordinal >= count {
        return Err(Error::InvalidArgument(format!(
            "GPU device {ordinal} requested, but this machine has {count} CUDA device(s)"
        )));
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(|e| driver("context", e))?;
    let module = compile(&ctx, "ferrovod_copy.cu", COPY_SOURCE)?;
    let batched_copy = Function(module.function("fv_batched_copy")?);
    let g = Arc::new(Gpu {
        ordinal,
        ctx,
        batched_copy,
        elementwise: RwLock::default(),
        libraries: RwLock::default(),
        joiner: Mutex::new(None),
        signals: Mutex::new(None),
        marks: Arc::default(),
        retired: Mutex::default(),
    });
    gpus.insert(ordinal, g.clone());
    OPENED.store(true, Ordering::Release);
    Ok(g)
}

/// Whether this process has opened a GPU (`gpu`): before that ferrovod has made no context
/// current on any thread.
static OPENED: AtomicBool = AtomicBool::new(false);

/// The calling thread's current CUDA context, made current again when this is dropped. The C
/// API runs on the framework's threads, whose current context is the framework's current device
/// (`torch.cuda.current_device()` reads it); ferrovod binds the tensors' GPU there to record
/// and wait on streams, and must leave the caller's choice as it found it.
pub struct KeepContext(Option<sys::CUcontext>);

impl KeepContext {
    /// `gpu_call`: the call may open a GPU (a GPU operation); other calls keep the context
    /// only once a GPU is open, so host-only processes never load the driver here.
    pub fn new(gpu_call: bool) -> KeepContext {
        let active = OPENED.load(Ordering::Acquire) || (gpu_call && cuda_present());
        if !active {
            return KeepContext(None);
        }
        // before cuInit no context can be current: the thread has none
        KeepContext(Some(
            result::ctx::get_current()
                .ok()
                .flatten()
                .unwrap_or(std::ptr::null_mut()),
        ))
    }
}

impl Drop for KeepContext {
    fn drop(&mut self) {
        let Some(before) = self.0 else {
            return;
        };
        let now = result::ctx::get_current()
            .ok()
            .flatten()
            .unwrap_or(std::ptr::null_mut());
        if now != before {
            // SAFETY: the context this thread had current when the call began (or none); the
            // call destroys no context, so it is still alive.
            let _ = unsafe { result::ctx::set_current(before) };
        }
    }
}

impl Gpu {
    /// Makes this GPU's context current on the calling thread (driver calls need it).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("context bind", e))
    }

    pub fn new_stream(&self) -> Result<Stream> {
        self.bind()?;
        let s = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("stream create", e))?;
        Ok(Stream(s))
    }

    /// A stream of the device's highest priority: its blocks are scheduled ahead of those of
    /// ordinary streams (communication ahead of copies running beside it).
    pub fn new_priority_stream(&self) -> Result<Stream> {
        self.bind()?;
        let (_, greatest) =
            result::stream::get_priority_range().map_err(|e| driver("stream priorities", e))?;
        let s =
            result::stream::create_with_priority(result::stream::StreamKind::NonBlocking, greatest)
                .map_err(|e| driver("stream create", e))?;
        Ok(Stream(s))
    }

    /// Records where `stream` is now (see `StreamMark`).
    pub fn mark_stream(&self, stream: ForeignStream) -> Result<StreamMark> {
        self.bind()?;
        let pooled = self.marks.free.lock().expect("mark pool").pop();
        let event = match pooled {
            Some(e) => e,
            None => self.new_event()?,
        };
        // on failure the mark's drop returns the event to the pool
        let mark = StreamMark {
            event: Some(event),
            pool: self.marks.clone(),
        };
        mark.event().record_foreign(stream)?;
        Ok(mark)
    }

    pub fn new_event(&self) -> Result<Event> {
        self.bind()?;
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("event create", e))?;
        Ok(Event(e))
    }

    /// An event that fires once every one of `events` has (for an operation whose tensors ran
    /// in batches on different streams).
    pub fn join_events(&self, events: &[&Event]) -> Result<Event> {
        let mut joiner = self.joiner.lock().expect("joiner stream");
        if joiner.is_none() {
            *joiner = Some(self.new_stream()?);
        }
        let stream = joiner.as_ref().expect("joiner stream");
        for e in events {
            stream.wait(e)?;
        }
        let joined = self.new_event()?;
        joined.record(stream)?;
        Ok(joined)
    }

    /// Frees `mem` in a later batch's stream order, once `after` (if any) has fired
    /// (`free_retired`): dropping it would free it synchronously, which waits for the whole
    /// device, and so for a caller's stream that waits on the device for a launch still to
    /// come (`place_signal`). Called from drops too: a poisoned lock drops `mem` instead.
    pub fn retire(&self, mem: DeviceMem, after: Option<Arc<Event>>) {
        if let Ok(mut retired) = self.retired.lock() {
            retired.push((mem, after));
        }
    }

    /// Frees the retired memory (dropped `StateMem`, `retire`) in `stream`'s order, each after
    /// the last batch that used it.
    pub fn free_retired(&self, stream: &Stream) -> Result<()> {
        let retired = std::mem::take(&mut *self.retired.lock().expect("retired memory"));
        for (mem, last) in retired {
            if let Some(e) = last {
                stream.wait(&e)?;
            }
            mem.free_on(stream)?;
        }
        Ok(())
    }

    /// Device memory allocated in `stream`'s order (usable by work enqueued on it after this).
    pub fn alloc_on(&self, stream: &Stream, len: usize) -> Result<DeviceMem> {
        self.bind()?;
        if len == 0 {
            return Ok(DeviceMem { ptr: 0, len: 0 });
        }
        // SAFETY: a stream-ordered allocation in the bound context; freed by Drop or free_on.
        let ptr =
            unsafe { result::malloc_async(stream.0, len) }.map_err(|e| driver("allocation", e))?;
        Ok(DeviceMem { ptr, len })
    }

    /// `len` bytes of page-locked host memory (`PinnedMem`).
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedMem> {
        self.bind()?;
        // SAFETY: a plain page-locked allocation in the bound context; freed by Drop.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| driver("pinned allocation", e))?;
        Ok(PinnedMem {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Copies `src` into the start of `dst` in `stream`'s order, without waiting.
    pub fn copy_to_pinned(
        &self,
        stream: &Stream,
        src: DeviceRange,
        dst: &mut PinnedMem,
    ) -> Result<()> {
        if src.len() > dst.len {
            return Err(Error::Internal(format!(
                "{} bytes into {} of pinned memory",
                src.len(),
                dst.len
            )));
        }
        // SAFETY: `dst` holds `src.len()` bytes (checked) of page-locked memory that lives
        // until it is read after an event recorded behind this copy (`PinnedMem::read`).
        unsafe {
            let host = std::slice::from_raw_parts_mut(dst.ptr, src.len());
            result::memcpy_dtoh_async(host, src.ptr(), stream.0)
        }
        .map_err(|e| driver("copy to pinned memory", e))
    }

    pub fn alloc(&self, len: usize) -> Result<DeviceMem> {
        self.bind()?;
        if len == 0 {
            return Ok(DeviceMem { ptr: 0, len: 0 });
        }
        // SAFETY: a plain allocation in the bound context; freed in Drop.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| driver("allocation", e))?;
        Ok(DeviceMem { ptr, len })
    }

    /// Free and total bytes of this GPU's memory.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(|e| driver("memory info", e))
    }

    /// Copies many byte ranges with one kernel launch per `COPY_BATCH` ranges (not one memcpy each).
    pub fn copy_batch(&self, stream: &Stream, copies: &[Copy]) -> Result<()> {
        for chunk in copies.chunks(COPY_BATCH) {
            let mut batch = CopyBatch {
                d: [Copy::default(); COPY_BATCH],
                n: chunk.len() as i32,
            };
            batch.d[..chunk.len()].copy_from_slice(chunk);
            let longest = chunk.iter().map(|c| c.len).max().unwrap_or(0);
            if longest == 0 {
                continue;
            }
            // 256 threads of 16 bytes each, 4 rounds a block; at most 512 blocks a copy
            let blocks = longest.div_ceil(256 * 16 * 4).clamp(1, 512) as u32;
            let mut params = [(&mut batch as *mut CopyBatch).cast::<c_void>()];
            // SAFETY: the kernel reads `batch` (copied by the launch); each `Copy` was made from
            // ranges checked to hold its bytes (`Copy::new`).
            unsafe {
                result::launch_kernel(
                    self.batched_copy.0,
                    (blocks, chunk.len() as u32, 1),
                    (256, 1, 1),
                    0,
                    stream.0,
                    &mut params,
                )
            }
            .map_err(|e| driver("batched copy launch", e))?;
        }
        Ok(())
    }

    /// Whether `lib` is loaded.
    pub fn loaded(&self, lib: &KernelLibrary) -> bool {
        (self.libraries.read().expect("kernel libraries")).contains(&lib.name)
    }

    /// Compiles and loads `lib` (once per process; later calls return at once), so that its
    /// kernels can be launched and a failing compilation shows when the GPU is first used.
    pub fn load(&self, lib: &KernelLibrary) -> Result<()> {
        if self.loaded(lib) {
            return Ok(());
        }
        let mut loaded = self.libraries.write().expect("kernel libraries");
        if loaded.contains(&lib.name) {
            return Ok(());
        }
        let module = compile(&self.ctx, lib.name, lib.source)?;
        let functions = lib
            .kernels
            .iter()
            .map(|k| Ok((*k, Function(module.function(k)?))))
            .collect::<Result<Vec<_>>>()?;
        let mut table = self.elementwise.write().expect("kernel table");
        if let Some((k, _)) = functions.iter().find(|(k, _)| table.contains_key(k)) {
            return Err(Error::Internal(format!(
                "kernel {k} of {} is already loaded from another library",
                lib.name
            )));
        }
        table.extend(functions);
        loaded.push(lib.name);
        Ok(())
    }

    /// The function of `kernel`, its library loaded first if it is not yet.
    fn function(&self, kernel: Elementwise) -> Result<Function> {
        let found = self
            .elementwise
            .read()
            .expect("kernel table")
            .get(kernel.name)
            .copied();
        match found {
            Some(f) => Ok(f),
            None => {
                let lib = kernel.library;
                self.load(lib)?;
                let table = self.elementwise.read().expect("kernel table");
                table.get(kernel.name).copied().ok_or_else(|| {
                    Error::Internal(format!("{} has no kernel {}", lib.name, kernel.name))
                })
            }
        }
    }

    /// Launches the batched `kernel` over every span, up to `SPAN_BATCH` spans a launch, each
    /// span's elements multiplied by `factor` (the `KernelLibrary` contract for batched
    /// kernels: `name(const SpanBatch b)`). Kernels that count add span k's count to the u32
    /// at `counts` + 4k, where given.
    pub fn launch_batched(
        &self,
        stream: &Stream,
        kernel: Elementwise,
        spans: &[Span],
        factor: f32,
        counts: Option<DeviceRange>,
    ) -> Result<()> {
        if spans.iter().all(|s| s.n == 0) {
            return Ok(());
        }
        if let Some(c) = counts {
            c.holds(4 * spans.len(), "per-span counters")?;
        }
        let f = self.function(kernel)?;
        for (c, chunk) in spans.chunks(SPAN_BATCH).enumerate() {
            let mut batch = SpanBatch {
                d: [Span::default(); SPAN_BATCH],
                n: chunk.len() as i32,
                factor,
                counts: counts.map_or(0, |r| r.ptr() + (4 * SPAN_BATCH * c) as u64),
                start: [0; SPAN_BATCH + 1],
            };
            batch.d[..chunk.len()].copy_from_slice(chunk);
            for (k, s) in chunk.iter().enumerate() {
                batch.start[k + 1] = batch.start[k] + span_blocks(s.n);
            }
            let blocks = batch.start[chunk.len()];
            if blocks == 0 {
                continue;
            }
            let mut params = [(&mut batch as *mut SpanBatch).cast::<c_void>()];
            // SAFETY: the kernel reads `batch` (copied by the launch); each span was made from
            // ranges checked to hold its elements at the kernel's sizes (`Span::new`).
            unsafe {
                result::launch_kernel(f.0, (blocks, 1, 1), (256, 1, 1), 0, stream.0, &mut params)
            }
            .map_err(|e| driver("batched kernel launch", e))?;
        }
        Ok(())
    }

    /// Launches `kernel` over `n` elements: it reads `n` elements of `kernel.src_size` bytes at
    /// `src` and writes `n` of `kernel.dst_size` bytes at `dst` (src may equal dst). Its library
    /// is loaded first if it is not yet.
    pub fn launch_elementwise(
        &self,
        stream: &Stream,
        kernel: Elementwise,
        src: DeviceRange,
        dst: DeviceRange,
        n: usize,
        extra: Extra,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        src.holds(n.saturating_mul(kernel.src_size), "kernel source")?;
        dst.holds(n.saturating_mul(kernel.dst_size), "kernel destination")?;
        let f = self.function(kernel)?;
        let (mut s, mut d, mut count) = (src.ptr(), dst.ptr(), n as u64);
        let (mut factor, mut op) = match extra {
            Extra::Factor(k) => (k, 0),
            Extra::Op(o) => (1.0, o),
            Extra::None => (1.0, 0),
        };
        let blocks = n.div_ceil(256 * 4).clamp(1, 65535) as u32;
        let mut params: Vec<*mut c_void> = vec![
            (&mut s as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
        ];
        match extra {
            Extra::Factor(_) => params.push((&mut factor as *mut f64).cast()),
            Extra::Op(_) => params.push((&mut op as *mut i32).cast()),
            Extra::None => {}
        }
        // SAFETY: elementwise kernels take (src, dst, count) and the parameter `extra` names
        // (the `KernelLibrary` contract); both ranges were checked above to hold the `n`
        // elements the kernel reads and writes.
        unsafe { result::launch_kernel(f.0, (blocks, 1, 1), (256, 1, 1), 0, stream.0, &mut params) }
            .map_err(|e| driver("kernel launch", e))
    }

    /// Launches `kernel` (`name(const Ranges a)`) on `grid` blocks of 256 threads. It may touch
    /// the bytes of `ranges` only (`a.at[i]`, `a.len[i]` long, in order) and reads `args` as
    /// integers (`a.arg[i]`): kernels whose memory does not follow one element per thread.
    pub fn launch_ranges(
        &self,
        stream: &Stream,
        kernel: Elementwise,
        ranges: &[DeviceRange],
        args: &[u64],
        grid: (u32, u32),
    ) -> Result<()> {
        if ranges.len() > RANGES || args.len() > RANGES {
            return Err(Error::Internal(format!(
                "kernel {} takes at most {RANGES} ranges and {RANGES} integers",
                kernel.name
            )));
        }
        let f = self.function(kernel)?;
        let mut p = Ranges {
            at: [0; RANGES],
            len: [0; RANGES],
            arg: [0; RANGES],
        };
        for (i, r) in ranges.iter().enumerate() {
            (p.at[i], p.len[i]) = (r.ptr(), r.len() as u64);
        }
        p.arg[..args.len()].copy_from_slice(args);
        let mut params = [(&mut p as *mut Ranges).cast::<c_void>()];
        let grid = (grid.0.clamp(1, 65535), grid.1.clamp(1, 65535), 1);
        // SAFETY: the kernel reads `p` (copied by the launch) and, by the `KernelLibrary`
        // contract, touches only the ranges in it, each device memory of its length.
        unsafe { result::launch_kernel(f.0, grid, (256, 1, 1), 0, stream.0, &mut params) }
            .map_err(|e| driver("kernel launch", e))
    }

    pub fn memset_zero(&self, stream: &Stream, range: DeviceRange) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: the range is device memory of its length (`DeviceRange`).
        unsafe { result::memset_d8_async(range.ptr(), 0, range.len(), stream.0) }
            .map_err(|e| driver("memset", e))
    }

    /// Device to host, waiting for the stream's earlier work and the copy.
    pub fn download(&self, stream: &Stream, src: DeviceRange, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        src.holds(dst.len(), "copy to host")?;
        // SAFETY: `src` holds `dst.len()` bytes (checked); synchronised before return.
        unsafe {
            result::memcpy_dtoh_async(dst, src.ptr(), stream.0)
                .map_err(|e| driver("copy to host", e))?;
        }
        stream.synchronize()
    }

    /// Host to device, finished before return.
    pub fn upload(&self, stream: &Stream, src: &[u8], dst: DeviceRange) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        dst.holds(src.len(), "copy to device")?;
        // SAFETY: `dst` holds `src.len()` bytes (checked); synchronised before return.
        unsafe {
            result::memcpy_htod_async(dst.ptr(), src, stream.0)
                .map_err(|e| driver("copy to device", e))?;
        }
        stream.synchronize()
    }

    /// Compute capability, e.g. (9, 0).
    pub fn capability(&self) -> Result<(i32, i32)> {
        self.ctx
            .compute_capability()
            .map_err(|e| driver("device attribute", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_copy_parameter_matches_the_kernel() {
        // whole lines, so that nothing but CUDA C stands before a declaration
        assert!(COPY_SOURCE.contains("\nstruct CopyDesc { const unsigned char* src;"));
        assert!(COPY_SOURCE.contains(&format!(
            "\nstruct CopyBatch {{ CopyDesc d[{COPY_BATCH}]; int n; }};"
        )));
        // the parameter as the kernel sees it fits the 4 KiB every CUDA device accepts
        assert!(std::mem::size_of::<CopyBatch>() <= 4096);
        assert_eq!(std::mem::size_of::<Copy>(), 24);
        assert!(std::mem::size_of::<SpanBatch>() <= 4096);
        assert_eq!(std::mem::size_of::<Span>(), 24);
    }
}
