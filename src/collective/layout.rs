//! Where a batch's tensors sit in a fusion buffer. Consecutive (allreduce, one rank's part of
//! an allgather, reducescatter's output): tensor after tensor. Rank-major (allgather's result,
//! reducescatter's input): rank by rank, and within each rank every tensor's segment in tensor
//! order. Pure, and the one copy of each walk: the host collectives copy the pieces with slices
//! (scaling or casting on the way), the GPU ones turn them into batched device copies, the
//! staged GPU paths into uploads and downloads.

/// `len` bytes at `offset` of tensor `tensor`, at `place` of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub offset: usize,
    pub place: usize,
    pub len: usize,
}

/// The pieces of a buffer holding tensors of `lens` bytes one after another, in tensor order.
pub fn consecutive(lens: impl IntoIterator<Item = usize>) -> Vec<Piece> {
    let mut place = 0;
    lens.into_iter()
        .enumerate()
        .map(|(tensor, len)| {
            let p = Piece {
                tensor,
                offset: 0,
                place,
                len,
            };
            place += len;
            p
        })
        .collect()
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
    fn consecutive_places_tensors_one_after_another() {
        let got: Vec<(usize, usize, usize, usize)> = consecutive([3, 0, 5])
            .iter()
            .map(|p| (p.tensor, p.offset, p.place, p.len))
            .collect();
        assert_eq!(got, [(0, 0, 0, 3), (1, 0, 3, 0), (2, 0, 3, 5)]);
    }

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
