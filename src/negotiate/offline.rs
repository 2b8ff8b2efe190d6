//! Offline negotiation's steady state: the frozen plan's batches run in plan order, each as
//! soon as this rank holds all its tensors, with no control collective. Each batch carries one
//! extra element, the *escape flag*: a rank that holds work the plan cannot run (a new name, a
//! changed shape, another kind of collective, a shutdown), or that has waited too long for the
//! next batch while holding other tensors (it skipped one, or its order diverged), raises the
//! flag, contributing zeros if it lacks the batch's tensors. Every rank reads the reduced flag
//! of the same batch, so all of them discard that batch's result and hand everything pending
//! back to online negotiation at the same point. Pure: decisions here depend only on what this
//! rank submitted and on time; the agreement comes from the flag.

use std::time::{Duration, Instant};

use crate::hashing::HashMap;
use crate::message::{Request, Response};
use crate::negotiate::plan::Plan;

/// What the background loop should do next for the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Run batch `batch` with this rank's tensors, raising the flag if `escape`.
    Run { batch: usize, escape: bool },
    /// Run batch `batch` with zeros and the flag raised: this rank cannot run it and must not
    /// leave the others waiting inside the collective.
    Dummy { batch: usize },
    /// Nothing to do until more tensors arrive (or time passes).
    Wait,
}

/// When a rank gives up waiting for the next batch.
#[derive(Clone, Copy, Debug)]
pub struct EscapePolicy {
    /// Holding plan tensors of later batches while the next batch is incomplete.
    pub out_of_order: Duration,
    /// Holding work the plan cannot run.
    pub foreign: Duration,
}

pub struct OfflineQueue {
    plan: Plan,
    pos: usize,
    /// Plan tensors submitted and not yet run, with their submission sequence number.
    pending: HashMap<String, (u64, Request)>,
    /// Submissions the plan does not hold, in order.
    foreign: Vec<(u64, Request)>,
    escape_requested: bool,
    seq: u64,
    blocked_since: Option<Instant>,
    policy: EscapePolicy,
}

impl OfflineQueue {
    pub fn new(plan: Plan, policy: EscapePolicy) -> OfflineQueue {
        OfflineQueue {
            plan,
            pos: 0,
            pending: HashMap::default(),
            foreign: Vec::new(),
            escape_requested: false,
            seq: 0,
            blocked_since: None,
            policy,
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn submit(&mut self, req: Request) {
        self.seq += 1;
        if self.plan.accepts(&req) && !self.pending.contains_key(&req.name) {
            self.pending.insert(req.name.clone(), (self.seq, req));
        } else {
            self.foreign.push((self.seq, req));
        }
    }

    /// Leave offline mode at the next batch (shutdown, or work only online negotiation does).
    pub fn request_escape(&mut self) {
        self.escape_requested = true;
    }

    pub fn next(&mut self, now: Instant) -> Next {
        let batch = &self.plan.batches[self.pos];
        let escape = self.escape_requested || !self.foreign.is_empty();
        if batch.iter().all(|r| self.pending.contains_key(&r.name)) {
            self.blocked_since = None;
            return Next::Run {
                batch: self.pos,
                escape,
            };
        }
        // waiting only for this batch's own stragglers is normal; holding tensors of other
        // batches while this one stays incomplete is what may mean divergence
        let others = self
            .pending
            .keys()
            .any(|name| !batch.iter().any(|r| &r.name == name));
        if !escape && !others {
            self.blocked_since = None;
            return Next::Wait;
        }
        let since = *self.blocked_since.get_or_insert(now);
        let limit = if escape {
            self.policy.foreign
        } else {
            self.policy.out_of_order
        };
        if now.saturating_duration_since(since) >= limit {
            Next::Dummy { batch: self.pos }
        } else {
            Next::Wait
        }
    }

    /// Batch `pos` ran without anyone raising the flag: its names, now complete; the plan
    /// moves to the next batch (wrapping to the next step).
    pub fn complete_batch(&mut self) -> Vec<String> {
        let names: Vec<String> = self.plan.batches[self.pos]
            .iter()
            .map(|r| r.name.clone())
            .collect();
        for n in &names {
            self.pending.remove(n);
        }
        self.pos = (self.pos + 1) % self.plan.batches.len();
        self.blocked_since = None;
        names
    }

    /// The responses of the step in progress that ran from the plan (every rank is at the
    /// same batch).
    pub fn ran_this_step(&self) -> impl Iterator<Item = &Response> {
        self.plan.batches[..self.pos].iter().flatten()
    }

    /// Everything not yet run, in submission order, for online negotiation to take over.
    pub fn into_requests(self) -> Vec<Request> {
        let mut all: Vec<(u64, Request)> = self.pending.into_values().chain(self.foreign).collect();
        all.sort_by_key(|(seq, _)| *seq);
        all.into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;
    use crate::message::OpKind;

    fn req(name: &str, n: i64) -> Request {
        Request::test(name, OpKind::Allreduce, DataType::F32, &[n])
    }

    fn queue() -> OfflineQueue {
        let step: Vec<Response> = ["a", "b", "c"]
            .iter()
            .map(|n| Response::from_request(&req(n, 4)))
            .collect();
        // threshold 32 bytes: [a, b] then [c]
        let plan = Plan::from_step(&step, 32, 1 << 20, &crate::compress::Codecs::default());
        assert_eq!(plan.batches.len(), 2);
        OfflineQueue::new(
            plan,
            EscapePolicy {
                out_of_order: Duration::from_millis(100),
                foreign: Duration::from_millis(5),
            },
        )
    }

    #[test]
    fn batches_run_in_plan_order_when_complete() {
        let t = Instant::now();
        let mut q = queue();
        assert_eq!(q.next(t), Next::Wait);
        q.submit(req("b", 4));
        assert_eq!(q.next(t), Next::Wait);
        // a batch's own stragglers never count as divergence
        assert_eq!(q.next(t + Duration::from_secs(5)), Next::Wait);
        q.submit(req("a", 4));
        assert_eq!(
            q.next(t),
            Next::Run {
                batch: 0,
                escape: false
            }
        );
        assert_eq!(q.complete_batch(), ["a", "b"]);
        q.submit(req("c", 4));
        assert_eq!(
            q.next(t),
            Next::Run {
                batch: 1,
                escape: false
            }
        );
        q.complete_batch();
        // next step: back to batch 0
        q.submit(req("a", 4));
        assert_eq!(q.next(t), Next::Wait);
    }

    #[test]
    fn foreign_work_raises_the_flag_or_escapes_after_a_short_wait() {
        let t = Instant::now();
        let mut q = queue();
        q.submit(req("a", 4));
        q.submit(req("b", 5)); // changed shape: the plan cannot run it
        assert_eq!(q.next(t), Next::Wait);
        assert_eq!(
            q.next(t + Duration::from_millis(6)),
            Next::Dummy { batch: 0 }
        );
        let back: Vec<String> = q.into_requests().into_iter().map(|r| r.name).collect();
        assert_eq!(back, ["a", "b"], "submission order");

        let mut q = queue();
        q.submit(req("a", 4));
        q.submit(req("b", 4));
        q.submit(req("new", 1));
        assert_eq!(
            q.next(t),
            Next::Run {
                batch: 0,
                escape: true
            }
        );
    }

    #[test]
    fn a_missing_tensor_escapes_after_the_out_of_order_wait() {
        let t = Instant::now();
        let mut q = queue();
        q.submit(req("c", 4)); // batch 1's tensor while batch 0 never completes
        assert_eq!(q.next(t), Next::Wait);
        assert_eq!(q.next(t + Duration::from_millis(99)), Next::Wait);
        assert_eq!(
            q.next(t + Duration::from_millis(100)),
            Next::Dummy { batch: 0 }
        );
        let mut q = queue();
        q.request_escape();
        assert_eq!(q.next(t + Duration::from_millis(10)), Next::Wait);
        assert_eq!(
            q.next(t + Duration::from_millis(20)),
            Next::Dummy { batch: 0 }
        );
    }
}
