//! Owners of driver handles: streams, graphs, events, the caller's own streams and events,
//! device and pinned memory.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUdeviceptr};

use super::*;

/// A ferrovod-owned stream (non-blocking with respect to the legacy default stream).
pub struct Stream(pub(super) sys::CUstream);

// SAFETY: CUDA streams may be used from any thread whose current context owns them.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn raw(&self) -> sys::CUstream {
        self.0
    }

    /// Makes later work on this stream wait for `event`'s last record (no host wait).
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.wait_event(event.0)
    }

    /// As `wait`, for a caller's event.
    pub fn wait_foreign(&self, event: ForeignEvent) -> Result<()> {
        self.wait_event(event.0 as sys::CUevent)
    }

    pub(super) fn wait_event(&self, event: sys::CUevent) -> Result<()> {
        // SAFETY: `event` is ours or a caller's live event (ForeignEvent's contract); the wait
        // is captured at this call.
        unsafe {
            result::stream::wait_event(
                self.0,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver("stream wait", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        // the stream may hold collectives that wait for other ranks
        let _blocked = crate::transport::mpi::blocked("cuStreamSynchronize");
        // SAFETY: a live stream of ours.
        unsafe { result::stream::synchronize(self.0) }.map_err(|e| driver("stream synchronize", e))
    }

    /// Records the work `launch` enqueues on this stream as a graph instead of running it, so
    /// that it can be replayed with one launch. Relaxed capture: other threads (the finisher,
    /// the framework) keep using CUDA meanwhile. The capture ends even when `launch` fails.
    pub fn capture(&self, launch: impl FnOnce() -> Result<()>) -> Result<GraphExec> {
        // SAFETY: a live stream of ours, not capturing (captures end before this returns).
        unsafe {
            sys::cuStreamBeginCapture_v2(
                self.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .result()
        .map_err(|e| driver("stream capture", e))?;
        let launched = launch();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; `graph` receives a graph we destroy below.
        let ended = unsafe { sys::cuStreamEndCapture(self.0, &mut graph) }
            .result()
            .map_err(|e| driver("stream capture", e));
        let exec = launched.and(ended).and_then(|()| {
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: `graph` is the live graph just captured.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }
                .result()
                .map_err(|e| driver("graph instantiate", e))?;
            Ok(GraphExec(exec))
        });
        if !graph.is_null() {
            // SAFETY: the captured graph, no longer needed once instantiated (or failed).
            let _ = unsafe { sys::cuGraphDestroy(graph) };
        }
        exec
    }
}

/// Launches captured from a stream, replayed with one host call: a fused batch's copies and
/// NCCL group cost the host tens of microseconds to launch one by one, a graph a few.
pub struct GraphExec(pub(super) sys::CUgraphExec);

// SAFETY: an executable graph may be launched and destroyed from any thread of its context.
unsafe impl Send for GraphExec {}

impl GraphExec {
    /// Enqueues the captured work on `stream`, after what is already there.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: a live executable graph and stream of ours.
        unsafe { sys::cuGraphLaunch(self.0, stream.0) }
            .result()
            .map_err(|e| driver("graph launch", e))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: ours, not launched after this; launches already enqueued still complete.
        let _ = unsafe { sys::cuGraphExecDestroy(self.0) };
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: ours, not used after this; pending work completes before resources go.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// A ferrovod-owned event.
pub struct Event(pub(super) sys::CUevent);

// SAFETY: CUDA events may be recorded, queried and waited on from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn raw(&self) -> sys::CUevent {
        self.0
    }

    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.record_on(stream.0)
    }

    /// Records on a caller's stream (e.g. the framework's compute stream).
    pub fn record_foreign(&self, stream: ForeignStream) -> Result<()> {
        self.record_on(stream.0 as sys::CUstream)
    }

    pub(super) fn record_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live event of ours; `stream` is ours or a caller's live stream
        // (ForeignStream's contract).
        unsafe { result::event::record(self.0, stream) }.map_err(|e| driver("event record", e))
    }

    /// Whether the recorded work has finished.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: a live event of ours.
        match unsafe { result::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(driver("event query", e)),
        }
    }

    /// Blocks the calling thread until the recorded work has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event of ours.
        unsafe { result::event::synchronize(self.0) }.map_err(|e| driver("event synchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: ours; the driver releases it once recorded work has completed.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A caller's `CUstream`, handed in through the C API.
#[derive(Clone, Copy, Debug)]
pub struct ForeignStream(pub(super) usize);

impl ForeignStream {
    /// # Safety
    /// `raw` is a live `CUstream` of this process's context on the operation's GPU, valid
    /// until the operation's `fv_enqueue` returns.
    pub unsafe fn from_raw(raw: *mut c_void) -> ForeignStream {
        ForeignStream(raw as usize)
    }
}

/// A caller's recorded `CUevent`, handed in through the C API.
#[derive(Clone, Copy, Debug)]
pub struct ForeignEvent(pub(super) usize);

impl ForeignEvent {
    /// # Safety
    /// `raw` is a live `CUevent` of the operation's GPU, valid until the operation completes.
    pub unsafe fn from_raw(raw: *mut c_void) -> ForeignEvent {
        ForeignEvent(raw as usize)
    }
}

/// Device memory owned by ferrovod (fusion buffers, staging, a joined rank's zeros).
pub struct DeviceMem {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
}

// SAFETY: a device address; the driver allows any thread of the process to use it.
unsafe impl Send for DeviceMem {}

impl DeviceMem {
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The whole allocation, for the functions that enqueue work on it.
    pub fn range(&self) -> DeviceRange {
        // SAFETY: ferrovod's own allocation of `len` bytes on this GPU, freed only after the
        // work enqueued on it (Drop, or `free_on` in stream order).
        unsafe { DeviceRange::from_raw(self.ptr, self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Frees in `stream`'s order: after the work already enqueued there, without waiting.
    pub fn free_on(self, stream: &Stream) -> Result<()> {
        let ptr = self.ptr;
        std::mem::forget(self);
        if ptr == 0 {
            return Ok(());
        }
        // SAFETY: ours, not used by work enqueued after this point (the caller's contract).
        unsafe { result::free_async(ptr, stream.0) }.map_err(|e| driver("free", e))
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by `Gpu::alloc`; the synchronous free waits for pending use.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory: a copy from the device into it runs in stream order without
/// blocking the thread that enqueues it, and is read once an event after it has fired.
pub struct PinnedMem {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: host memory owned by this value; the driver allows any thread to use and free it.
unsafe impl Send for PinnedMem {}

impl PinnedMem {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, once `done` (recorded after every copy into this memory) has fired.
    pub fn read(&self, done: &Event) -> Result<&[u8]> {
        if !done.query()? {
            return Err(Error::Internal(
                "pinned memory read before its copy finished".into(),
            ));
        }
        // SAFETY: `len` bytes allocated by `Gpu::alloc_pinned`; the copies into them are over.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
}

impl Drop for PinnedMem {
    fn drop(&mut self) {
        // SAFETY: allocated by `Gpu::alloc_pinned`, not used after this.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}
