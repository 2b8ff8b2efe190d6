//! Replaying a fused GPU batch's launches as one CUDA graph. Launching a learned bucket's
//! copies and NCCL group one call at a time costs the host several times what one graph
//! launch of the same work costs (figures in BENCHMARKS.md, "Figures moved out of comments").
//!
//! NCCL requires a captured collective to be captured on every rank, and a replayed graph to
//! be replayed on every rank. So whether a batch runs eagerly, is captured or is replayed is
//! decided from agreed data only: the batch's agreed content, the *epoch* (which every vote
//! in which some rank's GPU tensors moved to other addresses advances), and the batches run
//! on the stream before. A batch is captured the second time it runs in an epoch and replayed
//! from the third. The addresses a graph was captured with are kept and compared at each
//! replay: a difference means the rule above was broken, and fails the batch rather than
//! reducing the wrong memory.

use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};
use crate::hashing::HashMap;
use crate::message::Response;
use crate::transport::cuda::GraphExec;

/// What identifies a batch for replay, identical on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayKey {
    /// The batch's agreed content (`batch_fingerprint`).
    pub batch: u64,
    /// The set's epoch when the batch was agreed.
    pub epoch: u64,
}

/// A fingerprint of what a batch reduces (kinds, names, shapes, types, ops, scales), in order.
pub fn batch_fingerprint(resps: &[&Response]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    for r in resps {
        r.kind.hash(&mut h);
        r.name.hash(&mut h);
        r.shape.hash(&mut h);
        r.dtype.hash(&mut h);
        r.reduce_op.hash(&mut h);
        r.prescale.to_bits().hash(&mut h);
        r.postscale.to_bits().hash(&mut h);
        r.device.hash(&mut h);
        r.compression.hash(&mut h);
    }
    h.finish()
}

/// How a batch is launched (the same on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    Eager,
    /// Record the launches as a graph, then launch the graph.
    Capture,
    Replay,
}

struct Slot {
    epoch: u64,
    /// When the slot was last used (the stream's batch count): the least recently used goes.
    used: u64,
    /// The graph and the local addresses it was captured with.
    graph: Option<(Vec<u64>, GraphExec)>,
}

/// One NCCL stream's graphs (a stream runs its batches in one order on every rank).
#[derive(Default)]
pub struct LaunchGraphs {
    slots: HashMap<u64, Slot>,
    clock: u64,
}

/// Batches remembered per NCCL stream (a step's buckets, with room for several phases of a job).
const SLOTS: usize = 64;

impl LaunchGraphs {
    /// How to launch the batch `key` (advances the stream's history: call once per batch).
    pub fn decide(&mut self, key: ReplayKey) -> Launch {
        self.clock += 1;
        let clock = self.clock;
        if let Some(slot) = self.slots.get_mut(&key.batch) {
            slot.used = clock;
            if slot.epoch != key.epoch {
                // some rank's tensors moved since: seen once in this epoch
                *slot = Slot {
                    epoch: key.epoch,
                    used: clock,
                    graph: None,
                };
                return Launch::Eager;
            }
            return match slot.graph {
                Some(_) => Launch::Replay,
                None => Launch::Capture,
            };
        }
        if self.slots.len() >= SLOTS {
            let oldest = self
                .slots
                .iter()
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k)
                .expect("slots are full");
            self.slots.remove(&oldest);
        }
        self.slots.insert(
            key.batch,
            Slot {
                epoch: key.epoch,
                used: clock,
                graph: None,
            },
        );
        Launch::Eager
    }

    /// Keeps the graph captured for `batch` (after `decide` said `Capture`).
    pub fn keep(&mut self, batch: u64, addresses: Vec<u64>, graph: GraphExec) {
        if let Some(slot) = self.slots.get_mut(&batch) {
            slot.graph = Some((addresses, graph));
        }
    }

    /// The graph of `batch` (after `decide` said `Replay`), if this rank's `addresses` are
    /// the ones it was captured with.
    pub fn graph(&self, batch: u64, addresses: &[u64]) -> Result<&GraphExec> {
        match self.slots.get(&batch).and_then(|s| s.graph.as_ref()) {
            Some((captured, g)) if captured == addresses => Ok(g),
            Some(_) => Err(Error::Internal(
                "a GPU batch agreed for replay has moved tensors on this rank".into(),
            )),
            None => Err(Error::Internal(
                "no graph for a GPU batch agreed for replay".into(),
            )),
        }
    }

    /// Forgets every batch (the fusion buffer moved, or the communicator goes: NCCL waits for
    /// the graphs that use a communicator to go first). Identical on every rank.
    pub fn clear(&mut self) {
        self.slots.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(batch: u64, epoch: u64) -> ReplayKey {
        ReplayKey { batch, epoch }
    }

    #[test]
    fn a_batch_is_captured_the_second_time_in_an_epoch() {
        let mut g = LaunchGraphs::default();
        assert_eq!(g.decide(key(7, 0)), Launch::Eager);
        assert_eq!(g.decide(key(8, 0)), Launch::Eager);
        assert_eq!(g.decide(key(7, 0)), Launch::Capture);
        // no graph kept (a capture that failed): captured again
        assert_eq!(g.decide(key(7, 0)), Launch::Capture);
        // a new epoch starts over
        assert_eq!(g.decide(key(7, 1)), Launch::Eager);
        assert_eq!(g.decide(key(7, 1)), Launch::Capture);
        assert_eq!(g.decide(key(8, 1)), Launch::Eager);
    }

    #[test]
    fn the_least_recently_used_batch_is_forgotten() {
        let mut g = LaunchGraphs::default();
        for b in 0..SLOTS as u64 {
            g.decide(key(b, 0));
        }
        // batch 0 used again: batch 1 is now the oldest
        assert_eq!(g.decide(key(0, 0)), Launch::Capture);
        assert_eq!(g.decide(key(1000, 0)), Launch::Eager);
        assert_eq!(g.slots.len(), SLOTS);
        assert_eq!(g.decide(key(0, 0)), Launch::Capture);
        assert_eq!(g.decide(key(1, 0)), Launch::Eager);
    }

    #[test]
    fn clearing_forgets_every_batch() {
        let mut g = LaunchGraphs::default();
        g.decide(key(3, 0));
        g.clear();
        assert_eq!(g.decide(key(3, 0)), Launch::Eager);
    }

    #[test]
    fn fingerprints_follow_the_agreed_content() {
        let r = |name: &str, n: i64| Response {
            kind: crate::message::OpKind::Allreduce,
            name: name.into(),
            dtype: crate::dtype::DataType::F32,
            shape: vec![n],
            first_dims: Vec::new(),
            root: 0,
            device: 0,
            reduce_op: crate::message::ReduceOp::Average,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: crate::message::Multistep::EVERY_CALL,
            result: 0,
            error: None,
        };
        let (a, b, c) = (r("a", 4), r("b", 4), r("a", 5));
        assert_eq!(batch_fingerprint(&[&a, &b]), batch_fingerprint(&[&a, &b]));
        assert_ne!(batch_fingerprint(&[&a, &b]), batch_fingerprint(&[&b, &a]));
        assert_ne!(batch_fingerprint(&[&a]), batch_fingerprint(&[&c]));
    }
}
