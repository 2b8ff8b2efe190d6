//! Allreduce of f32 values that travel as 8-bit blocks (the `u8` codec): 8-bit values cannot be
//! summed on the way, so each rank owns one chunk of the batch, receives every rank's encoded
//! chunk (a reduce-scatter as an alltoall of blocks), sums them in f32, encodes the sum once
//! more and hands it to everyone (an allgather of blocks). Every rank decodes the same bytes,
//! so every rank gets the same values.
//!
//! The algorithm is written once (`allreduce`) over `Blocks`, the memory its blocks live in and
//! the transfers that move them: host memory over MPI (`HostBlocks`), GPU memory over NCCL
//! (`collective::device`). Both lay the blocks out alike (`Layout`), so the bytes on the wire
//! and the values decoded are the same on either.

use std::ops::Range;

use crate::collective::ring;
use crate::compress::quantize::{self, encoded_len};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Where each chunk and its block sit: functions of the agreed batch length and the set's size
/// only, so the same on every rank.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Values in the batch.
    pub values: usize,
    pub ranks: usize,
    pub rank: usize,
    /// Bytes from one block to the next (`quantize::block_stride` of the largest chunk).
    pub stride: usize,
}

impl Layout {
    pub fn new(values: usize, ranks: usize, rank: usize) -> Layout {
        Layout {
            values,
            ranks,
            rank,
            stride: quantize::block_stride(values.div_ceil(ranks.max(1))),
        }
    }

    /// The values of chunk `c` (as the ring splits a buffer).
    pub fn chunk(&self, c: usize) -> Range<usize> {
        ring::chunk(self.values, 1, self.ranks, c)
    }

    /// Bytes of the `ranks` blocks of a batch (and of the blocks received).
    pub fn blocks_bytes(&self) -> usize {
        self.ranks * self.stride
    }
}

/// The memory a u8 allreduce works in and the transfers between ranks. Its areas: the batch's
/// contributions `x` and what rounding lost of them, `lost` (values); the batch's blocks, the
/// blocks received, and this rank's sum.
pub trait Blocks {
    /// Encodes every chunk of `x` into its block; what rounding loses goes to `lost`.
    fn encode_batch(&mut self, l: &Layout) -> Result<()>;
    /// Sends block `c` to rank `c` while every rank's block of this rank's chunk arrives, in
    /// rank order.
    fn exchange(&mut self, l: &Layout) -> Result<()>;
    /// The received blocks' decoded values, summed in rank order from 0.0.
    fn sum_received(&mut self, l: &Layout) -> Result<()>;
    /// Encodes the sum into this rank's block, adding what rounding loses to `lost` of this
    /// rank's chunk.
    fn encode_sum(&mut self, l: &Layout) -> Result<()>;
    /// Every rank's block to every rank.
    fn gather(&mut self, l: &Layout) -> Result<()>;
}

/// The u8 allreduce of a batch: afterwards the blocks hold the reduced batch alike on every
/// rank, and `lost` what this rank's roundings lost (of its contribution everywhere, plus, on
/// its own chunk, of the sum), which its next contribution carries so the job's sum recovers it.
pub fn allreduce<B: Blocks + ?Sized>(b: &mut B, l: &Layout) -> Result<()> {
    b.encode_batch(l)?;
    b.exchange(l)?;
    b.sum_received(l)?;
    b.encode_sum(l)?;
    b.gather(l)
}

/// Scratch a host allreduce of `len` values over `n` ranks needs: (f32 values, bytes).
pub fn scratch(len: usize, n: usize) -> (usize, usize) {
    let l = Layout::new(len, n, 0);
    (2 * len.div_ceil(n.max(1)), 2 * l.blocks_bytes())
}

/// Host memory over a `Transport`'s alltoall and allgather.
pub struct HostBlocks<'a, 'b> {
    t: &'a dyn Transport,
    x: &'a [f32],
    lost: &'a mut [f32],
    /// This rank's sum, then what encoding it lost.
    values: &'a mut [f32],
    /// The batch's blocks, then the blocks received: what `reduced` keeps.
    bytes: &'b mut [u8],
}

impl<'a, 'b> HostBlocks<'a, 'b> {
    /// `values` and `bytes`: at least `scratch(x.len(), t.size())`.
    pub fn new(
        t: &'a dyn Transport,
        x: &'a [f32],
        lost: &'a mut [f32],
        values: &'a mut [f32],
        bytes: &'b mut [u8],
    ) -> Result<HostBlocks<'a, 'b>> {
        let (need_values, need_bytes) = scratch(x.len(), t.size());
        if values.len() < need_values || bytes.len() < need_bytes || lost.len() < x.len() {
            return Err(Error::Internal("u8 allreduce scratch too small".into()));
        }
        Ok(HostBlocks {
            t,
            x,
            lost,
            values,
            bytes,
        })
    }

    /// The reduced batch (after `allreduce`).
    pub fn reduced(self, l: &Layout) -> Reduced<'b> {
        Reduced {
            layout: l.clone(),
            blocks: &self.bytes[..l.blocks_bytes()],
        }
    }
}

impl Blocks for HostBlocks<'_, '_> {
    fn encode_batch(&mut self, l: &Layout) -> Result<()> {
        let blocks = &mut self.bytes[..l.blocks_bytes()];
        for (c, block) in blocks.chunks_exact_mut(l.stride).enumerate() {
            let chunk = l.chunk(c);
            let block = &mut block[..encoded_len(chunk.len())];
            quantize::encode(&self.x[chunk.clone()], block, &mut self.lost[chunk]);
        }
        Ok(())
    }

    fn exchange(&mut self, l: &Layout) -> Result<()> {
        let (blocks, recv) = self.bytes.split_at_mut(l.blocks_bytes());
        let each = vec![l.stride; l.ranks];
        let recv = &mut recv[..l.blocks_bytes()];
        self.t.alltoallv(blocks, &each, recv, &each)
    }

    fn sum_received(&mut self, l: &Layout) -> Result<()> {
        let own = l.chunk(l.rank).len();
        let recv = &self.bytes[l.blocks_bytes()..2 * l.blocks_bytes()];
        let sum = &mut self.values[..own];
        sum.fill(0.0);
        for block in recv.chunks_exact(l.stride) {
            quantize::decode(&block[..encoded_len(own)], sum, true);
        }
        Ok(())
    }

    fn encode_sum(&mut self, l: &Layout) -> Result<()> {
        let own = l.chunk(l.rank);
        let (sum, again) = self.values.split_at_mut(own.len());
        let again = &mut again[..own.len()];
        let at = l.rank * l.stride;
        quantize::encode(sum, &mut self.bytes[at..at + encoded_len(own.len())], again);
        for (lost, a) in self.lost[own].iter_mut().zip(again.iter()) {
            *lost += a;
        }
        Ok(())
    }

    fn gather(&mut self, l: &Layout) -> Result<()> {
        let each = vec![l.stride; l.ranks];
        self.t
            .allgatherv(None, &mut self.bytes[..l.blocks_bytes()], &each)
    }
}

/// The reduced batch, as the encoded blocks every rank holds alike.
pub struct Reduced<'a> {
    layout: Layout,
    blocks: &'a [u8],
}

impl Reduced<'_> {
    /// Writes the values of `span` (indices into the batch) times `factor` into `out` as
    /// little-endian f32: decoding and unpacking in one pass.
    pub fn write(&self, span: Range<usize>, factor: f32, out: &mut [u8]) {
        let l = &self.layout;
        for c in 0..l.ranks {
            let chunk = l.chunk(c);
            let (from, to) = (span.start.max(chunk.start), span.end.min(chunk.end));
            if from >= to {
                continue;
            }
            let at = c * l.stride;
            let block = &self.blocks[at..at + encoded_len(chunk.len())];
            let (min, step) = quantize::header(block);
            let (min, step) = (min * factor, step * factor);
            let first = quantize::HEADER + from - chunk.start;
            let qs = &block[first..first + (to - from)];
            let dst = &mut out[(from - span.start) * 4..(to - span.start) * 4];
            for (o, q) in dst.chunks_exact_mut(4).zip(qs) {
                o.copy_from_slice(&(min + f32::from(*q) * step).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_hold_every_chunk_at_aligned_places() {
        for values in [0, 1, 5, 16, 1000, 4097] {
            for ranks in 1..=9 {
                let l = Layout::new(values, ranks, 0);
                assert_eq!(l.stride % 16, 0);
                let mut next = 0;
                for c in 0..ranks {
                    let chunk = l.chunk(c);
                    assert_eq!(chunk.start, next);
                    next = chunk.end;
                    assert!(encoded_len(chunk.len()) <= l.stride, "{values} {ranks} {c}");
                }
                assert_eq!(next, values);
            }
        }
    }
}
