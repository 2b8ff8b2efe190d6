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

/// One step of the ring on one rank: send the bytes `send` of the working buffer to rank `to`
/// while the same chunk of rank `from` arrives for `recv` (disjoint from `send`).
#[derive(Clone, Debug)]
pub struct Step {
    pub to: usize,
    pub send: Range<usize>,
    pub from: usize,
    pub recv: Range<usize>,
    /// `send` is this rank's own chunk, not yet reduced into (the first reduce-scatter step).
    pub first: bool,
    /// `recv` holds its final value after this step.
    pub last: bool,
}

/// A working buffer and point-to-point transfers between ranks, on one kind of memory (host:
/// `HostWorkspace`; GPU: `DeviceWorkspace`). Ranges are bytes of the working buffer.
pub trait Workspace {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// A reduce-scatter step: `working[recv] = op(working[recv], what arrives)`.
    fn reduce_step(&mut self, step: Step, dtype: DataType, op: ReduceOp) -> Result<()>;

    /// An allgather step: what arrives replaces `working[recv]`.
    fn copy_step(&mut self, step: Step) -> Result<()>;
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
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let (send, recv) = scatter_step(r, n, s);
        let step = Step {
            to,
            send: chunk(elems, size, n, send),
            from,
            recv: chunk(elems, size, n, recv),
            first: s == 0,
            last: s == n - 2,
        };
        ws.reduce_step(step, dtype, op)?;
    }
    for s in 0..n - 1 {
        let (send, recv) = gather_step(r, n, s);
        let step = Step {
            to,
            send: chunk(elems, size, n, send),
            from,
            recv: chunk(elems, size, n, recv),
            first: false,
            last: true,
        };
        ws.copy_step(step)?;
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
    let elems = data.len() / dtype.size();
    if t.size() <= 1 || elems == 0 {
        stage(Stage::Pack { at: 0, piece: data })?;
        return stage(Stage::Unpack { at: 0, piece: data });
    }
    let mut ws = HostWorkspace::new(t, data, elems, dtype)?.staged(stage);
    allreduce(&mut ws, elems, dtype, op)
}

/// What a host workspace does besides the transfers.
enum Around<'a> {
    /// Transfers in segments (whole elements, at most `max_transfer_bytes`), with the batch's
    /// packing.
    Staged(&'a mut dyn FnMut(Stage) -> Result<()>),
    /// Whole transfers, with work on another level while each is in flight.
    Overlapping(&'a mut dyn FnMut() -> Result<()>),
}

/// Host memory over a `Transport`'s point-to-point transfers; reductions run on the CPU.
pub struct HostWorkspace<'a> {
    transport: &'a dyn Transport,
    data: &'a mut [u8],
    scratch: Vec<u8>,
    /// Bytes of one segment: whole elements, within what one transfer may carry.
    segment: usize,
    /// None: whole transfers, split only where MPI's count limit requires.
    around: Option<Around<'a>>,
}

impl<'a> HostWorkspace<'a> {
    /// A workspace over `data`, holding `elems` elements of `dtype`.
    pub fn new(
        transport: &'a dyn Transport,
        data: &'a mut [u8],
        elems: usize,
        dtype: DataType,
    ) -> Result<HostWorkspace<'a>> {
        let size = dtype.size();
        if data.len() < elems * size {
            return Err(Error::Internal(format!(
                "ring allreduce of {elems} {} elements over {} bytes",
                dtype.name(),
                data.len()
            )));
        }
        let scratch = vec![0u8; scratch_bytes(elems, size, transport.size())];
        // at least one element: the smallest count limit holds any dtype
        let segment = (RING_SEGMENT.min(transport.max_transfer_bytes()) / size * size).max(size);
        Ok(HostWorkspace {
            transport,
            data,
            scratch,
            segment,
            around: None,
        })
    }

    /// Packs and unpacks the batch with `stage` inside the transfers.
    pub fn staged(mut self, stage: &'a mut dyn FnMut(Stage) -> Result<()>) -> Self {
        self.around = Some(Around::Staged(stage));
        self
    }

    /// Runs `meanwhile` while each of the ring's transfers is in flight.
    pub fn overlapping(mut self, meanwhile: &'a mut dyn FnMut() -> Result<()>) -> Self {
        self.around = Some(Around::Overlapping(meanwhile));
        self
    }
}

impl Workspace for HostWorkspace<'_> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn reduce_step(&mut self, step: Step, dtype: DataType, op: ReduceOp) -> Result<()> {
        disjoint(&step.send, &step.recv, self.data.len())?;
        let Step {
            to,
            send,
            from,
            recv,
            first,
            last,
        } = step;
        let (send_at, recv_at, len) = (send.start, recv.start, recv.len());
        let (send_part, recv_part) = split_disjoint(self.data, send, recv);
        let scratch = &mut self.scratch[..len];
        let stage = match &mut self.around {
            Some(Around::Staged(stage)) => stage,
            Some(Around::Overlapping(f)) => {
                self.transport
                    .sendrecv_while(send_part, to, scratch, from, *f)?;
                return reduce_into(recv_part, scratch, dtype, op);
            }
            None => {
                self.transport.sendrecv(send_part, to, scratch, from)?;
                return reduce_into(recv_part, scratch, dtype, op);
            }
        };
        let segment = self.segment;
        self.transport.sendrecv_segments(
            send_part,
            to,
            scratch,
            from,
            segment,
            &mut |seg| match seg {
                // this rank's own chunk, sent before anything is reduced into it
                Segment::Send(k, piece) if first => stage(Stage::Pack {
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
                    match last {
                        true => stage(Stage::Unpack {
                            at: recv_at + at,
                            piece: own,
                        }),
                        false => Ok(()),
                    }
                }
            },
        )
    }

    fn copy_step(&mut self, step: Step) -> Result<()> {
        disjoint(&step.send, &step.recv, self.data.len())?;
        let Step {
            to,
            send,
            from,
            recv,
            ..
        } = step;
        let recv_at = recv.start;
        let (send_part, recv_part) = split_disjoint(self.data, send, recv);
        match &mut self.around {
            Some(Around::Overlapping(f)) => self
                .transport
                .sendrecv_while(send_part, to, recv_part, from, *f),
            Some(Around::Staged(stage)) => self.transport.sendrecv_segments(
                send_part,
                to,
                recv_part,
                from,
                self.segment,
                &mut |seg| match seg {
                    Segment::Send(..) => Ok(()),
                    Segment::Received(k, piece) => stage(Stage::Unpack {
                        at: recv_at + k * self.segment,
                        piece,
                    }),
                },
            ),
            None => self.transport.sendrecv(send_part, to, recv_part, from),
        }
    }
}

/// Segments of `allreduce_staged`'s transfers: each is packed, reduced or unpacked while the
/// later ones are still on the wire. Small, because MPI moves nothing while a segment is worked
/// on (Open MPI's TCP transport progresses only inside MPI calls) and a step's last segment is
/// worked on with the link idle (BENCHMARKS.md, the ring's segments, measures both sizes).
const RING_SEGMENT: usize = 128 << 10;

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

    fn reduce_step(&mut self, step: Step, dtype: DataType, op: ReduceOp) -> Result<()> {
        disjoint(&step.send, &step.recv, self.data.len())?;
        let x = self.scratch.first(step.recv.len())?;
        let acc = self.part(&step.recv)?;
        self.transport
            .sendrecv(self.part(&step.send)?, step.to, x, step.from, self.stream)?;
        let n = step.recv.len() / dtype.size();
        crate::collective::kernels::reduce_into(self.gpu, self.stream, acc, x, n, dtype, op)
    }

    fn copy_step(&mut self, step: Step) -> Result<()> {
        disjoint(&step.send, &step.recv, self.data.len())?;
        let (send, recv) = (self.part(&step.send)?, self.part(&step.recv)?);
        self.transport
            .sendrecv(send, step.to, recv, step.from, self.stream)
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
