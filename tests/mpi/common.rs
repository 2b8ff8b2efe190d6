//! Helpers every scenario uses: this rank and size, closed-form values (element i of rank r is
//! `val(i, r)`), encoding to and from each dtype, submitting and finishing operations, and the
//! training-like steps the negotiation scenarios repeat.

use super::*;

pub(crate) fn rank() -> usize {
    runtime::runtime().unwrap().topology().rank as usize
}

pub(crate) fn size() -> usize {
    runtime::runtime().unwrap().topology().size as usize
}

pub(crate) fn pass() {
    println!("RANK-PASSED");
}

/// Shutting down stops every rank (Horovod's semantics), so ranks first wait for each other.
pub(crate) fn finish_job() {
    run(OpSpec::new(OpKind::Barrier, vec![])).expect("final barrier");
    runtime::shutdown();
    pass();
}

pub(crate) fn init() {
    runtime::init(Default::default()).expect("init");
}

/// Encodes values (small integers or exact binary fractions) as `dtype`.
pub(crate) fn encode(dtype: DataType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DataType::U8 => out.push(v as u8),
            DataType::Bool => out.push(u8::from(v != 0.0)),
            DataType::I8 => out.extend((v as i8).to_le_bytes()),
            DataType::U16 => out.extend((v as u16).to_le_bytes()),
            DataType::I16 => out.extend((v as i16).to_le_bytes()),
            DataType::I32 => out.extend((v as i32).to_le_bytes()),
            DataType::I64 => out.extend((v as i64).to_le_bytes()),
            DataType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
            DataType::BF16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
            DataType::F32 => out.extend((v as f32).to_le_bytes()),
            DataType::F64 => out.extend(v.to_le_bytes()),
        }
    }
    out
}

pub(crate) fn decode(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DataType::U8 | DataType::Bool => c[0] as f64,
            DataType::I8 => c[0] as i8 as f64,
            DataType::U16 => u16::from_le_bytes([c[0], c[1]]) as f64,
            DataType::I16 => i16::from_le_bytes([c[0], c[1]]) as f64,
            DataType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
            DataType::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            DataType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DataType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

/// Element i of rank r: a small positive integer (exact in every dtype, also when summed).
pub(crate) fn val(i: usize, r: usize) -> f64 {
    ((i * 7 + r * 3) % 11 + 1) as f64
}

/// Factors for products: 1 or 2, so products over 4 ranks stay within int8.
pub(crate) fn factor(i: usize, r: usize) -> f64 {
    (1 + (i + r) % 2) as f64
}

pub(crate) fn bit(i: usize, r: usize) -> f64 {
    ((i + r) % 2) as f64
}

pub(crate) fn tensor(
    name: &str,
    dtype: DataType,
    shape: &[i64],
    vals: &[f64],
    later: bool,
) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        input: InputMem::Owned(encode(dtype, vals)),
        output: if later {
            OutputMem::Later
        } else {
            OutputMem::InPlace
        },
        splits: None,
    }
}

pub(crate) fn submit(spec: OpSpec) -> Result<Arc<Handle>, Error> {
    if gpu_mode() && spec.device == ferrovod::message::CPU_DEVICE {
        return gpu::submit(spec);
    }
    runtime::runtime()?.enqueue(spec)
}

/// Tensors allreduced as one operation: their indices, the reduction, prescale and postscale.
pub(crate) type Group<'a> = (&'a [usize], ReduceOp, f64, f64);

/// One f32 allreduce per group, submitted together, each tensor made by `make` from its index.
pub(crate) fn submit_groups(
    groups: &[Group],
    make: impl Fn(usize) -> TensorSpec,
) -> Vec<Arc<Handle>> {
    groups
        .iter()
        .map(|(ts, op, pre, post)| {
            let mut spec = OpSpec::new(OpKind::Allreduce, ts.iter().map(|t| make(*t)).collect());
            (spec.reduce_op, spec.prescale, spec.postscale) = (*op, *pre, *post);
            submit(spec).unwrap()
        })
        .collect()
}

pub(crate) fn finish(h: Arc<Handle>) -> Result<Vec<TensorResult>, Error> {
    let r = h.wait(Some(Duration::from_secs(120)));
    let rt = runtime::runtime()?;
    rt.handles.release(h.id)?;
    let op = gpu::take(h.id);
    r?;
    let n = (0..).take_while(|i| h.result(*i).is_some()).count();
    let mut results: Vec<TensorResult> = (0..n).map(|i| h.result(i).unwrap()).collect();
    if let Some(op) = op {
        op.download_into(&h, &mut results);
    }
    Ok(results)
}

pub(crate) fn run(spec: OpSpec) -> Result<Vec<TensorResult>, Error> {
    finish(submit(spec)?)
}

pub(crate) fn output(r: &TensorResult, dtype: DataType) -> Vec<f64> {
    decode(dtype, r.output.as_ref().expect("library-owned output"))
}

/// Rounds reference values to what `dtype` can hold.
pub(crate) fn quantize(dtype: DataType, vals: &[f64]) -> Vec<f64> {
    decode(dtype, &encode(dtype, vals))
}

pub(crate) fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Truncation toward zero after scaling, as integer tensors are scaled.
pub(crate) fn scaled(dtype: DataType, v: f64) -> f64 {
    if dtype.is_float() { v } else { v.trunc() }
}

/// Simple deterministic generator, seeded per rank.
pub(crate) struct Lcg(pub(crate) u64);
impl Lcg {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// The tensors of one simulated step: (name, length, dtype).
pub(crate) fn step_tensors(
    count: usize,
    extra: &[&str],
    grow: usize,
) -> Vec<(String, usize, DataType)> {
    let mut names: Vec<(String, usize, DataType)> = (0..count)
        .map(|k| {
            let len = if k % 7 == 3 {
                20_000
            } else {
                1 + (k * 37) % 300
            } + grow * (k % 2);
            let dtype = [DataType::F32, DataType::F64, DataType::I32, DataType::BF16][k % 4];
            (format!("p.{k}"), len, dtype)
        })
        .collect();
    for (i, x) in extra.iter().enumerate() {
        names.push((x.to_string(), 5 + i, DataType::F32));
    }
    names
}

/// Submits tensor `k` of `names` for `step` (rank r's element i is `val(i + k + step, r)`).
pub(crate) fn submit_step_tensor(
    names: &[(String, usize, DataType)],
    k: usize,
    step: usize,
) -> Arc<Handle> {
    let (name, len, dtype) = &names[k];
    let mine: Vec<f64> = (0..*len).map(|i| val(i + k + step, rank())).collect();
    submit(OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(name, *dtype, &[*len as i64], &mine, false)],
    ))
    .unwrap()
}

/// Submits every tensor of a `count`-tensor step but those in `skip`, in index order.
pub(crate) fn submit_step(count: usize, step: usize, skip: &[usize]) -> Vec<(usize, Arc<Handle>)> {
    let names = step_tensors(count, &[], 0);
    (0..count)
        .filter(|k| !skip.contains(k))
        .map(|k| (k, submit_step_tensor(&names, k, step)))
        .collect()
}

/// One training-like step: `count` allreduces (mixed dtypes, some fused, some large enough to
/// run alone) submitted in a per-rank random order with jitter, all checked against sums each
/// rank computes itself. `extra` adds tensors after the usual ones; `grow` lengthens every odd tensor.
pub(crate) fn offline_step(rng: &mut Lcg, step: usize, count: usize, extra: &[&str], grow: usize) {
    let n = size();
    let names = step_tensors(count, extra, grow);
    let mut order: Vec<usize> = (0..count).collect();
    for i in (1..count).rev() {
        order.swap(i, rng.next() as usize % (i + 1));
    }
    order.extend(count..names.len());
    let mut handles = Vec::new();
    for &k in &order {
        if rng.next().is_multiple_of(6) {
            std::thread::sleep(Duration::from_micros(rng.next() % 2000));
        }
        handles.push((k, submit_step_tensor(&names, k, step)));
    }
    for (k, h) in handles {
        let (_, len, dtype) = &names[k];
        let res = finish(h).unwrap();
        let want: Vec<f64> = (0..*len)
            .map(|i| (0..n).map(|r| val(i + k + step, r)).sum())
            .collect();
        assert_close(
            &output(&res[0], *dtype),
            &want,
            &format!("step {step} tensor {k}"),
        );
    }
}

pub(crate) fn control_collectives() -> u64 {
    runtime::runtime()
        .unwrap()
        .metrics
        .snapshot()
        .control_collectives
}

/// How soon after its start a stall scenario must end on every rank: the scenarios' stall
/// shutdown time (2 s), the presence probe and a wide margin.
pub(crate) const STALL_END: Duration = Duration::from_secs(30);

/// A stall's error text as a rank must get it: holding each of `parts` (the missing ranks, the
/// tensors), within `STALL_END` of `start`.
pub(crate) fn assert_stall_report(msg: &str, parts: &[&str], start: Instant) {
    for part in parts {
        assert!(msg.contains(part), "no '{part}' in: {msg}");
    }
    assert!(
        start.elapsed() < STALL_END,
        "the stall ended after {:?}",
        start.elapsed()
    );
}

/// Waits (at most twice `STALL_END`) until this rank's runtime has shut down, as it does once
/// a stall elsewhere stopped the job.
pub(crate) fn wait_for_shutdown(start: Instant) {
    let rt = runtime::runtime().unwrap();
    while !rt.is_shut_down() && start.elapsed() < 2 * STALL_END {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Under offline negotiation (`FERROVOD_NEGOTIATION=offline`), counts the steps from the fifth on
/// that issued no control collective: the plan froze. Elsewhere it checks nothing.
pub(crate) struct PlanWatch {
    offline: bool,
    control: u64,
    steady: usize,
}

impl PlanWatch {
    pub(crate) fn new() -> PlanWatch {
        PlanWatch {
            // plans hold host allreduces only (`negotiate::plan::eligible`): on GPUs the same
            // steps are negotiated online
            offline: std::env::var("FERROVOD_NEGOTIATION").as_deref() == Ok("offline")
                && !gpu_mode(),
            control: 0,
            steady: 0,
        }
    }

    pub(crate) fn step_start(&mut self) {
        self.control = control_collectives();
    }

    pub(crate) fn step_end(&mut self, step: usize) {
        if self.offline && step >= 4 && control_collectives() == self.control {
            self.steady += 1;
        }
    }

    /// Under offline negotiation, at least `steps` steps ran from the frozen plan.
    pub(crate) fn froze(&self, steps: usize) {
        if self.offline {
            let steady = self.steady;
            assert!(
                steady >= steps,
                "the plan never froze ({steady} steady steps)"
            );
        }
    }
}

/// f64 sums and f32 maxima travel as they are whatever the job's codec: exact. The f64 value
/// needs more than f32's mantissa; the maximum needs more than f16's, and its three values
/// would round in an 8-bit block.
pub(crate) fn uncompressed_ops_stay_exact(prefix: &str) {
    let (me, n) = (rank(), size());
    let fine64 = 1.0 + 2f64.powi(-30);
    let spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            &format!("{prefix}.f64"),
            DataType::F64,
            &[2],
            &[fine64, 3.0],
            false,
        )],
    );
    assert_eq!(
        output(&run(spec).unwrap()[0], DataType::F64),
        vec![fine64 * n as f64, 3.0 * n as f64]
    );
    let fine = 1.0 + 2f64.powi(-12);
    let mut spec = OpSpec::new(
        OpKind::Allreduce,
        vec![tensor(
            &format!("{prefix}.max"),
            DataType::F32,
            &[3],
            &[fine + me as f64, 7.25, -1.0],
            false,
        )],
    );
    spec.reduce_op = ReduceOp::Max;
    assert_eq!(
        output(&run(spec).unwrap()[0], DataType::F32),
        vec![fine + (n - 1) as f64, 7.25, -1.0]
    );
}

/// The f64 reference of a sum of `each` (every rank's value) times `factor`, and the bound a
/// 16-bit codec with unit roundoff `eps` keeps it within: each rank's value rounded once, each
/// partial sum once.
pub(crate) fn half_sum(each: &[f64], factor: f64, eps: f64) -> (f64, f64) {
    let want = each.iter().sum::<f64>() * factor;
    let mag = each.iter().map(|x| x.abs()).sum::<f64>() * factor.abs();
    (want, (each.len() + 1) as f64 * eps * mag + 1e-6)
}
