//! Point-to-point send and receive between two ranks of a set, outside negotiation: only the
//! two ranks take part, so there is nothing for the others to agree on. Messages between a
//! pair with one tag arrive in the order they were sent (MPI's non-overtaking rule), so the
//! k-th send with a tag meets the receiver's k-th receive with that tag.
//!
//! A send completes when the receiver acknowledges its message, so both sides learn of a size
//! mismatch (and fail together), as with NCCL a send does not complete before its receive is
//! posted. A receive takes whatever arrives, checks its size, and answers. Every transfer owns
//! its bytes: one given up on at the stall limit leaves nothing of the caller's to MPI.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Stall};
use crate::transport::mpi::{MpiComm, Transfer};

/// A transfer that completes later (MPI's: `transport::mpi::Transfer`).
pub trait Pending {
    fn is_done(&self) -> bool;
    /// The bytes sent or received, once done.
    fn into_bytes(self) -> Vec<u8>;
}

/// Posted point-to-point transfers, polled: what the runtime's p2p state is written over.
pub trait Mailbox {
    type Transfer: Pending;
    fn post_send(&mut self, peer: usize, tag: i32, data: Vec<u8>) -> Result<Self::Transfer>;
    fn post_recv(&mut self, peer: usize, tag: i32, len: usize) -> Result<Self::Transfer>;
    /// The next message from `peer` (None: any rank) with `tag` if it has arrived, its
    /// receive posted; with the rank it came from.
    fn take_arrived(
        &mut self,
        peer: Option<usize>,
        tag: i32,
    ) -> Result<Option<(Self::Transfer, usize)>>;
    /// Tests `t`; true once it completed.
    fn test(&mut self, t: &mut Self::Transfer) -> Result<bool>;
    /// Withdraws a posted acknowledgement receive nobody will answer (shutdown).
    fn cancel_recv(&mut self, t: &mut Self::Transfer);
}

impl Pending for Transfer {
    fn is_done(&self) -> bool {
        Transfer::is_done(self)
    }

    fn into_bytes(self) -> Vec<u8> {
        Transfer::into_bytes(self)
    }
}

impl Mailbox for MpiComm {
    type Transfer = Transfer;

    fn post_send(&mut self, peer: usize, tag: i32, data: Vec<u8>) -> Result<Transfer> {
        MpiComm::post_send(self, peer, tag, data)
    }

    fn post_recv(&mut self, peer: usize, tag: i32, len: usize) -> Result<Transfer> {
        MpiComm::post_recv(self, peer, tag, len)
    }

    fn take_arrived(&mut self, peer: Option<usize>, tag: i32) -> Result<Option<(Transfer, usize)>> {
        MpiComm::take_arrived(self, peer, tag)
    }

    fn test(&mut self, t: &mut Transfer) -> Result<bool> {
        MpiComm::test(self, t)
    }

    fn cancel_recv(&mut self, t: &mut Transfer) {
        MpiComm::cancel_recv(self, t)
    }
}

/// The MPI tags of a user tag: its messages and their acknowledgements.
fn data_tag(tag: i32) -> i32 {
    tag * 2
}

fn ack_tag(tag: i32) -> i32 {
    tag * 2 + 1
}

/// The largest user tag a communicator with tag bound `tag_ub` carries.
pub fn max_tag(tag_ub: i32) -> i32 {
    (tag_ub - 1) / 2
}

/// An acknowledgement: the message was what the receive expected (0), or the receiver
/// expected this many bytes (plus one).
const ACK_BYTES: usize = 8;

fn ack(expected: Option<usize>) -> Vec<u8> {
    expected.map_or(0, |n| n as u64 + 1).to_le_bytes().to_vec()
}

fn read_ack(bytes: &[u8]) -> Option<usize> {
    let v = u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]));
    (v != 0).then(|| (v - 1) as usize)
}

/// A waiting receive's key: its peer (`ANY`: any rank) and tag. Receives from a named peer
/// look for their message before receives from any rank.
const ANY: usize = usize::MAX;

struct SendOp<T, W> {
    op: W,
    name: String,
    peer: usize,
    bytes: usize,
    data: T,
    ack: T,
    since: Instant,
    warned: bool,
}

struct RecvOp<W> {
    op: W,
    name: String,
    /// `ANY` until a message from some rank came for it.
    peer: usize,
    tag: i32,
    len: usize,
    since: Instant,
    warned: bool,
}

struct Receiving<T, W> {
    recv: RecvOp<W>,
    data: T,
}

/// A finished operation: a send, or a receive with its bytes and the global rank they came
/// from.
pub enum Finished<W> {
    Sent(W, Result<()>),
    Received(W, Result<(Vec<u8>, i32)>),
}

/// The point-to-point operations of one set on this rank: posted sends waiting for their
/// acknowledgement, receives waiting for their message (in order per peer and tag), messages
/// arriving, and acknowledgements going out. Bounded by what the caller has in flight; all of
/// it ends with its operations (or at shutdown).
pub struct PointToPoint<M: Mailbox, W> {
    mailbox: M,
    sends: Vec<SendOp<M::Transfer, W>>,
    waiting: BTreeMap<(usize, i32), VecDeque<RecvOp<W>>>,
    receiving: Vec<Receiving<M::Transfer, W>>,
    acks: Vec<M::Transfer>,
    /// None: wait for ever (stall checks disabled).
    limit: Option<Duration>,
    warn_after: Duration,
    /// This rank's global rank, for the stall message.
    me: i32,
    what: String,
    /// The set's ranks in the world, for messages.
    global: Vec<i32>,
}

impl<M: Mailbox, W> PointToPoint<M, W> {
    /// `what` names the set in messages ("process set 0"); `global`: its ranks in the world.
    pub fn new(
        mailbox: M,
        limit: Option<Duration>,
        warn_after: Duration,
        what: String,
        global: Vec<i32>,
        set_rank: usize,
    ) -> Self {
        let me = global.get(set_rank).copied().unwrap_or(-1);
        PointToPoint {
            mailbox,
            sends: Vec::new(),
            waiting: BTreeMap::new(),
            receiving: Vec::new(),
            acks: Vec::new(),
            limit,
            warn_after,
            me,
            what,
            global,
        }
    }

    /// A set rank's global rank (-1: any rank).
    fn global_of(&self, peer: usize) -> i32 {
        self.global.get(peer).copied().unwrap_or(-1)
    }

    /// Whether anything is still in flight (the loop then polls).
    pub fn busy(&self) -> bool {
        !self.sends.is_empty()
            || !self.waiting.is_empty()
            || !self.receiving.is_empty()
            || !self.acks.is_empty()
    }

    /// Posts a send of `data` to set rank `peer`; on error, the operation comes back.
    pub fn send(
        &mut self,
        op: W,
        name: String,
        peer: usize,
        tag: i32,
        data: Vec<u8>,
        now: Instant,
    ) -> std::result::Result<(), (W, Error)> {
        let bytes = data.len();
        let ack = match self.mailbox.post_recv(peer, ack_tag(tag), ACK_BYTES) {
            Ok(t) => t,
            Err(e) => return Err((op, e)),
        };
        let data = match self.mailbox.post_send(peer, data_tag(tag), data) {
            Ok(t) => t,
            Err(e) => {
                let mut ack = ack;
                self.mailbox.cancel_recv(&mut ack);
                return Err((op, e));
            }
        };
        self.sends.push(SendOp {
            op,
            name,
            peer,
            bytes,
            data,
            ack,
            since: now,
            warned: false,
        });
        Ok(())
    }

    /// Queues a receive of `len` bytes from set rank `peer` (None: the first message with its
    /// tag from any rank).
    pub fn recv(
        &mut self,
        op: W,
        name: String,
        peer: Option<usize>,
        tag: i32,
        len: usize,
        now: Instant,
    ) {
        let peer = peer.unwrap_or(ANY);
        self.waiting
            .entry((peer, tag))
            .or_default()
            .push_back(RecvOp {
                op,
                name,
                peer,
                tag,
                len,
                since: now,
                warned: false,
            });
    }

    /// Moves everything along once: messages that arrived are received, finished transfers
    /// complete their operations. Err: an operation outlived the stall limit (the rank must
    /// stop: its transfers may still be matched later, out of turn).
    pub fn progress(&mut self, now: Instant) -> Result<(Vec<Finished<W>>, bool)> {
        let mut finished = Vec::new();
        let mut moved = false;
        // acknowledgements going out
        let mut i = 0;
        while i < self.acks.len() {
            if self.mailbox.test(&mut self.acks[i])? {
                self.acks.swap_remove(i);
                moved = true;
            } else {
                i += 1;
            }
        }
        // messages that arrived for the first receive waiting on each peer and tag
        let keys: Vec<(usize, i32)> = self.waiting.keys().copied().collect();
        for (peer, tag) in keys {
            while let Some(queue) = self.waiting.get_mut(&(peer, tag)) {
                let from = (peer != ANY).then_some(peer);
                let Some((data, source)) = self.mailbox.take_arrived(from, data_tag(tag))? else {
                    break;
                };
                let mut recv = queue.pop_front().expect("a waiting receive");
                recv.peer = source;
                if queue.is_empty() {
                    self.waiting.remove(&(peer, tag));
                }
                self.receiving.push(Receiving { recv, data });
                moved = true;
            }
        }
        // messages received: check, answer, complete
        let mut i = 0;
        while i < self.receiving.len() {
            if !self.mailbox.test(&mut self.receiving[i].data)? {
                i += 1;
                continue;
            }
            let Receiving { recv, data } = self.receiving.swap_remove(i);
            let bytes = data.into_bytes();
            let ok = bytes.len() == recv.len;
            let expected = (!ok).then_some(recv.len);
            let mut answer =
                (self.mailbox).post_send(recv.peer, ack_tag(recv.tag), ack(expected))?;
            if !self.mailbox.test(&mut answer)? {
                self.acks.push(answer);
            }
            let outcome = if ok {
                Ok((bytes, self.global_of(recv.peer)))
            } else {
                Err(Error::Precondition(format!(
                    "Mismatched point-to-point sizes: a receive of {} bytes from rank {} got a message of {} bytes (tensor '{}')",
                    recv.len,
                    self.global_of(recv.peer),
                    bytes.len(),
                    recv.name
                )))
            };
            finished.push(Finished::Received(recv.op, outcome));
            moved = true;
        }
        // sends whose message went and whose acknowledgement came
        let mut i = 0;
        while i < self.sends.len() {
            let s = &mut self.sends[i];
            if !(self.mailbox.test(&mut s.data)? & self.mailbox.test(&mut s.ack)?) {
                i += 1;
                continue;
            }
            let s = self.sends.swap_remove(i);
            let outcome = match read_ack(&s.ack.into_bytes()) {
                None => Ok(()),
                Some(expected) => Err(Error::Precondition(format!(
                    "Mismatched point-to-point sizes: a send of {} bytes to rank {} met a receive of {expected} bytes (tensor '{}')",
                    s.bytes,
                    self.global_of(s.peer),
                    s.name
                ))),
            };
            finished.push(Finished::Sent(s.op, outcome));
            moved = true;
        }
        self.check_stall(now)?;
        Ok((finished, moved))
    }

    /// Warns once about an operation waiting past the stall check time; the first waiting
    /// past the stall limit ends the rank's point-to-point work.
    fn check_stall(&mut self, now: Instant) -> Result<()> {
        let (limit, warn, me) = (self.limit, self.warn_after, self.me);
        let global = &self.global;
        let mut stalled: Option<(String, Vec<i32>)> = None;
        let mut look = |what: &str, name: &str, peer: usize, since: Instant, warned: &mut bool| {
            let waited = now.saturating_duration_since(since);
            let (who, missing) = match global.get(peer) {
                Some(g) => (format!("rank {g}"), vec![*g]),
                None => (
                    "any rank".to_string(),
                    global.iter().copied().filter(|g| *g != me).collect(),
                ),
            };
            if !*warned && waited >= warn {
                *warned = true;
                tracing::warn!(
                    "rank {me}: a {what} of '{name}' has waited {} s for {who}",
                    waited.as_secs()
                );
            }
            if limit.is_some_and(|l| waited >= l) && stalled.is_none() {
                stalled = Some((format!("a {what} of '{name}' with {who}"), missing));
            }
        };
        for s in &mut self.sends {
            look("send", &s.name, s.peer, s.since, &mut s.warned);
        }
        for q in self.waiting.values_mut() {
            for r in q {
                look("receive", &r.name, r.peer, r.since, &mut r.warned);
            }
        }
        for r in &mut self.receiving {
            let recv = &mut r.recv;
            look(
                "receive",
                &recv.name,
                recv.peer,
                recv.since,
                &mut recv.warned,
            );
        }
        match (stalled, limit) {
            (Some((waiting_in, missing)), Some(limit)) => Err(Error::Stalled(Box::new(Stall {
                rank: me,
                limit,
                waiting_in: format!("{waiting_in} on {}", self.what),
                missing: Some(missing),
                hint: "The peer never posted the matching send or receive (same tag, same process set), or is stopped, hung, or blocked elsewhere.",
            }))),
            _ => Ok(()),
        }
    }

    /// Takes every operation still pending, at shutdown; the acknowledgement receives nobody
    /// will answer are withdrawn. Returns them and whether MPI still holds transfers (then it
    /// must not be finalized).
    pub fn drain(&mut self) -> (Vec<W>, bool) {
        let mut ops = Vec::new();
        let mut held = false;
        for mut s in std::mem::take(&mut self.sends) {
            if !s.ack.is_done() {
                self.mailbox.cancel_recv(&mut s.ack);
            }
            held |= !s.data.is_done();
            ops.push(s.op);
        }
        for q in std::mem::take(&mut self.waiting).into_values() {
            ops.extend(q.into_iter().map(|r| r.op));
        }
        for r in std::mem::take(&mut self.receiving) {
            held |= !r.data.is_done();
            ops.push(r.recv.op);
        }
        held |= self.acks.iter().any(|a| !a.is_done());
        (ops, held)
    }
}

#[cfg(test)]
mod tests {
    use super::{ack, ack_tag, data_tag, max_tag, read_ack};

    #[test]
    fn acknowledgements_say_ok_or_the_expected_size() {
        assert_eq!(read_ack(&ack(None)), None);
        for n in [0usize, 1, 8, 1 << 40] {
            assert_eq!(read_ack(&ack(Some(n))), Some(n));
        }
    }

    #[test]
    fn user_tags_map_to_disjoint_mpi_tags_within_the_bound() {
        for ub in [32767, i32::MAX] {
            let max = max_tag(ub);
            assert!(ack_tag(max) <= ub, "{ub}");
            let mut seen = std::collections::HashSet::new();
            for t in [0, 1, 2, max - 1, max] {
                assert!(seen.insert(data_tag(t)) && seen.insert(ack_tag(t)));
            }
        }
    }
}
