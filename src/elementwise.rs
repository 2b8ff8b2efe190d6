//! Elementwise arithmetic on host buffers, below every stage: f16/bf16 reductions (the MPI
//! backend's user ops: MPI has no half types), `reduce_into` for every dtype (the local step of
//! algorithms over point-to-point transfers) and the prescale/postscale multiply. Chosen once
//! per call; inner loops on slices.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::ReduceOp;

/// The f32 arithmetic of `op` for the 16-bit float reductions.
fn in_f32(op: ReduceOp) -> fn(f32, f32) -> f32 {
    match op {
        ReduceOp::Min => f32::min,
        ReduceOp::Max => f32::max,
        ReduceOp::Product => |a, b| a * b,
        _ => |a, b| a + b,
    }
}

/// `acc[i] = op(acc[i], x[i])` for a 16-bit float type, computed in f32.
pub fn reduce_half<T: Copy>(
    acc: &mut [T],
    x: &[T],
    op: ReduceOp,
    to_f32: fn(T) -> f32,
    from_f32: fn(f32) -> T,
) {
    let f = in_f32(op);
    for (a, b) in acc.iter_mut().zip(x) {
        *a = from_f32(f(to_f32(*a), to_f32(*b)));
    }
}

/// Values converted at a time by the f16 paths: the slice conversions use the CPU's F16C
/// instructions where it has them (`half` detects them at run time), one value at a time does
/// not.
const F16_BLOCK: usize = 256;

pub fn reduce_f16(acc: &mut [f16], x: &[f16], op: ReduceOp) {
    let mut wide = ([0f32; F16_BLOCK], [0f32; F16_BLOCK]);
    for (a, b) in acc.chunks_mut(F16_BLOCK).zip(x.chunks(F16_BLOCK)) {
        reduce_f16_block(a, b, op, &mut wide);
    }
}

/// `a = op(a, b)` for at most `F16_BLOCK` values, through the caller's f32 scratch `wide`.
fn reduce_f16_block(
    a: &mut [f16],
    b: &[f16],
    op: ReduceOp,
    wide: &mut ([f32; F16_BLOCK], [f32; F16_BLOCK]),
) {
    let k = a.len().min(b.len());
    let (wa, wx) = (&mut wide.0[..k], &mut wide.1[..k]);
    a[..k].convert_to_f32_slice(wa);
    b[..k].convert_to_f32_slice(wx);
    combine(wa, wx, op);
    a[..k].convert_from_f32_slice(wa);
}

/// `a[i] = op(a[i], b[i])`, one loop per op so that each compiles to vector code (a function
/// pointer called per value cost more than the f16 conversions around it).
fn combine(a: &mut [f32], b: &[f32], op: ReduceOp) {
    let pairs = a.iter_mut().zip(b);
    match op {
        ReduceOp::Min => pairs.for_each(|(p, q)| *p = p.min(*q)),
        ReduceOp::Max => pairs.for_each(|(p, q)| *p = p.max(*q)),
        ReduceOp::Product => pairs.for_each(|(p, q)| *p *= *q),
        _ => pairs.for_each(|(p, q)| *p += *q),
    }
}

pub fn reduce_bf16(acc: &mut [bf16], x: &[bf16], op: ReduceOp) {
    reduce_half(acc, x, op, bf16::to_f32, bf16::from_f32);
}

macro_rules! scale_as {
    ($buf:expr, $t:ty, $factor:expr, $to:expr, $from:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for c in $buf.chunks_exact_mut(N) {
            let v = <$t>::from_le_bytes(c.try_into().expect("chunk size"));
            let s = $from($to(v) * $factor);
            c.copy_from_slice(&s.to_le_bytes());
        }
    }};
}

/// Multiplies every element of `buf` by `factor`. Integers are scaled in f64 and truncated
/// toward zero, as Horovod does; bool cannot be scaled.
pub fn scale(buf: &mut [u8], dtype: DataType, factor: f64) -> Result<()> {
    if factor == 1.0 {
        return Ok(());
    }
    match dtype {
        DataType::U8 => scale_as!(buf, u8, factor, f64::from, |v: f64| v as u8),
        DataType::I8 => scale_as!(buf, i8, factor, f64::from, |v: f64| v as i8),
        DataType::U16 => scale_as!(buf, u16, factor, f64::from, |v: f64| v as u16),
        DataType::I16 => scale_as!(buf, i16, factor, f64::from, |v: f64| v as i16),
        DataType::I32 => scale_as!(buf, i32, factor, f64::from, |v: f64| v as i32),
        DataType::I64 => scale_as!(buf, i64, factor, |v: i64| v as f64, |v: f64| v as i64),
        DataType::F32 => {
            let f = factor as f32;
            scale_as!(buf, f32, f, |v: f32| v, |v: f32| v)
        }
        DataType::F64 => scale_as!(buf, f64, factor, |v: f64| v, |v: f64| v),
        DataType::F16 => {
            let f = factor as f32;
            scale_as!(buf, f16, f, f16::to_f32, f16::from_f32)
        }
        DataType::BF16 => {
            let f = factor as f32;
            scale_as!(buf, bf16, f, bf16::to_f32, bf16::from_f32)
        }
        DataType::Bool => {
            return Err(Error::InvalidArgument(
                "bool tensors cannot be scaled (prescale/postscale/average)".into(),
            ));
        }
    }
    Ok(())
}

/// How many values of `buf` (of `dtype`) are NaN or infinite; 0 for integer types.
pub fn non_finite(buf: &[u8], dtype: DataType) -> usize {
    fn count<T: Copy>(
        buf: &[u8],
        n: usize,
        from: impl Fn(&[u8]) -> T,
        bad: impl Fn(T) -> bool,
    ) -> usize {
        buf.chunks_exact(n).filter(|c| bad(from(c))).count()
    }
    match dtype {
        DataType::F32 => count(
            buf,
            4,
            |c| f32::from_le_bytes(c.try_into().expect("4 bytes")),
            |v: f32| !v.is_finite(),
        ),
        DataType::F64 => count(
            buf,
            8,
            |c| f64::from_le_bytes(c.try_into().expect("8 bytes")),
            |v: f64| !v.is_finite(),
        ),
        DataType::F16 => count(
            buf,
            2,
            |c| f16::from_le_bytes([c[0], c[1]]),
            |v: f16| !v.is_finite(),
        ),
        DataType::BF16 => count(
            buf,
            2,
            |c| bf16::from_le_bytes([c[0], c[1]]),
            |v: bf16| !v.is_finite(),
        ),
        _ => 0,
    }
}

/// `dst = src * factor`, in pieces small enough to stay in cache between the copy and the
/// scaling, so that a fusion buffer's pack or unpack and its scaling are one pass over memory.
pub fn copy_scaled(dst: &mut [u8], src: &[u8], dtype: DataType, factor: f64) -> Result<()> {
    // a multiple of every element size
    const PIECE: usize = 64 << 10;
    if dst.len() != src.len() {
        return Err(Error::Internal(format!(
            "copy_scaled: {} bytes into {}",
            src.len(),
            dst.len()
        )));
    }
    for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        d.copy_from_slice(s);
        scale(d, dtype, factor)?;
    }
    Ok(())
}

/// `dst` (16-bit floats of `wire`: F16 or BF16) = `src` (f32) × `factor`, rounded to nearest.
/// Returns how many finite values left the 16-bit type's range (became infinite).
pub fn encode_half(dst: &mut [u8], src: &[u8], wire: DataType, factor: f64) -> Result<usize> {
    if dst.len() * 2 != src.len() {
        return Err(Error::Internal(format!(
            "encode_half: {} bytes of f32 into {} bytes",
            src.len(),
            dst.len()
        )));
    }
    let f = factor as f32;
    let mut lost = 0;
    match wire {
        DataType::F16 => {}
        DataType::BF16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let v = f32::from_le_bytes(s.try_into().expect("4 bytes")) * f;
                let h = bf16::from_f32(v);
                lost += usize::from(h.is_infinite() && v.is_finite());
                d.copy_from_slice(&h.to_le_bytes());
            }
            return Ok(lost);
        }
        other => {
            return Err(Error::Internal(format!(
                "encode_half into {}",
                other.name()
            )));
        }
    }
    let (mut wide, mut narrow) = ([0f32; F16_BLOCK], [f16::ZERO; F16_BLOCK]);
    for (d, s) in dst.chunks_mut(2 * F16_BLOCK).zip(src.chunks(4 * F16_BLOCK)) {
        let k = d.len() / 2;
        for (w, c) in wide[..k].iter_mut().zip(s.chunks_exact(4)) {
            *w = f32::from_le_bytes(c.try_into().expect("4 bytes")) * f;
        }
        narrow[..k].convert_from_f32_slice(&wide[..k]);
        for ((o, h), w) in d.chunks_exact_mut(2).zip(&narrow[..k]).zip(&wide[..k]) {
            lost += usize::from(h.is_infinite() && w.is_finite());
            o.copy_from_slice(&h.to_le_bytes());
        }
    }
    Ok(lost)
}

/// `dst` (f32) = `src` (16-bit floats of `wire`) × `factor`.
pub fn decode_half(dst: &mut [u8], src: &[u8], wire: DataType, factor: f64) -> Result<()> {
    if src.len() * 2 != dst.len() {
        return Err(Error::Internal(format!(
            "decode_half: {} bytes into {} bytes of f32",
            src.len(),
            dst.len()
        )));
    }
    let f = factor as f32;
    match wire {
        DataType::F16 => {}
        DataType::BF16 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                let v = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&(v * f).to_le_bytes());
            }
            return Ok(());
        }
        other => {
            return Err(Error::Internal(format!(
                "decode_half from {}",
                other.name()
            )));
        }
    }
    let (mut wide, mut narrow) = ([0f32; F16_BLOCK], [f16::ZERO; F16_BLOCK]);
    for (d, s) in dst.chunks_mut(4 * F16_BLOCK).zip(src.chunks(2 * F16_BLOCK)) {
        let k = s.len() / 2;
        for (h, c) in narrow[..k].iter_mut().zip(s.chunks_exact(2)) {
            *h = f16::from_le_bytes([c[0], c[1]]);
        }
        narrow[..k].convert_to_f32_slice(&mut wide[..k]);
        for (o, w) in d.chunks_exact_mut(4).zip(&wide[..k]) {
            o.copy_from_slice(&(w * f).to_le_bytes());
        }
    }
    Ok(())
}

macro_rules! reduce_as {
    ($acc:expr, $x:expr, $t:ty, $f:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(N).zip($x.chunks_exact(N)) {
            let va = <$t>::from_le_bytes(a.try_into().expect("chunk size"));
            let vb = <$t>::from_le_bytes(b.try_into().expect("chunk size"));
            a.copy_from_slice(&$f(va, vb).to_le_bytes());
        }
    }};
}

macro_rules! reduce_int {
    ($acc:expr, $x:expr, $t:ty, $op:expr) => {
        match $op {
            ReduceOp::Min => reduce_as!($acc, $x, $t, |a: $t, b: $t| a.min(b)),
            ReduceOp::Max => reduce_as!($acc, $x, $t, |a: $t, b: $t| a.max(b)),
            ReduceOp::Product => reduce_as!($acc, $x, $t, |a: $t, b: $t| a.wrapping_mul(b)),
            _ => reduce_as!($acc, $x, $t, |a: $t, b: $t| a.wrapping_add(b)),
        }
    };
}

macro_rules! reduce_float {
    ($acc:expr, $x:expr, $t:ty, $op:expr, $to:expr, $from:expr) => {
        match $op {
            ReduceOp::Min => reduce_as!($acc, $x, $t, |a: $t, b: $t| $from($to(a).min($to(b)))),
            ReduceOp::Max => reduce_as!($acc, $x, $t, |a: $t, b: $t| $from($to(a).max($to(b)))),
            ReduceOp::Product => reduce_as!($acc, $x, $t, |a: $t, b: $t| $from($to(a) * $to(b))),
            _ => reduce_as!($acc, $x, $t, |a: $t, b: $t| $from($to(a) + $to(b))),
        }
    };
}

/// `acc = op(acc, x)` elementwise for any dtype, on byte buffers of any alignment: the local
/// step of algorithms written over point-to-point transfers. Integers wrap as MPI's do; 16-bit
/// floats are computed in f32; bool's sum and max are OR, its min and product AND (as the MPI
/// backend reduces them). `op` is Sum, Min, Max or Product.
pub fn reduce_into(acc: &mut [u8], x: &[u8], dtype: DataType, op: ReduceOp) -> Result<()> {
    if acc.len() != x.len() || !acc.len().is_multiple_of(dtype.size()) {
        return Err(Error::Internal(format!(
            "reduce_into: {} and {} bytes of {}",
            acc.len(),
            x.len(),
            dtype.name()
        )));
    }
    op.elementwise_index()?;
    let id = |v: f64| v;
    match dtype {
        DataType::U8 => reduce_int!(acc, x, u8, op),
        DataType::I8 => reduce_int!(acc, x, i8, op),
        DataType::U16 => reduce_int!(acc, x, u16, op),
        DataType::I16 => reduce_int!(acc, x, i16, op),
        DataType::I32 => reduce_int!(acc, x, i32, op),
        DataType::I64 => reduce_int!(acc, x, i64, op),
        DataType::F32 => reduce_float!(acc, x, f32, op, |v: f32| v, |v: f32| v),
        DataType::F64 => reduce_float!(acc, x, f64, op, id, id),
        DataType::F16 => reduce_f16_bytes(acc, x, op),
        DataType::BF16 => reduce_float!(acc, x, bf16, op, bf16::to_f32, bf16::from_f32),
        DataType::Bool => {
            let or = matches!(op, ReduceOp::Sum | ReduceOp::Max);
            for (a, b) in acc.iter_mut().zip(x) {
                *a = if or { *a | *b } else { *a & *b };
            }
        }
    }
    Ok(())
}

/// `reduce_into` of f16 bytes (any alignment): `F16_BLOCK` values at a time copied out of the
/// bytes and reduced as `reduce_f16` does. A value at a time cost ten times as much
/// (BENCHMARKS.md, 2026-11-26, the f16 reduction on the host), and a host ring reduces half of
/// an fp16 batch this way on every step.
fn reduce_f16_bytes(acc: &mut [u8], x: &[u8], op: ReduceOp) {
    let (mut ha, mut hx) = ([f16::ZERO; F16_BLOCK], [f16::ZERO; F16_BLOCK]);
    let mut wide = ([0f32; F16_BLOCK], [0f32; F16_BLOCK]);
    for (a, b) in acc.chunks_mut(2 * F16_BLOCK).zip(x.chunks(2 * F16_BLOCK)) {
        let k = a.len() / 2;
        for (h, c) in ha[..k].iter_mut().zip(a.chunks_exact(2)) {
            *h = f16::from_le_bytes([c[0], c[1]]);
        }
        for (h, c) in hx[..k].iter_mut().zip(b.chunks_exact(2)) {
            *h = f16::from_le_bytes([c[0], c[1]]);
        }
        reduce_f16_block(&mut ha[..k], &hx[..k], op, &mut wide);
        for (o, h) in a.chunks_exact_mut(2).zip(&ha[..k]) {
            o.copy_from_slice(&h.to_le_bytes());
        }
    }
}

/// `out = (a + b) / 2` for floating dtypes in one pass: the sum rounded to the dtype (16-bit
/// floats added in f32), then halved. The same on both ranks of a gossip pair (addition
/// commutes).
pub fn mean_of_two(out: &mut [u8], a: &[u8], b: &[u8], dtype: DataType) -> Result<()> {
    if out.len() != a.len() || a.len() != b.len() || !out.len().is_multiple_of(dtype.size()) {
        return Err(Error::Internal(format!(
            "mean_of_two: {}, {} and {} bytes of {}",
            out.len(),
            a.len(),
            b.len(),
            dtype.name()
        )));
    }
    macro_rules! mean {
        ($t:ty, $n:expr, $f:expr) => {
            for ((o, x), y) in out
                .chunks_exact_mut($n)
                .zip(a.chunks_exact($n))
                .zip(b.chunks_exact($n))
            {
                let v: $t = $f(
                    <$t>::from_le_bytes(x.try_into().expect("element")),
                    <$t>::from_le_bytes(y.try_into().expect("element")),
                );
                o.copy_from_slice(&v.to_le_bytes());
            }
        };
    }
    match dtype {
        DataType::F32 => mean!(f32, 4, |x: f32, y: f32| (x + y) * 0.5),
        DataType::F64 => mean!(f64, 8, |x: f64, y: f64| (x + y) * 0.5),
        DataType::F16 => mean!(f16, 2, |x: f16, y: f16| {
            f16::from_f32(f16::from_f32(x.to_f32() + y.to_f32()).to_f32() * 0.5)
        }),
        DataType::BF16 => mean!(bf16, 2, |x: bf16, y: bf16| {
            bf16::from_f32(bf16::from_f32(x.to_f32() + y.to_f32()).to_f32() * 0.5)
        }),
        other => {
            return Err(Error::Internal(format!("mean_of_two of {}", other.name())));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_reductions_match_f32() {
        let a: Vec<f16> = [1.5f32, -2.0, 3.25, 0.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let b: Vec<f16> = [0.5f32, 4.0, -1.0, 7.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        for (op, want) in [
            (ReduceOp::Sum, [2.0f32, 2.0, 2.25, 7.0]),
            (ReduceOp::Min, [0.5, -2.0, -1.0, 0.0]),
            (ReduceOp::Max, [1.5, 4.0, 3.25, 7.0]),
            (ReduceOp::Product, [0.75, -8.0, -3.25, 0.0]),
        ] {
            let mut acc = a.clone();
            reduce_f16(&mut acc, &b, op);
            assert_eq!(
                acc.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
                want,
                "{op:?}"
            );
        }
        let mut acc = vec![bf16::from_f32(1.0), bf16::from_f32(256.0)];
        reduce_bf16(
            &mut acc,
            &[bf16::from_f32(2.0), bf16::from_f32(1.0)],
            ReduceOp::Sum,
        );
        // 257 is not representable in bf16 (8 bits of mantissa): rounds to 256
        assert_eq!(
            acc.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            [3.0, 256.0]
        );
    }

    #[test]
    fn f16_bytes_reduce_as_one_value_at_a_time() {
        // every class of value (subnormals, overflow to Inf, NaN, signed zeros), more than one
        // block and a partial one
        let specials = [
            0.0f32,
            -0.0,
            6.0e-8,
            -6.0e-8,
            65504.0,
            -65504.0,
            1.0e-3,
            f32::NAN,
        ];
        let value = |i: usize, s: usize| -> f16 {
            match (i * 7 + s) % 11 {
                k if k < specials.len() => f16::from_f32(specials[k]),
                _ => f16::from_f32(((i * 37 + s * 11) % 2001) as f32 * 0.37 - 370.0),
            }
        };
        let n = 2 * F16_BLOCK + 37;
        let bytes =
            |s: usize| -> Vec<u8> { (0..n).flat_map(|i| value(i, s).to_le_bytes()).collect() };
        for op in [
            ReduceOp::Sum,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ] {
            let (mut acc, x) = (bytes(0), bytes(1));
            // unaligned views too: one byte in
            let mut shifted = vec![0u8; acc.len() + 1];
            shifted[1..].copy_from_slice(&acc);
            reduce_into(&mut acc, &x, DataType::F16, op).unwrap();
            reduce_into(&mut shifted[1..], &x, DataType::F16, op).unwrap();
            let f = in_f32(op);
            for i in 0..n {
                let want = f16::from_f32(f(value(i, 0).to_f32(), value(i, 1).to_f32()));
                let got = f16::from_le_bytes([acc[2 * i], acc[2 * i + 1]]);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{op:?} element {i}: {got} vs {want}"
                );
            }
            assert_eq!(&shifted[1..], &acc[..]);
        }
    }

    #[test]
    fn scaling_every_dtype() {
        let mut b: Vec<u8> = [7i32, -7, 100]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        scale(&mut b, DataType::I32, 0.5).unwrap();
        let got: Vec<i32> = b
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [3, -3, 50]);
        let mut b: Vec<u8> = [1.5f64, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        scale(&mut b, DataType::F64, 3.0).unwrap();
        assert_eq!(f64::from_le_bytes(b[8..].try_into().unwrap()), -6.0);
        let mut b: Vec<u8> = f16::from_f32(3.0).to_le_bytes().to_vec();
        scale(&mut b, DataType::F16, 0.25).unwrap();
        assert_eq!(f16::from_le_bytes(b[..].try_into().unwrap()).to_f32(), 0.75);
        let mut b = vec![200u8];
        scale(&mut b, DataType::U8, 0.5).unwrap();
        assert_eq!(b, [100]);
        assert!(scale(&mut [1u8], DataType::Bool, 2.0).is_err());
        assert!(scale(&mut [1u8], DataType::Bool, 1.0).is_ok());
    }

    #[test]
    fn half_codecs_round_scale_and_report_overflow() {
        let vals = [1.0f32, -2.5, 1.0 + 1.0 / 4096.0, 3.0e-8, 70000.0, f32::NAN];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut wire = vec![0u8; src.len() / 2];
        // f16: 1 + 2^-12 rounds to 1 (10 fraction bits); 3e-8 rounds to the smallest subnormal
        // 2^-24; 70000 overflows
        let lost = encode_half(&mut wire, &src, DataType::F16, 1.0).unwrap();
        assert_eq!(lost, 1);
        let mut back = vec![0u8; src.len()];
        decode_half(&mut back, &wire, DataType::F16, 2.0).unwrap();
        let got: Vec<f32> = back
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(&got[..3], &[2.0, -5.0, 2.0]);
        assert_eq!(got[3], 2.0 * 2f32.powi(-24));
        assert!(got[4].is_infinite() && got[5].is_nan());
        // bf16 keeps f32's range: nothing overflows; the factor applies before the cast
        let lost = encode_half(&mut wire, &src, DataType::BF16, 0.5).unwrap();
        assert_eq!(lost, 0);
        decode_half(&mut back, &wire, DataType::BF16, 1.0).unwrap();
        let got: Vec<f32> = back
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(&got[..3], &[0.5, -1.25, 0.5]);
        assert!((got[4] - 35000.0).abs() <= 35000.0 / 256.0);
        assert!(encode_half(&mut wire[1..], &src, DataType::F16, 1.0).is_err());
        assert!(encode_half(&mut wire, &src, DataType::F32, 1.0).is_err());
    }

    /// Infinite inputs travel as infinities of their sign and are not counted as overflows
    /// (only finite values that left the range are); bf16 keeps f32's subnormals, rounded to
    /// nearest even.
    #[test]
    fn half_codecs_pass_infinities_and_round_bf16_subnormals() {
        let vals = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            2f32.powi(-130),
            1.5 * 2f32.powi(-133),
            -(2f32.powi(-140)),
        ];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut wire = vec![0u8; src.len() / 2];
        let mut back = vec![0u8; src.len()];
        let decoded = |back: &[u8]| -> Vec<f32> {
            back.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        for dtype in [DataType::F16, DataType::BF16] {
            let lost = encode_half(&mut wire, &src, dtype, 1.0).unwrap();
            assert_eq!(lost, 0, "{dtype:?}");
            decode_half(&mut back, &wire, dtype, 1.0).unwrap();
            let got = decoded(&back);
            assert_eq!(&got[..2], &[f32::INFINITY, f32::NEG_INFINITY], "{dtype:?}");
            if dtype == DataType::F16 {
                // far below f16's smallest subnormal (2^-24): zero, of the value's sign
                assert_eq!(&got[2..], &[0.0, 0.0, 0.0]);
                assert!(got[4].is_sign_negative());
            } else {
                // bf16's subnormals step by 2^-133: 2^-130 is exact, 1.5 × 2^-133 lies halfway
                // and goes to the even 2^-132, and 2^-140 is below half a step
                assert_eq!(got[2], 2f32.powi(-130));
                assert_eq!(got[3], 2f32.powi(-132));
                assert_eq!(got[4], 0.0);
                assert!(got[4].is_sign_negative());
            }
        }
    }

    #[test]
    fn copy_scaled_is_a_copy_then_a_scale_across_pieces() {
        // more than one 64 KiB piece, and a length that is not a multiple of it
        let src: Vec<u8> = (0..40_000)
            .flat_map(|i| (i as f32 * 0.5 - 7.0).to_le_bytes())
            .collect();
        let mut want = src.clone();
        scale(&mut want, DataType::F32, 0.25).unwrap();
        let mut got = vec![0u8; src.len()];
        copy_scaled(&mut got, &src, DataType::F32, 0.25).unwrap();
        assert_eq!(got, want);
        copy_scaled(&mut got, &src, DataType::F32, 1.0).unwrap();
        assert_eq!(got, src);
        assert!(copy_scaled(&mut got[1..], &src, DataType::F32, 1.0).is_err());
        assert!(copy_scaled(&mut [0u8], &[1u8], DataType::Bool, 2.0).is_err());
    }
}
