//! GPU mode of the MPI scenarios: the host tensors a scenario builds are copied to this rank's
//! GPU before submission (inputs, separate outputs, an allocator for outputs sized after
//! negotiation), and the results are copied back, so every check compares GPU results with
//! the same host-computed references as on the CPU.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferrovod::Error;
use ferrovod::runtime::entry::{InputMem, OutputAllocator, OutputMem};
use ferrovod::runtime::handle::{Handle, HandleId, TensorResult};
use ferrovod::runtime::{self, OpSpec};
use ferrovod::transport::cuda::{self, DeviceMem, Gpu};
use ferrovod::transport::memory::HostBuffer;

/// This rank's GPU: local rank modulo the GPUs present.
pub fn this_gpu() -> Arc<Gpu> {
    let local = runtime::runtime().unwrap().topology().local_rank as usize;
    let n = cuda::device_count().unwrap().max(1);
    cuda::gpu((local % n) as i32).expect("open GPU")
}

struct Alloc {
    gpu: Arc<Gpu>,
    mems: HashMap<usize, DeviceMem>,
}

impl OutputAllocator for Alloc {
    fn allocate(
        &mut self,
        index: usize,
        _shape: &[i64],
        bytes: usize,
    ) -> ferrovod::error::Result<HostBuffer> {
        let m = self.gpu.alloc(bytes)?;
        // SAFETY: the allocation lives in `mems` until the test has read the result back.
        let buf = unsafe { HostBuffer::from_raw(m.ptr() as usize as *mut u8, bytes) };
        self.mems.insert(index, m);
        Ok(buf)
    }
}

/// The device memory of one submitted operation.
pub struct Op {
    gpu: Arc<Gpu>,
    inputs: Vec<DeviceMem>,
    outputs: Vec<Option<DeviceMem>>,
    alloc: Option<Arc<Mutex<Alloc>>>,
}

static OPS: Mutex<Option<HashMap<HandleId, Op>>> = Mutex::new(None);

/// Moves the spec's host tensors to this rank's GPU and submits it as a GPU operation.
pub fn submit(mut spec: OpSpec) -> Result<Arc<Handle>, Error> {
    let gpu = this_gpu();
    spec.device = gpu.ordinal;
    if spec.tensors.is_empty() {
        // barrier, join: no memory
        return runtime::runtime()?.enqueue(spec);
    }
    let stream = gpu.new_stream()?;
    let mut op = Op {
        gpu: gpu.clone(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        alloc: None,
    };
    let mut later = false;
    for t in &mut spec.tensors {
        let InputMem::Owned(bytes) = &t.input else {
            panic!("GPU mode takes host tensors built by the scenario")
        };
        let m = gpu.alloc(bytes.len())?;
        gpu.upload(&stream, bytes, m.range())?;
        t.input = InputMem::Device(m.range().first(bytes.len()).expect("allocated for it"));
        op.inputs.push(m);
        let out = match &t.output {
            OutputMem::Owned(v) => {
                let o = gpu.alloc(v.len())?;
                t.output = OutputMem::Device(o.range().first(v.len()).expect("allocated for it"));
                Some(o)
            }
            OutputMem::Later => {
                later = true;
                None
            }
            _ => None,
        };
        op.outputs.push(out);
    }
    if later {
        let a = Arc::new(Mutex::new(Alloc {
            gpu: gpu.clone(),
            mems: HashMap::new(),
        }));
        spec.allocator = Some(a.clone());
        op.alloc = Some(a);
    }
    let h = runtime::runtime()?.enqueue(spec)?;
    OPS.lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(h.id, op);
    Ok(h)
}

/// The device memory of a GPU operation (None for host operations).
pub fn take(id: HandleId) -> Option<Op> {
    OPS.lock().unwrap().as_mut().and_then(|m| m.remove(&id))
}

impl Op {
    /// Copies each tensor's result to the host, as the CPU path returns it.
    pub fn download_into(self, h: &Handle, results: &mut [TensorResult]) {
        // with asynchronous completion the handle completes before the GPU work: a host
        // consumer waits for the handle's event first
        if let Some(ev) = h.event() {
            ev.synchronize().unwrap();
        }
        let stream = self.gpu.new_stream().unwrap();
        let alloc = self.alloc.as_ref().map(|a| a.lock().unwrap());
        for (i, r) in results.iter_mut().enumerate() {
            let mem = alloc
                .as_ref()
                .and_then(|a| a.mems.get(&i))
                .or(self.outputs.get(i).and_then(|o| o.as_ref()))
                .or(self.inputs.get(i))
                .expect("tensor memory");
            let mut bytes = vec![0u8; mem.len()];
            self.gpu.download(&stream, mem.range(), &mut bytes).unwrap();
            r.output = Some(bytes);
        }
    }
}
