//! Allgather, reducescatter, broadcast and alltoall on GPU memory: NCCL's own collectives
//! around batched packing (reducescatters NCCL cannot reduce staged through the host).

use super::*;

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
        let src = ios[0].input();
        let out = ios[0].output();
        let mine: usize = bytes[0][..me].iter().sum();
        act(Some("NCCL_ALLGATHER"));
        let place = out.sub(mine, src.len())?;
        gpu.copy_batch(stream, &[Copy::new(src, place, src.len())?])?;
        t.allgatherv_in_place(out, &bytes[0], stream)?;
        act(None);
        return Ok(());
    }
    let counts: Vec<usize> = (0..size)
        .map(|r| bytes.iter().map(|b| b[r]).sum())
        .collect();
    let total: usize = counts.iter().sum();
    let buf = lane.fusion(total)?.first(total)?;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mine = buf.sub(counts[..me].iter().sum(), counts[me])?;
    copy_consecutive(gpu, stream, mine, &inputs(ios), true)?;
    act(Some("NCCL_ALLGATHER"));
    t.allgatherv_in_place(buf, &counts, stream)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let outputs: Vec<DeviceRange> = ios.iter().map(|io| io.output()).collect();
    gpu.copy_batch(stream, &rank_major_copies(buf, &outputs, &bytes, false)?)?;
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
        let src = ios[0].input();
        let dst = ios[0].output();
        act(Some("NCCL_REDUCESCATTER"));
        t.reduce_scatter(src, dst, &elems, dtype, op, stream)?;
        kernels::scale(gpu, stream, dst, dst, dst.len() / dtype.size(), dtype, post)?;
        act(None);
        return Ok(());
    }
    let total: usize = counts.iter().sum();
    let fusion = lane.fusion(total + counts[me])?;
    let (buf, recv) = (fusion.first(total)?, fusion.sub(total, counts[me])?);
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let inputs: Vec<DeviceRange> = ios.iter().map(|io| io.input()).collect();
    gpu.copy_batch(stream, &rank_major_copies(buf, &inputs, &seg, true)?)?;
    kernels::scale(
        gpu,
        stream,
        buf,
        buf,
        total / dtype.size(),
        dtype,
        head.prescale,
    )?;
    act(Some("NCCL_REDUCESCATTER"));
    t.reduce_scatter(buf, recv, &elems, dtype, op, stream)?;
    kernels::scale(gpu, stream, recv, recv, elems[me], dtype, post)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    copy_consecutive(gpu, stream, recv, &outputs(ios), false)?;
    act(None);
    Ok(())
}

/// Reducescatter through host memory for dtypes the device backend cannot reduce.
pub(super) fn reducescatter_staged(
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
    for p in layout::rank_major(seg) {
        let at = ios[p.tensor].input().sub(p.offset, p.len)?;
        lane.gpu
            .download(lane.stream, at, &mut send[p.place..p.place + p.len])?;
    }
    if crate::config::test_fault("gpu_staged", host.rank() as i32) {
        // as a failed download: the other ranks wait in the host reduce-scatter below
        return Err(Error::Internal("test fault: gpu_staged".into()));
    }
    act(Some("MPI_REDUCESCATTER"));
    crate::elementwise::scale(&mut send, head.dtype, head.prescale)?;
    let mut recv = vec![0u8; counts[me]];
    host.reduce_scatter(&send, &mut recv, counts, head.dtype, op)?;
    crate::elementwise::scale(&mut recv, head.dtype, post)?;
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
    let src = io.input();
    let dst = io.output().first(src.len())?;
    if t.rank() == resp.root as usize && src.ptr() != dst.ptr() {
        lane.gpu
            .copy_batch(lane.stream, &[Copy::new(src, dst, src.len())?])?;
    }
    act(Some("NCCL_BCAST"));
    t.broadcast(dst, resp.root as usize, lane.stream)?;
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
    if crate::config::test_fault("gpu_alltoall", host.rank() as i32) {
        // a local failure before the host-MPI step the other ranks wait in
        return Err(Error::Internal("test fault: gpu_alltoall".into()));
    }
    let c = alltoall_counts(host, resp, io.input().len(), io.send_splits())?;
    act(Some("ALLOCATE_OUTPUT"));
    io.allocate_output(&c.shape, c.recv.iter().sum())?;
    act(Some("NCCL_ALLTOALL"));
    t.alltoallv(io.input(), &c.send, io.output(), &c.recv, lane.stream)?;
    io.set_received_splits(c.recv_splits);
    act(None);
    Ok(())
}
