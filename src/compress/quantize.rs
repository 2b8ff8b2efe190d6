//! 8-bit min-max quantization of f32 values, for the `u8` codec: a block travels as its minimum
//! and step (two f32) and one byte per value, `q = round((x - min) / step)` with
//! `step = (max - min) / 255`. What rounding loses is returned per value, for error feedback.

/// Bytes before a block's values: its minimum and step, little-endian f32.
pub const HEADER: usize = 8;

/// The encoded size of `values` f32 values.
pub fn encoded_len(values: usize) -> usize {
    HEADER + values
}

/// The bytes from one block to the next in a batch of blocks of up to `values` values: the
/// encoding rounded up so that every block's header is 16-byte aligned (what the GPU kernels
/// read; the host lays batches out alike, so the wire carries the same bytes).
pub fn block_stride(values: usize) -> usize {
    encoded_len(values).next_multiple_of(16)
}

/// Encodes `x` into `out` (`encoded_len(x.len())` bytes) and writes `x - decoded` into `lost`.
/// A block holding NaN or an infinity encodes as NaN throughout, so it stays visible in sums,
/// and loses nothing (a NaN kept for the next step would spoil every later one).
pub fn encode(x: &[f32], out: &mut [u8], lost: &mut [f32]) {
    debug_assert_eq!(out.len(), encoded_len(x.len()));
    let (lo, hi, finite) = bounds(x);
    let (cap, wide_step) = top(lo, hi);
    let (min, step) = match (finite, x.is_empty()) {
        (_, true) => (0.0, 0.0),
        (false, _) => (f32::NAN, f32::NAN),
        (true, _) => (lo, wide_step),
    };
    out[..4].copy_from_slice(&min.to_le_bytes());
    out[4..HEADER].copy_from_slice(&step.to_le_bytes());
    if !min.is_finite() {
        out[HEADER..].fill(0);
        lost.fill(0.0);
        return;
    }
    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
    if inv.is_finite() {
        quantize_block(x, &mut out[HEADER..], lost, min, cap, step, |d| d * inv);
    } else {
        // a step so small (subnormal) that its inverse overflows: divide instead
        quantize_block(x, &mut out[HEADER..], lost, min, cap, step, |d| d / step);
    }
}

/// One block's values, `scale` taking a value's distance from `min` to steps.
fn quantize_block(
    x: &[f32],
    out: &mut [u8],
    lost: &mut [f32],
    min: f32,
    cap: f32,
    step: f32,
    scale: impl Fn(f32) -> f32,
) {
    for ((v, q), l) in x.iter().zip(out).zip(lost) {
        // (v - min) / step lies in [0, 255]: adding 1.5 * 2^23 rounds it to the nearest
        // integer, which then sits in the low mantissa bits (no float-to-int conversion)
        let shifted = scale(v.min(cap) - min) + ROUND;
        *q = (shifted.to_bits() & 0xff) as u8;
        // saturated: only a range beyond f32 can leave more than f32::MAX behind
        *l = (v - (min + (shifted - ROUND) * step)).clamp(-f32::MAX, f32::MAX);
    }
}

/// The largest value a block from `lo` to `hi` encodes, and its step: `hi` and a 255th of the
/// range, unless the range, or the top that 255 steps reach, exceeds what an f32 holds (then
/// `lo` plus 255 steps of a 256th of the room up to f32::MAX from `lo`, or from 0 where `lo` is
/// negative: exact and finite. Larger values come back as that, and the rest stays in their
/// residuals, finite). The GPU's `fv_u8_encode` computes the same.
fn top(lo: f32, hi: f32) -> (f32, f32) {
    let step = (hi - lo) / 255.0;
    if (hi - lo).is_finite() && (lo + 255.0 * step).is_finite() {
        return (hi, step);
    }
    let room = if lo < 0.0 { f32::MAX } else { f32::MAX - lo };
    let step = room / 256.0;
    (lo + 255.0 * step, step)
}

/// 1.5 * 2^23: floats from it to 2^24 are integers one apart.
const ROUND: f32 = 12_582_912.0;

/// The minimum and maximum of `x`, and whether every value is finite, in lanes the compiler
/// can vectorise (comparisons rather than f32::min/max, which skip NaN; `v * 0.0` is NaN for
/// NaN and infinities).
fn bounds(x: &[f32]) -> (f32, f32, bool) {
    const LANES: usize = 16;
    let (mut lo, mut hi, mut poison) = (
        [f32::INFINITY; LANES],
        [f32::NEG_INFINITY; LANES],
        [0f32; LANES],
    );
    let mut blocks = x.chunks_exact(LANES);
    for b in &mut blocks {
        for j in 0..LANES {
            lo[j] = if b[j] < lo[j] { b[j] } else { lo[j] };
            hi[j] = if b[j] > hi[j] { b[j] } else { hi[j] };
            poison[j] += b[j] * 0.0;
        }
    }
    for v in blocks.remainder() {
        lo[0] = if *v < lo[0] { *v } else { lo[0] };
        hi[0] = if *v > hi[0] { *v } else { hi[0] };
        poison[0] += v * 0.0;
    }
    let lo = lo
        .iter()
        .fold(f32::INFINITY, |a, b| if *b < a { *b } else { a });
    let hi = hi
        .iter()
        .fold(f32::NEG_INFINITY, |a, b| if *b > a { *b } else { a });
    (lo, hi, poison.iter().all(|p| *p == 0.0))
}

/// A block's minimum and step.
pub fn header(block: &[u8]) -> (f32, f32) {
    let min = f32::from_le_bytes(block[..4].try_into().expect("4 bytes"));
    let step = f32::from_le_bytes(block[4..HEADER].try_into().expect("4 bytes"));
    (min, step)
}

/// Decodes a block into `out` (`src` is `encoded_len(out.len())` bytes); with `add`, adds the
/// decoded values to `out` instead.
pub fn decode(src: &[u8], out: &mut [f32], add: bool) {
    debug_assert_eq!(src.len(), encoded_len(out.len()));
    let (min, step) = header(src);
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
        let (back, lost) = round_trip(&[1.0, f32::NAN, 3.0]);
        assert!(back.iter().all(|v| v.is_nan()));
        assert_eq!(lost, vec![0.0; 3]);
        let (back, lost) = round_trip(&[1.0, f32::INFINITY]);
        assert!(back.iter().all(|v| !v.is_finite()));
        assert_eq!(lost, vec![0.0; 2]);
    }

    /// A finite block whose range exceeds f32::MAX: values and residuals stay finite, and
    /// what came back plus what was lost is the input.
    #[test]
    fn a_range_beyond_f32_stays_finite() {
        let x = [-3.0e38f32, 3.0e38, 0.0, 1.0e38, -1.0, -1.4222479e38];
        // the widest range: what is left of the top value saturates, finite
        let (back, lost) = round_trip(&[-f32::MAX, f32::MAX, 3.3961512e38]);
        assert!(
            back.iter().chain(&lost).all(|v| v.is_finite()),
            "{back:?} {lost:?}"
        );
        let (back, lost) = round_trip(&x);
        for ((v, b), l) in x.iter().zip(&back).zip(&lost) {
            assert!(
                b.is_finite() && l.is_finite(),
                "{v} came back {b}, lost {l}"
            );
            let rel = ((b + l) as f64 - *v as f64).abs() / 3.0e38;
            assert!(rel < 1e-6, "{v}: {b} + {l}");
        }
        assert_eq!(back[0], -3.0e38);
    }

    /// A finite range whose 255 steps, rounded, reach past f32::MAX (values near f32::MAX
    /// above a large positive minimum, found by fuzzing): what comes back stays finite, and
    /// what came back plus what was lost is the input.
    #[test]
    fn a_top_near_f32_max_stays_finite() {
        let x = [
            3.4028235e38f32,
            3.396118e38,
            1.4588146e38,
            3.3961514e38,
            3.3296642e38,
            3.396135e38,
        ];
        let (back, lost) = round_trip(&x);
        for ((v, b), l) in x.iter().zip(&back).zip(&lost) {
            assert!(
                b.is_finite() && l.is_finite(),
                "{v} came back {b}, lost {l}"
            );
            let rel = ((*b as f64 + *l as f64) - *v as f64).abs() / 3.4e38;
            assert!(rel < 1e-6, "{v}: {b} + {l}");
        }
        assert_eq!(back[2], 1.4588146e38);
    }

    /// Subnormal ranges: a step whose inverse overflows still encodes (found by fuzzing).
    #[test]
    fn a_subnormal_step_stays_finite() {
        let x = [f32::from_bits(0x20f6), f32::from_bits(0x009d_0400)];
        let (back, lost) = round_trip(&x);
        for ((v, b), l) in x.iter().zip(&back).zip(&lost) {
            assert!(
                b.is_finite() && l.is_finite(),
                "{v} came back {b}, lost {l}"
            );
            assert_eq!(b + l, *v);
        }
    }
}
