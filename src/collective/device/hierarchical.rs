//! The hierarchical GPU allreduce: NCCL inside the node, the host transport across nodes.

use super::codecs::{cast_items, half_buffer};
use super::*;
use crate::collective::hierarchical::{self, Piece, Step, Tiers};

/// The two levels of a hierarchical GPU allreduce (Horovod's shape with NCCL): NCCL among this
/// node's ranks, the host transport among the same node rank of every node.
pub struct Levels<'a> {
    pub local: &'a dyn DeviceTransport,
    pub cross: &'a dyn Transport,
}

/// Hierarchical allreduce of a batch, by the host's schedule (`hierarchical::allreduce_with`,
/// the same pieces in the same order): the tensors packed into the fusion buffer (prescaled;
/// under a 16-bit codec cast on the way, as `allreduce_half` does), each piece reduce-scattered
/// inside the node by NCCL, this rank's part allreduced across nodes through host memory,
/// allgathered inside the node by NCCL; then postscaled and unpacked. Only the parts cross
/// nodes. A piece's host step waits for the stream's work before it; the next piece's node
/// work is enqueued before that host step runs, so the device works while the host transfers.
pub fn allreduce_hierarchical(
    levels: &Levels,
    lane: &mut Lane,
    codec: Codec,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let (local, cross) = (levels.local, levels.cross);
    let ranks = local.size() * cross.size();
    let (dtype, op, pre, post) = match codec {
        Codec::None => {
            let (op, post) = backend_op(head.reduce_op, ranks, head.postscale)?;
            (head.dtype, op, head.prescale, post)
        }
        Codec::Half(_) => {
            let enc = Encoding::of(codec, head, ranks)?;
            (enc.wire, enc.op, enc.pre, enc.post)
        }
        Codec::U8 | Codec::PowerSgd(_) | Codec::TopK(_) => {
            return Err(Error::Internal(format!(
                "{codec:?} batches do not run hierarchically on GPUs"
            )));
        }
    };
    let size = dtype.size();
    let counts: Vec<usize> = (ios.iter())
        .map(|io| io.input().len() / head.dtype.size())
        .collect();
    let elems: usize = counts.iter().sum();
    let total = elems * size;
    let me = local.rank();
    let pieces = hierarchical::pieces(total, size, local.size(), cross.size());
    // the fusion buffer holds the batch, then this rank's reduced part of each piece (then the
    // 16-bit codecs' overflow counters); sized alike on every rank (the largest parts), so that
    // it grows at the same batch everywhere
    let parts: usize = pieces.iter().map(|p| p.parts[me]).sum();
    let most: usize = (pieces.iter())
        .map(|p| p.parts.iter().max().copied().unwrap_or(0))
        .sum();
    let (whole, overflows) = match codec {
        Codec::Half(_) => {
            let (whole, o) = half_buffer(lane, total, most, ios.len())?;
            (whole, Some(o))
        }
        _ => (lane.fusion(total + most)?, None),
    };
    let mut tiers = DeviceTiers {
        levels,
        buf: whole.first(total)?,
        mine: whole.sub(total, parts)?,
        lane,
        ios,
        codec,
        dtype,
        op,
        scales: (pre, post),
        counts,
        overflows,
        act,
    };
    hierarchical::allreduce_with(&mut tiers, &pieces)?;
    act(None);
    Ok(())
}

/// GPU memory: NCCL inside the node, the host transport across nodes.
struct DeviceTiers<'l, 'a, 'i, 'o> {
    levels: &'l Levels<'l>,
    /// The packed batch (in the wire dtype).
    buf: DeviceRange,
    /// This rank's reduced part of each piece, piece after piece.
    mine: DeviceRange,
    lane: &'l mut Lane<'a>,
    ios: &'i mut [&'o mut dyn DeviceIo],
    codec: Codec,
    dtype: DataType,
    op: ReduceOp,
    /// Prescale on the way in, postscale on the way out.
    scales: (f64, f64),
    /// Each tensor's elements.
    counts: Vec<usize>,
    overflows: Option<DeviceRange>,
    act: ActivitySink<'l>,
}

impl DeviceTiers<'_, '_, '_, '_> {
    /// Where this rank's reduced part of piece `k` waits in device memory.
    fn mine(&self, k: usize, pieces: &[Piece]) -> Result<DeviceRange> {
        let me = self.levels.local.rank();
        let at: usize = pieces[..k].iter().map(|p| p.parts[me]).sum();
        self.mine.sub(at, pieces[k].parts[me])
    }

    /// Packs (`into`) or unpacks the whole batch: one batched kernel each way, so it runs at
    /// the first piece's packing and the last piece's unpacking.
    fn whole(&mut self, into: bool) -> Result<()> {
        let (gpu, stream) = (self.lane.gpu, self.lane.stream);
        let size = self.dtype.size();
        let pieces = layout::consecutive(self.counts.iter().map(|c| c * size));
        let elems: usize = self.counts.iter().sum();
        let (buf, (pre, post)) = (self.buf, self.scales);
        match (self.codec, into) {
            (Codec::Half(w), true) => {
                let items = cast_items(self.ios, buf, &pieces, &self.counts, true)?;
                if let Some(o) = self.overflows {
                    gpu.memset_zero(stream, o)?;
                }
                kernels::cast_batch(gpu, stream, &items, w, true, pre, self.overflows)
            }
            (Codec::Half(w), false) => {
                let items = cast_items(self.ios, buf, &pieces, &self.counts, false)?;
                kernels::cast_batch(gpu, stream, &items, w, false, post, None)
            }
            (_, true) => {
                copy_consecutive(gpu, stream, buf, &inputs(self.ios), true)?;
                kernels::scale(gpu, stream, buf, buf, elems, self.dtype, pre)
            }
            (_, false) => {
                kernels::scale(gpu, stream, buf, buf, elems, self.dtype, post)?;
                copy_consecutive(gpu, stream, buf, &outputs(self.ios), false)
            }
        }
    }
}

impl Tiers for DeviceTiers<'_, '_, '_, '_> {
    fn step(&mut self, s: Step, pieces: &[Piece]) -> Result<()> {
        let k = s.piece();
        let p = &pieces[k];
        let data = self.buf.sub(p.at, p.len)?;
        let stream = self.lane.stream;
        match s {
            Step::Pack(0) => {
                (self.act)(Some("MEMCPY_IN_FUSION_BUFFER"));
                self.whole(true)
            }
            Step::Unpack(k) if k + 1 == pieces.len() => {
                (self.act)(Some("MEMCPY_OUT_FUSION_BUFFER"));
                self.whole(false)
            }
            Step::Pack(_) | Step::Unpack(_) => Ok(()),
            Step::Scatter(_) => {
                (self.act)(Some("NCCL_REDUCESCATTER"));
                let elems: Vec<usize> = p.parts.iter().map(|b| b / self.dtype.size()).collect();
                let mine = self.mine(k, pieces)?;
                (self.levels.local).reduce_scatter(data, mine, &elems, self.dtype, self.op, stream)
            }
            Step::Gather(_) => {
                (self.act)(Some("NCCL_ALLGATHER"));
                self.levels
                    .local
                    .allgatherv_in_place(data, &p.parts, stream)
            }
        }
    }

    fn cross(&mut self, k: usize, pieces: &[Piece], riders: &[Vec<Step>]) -> Result<()> {
        let p = &pieces[k];
        let me = self.levels.local.rank();
        let mine = self.mine(k, pieces)?;
        (self.act)(Some("MEMCPY_DEVICE_TO_HOST"));
        let mut host = vec![0u8; mine.len()];
        self.lane.gpu.download(self.lane.stream, mine, &mut host)?;
        // the next piece's node work and the last one's go on the stream before the host
        // transfer, and run while it does
        for s in riders.iter().flatten() {
            self.step(*s, pieces)?;
        }
        (self.act)(Some("MPI_ALLREDUCE"));
        self.levels
            .cross
            .allreduce(None, &mut host, self.dtype, self.op)?;
        (self.act)(Some("MEMCPY_HOST_TO_DEVICE"));
        let place = self.buf.sub(p.at + p.part(me).start, p.parts[me])?;
        self.lane.gpu.upload(self.lane.stream, &host, place)
    }
}
