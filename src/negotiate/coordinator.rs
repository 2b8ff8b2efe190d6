//! The coordinator's table (set rank 0): collects first-sight requests from every rank until a
//! name is ready everywhere, then turns it into a response. Pure: time is passed in.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::hashing::HashMap;
use crate::message::{OpKind, Request, Response};
use crate::negotiate::validate::construct_response;
use crate::negotiate::wire::OpTimeout;

struct Pending {
    by_rank: Vec<Option<Request>>,
    first_seen: Instant,
    /// The earliest deadline an operation's own timeout gave it on any rank, with that timeout.
    deadline: Option<(Instant, Duration)>,
}

/// A name waiting for some ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Stalled {
    pub name: String,
    pub missing: Vec<i32>,
    pub waited: Duration,
}

pub struct Coordinator {
    size: usize,
    table: HashMap<String, Pending>,
    /// Names in the order they were first seen, so responses come out in a stable order.
    arrival: Vec<String>,
    joined: BTreeSet<i32>,
    last_joined: i32,
}

impl Coordinator {
    pub fn new(size: usize) -> Self {
        Coordinator {
            size,
            table: HashMap::default(),
            arrival: Vec::new(),
            joined: BTreeSet::new(),
            last_joined: -1,
        }
    }

    pub fn joined(&self) -> Vec<i32> {
        self.joined.iter().copied().collect()
    }

    pub fn has_pending(&self) -> bool {
        !self.table.is_empty()
    }

    /// Adds one cycle's requests (each rank's list, in rank order) and returns the responses
    /// that became ready, in a deterministic order.
    pub fn add_round(&mut self, lists: Vec<Vec<Request>>, now: Instant) -> Vec<Response> {
        for (rank, list) in lists.into_iter().enumerate() {
            for mut req in list {
                req.rank = rank as i32;
                if req.kind == OpKind::Join {
                    self.joined.insert(rank as i32);
                    self.last_joined = rank as i32;
                    continue;
                }
                let entry = self.table.entry(req.name.clone()).or_insert_with(|| {
                    self.arrival.push(req.name.clone());
                    Pending {
                        by_rank: vec![None; self.size],
                        first_seen: now,
                        deadline: None,
                    }
                });
                entry.by_rank[rank] = Some(req);
            }
        }
        let mut ready = Vec::new();
        let mut still = Vec::new();
        for name in std::mem::take(&mut self.arrival) {
            let p = &self.table[&name];
            let complete = p
                .by_rank
                .iter()
                .enumerate()
                .all(|(r, q)| q.is_some() || self.joined.contains(&(r as i32)));
            let any_present = p.by_rank.iter().any(Option::is_some);
            if complete && any_present {
                let p = self.table.remove(&name).expect("present");
                let reqs: Vec<Request> = p.by_rank.into_iter().flatten().collect();
                ready.push(construct_response(
                    &reqs,
                    !self.joined.is_empty(),
                    self.size,
                ));
            } else {
                still.push(name);
            }
        }
        self.arrival = still;
        if self.joined.len() == self.size {
            let mut join = Response::from_request(&Request {
                rank: 0,
                kind: OpKind::Join,
                dtype: crate::dtype::DataType::I32,
                name: crate::message::JOIN_NAME.into(),
                shape: vec![],
                root: 0,
                device: crate::message::CPU_DEVICE,
                reduce_op: crate::message::ReduceOp::Sum,
                prescale: 1.0,
                postscale: 1.0,
                compression: None,
                multistep: crate::message::Multistep::EVERY_CALL,
            });
            join.result = self.last_joined;
            ready.push(join);
            self.joined.clear();
        }
        ready
    }

    /// Gives the pending names the deadlines their operations' own timeouts set (`(name,
    /// timeout)` as the requests carried them, after `add_round` took the requests); a name
    /// keeps its earliest deadline.
    pub fn add_timeouts<'a>(
        &mut self,
        timeouts: impl IntoIterator<Item = (&'a str, OpTimeout)>,
        now: Instant,
    ) {
        for (name, t) in timeouts {
            if let Some(p) = self.table.get_mut(name) {
                let at = now + t.timeout.saturating_sub(t.waited);
                if p.deadline.is_none_or(|(d, _)| at < d) {
                    p.deadline = Some((at, t.timeout));
                }
            }
        }
    }

    /// Whether a pending name's own timeout has run out.
    pub fn any_timed_out(&self, now: Instant) -> bool {
        self.table
            .values()
            .any(|p| p.deadline.is_some_and(|(d, _)| d <= now))
    }

    /// The pending names whose operation's own timeout has run out, with the ranks that never
    /// submitted them and that timeout.
    pub fn timed_out(&self, now: Instant) -> Vec<(Stalled, Duration)> {
        self.arrival
            .iter()
            .filter_map(|name| {
                let p = &self.table[name];
                let (at, timeout) = p.deadline.filter(|(d, _)| *d <= now)?;
                let stalled = Stalled {
                    name: name.clone(),
                    missing: self.missing(p),
                    waited: now.saturating_duration_since(at) + timeout,
                };
                Some((stalled, timeout))
            })
            .collect()
    }

    fn missing(&self, p: &Pending) -> Vec<i32> {
        (p.by_rank.iter().enumerate())
            .filter(|(r, q)| q.is_none() && !self.joined.contains(&(*r as i32)))
            .map(|(r, _)| r as i32)
            .collect()
    }

    /// Names that have waited at least `older_than`, with the ranks that never submitted them.
    pub fn stalled(&self, now: Instant, older_than: Duration) -> Vec<Stalled> {
        self.arrival
            .iter()
            .filter_map(|name| {
                let p = &self.table[name];
                let waited = now.saturating_duration_since(p.first_seen);
                (waited >= older_than).then(|| Stalled {
                    name: name.clone(),
                    missing: self.missing(p),
                    waited,
                })
            })
            .collect()
    }
}

/// The shutdown reason when operations' own timeouts ran out: each name, its timeout and the
/// ranks (global) that never submitted it. Says "Timed out" and " timeout " as PyTorch's
/// backends do (its tests look for either).
pub fn timeout_report(timed_out: &[(Stalled, Duration)], global_ranks: &[i32]) -> String {
    let each: Vec<String> = (timed_out.iter().take(6))
        .map(|(s, t)| {
            let ranks: Vec<i32> = (s.missing.iter())
                .map(|r| global_ranks.get(*r as usize).copied().unwrap_or(*r))
                .collect();
            format!(
                "'{}' waited {:.1} s for rank(s) {ranks:?}, past its operation's timeout of {:.1} s",
                s.name,
                s.waited.as_secs_f64(),
                t.as_secs_f64()
            )
        })
        .collect();
    let more = match timed_out.len() > 6 {
        true => format!(" and {} more", timed_out.len() - 6),
        false => String::new(),
    };
    format!(
        "Timed out waiting for ranks that never submitted the same operation: {}{more}; shutting down.",
        each.join("; ")
    )
}

/// Horovod's stall report: the warning, then for each missing rank up to six tensor names.
pub fn stall_report(stalled: &[Stalled], global_ranks: &[i32], seconds: u64) -> String {
    let mut by_rank: std::collections::BTreeMap<i32, Vec<&str>> = Default::default();
    for s in stalled {
        for &r in &s.missing {
            by_rank
                .entry(global_ranks.get(r as usize).copied().unwrap_or(r))
                .or_default()
                .push(&s.name);
        }
    }
    let mut msg = format!(
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder of ranks for more than {seconds} seconds. This may indicate that different ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, which will cause deadlock.\nMissing ranks:"
    );
    for (rank, names) in by_rank {
        let shown: Vec<&str> = names.iter().take(6).copied().collect();
        let more = if names.len() > 6 { " ..." } else { "" };
        msg.push_str(&format!("\n{rank}: [{}{more}]", shown.join(", ")));
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;

    fn req(name: &str, kind: OpKind) -> Request {
        Request::test(name, kind, DataType::F32, &[2])
    }

    #[test]
    fn ready_only_when_every_rank_submitted() {
        let mut c = Coordinator::new(3);
        let t0 = Instant::now();
        let out = c.add_round(
            vec![
                vec![req("a", OpKind::Allreduce), req("b", OpKind::Allreduce)],
                vec![req("b", OpKind::Allreduce)],
                vec![],
            ],
            t0,
        );
        assert!(out.is_empty());
        let out = c.add_round(
            vec![
                vec![],
                vec![req("a", OpKind::Allreduce)],
                vec![req("b", OpKind::Allreduce)],
            ],
            t0,
        );
        assert_eq!(
            out.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            vec!["b"]
        );
        let st = c.stalled(t0 + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(st.len(), 1);
        assert_eq!(st[0].name, "a");
        assert_eq!(st[0].missing, vec![2]);
        assert!(c.stalled(t0, Duration::from_secs(60)).is_empty());
        let report = stall_report(&st, &[0, 1, 2], 60);
        assert!(report.contains("Missing ranks:\n2: [a]"), "{report}");
    }

    #[test]
    fn an_operations_own_timeout_counts_from_its_submission() {
        let mut c = Coordinator::new(3);
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let out = c.add_round(
            vec![
                vec![req("a", OpKind::Allreduce), req("b", OpKind::Allreduce)],
                vec![],
                vec![],
            ],
            t0,
        );
        assert!(out.is_empty());
        assert!(
            !c.any_timed_out(t0 + secs(3600)),
            "no timeout given: none runs out"
        );
        // rank 0 had waited 1 s of a's 3 s before sending it; b's rank gave it 10 s
        let t = |timeout, waited| OpTimeout {
            timeout: secs(timeout),
            waited: secs(waited),
        };
        c.add_timeouts([("a", t(3, 1)), ("b", t(10, 0)), ("gone", t(1, 5))], t0);
        // another rank's later, longer deadline for a does not move the earlier one
        c.add_timeouts([("a", t(30, 0))], t0);
        assert!(!c.any_timed_out(t0 + Duration::from_millis(1999)));
        assert!(c.any_timed_out(t0 + secs(2)));
        let out = c.timed_out(t0 + secs(2));
        assert_eq!(out.len(), 1);
        let (s, timeout) = &out[0];
        assert_eq!(
            (s.name.as_str(), *timeout, s.waited),
            ("a", secs(3), secs(3))
        );
        assert_eq!(s.missing, vec![1, 2]);
        let report = timeout_report(&out, &[4, 5, 6]);
        assert!(
            report.starts_with("Timed out waiting for ranks"),
            "{report}"
        );
        assert!(
            report.contains(
                "'a' waited 3.0 s for rank(s) [5, 6], past its operation's timeout of 3.0 s"
            ),
            "{report}"
        );
        // a name that completes takes its deadline with it
        let out = c.add_round(
            vec![
                vec![],
                vec![req("a", OpKind::Allreduce)],
                vec![req("a", OpKind::Allreduce)],
            ],
            t0,
        );
        assert_eq!(out.len(), 1);
        assert!(c.timed_out(t0 + secs(5)).is_empty());
        assert_eq!(c.timed_out(t0 + secs(10))[0].0.name, "b");
    }

    #[test]
    fn joined_ranks_count_as_ready_and_release_together() {
        let mut c = Coordinator::new(2);
        let t = Instant::now();
        let out = c.add_round(
            vec![
                vec![req("g", OpKind::Allreduce)],
                vec![req("j", OpKind::Join)],
            ],
            t,
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].name, "g");
        assert_eq!(out[0].error, None);
        assert_eq!(c.joined(), vec![1]);
        let out = c.add_round(vec![vec![req("ag", OpKind::Allgather)], vec![]], t);
        assert!(
            out[0]
                .error
                .as_deref()
                .unwrap()
                .starts_with("Allgather is not supported with Join")
        );
        let out = c.add_round(vec![vec![req("j", OpKind::Join)], vec![]], t);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].kind, OpKind::Join);
        assert_eq!(out[0].result, 0);
        assert!(c.joined().is_empty());
    }

    #[test]
    fn mismatch_becomes_error_response() {
        let mut c = Coordinator::new(2);
        let mut b = req("x", OpKind::Allreduce);
        b.dtype = DataType::I64;
        let out = c.add_round(
            vec![vec![req("x", OpKind::Allreduce)], vec![b]],
            Instant::now(),
        );
        assert!(
            out[0]
                .error
                .as_deref()
                .unwrap()
                .contains("Mismatched data types")
        );
    }
}
