//! The scale model's network: α-β links on a topology of nodes × ranks per node (a fast link
//! between the ranks of one node, one NIC per node that every byte leaving or entering the node
//! crosses, whichever of its ranks sends it), and the time of each allreduce algorithm in
//! closed form. Ranks are placed node by node, so a flat ring crosses each NIC once each way.

use crate::collective::cost::Link;
use crate::collective::gossip;

/// Nodes of `per_node` ranks each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    pub nodes: usize,
    pub per_node: usize,
}

impl Topology {
    pub fn ranks(&self) -> usize {
        self.nodes * self.per_node
    }
}

/// The two kinds of link: inside a node, and a node's NIC.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fabric {
    pub inside: Link,
    pub nic: Link,
}

/// How an allreduce moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// A ring over every rank: reduce-scatter, then allgather, 2 (p − 1) steps.
    Ring,
    /// Recursive halving (reduce-scatter) then doubling (allgather), 2 log₂ p steps; a set
    /// that is not a power of two first folds its extra ranks in, and unfolds them at the end.
    HalvingDoubling,
    /// A binary tree: reduce to the root, broadcast back, whole tensors, 2 ⌈log₂ p⌉ steps.
    Tree,
    /// ferrovod's hierarchical allreduce: a reduce-scatter inside each node, one allreduce
    /// across nodes per rank of a node (all of a node's sharing its NIC), an allgather inside.
    Hierarchical,
    /// The same with halving and doubling across nodes instead of a ring.
    HierarchicalHalving,
    /// NCCL's own allreduce: its tuner's choice, per call, of the ring over every rank or its
    /// tree (a chain through each node's ranks, a binary tree across nodes, both pipelined),
    /// taken here as whichever is faster. One node: the ring.
    Nccl,
    /// Gossip's exchange in the given round: each rank swaps its tensor with its peer of the
    /// library's schedule (`gossip::peer`), through the fast link where the peer shares its
    /// node, else through the node's NIC with the node's other ranks whose peers are away.
    Exchange(u64),
}

/// The ring's time over `p` ranks on one kind of link: 2 (p − 1) steps, each moving a p-th of
/// the bytes.
pub fn ring(p: usize, bytes: f64, l: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let steps = 2.0 * (p - 1) as f64;
    steps * (l.alpha + bytes / p as f64 * l.beta)
}

/// Recursive halving and doubling over `p` ranks: 2 log₂ q steps over the largest power of
/// two q ≤ p (each rank's share halving, then doubling: 2 (q − 1)/q of the bytes in all), and
/// where p > q, the extra ranks' whole tensors folded in before and sent back after.
pub fn halving_doubling(p: usize, bytes: f64, l: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let q = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let levels = q.trailing_zeros() as f64;
    let core = 2.0 * levels * l.alpha + 2.0 * (q - 1) as f64 / q as f64 * bytes * l.beta;
    let fold = if p > q {
        2.0 * (l.alpha + bytes * l.beta)
    } else {
        0.0
    };
    core + fold
}

/// A binary tree over `p` ranks: the whole tensor up ⌈log₂ p⌉ levels and down again.
pub fn tree(p: usize, bytes: f64, l: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let depth = (usize::BITS - (p - 1).leading_zeros()) as f64;
    2.0 * depth * (l.alpha + bytes * l.beta)
}

impl Fabric {
    /// The slower of the two links, as a ring that crosses both is paced: each of its steps
    /// waits for the slowest edge.
    fn slowest(&self) -> Link {
        Link {
            alpha: self.inside.alpha.max(self.nic.alpha),
            beta: self.inside.beta.max(self.nic.beta),
        }
    }

    /// NCCL's tree allreduce over several nodes: the reduction up a chain through each node's
    /// ranks and a binary tree of the nodes, the result back down, pipelined in chunks, so
    /// that its latency is 2 (⌈log₂ nodes⌉ + ranks per node − 1) messages and each link
    /// carries about twice the bytes, as the ring's do.
    pub fn nccl_tree(&self, t: Topology, bytes: f64) -> f64 {
        let depth = (usize::BITS - (t.nodes.max(1) - 1).leading_zeros()) as f64;
        let chain = (t.per_node - 1) as f64;
        let beta = self.nic.beta.max(self.inside.beta);
        2.0 * (depth * self.nic.alpha + chain * self.inside.alpha) + 2.0 * bytes * beta
    }

    /// Seconds of gossip's exchange of `bytes` bytes per rank over `t` in round `round`: the
    /// busiest node's, whose pairs inside it use the fast link while the others share its NIC.
    pub fn exchange(&self, t: Topology, bytes: f64, round: u64) -> f64 {
        let (p, g) = (t.ranks(), t.per_node);
        (0..t.nodes)
            .map(|node| {
                let (mut inside, mut away) = (0usize, 0usize);
                for r in node * g..(node + 1) * g {
                    match gossip::peer(r, p, round) {
                        q if q == r => {}
                        q if q / g == node => inside += 1,
                        _ => away += 1,
                    }
                }
                let fast = match inside {
                    0 => 0.0,
                    _ => self.inside.alpha + bytes * self.inside.beta,
                };
                let nic = match away {
                    0 => 0.0,
                    n => self.nic.alpha + n as f64 * bytes * self.nic.beta,
                };
                fast.max(nic)
            })
            .fold(0.0, f64::max)
    }

    /// Seconds of one allreduce of `bytes` bytes per rank over `t`, by `algorithm`.
    pub fn allreduce(&self, t: Topology, bytes: f64, algorithm: Algorithm) -> f64 {
        let p = t.ranks();
        let link = match t.nodes {
            1 => self.inside,
            _ if t.per_node == 1 => self.nic,
            _ => self.slowest(),
        };
        match algorithm {
            Algorithm::Exchange(round) => self.exchange(t, bytes, round),
            Algorithm::Nccl if t.nodes == 1 => ring(p, bytes, link),
            Algorithm::Nccl => ring(p, bytes, link).min(self.nccl_tree(t, bytes)),
            Algorithm::Ring => ring(p, bytes, link),
            Algorithm::HalvingDoubling => halving_doubling(p, bytes, link),
            Algorithm::Tree => tree(p, bytes, link),
            Algorithm::Hierarchical | Algorithm::HierarchicalHalving => {
                let g = t.per_node;
                // reduce-scatter and allgather inside: each half a ring
                let inside = ring(g, bytes, self.inside);
                // g allreduces across the nodes at once, each of bytes / g, through one NIC:
                // the NIC carries them all, so its per-byte time is g times a single one's
                let shared = Link {
                    alpha: self.nic.alpha,
                    beta: self.nic.beta * g as f64,
                };
                let across = match algorithm {
                    Algorithm::Hierarchical => ring(t.nodes, bytes / g as f64, shared),
                    _ => halving_doubling(t.nodes, bytes / g as f64, shared),
                };
                inside + across
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Link = Link {
        alpha: 5e-6,
        beta: 1e-9,
    };

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn ring_halving_doubling_and_tree_are_their_closed_forms() {
        let n = 1e8;
        // ring: 2 (p - 1) α + 2 (p - 1) / p n β
        for p in [2usize, 3, 8, 100] {
            let want =
                2.0 * (p - 1) as f64 * L.alpha + 2.0 * (p - 1) as f64 / p as f64 * n * L.beta;
            assert!(close(ring(p, n, L), want), "ring at {p}");
        }
        // halving-doubling at powers of two: 2 log2 p α + 2 (p - 1) / p n β
        for (p, lg) in [(2usize, 1.0), (8, 3.0), (1024, 10.0)] {
            let want = 2.0 * lg * L.alpha + 2.0 * (p - 1) as f64 / p as f64 * n * L.beta;
            assert!(
                close(halving_doubling(p, n, L), want),
                "halving-doubling at {p}"
            );
        }
        // 12 ranks: 8 of them halve and double, 4 fold in and out (2 α + 2 n β more)
        let want = 6.0 * L.alpha + 2.0 * 7.0 / 8.0 * n * L.beta + 2.0 * (L.alpha + n * L.beta);
        assert!(close(halving_doubling(12, n, L), want));
        // tree: 2 ceil(log2 p) (α + n β)
        for (p, depth) in [(2usize, 1.0), (3, 2.0), (8, 3.0), (9, 4.0)] {
            assert!(
                close(tree(p, n, L), 2.0 * depth * (L.alpha + n * L.beta)),
                "tree at {p}"
            );
        }
        for f in [ring, halving_doubling, tree] {
            assert_eq!(f(1, n, L), 0.0);
        }
    }

    #[test]
    fn nccls_choice_is_its_ring_or_its_tree_whichever_is_faster() {
        let f = Fabric {
            inside: Link {
                alpha: 2e-6,
                beta: 1e-11,
            },
            nic: Link {
                alpha: 10e-6,
                beta: 1e-9,
            },
        };
        // one node: the ring
        let one = Topology {
            nodes: 1,
            per_node: 8,
        };
        let r = ring(8, 1e6, f.inside);
        assert!(close(f.allreduce(one, 1e6, Algorithm::Nccl), r));
        // 512 nodes of 8: the tree's 2 (9 + 7) messages against the ring's 2 × 4095
        let t = Topology {
            nodes: 512,
            per_node: 8,
        };
        let tree = 2.0 * (9.0 * 10e-6 + 7.0 * 2e-6) + 2.0 * 1e6 * 1e-9;
        assert!(close(f.nccl_tree(t, 1e6), tree));
        assert!(close(f.allreduce(t, 1e6, Algorithm::Nccl), tree));
        // 2 nodes, a large buffer: the ring moves 2 (p - 1)/p of it, less than the tree's 2
        let t = Topology {
            nodes: 2,
            per_node: 1,
        };
        let r = ring(2, 1e9, f.nic);
        assert!(close(f.allreduce(t, 1e9, Algorithm::Nccl), r));
        assert!(r < f.nccl_tree(t, 1e9));
    }

    #[test]
    fn gossip_exchanges_follow_the_librarys_schedule_inside_and_across_nodes() {
        let f = Fabric {
            inside: Link {
                alpha: 1e-6,
                beta: 1e-11,
            },
            nic: Link {
                alpha: 10e-6,
                beta: 1e-9,
            },
        };
        let bytes = 1e6;
        // the hypercube over 2 nodes of 4: rounds 0 and 1 pair ranks of a node, round 2 pairs
        // every rank with one on the other node, all four through the NIC
        let t = Topology {
            nodes: 2,
            per_node: 4,
        };
        let fast = 1e-6 + bytes * 1e-11;
        assert!(close(f.exchange(t, bytes, 0), fast));
        assert!(close(f.exchange(t, bytes, 1), fast));
        assert!(close(f.exchange(t, bytes, 2), 10e-6 + 4.0 * bytes * 1e-9));
        assert!(close(f.exchange(t, bytes, 3), fast));
        // one node: the fast link only; one rank: nothing
        let one = Topology {
            nodes: 1,
            per_node: 8,
        };
        assert!(close(f.allreduce(one, bytes, Algorithm::Exchange(5)), fast));
        let alone = Topology {
            nodes: 1,
            per_node: 1,
        };
        assert_eq!(f.exchange(alone, bytes, 0), 0.0);
        // 3 nodes of 2 (not a power of two: the tournament): in every round some rank of a
        // node has its peer away, and no node sends more than its 2 ranks' tensors
        let t = Topology {
            nodes: 3,
            per_node: 2,
        };
        for round in 0..5 {
            let e = f.exchange(t, bytes, round);
            assert!(e >= 10e-6 + bytes * 1e-9 - 1e-15, "{round}: {e}");
            assert!(e <= 10e-6 + 2.0 * bytes * 1e-9 + 1e-15, "{round}: {e}");
        }
    }

    #[test]
    fn large_tensors_favour_the_ring_and_small_ones_the_logarithmic_algorithms() {
        let (big, small, p) = (1e9, 8.0, 64);
        assert!(ring(p, big, L) < tree(p, big, L));
        assert!(halving_doubling(p, small, L) < ring(p, small, L));
        // both bandwidth-optimal ones move the same bytes
        let (r, h) = (ring(p, big, L), halving_doubling(p, big, L));
        assert!((r - h).abs() < 2.0 * p as f64 * L.alpha);
    }

    #[test]
    fn the_hierarchical_allreduce_sends_the_nic_the_flat_rings_bytes_in_fewer_steps() {
        let fabric = Fabric {
            inside: Link {
                alpha: 2e-6,
                beta: 1.0 / 300e9,
            },
            nic: Link {
                alpha: 10e-6,
                beta: 1.0 / 12.5e9,
            },
        };
        let t = Topology {
            nodes: 16,
            per_node: 8,
        };
        let n = 1e8;
        let flat = fabric.allreduce(t, n, Algorithm::Ring);
        let hier = fabric.allreduce(t, n, Algorithm::Hierarchical);
        // the NIC's bytes: 2 (p - 1)/p n for the flat ring, 2 (nodes - 1)/nodes n across
        let nic_flat = 2.0 * 127.0 / 128.0 * n * fabric.nic.beta;
        let nic_hier = 2.0 * 15.0 / 16.0 * n * fabric.nic.beta;
        assert!(close(flat, 2.0 * 127.0 * fabric.nic.alpha + nic_flat));
        let inside = 2.0 * 7.0 * (fabric.inside.alpha + n / 8.0 * fabric.inside.beta);
        assert!(close(
            hier,
            inside + 2.0 * 15.0 * fabric.nic.alpha + nic_hier
        ));
        assert!(hier < flat);
        // one node: only the fast link; one rank per node: only the NIC
        let one = Topology {
            nodes: 1,
            per_node: 8,
        };
        assert!(close(
            fabric.allreduce(one, n, Algorithm::Ring),
            ring(8, n, fabric.inside)
        ));
        let spread = Topology {
            nodes: 8,
            per_node: 1,
        };
        let ring_nic = ring(8, n, fabric.nic);
        assert!(close(
            fabric.allreduce(spread, n, Algorithm::Ring),
            ring_nic
        ));
        assert!(close(
            fabric.allreduce(spread, n, Algorithm::Hierarchical),
            ring_nic
        ));
    }
}
