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
