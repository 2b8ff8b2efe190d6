//! GPU batches in the runtime: a lane (NCCL communicator, stream, fusion buffer) per process
//! set and channel, opened when the set's first GPU batch runs — every rank runs the same
//! batches in the same order, so the collective NCCL set-up happens at the same point on all —
//! and the finisher, a thread that completes GPU tensors once their batch's event has fired,
//! so the background thread never waits for the GPU.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, unbounded};

use crate::collective::ActivitySink;
use crate::collective::device::{self as dev, DeviceIo, Lane};
use crate::error::{Error, Result};
use crate::message::{OpKind, Response};
use crate::runtime::Runtime;
use crate::runtime::entry::{ReadyEvent, TensorEntry};
use crate::transport::Transport;
use crate::transport::cuda::{DeviceMem, Event, Gpu, Stream};
use crate::transport::mpi::MpiComm;
use crate::transport::nccl::{self, NcclComm};

/// Where one set's (or one channel's) GPU batches run.
pub(crate) struct GpuLane {
    gpu: Arc<Gpu>,
    comm: NcclComm,
    fusion: Option<DeviceMem>,
    // declared last: dropped after the communicator and buffer that use it
    stream: Stream,
}

impl GpuLane {
    /// Collective over `data`: rank 0 makes the NCCL id and broadcasts it over MPI.
    fn open(gpu: Arc<Gpu>, data: &MpiComm) -> Result<GpuLane> {
        let id = if data.rank() == 0 {
            nccl::unique_id()?
        } else {
            Vec::new()
        };
        let id = data.broadcast_bytes(id, 0)?;
        let comm = NcclComm::new(&gpu, &id, data.rank(), data.size())?;
        let stream = gpu.new_stream()?;
        Ok(GpuLane {
            gpu,
            comm,
            fusion: None,
            stream,
        })
    }
}

/// What a device batch left behind: the event to wait for before its tensors are done.
pub(crate) struct Recorded {
    pub gpu: Arc<Gpu>,
    pub event: Arc<Event>,
}

/// Whether a batch of `head`'s kind runs on the GPU path.
pub(crate) fn on_device(head: &Response) -> bool {
    head.device != crate::message::CPU_DEVICE
        && matches!(
            head.kind,
            OpKind::Allreduce
                | OpKind::Allgather
                | OpKind::Reducescatter
                | OpKind::Broadcast
                | OpKind::Alltoall
        )
}

/// Enqueues one GPU batch on the lane (opening it first if needed): waits on the inputs'
/// ready events on the device, runs the collective, records the completion event.
pub(crate) fn run_device_batch(
    lane: &mut Option<GpuLane>,
    data: &MpiComm,
    resps: &[&Response],
    entries: &mut [TensorEntry],
    sink: ActivitySink,
) -> Result<Recorded> {
    // a joined rank has no tensor of its own: it runs on the lane's GPU, or the process's
    let gpu = match lane.as_ref() {
        Some(l) => l.gpu.clone(),
        None => match entries.iter().find_map(|e| e.device.as_ref()) {
            Some(d) => d.gpu.clone(),
            None => {
                let ordinal = crate::runtime::runtime()?
                    .gpu_device()
                    .unwrap_or(resps[0].device);
                crate::transport::cuda::gpu(ordinal)?
            }
        },
    };
    gpu.bind()?;
    if lane.is_none() {
        sink(Some("NCCL_INIT"));
        *lane = Some(GpuLane::open(gpu.clone(), data)?);
    }
    let l = lane.as_mut().expect("lane opened");
    sink(Some("WAIT_FOR_DATA"));
    for e in entries.iter_mut() {
        if e.device.is_none() {
            // a joined rank's stand-in: zeros on this GPU
            e.device = Some(crate::runtime::entry::OnDevice {
                gpu: gpu.clone(),
                ready: None,
                scratch: None,
            });
        }
        e.move_input_to_device(&l.stream)?;
        match e.device.as_ref().and_then(|d| d.ready.as_ref()) {
            Some(ReadyEvent::Owned(ev)) => l.stream.wait(ev)?,
            Some(ReadyEvent::Foreign(ev)) => l.stream.wait_foreign(*ev)?,
            None => {}
        }
    }
    let mut ios: Vec<&mut dyn DeviceIo> =
        entries.iter_mut().map(|e| e as &mut dyn DeviceIo).collect();
    let head = resps[0];
    let mut lane_ref = Lane {
        gpu: &l.gpu,
        stream: &l.stream,
        fusion: &mut l.fusion,
    };
    let t = &l.comm;
    match head.kind {
        OpKind::Allreduce => dev::allreduce_batch(t, data, &mut lane_ref, resps, &mut ios, sink),
        OpKind::Allgather => dev::allgather_batch(t, &mut lane_ref, resps, &mut ios, sink),
        OpKind::Reducescatter => {
            dev::reducescatter_batch(t, data, &mut lane_ref, resps, &mut ios, sink)
        }
        OpKind::Broadcast => dev::broadcast(t, &mut lane_ref, head, &mut *ios[0], sink),
        OpKind::Alltoall => dev::alltoall(t, data, &mut lane_ref, head, &mut *ios[0], sink),
        other => Err(Error::Internal(format!(
            "{} is not a GPU batch",
            other.name()
        ))),
    }?;
    let event = Arc::new(l.gpu.new_event()?);
    event.record(&l.stream)?;
    Ok(Recorded { gpu, event })
}

/// A GPU batch whose tensors complete when its event fires.
pub(crate) struct Finish {
    pub set: i32,
    pub recorded: Recorded,
    pub entries: Vec<TensorEntry>,
}

/// Completes GPU tensors after their batch's event, on its own thread, in submission order.
pub(crate) struct Finisher {
    tx: Option<Sender<Finish>>,
    thread: Option<JoinHandle<()>>,
}

impl Finisher {
    pub fn spawn(rt: Arc<Runtime>) -> Result<Finisher> {
        let (tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name("ferrovod-gpu-finisher".into())
            .spawn(move || finish_loop(rt, rx))
            .map_err(|e| Error::Internal(format!("cannot start the GPU finisher thread: {e}")))?;
        Ok(Finisher {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn send(&self, f: Finish) {
        if let Some(tx) = &self.tx {
            // the thread ends only after the sender is dropped
            let _ = tx.send(f);
        }
    }

    /// Completes what was sent (after the GPU finishes it) and ends the thread.
    pub fn close(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn finish_loop(rt: Arc<Runtime>, rx: Receiver<Finish>) {
    super::ON_BACKGROUND_THREAD.with(|f| f.set(true));
    for f in rx {
        let outcome = f
            .recorded
            .gpu
            .bind()
            .and_then(|()| f.recorded.event.synchronize());
        complete(&rt, f.set, f.entries, outcome, Some(f.recorded.event));
    }
}

/// Completes GPU tensors with their batch's event attached to the handles.
pub(crate) fn complete(
    rt: &Runtime,
    set: i32,
    entries: Vec<TensorEntry>,
    outcome: Result<()>,
    event: Option<Arc<Event>>,
) {
    for e in entries {
        rt.finish_names(&[(set, e.request.name.clone())]);
        e.complete_on_device(outcome.clone(), None, event.clone());
    }
}
