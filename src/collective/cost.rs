//! Which allreduce algorithm is faster for a batch of a given size: a latency–bandwidth model
//! of each level — inside a node, across nodes — and of the whole set. Latency is charged per
//! collective *call* (α: what one small allreduce on that level takes, synchronisation and
//! software included), bandwidth per byte (β) as MPI moves large allreduces (2(n−1)/n of the
//! bytes over each rank's link). Flat is one call over every rank; hierarchical
//! (`hierarchical.rs`) is three: a reduce-scatter and an allgather inside the node, an allreduce
//! across nodes, their latency measured together — so small batches, bound by calls, stay flat,
//! and large ones, bound by the network, go hierarchical. Pure: the parameters are agreed (rank
//! 0's measurement or the configuration), so every rank picks the same algorithm for every
//! batch.

/// One level's costs: `alpha` seconds per collective call, `beta` seconds per byte a rank
/// sends over it.
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
    /// Seconds of one small allreduce over every rank of the set.
    pub flat_alpha: f64,
    /// Seconds of one small hierarchical allreduce (its three calls in a row: measured whole,
    /// so what a call inside a busy node really costs is in it).
    pub hier_alpha: f64,
    pub per_node: usize,
    pub nodes: usize,
}

/// From this size a flat host allreduce over one rank on each of several nodes runs the ring
/// over point-to-point transfers: every link sends and receives at once, and the batch's
/// packing rides inside the transfers; MPI's own allreduce of the fused batch was no faster
/// across emulated hosts (BENCHMARKS.md, 2026-11-25 to 2026-11-27, the slow-link
/// measurements on 2 hosts × 1 rank).
const RING_ACROSS_NODES_BYTES: usize = 4 << 20;

/// The size from which a set's flat host allreduces run the ring (0: never):
/// `FERROVOD_RING_MIN_BYTES` when set, else `RING_ACROSS_NODES_BYTES` for a set of one rank on
/// each of several nodes, and never otherwise. Inside one node MPI's shared memory is faster,
/// and where a node holds several of the set's ranks the ring sends 1.5 × the data or more
/// across each node's link, more than MPI's own allreduce did in every placement measured
/// (BENCHMARKS.md, 2026-11-27, flat's algorithm by placement). `set_nodes`: the node of each
/// of the set's ranks. Agreed: rank 0's setting and the job's node map.
pub fn ring_min_bytes(configured: Option<usize>, set_nodes: &[i32]) -> usize {
    if let Some(bytes) = configured {
        return bytes;
    }
    let mut distinct = set_nodes.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() > 1 && distinct.len() == set_nodes.len() {
        RING_ACROSS_NODES_BYTES
    } else {
        0
    }
}

/// The bandwidth term of an allreduce of `bytes` over `n` ranks on `link`: each rank sends
/// 2(n−1)/n of the bytes.
fn moved(link: Link, n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    2.0 * (n - 1) as f64 / n as f64 * bytes * link.beta
}

impl CostModel {
    /// A model from per-message latencies (the textbook's: a small allreduce over n ranks
    /// takes 2⌈log₂n⌉ messages; over the set, that many inside the node and across nodes), for
    /// predictions where no call was measured.
    pub fn from_messages(local: Link, cross: Link, per_node: usize, nodes: usize) -> CostModel {
        let steps = |n: usize| 2.0 * (n.max(1) as f64).log2().ceil();
        CostModel {
            local: Link {
                alpha: steps(per_node) * local.alpha,
                beta: local.beta,
            },
            cross: Link {
                alpha: steps(nodes) * cross.alpha,
                beta: cross.beta,
            },
            flat_alpha: steps(per_node) * local.alpha + steps(nodes) * cross.alpha,
            hier_alpha: 2.0 * steps(per_node) * local.alpha + steps(nodes) * cross.alpha,
            per_node,
            nodes,
        }
    }

    /// One call over all ranks; every exchange waits for the slowest link, the cross-node one.
    pub fn flat(&self, bytes: usize) -> f64 {
        self.flat_alpha + moved(self.cross, self.per_node * self.nodes, bytes as f64)
    }

    /// A reduce-scatter and an allgather inside the node (two calls, together an allreduce's
    /// bytes there) and an allreduce of a 1/per_node slice across nodes.
    pub fn hierarchical(&self, bytes: usize) -> f64 {
        let b = bytes as f64;
        self.hier_alpha
            + moved(self.local, self.per_node, b)
            + moved(self.cross, self.nodes, b / self.per_node as f64)
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
    fn one_rank_per_node_across_nodes_runs_the_ring_unless_configured() {
        // one node; one rank on each of two and of three nodes (any order)
        assert_eq!(ring_min_bytes(None, &[0, 0]), 0);
        assert_eq!(ring_min_bytes(None, &[0, 1]), RING_ACROSS_NODES_BYTES);
        assert_eq!(ring_min_bytes(None, &[2, 0, 1]), RING_ACROSS_NODES_BYTES);
        assert_eq!(ring_min_bytes(None, &[0]), 0);
        // several ranks on a node: in blocks, round-robin, uneven
        assert_eq!(ring_min_bytes(None, &[0, 0, 1, 1]), 0);
        assert_eq!(ring_min_bytes(None, &[0, 1, 0, 1]), 0);
        assert_eq!(ring_min_bytes(None, &[0, 0, 1]), 0);
        // a setting wins everywhere
        assert_eq!(ring_min_bytes(Some(0), &[0, 1]), 0);
        assert_eq!(ring_min_bytes(Some(1 << 10), &[0, 0]), 1 << 10);
        assert_eq!(ring_min_bytes(Some(1 << 10), &[0, 0, 1, 1]), 1 << 10);
    }

    fn model(
        local: (f64, f64),
        cross: (f64, f64),
        flat_alpha: f64,
        per_node: usize,
        nodes: usize,
    ) -> CostModel {
        // its three calls as the sum of each level's
        let hier_alpha = 2.0 * local.0 + cross.0;
        CostModel {
            local: Link {
                alpha: local.0,
                beta: local.1,
            },
            cross: Link {
                alpha: cross.0,
                beta: cross.1,
            },
            flat_alpha,
            hier_alpha,
            per_node,
            nodes,
        }
    }

    #[test]
    fn the_crossover_is_where_the_two_costs_meet() {
        // 2 nodes x 2 ranks; calls inside a node 20 us at 10 GB/s, across nodes 40 us at
        // 1 Gbit/s, over all four 50 us
        let (al, bl, ac, bc, af) = (20e-6, 1e-10, 40e-6, 8e-9, 50e-6);
        let m = model((al, bl), (ac, bc), af, 2, 2);
        // flat: af + 3/2 S bc; hierarchical: 2 al + ac + S bl + 1/2 S bc;
        // equal where af + S bc = 2 al + ac + S bl, i.e. S = (2 al + ac - af) / (bc - bl)
        let analytic = (2.0 * al + ac - af) / (bc - bl);
        let got = m.crossover().expect("hierarchical wins for large batches");
        assert!((got as f64 - analytic).abs() <= 1.0, "{got} vs {analytic}");
        assert_eq!(m.choose(got - 2), Algorithm::Flat);
        assert_eq!(m.choose(got), Algorithm::Hierarchical);
        // small batches are bound by calls: one flat call beats three
        assert_eq!(m.choose(1 << 10), Algorithm::Flat);
        // calls cheaper than one flat call: hierarchical at every size
        let cheap = model((2e-6, 1e-10), (10e-6, 8e-9), 50e-6, 2, 2);
        assert_eq!(cheap.crossover(), Some(0));
        // a network as fast as shared memory: flat (fewer calls, the same bytes per link)
        let same = model((2e-6, 1e-10), (2e-6, 1e-10), 4e-6, 2, 2);
        assert_eq!(same.choose(1 << 30), Algorithm::Flat);
        assert_eq!(same.crossover(), None);
    }

    #[test]
    fn small_batches_follow_the_measured_hierarchical_call_not_its_parts() {
        // its parts (2 x 1 us inside the node + 20 us across) undercut one flat call of 30 us,
        // but the three calls in a row were measured at 40 us: small batches stay flat, and the
        // crossover moves to where the bandwidth saved pays for the 10 us
        let mut m = model((1e-6, 1e-10), (20e-6, 8e-9), 30e-6, 2, 2);
        assert_eq!(m.crossover(), Some(0));
        m.hier_alpha = 40e-6;
        assert_eq!(m.choose(1 << 10), Algorithm::Flat);
        let analytic = (m.hier_alpha - m.flat_alpha) / (8e-9 - 1e-10);
        let got = m.crossover().expect("hierarchical wins for large batches") as f64;
        assert!((got - analytic).abs() <= 1.0, "{got} vs {analytic}");
    }

    #[test]
    fn from_messages_counts_each_levels_steps() {
        let m = CostModel::from_messages(
            Link {
                alpha: 1e-6,
                beta: 1e-10,
            },
            Link {
                alpha: 10e-6,
                beta: 8e-9,
            },
            8,
            16,
        );
        // 2 log2 8 = 6 messages inside a node, 2 log2 16 = 8 across nodes
        assert!((m.local.alpha - 6e-6).abs() < 1e-12);
        assert!((m.cross.alpha - 80e-6).abs() < 1e-12);
        assert!((m.flat_alpha - 86e-6).abs() < 1e-12);
        assert!((m.hier_alpha - 92e-6).abs() < 1e-12);
        assert_eq!(m.local.beta, 1e-10);
        // large batches: the network's bytes rule, hierarchical sends 1/8 of them
        assert_eq!(m.choose(100 << 20), Algorithm::Hierarchical);
        let x = m.crossover().unwrap();
        assert_eq!(m.choose(x.saturating_sub(1)), Algorithm::Flat);
    }
}
