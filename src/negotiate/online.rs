//! One rank's negotiation state for one process set, advanced once per cycle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::NegotiationMode;
use crate::error::{Error, Result};
use crate::hashing::HashMap;
use crate::message::{OpKind, Request, Response};
use crate::negotiate::cache::{Lookup, ResponseCache};
use crate::negotiate::coordinator::{Coordinator, stall_report, timeout_report};
use crate::negotiate::ready_bitmap::{self, Vote};
use crate::negotiate::wire::{self, RequestList, ResponseList};
use crate::transport::Transport;

use crate::config::StallPolicy;

/// What one cycle decided.
#[derive(Debug, Default)]
pub struct CycleOutcome {
    /// Responses to execute now, in the same order on every rank.
    pub responses: Vec<Arc<Response>>,
    /// The first responses come group by group (learned batches agreed with one bit): each
    /// group's size, in order. A group is fused on its own, so that groups agreed in one vote
    /// still run as separate collectives (on separate streams).
    pub groups: Vec<usize>,
    /// Some rank asked to shut down, or the coordinator shut the job down (with the reason).
    pub shutdown: Option<String>,
    /// With the shutdown: some rank's GPU collective failed after agreement, so GPU work
    /// still running everywhere cannot finish and is to be aborted at once.
    pub abort_gpu: bool,
    /// Some rank's GPU tensors moved (or a rank has joined): nothing agreed now is replayed
    /// from a graph captured before (`collective::replay`).
    pub gpu_moved: bool,
    /// Learned groups were dissolved (agreed): one waited partly ready past its patience, or
    /// ready but unagreed past the stall check time (`learn::GroupLearner::dissolved`).
    pub groups_dissolved: bool,
    /// Control collectives this cycle issued (for metrics).
    pub control_collectives: u32,
    /// Bytes this rank contributed to them.
    pub control_bytes: u64,
}

struct Waiting {
    /// Shared with the tensor's entry: a submission costs no copy of its name and shape.
    req: Arc<Request>,
    since: Instant,
    /// The operation's own bound on waiting for the other ranks (`OpSpec::timeout`).
    timeout: Option<Duration>,
    /// Its cache lookup and group, for the cache and groups generations they were found in:
    /// a burst of tensors waits through many votes, which need not look them up again.
    found: Option<((u64, u64), Lookup, Option<usize>)>,
}

pub struct Negotiator {
    cache: ResponseCache,
    coordinator: Option<Coordinator>,
    waiting: Vec<Waiting>,
    /// Requests sent to the coordinator and not yet answered, by name.
    sent: HashMap<String, Request>,
    /// Set ranks currently joined (as last announced by the coordinator).
    joined: Vec<i32>,
    /// This rank has joined and is waiting for the JOIN response.
    self_joined: bool,
    /// A GPU tensor was agreed in this set (identical on every rank): from then on the votes
    /// carry the "GPU tensors moved" flag.
    gpu_agreed: bool,
    stall: StallPolicy,
    last_stall_check: Instant,
    /// Global ranks of the set, for reports.
    global_ranks: Vec<i32>,
    set_rank: usize,
    mode: NegotiationMode,
    /// Online mode with a learned plan: its batches, each voted with one bit (names, in order).
    groups: Vec<Vec<String>>,
    /// How long a group may be partly ready here before this rank dissolves it.
    group_patience: Duration,
    /// Bumped whenever `groups` changes.
    groups_generation: u64,
    /// What the vote needs to know about the groups, kept while neither they nor the cache's
    /// bits change (rebuilding it every cycle cost tens of microseconds at 161 tensors).
    index: Option<((u64, u64), GroupIndex)>,
    /// Members of each group waiting here, counted since the last vote (empty: unknown).
    group_arrived: Vec<usize>,
    /// Whether a submission since the last vote could let a vote agree on more: it completed
    /// a group here, or it votes on its own. Submissions into a group still incomplete here
    /// change nothing a vote could agree on.
    fresh: bool,
}

/// The groups seen from the cache: each member's group, and the bits voted on singly.
struct GroupIndex {
    group_of: HashMap<String, usize>,
    /// Cache bits outside every group, in order: single tensors vote with their position here.
    singles: Vec<usize>,
    /// Cache bit to its position in `singles`.
    compact: HashMap<usize, usize>,
}

impl Negotiator {
    pub fn new(
        set_rank: usize,
        global_ranks: Vec<i32>,
        cache_capacity: usize,
        mode: NegotiationMode,
        stall: StallPolicy,
    ) -> Self {
        Negotiator {
            cache: ResponseCache::new(cache_capacity),
            coordinator: (set_rank == 0).then(|| Coordinator::new(global_ranks.len())),
            waiting: Vec::new(),
            sent: HashMap::default(),
            joined: Vec::new(),
            self_joined: false,
            gpu_agreed: false,
            stall,
            last_stall_check: Instant::now(),
            global_ranks,
            set_rank,
            mode,
            groups: Vec::new(),
            group_patience: Duration::from_secs(1),
            groups_generation: 0,
            index: None,
            group_arrived: Vec::new(),
            fresh: false,
        }
    }

    /// Drops groups that lost a member to the cache (the cache is identical on every rank, so
    /// they drop everywhere alike) and indexes the rest.
    fn index_groups(&mut self) -> GroupIndex {
        let cache = &self.cache;
        let before = self.groups.len();
        self.groups
            .retain(|g| g.iter().all(|n| cache.bit_of(n).is_some()));
        if self.groups.len() != before {
            self.groups_generation += 1;
        }
        let mut group_of = HashMap::default();
        let mut member_bits = crate::hashing::HashSet::default();
        for (g, names) in self.groups.iter().enumerate() {
            for n in names {
                group_of.insert(n.clone(), g);
                member_bits.insert(self.cache.bit_of(n).expect("retained above"));
            }
        }
        let singles: Vec<usize> = (0..self.cache.num_bits())
            .filter(|b| !member_bits.contains(b))
            .collect();
        let compact = singles.iter().enumerate().map(|(i, b)| (*b, i)).collect();
        GroupIndex {
            group_of,
            singles,
            compact,
        }
    }

    /// Votes for these plan batches with one bit each from the next cycle (online mode, and
    /// offline mode while no plan runs; call at the same point on every rank). Members must be
    /// cached; groups that lose a member to the cache are dropped everywhere alike.
    pub fn set_groups(&mut self, groups: Vec<Vec<String>>, patience: Duration) {
        if self.mode != NegotiationMode::Horovod {
            self.groups = groups;
            self.groups_generation += 1;
            self.group_patience = patience;
        }
    }

    /// The last vote's index of the groups, while the groups and the cache are as it saw them.
    fn current_index(&self) -> Option<&GroupIndex> {
        match &self.index {
            Some((key, index)) if *key == (self.cache.generation(), self.groups_generation) => {
                Some(index)
            }
            _ => None,
        }
    }

    /// Whether `name` belongs to one of the groups voted on now.
    pub fn in_group(&self, name: &str) -> bool {
        match self.current_index() {
            Some(index) => index.group_of.contains_key(name),
            None => self.groups.iter().flatten().any(|n| n == name),
        }
    }

    /// The groups voted on now (names, in order).
    pub fn groups(&self) -> &[Vec<String>] {
        &self.groups
    }

    pub fn submit(&mut self, req: Arc<Request>, timeout: Option<Duration>, now: Instant) {
        // looked up now, while the rank waits for the rest of its step, rather than in the vote
        // that agrees on it (a learned bucket's last vote looked up its 130 tensors)
        let key = (self.cache.generation(), self.groups_generation);
        let found = match &self.index {
            Some((k, index)) if *k == key => Some((
                key,
                self.cache.lookup(&req),
                index.group_of.get(&req.name).copied(),
            )),
            _ => None,
        };
        if !self.fills_incomplete_group(found.and_then(|f| f.2)) {
            self.fresh = true;
        }
        self.waiting.push(Waiting {
            req,
            since: now,
            timeout,
            found,
        });
    }

    /// Counts a submission towards its group (`group`, by the groups indexed at the last vote);
    /// true while that group still lacks members here.
    fn fills_incomplete_group(&mut self, group: Option<usize>) -> bool {
        let Some(g) = group else {
            return false;
        };
        let (Some(n), Some(members)) = (self.group_arrived.get_mut(g), self.groups.get(g)) else {
            return false;
        };
        *n += 1;
        *n < members.len()
    }

    /// Whether a vote now could agree on something the last one could not (see `fresh`).
    /// Votes are collective, so this only times them; a rank votes at its timer regardless.
    pub fn wants_vote(&self) -> bool {
        self.fresh
    }

    /// Whether this rank's vote could agree on anything now: false while everything waiting
    /// here belongs to groups that are incomplete here (the vote would carry no bit).
    pub fn could_agree(&self) -> bool {
        if self.waiting.is_empty() {
            return false;
        }
        let counted: usize = self.group_arrived.iter().sum();
        !(self.current_index().is_some()
            && counted == self.waiting.len()
            && self
                .group_arrived
                .iter()
                .zip(&self.groups)
                .all(|(n, members)| *n < members.len()))
    }

    /// Takes the requests not yet agreed or sent to the coordinator (offline mode takes them
    /// over when its plan freezes).
    pub fn take_waiting(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.waiting)
            .into_iter()
            .map(|w| Arc::unwrap_or_clone(w.req))
            .collect()
    }

    /// Whether some rank of the set has joined (as the coordinator last announced; agreed).
    pub fn any_joined(&self) -> bool {
        !self.joined.is_empty()
    }

    /// Requests sent to the coordinator and not answered yet.
    pub fn has_sent(&self) -> bool {
        !self.sent.is_empty()
    }

    /// An invariant broken after the vote agreed: the other ranks go on into the collectives
    /// it agreed on, so this rank cannot simply leave; a job of several ranks is aborted.
    fn broken_after_vote(&self, what: String) -> Error {
        if self.global_ranks.len() > 1 {
            crate::transport::mpi::abort_job(&format!(
                "ferrovod: internal error on rank {} after a vote: {what}; aborting the job so that no rank waits for this one",
                self.global_ranks[self.set_rank]
            ));
        }
        Error::Internal(what)
    }

    /// Runs one negotiation cycle over `ctrl`. All members of the set must call this the same
    /// number of times, in the same order relative to other sets. `abort_gpu` (with
    /// `want_shutdown`): this rank's GPU work failed after agreement. `gpu_moved`: a GPU
    /// tensor submitted here at new addresses is not launched yet.
    pub fn cycle(
        &mut self,
        ctrl: &dyn Transport,
        want_shutdown: bool,
        abort_gpu: bool,
        gpu_moved: bool,
        now: Instant,
    ) -> Result<CycleOutcome> {
        let out = self.agree(ctrl, want_shutdown, abort_gpu, gpu_moved, now)?;
        if !self.gpu_agreed {
            self.gpu_agreed = out
                .responses
                .iter()
                .any(|r| r.device != crate::message::CPU_DEVICE);
        }
        Ok(out)
    }

    /// One cycle's agreement (`cycle` also notes whether it agreed on a GPU tensor).
    fn agree(
        &mut self,
        ctrl: &dyn Transport,
        want_shutdown: bool,
        abort_gpu: bool,
        gpu_moved: bool,
        now: Instant,
    ) -> Result<CycleOutcome> {
        let mut out = CycleOutcome::default();
        self.fresh = false;
        let stall_check_due = self.stall.enabled
            && now.saturating_duration_since(self.last_stall_check) >= self.stall.warn_after;

        let index = match self.index.take() {
            Some((k, index)) if k == (self.cache.generation(), self.groups_generation) => index,
            _ => self.index_groups(),
        };
        // after indexing, which may have dropped groups
        let key = (self.cache.generation(), self.groups_generation);
        let GroupIndex {
            group_of,
            singles,
            compact,
        } = &index;
        let mut group_ready = vec![0usize; self.groups.len()];
        let mut group_oldest: Vec<Option<Instant>> = vec![None; self.groups.len()];

        // 1. classify local requests
        let mut vote = Vote {
            shutdown: want_shutdown,
            ..Vote::default()
        };
        let mut to_send: Vec<Request> = Vec::new();
        // each request's (since, timeout), as its waiting entry had them
        let mut sending: Vec<(Instant, Option<Duration>)> = Vec::new();
        let mut send = |w: Waiting| {
            sending.push((w.since, w.timeout));
            to_send.push(Arc::unwrap_or_clone(w.req));
        };
        let mut keep: Vec<Waiting> = Vec::new();
        let mut group_timed_out = vec![false; self.groups.len()];
        for mut w in std::mem::take(&mut self.waiting) {
            let waited = now.saturating_duration_since(w.since);
            let timed_out = w.timeout.is_some_and(|t| waited >= t);
            let cached_path = self.cache.enabled()
                && w.req.kind.cacheable()
                && (self.joined.is_empty() || w.req.kind == OpKind::Allreduce);
            let (lookup, group) = match w.found {
                Some((k, lookup, group)) if k == key => (lookup, group),
                _ => {
                    let lookup = self.cache.lookup(&w.req);
                    let group = group_of.get(&w.req.name).copied();
                    w.found = Some((key, lookup, group));
                    (lookup, group)
                }
            };
            let lookup = if cached_path { lookup } else { Lookup::Miss };
            match (lookup, group) {
                (Lookup::Hit(_), Some(g)) => {
                    group_ready[g] += 1;
                    group_timed_out[g] |= timed_out;
                    let oldest = group_oldest[g].get_or_insert(w.since);
                    *oldest = (*oldest).min(w.since);
                    keep.push(w);
                }
                (Lookup::Invalid(_), Some(g)) => {
                    vote.group_invalid.push(g);
                    send(w);
                }
                (Lookup::Hit(bit), None) => {
                    let bit = compact_bit(compact, bit)?;
                    let stale =
                        (self.stall.enabled && waited >= self.stall.warn_after) || timed_out;
                    if stale {
                        // surface it in the coordinator's stall report (or its timeout check)
                        vote.invalid.push(bit);
                        send(w);
                    } else {
                        vote.hits.push(bit);
                        keep.push(w);
                    }
                }
                (Lookup::Invalid(bit), None) => {
                    vote.invalid.push(compact_bit(compact, bit)?);
                    send(w);
                }
                (Lookup::Miss, _) => {
                    if w.req.kind == OpKind::Join {
                        self.self_joined = true;
                    }
                    send(w);
                }
            }
        }
        for (g, names) in self.groups.iter().enumerate() {
            if vote.group_invalid.contains(&g) {
                continue;
            }
            let waited = group_oldest[g].map(|t| now.saturating_duration_since(t));
            if group_ready[g] == names.len()
                && ((self.stall.enabled && waited.is_some_and(|w| w >= self.stall.warn_after))
                    || group_timed_out[g])
            {
                // ready here but not agreed for the stall time (or a member's own timeout):
                // some rank lacks the batch. Dissolve it, so that its tensors go stale one by
                // one and the coordinator's stall inspector (or timeout check) reports them
                vote.group_invalid.push(g);
            } else if group_ready[g] == names.len() || (self.self_joined && group_ready[g] == 0) {
                vote.group_hits.push(g);
            } else if group_oldest[g]
                .is_some_and(|t| now.saturating_duration_since(t) >= self.group_patience)
            {
                // partly ready for too long (this step lacks a member): back to single votes
                vote.group_invalid.push(g);
            }
        }
        vote.group_invalid.sort_unstable();
        vote.group_invalid.dedup();
        if self.self_joined {
            vote.hits.extend(
                self.cache
                    .allreduce_bits()
                    .into_iter()
                    .filter_map(|b| compact.get(&b).copied()),
            );
            vote.hits.sort_unstable();
            vote.hits.dedup();
            // a bit this rank invalidates must not also count as its hit
            vote.hits.retain(|b| !vote.invalid.contains(b));
        }
        // a joined rank's stand-ins for missing tensors are new memory every time
        let carried = self.gpu_agreed;
        vote.gpu_moved = carried.then_some(gpu_moved || self.self_joined);
        let coordinator_check = self
            .coordinator
            .as_ref()
            .is_some_and(|c| c.has_pending() && (stall_check_due || c.any_timed_out(now)));
        vote.uncached = !to_send.is_empty() || !self.cache.enabled() || coordinator_check;

        if !to_send.is_empty()
            && crate::config::test_fault("negotiation_error", self.global_ranks[self.set_rank])
        {
            return Err(Error::Internal("test fault: negotiation_error".into()));
        }
        // 2. the vote: one AND allreduce (Horovod: an AND and an OR allreduce, no groups)
        let bits = self.cache.num_bits();
        let agreed = match self.mode {
            // offline mode negotiates online until its plan is frozen
            NegotiationMode::Online | NegotiationMode::Offline => {
                let (n, g) = (singles.len(), self.groups.len());
                let mut words = ready_bitmap::encode_grouped(&vote, n, g);
                crate::probe::mark("vote sent", keep.len() + to_send.len());
                ctrl.and_words(&mut words)?;
                crate::probe::mark("vote reduced", words.len());
                out.control_collectives += 1;
                out.control_bytes += 8 * words.len() as u64;
                ready_bitmap::decode_grouped(&words, n, g, carried)
            }
            NegotiationMode::Horovod => {
                let (mut hits, mut flags) = ready_bitmap::encode_split(&vote, bits);
                ctrl.and_words(&mut hits)?;
                ctrl.or_words(&mut flags)?;
                out.control_collectives += 2;
                out.control_bytes += 8 * (hits.len() + flags.len()) as u64;
                ready_bitmap::decode_split(&hits, &flags, bits, carried)
            }
        };

        // 3. apply the agreement identically everywhere (before the first GPU tensor was
        // agreed, nothing says that GPU tensors stayed put)
        out.gpu_moved = !carried || agreed.any_gpu_moved;
        let invalid: Vec<usize> = agreed.invalid.iter().map(|c| singles[*c]).collect();
        let hits: Vec<usize> = agreed.common_hits.iter().map(|c| singles[*c]).collect();
        let mut group_hit_bits = Vec::new();
        for &g in &agreed.common_group_hits {
            out.groups.push(self.groups[g].len());
            for name in &self.groups[g] {
                let bit = self.cache.bit_of(name).ok_or_else(|| {
                    self.broken_after_vote(format!("group member '{name}' is not cached"))
                })?;
                group_hit_bits.push(bit);
            }
        }
        let mut dissolved = Vec::new();
        for &g in &agreed.group_invalid {
            for name in &self.groups[g] {
                dissolved.extend(self.cache.bit_of(name));
            }
        }
        if !agreed.group_invalid.is_empty() {
            out.groups_dissolved = true;
            self.groups.clear();
            self.groups_generation += 1;
        }
        for bit in invalid.into_iter().chain(dissolved) {
            self.cache.erase(bit);
        }
        let mut taken = vec![false; bits];
        for bit in group_hit_bits.into_iter().chain(hits) {
            let Some(resp) = self.cache.take_response(bit) else {
                return Err(self
                    .broken_after_vote(format!("the agreed cache bit {bit} is not cached here")));
            };
            out.responses.push(resp);
            taken[bit] = true;
        }
        if !out.responses.is_empty() {
            // everything kept was a hit, found under its bit
            keep.retain(
                |w| !matches!(w.found, Some((_, Lookup::Hit(b), _)) if taken.get(b) == Some(&true)),
            );
        }
        self.waiting = keep;
        self.index = Some((key, index));
        // later submissions count on from here, while the groups stay as indexed
        self.group_arrived = if self.groups_generation == key.1 {
            for g in &agreed.common_group_hits {
                group_ready[*g] = 0;
            }
            group_ready
        } else {
            Vec::new()
        };
        if agreed.any_shutdown {
            // put back what was going to be sent so it is failed with the rest
            for req in to_send {
                self.sent.insert(req.name.clone(), req);
            }
            out.shutdown = Some(crate::error::SHUT_DOWN_MESSAGE.to_string());
            // every rank saw the shutdown in this vote: one more word says whether GPU work
            // failed somewhere (rare, so it costs the per-step vote no bit)
            let mut failed = [u64::from(abort_gpu)];
            ctrl.or_words(&mut failed)?;
            out.control_collectives += 1;
            out.control_bytes += 8;
            out.abort_gpu = failed[0] != 0;
            return Ok(out);
        }
        if !agreed.any_uncached {
            // requests that were invalid on this rank only were not sent: retry next cycle
            for (req, (since, timeout)) in to_send.into_iter().zip(sending) {
                // an operation's own timeout counts from its submission
                let since = if timeout.is_some() { since } else { now };
                self.waiting.push(Waiting {
                    req: Arc::new(req),
                    since,
                    timeout,
                    found: None,
                });
            }
            return Ok(out);
        }

        // 4. slow path: coordinator round
        let timeouts = (sending.iter().enumerate())
            .filter_map(|(i, (since, timeout))| {
                let timeout = (*timeout)?;
                let waited = now.saturating_duration_since(*since);
                Some((i as u32, wire::OpTimeout { timeout, waited }))
            })
            .collect();
        let mine = wire::encode_requests(&RequestList {
            requests: to_send.clone(),
            timeouts,
        });
        for req in to_send {
            self.sent.insert(req.name.clone(), req);
        }
        if crate::config::test_fault("stop_in_round", self.global_ranks[self.set_rank]) {
            // as a hung rank: stops between the vote and the coordinator round
            crate::config::stop_this_process();
        }
        let gathered = ctrl.gather_bytes(&mine, 0)?;
        out.control_collectives += 1;
        out.control_bytes += mine.len() as u64;
        let reply = match self.coordinator.as_mut() {
            Some(coord) => {
                let decoded = gathered
                    .iter()
                    .enumerate()
                    .map(|(r, b)| {
                        if crate::config::test_fault("decode", self.global_ranks[0]) && r > 0 {
                            return Err(Error::Internal("test fault: decode".into()));
                        }
                        wire::decode_requests(b).map_err(|e| {
                            Error::Internal(format!(
                                "rank {} sent a request list that rank {} cannot decode: {e}",
                                self.global_ranks[r], self.global_ranks[0]
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>();
                // the others wait in the broadcast below: an error here is their error too
                let (lists, mut shutdown) = match decoded {
                    Ok(lists) => (lists, None),
                    Err(e) => (
                        Vec::new(),
                        Some(format!("ferrovod negotiation failed: {e}")),
                    ),
                };
                let responses = if shutdown.is_none() {
                    let timeouts: Vec<(String, wire::OpTimeout)> = (lists.iter())
                        .flat_map(|l| {
                            (l.timeouts.iter())
                                .map(|(i, t)| (l.requests[*i as usize].name.clone(), *t))
                        })
                        .collect();
                    let lists = lists.into_iter().map(|l| l.requests).collect();
                    let responses = coord.add_round(lists, now);
                    coord.add_timeouts(timeouts.iter().map(|(n, t)| (n.as_str(), *t)), now);
                    responses
                } else {
                    Vec::new()
                };
                if stall_check_due && shutdown.is_none() {
                    self.last_stall_check = now;
                    let stalled = coord.stalled(now, self.stall.warn_after);
                    if !stalled.is_empty() {
                        let report = stall_report(
                            &stalled,
                            &self.global_ranks,
                            self.stall.warn_after.as_secs(),
                        );
                        tracing::warn!("{report}");
                        if self.stall.shutdown_after > Duration::ZERO
                            && stalled
                                .iter()
                                .any(|s| s.waited >= self.stall.shutdown_after)
                        {
                            shutdown = Some(format!(
                                "Stalled tensors waited longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={}; shutting down. {report}",
                                self.stall.shutdown_after.as_secs()
                            ));
                        }
                    }
                }
                if shutdown.is_none() {
                    let timed_out = coord.timed_out(now);
                    if !timed_out.is_empty() {
                        let report = timeout_report(&timed_out, &self.global_ranks);
                        tracing::warn!("{report}");
                        shutdown = Some(report);
                    }
                }
                let list = ResponseList {
                    responses,
                    joined: coord.joined(),
                    shutdown,
                };
                wire::encode_responses(&list)
            }
            None => Vec::new(),
        };
        let reply = ctrl.broadcast_bytes(reply, 0)?;
        out.control_collectives += 1;
        out.control_bytes += reply.len() as u64;
        if stall_check_due {
            self.last_stall_check = now;
        }
        let list = wire::decode_responses(&reply)?;
        self.joined = list.joined;
        for resp in list.responses {
            let local = self.sent.remove(&resp.name);
            if resp.kind == OpKind::Join {
                self.self_joined = false;
            }
            self.cache.put(&resp, local);
            out.responses.push(Arc::new(resp));
        }
        out.shutdown = list.shutdown;
        Ok(out)
    }
}

/// A single tensor's position in the vote. The index is rebuilt with the cache, so a bit outside
/// every group is always in it; an error (never a panic inside the vote) if not.
fn compact_bit(compact: &HashMap<usize, usize>, bit: usize) -> Result<usize> {
    compact
        .get(&bit)
        .copied()
        .ok_or_else(|| Error::Internal(format!("cache bit {bit} is missing from the vote's index")))
}
