//! Bounded control waits: collectives of a control communicator that give up after the stall
//! limit and name the ranks that never came.

use std::ffi::c_int;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::*;

impl MpiComm {
    /// Bitwise reduction of the vote words: non-blocking, then polled with backoff, so that a
    /// rank waiting for slower peers yields its core (often shared with the framework's
    /// threads) instead of spinning inside MPI. The request works on a buffer of its own,
    /// leaked if MPI fails so that MPI can never write to freed memory.
    pub(super) fn bitwise_words(
        &self,
        words: &mut [u64],
        op: ffi::MPI_Op,
        what: &str,
    ) -> Result<()> {
        let buf: Box<[u64]> = words.into();
        // SAFETY: `buf` holds `buf.len()` words and is owned by `control` until the request
        // completes (leaked if it does not).
        let buf = self.control(what, "a negotiation vote", buf, |buf, req| unsafe {
            ffi::MPI_Iallreduce(
                in_place(),
                buf.as_mut_ptr().cast(),
                buf.len() as c_int,
                ffi::RSMPI_UINT64_T,
                op,
                self.comm,
                req,
            )
        })?;
        words.copy_from_slice(&buf);
        Ok(())
    }

    /// Makes this a control communicator: its collectives give up after `limit` (the stall
    /// shutdown time) with an error that names the ranks that never joined, found through a
    /// private duplicate made here (collective: every member calls this, whatever its limit).
    pub fn bounded(
        mut self,
        limit: Option<Duration>,
        warn: Duration,
        global: Vec<i32>,
        what: String,
    ) -> Result<MpiComm> {
        let probe = MpiComm::dup_raw(self.comm)?;
        self.bound = Some(Box::new(Bound {
            limit,
            warn,
            probe,
            global,
            what,
        }));
        Ok(self)
    }

    /// Waits for a control collective's request within the communicator's bound. After the
    /// limit the request stays posted (its buffers must be leaked by the caller) and the
    /// error names the ranks that did not answer a presence probe.
    pub(super) fn wait_control(&self, req: &mut ffi::MPI_Request, what: &str) -> Result<()> {
        let Some(b) = self.bound.as_deref() else {
            // not a control communicator: the watchdog bounds this wait
            let _blocked = blocked("an MPI collective (non-blocking, waited for)");
            wait_polled(req, None, &mut |_| {})?;
            return Ok(());
        };
        let me = b.global.get(self.rank).copied().unwrap_or(-1);
        let mut warned = false;
        let mut slow = |waited: Duration| {
            if !warned && waited >= b.warn {
                warned = true;
                tracing::warn!(
                    "rank {me} has waited {} s in {what} of {} for ranks that have not joined it; a rank may be stopped or hung",
                    waited.as_secs(),
                    b.what
                );
            }
        };
        if wait_polled(req, b.limit, &mut slow)? {
            return Ok(());
        }
        Err(Error::Stalled(Box::new(Stall {
            rank: me,
            limit: b.limit.unwrap_or_default(),
            waiting_in: format!("{what} of {}", b.what),
            missing: self.missing_ranks(),
            hint: STALL_HINT,
        })))
    }

    /// For a control communicator: the global ranks that do not answer a presence probe (see
    /// `absent_ranks`), once a wait on the set's other communicators gave up on them. Every
    /// rank still there must be giving up too (they reach the same limit together).
    pub fn missing_ranks(&self) -> Option<Vec<i32>> {
        let b = self.bound.as_deref()?;
        Some(
            b.probe
                .absent_ranks(PROBE_GRACE)
                .into_iter()
                .map(|r| b.global.get(r).copied().unwrap_or(r as i32))
                .collect(),
        )
    }

    /// Ranks of this communicator that do not answer within `grace`: every rank that calls
    /// this sends each other rank one byte and listens for theirs. Ranks stuck in the same
    /// wait call it at about the same time; a stopped or hung rank never answers. The
    /// requests are left posted (the job is ending).
    pub(super) fn absent_ranks(&self, grace: Duration) -> Vec<usize> {
        static PRESENT: u8 = 1;
        let got: &'static mut [u8] = Box::leak(vec![0u8; self.size].into_boxed_slice());
        let mut recvs = Vec::new();
        for p in (0..self.size).filter(|p| *p != self.rank) {
            // the send buffer is static; each receive has its own leaked byte
            let sent = self.post(
                Direction::Send,
                (&raw const PRESENT).cast_mut().cast(),
                1,
                p,
                PROBE_TAG,
            );
            let recv = self.post(Direction::Recv, (&raw mut got[p]).cast(), 1, p, PROBE_TAG);
            // a rank whose probe cannot even be posted counts as absent
            recvs.push((p, sent.and(recv).ok(), false));
        }
        let start = Instant::now();
        loop {
            for (_, req, present) in recvs.iter_mut() {
                if let (Some(r), false) = (req.as_mut(), *present) {
                    let mut done: c_int = 0;
                    // SAFETY: r is an active request of this process (tested until it completes).
                    let rc = unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                    *present = rc == 0 && done != 0;
                }
            }
            let absent: Vec<usize> = recvs
                .iter()
                .filter(|(_, _, present)| !present)
                .map(|(p, _, _)| *p)
                .collect();
            if absent.is_empty() || start.elapsed() >= grace {
                return absent;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Posts one non-blocking control collective with `start` over `bufs` (the buffers the
    /// request reads and writes, which this owns meanwhile) and waits for it within the
    /// communicator's bound (`waiting_in` names it in the stall report). Returns the buffers;
    /// when the wait gives up they are leaked, since the request may still use them. They
    /// must be heap memory (`Vec`, `Box`): an inline array would move with `bufs`.
    pub(super) fn control<B>(
        &self,
        call: &str,
        waiting_in: &str,
        mut bufs: B,
        start: impl FnOnce(&mut B, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<B> {
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        check(start(&mut bufs, &mut req), call)?;
        match self.wait_control(&mut req, waiting_in) {
            Ok(()) => Ok(bufs),
            Err(e) => {
                std::mem::forget(bufs);
                Err(e)
            }
        }
    }
}
