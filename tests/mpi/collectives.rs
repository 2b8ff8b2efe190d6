//! Every collective and dtype against closed forms (with and without fusion, channels, split MPI
//! calls), random submission orders, metrics, topology, callbacks, allocation failures, bad
//! arguments, the timeline and counts beyond 2^31.

use super::*;

pub(crate) struct Ctx {
    /// Ranks of the process set, in set order.
    ranks: Vec<usize>,
    set: i32,
    tag: String,
}

pub(crate) fn allreduce_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let shape = [3i64, 5];
    let count = 15;
    let mut ops = vec![
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];
    if dtype != DataType::Bool {
        ops.push(ReduceOp::Average);
    }
    for op in ops {
        let src = |i: usize, r: usize| match (dtype, op) {
            (DataType::Bool, _) => bit(i, r),
            (_, ReduceOp::Product) => factor(i, r),
            _ => val(i, r),
        };
        let mine: Vec<f64> = (0..count).map(|i| src(i, me)).collect();
        let want: Vec<f64> = (0..count)
            .map(|i| {
                let xs = ctx.ranks.iter().map(|r| src(i, *r));
                match op {
                    ReduceOp::Sum if dtype == DataType::Bool => xs.fold(0.0, f64::max),
                    ReduceOp::Sum => xs.sum(),
                    ReduceOp::Average => scaled(dtype, xs.sum::<f64>() * (1.0 / n as f64)),
                    ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                    ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                    ReduceOp::Product if dtype == DataType::Bool => xs.fold(1.0, f64::min),
                    ReduceOp::Product => xs.product(),
                    ReduceOp::Adasum => unreachable!(),
                }
            })
            .collect();
        // in place (library-owned), and out of place into a separate output
        for out_of_place in [false, true] {
            let name = format!("{}.ar.{dtype}.{op:?}.{out_of_place}", ctx.tag);
            let mut t = tensor(&name, dtype, &shape, &mine, false);
            if out_of_place {
                t.output = OutputMem::Owned(vec![0u8; count * dtype.size()]);
            }
            let mut spec = OpSpec::new(OpKind::Allreduce, vec![t]);
            spec.reduce_op = op;
            spec.process_set = ctx.set;
            let res = run(spec).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(res[0].shape, shape.to_vec());
            assert_close(&output(&res[0], dtype), &quantize(dtype, &want), &name);
        }
    }
    if dtype.is_float() || matches!(dtype, DataType::I32 | DataType::I64) {
        // prescale 0.5 then postscale 4: twice the sum (exact for these values)
        let mine: Vec<f64> = (0..count).map(|i| 2.0 * val(i, me)).collect();
        let want: Vec<f64> = (0..count)
            .map(|i| ctx.ranks.iter().map(|r| 4.0 * val(i, *r)).sum())
            .collect();
        let name = format!("{}.ar.scaled.{dtype}", ctx.tag);
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(&name, dtype, &shape, &mine, false)],
        );
        spec.prescale = 0.5;
        spec.postscale = 4.0;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_close(&output(&res[0], dtype), &want, &name);
    }
}

pub(crate) fn allgather_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    // set rank p contributes p + 1 rows of 2 columns
    let rows = |p: usize| p + 1;
    let row_vals = |p: usize, r: usize| -> Vec<f64> {
        (0..rows(p) * 2)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, r)
                } else {
                    val(i, r)
                }
            })
            .collect()
    };
    let want: Vec<f64> = ctx
        .ranks
        .iter()
        .enumerate()
        .flat_map(|(p, r)| row_vals(p, *r))
        .collect();
    let total_rows: usize = (0..ctx.ranks.len()).map(rows).sum();
    let single = format!("{}.ag.{dtype}", ctx.tag);
    let mut spec = OpSpec::new(
        OpKind::Allgather,
        vec![tensor(
            &single,
            dtype,
            &[rows(pos) as i64, 2],
            &row_vals(pos, me),
            true,
        )],
    );
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    assert_eq!(res[0].shape, vec![total_rows as i64, 2]);
    assert_close(&output(&res[0], dtype), &want, &single);

    // grouped: three tensors fused into one allgather
    let names: Vec<String> = (0..3)
        .map(|k| format!("{}.gag.{dtype}.{k}", ctx.tag))
        .collect();
    let tensors = names
        .iter()
        .map(|n| tensor(n, dtype, &[rows(pos) as i64, 2], &row_vals(pos, me), true))
        .collect();
    let mut spec = OpSpec::new(OpKind::Allgather, tensors);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, r) in res.iter().enumerate() {
        assert_close(&output(r, dtype), &want, &names[k]);
    }
}

pub(crate) fn broadcast_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    for root in [ctx.ranks[0], *ctx.ranks.last().unwrap()] {
        let vals: Vec<f64> = (0..6)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, me)
                } else {
                    val(i, me)
                }
            })
            .collect();
        let want: Vec<f64> = (0..6)
            .map(|i| {
                if dtype == DataType::Bool {
                    bit(i, root)
                } else {
                    val(i, root)
                }
            })
            .collect();
        for out_of_place in [false, true] {
            let name = format!("{}.bc.{dtype}.{root}.{out_of_place}", ctx.tag);
            let mut t = tensor(&name, dtype, &[2, 3], &vals, false);
            if out_of_place {
                t.output = OutputMem::Owned(vec![0u8; 6 * dtype.size()]);
            }
            let mut spec = OpSpec::new(OpKind::Broadcast, vec![t]);
            spec.root_rank = root as i32;
            spec.process_set = ctx.set;
            let res = run(spec).unwrap();
            assert_close(&output(&res[0], dtype), &want, &name);
        }
    }
}

pub(crate) fn alltoall_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    let code = |from: usize, to: usize, k: usize| ((from * 5 + to * 3 + k) % 13 + 1) as f64;
    let code = |from, to, k| {
        if dtype == DataType::Bool {
            code(from, to, k) % 2.0
        } else {
            code(from, to, k)
        }
    };
    // with splits: set rank p sends (p + q) % 3 rows of one column to set rank q
    let splits = |p: usize| -> Vec<i32> { (0..n).map(|q| ((p + q) % 3) as i32).collect() };
    let mut vals = Vec::new();
    for (q, s) in splits(pos).iter().enumerate() {
        vals.extend((0..*s as usize).map(|k| code(pos, q, k)));
    }
    let dim0 = vals.len() + 1; // one extra trailing row that is not sent
    vals.push(0.0);
    let name = format!("{}.a2a.{dtype}", ctx.tag);
    let mut t = tensor(&name, dtype, &[dim0 as i64, 1], &vals, true);
    t.splits = Some(splits(pos));
    let mut spec = OpSpec::new(OpKind::Alltoall, vec![t]);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    let want_splits: Vec<i32> = (0..n).map(|p| splits(p)[pos]).collect();
    let want: Vec<f64> = (0..n)
        .flat_map(|p| (0..splits(p)[pos] as usize).map(move |k| code(p, pos, k)))
        .collect();
    assert_eq!(
        res[0].received_splits, want_splits,
        "{name}: received splits"
    );
    assert_eq!(res[0].shape, vec![want.len() as i64, 1]);
    assert_close(&output(&res[0], dtype), &want, &name);

    // even split, two columns
    let vals: Vec<f64> = (0..n)
        .flat_map(|q| (0..2).map(move |k| code(pos, q, k)))
        .collect();
    let name = format!("{}.a2a.even.{dtype}", ctx.tag);
    let mut spec = OpSpec::new(
        OpKind::Alltoall,
        vec![tensor(&name, dtype, &[n as i64, 2], &vals, true)],
    );
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    let want: Vec<f64> = (0..n)
        .flat_map(|p| (0..2).map(move |k| code(p, pos, k)))
        .collect();
    assert_eq!(res[0].received_splits, vec![1; n]);
    assert_close(&output(&res[0], dtype), &want, &name);
}

pub(crate) fn reducescatter_checks(ctx: &Ctx, dtype: DataType) {
    let me = rank();
    let n = ctx.ranks.len();
    let pos = ctx.ranks.iter().position(|r| *r == me).unwrap();
    let dim0 = 2 * n + 1; // uneven: the first rank gets one extra row
    let cols = 2;
    let mine: Vec<f64> = (0..dim0 * cols).map(|i| val(i, me)).collect();
    let first_row: usize = (0..pos).map(|p| dim0 / n + usize::from(p < dim0 % n)).sum();
    let my_rows = dim0 / n + usize::from(pos < dim0 % n);
    for op in [ReduceOp::Sum, ReduceOp::Average] {
        let want: Vec<f64> = (first_row * cols..(first_row + my_rows) * cols)
            .map(|i| {
                let s: f64 = ctx.ranks.iter().map(|r| val(i, *r)).sum();
                if op == ReduceOp::Average {
                    scaled(dtype, s * (1.0 / n as f64))
                } else {
                    s
                }
            })
            .collect();
        let name = format!("{}.rs.{dtype}.{op:?}", ctx.tag);
        let mut spec = OpSpec::new(
            OpKind::Reducescatter,
            vec![tensor(
                &name,
                dtype,
                &[dim0 as i64, cols as i64],
                &mine,
                true,
            )],
        );
        spec.reduce_op = op;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_eq!(res[0].shape, vec![my_rows as i64, cols as i64], "{name}");
        let want = quantize(dtype, &want);
        assert_close(&output(&res[0], dtype), &want, &name);
        // grouped: two tensors of different lengths fused into one reduce-scatter
        let names = [format!("{name}.g0"), format!("{name}.g1")];
        let other: Vec<f64> = (0..n * cols).map(|i| val(i + 100, me)).collect();
        let mut spec = OpSpec::new(
            OpKind::Reducescatter,
            vec![
                tensor(&names[0], dtype, &[dim0 as i64, cols as i64], &mine, true),
                tensor(&names[1], dtype, &[n as i64, cols as i64], &other, true),
            ],
        );
        spec.reduce_op = op;
        spec.process_set = ctx.set;
        let res = run(spec).unwrap();
        assert_close(&output(&res[0], dtype), &want, &names[0]);
        let want1: Vec<f64> = (pos * cols..(pos + 1) * cols)
            .map(|i| {
                let s: f64 = ctx.ranks.iter().map(|r| val(i + 100, *r)).sum();
                if op == ReduceOp::Average {
                    scaled(dtype, s * (1.0 / n as f64))
                } else {
                    s
                }
            })
            .collect();
        assert_close(&output(&res[1], dtype), &quantize(dtype, &want1), &names[1]);
    }
}

pub(crate) fn grouped_allreduce_checks(ctx: &Ctx) {
    let me = rank();
    // many small tensors of two dtypes in one group: fused per dtype, completed together
    let mut tensors = Vec::new();
    let mut wants = Vec::new();
    for k in 0..12 {
        let dtype = if k % 3 == 0 {
            DataType::F64
        } else {
            DataType::F32
        };
        let len = 1 + k * 3;
        let mine: Vec<f64> = (0..len).map(|i| val(i + k, me)).collect();
        let want: Vec<f64> = (0..len)
            .map(|i| ctx.ranks.iter().map(|r| val(i + k, *r)).sum())
            .collect();
        tensors.push(tensor(
            &format!("{}.gar.{k}", ctx.tag),
            dtype,
            &[len as i64],
            &mine,
            false,
        ));
        wants.push((dtype, want));
    }
    let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, (r, (dtype, want))) in res.iter().zip(&wants).enumerate() {
        assert_close(&output(r, *dtype), want, &format!("grouped allreduce {k}"));
    }
    // large and small tensors in one batch, scaled, some out of place: on GPUs the large ones
    // (from 1 MiB) are reduced where they are and the small ones through the fusion buffer
    let n = ctx.ranks.len() as f64;
    let lens = [300_000usize, 5, 17, 262_144, 9, 400_000];
    let mut tensors = Vec::new();
    let mut wants = Vec::new();
    for (k, len) in lens.iter().enumerate() {
        let mine: Vec<f64> = (0..*len).map(|i| 2.0 * val(i + k, me)).collect();
        let want: Vec<f64> = (0..*len)
            .map(|i| 4.0 * ctx.ranks.iter().map(|r| val(i + k, *r)).sum::<f64>() / n)
            .collect();
        let mut t = tensor(
            &format!("{}.gar.mixed.{k}", ctx.tag),
            DataType::F32,
            &[*len as i64],
            &mine,
            false,
        );
        if k % 2 == 1 {
            t.output = OutputMem::Owned(vec![0u8; len * 4]);
        }
        tensors.push(t);
        wants.push(want);
    }
    let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
    spec.reduce_op = ReduceOp::Average;
    spec.prescale = 0.5;
    spec.postscale = 4.0;
    spec.process_set = ctx.set;
    let res = run(spec).unwrap();
    for (k, (r, want)) in res.iter().zip(&wants).enumerate() {
        let what = format!("grouped mixed-size allreduce {k}");
        assert_close(
            &output(r, DataType::F32),
            &quantize(DataType::F32, want),
            &what,
        );
    }
}

pub(crate) fn barrier_check(ctx: &Ctx) {
    let mut spec = OpSpec::new(OpKind::Barrier, vec![]);
    spec.process_set = ctx.set;
    run(spec).unwrap();
}

pub(crate) fn all_ops(ctx: &Ctx) {
    for dtype in DataType::ALL {
        allreduce_checks(ctx, dtype);
        allgather_checks(ctx, dtype);
        broadcast_checks(ctx, dtype);
        alltoall_checks(ctx, dtype);
        if dtype != DataType::Bool {
            reducescatter_checks(ctx, dtype);
        }
    }
    grouped_allreduce_checks(ctx);
    barrier_check(ctx);
}

/// Every op × dtype on the world, then on two disjoint process sets running at once.
pub(crate) fn collectives() {
    init();
    let n = size();
    let me = rank();
    all_ops(&Ctx {
        ranks: (0..n).collect(),
        set: 0,
        tag: "world".into(),
    });
    let rt = runtime::runtime().unwrap();
    // FERROVOD_TEST_HIERARCHICAL: whether the global set's allreduces went hierarchical
    if let Ok(want) = std::env::var("FERROVOD_TEST_HIERARCHICAL") {
        let batches = rt.metrics.snapshot().hierarchical_batches;
        assert_eq!(batches > 0, want == "1", "{batches} hierarchical batches");
    }
    // static-like sets added dynamically: lower and upper half, disjoint, used concurrently
    let half = n.div_ceil(2);
    let lower: Vec<i32> = (0..half as i32).collect();
    let upper: Vec<i32> = (half as i32..n as i32).collect();
    let mut ids = Vec::new();
    for ranks in [&lower, &upper] {
        if ranks.is_empty() {
            continue;
        }
        let h = rt.add_process_set(ranks).unwrap();
        h.wait(None).unwrap();
        ids.push((h.value(), ranks.clone()));
    }
    let (id, ranks) = ids
        .iter()
        .find(|(_, r)| r.contains(&(me as i32)))
        .unwrap()
        .clone();
    assert_eq!(rt.process_set_ranks(id), Some(ranks.clone()));
    let before = rt.metrics.snapshot().hierarchical_batches;
    all_ops(&Ctx {
        ranks: ranks.iter().map(|r| *r as usize).collect(),
        set: id,
        tag: format!("set{id}"),
    });
    // FERROVOD_TEST_HIERARCHICAL_SETS: the halves span nodes evenly, so they go hierarchical
    if std::env::var("FERROVOD_TEST_HIERARCHICAL_SETS").is_ok_and(|v| v == "1") {
        let after = rt.metrics.snapshot().hierarchical_batches;
        assert!(after > before, "no hierarchical batch in set {id}");
    }
    finish_job();
}

/// Each rank submits the same tensors in its own random order with random pauses, for several
/// steps; results must be identical and correct everywhere.
pub(crate) fn random_order() {
    init();
    random_order_steps();
    finish_job();
}

/// Rank 1 starts with a different fusion threshold, direct threshold and cache capacity: the
/// ranks must still agree (rank 0's values win) and compute correct sums.
pub(crate) fn env_differs() {
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("1") {
        // SAFETY: set before any thread of this process reads the environment.
        unsafe {
            std::env::set_var("HOROVOD_CACHE_CAPACITY", "0");
            std::env::set_var("HOROVOD_FUSION_THRESHOLD", "100");
            std::env::set_var("FERROVOD_FUSION_DIRECT_BYTES", "0");
        }
    }
    init();
    random_order_steps();
    finish_job();
}

pub(crate) fn random_order_steps() {
    let n = size();
    let me = rank();
    let mut rng = Lcg(0x9e37_79b9 + me as u64 * 7919);
    let count = 40;
    for step in 0..5 {
        let mut order: Vec<usize> = (0..count).collect();
        for i in (1..count).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
        let mut handles = Vec::new();
        for &k in &order {
            if rng.next().is_multiple_of(8) {
                std::thread::sleep(Duration::from_micros(rng.next() % 3000));
            }
            let len = 1 + (k * 37) % 300;
            let dtype = [DataType::F32, DataType::F64, DataType::I32, DataType::BF16][k % 4];
            let mine: Vec<f64> = (0..len).map(|i| val(i + k + step, me)).collect();
            let name = format!("grad.{k}");
            let h = submit(OpSpec::new(
                OpKind::Allreduce,
                vec![tensor(&name, dtype, &[len as i64], &mine, false)],
            ))
            .unwrap();
            handles.push((k, len, dtype, h));
        }
        for (k, len, dtype, h) in handles {
            let res = finish(h).unwrap();
            let want: Vec<f64> = (0..len)
                .map(|i| (0..n).map(|r| val(i + k + step, r)).sum())
                .collect();
            assert_close(
                &output(&res[0], dtype),
                &want,
                &format!("step {step} tensor {k}"),
            );
        }
    }
}

/// The counters: data bytes and tensors exactly what was submitted; every cycle issued its
/// mode's votes (two in the horovod mode, one otherwise), plus coordinator rounds for new names.
pub(crate) fn metrics() {
    init();
    let rt = runtime::runtime().unwrap();
    let horovod = std::env::var("FERROVOD_NEGOTIATION").as_deref() == Ok("horovod");
    let me = rank();
    let before = rt.metrics.snapshot();
    let (steps, count, len) = (4, 12, 50usize);
    for step in 0..steps {
        let handles: Vec<_> = (0..count)
            .map(|k| {
                let mine: Vec<f64> = (0..len).map(|i| val(i + k + step, me)).collect();
                submit(OpSpec::new(
                    OpKind::Allreduce,
                    vec![tensor(
                        &format!("m{k}"),
                        DataType::F32,
                        &[len as i64],
                        &mine,
                        false,
                    )],
                ))
                .unwrap()
            })
            .collect();
        for h in handles {
            finish(h).unwrap();
        }
    }
    let after = rt.metrics.snapshot();
    let d = |f: fn(&runtime::metrics::MetricsSnapshot) -> u64| f(&after) - f(&before);
    assert_eq!(d(|m| m.tensors), (steps * count) as u64);
    assert_eq!(d(|m| m.data_bytes), (steps * count * len * 4) as u64);
    let batches = d(|m| m.data_collectives);
    assert!(
        (1..=(steps * count) as u64).contains(&batches),
        "{batches} batches"
    );
    assert!(d(|m| m.fused_batches) <= batches);
    let cycles = d(|m| m.cycles);
    let votes = if horovod { 2 } else { 1 };
    let control = d(|m| m.control_collectives);
    // each cycle votes; the first sight of the 12 names adds coordinator rounds (gather + bcast)
    assert!(
        control >= votes * cycles,
        "{control} control collectives in {cycles} cycles"
    );
    assert!(
        control <= votes * cycles + 2 * cycles,
        "{control} in {cycles} cycles"
    );
    assert!(
        control > votes * cycles,
        "new names need a coordinator round"
    );
    assert!(d(|m| m.control_bytes) >= 8 * control);
    assert!(d(|m| m.negotiation_ns) > 0);
    finish_job();
}

/// Enqueue-time errors: on the calling rank, immediately, nothing enqueued.
pub(crate) fn bad_arguments() {
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert_eq!(err, Error::NotInitialized);
    init();
    let me = rank();
    let n = size();
    let invalid = |spec: OpSpec, want: &str| {
        let err = submit(spec).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::Aborted(_)),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(want),
            "rank {me}: got '{err}', want '{want}'"
        );
    };
    // duplicate name while the first is in flight: "dup.<r>" cannot complete before the others
    // submit it, which they do only after the barrier that rank r reaches after its attempt
    let dup = |r: usize| {
        OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                &format!("dup.{r}"),
                DataType::F32,
                &[1],
                &[1.0],
                false,
            )],
        )
    };
    let mine = submit(dup(me)).unwrap();
    invalid(
        dup(me),
        "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is currently being processed.",
    );
    run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    let others: Vec<_> = (0..n)
        .filter(|r| *r != me)
        .map(|r| submit(dup(r)).unwrap())
        .collect();
    for h in std::iter::once(mine).chain(others) {
        finish(h).unwrap();
    }
    // same name twice inside one group
    invalid(
        OpSpec::new(
            OpKind::Allreduce,
            vec![
                tensor("g", DataType::F32, &[1], &[1.0], false),
                tensor("g", DataType::F32, &[1], &[1.0], false),
            ],
        ),
        "same name",
    );
    let mut spec = OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("b", DataType::F32, &[1], &[1.0], false)],
    );
    spec.root_rank = n as i32;
    invalid(
        spec,
        &format!("broadcast received invalid root rank {n} for provided process set"),
    );
    let mut t = tensor("a2a", DataType::F32, &[4], &[1.0; 4], true);
    t.splits = Some(vec![1; n + 1]);
    invalid(
        OpSpec::new(OpKind::Alltoall, vec![t]),
        "Number of entries in splits does not equal number of workers.",
    );
    let mut t = tensor("a2a", DataType::F32, &[4], &[1.0; 4], true);
    t.splits = Some(vec![3; n]);
    invalid(
        OpSpec::new(OpKind::Alltoall, vec![t]),
        "Sum of splits entries is greater than the first dimension of tensor.",
    );
    invalid(
        OpSpec::new(
            OpKind::Alltoall,
            vec![tensor(
                "a2a",
                DataType::F32,
                &[n as i64 + 1],
                &vec![1.0; n + 1],
                true,
            )],
        ),
        "splits not provided, but first dimension of tensor is not an even multiple of the number of workers.",
    );
    let mut spec = OpSpec::new(
        OpKind::Reducescatter,
        vec![tensor("rs", DataType::F32, &[4], &[1.0; 4], true)],
    );
    spec.reduce_op = ReduceOp::Max;
    invalid(
        spec,
        "Reducescatter currently only supports AVERAGE and SUM.",
    );
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ad", DataType::F32, &[1], &[1.0], false)],
    );
    spec.reduce_op = ReduceOp::Adasum;
    invalid(spec, "Adasum");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("bavg", DataType::Bool, &[1], &[1.0], false)],
    );
    spec.reduce_op = ReduceOp::Average;
    invalid(spec, "cannot be averaged");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ps", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = 42;
    invalid(spec, "Process set provided does not exist");
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("dev", DataType::F32, &[1], &[1.0], false)],
    );
    spec.device = 0;
    if ferrovod::transport::cuda::cuda_present() {
        invalid(spec, "must be given as device memory");
    } else {
        // the documented error of a GPU request where CUDA cannot be loaded
        let err = submit(spec).unwrap_err();
        assert!(matches!(err, Error::Precondition(_)), "{err:?}");
        assert!(
            err.to_string()
                .contains("GPU device 0 requested, but CUDA is not available on this machine"),
            "rank {me}: got '{err}'"
        );
    }
    let mut t = tensor("size", DataType::F32, &[3], &[1.0; 2], false);
    t.shape = vec![3];
    invalid(
        OpSpec::new(OpKind::Allreduce, vec![t]),
        "has 8 bytes but its shape and dtype need 12",
    );
    invalid(
        OpSpec::new(
            OpKind::Allgather,
            vec![tensor("ag", DataType::F32, &[1], &[1.0], false)],
        ),
        "allocated after negotiation",
    );
    invalid(OpSpec::new(OpKind::Allreduce, vec![]), "no tensors");
    // the job is still healthy afterwards
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("ok", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    assert_close(
        &output(&res[0], DataType::F32),
        &[n as f64],
        "after bad arguments",
    );
    finish_job();
}

/// FERROVOD_LOCAL_SIZE=2 on 4 ranks emulates two hosts of two ranks each.
pub(crate) fn topology() {
    init();
    let rt = runtime::runtime().unwrap();
    let t = rt.topology().clone();
    let r = t.rank;
    assert_eq!((t.size, t.local_size, t.cross_size), (4, 2, 2));
    assert_eq!((t.local_rank, t.cross_rank), (r % 2, r / 2));
    assert!(t.is_homogeneous);
    assert!(t.mpi_threads_supported);
    finish_job();
}

/// Open MPI's TCP transport runs as ferrovod starts it (without put: `OMPI_TCP_FLAGS`), or as
/// the job asked (`FERROVOD_TEST_EXPECT_PUT=1` with put in `OMPI_MCA_btl_tcp_flags`), read back
/// from Open MPI itself; reading it does not lower MPI's thread level.
pub(crate) fn tcp_flags() {
    init();
    let expect = std::env::var("FERROVOD_TEST_EXPECT_PUT").unwrap() == "1";
    assert_eq!(
        ferrovod::transport::mpi::tcp_put_in_force(),
        Some(expect),
        "btl_tcp_flags' put"
    );
    // reading it (at init and here) leaves MPI at the thread level it started with
    assert_eq!(
        mpi::environment::threading_support(),
        mpi::Threading::Multiple,
        "MPI's thread level after reading btl_tcp_flags"
    );
    finish_job();
}

pub(crate) struct FailingAllocator;

impl ferrovod::runtime::entry::OutputAllocator for FailingAllocator {
    fn allocate(
        &mut self,
        _index: usize,
        _shape: &[i64],
        bytes: usize,
    ) -> Result<ferrovod::transport::memory::HostBuffer, Error> {
        Err(Error::Aborted(format!(
            "test allocator refuses {bytes} bytes"
        )))
    }
}

/// An output allocation that fails on one rank fails that rank's tensor only: the rank still
/// takes part in the collective, so the others complete with correct values instead of hanging.
pub(crate) fn alloc_failure() {
    init();
    let me = rank();
    for kind in [OpKind::Allgather, OpKind::Reducescatter, OpKind::Alltoall] {
        let name = format!("alloc.{}", kind.name());
        let mut spec = OpSpec::new(
            kind,
            vec![tensor(&name, DataType::F32, &[2], &[1.0, 2.0], true)],
        );
        if me == 1 {
            spec.allocator = Some(Arc::new(std::sync::Mutex::new(FailingAllocator)));
        }
        match run(spec) {
            Ok(res) => {
                assert_eq!(me, 0);
                let want: Vec<f64> = match kind {
                    OpKind::Allgather => vec![1.0, 2.0, 1.0, 2.0],
                    OpKind::Reducescatter => vec![2.0], // row 0 summed over both ranks
                    _ => vec![1.0, 1.0],
                };
                assert_close(&output(&res[0], DataType::F32), &want, &name);
            }
            Err(e) => {
                assert_eq!(me, 1, "{e}");
                // output sizes: allgather 2 ranks x 2 floats, reducescatter 1 row, alltoall 2 rows
                let bytes = match kind {
                    OpKind::Allgather => 16,
                    OpKind::Reducescatter => 4,
                    _ => 8,
                };
                assert_eq!(
                    e,
                    Error::Aborted(format!("test allocator refuses {bytes} bytes"))
                );
            }
        }
    }
    finish_job();
}

/// Completion callbacks run on the background thread: they see the status, and waiting there
/// for an unfinished operation is refused instead of deadlocking.
pub(crate) fn callbacks() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    // B is pending on rank 0 until rank 1 submits it after A.
    let b = if me == 0 {
        Some(
            submit(OpSpec::new(
                OpKind::Allreduce,
                vec![tensor("cb.b", DataType::F32, &[1], &[1.0], false)],
            ))
            .unwrap(),
        )
    } else {
        None
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let b2 = b.clone();
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("cb.a", DataType::F32, &[1], &[2.0], false)],
    );
    spec.callback = Some(Box::new(move |_, r: &Result<(), Error>| {
        let inner = b2.map(|b| b.wait(None));
        tx.send((r.clone(), inner)).unwrap();
    }));
    let a = submit(spec).unwrap();
    let (status, inner) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!(status, Ok(()));
    if me == 0 {
        let err = inner.unwrap().unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot wait for an operation from a ferrovod callback"),
            "{err}"
        );
    }
    assert_close(
        &output(&finish(a).unwrap()[0], DataType::F32),
        &[4.0],
        "cb.a",
    );
    let b = match b {
        Some(b) => b,
        None => submit(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("cb.b", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap(),
    };
    assert_close(
        &output(&finish(b).unwrap()[0], DataType::F32),
        &[2.0],
        "cb.b",
    );
    assert!(
        rt.handles.is_empty(),
        "handles leaked: {}",
        rt.handles.len()
    );
    finish_job();
}

pub(crate) fn timeline() {
    init();
    let me = rank();
    for step in 0..3 {
        let tensors = (0..4)
            .map(|k| {
                tensor(
                    &format!("timeline.grad.{k}"),
                    DataType::F32,
                    &[8],
                    &[(me + step) as f64; 8],
                    false,
                )
            })
            .collect();
        run(OpSpec::new(OpKind::Allreduce, tensors)).unwrap();
    }
    run(OpSpec::new(
        OpKind::Allgather,
        vec![tensor(
            "timeline.ag",
            DataType::F32,
            &[2],
            &[1.0, 2.0],
            true,
        )],
    ))
    .unwrap();
    finish_job();
}

/// The elementwise reductions.
pub(crate) const REDUCTIONS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// Lengths that do and do not divide by the ranks, and fewer elements than ranks.
pub(crate) fn ring_lengths(n: usize) -> [usize; 7] {
    [0, 1, n - 1, n, n + 1, 1000, 4099]
}

/// Element i of rank r in the ring scenarios: small integers, exact in every dtype whatever
/// the order of the reduction (products stay below 2^4 on 4 ranks).
pub(crate) fn ring_value(dtype: DataType, op: ReduceOp, i: usize, r: usize) -> f64 {
    if dtype == DataType::Bool {
        f64::from(u8::from((i + r).is_multiple_of(3)))
    } else if op == ReduceOp::Product {
        ((i * 7 + r * 3) % 2 + 1) as f64
    } else if matches!(dtype, DataType::U8 | DataType::U16) {
        ((i * 7 + r * 3) % 9) as f64
    } else {
        ((i * 7 + r * 3) % 9) as f64 - 4.0
    }
}

/// The ring allreduce (collective/ring.rs, over point-to-point transfers) against the native
/// MPI allreduce, byte for byte, for every dtype and reduction and the ring lengths; Sum also
/// against its closed form. Again with MPI calls limited to 7 bytes (the chunked transfers) for
/// one dtype of each element size: chunking does not depend on the dtype, and thousands of
/// 7-byte messages per call make an oversubscribed machine slow. MPI alone first, with the
/// runtime (and its background thread's votes) started only for the final barrier.
pub(crate) fn ring() {
    use ferrovod::collective::ring::{HostWorkspace, allreduce, allreduce_staged};
    use ferrovod::transport::Transport;
    use ferrovod::transport::mpi::{MpiComm, finalize_mpi, init_mpi};

    assert!(init_mpi(true).unwrap().0, "MPI initialised by this test");
    let world = MpiComm::world().unwrap();
    let small = MpiComm::world().unwrap().with_max_count(7);
    let (me, n) = (world.rank(), world.size());
    let chunked = [DataType::U8, DataType::F16, DataType::F32, DataType::F64];
    for dtype in DataType::ALL {
        for op in REDUCTIONS {
            for elems in ring_lengths(n) {
                let mine: Vec<f64> = (0..elems).map(|i| ring_value(dtype, op, i, me)).collect();
                let mut native = encode(dtype, &mine);
                world.allreduce(None, &mut native, dtype, op).unwrap();
                let comms: &[&MpiComm] = if chunked.contains(&dtype) && op == ReduceOp::Sum {
                    &[&world, &small]
                } else {
                    &[&world]
                };
                for comm in comms {
                    let mut by_ring = encode(dtype, &mine);
                    let mut ws = HostWorkspace::new(*comm, &mut by_ring, elems, dtype).unwrap();
                    allreduce(&mut ws, elems, dtype, op).unwrap();
                    let what = format!("{} {op:?} {elems} elements", dtype.name());
                    assert_eq!(by_ring, native, "ring vs native: {what}");
                    if op == ReduceOp::Sum && dtype != DataType::Bool {
                        let want: Vec<f64> = (0..elems)
                            .map(|i| (0..n).map(|r| ring_value(dtype, op, i, r)).sum())
                            .collect();
                        assert_eq!(decode(dtype, &by_ring), want, "closed form: {what}");
                    }
                }
            }
        }
    }
    // chunks of many segments (each reduced while the later ones arrive), the last segment
    // short
    for dtype in [DataType::F16, DataType::F32, DataType::F64] {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let elems = n * ((10 << 20) / dtype.size()) + 3;
            let mine: Vec<f64> = (0..elems).map(|i| ring_value(dtype, op, i, me)).collect();
            let mut native = encode(dtype, &mine);
            world.allreduce(None, &mut native, dtype, op).unwrap();
            let mut by_ring = encode(dtype, &mine);
            allreduce_staged(&world, &mut by_ring, dtype, op, &mut |_| Ok(())).unwrap();
            let what = format!("{} {op:?} {elems} elements in segments", dtype.name());
            assert!(by_ring == native, "ring vs native: {what}");
        }
    }
    // a rank asking for a peer outside the communicator gets an error, not a hang
    let mut buf = [0u8; 4];
    assert!(matches!(
        world.sendrecv(&[1, 2, 3, 4], n, &mut buf, 0),
        Err(Error::InvalidArgument(_))
    ));
    drop((world, small));
    init();
    finish_job();
    finalize_mpi();
}

/// Element counts beyond 2^31: a u8 allreduce of 2^31 + 3 elements and an allgather whose
/// output exceeds 2^31 bytes.
pub(crate) fn large_counts() {
    init();
    let me = rank();
    let n = size();
    let count = (1usize << 31) + 3;
    let data: Vec<u8> = (0..count).map(|i| ((i % 5) + me) as u8).collect();
    let spec = OpSpec::new(
        OpKind::Allreduce,
        vec![TensorSpec {
            name: "big".into(),
            dtype: DataType::U8,
            shape: vec![count as i64],
            input: InputMem::Owned(data),
            output: OutputMem::InPlace,
            splits: None,
        }],
    );
    let out = run(spec).unwrap().remove(0).output.unwrap();
    let want = |i: usize| (0..n).map(|r| (i % 5) + r).sum::<usize>() as u8;
    for i in (0..count).step_by(4099).chain(count - 8..count) {
        assert_eq!(out[i], want(i), "element {i}");
    }
    drop(out);
    let rows = (1usize << 30) + 7 * me; // two ranks: > 2^31 bytes gathered
    let data: Vec<u8> = (0..rows).map(|i| ((i + me) % 251) as u8).collect();
    let spec = OpSpec::new(
        OpKind::Allgather,
        vec![TensorSpec {
            name: "big.ag".into(),
            dtype: DataType::U8,
            shape: vec![rows as i64],
            input: InputMem::Owned(data),
            output: OutputMem::Later,
            splits: None,
        }],
    );
    let res = run(spec).unwrap().remove(0);
    let out = res.output.unwrap();
    let rows_of = |r: usize| (1usize << 30) + 7 * r;
    assert_eq!(out.len(), (0..n).map(rows_of).sum::<usize>());
    let mut off = 0;
    for r in 0..n {
        for i in (0..rows_of(r))
            .step_by(7919)
            .chain(rows_of(r) - 3..rows_of(r))
        {
            assert_eq!(out[off + i], ((i + r) % 251) as u8, "rank {r} row {i}");
        }
        off += rows_of(r);
    }
    finish_job();
}

/// Allreduces alone, of every dtype NCCL reduces, single and grouped, with
/// `HOROVOD_HIERARCHICAL_ALLREDUCE` and `FERROVOD_LOCAL_SIZE=1`: every rank is a node of its
/// own, so on GPUs NCCL runs inside each node and MPI across the nodes, and only the nodes'
/// communicators open (the ranks may share one GPU); on host memory the same shape over MPI.
pub(crate) fn hierarchical_allreduces() {
    init();
    let ctx = Ctx {
        ranks: (0..size()).collect(),
        set: 0,
        tag: "world".into(),
    };
    let dtypes = DataType::ALL.into_iter();
    for dtype in dtypes.filter(|d| !gpu_mode() || ferrovod::transport::nccl::reduces(*d)) {
        allreduce_checks(&ctx, dtype);
    }
    grouped_allreduce_checks(&ctx);
    assert!(hierarchical_batches() > 0, "no hierarchical batch");
    finish_job();
}

/// Batches this process has allreduced hierarchically so far.
fn hierarchical_batches() -> u64 {
    runtime::runtime()
        .unwrap()
        .metrics
        .snapshot()
        .hierarchical_batches
}

/// Fused batches of tens of MiB whose scaling rides the copies into and out of the fusion
/// buffer (in pieces of 64 KiB): tensors of odd sizes, inputs in place and in separate outputs;
/// average with pre- and postscale, sum and max. Hierarchical, they are pipelined in pieces.
pub(crate) fn large_fused() {
    init();
    let (me, n) = (rank(), size());
    // elements: 3 pieces' worth of f32 and more, with ends inside pieces
    let sizes = [3_000_001usize, 1, 5_000_003, 257, 2_000_000];
    let cases = [
        (DataType::F32, ReduceOp::Average, 0.5, 3.0),
        (DataType::F64, ReduceOp::Sum, 1.0, 1.0),
        (DataType::I32, ReduceOp::Max, 1.0, 1.0),
    ];
    for (case, (dtype, op, pre, post)) in cases.into_iter().enumerate() {
        let v = |t: usize, i: usize, r: usize| ((i * 7 + t * 5 + r * 3) % 13 + 1) as f64;
        let tensors: Vec<TensorSpec> = sizes
            .iter()
            .enumerate()
            .map(|(t, &len)| {
                let vals: Vec<f64> = (0..len).map(|i| v(t, i, me)).collect();
                let bytes = encode(dtype, &vals);
                let output = match t % 2 {
                    0 => OutputMem::InPlace,
                    _ => OutputMem::Owned(vec![0u8; bytes.len()]),
                };
                TensorSpec {
                    name: format!("large_fused.{case}.{t}"),
                    dtype,
                    shape: vec![len as i64],
                    input: InputMem::Owned(bytes),
                    output,
                    splits: None,
                }
            })
            .collect();
        let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
        spec.reduce_op = op;
        spec.prescale = pre;
        spec.postscale = post;
        let results = run(spec).unwrap();
        for (t, (res, &len)) in results.iter().zip(&sizes).enumerate() {
            let got = output(res, dtype);
            assert_eq!(got.len(), len, "tensor {t}");
            for i in (0..len).step_by(997).chain(len.saturating_sub(3)..len) {
                let each = (0..n).map(|r| v(t, i, r));
                let want = match op {
                    ReduceOp::Max => each.fold(f64::MIN, f64::max),
                    ReduceOp::Average => each.map(|x| x * pre).sum::<f64>() / n as f64 * post,
                    _ => each.sum::<f64>(),
                };
                let w = quantize(dtype, &[want])[0];
                assert!(
                    (got[i] - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "case {case} tensor {t} element {i}: got {}, want {w}",
                    got[i]
                );
            }
        }
    }
    // FERROVOD_TEST_HIERARCHICAL=1: the batches went hierarchical, in several pieces each
    if std::env::var("FERROVOD_TEST_HIERARCHICAL").is_ok_and(|v| v == "1") {
        assert!(hierarchical_batches() > 0, "no hierarchical batch");
        let smallest_batch = 4 * sizes.iter().sum::<usize>();
        assert!(smallest_batch > 2 * ferrovod::collective::hierarchical::PIECE_BYTES);
    }
    finish_job();
}

/// `FERROVOD_COMPRESSION=fp16|bf16`: f32 sums and averages travel as 16-bit floats, fused and
/// alone, over all ranks and (from 3 ranks) a process set of all but the last, within the
/// codec's bound of an f64 reference; bits below the 16-bit precision are
/// gone (the wire really was 16-bit); averages divide before the cast (no overflow where one
/// rank's value fits); f64 sums and f32 maxima stay exact (they travel uncompressed).
pub(crate) fn compressed() {
    init();
    let (me, n) = (rank(), size());
    let setting = std::env::var("FERROVOD_COMPRESSION").expect("FERROVOD_COMPRESSION");
    // unit roundoff of the wire type
    let eps = match setting.as_str() {
        "fp16" => 2f64.powi(-11),
        "bf16" => 2f64.powi(-8),
        other => panic!("compressed scenario under FERROVOD_COMPRESSION={other}"),
    };
    let hierarchical_before = runtime::runtime()
        .unwrap()
        .metrics
        .snapshot()
        .hierarchical_batches;
    let v = |t: usize, i: usize, r: usize| ((i * 7 + t * 3 + r * 5) % 17) as f64 * 0.37 - 2.0;
    let sizes = [1usize, 1000, 33, 4097];
    let cases = [
        (ReduceOp::Sum, 1.0, 1.0),
        (ReduceOp::Average, 1.0, 1.0),
        (ReduceOp::Average, 2.0, 0.25),
    ];
    // every case fused (all tensors in one op) and alone (the first tensor by itself), over
    // the process set `set` of `members`
    let check = |set: i32, members: &[usize], tag: &str| {
        for (case, (op, pre, post)) in cases.into_iter().enumerate() {
            for fused in [true, false] {
                let count = if fused { sizes.len() } else { 1 };
                let tensors: Vec<TensorSpec> = (0..count)
                    .map(|t| {
                        let vals: Vec<f64> = (0..sizes[t]).map(|i| v(t, i, me)).collect();
                        tensor(
                            &format!("cmp{tag}.{case}.{fused}.{t}"),
                            DataType::F32,
                            &[sizes[t] as i64],
                            &vals,
                            false,
                        )
                    })
                    .collect();
                let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
                spec.reduce_op = op;
                spec.prescale = pre;
                spec.postscale = post;
                spec.process_set = set;
                let results = run(spec).unwrap();
                for (t, res) in results.iter().enumerate() {
                    let got = output(res, DataType::F32);
                    for (i, g) in got.iter().enumerate() {
                        let each: Vec<f64> = members.iter().map(|r| v(t, i, *r)).collect();
                        let div = if op == ReduceOp::Average {
                            members.len() as f64
                        } else {
                            1.0
                        };
                        let (want, tol) = half_sum(&each, pre * post / div, eps);
                        assert!(
                            (g - want).abs() <= tol,
                            "set {set} case {case} fused {fused} tensor {t} element {i}: got {g}, want {want} (tolerance {tol})"
                        );
                    }
                }
            }
        }
    };
    check(0, &(0..n).collect::<Vec<_>>(), "");
    if n >= 3 {
        // a process set of all ranks but the last
        let members: Vec<usize> = (0..n - 1).collect();
        let ranks: Vec<i32> = members.iter().map(|r| *r as i32).collect();
        let h = runtime::runtime().unwrap().add_process_set(&ranks).unwrap();
        h.wait(None).unwrap();
        if me < n - 1 {
            check(h.value(), &members, ".set");
        }
    }
    // 1 + 2^-12 is exact in f32 and rounds to 1 in either 16-bit type: the sum shows the wire
    let fine = 1.0 + 2f64.powi(-12);
    let spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("cmp.fine", DataType::F32, &[4], &[fine; 4], false)],
    );
    let got = output(&run(spec).unwrap()[0], DataType::F32);
    assert_eq!(
        got,
        vec![n as f64; 4],
        "values did not travel as 16-bit floats"
    );
    uncompressed_ops_stay_exact("cmp");
    // an average divides before the cast: 40000 on every rank fits f16 once divided
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            "cmp.avg.big",
            DataType::F32,
            &[2],
            &[40000.0; 2],
            false,
        )],
    );
    spec.reduce_op = ReduceOp::Average;
    let got = output(&run(spec).unwrap()[0], DataType::F32);
    for g in got {
        assert!(
            (g - 40000.0).abs() <= 40000.0 * (n + 1) as f64 * eps,
            "average of 40000: {g}"
        );
    }
    if setting == "fp16" {
        // beyond f16's 65504 on one rank: infinite, and named in a warning
        let spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "cmp.overflow",
                DataType::F32,
                &[1],
                &[70000.0],
                false,
            )],
        );
        let got = output(&run(spec).unwrap()[0], DataType::F32);
        assert!(got[0].is_infinite(), "70000 as f16: {}", got[0]);
    }
    if std::env::var("HOROVOD_HIERARCHICAL_ALLREDUCE").is_ok_and(|v| v == "1") {
        let after = runtime::runtime()
            .unwrap()
            .metrics
            .snapshot()
            .hierarchical_batches;
        assert!(
            after > hierarchical_before,
            "the compressed allreduces did not run hierarchically"
        );
    }
    finish_job();
}

/// `mixed` under `FERROVOD_COMPRESSION_MIN_BYTES=4096`, steps of one grouped allreduce whose
/// tensors straddle the threshold, plus tensors that ask for their own compression: each
/// tensor travels as its codec says although they are submitted (and could be fused)
/// together, on every step (under offline negotiation, also from the frozen plan).
pub(crate) fn mixed_compressed() {
    init();
    let n = size();
    let mut plan = PlanWatch::new();
    // 1 + 2^-12 is exact in f32 and rounds to 1 in f16: a sum shows how a tensor travelled
    let fine = 1.0 + 2f64.powi(-12);
    // (elements, asks for, travels compressed): 1023 f32 values are below 4096 bytes
    let cases: [(usize, Option<Compression>, bool); 6] = [
        (1023, None, false),
        (1024, None, true),
        (5000, None, true),
        (7, None, false),
        (2048, Some(Compression::None), false),
        (3, Some(Compression::Fp16), true),
    ];
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    for step in 0..8 {
        let before = metrics();
        plan.step_start();
        // one op per codec request: an op's tensors share its compression field
        let mut handles = Vec::new();
        for (k, (elems, asks, _)) in cases.iter().enumerate() {
            let vals = vec![fine * (step + 1) as f64; *elems];
            let t = tensor(
                &format!("mixed.{k}"),
                DataType::F32,
                &[*elems as i64],
                &vals,
                false,
            );
            let mut spec = OpSpec::new(OpKind::Allreduce, vec![t]);
            spec.reduce_op = ReduceOp::Sum;
            spec.compression = *asks;
            handles.push(submit(spec).unwrap());
        }
        let mut fp16 = 0u64;
        for (k, h) in handles.into_iter().enumerate() {
            let (elems, _, compressed) = cases[k];
            let got = output(&finish(h).unwrap()[0], DataType::F32);
            let exact = fine * (step + 1) as f64 * n as f64;
            let rounded = ((step + 1) * n) as f64;
            let want = if compressed { rounded } else { exact };
            assert!(
                got.iter().all(|g| (*g - want).abs() < 1e-9 * want),
                "step {step} tensor {k} ({elems} values, compressed: {compressed}): got {}, want {want}",
                got[0]
            );
            if compressed {
                fp16 += elems as u64 * 2;
            }
        }
        let after = metrics();
        assert_eq!(after.wire_fp16 - before.wire_fp16, fp16, "step {step}");
        plan.step_end(step);
    }
    plan.froze(3);
    finish_job();
}

/// `PERSEUS_ALLREDUCE_NANCHECK=1`: steps of two allreduces submitted together; on step 5 rank 1
/// puts a NaN into one of them, on step 6 an f32 beyond f16's range into one that asks for
/// fp16. Every rank fails exactly those tensors, with their names; the others and later steps
/// complete (under offline negotiation, from the frozen plan).
pub(crate) fn nan_check() {
    init();
    let (me, n) = (rank(), size());
    let mut plan = PlanWatch::new();
    for step in 0..9 {
        plan.step_start();
        let mut handles = Vec::new();
        for k in 0..2 {
            let mut vals = vec![(k + step) as f64; 300];
            let bad = (step == 5 && k == 0) || (step == 6 && k == 1);
            if bad && me == 1 {
                vals[17] = if step == 5 { f64::NAN } else { 70000.0 };
            }
            let t = tensor(&format!("nan.{k}"), DataType::F32, &[300], &vals, false);
            let mut spec = OpSpec::new(OpKind::Allreduce, vec![t]);
            spec.reduce_op = ReduceOp::Sum;
            if k == 1 {
                spec.compression = Some(Compression::Fp16);
            }
            handles.push((k, bad, submit(spec).unwrap()));
        }
        for (k, bad, h) in handles {
            match (finish(h), bad) {
                (Ok(res), false) => {
                    let got = output(&res[0], DataType::F32);
                    assert!(
                        got.iter().all(|g| *g == ((k + step) * n) as f64),
                        "step {step} tensor {k}: {}",
                        got[0]
                    );
                }
                (Err(e), true) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(&format!(
                            "NaN or Inf in the allreduced values of tensor 'nan.{k}' (1 values)"
                        )),
                        "step {step}: {msg}"
                    );
                }
                (r, bad) => panic!("step {step} tensor {k} (bad: {bad}): {:?}", r.map(|_| ())),
            }
        }
        plan.step_end(step);
    }
    plan.froze(4);
    finish_job();
}

/// `FERROVOD_COMPRESSION=u8`: each rank allreduces the same gradients every step (two fused,
/// one alone, an average with scales among them). The first step lands within the 8-bit
/// rounding bound of the f64 sum (half a step of each contribution's and of the sum's range),
/// later ones within twice that (a step also returns what the one before lost); over the
/// steps error feedback makes the mean of the results converge to the exact value, where
/// rounding alone would repeat the same error every step. f64 sums and maxima travel as they
/// are; the wire carries one byte per value. Also with two channels and from an offline plan.
pub(crate) fn u8_compressed() {
    init();
    let (me, n) = (rank(), size());
    let mut plan = PlanWatch::new();
    let v = |t: usize, i: usize, r: usize| {
        ((i * 7919 + t * 104_729 + r * 31) % 1000) as f64 / 1000.0 * (t + 1) as f64 - 0.3
    };
    let sizes = [700usize, 33, 2500];
    let ops = [
        (ReduceOp::Sum, 1.0, 1.0),
        (ReduceOp::Sum, 1.0, 1.0),
        (ReduceOp::Average, 2.0, 0.5),
    ];
    // the range of a rank's values in its batch (tensors 0 and 1 travel fused, in shared blocks)
    let range = |t: usize, r: usize| {
        let batch: &[usize] = if t == 2 { &[2] } else { &[0, 1] };
        let vals: Vec<f64> = (batch.iter())
            .flat_map(|b| (0..sizes[*b]).map(move |i| v(*b, i, r)))
            .collect();
        vals.iter().cloned().fold(f64::MIN, f64::max)
            - vals.iter().cloned().fold(f64::MAX, f64::min)
    };
    let exact = |t: usize, i: usize| {
        let (op, pre, post) = ops[t];
        let sum: f64 = (0..n).map(|r| v(t, i, r)).sum::<f64>() * pre * post;
        if op == ReduceOp::Average {
            sum / n as f64
        } else {
            sum
        }
    };
    // one step's bound: half a step (range / 255) of every rank's contribution and of the sum
    let bound = |t: usize| {
        let (op, pre, post) = ops[t];
        let contributions: f64 = (0..n).map(|r| range(t, r) * pre).sum();
        let scale = post
            / if op == ReduceOp::Average {
                n as f64
            } else {
                1.0
            };
        (2.0 * contributions) / 510.0 * scale * 1.01 + 1e-5
    };
    let steps = 30;
    let mut means: Vec<Vec<f64>> = sizes.iter().map(|s| vec![0.0; *s]).collect();
    let mut first_error = [0f64; 3];
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    for step in 0..steps {
        plan.step_start();
        let before = metrics();
        let mut handles = Vec::new();
        // tensors 0 and 1 in one op (fusable), tensor 2 alone with scales
        for group in [vec![0usize, 1], vec![2]] {
            let (op, pre, post) = ops[group[0]];
            let tensors = group
                .iter()
                .map(|t| {
                    let vals: Vec<f64> = (0..sizes[*t]).map(|i| v(*t, i, me)).collect();
                    tensor(
                        &format!("u8.{t}"),
                        DataType::F32,
                        &[sizes[*t] as i64],
                        &vals,
                        false,
                    )
                })
                .collect();
            let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
            spec.reduce_op = op;
            spec.prescale = pre;
            spec.postscale = post;
            handles.push((group, submit(spec).unwrap()));
        }
        for (group, h) in handles {
            for (res, t) in finish(h).unwrap().iter().zip(group) {
                let got = output(res, DataType::F32);
                for (i, g) in got.iter().enumerate() {
                    // later steps also give back what the step before lost: twice the bound
                    let within = bound(t) * if step == 0 { 1.0 } else { 2.0 };
                    let err = (g - exact(t, i)).abs();
                    assert!(
                        err <= within,
                        "step {step} tensor {t} element {i}: error {err} > {within}"
                    );
                    if step == 0 {
                        first_error[t] = first_error[t].max(err);
                    }
                    means[t][i] += g / steps as f64;
                }
            }
        }
        let after = metrics();
        assert_eq!(
            after.wire_u8 - before.wire_u8,
            sizes.iter().sum::<usize>() as u64
        );
        plan.step_end(step);
    }
    for t in 0..3 {
        // rounding did lose something in one step, and the mean recovered it
        assert!(
            first_error[t] > bound(t) / 50.0,
            "tensor {t}: no rounding to recover ({})",
            first_error[t]
        );
        let mean_error = (0..sizes[t])
            .map(|i| (means[t][i] - exact(t, i)).abs())
            .fold(0.0, f64::max);
        assert!(
            mean_error <= 2.0 * bound(t) / steps as f64 + 1e-5,
            "tensor {t}: the mean over {steps} steps is off by {mean_error} (one step: {}, bound {})",
            first_error[t],
            bound(t)
        );
    }
    plan.froze(10);
    uncompressed_ops_stay_exact("u8");
    finish_job();
}

/// Codecs in process sets: ranks {0, 2} and {1, 3} each allreduce a tensor as u8 every step,
/// and the global set a tensor of the same name as u8 too (each set keeps its own residuals:
/// the means over the steps converge to each set's exact sum), one as fp16 (within its rounding
/// bound) and an uncompressed one.
pub(crate) fn compressed_in_sets() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    let sets: Vec<i32> = [[0, 2], [1, 3]]
        .iter()
        .map(|r| {
            let h = rt.add_process_set(r).unwrap();
            h.wait(None).unwrap();
            h.value()
        })
        .collect();
    let (set, members) = if me.is_multiple_of(2) {
        (sets[0], [0, 2])
    } else {
        (sets[1], [1, 3])
    };
    let v = |i: usize, r: usize| ((i * 131 + r * 977) % 1000) as f64 / 250.0 - 1.5 + r as f64;
    let len = 3000;
    let exact: Vec<f64> = (0..len)
        .map(|i| members.iter().map(|r| v(i, *r)).sum())
        .collect();
    let range = |r: usize| {
        let x: Vec<f64> = (0..len).map(|i| v(i, r)).collect();
        x.iter().cloned().fold(f64::MIN, f64::max) - x.iter().cloned().fold(f64::MAX, f64::min)
    };
    let one_step = 2.0 * members.iter().map(|r| range(*r)).sum::<f64>() / 510.0 * 1.01;
    let all_exact: Vec<f64> = (0..len).map(|i| (0..4).map(|r| v(i, r)).sum()).collect();
    let all_step = 2.0 * (0..4).map(range).sum::<f64>() / 510.0 * 1.01;
    let steps = 20;
    let mut mean = vec![0.0; len];
    let mut all_mean = vec![0.0; len];
    for step in 0..steps {
        let mine: Vec<f64> = (0..len).map(|i| v(i, me)).collect();
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("sets.g", DataType::F32, &[len as i64], &mine, false)],
        );
        spec.process_set = set;
        spec.reduce_op = ReduceOp::Sum;
        spec.compression = Some(Compression::U8);
        let u8_handle = submit(spec).unwrap();
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("sets.h", DataType::F32, &[len as i64], &mine, false)],
        );
        spec.process_set = set;
        spec.reduce_op = ReduceOp::Sum;
        spec.compression = Some(Compression::Fp16);
        let half_handle = submit(spec).unwrap();
        let global = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "sets.global",
                DataType::F64,
                &[2],
                &[1.0, me as f64],
                false,
            )],
        );
        assert_eq!(
            output(&run(global).unwrap()[0], DataType::F64),
            vec![4.0, 6.0]
        );
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("sets.g", DataType::F32, &[len as i64], &mine, false)],
        );
        spec.reduce_op = ReduceOp::Sum;
        spec.compression = Some(Compression::U8);
        let got = output(&run(spec).unwrap()[0], DataType::F32);
        for (i, g) in got.iter().enumerate() {
            assert!(
                (g - all_exact[i]).abs() <= 2.0 * all_step,
                "step {step} global u8 element {i}"
            );
            all_mean[i] += g / steps as f64;
        }
        let got = output(&finish(u8_handle).unwrap()[0], DataType::F32);
        let within = one_step * if step == 0 { 1.0 } else { 2.0 };
        for (i, g) in got.iter().enumerate() {
            assert!(
                (g - exact[i]).abs() <= within,
                "step {step} u8 element {i}: {g} vs {}",
                exact[i]
            );
            mean[i] += g / steps as f64;
        }
        let got = output(&finish(half_handle).unwrap()[0], DataType::F32);
        for (i, g) in got.iter().enumerate() {
            let each: Vec<f64> = members.iter().map(|r| v(i, *r)).collect();
            let (want, tol) = half_sum(&each, 1.0, 2f64.powi(-11));
            assert!((g - want).abs() <= tol, "step {step} fp16 element {i}");
        }
    }
    let off = (0..len)
        .map(|i| (mean[i] - exact[i]).abs())
        .fold(0.0, f64::max);
    assert!(
        off <= 2.0 * one_step / steps as f64,
        "set {set}: the mean is off by {off} (one step {one_step})"
    );
    let off = (0..len)
        .map(|i| (all_mean[i] - all_exact[i]).abs())
        .fold(0.0, f64::max);
    assert!(
        off <= 2.0 * all_step / steps as f64,
        "global set: the mean is off by {off} (one step {all_step})"
    );
    finish_job();
}

/// One tensor's PowerSGD in f64, written plainly from the method's formulas: the reference the
/// runtime's batches are held to. Every rank computes every rank's part (the inputs are
/// functions of the rank), so each can check its own output.
struct PowerReference {
    rows: usize,
    cols: usize,
    rank: usize,
    /// cols × rank, agreed.
    q: Vec<f64>,
    /// Per rank, rows × cols.
    residual: Vec<Vec<f64>>,
}

impl PowerReference {
    fn new(shape: &[i64], rank: usize, q0: &[f32], ranks: usize) -> PowerReference {
        let rows = shape[0] as usize;
        let cols = shape[1..].iter().product::<i64>() as usize;
        PowerReference {
            rows,
            cols,
            rank,
            q: q0.iter().map(|v| *v as f64).collect(),
            residual: vec![vec![0.0; rows * cols]; ranks],
        }
    }

    /// One step over every rank's (prescaled) gradient: the approximation of their average.
    fn step(&mut self, grads: &[Vec<f64>]) -> Vec<f64> {
        let (n, m, k) = (self.rows, self.cols, self.rank);
        let ms: Vec<Vec<f64>> = (grads.iter().zip(&self.residual))
            .map(|(g, e)| g.iter().zip(e).map(|(a, b)| a + b).collect())
            .collect();
        let mut p = vec![0.0; n * k];
        for mm in &ms {
            for i in 0..n {
                for c in 0..k {
                    p[i * k + c] += (0..m)
                        .map(|j| mm[i * m + j] * self.q[j * k + c])
                        .sum::<f64>();
                }
            }
        }
        for c in 0..k {
            let norm = (0..n).map(|i| p[i * k + c].powi(2)).sum::<f64>().sqrt();
            (0..n).for_each(|i| p[i * k + c] /= norm + 1e-8);
            for d in c + 1..k {
                let dot: f64 = (0..n).map(|i| p[i * k + c] * p[i * k + d]).sum();
                (0..n).for_each(|i| p[i * k + d] -= dot * p[i * k + c]);
            }
        }
        let mut q = vec![0.0; m * k];
        for mm in &ms {
            for j in 0..m {
                for c in 0..k {
                    q[j * k + c] += (0..n).map(|i| mm[i * m + j] * p[i * k + c]).sum::<f64>();
                }
            }
        }
        q.iter_mut().for_each(|v| *v /= grads.len() as f64);
        let approx: Vec<f64> = (0..n * m)
            .map(|x| (0..k).map(|c| p[x / m * k + c] * q[x % m * k + c]).sum())
            .collect();
        for (e, mm) in self.residual.iter_mut().zip(&ms) {
            *e = mm.iter().zip(&approx).map(|(a, b)| a - b).collect();
        }
        self.q = q;
        approx
    }
}

/// `FERROVOD_COMPRESSION=powersgd`: a batch of two matrices averaged with scales, a matrix
/// summed alone, and a vector and a small matrix that travel uncompressed, over eight steps,
/// each rank's output against an f64 reference of the same method (error feedback and the
/// warm-started Q included), and the wire counter at the factors' bytes. Under
/// `FERROVOD_POWERSGD_START=s` the first s steps are exact averages with the matrices' whole
/// bytes on the wire, and the method starts afresh at step s.
pub(crate) fn powersgd_compressed() {
    use ferrovod::compress::powersgd::{PowerMemory, Shape};
    init();
    let (me, n) = (rank(), size());
    let mut plan = PlanWatch::new();
    let rank_setting: usize = std::env::var("FERROVOD_POWERSGD_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ferrovod::compress::POWERSGD_RANK);
    let start: usize = std::env::var("FERROVOD_POWERSGD_START")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // the last two: one batch of 2 × 262,144 values where FERROVOD_FUSION_DIRECT_BYTES fuses
    // large tensors (as across nodes)
    let shapes: [&[i64]; 7] = [
        &[24, 3, 3, 2],
        &[40, 30],
        &[50],
        &[3, 2],
        &[16, 16],
        &[512, 512],
        &[256, 1024],
    ];
    // (tensors, op, prescale, postscale)
    let groups: [Group; 4] = [
        (&[0, 1], ReduceOp::Average, 2.0, 0.5),
        (&[4], ReduceOp::Sum, 1.0, 1.0),
        (&[2, 3], ReduceOp::Average, 1.0, 1.0),
        (&[5, 6], ReduceOp::Average, 1.0, 1.0),
    ];
    let len = |t: usize| shapes[t].iter().product::<i64>() as usize;
    // a low-rank part that persists across steps and a part that changes with the step and rank
    let v = |t: usize, i: usize, r: usize, step: usize| {
        let (a, b) = (i % 7, i / 7);
        ((a as f64 + 1.0) * (b as f64 % 5.0 - 2.0)) / 10.0
            + (((i * 7919 + t * 104_729 + r * 31 + step * 577) % 1000) as f64 / 1000.0 - 0.5)
    };
    let name = |t: usize| format!("psgd.{t}");
    let fresh = PowerMemory::default();
    let mut refs: Vec<Option<PowerReference>> = (0..shapes.len())
        .map(|t| {
            Shape::of(shapes[t], rank_setting).map(|s| {
                let q0 = fresh.take(&name(t), &s).q;
                PowerReference::new(shapes[t], s.rank, &q0, n)
            })
        })
        .collect();
    assert!(refs[0].is_some() && refs[1].is_some() && refs[4].is_some());
    assert!(refs[2].is_none() && refs[3].is_none());
    let matrices = [0usize, 1, 4, 5, 6];
    let factor_bytes: u64 = matrices
        .iter()
        .map(|t| {
            let s = Shape::of(shapes[*t], rank_setting).unwrap();
            ((s.p_len() + s.q_len()) * 4) as u64
        })
        .sum();
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    for step in 0..8 {
        plan.step_start();
        let before = metrics();
        let handles = submit_groups(&groups, |t| {
            let vals: Vec<f64> = (0..len(t)).map(|i| v(t, i, me, step)).collect();
            tensor(&name(t), DataType::F32, shapes[t], &vals, false)
        });
        for ((ts, op, pre, post), h) in groups.iter().zip(handles) {
            for (res, t) in finish(h).unwrap().iter().zip(ts.iter()) {
                let got = output(res, DataType::F32);
                let grads: Vec<Vec<f64>> = (0..n)
                    .map(|r| (0..len(*t)).map(|i| v(*t, i, r, step) * pre).collect())
                    .collect();
                let ranks = if *op == ReduceOp::Sum { n as f64 } else { 1.0 };
                let want: Vec<f64> = match refs[*t].as_mut() {
                    Some(reference) if step >= start => reference.step(&grads),
                    _ => (0..len(*t))
                        .map(|i| grads.iter().map(|g| g[i]).sum::<f64>() / n as f64)
                        .collect(),
                };
                let scale = post * ranks;
                let top = want.iter().fold(0f64, |a, b| a.max(b.abs())) * scale;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let err = (g - w * scale).abs();
                    assert!(
                        err <= 1e-4 * top + 1e-6,
                        "step {step} tensor {t} element {i}: got {g}, want {} (largest {top})",
                        w * scale
                    );
                }
            }
        }
        let (after, whole) = (metrics(), matrices.iter().map(|t| len(*t) as u64 * 4));
        if step < start {
            assert_eq!(after.wire_powersgd, before.wire_powersgd);
            let plain = after.wire_uncompressed - before.wire_uncompressed;
            assert_eq!(plain, whole.sum::<u64>() + (len(2) + len(3)) as u64 * 4);
        } else {
            assert_eq!(after.wire_powersgd - before.wire_powersgd, factor_bytes);
        }
        plan.step_end(step);
    }
    plan.froze(1);
    uncompressed_ops_stay_exact("powersgd");
    finish_job();
}

/// PowerSGD and top-k, each asked per operation, over 1,000 steps of a named matrix and an
/// unnamed one (a new name each call): the named tensor's state is kept, the unnamed ones'
/// never, so memory stays flat — the process's resident memory on host tensors, the GPU's
/// free memory on GPU tensors. PowerSGD's results are checked against the exact average (a
/// rank-1 average comes back exact up to the rounding that feedback carries), top-k's are
/// finite.
pub(crate) fn codec_memory_flat() {
    init();
    let (me, n) = (rank(), size());
    let (rows, cols) = (64usize, 48usize);
    let used = || -> u64 {
        if gpu_mode() {
            let (free, _) = gpu::this_gpu().memory_info().unwrap();
            u64::MAX - free as u64
        } else {
            let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
            let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
            pages * 4096
        }
    };
    for (c, codec) in [Compression::PowerSgd(0), Compression::TopK(0)]
        .iter()
        .enumerate()
    {
        let mut at_50 = 0;
        for step in 0..1000 {
            // every rank's matrix the same rank-1 one times (rank + 1): the average is exact
            // under PowerSGD; under top-k each rank sends its 1 % of equal values (the lowest
            // indices), summed
            let vals: Vec<f64> = (0..rows * cols)
                .map(|i| ((i / cols + 1) * (i % cols + 1)) as f64 / 64.0 * (me + 1) as f64)
                .collect();
            let names = [
                format!("flat.{c}.w"),
                format!("allreduce.noname.{}", step + c * 1000),
            ];
            let specs = names
                .iter()
                .map(|name| {
                    tensor(
                        name,
                        DataType::F32,
                        &[rows as i64, cols as i64],
                        &vals,
                        false,
                    )
                })
                .collect();
            let mut spec = OpSpec::new(OpKind::Allreduce, specs);
            spec.reduce_op = ReduceOp::Average;
            spec.compression = Some(*codec);
            let results = run(spec).unwrap();
            if step % 100 == 0 || step == 999 {
                let ranks = (1..=n).sum::<usize>() as f64 / n as f64;
                for (res, name) in results.iter().zip(&names) {
                    let got = output(res, DataType::F32);
                    if c == 0 {
                        let want: Vec<f64> =
                            vals.iter().map(|v| v / (me + 1) as f64 * ranks).collect();
                        // the named matrix carries its residual: each step's rounding, which
                        // feedback returns (a little of it shows in the output)
                        let tol = if name.contains("noname") { 1e-4 } else { 1e-2 };
                        for (g, w) in got.iter().zip(&want) {
                            let err = (g - w).abs();
                            assert!(
                                err <= tol * (1.0 + w.abs()),
                                "step {step} {name}: {g} vs {w}"
                            );
                        }
                    } else {
                        assert!(got.iter().all(|g| g.is_finite()));
                    }
                }
            }
            if step == 50 {
                at_50 = used();
            }
        }
        let grown = used().saturating_sub(at_50);
        assert!(
            grown <= 8 << 20,
            "{codec:?}: memory grew by {grown} bytes from step 50 to 1,000"
        );
    }
    finish_job();
}

/// `FERROVOD_COMPRESSION=topk` against the host's own phases bit for bit: every rank runs
/// `topk::select` over every rank's values (with `FERROVOD_TOPK_MOMENTUM`'s correction) and
/// `topk::decode` of their pairs, and its output must be those bits. Values are multiples of
/// 1/8 in a narrow range, so many magnitudes tie at the threshold (ties go to the lower
/// index), and one rank sends a NaN at one step. With `FERROVOD_TOPK_RATIO=0.25` the host's
/// batch travels in pieces, each selected while the one before travels. On GPUs this holds the kernels to the host's
/// selection, residuals and sums.
pub(crate) fn topk_exact() {
    use ferrovod::compress::TopK;
    use ferrovod::compress::topk::{self, Gradient, Memory};
    init();
    let (me, n) = (rank(), size());
    let momentum: f64 = std::env::var("FERROVOD_TOPK_MOMENTUM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let ratio: f64 = std::env::var("FERROVOD_TOPK_RATIO")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.01);
    let params = TopK::of(ratio, momentum);
    // at a ratio of 0.25 the batch's pairs (630 KB) travel in pieces (`sparse::pieces`)
    let lens = [5000usize, 70_000, 333, 120_000, 120_000];
    let v = |t: usize, i: usize, r: usize, step: usize| -> f32 {
        if (t, i, r, step) == (0, 77, 0, 2) {
            return f32::NAN;
        }
        ((i * 31 + t * 7 + r * 13 + step * 5) % 97) as f32 / 8.0 - 6.0
    };
    let mut mems: Vec<Vec<Memory>> = lens.iter().map(|l| vec![Memory::new(*l); n]).collect();
    let groups: [Group; 1] = [(&[0, 1, 2, 3, 4], ReduceOp::Sum, 1.0, 1.0)];
    for step in 0..5 {
        let handles = submit_groups(&groups, |t| {
            let vals: Vec<f64> = (0..lens[t]).map(|i| v(t, i, me, step) as f64).collect();
            tensor(
                &format!("topk.exact.{t}"),
                DataType::F32,
                &[lens[t] as i64],
                &vals,
                false,
            )
        });
        let results = finish(handles.into_iter().next().unwrap()).unwrap();
        for (t, res) in results.iter().enumerate() {
            let got = output(res, DataType::F32);
            let k = params.k(lens[t]).unwrap();
            let parts: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    let grad: Vec<u8> = (0..lens[t])
                        .flat_map(|i| v(t, i, r, step).to_le_bytes())
                        .collect();
                    let mut send = Vec::new();
                    let m = params.momentum();
                    topk::select(Gradient::Kept(&grad), 1.0, &mut mems[t][r], k, m, &mut send);
                    send
                })
                .collect();
            let mut want = vec![0u8; lens[t] * 4];
            let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            topk::decode(&refs, &mut want, 1.0, false).unwrap();
            for (i, (g, w)) in got.iter().zip(want.chunks_exact(4)).enumerate() {
                let w = f32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                let same = (g.is_nan() && w.is_nan()) || (*g as f32).to_bits() == w.to_bits();
                assert!(
                    same,
                    "step {step} tensor {t} element {i}: got {g}, want {w}"
                );
            }
        }
    }
    finish_job();
}

/// `FERROVOD_COMPRESSION=topk`: a batch of two tensors averaged with scales and one of two
/// summed (the second large enough, 70,000 values, that the choice goes through a sampled
/// floor, with many ties), over six steps, each rank's output against an f64 reference of the method (each
/// rank's k largest of its gradient plus residual, ties to the lower index, summed over the
/// ranks; what was not sent kept), the wire counter at the pairs' bytes, and a tensor too small
/// to gain travelling as it is.
pub(crate) fn topk_compressed() {
    init();
    let (me, n) = (rank(), size());
    let mut plan = PlanWatch::new();
    let ratio: f64 = std::env::var("FERROVOD_TOPK_RATIO")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.01);
    let lens = [700usize, 1500, 2, 333, 70_000];
    let groups: [Group; 3] = [
        (&[0, 1], ReduceOp::Average, 2.0, 0.5),
        (&[3, 4], ReduceOp::Sum, 1.0, 1.0),
        (&[2], ReduceOp::Sum, 1.0, 1.0),
    ];
    // DGC's warm-up: the share sent over a tensor's first `warmup` steps, by quarter
    let warmup: usize = std::env::var("FERROVOD_TOPK_WARMUP_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let share = |step: usize| match step < warmup {
        true => ratio.max([0.25, 0.0625, 0.015625, 0.003906][step * 4 / warmup]),
        false => ratio,
    };
    let k_at = |len: usize, step: usize| ((len as f64 * share(step)).ceil() as usize).clamp(1, len);
    let v = |t: usize, i: usize, r: usize, step: usize| {
        (((i * 7919 + t * 104_729 + r * 31 + step * 577) % 1000) as f64 / 1000.0 - 0.5)
            * (1.0 + (i % 13) as f64)
    };
    // per tensor, per rank: what was not sent
    let mut residual: Vec<Vec<Vec<f64>>> = lens.iter().map(|l| vec![vec![0.0; *l]; n]).collect();
    let pair_bytes = |step: usize| -> u64 {
        [0usize, 1, 3, 4]
            .iter()
            .map(|t| 8 * k_at(lens[*t], step) as u64)
            .sum()
    };
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    for step in 0..6 {
        plan.step_start();
        let before = metrics();
        let handles = submit_groups(&groups, |t| {
            let vals: Vec<f64> = (0..lens[t]).map(|i| v(t, i, me, step)).collect();
            let shape = [lens[t] as i64];
            tensor(&format!("topk.{t}"), DataType::F32, &shape, &vals, false)
        });
        for ((ts, op, pre, post), h) in groups.iter().zip(handles) {
            for (res, t) in finish(h).unwrap().iter().zip(ts.iter()) {
                let got = output(res, DataType::F32);
                let scale = post
                    / if *op == ReduceOp::Average {
                        n as f64
                    } else {
                        1.0
                    };
                let mut want = vec![0.0; lens[*t]];
                for (r, kept) in residual[*t].iter_mut().enumerate() {
                    // the residual is kept in f32, as the method keeps it
                    let acc: Vec<f64> = (0..lens[*t])
                        .map(|i| ((v(*t, i, r, step) * pre) as f32 + kept[i] as f32) as f64)
                        .collect();
                    let sent: Vec<usize> = if *t == 2 {
                        (0..lens[*t]).collect() // travels as it is
                    } else {
                        let mut order: Vec<usize> = (0..lens[*t]).collect();
                        order.sort_by(|a, b| {
                            acc[*b]
                                .abs()
                                .partial_cmp(&acc[*a].abs())
                                .unwrap()
                                .then(a.cmp(b))
                        });
                        order.truncate(k_at(lens[*t], step));
                        order
                    };
                    let mut left = acc.clone();
                    for i in sent {
                        want[i] += acc[i];
                        left[i] = 0.0;
                    }
                    if *t != 2 {
                        *kept = left;
                    }
                }
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let w = w * scale;
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "step {step} tensor {t} element {i}: got {g}, want {w}"
                    );
                }
            }
        }
        assert_eq!(metrics().wire_topk - before.wire_topk, pair_bytes(step));
        plan.step_end(step);
    }
    plan.froze(1);
    uncompressed_ops_stay_exact("topk");
    finish_job();
}
