//! The collectives over GPU memory: the same batches as the host algorithms, written against
//! a `DeviceTransport` (NCCL). Work is enqueued on the lane's stream and not waited for;
//! fusion packing and unpacking are batched copy kernels, scaling is a kernel, and large
//! tensors (and a batch of one) are reduced in the tensor's own memory. Allreduces of dtypes
//! NCCL cannot reduce (16-bit integers, bool) run the ring over NCCL send/recv.

use crate::collective::replay::{Launch, LaunchGraphs, ReplayKey};
use crate::collective::{ActivitySink, Encoding, backend_op};
use crate::collective::{kernels, layout, quantized, ring};
use crate::compress::{Codec, DeviceFeedback};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{ReduceOp, Response};
use std::sync::Arc;

use crate::transport::cuda::{Copy, DeviceMem, Gpu, Stream};
use crate::transport::memory::DeviceRange;
use crate::transport::{DeviceTransport, Transport};

mod codecs;
mod gossip;
mod hierarchical;
mod lowrank;
mod native;
mod sparse;

pub use codecs::{allreduce_half, allreduce_u8};

/// Every kernel library a GPU batch may load: loaded before a caller's stream first waits on
/// the device (`Gpu::load_unless_waited`), as loading one waits for the whole device.
pub static LIBRARIES: [&crate::transport::cuda::KernelLibrary; 3] =
    [&kernels::LIBRARY, &sparse::LIBRARY, &lowrank::LIBRARY];
pub use gossip::gossip_batch;
pub use hierarchical::{Levels, allreduce_hierarchical};
pub use lowrank::allreduce_powersgd;
pub use native::DeviceBatch;
pub use sparse::allreduce_topk;

/// The device memory of one tensor taking part in a collective.
pub trait DeviceIo {
    /// The input's device memory.
    fn input(&self) -> DeviceRange;
    /// The output's device memory (the input's for in-place ops).
    fn output(&self) -> DeviceRange;
    /// For ops whose output size is known only after negotiation.
    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()>;
    fn send_splits(&self) -> Option<&[i32]>;
    fn set_received_splits(&mut self, splits: Vec<i32>);
}

/// Where a batch runs: a GPU, one of its NCCL streams (the runtime's `NcclStream`: a CUDA
/// stream, its fusion buffer and graphs; work on one stream runs in order, so the buffer is
/// reused without waiting).
pub struct Lane<'a> {
    pub gpu: &'a Arc<Gpu>,
    pub stream: &'a Stream,
    pub fusion: &'a mut Option<DeviceMem>,
    /// The stream's graphs (forgotten when the fusion buffer moves).
    pub graphs: &'a mut LaunchGraphs,
    /// Set for a batch that may be replayed as a graph (a fused allreduce, or gossip run as
    /// one inside a node).
    pub replay: Option<ReplayKey>,
    /// Set by a batch launched from a replayed graph.
    pub replayed: bool,
    /// The `u8` codec's residuals of the process set's tensors.
    pub feedback: &'a mut DeviceFeedback,
    /// Set by a 16-bit codec's batch: one u32 per tensor, its values that overflowed the
    /// 16-bit type when packed (in the fusion buffer, after the batch; valid in stream order
    /// until the stream's next batch).
    pub overflows: Option<DeviceRange>,
}

impl Lane<'_> {
    /// The fusion buffer, grown to at least `bytes`.
    pub(crate) fn fusion(&mut self, bytes: usize) -> Result<DeviceRange> {
        if self.fusion.as_ref().is_none_or(|f| f.len() < bytes) {
            // both in stream order: the old buffer goes after the work that still uses it,
            // without stalling the device or this thread
            if let Some(old) = self.fusion.take() {
                old.free_on(self.stream)?;
            }
            // identical on every rank: the buffer grows at the same agreed batch everywhere
            self.graphs.clear();
            let len = bytes.next_power_of_two().max(1 << 20);
            *self.fusion = Some(self.gpu.alloc_on(self.stream, len)?);
        }
        Ok(self
            .fusion
            .as_ref()
            .map_or_else(DeviceRange::empty, DeviceMem::range))
    }
}

fn is_float(d: DataType) -> bool {
    matches!(
        d,
        DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
    )
}

/// The device reduction and the factor after it: Average of floats without scales is NCCL's
/// own average (one pass); otherwise as on the host (Sum, then a postscale of 1/size). Never
/// NCCL's average on one rank: NCCL before 2.29.7 leaves the tail of the buffer unwritten there
/// (NVIDIA/nccl#1950), and a sum over one rank is the same copy.
fn device_op(resp: &Response, size: usize) -> Result<(ReduceOp, f64)> {
    if resp.reduce_op == ReduceOp::Average
        && size > 1
        && is_float(resp.dtype)
        && resp.prescale == 1.0
        && resp.postscale == 1.0
    {
        return Ok((ReduceOp::Average, 1.0));
    }
    backend_op(resp.reduce_op, size, resp.postscale)
}

/// One copy of `len` bytes between a tensor's memory and a place in a fusion buffer, in
/// either direction.
fn between(
    tensor: DeviceRange,
    buffer: DeviceRange,
    len: usize,
    into_buffer: bool,
) -> Result<Copy> {
    match into_buffer {
        true => Copy::new(tensor, buffer, len),
        false => Copy::new(buffer, tensor, len),
    }
}

/// Enqueues one batch of copies between `(range, bytes)` tensors and consecutive places of the
/// buffer range `at`, in tensor order: into the buffer (packing), or out of it (unpacking).
pub(crate) fn copy_consecutive(
    gpu: &Gpu,
    stream: &Stream,
    at: DeviceRange,
    tensors: &[(DeviceRange, usize)],
    into_buffer: bool,
) -> Result<()> {
    gpu.copy_batch(stream, &consecutive_copies(at, tensors, into_buffer)?)
}

/// Every tensor's input and its length.
fn inputs(ios: &[&mut dyn DeviceIo]) -> Vec<(DeviceRange, usize)> {
    ios.iter()
        .map(|io| (io.input(), io.input().len()))
        .collect()
}

/// Every tensor's output and its length.
fn outputs(ios: &[&mut dyn DeviceIo]) -> Vec<(DeviceRange, usize)> {
    ios.iter()
        .map(|io| (io.output(), io.output().len()))
        .collect()
}

/// The copies of `copy_consecutive`.
fn consecutive_copies(
    at: DeviceRange,
    tensors: &[(DeviceRange, usize)],
    into_buffer: bool,
) -> Result<Vec<Copy>> {
    layout::consecutive(tensors.iter().map(|t| t.1))
        .iter()
        .map(|p| {
            between(
                tensors[p.tensor].0,
                at.sub(p.place, p.len)?,
                p.len,
                into_buffer,
            )
        })
        .collect()
}

/// Allreduce of a batch (same dtype, op and scales). With `lane.replay`, the launches are
/// captured into a graph and replayed as `replay` decides.
pub fn allreduce_batch(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let dtype = head.dtype;
    if !t.reduces(dtype) {
        return allreduce_ring(t, lane, resps, ios, act);
    }
    let (op, post) = device_op(head, t.size())?;
    let sizes: Vec<usize> = ios.iter().map(|io| io.input().len()).collect();
    let direct = reduced_in_place(&sizes);
    let fused: Vec<usize> = (0..ios.len()).filter(|i| !direct[*i]).collect();
    let total: usize = fused.iter().map(|i| sizes[*i]).sum();
    let buf = if fused.is_empty() {
        DeviceRange::empty()
    } else {
        lane.fusion(total)?.first(total)?
    };
    let batch = FusedAllreduce {
        ios,
        direct: &direct,
        fused: &fused,
        buf,
        op,
        prescale: head.prescale,
        post,
        dtype,
    };
    launch_or_replay(t, lane, &batch, act)
}

/// A batch's launches, which a graph may capture and replay.
trait Launches {
    /// This rank's addresses the launches use (what a replayed graph must find again).
    fn addresses(&self) -> Vec<u64>;
    /// Enqueues the batch's kernels and NCCL calls on `stream`.
    fn launch(
        &self,
        t: &dyn DeviceTransport,
        gpu: &Gpu,
        stream: &Stream,
        act: ActivitySink,
    ) -> Result<()>;
}

/// The fusion buffer's address, then each tensor's input and output addresses.
fn buffer_and_tensors(buf: DeviceRange, ios: &[&mut dyn DeviceIo]) -> Vec<u64> {
    let mut a = Vec::with_capacity(1 + 2 * ios.len());
    a.push(buf.ptr());
    for io in ios {
        a.extend([io.input().ptr(), io.output().ptr()]);
    }
    a
}

/// Launches `batch`, or, with `lane.replay`, captures it into a graph and replays it as the
/// lane's graphs decide.
fn launch_or_replay(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    batch: &dyn Launches,
    act: ActivitySink,
) -> Result<()> {
    let (gpu, stream) = (lane.gpu, lane.stream);
    let Some(key) = lane.replay else {
        return batch.launch(t, gpu, stream, act);
    };
    let how = lane.graphs.decide(key);
    if how == Launch::Eager {
        return batch.launch(t, gpu, stream, act);
    }
    let addresses = batch.addresses();
    if how == Launch::Replay {
        act(Some("NCCL_ALLREDUCE"));
        lane.graphs.graph(key.batch, &addresses)?.launch(stream)?;
        lane.replayed = true;
        act(None);
        return Ok(());
    }
    let graph = stream.capture(|| batch.launch(t, gpu, stream, act))?;
    graph.launch(stream)?;
    lane.graphs.keep(key.batch, addresses, graph);
    Ok(())
}

/// A fused allreduce's launches: large tensors where they are, the rest through `buf`.
struct FusedAllreduce<'a, 'b> {
    ios: &'a [&'b mut dyn DeviceIo],
    direct: &'a [bool],
    fused: &'a [usize],
    buf: DeviceRange,
    op: ReduceOp,
    prescale: f64,
    post: f64,
    dtype: DataType,
}

impl Launches for FusedAllreduce<'_, '_> {
    fn addresses(&self) -> Vec<u64> {
        buffer_and_tensors(self.buf, self.ios)
    }

    /// The batch's copies, scaling and NCCL group.
    fn launch(
        &self,
        t: &dyn DeviceTransport,
        gpu: &Gpu,
        stream: &Stream,
        act: ActivitySink,
    ) -> Result<()> {
        let (ios, dtype, buf) = (self.ios, self.dtype, self.buf);
        // the large tensors where they are, prescaled into their outputs where asked
        let mut calls = Vec::with_capacity(ios.len());
        for (io, _) in ios.iter().zip(self.direct).filter(|(_, d)| **d) {
            let (input, output) = (io.input(), io.output());
            let n = input.len() / dtype.size();
            let mut src = input;
            if self.prescale != 1.0 {
                kernels::scale(gpu, stream, input, output, n, dtype, self.prescale)?;
                src = output;
            }
            calls.push((src, output, n));
        }
        // the rest through the fusion buffer
        if !self.fused.is_empty() {
            act(Some("MEMCPY_IN_FUSION_BUFFER"));
            let inputs: Vec<_> = self
                .fused
                .iter()
                .map(|i| (ios[*i].input(), ios[*i].input().len()))
                .collect();
            copy_consecutive(gpu, stream, buf, &inputs, true)?;
            let total: usize = self.fused.iter().map(|i| ios[*i].input().len()).sum();
            let n = total / dtype.size();
            kernels::scale(gpu, stream, buf, buf, n, dtype, self.prescale)?;
            calls.push((buf, buf, n));
        }
        act(Some("NCCL_ALLREDUCE"));
        t.allreduce_many(&calls, dtype, self.op, stream)?;
        for (_, out, n) in &calls {
            kernels::scale(gpu, stream, *out, *out, *n, dtype, self.post)?;
        }
        if !self.fused.is_empty() {
            act(Some("MEMCPY_OUT_FUSION_BUFFER"));
            let outputs: Vec<_> = self
                .fused
                .iter()
                .map(|i| (ios[*i].output(), ios[*i].input().len()))
                .collect();
            copy_consecutive(gpu, stream, buf, &outputs, false)?;
        }
        act(None);
        Ok(())
    }
}

/// GPU tensors of at least this many bytes in a fused allreduce are reduced where they are, in
/// the batch's NCCL group, rather than copied through the fusion buffer: at this size NCCL's
/// per-call cost is below the copies' (BENCHMARKS.md, "Figures moved out of comments").
pub(crate) const GPU_IN_PLACE_BYTES: usize = 1 << 20;

/// `GPU_IN_PLACE_BYTES`, for benchmarks that lay out the same launches (a function: public
/// constants would land in the C header).
pub fn gpu_in_place_bytes() -> usize {
    GPU_IN_PLACE_BYTES
}

/// Which members of a batch (by bytes, in batch order) are reduced in place; the rest share
/// the fusion buffer. A lone small member is in place too: copying it would gain nothing.
/// Every rank computes the same from the agreed sizes, so the NCCL calls match.
pub(crate) fn reduced_in_place(sizes: &[usize]) -> Vec<bool> {
    let mut direct: Vec<bool> = sizes.iter().map(|b| *b >= GPU_IN_PLACE_BYTES).collect();
    if direct.iter().filter(|d| !**d).count() == 1 {
        direct.iter_mut().for_each(|d| *d = true);
    }
    direct
}

/// Allreduce by the ring (`collective::ring`, the host's algorithm) over NCCL send/recv, all
/// enqueued on the lane's stream: for dtypes NCCL cannot reduce, where NCCL's own allreduce
/// is not a choice. Packed, prescaled, reduced with the ring's kernels, postscaled, unpacked.
fn allreduce_ring(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let dtype = head.dtype;
    let (op, post) = backend_op(head.reduce_op, t.size(), head.postscale)?;
    let total: usize = ios.iter().map(|io| io.input().len()).sum();
    let elems = total / dtype.size();
    let scratch_len = ring::scratch_bytes(elems, dtype.size(), t.size());
    let at = total.next_multiple_of(16);
    let whole = lane.fusion(at + scratch_len)?;
    let (data, scratch) = (whole.first(total)?, whole.sub(at, scratch_len)?);
    let (gpu, stream) = (lane.gpu, lane.stream);
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    copy_consecutive(gpu, stream, data, &inputs(ios), true)?;
    kernels::scale(gpu, stream, data, data, elems, dtype, head.prescale)?;
    act(Some("RING_ALLREDUCE"));
    let mut ws = ring::DeviceWorkspace::new(t, gpu, stream, data, scratch, elems, dtype)?;
    ring::allreduce(&mut ws, elems, dtype, op)?;
    kernels::scale(gpu, stream, data, data, elems, dtype, post)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    copy_consecutive(gpu, stream, data, &outputs(ios), false)?;
    act(None);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_members_and_a_lone_small_one_are_reduced_in_place() {
        let big = GPU_IN_PLACE_BYTES;
        assert_eq!(
            reduced_in_place(&[big, 4, big - 1, 8 * big]),
            vec![true, false, false, true]
        );
        // one small member left: no fusion buffer at all
        assert_eq!(reduced_in_place(&[big, 4, big]), vec![true, true, true]);
        assert_eq!(reduced_in_place(&[4]), vec![true]);
        assert_eq!(reduced_in_place(&[4, 4]), vec![false, false]);
        assert_eq!(reduced_in_place(&[]), Vec::<bool>::new());
    }

    #[test]
    fn average_is_nccls_own_except_on_one_rank_or_with_scales() {
        let avg = |dtype, prescale| Response {
            kind: crate::message::OpKind::Allreduce,
            name: "g".into(),
            dtype,
            shape: vec![5],
            first_dims: Vec::new(),
            root: 0,
            device: 0,
            reduce_op: ReduceOp::Average,
            prescale,
            postscale: 1.0,
            compression: None,
            multistep: crate::message::Multistep::EVERY_CALL,
            result: 0,
            error: None,
        };
        let f32 = avg(DataType::F32, 1.0);
        assert_eq!(device_op(&f32, 4).unwrap(), (ReduceOp::Average, 1.0));
        // one rank: a sum (NCCL's one-rank average drops the tail before 2.29.7)
        assert_eq!(device_op(&f32, 1).unwrap(), (ReduceOp::Sum, 1.0));
        assert_eq!(
            device_op(&avg(DataType::F32, 0.5), 4).unwrap(),
            (ReduceOp::Sum, 0.25)
        );
        assert_eq!(
            device_op(&avg(DataType::I32, 1.0), 2).unwrap(),
            (ReduceOp::Sum, 0.5)
        );
    }

    fn triples(c: &[Copy]) -> Vec<(u64, u64, u64)> {
        c.iter().map(Copy::parts).collect()
    }

    fn r(ptr: u64, len: usize) -> DeviceRange {
        DeviceRange::for_test(ptr, len)
    }

    #[test]
    fn consecutive_copies_pack_and_unpack_in_order() {
        let ranges = [(r(1000, 4), 4), (r(2000, 8), 8), (r(3000, 0), 0)];
        let into = consecutive_copies(r(100, 12), &ranges, true).unwrap();
        assert_eq!(
            triples(&into),
            [(1000, 100, 4), (2000, 104, 8), (3000, 112, 0)]
        );
        let out = consecutive_copies(r(100, 12), &ranges, false).unwrap();
        assert_eq!(
            triples(&out),
            [(100, 1000, 4), (104, 2000, 8), (112, 3000, 0)]
        );
        // a buffer too short, or a tensor shorter than its bytes: refused, nothing enqueued
        assert!(consecutive_copies(r(100, 11), &ranges, true).is_err());
        assert!(consecutive_copies(r(100, 12), &[(r(1000, 3), 4)], true).is_err());
    }
}
