//! Backends. Algorithms and the negotiation see only the `Transport` trait: a communicator of
//! `size` ranks with byte-range collectives, over host memory (`Transport`: MPI; ibverbs
//! later) or GPU memory (`DeviceTransport`: NCCL).

pub mod cuda;
pub mod memory;
pub mod mpi;
pub mod nccl;
pub mod rdma;

use crate::dtype::DataType;
use crate::error::Result;
use crate::message::ReduceOp;
use crate::transport::memory::DeviceRange;

/// A communicator over which collectives run. Counts are bytes and 64-bit: a backend with
/// 32-bit counts splits the work itself. Every rank must take the same path through each call:
/// a choice that depends on data only one rank sees (e.g. its own alltoall counts) is agreed
/// with the other ranks first.
pub trait Transport {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Elementwise reduction across ranks into `data`; `send` is `None` for in place.
    /// `op` is `Sum`, `Min`, `Max` or `Product` (averaging is a postscale applied above).
    fn allreduce(
        &self,
        send: Option<&[u8]>,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Bitwise AND of `words` across ranks: the negotiation's vote.
    fn and_words(&self, words: &mut [u64]) -> Result<()>;

    /// Bitwise OR of `words` across ranks (Horovod's second vote, kept for its baseline mode).
    fn or_words(&self, words: &mut [u64]) -> Result<()>;

    /// In-place allreduce of an owned buffer that waits at most `limit` (and reports long waits
    /// to `slow`): the buffer comes back when the collective completed; `None` when the limit
    /// passed first — the operation then stays posted and keeps the buffer, which is never
    /// freed, so that the backend can never write into released memory.
    fn allreduce_owned_within(
        &self,
        data: Vec<u8>,
        dtype: DataType,
        op: ReduceOp,
        limit: Option<std::time::Duration>,
        slow: &mut dyn FnMut(std::time::Duration),
    ) -> Result<Option<Vec<u8>>>;

    /// Rank r contributes `counts[r]` bytes; `recv` gets them in rank order. With `send` None,
    /// this rank's bytes are already at their place in `recv`.
    fn allgatherv(&self, send: Option<&[u8]>, recv: &mut [u8], counts: &[usize]) -> Result<()>;

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<()>;

    /// `send` holds `send_counts[r]` bytes for each rank r in order; `recv` receives
    /// `recv_counts[r]` bytes from each rank r in order.
    fn alltoallv(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()>;

    /// Reduces `send` (segments of `counts[r]` bytes in rank order) and leaves segment `rank`
    /// of the result in `recv`.
    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Every rank's bytes at `root` (empty vector elsewhere).
    fn gather_bytes(&self, send: &[u8], root: usize) -> Result<Vec<Vec<u8>>>;

    /// `root`'s bytes everywhere; other ranks' `data` is ignored.
    fn broadcast_bytes(&self, data: Vec<u8>, root: usize) -> Result<Vec<u8>>;

    /// Sends `send` to rank `to` while receiving `recv.len()` bytes from rank `from` (the two
    /// may be the same rank; either length may be 0). The point-to-point step that algorithms
    /// in `collective/` are built from.
    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()> {
        self.sendrecv_while(send, to, recv, from, &mut || Ok(()))
    }

    /// `sendrecv`, running `meanwhile` (work on other communicators or memory) while the
    /// transfer is in flight: how a pipelined algorithm overlaps one level's transfers with
    /// another's. Both finish before it returns; `meanwhile`'s error comes first.
    fn sendrecv_while(
        &self,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>;

    /// `sendrecv` with both buffers split into segments of `segment` bytes (the last one
    /// shorter), each travelling on its own: `on(Segment::Send(k, part))` runs on segment k of
    /// `send` just before it goes (it may still write it), `on(Segment::Received(k, part))` on
    /// segment k of `recv` as soon as it is in, while the later ones are on the wire. Work on
    /// the data so hides behind the transfer of the rest. The peer splits alike (the same
    /// `segment`, the same length).
    fn sendrecv_segments(
        &self,
        send: &mut [u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        segment: usize,
        on: &mut dyn FnMut(Segment) -> Result<()>,
    ) -> Result<()>;

    fn barrier(&self) -> Result<()>;

    /// The most bytes one point-to-point transfer may carry (`sendrecv_segments`' largest
    /// segment): MPI's count limit, lowered by `FERROVOD_MPI_MAX_COUNT`.
    fn max_transfer_bytes(&self) -> usize {
        usize::MAX
    }
}

/// A segment of `Transport::sendrecv_segments`, by index.
pub enum Segment<'a> {
    /// About to be sent: the last moment to fill it.
    Send(usize, &'a mut [u8]),
    /// Arrived.
    Received(usize, &'a [u8]),
}

/// A device address (CUDA's `CUdeviceptr`).
pub type DevicePtr = u64;

/// A communicator over GPU memory. Calls enqueue work on `stream` and return without waiting;
/// counts are bytes unless named elements. Every rank must make the same calls in the same
/// order on each communicator. Memory comes as `DeviceRange`s, and every count is checked
/// against them before anything is enqueued.
pub trait DeviceTransport {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Whether `allreduce` can reduce `dtype`; other dtypes are staged through host memory.
    fn reduces(&self, dtype: DataType) -> bool;

    /// Reduces `count` elements of `send` into `recv` (they may be equal). `op` may be Average.
    #[allow(clippy::too_many_arguments)]
    fn allreduce(
        &self,
        send: DeviceRange,
        recv: DeviceRange,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &cuda::Stream,
    ) -> Result<()>;

    /// Several independent allreduces of one dtype and op, `(send, recv, count)` each,
    /// launched together (one NCCL group): no fusion copies, one launch.
    fn allreduce_many(
        &self,
        tensors: &[(DeviceRange, DeviceRange, usize)],
        dtype: DataType,
        op: ReduceOp,
        stream: &cuda::Stream,
    ) -> Result<()>;

    /// Rank r's `counts[r]` bytes, concatenated in rank order into `recv`; this rank's bytes
    /// are already at their place in `recv`.
    fn allgatherv_in_place(
        &self,
        recv: DeviceRange,
        counts: &[usize],
        stream: &cuda::Stream,
    ) -> Result<()>;

    /// `root`'s `data` into every rank's `data` (all of it).
    fn broadcast(&self, data: DeviceRange, root: usize, stream: &cuda::Stream) -> Result<()>;

    /// Sends all of `send` to rank `to` while receiving all of `recv` from rank `from` (either
    /// may be empty), as one group.
    fn sendrecv(
        &self,
        send: DeviceRange,
        to: usize,
        recv: DeviceRange,
        from: usize,
        stream: &cuda::Stream,
    ) -> Result<()>;

    fn alltoallv(
        &self,
        send: DeviceRange,
        send_counts: &[usize],
        recv: DeviceRange,
        recv_counts: &[usize],
        stream: &cuda::Stream,
    ) -> Result<()>;

    /// Reduces `send` (segments of `counts[r]` elements in rank order); segment `rank` of the
    /// result lands in `recv`.
    fn reduce_scatter(
        &self,
        send: DeviceRange,
        recv: DeviceRange,
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
        stream: &cuda::Stream,
    ) -> Result<()>;
}
