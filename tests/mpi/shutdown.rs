//! Stalls, shutdown with work pending, and ranks that exit, are killed, stop or fail locally:
//! every other rank ends with an error, never a hang.

use super::*;

/// Each rank submits a tensor the other never does: the stall becomes an error on all ranks.
pub(crate) fn stall() {
    init();
    let me = rank();
    let name = format!("only.on.rank{me}");
    let start = Instant::now();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(&name, DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    let parts = [
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        "Missing ranks:",
        "only.on.rank0",
        "only.on.rank1",
    ];
    assert_stall_report(&err.to_string(), &parts, start);
    // new work is refused with the same reason
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(err.to_string().contains("Missing ranks:"));
    runtime::shutdown();
    pass();
}

/// A name both ranks used before (so it is cached) that only rank 0 submits again, while rank 1
/// submits nothing: only the cached path can see it. Rank 0's vote goes stale, is sent to the
/// coordinator, and the stall ends in an error on both ranks.
pub(crate) fn stall_cached() {
    init();
    let me = rank();
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("cached.once", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap();
    let start = Instant::now();
    let err = if me == 0 {
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("cached.once", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    } else {
        wait_for_shutdown(start);
        submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err()
    };
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    let parts = ["Missing ranks:\n1: [cached.once]"];
    assert_stall_report(&err.to_string(), &parts, start);
    runtime::shutdown();
    pass();
}

/// Operations with a timeout of their own (a torch group's): healthy ones, whose ranks arrive
/// 100 ms apart within it, complete; one that the other ranks never submit ends the job with a
/// "Timed out" error on every rank once its timeout has passed, long before the stall limit
/// (a minute here). `FERROVOD_TEST_TIMEOUT_PATH`: `cached`, the name was agreed before, so only
/// the waiting rank's vote knows of it until it goes stale; `group`, four names agreed together
/// in earlier steps vote as one learned group. There the waiting rank is the last one, not the
/// coordinator (the timeout travels with the request).
pub(crate) fn op_timeout() {
    init();
    let (me, n) = (rank(), size());
    let timed = |name: &str, seconds: f64| {
        let vals = [me as f64 + 1.0, 1.0];
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(name, DataType::F32, &[2], &vals, false)],
        );
        spec.timeout = Some(Duration::from_secs_f64(seconds));
        spec
    };
    let want = [(n * (n + 1) / 2) as f64, n as f64];
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(100 * me as u64));
        let out = run(timed("timeout.healthy", 2.0)).unwrap();
        assert_close(&output(&out[0], DataType::F32), &want, "healthy");
    }
    let path = std::env::var("FERROVOD_TEST_TIMEOUT_PATH").unwrap_or_default();
    let (names, before): (Vec<String>, usize) = match path.as_str() {
        "cached" => (vec!["timeout.left".into()], 1),
        "group" => ((0..4).map(|i| format!("timeout.left.{i}")).collect(), 6),
        _ => (vec!["timeout.left".into()], 0),
    };
    let waiter = if before > 0 { n - 1 } else { 0 };
    // every rank's step of `names`, each with timeout `seconds`: the first error, if any
    let step = |seconds: f64| {
        let hs: Vec<_> = (names.iter())
            .map(|name| submit(timed(name, seconds)).unwrap())
            .collect();
        let mut first = None;
        for h in hs {
            match finish(h) {
                Ok(out) => assert_close(&output(&out[0], DataType::F32), &want, "step"),
                Err(e) => first = first.or(Some(e)),
            }
        }
        first
    };
    for _ in 0..before {
        assert!(step(5.0).is_none());
    }
    run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    let start = Instant::now();
    let err = if me == waiter {
        step(1.0).expect("an error")
    } else {
        wait_for_shutdown(start);
        submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err()
    };
    let waited = start.elapsed();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    let msg = err.to_string();
    let missing: Vec<usize> = (0..n).filter(|r| *r != waiter).collect();
    for part in [
        "Timed out waiting for ranks",
        &format!("'{}' waited", names[0]),
        &format!("rank(s) {missing:?}"),
        "timeout of 1.0 s",
    ] {
        assert!(msg.contains(part), "no '{part}' in: {msg}");
    }
    if me == waiter {
        assert!(waited >= Duration::from_secs(1), "ended after {waited:?}");
    }
    assert!(waited < Duration::from_secs(10), "ended after {waited:?}");
    runtime::shutdown();
    pass();
}

/// A stall inside process set {0, 1}: rank 2, outside the set, must not be left waiting in the
/// global vote; every rank ends with an error.
pub(crate) fn stall_in_set() {
    init();
    let me = rank();
    let rt = runtime::runtime().unwrap();
    let h = rt.add_process_set(&[0, 1]).unwrap();
    h.wait(None).unwrap();
    let set = h.value();
    let start = Instant::now();
    if me == 0 {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("set.only0", DataType::F32, &[1], &[1.0], false)],
        );
        spec.process_set = set;
        let err = run(spec).unwrap_err();
        assert!(
            err.to_string().contains("Missing ranks:\n1: [set.only0]"),
            "{err}"
        );
    }
    // the whole job stops through the global set's next vote
    wait_for_shutdown(start);
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert_stall_report(&err.to_string(), &[], start);
    runtime::shutdown();
    pass();
}

/// One rank shuts down while the other has an operation pending.
pub(crate) fn shutdown_pending() {
    init();
    if rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
        runtime::shutdown();
    } else {
        let err = run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err();
        assert_eq!(err, Error::ShutDown(SHUT_DOWN_MESSAGE.into()));
        let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
        assert_eq!(err.to_string(), SHUT_DOWN_MESSAGE);
        runtime::shutdown();
    }
    pass();
}

/// A rank whose program ends without calling shutdown: the exit handler that fv_init registers
/// tells the others, whose pending operation fails instead of hanging.
pub(crate) fn rank_exits() {
    // SAFETY: NULL options are documented.
    assert_eq!(
        unsafe { ferrovod::capi::fv_init(std::ptr::null()) },
        ferrovod::Status::Ok
    );
    if rank() == 1 {
        pass();
        std::thread::sleep(Duration::from_millis(200));
        std::process::exit(0);
    }
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    assert_eq!(err, Error::ShutDown(SHUT_DOWN_MESSAGE.into()));
    pass();
}

/// A rank that dies while the others wait for it. Launched so that mpirun lets the others run
/// on (`--enable-recovery`): each survivor's operation fails within the stall limit, naming
/// the dead rank.
pub(crate) fn rank_killed() {
    init();
    if rank() == 1 {
        std::thread::sleep(Duration::from_millis(200));
        std::process::abort();
    }
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("pending", DataType::F32, &[1], &[1.0], false)],
    ))
    .expect_err("an allreduce with a dead rank succeeded");
    let msg = err.to_string();
    assert!(msg.contains("Missing ranks: 1."), "{msg}");
    report_and_exit("KILLED-REPORTED", &msg);
}

/// Rank 1 spends longer than the stall limit inside a batch (`slow_in_batch`) while the
/// others wait in its collective: every rank is present, so the watchdog waits on and the
/// step gives the right sum.
pub(crate) fn slow_collective() {
    init();
    steps_together(1);
    finish_job();
}

/// Settings too large for a clock are refused (the job runs on defaults), and a wait with a
/// timeout past what the clock holds waits for the operation, as one with none does.
pub(crate) fn huge_settings() {
    init();
    steps_together(3);
    let rt = runtime::runtime().unwrap();
    assert_eq!(rt.config.cycle_time, Duration::from_millis(1));
    assert_eq!(rt.config.stall_warn, Duration::from_secs(60));
    let h = rt
        .enqueue(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("huge.wait", DataType::F32, &[2], &[1.0, 2.0], false)],
        ))
        .unwrap();
    h.wait(Some(Duration::from_secs_f64(1e19))).unwrap();
    let got = h.result(0).unwrap();
    let n = size() as f64;
    assert_eq!(output(&got, DataType::F32), vec![n, 2.0 * n]);
    rt.handles.release(h.id).unwrap();
    finish_job();
}

/// A few steps every rank runs together.
pub(crate) fn steps_together(n: usize) {
    for step in 0..n {
        let out = run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                "together",
                DataType::F32,
                &[1],
                &[1.0 + step as f64],
                false,
            )],
        ))
        .expect("a step before the fault");
        let want = (size() as f64) * (1.0 + step as f64);
        assert_eq!(output(&out[0], DataType::F32), vec![want]);
    }
}

/// Prints the marker a failing scenario's harness counts, then ends this process as a
/// framework's uncaught exception does: shutdown (the C API's exit handler), exit without
/// finalizing MPI; mpirun ends the job.
pub(crate) fn report_and_exit(marker: &str, msg: &str) -> ! {
    use std::io::Write;
    println!("{marker} rank={}: {msg}", rank());
    std::io::stdout().flush().unwrap();
    runtime::shutdown();
    std::process::exit(1);
}

/// A rank that hangs instead of dying (kill -STOP, as a stuck file system or GPU does): the
/// others wait in a negotiation vote, report the stall naming it once the stall shutdown time
/// has passed, and end.
pub(crate) fn rank_stopped() {
    init();
    let start;
    let err = if std::env::var("FERROVOD_TEST_FAULT").is_ok_and(|f| f.starts_with("stop_in_round"))
    {
        // rank 1 stops inside the first coordinator round: the first step fails
        start = Instant::now();
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("in.round", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    } else {
        steps_together(3);
        if rank() == 1 {
            let _ = Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
            unreachable!("a stopped rank is killed by mpirun");
        }
        start = Instant::now();
        run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("after.stop", DataType::F32, &[1], &[1.0], false)],
        ))
        .unwrap_err()
    };
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("Missing ranks: 1."), "{msg}");
    assert!(
        msg.contains("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2"),
        "{msg}"
    );
    // the limit (2 s) plus the presence probe (3 s) plus a margin
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
    report_and_exit("STALL-REPORTED", &msg);
}

/// Rank 1 stops itself after agreeing to run a batch: the others wait inside the blocking
/// data collective, which no error can interrupt; the watchdog names rank 1 and aborts the
/// job (checked by the harness on stderr).
///
/// On GPUs rank 0 launched the batch's NCCL call and waits for its completion event while it
/// votes: the vote's limit (or the completion's) fails the operation, the NCCL communicators are
/// aborted, and rank 0 ends as a framework would on the error.
pub(crate) fn rank_stopped_in_batch() {
    init();
    // a matrix, so that under PowerSGD and top-k the waiting ranks are inside the codec's
    // exchange
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            "stopped.in.batch",
            DataType::F32,
            &[64, 32],
            &[1.0; 64 * 32],
            false,
        )],
    ))
    .unwrap_err();
    // host memory: the watchdog aborted the job before this
    assert!(gpu_mode(), "the blocking collective returned: {err}");
    let msg = err.to_string();
    assert!(
        msg.contains("Missing ranks: 1.") || msg.contains("GPU collective did not finish within"),
        "{msg}"
    );
    report_and_exit("STALL-REPORTED", &msg);
}

/// Only rank 0's environment sets short stall limits, and rank 0 stops inside a batch: the
/// limits are agreed from rank 0, so rank 1's watchdog (60 s / 600 s in its own environment)
/// reports rank 0 missing after 2 s and ends the job.
pub(crate) fn stall_env_differs() {
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0") {
        // SAFETY: set before any thread of this process reads the environment.
        unsafe {
            std::env::set_var("HOROVOD_STALL_CHECK_TIME_SECONDS", "1");
            std::env::set_var("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "2");
        }
    }
    init();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("stopped.rank0", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    // host memory: the watchdog aborted the job before this
    assert!(gpu_mode(), "the blocking collective returned: {err}");
    report_and_exit("STALL-REPORTED", &err.to_string());
}

/// Rank 1's background thread panics before a batch every rank agreed to run: it aborts the
/// job at once with a message (the others may already wait inside the batch's collective).
pub(crate) fn fault_panic() {
    init();
    let _ = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("panics", DataType::F32, &[1], &[1.0], false)],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// Rank 1's vote fails locally: its operation gets the error; its background thread is gone,
/// so the others report it missing after the stall shutdown time.
pub(crate) fn fault_negotiation() {
    init();
    // steps until the fault (at once, or once an offline plan froze) fails one
    let mut failed = None;
    for step in 0..12 {
        let v = 1.0 + step as f64;
        match run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("fault.step", DataType::F32, &[1], &[v], false)],
        )) {
            Ok(out) => assert_eq!(output(&out[0], DataType::F32), vec![size() as f64 * v]),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let msg = failed.expect("the fault failed no step").to_string();
    if rank() == 1 {
        assert!(msg.contains("test fault:"), "{msg}");
        use std::io::Write;
        println!("FAULT-REPORTED rank=1: {msg}");
        std::io::stdout().flush().unwrap();
        // alive, but no longer negotiating: the others must not wait for ever
        std::thread::sleep(Duration::from_secs(120));
    }
    assert!(msg.contains("Missing ranks: 1."), "{msg}");
    report_and_exit("STALL-REPORTED", &msg);
}

/// Rank 0 cannot decode a request list: it answers the round with a shutdown instead of
/// leaving the others waiting in its broadcast. Every rank gets the reason; MPI stays usable.
pub(crate) fn fault_decode() {
    init();
    let err = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("fault.decode", DataType::F32, &[1], &[1.0], false)],
    ))
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ShutDown(_)), "{err:?}");
    assert!(msg.contains("test fault: decode"), "{msg}");
    let err = submit(OpSpec::new(OpKind::Barrier, vec![])).unwrap_err();
    assert!(err.to_string().contains("test fault: decode"), "{err}");
    runtime::shutdown();
    pass();
}

/// GPU: rank 1 fails just before creating its NCCL communicator; rank 0 waits in
/// ncclCommInitRank, which nothing interrupts: the watchdog names the wait and ends the job.
pub(crate) fn fault_nccl_init() {
    init();
    let _ = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("nccl.init", DataType::F32, &[4], &[1.0; 4], false)],
    ));
    std::thread::sleep(Duration::from_secs(120));
}

/// GPU: rank 1's alltoall fails before the split exchange over MPI that rank 0 waits in.
pub(crate) fn gpu_alltoall_fault() {
    init();
    let rows = size() as i64;
    let got = run(OpSpec::new(
        OpKind::Alltoall,
        vec![tensor(
            "a2a.fault",
            DataType::F32,
            &[rows],
            &vec![1.0; rows as usize],
            true,
        )],
    ));
    match (rank(), got) {
        (1, Err(e)) if e.to_string().contains("test fault: gpu_alltoall") => {}
        (r, got) => panic!("rank {r}: alltoall returned {:?}", got.map(|_| ())),
    }
    std::thread::sleep(Duration::from_secs(120));
}

/// GPU: rank 1's reducescatter of a dtype NCCL cannot reduce (u16, staged through a host-MPI
/// reduce-scatter) fails before the host reduction that rank 0 waits in.
pub(crate) fn gpu_staged_fault() {
    init();
    let rows = 2 * size();
    let got = run(OpSpec::new(
        OpKind::Reducescatter,
        vec![tensor(
            "staged.fault",
            DataType::U16,
            &[rows as i64],
            &vec![1.0; rows],
            true,
        )],
    ));
    // rank 1 fails locally; rank 0 never returns (the watchdog ends the job): any other end
    // is a wrong setup, said at once rather than as a hang
    match (rank(), got) {
        (1, Err(e)) if e.to_string().contains("test fault: gpu_staged") => {}
        (r, got) => panic!(
            "rank {r}: staged reducescatter returned {:?}",
            got.map(|_| ())
        ),
    }
    std::thread::sleep(Duration::from_secs(120));
}
