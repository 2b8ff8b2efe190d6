//! Hierarchical allreduce (Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`, AIACC's and NCCL's
//! shape): a reduce-scatter inside each node, an allreduce of each node rank's slice across the
//! nodes among the ranks with the same node rank, an allgather inside each node. Only
//! 1/ranks-per-node of the data crosses the slower network between nodes; large buffers go in
//! pieces whose node work overlaps the previous piece's network transfers. Hierarchical
//! allgather (`HOROVOD_HIERARCHICAL_ALLGATHER`): an allgather inside the node, one allgather of
//! whole nodes' blocks among the nodes' first ranks, a broadcast inside the node — every byte
//! crosses the network once per node instead of once per rank. Written over the
//! transport trait: `local` holds the ranks of this node, `cross` the same node rank on every
//! node; every node holds the same number of ranks (the runtime falls back to the flat
//! collective otherwise).

pub use crate::collective::ring::Stage;
use crate::collective::ring::{self, HostWorkspace, chunk};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::ReduceOp;
use crate::transport::Transport;

/// The two levels of a set: this node's ranks, and this node rank on every node; and which
/// set ranks each node holds.
pub struct Levels<'a> {
    pub local: &'a dyn Transport,
    pub cross: &'a dyn Transport,
    /// The set ranks of each node, nodes in their cross-rank order, ranks in local-rank order.
    pub nodes: &'a [Vec<usize>],
}

/// The nodes of a set from each set rank's node id (identical on every rank): nodes ordered by
/// their lowest set rank, each node's ranks ascending — the orders `MPI_Comm_split` with the set
/// rank as key gives the cross and local communicators.
pub fn node_members(node_of_rank: &[i64]) -> Vec<Vec<usize>> {
    let mut nodes: Vec<(i64, Vec<usize>)> = Vec::new();
    for (rank, node) in node_of_rank.iter().enumerate() {
        match nodes.iter_mut().find(|(n, _)| n == node) {
            Some((_, members)) => members.push(rank),
            None => nodes.push((*node, vec![rank])),
        }
    }
    nodes.into_iter().map(|(_, m)| m).collect()
}

/// Allgather in place: `buf` holds each set rank's `counts[r]` bytes in set-rank order, this
/// rank's already in place; on return every rank's are.
pub fn allgatherv(levels: &Levels, buf: &mut [u8], counts: &[usize]) -> Result<()> {
    let offsets: Vec<usize> = counts
        .iter()
        .scan(0, |at, c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect();
    let node_index = levels.cross.rank();
    let local_rank = levels.local.rank();
    let members = levels
        .nodes
        .get(node_index)
        .ok_or_else(|| Error::Internal("hierarchical allgather: no such node".into()))?;
    let me = members[local_rank];
    // 1. inside the node, in local-rank order
    let member_counts: Vec<usize> = members.iter().map(|r| counts[*r]).collect();
    let mut node_block = vec![0u8; member_counts.iter().sum()];
    let mine = &buf[offsets[me]..offsets[me] + counts[me]];
    levels
        .local
        .allgatherv(Some(mine), &mut node_block, &member_counts)?;
    // 2. across nodes among the nodes' first ranks: whole node blocks, in node order
    let block_counts: Vec<usize> = (levels.nodes.iter())
        .map(|m| m.iter().map(|r| counts[*r]).sum())
        .collect();
    let mut all = vec![0u8; block_counts.iter().sum()];
    if local_rank == 0 {
        levels
            .cross
            .allgatherv(Some(&node_block), &mut all, &block_counts)?;
    }
    // 3. from the node's first rank to the others
    levels.local.broadcast(&mut all, 0)?;
    // the blocks, node by node, back to their set-rank places
    let mut at = 0;
    for r in levels.nodes.iter().flatten() {
        buf[offsets[*r]..offsets[*r] + counts[*r]].copy_from_slice(&all[at..at + counts[*r]]);
        at += counts[*r];
    }
    Ok(())
}

/// Size of the pieces a large hierarchical allreduce is cut into: while one piece crosses the
/// network, the next is reduce-scattered inside the node and the one before allgathered there,
/// so the node's work hides behind the slower link.
pub const PIECE_BYTES: usize = 4 << 20;

/// Allreduces `buf` (whole elements of `dtype`) in place with `op` (Sum, Min, Max or Product;
/// averaging is the caller's postscale, as for the flat collective). Buffers of more than one
/// piece are pipelined; the number of pieces depends on the size alone, so every rank cuts
/// the same.
pub fn allreduce(levels: &Levels, buf: &mut [u8], dtype: DataType, op: ReduceOp) -> Result<()> {
    allreduce_staged(levels, buf, dtype, op, &mut |_| Ok(()))
}

/// `allreduce` with the batch's packing around it (`Stage`): each piece is packed
/// before it is reduce-scattered inside the node and unpacked after its allgather there, the
/// next piece's packing and the previous one's unpacking riding along with its node work.
pub fn allreduce_staged(
    levels: &Levels,
    buf: &mut [u8],
    dtype: DataType,
    op: ReduceOp,
    stage: &mut dyn FnMut(Stage) -> Result<()>,
) -> Result<()> {
    let size = dtype.size();
    if !buf.len().is_multiple_of(size) {
        return Err(Error::Internal(format!(
            "hierarchical allreduce of {} bytes of {}",
            buf.len(),
            dtype.name()
        )));
    }
    let pieces = pieces(buf.len());
    if pieces <= 1 || levels.cross.size() == 1 {
        stage(Stage::Pack { at: 0, piece: buf })?;
        let mut piece = Piece::new(levels, 0, buf, dtype);
        piece.scatter(levels, dtype, op)?;
        levels.cross.allreduce(None, &mut piece.mine, dtype, op)?;
        piece.gather(levels)?;
        return stage(Stage::Unpack { at: 0, piece: buf });
    }
    pipelined(levels, buf, pieces, dtype, op, stage)
}

/// How many pieces a buffer of `len` bytes is cut into: pieces of `PIECE_BYTES`, and at least
/// `MIN_PIECES` of a buffer from `MIN_PIECES` MiB up, so that mid sizes overlap too.
fn pieces(len: usize) -> usize {
    if len < MIN_PIECES << 20 {
        return 1;
    }
    len.div_ceil(PIECE_BYTES).max(MIN_PIECES)
}

/// Pieces of a buffer that is pipelined at all.
const MIN_PIECES: usize = 4;

/// One piece of a hierarchical allreduce: its bytes, how they split among the node's ranks
/// (the same split on every rank of the node: a function of agreed sizes only), and this
/// rank's part once reduced inside the node.
struct Piece<'b> {
    /// Where the piece starts in the batch.
    at: usize,
    data: &'b mut [u8],
    counts: Vec<usize>,
    mine: Vec<u8>,
}

impl<'b> Piece<'b> {
    fn new(levels: &Levels, at: usize, data: &'b mut [u8], dtype: DataType) -> Piece<'b> {
        let (n, me) = (levels.local.size(), levels.local.rank());
        let elems = data.len() / dtype.size();
        let counts: Vec<usize> = (0..n)
            .map(|c| chunk(elems, dtype.size(), n, c).len())
            .collect();
        let mine = vec![0u8; counts[me]];
        Piece {
            at,
            data,
            counts,
            mine,
        }
    }

    /// This rank's part, reduced over the node's ranks.
    fn scatter(&mut self, levels: &Levels, dtype: DataType, op: ReduceOp) -> Result<()> {
        (levels.local).reduce_scatter(self.data, &mut self.mine, &self.counts, dtype, op)
    }

    /// Every part of the node back into the piece.
    fn gather(&mut self, levels: &Levels) -> Result<()> {
        (levels.local).allgatherv(Some(&self.mine), self.data, &self.counts)
    }
}

/// The pieces in turn: each crosses the nodes in the ring (`ring.rs`), and while its transfers
/// are in flight this rank packs and reduce-scatters the next piece inside the node, then
/// allgathers and unpacks the previous one. Every rank of a node runs the same node collectives
/// in the same order, and the ring's transfers are posted before them, so neither level waits
/// on the other.
fn pipelined(
    levels: &Levels,
    buf: &mut [u8],
    pieces: usize,
    dtype: DataType,
    op: ReduceOp,
    stage: &mut dyn FnMut(Stage) -> Result<()>,
) -> Result<()> {
    let size = dtype.size();
    let elems = buf.len() / size;
    let mut parts = Vec::with_capacity(pieces);
    let (mut rest, mut at) = (buf, 0);
    for k in 0..pieces {
        let len = chunk(elems, size, pieces, k).len();
        let (head, tail) = rest.split_at_mut(len);
        parts.push(Piece::new(levels, at, head, dtype));
        (rest, at) = (tail, at + len);
    }
    let mut parts = parts.into_iter();
    let mut current = parts.next();
    if let Some(first) = current.as_mut() {
        stage(Stage::Pack {
            at: first.at,
            piece: first.data,
        })?;
        first.scatter(levels, dtype, op)?;
    }
    let mut gathering: Option<Piece> = None;
    while let Some(mut piece) = current {
        let mut next = parts.next();
        let mut scattered = next.is_none();
        let mut work = || -> Result<()> {
            if !scattered {
                scattered = true;
                if let Some(n) = next.as_mut() {
                    stage(Stage::Pack {
                        at: n.at,
                        piece: n.data,
                    })?;
                    return n.scatter(levels, dtype, op);
                }
            }
            match gathering.take() {
                Some(mut g) => {
                    g.gather(levels)?;
                    stage(Stage::Unpack {
                        at: g.at,
                        piece: g.data,
                    })
                }
                None => Ok(()),
            }
        };
        let mine_elems = piece.mine.len() / size;
        {
            let mut ws = HostWorkspace::new(levels.cross, &mut piece.mine, mine_elems, dtype)?
                .overlapping(&mut work);
            ring::allreduce(&mut ws, mine_elems, dtype, op)?;
        }
        // what the ring's transfers left no room for
        work()?;
        work()?;
        gathering = Some(piece);
        current = next;
    }
    match gathering {
        Some(mut g) => {
            g.gather(levels)?;
            stage(Stage::Unpack {
                at: g.at,
                piece: g.data,
            })
        }
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::node_members;

    #[test]
    fn buffers_from_4_mib_go_in_at_least_4_pieces_of_at_most_4_mib() {
        use super::{PIECE_BYTES, pieces};
        assert_eq!(pieces(0), 1);
        assert_eq!(pieces((4 << 20) - 1), 1);
        assert_eq!(pieces(4 << 20), 4);
        assert_eq!(pieces(16 << 20), 4);
        assert_eq!(pieces((16 << 20) + 1), 5);
        for len in [5usize << 20, 100 << 20, (97 << 20) + 3] {
            assert!(len.div_ceil(pieces(len)) <= PIECE_BYTES, "{len}");
        }
    }

    #[test]
    fn nodes_are_ordered_by_their_lowest_rank_and_hold_their_ranks_ascending() {
        // ranks placed round-robin over two nodes, and a third node's
        assert_eq!(
            node_members(&[7, 3, 7, 3, 9]),
            vec![vec![0, 2], vec![1, 3], vec![4]]
        );
        assert_eq!(node_members(&[]), Vec::<Vec<usize>>::new());
    }
}
