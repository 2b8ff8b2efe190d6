//! The collectives over GPU memory: the same batches as the host algorithms, written against
//! a `DeviceTransport` (NCCL). Work is enqueued on the lane's stream and not waited for;
//! fusion packing and unpacking are batched copy kernels, scaling is a kernel, and a batch of
//! one tensor runs in the tensor's own memory. Reductions the device backend lacks (16-bit
//! integers, bool) are staged through host memory and the host transport.

use crate::collective::{
    ActivitySink, allgather_contributions, allgather_shape, alltoall_counts, backend_op,
    reducescatter_segments, reducescatter_shape,
};
use crate::dtype::DataType;
use crate::error::Result;
use crate::message::{ReduceOp, Response};
use crate::transport::cuda::{Copy, DeviceMem, Gpu, Stream};
use crate::transport::{DevicePtr, DeviceTransport, Transport};

/// The device memory of one tensor taking part in a collective.
pub trait DeviceIo {
    /// Input address and bytes.
    fn input(&self) -> (DevicePtr, usize);
    /// Output address and bytes (the input's for in-place ops).
    fn output(&self) -> (DevicePtr, usize);
    /// For ops whose output size is known only after negotiation.
    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()>;
    fn send_splits(&self) -> Option<&[i32]>;
    fn set_received_splits(&mut self, splits: Vec<i32>);
}

/// Where a batch runs: a GPU, one of ferrovod's streams on it, and that stream's fusion buffer
/// (work on one stream runs in order, so the buffer is reused without waiting).
pub struct Lane<'a> {
    pub gpu: &'a Gpu,
    pub stream: &'a Stream,
    pub fusion: &'a mut Option<DeviceMem>,
}

impl Lane<'_> {
    /// The fusion buffer, grown to at least `bytes`.
    fn fusion(&mut self, bytes: usize) -> Result<DevicePtr> {
        if self.fusion.as_ref().is_none_or(|f| f.len() < bytes) {
            // both in stream order: the old buffer goes after the work that still uses it,
            // without stalling the device or this thread
            if let Some(old) = self.fusion.take() {
                old.free_on(self.stream)?;
            }
            let len = bytes.next_power_of_two().max(1 << 20);
            *self.fusion = Some(self.gpu.alloc_on(self.stream, len)?);
        }
        Ok(self.fusion.as_ref().map_or(0, |f| f.ptr()))
    }
}

fn is_float(d: DataType) -> bool {
    matches!(
        d,
        DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
    )
}

/// The device reduction and the factor after it: Average of floats without scales is NCCL's
/// own average (one pass); otherwise as on the host (Sum, then a postscale of 1/size).
fn device_op(resp: &Response, size: usize) -> Result<(ReduceOp, f64)> {
    if resp.reduce_op == ReduceOp::Average
        && is_float(resp.dtype)
        && resp.prescale == 1.0
        && resp.postscale == 1.0
    {
        return Ok((ReduceOp::Average, 1.0));
    }
    backend_op(resp.reduce_op, size, resp.postscale)
}

/// Allreduce of a batch (same dtype, op and scales).
pub fn allreduce_batch(
    t: &dyn DeviceTransport,
    host: &dyn Transport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let dtype = head.dtype;
    if !t.reduces(dtype) {
        return allreduce_staged(host, lane, resps, ios, act);
    }
    let (op, post) = device_op(head, t.size())?;
    let gpu = lane.gpu;
    let stream = lane.stream;
    if ios.len() == 1 {
        let (input, bytes) = ios[0].input();
        let (output, _) = ios[0].output();
        let n = bytes / dtype.size();
        act(Some("NCCL_ALLREDUCE"));
        let mut src = input;
        if head.prescale != 1.0 {
            gpu.scale(stream, input, output, n, dtype, head.prescale)?;
            src = output;
        }
        t.allreduce(src, output, n, dtype, op, stream)?;
        gpu.scale(stream, output, output, n, dtype, post)?;
        act(None);
        return Ok(());
    }
    let total: usize = ios.iter().map(|io| io.input().1).sum();
    let buf = lane.fusion(total)?;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mut off = 0u64;
    let mut copies_in = Vec::with_capacity(ios.len());
    let mut copies_out = Vec::with_capacity(ios.len());
    for io in ios.iter() {
        let (src, len) = io.input();
        let (dst, _) = io.output();
        copies_in.push(Copy {
            src,
            dst: buf + off,
            len: len as u64,
        });
        copies_out.push(Copy {
            src: buf + off,
            dst,
            len: len as u64,
        });
        off += len as u64;
    }
    gpu.copy_batch(stream, &copies_in)?;
    let n = total / dtype.size();
    act(Some("NCCL_ALLREDUCE"));
    gpu.scale(stream, buf, buf, n, dtype, head.prescale)?;
    t.allreduce(buf, buf, n, dtype, op, stream)?;
    gpu.scale(stream, buf, buf, n, dtype, post)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    gpu.copy_batch(stream, &copies_out)?;
    act(None);
    Ok(())
}

/// Allreduce through host memory for dtypes the device backend cannot reduce: waits for the
/// inputs, reduces on the host transport and copies the result back (finished on return).
fn allreduce_staged(
    host: &dyn Transport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let (op, post) = backend_op(head.reduce_op, host.size(), head.postscale)?;
    let total: usize = ios.iter().map(|io| io.input().1).sum();
    let mut buf = vec![0u8; total];
    act(Some("MEMCPY_DEVICE_TO_HOST"));
    let mut off = 0;
    for io in ios.iter() {
        let (src, len) = io.input();
        lane.gpu
            .download(lane.stream, src, &mut buf[off..off + len])?;
        off += len;
    }
    act(Some("MPI_ALLREDUCE"));
    crate::collective::reduce::scale(&mut buf, head.dtype, head.prescale)?;
    host.allreduce(None, &mut buf, head.dtype, op)?;
    crate::collective::reduce::scale(&mut buf, head.dtype, post)?;
    act(Some("MEMCPY_HOST_TO_DEVICE"));
    upload_outputs(lane, &buf, ios)?;
    act(None);
    Ok(())
}

/// Copies consecutive bytes of `src` into the tensors' outputs, in order (the staged paths).
fn upload_outputs(lane: &Lane, src: &[u8], ios: &[&mut dyn DeviceIo]) -> Result<()> {
    let mut off = 0;
    for io in ios {
        let (dst, len) = io.output();
        lane.gpu.upload(lane.stream, &src[off..off + len], dst)?;
        off += len;
    }
    Ok(())
}

/// Allgather of a batch; first dimensions may differ per rank. Fused layout: rank-major, then
/// tensor order (as on the host).
pub fn allgather_batch(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let size = t.size();
    let me = t.rank();
    let bytes = allgather_contributions(resps);
    act(Some("ALLOCATE_OUTPUT"));
    for ((io, r), b) in ios.iter_mut().zip(resps).zip(&bytes) {
        io.allocate_output(&allgather_shape(r), b.iter().sum())?;
    }
    let (gpu, stream) = (lane.gpu, lane.stream);
    if ios.len() == 1 {
        let (src, len) = ios[0].input();
        let (out, _) = ios[0].output();
        let mine: usize = bytes[0][..me].iter().sum();
        act(Some("NCCL_ALLGATHER"));
        gpu.copy_batch(
            stream,
            &[Copy {
                src,
                dst: out + mine as u64,
                len: len as u64,
            }],
        )?;
        t.allgatherv_in_place(out, &bytes[0], stream)?;
        act(None);
        return Ok(());
    }
    let counts: Vec<usize> = (0..size)
        .map(|r| bytes.iter().map(|b| b[r]).sum())
        .collect();
    let total: usize = counts.iter().sum();
    let buf = lane.fusion(total)?;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mut at = buf + counts[..me].iter().sum::<usize>() as u64;
    let mut copies = Vec::with_capacity(ios.len());
    for io in ios.iter() {
        let (src, len) = io.input();
        copies.push(Copy {
            src,
            dst: at,
            len: len as u64,
        });
        at += len as u64;
    }
    gpu.copy_batch(stream, &copies)?;
    act(Some("NCCL_ALLGATHER"));
    t.allgatherv_in_place(buf, &counts, stream)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let mut copies = Vec::with_capacity(ios.len() * size);
    let mut src = buf;
    let mut dst = vec![0u64; ios.len()];
    #[allow(clippy::needless_range_loop)] // walks a [tensor][rank] matrix rank-major
    for r in 0..size {
        for (i, io) in ios.iter().enumerate() {
            let n = bytes[i][r] as u64;
            copies.push(Copy {
                src,
                dst: io.output().0 + dst[i],
                len: n,
            });
            dst[i] += n;
            src += n;
        }
    }
    gpu.copy_batch(stream, &copies)?;
    act(None);
    Ok(())
}

/// Reducescatter of a batch (Sum or Average), rows split as on the host.
pub fn reducescatter_batch(
    t: &dyn DeviceTransport,
    host: &dyn Transport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let size = t.size();
    let me = t.rank();
    let head = resps[0];
    let dtype = head.dtype;
    let seg = reducescatter_segments(resps, size);
    act(Some("ALLOCATE_OUTPUT"));
    for ((io, r), s) in ios.iter_mut().zip(resps).zip(&seg) {
        io.allocate_output(&reducescatter_shape(r, size, me), s[me])?;
    }
    let counts: Vec<usize> = (0..size).map(|r| seg.iter().map(|s| s[r]).sum()).collect();
    if !t.reduces(dtype) {
        return reducescatter_staged(host, lane, head, &seg, &counts, ios, act);
    }
    let (op, post) = device_op(head, size)?;
    let elems: Vec<usize> = counts.iter().map(|c| c / dtype.size()).collect();
    let (gpu, stream) = (lane.gpu, lane.stream);
    if ios.len() == 1 && head.prescale == 1.0 {
        // one tensor is already laid out rank-major
        let (src, _) = ios[0].input();
        let (dst, n) = ios[0].output();
        act(Some("NCCL_REDUCESCATTER"));
        t.reduce_scatter(src, dst, &elems, dtype, op, stream)?;
        gpu.scale(stream, dst, dst, n / dtype.size(), dtype, post)?;
        act(None);
        return Ok(());
    }
    let total: usize = counts.iter().sum();
    let buf = lane.fusion(total + counts[me])?;
    let recv = buf + total as u64;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mut copies = Vec::with_capacity(ios.len() * size);
    let mut dst = buf;
    let mut src = vec![0u64; ios.len()];
    #[allow(clippy::needless_range_loop)] // walks a [tensor][rank] matrix rank-major
    for r in 0..size {
        for (i, io) in ios.iter().enumerate() {
            let n = seg[i][r] as u64;
            copies.push(Copy {
                src: io.input().0 + src[i],
                dst,
                len: n,
            });
            src[i] += n;
            dst += n;
        }
    }
    gpu.copy_batch(stream, &copies)?;
    gpu.scale(stream, buf, buf, total / dtype.size(), dtype, head.prescale)?;
    act(Some("NCCL_REDUCESCATTER"));
    t.reduce_scatter(buf, recv, &elems, dtype, op, stream)?;
    gpu.scale(stream, recv, recv, elems[me], dtype, post)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let mut copies = Vec::with_capacity(ios.len());
    let mut src = recv;
    for io in ios.iter() {
        let (dst, n) = io.output();
        copies.push(Copy {
            src,
            dst,
            len: n as u64,
        });
        src += n as u64;
    }
    gpu.copy_batch(stream, &copies)?;
    act(None);
    Ok(())
}

/// Reducescatter through host memory for dtypes the device backend cannot reduce.
fn reducescatter_staged(
    host: &dyn Transport,
    lane: &mut Lane,
    head: &Response,
    seg: &[Vec<usize>],
    counts: &[usize],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let me = host.rank();
    let (op, post) = backend_op(head.reduce_op, host.size(), head.postscale)?;
    let total: usize = counts.iter().sum();
    let mut send = vec![0u8; total];
    act(Some("MEMCPY_DEVICE_TO_HOST"));
    let mut dst = 0;
    let mut src = vec![0u64; ios.len()];
    #[allow(clippy::needless_range_loop)] // walks a [tensor][rank] matrix rank-major
    for r in 0..host.size() {
        for (i, io) in ios.iter().enumerate() {
            let n = seg[i][r];
            let at = io.input().0 + src[i];
            lane.gpu
                .download(lane.stream, at, &mut send[dst..dst + n])?;
            src[i] += n as u64;
            dst += n;
        }
    }
    act(Some("MPI_REDUCESCATTER"));
    crate::collective::reduce::scale(&mut send, head.dtype, head.prescale)?;
    let mut recv = vec![0u8; counts[me]];
    host.reduce_scatter(&send, &mut recv, counts, head.dtype, op)?;
    crate::collective::reduce::scale(&mut recv, head.dtype, post)?;
    act(Some("MEMCPY_HOST_TO_DEVICE"));
    upload_outputs(lane, &recv, ios)?;
    act(None);
    Ok(())
}

/// Broadcast from set rank `resp.root`.
pub fn broadcast(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    resp: &Response,
    io: &mut dyn DeviceIo,
    act: ActivitySink,
) -> Result<()> {
    let (src, len) = io.input();
    let (dst, _) = io.output();
    if t.rank() == resp.root as usize && src != dst {
        lane.gpu.copy_batch(
            lane.stream,
            &[Copy {
                src,
                dst,
                len: len as u64,
            }],
        )?;
    }
    act(Some("NCCL_BCAST"));
    t.broadcast(dst, len, resp.root as usize, lane.stream)?;
    act(None);
    Ok(())
}

/// Alltoall: the row counts travel over the host transport first (the output is allocated
/// from them), then the rows over the device transport.
pub fn alltoall(
    t: &dyn DeviceTransport,
    host: &dyn Transport,
    lane: &mut Lane,
    resp: &Response,
    io: &mut dyn DeviceIo,
    act: ActivitySink,
) -> Result<()> {
    act(Some("MPI_ALLTOALL"));
    let c = alltoall_counts(host, resp, io.input().1, io.send_splits())?;
    act(Some("ALLOCATE_OUTPUT"));
    io.allocate_output(&c.shape, c.recv.iter().sum())?;
    act(Some("NCCL_ALLTOALL"));
    t.alltoallv(io.input().0, &c.send, io.output().0, &c.recv, lane.stream)?;
    io.set_received_splits(c.recv_splits);
    act(None);
    Ok(())
}
