//! Gossip on GPU memory: `gossip::mix`'s rounds and peers over NCCL. Each round's group is
//! packed into the lane's fusion buffer and sent whole while the peer's arrives beside it (one
//! NCCL send/recv: many small ones in a group are far slower); one batched kernel then averages
//! into the outputs, which hold this rank's values, as `mean_of_two` does on the host. The
//! values travel uncompressed (the job's codec does not apply to GPU gossip).

use super::*;
use crate::collective::gossip::{self, Mixing, Schedule};

/// Gossip of one batch of GPU tensors.
pub fn gossip_batch(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    schedule: &Schedule,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let dtype = resps[0].dtype;
    let mut device = DeviceMixing {
        t,
        lane,
        ios,
        dtype,
        act,
    };
    gossip::mix(&mut device, schedule, dtype)?;
    act(None);
    Ok(())
}

struct DeviceMixing<'m, 'a, 'i, 'o> {
    t: &'m dyn DeviceTransport,
    lane: &'m mut Lane<'a>,
    ios: &'i mut [&'o mut dyn DeviceIo],
    dtype: DataType,
    act: ActivitySink<'m>,
}

impl DeviceMixing<'_, '_, '_, '_> {
    /// The members' (input, output) and their bytes.
    fn tensors(&self, members: &[usize]) -> Vec<(DeviceRange, DeviceRange, usize)> {
        let io = |i: &usize| {
            let io = &self.ios[*i];
            (io.input(), io.output(), io.input().len())
        };
        members.iter().map(io).collect()
    }

    /// The members' inputs packed into the fusion buffer's first half; both halves.
    fn pack(&mut self, members: &[usize]) -> Result<(DeviceRange, DeviceRange)> {
        let tensors = self.tensors(members);
        let total: usize = tensors.iter().map(|(_, _, len)| len).sum();
        let buf = self.lane.fusion(2 * total)?;
        let (mine, theirs) = (buf.first(total)?, buf.sub(total, total)?);
        (self.act)(Some("MEMCPY_IN_FUSION_BUFFER"));
        let inputs: Vec<_> = tensors.iter().map(|(i, _, len)| (*i, *len)).collect();
        copy_consecutive(self.lane.gpu, self.lane.stream, mine, &inputs, true)?;
        Ok((mine, theirs))
    }
}

impl Mixing for DeviceMixing<'_, '_, '_, '_> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn average(&mut self, members: &[usize]) -> Result<()> {
        let (mine, _) = self.pack(members)?;
        let (gpu, stream, dtype) = (self.lane.gpu, self.lane.stream, self.dtype);
        let n = mine.len() / dtype.size();
        (self.act)(Some("NCCL_ALLREDUCE"));
        self.t
            .allreduce(mine, mine, n, dtype, ReduceOp::Sum, stream)?;
        let scale = 1.0 / self.t.size() as f64;
        kernels::scale(gpu, stream, mine, mine, n, dtype, scale)?;
        (self.act)(Some("MEMCPY_OUT_FUSION_BUFFER"));
        let tensors = self.tensors(members);
        let outputs: Vec<_> = tensors.iter().map(|(_, o, len)| (*o, *len)).collect();
        copy_consecutive(gpu, stream, mine, &outputs, false)
    }

    fn keep(&mut self, members: &[usize]) -> Result<()> {
        // the fusion buffer grows at the same round on every rank, idle or not: growing
        // forgets the stream's graphs, which every rank must do alike
        let total: usize = self.tensors(members).iter().map(|(_, _, len)| len).sum();
        self.lane.fusion(2 * total)?;
        let copies = (self.tensors(members).iter())
            .filter(|(input, output, _)| input.ptr() != output.ptr())
            .map(|(input, output, len)| Copy::new(*input, *output, *len))
            .collect::<Result<Vec<_>>>()?;
        self.lane.gpu.copy_batch(self.lane.stream, &copies)
    }

    fn exchange(&mut self, peer: usize, members: &[usize]) -> Result<()> {
        let (mine, theirs) = self.pack(members)?;
        // this rank's values into the outputs (the average is taken in place there)
        self.keep(members)?;
        let (gpu, stream, dtype) = (self.lane.gpu, self.lane.stream, self.dtype);
        (self.act)(Some("GOSSIP_SENDRECV"));
        self.t.sendrecv(mine, peer, theirs, peer, stream)?;
        (self.act)(Some("GOSSIP_AVERAGE"));
        let tensors = self.tensors(members);
        let places = layout::consecutive(tensors.iter().map(|(_, _, len)| *len));
        let means = (places.iter().zip(&tensors))
            .map(|(p, (_, output, len))| {
                Ok((theirs.sub(p.place, p.len)?, *output, len / dtype.size()))
            })
            .collect::<Result<Vec<_>>>()?;
        kernels::mean_batch(gpu, stream, &means, dtype)
    }
}
