//! GPU scenarios (NCCL; with FERROVOD_TEST_GPU=1 on a GPU machine): device memory, streams,
//! CUDA-graph replay, the NVRTC kernels and GPU failures, plus the helpers that put tensors on
//! this rank's GPU.

use super::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferrovod::Error;
use ferrovod::collective::kernels;
use ferrovod::runtime::entry::{InputMem, OutputAllocator, OutputMem};
use ferrovod::runtime::handle::{Handle, HandleId, TensorResult};
use ferrovod::runtime::{self, OpSpec};
use ferrovod::transport::cuda::{self, DeviceMem, Gpu};
use ferrovod::transport::memory::HostBuffer;

/// This rank's GPU: local rank modulo the GPUs present.
pub fn this_gpu() -> Arc<Gpu> {
    let local = runtime::runtime().unwrap().topology().local_rank as usize;
    let n = cuda::device_count().unwrap().max(1);
    cuda::gpu((local % n) as i32).expect("open GPU")
}

struct Alloc {
    gpu: Arc<Gpu>,
    mems: HashMap<usize, DeviceMem>,
}

impl OutputAllocator for Alloc {
    fn allocate(
        &mut self,
        index: usize,
        _shape: &[i64],
        bytes: usize,
    ) -> ferrovod::error::Result<HostBuffer> {
        let m = self.gpu.alloc(bytes)?;
        // SAFETY: the allocation lives in `mems` until the test has read the result back.
        let buf = unsafe { HostBuffer::from_raw(m.ptr() as usize as *mut u8, bytes) };
        self.mems.insert(index, m);
        Ok(buf)
    }
}

/// The device memory of one submitted operation.
pub struct Op {
    gpu: Arc<Gpu>,
    inputs: Vec<DeviceMem>,
    outputs: Vec<Option<DeviceMem>>,
    alloc: Option<Arc<Mutex<Alloc>>>,
}

static OPS: Mutex<Option<HashMap<HandleId, Op>>> = Mutex::new(None);

/// Moves the spec's host tensors to this rank's GPU and submits it as a GPU operation.
pub fn submit(mut spec: OpSpec) -> Result<Arc<Handle>, Error> {
    let gpu = this_gpu();
    spec.device = gpu.ordinal;
    if spec.tensors.is_empty() {
        // barrier, join: no memory
        return runtime::runtime()?.enqueue(spec);
    }
    let stream = gpu.new_stream()?;
    let mut op = Op {
        gpu: gpu.clone(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        alloc: None,
    };
    let mut later = false;
    for t in &mut spec.tensors {
        let InputMem::Owned(bytes) = &t.input else {
            panic!("GPU mode takes host tensors built by the scenario")
        };
        let m = gpu.alloc(bytes.len())?;
        gpu.upload(&stream, bytes, m.range())?;
        t.input = InputMem::Device(m.range().first(bytes.len()).expect("allocated for it"));
        op.inputs.push(m);
        let out = match &t.output {
            OutputMem::Owned(v) => {
                let o = gpu.alloc(v.len())?;
                t.output = OutputMem::Device(o.range().first(v.len()).expect("allocated for it"));
                Some(o)
            }
            OutputMem::Later => {
                later = true;
                None
            }
            _ => None,
        };
        op.outputs.push(out);
    }
    if later {
        let a = Arc::new(Mutex::new(Alloc {
            gpu: gpu.clone(),
            mems: HashMap::new(),
        }));
        spec.allocator = Some(a.clone());
        op.alloc = Some(a);
    }
    let h = runtime::runtime()?.enqueue(spec)?;
    OPS.lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(h.id, op);
    Ok(h)
}

/// The device memory of a GPU operation (None for host operations).
pub fn take(id: HandleId) -> Option<Op> {
    OPS.lock().unwrap().as_mut().and_then(|m| m.remove(&id))
}

impl Op {
    /// Copies each tensor's result to the host, as the CPU path returns it.
    pub fn download_into(self, h: &Handle, results: &mut [TensorResult]) {
        // with asynchronous completion the handle completes before the GPU work: a host
        // consumer waits for the handle's event first
        if let Some(ev) = h.event() {
            ev.synchronize().unwrap();
        }
        let stream = self.gpu.new_stream().unwrap();
        let alloc = self.alloc.as_ref().map(|a| a.lock().unwrap());
        for (i, r) in results.iter_mut().enumerate() {
            let mem = alloc
                .as_ref()
                .and_then(|a| a.mems.get(&i))
                .or(self.outputs.get(i).and_then(|o| o.as_ref()))
                .or(self.inputs.get(i))
                .expect("tensor memory");
            let mut bytes = vec![0u8; mem.len()];
            self.gpu.download(&stream, mem.range(), &mut bytes).unwrap();
            r.output = Some(bytes);
        }
    }
}

/// A rank whose GPU batch fails after every rank agreed to run it (here: its fusion buffer
/// cannot grow, its GPU memory being taken; under the u8 codec, whose batches exchange blocks
/// over NCCL send/recv, this rank's alltoall never comes): it aborts its NCCL communicators and shuts the
/// job down; the vote tells the other rank, whose NCCL call waits for it, to abort its own at
/// once rather than after the grace time (4 s here). Both get an error, nobody hangs, later
/// work is refused, and MPI finalizes.
pub(crate) fn gpu_failure() {
    init();
    let me = rank();
    // what is under test is that nothing hangs: fail fast rather than at the harness's limit
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("gpu_failure: rank {me} still running after 60 s");
        std::process::exit(3);
    });
    let n = size();
    // opens the lane (small fusion buffer)
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        (0..2)
            .map(|k| tensor(&format!("warm.{k}"), DataType::F32, &[4], &[1.0; 4], false))
            .collect(),
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F32), &[n as f64; 4], "warm-up");
    // 200 tensors of 512 KiB: fused through a 100 MiB fusion buffer
    let count = 128 << 10;
    let specs: Vec<TensorSpec> = (0..200)
        .map(|k| {
            tensor(
                &format!("big.{k}"),
                DataType::F32,
                &[count as i64],
                &vec![1.0; count],
                false,
            )
        })
        .collect();
    let gpu = gpu::this_gpu();
    // rank 1 leaves less free than the inputs (copied to the GPU at submission) and the
    // fusion buffer need together
    let _hog = (me == 1).then(|| {
        let (free, _) = gpu.memory_info().unwrap();
        gpu.alloc(free - (160 << 20)).unwrap()
    });
    let start = Instant::now();
    let err = run(OpSpec::new(OpKind::Allreduce, specs)).unwrap_err();
    let msg = err.to_string();
    if me == 1 {
        assert!(
            msg.contains("GPU collective failed on this rank")
                && msg.contains("NCCL communicators were aborted"),
            "{msg}"
        );
    } else {
        assert!(
            matches!(err, Error::Aborted(_)) && msg.contains("GPU collective was aborted"),
            "{err:?}"
        );
    }
    // the grace time is the stall shutdown time, 4 s
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    let later = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("later", DataType::F32, &[1], &[1.0], false)],
    ));
    assert!(matches!(later, Err(Error::ShutDown(_))), "{later:?}");
    // MPI's finalize waits for both ranks (rank 0 ends its wait after the grace time)
    runtime::shutdown();
    pass();
}

/// GPU: rank 1 cannot prepare the send/recv connections that the first alltoall needs (test
/// fault `nccl_peers`). The ranks agree on that before NCCL's set-up, so both get the error at
/// once, neither waits in NCCL for the other, and the job goes on: an allreduce (no send/recv)
/// runs after it, and a second alltoall fails the same way rather than hang.
pub(crate) fn gpu_peers_fault() {
    init();
    let n = size();
    let alltoall = |name: &str| {
        let t = tensor(
            name,
            DataType::F32,
            &[n as i64],
            &vec![rank() as f64; n],
            true,
        );
        run(OpSpec::new(OpKind::Alltoall, vec![t]))
    };
    // opens the NCCL streams and communicators (collectives only)
    let res = run(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor("peers.warm", DataType::F32, &[4], &[1.0; 4], false)],
    ))
    .unwrap();
    assert_close(&output(&res[0], DataType::F32), &[n as f64; 4], "warm-up");
    for name in ["peers.a2a.0", "peers.a2a.1"] {
        let start = Instant::now();
        let err = alltoall(name).unwrap_err();
        let msg = err.to_string();
        // the failing rank names its own cause, the other one the agreed failure
        match rank() {
            1 => assert!(msg.contains("test fault: nccl_peers"), "{err:?}"),
            _ => assert!(
                matches!(err, Error::Aborted(_))
                    && msg.contains("send/recv connections could not be set up on every rank"),
                "{err:?}"
            ),
        }
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{name}: took {:?}",
            start.elapsed()
        );
        let res = run(OpSpec::new(
            OpKind::Allreduce,
            vec![tensor(
                &format!("{name}.after"),
                DataType::F32,
                &[4],
                &[1.0; 4],
                false,
            )],
        ))
        .unwrap();
        assert_close(&output(&res[0], DataType::F32), &[n as f64; 4], name);
    }
    runtime::shutdown();
    pass();
}

/// GPU inputs produced asynchronously on the caller's stream (a kernel still running at
/// enqueue): ferrovod's stream must wait for it on the device, through the recorded stream
/// or the caller's event; the handle's event (also through the C API) orders a consumer.
pub(crate) fn gpu_streams() {
    use ferrovod::transport::cuda::{ForeignEvent, ForeignStream};
    init();
    let me = rank();
    let n = size();
    let gpu = gpu::this_gpu();
    let count = 16 << 20; // 64 MiB of f32: the producer kernel is still running at enqueue
    let host = encode(DataType::F32, &vec![(me + 1) as f64; count]);
    let upload = gpu.new_stream().unwrap();
    let producer = gpu.new_stream().unwrap();
    let consumer = gpu.new_stream().unwrap();
    let want = 2.0 * (n * (n + 1) / 2) as f64;
    for (k, by_event) in [false, true, false, true].into_iter().enumerate() {
        let data = gpu.alloc(host.len()).unwrap();
        gpu.upload(&upload, &host, data.range()).unwrap();
        // the producer doubles the values; nothing waits for it on the host
        kernels::scale(
            &gpu,
            &producer,
            data.range(),
            data.range(),
            count,
            DataType::F32,
            2.0,
        )
        .unwrap();
        let name = format!("gpu.stream.{k}");
        let mut spec = OpSpec::new(
            OpKind::Allreduce,
            vec![TensorSpec {
                name: name.clone(),
                dtype: DataType::F32,
                shape: vec![count as i64],
                input: InputMem::Device(data.range().first(host.len()).expect("allocated for it")),
                output: OutputMem::InPlace,
                splits: None,
            }],
        );
        spec.device = gpu.ordinal;
        let ready = gpu.new_event().unwrap();
        if by_event {
            ready.record(&producer).unwrap();
            // SAFETY: a live event of this GPU, kept until the operation completes
            spec.ready_event = Some(unsafe { ForeignEvent::from_raw(ready.raw().cast()) });
        } else {
            // SAFETY: a live stream of this GPU
            spec.ready_stream = Some(unsafe { ForeignStream::from_raw(producer.raw().cast()) });
        }
        let h = runtime::runtime().unwrap().enqueue(spec).unwrap();
        h.wait(Some(Duration::from_secs(120))).unwrap();
        // the C API hands out the same completion event
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        let status = ferrovod::capi::fv_handle_event(h.id, &mut raw);
        assert_eq!(status, ferrovod::error::Status::Ok);
        assert!(!raw.is_null(), "{name}: no completion event");
        assert_eq!(raw, h.event().unwrap().raw().cast());
        // a GPU consumer orders its reads after the event, without a host wait
        // SAFETY: the handle's live event
        consumer
            .wait_foreign(unsafe { ForeignEvent::from_raw(raw) })
            .unwrap();
        let mut got = vec![0u8; host.len()];
        gpu.download(&consumer, data.range(), &mut got).unwrap();
        runtime::runtime().unwrap().handles.release(h.id).unwrap();
        let got = decode(DataType::F32, &got);
        let bad = got.iter().position(|v| *v != want);
        assert!(
            bad.is_none(),
            "{name}: element {bad:?} is {:?}, want {want}",
            bad.map(|i| got[i])
        );
    }
    finish_job();
}

/// Fused GPU allreduces replayed from CUDA graphs: a step of tensors (two large enough to be
/// reduced in place, three packed) repeated with new values, each step checked against the
/// host's sums. One rank moving a tensor to new memory (rank 1 at step 8), then every rank
/// (step 11), must not replay a graph with the old addresses; the batches are replayed again
/// once the tensors stay put.
pub(crate) fn gpu_graphs() {
    graphs_of(OpKind::Allreduce);
}

/// The same steps as gossip inside one node (exact averages, which run the allreduce's
/// launches): replayed alike, each step checked against the host's means.
pub(crate) fn gpu_graphs_gossip() {
    graphs_of(OpKind::Gossip);
}

fn graphs_of(kind: OpKind) {
    init();
    let me = rank();
    let n = size();
    let rt = runtime::runtime().unwrap();
    let gpu = gpu::this_gpu();
    let stream = gpu.new_stream().unwrap();
    let counts = [600_000usize, 300, 1000, 400_000, 7];
    let mut mems: Vec<_> = counts.iter().map(|c| gpu.alloc(c * 4).unwrap()).collect();
    let value =
        |r: usize, step: usize, t: usize, i: usize| ((r + 1) * (step + 1) + t + i % 5) as f64;
    let mut replayed_after_moves = 0;
    for step in 0..20 {
        // the new memory is taken while the old is still held: a new address
        if step == 8 && me == 1 {
            mems[2] = gpu.alloc(counts[2] * 4).unwrap();
        }
        if step == 11 {
            mems[0] = gpu.alloc(counts[0] * 4).unwrap();
        }
        let before = rt.metrics.snapshot().graph_launches;
        for (t, (m, c)) in mems.iter().zip(counts).enumerate() {
            let vals: Vec<f64> = (0..c).map(|i| value(me, step, t, i)).collect();
            gpu.upload(&stream, &encode(DataType::F32, &vals), m.range())
                .unwrap();
        }
        stream.synchronize().unwrap();
        let handles: Vec<_> = mems
            .iter()
            .zip(counts)
            .enumerate()
            .map(|(t, (m, c))| {
                let mut spec = OpSpec::new(
                    kind,
                    vec![TensorSpec {
                        name: format!("graphs.{t}"),
                        dtype: DataType::F32,
                        shape: vec![c as i64],
                        input: InputMem::Device(m.range().first(c * 4).expect("allocated for it")),
                        output: OutputMem::InPlace,
                        splits: None,
                    }],
                );
                spec.device = gpu.ordinal;
                if kind == OpKind::Allreduce {
                    spec.reduce_op = ReduceOp::Sum;
                }
                rt.enqueue(spec).unwrap()
            })
            .collect();
        for h in handles {
            h.wait(Some(Duration::from_secs(60))).unwrap();
            if let Some(ev) = h.event() {
                ev.synchronize().unwrap();
            }
            rt.handles.release(h.id).unwrap();
        }
        if step > 11 {
            replayed_after_moves += rt.metrics.snapshot().graph_launches - before;
        }
        for (t, (m, c)) in mems.iter().zip(counts).enumerate() {
            let mut got = vec![0u8; c * 4];
            gpu.download(&stream, m.range(), &mut got).unwrap();
            let got = decode(DataType::F32, &got);
            for (i, g) in got.iter().enumerate() {
                let sum: f64 = (0..n).map(|r| value(r, step, t, i)).sum();
                if kind == OpKind::Allreduce {
                    assert_eq!(*g, sum, "step {step}, tensor {t}, element {i}");
                } else {
                    let mean = sum / n as f64;
                    assert!(
                        (g - mean).abs() <= 1e-6 * mean,
                        "step {step}, tensor {t}, element {i}: {g} vs the mean {mean}"
                    );
                }
            }
        }
    }
    assert!(
        replayed_after_moves > 0,
        "no batch was replayed from a graph once the tensors stayed put"
    );
    finish_job();
}

/// The NVRTC kernels against host references: casts f32↔f16/bf16 bit for bit against `half`,
/// scaling of every dtype against the host path's scaling, and batched copies of many
/// misaligned ranges.
pub(crate) fn gpu_kernels() {
    use ferrovod::transport::cuda::Copy;
    init();
    let gpu = gpu::this_gpu();
    let s = gpu.new_stream().unwrap();
    let mut rng = Lcg(12345);
    let mut vals: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.0,
        65520.0,
        1e-8,
        6.1e-5,
        3.0e-8,
        1.0 / 3.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e30,
        -1e-30,
        f32::MAX,
        f32::MIN_POSITIVE,
    ];
    for _ in 0..4000 {
        // random bit patterns, NaNs aside
        let v = f32::from_bits(rng.next() as u32 ^ ((rng.next() as u32) << 16));
        if !v.is_nan() {
            vals.push(v);
        }
    }
    let n = vals.len();
    let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let d32 = gpu.alloc(n * 4).unwrap();
    let d16 = gpu.alloc(n * 2).unwrap();
    let back = gpu.alloc(n * 4).unwrap();
    gpu.upload(&s, &src, d32.range()).unwrap();
    for half_type in [DataType::F16, DataType::BF16] {
        kernels::cast(
            &gpu,
            &s,
            d32.range(),
            DataType::F32,
            d16.range(),
            half_type,
            n,
        )
        .unwrap();
        kernels::cast(
            &gpu,
            &s,
            d16.range(),
            half_type,
            back.range(),
            DataType::F32,
            n,
        )
        .unwrap();
        let mut h16 = vec![0u8; n * 2];
        let mut h32 = vec![0u8; n * 4];
        gpu.download(&s, d16.range(), &mut h16).unwrap();
        gpu.download(&s, back.range(), &mut h32).unwrap();
        for (i, v) in vals.iter().enumerate() {
            let got = u16::from_le_bytes([h16[2 * i], h16[2 * i + 1]]);
            let (want, wide) = match half_type {
                DataType::F16 => {
                    let h = half::f16::from_f32(*v);
                    (h.to_bits(), h.to_f32())
                }
                _ => {
                    let h = half::bf16::from_f32(*v);
                    (h.to_bits(), h.to_f32())
                }
            };
            assert_eq!(got, want, "{half_type} cast of {v:e} (element {i})");
            let w = f32::from_le_bytes(h32[4 * i..4 * i + 4].try_into().unwrap());
            assert_eq!(w.to_bits(), wide.to_bits(), "{half_type} widening of {v:e}");
        }
    }
    // scaling: every scalable dtype, against the host path's own scaling; f16 by the factor
    // rounded to f16 first, as Horovod's CUDA kernel multiplies (`kernels::scale`)
    for dtype in DataType::ALL {
        if dtype == DataType::Bool {
            continue;
        }
        let count = 1000;
        let xs: Vec<f64> = (0..count)
            .map(|i| {
                let v = (i % 97) as f64
                    - if dtype.is_float() || !matches!(dtype, DataType::U8 | DataType::U16) {
                        48.0
                    } else {
                        0.0
                    };
                if dtype.is_float() { v * 1.37 } else { v }
            })
            .collect();
        let bytes = encode(dtype, &xs);
        let dev = gpu.alloc(bytes.len()).unwrap();
        let out = gpu.alloc(bytes.len()).unwrap();
        gpu.upload(&s, &bytes, dev.range()).unwrap();
        for factor in [0.37, 2.5, -1.25] {
            if factor < 0.0 && matches!(dtype, DataType::U8 | DataType::U16) {
                continue;
            }
            kernels::scale(&gpu, &s, dev.range(), out.range(), count, dtype, factor).unwrap();
            let mut got = vec![0u8; bytes.len()];
            gpu.download(&s, out.range(), &mut got).unwrap();
            let mut want = bytes.clone();
            let host_factor = match dtype {
                DataType::F16 => half::f16::from_f64(factor).to_f64(),
                _ => factor,
            };
            ferrovod::elementwise::scale(&mut want, dtype, host_factor).unwrap();
            assert_eq!(
                decode(dtype, &got),
                decode(dtype, &want),
                "scale {dtype} by {factor}"
            );
        }
    }
    // the 16-bit codecs' packing and its overflow count (finite scaled values that travel as
    // infinities), against the host's own encoding and count: two spans, one of them inside
    // the other, then 130 spans of the whole (two launches: each launch's counters are its own)
    let xs: Vec<f32> = vec![
        1.0,
        70000.0,
        -70000.0,
        65519.0,
        65520.0,
        f32::INFINITY,
        f32::NAN,
        3.3999e38,
        -3.3999e38,
        1e30,
        0.0,
        -2.5e4,
        1e38,
    ];
    let bytes: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let dev = gpu.alloc(bytes.len()).unwrap();
    gpu.upload(&s, &bytes, dev.range()).unwrap();
    let many = 130;
    let counters = gpu.alloc(4 * many).unwrap();
    let packed = gpu.alloc(2 * xs.len() * many).unwrap();
    let mut seen = 0;
    for wire in [DataType::F16, DataType::BF16] {
        for factor in [1.0, 0.5, 4.0] {
            let host = |from: usize, n: usize| {
                let mut out = vec![0u8; 2 * n];
                let src = &bytes[4 * from..4 * (from + n)];
                let count = ferrovod::elementwise::encode_half(&mut out, src, wire, factor);
                (out, count.unwrap())
            };
            let parts = [(0usize, xs.len()), (1, 3)];
            gpu.memset_zero(&s, counters.range()).unwrap();
            let mut items = Vec::new();
            let mut at = 0;
            for (from, n) in parts {
                let src = dev.range().sub(4 * from, 4 * n).unwrap();
                items.push((src, packed.range().sub(at, 2 * n).unwrap(), n));
                at += 2 * n;
            }
            let counts = Some(counters.range().first(8).unwrap());
            kernels::cast_batch(&gpu, &s, &items, wire, true, factor, counts).unwrap();
            let mut got = vec![0u8; 8];
            gpu.download(&s, counters.range().first(8).unwrap(), &mut got)
                .unwrap();
            let mut got_packed = vec![0u8; at];
            gpu.download(&s, packed.range().first(at).unwrap(), &mut got_packed)
                .unwrap();
            let mut at = 0;
            for (k, (from, n)) in parts.into_iter().enumerate() {
                let (out, want) = host(from, n);
                let count = u32::from_le_bytes(got[4 * k..4 * k + 4].try_into().unwrap());
                assert_eq!(
                    count as usize, want,
                    "{wire} overflow count times {factor}, span {k}"
                );
                // NaN payloads may differ (PTX's cvt gives the canonical NaN)
                let nan = |h: u16| match wire {
                    DataType::F16 => h & 0x7c00 == 0x7c00 && h & 0x03ff != 0,
                    _ => h & 0x7f80 == 0x7f80 && h & 0x007f != 0,
                };
                let halves = |b: &[u8]| -> Vec<Option<u16>> {
                    (b.chunks_exact(2))
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .map(|h| (!nan(h)).then_some(h))
                        .collect()
                };
                assert_eq!(
                    halves(&got_packed[at..at + 2 * n]),
                    halves(&out),
                    "{wire} packing, span {k}"
                );
                at += 2 * n;
                seen += want;
            }
            // 130 spans: counters 128 and 129 belong to the second launch
            gpu.memset_zero(&s, counters.range()).unwrap();
            let items: Vec<_> = (0..many)
                .map(|k| {
                    let dst = packed.range().sub(2 * xs.len() * k, 2 * xs.len()).unwrap();
                    (dev.range(), dst, xs.len())
                })
                .collect();
            let counts = Some(counters.range());
            kernels::cast_batch(&gpu, &s, &items, wire, true, factor, counts).unwrap();
            let mut got = vec![0u8; 4 * many];
            gpu.download(&s, counters.range(), &mut got).unwrap();
            let want = host(0, xs.len()).1 as u32;
            let counts: Vec<u32> = (got.chunks_exact(4))
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(counts, vec![want; many], "{wire} times {factor}, 130 spans");
        }
    }
    assert!(seen > 0, "no value overflowed: the count was never tested");
    // batched copies: 300 ranges (several launches), odd lengths and misaligned offsets, some
    // over several 64 KiB slices
    let len = 8 << 20;
    let host_src: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let dsrc = gpu.alloc(len).unwrap();
    let ddst = gpu.alloc(len).unwrap();
    gpu.upload(&s, &host_src, dsrc.range()).unwrap();
    gpu.memset_zero(&s, ddst.range()).unwrap();
    let mut want = vec![0u8; len];
    let mut copies = Vec::new();
    let mut at = 0usize;
    for k in 0..300 {
        let n = if k % 50 == 0 {
            0
        } else if k % 37 == 0 {
            (rng.next() % (300 << 10)) as usize + (64 << 10)
        } else if k % 41 == 0 {
            128 << 10
        } else {
            (rng.next() % 3000) as usize + (k % 17)
        };
        let mut from = (rng.next() as usize) % (len - n);
        if k % 41 == 0 {
            // both ends 16-byte aligned: the kernel's wide path
            from -= from % 16;
            at = at.next_multiple_of(16);
        }
        if at + n > len {
            break;
        }
        want[at..at + n].copy_from_slice(&host_src[from..from + n]);
        copies.push(
            Copy::new(
                dsrc.range().sub(from, n).unwrap(),
                ddst.range().sub(at, n).unwrap(),
                n,
            )
            .unwrap(),
        );
        at += n + (k % 5);
    }
    gpu.copy_batch(&s, &copies).unwrap();
    let mut got = vec![0u8; len];
    gpu.download(&s, ddst.range(), &mut got).unwrap();
    let bad = got.iter().zip(&want).position(|(g, w)| g != w);
    assert!(bad.is_none(), "batched copy differs at byte {bad:?}");
    finish_job();
}

/// The same ring allreduce on GPU memory (NCCL send/recv, the NVRTC reduction kernel, all on
/// one stream) against the native MPI allreduce of the same values on host memory, byte for
/// byte, every dtype and reduction; and against NCCL's own allreduce where NCCL reduces the
/// dtype.
pub(crate) fn gpu_ring() {
    use ferrovod::collective::ring::{DeviceWorkspace, allreduce, scratch_bytes};
    use ferrovod::transport::mpi::MpiComm;
    use ferrovod::transport::nccl::{self, NcclComm};
    use ferrovod::transport::{DeviceTransport, Transport};

    init();
    let (me, n) = (rank(), size());
    let world = MpiComm::world().unwrap();
    let id = if me == 0 {
        nccl::unique_id().unwrap()
    } else {
        Vec::new()
    };
    let id = world.broadcast_bytes(id, 0).unwrap();
    let gpu = this_gpu();
    let comm = NcclComm::new(&gpu, &id, me, n).unwrap();
    let stream = gpu.new_stream().unwrap();
    for dtype in DataType::ALL {
        for op in REDUCTIONS {
            for elems in ring_lengths(n) {
                let mine: Vec<f64> = (0..elems).map(|i| ring_value(dtype, op, i, me)).collect();
                let host = encode(dtype, &mine);
                let mut native = host.clone();
                world.allreduce(None, &mut native, dtype, op).unwrap();
                let bytes = host.len();
                let data = gpu.alloc(bytes).unwrap();
                let scratch = gpu.alloc(scratch_bytes(elems, dtype.size(), n)).unwrap();
                gpu.upload(&stream, &host, data.range()).unwrap();
                let mut ws = DeviceWorkspace::new(
                    &comm,
                    &gpu,
                    &stream,
                    data.range(),
                    scratch.range(),
                    elems,
                    dtype,
                )
                .unwrap();
                allreduce(&mut ws, elems, dtype, op).unwrap();
                let mut got = vec![0u8; bytes];
                gpu.download(&stream, data.range(), &mut got).unwrap();
                let what = format!("{} {op:?} {elems} elements", dtype.name());
                assert_eq!(got, native, "GPU ring vs MPI: {what}");
                if comm.reduces(dtype) && elems > 0 {
                    let other = gpu.alloc(bytes).unwrap();
                    gpu.upload(&stream, &host, other.range()).unwrap();
                    comm.allreduce(other.range(), other.range(), elems, dtype, op, &stream)
                        .unwrap();
                    let mut by_nccl = vec![0u8; bytes];
                    gpu.download(&stream, other.range(), &mut by_nccl).unwrap();
                    assert_eq!(got, by_nccl, "GPU ring vs NCCL: {what}");
                }
            }
        }
    }
    finish_job();
}

/// GPU allreduces asking for fp16 and bf16: several tensors fused into one 16-bit buffer by a
/// batched cast kernel (and one alone), sums and averages with scales, within the codec's
/// rounding of the f64 reference; 1 + 2^-12 arrives as 1 (it did travel as 16 bits); the wire
/// bytes are counted per codec; an f32 maximum is not compressed.
pub(crate) fn gpu_compressed() {
    init();
    let (me, n) = (rank(), size());
    let gpu = gpu::this_gpu();
    let stream = gpu.new_stream().unwrap();
    let v = |t: usize, i: usize, r: usize| ((i * 7 + t * 3 + r * 5) % 17) as f64 * 0.37 - 2.0;
    let sizes = [1usize, 1000, 33, 70_000];
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    let run_gpu =
        |name: &str, vals: &[Vec<f64>], asks: Compression, op: ReduceOp, pre: f64, post: f64| {
            let mems: Vec<DeviceMem> = vals
                .iter()
                .map(|x| {
                    let host = encode(DataType::F32, x);
                    let m = gpu.alloc(host.len().max(4)).unwrap();
                    gpu.upload(&stream, &host, m.range()).unwrap();
                    m
                })
                .collect();
            stream.synchronize().unwrap();
            let tensors = vals
                .iter()
                .zip(&mems)
                .enumerate()
                .map(|(t, (x, m))| TensorSpec {
                    name: format!("{name}.{t}"),
                    dtype: DataType::F32,
                    shape: vec![x.len() as i64],
                    input: InputMem::Device(m.range().first(x.len() * 4).unwrap()),
                    output: OutputMem::InPlace,
                    splits: None,
                })
                .collect();
            let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
            spec.device = gpu.ordinal;
            spec.reduce_op = op;
            spec.prescale = pre;
            spec.postscale = post;
            spec.compression = Some(asks);
            let h = runtime::runtime().unwrap().enqueue(spec).unwrap();
            h.wait(Some(Duration::from_secs(120))).unwrap();
            runtime::runtime().unwrap().handles.release(h.id).unwrap();
            vals.iter()
                .zip(&mems)
                .map(|(x, m)| {
                    let mut got = vec![0u8; x.len() * 4];
                    gpu.download(&stream, m.range().first(x.len() * 4).unwrap(), &mut got)
                        .unwrap();
                    stream.synchronize().unwrap();
                    decode(DataType::F32, &got)
                })
                .collect::<Vec<_>>()
        };
    for (asks, eps, key) in [
        (Compression::Fp16, 2f64.powi(-11), 0),
        (Compression::Bf16, 2f64.powi(-8), 1),
    ] {
        for (case, (op, pre, post)) in [
            (ReduceOp::Sum, 1.0, 1.0),
            (ReduceOp::Average, 1.0, 1.0),
            (ReduceOp::Average, 2.0, 0.25),
        ]
        .into_iter()
        .enumerate()
        {
            for fused in [true, false] {
                let count = if fused { sizes.len() } else { 1 };
                let vals: Vec<Vec<f64>> = (0..count)
                    .map(|t| (0..sizes[t]).map(|i| v(t, i, me)).collect())
                    .collect();
                let before = metrics();
                let name = format!("gpu.cmp.{key}.{case}.{fused}");
                let results = run_gpu(&name, &vals, asks, op, pre, post);
                let wire = metrics();
                let elems: usize = sizes[..count].iter().sum();
                let counted = if key == 0 {
                    wire.wire_fp16 - before.wire_fp16
                } else {
                    wire.wire_bf16 - before.wire_bf16
                };
                assert_eq!(counted, 2 * elems as u64, "{name}: wire bytes");
                for (t, got) in results.iter().enumerate() {
                    for (i, g) in got.iter().enumerate() {
                        let each: Vec<f64> = (0..n).map(|r| v(t, i, r)).collect();
                        let div = if op == ReduceOp::Average {
                            n as f64
                        } else {
                            1.0
                        };
                        let (want, tol) = half_sum(&each, pre * post / div, eps);
                        assert!(
                            (g - want).abs() <= tol,
                            "{name} tensor {t} element {i}: got {g}, want {want} (tolerance {tol})"
                        );
                    }
                }
            }
        }
        // the same batch in the same memory step after step: captured into a graph, then
        // replayed, on new values
        let graphs = metrics().graph_launches;
        let mems: Vec<DeviceMem> = sizes.iter().map(|s| gpu.alloc(s * 4).unwrap()).collect();
        for step in 0..6 {
            let vals: Vec<Vec<f64>> = (sizes.iter().enumerate())
                .map(|(t, s)| (0..*s).map(|i| v(t, i + step, me)).collect())
                .collect();
            for (x, m) in vals.iter().zip(&mems) {
                gpu.upload(&stream, &encode(DataType::F32, x), m.range())
                    .unwrap();
            }
            stream.synchronize().unwrap();
            let tensors = (sizes.iter().zip(&mems).enumerate())
                .map(|(t, (s, m))| TensorSpec {
                    name: format!("gpu.cmp.steps.{key}.{t}"),
                    dtype: DataType::F32,
                    shape: vec![*s as i64],
                    input: InputMem::Device(m.range().first(s * 4).unwrap()),
                    output: OutputMem::InPlace,
                    splits: None,
                })
                .collect();
            let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
            spec.device = gpu.ordinal;
            spec.compression = Some(asks);
            let h = runtime::runtime().unwrap().enqueue(spec).unwrap();
            h.wait(Some(Duration::from_secs(120))).unwrap();
            runtime::runtime().unwrap().handles.release(h.id).unwrap();
            for (t, (s, m)) in sizes.iter().zip(&mems).enumerate() {
                let mut got = vec![0u8; s * 4];
                gpu.download(&stream, m.range().first(s * 4).unwrap(), &mut got)
                    .unwrap();
                stream.synchronize().unwrap();
                for (i, x) in decode(DataType::F32, &got).iter().enumerate() {
                    let each: Vec<f64> = (0..n).map(|r| v(t, i + step, r)).collect();
                    let (want, tol) = half_sum(&each, 1.0, eps);
                    assert!(
                        (x - want).abs() <= tol,
                        "step {step} tensor {t} element {i}: {x} vs {want}"
                    );
                }
            }
        }
        assert!(
            metrics().graph_launches > graphs,
            "the compressed batch was never replayed from a graph"
        );
        let fine = 1.0 + 2f64.powi(-12);
        let got = run_gpu(
            &format!("gpu.cmp.fine.{key}"),
            &[vec![fine; 8]],
            asks,
            ReduceOp::Sum,
            1.0,
            1.0,
        );
        assert_eq!(
            got[0],
            vec![n as f64; 8],
            "values did not travel as 16-bit floats"
        );
        let got = run_gpu(
            &format!("gpu.cmp.max.{key}"),
            &[vec![fine + me as f64; 3]],
            asks,
            ReduceOp::Max,
            1.0,
            1.0,
        );
        assert_eq!(
            got[0],
            vec![(fine + (n - 1) as f64) as f32 as f64; 3],
            "a maximum is not compressed"
        );
    }
    finish_job();
}

/// The u8 codec on GPU tensors computes what the host's computes, bit for bit, step after step
/// (so the residuals evolve alike): tensors of odd sizes fused, sums and averages with scales,
/// a block holding NaN; the mean over the steps of a constant gradient converges to the exact
/// value (error feedback on the GPU); the wire bytes are counted as u8.
pub(crate) fn gpu_u8() {
    init();
    let (me, n) = (rank(), size());
    let v = |t: usize, i: usize, r: usize| {
        ((i * 7919 + t * 104_729 + r * 31) % 1000) as f64 / 1000.0 * (t + 1) as f64 - 0.3
    };
    let metrics = || runtime::runtime().unwrap().metrics.snapshot();
    let spec = |prefix: &str, vals: &[Vec<f64>], op: ReduceOp, pre: f64, post: f64| {
        let tensors = (vals.iter().enumerate())
            .map(|(t, x)| {
                let name = format!("{prefix}.{t}");
                tensor(&name, DataType::F32, &[x.len() as i64], x, false)
            })
            .collect();
        let mut spec = OpSpec::new(OpKind::Allreduce, tensors);
        spec.reduce_op = op;
        spec.prescale = pre;
        spec.postscale = post;
        spec.compression = Some(Compression::U8);
        spec
    };
    let steps = 8;
    // fused (every tensor below the host's direct size, so both sides fuse alike), and one
    // tensor alone (many blocks of threads per chunk)
    let batches: [&[usize]; 2] = [&[1, 1000, 33, 7000], &[300_001]];
    let cases = [(ReduceOp::Sum, 1.0, 1.0), (ReduceOp::Average, 2.0, 0.25)];
    for (case, (sizes, (op, pre, post))) in
        (batches.iter().flat_map(|b| cases.map(|c| (*b, c)))).enumerate()
    {
        let total: usize = sizes.iter().sum();
        let vals: Vec<Vec<f64>> = (sizes.iter().enumerate())
            .map(|(t, s)| (0..*s).map(|i| v(t, i, me)).collect())
            .collect();
        let div = if op == ReduceOp::Average {
            n as f64
        } else {
            1.0
        };
        let exact = |t: usize, i: usize| (0..n).map(|r| v(t, i, r)).sum::<f64>() * pre * post / div;
        // one step's bound, as u8_compressed's: half a step of each contribution and of the sum
        let range = |r: usize| {
            let all: Vec<f64> = (sizes.iter().enumerate())
                .flat_map(|(t, s)| (0..*s).map(move |i| v(t, i, r)))
                .collect();
            all.iter().cloned().fold(f64::MIN, f64::max)
                - all.iter().cloned().fold(f64::MAX, f64::min)
        };
        let bound = 2.0 * (0..n).map(|r| range(r) * pre).sum::<f64>() / 510.0 * post / div * 1.01;
        let mut means: Vec<Vec<f64>> = sizes.iter().map(|s| vec![0.0; *s]).collect();
        for step in 0..steps {
            let before = metrics();
            let on_gpu =
                finish(gpu::submit(spec(&format!("gpu.u8.{case}"), &vals, op, pre, post)).unwrap())
                    .unwrap();
            let host = spec(&format!("host.u8.{case}"), &vals, op, pre, post);
            let on_host = finish(runtime::runtime().unwrap().enqueue(host).unwrap()).unwrap();
            assert_eq!(
                metrics().wire_u8 - before.wire_u8,
                2 * total as u64,
                "step {step}: u8 wire bytes of the GPU and the host batch"
            );
            for (t, (g, h)) in on_gpu.iter().zip(&on_host).enumerate() {
                let (g, h) = (output(g, DataType::F32), output(h, DataType::F32));
                for (i, (a, b)) in g.iter().zip(&h).enumerate() {
                    assert!(
                        a == b,
                        "case {case} step {step} tensor {t} element {i}: GPU {a}, host {b}"
                    );
                    assert!(
                        (a - exact(t, i)).abs() <= 2.0 * bound,
                        "case {case} step {step} tensor {t} element {i}: {a} vs {}",
                        exact(t, i)
                    );
                    means[t][i] += a / steps as f64;
                }
            }
        }
        let off = (sizes.iter().enumerate())
            .flat_map(|(t, s)| (0..*s).map(move |i| (t, i)))
            .map(|(t, i)| (means[t][i] - exact(t, i)).abs())
            .fold(0.0, f64::max);
        assert!(
            off <= 2.0 * bound / steps as f64 + 1e-6,
            "case {case}: the mean over {steps} steps is off by {off} (one step's bound {bound})"
        );
    }
    // one tensor's u8 sum on the GPU and on the host: (GPU, host)
    let both = |what: &str, x: Vec<f64>| {
        let gpu_spec = spec(
            &format!("gpu.u8.{what}"),
            std::slice::from_ref(&x),
            ReduceOp::Sum,
            1.0,
            1.0,
        );
        let on_gpu = finish(gpu::submit(gpu_spec).unwrap()).unwrap();
        let host = spec(&format!("host.u8.{what}"), &[x], ReduceOp::Sum, 1.0, 1.0);
        let on_host = finish(runtime::runtime().unwrap().enqueue(host).unwrap()).unwrap();
        (
            output(&on_gpu[0], DataType::F32),
            output(&on_host[0], DataType::F32),
        )
    };
    // a block holding NaN travels as NaN throughout, on the GPU as on the host
    let mut x = vec![1.0, 2.0, 3.0, -4.0, 5.0];
    if me == 0 {
        x[2] = f64::NAN;
    }
    let (g, h) = both("nan", x);
    assert!(h.iter().any(|v| v.is_nan()), "host: {h:?}");
    for (a, b) in g.iter().zip(&h) {
        assert!(
            a == b || a.is_nan() && b.is_nan(),
            "NaN block: GPU {g:?}, host {h:?}"
        );
    }
    // a block near f32::MAX above a large positive minimum (its top, 255 steps up, would
    // round past f32::MAX) decodes finite, the same on the GPU as on the host
    let x = if me == 0 {
        vec![1.0e38, 3.0e38, 3.4e38, 2.0e38, 3.4028e38]
    } else {
        vec![0.0; 5]
    };
    let (g, h) = both("top", x);
    assert!(h.iter().all(|v| v.is_finite()), "host: {h:?}");
    assert_eq!(g, h, "block near f32::MAX: GPU vs host");
    finish_job();
}

/// The C API leaves the calling thread's current CUDA context as it found it: a framework's
/// current device is the context it made current (`torch.cuda.current_device()` reads it), and
/// must not turn into the tensors' GPU because ferrovod recorded on or waited on a stream of
/// it. Checked on a thread with no context current and on one whose current context is one of
/// its own on the same GPU (what another GPU's context is on a machine with one), through
/// `fv_enqueue` with a ready stream, `fv_stream_wait`, `fv_wait` and `fv_release`, with the
/// sums checked.
pub(crate) fn gpu_thread_context() {
    use cudarc::driver::sys;
    use ferrovod::capi::{self, fv_op, fv_tensor};
    use ferrovod::error::Status;
    init();
    let me = rank();
    let n = size();
    let gpu = this_gpu();
    let count = 1usize << 16;
    let host = encode(DataType::F32, &vec![(me + 1) as f64; count]);
    let want = (n * (n + 1) / 2) as f64;
    let current = || {
        let mut c = std::ptr::null_mut();
        // SAFETY: a plain query of this thread's current context.
        unsafe { sys::cuCtxGetCurrent(&mut c) }.result().unwrap();
        c as usize
    };
    for own in [false, true] {
        let (gpu, host) = (gpu.clone(), host.clone());
        std::thread::spawn(move || {
            let what = if own { "its own context" } else { "no context" };
            let stream = gpu.new_stream().unwrap();
            let data = gpu.alloc(host.len()).unwrap();
            // the test's own calls bound ferrovod's context; the caller's choice comes now
            let mine = if own {
                let mut dev = 0;
                let mut c = std::ptr::null_mut();
                // SAFETY: plain driver calls creating a context of this thread's own (made
                // current), destroyed at the end of the thread.
                unsafe {
                    sys::cuDeviceGet(&mut dev, gpu.ordinal).result().unwrap();
                    sys::cuCtxCreate_v4(&mut c, std::ptr::null_mut(), 0, dev)
                        .result()
                        .unwrap();
                }
                c
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: `mine` is null or the live context just created.
            unsafe { sys::cuCtxSetCurrent(mine) }.result().unwrap();
            assert_eq!(current(), mine as usize, "{what}: set");
            for step in 0..3 {
                gpu.upload(&stream, &host, data.range()).unwrap();
                // SAFETY: as above (the upload bound ferrovod's context on this thread).
                unsafe { sys::cuCtxSetCurrent(mine) }.result().unwrap();
                let name = std::ffi::CString::new(format!("ctx.{own}.{step}")).unwrap();
                let shape = [count as i64];
                let t = fv_tensor {
                    name: name.as_ptr(),
                    dtype: DataType::F32 as i32,
                    ndim: 1,
                    shape: shape.as_ptr(),
                    input: data.ptr() as usize as *const std::ffi::c_void,
                    output: std::ptr::null_mut(),
                    splits: std::ptr::null(),
                    nsplits: 0,
                };
                // SAFETY: every field of fv_op is an integer, a float or a pointer, for
                // which zero is valid (no callback, no allocator, host defaults).
                let mut op: fv_op = unsafe { std::mem::zeroed() };
                op.kind = OpKind::Allreduce as i32;
                op.reduce_op = ReduceOp::Sum as i32;
                op.prescale = 1.0;
                op.postscale = 1.0;
                op.device = gpu.ordinal;
                op.tensors = &t;
                op.num_tensors = 1;
                op.stream = stream.raw().cast();
                let mut h = 0;
                // SAFETY: a valid op whose tensor memory lives until the handle completes.
                let status = unsafe { capi::fv_enqueue(&op, &mut h) };
                assert_eq!(status, Status::Ok, "{what}: enqueue");
                assert_eq!(current(), mine as usize, "{what}: after fv_enqueue");
                let mut placed = 0;
                // SAFETY: a live stream of this GPU.
                let status = unsafe {
                    capi::fv_stream_wait(h, gpu.ordinal, stream.raw().cast(), &mut placed)
                };
                assert_eq!(status, Status::Ok, "{what}: stream wait");
                assert_eq!(current(), mine as usize, "{what}: after fv_stream_wait");
                assert_eq!(capi::fv_wait(h, 120.0), Status::Ok, "{what}: wait");
                assert_eq!(current(), mine as usize, "{what}: after fv_wait");
                assert_eq!(capi::fv_release(h), Status::Ok);
                assert_eq!(current(), mine as usize, "{what}: after fv_release");
                let mut got = vec![0u8; host.len()];
                gpu.download(&stream, data.range(), &mut got).unwrap();
                let got = decode(DataType::F32, &got);
                let bad = got.iter().position(|v| *v != want);
                assert!(
                    bad.is_none(),
                    "{what}: element {bad:?} is {:?}, want {want}",
                    bad.map(|i| got[i])
                );
                // SAFETY: as above.
                unsafe { sys::cuCtxSetCurrent(mine) }.result().unwrap();
            }
            if own {
                // SAFETY: the context this thread created; nothing of ferrovod's lives in it.
                unsafe { sys::cuCtxDestroy_v2(mine) }.result().unwrap();
            }
        })
        .join()
        .unwrap();
    }
    finish_job();
}
