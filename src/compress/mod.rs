//! Compression: how a batch's values travel on the wire. The stage between fusion and the
//! collective: a codec is chosen per batch from agreed data only (the batch's responses and the
//! job's agreed setting), so every rank encodes and decodes the same batches alike.

use crate::dtype::DataType;
use crate::message::{OpKind, ReduceOp, Response};

/// What the job asks for (`FERROVOD_COMPRESSION`, or AIACC's `PERSEUS_ALLREDUCE_DTYPE`); agreed
/// from rank 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    #[default]
    None,
    /// f32 allreduces travel as IEEE half precision.
    Fp16,
    /// f32 allreduces travel as bfloat16.
    Bf16,
}

impl Compression {
    /// `none`, `fp16` or `bf16` (`FERROVOD_COMPRESSION`).
    pub fn parse(s: &str) -> Option<Compression> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Some(Compression::None),
            "fp16" => Some(Compression::Fp16),
            "bf16" => Some(Compression::Bf16),
            _ => None,
        }
    }

    /// AIACC's `PERSEUS_ALLREDUCE_DTYPE`: 0 fp16, 1 none; its 2 ("mixed") is not implemented
    /// yet (None here: the caller says so).
    pub fn from_perseus(s: &str) -> Option<Compression> {
        match s.trim() {
            "0" => Some(Compression::Fp16),
            "1" => Some(Compression::None),
            _ => None,
        }
    }

    pub fn code(self) -> usize {
        self as usize
    }

    pub fn from_code(c: usize) -> Compression {
        match c {
            1 => Compression::Fp16,
            2 => Compression::Bf16,
            _ => Compression::None,
        }
    }
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
}

impl Codec {
    /// The dtype on the wire for values of `dtype`.
    pub fn wire(self, dtype: DataType) -> DataType {
        match self {
            Codec::None => dtype,
            Codec::Half(w) => w,
        }
    }
}

/// The codec of a batch: a pure function of its agreed responses and the agreed setting
/// (identical on every rank). Only f32 sums and averages compress: a 16-bit min, max or
/// product would change results beyond rounding, and other dtypes gain nothing or lose range.
pub fn choose(resps: &[&Response], setting: Compression) -> Codec {
    debug_assert!(!resps.is_empty());
    let head = resps[0];
    let compressible = head.kind == OpKind::Allreduce
        && head.dtype == DataType::F32
        && matches!(head.reduce_op, ReduceOp::Sum | ReduceOp::Average);
    match (setting, compressible) {
        (Compression::Fp16, true) => Codec::Half(DataType::F16),
        (Compression::Bf16, true) => Codec::Half(DataType::BF16),
        _ => Codec::None,
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
            shape: vec![4],
            first_dims: Vec::new(),
            root: 0,
            device: crate::message::CPU_DEVICE,
            reduce_op: op,
            prescale: 1.0,
            postscale: 1.0,
            result: 0,
            error: None,
        }
    }

    #[test]
    fn only_f32_sums_and_averages_compress() {
        let sum = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Sum);
        let avg = resp(OpKind::Allreduce, DataType::F32, ReduceOp::Average);
        assert_eq!(
            choose(&[&sum], Compression::Fp16),
            Codec::Half(DataType::F16)
        );
        assert_eq!(
            choose(&[&avg], Compression::Bf16),
            Codec::Half(DataType::BF16)
        );
        assert_eq!(choose(&[&sum], Compression::None), Codec::None);
        for other in [
            resp(OpKind::Allreduce, DataType::F32, ReduceOp::Max),
            resp(OpKind::Allreduce, DataType::F32, ReduceOp::Product),
            resp(OpKind::Allreduce, DataType::F64, ReduceOp::Sum),
            resp(OpKind::Allreduce, DataType::F16, ReduceOp::Sum),
            resp(OpKind::Allgather, DataType::F32, ReduceOp::Sum),
        ] {
            assert_eq!(
                choose(&[&other], Compression::Fp16),
                Codec::None,
                "{other:?}"
            );
        }
    }

    #[test]
    fn settings_parse_and_round_trip() {
        assert_eq!(Compression::parse(" FP16 "), Some(Compression::Fp16));
        assert_eq!(Compression::parse("bf16"), Some(Compression::Bf16));
        assert_eq!(Compression::parse("none"), Some(Compression::None));
        assert_eq!(Compression::parse("u8"), None);
        // AIACC: 0 is fp16 (its default), 1 none, 2 mixed (not here yet)
        assert_eq!(Compression::from_perseus("0"), Some(Compression::Fp16));
        assert_eq!(Compression::from_perseus("1"), Some(Compression::None));
        assert_eq!(Compression::from_perseus("2"), None);
        for c in [Compression::None, Compression::Fp16, Compression::Bf16] {
            assert_eq!(Compression::from_code(c.code()), c);
        }
        assert_eq!(
            Codec::Half(DataType::F16).wire(DataType::F32),
            DataType::F16
        );
        assert_eq!(Codec::None.wire(DataType::F32), DataType::F32);
    }
}
