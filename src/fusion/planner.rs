//! Groups a cycle's responses into batches. A pure function of the agreed response list and the
//! threshold, so every rank computes the same batches.

use std::borrow::Borrow;

use crate::compress::{Codec, Codecs};
use crate::message::{OpKind, Response};

/// Indices into the cycle's response list, executed as one collective, and how its values
/// travel: the one place a batch's codec is resolved (the algorithm's choice reads it here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub members: Vec<usize>,
    pub codec: Codec,
}

/// How a batch led by `head` travels: the codec the job's settings give it. Batches hold one
/// codec each, so the head's is the batch's.
pub fn codec(head: &Response, codecs: &Codecs) -> Codec {
    codecs.of(head)
}

/// Responses that may share one collective: same op, dtype, device, reduction, scales and codec.
fn fusable(a: &Response, b: &Response, codecs: &Codecs) -> bool {
    a.kind == b.kind
        && a.dtype == b.dtype
        && a.device == b.device
        && a.reduce_op == b.reduce_op
        && a.prescale == b.prescale
        && a.postscale == b.postscale
        && a.error.is_none()
        && b.error.is_none()
        && codec(a, codecs) == codec(b, codecs)
}

fn fuses_at_all(r: &Response) -> bool {
    r.error.is_none()
        && matches!(
            r.kind,
            OpKind::Allreduce | OpKind::Allgather | OpKind::Reducescatter | OpKind::Gossip
        )
}

/// Host tensors of this size or more run alone, in place, in a process set inside one node.
const HOST_DIRECT_BYTES: usize = 64 << 10;

/// Host tensors of this size or more run alone, in place, in a process set that spans nodes.
const HOST_DIRECT_BYTES_ACROSS_NODES: usize = 16 << 20;

/// The host size from which a set's tensors run alone, in place (`FERROVOD_FUSION_DIRECT_BYTES`
/// when set). Inside a node the copy through the fusion buffer costs more than an extra
/// collective call. Across nodes the network bounds an allreduce and one large message moves at
/// its rate where many medium ones do not (BENCHMARKS.md, slow links), so tensors are fused up
/// to the threshold there; one of 16 MiB already moves at the link's rate alone, and copying it
/// into the fusion buffer and out again only delays it (DDP's buckets; BENCHMARKS.md,
/// torch.distributed). Agreed: from rank 0's setting and the job's node map.
pub fn direct_bytes(configured: Option<usize>, spans_nodes: bool) -> usize {
    match (configured, spans_nodes) {
        (Some(bytes), _) => bytes,
        (None, true) => HOST_DIRECT_BYTES_ACROSS_NODES,
        (None, false) => HOST_DIRECT_BYTES,
    }
}

/// GPU tensors of this size or more run alone, in place. Below it a device copy (TB/s) costs
/// less than NCCL's per-call latency and small-message inefficiency; above it NCCL is at its
/// bandwidth plateau and copying through the fusion buffer only adds time (BENCHMARKS.md,
/// "Figures moved out of comments").
const GPU_DIRECT_BYTES: usize = 32 << 20;

/// Greedy planning in response order: each batch starts at the first unassigned response and
/// takes every later compatible response that still fits under `threshold` bytes (looking past
/// incompatible ones). A host response of `direct_bytes` or more runs alone, in place: on host
/// memory copying it through the fusion buffer costs more than the extra collective call. GPU
/// responses use `GPU_DIRECT_BYTES` instead. Batches run in the order of their first member.
pub fn plan_batches<R: Borrow<Response>>(
    responses: &[R],
    threshold: usize,
    direct_bytes: usize,
    codecs: &Codecs,
) -> Vec<Batch> {
    let fuses = |r: &Response| {
        let direct = if r.device == crate::message::CPU_DEVICE {
            direct_bytes
        } else {
            GPU_DIRECT_BYTES
        };
        fuses_at_all(r) && r.fused_bytes() < direct
    };
    let mut assigned = vec![false; responses.len()];
    let mut batches = Vec::new();
    for i in 0..responses.len() {
        if assigned[i] {
            continue;
        }
        assigned[i] = true;
        let mut members = vec![i];
        let head = responses[i].borrow();
        if fuses(head) {
            let mut bytes = head.fused_bytes();
            for j in i + 1..responses.len() {
                let r = responses[j].borrow();
                if assigned[j] || !fusable(head, r, codecs) || !fuses(r) {
                    continue;
                }
                let b = r.fused_bytes();
                if bytes + b <= threshold {
                    bytes += b;
                    assigned[j] = true;
                    members.push(j);
                }
            }
        }
        batches.push(Batch {
            members,
            codec: codec(head, codecs),
        });
    }
    batches
}

/// `plan_batches` over consecutive segments of `responses` (`segments`: the first segments'
/// lengths; the rest is one more), so that no batch spans two segments. Indices are into
/// `responses`.
pub fn plan_segments<R: Borrow<Response>>(
    responses: &[R],
    segments: &[usize],
    threshold: usize,
    direct_bytes: usize,
    codecs: &Codecs,
) -> Vec<Batch> {
    let mut batches = Vec::new();
    let mut start = 0;
    let rest = responses.len() - segments.iter().sum::<usize>().min(responses.len());
    for len in segments.iter().copied().chain([rest]) {
        let end = (start + len).min(responses.len());
        for b in plan_batches(&responses[start..end], threshold, direct_bytes, codecs) {
            batches.push(Batch {
                members: b.members.iter().map(|m| m + start).collect(),
                codec: b.codec,
            });
        }
        start = end;
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;
    use crate::message::{Compression, Request};

    const NONE: Codecs = Codecs {
        setting: Compression::None,
        min_bytes: 0,
        powersgd_rank: crate::compress::POWERSGD_RANK,
        topk: crate::compress::TopK {
            ratio_ppm: 10_000,
            momentum_permille: 0,
        },
    };

    fn resp(name: &str, kind: OpKind, dtype: DataType, elems: i64) -> Response {
        Response::from_request(&Request::test(name, kind, dtype, &[elems]))
    }

    fn members(b: &[Batch]) -> Vec<Vec<usize>> {
        b.iter().map(|b| b.members.clone()).collect()
    }

    #[test]
    fn sets_across_nodes_fuse_up_to_16_mib_unless_configured() {
        assert_eq!(direct_bytes(None, false), HOST_DIRECT_BYTES);
        assert_eq!(direct_bytes(None, true), 16 << 20);
        assert_eq!(direct_bytes(Some(0), true), 0);
        assert_eq!(direct_bytes(Some(1 << 20), false), 1 << 20);
        // across nodes two 4 MiB tensors share one batch; inside one they run alone
        let big = [
            resp("a", OpKind::Allreduce, DataType::F32, 1 << 20),
            resp("b", OpKind::Allreduce, DataType::F32, 1 << 20),
        ];
        let across = plan_batches(&big, 64 << 20, direct_bytes(None, true), &NONE);
        assert_eq!(members(&across), vec![vec![0, 1]]);
        let inside = plan_batches(&big, 64 << 20, direct_bytes(None, false), &NONE);
        assert_eq!(members(&inside), vec![vec![0], vec![1]]);
        // across nodes a 16 MiB tensor (DDP's bucket) runs alone; the smaller ones still fuse
        let bucket = [
            resp("a", OpKind::Allreduce, DataType::F32, 1 << 20),
            resp("bucket", OpKind::Allreduce, DataType::F32, 4 << 20),
            resp("b", OpKind::Allreduce, DataType::F32, (4 << 20) - 1),
        ];
        let across = plan_batches(&bucket, 64 << 20, direct_bytes(None, true), &NONE);
        assert_eq!(members(&across), vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn segments_are_planned_apart() {
        let rs: Vec<Response> = (0..6)
            .map(|i| resp(&format!("t{i}"), OpKind::Allreduce, DataType::F32, 4))
            .collect();
        assert_eq!(
            members(&plan_segments(&rs, &[2, 3], 1 << 20, 1 << 20, &NONE)),
            vec![vec![0, 1], vec![2, 3, 4], vec![5]]
        );
        assert_eq!(
            members(&plan_segments(&rs, &[], 1 << 20, 1 << 20, &NONE)),
            vec![vec![0, 1, 2, 3, 4, 5]]
        );
        assert_eq!(
            members(&plan_segments(&rs, &[6], 1 << 20, 1 << 20, &NONE)),
            vec![vec![0, 1, 2, 3, 4, 5]]
        );
    }

    #[test]
    fn gpu_tensors_fuse_below_their_own_direct_size() {
        let mut rs: Vec<Response> = (0..3)
            .map(|i| resp(&format!("t{i}"), OpKind::Allreduce, DataType::F32, 1 << 20))
            .collect();
        // host: each 4 MiB tensor is at least direct_bytes and runs alone
        assert_eq!(
            members(&plan_batches(&rs, 64 << 20, 64 << 10, &NONE)),
            vec![vec![0], vec![1], vec![2]]
        );
        for r in &mut rs {
            r.device = 0;
        }
        assert_eq!(
            members(&plan_batches(&rs, 64 << 20, 64 << 10, &NONE)),
            vec![vec![0, 1, 2]]
        );
        // still bounded by the threshold
        assert_eq!(
            members(&plan_batches(&rs, 8 << 20, 64 << 10, &NONE)),
            vec![vec![0, 1], vec![2]]
        );
        // at NCCL's plateau a GPU tensor runs alone
        rs[1] = resp(
            "big",
            OpKind::Allreduce,
            DataType::F32,
            (GPU_DIRECT_BYTES / 4) as i64,
        );
        rs[1].device = 0;
        assert_eq!(
            members(&plan_batches(&rs, 128 << 20, 64 << 10, &NONE)),
            vec![vec![0, 2], vec![1]]
        );
    }

    #[test]
    fn fuses_same_kind_and_dtype_up_to_threshold() {
        let rs = vec![
            resp("a", OpKind::Allreduce, DataType::F32, 10), // 40 B
            resp("b", OpKind::Allreduce, DataType::F64, 5),  // other dtype, 40 B
            resp("c", OpKind::Allreduce, DataType::F32, 10),
            resp("d", OpKind::Broadcast, DataType::F32, 1),
            resp("e", OpKind::Allreduce, DataType::F32, 10),
            resp("f", OpKind::Allreduce, DataType::F64, 5),
        ];
        assert_eq!(
            members(&plan_batches(&rs, 80, usize::MAX, &NONE)),
            vec![vec![0, 2], vec![1, 5], vec![3], vec![4]]
        );
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, usize::MAX, &NONE)),
            vec![vec![0, 2, 4], vec![1, 5], vec![3]]
        );
    }

    #[test]
    fn oversize_and_zero_threshold_run_alone() {
        let rs = vec![
            resp("a", OpKind::Allreduce, DataType::F32, 100),
            resp("b", OpKind::Allreduce, DataType::F32, 1),
            resp("c", OpKind::Allreduce, DataType::F32, 1),
        ];
        assert_eq!(
            members(&plan_batches(&rs, 8, usize::MAX, &NONE)),
            vec![vec![0], vec![1, 2]]
        );
        assert_eq!(
            members(&plan_batches(&rs, 0, usize::MAX, &NONE)),
            vec![vec![0], vec![1], vec![2]]
        );
    }

    #[test]
    fn large_responses_run_alone_in_place() {
        let rs = vec![
            resp("small0", OpKind::Allreduce, DataType::F32, 4),
            resp("big", OpKind::Allreduce, DataType::F32, 1000),
            resp("small1", OpKind::Allreduce, DataType::F32, 4),
        ];
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, 4000, &NONE)),
            vec![vec![0, 2], vec![1]]
        );
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, 4001, &NONE)),
            vec![vec![0, 1, 2]]
        );
    }

    #[test]
    fn never_fuses_errors_scales_or_unfusable_kinds() {
        let mut e = resp("e", OpKind::Allreduce, DataType::F32, 1);
        e.error = Some("x".into());
        let mut s = resp("s", OpKind::Allreduce, DataType::F32, 1);
        s.postscale = 0.5;
        let rs = vec![
            resp("a", OpKind::Allreduce, DataType::F32, 1),
            e,
            s,
            resp("t", OpKind::Alltoall, DataType::F32, 1),
            resp("u", OpKind::Alltoall, DataType::F32, 1),
            resp("b", OpKind::Allreduce, DataType::F32, 1),
        ];
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, usize::MAX, &NONE)),
            vec![vec![0, 5], vec![1], vec![2], vec![3], vec![4]]
        );
    }

    #[test]
    fn allgather_counts_every_ranks_rows() {
        let mut a = resp("a", OpKind::Allgather, DataType::F32, 4);
        a.first_dims = vec![4, 6];
        let mut b = a.clone();
        b.name = "b".into();
        assert_eq!(a.fused_bytes(), 40);
        assert_eq!(
            members(&plan_batches(
                &[a.clone(), b.clone()],
                79,
                usize::MAX,
                &NONE
            )),
            vec![vec![0], vec![1]]
        );
        assert_eq!(
            members(&plan_batches(&[a, b], 80, usize::MAX, &NONE)),
            vec![vec![0, 1]]
        );
    }

    #[test]
    fn batches_hold_one_codec() {
        // mixed from 64 bytes: a and c travel as f16, the small b as f32; d asks for none
        let mixed = Codecs {
            setting: Compression::Mixed,
            min_bytes: 64,
            powersgd_rank: crate::compress::POWERSGD_RANK,
            topk: crate::compress::TopK {
                ratio_ppm: 10_000,
                momentum_permille: 0,
            },
        };
        let mut d = resp("d", OpKind::Allreduce, DataType::F32, 16);
        d.compression = Some(Compression::None);
        let rs = vec![
            resp("a", OpKind::Allreduce, DataType::F32, 16),
            resp("b", OpKind::Allreduce, DataType::F32, 15),
            resp("c", OpKind::Allreduce, DataType::F32, 20),
            d,
        ];
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, usize::MAX, &mixed)),
            vec![vec![0, 2], vec![1, 3]]
        );
        assert_eq!(
            members(&plan_batches(&rs, 1 << 20, usize::MAX, &NONE)),
            vec![vec![0, 1, 2, 3]]
        );
    }
}
