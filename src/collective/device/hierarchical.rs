//! The hierarchical GPU allreduce: NCCL inside the node, the host transport across nodes.

use super::codecs::{cast_items, half_buffer};
use super::*;

/// The two levels of a hierarchical GPU allreduce (Horovod's shape with NCCL): NCCL among this
/// node's ranks, the host transport among the same node rank of every node.
pub struct Levels<'a> {
    pub local: &'a dyn DeviceTransport,
    pub cross: &'a dyn Transport,
}

/// Hierarchical allreduce of a batch: the tensors packed into the fusion buffer (prescaled; under
/// a 16-bit codec cast on the way, as `allreduce_half` does), an NCCL reduce-scatter inside the
/// node, this rank's slice allreduced across nodes through host memory, an NCCL allgather inside
/// the node, postscaled and unpacked. Only the slice crosses nodes. The host step waits for the
/// stream's work before it; the rest is enqueued.
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
        Codec::U8 => {
            return Err(Error::Internal(
                "u8 batches do not run hierarchically on GPUs".into(),
            ));
        }
    };
    let size = dtype.size();
    let counts: Vec<usize> = (ios.iter())
        .map(|io| io.input().len() / head.dtype.size())
        .collect();
    let elems: usize = counts.iter().sum();
    let total = elems * size;
    let (n, me) = (local.size(), local.rank());
    // the same split on every rank of the node: a function of agreed sizes only
    let slices: Vec<Range<usize>> = (0..n).map(|c| ring::chunk(elems, size, n, c)).collect();
    let mine = slices[me].clone();
    // the fusion buffer holds the batch, then this rank's reduced slice (then the 16-bit
    // codecs' overflow counters)
    let (whole, overflows) = match codec {
        Codec::Half(_) => {
            let (whole, o) = half_buffer(lane, total, mine.len(), ios.len())?;
            (whole, Some(o))
        }
        _ => (lane.fusion(total + mine.len())?, None),
    };
    let (buf, slice) = (whole.first(total)?, whole.sub(total, mine.len())?);
    let (gpu, stream) = (lane.gpu, lane.stream);
    let pieces = layout::consecutive(counts.iter().map(|c| c * size));
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    match codec {
        Codec::Half(w) => {
            let into = cast_items(ios, buf, &pieces, &counts, true)?;
            if let Some(o) = overflows {
                gpu.memset_zero(stream, o)?;
            }
            kernels::cast_batch(gpu, stream, &into, w, true, pre, overflows)?
        }
        _ => {
            copy_consecutive(gpu, stream, buf, &inputs(ios), true)?;
            kernels::scale(gpu, stream, buf, buf, elems, dtype, pre)?;
        }
    }
    act(Some("NCCL_REDUCESCATTER"));
    let slice_counts: Vec<usize> = slices.iter().map(|s| s.len() / size).collect();
    local.reduce_scatter(buf, slice, &slice_counts, dtype, op, stream)?;
    act(Some("MEMCPY_DEVICE_TO_HOST"));
    let mut host = vec![0u8; mine.len()];
    gpu.download(stream, slice, &mut host)?;
    act(Some("MPI_ALLREDUCE"));
    cross.allreduce(None, &mut host, dtype, op)?;
    act(Some("MEMCPY_HOST_TO_DEVICE"));
    gpu.upload(stream, &host, buf.sub(mine.start, mine.len())?)?;
    act(Some("NCCL_ALLGATHER"));
    let bytes: Vec<usize> = slices.iter().map(Range::len).collect();
    local.allgatherv_in_place(buf, &bytes, stream)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    match codec {
        Codec::Half(w) => {
            let out = cast_items(ios, buf, &pieces, &counts, false)?;
            kernels::cast_batch(gpu, stream, &out, w, false, post, None)?
        }
        _ => {
            kernels::scale(gpu, stream, buf, buf, elems, dtype, post)?;
            copy_consecutive(gpu, stream, buf, &outputs(ios), false)?;
        }
    }
    act(None);
    Ok(())
}
