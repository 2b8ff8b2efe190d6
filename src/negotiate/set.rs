//! One process set's negotiation, whichever the mode: Horovod's (every name through the
//! coordinator or the cache), online (the global set also learns the step's batches and votes
//! one bit per batch) or offline (the global set learns a plan, freezes it and then runs its
//! batches with no control collective until a rank raises the escape flag). The background loop
//! asks for the next step of work and reports what ran; it never looks at the mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, NegotiationMode};
use crate::error::{Error, Result};
use crate::message::{Request, Response};
use crate::negotiate::learn::{GroupLearner, LearnContext, PlanLearner};
use crate::negotiate::offline::{EscapePolicy, Next, OfflineQueue};
use crate::negotiate::online::{CycleOutcome, Negotiator};
use crate::negotiate::plan::{Plan, agree_on_plan, agreed_plan_file};
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

/// What the set does next.
pub enum Step {
    /// A vote ran: run what it agreed.
    Voted(CycleOutcome),
    /// Offline: run this plan batch with the escape flag, then report it (`plan_batch_ran`).
    Plan(PlanBatch),
    /// Nothing now: the frozen plan's next batch is not complete here yet.
    Idle,
}

/// A batch of the frozen plan, identical on every rank.
pub struct PlanBatch {
    /// Its position in the plan.
    pub index: usize,
    pub responses: Vec<Response>,
    /// This rank raises the escape flag.
    pub raise: bool,
    /// This rank holds the batch's tensors (else it contributes zeros with the flag raised).
    pub have: bool,
}

/// Control traffic outside the vote (for metrics).
pub struct Control {
    pub collectives: u64,
    pub bytes: u64,
    pub elapsed: Duration,
}

/// A plan that was ready to freeze, after the ranks compared it.
pub struct Freeze {
    pub control: Control,
    /// Requests that waited for a vote and now wait for the plan (their negotiation ends).
    pub handed_to_plan: Vec<String>,
}

enum Mode {
    /// Horovod's negotiation, or a set other than the global one.
    Plain,
    /// Online: learning the step's batches to vote one bit each.
    Groups(GroupLearner),
    /// Offline: negotiating online while learning a plan. Steps a plan cannot hold (GPU
    /// tensors: the plan's escape flag rides in a host allreduce) never freeze, so meanwhile
    /// the votes carry learned groups, as online.
    Learning(PlanLearner, Box<GroupLearner>),
    /// Offline: running the plan.
    Frozen(OfflineQueue),
}

pub struct SetNegotiation {
    negotiator: Negotiator,
    mode: Mode,
    warmup: usize,
    escape: EscapePolicy,
    /// How long a learned group may be partly ready here before this rank dissolves it.
    group_patience: Duration,
}

impl SetNegotiation {
    /// `mode` and `warmup` (steps agreed before a plan or groups are learned) as rank 0
    /// decided; `global`: the set of every rank, the only one that learns groups or plans.
    pub fn new(
        negotiator: Negotiator,
        mode: NegotiationMode,
        warmup: usize,
        global: bool,
        cfg: &Config,
    ) -> Self {
        let mode = match (global, mode) {
            (true, NegotiationMode::Online) => Mode::Groups(GroupLearner::new(warmup)),
            (true, NegotiationMode::Offline) => Mode::Learning(
                PlanLearner::new(warmup),
                Box::new(GroupLearner::new(warmup)),
            ),
            _ => Mode::Plain,
        };
        SetNegotiation {
            negotiator,
            mode,
            warmup,
            escape: EscapePolicy {
                out_of_order: cfg.plan_escape,
                foreign: (cfg.cycle_time * 5).max(Duration::from_millis(5)),
            },
            group_patience: cfg.plan_escape,
        }
    }

    /// Offline mode at init (collective over `ctrl`): runs the plan file's plan when every rank
    /// loaded the same one and the global set is `alone`, else keeps learning.
    pub fn load_plan(&mut self, ctrl: &MpiComm, path: Option<&str>, alone: bool) -> Result<()> {
        if !matches!(self.mode, Mode::Learning(..)) {
            return Ok(());
        }
        match agreed_plan_file(ctrl, path)? {
            Some(plan) if alone => {
                tracing::info!(
                    "offline negotiation: running the plan from {} ({} tensors in {} batches)",
                    path.unwrap_or(""),
                    plan.num_tensors(),
                    plan.batches.len()
                );
                self.mode = Mode::Frozen(OfflineQueue::new(plan, self.escape));
            }
            Some(_) => tracing::warn!(
                "offline negotiation: the plan file cannot run while other process sets exist; learning online"
            ),
            None => {}
        }
        Ok(())
    }

    /// Takes a submission; true when it is negotiated (not run by a frozen plan). `timeout`:
    /// the operation's own bound on waiting for the other ranks (a frozen plan has none: every
    /// rank runs it in the plan's order).
    pub fn submit(&mut self, req: &Arc<Request>, timeout: Option<Duration>, now: Instant) -> bool {
        match &mut self.mode {
            Mode::Frozen(q) => {
                q.submit(Request::clone(req));
                false
            }
            _ => {
                self.negotiator.submit(req.clone(), timeout, now);
                true
            }
        }
    }

    /// Whether to step now rather than at the timer: a frozen plan runs its batches as soon as
    /// they are complete; otherwise when a vote could agree on more.
    pub fn wants_step(&self) -> bool {
        matches!(self.mode, Mode::Frozen(_)) || self.negotiator.wants_vote()
    }

    /// Whether tensors wait on work a step soon could do; `pending`: this rank holds tensors
    /// of the set not yet run.
    pub fn waiting(&self, pending: bool) -> bool {
        match self.mode {
            Mode::Frozen(_) => pending,
            _ => self.negotiator.could_agree() || self.negotiator.has_sent(),
        }
    }

    /// The next step of work. Every member calls this the same number of times, in the same
    /// order relative to other sets; a frozen plan is asked until it returns `Idle` or a batch
    /// escapes. `abort_gpu` (with `want_shutdown`): this rank's GPU work failed after
    /// agreement; `gpu_moved`: a GPU tensor submitted here at new addresses is not launched.
    pub fn next(
        &mut self,
        ctrl: &MpiComm,
        want_shutdown: bool,
        abort_gpu: bool,
        gpu_moved: bool,
        now: Instant,
    ) -> Result<Step> {
        let Mode::Frozen(q) = &mut self.mode else {
            return self
                .negotiator
                .cycle(ctrl, want_shutdown, abort_gpu, gpu_moved, now)
                .map(Step::Voted);
        };
        if want_shutdown {
            // the flag takes every rank back online, where the vote carries the shutdown
            q.request_escape();
        }
        let (index, raise, have) = match q.next(now) {
            Next::Run { batch, escape } => (batch, escape, true),
            Next::Dummy { batch } => (batch, true, false),
            Next::Wait => return Ok(Step::Idle),
        };
        Ok(Step::Plan(PlanBatch {
            index,
            responses: q.plan().batches[index].clone(),
            raise,
            have,
        }))
    }

    /// The plan batch last returned ran; `escaped`: some rank raised the flag, so it did not
    /// count and every rank negotiates online from here. Returns the requests handed back to
    /// online negotiation (their negotiation starts).
    pub fn plan_batch_ran(&mut self, escaped: bool, now: Instant) -> Vec<Arc<Request>> {
        if !escaped {
            if let Mode::Frozen(q) = &mut self.mode {
                q.complete_batch();
            }
            return Vec::new();
        }
        let (learner, groups) = match &self.mode {
            Mode::Frozen(q) => (
                PlanLearner::resuming(self.warmup, q.ran_this_step()),
                GroupLearner::resuming(self.warmup, q.ran_this_step()),
            ),
            _ => (
                PlanLearner::new(self.warmup),
                GroupLearner::new(self.warmup),
            ),
        };
        let learning = Mode::Learning(learner, Box::new(groups));
        let Mode::Frozen(q) = std::mem::replace(&mut self.mode, learning) else {
            return Vec::new();
        };
        q.into_requests()
            .into_iter()
            .map(|req| {
                let req = Arc::new(req);
                // a frozen plan kept no timeouts: the stall limit bounds these
                self.negotiator.submit(req.clone(), None, now);
                req
            })
            .collect()
    }

    /// Learns from a vote's agreed responses, after they were launched (identically on every
    /// rank: it shapes only later votes). `ctx.alone`: the global set was the only set while
    /// they ran; `dissolved`: the vote dissolved learned groups (`CycleOutcome`).
    pub fn observe(&mut self, responses: &[Arc<Response>], ctx: LearnContext, dissolved: bool) {
        let group = |g: &mut GroupLearner, negotiator: &mut Negotiator| {
            if dissolved {
                g.dissolved();
            }
            let held = |name: &str| negotiator.in_group(name);
            if let Some(groups) = g.observe(responses, ctx, held, negotiator.groups()) {
                negotiator.set_groups(groups, self.group_patience);
            }
        };
        match &mut self.mode {
            Mode::Groups(g) => group(g, &mut self.negotiator),
            Mode::Learning(learner, g) => {
                // a plan needs the global set alone and no joined rank
                let plan_ctx = LearnContext {
                    alone: ctx.alone && !self.negotiator.any_joined(),
                    ..ctx
                };
                learner.observe(responses, plan_ctx);
                group(g, &mut self.negotiator);
            }
            Mode::Plain | Mode::Frozen(_) => {}
        }
    }

    /// Freezes a learned plan once its step has run: the ranks compare plan hashes over `ctrl`
    /// (one allgather), then the set runs the plan; rank 0 writes it to `plan_file`. `None`
    /// when no plan was ready.
    pub fn freeze_if_ready(
        &mut self,
        ctrl: &MpiComm,
        plan_file: Option<&str>,
        me: i32,
    ) -> Result<Option<Freeze>> {
        let Mode::Learning(learner, _) = &mut self.mode else {
            return Ok(None);
        };
        let Some(plan) = learner.take_ready() else {
            return Ok(None);
        };
        if crate::config::test_fault("freeze", me) {
            return Err(Error::Internal("test fault: freeze".into()));
        }
        let started = Instant::now();
        let agreed = agree_on_plan(ctrl, &plan, plan_file)?;
        let control = Control {
            collectives: 1,
            bytes: 8 * ctrl.size() as u64,
            elapsed: started.elapsed(),
        };
        if !agreed {
            // the learner already starts over (take_ready)
            return Ok(Some(Freeze {
                control,
                handed_to_plan: Vec::new(),
            }));
        }
        Ok(Some(Freeze {
            control,
            handed_to_plan: self.freeze(plan),
        }))
    }

    /// Runs `plan` from now on; returns the names of the requests that waited for a vote.
    fn freeze(&mut self, plan: Plan) -> Vec<String> {
        tracing::info!(
            "offline negotiation: plan frozen ({} tensors in {} batches)",
            plan.num_tensors(),
            plan.batches.len()
        );
        let mut q = OfflineQueue::new(plan, self.escape);
        let names = self
            .negotiator
            .take_waiting()
            .into_iter()
            .map(|req| {
                let name = req.name.clone();
                q.submit(req);
                name
            })
            .collect();
        if self.negotiator.has_sent() {
            // a request waits for a coordinator round: only online negotiation can finish it
            q.request_escape();
        }
        // the plan replaces the groups; after an escape, groups are learned again
        self.negotiator.set_groups(Vec::new(), self.group_patience);
        self.mode = Mode::Frozen(q);
        names
    }
}
