//! Collective algorithms over a `Transport`: fused allreduce, allgather and reducescatter
//! through a fusion buffer, broadcast and alltoall per tensor. They know nothing of names,
//! negotiation or configuration: a batch of agreed responses and the tensors' memory come in.

pub mod cost;
pub mod device;
pub mod execute;
pub mod gossip;
pub mod hierarchical;
pub mod kernels;
pub mod layout;
pub mod lowrank;
pub mod native;
pub mod p2p;
pub mod parallel;
pub mod plan;
pub mod quantized;
pub mod replay;
pub mod ring;
pub mod sparse;

pub use native::{BatchMemory, HostBatch, reducescatter_rows};

pub(crate) use crate::compress::backend_op;
use crate::compress::{Codec, Feedback, Reduction, Wire};
use crate::dtype::DataType;
use crate::elementwise;
use crate::error::{Error, Result};
use crate::fusion::FusionBuffer;
use crate::message::{ReduceOp, Response};
use crate::transport::Transport;
use hierarchical::Levels;
use ring::Stage;
use std::ops::{Deref, Range};

/// The memory of one tensor taking part in a collective.
/// `Send`: a codec may hand some of a batch's tensors to a helper thread (top-k's selection).
pub trait TensorIo: Send {
    fn input(&self) -> &[u8];
    /// The input (when it is separate from the output) and the output. For ops whose output
    /// size is known only after negotiation, call `allocate_output` first.
    fn split_io(&mut self) -> (Option<&[u8]>, &mut [u8]);
    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()>;
    /// Alltoall: rows to send to each rank (None: split evenly).
    fn send_splits(&self) -> Option<&[i32]>;
    fn set_received_splits(&mut self, splits: Vec<i32>);
}

/// Receives the name of each phase as it starts (`None` when the last one ends): the timeline.
pub type ActivitySink<'a> = &'a mut dyn FnMut(Option<&'static str>);

/// A codec's reduction rule (`compress::Reduction`: the wire dtype, the reduction there, the
/// factors on the way in and out) with the host packing around it.
struct Encoding(Reduction);

impl Deref for Encoding {
    type Target = Reduction;

    fn deref(&self) -> &Reduction {
        &self.0
    }
}

impl Encoding {
    /// `head`'s allreduce over `size` ranks, travelling as `codec` says.
    fn of(codec: Codec, head: &Response, size: usize) -> Result<Encoding> {
        Reduction::of(codec, head, size).map(Encoding)
    }

    /// The bytes on the wire of `bytes` bytes of values.
    fn wire_len(&self, bytes: usize) -> usize {
        bytes / self.dtype.size() * self.wire.size()
    }

    /// Packs every tensor's input, in order, into consecutive places of `dst`, scaled by `pre`
    /// and cast on the way (one pass over the batch). Values that leave a 16-bit range are
    /// named in a warning (they arrive as infinities).
    fn pack(&self, ios: &[&mut dyn TensorIo], dst: &mut [u8], resps: &[&Response]) -> Result<()> {
        let mut lost = vec![0usize; ios.len()];
        self.pack_piece(ios, 0, dst, &mut lost)?;
        self.warn_lost(resps, &lost);
        Ok(())
    }

    /// Names the tensors (of `resps`) whose values left the 16-bit wire type's range, `lost`
    /// counting them per tensor.
    fn warn_lost(&self, resps: &[&Response], lost: &[usize]) {
        if let Codec::Half(w) = self.codec {
            for (r, lost) in resps.iter().zip(lost) {
                warn_out_of_range(&r.name, *lost, w);
            }
        }
    }

    /// `pack` of the batch's wire bytes `at..at + dst.len()` only (whole elements): one piece
    /// of a pipelined allreduce (the ring's segments, the hierarchical pieces). Adds to `lost[tensor]` the values that left a 16-bit range.
    fn pack_piece(
        &self,
        ios: &[&mut dyn TensorIo],
        at: usize,
        dst: &mut [u8],
        lost: &mut [usize],
    ) -> Result<()> {
        let lens = ios.iter().map(|io| io.input().len());
        for (t, wire, input) in self.window(lens, at, dst.len()) {
            let (d, s) = (
                &mut dst[wire.start - at..wire.end - at],
                &ios[t].input()[input],
            );
            match self.codec {
                Codec::None => elementwise::copy_scaled(d, s, self.dtype, self.pre)?,
                Codec::Half(w) => lost[t] += elementwise::encode_half(d, s, w, self.pre)?,
                Codec::U8 | Codec::PowerSgd(_) | Codec::TopK(_) => {
                    return Err(Error::Internal(format!(
                        "{:?} batches are not packed as bytes",
                        self.codec
                    )));
                }
            }
        }
        Ok(())
    }

    /// `unpack` of the batch's wire bytes `at..at + src.len()` only.
    fn unpack_piece(&self, src: &[u8], at: usize, ios: &mut [&mut dyn TensorIo]) -> Result<()> {
        let lens: Vec<usize> = ios.iter_mut().map(|io| io.split_io().1.len()).collect();
        for (t, wire, output) in self.window(lens.into_iter(), at, src.len()) {
            let (_, out) = ios[t].split_io();
            let (d, s) = (&mut out[output], &src[wire.start - at..wire.end - at]);
            match self.codec {
                Codec::None => elementwise::copy_scaled(d, s, self.dtype, self.post)?,
                Codec::Half(w) => elementwise::decode_half(d, s, w, self.post)?,
                Codec::U8 | Codec::PowerSgd(_) | Codec::TopK(_) => {
                    return Err(Error::Internal(format!(
                        "{:?} batches are not unpacked as bytes",
                        self.codec
                    )));
                }
            }
        }
        Ok(())
    }

    /// The tensors (of `lens` bytes each, consecutive on the wire) that the batch's wire bytes
    /// `at..at + len` hold: each tensor's index, its wire bytes there, and the same values'
    /// bytes in the tensor.
    fn window(
        &self,
        lens: impl Iterator<Item = usize>,
        at: usize,
        len: usize,
    ) -> Vec<(usize, Range<usize>, Range<usize>)> {
        let (wire, own) = (self.wire.size(), self.dtype.size());
        layout::consecutive(lens.map(|n| self.wire_len(n)))
            .iter()
            .filter_map(|p| {
                let (lo, hi) = (p.place.max(at), (p.place + p.len).min(at + len));
                let values = (lo - p.place) / wire * own..(hi - p.place) / wire * own;
                (lo < hi).then_some((p.tensor, lo..hi, values))
            })
            .collect()
    }

    /// Fills every tensor's output from consecutive places of `src`, cast back and scaled by
    /// `post` on the way.
    fn unpack(&self, src: &[u8], ios: &mut [&mut dyn TensorIo]) -> Result<()> {
        self.unpack_piece(src, 0, ios)
    }
}

/// Names a tensor whose values left the 16-bit type `wire`'s range while packed.
pub(crate) fn warn_out_of_range(name: &str, lost: usize, wire: DataType) {
    if lost > 0 {
        tracing::warn!(
            "tensor '{name}': {lost} values out of {}'s range became infinite on the wire",
            wire.name()
        );
    }
}

pub(crate) fn byte_len(elems: i64, dtype: DataType) -> usize {
    elems.max(0) as usize * dtype.size()
}

/// Which algorithms a batch's collectives use (chosen per batch from agreed data).
pub struct Algorithms<'a> {
    pub allreduce: Allreduce<'a>,
    /// Allgather hierarchically over these levels.
    pub allgather: Option<Levels<'a>>,
    /// A gossip batch's rounds.
    pub gossip: Option<gossip::Schedule<'a>>,
}

/// How a batch's values are allreduced (chosen per batch from agreed data).
pub enum Allreduce<'a> {
    /// The transport's own allreduce.
    Native,
    /// The ring over point-to-point transfers (`ring.rs`): every link sends and receives at
    /// once, which MPI's own choice for mid sizes does not do on TCP.
    Ring,
    /// Inside each node, across nodes, inside each node again (`hierarchical.rs`).
    Hierarchical(Levels<'a>),
}

/// Allreduce of one or more tensors with the same dtype, op, scales and codec, over `t` as `how`
/// says. A single uncompressed tensor is reduced directly in its output, without a copy through
/// the fusion buffer.
pub fn allreduce_batch(
    t: &dyn Transport,
    how: &Allreduce,
    wire: Wire,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let codec = wire.codec;
    let enc = Encoding::of(codec, head, t.size())?;
    if codec == Codec::U8 {
        return allreduce_u8(t, &enc, wire.feedback, resps, ios, fusion, act);
    }
    if let Codec::PowerSgd(rank) = codec {
        return lowrank::allreduce(t, &enc, rank, &wire, resps, ios, act);
    }
    if let Codec::TopK(params) = codec {
        let (warmup, store) = (wire.topk_warmup, wire.topk);
        return sparse::allreduce(t, &enc, params, warmup, store, resps, ios, act);
    }
    let phase = phase(how);
    if ios.len() == 1 && codec == Codec::None {
        let (input, output) = ios[0].split_io();
        act(Some(phase));
        match (how, head.prescale != 1.0) {
            (Allreduce::Native, false) => t.allreduce(input, output, head.dtype, enc.op)?,
            (how, _) => {
                if let Some(inp) = input {
                    output.copy_from_slice(inp);
                }
                elementwise::scale(output, head.dtype, head.prescale)?;
                reduce_in_place(t, how, output, head.dtype, enc.op)?;
            }
        }
        elementwise::scale(output, head.dtype, enc.post)?;
        act(None);
        return Ok(());
    }
    let total: usize = ios.iter().map(|io| enc.wire_len(io.input().len())).sum();
    let buf = fusion.get(total);
    // scaling and casting ride the copies in and out: one pass over the batch each way
    if let Allreduce::Native = how {
        act(Some("MEMCPY_IN_FUSION_BUFFER"));
        enc.pack(ios, buf, resps)?;
        act(Some(phase));
        reduce_in_place(t, how, buf, enc.wire, enc.op)?;
        act(Some("MEMCPY_OUT_FUSION_BUFFER"));
        enc.unpack(buf, ios)?;
        act(None);
        return Ok(());
    }
    // the ring and the hierarchical allreduce go in segments or pieces: the copies in and out
    // of the fusion buffer overlap the transfers
    act(Some(phase));
    let mut lost = vec![0usize; ios.len()];
    let mut stage = |s: Stage| match s {
        Stage::Pack { at, piece } => enc.pack_piece(ios, at, piece, &mut lost),
        Stage::Unpack { at, piece } => enc.unpack_piece(piece, at, ios),
    };
    match how {
        Allreduce::Hierarchical(levels) => {
            hierarchical::allreduce_staged(levels, buf, enc.wire, enc.op, &mut stage)?
        }
        _ => ring::allreduce_staged(t, buf, enc.wire, enc.op, &mut stage)?,
    }
    enc.warn_lost(resps, &lost);
    act(None);
    Ok(())
}

/// An f32 sum or average travelling as 8-bit blocks (`quantized`): each tensor's contribution
/// is its prescaled input plus what rounding lost of it last time (`feedback`), and what it
/// loses now is kept for next time.
fn allreduce_u8(
    t: &dyn Transport,
    enc: &Encoding,
    feedback: &Feedback,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    let lens: Vec<usize> = (ios.iter())
        .map(|io| io.input().len() / enc.dtype.size())
        .collect();
    let total: usize = lens.iter().sum();
    let (scratch_values, scratch_bytes) = quantized::scratch(total, t.size());
    let (values, bytes) = fusion.values_and_bytes(2 * total + scratch_values, scratch_bytes);
    let (x, rest) = values.split_at_mut(total);
    let (lost, scratch) = rest.split_at_mut(total);
    let pieces = layout::consecutive(lens);
    let mut residuals = Vec::with_capacity(pieces.len());
    let pre = enc.pre as f32;
    for p in &pieces {
        let residual = feedback.take(&resps[p.tensor].name, p.len);
        let input = ios[p.tensor].input().chunks_exact(4);
        let dst = &mut x[p.place..p.place + p.len];
        for ((d, b), r) in dst.iter_mut().zip(input).zip(&residual) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * pre + r;
        }
        residuals.push(residual);
    }
    act(Some("U8_ALLREDUCE"));
    let layout = quantized::Layout::new(total, t.size(), t.rank());
    let mut blocks = quantized::HostBlocks::new(t, x, lost, scratch, bytes)?;
    quantized::allreduce(&mut blocks, &layout)?;
    let reduced = blocks.reduced(&layout);
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    for (p, mut residual) in pieces.iter().zip(residuals) {
        residual.copy_from_slice(&lost[p.place..p.place + p.len]);
        feedback.put(&resps[p.tensor].name, residual);
        let (_, out) = ios[p.tensor].split_io();
        reduced.write(p.place..p.place + p.len, enc.post as f32, out);
    }
    act(None);
    Ok(())
}

/// The timeline's name for an allreduce run as `how` says.
fn phase(how: &Allreduce) -> &'static str {
    match how {
        Allreduce::Native => "MPI_ALLREDUCE",
        Allreduce::Ring => "RING_ALLREDUCE",
        Allreduce::Hierarchical(_) => "MPI_HIERARCHICAL_ALLREDUCE",
    }
}

/// Allreduces `buf` in place as `how` says.
fn reduce_in_place(
    t: &dyn Transport,
    how: &Allreduce,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    match how {
        Allreduce::Native => t.allreduce(None, buf, dtype, op),
        // nothing to pack: the segments only hide the reduction behind the transfers
        Allreduce::Ring => ring::allreduce_staged(t, buf, dtype, op, &mut |_| Ok(())),
        Allreduce::Hierarchical(l) => hierarchical::allreduce(l, buf, dtype, op),
    }
}

/// How long a collective may wait for the other ranks, and who hears about long waits.
pub struct Wait<'a> {
    pub limit: Option<std::time::Duration>,
    pub slow: &'a mut dyn FnMut(std::time::Duration),
}

/// How a flagged batch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flagged {
    /// Completed; `raised`: some rank raised the flag (then the outputs are left untouched).
    Done { raised: bool },
    /// The other ranks did not join within the wait limit.
    TimedOut,
}

/// How an offline-plan batch's escape flag travels (`plan::flag_alone` chooses).
pub enum Flag<'r> {
    /// Appended to the batch in the fusion buffer and reduced with it by the transport's own
    /// allreduce: every rank learns in the same call whether any rank raised it.
    WithData,
    /// Allreduced alone first (an i32, which cannot wrap); if no rank raised it, `run` moves the
    /// batch as its plan says (the ring, hierarchical, u8 blocks: routes that cannot carry a
    /// flag among their values, or whose wait is the watchdog's rather than `Wait`'s).
    Alone(&'r mut BatchRun<'r>),
}

/// Runs a batch as its plan says, through the fusion buffer it is given.
pub type BatchRun<'r> =
    dyn FnMut(&mut FusionBuffer, &mut [&mut dyn TensorIo], ActivitySink) -> Result<()> + 'r;

/// Allreduce of one offline-plan batch with an escape flag: every rank learns whether any rank
/// raised it, and the batch's values count only if none did. `ios` None: this rank lacks the
/// batch's tensors and contributes zeros (and must raise the flag).
#[allow(clippy::too_many_arguments)] // the batch, how it travels, its flag, where and how long
pub fn allreduce_flagged(
    t: &dyn Transport,
    resps: &[Response],
    wire: Wire,
    ios: Option<&mut [&mut dyn TensorIo]>,
    fusion: &mut FusionBuffer,
    raise: bool,
    flag: Flag,
    wait: Wait,
    act: ActivitySink,
) -> Result<Flagged> {
    let refs: Vec<&Response> = resps.iter().collect();
    let enc = Encoding::of(wire.codec, &resps[0], t.size())?;
    let mut run = match flag {
        Flag::WithData => None,
        Flag::Alone(run) => Some(run),
    };
    let alone = run.is_some();
    let (data, flag_dtype) = match alone {
        true => (0, DataType::I32),
        false => {
            let data = (resps.iter())
                .map(|r| enc.wire_len(byte_len(r.num_elements(), enc.dtype)))
                .sum();
            (data, enc.wire)
        }
    };
    let total = data + flag_dtype.size();
    let buf = fusion.get(total);
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    // a rank without the tensors contributes zeros (scaled or cast, still zeros)
    let ios = match ios {
        Some(ios) if alone => Some(ios),
        Some(ios) => {
            enc.pack(ios, &mut buf[..data], &refs)?;
            Some(ios)
        }
        None => {
            buf[..data].fill(0);
            None
        }
    };
    // Sum and Max see 1 where a rank raised the flag; Min and Product see 0
    let one_means_raised = matches!(enc.op, ReduceOp::Sum | ReduceOp::Max);
    let flag = &mut buf[data..];
    if raise == one_means_raised {
        flag.copy_from_slice(&one(flag_dtype));
    } else {
        flag.fill(0);
    }
    act(Some("MPI_ALLREDUCE"));
    let owned = fusion.take(total);
    let Some(reduced) =
        t.allreduce_owned_within(owned, flag_dtype, enc.op, wait.limit, wait.slow)?
    else {
        act(None);
        return Ok(Flagged::TimedOut);
    };
    fusion.restore(reduced);
    let buf = fusion.get(total);
    let zero = buf[data..].iter().all(|b| *b == 0);
    if zero == one_means_raised {
        match (ios, run.as_mut()) {
            (Some(ios), Some(run)) => run(fusion, ios, act)?,
            (Some(ios), None) => {
                act(Some("MEMCPY_OUT_FUSION_BUFFER"));
                enc.unpack(&buf[..data], ios)?;
            }
            (None, _) => {}
        }
        act(None);
        return Ok(Flagged::Done { raised: false });
    }
    act(None);
    Ok(Flagged::Done { raised: true })
}

/// The value 1 of `dtype`, little-endian.
fn one(dtype: DataType) -> Vec<u8> {
    match dtype {
        DataType::U8 | DataType::I8 | DataType::Bool => vec![1],
        DataType::U16 | DataType::I16 => 1u16.to_le_bytes().to_vec(),
        DataType::I32 => 1i32.to_le_bytes().to_vec(),
        DataType::I64 => 1i64.to_le_bytes().to_vec(),
        DataType::F16 => half::f16::ONE.to_le_bytes().to_vec(),
        DataType::BF16 => half::bf16::ONE.to_le_bytes().to_vec(),
        DataType::F32 => 1f32.to_le_bytes().to_vec(),
        DataType::F64 => 1f64.to_le_bytes().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::native::even_split;
    use super::*;

    struct Io {
        input: Vec<u8>,
        output: Vec<u8>,
    }

    impl TensorIo for Io {
        fn input(&self) -> &[u8] {
            &self.input
        }
        fn split_io(&mut self) -> (Option<&[u8]>, &mut [u8]) {
            (Some(&self.input), &mut self.output)
        }
        fn allocate_output(&mut self, _: &[i64], _: usize) -> Result<()> {
            Ok(())
        }
        fn send_splits(&self) -> Option<&[i32]> {
            None
        }
        fn set_received_splits(&mut self, _: Vec<i32>) {}
    }

    /// Packing and unpacking a batch piece by piece (the ring's segments, the hierarchical pieces)
    /// writes the same bytes as the whole batch at once, for plain and 16-bit codecs, with
    /// pieces that cut tensors anywhere, and counts the same values out of range.
    #[test]
    fn pieces_pack_and_unpack_as_the_whole_batch() {
        let sizes = [3usize, 1000, 1, 77, 40];
        let value = |t: usize, i: usize| ((t * 31 + i * 7) % 23) as f32 * 0.37 - 4.0;
        let ios = || -> Vec<Io> {
            (sizes.iter().enumerate())
                .map(|(t, n)| {
                    let mut x: Vec<f32> = (0..*n).map(|i| value(t, i)).collect();
                    if t == 1 {
                        x[500] = 1e6; // beyond f16's range once scaled
                    }
                    Io {
                        input: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        output: vec![0; n * 4],
                    }
                })
                .collect()
        };
        for codec in [
            Codec::None,
            Codec::Half(DataType::F16),
            Codec::Half(DataType::BF16),
        ] {
            let enc = Encoding(Reduction {
                codec,
                dtype: DataType::F32,
                wire: codec.wire(DataType::F32),
                op: ReduceOp::Sum,
                pre: 0.5,
                post: 2.0,
            });
            let total: usize = sizes.iter().map(|n| n * enc.wire.size()).sum();
            let (mut whole_ios, mut piece_ios) = (ios(), ios());
            let mut whole = vec![0u8; total];
            let refs: Vec<&mut dyn TensorIo> = whole_ios
                .iter_mut()
                .map(|io| io as &mut dyn TensorIo)
                .collect();
            let resp = Response::from_request(&crate::message::Request::test(
                "t",
                crate::message::OpKind::Allreduce,
                DataType::F32,
                &[1],
            ));
            enc.pack(&refs, &mut whole, &vec![&resp; sizes.len()])
                .unwrap();
            // pieces of 37 wire values, the last one shorter
            let step = 37 * enc.wire.size();
            let mut pieces = vec![0u8; total];
            let mut lost = vec![0usize; sizes.len()];
            let mut piece_refs: Vec<&mut dyn TensorIo> = piece_ios
                .iter_mut()
                .map(|io| io as &mut dyn TensorIo)
                .collect();
            for at in (0..total).step_by(step) {
                let end = (at + step).min(total);
                enc.pack_piece(&piece_refs, at, &mut pieces[at..end], &mut lost)
                    .unwrap();
            }
            assert_eq!(pieces, whole, "{codec:?}: packed bytes");
            let want_lost = usize::from(codec == Codec::Half(DataType::F16));
            assert_eq!(lost, vec![0, want_lost, 0, 0, 0], "{codec:?}: out of range");
            let mut refs: Vec<&mut dyn TensorIo> = whole_ios
                .iter_mut()
                .map(|io| io as &mut dyn TensorIo)
                .collect();
            enc.unpack(&whole, &mut refs).unwrap();
            for at in (0..total).step_by(step).rev() {
                let end = (at + step).min(total);
                enc.unpack_piece(&pieces[at..end], at, &mut piece_refs)
                    .unwrap();
            }
            for (a, b) in whole_ios.iter().zip(&piece_ios) {
                assert_eq!(a.output, b.output, "{codec:?}: unpacked bytes");
                assert!(a.output.iter().any(|b| *b != 0));
            }
        }
    }

    #[test]
    fn even_alltoall_splits_are_never_cut_short() {
        assert_eq!(even_split(10, 2).unwrap(), 5);
        assert_eq!(even_split(i32::MAX as usize * 2, 2).unwrap(), i32::MAX);
        // 2^32 rows over 2 ranks: 2^31 each, one more than a split holds (was truncated)
        assert!(even_split(1 << 32, 2).is_err());
    }

    #[test]
    fn reducescatter_remainder_goes_to_lowest_ranks() {
        let rows: Vec<i64> = (0..4).map(|r| reducescatter_rows(10, 4, r)).collect();
        assert_eq!(rows, vec![3, 3, 2, 2]);
        let rows: Vec<i64> = (0..3).map(|r| reducescatter_rows(2, 3, r)).collect();
        assert_eq!(rows, vec![1, 1, 0]);
    }

    #[test]
    fn average_becomes_sum_with_postscale() {
        assert_eq!(
            backend_op(ReduceOp::Average, 4, 2.0).unwrap(),
            (ReduceOp::Sum, 0.5)
        );
        assert_eq!(
            backend_op(ReduceOp::Max, 4, 2.0).unwrap(),
            (ReduceOp::Max, 2.0)
        );
        assert!(backend_op(ReduceOp::Adasum, 4, 1.0).is_err());
    }
}
