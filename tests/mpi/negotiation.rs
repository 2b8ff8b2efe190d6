//! Online negotiation: learned groups and their votes, the response cache, and mismatches that
//! must end in an error on every rank.

use super::*;

/// Online mode learns the step's batches and then votes one bit per batch: 40 cached tensors
/// agree with a single 8-byte word per cycle instead of two words of per-tensor bits. A step
/// that lacks one tensor on every rank dissolves its group after FERROVOD_PLAN_ESCAPE_MS and
/// the rest still complete, per tensor; all results stay right.
pub(crate) fn online_groups() {
    init();
    let me = rank();
    let mut rng = Lcg(41 + me as u64);
    let rt = runtime::runtime().unwrap();
    // which groups are learned depends on how each step's tensors fall into cycles, which a
    // loaded machine changes: warm up until one whole step voted a word per vote (at most 20
    // steps; the vote counts are the same on every rank, so every rank stops at the same step)
    let mut step = 0;
    while step < 20 {
        let before = rt.metrics.snapshot();
        offline_step(&mut rng, step, 40, &[], 0);
        step += 1;
        let after = rt.metrics.snapshot();
        let votes = after.control_collectives - before.control_collectives;
        let bytes = after.control_bytes - before.control_bytes;
        if step >= 6 && votes > 0 && bytes == 8 * votes {
            break;
        }
    }
    // four steps in a row vote one word each; a loaded machine may still split a step's
    // tensors into other cycles now and then, which is re-learned: up to three windows
    for window in 1..=3 {
        let before = rt.metrics.snapshot();
        for _ in 0..4 {
            offline_step(&mut rng, step, 40, &[], 0);
            step += 1;
        }
        let after = rt.metrics.snapshot();
        let votes = after.control_collectives - before.control_collectives;
        let bytes = after.control_bytes - before.control_bytes;
        assert!(votes > 0);
        if bytes == 8 * votes {
            break;
        }
        assert!(
            window < 3,
            "one word per vote once the batches are groups: {bytes} bytes in {votes} votes in each of 3 windows of 4 steps"
        );
    }
    // every rank leaves out p.3 this step: its group dissolves, the others complete
    let n = size();
    let names = step_tensors(40, &[], 0);
    for (k, h) in submit_step(40, 0, &[3]) {
        let (_, len, dtype) = names[k].clone();
        let res = finish(h).unwrap();
        let want: Vec<f64> = (0..len)
            .map(|i| (0..n).map(|r| val(i + k, r)).sum())
            .collect();
        assert_close(&output(&res[0], dtype), &want, &format!("tensor {k}"));
    }
    for s in step + 1..step + 4 {
        offline_step(&mut rng, s, 40, &[], 0);
    }
    finish_job();
}

/// Once a step's tensors vote as one group, a step whose tensors come one by one (300 us
/// apart) is voted on when the group is complete here, not at every submission: with a 50 ms
/// cycle time, a few votes for 40 tensors (one per submission before the group was learned).
/// `GROUP_KIND=gossip`: the same steps as gossip, whose rounds are exact averages with
/// `FERROVOD_GOSSIP_SYNC_EVERY=1` (checked against the mean).
pub(crate) fn group_votes() {
    init();
    let kind = match std::env::var("GROUP_KIND").as_deref() {
        Ok("gossip") => OpKind::Gossip,
        _ => OpKind::Allreduce,
    };
    let n = size();
    let count = 40;
    let me = rank();
    let mine =
        |k: usize, step: usize| -> Vec<f64> { (0..100).map(|i| val(i + k + step, me)).collect() };
    let spec = |k: usize, step: usize| {
        tensor(
            &format!("gv.{k}"),
            DataType::F32,
            &[100],
            &mine(k, step),
            false,
        )
    };
    let per = if kind == OpKind::Gossip {
        n as f64
    } else {
        1.0
    };
    let check = |k: usize, step: usize, res: &TensorResult| {
        let want: Vec<f64> = (0..100)
            .map(|i| (0..n).map(|r| val(i + k + step, r)).sum::<f64>() / per)
            .collect();
        assert_close(
            &output(res, DataType::F32),
            &want,
            &format!("step {step} tensor {k}"),
        );
    };
    // learned from steps submitted in one piece: one batch, so one group
    for step in 0..4 {
        let res = run(OpSpec::new(
            kind,
            (0..count).map(|k| spec(k, step)).collect(),
        ))
        .unwrap();
        for (k, r) in res.iter().enumerate() {
            check(k, step, r);
        }
    }
    let before_paced = control_collectives();
    let mut votes = Vec::new();
    for step in 4..7 {
        let before = control_collectives();
        let handles: Vec<_> = (0..count)
            .map(|k| {
                std::thread::sleep(Duration::from_micros(300));
                submit(OpSpec::new(kind, vec![spec(k, step)])).unwrap()
            })
            .collect();
        for (k, h) in handles.into_iter().enumerate() {
            check(k, step, &finish(h).unwrap()[0]);
        }
        votes.push(control_collectives() - before);
    }
    assert!(control_collectives() > before_paced);
    assert!(
        votes.iter().all(|v| *v <= 6),
        "votes per paced step of {count} tensors: {votes:?}"
    );
    finish_job();
}

/// Once the batches vote as groups, rank 1 submits nothing for a step: rank 0's groups are
/// ready but never agreed; after the stall warning time rank 0 dissolves them, its tensors go
/// stale one by one, and the stall inspector shuts the job down on both ranks with a report.
pub(crate) fn online_groups_stall() {
    init();
    let me = rank();
    let mut rng = Lcg(43 + me as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    let start = Instant::now();
    let msg = if me == 0 {
        let errors: Vec<String> = submit_step(16, 0, &[])
            .into_iter()
            .filter_map(|(_, h)| finish(h).err().map(|e| e.to_string()))
            .collect();
        assert_eq!(errors.len(), 16, "every tensor of the step fails");
        errors[0].clone()
    } else {
        std::thread::sleep(Duration::from_secs(6));
        run(OpSpec::new(OpKind::Barrier, vec![]))
            .unwrap_err()
            .to_string()
    };
    assert_stall_report(&msg, &["Missing ranks:", "p."], start);
    runtime::shutdown();
    pass();
}

/// Cached names whose shape or op changes, and more names than the cache holds.
pub(crate) fn cache_changes() {
    init();
    let n = size();
    let me = rank();
    for step in 0..6 {
        let len = if step < 3 { 4 } else { 6 }; // shape change invalidates the cached entry
        let op = if step % 2 == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        for k in 0..10 {
            let mine: Vec<f64> = (0..len).map(|i| val(i + k, me)).collect();
            let mut spec = OpSpec::new(
                OpKind::Allreduce,
                vec![tensor(
                    &format!("c{k}"),
                    DataType::F32,
                    &[len as i64],
                    &mine,
                    false,
                )],
            );
            spec.reduce_op = op;
            let res = run(spec).unwrap();
            let want: Vec<f64> = (0..len)
                .map(|i| {
                    let xs = (0..n).map(|r| val(i + k, r));
                    if op == ReduceOp::Sum {
                        xs.sum()
                    } else {
                        xs.fold(0.0, f64::max)
                    }
                })
                .collect();
            assert_close(
                &output(&res[0], DataType::F32),
                &want,
                &format!("step {step} c{k}"),
            );
        }
    }
    finish_job();
}

/// Cross-rank mismatches fail on every rank with the same message naming the tensor.
pub(crate) fn mismatches() {
    init();
    let me = rank();
    let last = size() - 1;
    let expect = |spec: OpSpec, start: &str, name: &str| {
        let err = run(spec).unwrap_err();
        match &err {
            Error::Precondition(m) => {
                assert!(m.starts_with(start), "rank {me}: {m}");
                assert!(m.contains(&format!("tensor '{name}'")), "rank {me}: {m}");
            }
            other => panic!("rank {me}: expected a precondition error, got {other:?}"),
        }
    };
    // shape
    let len = if me == last { 3 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "m.shape",
                DataType::F32,
                &[len],
                &vec![1.0; len as usize],
                false,
            )],
        ),
        "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [2], but another rank sent a tensor of shape [3].",
        "m.shape",
    );
    // dtype
    let dtype = if me == last {
        DataType::I32
    } else {
        DataType::F32
    };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("m.dtype", dtype, &[2], &[1.0, 2.0], false)],
        ),
        "Mismatched data types: One rank had type float32, but another rank had type int32.",
        "m.dtype",
    );
    // op kind
    let kind = if me == last {
        OpKind::Allgather
    } else {
        OpKind::Allreduce
    };
    expect(
        OpSpec::new(
            kind,
            vec![tensor(
                "m.op",
                DataType::F32,
                &[2],
                &[1.0, 2.0],
                kind == OpKind::Allgather,
            )],
        ),
        "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.",
        "m.op",
    );
    // root
    let mut spec = OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("m.root", DataType::F32, &[2], &[1.0, 2.0], false)],
    );
    spec.root_rank = if me == last { 1 } else { 0 };
    expect(
        spec,
        "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1.",
        "m.root",
    );
    // reduction op
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.redop", DataType::F32, &[2], &[1.0, 2.0], false)],
    );
    spec.reduce_op = if me == last {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    expect(
        spec,
        "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction op 4.",
        "m.redop",
    );
    // allgather trailing dimension
    let cols = if me == last { 3 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allgather,
            vec![tensor(
                "m.ag",
                DataType::F32,
                &[1, cols],
                &vec![1.0; cols as usize],
                true,
            )],
        ),
        "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 2, but another rank sent a tensor with dimension 1 equal to 3.",
        "m.ag",
    );
    // a mismatch on a cached name (second use with a changed shape on one rank)
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.cached", DataType::F32, &[2], &[1.0, 2.0], false)],
    ))
    .unwrap();
    let len = if me == last { 4 } else { 2 };
    expect(
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "m.cached",
                DataType::F32,
                &[len],
                &vec![1.0; len as usize],
                false,
            )],
        ),
        "Mismatched ALLREDUCE tensor shapes",
        "m.cached",
    );
    // the job is still healthy afterwards
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("m.ok", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    assert_close(
        &output(&res[0], DataType::F32),
        &[size() as f64],
        "after mismatches",
    );
    finish_job();
}
