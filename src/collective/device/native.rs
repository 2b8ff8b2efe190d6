//! GPU memory for `collective::native`'s allgather, reducescatter, broadcast and alltoall:
//! NCCL's own collectives, batched copy kernels for packing, a kernel for scaling;
//! reducescatters of dtypes NCCL cannot reduce staged through the host transport.

use super::*;
use crate::collective::native::{Area, BatchMemory, Span};
use crate::message::OpKind;

/// GPU memory on a lane over a `DeviceTransport`; `host` carries what must be agreed or staged
/// on the host.
pub struct DeviceBatch<'d, 'a, 'i, 'o> {
    pub t: &'d dyn DeviceTransport,
    pub host: &'d dyn Transport,
    pub lane: &'d mut Lane<'a>,
    pub ios: &'i mut [&'o mut dyn DeviceIo],
}

impl DeviceBatch<'_, '_, '_, '_> {
    /// The device memory of a span (the fusion buffer as reserved: it does not move here).
    fn range(&mut self, s: Span) -> Result<DeviceRange> {
        let area = match s.area {
            Area::Input(i) => self.ios[i].input(),
            Area::Output(i) => self.ios[i].output(),
            Area::Fusion => self.lane.fusion(s.at + s.len)?,
        };
        area.sub(s.at, s.len)
    }

    /// A reducescatter through host memory.
    fn reduce_scatter_staged(
        &mut self,
        send: DeviceRange,
        recv: DeviceRange,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        let mut bytes = vec![0u8; send.len()];
        gpu.download(stream, send, &mut bytes)?;
        if crate::config::test_fault("gpu_staged", self.host.rank() as i32) {
            // as a failed download: the other ranks wait in the host reduce-scatter below
            return Err(Error::Internal("test fault: gpu_staged".into()));
        }
        let mut mine = vec![0u8; recv.len()];
        self.host
            .reduce_scatter(&bytes, &mut mine, counts, dtype, op)?;
        gpu.upload(stream, &mine, recv)
    }
}

impl BatchMemory for DeviceBatch<'_, '_, '_, '_> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn phase(&self, kind: OpKind) -> &'static str {
        match kind {
            OpKind::Allgather => "NCCL_ALLGATHER",
            OpKind::Reducescatter => "NCCL_REDUCESCATTER",
            OpKind::Broadcast => "NCCL_BCAST",
            _ => "NCCL_ALLTOALL",
        }
    }

    fn allocate_output(&mut self, i: usize, shape: &[i64], bytes: usize) -> Result<()> {
        self.ios[i].allocate_output(shape, bytes)
    }

    fn input_len(&self, i: usize) -> usize {
        self.ios[i].input().len()
    }

    fn send_splits(&self, i: usize) -> Option<Vec<i32>> {
        self.ios[i].send_splits().map(<[i32]>::to_vec)
    }

    fn set_received_splits(&mut self, i: usize, splits: Vec<i32>) {
        self.ios[i].set_received_splits(splits)
    }

    fn reserve(&mut self, bytes: usize) -> Result<()> {
        self.lane.fusion(bytes).map(|_| ())
    }

    fn copy(&mut self, copies: &[(Span, Span)]) -> Result<()> {
        let mut batch = Vec::with_capacity(copies.len());
        for (from, to) in copies {
            let (src, dst) = (self.range(*from)?, self.range(*to)?);
            if src.ptr() != dst.ptr() {
                batch.push(Copy::new(src, dst, from.len)?);
            }
        }
        self.lane.gpu.copy_batch(self.lane.stream, &batch)
    }

    fn scale(&mut self, s: Span, dtype: DataType, factor: f64) -> Result<()> {
        let r = self.range(s)?;
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        kernels::scale(gpu, stream, r, r, s.len / dtype.size(), dtype, factor)
    }

    fn reduce_op(&self, head: &Response) -> Result<(ReduceOp, f64)> {
        match self.t.reduces(head.dtype) {
            true => device_op(head, self.t.size()),
            false => backend_op(head.reduce_op, self.t.size(), head.postscale),
        }
    }

    fn allgatherv(&mut self, s: Span, counts: &[usize]) -> Result<()> {
        let r = self.range(s)?;
        self.t.allgatherv_in_place(r, counts, self.lane.stream)
    }

    fn reduce_scatter(
        &mut self,
        send: Span,
        recv: Span,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (send, recv) = (self.range(send)?, self.range(recv)?);
        if !self.t.reduces(dtype) {
            return self.reduce_scatter_staged(send, recv, counts, dtype, op);
        }
        let elems: Vec<usize> = counts.iter().map(|c| c / dtype.size()).collect();
        (self.t).reduce_scatter(send, recv, &elems, dtype, op, self.lane.stream)
    }

    fn broadcast(&mut self, s: Span, root: usize) -> Result<()> {
        let r = self.range(s)?;
        self.t.broadcast(r, root, self.lane.stream)
    }

    fn host(&self) -> Result<&dyn Transport> {
        if crate::config::test_fault("gpu_alltoall", self.host.rank() as i32) {
            // a local failure before the host-MPI step the other ranks wait in
            return Err(Error::Internal("test fault: gpu_alltoall".into()));
        }
        Ok(self.host)
    }

    fn alltoallv(
        &mut self,
        send: Span,
        send_counts: &[usize],
        recv: Span,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (send, recv) = (self.range(send)?, self.range(recv)?);
        (self.t).alltoallv(send, send_counts, recv, recv_counts, self.lane.stream)
    }
}
