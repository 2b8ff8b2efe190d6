//! Learning a training step's fusion batches from the global set's agreed responses: online
//! mode votes one bit per learned batch (`GroupLearner`), offline mode freezes the learned plan
//! (`PlanLearner`). Both are pure functions of agreed data, fed at the same point on every rank,
//! so every rank learns the same batches at the same response.

use std::sync::Arc;

use crate::compress::Codecs;
use crate::hashing::HashSet;
use crate::message::{CPU_DEVICE, Response};
use crate::negotiate::plan::{Plan, PlanRecorder};
use crate::negotiate::ready_bitmap::GROUPS_PER_WORD;

/// The largest group of a step of GPU tensors (capped by the fusion threshold): buckets of it
/// are launched from CUDA graphs while the step's later gradients are still computed. The
/// sizes tried and their cost are in BENCHMARKS.md (2026-11-23, buckets
/// replayed from CUDA graphs).
pub(crate) const GPU_BUCKET_BYTES: usize = 48 << 20;

/// What shapes the learned batches (agreed settings) and whether learning may proceed.
#[derive(Clone, Copy, Debug)]
pub struct LearnContext {
    pub fusion_threshold: usize,
    pub direct_bytes: usize,
    pub codecs: Codecs,
    /// The global set is the only set (another set's votes could interleave with a batch
    /// differently on different ranks), and, for plans, no rank has joined.
    pub alone: bool,
}

/// A learned plan waiting for the step in progress to end: a plan must start with a step.
struct Armed {
    plan: Plan,
    remaining: HashSet<String>,
}

impl Armed {
    /// Armed at `first`, the first response of the step after the learned one.
    fn new(plan: Plan, first: &str) -> Armed {
        let mut remaining: HashSet<String> = plan
            .batches
            .iter()
            .flatten()
            .map(|x| x.name.clone())
            .collect();
        remaining.remove(first);
        Armed { plan, remaining }
    }
}

/// Online mode's learner: which batches the vote carries one bit for (as many as fit one word
/// where merging neighbouring cycles allows).
pub struct GroupLearner {
    recorder: PlanRecorder,
    armed: Option<Armed>,
    cycles: u64,
    /// How often learned groups were dissolved (`dissolved`).
    dissolutions: u32,
}

impl GroupLearner {
    pub fn new(warmup: usize) -> GroupLearner {
        GroupLearner {
            recorder: PlanRecorder::for_groups(warmup),
            armed: None,
            cycles: 0,
            dissolutions: 0,
        }
    }

    /// Learning again after leaving a frozen plan in the middle of a step (offline mode), as
    /// `PlanLearner::resuming`: `ran`, the responses the plan ran in that step, start the step
    /// the recorder sees, so that its steps (and so its groups) begin where the training's do.
    pub fn resuming<'a>(
        warmup: usize,
        ran: impl IntoIterator<Item = &'a Response>,
    ) -> GroupLearner {
        let mut learner = GroupLearner::new(warmup);
        for r in ran {
            learner.recorder.observe(r, 0, false);
        }
        learner
    }

    /// Learned groups were dissolved (agreed on every rank): a group waited partly ready past
    /// its patience. GPU steps are learned as size buckets across the cycles their tensors were
    /// agreed in, which holds a tensor whose submission depends on an earlier one of its bucket
    /// (the next layer's all-gather, a collective on a result) until the patience ends, every
    /// step. After one dissolution, groups keep to the cycles tensors were agreed in (two
    /// dependent tensors are never agreed in one cycle); after a second, no groups are learned
    /// and every tensor votes with its own bit.
    pub fn dissolved(&mut self) {
        self.dissolutions = self.dissolutions.saturating_add(1);
        self.armed = None;
    }

    /// Feeds one cycle's agreed responses. `held(name)`: the name belongs to a group voted on
    /// now; `current`: those groups. Returns the groups to vote on from the next cycle when they
    /// change: once `FERROVOD_PLAN_WARMUP_STEPS` steps agreed and the next one has run, unless
    /// the groups voted on now hold the same tensors.
    pub fn observe(
        &mut self,
        responses: &[Arc<Response>],
        ctx: LearnContext,
        held: impl Fn(&str) -> bool,
        current: &[Vec<String>],
    ) -> Option<Vec<Vec<String>>> {
        self.cycles += 1;
        for r in responses {
            if let Some(a) = self.armed.as_mut()
                && !a.remaining.remove(&r.name)
            {
                self.armed = None;
            }
            if let Some((step, cycles)) = self.recorder.observe(r, self.cycles, held(&r.name))
                && self.armed.is_none()
                && ctx.alone
                && self.dissolutions < 2
            {
                let on_gpu = step.iter().all(|r| r.device != CPU_DEVICE);
                let plan = if on_gpu && self.dissolutions == 0 {
                    Plan::from_buckets(
                        &step,
                        ctx.fusion_threshold.min(GPU_BUCKET_BYTES),
                        ctx.direct_bytes,
                        &ctx.codecs,
                    )
                } else {
                    Plan::from_cycles_within(
                        &step,
                        &cycles,
                        ctx.fusion_threshold,
                        ctx.direct_bytes,
                        &ctx.codecs,
                        GROUPS_PER_WORD,
                    )
                };
                self.armed = Some(Armed::new(plan, &r.name));
            }
        }
        if !self.armed.as_ref().is_some_and(|a| a.remaining.is_empty()) {
            return None;
        }
        let plan = self.armed.take().expect("checked").plan;
        let groups: Vec<Vec<String>> = plan
            .batches
            .iter()
            .map(|b| b.iter().map(|x| x.name.clone()).collect())
            .collect();
        replaces(&groups, current).then_some(groups)
    }
}

/// Whether learned groups replace the current ones: the first plan stays while its tensors
/// still come, unless the new one holds them all and more (a step that gained tensors); a step
/// of other tensors (another phase of the job, the benchmark's next size) replaces groups that
/// would otherwise never be voted again. The step agreed while the first plan was being armed
/// returns the same tensors in other cycles: replacing the plan with it only churned the groups.
pub fn replaces(learned: &[Vec<String>], current: &[Vec<String>]) -> bool {
    let learned: HashSet<&String> = learned.iter().flatten().collect();
    let (mut stale, mut covered, mut count) = (true, true, 0);
    for n in current.iter().flatten() {
        let has = learned.contains(n);
        stale &= !has;
        covered &= has;
        count += 1;
    }
    stale || (covered && learned.len() > count)
}

/// Offline mode's learner: learning a plan while negotiating online, then armed until the step
/// in progress has run, then ready to freeze.
pub struct PlanLearner {
    warmup: usize,
    recorder: PlanRecorder,
    armed: Option<Armed>,
    cycles: u64,
}

impl PlanLearner {
    pub fn new(warmup: usize) -> PlanLearner {
        PlanLearner {
            warmup,
            recorder: PlanRecorder::new(warmup),
            armed: None,
            cycles: 0,
        }
    }

    /// Learning again after leaving a frozen plan in the middle of a step: `ran` are the
    /// responses the plan ran in that step before every rank escaped. They start the step the
    /// recorder sees, so its steps begin where the training's do; without them the first step
    /// seen online would be only the rest of one, and every later step would be cut at a point
    /// that depends on the order tensors happened to be agreed in.
    pub fn resuming<'a>(warmup: usize, ran: impl IntoIterator<Item = &'a Response>) -> PlanLearner {
        let mut learner = PlanLearner::new(warmup);
        for r in ran {
            learner.recorder.observe(r, 0, false);
        }
        learner
    }

    /// Feeds one cycle's agreed responses of the global set.
    pub fn observe(&mut self, responses: &[Arc<Response>], ctx: LearnContext) {
        self.cycles += 1;
        for r in responses {
            match self.armed.as_mut() {
                Some(a) => {
                    if !a.remaining.remove(&r.name) {
                        // the step changed: learn again from this response on
                        self.armed = None;
                        self.recorder = PlanRecorder::new(self.warmup);
                        self.recorder.observe(r, self.cycles, false);
                    }
                }
                None => {
                    if let Some((step, cycles)) = self.recorder.observe(r, self.cycles, false)
                        && ctx.alone
                    {
                        let plan = Plan::from_cycles(
                            &step,
                            &cycles,
                            ctx.fusion_threshold,
                            ctx.direct_bytes,
                            &ctx.codecs,
                        );
                        self.armed = Some(Armed::new(plan, &r.name));
                    }
                }
            }
        }
    }

    /// The plan, once its step has run (every rank takes it at the same response).
    pub fn take_ready(&mut self) -> Option<Plan> {
        if self.armed.as_ref().is_some_and(|a| a.remaining.is_empty()) {
            self.recorder = PlanRecorder::new(self.warmup);
            return self.armed.take().map(|a| a.plan);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;
    use crate::message::{OpKind, Request};

    fn names(groups: &[&[&str]]) -> Vec<Vec<String>> {
        groups
            .iter()
            .map(|g| g.iter().map(|s| s.to_string()).collect())
            .collect()
    }

    #[test]
    fn groups_are_replaced_only_by_more_tensors_or_other_ones() {
        let current = names(&[&["a", "b"], &["c"]]);
        // the same tensors batched otherwise: kept
        assert!(!replaces(&names(&[&["a"], &["b", "c"]]), &current));
        // a step that gained a tensor: replaced
        assert!(replaces(&names(&[&["a", "b", "c", "d"]]), &current));
        // another phase's tensors: replaced
        assert!(replaces(&names(&[&["x", "y"]]), &current));
        // part of them only: kept (the first plan stays while its tensors still come)
        assert!(!replaces(&names(&[&["a", "x"]]), &current));
        // nothing voted on now
        assert!(replaces(&names(&[&["a"]]), &[]));
    }

    fn step(n: usize) -> Vec<Arc<Response>> {
        (0..n)
            .map(|k| {
                Arc::new(Response::from_request(&Request::test(
                    &format!("t{k}"),
                    OpKind::Allreduce,
                    DataType::F32,
                    &[4],
                )))
            })
            .collect()
    }

    fn ctx() -> LearnContext {
        LearnContext {
            fusion_threshold: 1 << 20,
            direct_bytes: 1 << 20,
            codecs: Codecs::default(),
            alone: true,
        }
    }

    /// A step of GPU tensors agreed one per cycle.
    fn gpu_step(n: usize) -> Vec<Arc<Response>> {
        (0..n)
            .map(|k| {
                let mut req =
                    Request::test(&format!("g{k}"), OpKind::Allreduce, DataType::F32, &[4]);
                req.device = 0;
                Arc::new(Response::from_request(&req))
            })
            .collect()
    }

    /// The groups learned from `steps` steps, each tensor agreed in a cycle of its own.
    fn learn_gpu(g: &mut GroupLearner, steps: usize) -> Option<Vec<Vec<String>>> {
        let mut learned = None;
        for _ in 0..steps {
            for r in gpu_step(3) {
                learned = g.observe(&[r], ctx(), |_| false, &[]).or(learned);
            }
        }
        learned
    }

    #[test]
    fn groups_learned_again_after_an_escape_start_where_the_steps_do() {
        // a plan ran g0 of a step of three, then escaped; g1 and g2 follow online
        let ran = gpu_step(3);
        let mut resumed = GroupLearner::resuming(2, ran[..1].iter().map(|r| r.as_ref()));
        let mut fresh = GroupLearner::new(2);
        let (mut a, mut b) = (None, None);
        for r in (gpu_step(3).into_iter().skip(1)).chain((0..4).flat_map(|_| gpu_step(3))) {
            a = resumed
                .observe(std::slice::from_ref(&r), ctx(), |_| false, &[])
                .or(a);
            b = fresh.observe(&[r], ctx(), |_| false, &[]).or(b);
        }
        // the resumed learner's group is a step; the fresh one's steps start at g1
        assert_eq!(a.expect("learned"), names(&[&["g0", "g1", "g2"]]));
        assert_eq!(b.expect("learned"), names(&[&["g1", "g2", "g0"]]));
    }

    #[test]
    fn gpu_groups_keep_to_cycles_after_a_dissolution_and_stop_after_two() {
        let mut g = GroupLearner::new(2);
        // size buckets across cycles: one group of the three
        assert_eq!(
            learn_gpu(&mut g, 4).expect("learned"),
            names(&[&["g0", "g1", "g2"]])
        );
        // it waited partly ready (g1 depends on g0): learned again, one group per cycle
        g.dissolved();
        assert_eq!(
            learn_gpu(&mut g, 4).expect("learned again"),
            names(&[&["g0"], &["g1"], &["g2"]])
        );
        g.dissolved();
        assert_eq!(learn_gpu(&mut g, 6), None);
    }

    #[test]
    fn gossip_steps_learn_the_groups_of_allreduce_steps_but_never_a_plan() {
        let step_of = |kind: OpKind, device: i32| -> Vec<Arc<Response>> {
            (0..3)
                .map(|k| {
                    let mut req = Request::test(&format!("g{k}"), kind, DataType::F32, &[4]);
                    req.device = device;
                    Arc::new(Response::from_request(&req))
                })
                .collect()
        };
        let learned = |kind: OpKind| {
            let mut g = GroupLearner::new(2);
            let mut learned = None;
            for _ in 0..4 {
                for r in step_of(kind, 0) {
                    learned = g.observe(&[r], ctx(), |_| false, &[]).or(learned);
                }
            }
            learned
        };
        let allreduce = learned(OpKind::Allreduce);
        assert!(allreduce.is_some());
        assert_eq!(learned(OpKind::Gossip), allreduce);
        // an offline plan's escape flag rides in an allreduce: gossip stays online
        let mut p = PlanLearner::new(2);
        for _ in 0..6 {
            p.observe(&step_of(OpKind::Gossip, CPU_DEVICE), ctx());
            assert!(p.take_ready().is_none());
        }
        let mut p = PlanLearner::new(2);
        let ready = (0..6).any(|_| {
            p.observe(&step_of(OpKind::Allreduce, CPU_DEVICE), ctx());
            p.take_ready().is_some()
        });
        assert!(ready, "the same step as allreduces freezes");
    }

    #[test]
    fn groups_are_learned_once_and_not_churned() {
        let mut g = GroupLearner::new(2);
        let mut current: Vec<Vec<String>> = Vec::new();
        let mut installed = Vec::new();
        for s in 0..8 {
            // one tensor per cycle, as a slow step agrees them
            for r in step(6) {
                let held = |n: &str| current.iter().flatten().any(|x| x == n);
                if let Some(groups) = g.observe(&[r], ctx(), held, &current) {
                    installed.push(s);
                    current = groups;
                }
            }
        }
        assert_eq!(installed.len(), 1, "installed at steps {installed:?}");
        assert_eq!(current.iter().flatten().count(), 6);
    }

    #[test]
    fn a_step_agreed_one_tensor_a_cycle_learns_groups_that_fit_one_vote_word() {
        let mut g = GroupLearner::new(2);
        let mut learned = None;
        for _ in 0..4 {
            for r in step(100) {
                learned = learned.or(g.observe(&[r], ctx(), |_| false, &[]));
            }
        }
        let groups = learned.expect("learned after two steps and one more");
        assert!(groups.len() <= GROUPS_PER_WORD, "{} groups", groups.len());
        // every tensor once, in the step's order
        let all: Vec<String> = groups.into_iter().flatten().collect();
        assert_eq!(all, (0..100).map(|k| format!("t{k}")).collect::<Vec<_>>());
    }

    #[test]
    fn learning_after_an_escape_mid_step_starts_with_what_the_plan_ran() {
        let all = step(5);
        let t = |k: usize| all[k].clone();
        // the plan ran t0 and t1, then a new tensor (t4) sent every rank back online
        let ran = [t(0), t(1)];
        let rest = [t(2), t(3), t(4)];
        // later steps agree their tensors in a different order each time
        let orders: [[usize; 4]; 5] = [
            [0, 1, 2, 3],
            [1, 2, 3, 0],
            [2, 3, 0, 1],
            [3, 0, 1, 2],
            [0, 1, 2, 3],
        ];
        let ready_after = |seeded: bool| {
            let mut p = if seeded {
                PlanLearner::resuming(2, ran.iter().map(|r| r.as_ref()))
            } else {
                PlanLearner::new(2)
            };
            p.observe(&rest, ctx());
            orders.iter().position(|order| {
                for &k in order {
                    p.observe(&[t(k)], ctx());
                }
                p.take_ready().is_some_and(|plan| plan.num_tensors() == 4)
            })
        };
        // two steps agree, the third arms and completes the plan
        assert_eq!(ready_after(true), Some(2));
        // cut mid-step, the recorder's steps are rotated and realign only by chance
        assert_eq!(ready_after(false), Some(4));
    }

    #[test]
    fn a_plan_is_ready_after_warmup_and_one_more_step_and_a_changed_step_starts_over() {
        let mut p = PlanLearner::new(2);
        let mut ready_at = None;
        for s in 0..5 {
            p.observe(&step(4), ctx());
            if let Some(plan) = p.take_ready() {
                assert_eq!(plan.num_tensors(), 4);
                ready_at.get_or_insert(s);
            }
        }
        // steps 0 and 1 agree; step 2's first response arms the plan, its last completes it
        assert_eq!(ready_at, Some(2));
        let mut p = PlanLearner::new(2);
        for _ in 0..2 {
            p.observe(&step(4), ctx());
        }
        p.observe(&step(4)[..1], ctx());
        assert!(
            p.take_ready().is_none(),
            "armed, waiting for the step to end"
        );
        // the step brings a tensor the plan lacks: learning starts over
        p.observe(&step(5)[4..], ctx());
        p.observe(&step(4)[1..], ctx());
        assert!(p.take_ready().is_none());
        // not while another set exists
        let mut p = PlanLearner::new(2);
        for _ in 0..6 {
            p.observe(
                &step(4),
                LearnContext {
                    alone: false,
                    ..ctx()
                },
            );
            assert!(p.take_ready().is_none());
        }
    }
}
