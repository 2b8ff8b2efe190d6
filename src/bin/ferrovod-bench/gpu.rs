//! `ferrovod-bench gpu`: ferrovod's allreduce of GPU tensors against NCCL underneath, in one
//! process. Sweep (nccl-tests form): in-place f32 sums of `iters` buffers of one size,
//! submitted back to back and waited for together, against the same raw `ncclAllReduce` calls
//! on one stream; at 256 MiB also one tensor at a time (each waited for before the next),
//! against one allreduce then a synchronize. ResNet-50: the gradient set (one device buffer per tensor, submitted in backward
//! order, averaged) against one raw NCCL allreduce of the same bytes. Each figure is the median
//! of several repetitions. Rank 0 prints one JSON object per line (the GPU script joins them
//! with PyTorch's figures) and a table.

use std::sync::Arc;
use std::time::Instant;

use ferrovod::runtime::entry::{InputMem, OutputMem};
use ferrovod::runtime::handle::Handle;
use ferrovod::runtime::{self, OpSpec, TensorSpec};
use ferrovod::transport::cuda::{self, DeviceMem, Gpu, Stream};
use ferrovod::transport::memory::DeviceRange;
use ferrovod::transport::mpi::MpiComm;
use ferrovod::transport::nccl::{self, NcclComm};
use ferrovod::transport::{DeviceTransport, Transport};
use ferrovod::{DataType, OpKind, ReduceOp};

pub struct Options {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub reps: usize,
    /// Also time the same gradients through NCCL alone in several layouts.
    pub floors: bool,
}

/// GiB/s on the bus of an allreduce of `bytes` over `size` ranks in `secs`; at np 1, where
/// nothing crosses one, the algorithm's bandwidth.
fn busbw(bytes: usize, secs: f64, size: usize) -> f64 {
    let bus = match size {
        1 => 1.0,
        n => 2.0 * (n as f64 - 1.0) / n as f64,
    };
    bytes as f64 / secs / (1u64 << 30) as f64 * bus
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn iters_for(bytes: usize) -> usize {
    (1usize << 30).div_ceil(bytes).clamp(10, 50)
}

fn submit(gpu: &Gpu, name: &str, mem: &DeviceMem, len: usize, op: ReduceOp) -> Arc<Handle> {
    submit_kind(gpu, OpKind::Allreduce, name, mem, len, op)
}

fn submit_kind(
    gpu: &Gpu,
    kind: OpKind,
    name: &str,
    mem: &DeviceMem,
    len: usize,
    op: ReduceOp,
) -> Arc<Handle> {
    let mut spec = OpSpec::new(
        kind,
        vec![TensorSpec {
            name: name.to_string(),
            dtype: DataType::F32,
            shape: vec![(len / 4) as i64],
            input: InputMem::Device(mem.range().first(len).unwrap()),
            output: OutputMem::InPlace,
            splits: None,
        }],
    );
    spec.reduce_op = op;
    spec.device = gpu.ordinal;
    runtime::runtime().unwrap().enqueue(spec).unwrap()
}

/// Waits until every operation's GPU work has finished, as a framework would: for each handle
/// (a handle completes after its GPU work by default), and with
/// `HOROVOD_ENABLE_ASYNC_COMPLETION=1`, where handles complete at enqueue, for their
/// completion events too.
fn wait_all(hs: Vec<Arc<Handle>>) {
    let rt = runtime::runtime().unwrap();
    let async_completion = rt.config.async_completion;
    let mut events: Vec<Arc<cuda::Event>> = Vec::new();
    for h in hs {
        h.wait(None).unwrap();
        if async_completion
            && let Some(ev) = h.event()
            && !events.last().is_some_and(|l| Arc::ptr_eq(l, &ev))
        {
            events.push(ev);
        }
        rt.handles.release(h.id).unwrap();
    }
    for ev in events {
        ev.synchronize().unwrap();
    }
}

/// Seconds for ferrovod allreduces of `len` bytes of each of `mems`, submitted together.
fn ferrovod_round(gpu: &Gpu, host: &MpiComm, mems: &[DeviceMem], len: usize) -> f64 {
    host.barrier().unwrap();
    let t = Instant::now();
    let hs: Vec<_> = mems
        .iter()
        .enumerate()
        .map(|(i, m)| submit(gpu, &format!("sweep.{len}.{i}"), m, len, ReduceOp::Sum))
        .collect();
    wait_all(hs);
    t.elapsed().as_secs_f64()
}

/// Seconds for raw NCCL allreduces of `len` bytes of each of `mems`, back to back on one
/// stream.
fn nccl_round(
    comm: &NcclComm,
    stream: &Stream,
    host: &MpiComm,
    mems: &[DeviceMem],
    len: usize,
    op: ReduceOp,
) -> f64 {
    host.barrier().unwrap();
    let t = Instant::now();
    for m in mems {
        comm.allreduce(m.range(), m.range(), len / 4, DataType::F32, op, stream)
            .unwrap();
    }
    stream.synchronize().unwrap();
    t.elapsed().as_secs_f64()
}

pub fn run(o: &Options, grads: &[(String, usize)]) {
    runtime::init(Default::default()).expect("ferrovod init");
    let rt = runtime::runtime().unwrap();
    let topo = rt.topology();
    let (me, size) = (topo.rank as usize, topo.size as usize);
    let count = cuda::device_count().expect("CUDA");
    assert!(count > 0, "no CUDA device");
    let gpu = cuda::gpu(topo.local_rank % count as i32).expect("GPU");
    gpu.load(&ferrovod::collective::kernels::LIBRARY)
        .expect("kernels");
    let host = MpiComm::world().unwrap();
    let id = if me == 0 {
        nccl::unique_id().unwrap()
    } else {
        Vec::new()
    };
    let id = host.broadcast_bytes(id, 0).unwrap();
    let comm = NcclComm::new(&gpu, &id, me, size).unwrap();
    let stream = gpu.new_stream().unwrap();
    if me == 0 {
        println!(
            "# ferrovod GPU allreduce, np={size}, NCCL {}, f32 sum in place",
            nccl::version().unwrap_or(0)
        );
        println!(
            "# {:>10} {:>6} {:>11} {:>11} {:>11} {:>11} {:>8}",
            "bytes", "iters", "fv us", "fv busbw", "nccl us", "nccl busbw", "fv/nccl"
        );
    }
    let mut bytes = o.min_bytes;
    while bytes <= o.max_bytes {
        let iters = iters_for(bytes);
        // one buffer per tensor, as a framework's gradients are (ferrovod may reduce
        // consecutive tensors at once, on its several NCCL streams)
        let mems: Vec<DeviceMem> = (0..iters)
            .map(|_| {
                let m = gpu.alloc(bytes).unwrap();
                gpu.memset_zero(&stream, m.range()).unwrap();
                m
            })
            .collect();
        stream.synchronize().unwrap();
        // warm-up: NCCL channels, ferrovod's response cache for these names
        ferrovod_round(&gpu, &host, &mems, bytes);
        nccl_round(&comm, &stream, &host, &mems, bytes, ReduceOp::Sum);
        let mut fv = Vec::new();
        let mut raw = Vec::new();
        for _ in 0..o.reps {
            fv.push(ferrovod_round(&gpu, &host, &mems, bytes) / iters as f64);
            raw.push(nccl_round(&comm, &stream, &host, &mems, bytes, ReduceOp::Sum) / iters as f64);
        }
        let (fv, raw) = (median(fv), median(raw));
        let gbs = |t: f64| busbw(bytes, t, size);
        if me == 0 {
            println!(
                "  {:>10} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>8.3}",
                bytes,
                iters,
                fv * 1e6,
                gbs(fv),
                raw * 1e6,
                gbs(raw),
                gbs(fv) / gbs(raw)
            );
            println!(
                "JSON {{\"kind\":\"sweep\",\"np\":{size},\"bytes\":{bytes},\"ferrovod_s\":{fv},\"nccl_s\":{raw}}}"
            );
        }
        if bytes == SINGLE_BYTES {
            single(&gpu, &host, &comm, &stream, &mems[0], o.reps, me, size);
        }
        bytes *= 2;
    }
    if !grads.is_empty() {
        // a second communicator, for the floors with two lanes
        let second = o.floors.then(|| {
            let id = if me == 0 {
                nccl::unique_id().unwrap()
            } else {
                Vec::new()
            };
            let id = host.broadcast_bytes(id, 0).unwrap();
            NcclComm::new(&gpu, &id, me, size).unwrap()
        });
        let mut comms = vec![&comm];
        comms.extend(second.as_ref());
        resnet(&gpu, &host, &comms, &stream, grads, o, me, size);
    }
    let h = rt.enqueue(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    h.wait(None).unwrap();
    runtime::shutdown();
}

/// The size whose single-tensor figure the sweep adds.
const SINGLE_BYTES: usize = 256 << 20;

/// One tensor at a time: each allreduce submitted, then waited for, before the next (nothing
/// for ferrovod to fuse or to overlap on its second stream), against one raw NCCL allreduce
/// then a synchronize; seconds per allreduce, median of `reps` rounds of `iters_for` each,
/// each round timed from one barrier.
#[allow(clippy::too_many_arguments)]
fn single(
    gpu: &Gpu,
    host: &MpiComm,
    comm: &NcclComm,
    stream: &Stream,
    mem: &DeviceMem,
    reps: usize,
    me: usize,
    size: usize,
) {
    let bytes = SINGLE_BYTES;
    let iters = iters_for(bytes);
    let fv_round = || {
        host.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            wait_all(vec![submit(gpu, "single", mem, bytes, ReduceOp::Sum)]);
        }
        t.elapsed().as_secs_f64() / iters as f64
    };
    let raw_round = || {
        host.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            comm.allreduce(
                mem.range(),
                mem.range(),
                bytes / 4,
                DataType::F32,
                ReduceOp::Sum,
                stream,
            )
            .unwrap();
            stream.synchronize().unwrap();
        }
        t.elapsed().as_secs_f64() / iters as f64
    };
    fv_round();
    raw_round();
    let (mut fv, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        fv.push(fv_round());
        raw.push(raw_round());
    }
    let (fv, raw) = (median(fv), median(raw));
    if me == 0 {
        let gbs = |t: f64| busbw(bytes, t, size);
        println!(
            "# one tensor at a time, {bytes} bytes: ferrovod {:.1} us ({:.1} GiB/s busbw), NCCL {:.1} us ({:.1} GiB/s), ratio {:.3}",
            fv * 1e6,
            gbs(fv),
            raw * 1e6,
            gbs(raw),
            gbs(fv) / gbs(raw)
        );
        println!(
            "JSON {{\"kind\":\"single\",\"np\":{size},\"bytes\":{bytes},\"ferrovod_s\":{fv},\"nccl_s\":{raw}}}"
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn resnet(
    gpu: &Gpu,
    host: &MpiComm,
    comms: &[&NcclComm],
    stream: &Stream,
    grads: &[(String, usize)],
    o: &Options,
    me: usize,
    size: usize,
) {
    let mems: Vec<(String, DeviceMem, usize)> = grads
        .iter()
        .map(|(n, elems)| {
            let m = gpu.alloc(elems * 4).unwrap();
            gpu.memset_zero(stream, m.range()).unwrap();
            (n.clone(), m, elems * 4)
        })
        .collect();
    let total: usize = mems.iter().map(|(_, _, b)| b).sum();
    let flat = gpu.alloc(total).unwrap();
    gpu.memset_zero(stream, flat.range()).unwrap();
    stream.synchronize().unwrap();
    // each enqueue's own time, over the measured steps (ns)
    let each = std::cell::RefCell::new(Vec::new());
    // (when it started, whole step and submitting alone in seconds)
    let step = || {
        host.barrier().unwrap();
        let t = Instant::now();
        // gradients become ready in reverse registration order
        let hs: Vec<_> = mems
            .iter()
            .rev()
            .map(|(n, m, b)| {
                let t = Instant::now();
                let h = submit(gpu, n, m, *b, ReduceOp::Average);
                each.borrow_mut().push(t.elapsed().as_nanos() as u64);
                h
            })
            .collect();
        let submitted = t.elapsed().as_secs_f64();
        wait_all(hs);
        (t, t.elapsed().as_secs_f64(), submitted)
    };
    let reps = o.reps.max(10);
    let comm = comms[0];
    let one_allreduce = || {
        nccl_round(
            comm,
            stream,
            host,
            std::slice::from_ref(&flat),
            total,
            ReduceOp::Average,
        )
    };
    // warm-up: buckets are learned in FERROVOD_PLAN_WARMUP_STEPS (5) steps, and a bucket is
    // replayed from a CUDA graph from its third launch on
    for _ in 0..10 {
        step();
        one_allreduce();
    }
    each.borrow_mut().clear();
    let mut fv = Vec::new();
    let mut sub = Vec::new();
    let mut one = Vec::new();
    let before = runtime::runtime().unwrap().metrics.snapshot();
    for _ in 0..reps {
        let (_, t, s) = step();
        fv.push(t);
        sub.push(s);
        one.push(one_allreduce());
    }
    let after = runtime::runtime().unwrap().metrics.snapshot();
    let (fv, one, sub) = (median(fv), median(one), median(sub));
    let enqueues = each.take();
    // inside three more steps: when the runtime's stages happened (us from the first submit)
    let mut inside = Vec::new();
    for _ in 0..3 {
        ferrovod::probe::take();
        ferrovod::probe::set_enabled(true);
        let (t, done, submitted) = step();
        ferrovod::probe::set_enabled(false);
        let marks: Vec<String> = ferrovod::probe::take()
            .iter()
            .map(|m| {
                let us = m.at.saturating_duration_since(t).as_secs_f64() * 1e6;
                format!("{} {} @{us:.0}", m.what, m.tensors)
            })
            .collect();
        inside.push(format!(
            "submitted @{:.0}, {}, all done @{:.0}",
            submitted * 1e6,
            marks.join(", "),
            done * 1e6
        ));
    }
    let gossip = gossip_steps(gpu, host, comm, stream, &mems, &flat, reps, me, size);
    let per_step = |a: u64, b: u64| (a - b) as f64 / reps as f64;
    if o.floors && me == 0 {
        submit_anatomy(gpu, &mems);
    }
    let floors = if o.floors {
        engine_floors(gpu, host, comms, &mems, &flat, reps)
    } else {
        Vec::new()
    };
    // every rank's view of the probed steps, rank by rank
    for r in 0..size {
        host.barrier().unwrap();
        if me == r {
            for line in &inside {
                println!("# resnet50 step inside rank {r} (us): {line}");
            }
        }
    }
    if me == 0 {
        let mut e = enqueues;
        e.sort_unstable();
        let q = |f: f64| e[((e.len() - 1) as f64 * f) as usize] as f64 / 1e3;
        println!(
            "# resnet50 enqueue (us each): median {:.2}, p90 {:.2}, p99 {:.2}, max {:.1}, sum/step {:.1}",
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0),
            e.iter().sum::<u64>() as f64 / 1e3 / reps as f64
        );
        for (what, t) in &floors {
            println!(
                "# resnet50 floor, {what}: {:.1} us ({:.3} of one allreduce)",
                t * 1e6,
                t / one
            );
        }
        println!(
            "# resnet50 per step: {:.1} negotiation cycles, {:.1} collectives, {:.1} replayed from CUDA graphs",
            per_step(after.cycles, before.cycles),
            per_step(after.data_collectives, before.data_collectives),
            per_step(after.graph_launches, before.graph_launches)
        );
        println!(
            "# resnet50: {} tensors, {} bytes: ferrovod {:.1} us (submitting {:.1} us), one NCCL allreduce {:.1} us, ratio {:.3}",
            mems.len(),
            total,
            fv * 1e6,
            sub * 1e6,
            one * 1e6,
            fv / one
        );
        println!(
            "JSON {{\"kind\":\"resnet50\",\"np\":{size},\"tensors\":{},\"bytes\":{total},\"ferrovod_s\":{fv},\"nccl_s\":{one}}}",
            mems.len()
        );
        match gossip {
            (g, None) => println!(
                "# resnet50 gossip, one rank: ferrovod {:.1} us; gossip/allreduce (ferrovod) {:.3}",
                g * 1e6,
                g / fv
            ),
            (g, Some(raw)) => {
                println!(
                    "# resnet50 gossip: ferrovod {:.1} us, one NCCL send/recv of the flat set with the peer {:.1} us, ratio {:.3}; gossip/allreduce (ferrovod) {:.3}",
                    g * 1e6,
                    raw * 1e6,
                    g / raw,
                    g / fv
                );
                println!(
                    "JSON {{\"kind\":\"resnet50_gossip\",\"np\":{size},\"ferrovod_s\":{g},\"nccl_sendrecv_s\":{raw},\"ferrovod_allreduce_s\":{fv}}}"
                );
            }
        }
    }
}

/// The gradient set gossiped (every tensor an `OpKind::Gossip`, in backward order) against
/// one NCCL send/recv of the same bytes with the round-0 peer: median seconds per step of
/// each. Rounds that are exact averages (`FERROVOD_GOSSIP_SYNC_EVERY`) fall in the median only
/// if most are. With one rank there is no peer and no send/recv: the gossip step alone (the
/// host's part of it, against the allreduce step's).
#[allow(clippy::too_many_arguments)]
fn gossip_steps(
    gpu: &Gpu,
    host: &MpiComm,
    comm: &NcclComm,
    stream: &Stream,
    mems: &[(String, DeviceMem, usize)],
    flat: &DeviceMem,
    reps: usize,
    me: usize,
    size: usize,
) -> (f64, Option<f64>) {
    let peer = ferrovod::collective::gossip::peer(me, size, 0);
    let alone = peer == me;
    let total: usize = mems.iter().map(|(_, _, b)| b).sum();
    let theirs = gpu.alloc(total).unwrap();
    let step = || {
        host.barrier().unwrap();
        let t = Instant::now();
        let hs: Vec<_> = (mems.iter().rev())
            .map(|(n, m, b)| {
                let name = format!("gossip.{n}");
                submit_kind(gpu, OpKind::Gossip, &name, m, *b, ReduceOp::Sum)
            })
            .collect();
        wait_all(hs);
        t.elapsed().as_secs_f64()
    };
    let raw = || {
        host.barrier().unwrap();
        let t = Instant::now();
        let (mine, recv) = (flat.range().first(total).unwrap(), theirs.range());
        comm.sendrecv(mine, peer, recv, peer, stream).unwrap();
        stream.synchronize().unwrap();
        t.elapsed().as_secs_f64()
    };
    for _ in 0..5 {
        step();
        if !alone {
            raw();
        }
    }
    let (mut g, mut r) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        g.push(step());
        if !alone {
            r.push(raw());
        }
    }
    (median(g), (!alone).then(|| median(r)))
}

/// The same gradients through NCCL alone, no ferrovod: how close any engine can come to one
/// allreduce (the bench's floors). Each: median seconds per step.
fn engine_floors(
    gpu: &Gpu,
    host: &MpiComm,
    comms: &[&NcclComm],
    mems: &[(String, DeviceMem, usize)],
    flat: &DeviceMem,
    reps: usize,
) -> Vec<(String, f64)> {
    let tensors: Vec<(DeviceRange, DeviceRange, usize)> = mems
        .iter()
        .rev()
        .map(|(_, m, b)| (m.range(), m.range(), b / 4))
        .collect();
    let whole = flat.range();
    let streams: Vec<Stream> = (0..comms.len())
        .map(|_| gpu.new_stream().unwrap())
        .collect();
    let urgent = gpu.new_priority_stream().unwrap();
    let (packer, unpacker) = (gpu.new_stream().unwrap(), gpu.new_stream().unwrap());
    let stream = &streams[0];
    let joined = gpu.new_event().unwrap();
    // runs `f`, then waits for every stream it used; the median time with the GPU work, or
    // (`host_only`) of the host's enqueueing alone
    let measure = |f: &dyn Fn(), host_only: bool| {
        let mut v = Vec::new();
        for i in 0..reps + 3 {
            host.barrier().unwrap();
            let t = Instant::now();
            f();
            let enqueued = t.elapsed().as_secs_f64();
            for s in streams.iter().chain([&urgent, &packer, &unpacker]) {
                s.synchronize().unwrap();
            }
            if i >= 3 {
                v.push(match host_only {
                    true => enqueued,
                    false => t.elapsed().as_secs_f64(),
                });
            }
        }
        median(v)
    };
    let time = |f: &dyn Fn()| measure(f, false);
    let avg = ReduceOp::Average;
    let f32 = DataType::F32;
    let mut out = Vec::new();
    out.push((
        "one NCCL group of 161 allreduces (no copies)".to_string(),
        time(&|| comms[0].allreduce_many(&tensors, f32, avg, stream).unwrap()),
    ));
    if comms.len() > 1 {
        let half = flat.len() / 8 * 4;
        out.push((
            "two communicators at once, half the flat buffer each (no copies)".to_string(),
            time(&|| {
                let first = whole.first(half).unwrap();
                comms[0]
                    .allreduce(first, first, half / 4, f32, avg, &streams[0])
                    .unwrap();
                let rest = whole.sub(half, flat.len() - half).unwrap();
                comms[1]
                    .allreduce(rest, rest, rest.len() / 4, f32, avg, &streams[1])
                    .unwrap();
            }),
        ));
    }
    // fusion-buffer layout of the gradients in backward order: each tensor, its place
    let mut off = 0;
    let mut places: Vec<(DeviceRange, DeviceRange)> = Vec::new();
    let (mut cin, mut cout) = (Vec::new(), Vec::new());
    for (p, _, n) in &tensors {
        let len = n * 4;
        let at = whole.sub(off, len).unwrap();
        cin.push(cuda::Copy::new(*p, at, len).unwrap());
        cout.push(cuda::Copy::new(at, *p, len).unwrap());
        places.push((*p, at));
        off += len;
    }
    // the flat buffer's bytes from tensor i's place on, `bytes` long
    let region = |i: usize, bytes: usize| {
        let start = places[i].1.ptr() - whole.ptr();
        whole.sub(start as usize, bytes).unwrap()
    };
    out.push((
        "pack alone".to_string(),
        time(&|| gpu.copy_batch(stream, &cin).unwrap()),
    ));
    // the runtime's rule for GPU buckets
    let sizes: Vec<usize> = places.iter().map(|(t, _)| t.len()).collect();
    let buckets = |limit: usize| ferrovod::negotiate::plan::bucket_ranges(&sizes, limit);
    let reduce = |r: &std::ops::Range<usize>, comm: &NcclComm, s: &Stream| {
        let n: usize = sizes[r.clone()].iter().sum();
        let lo = region(r.start, n);
        comm.allreduce(lo, lo, n / 4, f32, avg, s).unwrap();
    };
    // ferrovod's lanes: bucket k packs, reduces and unpacks on lane k % lanes
    for lanes in 1..=comms.len() {
        for limit in [16usize << 20, 32 << 20, 64 << 20, 128 << 20] {
            let groups = buckets(limit);
            out.push((
                format!(
                    "{} buckets of <= {} MiB, pack+allreduce+unpack on {lanes} lane(s)",
                    groups.len(),
                    limit >> 20
                ),
                time(&|| {
                    for (k, r) in groups.iter().enumerate() {
                        let s = &streams[k % lanes];
                        gpu.copy_batch(s, &cin[r.clone()]).unwrap();
                        reduce(r, comms[k % lanes], s);
                        gpu.copy_batch(s, &cout[r.clone()]).unwrap();
                    }
                }),
            ));
        }
    }
    // host time to enqueue the runtime's launch of the last 64 MiB bucket, part by part
    let host_only = |f: &dyn Fn()| measure(f, true);
    if let Some(last) = buckets(64 << 20).last().cloned() {
        let big = ferrovod::collective::device::gpu_in_place_bytes();
        let small_at: Vec<usize> = last.clone().filter(|i| sizes[*i] < big).collect();
        let small: Vec<cuda::Copy> = small_at.iter().map(|i| cin[*i]).collect();
        let mut calls: Vec<(DeviceRange, DeviceRange, usize)> = last
            .clone()
            .filter(|i| sizes[*i] >= big)
            .map(|i| (places[i].0, places[i].0, sizes[i] / 4))
            .collect();
        let n: usize = small_at.iter().map(|i| sizes[*i]).sum();
        let fused = region(small_at[0], n);
        calls.push((fused, fused, n / 4));
        let what = format!("host enqueue, last bucket ({} tensors): ", last.len());
        for (part, f) in [
            (
                format!("copy_batch of its {} small tensors", small.len()),
                &(|| gpu.copy_batch(stream, &small).unwrap()) as &dyn Fn(),
            ),
            (format!("NCCL group of {} allreduces", calls.len()), &|| {
                comms[0].allreduce_many(&calls, f32, avg, stream).unwrap()
            }),
            ("one NCCL allreduce of the fused part".to_string(), &|| {
                let (p, _, n) = calls[calls.len() - 1];
                comms[0].allreduce(p, p, n, f32, avg, stream).unwrap()
            }),
            ("cuEventCreate + record".to_string(), &|| {
                let e = gpu.new_event().unwrap();
                e.record(stream).unwrap();
            }),
        ] {
            out.push((format!("{what}{part}"), host_only(f)));
        }
    }
    // a bucket's NCCL calls: members of >= `big` bytes in place, the rest packed (`half`: every
    // other in-place call by bytes, the packed rest with the first half)
    let launch = |r: &std::ops::Range<usize>,
                  big: usize,
                  half: Option<bool>,
                  comm: &NcclComm,
                  s: &Stream| {
        let (mut inplace, mut small) = (Vec::new(), Vec::new());
        let (mut a, mut b) = (0usize, 0usize);
        for i in r.clone() {
            let len = sizes[i];
            if len < big {
                small.push(i);
                continue;
            }
            let first = a <= b;
            *(if first { &mut a } else { &mut b }) += len;
            if half.is_none_or(|h| h == first) {
                inplace.push((places[i].0, places[i].0, len / 4));
            }
        }
        let packed: Vec<_> = small.iter().map(|i| cin[*i]).collect();
        let lo = small.first().copied().filter(|_| half != Some(false));
        if let Some(lo) = lo {
            let n: usize = small.iter().map(|i| sizes[*i]).sum();
            gpu.copy_batch(s, &packed).unwrap();
            let fused = region(lo, n);
            inplace.push((fused, fused, n / 4));
        }
        comm.allreduce_many(&inplace, f32, avg, s).unwrap();
        if lo.is_some() {
            let back: Vec<_> = small.iter().map(|i| cout[*i]).collect();
            gpu.copy_batch(s, &back).unwrap();
        }
    };
    // zero-copy for large gradients: tensors of >= `big` bytes are reduced where they are (one
    // NCCL group per bucket), only the small rest is packed
    for lanes in 1..=comms.len() {
        for big in [256usize << 10, 1 << 20, 4 << 20] {
            for limit in [16usize << 20, 32 << 20, 64 << 20] {
                let groups = buckets(limit);
                out.push((
                    format!(
                        "{} buckets of <= {} MiB, >= {} KiB in place, rest packed, {lanes} lane(s)",
                        groups.len(),
                        limit >> 20,
                        big >> 10
                    ),
                    time(&|| {
                        for (k, r) in groups.iter().enumerate() {
                            launch(r, big, None, comms[k % lanes], &streams[k % lanes]);
                        }
                    }),
                ));
            }
        }
    }
    // the runtime's launches of 48 MiB buckets (>= 1 MiB in place) replayed as CUDA graphs,
    // whole or each split over both communicators
    let big = ferrovod::collective::device::gpu_in_place_bytes();
    let groups = buckets(48 << 20);
    if comms.len() > 1 {
        let whole: Vec<cuda::GraphExec> = groups
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let s = &streams[k % 2];
                s.capture(|| {
                    launch(r, big, None, comms[k % 2], s);
                    Ok(())
                })
                .unwrap()
            })
            .collect();
        let split: Vec<(usize, cuda::GraphExec)> = groups
            .iter()
            .flat_map(|r| [(r, true), (r, false)])
            .map(|(r, h)| {
                let k = usize::from(!h);
                let s = &streams[k];
                let g = s.capture(|| {
                    launch(r, big, Some(h), comms[k], s);
                    Ok(())
                });
                (k, g.unwrap())
            })
            .collect();
        let first = &groups[0];
        let what = format!("host enqueue, first bucket ({} tensors): ", first.len());
        for (part, f) in [
            (
                "copies and NCCL group".to_string(),
                &(|| launch(first, big, None, comms[0], stream)) as &dyn Fn(),
            ),
            ("one CUDA graph of them".to_string(), &|| {
                whole[0].launch(stream).unwrap()
            }),
        ] {
            out.push((format!("{what}{part}"), host_only(f)));
        }
        out.push((
            format!(
                "{} buckets of <= 48 MiB, >= 1 MiB in place, 2 lanes, each bucket one CUDA graph",
                groups.len()
            ),
            time(&|| {
                for (k, g) in whole.iter().enumerate() {
                    g.launch(&streams[k % 2]).unwrap();
                }
            }),
        ));
        out.push((
            format!(
                "{} buckets of <= 48 MiB, >= 1 MiB in place, each split over both communicators, one CUDA graph per half",
                groups.len()
            ),
            time(&|| {
                for (k, g) in &split {
                    g.launch(&streams[*k]).unwrap();
                }
            }),
        ));
    }
    // a pipeline: packing and unpacking on their own streams, NCCL on a high-priority one
    for limit in [8usize << 20, 16 << 20, 32 << 20] {
        let groups = buckets(limit);
        let packed: Vec<_> = groups.iter().map(|_| gpu.new_event().unwrap()).collect();
        let reduced: Vec<_> = groups.iter().map(|_| gpu.new_event().unwrap()).collect();
        out.push((
            format!(
                "{} buckets of <= {} MiB, pack / allreduce (priority stream) / unpack pipelined",
                groups.len(),
                limit >> 20
            ),
            time(&|| {
                packer.wait(&joined).unwrap();
                for (k, r) in groups.iter().enumerate() {
                    gpu.copy_batch(&packer, &cin[r.clone()]).unwrap();
                    packed[k].record(&packer).unwrap();
                }
                for (k, r) in groups.iter().enumerate() {
                    urgent.wait(&packed[k]).unwrap();
                    reduce(r, comms[0], &urgent);
                    reduced[k].record(&urgent).unwrap();
                    unpacker.wait(&reduced[k]).unwrap();
                    gpu.copy_batch(&unpacker, &cout[r.clone()]).unwrap();
                }
                joined.record(&unpacker).unwrap();
            }),
        ));
    }
    out
}

/// What one enqueue is made of on this machine: per-call costs of the primitives it uses, and
/// of whole enqueues of host and of GPU tensors (rank 0 only, nothing negotiated).
fn submit_anatomy(gpu: &Gpu, mems: &[(String, DeviceMem, usize)]) {
    let per = |n: usize, f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        t.elapsed().as_secs_f64() * 1e9 / n as f64
    };
    let n = 20000;
    let clock = per(n, &mut || {
        std::hint::black_box(Instant::now());
    });
    let m = std::sync::Mutex::new(0u64);
    let lock = per(n, &mut || *m.lock().unwrap() += 1);
    let open = per(n, &mut || {
        std::hint::black_box(cuda::gpu(gpu.ordinal).unwrap());
    });
    let (tx, rx) = crossbeam::channel::unbounded::<u64>();
    let parked = std::thread::spawn(move || while rx.recv().is_ok() {});
    let wake = per(2000, &mut || {
        tx.send(1).unwrap();
        std::thread::sleep(std::time::Duration::from_micros(50));
    }) - per(2000, &mut || {
        std::thread::sleep(std::time::Duration::from_micros(50))
    });
    drop(tx);
    parked.join().unwrap();
    let names: Vec<String> = (0..mems.len()).map(|i| format!("anatomy.{i}")).collect();
    let alloc = per(n, &mut || {
        std::hint::black_box(names[7].clone());
    });
    println!(
        "# submit anatomy (ns per call): clock {clock:.0}, uncontended mutex {lock:.0}, \
         cuda::gpu {open:.0}, channel send to a sleeping thread {wake:.0}, string clone {alloc:.0}"
    );
    let clocksource =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .unwrap_or_default();
    println!("# clocksource: {}", clocksource.trim());
}
