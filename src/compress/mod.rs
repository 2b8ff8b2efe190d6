//! Compression: how a batch's values travel on the wire. The stage between negotiation and the
//! collective: a codec is chosen per tensor from agreed data only (its response and the job's
//! agreed settings), fusion puts only tensors of one codec in a batch, and every rank encodes and
//! decodes the same batches alike.

pub mod multistep;
pub mod powersgd;
pub mod quantize;
pub mod topk;

use crate::dtype::DataType;
use crate::error::{Error, Result};
pub use crate::message::Compression;
use crate::message::{OpKind, ReduceOp, Response};
use crate::store::{self, Recent};
use crate::transport::cuda::{DeviceMem, Gpu, Stream};
use crate::transport::memory::DeviceRange;

/// Tensors below this many bytes stay f32 under `mixed` unless `FERROVOD_COMPRESSION_MIN_BYTES`
/// says otherwise: above every bias and norm parameter of common models (ResNet-50's largest is
/// 8 KiB), below their weights.
pub const MIXED_MIN_BYTES: usize = 32 << 10;

/// Which codec each tensor gets: the job's agreed compression settings, which with a tensor's
/// response are all the choice reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Codecs {
    /// For operations that do not ask for a compression of their own.
    pub setting: Compression,
    /// `mixed`: tensors of at least this many bytes travel compressed.
    pub min_bytes: usize,
    /// `powersgd`: the factors' columns (`FERROVOD_POWERSGD_RANK`).
    pub powersgd_rank: usize,
    /// `topk`: its ratio and momentum (`FERROVOD_TOPK_RATIO`, `FERROVOD_TOPK_MOMENTUM`).
    pub topk: TopK,
}

/// Top-k's agreed settings, as whole numbers so that a codec can carry them: the share of a
/// tensor's values sent, in millionths, and the momentum correction's factor, in thousandths
/// (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TopK {
    pub ratio_ppm: u32,
    pub momentum_permille: u32,
}

impl Default for TopK {
    fn default() -> TopK {
        TopK {
            ratio_ppm: 10_000,
            momentum_permille: 0,
        }
    }
}

impl TopK {
    /// From the settings' values (a ratio in (0, 1], a momentum in [0, 1)).
    pub fn of(ratio: f64, momentum: f64) -> TopK {
        TopK {
            ratio_ppm: ((ratio * 1e6).round() as u32).clamp(1, 1_000_000),
            momentum_permille: ((momentum * 1e3).round() as u32).min(999),
        }
    }

    pub fn ratio(self) -> f64 {
        self.ratio_ppm as f64 / 1e6
    }

    pub fn momentum(self) -> f32 {
        self.momentum_permille as f32 / 1e3
    }

    /// Pairs sent of a tensor of `len` values; None where they would not be smaller than the
    /// tensor (a pair is two values).
    pub fn k(self, len: usize) -> Option<usize> {
        let k = topk::k_of(len, self.ratio()).ok()?;
        (2 * k < len).then_some(k)
    }

    /// `k` at a tensor's `step`-th allreduce (from 0) under a warm-up of `warmup` steps, as
    /// DGC's: the share sent starts at 25 % and is quartered at each quarter of the warm-up
    /// (25, 6.25, 1.5625, 0.39 %), never below the ratio. In whole numbers, so that every rank
    /// gets the same k.
    pub fn k_at(self, len: usize, step: u64, warmup: u64) -> Option<usize> {
        if step >= warmup {
            return self.k(len);
        }
        let stage = (step * 4 / warmup) as u32;
        let ratio_ppm = (250_000u32 >> (2 * stage)).max(self.ratio_ppm);
        TopK { ratio_ppm, ..self }.k(len).or(self.k(len))
    }
}

pub use crate::message::POWERSGD_RANK;

impl Default for Codecs {
    fn default() -> Codecs {
        Codecs {
            setting: Compression::None,
            min_bytes: MIXED_MIN_BYTES,
            powersgd_rank: POWERSGD_RANK,
            topk: TopK::default(),
        }
    }
}

impl Codecs {
    /// What `cfg` asks for, as one rank reads it (a job runs with rank 0's, agreed).
    pub fn from_config(cfg: &crate::config::Config) -> Codecs {
        Codecs {
            setting: cfg.compression,
            min_bytes: cfg.compression_min_bytes.unwrap_or(MIXED_MIN_BYTES),
            powersgd_rank: cfg.powersgd_rank,
            topk: TopK::of(cfg.topk_ratio, cfg.topk_momentum),
        }
    }

    /// The codec of one tensor: a pure function of its agreed response and the agreed settings
    /// (identical on every rank). Only f32 sums, averages and gossip compress: a 16-bit min,
    /// max or product would change results beyond rounding, and other dtypes gain nothing or
    /// lose range. PowerSGD takes allreduces of matrices whose factors are smaller than they
    /// are, top-k allreduces whose pairs are fewer bytes than their values; other tensors and
    /// gossip travel as they are.
    pub fn of(&self, r: &Response) -> Codec {
        let reduces = match r.kind {
            OpKind::Allreduce => matches!(r.reduce_op, ReduceOp::Sum | ReduceOp::Average),
            OpKind::Gossip => true,
            _ => false,
        };
        let compressible = reduces && r.dtype == DataType::F32;
        if !compressible {
            return Codec::None;
        }
        let allreduce = r.kind == OpKind::Allreduce;
        match r.compression.unwrap_or(self.setting) {
            Compression::None => Codec::None,
            Compression::Fp16 => Codec::Half(DataType::F16),
            Compression::Bf16 => Codec::Half(DataType::BF16),
            Compression::Mixed if r.fused_bytes() >= self.min_bytes => Codec::Half(DataType::F16),
            Compression::Mixed => Codec::None,
            Compression::U8 => Codec::U8,
            Compression::PowerSgd(own) => {
                let rank = if own > 0 {
                    own as usize
                } else {
                    self.powersgd_rank
                };
                match powersgd::Shape::of(&r.shape, rank) {
                    Some(s) if allreduce => Codec::PowerSgd(s.rank),
                    _ => Codec::None,
                }
            }
            Compression::TopK(own) => {
                let len = r.num_elements().max(0) as usize;
                let params = TopK {
                    ratio_ppm: if own > 0 { own } else { self.topk.ratio_ppm },
                    ..self.topk
                };
                match params.k(len) {
                    Some(_) if allreduce => Codec::TopK(params),
                    _ => Codec::None,
                }
            }
        }
    }
}

/// How a batch's values travel and are reduced under a codec: the dtype on the wire, the
/// reduction there, and the factors applied on the way in (`pre`) and out (`post`). The rule
/// each memory's packing and algorithm follow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reduction {
    pub codec: Codec,
    /// The tensors' dtype.
    pub dtype: DataType,
    pub wire: DataType,
    pub op: ReduceOp,
    pub pre: f64,
    pub post: f64,
}

impl Reduction {
    /// `head`'s allreduce over `size` ranks, travelling as `codec` says. Under a 16-bit codec an
    /// average divides by the ranks before the cast, so the sum overflows only where one rank's
    /// value already would; u8 sums in f32 at each chunk's owner, so it divides after.
    pub fn of(codec: Codec, head: &Response, size: usize) -> Result<Reduction> {
        let (op, pre, post) = match (codec, head.reduce_op) {
            (Codec::None, op) => {
                let (op, post) = backend_op(op, size, head.postscale)?;
                (op, head.prescale, post)
            }
            (Codec::Half(_), ReduceOp::Average) => {
                (ReduceOp::Sum, head.prescale / size as f64, head.postscale)
            }
            (Codec::Half(_), ReduceOp::Sum) => (ReduceOp::Sum, head.prescale, head.postscale),
            (Codec::U8, ReduceOp::Average) => {
                (ReduceOp::Sum, head.prescale, head.postscale / size as f64)
            }
            (Codec::U8, ReduceOp::Sum) => (ReduceOp::Sum, head.prescale, head.postscale),
            // the factors are summed; the approximation is of the ranks' average
            (Codec::PowerSgd(_), ReduceOp::Average) => {
                (ReduceOp::Sum, head.prescale, head.postscale)
            }
            (Codec::PowerSgd(_), ReduceOp::Sum) => {
                (ReduceOp::Sum, head.prescale, head.postscale * size as f64)
            }
            // the pairs are summed where they land
            (Codec::TopK(_), ReduceOp::Average) => {
                (ReduceOp::Sum, head.prescale, head.postscale / size as f64)
            }
            (Codec::TopK(_), ReduceOp::Sum) => (ReduceOp::Sum, head.prescale, head.postscale),
            (codec, other) => {
                return Err(Error::Internal(format!(
                    "a {other:?} allreduce cannot travel as {codec:?}"
                )));
            }
        };
        Ok(Reduction {
            codec,
            dtype: head.dtype,
            wire: codec.wire(head.dtype),
            op,
            pre,
            post,
        })
    }
}

/// The reduction an engine performs for `op` uncompressed, and the factor applied after it
/// (an average is a sum, then a division by the ranks).
pub fn backend_op(op: ReduceOp, size: usize, postscale: f64) -> Result<(ReduceOp, f64)> {
    match op {
        ReduceOp::Average => Ok((ReduceOp::Sum, postscale / size as f64)),
        ReduceOp::Adasum => Err(Error::InvalidArgument(
            "Adasum reduction is not supported by ferrovod".into(),
        )),
        other => Ok((other, postscale)),
    }
}

/// `PERSEUS_ALLREDUCE_NANCHECK=1`: an allreduce whose result holds NaN or infinite values
/// fails, naming each such tensor. The result is the same on every rank, so every rank fails the
/// same tensors (a NaN an input brings in stays in a sum; one a minimum or maximum drops is not
/// seen). `outputs`: each tensor's name and reduced bytes.
pub fn check_finite<'a>(
    dtype: DataType,
    outputs: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Result<()> {
    non_finite_error(
        outputs.map(|(name, bytes)| (name, crate::elementwise::non_finite(bytes, dtype))),
    )
}

/// The NaN check's error for tensors with these counts of non-finite values (Ok if none has
/// any): for host batches counted by `check_finite`, for GPU batches by a kernel.
pub fn non_finite_error<'a>(counts: impl Iterator<Item = (&'a str, usize)>) -> Result<()> {
    let bad: Vec<String> = counts
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("'{name}' ({n} values)"))
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "NaN or Inf in the allreduced values of tensor {} (PERSEUS_ALLREDUCE_NANCHECK)",
        bad.join(", ")
    )))
}

/// How a batch's values travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Codec {
    /// As the caller's dtype.
    #[default]
    None,
    /// f32 values cast to this 16-bit float type (F16 or BF16) while packed, summed as it
    /// (MPI's reduction of 16-bit floats adds pairs in f32 and rounds each partial sum), cast
    /// back while unpacked. Averages are divided by the ranks before the cast, so sums cannot
    /// overflow what each rank's values would not.
    Half(DataType),
    /// f32 values quantized to 8 bits per block (`quantize`), carried by a reduce-scatter and
    /// an allgather of the blocks (8-bit values cannot simply be summed) and summed in f32;
    /// what each rank's rounding lost is added to the tensor's next contribution (`Feedback`).
    U8,
    /// f32 matrices as PowerSGD's two factors of this many columns, each summed by an f32
    /// allreduce; what the approximation misses is added to the tensor's next contribution
    /// (`PowerMemory`).
    PowerSgd(usize),
    /// f32 tensors as each rank's k values of largest magnitude, (index, value) pairs gathered
    /// by every rank and summed in rank order; what was not sent is added to the tensor's next
    /// contribution (`topk::TopkMemory`).
    TopK(TopK),
}

impl Codec {
    /// As the timeline's schedule records it: `FERROVOD_COMPRESSION`'s word, with PowerSGD's
    /// rank and top-k's share in parts per million.
    pub fn label(self) -> String {
        match self {
            Codec::None => "none".into(),
            Codec::Half(DataType::BF16) => "bf16".into(),
            Codec::Half(_) => "fp16".into(),
            Codec::U8 => "u8".into(),
            Codec::PowerSgd(rank) => format!("powersgd:{rank}"),
            Codec::TopK(t) => format!("topk:{}", t.ratio_ppm),
        }
    }

    /// The dtype on the wire for values of `dtype`.
    pub fn wire(self, dtype: DataType) -> DataType {
        match self {
            Codec::None => dtype,
            Codec::Half(w) => w,
            Codec::U8 => DataType::U8,
            Codec::PowerSgd(_) | Codec::TopK(_) => dtype,
        }
    }

    /// The bytes `r`'s values take on the wire under this codec: PowerSGD's are its two
    /// factors, each summed once (u8's are its values, without the blocks' headers).
    pub fn wire_bytes(self, r: &Response) -> usize {
        let bytes = r.num_elements().max(0) as usize * r.dtype.size();
        match self {
            Codec::PowerSgd(rank) => powersgd::Shape::of(&r.shape, rank)
                .map_or(bytes, |s| (s.p_len() + s.q_len()) * r.dtype.size()),
            Codec::TopK(t) => t
                .k(bytes / r.dtype.size())
                .map_or(bytes, |k| k * topk::PAIR_BYTES),
            _ => bytes / r.dtype.size() * self.wire(r.dtype).size(),
        }
    }
}

/// What the `u8` codec's rounding lost, per tensor name: added to the tensor's next
/// contribution, so the error does not accumulate over steps (error feedback). Bounded as
/// `store` says: unnamed tensors keep no residual, and names unused for the store's window are
/// dropped.
pub type Feedback = store::Named<Vec<f32>>;

impl Feedback {
    /// The residual of `name` (zeros if none, or if the tensor's size changed), taken out.
    pub fn take(&self, name: &str, len: usize) -> Vec<f32> {
        self.take_or(name, |r| r.len() == len, || vec![0.0; len])
    }
}

/// The `u8` codec's residuals of GPU tensors, per tensor name, in device memory (`Feedback`'s
/// counterpart, bounded alike): read and written in stream order by the batches of one
/// process set.
#[derive(Default)]
pub struct DeviceFeedback(Recent<String, (Option<DeviceMem>, usize)>);

impl DeviceFeedback {
    /// The residual of `name`, `bytes` long: zeros (set on `stream`) the first time, or if the
    /// tensor's size changed. An unnamed tensor's lives until the next sweep. Residuals
    /// evicted meanwhile are freed on `stream`, which must be ordered after every earlier use
    /// of them.
    pub fn get(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        name: &str,
        bytes: usize,
    ) -> Result<DeviceRange> {
        let key = name.to_owned();
        if let Some((Some(m), _)) = self.0.touch(&key).filter(|(_, b)| *b == bytes) {
            return m.range().first(bytes);
        }
        let m = gpu.alloc_on(stream, bytes)?;
        gpu.memset_zero(stream, m.range())?;
        let range = m.range().first(bytes)?;
        if let Some((Some(old), _)) = self.0.remove(&key) {
            old.free_on(stream)?;
        }
        self.0.put(key, (Some(m), bytes));
        Ok(range)
    }

    /// Frees the residuals unused for the store's window, and those of unnamed tensors, on
    /// `stream` (ordered after every earlier use of them).
    pub fn sweep(&mut self, stream: &Stream, names: &[&str]) -> Result<()> {
        for name in names.iter().filter(|n| store::is_unnamed(n)) {
            if let Some((Some(m), _)) = self.0.remove(&name.to_string()) {
                m.free_on(stream)?;
            }
        }
        for (m, _) in self.0.sweep() {
            if let Some(m) = m {
                m.free_on(stream)?;
            }
        }
        Ok(())
    }

    /// Names holding a residual.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A batch's codec and where its per-tensor state lives: `u8`'s residuals, PowerSGD's
/// residuals and factors.
#[derive(Clone, Copy)]
pub struct Wire<'a> {
    pub codec: Codec,
    pub feedback: &'a Feedback,
    pub powersgd: &'a powersgd::PowerMemory,
    /// PowerSGD's first allreduces of each tensor that travel uncompressed
    /// (`FERROVOD_POWERSGD_START`, agreed).
    pub powersgd_start: u64,
    pub topk: &'a topk::TopkMemory,
    /// Top-k's first allreduces of each tensor that send a larger share
    /// (`FERROVOD_TOPK_WARMUP_STEPS`, agreed: `TopK::k_at`).
    pub topk_warmup: u64,
    /// Threads a codec's local arithmetic may use (`FERROVOD_COMPRESSION_THREADS`; local:
    /// the results are the same bits for any).
    pub threads: usize,
}

impl Wire<'_> {
    /// How `r` travels in this batch and the bytes it puts on the wire: as the codec says,
    /// except a tensor in PowerSGD's first steps, which goes as it is, and top-k's pairs at the
    /// tensor's share of this step (its warm-up's or the ratio's).
    pub fn sent(&self, r: &Response) -> (Codec, usize) {
        if let Codec::PowerSgd(rank) = self.codec
            && powersgd::Shape::of(&r.shape, rank)
                .is_some_and(|s| self.powersgd.warming(&r.name, &s, self.powersgd_start))
        {
            return (Codec::None, Codec::None.wire_bytes(r));
        }
        if let Codec::TopK(params) = self.codec {
            let len = r.num_elements().max(0) as usize;
            let step = self.topk.steps(&r.name, len);
            if let Some(k) = params.k_at(len, step, self.topk_warmup) {
                return (self.codec, k * topk::PAIR_BYTES);
            }
        }
        (self.codec, self.codec.wire_bytes(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(kind: OpKind, dtype: DataType, op: ReduceOp) -> Response {
        Response {
            kind,
            name: "t".into(),
            dtype,
            shape: vec![1 << 14],
            first_dims: Vec::new(),
            root: 0,
            device: crate::message::CPU_DEVICE,
            reduce_op: op,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: crate::message::Multistep::EVERY_CALL,
            result: 0,
            error: None,
        }
    }

    fn codecs(setting: Compression) -> Codecs {
        Codecs {
            setting,
            ..Codecs::default()
        }
    }

    #[test]
    fn top_k_warms_up_from_a_quarter_by_quarters_never_below_its_ratio() {
        let one = TopK::of(0.01, 0.0);
        let ks: Vec<Option<usize>> = (0..10).map(|s| one.k_at(1000, s, 8)).collect();
        let want = [250, 250, 63, 63, 16, 16, 10, 10, 10, 10];
        assert_eq!(ks, want.map(Some));
        assert_eq!(one.k_at(1000, 0, 0), Some(10), "no warm-up");
        // above a quarter already: the ratio throughout
        let wide = TopK::of(0.4, 0.0);
        assert!((0..4).all(|s| wide.k_at(1000, s, 4) == Some(400)));
        // unnamed tensors never count steps (`TopkMemory::steps`), so never warm up
        let store = topk::TopkMemory::default();
        assert_eq!(store.steps("allreduce.noname.1", 1000), u64::MAX);
        assert_eq!(store.steps("w", 1000), 0);
    }

    #[test]
    fn powersgd_takes_allreduces_of_matrices_whose_factors_are_smaller() {
        let c = codecs(Compression::PowerSgd(0));
        let with = |shape: &[i64], kind, op, device| {
            let mut r = resp(kind, DataType::F32, op);
            (r.shape, r.device) = (shape.to_vec(), device);
            c.of(&r)
        };
        let host = crate::message::CPU_DEVICE;
        let (ar, sum, avg) = (OpKind::Allreduce, ReduceOp::Sum, ReduceOp::Average);
        assert_eq!(with(&[64, 3, 3, 3], ar, sum, host), Codec::PowerSgd(4));
        assert_eq!(with(&[64, 32], ar, avg, host), Codec::PowerSgd(4));
        // factors as wide as the matrix's smaller side would be larger than it
        assert_eq!(with(&[3, 1000], ar, sum, host), Codec::None);
        assert_eq!(with(&[5, 1000], ar, sum, host), Codec::PowerSgd(4));
        // on GPUs alike
        assert_eq!(with(&[64, 32], ar, sum, 0), Codec::PowerSgd(4));
        assert_eq!(with(&[3, 1000], ar, sum, 0), Codec::None);
        // vectors, small matrices, other reductions and gossip as they are
        assert_eq!(with(&[4096], ar, sum, host), Codec::None);
        assert_eq!(with(&[4, 4], ar, sum, host), Codec::None);
        assert_eq!(with(&[64, 32], ar, ReduceOp::Max, host), Codec::None);
        assert_eq!(with(&[64, 32], OpKind::Gossip, avg, host), Codec::None);
        assert_eq!(with(&[64, 32], OpKind::Gossip, avg, 0), Codec::None);
        // a sum's approximation is of the average, times the ranks
        let mut r = resp(ar, DataType::F32, sum);
        r.shape = vec![64, 32];
        let red = Reduction::of(Codec::PowerSgd(4), &r, 4).unwrap();
        assert_eq!((red.op, red.post, red.wire), (sum, 4.0, DataType::F32));
        let red = Reduction::of(Codec::PowerSgd(4), &resp(ar, DataType::F32, avg), 4).unwrap();
        assert_eq!(red.post, 1.0);
        // on the wire: the two factors, (64 + 32) x 4 values
        assert_eq!(Codec::PowerSgd(4).wire_bytes(&r), (64 + 32) * 4 * 4);
        assert_eq!(Codec::U8.wire_bytes(&r), 64 * 32);
    }

    #[test]
    fn topk_takes_allreduces_whose_pairs_are_smaller_than_their_values() {
        let c = codecs(Compression::TopK(0));
        let params = TopK::default();
        let with = |n: i64, kind, device| {
            let mut r = resp(kind, DataType::F32, ReduceOp::Sum);
            (r.shape, r.device) = (vec![n], device);
            c.of(&r)
        };
        let host = crate::message::CPU_DEVICE;
        assert_eq!(with(1000, OpKind::Allreduce, host), Codec::TopK(params));
        // 1 % of 100 is one pair of two values: still fewer bytes; of 2, one pair is not
        assert_eq!(with(100, OpKind::Allreduce, host), Codec::TopK(params));
        assert_eq!(with(2, OpKind::Allreduce, host), Codec::None);
        assert_eq!(with(1000, OpKind::Gossip, host), Codec::None);
        // on GPUs alike
        assert_eq!(with(1000, OpKind::Allreduce, 0), Codec::TopK(params));
        assert_eq!(with(2, OpKind::Allreduce, 0), Codec::None);
        // an operation's own ratio (the job's momentum stays); at 60 % a pair costs more than
        // the values it replaces
        let mut r = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Sum);
        r.shape = vec![1000];
        r.compression = Some(Compression::TopK(250_000));
        let own = TopK {
            ratio_ppm: 250_000,
            ..params
        };
        assert_eq!(c.of(&r), Codec::TopK(own));
        assert_eq!(own.k(1000), Some(250));
        r.compression = Some(Compression::TopK(600_000));
        assert_eq!(c.of(&r), Codec::None);
        // and PowerSGD's own rank
        r.shape = vec![64, 32];
        r.compression = Some(Compression::PowerSgd(2));
        assert_eq!(c.of(&r), Codec::PowerSgd(2));
        let mut r = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Average);
        r.shape = vec![1000];
        assert_eq!(Codec::TopK(params).wire_bytes(&r), 10 * topk::PAIR_BYTES);
        let red = Reduction::of(Codec::TopK(params), &r, 4).unwrap();
        assert_eq!((red.op, red.post), (ReduceOp::Sum, 0.25));
        // the settings round to whole millionths and thousandths
        let t = TopK::of(0.0025, 0.9);
        assert_eq!((t.ratio_ppm, t.momentum_permille), (2500, 900));
        assert_eq!((t.ratio(), t.momentum()), (0.0025, 0.9));
        assert_eq!(
            TopK::of(1e-9, 5.0),
            TopK {
                ratio_ppm: 1,
                momentum_permille: 999
            }
        );
    }

    #[test]
    fn averages_divide_before_a_16_bit_cast_and_after_an_8_bit_sum() {
        let mut avg = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Average);
        (avg.prescale, avg.postscale) = (2.0, 3.0);
        let r = |codec| Reduction::of(codec, &avg, 4).unwrap();
        let half = r(Codec::Half(DataType::F16));
        assert_eq!(
            (half.wire, half.op, half.pre, half.post),
            (DataType::F16, ReduceOp::Sum, 0.5, 3.0)
        );
        let u8s = r(Codec::U8);
        assert_eq!(
            (u8s.wire, u8s.op, u8s.pre, u8s.post),
            (DataType::U8, ReduceOp::Sum, 2.0, 0.75)
        );
        let none = r(Codec::None);
        assert_eq!(
            (none.wire, none.op, none.pre, none.post),
            (DataType::F32, ReduceOp::Sum, 2.0, 0.75)
        );
        // a minimum keeps its op uncompressed and cannot travel compressed
        let min = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Min);
        assert_eq!(
            Reduction::of(Codec::None, &min, 4).unwrap().op,
            ReduceOp::Min
        );
        assert!(Reduction::of(Codec::Half(DataType::BF16), &min, 4).is_err());
        assert!(Reduction::of(Codec::U8, &min, 4).is_err());
    }

    #[test]
    fn only_f32_sums_and_averages_compress() {
        let sum = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Sum);
        let avg = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Average);
        assert_eq!(
            codecs(Compression::Fp16).of(&sum),
            Codec::Half(DataType::F16)
        );
        assert_eq!(
            codecs(Compression::Bf16).of(&avg),
            Codec::Half(DataType::BF16)
        );
        assert_eq!(codecs(Compression::None).of(&sum), Codec::None);
        for other in [
            resp(OpKind::Allreduce, DataType::F32, ReduceOp::Max),
            resp(OpKind::Allreduce, DataType::F32, ReduceOp::Product),
            resp(OpKind::Allreduce, DataType::F64, ReduceOp::Sum),
            resp(OpKind::Allreduce, DataType::F16, ReduceOp::Sum),
            resp(OpKind::Allgather, DataType::F32, ReduceOp::Sum),
        ] {
            for c in Compression::ALL {
                assert_eq!(codecs(c).of(&other), Codec::None, "{other:?} {c:?}");
            }
        }
    }

    #[test]
    fn an_operations_own_compression_wins_over_the_jobs() {
        let mut r = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Sum);
        r.compression = Some(Compression::None);
        assert_eq!(codecs(Compression::Fp16).of(&r), Codec::None);
        r.compression = Some(Compression::Bf16);
        assert_eq!(
            codecs(Compression::None).of(&r),
            Codec::Half(DataType::BF16)
        );
    }

    #[test]
    fn mixed_keeps_small_tensors_f32_by_size_alone() {
        let p = Codecs {
            setting: Compression::Mixed,
            min_bytes: 4096,
            powersgd_rank: crate::compress::POWERSGD_RANK,
            topk: crate::compress::TopK {
                ratio_ppm: 10_000,
                momentum_permille: 0,
            },
        };
        let mut r = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Average);
        r.shape = vec![1023];
        assert_eq!(p.of(&r), Codec::None);
        r.shape = vec![32, 32];
        assert_eq!(p.of(&r), Codec::Half(DataType::F16));
        // the same shape under any name, on any rank: the choice reads agreed metadata only
        r.name = "other".into();
        assert_eq!(p.of(&r), Codec::Half(DataType::F16));
    }

    #[test]
    fn settings_parse_and_round_trip() {
        assert_eq!(Compression::parse(" FP16 "), Some(Compression::Fp16));
        assert_eq!(Compression::parse("bf16"), Some(Compression::Bf16));
        assert_eq!(Compression::parse("none"), Some(Compression::None));
        assert_eq!(Compression::parse("u8"), Some(Compression::U8));
        assert_eq!(Compression::parse("int8"), None);
        assert_eq!(Compression::parse("mixed"), Some(Compression::Mixed));
        // AIACC: 0 is fp16 (its default), 1 none, 2 mixed
        assert_eq!(Compression::from_perseus("0"), Some(Compression::Fp16));
        assert_eq!(Compression::from_perseus("1"), Some(Compression::None));
        assert_eq!(Compression::from_perseus("2"), Some(Compression::Mixed));
        assert_eq!(Compression::from_perseus("3"), None);
        for c in Compression::ALL {
            assert_eq!(Compression::from_code(c.code()), Some(c));
            assert_eq!(Compression::parse(c.name()), Some(c));
            assert_eq!(c.param(), 0);
        }
        // an operation's own parameter: PowerSGD's rank, top-k's ratio in millionths
        let topk = Compression::TopK(0);
        assert_eq!(topk.with_param(50_000), Ok(Compression::TopK(50_000)));
        assert_eq!(
            topk.with_param(50_000).unwrap().describe(),
            "topk (ratio 0.05)"
        );
        assert!(topk.with_param(1_000_001).is_err());
        let psgd = Compression::PowerSgd(0);
        assert_eq!(psgd.with_param(8).unwrap().describe(), "powersgd (rank 8)");
        assert!(
            psgd.with_param(crate::message::POWERSGD_MAX_RANK + 1)
                .is_err()
        );
        assert!(Compression::Fp16.with_param(1).is_err());
        assert_eq!(Compression::Fp16.with_param(0), Ok(Compression::Fp16));
        assert_eq!(Compression::from_code(Compression::ALL.len()), None);
        assert_eq!(
            Codec::Half(DataType::F16).wire(DataType::F32),
            DataType::F16
        );
        assert_eq!(Codec::None.wire(DataType::F32), DataType::F32);
    }

    #[test]
    fn the_nan_check_names_each_tensor_with_non_finite_values() {
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let (clean, nan, inf) = (
            f32s(&[1.0, -2.0, f32::MAX]),
            f32s(&[f32::NAN, 1.0, f32::NAN]),
            f32s(&[0.0, f32::NEG_INFINITY]),
        );
        assert!(check_finite(DataType::F32, [("a", &clean[..])].into_iter()).is_ok());
        let e = check_finite(
            DataType::F32,
            [("a", &clean[..]), ("b", &nan[..]), ("c", &inf[..])].into_iter(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "NaN or Inf in the allreduced values of tensor 'b' (2 values), 'c' (1 values) (PERSEUS_ALLREDUCE_NANCHECK)"
        );
        let h = half::f16::INFINITY.to_le_bytes();
        assert!(check_finite(DataType::F16, [("h", &h[..])].into_iter()).is_err());
        let b = half::bf16::NAN.to_le_bytes();
        assert!(check_finite(DataType::BF16, [("b", &b[..])].into_iter()).is_err());
        let d = f64::NAN.to_le_bytes();
        assert!(check_finite(DataType::F64, [("d", &d[..])].into_iter()).is_err());
        // integers have no NaN
        assert!(check_finite(DataType::I32, [("i", &[255u8; 8][..])].into_iter()).is_ok());
    }
}
