//! Allgather, reducescatter, broadcast and alltoall, written once over `BatchMemory`: the
//! engine's own collectives (MPI's, NCCL's) around the fusion buffer's packing. Host memory
//! over MPI is here (`HostBatch`, allgathers hierarchical where the set asks); GPU memory over
//! NCCL is in `collective::device`. The layouts and shapes are functions of agreed responses.

use super::*;
use crate::message::OpKind;

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

/// Rows of a `dim0`-row tensor that rank `r` of `size` receives in a reducescatter:
/// the remainder goes to the lowest ranks.
pub fn reducescatter_rows(dim0: i64, size: usize, r: usize) -> i64 {
    let size = size as i64;
    dim0 / size + i64::from((r as i64) < dim0 % size)
}

/// Which memory a span lies in: a tensor's input or output, or the batch's fusion buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Area {
    Input(usize),
    Output(usize),
    Fusion,
}

/// `len` bytes from `at` in an area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub area: Area,
    pub at: usize,
    pub len: usize,
}

impl Span {
    pub fn input(i: usize, at: usize, len: usize) -> Span {
        Span {
            area: Area::Input(i),
            at,
            len,
        }
    }

    pub fn output(i: usize, at: usize, len: usize) -> Span {
        Span {
            area: Area::Output(i),
            at,
            len,
        }
    }

    pub fn fusion(at: usize, len: usize) -> Span {
        Span {
            area: Area::Fusion,
            at,
            len,
        }
    }

    pub fn range(&self) -> Range<usize> {
        self.at..self.at + self.len
    }
}

/// The memory a batch of allgathers, reducescatters, broadcasts or alltoalls lives in, and the
/// engine's collectives over it. Spans name the memory; counts are bytes per rank.
pub trait BatchMemory {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The timeline's name of the engine's collective of `kind`.
    fn phase(&self, kind: OpKind) -> &'static str;
    fn allocate_output(&mut self, i: usize, shape: &[i64], bytes: usize) -> Result<()>;
    fn input_len(&self, i: usize) -> usize;
    fn send_splits(&self, i: usize) -> Option<Vec<i32>>;
    fn set_received_splits(&mut self, i: usize, splits: Vec<i32>);
    /// Grows the fusion buffer to at least `bytes` (contents unspecified).
    fn reserve(&mut self, bytes: usize) -> Result<()>;
    /// Each `(from, to)` in order; a copy onto the same memory does nothing.
    fn copy(&mut self, copies: &[(Span, Span)]) -> Result<()>;
    fn scale(&mut self, s: Span, dtype: DataType, factor: f64) -> Result<()>;
    /// The engine's reduction for a batch led by `head`, and the postscale it leaves.
    fn reduce_op(&self, head: &Response) -> Result<(ReduceOp, f64)>;
    /// Every rank's `counts[r]` bytes, in rank order, this rank's already in place.
    fn allgatherv(&mut self, s: Span, counts: &[usize]) -> Result<()>;
    /// `send` (rank-major segments of `counts[r]` bytes) reduced; this rank's segment to `recv`.
    fn reduce_scatter(
        &mut self,
        send: Span,
        recv: Span,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;
    fn broadcast(&mut self, s: Span, root: usize) -> Result<()>;
    /// The host transport, for what every rank must know before its output is allocated.
    fn host(&self) -> Result<&dyn Transport>;
    fn alltoallv(
        &mut self,
        send: Span,
        send_counts: &[usize],
        recv: Span,
        recv_counts: &[usize],
    ) -> Result<()>;
}

/// The copies between consecutive places of the fusion buffer from `at` and the tensors'
/// spans `of(i, len)` (`lens[i]` bytes each): into the buffer, or out of it.
fn consecutive_spans(
    at: usize,
    lens: &[usize],
    of: impl Fn(usize, usize) -> Span,
    into: bool,
) -> Vec<(Span, Span)> {
    (layout::consecutive(lens.iter().copied()).iter())
        .map(|p| {
            let (tensor, buf) = (of(p.tensor, p.len), Span::fusion(at + p.place, p.len));
            if into { (tensor, buf) } else { (buf, tensor) }
        })
        .collect()
}

/// The copies between a rank-major fusion buffer (rank by rank, each rank's segments in tensor
/// order, `bytes[tensor][rank]` long) and the tensors' spans `of(i, offset, len)`.
fn rank_major_spans(
    bytes: &[Vec<usize>],
    of: impl Fn(usize, usize, usize) -> Span,
    into: bool,
) -> Vec<(Span, Span)> {
    (layout::rank_major(bytes).iter())
        .map(|p| {
            let (tensor, buf) = (of(p.tensor, p.offset, p.len), Span::fusion(p.place, p.len));
            if into { (tensor, buf) } else { (buf, tensor) }
        })
        .collect()
}

/// Allgather of one or more tensors with the same dtype; first dimensions may differ per rank.
/// Fused layout in the buffer: rank-major, then tensor order.
pub fn allgather_batch<M: BatchMemory + ?Sized>(
    m: &mut M,
    resps: &[&Response],
    act: ActivitySink,
) -> Result<()> {
    let (size, me) = (m.size(), m.rank());
    let bytes = allgather_contributions(resps);
    act(Some("ALLOCATE_OUTPUT"));
    for (i, (r, b)) in resps.iter().zip(&bytes).enumerate() {
        m.allocate_output(i, &allgather_shape(r), b.iter().sum())?;
    }
    let phase = m.phase(OpKind::Allgather);
    if resps.len() == 1 {
        act(Some(phase));
        let (mine, len) = (bytes[0][..me].iter().sum(), bytes[0][me]);
        m.copy(&[(Span::input(0, 0, len), Span::output(0, mine, len))])?;
        m.allgatherv(Span::output(0, 0, bytes[0].iter().sum()), &bytes[0])?;
        act(None);
        return Ok(());
    }
    let counts: Vec<usize> = (0..size)
        .map(|r| bytes.iter().map(|b| b[r]).sum())
        .collect();
    let total: usize = counts.iter().sum();
    m.reserve(total)?;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let mine: Vec<usize> = bytes.iter().map(|b| b[me]).collect();
    let at = counts[..me].iter().sum();
    m.copy(&consecutive_spans(
        at,
        &mine,
        |i, len| Span::input(i, 0, len),
        true,
    ))?;
    act(Some(phase));
    m.allgatherv(Span::fusion(0, total), &counts)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    m.copy(&rank_major_spans(&bytes, Span::output, false))?;
    act(None);
    Ok(())
}

/// Reducescatter of one or more tensors (Sum or Average) with the same dtype and scales. One
/// tensor without a prescale is already laid out rank-major: it is reduced straight into its
/// output.
pub fn reducescatter_batch<M: BatchMemory + ?Sized>(
    m: &mut M,
    resps: &[&Response],
    act: ActivitySink,
) -> Result<()> {
    let (size, me) = (m.size(), m.rank());
    let head = resps[0];
    let dtype = head.dtype;
    let (op, post) = m.reduce_op(head)?;
    let seg = reducescatter_segments(resps, size);
    act(Some("ALLOCATE_OUTPUT"));
    for (i, (r, s)) in resps.iter().zip(&seg).enumerate() {
        m.allocate_output(i, &reducescatter_shape(r, size, me), s[me])?;
    }
    let counts: Vec<usize> = (0..size).map(|r| seg.iter().map(|s| s[r]).sum()).collect();
    let total: usize = counts.iter().sum();
    let phase = m.phase(OpKind::Reducescatter);
    if resps.len() == 1 && head.prescale == 1.0 {
        act(Some(phase));
        let out = Span::output(0, 0, counts[me]);
        m.reduce_scatter(Span::input(0, 0, total), out, &counts, dtype, op)?;
        m.scale(out, dtype, post)?;
        act(None);
        return Ok(());
    }
    // the same size on every rank (the largest segment), so that a GPU fusion buffer grows at
    // the same batch everywhere
    m.reserve(total + counts.iter().max().copied().unwrap_or(0))?;
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    m.copy(&rank_major_spans(&seg, Span::input, true))?;
    m.scale(Span::fusion(0, total), dtype, head.prescale)?;
    act(Some(phase));
    let recv = Span::fusion(total, counts[me]);
    m.reduce_scatter(Span::fusion(0, total), recv, &counts, dtype, op)?;
    m.scale(recv, dtype, post)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let mine: Vec<usize> = seg.iter().map(|s| s[me]).collect();
    m.copy(&consecutive_spans(
        total,
        &mine,
        |i, len| Span::output(i, 0, len),
        false,
    ))?;
    act(None);
    Ok(())
}

/// Broadcast from set rank `resp.root`.
pub fn broadcast<M: BatchMemory + ?Sized>(
    m: &mut M,
    resp: &Response,
    act: ActivitySink,
) -> Result<()> {
    let len = m.input_len(0);
    let root = resp.root as usize;
    if m.rank() == root {
        m.copy(&[(Span::input(0, 0, len), Span::output(0, 0, len))])?;
    }
    act(Some(m.phase(OpKind::Broadcast)));
    m.broadcast(Span::output(0, 0, len), root)?;
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

/// Alltoall: rows are sent to each rank as the splits say (or evenly); the row counts travel
/// over the host transport first (the output is allocated from them), and the received row
/// counts are recorded for the caller.
pub fn alltoall<M: BatchMemory + ?Sized>(
    m: &mut M,
    resp: &Response,
    act: ActivitySink,
) -> Result<()> {
    act(Some("MPI_ALLTOALL"));
    let splits = m.send_splits(0);
    let c = alltoall_counts(m.host()?, resp, m.input_len(0), splits.as_deref())?;
    act(Some("ALLOCATE_OUTPUT"));
    let received: usize = c.recv.iter().sum();
    m.allocate_output(0, &c.shape, received)?;
    act(Some(m.phase(OpKind::Alltoall)));
    let sent: usize = c.send.iter().sum();
    let (send, recv) = (Span::input(0, 0, sent), Span::output(0, 0, received));
    m.alltoallv(send, &c.send, recv, &c.recv)?;
    m.set_received_splits(0, c.recv_splits);
    act(None);
    Ok(())
}

/// Host memory over a `Transport` (and, for allgathers, hierarchically over `levels`).
pub struct HostBatch<'h, 'a> {
    pub t: &'h dyn Transport,
    pub levels: Option<&'h Levels<'h>>,
    pub ios: &'h mut [&'a mut dyn TensorIo],
    pub fusion: &'h mut FusionBuffer,
}

fn outside(s: Span, len: usize) -> Error {
    Error::Internal(format!("{s:?} outside {len} bytes"))
}

/// `s` within `buf`.
fn within(buf: &[u8], s: Span) -> Result<&[u8]> {
    buf.get(s.range()).ok_or_else(|| outside(s, buf.len()))
}

fn within_mut(buf: &mut [u8], s: Span) -> Result<&mut [u8]> {
    let len = buf.len();
    buf.get_mut(s.range()).ok_or_else(|| outside(s, len))
}

impl HostBatch<'_, '_> {
    /// The memory of a span to write.
    fn written(&mut self, s: Span) -> Result<&mut [u8]> {
        match s.area {
            Area::Fusion => within_mut(self.fusion.get(s.at + s.len), s),
            Area::Output(i) => within_mut(self.ios[i].split_io().1, s),
            Area::Input(_) => Err(Error::Internal(format!("{s:?} written"))),
        }
    }

    /// The memory of a span to read and another to write; None where both are the same memory
    /// (a tensor in place).
    fn read_write(&mut self, from: Span, to: Span) -> Result<Option<(&[u8], &mut [u8])>> {
        match (from.area, to.area) {
            (Area::Fusion, Area::Fusion) => {
                let buf = self.fusion.get(from.range().end.max(to.range().end));
                if from.range().end <= to.at {
                    let (a, b) = buf.split_at_mut(to.at);
                    Ok(Some((
                        within(a, from)?,
                        within_mut(b, Span { at: 0, ..to })?,
                    )))
                } else if to.range().end <= from.at {
                    let (a, b) = buf.split_at_mut(from.at);
                    Ok(Some((
                        within(b, Span { at: 0, ..from })?,
                        within_mut(a, to)?,
                    )))
                } else {
                    Err(Error::Internal(format!("{from:?} overlaps {to:?}")))
                }
            }
            (Area::Input(i), Area::Fusion) => {
                let input = within(self.ios[i].input(), from)?;
                Ok(Some((
                    input,
                    within_mut(self.fusion.get(to.range().end), to)?,
                )))
            }
            (Area::Fusion, Area::Output(i)) => {
                let buf = within(self.fusion.get(from.range().end), from)?;
                Ok(Some((buf, within_mut(self.ios[i].split_io().1, to)?)))
            }
            (Area::Input(i), Area::Output(j)) if i == j => match self.ios[i].split_io() {
                (Some(input), output) => Ok(Some((within(input, from)?, within_mut(output, to)?))),
                (None, _) if from.at == to.at => Ok(None),
                (None, _) => Err(Error::Internal(format!("{from:?} into {to:?} in place"))),
            },
            _ => Err(Error::Internal(format!("{from:?} into {to:?}"))),
        }
    }
}

impl BatchMemory for HostBatch<'_, '_> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn phase(&self, kind: OpKind) -> &'static str {
        match kind {
            OpKind::Allgather if self.levels.is_some() => "MPI_HIERARCHICAL_ALLGATHER",
            OpKind::Allgather => "MPI_ALLGATHER",
            OpKind::Reducescatter => "MPI_REDUCESCATTER",
            OpKind::Broadcast => "MPI_BCAST",
            _ => "MPI_ALLTOALL",
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
        self.fusion.get(bytes);
        Ok(())
    }

    fn copy(&mut self, copies: &[(Span, Span)]) -> Result<()> {
        for (from, to) in copies {
            if from.len != to.len {
                return Err(Error::Internal(format!("{from:?} into {to:?}")));
            }
            if let Some((src, dst)) = self.read_write(*from, *to)? {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn scale(&mut self, s: Span, dtype: DataType, factor: f64) -> Result<()> {
        if factor == 1.0 {
            return Ok(());
        }
        elementwise::scale(self.written(s)?, dtype, factor)
    }

    fn reduce_op(&self, head: &Response) -> Result<(ReduceOp, f64)> {
        backend_op(head.reduce_op, self.t.size(), head.postscale)
    }

    fn allgatherv(&mut self, s: Span, counts: &[usize]) -> Result<()> {
        let (t, levels) = (self.t, self.levels);
        let buf = self.written(s)?;
        match levels {
            None => t.allgatherv(None, buf, counts),
            Some(l) => hierarchical::allgatherv(l, buf, counts),
        }
    }

    fn reduce_scatter(
        &mut self,
        send: Span,
        recv: Span,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let t = self.t;
        let (send, recv) = self
            .read_write(send, recv)?
            .ok_or_else(|| Error::Internal("a reducescatter in place".into()))?;
        t.reduce_scatter(send, recv, counts, dtype, op)
    }

    fn broadcast(&mut self, s: Span, root: usize) -> Result<()> {
        let t = self.t;
        t.broadcast(self.written(s)?, root)
    }

    fn host(&self) -> Result<&dyn Transport> {
        Ok(self.t)
    }

    fn alltoallv(
        &mut self,
        send: Span,
        send_counts: &[usize],
        recv: Span,
        recv_counts: &[usize],
    ) -> Result<()> {
        let t = self.t;
        let (send, recv) = self
            .read_write(send, recv)?
            .ok_or_else(|| Error::Internal("an alltoall in place".into()))?;
        t.alltoallv(send, send_counts, recv, recv_counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn triples(copies: &[(Span, Span)]) -> Vec<(Span, Span, usize)> {
        copies.iter().map(|(a, b)| (*a, *b, a.len)).collect()
    }

    #[test]
    fn rank_major_spans_walk_ranks_then_tensors() {
        // two tensors over three ranks: [tensor][rank] segment bytes
        let bytes = vec![vec![2, 3, 1], vec![4, 0, 5]];
        let out = rank_major_spans(&bytes, Span::output, false);
        let want = [
            (0, 0, 0, 2),
            (2, 1, 0, 4),
            (6, 0, 2, 3),
            (9, 1, 4, 0),
            (9, 0, 5, 1),
            (10, 1, 4, 5),
        ];
        let got: Vec<_> = triples(&out)
            .iter()
            .map(|(from, to, n)| match to.area {
                Area::Output(i) => (from.at, i, to.at, *n),
                _ => panic!("{to:?}"),
            })
            .collect();
        assert_eq!(got, want);
        assert!(
            out.iter()
                .all(|(f, t)| f.area == Area::Fusion && f.len == t.len)
        );
        let into = rank_major_spans(&bytes, Span::input, true);
        assert!(into.iter().zip(&out).all(|((f, t), (of, ot))| f.at == ot.at
            && t == of
            && matches!(f.area, Area::Input(_))));
    }

    #[test]
    fn consecutive_spans_pack_and_unpack_in_order_from_a_place() {
        let lens = [4, 8, 0];
        let into = consecutive_spans(100, &lens, |i, len| Span::input(i, 0, len), true);
        assert_eq!(
            into,
            vec![
                (Span::input(0, 0, 4), Span::fusion(100, 4)),
                (Span::input(1, 0, 8), Span::fusion(104, 8)),
                (Span::input(2, 0, 0), Span::fusion(112, 0)),
            ]
        );
        let out = consecutive_spans(100, &lens, |i, len| Span::output(i, 0, len), false);
        assert_eq!(out[1], (Span::fusion(104, 8), Span::output(1, 0, 8)));
    }
}
