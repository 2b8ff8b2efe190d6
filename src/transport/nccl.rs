//! NCCL through cudarc, loaded at run time. A communicator is created collectively: rank 0 of
//! the group makes the unique id and the caller distributes it (over MPI).

use cudarc::nccl::{result, sys};

use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::ReduceOp;
use crate::transport::cuda::{Gpu, Stream};
use crate::transport::memory::DeviceRange;
use crate::transport::{DevicePtr, DeviceTransport};

fn nccl(what: &str, e: result::NcclError) -> Error {
    Error::Backend(format!("NCCL {what} failed: {e:?}"))
}

/// Whether libnccl.so can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { sys::is_culib_present() }
}

fn require_nccl() -> Result<()> {
    if nccl_present() {
        Ok(())
    } else {
        Err(Error::Precondition(
            "GPU collectives need NCCL, but libnccl.so could not be loaded (set LD_LIBRARY_PATH, or link libnccl.so.2 as libnccl.so)".into(),
        ))
    }
}

/// Bytes of an NCCL unique id.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// The bytes of a fresh NCCL unique id (call on one rank, then share).
pub fn unique_id() -> Result<Vec<u8>> {
    require_nccl()?;
    let id = result::get_uniqueid().map_err(|e| nccl("unique id", e))?;
    Ok(id.internal.iter().map(|c| *c as u8).collect())
}

/// The NCCL version as NCCL encodes it (e.g. 22803).
pub fn version() -> Result<i32> {
    require_nccl()?;
    result::get_nccl_version().map_err(|e| nccl("version", e))
}

pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    /// Set by `abort`: the communicator is gone, calls fail.
    aborted: bool,
    /// Whether `connect_peers` has set up the send/recv connections to every peer.
    peers_connected: bool,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time; ferrovod drives each
// from a single thread (the background thread or one channel).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the communicator named by `id` (identical bytes on every rank) on `gpu`.
    pub fn new(gpu: &Gpu, id: &[u8], rank: usize, size: usize) -> Result<NcclComm> {
        require_nccl()?;
        let mut uid = sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        if id.len() != uid.internal.len() {
            return Err(Error::Internal(format!(
                "NCCL unique id of {} bytes",
                id.len()
            )));
        }
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        gpu.bind()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // every rank must come: one that failed before it leaves the others here
        let _blocked = crate::transport::mpi::blocked("ncclCommInitRank");
        // SAFETY: `comm` is a valid out-pointer; the id came from ncclGetUniqueId on one rank.
        unsafe { result::comm_init_rank(&mut comm, size as i32, uid, rank as i32) }
            .map_err(|e| nccl("communicator init", e))?;
        Ok(NcclComm {
            comm,
            rank,
            size,
            aborted: false,
            peers_connected: false,
        })
    }

    /// Sets up the send/recv connections to every peer now, with one byte each way through
    /// `buf` (2 × size bytes, on `stream`). NCCL makes them on first use, inside the call that enqueues the
    /// operation, which then blocks until the peer makes its side: a peer that fails after
    /// agreeing to the operation would leave this rank's thread there, unable to vote. After
    /// this, enqueueing send/recv never waits for a peer. Collective over the communicator,
    /// like its creation; a rank that dies in between is caught by the stall watchdog.
    pub fn connect_peers(&mut self, buf: DeviceRange, stream: &Stream) -> Result<()> {
        if self.peers_connected || self.size < 2 {
            return Ok(());
        }
        let n = self.size;
        let _blocked = crate::transport::mpi::blocked("NCCL send/recv connection set-up");
        self.group(|| {
            for peer in (0..n).filter(|p| *p != self.rank) {
                self.send(buf.sub(peer, 1)?, peer, stream)?;
                self.recv(buf.sub(n + peer, 1)?, peer, stream)?;
            }
            Ok(())
        })?;
        self.peers_connected = true;
        Ok(())
    }

    /// Whether send/recv to every peer is set up (`connect_peers`).
    pub fn peers_connected(&self) -> bool {
        self.peers_connected || self.size < 2
    }

    /// Ends the communicator and every operation of it still pending or running on the GPU
    /// (after a rank failed between agreement and its NCCL call, the others' calls can never
    /// complete); later calls fail.
    pub fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: ours; NCCL frees it and stops its kernels; it is not used again.
            if let Err(e) = unsafe { result::comm_abort(self.comm) } {
                tracing::error!("ncclCommAbort failed: {e:?}");
            }
        }
    }

    /// The communicator, while it has not been aborted.
    fn live(&self) -> Result<sys::ncclComm_t> {
        if self.aborted {
            return Err(Error::Aborted(
                "the NCCL communicator was aborted after an earlier GPU failure".into(),
            ));
        }
        Ok(self.comm)
    }

    /// Enqueues a send of `data` to `to` (nothing for an empty range); inside a group.
    fn send(&self, data: DeviceRange, to: usize, stream: &Stream) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the pointer covers the range's length, as DeviceRange guarantees.
        unsafe {
            result::send(
                ptr(data.ptr()),
                data.len(),
                bytes_type(),
                to as i32,
                self.live()?,
                stream.raw().cast(),
            )
        }
        .map(|_| ())
        .map_err(|e| nccl("send", e))
    }

    /// Enqueues a receive into `data` from `from` (nothing for an empty range); inside a group.
    fn recv(&self, data: DeviceRange, from: usize, stream: &Stream) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the pointer covers the range's length, as DeviceRange guarantees.
        unsafe {
            result::recv(
                ptr(data.ptr()),
                data.len(),
                bytes_type(),
                from as i32,
                self.live()?,
                stream.raw().cast(),
            )
        }
        .map(|_| ())
        .map_err(|e| nccl("recv", e))
    }

    fn group(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        result::group_start().map_err(|e| nccl("group start", e))?;
        let r = f();
        let end = result::group_end().map_err(|e| nccl("group end", e));
        r.and(end.map(|_| ()))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted {
            // SAFETY: ours and no longer used; destroy waits for pending operations (the runtime
            // aborts communicators whose work cannot finish before dropping them).
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

/// NCCL's element type for `dtype`, where NCCL can reduce it.
/// Whether NCCL reduces `dtype` (the others are staged through host memory). The same on every
/// rank: a function of the dtype only.
pub fn reduces(dtype: DataType) -> bool {
    nccl_type(dtype).is_some()
}

fn nccl_type(dtype: DataType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t::*;
    Some(match dtype {
        DataType::U8 => ncclUint8,
        DataType::I8 => ncclInt8,
        DataType::I32 => ncclInt32,
        DataType::I64 => ncclInt64,
        DataType::F16 => ncclFloat16,
        DataType::BF16 => ncclBfloat16,
        DataType::F32 => ncclFloat32,
        DataType::F64 => ncclFloat64,
        DataType::U16 | DataType::I16 | DataType::Bool => return None,
    })
}

fn nccl_op(op: ReduceOp) -> Result<sys::ncclRedOp_t> {
    use sys::ncclRedOp_t::*;
    Ok(match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Average => ncclAvg,
        ReduceOp::Min => ncclMin,
        ReduceOp::Max => ncclMax,
        ReduceOp::Product => ncclProd,
        ReduceOp::Adasum => {
            return Err(Error::InvalidArgument(
                "Adasum is not supported by ferrovod".into(),
            ));
        }
    })
}

fn typed(dtype: DataType) -> Result<sys::ncclDataType_t> {
    nccl_type(dtype).ok_or_else(|| Error::Internal(format!("NCCL cannot reduce {}", dtype.name())))
}

fn ptr(p: DevicePtr) -> *mut std::ffi::c_void {
    p as usize as *mut std::ffi::c_void
}

/// One count per rank of the communicator.
fn counts_fit(counts: &[usize], size: usize) -> Result<()> {
    if counts.len() != size {
        return Err(Error::Internal(format!(
            "{} counts for a communicator of {size}",
            counts.len()
        )));
    }
    Ok(())
}

fn bytes_type() -> sys::ncclDataType_t {
    sys::ncclDataType_t::ncclUint8
}

impl DeviceTransport for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn reduces(&self, dtype: DataType) -> bool {
        reduces(dtype)
    }

    fn allreduce(
        &self,
        send: DeviceRange,
        recv: DeviceRange,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = count.saturating_mul(dtype.size());
        send.holds(bytes, "allreduce input")?;
        recv.holds(bytes, "allreduce output")?;
        // SAFETY: `send`/`recv` hold `count` elements (checked) of device memory (`DeviceRange`).
        unsafe {
            result::all_reduce(
                ptr(send.ptr()),
                ptr(recv.ptr()),
                count,
                typed(dtype)?,
                nccl_op(op)?,
                self.live()?,
                stream.raw().cast(),
            )
        }
        .map(|_| ())
        .map_err(|e| nccl("allreduce", e))
    }

    fn allreduce_many(
        &self,
        tensors: &[(DeviceRange, DeviceRange, usize)],
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        if let [(send, recv, count)] = tensors {
            return self.allreduce(*send, *recv, *count, dtype, op, stream);
        }
        self.group(|| {
            for (send, recv, count) in tensors {
                self.allreduce(*send, *recv, *count, dtype, op, stream)?;
            }
            Ok(())
        })
    }

    fn allgatherv_in_place(
        &self,
        recv: DeviceRange,
        counts: &[usize],
        stream: &Stream,
    ) -> Result<()> {
        counts_fit(counts, self.size)?;
        recv.holds(counts.iter().sum(), "allgather output")?;
        let recv = recv.ptr();
        let s = stream.raw().cast();
        if counts.iter().all(|c| *c == counts[0]) {
            let me = recv + (self.rank * counts[0]) as u64;
            // SAFETY: `recv` holds size × counts[0] bytes; in place as NCCL allows.
            return unsafe {
                result::all_gather(ptr(me), ptr(recv), counts[0], bytes_type(), self.live()?, s)
            }
            .map(|_| ())
            .map_err(|e| nccl("allgather", e));
        }
        // uneven: one broadcast per rank, from its segment, in one group
        self.group(|| {
            let mut off = 0u64;
            for (r, c) in counts.iter().enumerate() {
                let at = recv + off;
                // SAFETY: segment r of `recv`; in-place broadcast.
                unsafe {
                    result::broadcast(
                        ptr(at),
                        ptr(at),
                        *c,
                        bytes_type(),
                        r as i32,
                        self.live()?,
                        s,
                    )
                }
                .map_err(|e| nccl("allgather broadcast", e))?;
                off += *c as u64;
            }
            Ok(())
        })
    }

    fn broadcast(&self, data: DeviceRange, root: usize, stream: &Stream) -> Result<()> {
        let bytes = data.len();
        // SAFETY: `data` is device memory of `bytes` bytes (`DeviceRange`); in place.
        unsafe {
            result::broadcast(
                ptr(data.ptr()),
                ptr(data.ptr()),
                bytes,
                bytes_type(),
                root as i32,
                self.live()?,
                stream.raw().cast(),
            )
        }
        .map(|_| ())
        .map_err(|e| nccl("broadcast", e))
    }

    fn sendrecv(
        &self,
        send: DeviceRange,
        to: usize,
        recv: DeviceRange,
        from: usize,
        stream: &Stream,
    ) -> Result<()> {
        if to >= self.size || from >= self.size {
            return Err(Error::InvalidArgument(format!(
                "sendrecv with rank {to}/{from} on a communicator of {} ranks",
                self.size
            )));
        }
        self.group(|| {
            self.send(send, to, stream)?;
            self.recv(recv, from, stream)
        })
    }

    fn alltoallv(
        &self,
        send: DeviceRange,
        send_counts: &[usize],
        recv: DeviceRange,
        recv_counts: &[usize],
        stream: &Stream,
    ) -> Result<()> {
        counts_fit(send_counts, self.size)?;
        counts_fit(recv_counts, self.size)?;
        send.holds(send_counts.iter().sum(), "alltoall input")?;
        recv.holds(recv_counts.iter().sum(), "alltoall output")?;
        self.group(|| {
            let (mut so, mut ro) = (0usize, 0usize);
            for r in 0..self.size {
                self.send(send.sub(so, send_counts[r])?, r, stream)?;
                self.recv(recv.sub(ro, recv_counts[r])?, r, stream)?;
                so += send_counts[r];
                ro += recv_counts[r];
            }
            Ok(())
        })
    }

    fn reduce_scatter(
        &self,
        send: DeviceRange,
        recv: DeviceRange,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        counts_fit(counts, self.size)?;
        let esz = dtype.size();
        send.holds(
            counts.iter().sum::<usize>().saturating_mul(esz),
            "reducescatter input",
        )?;
        recv.holds(
            counts[self.rank].saturating_mul(esz),
            "reducescatter output",
        )?;
        let (send, recv) = (send.ptr(), recv.ptr());
        let s = stream.raw().cast();
        let (ty, nop) = (typed(dtype)?, nccl_op(op)?);
        if counts.iter().all(|c| *c == counts[0]) {
            // SAFETY: `send` holds size × counts[0] elements, `recv` counts[0].
            return unsafe {
                result::reduce_scatter(ptr(send), ptr(recv), counts[0], ty, nop, self.live()?, s)
            }
            .map(|_| ())
            .map_err(|e| nccl("reducescatter", e));
        }
        // uneven: one reduce to each rank, in one group
        self.group(|| {
            let mut off = 0u64;
            for (r, c) in counts.iter().enumerate() {
                let dst = if r == self.rank {
                    recv
                } else {
                    send + off * dtype.size() as u64
                };
                // SAFETY: segment r of `send`; `recv` (root only) holds counts[rank] elements.
                unsafe {
                    result::reduce(
                        ptr(send + off * dtype.size() as u64),
                        ptr(dst),
                        *c,
                        ty,
                        nop,
                        r as i32,
                        self.live()?,
                        s,
                    )
                }
                .map_err(|e| nccl("reduce", e))?;
                off += *c as u64;
            }
            Ok(())
        })
    }
}
