//! Offline negotiation: plans learned, frozen, saved and loaded, left when the step changes, and
//! the stalls they must report; autotune.

use super::*;

/// Random orders and jitter: identical, correct results; once the plan is frozen (after two
/// agreeing steps), steps issue no control collective at all.
pub(crate) fn offline_steps() {
    init();
    let mut rng = Lcg(0x51ed + rank() as u64 * 31);
    for step in 0..5 {
        offline_step(&mut rng, step, 24, &[], 0);
    }
    let before = control_collectives();
    let hierarchical = || {
        runtime::runtime()
            .unwrap()
            .metrics
            .snapshot()
            .hierarchical_batches
    };
    let hierarchical_before = hierarchical();
    for step in 5..15 {
        offline_step(&mut rng, step, 24, &[], 0);
    }
    assert_eq!(
        control_collectives() - before,
        0,
        "steady-state steps negotiated"
    );
    if std::env::var("HOROVOD_HIERARCHICAL_ALLREDUCE").is_ok_and(|v| v == "1") {
        // the frozen plan's batches take the route their plan chooses, as online ones do
        assert!(
            hierarchical() > hierarchical_before,
            "the frozen steps ran no hierarchical batch"
        );
    }
    finish_job();
}

pub(crate) fn plan_path() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("FERROVOD_TEST_SHARED").unwrap()).join("plan.bin")
}

pub(crate) fn init_with_plan_file() {
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.plan_file = Some(plan_path().to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
}

/// Learns a plan and writes it (rank 0) to the shared plan file, for `offline_load`.
pub(crate) fn offline_save() {
    init_with_plan_file();
    let mut rng = Lcg(7 + rank() as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    let before = control_collectives();
    offline_step(&mut rng, 6, 16, &[], 0);
    assert_eq!(control_collectives(), before, "frozen");
    if rank() == 0 {
        let bytes = std::fs::read(plan_path()).expect("plan file written");
        let plan = ferrovod::negotiate::plan::Plan::decode(&bytes).unwrap();
        assert_eq!(plan.num_tensors(), 16);
    }
    finish_job();
}

/// A new run with the saved plan: no control collective from the very first step.
pub(crate) fn offline_load() {
    init_with_plan_file();
    let before = control_collectives();
    let mut rng = Lcg(99 + rank() as u64);
    for step in 0..4 {
        offline_step(&mut rng, step, 16, &[], 0);
    }
    assert_eq!(
        control_collectives(),
        before,
        "the loaded plan ran without negotiation"
    );
    finish_job();
}

/// A plan file from another model: the first tensor is not in it, offline mode falls back to
/// online negotiation, results stay right, and a new plan is learned and frozen.
pub(crate) fn offline_stale_plan() {
    let other: Vec<ferrovod::message::Response> = (0..3)
        .map(|k| {
            let req = ferrovod::message::Request {
                rank: 0,
                kind: OpKind::Allreduce,
                dtype: DataType::F32,
                name: format!("other.model.{k}"),
                shape: vec![10],
                root: 0,
                device: ferrovod::message::CPU_DEVICE,
                reduce_op: ReduceOp::Sum,
                prescale: 1.0,
                postscale: 1.0,
                compression: None,
                multistep: ferrovod::message::Multistep::EVERY_CALL,
            };
            ferrovod::message::Response::from_request(&req)
        })
        .collect();
    let stale = ferrovod::negotiate::plan::Plan::from_step(
        &other,
        1 << 20,
        1 << 20,
        &ferrovod::compress::Codecs::default(),
    );
    let path = plan_path().with_file_name("stale.bin");
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0") {
        std::fs::write(&path, stale.encode()).unwrap();
    }
    // MPI is not initialised yet: the other ranks wait for the file itself
    while !path.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.plan_file = Some(path.to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
    let mut rng = Lcg(3 + rank() as u64);
    for step in 0..6 {
        offline_step(&mut rng, step, 12, &[], 0);
    }
    let before = control_collectives();
    offline_step(&mut rng, 6, 12, &[], 0);
    assert_eq!(control_collectives(), before, "a new plan was frozen");
    if rank() == 0 {
        let plan = ferrovod::negotiate::plan::Plan::decode(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(plan.num_tensors(), 12, "the stale plan file was replaced");
    }
    finish_job();
}

/// After the plan froze: a new tensor, a changed shape and another kind of collective each
/// fall back to online negotiation with correct results, and the plan is learned again.
pub(crate) fn offline_diverge() {
    init();
    let me = rank();
    let mut rng = Lcg(11 + me as u64);
    let mut step = 0;
    let warm = |rng: &mut Lcg, step: &mut usize| {
        for _ in 0..4 {
            offline_step(rng, *step, 10, &[], 0);
            *step += 1;
        }
        let before = control_collectives();
        offline_step(rng, *step, 10, &[], 0);
        *step += 1;
        assert_eq!(control_collectives(), before, "frozen at step {step}");
    };
    warm(&mut rng, &mut step);
    // a tensor the plan does not hold
    let before = control_collectives();
    offline_step(&mut rng, step, 10, &["brand.new"], 0);
    step += 1;
    assert!(control_collectives() > before, "fell back to online");
    warm(&mut rng, &mut step);
    // a changed shape
    offline_step(&mut rng, step, 10, &[], 3);
    step += 1;
    warm(&mut rng, &mut step);
    // a broadcast between steps
    let mine = [me as f64 + 1.0, 2.0];
    let res = run(OpSpec::new(
        OpKind::Broadcast,
        vec![tensor("between.steps", DataType::F64, &[2], &mine, false)],
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F64), &[1.0, 2.0], "broadcast");
    warm(&mut rng, &mut step);
    finish_job();
}

/// After the plan froze, rank 1 skips one tensor of a step: it escapes after
/// FERROVOD_PLAN_ESCAPE_MS, online negotiation takes over, and the stall inspector ends the
/// job with an error naming the tensor on every rank, within the stall timeout.
pub(crate) fn offline_skip() {
    init();
    let me = rank();
    let mut rng = Lcg(5 + me as u64);
    for step in 0..5 {
        offline_step(&mut rng, step, 8, &[], 0);
    }
    let start = Instant::now();
    let skip: &[usize] = if me == 1 { &[2] } else { &[] };
    let handles = submit_step(8, 0, skip);
    let mut errors = Vec::new();
    for (_, h) in handles {
        if let Err(e) = finish(h) {
            errors.push(e.to_string());
        }
    }
    if errors.is_empty() {
        // rank 1 holds no stalled tensor: its next operation fails with the job's stall report
        errors.push(
            run(OpSpec::new(OpKind::Barrier, vec![]))
                .unwrap_err()
                .to_string(),
        );
    }
    assert_stall_report(&errors[0], &["Missing ranks:", "p.2"], start);
    runtime::shutdown();
    pass();
}

/// After the plan froze, rank 1 stops submitting altogether (it holds nothing, so it cannot
/// escape): rank 0 waits inside a plan batch, warns, and after the stall shutdown time fails its
/// tensors with the stall report; it leaves MPI unfinalized, so the job ends instead of hanging
/// when rank 0 exits. The harness expects the job to fail and rank 0's report in the output.
pub(crate) fn offline_stall() {
    init();
    let me = rank();
    let mut rng = Lcg(17 + me as u64);
    for step in 0..5 {
        offline_step(&mut rng, step, 8, &[], 0);
    }
    if me == 1 {
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let start = Instant::now();
    let errors: Vec<String> = submit_step(8, 0, &[])
        .into_iter()
        .filter_map(|(_, h)| finish(h).err().map(|e| e.to_string()))
        .collect();
    assert!(!errors.is_empty());
    let parts = ["in offline plan batch", "Missing ranks: 1."];
    assert_stall_report(&errors[0], &parts, start);
    println!("OFFLINE-STALL-REPORTED");
}

/// Autotune changes the fusion threshold and cycle time while steps run: every result stays
/// right, and rank 0's log records every setting tried (a header-less CSV, one line per
/// scored window: threshold, cycle ms, bytes/s).
pub(crate) fn autotune() {
    let log =
        std::path::PathBuf::from(std::env::var("FERROVOD_TEST_DIR").unwrap()).join("tune.csv");
    let mut cfg = ferrovod::config::Config::from_env();
    cfg.autotune_log = Some(log.to_string_lossy().into_owned());
    runtime::init(runtime::InitOptions {
        config: Some(cfg),
        ..Default::default()
    })
    .expect("init");
    let mut rng = Lcg(23 + rank() as u64);
    for step in 0..120 {
        offline_step(&mut rng, step, 12, &[], 0);
    }
    if rank() == 0 {
        let text = std::fs::read_to_string(&log).unwrap();
        let thresholds: std::collections::BTreeSet<&str> =
            text.lines().map(|l| l.split(',').next().unwrap()).collect();
        // every threshold of the grid was tried
        assert!(thresholds.len() >= 7, "{text}");
    }
    finish_job();
}
