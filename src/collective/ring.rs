//! Ring allreduce, written once over point-to-point transfers: a reduce-scatter of n−1 steps
//! (each rank sends one chunk to its right neighbour and reduces the chunk that arrives from its
//! left into its own copy), then an allgather of n−1 steps that passes the reduced chunks on.
//! Each rank sends and receives 2(n−1)/n of the buffer whatever n is, which is why hierarchical
//! and compressed paths are built from it. The memory it works on is behind `Workspace`
//! (host memory: `HostWorkspace`; GPU memory: `DeviceWorkspace`), so the schedule below is the
//! only copy of the algorithm.

use std::ops::Range;

use crate::dtype::DataType;
use crate::elementwise::reduce_into;
use crate::error::{Error, Result};
use crate::message::ReduceOp;
use crate::transport::cuda::{Gpu, Stream};
use crate::transport::memory::DeviceRange;
use crate::transport::{DeviceTransport, Segment, Transport};

/// A working buffer, a scratch buffer of at least one chunk, and point-to-point transfers
/// between ranks, on one kind of memory. Ranges are bytes of the working buffer.
pub trait Workspace {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Sends `send` to rank `to` while receiving `recv_len` bytes from rank `from` into the
    /// start of the scratch buffer.
    fn exchange_to_scratch(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv_len: usize,
    ) -> Result<()>;

    /// `working[range] = op(working[range], scratch[..range.len()])`.
    fn reduce_from_scratch(
        &mut self,
        range: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Sends `send` to rank `to` while receiving `recv` (disjoint from `send`) from rank `from`.
    fn exchange(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv: Range<usize>,
    ) -> Result<()>;
}

/// Bytes of chunk `c` when `elems` elements of `elem_size` bytes are split into `n` chunks that
/// differ by at most one element (the first `elems % n` get the extra one). The same on every
/// rank: a function of agreed sizes only.
pub fn chunk(elems: usize, elem_size: usize, n: usize, c: usize) -> Range<usize> {
    let (base, extra) = (elems / n, elems % n);
    let start = c * base + c.min(extra);
    let len = base + usize::from(c < extra);
    start * elem_size..(start + len) * elem_size
}

/// The largest chunk, in bytes: what the scratch buffer must hold.
pub fn scratch_bytes(elems: usize, elem_size: usize, n: usize) -> usize {
    elems.div_ceil(n.max(1)) * elem_size
}

/// Allreduces the first `elems` elements of the workspace's buffer in place. `op` is Sum, Min,
/// Max or Product (averaging is a postscale applied by the caller, as for native allreduce).
pub fn allreduce<W: Workspace + ?Sized>(
    ws: &mut W,
    elems: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (ws.size(), ws.rank());
    if n <= 1 || elems == 0 {
        return Ok(());
    }
    let size = dtype.size();
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let (send, recv) = scatter_step(r, n, s);
        let (send, recv) = (chunk(elems, size, n, send), chunk(elems, size, n, recv));
        ws.exchange_to_scratch(right, send, left, recv.len())?;
        ws.reduce_from_scratch(recv, dtype, op)?;
    }
    for s in 0..n - 1 {
        let (send, recv) = gather_step(r, n, s);
        let (send, recv) = (chunk(elems, size, n, send), chunk(elems, size, n, recv));
        ws.exchange(right, send, left, recv)?;
    }
    Ok(())
}

/// The chunks rank `r` of `n` sends and receives at reduce-scatter step `s`: after it, chunk
/// r − s − 1 holds s + 2 ranks' contributions here.
fn scatter_step(r: usize, n: usize, s: usize) -> (usize, usize) {
    ((r + n - s) % n, (r + 2 * n - s - 1) % n)
}

/// The chunks rank `r` of `n` sends and receives at allgather step `s`: after the
/// reduce-scatter it owns the reduced chunk r + 1 and passes it around the ring.
fn gather_step(r: usize, n: usize, s: usize) -> (usize, usize) {
    ((r + 1 + n - s) % n, (r + n - s) % n)
}

/// A step of a batch's packing around a pipelined allreduce: fill `piece` (the batch's bytes
/// from `at`) from the tensors, or hand its reduced bytes back to them.
pub enum Stage<'a> {
    Pack { at: usize, piece: &'a mut [u8] },
    Unpack { at: usize, piece: &'a [u8] },
}

/// The ring allreduce of `data` (whole elements of `dtype`) on host memory with the batch's
/// packing inside it (`Stage`): every byte is packed just before it is first sent or reduced
/// into, and unpacked as soon as it is final, segment by segment, so that the copies in and out
/// of the fusion buffer hide behind the transfers (only the first segment's packing and the
/// last one's unpacking do not).
pub fn allreduce_staged(
    t: &dyn Transport,
    data: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    stage: &mut dyn FnMut(Stage) -> Result<()>,
) -> Result<()> {
    let (n, r, size) = (t.size(), t.rank(), dtype.size());
    let elems = data.len() / size;
    if n <= 1 || elems == 0 {
        stage(Stage::Pack { at: 0, piece: data })?;
        return stage(Stage::Unpack { at: 0, piece: data });
    }
    // whole elements, within what one transfer may carry (at least one element: the
    // smallest count limit holds any dtype)
    let segment = (RING_SEGMENT.min(t.max_transfer_bytes()) / size * size).max(size);
    let mut scratch = vec![0u8; scratch_bytes(elems, size, n)];
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let (send, recv) = scatter_step(r, n, s);
        let (send, recv) = (chunk(elems, size, n, send), chunk(elems, size, n, recv));
        let (send_at, recv_at) = (send.start, recv.start);
        let (send_part, recv_part) = split_disjoint(data, send, recv);
        let scratch = &mut scratch[..recv_part.len()];
        t.sendrecv_segments(
            send_part,
            right,
            scratch,
            left,
            segment,
            &mut |seg| match seg {
                // this rank's own chunk, sent before anything is reduced into it
                Segment::Send(k, piece) if s == 0 => stage(Stage::Pack {
                    at: send_at + k * segment,
                    piece,
                }),
                Segment::Send(..) => Ok(()),
                Segment::Received(k, part) => {
                    let at = k * segment;
                    let own = &mut recv_part[at..at + part.len()];
                    stage(Stage::Pack {
                        at: recv_at + at,
                        piece: own,
                    })?;
                    reduce_into(own, part, dtype, op)?;
                    match s == n - 2 {
                        true => stage(Stage::Unpack {
                            at: recv_at + at,
                            piece: own,
                        }),
                        false => Ok(()),
                    }
                }
            },
        )?;
    }
    for s in 0..n - 1 {
        let (send, recv) = gather_step(r, n, s);
        let (send, recv) = (chunk(elems, size, n, send), chunk(elems, size, n, recv));
        let recv_at = recv.start;
        let (send_part, recv_part) = split_disjoint(data, send, recv);
        t.sendrecv_segments(
            send_part,
            right,
            recv_part,
            left,
            segment,
            &mut |seg| match seg {
                Segment::Send(..) => Ok(()),
                Segment::Received(k, piece) => stage(Stage::Unpack {
                    at: recv_at + k * segment,
                    piece,
                }),
            },
        )?;
    }
    Ok(())
}

/// Host memory over a `Transport`'s point-to-point transfers; reductions run on the CPU.
pub struct HostWorkspace<'a> {
    transport: &'a dyn Transport,
    data: &'a mut [u8],
    scratch: Vec<u8>,
    /// Run while each transfer is in flight (a pipelined algorithm's work on another level).
    meanwhile: Option<&'a mut dyn FnMut() -> Result<()>>,
}

impl<'a> HostWorkspace<'a> {
    /// A workspace over `data`, holding `elems` elements of `dtype`.
    pub fn new(
        transport: &'a dyn Transport,
        data: &'a mut [u8],
        elems: usize,
        dtype: DataType,
    ) -> Result<HostWorkspace<'a>> {
        if data.len() < elems * dtype.size() {
            return Err(Error::Internal(format!(
                "ring allreduce of {elems} {} elements over {} bytes",
                dtype.name(),
                data.len()
            )));
        }
        let scratch = vec![0u8; scratch_bytes(elems, dtype.size(), transport.size())];
        Ok(HostWorkspace {
            transport,
            data,
            scratch,
            meanwhile: None,
        })
    }

    /// Runs `meanwhile` while each of the ring's transfers is in flight.
    pub fn overlapping(mut self, meanwhile: &'a mut dyn FnMut() -> Result<()>) -> Self {
        self.meanwhile = Some(meanwhile);
        self
    }
}

/// One of a host ring's transfers, with the workspace's `meanwhile` work if it has any.
fn transfer(
    transport: &dyn Transport,
    meanwhile: &mut Option<&mut dyn FnMut() -> Result<()>>,
    send: &[u8],
    to: usize,
    recv: &mut [u8],
    from: usize,
) -> Result<()> {
    match meanwhile {
        Some(f) => transport.sendrecv_while(send, to, recv, from, *f),
        None => transport.sendrecv(send, to, recv, from),
    }
}

impl Workspace for HostWorkspace<'_> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn exchange_to_scratch(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv_len: usize,
    ) -> Result<()> {
        transfer(
            self.transport,
            &mut self.meanwhile,
            &self.data[send],
            to,
            &mut self.scratch[..recv_len],
            from,
        )
    }

    fn reduce_from_scratch(
        &mut self,
        range: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let len = range.len();
        reduce_into(&mut self.data[range], &self.scratch[..len], dtype, op)
    }

    fn exchange(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv: Range<usize>,
    ) -> Result<()> {
        disjoint(&send, &recv, self.data.len())?;
        let (send_part, recv_part) = split_disjoint(self.data, send, recv);
        transfer(
            self.transport,
            &mut self.meanwhile,
            send_part,
            to,
            recv_part,
            from,
        )
    }
}

/// Segments of `allreduce_staged`'s transfers: each is packed, reduced or unpacked while the
/// later ones are still on the wire.
const RING_SEGMENT: usize = 4 << 20;

/// The two disjoint chunks `send` and `recv` of `data` (checked by `disjoint` first).
fn split_disjoint(
    data: &mut [u8],
    send: Range<usize>,
    recv: Range<usize>,
) -> (&mut [u8], &mut [u8]) {
    if send.end <= recv.start {
        let (a, b) = data.split_at_mut(recv.start);
        (&mut a[send], &mut b[..recv.len()])
    } else {
        let (a, b) = data.split_at_mut(send.start);
        (&mut b[..send.len()], &mut a[recv])
    }
}

/// Checks a ring exchange's two ranges against a buffer of `len` bytes: inside it and disjoint.
fn disjoint(send: &Range<usize>, recv: &Range<usize>, len: usize) -> Result<()> {
    if send.end > len || recv.end > len || (send.start < recv.end && recv.start < send.end) {
        return Err(Error::Internal(format!(
            "ring exchange of overlapping or outside ranges {send:?} and {recv:?} of {len} bytes"
        )));
    }
    Ok(())
}

/// GPU memory over a `DeviceTransport` (NCCL send/recv); reductions run as a kernel. Every
/// step is enqueued on `stream` in order: nothing waits on the host.
pub struct DeviceWorkspace<'a> {
    transport: &'a dyn DeviceTransport,
    gpu: &'a Gpu,
    stream: &'a Stream,
    data: DeviceRange,
    scratch: DeviceRange,
}

impl<'a> DeviceWorkspace<'a> {
    /// A workspace over `data` holding `elems` elements of `dtype`; `scratch` must hold
    /// `scratch_bytes(elems, dtype.size(), size)`.
    pub fn new(
        transport: &'a dyn DeviceTransport,
        gpu: &'a Gpu,
        stream: &'a Stream,
        data: DeviceRange,
        scratch: DeviceRange,
        elems: usize,
        dtype: DataType,
    ) -> Result<DeviceWorkspace<'a>> {
        data.holds(elems * dtype.size(), "ring allreduce buffer")?;
        scratch.holds(
            scratch_bytes(elems, dtype.size(), transport.size()),
            "ring allreduce scratch",
        )?;
        Ok(DeviceWorkspace {
            transport,
            gpu,
            stream,
            data,
            scratch,
        })
    }

    fn part(&self, r: &Range<usize>) -> Result<DeviceRange> {
        self.data.sub(r.start, r.len())
    }
}

impl Workspace for DeviceWorkspace<'_> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn exchange_to_scratch(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv_len: usize,
    ) -> Result<()> {
        let recv = self.scratch.first(recv_len)?;
        self.transport
            .sendrecv(self.part(&send)?, to, recv, from, self.stream)
    }

    fn reduce_from_scratch(
        &mut self,
        range: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let x = self.scratch.first(range.len())?;
        let n = range.len() / dtype.size();
        let acc = self.part(&range)?;
        crate::collective::kernels::reduce_into(self.gpu, self.stream, acc, x, n, dtype, op)
    }

    fn exchange(
        &mut self,
        to: usize,
        send: Range<usize>,
        from: usize,
        recv: Range<usize>,
    ) -> Result<()> {
        disjoint(&send, &recv, self.data.len())?;
        self.transport
            .sendrecv(self.part(&send)?, to, self.part(&recv)?, from, self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_once_and_differ_by_at_most_one_element() {
        for elems in [0, 1, 2, 3, 7, 64, 1001] {
            for n in 1..=9 {
                let mut next = 0;
                let mut lens = Vec::new();
                for c in 0..n {
                    let r = chunk(elems, 4, n, c);
                    assert_eq!(r.start, next, "elems {elems} n {n} chunk {c}");
                    next = r.end;
                    lens.push(r.len() / 4);
                    assert!(r.len() <= scratch_bytes(elems, 4, n));
                }
                assert_eq!(next, elems * 4);
                let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                assert!(hi - lo <= 1, "elems {elems} n {n}: {lens:?}");
            }
        }
    }

    /// The schedule, simulated for every rank at once with plain vectors standing in for the
    /// transfers: every rank ends with the elementwise sum.
    #[test]
    fn the_schedule_sums_every_element_on_every_rank() {
        for n in 2..=6 {
            for elems in [1, n - 1, n, 2 * n + 1, 50] {
                let init: Vec<Vec<i64>> = (0..n)
                    .map(|r| (0..elems).map(|i| (i * 10 + r) as i64).collect())
                    .collect();
                let mut bufs = init.clone();
                let el = |range: Range<usize>| range.start / 8..range.end / 8;
                for s in 0..n - 1 {
                    let snapshot = bufs.clone();
                    for (r, buf) in bufs.iter_mut().enumerate() {
                        let left = (r + n - 1) % n;
                        let recv = el(chunk(elems, 8, n, (r + 2 * n - s - 1) % n));
                        // what the left neighbour sent this step
                        let sent = el(chunk(elems, 8, n, (left + n - s) % n));
                        assert_eq!(sent, recv);
                        for i in recv {
                            buf[i] += snapshot[left][i];
                        }
                    }
                }
                for s in 0..n - 1 {
                    let snapshot = bufs.clone();
                    for (r, buf) in bufs.iter_mut().enumerate() {
                        let left = (r + n - 1) % n;
                        let recv = el(chunk(elems, 8, n, (r + n - s) % n));
                        let sent = el(chunk(elems, 8, n, (left + 1 + n - s) % n));
                        assert_eq!(sent, recv);
                        for i in recv {
                            buf[i] = snapshot[left][i];
                        }
                    }
                }
                let want: Vec<i64> = (0..elems)
                    .map(|i| (0..n).map(|r| init[r][i]).sum())
                    .collect();
                for buf in &bufs {
                    assert_eq!(buf, &want, "n {n} elems {elems}");
                }
            }
        }
    }
}
