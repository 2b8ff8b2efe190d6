//! Allreduce of f32 values that travel as 8-bit blocks (the `u8` codec): 8-bit values cannot be
//! summed on the way, so each rank owns one chunk of the batch, receives every rank's encoded
//! chunk (a reduce-scatter as an alltoall of blocks), sums them in f32, encodes the sum once
//! more and hands it to everyone (an allgather of blocks). Every rank decodes the same bytes,
//! so every rank gets the same values. Written over the transport's alltoall and allgather.

use std::ops::Range;

use crate::collective::ring;
use crate::compress::quantize::{self, encoded_len};
use crate::error::Result;
use crate::transport::Transport;

/// Allreduces `x` (each rank's contribution) in place. `lost` receives what this rank's
/// rounding lost: of its contribution everywhere, plus, on the chunk it owns, of the sum (its
/// next contribution carries both, so the job's sum recovers them).
pub fn allreduce(t: &dyn Transport, x: &mut [f32], lost: &mut [f32]) -> Result<()> {
    let (n, me) = (t.size(), t.rank());
    // the same chunks on every rank: a function of the agreed length only
    let chunks: Vec<Range<usize>> = (0..n).map(|c| ring::chunk(x.len(), 1, n, c)).collect();
    let sizes: Vec<usize> = chunks.iter().map(|c| encoded_len(c.len())).collect();
    let places: Vec<usize> = sizes
        .iter()
        .scan(0, |at, s| {
            let p = *at;
            *at += s;
            Some(p)
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let mut send = vec![0u8; total];
    for ((c, p), s) in chunks.iter().zip(&places).zip(&sizes) {
        quantize::encode(&x[c.clone()], &mut send[*p..p + s], &mut lost[c.clone()]);
    }
    let mine = sizes[me];
    let mut recv = vec![0u8; n * mine];
    t.alltoallv(&send, &sizes, &mut recv, &vec![mine; n])?;
    // the owner's sum, rank by rank in f32
    let own = chunks[me].clone();
    let mut sum = vec![0f32; own.len()];
    for block in recv.chunks_exact(mine) {
        quantize::decode(block, &mut sum, true);
    }
    let mut again = vec![0f32; own.len()];
    let at = places[me];
    quantize::encode(&sum, &mut send[at..at + mine], &mut again);
    for (l, a) in lost[own].iter_mut().zip(again) {
        *l += a;
    }
    t.allgatherv(None, &mut send, &sizes)?;
    for ((c, p), s) in chunks.iter().zip(&places).zip(&sizes) {
        quantize::decode(&send[*p..p + s], &mut x[c.clone()], false);
    }
    Ok(())
}
