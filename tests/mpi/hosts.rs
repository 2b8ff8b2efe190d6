//! Scenarios on emulated hosts (scripts/hosts/: network namespaces joined by rate-limited
//! links), launched by the harness through `scripts/hosts/mpirun.sh`.

use super::*;

/// The link's rate limit is in force: 100 MB broadcast from host 0 to host 1 at 1 Gbit/s takes at
/// least 0.8 s (8e8 bits), and arrives intact.
pub(crate) fn link_rate() {
    init();
    let n = 25_000_000usize; // 100 MB of f32
    let vals: Vec<f64> = (0..n)
        .map(|i| if rank() == 0 { (i % 1000) as f64 } else { 0.0 })
        .collect();
    // both ranks start the transfer together
    run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    let start = Instant::now();
    let mut spec = OpSpec::new(
        OpKind::Broadcast,
        vec![tensor(
            "link.rate",
            DataType::F32,
            &[n as i64],
            &vals,
            false,
        )],
    );
    spec.root_rank = 0;
    let out = run(spec).unwrap();
    let secs = start.elapsed().as_secs_f64();
    if rank() == 1 {
        let got = output(&out[0], DataType::F32);
        assert!(
            got.iter().enumerate().all(|(i, v)| *v == (i % 1000) as f64),
            "broadcast data"
        );
        println!("LINK-RATE rank=1: 100 MB in {secs:.2} s");
        assert!(secs >= 0.8, "100 MB crossed a 1 Gbit/s link in {secs:.2} s");
    }
    finish_job();
}

/// `FERROVOD_ALGORITHM=auto`: every rank chooses the same algorithm for every batch size, also
/// when its own probe measured other figures (`FERROVOD_TEST_FAULT=slow_probe:1`); with
/// `FERROVOD_TEST_SLOW_CROSS=1` (hosts joined by a slow network) large batches go hierarchical.
pub(crate) fn algorithm_agreed() {
    use ferrovod::collective::cost::Algorithm;
    init();
    let rt = runtime::runtime().unwrap();
    let sizes: Vec<usize> = (0..36).map(|k| 1usize << k).collect();
    let bits: Vec<f64> = sizes
        .iter()
        .map(|b| {
            f64::from(u8::from(
                rt.allreduce_algorithm(*b) == Algorithm::Hierarchical,
            ))
        })
        .collect();
    let n = bits.len() as i64;
    let mut agreed = Vec::new();
    for (name, op) in [("algo.min", ReduceOp::Min), ("algo.max", ReduceOp::Max)] {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(name, DataType::F32, &[n], &bits, false)],
        );
        spec.reduce_op = op;
        agreed.push(output(&run(spec).unwrap()[0], DataType::F32));
    }
    assert_eq!(agreed[0], agreed[1], "ranks chose differently");
    assert_eq!(agreed[0], bits);
    if std::env::var("FERROVOD_TEST_SLOW_CROSS").is_ok_and(|v| v == "1") {
        assert_eq!(
            rt.allreduce_algorithm(64 << 20),
            Algorithm::Hierarchical,
            "a 64 MiB batch across a slow network"
        );
    }
    finish_job();
}
