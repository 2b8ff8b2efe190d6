//! Hierarchical allreduce (Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`, AIACC's and NCCL's
//! shape): a reduce-scatter inside each node, an allreduce of each node rank's slice across the
//! nodes among the ranks with the same node rank, an allgather inside each node. Only
//! 1/ranks-per-node of the data crosses the slower network between nodes. Hierarchical
//! allgather (`HOROVOD_HIERARCHICAL_ALLGATHER`): an allgather inside the node, one allgather of
//! whole nodes' blocks among the nodes' first ranks, a broadcast inside the node — every byte
//! crosses the network once per node instead of once per rank. Written over the
//! transport trait: `local` holds the ranks of this node, `cross` the same node rank on every
//! node; every node holds the same number of ranks (the runtime falls back to the flat
//! collective otherwise).

use crate::collective::ring::chunk;
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

/// Allreduces `buf` (whole elements of `dtype`) in place with `op` (Sum, Min, Max or Product;
/// averaging is the caller's postscale, as for the flat collective).
pub fn allreduce(levels: &Levels, buf: &mut [u8], dtype: DataType, op: ReduceOp) -> Result<()> {
    let size = dtype.size();
    if !buf.len().is_multiple_of(size) {
        return Err(Error::Internal(format!(
            "hierarchical allreduce of {} bytes of {}",
            buf.len(),
            dtype.name()
        )));
    }
    let (n, me) = (levels.local.size(), levels.local.rank());
    let elems = buf.len() / size;
    // the same split on every rank of the node: a function of agreed sizes only
    let counts: Vec<usize> = (0..n).map(|c| chunk(elems, size, n, c).len()).collect();
    let mut mine = vec![0u8; counts[me]];
    levels
        .local
        .reduce_scatter(buf, &mut mine, &counts, dtype, op)?;
    levels.cross.allreduce(None, &mut mine, dtype, op)?;
    levels.local.allgatherv(Some(&mine), buf, &counts)
}

#[cfg(test)]
mod tests {
    use super::node_members;

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
