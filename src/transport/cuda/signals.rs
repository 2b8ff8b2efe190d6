//! Device words a caller's stream waits on (`cuStreamWaitValue32`) until ferrovod writes them
//! (`cuStreamWriteValue32`): how a GPU consumer waits for an operation that is not launched
//! yet (the ranks have not agreed on it) without its host thread waiting. NCCL's own
//! collectives are enqueued at the call, so torch's NCCL backend never needs this.
//!
//! Every write goes through one stream per GPU, in the order slots are released, so a slot's
//! word only grows (cyclically) and a slot goes back to the free list once its write is
//! enqueued: a later wait on it asks for a larger value, which comes after in that order.
//! The words are host memory mapped into the device, so that where no write can be enqueued
//! the host gives the signal itself and no stream waits for ever.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::sys::{self, CUdeviceptr};

use super::*;

/// How many waits may be outstanding at once per GPU; past that, callers wait on the host.
const SIGNAL_SLOTS: usize = 4096;

/// One placed wait: its slot and the value that releases it. Owned by the operation's handle
/// until released (`Gpu::release_signal`), which every completion does, failed or not.
#[derive(Debug)]
pub struct Signal {
    slot: u32,
    value: u32,
}

/// Outstanding waits by slot: the value that gives each, when it was placed, its limit.
type Outstanding = Mutex<HashMap<u32, (u32, std::time::Instant, Duration)>>;

pub(super) struct Signals {
    /// SIGNAL_SLOTS words of page-locked host memory mapped into the device: the device
    /// polls them, and the host can write one when the stream's write cannot be enqueued.
    host: *mut u32,
    device: CUdeviceptr,
    /// Where the releasing writes run, each after its operation's event.
    stream: Stream,
    free: Vec<u32>,
    /// The value each slot's next wait asks for.
    next: Vec<u32>,
    /// Waits placed and not yet given, watched apart from the lock above (`watch`).
    outstanding: Arc<Outstanding>,
}

// SAFETY: the words are plain memory every thread may reach; all use is under the GPU's lock.
unsafe impl Send for Signals {}

impl Signals {
    fn open(gpu: &Gpu) -> Result<Signals> {
        let stream = gpu.new_stream()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut device: CUdeviceptr = 0;
        // SAFETY: out-pointers to locals; page-locked memory mapped into the bound context,
        // freed in Drop.
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                4 * SIGNAL_SLOTS,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
            .result()
            .map_err(|e| driver("mapped host allocation", e))?;
            std::ptr::write_bytes(host.cast::<u32>(), 0, SIGNAL_SLOTS);
            if let Err(e) = sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0).result() {
                let _ = sys::cuMemFreeHost(host);
                return Err(driver("mapped host pointer", e));
            }
        }
        let outstanding = Arc::<Outstanding>::default();
        watch(host as usize, Arc::downgrade(&outstanding));
        Ok(Signals {
            host: host.cast(),
            device,
            stream,
            free: (0..SIGNAL_SLOTS as u32).rev().collect(),
            next: vec![1; SIGNAL_SLOTS],
            outstanding,
        })
    }

    fn word(&self, slot: u32) -> CUdeviceptr {
        self.device + 4 * slot as CUdeviceptr
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        // SAFETY: ours; the GPU (and every stream that waited on a word) is going.
        let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// A stream waiting on a signal can hold up a CUDA call of the process that waits for the
/// whole device while it holds the driver's locks (lazy kernel loading does): the call that
/// would give the signal then waits behind it. A wait outstanding past its limit is such a
/// deadlock, or a launch stuck for as long: the host gives the word (no CUDA call), which
/// frees the device, and since the stream then ran on without the operation's result, the
/// process ends with the reason rather than compute on.
fn watch(host: usize, outstanding: std::sync::Weak<Outstanding>) {
    let spawned = std::thread::Builder::new()
        .name("ferrovod-signals".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let Some(outstanding) = outstanding.upgrade() else {
                    return;
                };
                let late: Vec<(u32, u32, Duration)> = outstanding
                    .lock()
                    .map(|o| {
                        o.iter()
                            .filter(|(_, (_, at, limit))| at.elapsed() > *limit)
                            .map(|(slot, (value, _, limit))| (*slot, *value, *limit))
                            .collect()
                    })
                    .unwrap_or_default();
                if let Some((_, _, limit)) = late.first() {
                    for (slot, value, _) in &late {
                        // SAFETY: the slot's word inside the SIGNAL_SLOTS words at `host`,
                        // which live while `outstanding` does.
                        unsafe { std::ptr::write_volatile((host as *mut u32).add(*slot as usize), *value) };
                    }
                    eprintln!(
                        "ferrovod: a CUDA stream waited on the device for a collective for more than {:.0} s (the stall limit) without its launch: the process is deadlocked on the GPU (a CUDA call that waits for the whole device, such as lazy kernel loading, cannot return while the stream waits) or the launch is stuck. The stream was released without the result, so the process ends. Run with CUDA_MODULE_LOADING=EAGER or without FERROVOD_TORCH_DEVICE_WAIT.",
                        limit.as_secs_f64()
                    );
                    std::process::abort();
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the signals' watch: {e}");
    }
}

/// Whether work on `stream` may wait on a signal: only a stream that is non-blocking with
/// respect to the legacy default stream. Work on the legacy stream (and any blocking stream)
/// orders every synchronous CUDA call of the process behind it, NCCL's and the allocator's
/// among them, so the write that would release it could queue behind the wait itself.
fn may_wait(stream: ForeignStream) -> bool {
    let raw = stream.0;
    // the legacy and per-thread default streams' handles
    if raw <= 2 {
        return false;
    }
    let mut flags = 0u32;
    // SAFETY: a caller's live stream (ForeignStream's contract); `flags` is a local.
    let rc = unsafe { sys::cuStreamGetFlags(raw as sys::CUstream, &mut flags) };
    rc == sys::cudaError_enum::CUDA_SUCCESS
        && flags & sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32 != 0
}

impl Gpu {
    /// Loads `libraries` unless a stream waits on the device now (loading one waits for the
    /// whole device, and so for a waiting stream, whose signal may need the very launch that
    /// loads): whether all are loaded.
    pub fn load_unless_waited(&self, libraries: &[&KernelLibrary]) -> Result<bool> {
        if libraries.iter().all(|l| self.loaded(l)) {
            return Ok(true);
        }
        let guard = self.signals.lock().expect("signals");
        let waited = guard
            .as_ref()
            .is_some_and(|s| !(s.outstanding.lock().expect("outstanding signals")).is_empty());
        if waited {
            return Ok(false);
        }
        // under the lock: no wait is placed meanwhile
        for l in libraries {
            self.load(l)?;
        }
        Ok(true)
    }

    /// Makes the caller's `stream` wait on the device for a signal not yet given; `None` when
    /// it cannot (a blocking stream, every slot in use), and the caller waits on the host.
    /// `limit`: how long it may wait before the process ends (`watch`).
    pub fn place_signal(&self, stream: ForeignStream, limit: Duration) -> Result<Option<Signal>> {
        self.bind()?;
        if !may_wait(stream) {
            return Ok(None);
        }
        let mut guard = self.signals.lock().expect("signals");
        if guard.is_none() {
            *guard = Some(Signals::open(self)?);
        }
        let s = guard.as_mut().expect("signals");
        let Some(slot) = s.free.pop() else {
            return Ok(None);
        };
        let value = s.next[slot as usize];
        // SAFETY: the caller's live stream; the word is ours and lives as long as the GPU.
        let rc = unsafe {
            sys::cuStreamWaitValue32_v2(
                stream.0 as sys::CUstream,
                s.word(slot),
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result();
        if let Err(e) = rc {
            s.free.push(slot);
            return Err(driver("stream wait value", e));
        }
        s.next[slot as usize] = value.wrapping_add(1);
        s.outstanding
            .lock()
            .expect("outstanding signals")
            .insert(slot, (value, std::time::Instant::now(), limit));
        Ok(Some(Signal { slot, value }))
    }

    /// Gives `signal` once `after` has fired (the operation's work), or at once: the stream
    /// that waits on it goes on. A failed operation gives it at once, so no stream waits for
    /// kernels that may never end.
    pub fn release_signal(&self, signal: Signal, after: Option<&Event>) -> Result<()> {
        self.bind()?;
        let mut guard = self.signals.lock().expect("signals");
        let s = guard
            .as_mut()
            .ok_or_else(|| Error::Internal("a signal released on a GPU that gave none".into()))?;
        let waited = match after {
            Some(e) => s.stream.wait(e),
            None => Ok(()),
        };
        // SAFETY: our stream and word; the write runs after what the stream already holds.
        let written = unsafe {
            sys::cuStreamWriteValue32_v2(
                s.stream.0,
                s.word(signal.slot),
                signal.value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .map_err(|e| driver("stream write value", e));
        s.outstanding
            .lock()
            .expect("outstanding signals")
            .remove(&signal.slot);
        match &written {
            // in the stream's order: the slot may take its next wait
            Ok(()) => s.free.push(signal.slot),
            // the host gives it instead; the slot is spent (the stream could still write an
            // earlier, smaller value over it)
            Err(_) => {
                // SAFETY: the slot's word, inside the SIGNAL_SLOTS words of `host`.
                unsafe { std::ptr::write_volatile(s.host.add(signal.slot as usize), signal.value) };
            }
        }
        waited.and(written)
    }
}
