//! Sends and receives: exchanges around a ring in every dtype, many in flight at once with
//! tags, inside a process set while the global set runs collectives; a size mismatch failing
//! both sides (and the pair going on after it); a receive nobody answers ending at the stall
//! limit; bad calls refused at the call.

use super::*;

fn p2p_spec(
    kind: OpKind,
    peer: usize,
    tag: i32,
    name: &str,
    dtype: DataType,
    vals: &[f64],
) -> OpSpec {
    let mut spec = OpSpec::new(
        kind,
        vec![tensor(name, dtype, &[vals.len() as i64], vals, false)],
    );
    spec.root_rank = peer as i32;
    spec.tag = tag;
    spec
}

/// Host memory always (point-to-point takes host memory, also in GPU mode).
fn enqueue(spec: OpSpec) -> Result<Arc<Handle>, Error> {
    runtime::runtime()?.enqueue(spec)
}

/// What rank `r` sends with tag `tag` as its `k`-th message: distinct per sender, tag and turn.
fn message(r: usize, tag: i32, k: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| val(i + k, r) + (tag as f64) * 16.0)
        .collect()
}

/// The received values of a finished receive (in place into the library-owned input).
fn received(h: Arc<Handle>, dtype: DataType) -> Vec<f64> {
    let r = finish(h).expect("receive");
    output(&r[0], dtype)
}

pub(crate) fn p2p() {
    init();
    let (me, n) = (rank(), size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    // every dtype around the ring, receive posted first on even ranks, send first on odd
    for (d, dtype) in DataType::ALL.into_iter().enumerate() {
        let len = 1 + d * 37;
        // bool holds 0 and 1 only
        let fit = |v: Vec<f64>| -> Vec<f64> {
            match dtype {
                DataType::Bool => v.iter().map(|x| x % 2.0).collect(),
                _ => v,
            }
        };
        let want = fit(message(prev, 0, d, len));
        let mine = fit(message(me, 0, d, len));
        let send = p2p_spec(OpKind::Send, next, 0, &format!("s.{d}"), dtype, &mine);
        let recv = p2p_spec(
            OpKind::Recv,
            prev,
            0,
            &format!("r.{d}"),
            dtype,
            &vec![0.0; len],
        );
        let (hs, hr) = if me % 2 == 0 {
            let hr = enqueue(recv).unwrap();
            (enqueue(send).unwrap(), hr)
        } else {
            let hs = enqueue(send).unwrap();
            (hs, enqueue(recv).unwrap())
        };
        assert_eq!(received(hr, dtype), quantize(dtype, &want), "{dtype:?}");
        finish(hs).expect("send");
    }
    // many in flight: three tags, twenty messages each, receives posted in a different tag
    // order than the sends; sizes from empty to 1 MiB
    let sizes = |k: usize| [0usize, 1, 1000, 262_144][k % 4];
    let mut recvs = Vec::new();
    for tag in [2, 0, 1] {
        for k in 0..20 {
            let spec = p2p_spec(
                OpKind::Recv,
                prev,
                tag,
                &format!("m.r{tag}.{k}"),
                DataType::F32,
                &vec![0.0; sizes(k)],
            );
            recvs.push((tag, k, enqueue(spec).unwrap()));
        }
    }
    let mut sends = Vec::new();
    for k in 0..20 {
        for tag in [0, 1, 2] {
            let spec = p2p_spec(
                OpKind::Send,
                next,
                tag,
                &format!("m.s{tag}.{k}"),
                DataType::F32,
                &message(me, tag, k, sizes(k)),
            );
            sends.push(enqueue(spec).unwrap());
        }
    }
    for (tag, k, h) in recvs {
        assert_eq!(
            received(h, DataType::F32),
            message(prev, tag, k, sizes(k)),
            "tag {tag} message {k}"
        );
    }
    for h in sends {
        finish(h).expect("send");
    }
    // inside a process set of all ranks but 0, while every rank allreduces in the global set
    let ranks: Vec<i32> = (1..n as i32).collect();
    let set = match ranks.len() >= 2 {
        true => {
            let h = runtime::runtime().unwrap().add_process_set(&ranks).unwrap();
            h.wait(None).unwrap();
            Some(h.value())
        }
        false => None,
    };
    let mut in_set = None;
    if let (Some(id), true) = (set, me > 0) {
        let members = n - 1;
        let (next_w, prev_w) = (1 + me % members, 1 + (me + members - 2) % members);
        let mut send = p2p_spec(
            OpKind::Send,
            next_w,
            5,
            "set.s",
            DataType::I32,
            &message(me, 5, 0, 10),
        );
        send.process_set = id;
        let mut recv = p2p_spec(OpKind::Recv, prev_w, 5, "set.r", DataType::I32, &[0.0; 10]);
        recv.process_set = id;
        let hr = enqueue(recv).unwrap();
        in_set = Some((prev_w, hr, enqueue(send).unwrap()));
    }
    let all = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ar", DataType::F64, &[3], &[me as f64; 3], false)],
    ))
    .unwrap();
    let total = (0..n).sum::<usize>() as f64;
    assert_eq!(output(&all[0], DataType::F64), vec![total; 3]);
    if let Some((prev_w, hr, hs)) = in_set {
        assert_eq!(received(hr, DataType::I32), message(prev_w, 5, 0, 10));
        finish(hs).unwrap();
    }
    finish_job();
}

/// Receives from any rank: rank 0 takes one message from every other rank, each reporting
/// the rank it came from, whose values it holds; then a named receive still gets its own.
pub(crate) fn p2p_any_source() {
    init();
    let (me, n) = (rank(), size());
    if me == 0 {
        let handles: Vec<_> = (1..n)
            .map(|k| {
                let spec = p2p_spec(
                    OpKind::Recv,
                    0,
                    9,
                    &format!("any.{k}"),
                    DataType::I64,
                    &[0.0; 6],
                );
                let spec = OpSpec {
                    root_rank: ferrovod::message::ANY_SOURCE,
                    ..spec
                };
                enqueue(spec).unwrap()
            })
            .collect();
        let mut sources = Vec::new();
        for h in handles {
            let source = {
                h.wait(Some(Duration::from_secs(60))).unwrap();
                h.value() as usize
            };
            assert_eq!(
                received(h, DataType::I64),
                message(source, 9, 0, 6),
                "from {source}"
            );
            sources.push(source);
        }
        sources.sort_unstable();
        assert_eq!(sources, (1..n).collect::<Vec<_>>());
        // (the last rank sends again only after this: any-source receives could take it)
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        let h = enqueue(p2p_spec(
            OpKind::Recv,
            n - 1,
            9,
            "named",
            DataType::I64,
            &[0.0; 6],
        ))
        .unwrap();
        assert_eq!(received(h, DataType::I64), message(n - 1, 9, 1, 6));
    } else {
        run(p2p_spec(
            OpKind::Send,
            0,
            9,
            "to0",
            DataType::I64,
            &message(me, 9, 0, 6),
        ))
        .unwrap();
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        if me == n - 1 {
            run(p2p_spec(
                OpKind::Send,
                0,
                9,
                "to0.again",
                DataType::I64,
                &message(me, 9, 1, 6),
            ))
            .unwrap();
        }
    }
    finish_job();
}

/// A receive expecting other bytes than the message has: both sides fail, naming the sizes,
/// and the pair's next exchange (same tag) is right.
pub(crate) fn p2p_mismatch() {
    init();
    let me = rank();
    let peer = 1 - me;
    let h = if me == 0 {
        enqueue(p2p_spec(
            OpKind::Send,
            peer,
            3,
            "mm",
            DataType::F32,
            &[1.0; 4],
        ))
        .unwrap()
    } else {
        enqueue(p2p_spec(
            OpKind::Recv,
            peer,
            3,
            "mm",
            DataType::F32,
            &[0.0; 2],
        ))
        .unwrap()
    };
    let err = finish(h).unwrap_err();
    assert!(matches!(err, Error::Precondition(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("Mismatched point-to-point sizes"), "{msg}");
    assert!(
        msg.contains("16 bytes") && msg.contains("8 bytes") && msg.contains("'mm'"),
        "{msg}"
    );
    let h = if me == 0 {
        enqueue(p2p_spec(
            OpKind::Send,
            peer,
            3,
            "ok",
            DataType::F32,
            &[7.0; 4],
        ))
        .unwrap()
    } else {
        enqueue(p2p_spec(
            OpKind::Recv,
            peer,
            3,
            "ok",
            DataType::F32,
            &[0.0; 4],
        ))
        .unwrap()
    };
    if me == 1 {
        assert_eq!(received(h, DataType::F32), vec![7.0; 4]);
    } else {
        finish(h).unwrap();
    }
    finish_job();
}

/// Rank 1 waits for a message rank 0 never sends: at the stall limit it fails naming rank 0
/// and the tensor, its runtime stops (unclean: the job fails), and rank 0 learns of it through
/// its next collective. Each rank prints its report; rank 1 stays until rank 0 has printed.
pub(crate) fn p2p_stall() {
    init();
    let me = rank();
    let start = Instant::now();
    let dir = std::path::PathBuf::from(std::env::var("FERROVOD_TEST_DIR").unwrap());
    let (reported, first) = (dir.join("rank0-reported"), dir.join("rank1-reported"));
    if me == 1 {
        let h = enqueue(p2p_spec(
            OpKind::Recv,
            0,
            0,
            "never",
            DataType::F32,
            &[0.0; 4],
        ))
        .unwrap();
        let err = finish(h).unwrap_err();
        assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
        assert_stall_report(
            &err.to_string(),
            &["Missing ranks: 0", "receive of 'never'"],
            start,
        );
        println!("P2P-STALL-REPORTED rank=1");
        std::fs::write(&first, b"").unwrap();
        while !reported.exists() && start.elapsed() < 2 * STALL_END {
            std::thread::sleep(Duration::from_millis(50));
        }
        runtime::shutdown();
        return;
    }
    // only after rank 1's report: a barrier waiting meanwhile would reach its own stall
    // limit as soon, and the coordinator's report could end rank 1's receive first
    while !first.exists() && start.elapsed() < STALL_END {
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = loop {
        if let Err(e) = run(OpSpec::new(OpKind::Barrier, vec![])) {
            break e;
        }
        assert!(start.elapsed() < STALL_END, "rank 0: no stall error");
    };
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    println!("P2P-STALL-REPORTED rank=0");
    std::fs::write(&reported, b"").unwrap();
    runtime::shutdown();
}

/// Calls refused where they are made: a peer outside the set or the world, oneself, tags out
/// of range, GPU memory, several tensors with a bad one; nothing is left in flight.
pub(crate) fn p2p_bad_calls() {
    init();
    let (me, n) = (rank(), size());
    let peer = (me + 1) % n;
    let refused = |spec: OpSpec, want: &str| {
        let err = enqueue(spec).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(err.to_string().contains(want), "{err} lacks {want}");
    };
    let max = runtime::runtime().unwrap().p2p_max_tag();
    assert!(max >= 16383, "{max}");
    for kind in [OpKind::Send, OpKind::Recv] {
        refused(
            p2p_spec(kind, n + 3, 0, "x", DataType::F32, &[1.0]),
            "is not a member of the provided process set",
        );
        refused(
            p2p_spec(kind, me, 0, "x", DataType::F32, &[1.0]),
            "cannot send to or receive from itself",
        );
        refused(
            p2p_spec(kind, peer, -1, "x", DataType::F32, &[1.0]),
            "tag -1 is outside 0..=",
        );
        refused(
            p2p_spec(kind, peer, max + 1, "x", DataType::F32, &[1.0]),
            "is outside 0..=",
        );
        let mut gpu = p2p_spec(kind, peer, 0, "x", DataType::F32, &[1.0]);
        gpu.device = 0;
        let err = enqueue(gpu).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let mut two = p2p_spec(kind, peer, 0, "x", DataType::F32, &[1.0]);
        two.tensors
            .push(tensor("", DataType::F32, &[1], &[1.0], false));
        refused(two, "tensor name is empty");
    }
    // the largest tag works
    let mine = message(me, 1, 0, 5);
    let hs = enqueue(p2p_spec(
        OpKind::Send,
        peer,
        max,
        "hi",
        DataType::F64,
        &mine,
    ))
    .unwrap();
    let prev = (me + n - 1) % n;
    let hr = enqueue(p2p_spec(
        OpKind::Recv,
        prev,
        max,
        "hi.r",
        DataType::F64,
        &[0.0; 5],
    ))
    .unwrap();
    assert_eq!(received(hr, DataType::F64), message(prev, 1, 0, 5));
    finish(hs).unwrap();
    finish_job();
}
