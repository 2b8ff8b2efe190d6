//! 8-bit min-max quantization of f32 values, for the `u8` codec: a block travels as its minimum
//! and step (two f32) and one byte per value, `q = round((x - min) / step)` with
//! `step = (max - min) / 255`. What rounding loses is returned per value, for error feedback.

/// Bytes before a block's values: its minimum and step, little-endian f32.
pub const HEADER: usize = 8;

/// The encoded size of `values` f32 values.
pub fn encoded_len(values: usize) -> usize {
    HEADER + values
}

/// Encodes `x` into `out` (`encoded_len(x.len())` bytes) and writes `x - decoded` into `lost`.
/// A block holding NaN or an infinity encodes as NaN throughout, so it stays visible in sums.
pub fn encode(x: &[f32], out: &mut [u8], lost: &mut [f32]) {
    debug_assert_eq!(out.len(), encoded_len(x.len()));
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for v in x {
        lo = lo.min(*v);
        hi = hi.max(*v);
    }
    let finite = x.iter().all(|v| v.is_finite());
    let (min, step) = match (finite, x.is_empty()) {
        (_, true) => (0.0, 0.0),
        (false, _) => (f32::NAN, f32::NAN),
        (true, _) => (lo, (hi - lo) / 255.0),
    };
    out[..4].copy_from_slice(&min.to_le_bytes());
    out[4..HEADER].copy_from_slice(&step.to_le_bytes());
    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
    for ((v, q), l) in x.iter().zip(&mut out[HEADER..]).zip(lost) {
        let k = ((v - min) * inv).round().clamp(0.0, 255.0);
        *q = k as u8;
        *l = v - (min + k * step);
    }
}

/// Decodes a block into `out` (`src` is `encoded_len(out.len())` bytes); with `add`, adds the
/// decoded values to `out` instead.
pub fn decode(src: &[u8], out: &mut [f32], add: bool) {
    debug_assert_eq!(src.len(), encoded_len(out.len()));
    let min = f32::from_le_bytes(src[..4].try_into().expect("4 bytes"));
    let step = f32::from_le_bytes(src[4..HEADER].try_into().expect("4 bytes"));
    let values = src[HEADER..].iter().map(|q| min + f32::from(*q) * step);
    match add {
        true => out.iter_mut().zip(values).for_each(|(o, v)| *o += v),
        false => out.iter_mut().zip(values).for_each(|(o, v)| *o = v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut buf = vec![0u8; encoded_len(x.len())];
        let mut lost = vec![0f32; x.len()];
        encode(x, &mut buf, &mut lost);
        let mut back = vec![0f32; x.len()];
        decode(&buf, &mut back, false);
        (back, lost)
    }

    #[test]
    fn values_come_back_within_half_a_step_and_the_loss_is_exact() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 * 0.013 - 0.4)
            .collect();
        let (back, lost) = round_trip(&x);
        let (lo, hi) = (-0.4f32, 100.0 * 0.013 - 0.4);
        let step = (hi - lo) / 255.0;
        for ((v, b), l) in x.iter().zip(&back).zip(&lost) {
            assert!((v - b).abs() <= step / 2.0 * 1.0001, "{v} came back {b}");
            assert!((v - b - l).abs() <= 1e-6, "lost {l} for {v} -> {b}");
        }
        // the extremes are exact
        assert_eq!(back[x.iter().position(|v| *v == lo).unwrap()], lo);
        // decode with add accumulates
        let mut buf = vec![0u8; encoded_len(x.len())];
        encode(&x, &mut buf, &mut vec![0.0; x.len()]);
        let mut acc = vec![1.0f32; x.len()];
        decode(&buf, &mut acc, true);
        for (a, b) in acc.iter().zip(&back) {
            assert!((a - (1.0 + b)).abs() <= 1e-6);
        }
    }

    #[test]
    fn constant_empty_and_non_finite_blocks() {
        let (back, lost) = round_trip(&[2.5; 7]);
        assert_eq!(back, vec![2.5; 7]);
        assert_eq!(lost, vec![0.0; 7]);
        assert!(round_trip(&[]).0.is_empty());
        let (back, _) = round_trip(&[1.0, f32::NAN, 3.0]);
        assert!(back.iter().all(|v| v.is_nan()));
        let (back, _) = round_trip(&[1.0, f32::INFINITY]);
        assert!(back.iter().all(|v| !v.is_finite()));
    }
}
