//! GPU allreduces whose values travel compressed: the 16-bit codecs (cast kernels around
//! NCCL's sum, replayable as graphs) and u8 (the host's algorithm over `DeviceBlocks`).

use super::*;

/// An f32 sum or average whose values travel as the 16-bit float type `wire` (fp16, bf16,
/// mixed's large tensors): one batched kernel casts every tensor into the fusion buffer, scaled
/// (an average divided by the ranks first, so the sum cannot overflow where no rank's value
/// does), NCCL sums the 16-bit values, one batched kernel casts back into the outputs,
/// postscaled. Captured and replayed as graphs like the uncompressed batches.
pub fn allreduce_half(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    wire: DataType,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    // the host's encoding of the codec: the same scales, the same reduction
    let enc = Encoding::of(Codec::Half(wire), resps[0], t.size())?;
    let counts: Vec<usize> = (ios.iter())
        .map(|io| io.input().len() / enc.dtype.size())
        .collect();
    let pieces = layout::consecutive(counts.iter().map(|n| n * wire.size()));
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let (buf, overflows) = half_buffer(lane, total, 0, ios.len())?;
    let batch = HalfAllreduce {
        ios,
        buf,
        overflows,
        pieces,
        counts,
        wire,
        pre: enc.pre,
        post: enc.post,
    };
    launch_or_replay(t, lane, &batch, act)
}

/// A 16-bit batch's places in the fusion buffer: `total` bytes of values, `extra` bytes after
/// them (returned within the first range), then one u32 overflow counter per tensor (set as
/// the lane's `overflows`). The counters sit at an address as stable as the buffer's, so
/// replayed graphs count into the same place.
pub(super) fn half_buffer(
    lane: &mut Lane,
    total: usize,
    extra: usize,
    tensors: usize,
) -> Result<(DeviceRange, DeviceRange)> {
    let at = (total + extra).next_multiple_of(4);
    let whole = lane.fusion(at + 4 * tensors)?;
    let overflows = whole.sub(at, 4 * tensors)?;
    lane.overflows = Some(overflows);
    Ok((whole.first(total + extra)?, overflows))
}

/// An f32 sum or average travelling as 8-bit blocks, by the host's algorithm
/// (`quantized::allreduce`, bit for bit): every tensor's contribution (prescaled, plus its
/// residual from `lane.feedback`) packed into the fusion buffer, reduced over `DeviceBlocks`,
/// decoded (postscaled) and unpacked. What rounding lost becomes the tensors' residuals. Never
/// replayed from a graph: residuals of a tensor whose size changes move.
pub fn allreduce_u8(
    t: &dyn DeviceTransport,
    lane: &mut Lane,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    act: ActivitySink,
) -> Result<()> {
    let enc = Encoding::of(Codec::U8, resps[0], t.size())?;
    let (n, me) = (t.size(), t.rank());
    let counts: Vec<usize> = ios.iter().map(|io| io.input().len() / 4).collect();
    let total: usize = counts.iter().sum();
    let (gpu, stream) = (lane.gpu, lane.stream);
    let residuals = (resps.iter().zip(&counts))
        .map(|(r, c)| lane.feedback.get(gpu, stream, &r.name, c * 4))
        .collect::<Result<Vec<_>>>()?;
    let layout = quantized::Layout::new(total, n, me);
    let own = layout.chunk(me).len() * 4;
    let parts = [
        total * 4,
        total * 4,
        layout.blocks_bytes(),
        layout.blocks_bytes(),
        own,
        kernels::u8_bounds_bytes(n),
    ];
    let places: Vec<usize> = (parts.iter())
        .scan(0, |at, len| {
            let place = *at;
            *at += len.next_multiple_of(16);
            Some(place)
        })
        .collect();
    let whole = lane.fusion(places[5] + parts[5])?;
    let part = |i: usize| whole.sub(places[i], parts[i]);
    let mut blocks = DeviceBlocks {
        t,
        gpu,
        stream,
        x: part(0)?,
        lost: part(1)?,
        blocks: part(2)?,
        recv: part(3)?,
        sum: part(4)?,
        bounds: part(5)?,
    };
    let (x, lost) = (blocks.x, blocks.lost);
    let pieces = layout::consecutive(counts.iter().map(|c| c * 4));
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    copy_consecutive(gpu, stream, x, &inputs(ios), true)?;
    kernels::scale(gpu, stream, x, x, total, DataType::F32, enc.pre)?;
    let adds = (pieces.iter())
        .map(|p| Ok((residuals[p.tensor], x.sub(p.place, p.len)?, p.len / 4)))
        .collect::<Result<Vec<_>>>()?;
    kernels::add_batch(gpu, stream, &adds)?;
    act(Some("U8_ALLREDUCE"));
    quantized::allreduce(&mut blocks, &layout)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let stride = layout.stride;
    kernels::u8_decode(
        gpu,
        stream,
        blocks.blocks,
        x,
        total,
        n,
        stride,
        enc.post as f32,
    )?;
    copy_consecutive(gpu, stream, x, &outputs(ios), false)?;
    let keep = (pieces.iter())
        .map(|p| Copy::new(lost.sub(p.place, p.len)?, residuals[p.tensor], p.len))
        .collect::<Result<Vec<_>>>()?;
    gpu.copy_batch(stream, &keep)?;
    act(None);
    Ok(())
}

/// GPU memory over NCCL for the u8 allreduce: the encoding and summing run as kernels, the
/// blocks move by NCCL send/recv (alltoall) and allgather, all enqueued on `stream`.
pub(super) struct DeviceBlocks<'a> {
    t: &'a dyn DeviceTransport,
    gpu: &'a Gpu,
    stream: &'a Stream,
    x: DeviceRange,
    lost: DeviceRange,
    blocks: DeviceRange,
    recv: DeviceRange,
    sum: DeviceRange,
    /// Scratch of the encoding kernels: each chunk's extremes.
    bounds: DeviceRange,
}

impl quantized::Blocks for DeviceBlocks<'_> {
    fn encode_batch(&mut self, l: &quantized::Layout) -> Result<()> {
        let (x, lost, blocks, bounds) = (self.x, self.lost, self.blocks, self.bounds);
        kernels::u8_encode(
            self.gpu,
            self.stream,
            x,
            lost,
            blocks,
            bounds,
            l.values,
            l.ranks,
            l.stride,
            false,
        )
    }

    fn exchange(&mut self, l: &quantized::Layout) -> Result<()> {
        let each = vec![l.stride; l.ranks];
        (self.t).alltoallv(self.blocks, &each, self.recv, &each, self.stream)
    }

    fn sum_received(&mut self, l: &quantized::Layout) -> Result<()> {
        let mine = l.chunk(l.rank).len();
        let (recv, sum) = (self.recv, self.sum);
        kernels::u8_sum(self.gpu, self.stream, recv, sum, l.ranks, l.stride, mine)
    }

    fn encode_sum(&mut self, l: &quantized::Layout) -> Result<()> {
        let own = l.chunk(l.rank);
        let own_lost = self.lost.sub(own.start * 4, own.len() * 4)?;
        let own_block = self.blocks.sub(l.rank * l.stride, l.stride)?;
        let (sum, bounds) = (self.sum, self.bounds);
        kernels::u8_encode(
            self.gpu,
            self.stream,
            sum,
            own_lost,
            own_block,
            bounds,
            own.len(),
            1,
            l.stride,
            true,
        )
    }

    fn gather(&mut self, l: &quantized::Layout) -> Result<()> {
        let each = vec![l.stride; l.ranks];
        (self.t).allgatherv_in_place(self.blocks, &each, self.stream)
    }
}

/// The `(source, destination, elements)` of a batched cast between each tensor (its input
/// when packing into `buf`, its output when unpacking) and its place in `buf`: the 16-bit
/// codecs' packing, flat and hierarchical.
pub(super) fn cast_items(
    ios: &[&mut dyn DeviceIo],
    buf: DeviceRange,
    pieces: &[layout::Piece],
    counts: &[usize],
    into_buffer: bool,
) -> Result<Vec<(DeviceRange, DeviceRange, usize)>> {
    (pieces.iter())
        .map(|p| {
            let place = buf.sub(p.place, p.len)?;
            let io = &ios[p.tensor];
            Ok(match into_buffer {
                true => (io.input(), place, counts[p.tensor]),
                false => (place, io.output(), counts[p.tensor]),
            })
        })
        .collect()
}

/// A 16-bit allreduce's launches: cast in, sum, cast out.
pub(super) struct HalfAllreduce<'a, 'b> {
    ios: &'a [&'b mut dyn DeviceIo],
    buf: DeviceRange,
    /// One u32 per tensor: its values that overflowed when packed.
    overflows: DeviceRange,
    pieces: Vec<layout::Piece>,
    /// Elements of each tensor.
    counts: Vec<usize>,
    wire: DataType,
    pre: f64,
    post: f64,
}

impl Launches for HalfAllreduce<'_, '_> {
    fn addresses(&self) -> Vec<u64> {
        buffer_and_tensors(self.buf, self.ios)
    }

    fn launch(
        &self,
        t: &dyn DeviceTransport,
        gpu: &Gpu,
        stream: &Stream,
        act: ActivitySink,
    ) -> Result<()> {
        let (ios, buf, wire) = (self.ios, self.buf, self.wire);
        let (pieces, counts) = (&self.pieces, &self.counts);
        act(Some("MEMCPY_IN_FUSION_BUFFER"));
        let into = cast_items(ios, buf, pieces, counts, true)?;
        gpu.memset_zero(stream, self.overflows)?;
        let overflows = Some(self.overflows);
        kernels::cast_batch(gpu, stream, &into, wire, true, self.pre, overflows)?;
        act(Some("NCCL_ALLREDUCE"));
        let n = buf.len() / wire.size();
        t.allreduce_many(&[(buf, buf, n)], wire, ReduceOp::Sum, stream)?;
        act(Some("MEMCPY_OUT_FUSION_BUFFER"));
        let out = cast_items(ios, buf, pieces, counts, false)?;
        kernels::cast_batch(gpu, stream, &out, wire, false, self.post, None)?;
        act(None);
        Ok(())
    }
}
