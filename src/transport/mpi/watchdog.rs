//! The watchdog: a thread that finds, when a rank waits too long inside a blocking MPI call,
//! whether the other ranks are still there, and aborts the job with their names if not; and the
//! registry of blocking calls it reads (CUDA and NCCL waits register there too).

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::*;

/// Tag of the presence probe (on private communicators only).
pub(super) const PROBE_TAG: usize = 7;

/// How long a rank that gave up waiting listens for the others' presence probes: ranks stuck
/// in the same wait reach their limit within a second of each other (the watchdog looks
/// every 200 ms).
pub(super) const PROBE_GRACE: Duration = Duration::from_secs(3);

/// What a rank missing from a collective may be doing.
pub(super) const STALL_HINT: &str = "A missing rank is stopped, hung, or blocked elsewhere.";

/// Blocking MPI calls in progress, one slot per thread that has made one: when each started
/// and what it is. The watchdog reads them.
pub(super) static BLOCKED: Mutex<Vec<Option<(Instant, &'static str)>>> = Mutex::new(Vec::new());

thread_local! {
    static BLOCKED_SLOT: usize = {
        let mut slots = BLOCKED.lock().unwrap_or_else(|e| e.into_inner());
        slots.push(None);
        slots.len() - 1
    };
}

/// Marks this thread as inside a blocking call that waits for other ranks (MPI, NCCL's
/// communicator creation, a stream the other ranks' work holds up) until dropped; an outer
/// mark, if any, is kept (calls split into several nest).
pub(crate) struct Blocked(usize, Option<(Instant, &'static str)>);

pub(crate) fn blocked(what: &'static str) -> Blocked {
    let slot = BLOCKED_SLOT.with(|s| *s);
    let mut slots = BLOCKED.lock().unwrap_or_else(|e| e.into_inner());
    let outer = slots[slot];
    slots[slot] = Some(outer.unwrap_or((Instant::now(), what)));
    Blocked(slot, outer)
}

impl Drop for Blocked {
    fn drop(&mut self) {
        BLOCKED.lock().unwrap_or_else(|e| e.into_inner())[self.0] = self.1;
    }
}

/// The longest-running blocking MPI call: when it started, and which.
pub(super) fn longest_blocked() -> Option<(Instant, &'static str)> {
    BLOCKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .flatten()
        .min_by_key(|(t, _)| *t)
        .copied()
}

/// Ends the whole job from this process: MPI_Abort on MPI_COMM_WORLD, after `message` is on
/// stderr. For failures that leave the ranks unable to agree on a shutdown.
pub fn abort_job(message: &str) -> ! {
    eprintln!("{message}");
    tracing::error!("{message}");
    if mpi_initialized() {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    }
    std::process::exit(1)
}

/// A thread that ends the job when a blocking call that waits for other ranks (a data
/// collective a rank never joins: it is stopped, or hung) has waited longer than the stall
/// shutdown time while some rank is missing from it. The waiting thread cannot be
/// interrupted, so the watchdog asks every rank whether it is inside such a call too (each
/// watchdog answers its peers' questions: `Responder`). A collective that outlasts the limit
/// with every rank inside it is slow, not stalled (a large transfer on a slow link): the
/// watchdog says so and asks again after another limit. A rank that does not answer, or
/// answers that it is elsewhere, is missing: the watchdog names it and aborts the job.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<MpiComm>>,
}

/// Tags of the watchdog's presence questions and answers (on its private communicator).
pub(super) const ASK_TAG: usize = 8;
pub(super) const ANSWER_TAG: usize = 9;

/// Answers: inside a blocking call that waits for other ranks, or running elsewhere.
pub(super) const INSIDE: u8 = 1;
pub(super) const ELSEWHERE: u8 = 2;

/// How often the watchdog looks at the blocked calls and its peers' questions.
pub(super) const WATCH_TICK: Duration = Duration::from_millis(100);

/// The watchdog's side of the presence questions: one receive from any rank always posted,
/// answered with whether this process is inside a blocking call, and the answers' sends
/// until they complete. Only with MPI_THREAD_MULTIPLE (it runs beside the blocked call).
pub(super) struct Responder {
    question: Box<[u8; 4]>,
    req: ffi::MPI_Request,
    /// Answers in flight: (request, [round, answer]).
    sends: Vec<(ffi::MPI_Request, Box<[u8; 5]>)>,
}

impl Responder {
    pub(super) fn new(comm: &MpiComm) -> Result<Responder> {
        let mut r = Responder {
            question: Box::new([0; 4]),
            // SAFETY: zeroed is a valid placeholder for a request out-parameter.
            req: unsafe { std::mem::zeroed() },
            sends: Vec::new(),
        };
        r.listen(comm)?;
        Ok(r)
    }

    pub(super) fn listen(&mut self, comm: &MpiComm) -> Result<()> {
        // SAFETY: the question buffer is heap memory owned by self, which completes or cancels
        // the receive before it goes (Drop) and is never moved out of its box.
        let rc = unsafe {
            ffi::MPI_Irecv(
                self.question.as_mut_ptr().cast(),
                4,
                byte_type(),
                ffi::RSMPI_ANY_SOURCE,
                ASK_TAG as c_int,
                comm.comm,
                &mut self.req,
            )
        };
        check(rc, "MPI_Irecv")
    }

    /// Answers every question that has arrived; frees the answers that have gone.
    pub(super) fn serve(&mut self, comm: &MpiComm) -> Result<()> {
        loop {
            let mut done: c_int = 0;
            // SAFETY: zeroed is a valid MPI_Status to be written.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: req is the active receive posted by `listen`.
            check(
                unsafe { ffi::MPI_Test(&mut self.req, &mut done, &mut status) },
                "MPI_Test",
            )?;
            if done == 0 {
                break;
            }
            let mut answer = Box::new([0u8; 5]);
            answer[..4].copy_from_slice(&self.question[..]);
            answer[4] = if longest_blocked().is_some() {
                INSIDE
            } else {
                ELSEWHERE
            };
            let req = comm.post(
                Direction::Send,
                answer.as_mut_ptr().cast(),
                5,
                status.MPI_SOURCE as usize,
                ANSWER_TAG,
            )?;
            self.sends.push((req, answer));
            self.listen(comm)?;
        }
        self.sends.retain_mut(|(req, _)| {
            let mut done: c_int = 0;
            // SAFETY: an active send of this process; its buffer lives in the same entry.
            let rc = unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            rc == 0 && done == 0
        });
        Ok(())
    }

    /// Ends the posted receive (before the communicator goes); answers still in flight keep
    /// their buffers, leaked (only where the job is ending with a peer gone).
    pub(super) fn close(mut self) {
        // SAFETY: req is this process's posted receive; a cancelled request completes locally.
        unsafe {
            ffi::MPI_Cancel(&mut self.req);
            ffi::MPI_Wait(&mut self.req, ffi::RSMPI_STATUS_IGNORE);
        }
        for (mut req, buf) in self.sends.drain(..) {
            // SAFETY: an active send; freeing it lets it complete on its own, so its buffer
            // must outlive this: leaked.
            unsafe { ffi::MPI_Request_free(&mut req) };
            Box::leak(buf);
        }
    }
}

impl MpiComm {
    /// Asks every other rank whether it is inside a blocking call (`Responder` answers),
    /// answering their questions meanwhile; returns the ranks that are not, or that do not
    /// answer within `grace`. Requests left unanswered are cancelled.
    pub(super) fn ranks_outside(
        &self,
        round: u32,
        grace: Duration,
        me: &mut Responder,
    ) -> Vec<usize> {
        let question: &'static [u8; 4] = Box::leak(Box::new(round.to_le_bytes()));
        let mut asks = Vec::new();
        for p in (0..self.size).filter(|p| *p != self.rank) {
            let mut answer = Box::new([0u8; 5]);
            let sent = self.post(
                Direction::Send,
                question.as_ptr().cast_mut().cast(),
                4,
                p,
                ASK_TAG,
            );
            let recv = self.post(
                Direction::Recv,
                answer.as_mut_ptr().cast(),
                5,
                p,
                ANSWER_TAG,
            );
            asks.push((p, sent.ok(), recv.ok(), answer, None::<u8>));
        }
        let start = Instant::now();
        while start.elapsed() < grace && asks.iter().any(|a| a.4.is_none() && a.2.is_some()) {
            let _ = me.serve(self);
            for (p, _, recv, answer, got) in asks.iter_mut().filter(|a| a.4.is_none()) {
                let Some(r) = recv.as_mut() else { continue };
                let mut done: c_int = 0;
                // SAFETY: r is an active receive into `answer`, which lives in the same entry.
                let rc = unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                if rc != 0 {
                    *recv = None;
                } else if done != 0 {
                    if answer[..4] == round.to_le_bytes() {
                        *got = Some(answer[4]);
                    } else if let Ok(again) = self.post(
                        // an answer to an earlier round: listen again
                        Direction::Recv,
                        answer.as_mut_ptr().cast(),
                        5,
                        *p,
                        ANSWER_TAG,
                    ) {
                        *r = again;
                    } else {
                        *recv = None;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut outside = Vec::new();
        for (p, sent, recv, answer, got) in asks {
            if got != Some(INSIDE) {
                outside.push(p);
            }
            // SAFETY: requests still active are cancelled and completed locally (a cancelled
            // receive no longer writes); the buffers of those that cannot be are leaked.
            unsafe {
                if let (Some(mut r), None) = (recv, got) {
                    ffi::MPI_Cancel(&mut r);
                    ffi::MPI_Wait(&mut r, ffi::RSMPI_STATUS_IGNORE);
                }
                if let Some(mut r) = sent {
                    ffi::MPI_Request_free(&mut r);
                }
            }
            drop(answer);
        }
        outside
    }
}

impl Watchdog {
    /// `probe`: a private duplicate of the world communicator (made on every rank).
    /// `concurrent`: MPI_THREAD_MULTIPLE, so the watchdog may ask and answer while another
    /// thread waits inside MPI.
    pub fn start(limit: Option<Duration>, probe: MpiComm, concurrent: bool) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferrovod-watchdog".into())
            .spawn(move || {
                let mut responder = match concurrent {
                    true => Responder::new(&probe).ok(),
                    false => None,
                };
                let mut round = 0u32;
                // the call last found slow with every rank inside it, and when to ask again
                let mut slow: Option<(Instant, Duration)> = None;
                while !flag.load(Ordering::Relaxed) {
                    // woken at once when the runtime stops
                    std::thread::park_timeout(WATCH_TICK);
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(r) = responder.as_mut() {
                        let _ = r.serve(&probe);
                    }
                    let (Some(limit), Some((since, what))) = (limit, longest_blocked()) else {
                        continue;
                    };
                    let waited = since.elapsed();
                    let due = match slow {
                        Some((call, next)) if call == since => next,
                        _ => limit,
                    };
                    if waited < due {
                        continue;
                    }
                    tracing::debug!("watchdog: {what} has waited {waited:?}; asking the ranks");
                    round = round.wrapping_add(1);
                    let missing: Option<Vec<i32>> = responder.as_mut().map(|r| {
                        (probe.ranks_outside(round, PROBE_GRACE, r).into_iter())
                            .map(|r| r as i32)
                            .collect()
                    });
                    if missing.as_ref().is_some_and(|m| m.is_empty()) {
                        tracing::warn!(
                            "rank {}: {what} has run for {} s with every rank inside a collective: slow, not stalled; still waiting",
                            probe.rank,
                            waited.as_secs()
                        );
                        slow = Some((since, waited + limit));
                        continue;
                    }
                    let msg = Stall {
                        rank: probe.rank as i32,
                        limit,
                        waiting_in: what.to_string(),
                        missing,
                        hint: STALL_HINT,
                    };
                    eprintln!("ferrovod: {msg} Aborting the job.");
                    // the other waiting ranks report too before the abort reaches them
                    std::thread::sleep(Duration::from_secs(1));
                    abort_job("ferrovod: aborting the job after a stalled MPI call");
                }
                if let Some(r) = responder {
                    r.close();
                }
                probe
            })
            .expect("spawn the watchdog thread");
        Watchdog {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // the probe communicator is freed here, on the thread that owns MPI
            drop(t.join());
        }
    }
}
