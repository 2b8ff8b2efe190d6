//! Allgather, reducescatter, broadcast and alltoall on host memory: MPI's own collectives
//! around the fusion buffer's packing (allgathers hierarchical where the set asks), and the
//! layouts and shapes the GPU versions share.

use super::*;

/// `bytes[i][r]`: what rank r contributes to tensor i of an allgather.
pub(crate) fn allgather_contributions(resps: &[&Response]) -> Vec<Vec<usize>> {
    resps
        .iter()
        .map(|r| {
            let rb = byte_len(r.row_elements(), r.dtype);
            r.first_dims.iter().map(|d| *d as usize * rb).collect()
        })
        .collect()
}

/// The output shape of an allgathered tensor: every rank's rows.
pub(crate) fn allgather_shape(r: &Response) -> Vec<i64> {
    let mut shape = r.shape.clone();
    let rows: i64 = r.first_dims.iter().sum();
    if shape.is_empty() {
        shape.push(rows);
    } else {
        shape[0] = rows;
    }
    shape
}

/// `seg[i][r]`: bytes of tensor i of a reducescatter that end up on rank r.
pub(crate) fn reducescatter_segments(resps: &[&Response], size: usize) -> Vec<Vec<usize>> {
    resps
        .iter()
        .map(|r| {
            let dim0 = r.shape.first().copied().unwrap_or(1);
            let rb = byte_len(r.row_elements(), r.dtype);
            (0..size)
                .map(|k| reducescatter_rows(dim0, size, k) as usize * rb)
                .collect()
        })
        .collect()
}

/// Rank `me`'s output shape of a reducescattered tensor.
pub(crate) fn reducescatter_shape(r: &Response, size: usize, me: usize) -> Vec<i64> {
    let mut shape = r.shape.clone();
    if shape.is_empty() {
        shape.push(1);
    }
    shape[0] = reducescatter_rows(shape[0], size, me);
    shape
}

/// Allgather of one or more tensors with the same dtype; first dimensions may differ per rank.
/// Fused layout in the buffer: rank-major, then tensor order. Over `levels`, hierarchically.
pub fn allgather_batch(
    t: &dyn Transport,
    levels: Option<&Levels>,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let size = t.size();
    let me = t.rank();
    let bytes = allgather_contributions(resps);
    act(Some("ALLOCATE_OUTPUT"));
    for ((io, r), b) in ios.iter_mut().zip(resps).zip(&bytes) {
        io.allocate_output(&allgather_shape(r), b.iter().sum())?;
    }
    let phase = match levels {
        Some(_) => "MPI_HIERARCHICAL_ALLGATHER",
        None => "MPI_ALLGATHER",
    };
    if ios.len() == 1 {
        act(Some(phase));
        let (input, output) = ios[0].split_io();
        let input =
            input.ok_or_else(|| Error::Internal("an allgather's output is its input".into()))?;
        match levels {
            None => t.allgatherv(Some(input), output, &bytes[0])?,
            Some(l) => {
                let mine: usize = bytes[0][..me].iter().sum();
                output[mine..mine + input.len()].copy_from_slice(input);
                hierarchical::allgatherv(l, output, &bytes[0])?;
            }
        }
        act(None);
        return Ok(());
    }
    let counts: Vec<usize> = (0..size)
        .map(|r| bytes.iter().map(|b| b[r]).sum())
        .collect();
    let total: usize = counts.iter().sum();
    let buf = fusion.get(total);
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mine: usize = counts[..me].iter().sum();
    pack_with(
        ios,
        &mut buf[mine..],
        |n| n,
        |_, d, s| {
            d.copy_from_slice(s);
            Ok(())
        },
    )?;
    act(Some(phase));
    match levels {
        None => t.allgatherv(None, buf, &counts)?,
        Some(l) => hierarchical::allgatherv(l, buf, &counts)?,
    }
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    for p in layout::rank_major(&bytes) {
        let (_, out) = ios[p.tensor].split_io();
        out[p.offset..p.offset + p.len].copy_from_slice(&buf[p.place..p.place + p.len]);
    }
    act(None);
    Ok(())
}

/// Rows of a `dim0`-row tensor that rank `r` of `size` receives in a reducescatter:
/// the remainder goes to the lowest ranks.
pub fn reducescatter_rows(dim0: i64, size: usize, r: usize) -> i64 {
    let size = size as i64;
    dim0 / size + i64::from((r as i64) < dim0 % size)
}

/// Reducescatter of one or more tensors (Sum or Average) with the same dtype and scales.
pub fn reducescatter_batch(
    t: &dyn Transport,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let size = t.size();
    let me = t.rank();
    let head = resps[0];
    let (op, post) = backend_op(head.reduce_op, size, head.postscale)?;
    let seg = reducescatter_segments(resps, size);
    act(Some("ALLOCATE_OUTPUT"));
    for ((io, r), s) in ios.iter_mut().zip(resps).zip(&seg) {
        io.allocate_output(&reducescatter_shape(r, size, me), s[me])?;
    }
    let counts: Vec<usize> = (0..size).map(|r| seg.iter().map(|s| s[r]).sum()).collect();
    let total: usize = counts.iter().sum();
    let my_total = counts[me];
    let (send, recv) = fusion.get(total + my_total).split_at_mut(total);
    let recv = &mut recv[..my_total];
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    for p in layout::rank_major(&seg) {
        let input = ios[p.tensor].input();
        send[p.place..p.place + p.len].copy_from_slice(&input[p.offset..p.offset + p.len]);
    }
    elementwise::scale(send, head.dtype, head.prescale)?;
    act(Some("MPI_REDUCESCATTER"));
    t.reduce_scatter(send, recv, &counts, head.dtype, op)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    unpack_with(
        recv,
        ios,
        |n| n,
        |d, s| elementwise::copy_scaled(d, s, head.dtype, post),
    )?;
    act(None);
    Ok(())
}

/// Broadcast from set rank `resp.root`.
pub fn broadcast(
    t: &dyn Transport,
    resp: &Response,
    io: &mut dyn TensorIo,
    act: ActivitySink,
) -> Result<()> {
    let (input, output) = io.split_io();
    if t.rank() == resp.root as usize
        && let Some(inp) = input
    {
        output.copy_from_slice(inp);
    }
    act(Some("MPI_BCAST"));
    t.broadcast(output, resp.root as usize)?;
    act(None);
    Ok(())
}

/// Each rank's row counts for every other rank, exchanged: what this rank receives from each.
pub(crate) fn exchange_splits(t: &dyn Transport, splits: &[i32]) -> Result<Vec<i32>> {
    let size = t.size();
    let send: Vec<u8> = splits.iter().flat_map(|s| s.to_le_bytes()).collect();
    let mut recv = vec![0u8; 4 * size];
    t.alltoallv(&send, &vec![4; size], &mut recv, &vec![4; size])?;
    Ok(recv
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

/// An alltoall's byte counts per rank, and what this rank receives.
pub(crate) struct AlltoallCounts {
    pub send: Vec<usize>,
    pub recv: Vec<usize>,
    pub recv_splits: Vec<i32>,
    /// This rank's output shape.
    pub shape: Vec<i64>,
}

/// Rows per rank of an alltoall without splits. Splits are 32-bit in Horovod's API (and in
/// the received splits ferrovod returns), so more rows per rank than that is an error rather
/// than a count cut short.
pub(crate) fn even_split(rows: usize, size: usize) -> Result<i32> {
    let per = rows / size.max(1);
    i32::try_from(per).map_err(|_| {
        Error::InvalidArgument(format!(
            "alltoall of {rows} rows over {size} ranks: {per} rows per rank exceed the largest split ({})",
            i32::MAX
        ))
    })
}

/// Rows go to each rank as `splits` says (or evenly); the row counts are exchanged over `host`
/// so that each rank knows what it receives before its output is allocated.
pub(crate) fn alltoall_counts(
    host: &dyn Transport,
    resp: &Response,
    input_bytes: usize,
    splits: Option<&[i32]>,
) -> Result<AlltoallCounts> {
    let size = host.size();
    let row_bytes = byte_len(resp.row_elements(), resp.dtype);
    let splits: Vec<i32> = match splits {
        Some(s) => s.to_vec(),
        None => vec![even_split(input_bytes / row_bytes.max(1), size)?; size],
    };
    let recv_splits = exchange_splits(host, &splits)?;
    let mut shape = resp.shape.clone();
    shape[0] = recv_splits.iter().map(|s| *s as i64).sum();
    let bytes = |s: &[i32]| s.iter().map(|r| *r as usize * row_bytes).collect();
    Ok(AlltoallCounts {
        send: bytes(&splits),
        recv: bytes(&recv_splits),
        recv_splits,
        shape,
    })
}

/// Alltoall: rows are sent to each rank as the splits say (or evenly); the received row counts
/// are recorded for the caller.
pub fn alltoall(
    t: &dyn Transport,
    resp: &Response,
    io: &mut dyn TensorIo,
    act: ActivitySink,
) -> Result<()> {
    act(Some("MPI_ALLTOALL"));
    let c = alltoall_counts(t, resp, io.input().len(), io.send_splits())?;
    act(Some("ALLOCATE_OUTPUT"));
    io.allocate_output(&c.shape, c.recv.iter().sum())?;
    let (send_counts, recv_counts) = (c.send, c.recv);
    act(Some("MPI_ALLTOALL"));
    {
        let (input, output) = io.split_io();
        let input = input.expect("alltoall output is separate");
        let sent: usize = send_counts.iter().sum();
        t.alltoallv(&input[..sent], &send_counts, output, &recv_counts)?;
    }
    io.set_received_splits(c.recv_splits);
    act(None);
    Ok(())
}
