//! The coordinator's cross-rank checks: given every rank's request for one name, either the
//! agreed `Response` or an error response whose message (Horovod's text, plus the tensor and the
//! ranks that differed) every rank reports.

use crate::message::{OpKind, Request, Response};

fn device_name(d: i32) -> &'static str {
    if d < 0 { "CPU" } else { "GPU" }
}

fn shape_str(s: &[i64]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn mismatch(text: String, name: &str, a: &Request, b: &Request) -> Option<String> {
    Some(format!(
        "{text} (tensor '{name}': set ranks {} and {} differ)",
        a.rank, b.rank
    ))
}

/// First pair of requests (the first rank's and a later one) that differ in `key`.
fn first_difference<K: PartialEq>(
    reqs: &[Request],
    key: impl Fn(&Request) -> K,
) -> Option<(&Request, &Request)> {
    let first = &reqs[0];
    let k0 = key(first);
    reqs[1..].iter().find(|r| key(r) != k0).map(|r| (first, r))
}

fn join_unsupported(kind: OpKind) -> Option<&'static str> {
    match kind {
        OpKind::Allgather => Some(
            "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using DistributedOptimizer",
        ),
        OpKind::Alltoall => Some("Alltoall is not supported with Join at this time."),
        OpKind::Broadcast => Some("Broadcast is not supported with Join at this time."),
        OpKind::Reducescatter => Some("Reducescatter is not supported with Join at this time."),
        OpKind::Gossip => Some("Gossip is not supported with Join at this time."),
        OpKind::AddProcessSet | OpKind::RemoveProcessSet => {
            Some("Process sets cannot be changed while a rank has joined.")
        }
        _ => None,
    }
}

/// Checks the requests (one per non-joined rank, in rank order, at least one) and returns the
/// error message of the first disagreement, in Horovod's order of checks.
pub fn find_mismatch(reqs: &[Request], any_joined: bool) -> Option<String> {
    let name = &reqs[0].name;
    let kind = reqs[0].kind;
    if let Some((a, b)) = first_difference(reqs, |r| r.kind) {
        return mismatch(
            format!(
                "Mismatched operations: One rank did an {}, but another rank did an {}.",
                a.kind.name(),
                b.kind.name()
            ),
            name,
            a,
            b,
        );
    }
    if let Some((a, b)) = first_difference(reqs, |r| r.dtype) {
        return mismatch(
            format!(
                "Mismatched data types: One rank had type {}, but another rank had type {}.",
                a.dtype, b.dtype
            ),
            name,
            a,
            b,
        );
    }
    if any_joined && let Some(text) = join_unsupported(kind) {
        return Some(format!("{text} (tensor '{name}')"));
    }
    match kind {
        OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter | OpKind::Gossip => {
            if let Some((a, b)) = first_difference(reqs, |r| r.shape.clone()) {
                return mismatch(
                    format!(
                        "Mismatched {} tensor shapes: One rank sent a tensor of shape {}, but another rank sent a tensor of shape {}.",
                        kind.name(),
                        shape_str(&a.shape),
                        shape_str(&b.shape)
                    ),
                    name,
                    a,
                    b,
                );
            }
        }
        OpKind::Allgather | OpKind::Alltoall => {
            if reqs[0].rank == 0 && reqs[0].shape.is_empty() {
                return Some(format!(
                    "Process-set rank zero tried to {} a rank-zero tensor. (tensor '{name}')",
                    kind.name()
                ));
            }
            if let Some((a, b)) = first_difference(reqs, |r| r.shape.len()) {
                return mismatch(
                    format!(
                        "Mismatched {} tensor shapes: One rank sent a tensor of rank {}, but another rank sent a tensor of rank {}.",
                        kind.name(),
                        a.shape.len(),
                        b.shape.len()
                    ),
                    name,
                    a,
                    b,
                );
            }
            for dim in 1..reqs[0].shape.len() {
                if let Some((a, b)) = first_difference(reqs, |r| r.shape[dim]) {
                    return mismatch(
                        format!(
                            "Mismatched {} tensor shapes: One rank sent a tensor with dimension {dim} equal to {}, but another rank sent a tensor with dimension {dim} equal to {}.",
                            kind.name(),
                            a.shape[dim],
                            b.shape[dim]
                        ),
                        name,
                        a,
                        b,
                    );
                }
            }
        }
        OpKind::AddProcessSet | OpKind::RemoveProcessSet => {
            if let Some((a, b)) = first_difference(reqs, |r| r.shape.clone()) {
                return mismatch(
                    format!(
                        "Mismatched {} arguments: One rank sent {}, but another rank sent {}.",
                        kind.name(),
                        shape_str(&a.shape),
                        shape_str(&b.shape)
                    ),
                    name,
                    a,
                    b,
                );
            }
        }
        // point-to-point ops are never negotiated
        OpKind::Join | OpKind::Barrier | OpKind::Send | OpKind::Recv => {}
    }
    if matches!(kind, OpKind::Allreduce | OpKind::Reducescatter) {
        if let Some((a, b)) = first_difference(reqs, |r| (r.prescale, r.postscale)) {
            return mismatch(
                format!(
                    "Mismatched prescale and/or postscale factors: One rank sent factors ({}, {}), but another rank sent factors ({}, {}).",
                    a.prescale, a.postscale, b.prescale, b.postscale
                ),
                name,
                a,
                b,
            );
        }
        if let Some((a, b)) = first_difference(reqs, |r| r.reduce_op) {
            return mismatch(
                format!(
                    "Mismatched reduction operation: One rank sent reduction op {}, but another rank sent reduction op {}.",
                    a.reduce_op as i32, b.reduce_op as i32
                ),
                name,
                a,
                b,
            );
        }
    }
    if matches!(kind, OpKind::Allreduce | OpKind::Gossip)
        && let Some((a, b)) = first_difference(reqs, |r| r.compression)
    {
        let said = |r: &Request| r.compression.map_or("the job's".into(), |c| c.describe());
        return mismatch(
            format!(
                "Mismatched compression: One rank asked for {} compression, but another rank asked for {}.",
                said(a),
                said(b)
            ),
            name,
            a,
            b,
        );
    }
    if kind == OpKind::Allreduce
        && let Some((a, b)) = first_difference(reqs, |r| r.multistep)
    {
        let said = |r: &Request| {
            let m = r.multistep;
            let mode = if m.accumulate {
                "accumulating"
            } else {
                "latest"
            };
            format!("every {} calls ({mode}, warm-up {})", m.every, m.warmup)
        };
        return mismatch(
            format!(
                "Mismatched multistep: One rank communicates {}, but another rank communicates {}.",
                said(a),
                said(b)
            ),
            name,
            a,
            b,
        );
    }
    if kind == OpKind::Broadcast
        && let Some((a, b)) = first_difference(reqs, |r| r.root)
    {
        return mismatch(
            format!(
                "Mismatched BROADCAST root ranks: One rank specified root rank {}, but another rank specified root rank {}.",
                a.root, b.root
            ),
            name,
            a,
            b,
        );
    }
    if let Some((a, b)) = first_difference(reqs, |r| device_name(r.device)) {
        return mismatch(
            format!(
                "Mismatched {} CPU/GPU device selection: One rank specified device {}, but another rank specified device {}.",
                kind.name(),
                device_name(a.device),
                device_name(b.device)
            ),
            name,
            a,
            b,
        );
    }
    None
}

/// The response for one ready name: `reqs` holds the non-joined ranks' requests in rank order;
/// `set_size` is the process set's size.
pub fn construct_response(reqs: &[Request], any_joined: bool, set_size: usize) -> Response {
    if let Some(msg) = find_mismatch(reqs, any_joined) {
        return Response::error(&reqs[0], msg);
    }
    let mut resp = Response::from_request(&reqs[0]);
    if resp.kind == OpKind::Allgather {
        let mut dims = vec![0i64; set_size];
        for r in reqs {
            if let Some(slot) = dims.get_mut(r.rank as usize) {
                *slot = r.shape.first().copied().unwrap_or(1);
            }
        }
        resp.first_dims = dims;
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;
    use crate::message::ReduceOp;

    fn req(rank: i32, kind: OpKind, dtype: DataType, shape: &[i64]) -> Request {
        Request {
            rank,
            ..Request::test("t", kind, dtype, shape)
        }
    }

    #[test]
    fn agreeing_allreduce_has_no_error() {
        let reqs: Vec<_> = (0..3)
            .map(|r| req(r, OpKind::Allreduce, DataType::F32, &[4, 5]))
            .collect();
        let resp = construct_response(&reqs, false, 3);
        assert_eq!(resp.error, None);
        assert_eq!(resp.shape, vec![4, 5]);
    }

    #[test]
    fn dtype_mismatch_names_types_tensor_and_ranks() {
        let reqs = vec![
            req(0, OpKind::Allreduce, DataType::F32, &[2]),
            req(1, OpKind::Allreduce, DataType::F32, &[2]),
            req(2, OpKind::Allreduce, DataType::I32, &[2]),
        ];
        let msg = find_mismatch(&reqs, false).unwrap();
        assert!(msg.starts_with(
            "Mismatched data types: One rank had type float32, but another rank had type int32."
        ));
        assert!(
            msg.contains("tensor 't'") && msg.contains("ranks 0 and 2"),
            "{msg}"
        );
    }

    #[test]
    fn op_kind_is_checked_before_dtype() {
        let reqs = vec![
            req(0, OpKind::Allreduce, DataType::F32, &[2]),
            req(1, OpKind::Allgather, DataType::I32, &[2]),
        ];
        assert!(find_mismatch(&reqs, false).unwrap().starts_with(
            "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."
        ));
    }

    #[test]
    fn shape_rules_per_op() {
        let a = req(0, OpKind::Allreduce, DataType::F32, &[17, 17, 17]);
        let b = req(1, OpKind::Allreduce, DataType::F32, &[18, 18, 18]);
        assert!(find_mismatch(&[a, b], false).unwrap().starts_with(
            "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 17, 17], but another rank sent a tensor of shape [18, 18, 18]."
        ));
        // allgather: first dimension may differ, others may not
        let a = req(0, OpKind::Allgather, DataType::F32, &[3, 4]);
        let b = req(1, OpKind::Allgather, DataType::F32, &[5, 4]);
        let resp = construct_response(&[a.clone(), b], false, 2);
        assert_eq!(resp.error, None);
        assert_eq!(resp.first_dims, vec![3, 5]);
        let c = req(1, OpKind::Allgather, DataType::F32, &[5, 6]);
        assert!(
            find_mismatch(&[a.clone(), c], false)
                .unwrap()
                .contains("dimension 1 equal to 4")
        );
        let d = req(1, OpKind::Allgather, DataType::F32, &[5, 4, 1]);
        assert!(
            find_mismatch(&[a, d], false)
                .unwrap()
                .contains("tensor of rank 2")
        );
        let s = req(0, OpKind::Allgather, DataType::F32, &[]);
        assert!(
            find_mismatch(&[s.clone(), s], false)
                .unwrap()
                .starts_with("Process-set rank zero tried to ALLGATHER a rank-zero tensor.")
        );
    }

    #[test]
    fn scale_op_root_and_device() {
        let a = req(0, OpKind::Allreduce, DataType::F32, &[2]);
        let mut b = a.clone();
        b.rank = 1;
        b.postscale = 0.5;
        assert!(find_mismatch(&[a.clone(), b], false).unwrap().starts_with(
            "Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), but another rank sent factors (1, 0.5)."
        ));
        let mut b = a.clone();
        b.rank = 1;
        b.compression = Some(crate::message::Compression::Fp16);
        assert!(find_mismatch(&[a.clone(), b], false).unwrap().starts_with(
            "Mismatched compression: One rank asked for the job's compression, but another rank asked for fp16."
        ));
        // the same codec with another parameter of its own
        let (mut x, mut y) = (a.clone(), a.clone());
        y.rank = 1;
        x.compression = Some(crate::message::Compression::TopK(10_000));
        y.compression = Some(crate::message::Compression::TopK(0));
        let got = find_mismatch(&[x, y], false).unwrap();
        assert!(got.starts_with(
            "Mismatched compression: One rank asked for topk (ratio 0.01) compression, but another rank asked for topk."
        ), "{got}");
        let mut b = a.clone();
        b.rank = 1;
        b.reduce_op = ReduceOp::Min;
        assert!(find_mismatch(&[a.clone(), b], false).unwrap().starts_with(
            "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction op 3."
        ));
        let mut b = a.clone();
        b.rank = 1;
        b.device = 0;
        assert!(find_mismatch(&[a.clone(), b], false).unwrap().starts_with(
            "Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device CPU, but another rank specified device GPU."
        ));
        let x = req(0, OpKind::Broadcast, DataType::F32, &[2]);
        let mut y = x.clone();
        y.rank = 1;
        y.root = 1;
        let got = find_mismatch(&[x, y], false).unwrap();
        assert!(got.starts_with(
            "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1."
        ));
    }

    #[test]
    fn join_allows_only_allreduce() {
        let a = req(0, OpKind::Allreduce, DataType::F32, &[2]);
        assert_eq!(find_mismatch(&[a], true), None);
        let g = req(0, OpKind::Allgather, DataType::F32, &[2]);
        assert!(
            find_mismatch(&[g], true)
                .unwrap()
                .starts_with("Allgather is not supported with Join")
        );
        let b = req(0, OpKind::Broadcast, DataType::F32, &[2]);
        assert!(
            find_mismatch(&[b], true)
                .unwrap()
                .starts_with("Broadcast is not supported with Join")
        );
    }
}
