//! A submitted tensor on its way through the runtime: its request, its memory and its handle.

use std::sync::{Arc, Mutex};

use crate::collective::TensorIo;
use crate::collective::device::DeviceIo;
use crate::error::{Error, Result};
use crate::message::Request;
use crate::runtime::handle::{Handle, TensorResult};
use crate::transport::cuda::{DeviceMem, Event, Gpu, StreamMark};
use crate::transport::memory::{DeviceRange, HostBuffer};

/// Input memory: the caller's (C API) or owned by the library (Rust API, join zeros).
pub enum InputMem {
    Borrowed(HostBuffer),
    Owned(Vec<u8>),
    /// GPU memory of the caller's.
    Device(DeviceRange),
    /// GPU memory of ferrovod's (a joined rank's zeros).
    DeviceOwned(DeviceMem),
}

/// Where the result goes.
pub enum OutputMem {
    /// Into the input memory (in place).
    InPlace,
    Borrowed(HostBuffer),
    Owned(Vec<u8>),
    Device(DeviceRange),
    /// Allocated after negotiation (allgather, alltoall, reducescatter).
    Later,
}

/// Allocates outputs whose size is known only after negotiation (the C API's callback).
pub trait OutputAllocator: Send {
    fn allocate(&mut self, index: usize, shape: &[i64], bytes: usize) -> Result<HostBuffer>;
}

pub type SharedAllocator = Arc<Mutex<dyn OutputAllocator>>;

/// What a GPU tensor's producer left for ferrovod to wait on (on the device, not the host).
#[derive(Clone)]
pub enum ReadyEvent {
    /// Recorded by ferrovod on the caller's stream at enqueue.
    Owned(Arc<StreamMark>),
    /// The caller's own event, already recorded.
    Foreign(crate::transport::cuda::ForeignEvent),
}

/// A GPU tensor's device: its GPU and what to wait for before reading it.
pub struct OnDevice {
    pub gpu: Arc<Gpu>,
    pub ready: Option<ReadyEvent>,
    /// Output of a failed allocation: the collective still runs into it (see `alloc_error`).
    pub scratch: Option<DeviceMem>,
}

pub struct TensorEntry {
    /// Shared with the negotiator while the tensor waits for agreement.
    pub request: Arc<Request>,
    pub input: InputMem,
    pub output: OutputMem,
    pub splits: Option<Vec<i32>>,
    pub allocator: Option<SharedAllocator>,
    pub handle: Option<Arc<Handle>>,
    /// Position of this tensor within its operation (grouped ops have several).
    pub index: usize,
    /// Set for GPU tensors.
    pub device: Option<OnDevice>,
    /// Held until launch by a GPU tensor at other addresses than its name's last submission.
    pub(crate) moved: Option<crate::runtime::in_flight::MovedMark>,
    /// The operation's own bound on waiting for the other ranks (`OpSpec::timeout`).
    pub timeout: Option<std::time::Duration>,
    /// Copied from the request at creation, on the submitting thread: the finisher then
    /// hands it over without allocating (allocating there slowed the completion of large GPU
    /// batches; BENCHMARKS.md, "Figures moved out of comments").
    out_shape: Vec<i64>,
    received_splits: Vec<i32>,
    /// A failed output allocation: the tensor still takes part in the collective (through a
    /// scratch buffer), so the other ranks are not left waiting, and then fails.
    alloc_error: Option<Error>,
}

impl TensorEntry {
    pub fn new(request: Request, input: InputMem, output: OutputMem) -> TensorEntry {
        TensorEntry {
            out_shape: request.shape.clone(),
            request: Arc::new(request),
            input,
            output,
            splits: None,
            allocator: None,
            handle: None,
            index: 0,
            device: None,
            moved: None,
            timeout: None,
            received_splits: Vec::new(),
            alloc_error: None,
        }
    }

    /// Makes `values` what this tensor contributes (a multistep sum), its result still going
    /// where the caller's input would have.
    pub fn contribute(&mut self, values: Vec<u8>) {
        let old = std::mem::replace(&mut self.input, InputMem::Owned(values));
        if let (OutputMem::InPlace, InputMem::Borrowed(b)) = (&self.output, old) {
            self.output = OutputMem::Borrowed(b);
        }
    }

    /// Finishes this tensor: hands its result (and library-owned output) to the handle.
    pub fn complete(mut self, outcome: Result<()>, value: Option<i32>) {
        self.complete_on_device(outcome, value, None);
    }

    /// As `complete`, with the event recorded after the tensor's GPU work (for GPU consumers).
    /// Leaves the spent entry to the caller, which can complete a whole batch's handles
    /// before it pays for freeing the entries.
    pub fn complete_on_device(
        &mut self,
        outcome: Result<()>,
        value: Option<i32>,
        event: Option<(&Arc<Gpu>, &Arc<Event>)>,
    ) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        if let Some((gpu, ev)) = event {
            handle.add_event(gpu, ev);
        }
        let outcome = self.with_alloc_error(outcome);
        let result = outcome.map(|()| self.take_result());
        handle.complete_one(self.index, result, value);
    }

    /// The first half of completing a GPU tensor, done while its batch runs: hands the handle
    /// the result (as if the batch succeeds) and the batch's event, so that `finish_staged`
    /// only counts the tensor down once the event has fired.
    pub fn stage_on_device(&mut self, gpu: &Arc<Gpu>, event: &Arc<Event>) {
        if self.handle.is_none() {
            return;
        }
        let result = self.take_result();
        if let Some(handle) = &self.handle {
            handle.add_event(gpu, event);
            handle.stage(self.index, result);
        }
    }

    /// Completes a tensor staged by `stage_on_device`.
    pub fn finish_staged(&mut self, outcome: Result<()>) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        handle.complete_staged(self.with_alloc_error(outcome));
    }

    /// A failed output allocation fails an otherwise successful tensor.
    fn with_alloc_error(&mut self, outcome: Result<()>) -> Result<()> {
        match (outcome, self.alloc_error.take()) {
            (Ok(()), Some(e)) => Err(e),
            (o, _) => o,
        }
    }

    fn take_result(&mut self) -> TensorResult {
        let output = match (&mut self.output, &mut self.input) {
            (OutputMem::Owned(v), _) | (OutputMem::InPlace, InputMem::Owned(v)) => {
                Some(std::mem::take(v))
            }
            _ => None,
        };
        TensorResult {
            output,
            shape: std::mem::take(&mut self.out_shape),
            received_splits: std::mem::take(&mut self.received_splits),
        }
    }
}

impl TensorEntry {
    /// The caller's allocator for this tensor's output, checked to give at least `bytes`
    /// (and cut to exactly that).
    fn call_allocator(
        &self,
        alloc: &SharedAllocator,
        shape: &[i64],
        bytes: usize,
    ) -> Result<HostBuffer> {
        let mut buf = alloc
            .lock()
            .map_err(|_| Error::Internal("output allocator poisoned".into()))
            .and_then(|mut a| a.allocate(self.index, shape, bytes))?;
        if buf.len() < bytes {
            return Err(Error::Aborted(format!(
                "output allocator returned {} bytes for tensor '{}', {} needed",
                buf.len(),
                self.request.name,
                bytes
            )));
        }
        buf.truncate(bytes);
        Ok(buf)
    }
}

fn input_slice(input: &InputMem) -> &[u8] {
    match input {
        InputMem::Borrowed(b) => b.as_slice(),
        InputMem::Owned(v) => v,
        InputMem::Device(_) | InputMem::DeviceOwned(_) => &[],
    }
}

impl TensorIo for TensorEntry {
    fn input(&self) -> &[u8] {
        input_slice(&self.input)
    }

    fn split_io(&mut self) -> (Option<&[u8]>, &mut [u8]) {
        match (&mut self.input, &mut self.output) {
            (InputMem::Borrowed(b), OutputMem::InPlace | OutputMem::Later) => {
                (None, b.as_mut_slice())
            }
            (InputMem::Owned(v), OutputMem::InPlace | OutputMem::Later) => (None, v.as_mut_slice()),
            (input, OutputMem::Borrowed(out)) => (Some(input_slice(input)), out.as_mut_slice()),
            (input, OutputMem::Owned(out)) => (Some(input_slice(input)), out.as_mut_slice()),
            // GPU tensors never run on the host path
            (_, OutputMem::Device(_)) | (InputMem::Device(_) | InputMem::DeviceOwned(_), _) => {
                (None, &mut [])
            }
        }
    }

    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()> {
        self.out_shape = shape.to_vec();
        let allocated = match &self.allocator {
            Some(alloc) => self.call_allocator(alloc, shape, bytes).and_then(|buf| {
                let input = input_slice(&self.input);
                let (i0, o0) = (input.as_ptr() as usize, buf.as_ptr() as usize);
                let disjoint =
                    bytes == 0 || input.is_empty() || o0 >= i0 + input.len() || i0 >= o0 + bytes;
                if !disjoint {
                    return Err(Error::Aborted(format!(
                        "output allocator returned memory overlapping the input of tensor '{}'",
                        self.request.name
                    )));
                }
                Ok(OutputMem::Borrowed(buf))
            }),
            None => Ok(OutputMem::Owned(vec![0u8; bytes])),
        };
        self.output = allocated.unwrap_or_else(|e| {
            self.alloc_error = Some(e);
            OutputMem::Owned(vec![0u8; bytes])
        });
        Ok(())
    }

    fn send_splits(&self) -> Option<&[i32]> {
        self.splits.as_deref()
    }

    fn set_received_splits(&mut self, splits: Vec<i32>) {
        self.received_splits = splits;
    }
}

impl TensorEntry {
    /// Marks this tensor as GPU memory: the caller's pointers are device addresses.
    pub fn move_to_device(&mut self, gpu: Arc<Gpu>, ready: Option<ReadyEvent>) -> Result<()> {
        let device = |b: &HostBuffer| b.device_range();
        self.input = match std::mem::replace(&mut self.input, InputMem::Owned(Vec::new())) {
            InputMem::Borrowed(b) => InputMem::Device(device(&b)),
            InputMem::Owned(_) => {
                return Err(Error::InvalidArgument(format!(
                    "GPU tensor '{}' must be given as device memory",
                    self.request.name
                )));
            }
            other => other,
        };
        if let OutputMem::Borrowed(b) = &self.output {
            self.output = OutputMem::Device(device(b));
        } else if let OutputMem::Owned(_) = &self.output {
            return Err(Error::InvalidArgument(format!(
                "GPU tensor '{}' must be given device output memory",
                self.request.name
            )));
        }
        self.device = Some(OnDevice {
            gpu,
            ready,
            scratch: None,
        });
        Ok(())
    }

    /// A GPU tensor's input and output addresses (None on the host).
    pub(crate) fn place(&self) -> Option<crate::runtime::in_flight::Place> {
        self.device.as_ref()?;
        Some([DeviceIo::input(self).ptr(), DeviceIo::output(self).ptr()])
    }

    /// Moves a host input (a joined rank's zeros) to the tensor's GPU before a device batch.
    pub fn move_input_to_device(&mut self, stream: &crate::transport::cuda::Stream) -> Result<()> {
        let Some(dev) = &self.device else {
            return Ok(());
        };
        if let InputMem::Owned(v) = &self.input {
            let mem = dev.gpu.alloc_on(stream, v.len())?;
            if v.iter().all(|b| *b == 0) {
                // a joined rank's zeros: set in stream order, no host wait
                dev.gpu.memset_zero(stream, mem.range())?;
            } else {
                dev.gpu.upload(stream, v, mem.range())?;
            }
            self.input = InputMem::DeviceOwned(mem);
        }
        Ok(())
    }

    /// The device memory ferrovod owns for this tensor (a joined rank's zeros, a failed
    /// allocation's scratch), to be kept until the GPU work using it has finished.
    pub fn take_device_memory(&mut self) -> Vec<DeviceMem> {
        let mut out = Vec::new();
        if let InputMem::DeviceOwned(_) = &self.input
            && let InputMem::DeviceOwned(m) =
                std::mem::replace(&mut self.input, InputMem::Owned(Vec::new()))
        {
            out.push(m);
        }
        if let Some(m) = self.device.as_mut().and_then(|d| d.scratch.take()) {
            out.push(m);
        }
        out
    }
}

impl DeviceIo for TensorEntry {
    fn input(&self) -> DeviceRange {
        match &self.input {
            InputMem::Device(r) => *r,
            InputMem::DeviceOwned(m) => m.range(),
            InputMem::Borrowed(_) | InputMem::Owned(_) => DeviceRange::empty(),
        }
    }

    fn output(&self) -> DeviceRange {
        if let Some(m) = self.device.as_ref().and_then(|d| d.scratch.as_ref()) {
            return m.range();
        }
        match &self.output {
            OutputMem::Device(r) => *r,
            OutputMem::InPlace | OutputMem::Later => DeviceIo::input(self),
            OutputMem::Borrowed(_) | OutputMem::Owned(_) => DeviceRange::empty(),
        }
    }

    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()> {
        self.out_shape = shape.to_vec();
        let allocated = match &self.allocator {
            Some(alloc) => self
                .call_allocator(alloc, shape, bytes)
                .and_then(|buf| buf.device_range().first(bytes)),
            None => Err(Error::InvalidArgument(format!(
                "GPU tensor '{}' needs an output allocator",
                self.request.name
            ))),
        };
        match allocated {
            Ok(r) => self.output = OutputMem::Device(r),
            Err(e) => {
                // the collective still runs, into scratch memory, so no rank is left waiting
                let dev = self
                    .device
                    .as_mut()
                    .ok_or_else(|| Error::Internal("GPU tensor without a device".into()))?;
                dev.scratch = Some(dev.gpu.alloc(bytes)?);
                self.alloc_error = Some(e);
            }
        }
        Ok(())
    }

    fn send_splits(&self) -> Option<&[i32]> {
        self.splits.as_deref()
    }

    fn set_received_splits(&mut self, splits: Vec<i32>) {
        self.received_splits = splits;
    }
}

/// A process set's tensors waiting for agreement, found by name. The key is the entry's own
/// name, so taking in a submission copies no string.
#[derive(Default)]
pub(crate) struct PendingEntries(crate::hashing::HashSet<ByName>);

pub(crate) struct ByName(TensorEntry);

impl ByName {
    fn name(&self) -> &str {
        &self.0.request.name
    }
}

impl std::hash::Hash for ByName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // as `str` hashes, so that lookups by `&str` find it
        self.name().hash(state);
    }
}

impl PartialEq for ByName {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for ByName {}

impl std::borrow::Borrow<str> for ByName {
    fn borrow(&self) -> &str {
        self.name()
    }
}

impl PendingEntries {
    /// Adds `e`, replacing an entry of the same name.
    pub fn insert(&mut self, e: TensorEntry) {
        self.0.replace(ByName(e));
    }

    pub fn remove(&mut self, name: &str) -> Option<TensorEntry> {
        self.0.take(name).map(|b| b.0)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl IntoIterator for PendingEntries {
    type Item = TensorEntry;
    type IntoIter =
        std::iter::Map<std::collections::hash_set::IntoIter<ByName>, fn(ByName) -> TensorEntry>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter().map(|b| b.0)
    }
}
