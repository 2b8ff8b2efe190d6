//! Which allreduce algorithm is faster for a batch of a given size: a latency–bandwidth model
//! (α seconds per message, β seconds per byte) of each level — inside a node, across nodes —
//! with the textbook cost of an allreduce as MPI runs large ones (reduce-scatter by recursive
//! halving, allgather by recursive doubling: 2⌈log₂n⌉ messages, 2(n−1)/n of the bytes), flat over
//! every rank or hierarchically (`hierarchical.rs`). Pure: the parameters are agreed (rank 0's measurement or the
//! configuration), so every rank picks the same algorithm for every batch.

/// One level's cost of a message of `b` bytes: `alpha + b * beta` seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub alpha: f64,
    pub beta: f64,
}

/// How a batch is allreduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Over every rank of the set at once (the transport's own allreduce).
    Flat,
    /// Inside each node, across nodes, inside each node again.
    Hierarchical,
}

/// How a set picks each allreduce's algorithm (agreed by every rank).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    Flat,
    Hierarchical,
    /// By size, from the model.
    Auto(CostModel),
}

impl Policy {
    pub fn choose(&self, bytes: usize) -> Algorithm {
        match self {
            Policy::Flat => Algorithm::Flat,
            Policy::Hierarchical => Algorithm::Hierarchical,
            Policy::Auto(m) => m.choose(bytes),
        }
    }
}

/// The model of a set of `nodes` nodes of `per_node` ranks each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    pub local: Link,
    pub cross: Link,
    pub per_node: usize,
    pub nodes: usize,
}

/// From this size a flat host allreduce whose ranks span nodes runs the ring over
/// point-to-point transfers: every link then sends and receives at once, where MPI's own
/// allreduce over TCP was measured at half the link's rate (BENCHMARKS.md, "issue 18, slow
/// links").
const RING_ACROSS_NODES_BYTES: usize = 4 << 20;

/// The size from which a set's flat host allreduces run the ring (0: never):
/// `FERROVOD_RING_MIN_BYTES` when set, else `RING_ACROSS_NODES_BYTES` for a set that spans
/// nodes and never inside one node. Agreed: rank 0's setting and the job's node map.
pub fn ring_min_bytes(configured: Option<usize>, spans_nodes: bool) -> usize {
    match (configured, spans_nodes) {
        (Some(bytes), _) => bytes,
        (None, true) => RING_ACROSS_NODES_BYTES,
        (None, false) => 0,
    }
}

/// An allreduce of `bytes` over `n` ranks on `link`.
fn allreduce(link: Link, n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let messages = 2.0 * (n as f64).log2().ceil();
    messages * link.alpha + 2.0 * (n - 1) as f64 / n as f64 * bytes * link.beta
}

impl CostModel {
    /// Flat over all ranks: every exchange waits for the slowest link, the cross-node one.
    pub fn flat(&self, bytes: usize) -> f64 {
        allreduce(self.cross, self.per_node * self.nodes, bytes as f64)
    }

    /// Reduce-scatter and allgather inside the node (together one allreduce's cost there), and
    /// an allreduce of a 1/per_node slice across nodes.
    pub fn hierarchical(&self, bytes: usize) -> f64 {
        let b = bytes as f64;
        allreduce(self.local, self.per_node, b)
            + allreduce(self.cross, self.nodes, b / self.per_node as f64)
    }

    pub fn choose(&self, bytes: usize) -> Algorithm {
        if self.hierarchical(bytes) < self.flat(bytes) {
            Algorithm::Hierarchical
        } else {
            Algorithm::Flat
        }
    }

    /// The smallest size from which hierarchical is chosen (None: never, within 2^40 bytes).
    /// Both costs are linear in the size, so the choice changes at most once.
    pub fn crossover(&self) -> Option<usize> {
        let limit = 1usize << 40;
        if self.choose(limit) == Algorithm::Flat {
            return None;
        }
        let (mut lo, mut hi) = (0usize, limit);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.choose(mid) {
                Algorithm::Hierarchical => hi = mid,
                Algorithm::Flat => lo = mid + 1,
            }
        }
        Some(lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn across_nodes_large_allreduces_run_the_ring_unless_configured() {
        assert_eq!(ring_min_bytes(None, false), 0);
        assert_eq!(ring_min_bytes(None, true), RING_ACROSS_NODES_BYTES);
        assert_eq!(ring_min_bytes(Some(0), true), 0);
        assert_eq!(ring_min_bytes(Some(1 << 10), false), 1 << 10);
    }

    fn model(local: (f64, f64), cross: (f64, f64), per_node: usize, nodes: usize) -> CostModel {
        CostModel {
            local: Link {
                alpha: local.0,
                beta: local.1,
            },
            cross: Link {
                alpha: cross.0,
                beta: cross.1,
            },
            per_node,
            nodes,
        }
    }

    #[test]
    fn the_crossover_is_where_the_two_costs_meet() {
        // 2 nodes x 2 ranks; local messages 200 us at 10 GB/s, cross ones 10 us at 1 Gbit/s
        let (al, bl, ac, bc) = (200e-6, 1e-10, 10e-6, 8e-9);
        let m = model((al, bl), (ac, bc), 2, 2);
        // flat: 4 ac + 3/2 S bc; hierarchical: (2 al + S bl) + (2 ac + 1/2 S bc);
        // equal where 2 ac + S bc = 2 al + S bl, i.e. S = (2 al - 2 ac) / (bc - bl)
        let analytic = (2.0 * al - 2.0 * ac) / (bc - bl);
        let got = m.crossover().expect("hierarchical wins for large batches");
        assert!((got as f64 - analytic).abs() <= 1.0, "{got} vs {analytic}");
        assert_eq!(m.choose(got - 2), Algorithm::Flat);
        assert_eq!(m.choose(got), Algorithm::Hierarchical);
        // shared memory cheaper than the network in both terms: hierarchical at every size
        let shm = model((2e-6, 1e-10), (50e-6, 8e-9), 2, 2);
        assert_eq!(shm.crossover(), Some(0));
        // a network as fast as shared memory: the same cost, and flat (fewer collectives)
        let same = model((2e-6, 1e-10), (2e-6, 1e-10), 2, 2);
        assert_eq!(same.choose(1 << 30), Algorithm::Flat);
        assert_eq!(same.crossover(), None);
    }

    #[test]
    fn latency_bound_small_batches_stay_flat_when_the_local_level_is_slow() {
        // local messages cost more than cross ones (no shared memory): small batches flat,
        // large ones hierarchical (less cross-node traffic)
        let m = model((100e-6, 1e-10), (10e-6, 8e-9), 4, 4);
        assert_eq!(m.choose(1 << 10), Algorithm::Flat);
        assert_eq!(m.choose(1 << 30), Algorithm::Hierarchical);
        let x = m.crossover().unwrap();
        assert_eq!(m.choose(x - 1), Algorithm::Flat);
        assert_eq!(m.choose(x), Algorithm::Hierarchical);
    }
}
