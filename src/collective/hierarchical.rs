//! Hierarchical allreduce (Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`, AIACC's and NCCL's
//! shape): a reduce-scatter inside each node, an allreduce of each node rank's slice across the
//! nodes among the ranks with the same node rank, an allgather inside each node. Only
//! 1/ranks-per-node of the data crosses the slower network between nodes. Written over the
//! transport trait: `local` holds the ranks of this node, `cross` the same node rank on every
//! node; every node holds the same number of ranks (the runtime falls back to the flat
//! collective otherwise).

use crate::collective::ring::chunk;
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::ReduceOp;
use crate::transport::Transport;

/// The two levels of a set: this node's ranks, and this node rank on every node.
pub struct Levels<'a> {
    pub local: &'a dyn Transport,
    pub cross: &'a dyn Transport,
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
