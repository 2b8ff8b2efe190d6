//! `ferrovod-bench gpu`: ferrovod's allreduce of GPU tensors against NCCL underneath, in one
//! process. Sweep (nccl-tests form): `iters` in-place f32 sums of one buffer, submitted back to
//! back and waited for together, against the same number of raw `ncclAllReduce` calls on one
//! stream. ResNet-50: the gradient set (one device buffer per tensor, submitted in backward
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
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn iters_for(bytes: usize) -> usize {
    (1usize << 30).div_ceil(bytes).clamp(10, 50)
}

fn submit(gpu: &Gpu, name: &str, mem: &DeviceMem, len: usize, op: ReduceOp) -> Arc<Handle> {
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![TensorSpec {
            name: name.to_string(),
            dtype: DataType::F32,
            shape: vec![(len / 4) as i64],
            input: InputMem::Device(DeviceRange {
                ptr: mem.ptr(),
                len,
            }),
            output: OutputMem::InPlace,
            splits: None,
        }],
    );
    spec.reduce_op = op;
    spec.device = gpu.ordinal;
    runtime::runtime().unwrap().enqueue(spec).unwrap()
}

/// Waits until every operation's GPU work has finished: for the handles, then for their
/// completion events (already fired by default; with `HOROVOD_ENABLE_ASYNC_COMPLETION=1` the
/// handles complete at enqueue and the events are what a GPU consumer would wait for).
fn wait_all(hs: Vec<Arc<Handle>>) {
    let rt = runtime::runtime().unwrap();
    let mut events: Vec<Arc<cuda::Event>> = Vec::new();
    for h in hs {
        h.wait(None).unwrap();
        if let Some(ev) = h.event()
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

/// Seconds for `iters` ferrovod allreduces of `len` bytes of `mem`, submitted together.
fn ferrovod_round(gpu: &Gpu, host: &MpiComm, mem: &DeviceMem, len: usize, iters: usize) -> f64 {
    host.barrier().unwrap();
    let t = Instant::now();
    let hs: Vec<_> = (0..iters)
        .map(|i| submit(gpu, &format!("sweep.{len}.{i}"), mem, len, ReduceOp::Sum))
        .collect();
    wait_all(hs);
    t.elapsed().as_secs_f64()
}

/// Seconds for `iters` raw NCCL allreduces of `len` bytes, back to back on one stream.
fn nccl_round(
    comm: &NcclComm,
    stream: &Stream,
    host: &MpiComm,
    mem: &DeviceMem,
    len: usize,
    iters: usize,
    op: ReduceOp,
) -> f64 {
    host.barrier().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        comm.allreduce(mem.ptr(), mem.ptr(), len / 4, DataType::F32, op, stream)
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
    let host = MpiComm::world().unwrap();
    let id = if me == 0 {
        nccl::unique_id().unwrap()
    } else {
        Vec::new()
    };
    let id = host.broadcast_bytes(id, 0).unwrap();
    let comm = NcclComm::new(&gpu, &id, me, size).unwrap();
    let stream = gpu.new_stream().unwrap();
    let bus = 2.0 * (size as f64 - 1.0) / size as f64;
    let mem = gpu.alloc(o.max_bytes).unwrap();
    gpu.memset_zero(&stream, mem.ptr(), o.max_bytes).unwrap();
    stream.synchronize().unwrap();
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
        // warm-up: NCCL channels, ferrovod's response cache for these names
        ferrovod_round(&gpu, &host, &mem, bytes, iters);
        nccl_round(&comm, &stream, &host, &mem, bytes, iters, ReduceOp::Sum);
        let mut fv = Vec::new();
        let mut raw = Vec::new();
        for _ in 0..o.reps {
            fv.push(ferrovod_round(&gpu, &host, &mem, bytes, iters) / iters as f64);
            raw.push(
                nccl_round(&comm, &stream, &host, &mem, bytes, iters, ReduceOp::Sum) / iters as f64,
            );
        }
        let (fv, raw) = (median(fv), median(raw));
        let gbs = |t: f64| bytes as f64 / t / (1u64 << 30) as f64 * bus;
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
        bytes *= 2;
    }
    drop(mem);
    if !grads.is_empty() {
        resnet(&gpu, &host, &comm, &stream, grads, o.reps.max(10), me, size);
    }
    let h = rt.enqueue(OpSpec::new(OpKind::Barrier, vec![])).unwrap();
    h.wait(None).unwrap();
    runtime::shutdown();
}

#[allow(clippy::too_many_arguments)]
fn resnet(
    gpu: &Gpu,
    host: &MpiComm,
    comm: &NcclComm,
    stream: &Stream,
    grads: &[(String, usize)],
    reps: usize,
    me: usize,
    size: usize,
) {
    let mems: Vec<(String, DeviceMem, usize)> = grads
        .iter()
        .map(|(n, elems)| {
            let m = gpu.alloc(elems * 4).unwrap();
            gpu.memset_zero(stream, m.ptr(), elems * 4).unwrap();
            (n.clone(), m, elems * 4)
        })
        .collect();
    let total: usize = mems.iter().map(|(_, _, b)| b).sum();
    let flat = gpu.alloc(total).unwrap();
    gpu.memset_zero(stream, flat.ptr(), total).unwrap();
    stream.synchronize().unwrap();
    // (whole step, submitting alone) in seconds
    let step = || {
        host.barrier().unwrap();
        let t = Instant::now();
        // gradients become ready in reverse registration order
        let hs: Vec<_> = mems
            .iter()
            .rev()
            .map(|(n, m, b)| submit(gpu, n, m, *b, ReduceOp::Average))
            .collect();
        let submitted = t.elapsed().as_secs_f64();
        wait_all(hs);
        (t.elapsed().as_secs_f64(), submitted)
    };
    let one_allreduce = || nccl_round(comm, stream, host, &flat, total, 1, ReduceOp::Average);
    for _ in 0..5 {
        step();
        one_allreduce();
    }
    let mut fv = Vec::new();
    let mut sub = Vec::new();
    let mut one = Vec::new();
    let before = runtime::runtime().unwrap().metrics.snapshot();
    for _ in 0..reps {
        let (t, s) = step();
        fv.push(t);
        sub.push(s);
        one.push(one_allreduce());
    }
    let (fv, one, sub) = (median(fv), median(one), median(sub));
    let after = runtime::runtime().unwrap().metrics.snapshot();
    let per_step = |a: u64, b: u64| (a - b) as f64 / reps as f64;
    if me == 0 {
        println!(
            "# resnet50 per step: {:.1} negotiation cycles, {:.1} collectives",
            per_step(after.cycles, before.cycles),
            per_step(after.data_collectives, before.data_collectives)
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
    }
}
