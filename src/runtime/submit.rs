//! Submission, on the framework's threads: an operation's checks, its entries (host or GPU
//! memory, multistep accumulation) and its handle, before the background thread sees it.

use std::sync::Arc;

use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{
    ANY_SOURCE, BARRIER_NAME, CPU_DEVICE, Compression, JOIN_NAME, Multistep, OpKind, ReduceOp,
    Request, Response,
};
use entry::{InputMem, OutputMem, TensorEntry};
use handle::Handle;

use super::*;

impl Runtime {
    pub fn enqueue(&self, spec: OpSpec) -> Result<Arc<Handle>> {
        if self.is_shut_down() {
            return Err(self.shut_down_error());
        }
        let what = op_title(spec.kind);
        // read in place: a copy of the ranks cost an allocation per enqueue
        let sets = self.sets.read().expect("sets");
        let ranks = sets.get(&spec.process_set).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what}: Process set provided does not exist, or has not been registered."
            ))
        })?;
        let me = self.topology().rank;
        let set_rank = ranks.iter().position(|r| *r == me).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what}: Rank {me} is not a member of the provided process set."
            ))
        })? as i32;
        let on_device =
            spec.device != CPU_DEVICE && !matches!(spec.kind, OpKind::Join | OpKind::Barrier);
        if on_device && spec.kind.is_point_to_point() {
            return Err(Error::InvalidArgument(format!(
                "{what}: point-to-point transfers take host memory; copy GPU tensors to the host first"
            )));
        }
        let device = if on_device {
            Some(self.open_device(what, &spec)?)
        } else {
            None
        };
        let mut spec = spec;
        let mut entries = self.build_entries(spec.kind, &mut spec, set_rank, ranks)?;
        drop(sets);
        if let Some((gpu, ready)) = device {
            for e in &mut entries {
                e.move_to_device(gpu.clone(), ready.clone())?;
            }
        }
        let set = spec.process_set;
        let handle = self.handles.create(entries.len(), spec.callback.take());
        if let Some(first) = entries.first().filter(|e| e.device.is_some()) {
            handle.set_origin(set, first.request.clone());
        }
        let claimed = self.in_flight.lock().expect("in flight").claim(
            set,
            entries.iter().map(|e| (e.request.name.as_str(), e.place())),
            &handle,
        );
        let Some(moved) = claimed else {
            let _ = self.handles.release(handle.id);
            return Err(duplicate_name());
        };
        let mut entries: Vec<TensorEntry> = entries
            .into_iter()
            .enumerate()
            .map(|(i, mut e)| {
                e.index = i;
                e.handle = Some(handle.clone());
                e.allocator = spec.allocator.clone();
                e.timeout = spec.timeout;
                if moved && e.device.is_some() {
                    e.moved = Some(in_flight::MovedMark::new(&self.gpu_moved));
                }
                e
            })
            .collect();
        // counted only once the names are claimed: a refused call takes no step and no sum
        let multistep = (entries.first())
            .map(|e| e.request.multistep)
            .filter(|m| spec.kind == OpKind::Allreduce && !m.is_every_call());
        if let Some(m) = multistep {
            match self.take_steps(set, m, &mut entries) {
                Err(e) => {
                    let _ = self.handles.release(handle.id);
                    return Err(e);
                }
                Ok(false) => {
                    // summed, nothing to send: complete now (which frees the names),
                    // reporting that nothing travelled
                    for e in entries {
                        e.complete(Ok(()), Some(0));
                    }
                    return Ok(handle);
                }
                Ok(true) => {}
            }
        }
        if spec.kind == OpKind::Allreduce {
            handle.set_value(1);
        }
        let command = if spec.kind.is_point_to_point() {
            Command::PointToPoint {
                set,
                tag: spec.tag,
                entries,
            }
        } else {
            Command::Submit { set, entries }
        };
        if self.send(command).is_err() {
            // the operation never completes: nobody holds it once the caller has the error
            let _ = self.handles.release(handle.id);
            return Err(self.shut_down_error());
        }
        Ok(handle)
    }

    /// A send's or receive's peer as a rank of the set (a receive's `ANY_SOURCE`: -1, any
    /// rank), checked with its tag.
    fn p2p_peer(&self, what: &str, spec: &OpSpec, set_rank: i32, ranks: &[i32]) -> Result<i32> {
        let max = self.p2p_max_tag();
        if !(0..=max).contains(&spec.tag) {
            return Err(Error::InvalidArgument(format!(
                "{what}: tag {} is outside 0..={max}",
                spec.tag
            )));
        }
        if spec.kind == OpKind::Recv && spec.root_rank == ANY_SOURCE {
            return Ok(ANY_SOURCE);
        }
        let peer = ranks
            .iter()
            .position(|r| *r == spec.root_rank)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{what}: rank {} is not a member of the provided process set",
                    spec.root_rank
                ))
            })? as i32;
        if peer == set_rank {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {} cannot send to or receive from itself",
                spec.root_rank
            )));
        }
        Ok(peer)
    }

    /// Records a multistep call of an allreduce's tensors; whether it communicates (then each
    /// tensor's input is what is to travel: the sum of the calls since the last).
    fn take_steps(&self, set: i32, m: Multistep, entries: &mut [TensorEntry]) -> Result<bool> {
        use crate::collective::TensorIo;
        use crate::compress::multistep::Call;
        let calls = self.steps.call(
            set,
            m,
            (entries.iter()).map(|e| (e.request.name.as_str(), e.request.dtype, e.input())),
        )?;
        let mut communicates = false;
        for (e, call) in entries.iter_mut().zip(calls) {
            match call {
                Call::Skip => {}
                Call::Input => communicates = true,
                Call::Sum(sum) => {
                    communicates = true;
                    e.contribute(sum);
                }
            }
        }
        Ok(communicates)
    }

    fn build_entries(
        &self,
        kind: OpKind,
        spec: &mut OpSpec,
        set_rank: i32,
        ranks: &[i32],
    ) -> Result<Vec<TensorEntry>> {
        let what = op_title(kind);
        let bare = |name: String, shape: Vec<i64>| Request {
            rank: set_rank,
            kind,
            dtype: DataType::I32,
            name,
            shape,
            root: 0,
            device: spec.device,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: Multistep::EVERY_CALL,
        };
        let no_memory = |r| TensorEntry::new(r, InputMem::Owned(Vec::new()), OutputMem::InPlace);
        match kind {
            OpKind::Join => return Ok(vec![no_memory(bare(JOIN_NAME.into(), vec![]))]),
            OpKind::Barrier => return Ok(vec![no_memory(bare(BARRIER_NAME.into(), vec![]))]),
            OpKind::AddProcessSet | OpKind::RemoveProcessSet => {
                return Err(Error::InvalidArgument(format!(
                    "{what} is requested through add_process_set/remove_process_set"
                )));
            }
            _ => {}
        }
        if spec.tensors.is_empty() {
            return Err(Error::InvalidArgument(format!("{what}: no tensors given")));
        }
        let size = ranks.len() as i64;
        if kind == OpKind::Allreduce || kind == OpKind::Reducescatter {
            if spec.reduce_op == ReduceOp::Adasum {
                return Err(Error::InvalidArgument(
                    "Adasum is not supported by ferrovod.".into(),
                ));
            }
            if kind == OpKind::Reducescatter
                && !matches!(spec.reduce_op, ReduceOp::Sum | ReduceOp::Average)
            {
                return Err(Error::Aborted(
                    "Reducescatter currently only supports AVERAGE and SUM.".into(),
                ));
            }
        }
        let root = if kind.is_point_to_point() {
            self.p2p_peer(what, spec, set_rank, ranks)?
        } else if kind == OpKind::Broadcast {
            ranks
                .iter()
                .position(|r| *r == spec.root_rank)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "broadcast received invalid root rank {} for provided process set",
                        spec.root_rank
                    ))
                })? as i32
        } else {
            0
        };
        let reduces = matches!(kind, OpKind::Allreduce | OpKind::Reducescatter);
        // GPU gossip travels uncompressed: a codec asked for by the op itself is refused
        if kind == OpKind::Gossip
            && spec.device != CPU_DEVICE
            && spec.compression.is_some_and(|c| c != Compression::None)
        {
            return Err(Error::InvalidArgument(format!(
                "{what}: compressed gossip of GPU tensors is not supported (GPU gossip exchanges uncompressed values; ask for no compression)"
            )));
        }
        for t in &spec.tensors {
            if t.name.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "{what}: tensor name is empty"
                )));
            }
            if t.shape.iter().any(|d| *d < 0) {
                return Err(Error::InvalidArgument(format!(
                    "{what}: tensor '{}' has a negative dimension",
                    t.name
                )));
            }
            let elems: i64 = t.shape.iter().product();
            let bytes = elems as usize * t.dtype.size();
            if reduces && t.dtype == DataType::Bool {
                let scaled = spec.prescale != 1.0 || spec.postscale != 1.0;
                if scaled || spec.reduce_op == ReduceOp::Average {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: bool tensor '{}' cannot be averaged or scaled",
                        t.name
                    )));
                }
            }
            if kind == OpKind::Gossip && !t.dtype.is_float() {
                return Err(Error::InvalidArgument(format!(
                    "{what}: tensor '{}' is {}; gossip averages floating-point tensors only",
                    t.name,
                    t.dtype.name()
                )));
            }
            let input_len = match &t.input {
                InputMem::Borrowed(b) => b.len(),
                InputMem::Owned(v) => v.len(),
                InputMem::Device(r) => r.len(),
                InputMem::DeviceOwned(m) => m.len(),
            };
            if input_len != bytes {
                return Err(Error::InvalidArgument(format!(
                    "{what}: tensor '{}' has {input_len} bytes but its shape and dtype need {bytes}",
                    t.name
                )));
            }
            let later = matches!(
                kind,
                OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
            );
            match (&t.output, later) {
                (OutputMem::Later, true) | (OutputMem::InPlace, false) => {}
                (OutputMem::Borrowed(b), false) if b.len() == bytes => {}
                (OutputMem::Owned(v), false) if v.len() == bytes => {}
                (OutputMem::Device(r), false) if r.len() == bytes => {}
                (OutputMem::Later, false) => {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: tensor '{}' needs an output buffer",
                        t.name
                    )));
                }
                (_, true) => {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: the output of tensor '{}' is allocated after negotiation; pass none",
                        t.name
                    )));
                }
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: output of tensor '{}' must have {bytes} bytes",
                        t.name
                    )));
                }
            }
            if matches!(kind, OpKind::Alltoall | OpKind::Reducescatter) && t.shape.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "{what}: tensor '{}' is a scalar; a first dimension is required",
                    t.name
                )));
            }
            if kind == OpKind::Alltoall {
                let dim0 = t.shape[0];
                match &t.splits {
                    Some(s) => {
                        if s.len() as i64 != size {
                            return Err(Error::InvalidArgument(
                                "Number of entries in splits does not equal number of workers."
                                    .into(),
                            ));
                        }
                        if s.iter().any(|x| *x < 0) {
                            return Err(Error::InvalidArgument(
                                "splits entries must be non-negative.".into(),
                            ));
                        }
                        if s.iter().map(|x| *x as i64).sum::<i64>() > dim0 {
                            return Err(Error::InvalidArgument(
                                "Sum of splits entries is greater than the first dimension of tensor."
                                    .into(),
                            ));
                        }
                    }
                    None if dim0 % size != 0 => {
                        return Err(Error::InvalidArgument("splits not provided, but first dimension of tensor is not an even multiple of the number of workers.".into()));
                    }
                    None => {}
                }
            }
        }
        // checked: now take the names and shapes over rather than copy them
        let (reduce_op, prescale, postscale) = match reduces {
            true => (spec.reduce_op, spec.prescale, spec.postscale),
            false => (ReduceOp::Sum, 1.0, 1.0),
        };
        let device = spec.device;
        // only allreduces have codecs and steps: elsewhere the fields cannot make ranks disagree
        let compression =
            (spec.compression).filter(|_| matches!(kind, OpKind::Allreduce | OpKind::Gossip));
        let multistep = match kind {
            OpKind::Allreduce => spec.multistep.unwrap_or(Multistep {
                every: self.job_multistep.get().copied().unwrap_or(1),
                ..Multistep::EVERY_CALL
            }),
            _ => Multistep::EVERY_CALL,
        };
        if !multistep.is_every_call() && device != CPU_DEVICE {
            return Err(Error::InvalidArgument(format!(
                "{what}: multistep is not supported on GPU tensors yet"
            )));
        }
        Ok(std::mem::take(&mut spec.tensors)
            .into_iter()
            .map(|t| {
                let request = Request {
                    rank: set_rank,
                    kind,
                    dtype: t.dtype,
                    name: t.name,
                    shape: t.shape,
                    root,
                    device,
                    reduce_op,
                    prescale,
                    postscale,
                    compression,
                    multistep,
                };
                let mut e = TensorEntry::new(request, t.input, t.output);
                e.splits = t.splits;
                e
            })
            .collect())
    }

    /// Registers a process set on every rank (all ranks must call it with the same ranks).
    pub fn add_process_set(&self, ranks: &[i32]) -> Result<Arc<Handle>> {
        refuse_on_background_thread("add_process_set")?;
        let sorted = process_set_ranks(ranks, Some(self.topology().size))?;
        self.enqueue_control(
            OpKind::AddProcessSet,
            format!("process_set.add.{sorted:?}"),
            sorted.iter().map(|r| *r as i64).collect(),
        )
    }

    /// Removes a process set on every rank (all ranks must call it).
    pub fn remove_process_set(&self, id: i32) -> Result<Arc<Handle>> {
        refuse_on_background_thread("remove_process_set")?;
        if id == 0 {
            return Err(Error::InvalidArgument(
                "The global process set (id 0) cannot be removed.".into(),
            ));
        }
        if self.process_set_ranks(id).is_none() {
            return Err(unknown_set());
        }
        self.enqueue_control(
            OpKind::RemoveProcessSet,
            format!("process_set.remove.{id}"),
            vec![id as i64],
        )
    }

    fn enqueue_control(&self, kind: OpKind, name: String, shape: Vec<i64>) -> Result<Arc<Handle>> {
        if self.is_shut_down() {
            return Err(self.shut_down_error());
        }
        let handle = self.handles.create(1, None);
        if self
            .in_flight
            .lock()
            .expect("in flight")
            .claim(0, [(name.as_str(), None)], &handle)
            .is_none()
        {
            let _ = self.handles.release(handle.id);
            return Err(Error::InvalidArgument(format!(
                "a process set change '{name}' is already in progress"
            )));
        }
        let mut e = TensorEntry::new(
            Request {
                rank: self.topology().rank,
                kind,
                dtype: DataType::I32,
                name,
                shape,
                root: 0,
                device: CPU_DEVICE,
                reduce_op: ReduceOp::Sum,
                prescale: 1.0,
                postscale: 1.0,
                compression: None,
                multistep: Multistep::EVERY_CALL,
            },
            InputMem::Owned(Vec::new()),
            OutputMem::InPlace,
        );
        e.handle = Some(handle.clone());
        if self
            .send(Command::Submit {
                set: 0,
                entries: vec![e],
            })
            .is_err()
        {
            let _ = self.handles.release(handle.id);
            return Err(self.shut_down_error());
        }
        Ok(handle)
    }
}

impl Runtime {
    /// Makes `stream` wait on the device for `handle`'s operation, not launched yet, where its
    /// batch can no longer wait for the whole device on the way (which would wait for `stream`
    /// too): every kernel library is loaded (here, the first time no stream waits) and every
    /// NCCL connection it may need is made on the executors of its set that may run it.
    /// False: the caller waits on the host.
    pub fn wait_on_device(
        &self,
        handle: &Handle,
        gpu: &Arc<crate::transport::cuda::Gpu>,
        stream: crate::transport::cuda::ForeignStream,
    ) -> Result<bool> {
        let Some((set, request)) = handle.origin() else {
            return Ok(false);
        };
        if !gpu.load_unless_waited(&crate::collective::device::LIBRARIES)? {
            return Ok(false);
        }
        let head = Response::from_request(request);
        let connected = self.connected.read().expect("connected");
        if !connected.get(set).is_some_and(|c| c.covers(&head)) {
            return Ok(false);
        }
        drop(connected);
        // bounded by the stall limit (or, without one, by Horovod's default shutdown time)
        let limit = (self.stall().limit()).unwrap_or(std::time::Duration::from_secs(600));
        handle.wait_on_device(gpu, stream, limit)
    }
}

/// The GPU `ordinal` with the collectives' kernels loaded: a GPU whose kernels cannot be
/// compiled fails the call that first uses it, not a batch the ranks agreed to run.
pub(super) fn open_gpu(ordinal: i32) -> Result<Arc<crate::transport::cuda::Gpu>> {
    let gpu = crate::transport::cuda::gpu(ordinal)?;
    gpu.load(&crate::collective::kernels::LIBRARY)?;
    Ok(gpu)
}

/// Collective calls that block until all ranks agree cannot run inside a callback.
pub(super) fn refuse_on_background_thread(what: &str) -> Result<()> {
    if on_background_thread() {
        return Err(Error::InvalidArgument(format!(
            "{what} cannot be called from a ferrovod callback"
        )));
    }
    Ok(())
}

/// Horovod's error for a name that is in flight already.
pub(super) fn duplicate_name() -> Error {
    Error::InvalidArgument("Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is currently being processed.  If you want to request another tensor, use a different tensor name.".into())
}

pub(super) fn unknown_set() -> Error {
    Error::InvalidArgument(
        "Process set provided does not exist, or has not been registered.".into(),
    )
}

pub(super) fn op_title(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce => "Allreduce",
        OpKind::Allgather => "Allgather",
        OpKind::Broadcast => "Broadcast",
        OpKind::Join => "Join",
        OpKind::Alltoall => "Alltoall",
        OpKind::Barrier => "Barrier",
        OpKind::Reducescatter => "Reducescatter",
        OpKind::AddProcessSet => "AddProcessSet",
        OpKind::RemoveProcessSet => "RemoveProcessSet",
        OpKind::Gossip => "Gossip",
        OpKind::Send => "Send",
        OpKind::Recv => "Recv",
    }
}
