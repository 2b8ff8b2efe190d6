//! Offline negotiation's plan: the allreduces of one training step, in an agreed order and
//! grouped into fusion batches. It is learned from the responses online negotiation agreed on
//! (identical on every rank, so every rank learns the same plan at the same point), or loaded
//! from a file; once frozen, each batch runs when its tensors are ready locally.

use crate::compress::Codecs;
use crate::error::{Error, Result};
use crate::fusion::planner::plan_batches;
use crate::hashing::HashSet;
use crate::message::{OpKind, Request, Response};
use crate::negotiate::wire::{self, ResponseList};
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

/// One step's allreduces, batch by batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub batches: Vec<Vec<Response>>,
}

const FILE_MAGIC: &[u8; 8] = b"FVPLAN01";

impl Plan {
    /// Groups one step's responses (in agreed order) into batches with the fusion planner.
    pub fn from_step(
        step: &[Response],
        fusion_threshold: usize,
        direct_bytes: usize,
        codecs: &Codecs,
    ) -> Plan {
        Plan::from_cycles(
            step,
            &vec![0; step.len()],
            fusion_threshold,
            direct_bytes,
            codecs,
        )
    }

    /// Buckets in the step's order, as PyTorch DDP's: consecutive responses up to `bucket`
    /// bytes, cut before the first that does not fit, whatever cycle each was agreed in. A
    /// bucket is ready as soon as its last tensor is, and its size does not depend on when
    /// votes happened to run while the plan was learned (the GPU groups: on a GPU the first
    /// bucket's reduction then overlaps the submission of the rest).
    pub fn from_buckets(
        step: &[Response],
        bucket: usize,
        direct_bytes: usize,
        codecs: &Codecs,
    ) -> Plan {
        let sizes: Vec<usize> = step.iter().map(Response::fused_bytes).collect();
        let mut runs = vec![0u64; step.len()];
        for (k, range) in bucket_ranges(&sizes, bucket).into_iter().enumerate() {
            runs[range].fill(k as u64);
        }
        Plan::from_cycles(step, &runs, bucket, direct_bytes, codecs)
    }

    /// As `from_step`, but fusing only responses agreed in the same negotiation cycle
    /// (`cycle[i]` for `step[i]`): a batch then holds tensors that were ready at about the same
    /// time, so its communication still overlaps the rest of the backward pass.
    pub fn from_cycles(
        step: &[Response],
        cycle: &[u64],
        fusion_threshold: usize,
        direct_bytes: usize,
        codecs: &Codecs,
    ) -> Plan {
        let mut batches = Vec::new();
        let mut start = 0;
        while start < step.len() {
            let end = (start..step.len())
                .find(|&i| cycle[i] != cycle[start])
                .unwrap_or(step.len());
            let group = &step[start..end];
            batches.extend(
                plan_batches(group, fusion_threshold, direct_bytes, codecs)
                    .into_iter()
                    .map(|b| b.members.iter().map(|i| group[*i].clone()).collect()),
            );
            start = end;
        }
        Plan { batches }
    }

    /// As `from_cycles`, but with at most `most` batches where merging neighbouring cycles
    /// gets there: pairs of neighbouring cycles merge, then pairs of those, until the plan
    /// fits or the step is one cycle. How many cycles a step was agreed in depends on how fast
    /// votes ran while it was learned (a fast machine votes at nearly every submission): a
    /// learned group costs each vote two bits, so uncapped groups could make every vote of the
    /// job longer than the single tensors' bits would.
    pub fn from_cycles_within(
        step: &[Response],
        cycle: &[u64],
        fusion_threshold: usize,
        direct_bytes: usize,
        codecs: &Codecs,
        most: usize,
    ) -> Plan {
        // each response's cycle as the index of its run of equal labels
        let mut runs = Vec::with_capacity(cycle.len());
        for (i, c) in cycle.iter().enumerate() {
            let next = match runs.last() {
                None => 0,
                Some(&r) if cycle[i - 1] == *c => r,
                Some(&r) => r + 1,
            };
            runs.push(next);
        }
        loop {
            let plan = Plan::from_cycles(step, &runs, fusion_threshold, direct_bytes, codecs);
            if plan.batches.len() <= most || runs.last().is_none_or(|&r| r == 0) {
                return plan;
            }
            runs.iter_mut().for_each(|r| *r /= 2);
        }
    }

    pub fn num_tensors(&self) -> usize {
        self.batches.iter().map(Vec::len).sum()
    }

    /// Where `name` sits: (batch, index in batch).
    pub fn position(&self, name: &str) -> Option<(usize, usize)> {
        self.batches
            .iter()
            .enumerate()
            .find_map(|(b, batch)| batch.iter().position(|r| r.name == name).map(|i| (b, i)))
    }

    /// Whether `req` is the plan's tensor of that name, unchanged (kind, dtype, shape, op,
    /// scales, device).
    pub fn accepts(&self, req: &Request) -> bool {
        self.position(&req.name)
            .is_some_and(|(b, i)| self.batches[b][i].params() == req.params())
    }

    /// The plan as bytes: a magic tag, the batch sizes, then the responses in wire format.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = FILE_MAGIC.to_vec();
        out.extend((self.batches.len() as u64).to_le_bytes());
        for b in &self.batches {
            out.extend((b.len() as u64).to_le_bytes());
        }
        out.extend(wire::encode_responses(&ResponseList {
            responses: self.batches.iter().flatten().cloned().collect(),
            joined: Vec::new(),
            shutdown: None,
        }));
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Plan> {
        let bad = |what: &str| Error::InvalidArgument(format!("not a ferrovod plan: {what}"));
        let rest = buf.strip_prefix(FILE_MAGIC).ok_or_else(|| bad("magic"))?;
        let word = |b: &[u8], at: usize| -> Result<usize> {
            b.get(at..at + 8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")) as usize)
                .ok_or_else(|| bad("truncated"))
        };
        let n = word(rest, 0)?;
        if n > rest.len() / 8 {
            return Err(bad("batch count"));
        }
        let sizes = (0..n)
            .map(|k| word(rest, 8 + 8 * k))
            .collect::<Result<Vec<_>>>()?;
        let list = wire::decode_responses(&rest[8 + 8 * n..])?;
        if !list.joined.is_empty() || list.shutdown.is_some() {
            // a plan never holds them: a file that does was not written by ferrovod
            return Err(bad("join or shutdown state"));
        }
        let total = sizes.iter().try_fold(0usize, |a, s| a.checked_add(*s));
        if total != Some(list.responses.len()) || sizes.contains(&0) {
            return Err(bad("batch sizes"));
        }
        let mut it = list.responses.into_iter();
        let batches = sizes
            .iter()
            .map(|s| it.by_ref().take(*s).collect())
            .collect();
        let plan = Plan { batches };
        if !plan.is_valid() {
            return Err(bad("contents"));
        }
        Ok(plan)
    }

    /// Allreduces of distinct names only, each batch of one dtype, op, scale and compression.
    fn is_valid(&self) -> bool {
        let mut names = HashSet::default();
        self.batches.iter().all(|b| {
            let h = &b[0];
            b.iter().all(|r| {
                eligible(r)
                    && names.insert(r.name.clone())
                    && r.dtype == h.dtype
                    && r.reduce_op == h.reduce_op
                    && r.prescale == h.prescale
                    && r.postscale == h.postscale
                    && r.compression == h.compression
            })
        })
    }

    /// FNV-1a of the encoding: what ranks compare before trusting a plan.
    pub fn hash(&self) -> u64 {
        self.encode().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }
}

/// Consecutive runs of `sizes` of at most `bucket` in total, each cut before the first size
/// that does not fit (a size larger than `bucket` is a run of its own): the GPU buckets. (A
/// smaller first bucket, as DDP's, was measured on ResNet-50 and gained nothing.)
pub fn bucket_ranges(sizes: &[usize], bucket: usize) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, b) in sizes.iter().enumerate() {
        if bytes > 0 && bytes + b > bucket {
            ranges.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < sizes.len() {
        ranges.push(start..sizes.len());
    }
    ranges
}

/// Responses a plan may hold: error-free allreduces on the host of 32/64-bit integers or
/// floats (16-bit floats included), with a reduction the escape flag can ride along with. An
/// 8- or 16-bit integer flag could wrap to zero when 256 (or 65,536) ranks raise it at once.
pub fn eligible(r: &Response) -> bool {
    r.kind == OpKind::Allreduce && groupable(r) && r.device == crate::message::CPU_DEVICE
}

/// Responses an online group (one vote bit per batch) may hold: as `eligible`, on any device
/// (a group only votes; no escape flag rides along), and gossip too, so that a gossip step
/// runs in the same learned buckets as an allreduce step (on GPUs inside one node its exact
/// averages are the allreduce's launches, replayed from graphs only while the batches repeat).
fn groupable(r: &Response) -> bool {
    use crate::dtype::DataType as D;
    matches!(r.kind, OpKind::Allreduce | OpKind::Gossip)
        && r.error.is_none()
        && matches!(
            r.dtype,
            D::I32 | D::I64 | D::F16 | D::BF16 | D::F32 | D::F64
        )
        && r.reduce_op != crate::message::ReduceOp::Adasum
}

/// Learns the plan from agreed responses. A step ends where a name comes back; a plan is
/// frozen once `warmup` consecutive steps held the same tensors (in any order). Pure: every
/// rank feeds the same responses and freezes at the same one. Steps are compared by
/// fingerprint, and a step whose tensors the caller already holds is not kept: in a steady
/// job this runs for every agreed tensor, on the path from a vote to its collective.
/// The most tensors one learned step may hold; a longer run of names without a repeat is not
/// a training step.
const MAX_STEP_TENSORS: usize = 1 << 16;

pub struct PlanRecorder {
    warmup: usize,
    /// Whether GPU tensors may be in the step (online groups), or only host ones (plans).
    any_device: bool,
    /// The step so far, in agreed order, while `keeping`.
    current: Vec<Response>,
    cycles: Vec<u64>,
    current_names: HashSet<u64>,
    print: StepPrint,
    /// Whether every response of the step so far was held by the caller already.
    all_held: bool,
    /// Whether this step's responses are kept: the previous step had one the caller did not
    /// hold (a step of held tensors is never returned, so it need not be copied).
    keeping: bool,
    last: Option<StepPrint>,
    stable: usize,
}

/// An order-independent fingerprint of a step's tensors (name, dtype, shape, op, scales): the
/// count and the wrapping sum of per-tensor SipHashes. Equal prints mean the same tensors but
/// for a chance of about 2^-64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct StepPrint {
    len: usize,
    sum: u64,
}

impl StepPrint {
    fn add(&mut self, r: &Response) {
        use std::hash::{Hash, Hasher};
        // fixed keys: the same value on every rank (all ranks run one binary)
        let mut h = std::hash::DefaultHasher::new();
        (
            &r.name,
            r.dtype as i32,
            &r.shape,
            r.reduce_op as i32,
            r.prescale.to_bits(),
            r.postscale.to_bits(),
            r.compression,
        )
            .hash(&mut h);
        self.len += 1;
        self.sum = self.sum.wrapping_add(h.finish());
    }
}

impl PlanRecorder {
    /// For offline plans: host tensors only.
    pub fn new(warmup: usize) -> PlanRecorder {
        PlanRecorder {
            warmup: warmup.max(1),
            any_device: false,
            current: Vec::new(),
            cycles: Vec::new(),
            current_names: HashSet::default(),
            print: StepPrint::default(),
            all_held: true,
            keeping: true,
            last: None,
            stable: 0,
        }
    }

    /// For online groups: tensors on any device.
    pub fn for_groups(warmup: usize) -> PlanRecorder {
        PlanRecorder {
            any_device: true,
            ..PlanRecorder::new(warmup)
        }
    }

    /// Feeds one agreed response (agreed in negotiation cycle `cycle`; `held`: the caller has
    /// a plan for it already); returns a finished step that `warmup` steps in a row agreed on
    /// (the latest, in its order, with each response's cycle), unless the caller held all of
    /// it. After a step with a tensor not held, the next step is kept whole and returned.
    pub fn observe(
        &mut self,
        r: &Response,
        cycle: u64,
        held: bool,
    ) -> Option<(Vec<Response>, Vec<u64>)> {
        if !(if self.any_device {
            groupable(r)
        } else {
            eligible(r)
        }) {
            // other collectives, joins, process-set changes, allreduces a plan cannot hold:
            // a step containing them cannot run from a plan
            self.reset();
            return None;
        }
        let name = std::hash::BuildHasher::hash_one(&rustc_hash::FxBuildHasher, &r.name);
        if self.current_names.len() >= MAX_STEP_TENSORS && !self.current_names.contains(&name) {
            // names that never repeat (unnamed ops) make no step: forget them rather than
            // grow without bound
            self.reset();
            return None;
        }
        let mut done = None;
        if self.current_names.contains(&name) {
            let step = std::mem::take(&mut self.current);
            let cycles = std::mem::take(&mut self.cycles);
            self.current_names.clear();
            let print = std::mem::take(&mut self.print);
            self.stable = if self.last == Some(print) {
                self.stable + 1
            } else {
                1
            };
            if self.stable >= self.warmup && self.keeping && !self.all_held {
                done = Some((step, cycles));
            }
            self.keeping = !self.all_held;
            self.all_held = true;
            self.last = Some(print);
        }
        self.current_names.insert(name);
        self.print.add(r);
        self.all_held &= held;
        if self.keeping {
            self.current.push(r.clone());
            self.cycles.push(cycle);
        }
        done
    }

    pub fn reset(&mut self) {
        *self = PlanRecorder {
            warmup: self.warmup,
            any_device: self.any_device,
            ..PlanRecorder::new(self.warmup)
        };
    }
}

/// Offline mode at init: the plan in `path` if every rank of `ctrl` loaded the same one (one
/// allgather of plan hashes), else `None` and the plan is learned.
pub fn agreed_plan_file(ctrl: &MpiComm, path: Option<&str>) -> Result<Option<Plan>> {
    let loaded = path.and_then(|path| match std::fs::read(path) {
        Ok(bytes) => Plan::decode(&bytes)
            .inspect_err(|e| tracing::warn!("ignoring plan file {path}: {e}"))
            .ok(),
        Err(_) => None,
    });
    let mine = loaded.as_ref().map_or(0, |p| p.hash() as i64);
    let all = ctrl.allgather_i64(mine)?;
    if all.iter().all(|h| *h == mine) && loaded.is_some() {
        return Ok(loaded);
    }
    if all.iter().any(|h| *h != 0) {
        tracing::warn!(
            "offline negotiation: the plan file is missing, unreadable or different on some ranks; learning a new plan"
        );
    }
    Ok(None)
}

/// Whether every rank of `ctrl` learned `plan` (one allgather of its hash). When they did,
/// rank 0 writes it to `path` (atomically: a temporary file renamed).
pub fn agree_on_plan(ctrl: &MpiComm, plan: &Plan, path: Option<&str>) -> Result<bool> {
    let hash = plan.hash() as i64;
    if ctrl.allgather_i64(hash)?.iter().any(|h| *h != hash) {
        tracing::warn!("offline negotiation: ranks learned different plans; staying online");
        return Ok(false);
    }
    if ctrl.rank() == 0
        && let Some(path) = path
    {
        let tmp = format!("{path}.tmp{}", std::process::id());
        if let Err(e) =
            std::fs::write(&tmp, plan.encode()).and_then(|_| std::fs::rename(&tmp, path))
        {
            tracing::warn!("cannot write plan file {path}: {e}");
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;

    fn resp(name: &str, n: i64) -> Response {
        Response::from_request(&Request::test(name, OpKind::Allreduce, DataType::F32, &[n]))
    }

    #[test]
    fn names_that_never_repeat_are_not_kept_for_ever() {
        let mut rec = PlanRecorder::new(2);
        for k in 0..MAX_STEP_TENSORS + 10 {
            assert!(
                rec.observe(&resp(&format!("noname.{k}"), 4), k as u64, false)
                    .is_none()
            );
            assert!(
                rec.current.len() <= MAX_STEP_TENSORS
                    && rec.current_names.len() <= MAX_STEP_TENSORS
            );
        }
        assert!(
            rec.current_names.len() < 20,
            "reset once the bound was reached"
        );
    }

    fn feed(rec: &mut PlanRecorder, names: &[&str]) -> Option<Vec<Response>> {
        let mut out = None;
        for (i, n) in names.iter().enumerate() {
            if let Some((s, _)) = rec.observe(&resp(n, 4), i as u64, false) {
                out = Some(s);
            }
        }
        out
    }

    #[test]
    fn gpu_tensors_make_groups_but_not_plans() {
        let gpu = |n: &str| {
            let mut r = resp(n, 4);
            r.device = 0;
            r
        };
        let steps = ["a", "b", "a", "b", "a"];
        let mut plans = PlanRecorder::new(2);
        let mut groups = PlanRecorder::for_groups(2);
        let (mut p, mut g) = (None, None);
        for (i, n) in steps.iter().enumerate() {
            p = p.or(plans.observe(&gpu(n), i as u64, false));
            g = g.or(groups.observe(&gpu(n), i as u64, false));
        }
        assert!(p.is_none(), "an offline plan holds host tensors only");
        let (step, _) = g.expect("two identical GPU steps learned");
        assert_eq!(step.len(), 2);
    }

    #[test]
    fn buckets_are_consecutive_and_ignore_cycles() {
        // 40 B each; buckets of 100 B: [a b] [c d] [e] — never a later small one pulled forward
        let step: Vec<Response> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|n| resp(n, 10))
            .collect();
        let names = |p: &Plan| -> Vec<Vec<String>> {
            p.batches
                .iter()
                .map(|b| b.iter().map(|r| r.name.clone()).collect())
                .collect()
        };
        assert_eq!(
            names(&Plan::from_buckets(
                &step,
                100,
                usize::MAX,
                &Codecs::default()
            )),
            [vec!["a", "b"], vec!["c", "d"], vec!["e"]]
        );
        // a tensor larger than a bucket is a bucket of its own
        let mut big = step.clone();
        big[1] = resp("B", 100);
        assert_eq!(
            names(&Plan::from_buckets(
                &big,
                100,
                usize::MAX,
                &Codecs::default()
            )),
            [vec!["a"], vec!["B"], vec!["c", "d"], vec!["e"]]
        );
        // one bucket for everything when it fits, however the cycles fell
        assert_eq!(
            names(&Plan::from_buckets(
                &step,
                1 << 20,
                usize::MAX,
                &Codecs::default()
            )),
            [vec!["a", "b", "c", "d", "e"]]
        );
    }

    #[test]
    fn freezes_after_warmup_identical_steps_in_any_order() {
        let mut rec = PlanRecorder::new(3);
        assert!(feed(&mut rec, &["a", "b", "c"]).is_none());
        assert!(feed(&mut rec, &["b", "a", "c"]).is_none()); // ends step 1
        assert!(feed(&mut rec, &["c", "a", "b"]).is_none()); // ends step 2 (same set)
        // the first name of step 4 ends step 3: three steps agreed
        let step = feed(&mut rec, &["a"]).expect("frozen");
        let names: Vec<_> = step.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["c", "a", "b"]);
    }

    #[test]
    fn a_changed_step_restarts_the_count() {
        let mut rec = PlanRecorder::new(2);
        assert!(feed(&mut rec, &["a", "b", "a", "b", "x"]).is_none());
        // steps: [a,b], [a,b,x] differ; then [a,b,x] again is the second agreeing step
        assert!(feed(&mut rec, &["a", "b", "x"]).is_none());
        assert!(feed(&mut rec, &["a"]).is_some());
        let mut rec = PlanRecorder::new(2);
        feed(&mut rec, &["a", "b", "a", "b"]);
        let mut bcast = resp("bcast", 4);
        bcast.kind = OpKind::Broadcast;
        assert!(rec.observe(&bcast, 0, false).is_none()); // another collective: start over
        assert!(feed(&mut rec, &["a"]).is_none());
        // same names, another shape: another step
        let mut rec = PlanRecorder::new(2);
        for (i, n) in [4, 8, 8].iter().enumerate() {
            assert!(rec.observe(&resp("a", *n), i as u64, false).is_none());
        }
        // steps [a:4], [a:8], [a:8]: the last two agree
        assert!(rec.observe(&resp("a", 8), 3, false).is_some());
    }

    #[test]
    fn steps_the_caller_holds_are_not_returned_and_a_new_tensor_is_learned_a_step_later() {
        let mut rec = PlanRecorder::for_groups(1);
        let mut see = |n: &str, held: bool| rec.observe(&resp(n, 4), 0, held);
        let names = |s: Option<(Vec<Response>, Vec<u64>)>| -> Vec<String> {
            s.expect("a step").0.into_iter().map(|r| r.name).collect()
        };
        see("a", false);
        see("b", false);
        assert_eq!(names(see("a", true)), ["a", "b"]);
        see("b", true);
        // a step of held tensors only: nothing to learn
        assert!(see("a", true).is_none());
        see("b", true);
        see("x", false);
        // that step had an unheld tensor, but was not kept (its first tensors were held)
        assert!(see("a", true).is_none());
        see("b", true);
        see("x", false);
        // the next step was kept whole
        assert_eq!(names(see("a", true)), ["a", "b", "x"]);
    }

    #[test]
    fn batches_never_span_cycles() {
        let step: Vec<Response> = (0..6).map(|k| resp(&format!("g{k}"), 4)).collect();
        let plan = Plan::from_cycles(
            &step,
            &[0, 0, 1, 1, 1, 2],
            1 << 20,
            1 << 20,
            &Codecs::default(),
        );
        let names: Vec<Vec<&str>> = plan
            .batches
            .iter()
            .map(|b| b.iter().map(|r| r.name.as_str()).collect())
            .collect();
        assert_eq!(
            names,
            [vec!["g0", "g1"], vec!["g2", "g3", "g4"], vec!["g5"]]
        );
    }

    #[test]
    fn capped_plans_merge_neighbouring_cycles_only_as_far_as_needed() {
        let step: Vec<Response> = (0..7).map(|k| resp(&format!("g{k}"), 4)).collect();
        let names = |p: &Plan| -> Vec<Vec<String>> {
            p.batches
                .iter()
                .map(|b| b.iter().map(|r| r.name.clone()).collect())
                .collect()
        };
        let within = |cycles: &[u64], most: usize, direct: usize| {
            names(&Plan::from_cycles_within(
                &step,
                cycles,
                1 << 20,
                direct,
                &Codecs::default(),
                most,
            ))
        };
        // cycles as a vote counts them (gaps and all): within the cap, exactly from_cycles
        let cycles = [3, 3, 5, 9, 9, 9, 12];
        let uncapped = names(&Plan::from_cycles(
            &step,
            &cycles,
            1 << 20,
            1 << 20,
            &Codecs::default(),
        ));
        assert_eq!(uncapped.len(), 4);
        assert_eq!(within(&cycles, 4, 1 << 20), uncapped);
        // one merge of neighbouring pairs: [g0 g1 | g2] [g3 g4 g5 | g6]
        assert_eq!(
            within(&cycles, 3, 1 << 20),
            [vec!["g0", "g1", "g2"], vec!["g3", "g4", "g5", "g6"]]
        );
        // one tensor per cycle, at most 2 batches: merged twice, then three times
        let each: Vec<u64> = (0..7).collect();
        assert_eq!(
            within(&each, 2, 1 << 20),
            [vec!["g0", "g1", "g2", "g3"], vec!["g4", "g5", "g6"]]
        );
        assert_eq!(within(&each, 1, 1 << 20).len(), 1);
        // tensors that each run alone (over the direct size) cannot merge: the one-cycle plan
        assert_eq!(within(&each, 2, 8).len(), 7);
    }

    #[test]
    fn encodes_decodes_hashes_and_accepts() {
        let step: Vec<Response> = (0..5).map(|k| resp(&format!("g{k}"), 10 + k)).collect();
        let plan = Plan::from_step(&step, 200, 1 << 20, &Codecs::default());
        assert_eq!(plan.num_tensors(), 5);
        assert!(plan.batches.len() > 1, "threshold splits the step");
        let back = Plan::decode(&plan.encode()).unwrap();
        assert_eq!(back, plan);
        assert_eq!(back.hash(), plan.hash());
        let mut other = plan.clone();
        other.batches[0][0].shape = vec![99];
        assert_ne!(other.hash(), plan.hash());
        let mut req = Request::test("g2", OpKind::Allreduce, DataType::F32, &[12]);
        assert!(plan.accepts(&req));
        req.shape = vec![13];
        assert!(!plan.accepts(&req));
        req.name = "new".into();
        assert!(!plan.accepts(&req));
        assert!(Plan::decode(b"FVPLAN01").is_err());
        assert!(Plan::decode(b"garbage").is_err());
        let mut bytes = plan.encode();
        bytes.truncate(bytes.len() - 3);
        assert!(Plan::decode(&bytes).is_err());
        // batch sizes whose sum overflows (to the number of responses, 0) are refused
        let mut huge = FILE_MAGIC.to_vec();
        huge.extend(2u64.to_le_bytes());
        huge.extend((1u64 << 63).to_le_bytes());
        huge.extend((1u64 << 63).to_le_bytes());
        huge.extend(wire::encode_responses(&ResponseList::default()));
        assert!(Plan::decode(&huge).is_err());
        // an embedded list with joined ranks (found by the wire fuzz target) is not a plan
        let mut joined = FILE_MAGIC.to_vec();
        joined.extend(0u64.to_le_bytes());
        joined.extend(wire::encode_responses(&ResponseList {
            joined: vec![59],
            ..Default::default()
        }));
        assert!(Plan::decode(&joined).is_err());
    }
}
