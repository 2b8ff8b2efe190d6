//! Allreduce of f32 values that travel as 8-bit blocks (the `u8` codec): 8-bit values cannot be
//! summed on the way, so each rank owns one chunk of the batch, receives every rank's encoded
//! chunk (a reduce-scatter as an alltoall of blocks), sums them in f32, encodes the sum once
//! more and hands it to everyone (an allgather of blocks). Every rank decodes the same bytes,
//! so every rank gets the same values. Written over the transport's alltoall and allgather.

use std::ops::Range;

use crate::collective::ring;
use crate::compress::quantize::{self, encoded_len};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Scratch an allreduce of `len` values over `n` ranks needs: (f32 values, bytes).
pub fn scratch(len: usize, n: usize) -> (usize, usize) {
    let chunk = len.div_ceil(n.max(1));
    (
        2 * chunk,
        encoded_len(len) + (n - 1) * encoded_len(0) + n * encoded_len(chunk),
    )
}

/// The reduced batch, as the encoded blocks every rank holds alike.
pub struct Reduced<'a> {
    chunks: Vec<Range<usize>>,
    places: Vec<usize>,
    blocks: &'a [u8],
}

impl Reduced<'_> {
    /// Writes the values of `span` (indices into the batch) times `factor` into `out` as
    /// little-endian f32: decoding and unpacking in one pass.
    pub fn write(&self, span: Range<usize>, factor: f32, out: &mut [u8]) {
        for (c, p) in self.chunks.iter().zip(&self.places) {
            let (from, to) = (span.start.max(c.start), span.end.min(c.end));
            if from >= to {
                continue;
            }
            let block = &self.blocks[*p..p + encoded_len(c.len())];
            let (min, step) = quantize::header(block);
            let (min, step) = (min * factor, step * factor);
            let qs = &block[quantize::HEADER + from - c.start..quantize::HEADER + to - c.start];
            let dst = &mut out[(from - span.start) * 4..(to - span.start) * 4];
            for (o, q) in dst.chunks_exact_mut(4).zip(qs) {
                o.copy_from_slice(&(min + f32::from(*q) * step).to_le_bytes());
            }
        }
    }
}

/// Allreduces `x` (each rank's contribution). `lost` receives what this rank's rounding lost:
/// of its contribution everywhere, plus, on the chunk it owns, of the sum (its next
/// contribution carries both, so the job's sum recovers them). `values` and `bytes`: at least
/// `scratch(x.len(), t.size())`; the result lives in `bytes`.
pub fn allreduce<'a>(
    t: &dyn Transport,
    x: &[f32],
    lost: &mut [f32],
    values: &mut [f32],
    bytes: &'a mut [u8],
) -> Result<Reduced<'a>> {
    let (n, me) = (t.size(), t.rank());
    // the same chunks on every rank: a function of the agreed length only
    let chunks: Vec<Range<usize>> = (0..n).map(|c| ring::chunk(x.len(), 1, n, c)).collect();
    let sizes: Vec<usize> = chunks.iter().map(|c| encoded_len(c.len())).collect();
    let places: Vec<usize> = (0..n).map(|c| sizes[..c].iter().sum()).collect();
    let (total, mine) = (sizes.iter().sum::<usize>(), sizes[me]);
    let (need_values, need_bytes) = scratch(x.len(), n);
    if values.len() < need_values || bytes.len() < need_bytes {
        return Err(Error::Internal("u8 allreduce scratch too small".into()));
    }
    let (blocks, rest) = bytes.split_at_mut(total);
    let recv = &mut rest[..n * mine];
    for ((c, p), s) in chunks.iter().zip(&places).zip(&sizes) {
        quantize::encode(&x[c.clone()], &mut blocks[*p..p + s], &mut lost[c.clone()]);
    }
    t.alltoallv(blocks, &sizes, recv, &vec![mine; n])?;
    // the owner's sum, rank by rank in f32
    let own = chunks[me].clone();
    let (sum, again) = values.split_at_mut(own.len());
    let again = &mut again[..own.len()];
    sum.fill(0.0);
    for block in recv.chunks_exact(mine) {
        quantize::decode(block, sum, true);
    }
    let at = places[me];
    quantize::encode(sum, &mut blocks[at..at + mine], again);
    for (l, a) in lost[own].iter_mut().zip(again.iter()) {
        *l += a;
    }
    t.allgatherv(None, blocks, &sizes)?;
    Ok(Reduced {
        chunks,
        places,
        blocks,
    })
}
