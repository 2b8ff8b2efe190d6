//! Process sets, join, and init on a subset of ranks or on MPI initialised elsewhere.

use super::*;

/// Rank 0 keeps reducing after the others joined: joined ranks contribute zeros; join returns
/// the last rank to join; allgather with a joined rank is an error on the ranks that submit it.
pub(crate) fn join() {
    init();
    let n = size();
    let me = rank();
    // warm the cache with one name so joined ranks vote for a cached tensor too
    let first: Vec<f64> = (0..5).map(|i| val(i, me)).collect();
    run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("j.cached", DataType::F32, &[5], &first, false)],
    ))
    .unwrap();
    if me == 0 {
        for step in 0..3 {
            for name in ["j.cached", "j.new"] {
                let mine: Vec<f64> = (0..5).map(|i| val(i + step, me)).collect();
                let res = run(OpSpec::new(
                    OpKind::Allreduce,
                    vec![tensor(name, DataType::F32, &[5], &mine, false)],
                ))
                .unwrap();
                assert_close(
                    &output(&res[0], DataType::F32),
                    &mine,
                    "joined ranks add zeros",
                );
            }
        }
        // a barrier among the ranks that have not joined: joined ranks take part too
        run(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
        let err = run(OpSpec::new(
            OpKind::Allgather,
            vec![tensor("j.ag", DataType::F32, &[1], &[1.0], true)],
        ))
        .unwrap_err();
        assert!(
            matches!(err, Error::Precondition(ref m) if m.starts_with("Allgather is not supported with Join")),
            "{err}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // rank 0 submits a last allreduce and its join back to back, so both can be agreed in one
    // cycle: the joined ranks must still contribute to the allreduce
    let last = (me == 0).then(|| {
        let mine: Vec<f64> = (0..4).map(|i| val(i, me)).collect();
        let h = submit(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("j.last", DataType::F32, &[4], &mine, false)],
        ))
        .unwrap();
        (h, mine)
    });
    let h = submit(OpSpec::new(OpKind::Join, vec![])).unwrap();
    if let Some((g, mine)) = last {
        assert_close(
            &output(&finish(g).unwrap()[0], DataType::F32),
            &mine,
            "allreduce agreed with the join",
        );
    }
    h.wait(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(h.value(), 0, "rank 0 joins last");
    // after the join everyone works normally again
    let mine: Vec<f64> = (0..3).map(|i| val(i, me)).collect();
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("after", DataType::F64, &[3], &mine, false)],
    ))
    .unwrap();
    let want: Vec<f64> = (0..3).map(|i| (0..n).map(|r| val(i, r)).sum()).collect();
    assert_close(&output(&res[0], DataType::F64), &want, "after join");
    finish_job();
}

pub(crate) fn process_sets() {
    // a rank listed twice is refused, as fv_add_process_set refuses it (not deduplicated),
    // before anything collective starts: init can be retried
    let err = runtime::init(runtime::InitOptions {
        process_sets: vec![vec![0, 2], vec![1, 1, 3]],
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("must be distinct ranks"), "{err}");
    // static sets at init: {0, 2} and {1, 3}, plus a duplicate that maps to the same id
    runtime::init(runtime::InitOptions {
        process_sets: vec![vec![0, 2], vec![1, 3], vec![2, 0]],
        ..Default::default()
    })
    .unwrap();
    let rt = runtime::runtime().unwrap();
    let me = rank();
    assert_eq!(rt.process_set_ids(), vec![0, 1, 2]);
    assert_eq!(rt.process_set_ranks(1), Some(vec![0, 2]));
    let mine_set = if me.is_multiple_of(2) { 1 } else { 2 };
    assert_eq!(rt.process_set_rank(mine_set).unwrap(), (me / 2) as i32);
    assert_eq!(rt.process_set_rank(3 - mine_set).unwrap(), -1);
    // concurrent, same tensor name in both sets
    let mine: Vec<f64> = (0..4).map(|i| val(i, me)).collect();
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("shared.name", DataType::F32, &[4], &mine, false)],
    );
    spec.process_set = mine_set;
    let res = run(spec).unwrap();
    let peers = [me % 2, me % 2 + 2];
    let want: Vec<f64> = (0..4)
        .map(|i| peers.iter().map(|r| val(i, *r)).sum())
        .collect();
    assert_close(
        &output(&res[0], DataType::F32),
        &want,
        "static set allreduce",
    );
    // not a member
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("x", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = 3 - mine_set;
    let err = submit(spec).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("Allreduce: Rank {me} is not a member of the provided process set.")
    );
    // dynamic add, duplicate add, remove, removal of the global set
    let h = rt.add_process_set(&[0, 1, 2]).unwrap();
    h.wait(None).unwrap();
    let id = h.value();
    assert_eq!(id, 3);
    let dup = rt.add_process_set(&[0, 1, 2]).unwrap();
    let err = dup.wait(None).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    if me < 3 {
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![tensor("dyn", DataType::I64, &[4], &mine, false)],
        );
        spec.process_set = id;
        let res = run(spec).unwrap();
        let want: Vec<f64> = (0..4).map(|i| (0..3).map(|r| val(i, r)).sum()).collect();
        assert_close(&output(&res[0], DataType::I64), &want, "dynamic set");
    }
    let h = rt.remove_process_set(id).unwrap();
    h.wait(None).unwrap();
    assert_eq!(rt.process_set_ranks(id), None);
    assert!(rt.remove_process_set(0).is_err());
    assert!(rt.remove_process_set(id).is_err());
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("gone", DataType::F32, &[1], &[1.0], false)],
    );
    spec.process_set = id;
    assert_eq!(
        submit(spec).unwrap_err().to_string(),
        "Allreduce: Process set provided does not exist, or has not been registered."
    );
    finish_job();
}

/// MPI initialised by the program (as mpi4py does); ferrovod runs on two halves of the world
/// given as communicators, and leaves MPI for the program to finalise.
pub(crate) fn preinitialized_mpi() {
    use mpi::ffi;
    // SAFETY: plain MPI calls on a fresh process.
    let half_comm = unsafe {
        let mut provided = 0;
        ffi::MPI_Init_thread(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            ffi::RSMPI_THREAD_MULTIPLE,
            &mut provided,
        );
        let mut r = 0;
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut r);
        let mut half = std::mem::zeroed();
        ffi::MPI_Comm_split(ffi::RSMPI_COMM_WORLD, r % 2, r, &mut half);
        half
    };
    // SAFETY: a valid communicator.
    let handle = unsafe { ffi::MPI_Comm_c2f(half_comm) };
    runtime::init(runtime::InitOptions {
        comm: runtime::Communicator::Fortran(handle),
        ..Default::default()
    })
    .unwrap();
    let world_rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(size(), 2);
    assert_eq!(rank(), world_rank / 2);
    let mine = vec![world_rank as f64];
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("half", DataType::F64, &[1], &mine, false)],
    ))
    .unwrap();
    let peers: f64 = (0..4)
        .filter(|r| r % 2 == world_rank % 2)
        .map(|r| r as f64)
        .sum();
    assert_close(
        &output(&res[0], DataType::F64),
        &[peers],
        "allreduce on a sub-communicator",
    );
    runtime::shutdown();
    // MPI must still be usable: ferrovod did not finalise it
    // SAFETY: MPI is initialised by this program.
    unsafe {
        let mut flag = 0;
        ffi::MPI_Finalized(&mut flag);
        assert_eq!(flag, 0, "ferrovod finalised MPI it did not initialise");
        let mut half = half_comm;
        ffi::MPI_Comm_free(&mut half);
        ffi::MPI_Barrier(ffi::RSMPI_COMM_WORLD);
        ffi::MPI_Finalize();
    }
    pass();
}

/// init with a subset of MPI_COMM_WORLD: members run collectives among themselves; the rank
/// outside gets a clear error.
pub(crate) fn init_subset() {
    let world_rank: i32 = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let r = runtime::init(runtime::InitOptions {
        comm: runtime::Communicator::Ranks(vec![0, 2]),
        ..Default::default()
    });
    if world_rank == 1 {
        let err = r.unwrap_err();
        assert!(
            err.to_string()
                .contains("is not in the ranks given to init"),
            "{err}"
        );
        assert!(!runtime::is_initialized());
        pass();
        return;
    }
    r.unwrap();
    assert_eq!(size(), 2);
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            "sub",
            DataType::F32,
            &[1],
            &[world_rank as f64],
            false,
        )],
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F32), &[2.0], "subset allreduce");
    finish_job();
}
