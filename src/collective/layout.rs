//! Where a batch's tensors sit in a fusion buffer. Rank-major (allgather's result,
//! reducescatter's input): rank by rank, and within each rank every tensor's segment in tensor
//! order. Pure, and the one copy of the walk: the host collectives copy the pieces with slices,
//! the GPU ones turn them into batched device copies, the staged GPU paths into downloads.

/// `len` bytes at `offset` of tensor `tensor`, at `place` of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub offset: usize,
    pub place: usize,
    pub len: usize,
}

/// The pieces of a rank-major buffer of `bytes[tensor][rank]`-byte segments, in buffer order;
/// each tensor's segments follow one another in the tensor, rank by rank.
pub fn rank_major(bytes: &[Vec<usize>]) -> Vec<Piece> {
    let ranks = bytes.first().map_or(0, Vec::len);
    let mut pieces = Vec::with_capacity(bytes.len() * ranks);
    let mut done = vec![0usize; bytes.len()];
    let mut place = 0;
    for r in 0..ranks {
        for (tensor, b) in bytes.iter().enumerate() {
            let len = b[r];
            pieces.push(Piece {
                tensor,
                offset: done[tensor],
                place,
                len,
            });
            done[tensor] += len;
            place += len;
        }
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_major_walks_ranks_then_tensors() {
        // two tensors over three ranks: [tensor][rank] segment bytes
        let bytes = vec![vec![2, 3, 1], vec![4, 0, 5]];
        let got: Vec<(usize, usize, usize, usize)> = rank_major(&bytes)
            .iter()
            .map(|p| (p.tensor, p.offset, p.place, p.len))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 0, 2),
                (1, 0, 2, 4),
                (0, 2, 6, 3),
                (1, 4, 9, 0),
                (0, 5, 9, 1),
                (1, 4, 10, 5),
            ]
        );
        assert!(rank_major(&[]).is_empty());
    }
}
