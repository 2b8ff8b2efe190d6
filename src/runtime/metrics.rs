//! Counters of what agreeing and moving data cost this process, kept by the background thread
//! and readable at any time (C API `fv_metrics`, Python `hvd.metrics()`), so the cost of each
//! negotiation mode can be measured in real training, not only in benchmarks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(test)]
use crate::compress::TopK;
use crate::compress::{Codec, Wire};
use crate::dtype::DataType;
use crate::message::Response;

#[derive(Default)]
pub struct Metrics {
    cycles: AtomicU64,
    control_collectives: AtomicU64,
    control_bytes: AtomicU64,
    negotiation_ns: AtomicU64,
    data_collectives: AtomicU64,
    data_bytes: AtomicU64,
    fused_batches: AtomicU64,
    tensors: AtomicU64,
    graph_launches: AtomicU64,
    hierarchical_batches: AtomicU64,
    wire_uncompressed: AtomicU64,
    wire_fp16: AtomicU64,
    wire_bf16: AtomicU64,
    wire_u8: AtomicU64,
    wire_powersgd: AtomicU64,
    wire_topk: AtomicU64,
}

/// A copy of the counters at one moment. Every field counts from init.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Background-loop cycles run.
    pub cycles: u64,
    /// Collectives issued only to agree (votes, coordinator gathers and broadcasts).
    pub control_collectives: u64,
    /// Bytes this rank contributed to them.
    pub control_bytes: u64,
    /// Time spent in negotiation, including waiting there for other ranks.
    pub negotiation_ns: u64,
    /// Collectives that moved tensor data (one per executed batch).
    pub data_collectives: u64,
    /// Tensor bytes this rank handed to them.
    pub data_bytes: u64,
    /// Batches that packed more than one tensor into the fusion buffer.
    pub fused_batches: u64,
    /// Tensors completed by data collectives.
    pub tensors: u64,
    /// GPU batches launched by replaying a captured CUDA graph (`collective::replay`).
    pub graph_launches: u64,
    /// Batches allreduced hierarchically (`collective::hierarchical`).
    pub hierarchical_batches: u64,
    /// Bytes of tensor data this rank put into data collectives as each codec carried it:
    /// uncompressed, as IEEE half and as bfloat16 (`compress`). The savings of compression.
    pub wire_uncompressed: u64,
    pub wire_fp16: u64,
    pub wire_bf16: u64,
    /// ... and as 8-bit blocks (values only, without the blocks' headers).
    pub wire_u8: u64,
    /// ... and as PowerSGD's two factors.
    pub wire_powersgd: u64,
    /// ... and as top-k's (index, value) pairs.
    pub wire_topk: u64,
}

impl Metrics {
    pub(crate) fn add_negotiation(&self, collectives: u64, bytes: u64, took: Duration) {
        self.cycles.fetch_add(1, Ordering::Relaxed);
        self.control_collectives
            .fetch_add(collectives, Ordering::Relaxed);
        self.control_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.negotiation_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_batch(&self, tensors: u64, bytes: u64) {
        self.data_collectives.fetch_add(1, Ordering::Relaxed);
        self.data_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.tensors.fetch_add(tensors, Ordering::Relaxed);
        if tensors > 1 {
            self.fused_batches.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A batch's tensors put on the wire as `wire` carries them (`Wire::sent`).
    pub(crate) fn add_wire<'a>(&self, wire: &Wire, resps: impl IntoIterator<Item = &'a Response>) {
        for r in resps {
            let (codec, bytes) = wire.sent(r);
            self.add_wire_bytes(codec, bytes as u64);
        }
    }

    pub(crate) fn add_wire_bytes(&self, codec: Codec, wire: u64) {
        let counter = match codec {
            Codec::None => &self.wire_uncompressed,
            Codec::Half(DataType::BF16) => &self.wire_bf16,
            Codec::Half(_) => &self.wire_fp16,
            Codec::U8 => &self.wire_u8,
            Codec::PowerSgd(_) => &self.wire_powersgd,
            Codec::TopK(_) => &self.wire_topk,
        };
        counter.fetch_add(wire, Ordering::Relaxed);
    }

    pub(crate) fn add_graph_launch(&self) {
        self.graph_launches.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_hierarchical_batch(&self) {
        self.hierarchical_batches.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            cycles: get(&self.cycles),
            control_collectives: get(&self.control_collectives),
            control_bytes: get(&self.control_bytes),
            negotiation_ns: get(&self.negotiation_ns),
            data_collectives: get(&self.data_collectives),
            data_bytes: get(&self.data_bytes),
            fused_batches: get(&self.fused_batches),
            tensors: get(&self.tensors),
            graph_launches: get(&self.graph_launches),
            hierarchical_batches: get(&self.hierarchical_batches),
            wire_uncompressed: get(&self.wire_uncompressed),
            wire_fp16: get(&self.wire_fp16),
            wire_bf16: get(&self.wire_bf16),
            wire_u8: get(&self.wire_u8),
            wire_powersgd: get(&self.wire_powersgd),
            wire_topk: get(&self.wire_topk),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_accumulate() {
        let m = Metrics::default();
        m.add_negotiation(1, 16, Duration::from_micros(3));
        m.add_negotiation(3, 100, Duration::from_micros(7));
        m.add_batch(1, 40);
        m.add_batch(4, 400);
        m.add_graph_launch();
        m.add_hierarchical_batch();
        m.add_wire_bytes(Codec::None, 80);
        m.add_wire_bytes(Codec::Half(DataType::F16), 200);
        m.add_wire_bytes(Codec::Half(DataType::BF16), 20);
        m.add_wire_bytes(Codec::U8, 10);
        m.add_wire_bytes(Codec::PowerSgd(4), 7);
        m.add_wire_bytes(Codec::TopK(TopK::default()), 3);
        assert_eq!(
            m.snapshot(),
            MetricsSnapshot {
                cycles: 2,
                control_collectives: 4,
                control_bytes: 116,
                negotiation_ns: 10_000,
                data_collectives: 2,
                data_bytes: 440,
                fused_batches: 1,
                tensors: 5,
                graph_launches: 1,
                hierarchical_batches: 1,
                wire_uncompressed: 80,
                wire_fp16: 200,
                wire_bf16: 20,
                wire_u8: 10,
                wire_powersgd: 7,
                wire_topk: 3,
            }
        );
    }
}
