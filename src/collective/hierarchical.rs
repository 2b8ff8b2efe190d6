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

use std::ops::Range;

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

/// How many pieces a buffer of `len` bytes is cut into: pieces of `PIECE_BYTES`, and at least
/// `MIN_PIECES` of a buffer from `MIN_PIECES` MiB up, so that mid sizes overlap too.
fn piece_count(len: usize) -> usize {
    if len < MIN_PIECES << 20 {
        return 1;
    }
    len.div_ceil(PIECE_BYTES).max(MIN_PIECES)
}

/// Pieces of a buffer that is pipelined at all.
const MIN_PIECES: usize = 4;

/// One piece of a hierarchical allreduce: where it sits in the batch (bytes) and how it splits
/// among the node's ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub at: usize,
    pub len: usize,
    /// Bytes of the piece that each local rank reduces, in local-rank order.
    pub parts: Vec<usize>,
}

impl Piece {
    /// Where local rank `r`'s part sits in the piece.
    pub fn part(&self, r: usize) -> Range<usize> {
        let start: usize = self.parts[..r].iter().sum();
        start..start + self.parts[r]
    }
}

/// The pieces of a batch of `len` bytes of `elem`-byte elements, reduced by a node of `local`
/// ranks among `nodes` nodes: functions of agreed sizes only, so every rank cuts alike. One
/// piece where nothing crosses nodes (no transfers to hide the node's work behind).
pub fn pieces(len: usize, elem: usize, local: usize, nodes: usize) -> Vec<Piece> {
    let elems = len / elem;
    let count = if nodes <= 1 { 1 } else { piece_count(len) };
    (0..count)
        .map(|k| {
            let bytes = chunk(elems, elem, count, k);
            let piece_elems = bytes.len() / elem;
            Piece {
                at: bytes.start,
                len: bytes.len(),
                parts: (0..local)
                    .map(|c| chunk(piece_elems, elem, local, c).len())
                    .collect(),
            }
        })
        .collect()
}

/// A step of the allreduce on one piece (by index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Bring the piece's values into the batch buffer (cast, scaled).
    Pack(usize),
    /// Reduce-scatter the piece inside the node: this rank's part, reduced over the node.
    Scatter(usize),
    /// Allgather the piece's parts inside the node.
    Gather(usize),
    /// Bring the piece's reduced values out to the tensors.
    Unpack(usize),
}

impl Step {
    /// The index of the piece the step works on.
    pub fn piece(self) -> usize {
        match self {
            Step::Pack(k) | Step::Scatter(k) | Step::Gather(k) | Step::Unpack(k) => k,
        }
    }
}

/// What runs in turn: a step, or a piece's part crossing the nodes with the steps that ride
/// along its transfers (in groups: each group may run while one transfer is in flight).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Turn {
    Step(Step),
    Cross {
        piece: usize,
        riders: Vec<Vec<Step>>,
    },
}

/// The order of a hierarchical allreduce of `pieces` pieces: while piece k crosses the nodes,
/// the next is packed and reduce-scattered inside the node and the one before allgathered and
/// unpacked there. Every rank of a node runs the same node collectives in the same order.
pub fn order(pieces: usize) -> Vec<Turn> {
    let mut turns = vec![Turn::Step(Step::Pack(0)), Turn::Step(Step::Scatter(0))];
    for k in 0..pieces {
        let mut riders = Vec::new();
        if k + 1 < pieces {
            riders.push(vec![Step::Pack(k + 1), Step::Scatter(k + 1)]);
        }
        if k > 0 {
            riders.push(vec![Step::Gather(k - 1), Step::Unpack(k - 1)]);
        }
        turns.push(Turn::Cross { piece: k, riders });
    }
    let last = pieces.max(1) - 1;
    turns.push(Turn::Step(Step::Gather(last)));
    turns.push(Turn::Step(Step::Unpack(last)));
    turns
}

/// The memory a hierarchical allreduce works in and its two levels: host memory over MPI
/// (`HostTiers`), GPU memory over NCCL inside the node (`collective::device`).
pub trait Tiers {
    /// Runs one step on its piece.
    fn step(&mut self, s: Step, pieces: &[Piece]) -> Result<()>;
    /// Allreduces this rank's reduced part of `pieces[k]` among the nodes, running each group
    /// of `riders` in order, while its transfers are in flight or after them.
    fn cross(&mut self, k: usize, pieces: &[Piece], riders: &[Vec<Step>]) -> Result<()>;
}

/// The hierarchical allreduce of a batch cut into `pieces`, written once for every memory.
pub fn allreduce_with<T: Tiers + ?Sized>(t: &mut T, pieces: &[Piece]) -> Result<()> {
    for turn in order(pieces.len()) {
        match turn {
            Turn::Step(s) => t.step(s, pieces)?,
            Turn::Cross { piece, riders } => t.cross(piece, pieces, &riders)?,
        }
    }
    Ok(())
}

/// Allreduces `buf` (whole elements of `dtype`) in place with `op` (Sum, Min, Max or Product;
/// averaging is the caller's postscale, as for the flat collective). Buffers of more than one
/// piece are pipelined.
pub fn allreduce(levels: &Levels, buf: &mut [u8], dtype: DataType, op: ReduceOp) -> Result<()> {
    allreduce_staged(levels, buf, dtype, op, &mut |_| Ok(()))
}

/// `allreduce` with the batch's packing around it (`Stage`): each piece is packed before it is
/// reduce-scattered inside the node and unpacked after its allgather there.
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
    let pieces = pieces(buf.len(), size, levels.local.size(), levels.cross.size());
    let mut tiers = HostTiers {
        levels,
        buf,
        dtype,
        op,
        stage,
        mine: vec![Vec::new(); pieces.len()],
    };
    allreduce_with(&mut tiers, &pieces)
}

/// Host memory over MPI at both levels: the node's reduce-scatter and allgather are MPI's, a
/// piece crosses the nodes in the ring (whose transfers carry the riders) or, with nothing to
/// hide, in MPI's own allreduce.
struct HostTiers<'a, 'b> {
    levels: &'a Levels<'a>,
    buf: &'b mut [u8],
    dtype: DataType,
    op: ReduceOp,
    stage: &'b mut dyn FnMut(Stage) -> Result<()>,
    /// Each piece's part of this rank, reduced over the node.
    mine: Vec<Vec<u8>>,
}

impl HostTiers<'_, '_> {
    fn run(&mut self, group: &[Step], pieces: &[Piece]) -> Result<()> {
        group.iter().try_for_each(|s| self.step(*s, pieces))
    }
}

impl Tiers for HostTiers<'_, '_> {
    fn step(&mut self, s: Step, pieces: &[Piece]) -> Result<()> {
        let k = s.piece();
        let p = &pieces[k];
        let data = &mut self.buf[p.at..p.at + p.len];
        match s {
            Step::Pack(_) => (self.stage)(Stage::Pack {
                at: p.at,
                piece: data,
            }),
            Step::Unpack(_) => (self.stage)(Stage::Unpack {
                at: p.at,
                piece: data,
            }),
            Step::Scatter(_) => {
                let mine = &mut self.mine[k];
                mine.resize(p.parts[self.levels.local.rank()], 0);
                (self.levels.local).reduce_scatter(data, mine, &p.parts, self.dtype, self.op)
            }
            Step::Gather(_) => {
                let mine = std::mem::take(&mut self.mine[k]);
                (self.levels.local).allgatherv(Some(&mine), data, &p.parts)
            }
        }
    }

    fn cross(&mut self, k: usize, pieces: &[Piece], riders: &[Vec<Step>]) -> Result<()> {
        let (cross, dtype, op) = (self.levels.cross, self.dtype, self.op);
        let mut mine = std::mem::take(&mut self.mine[k]);
        if riders.is_empty() || cross.size() == 1 {
            cross.allreduce(None, &mut mine, dtype, op)?;
            self.mine[k] = mine;
            return self.run(&riders.concat(), pieces);
        }
        let mut left = riders.iter();
        let mut work = || match left.next() {
            Some(group) => self.run(group, pieces),
            None => Ok(()),
        };
        let elems = mine.len() / dtype.size();
        {
            let mut ws = HostWorkspace::new(cross, &mut mine, elems, dtype)?.overlapping(&mut work);
            ring::allreduce(&mut ws, elems, dtype, op)?;
        }
        // what the ring's transfers left no room for
        for group in left {
            self.run(group, pieces)?;
        }
        self.mine[k] = mine;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::node_members;

    #[test]
    fn buffers_from_4_mib_go_in_at_least_4_pieces_of_at_most_4_mib() {
        use super::{PIECE_BYTES, piece_count};
        assert_eq!(piece_count(0), 1);
        assert_eq!(piece_count((4 << 20) - 1), 1);
        assert_eq!(piece_count(4 << 20), 4);
        assert_eq!(piece_count(16 << 20), 4);
        assert_eq!(piece_count((16 << 20) + 1), 5);
        for len in [5usize << 20, 100 << 20, (97 << 20) + 3] {
            assert!(len.div_ceil(piece_count(len)) <= PIECE_BYTES, "{len}");
        }
    }

    #[test]
    fn pieces_cover_the_batch_once_and_split_alike_among_the_node() {
        use super::pieces;
        for (len, elem, local, nodes) in [
            (0, 4, 2, 2),
            (12, 4, 4, 2),
            ((17 << 20) + 6, 2, 3, 2),
            (64 << 20, 4, 4, 1),
        ] {
            let ps = pieces(len, elem, local, nodes);
            assert_eq!(ps.len() == 1, nodes == 1 || len < 4 << 20, "{len} {nodes}");
            let mut next = 0;
            for p in &ps {
                assert_eq!(p.at, next);
                assert_eq!(p.parts.len(), local);
                assert_eq!(p.parts.iter().sum::<usize>(), p.len);
                assert!(p.parts.iter().all(|b| b % elem == 0));
                assert_eq!(p.part(local - 1).end, p.len);
                next += p.len;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn each_piece_goes_pack_scatter_cross_gather_unpack_with_its_neighbours_riding_along() {
        use super::{Turn, order};
        for n in 1..6 {
            // flatten: a crossing's riders run after the crossing starts
            let mut seen = Vec::new();
            for turn in order(n) {
                match turn {
                    Turn::Step(s) => seen.push((s.piece(), format!("{s:?}"))),
                    Turn::Cross { piece, riders } => {
                        assert!(riders.len() <= 2);
                        for s in riders.iter().flatten() {
                            assert!(s.piece().abs_diff(piece) == 1, "{n}: {s:?} rides {piece}");
                        }
                        seen.push((piece, format!("Cross({piece})")));
                        seen.extend(
                            riders
                                .iter()
                                .flatten()
                                .map(|s| (s.piece(), format!("{s:?}"))),
                        );
                    }
                }
            }
            for k in 0..n {
                let mine: Vec<String> = seen
                    .iter()
                    .filter(|(p, _)| *p == k)
                    .map(|(_, s)| s.clone())
                    .collect();
                let want: Vec<String> = ["Pack", "Scatter", "Cross", "Gather", "Unpack"]
                    .iter()
                    .map(|w| format!("{w}({k})"))
                    .collect();
                assert_eq!(mine, want, "{n} pieces");
            }
            // one piece: nothing rides along
            if n == 1 {
                assert!(order(1).iter().all(|t| match t {
                    Turn::Cross { riders, .. } => riders.is_empty(),
                    _ => true,
                }));
            }
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
