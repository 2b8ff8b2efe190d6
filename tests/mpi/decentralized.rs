//! Gossip (neighbour average) and multistep allreduces: results against references each rank
//! computes itself, agreement errors, and a gossip a rank never joins.

use super::*;
use ferrovod::message::Multistep;

/// Element i of rank r's gossiped vector: distinct per rank, not exactly representable sums.
fn start(i: usize, r: usize) -> f64 {
    ((i * 7919 + r * 104_729) % 1000) as f64 / 37.0 - 11.0
}

fn gossip_spec(names: &[String], dtype: DataType, vals: &[Vec<f64>]) -> OpSpec {
    let tensors = (names.iter().zip(vals))
        .map(|(n, v)| tensor(n, dtype, &[v.len() as i64], v, false))
        .collect();
    OpSpec::new(OpKind::Gossip, tensors)
}

/// `(a + b) / 2` as `dtype` computes it: the sum rounded to the dtype, then halved.
fn pair_average(dtype: DataType, a: f64, b: f64) -> f64 {
    let q = |v: f64| quantize(dtype, &[v])[0];
    match dtype {
        // 16-bit values are summed in f32 and rounded once, then halved
        DataType::F16 | DataType::BF16 => q(q(a + b) * 0.5),
        DataType::F32 => ((a as f32 + b as f32) * 0.5) as f64,
        _ => (a + b) * 0.5,
    }
}

/// `FERROVOD_GOSSIP_SYNC_EVERY=0`: neighbour averages bit for bit in every float dtype, fused
/// (in place and out of place) and in several ops; on powers of two the mean after log2 n rounds, otherwise a geometric
/// decay; tensors at different rounds in one batch; then the errors.
pub(crate) fn gossip() {
    init();
    let (me, n) = (rank(), size());
    let len = 300;
    // one exchange: each dtype in its own op, two tensors fused in each
    for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::BF16] {
        let names: Vec<String> = (0..2).map(|k| format!("g.{}.{k}", dtype.name())).collect();
        let mine = |r: usize, k: usize| -> Vec<f64> {
            quantize(
                dtype,
                &(0..len + k).map(|i| start(i + k, r)).collect::<Vec<_>>(),
            )
        };
        let vals: Vec<Vec<f64>> = (0..2).map(|k| mine(me, k)).collect();
        let mut spec = gossip_spec(&names, dtype, &vals);
        // the second tensor out of place
        let bytes = vals[1].len() * dtype.size();
        spec.tensors[1].output = OutputMem::Owned(vec![0u8; bytes]);
        let got = run(spec).unwrap();
        // round 0: the hypercube's first dimension, or the tournament's first pairing
        let peer = ferrovod::collective::gossip::peer(me, n, 0);
        if n.is_power_of_two() {
            assert_eq!(peer, me ^ 1);
        }
        for (k, res) in got.iter().enumerate() {
            let want: Vec<f64> = (mine(me, k).iter().zip(mine(peer, k)))
                .map(|(a, b)| {
                    if peer == me {
                        *a
                    } else {
                        pair_average(dtype, *a, b)
                    }
                })
                .collect();
            assert_eq!(output(res, dtype), want, "rank {me} {dtype:?} tensor {k}");
        }
    }
    // a batch of several 4 MiB pieces whose edges fall inside tensors (pieces travel while
    // their neighbours are packed and averaged)
    let sizes = [1_500_001usize, 700_003, 1_000_000];
    let names: Vec<String> = (0..3).map(|k| format!("g.big.{k}")).collect();
    let big = |r: usize, k: usize| -> Vec<f64> {
        (0..sizes[k])
            .map(|i| start(i + 3 * k, r) as f32 as f64)
            .collect()
    };
    let got = run(gossip_spec(
        &names,
        DataType::F32,
        &(0..3).map(|k| big(me, k)).collect::<Vec<_>>(),
    ))
    .unwrap();
    let peer = ferrovod::collective::gossip::peer(me, n, 0);
    for (k, res) in got.iter().enumerate() {
        let want: Vec<f64> = (big(me, k).iter().zip(big(peer, k)))
            .map(|(a, b)| {
                if peer == me {
                    *a
                } else {
                    pair_average(DataType::F32, *a, b)
                }
            })
            .collect();
        assert!(
            output(res, DataType::F32) == want,
            "rank {me} big tensor {k}"
        );
    }
    // repeated rounds of one tensor: the global mean
    let mean: Vec<f64> = (0..len)
        .map(|i| (0..n).map(|r| start(i, r)).sum::<f64>() / n as f64)
        .collect();
    let spread = |x: &[f64]| {
        x.iter()
            .zip(&mean)
            .map(|(a, m)| (a - m).abs())
            .fold(0.0, f64::max)
    };
    let mut x: Vec<f64> = (0..len).map(|i| start(i, me)).collect();
    let first = spread(&x);
    let rounds = if n.is_power_of_two() {
        n.trailing_zeros() as usize
    } else {
        // a whole tournament, three times over
        3 * (n + n % 2 - 1)
    };
    for _ in 0..rounds {
        let got = run(gossip_spec(&["g.mean".into()], DataType::F64, &[x])).unwrap();
        x = output(&got[0], DataType::F64);
    }
    if n.is_power_of_two() {
        assert!(spread(&x) < 1e-6, "rank {me}: {} from the mean", spread(&x));
    } else {
        assert!(
            spread(&x) < first * 0.5f64.powi(3),
            "rank {me}: {first} -> {}",
            spread(&x)
        );
    }
    // "g.mean" is at round `rounds` now, "g.new" at 0: one batch, two exchanges
    let a: Vec<f64> = (0..len).map(|i| start(i, me)).collect();
    let got = run(gossip_spec(
        &["g.mean".into(), "g.new".into()],
        DataType::F64,
        &[a.clone(), a.clone()],
    ))
    .unwrap();
    for (k, round) in [(0usize, rounds as u64), (1, 0)] {
        let peer = ferrovod::collective::gossip::peer(me, n, round);
        let want: Vec<f64> = (0..len)
            .map(|i| match peer == me {
                true => start(i, me),
                false => (start(i, me) + start(i, peer)) * 0.5,
            })
            .collect();
        assert_eq!(output(&got[k], DataType::F64), want, "rank {me} tensor {k}");
    }
    // errors: a shape that differs, an integer tensor, a gossip meeting an allreduce
    let len = if me == n - 1 { 3 } else { 2 };
    let err = run(gossip_spec(
        &["g.shape".into()],
        DataType::F32,
        &[vec![1.0; len]],
    ))
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("Mismatched GOSSIP tensor shapes: One rank sent a tensor of shape [2], but another rank sent a tensor of shape [3]."),
        "{err}"
    );
    let err = run(gossip_spec(&["g.int".into()], DataType::I32, &[vec![1.0]])).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(
        err.to_string().contains("floating-point tensors only"),
        "{err}"
    );
    let kind = if me == n - 1 {
        OpKind::Allreduce
    } else {
        OpKind::Gossip
    };
    let err = run(OpSpec::new(
        kind,
        vec![tensor("g.kind", DataType::F32, &[2], &[1.0, 2.0], false)],
    ))
    .unwrap_err();
    assert!(err.to_string().contains("Mismatched operations"), "{err}");
    if gpu_mode() {
        // GPU gossip travels uncompressed: a codec the op asks for is refused
        let mut spec = gossip_spec(&["g.fp16".into()], DataType::F32, &[vec![1.0; 4]]);
        spec.compression = Some(ferrovod::message::Compression::Fp16);
        let err = run(spec).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(
            err.to_string().contains("compressed gossip of GPU tensors"),
            "{err}"
        );
    }
    finish_job();
}

/// `FERROVOD_GOSSIP_SYNC_EVERY=3`: the third round of a tensor is the exact average.
pub(crate) fn gossip_sync() {
    init();
    let (me, n) = (rank(), size());
    let len = 64;
    let mut x: Vec<f64> = (0..len).map(|i| start(i, me)).collect();
    for round in 0..3u64 {
        let got = run(gossip_spec(&["s".into()], DataType::F64, &[x.clone()])).unwrap();
        let y = output(&got[0], DataType::F64);
        if round == 2 {
            for (i, v) in y.iter().enumerate() {
                // every rank's x after two pairwise rounds, from the closed form
                let mut all: Vec<Vec<f64>> = (0..n).map(|r| vec![start(i, r)]).collect();
                for t in 0..2 {
                    let prev = all.clone();
                    for (r, a) in all.iter_mut().enumerate() {
                        let p = ferrovod::collective::gossip::peer(r, n, t);
                        a[0] = if p == r {
                            prev[r][0]
                        } else {
                            (prev[r][0] + prev[p][0]) * 0.5
                        };
                    }
                }
                let mean = all.iter().map(|a| a[0]).sum::<f64>() / n as f64;
                assert!(
                    (v - mean).abs() < 1e-9,
                    "rank {me} element {i}: {v} vs {mean}"
                );
            }
        }
        x = y;
    }
    finish_job();
}

/// GPU gossip of a set inside one node (`FERROVOD_GOSSIP_EXACT_INSIDE_NODE`, default 1): every
/// round is the exact average over all ranks (from 3 ranks it differs from any pair's), for a
/// named tensor over several rounds and for two tensors fused, in f32 and f64.
pub(crate) fn gossip_exact() {
    init();
    let (me, n) = (rank(), size());
    for dtype in [DataType::F32, DataType::F64] {
        let names: Vec<String> = (0..2)
            .map(|k| format!("exact.{}.{k}", dtype.name()))
            .collect();
        for round in 0..3usize {
            let mine = |r: usize, k: usize| -> Vec<f64> {
                let v: Vec<f64> = (0..200 + k).map(|i| start(i + k + round, r)).collect();
                quantize(dtype, &v)
            };
            let vals: Vec<Vec<f64>> = (0..2).map(|k| mine(me, k)).collect();
            let got = run(gossip_spec(&names, dtype, &vals)).unwrap();
            for (k, res) in got.iter().enumerate() {
                let y = output(res, dtype);
                let all: Vec<Vec<f64>> = (0..n).map(|r| mine(r, k)).collect();
                let peer = ferrovod::collective::gossip::peer(me, n, round as u64);
                // elements where the pairwise average this round is not the mean
                let mut apart = 0;
                for (i, v) in y.iter().enumerate() {
                    let mean = all.iter().map(|a| a[i]).sum::<f64>() / n as f64;
                    let tol = if dtype == DataType::F32 { 1e-5 } else { 1e-12 };
                    assert!(
                        (v - mean).abs() <= tol * mean.abs().max(1.0),
                        "rank {me} {} round {round} tensor {k} element {i}: {v} vs the mean {mean}",
                        dtype.name()
                    );
                    let pair = pair_average(dtype, all[me][i], all[peer][i]);
                    apart += usize::from((pair - mean).abs() > 1e3 * tol * mean.abs().max(1.0));
                }
                // from 3 ranks a pairwise exchange would have failed the check above
                assert!(n <= 2 || apart > y.len() / 2, "{apart} of {}", y.len());
            }
        }
    }
    finish_job();
}

/// Rank 0 gossips a tensor the others never submit (`STALL_ON=multistep`: calls a multistep
/// allreduce once more than they do): the stall error on every rank, naming the tensor.
pub(crate) fn gossip_stall() {
    init();
    let me = rank();
    let every2 = Multistep {
        every: 2,
        warmup: 0,
        accumulate: true,
    };
    let multistep = std::env::var("STALL_ON").as_deref() == Ok("multistep");
    let call = || {
        let spec = if multistep {
            let mut spec = OpSpec::new(
                OpKind::Allreduce,
                vec![tensor("ms.alone", DataType::F32, &[4], &[1.0; 4], false)],
            );
            spec.multistep = Some(every2);
            spec
        } else {
            gossip_spec(&["g.alone".into()], DataType::F32, &[vec![1.0; 4]])
        };
        run(spec)
    };
    if multistep {
        // every rank's first call of an every-2 allreduce completes without communicating
        call().unwrap();
    }
    if me == 0 {
        let err = call().unwrap_err();
        let name = if multistep { "ms.alone" } else { "g.alone" };
        assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
        assert!(err.to_string().contains("Missing ranks:"), "{err}");
        assert!(err.to_string().contains(name), "{err}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let err = loop {
        match submit(OpSpec::new(OpKind::Barrier, vec![])) {
            Err(e) => break e,
            Ok(h) => {
                let r = finish(h);
                if let Err(e) = r {
                    break e;
                }
            }
        }
        assert!(Instant::now() < deadline, "rank {me}: no stall error");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    runtime::shutdown();
    pass();
}

fn f32_bits(v: &[f64]) -> Vec<u32> {
    v.iter().map(|x| (*x as f32).to_bits()).collect()
}

/// One multistep allreduce call of `name` (Sum of f32 `vals`); its output and whether it
/// communicated.
fn multistep_call(name: &str, vals: &[f64], m: Option<Multistep>) -> (Vec<f64>, bool) {
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            name,
            DataType::F32,
            &[vals.len() as i64],
            vals,
            false,
        )],
    );
    spec.multistep = m;
    let h = submit(spec).unwrap();
    let h2 = h.clone();
    let res = finish(h).unwrap();
    (output(&res[0], DataType::F32), h2.value() == 1)
}

/// Element i of rank r's call c: values whose f32 sums round.
fn grad(i: usize, r: usize, c: usize) -> f64 {
    (((i * 31 + r * 17 + c * 13) % 97) as f64 / 7.0 - 6.0) as f32 as f64
}

/// Accumulating multistep (k = 3) is bit for bit one allreduce of the three calls' f32 sums;
/// `latest` with a warm-up sends what the communicating call gives; the job's
/// `FERROVOD_MULTISTEP` (2 here) applies where an op does not say; the errors.
pub(crate) fn multistep() {
    init();
    let (me, n) = (rank(), size());
    let len = 257;
    let every3 = Multistep {
        every: 3,
        warmup: 0,
        accumulate: true,
    };
    for period in 0..2 {
        let mut sum = vec![0f32; len];
        for c in 0..3 {
            let call = period * 3 + c;
            let x: Vec<f64> = (0..len).map(|i| grad(i, me, call)).collect();
            for (s, v) in sum.iter_mut().zip(&x) {
                *s = if c == 0 { *v as f32 } else { *s + *v as f32 };
            }
            let (out, sent) = multistep_call("ms.acc", &x, Some(every3));
            assert_eq!(sent, c == 2, "rank {me} call {call}");
            if c < 2 {
                // nothing travelled: the in-place output is the input
                assert_eq!(out, x);
                continue;
            }
            // the reference: a plain allreduce of this rank's f32 sum
            let sums: Vec<f64> = sum.iter().map(|v| *v as f64).collect();
            let (want, sent) = multistep_call("ms.ref", &sums, Some(Multistep::EVERY_CALL));
            assert!(sent);
            assert_eq!(f32_bits(&out), f32_bits(&want), "rank {me} period {period}");
            // and against the closed form
            for (i, v) in out.iter().enumerate() {
                let exact: f64 = (0..n)
                    .map(|r| (0..3).map(|c| grad(i, r, period * 3 + c)).sum::<f64>())
                    .sum();
                assert!((v - exact).abs() < 1e-4, "rank {me} element {i}");
            }
        }
    }
    // latest, warm-up 2, every 2: calls 0 and 1, then 3 and 5 communicate their own input
    let latest = Multistep {
        every: 2,
        warmup: 2,
        accumulate: false,
    };
    for call in 0..6 {
        let x: Vec<f64> = (0..len).map(|i| grad(i, me, call)).collect();
        let (out, sent) = multistep_call("ms.latest", &x, Some(latest));
        assert_eq!(sent, matches!(call, 0 | 1 | 3 | 5), "rank {me} call {call}");
        if sent {
            let want: Vec<f64> = (0..len)
                .map(|i| (0..n).map(|r| grad(i, r, call)).sum::<f64>())
                .collect();
            assert_close(&out, &want, "latest");
        } else {
            assert_eq!(out, x);
        }
    }
    // the job's FERROVOD_MULTISTEP=2 for ops that do not say; 1 means every call
    for call in 0..4 {
        let x: Vec<f64> = (0..len).map(|i| grad(i, me, call)).collect();
        let (_, sent) = multistep_call("ms.job", &x, None);
        assert_eq!(sent, call % 2 == 1, "rank {me} call {call}");
        let (_, sent) = multistep_call("ms.each", &x, Some(Multistep::EVERY_CALL));
        assert!(sent);
    }
    // ranks that disagree on the schedule: the communicating calls meet, and fail
    let mine = Multistep {
        every: if me == n - 1 { 4 } else { 2 },
        ..every3
    };
    let mut err = None;
    for call in 0..4 {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "ms.mismatch",
                DataType::F32,
                &[2],
                &[1.0, 2.0],
                false,
            )],
        );
        spec.multistep = Some(mine);
        let h = submit(spec).unwrap();
        if let Err(e) = finish(h) {
            err = Some((call, e));
            break;
        }
    }
    let (call, err) = err.expect("the schedules' mismatch is reported");
    assert_eq!(call, if me == n - 1 { 3 } else { 1 });
    assert!(
        err.to_string()
            .contains("Mismatched multistep: One rank communicates every 2 calls"),
        "{err}"
    );
    // a call refused because its name is in flight neither counts nor takes the sum: rank 0
    // holds "ms.busy" in flight (the others submit it only later) and calls it multistep
    let every2 = Multistep { every: 2, ..every3 };
    let x = |c: usize| -> Vec<f64> { (0..4).map(|i| grad(i, me, c)).collect() };
    assert!(!multistep_call("ms.busy", &x(0), Some(every2)).1);
    let plain = |vals: &[f64]| {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("ms.busy", DataType::F32, &[4], vals, false)],
        );
        spec.multistep = Some(Multistep::EVERY_CALL);
        submit(spec).unwrap()
    };
    if me == 0 {
        let held = plain(&[0.0; 4]);
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("ms.busy", DataType::F32, &[4], &x(1), false)],
        );
        spec.multistep = Some(every2);
        let err = submit(spec).unwrap_err();
        assert!(
            err.to_string().contains("currently being processed"),
            "{err}"
        );
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        finish(held).unwrap();
    } else {
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        finish(plain(&[0.0; 4])).unwrap();
    }
    let (out, sent) = multistep_call("ms.busy", &x(1), Some(every2));
    assert!(sent, "rank {me}");
    for (i, v) in out.iter().enumerate() {
        let exact: f64 = (0..n).map(|r| grad(i, r, 0) + grad(i, r, 1)).sum();
        assert!(
            (v - exact).abs() < 1e-4,
            "rank {me} element {i}: {v} vs {exact}"
        );
    }
    // an op whose tensors are at different calls
    let one = |name: &str| tensor(name, DataType::F32, &[1], &[1.0], false);
    let mut spec = OpSpec::new(OpKind::Allreduce, vec![one("ms.a")]);
    spec.multistep = Some(every3);
    run(spec).unwrap();
    let mut spec = OpSpec::new(OpKind::Allreduce, vec![one("ms.a"), one("ms.b")]);
    spec.multistep = Some(every3);
    let err = run(spec).unwrap_err();
    assert!(
        err.to_string().contains("must always be called together"),
        "{err}"
    );
    finish_job();
}

/// Compressed gossip (`FERROVOD_COMPRESSION` fp16 or u8 reaches gossip ops too, and an op's own
/// compression wins): the sum over the ranks is kept every round, and the ranks reach the mean
/// far below one rounding step of the compression (the error does not accumulate).
pub(crate) fn gossip_compressed() {
    init();
    let (me, n) = (rank(), size());
    let len = 3000;
    let exact_sum: Vec<f64> = (0..len)
        .map(|i| (0..n).map(|r| start(i, r) as f32 as f64).sum())
        .collect();
    let mean: Vec<f64> = exact_sum.iter().map(|s| s / n as f64).collect();
    let spread = |x: &[f64]| {
        x.iter()
            .zip(&mean)
            .map(|(a, m)| (a - m).abs())
            .fold(0.0, f64::max)
    };
    let job = std::env::var("FERROVOD_COMPRESSION").unwrap();
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    for (codec, name) in [(None, "c.job"), (Some(Compression::Bf16), "c.bf16")] {
        let mut x: Vec<f64> = (0..len).map(|i| start(i, me) as f32 as f64).collect();
        let first = spread(&x);
        let mut spreads = Vec::new();
        let rounds = 12 * (n + n % 2 - 1);
        for round in 0..rounds {
            let mut spec = gossip_spec(&[name.into()], DataType::F32, &[x.clone()]);
            spec.compression = codec;
            let before = metrics();
            let got = run(spec).unwrap();
            let after = metrics();
            let y = output(&got[0], DataType::F32);
            // the bytes travelled as the codec says
            let wire = match codec.map_or(job.as_str(), |c| c.name()) {
                "fp16" => after.wire_fp16 - before.wire_fp16,
                "bf16" => after.wire_bf16 - before.wire_bf16,
                "u8" => after.wire_u8 - before.wire_u8,
                other => panic!("{other}"),
            };
            assert!(wire > 0, "rank {me} {name}: nothing travelled compressed");
            let peer = ferrovod::collective::gossip::peer(me, n, round as u64);
            let wide = codec.map_or(job.as_str(), |c| c.name());
            if round == 0 && peer != me && wide != "u8" {
                // fresh copies: x + (h(x_peer) - h(x)) / 2, h the 16-bit rounding
                let dtype = if wide == "bf16" {
                    DataType::BF16
                } else {
                    DataType::F16
                };
                let h = |v: f64| quantize(dtype, &[v])[0] as f32;
                for (i, (got, mine)) in y.iter().zip(&x).enumerate() {
                    let theirs = start(i, peer) as f32 as f64;
                    let want = *mine as f32 + 0.5 * (h(theirs) - h(*mine));
                    assert_eq!(*got as f32, want, "rank {me} {name} element {i}");
                }
            }
            x = y;
            // the sum over the ranks is what it was
            let got = run(OpSpec::new(
                OpKind::Allreduce,
                vec![tensor(
                    &format!("{name}.sum"),
                    DataType::F64,
                    &[len as i64],
                    &x,
                    false,
                )],
            ))
            .unwrap();
            let sum = output(&got[0], DataType::F64);
            for (i, (s, e)) in sum.iter().zip(&exact_sum).enumerate() {
                assert!(
                    (s - e).abs() < 1e-3,
                    "rank {me} {name} element {i}: sum {s} vs {e}"
                );
            }
            spreads.push(spread(&x));
        }
        // one 16-bit rounding of these values is ~1e-2 (bf16) or ~4e-2 (an 8-bit block step)
        let last = *spreads.last().unwrap();
        assert!(
            last < first * 1e-4,
            "rank {me} {name}: {first} -> {spreads:?}"
        );
    }
    finish_job();
}
