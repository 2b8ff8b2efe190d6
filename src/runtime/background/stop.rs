//! The end of the background loop on this rank: channels drained, GPU work aborted or
//! finished, every tensor still pending failed with the reason, new work refused.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam::channel::Receiver;

use super::Background;
use crate::error::Error;
use crate::runtime::Command;

/// After this long, shutdown says that it still waits for the batches channels hold.
const DRAIN_WARN: Duration = Duration::from_secs(30);

impl Background {
    /// Closes every channel and waits for the batches they still hold. A channel's batch may
    /// be inside MPI on its tensors' buffers, so its tensors cannot fail before it returns:
    /// the wait is bounded by the watchdog, which ends the job when a rank is missing from
    /// that collective. Only batches whose threads are gone (they can no longer return)
    /// fail with `err`.
    fn drain_channels(&mut self, rx: &Receiver<Command>, err: &Error) {
        for set in self.sets.member.values_mut() {
            for c in &mut set.channels {
                c.close();
            }
        }
        let start = Instant::now();
        let mut warned = false;
        while self.launcher.on_channels() {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(cmd) => self.receive(cmd),
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {
                    if !warned && start.elapsed() >= DRAIN_WARN {
                        warned = true;
                        tracing::warn!(
                            "shutdown has waited {} s for batches still running on channels; waiting on (a rank missing from their collectives ends the job at the stall limit)",
                            start.elapsed().as_secs()
                        );
                    }
                }
                Err(crossbeam::channel::RecvTimeoutError::Disconnected) => break,
            }
        }
        if !self.launcher.on_channels() {
            for set in self.sets.member.values_mut() {
                for c in &mut set.channels {
                    c.join();
                }
            }
            return;
        }
        self.mpi_unclean = true;
        let n = self.launcher.fail_channel_batches(err);
        tracing::error!("{n} channel batches did not complete at shutdown; failed their tensors");
    }

    /// Fails everything still pending and refuses new work.
    pub(super) fn stop(&mut self, rx: &Receiver<Command>, reason: Option<String>) {
        *self.rt.shutdown_reason.lock().expect("reason") = reason.clone();
        self.rt.loop_ended.store(true, Ordering::SeqCst);
        let inbox = self.rt.inbox.lock().expect("inbox").take();
        drop(inbox);
        while let Ok(cmd) = rx.try_recv() {
            self.receive(cmd);
        }
        let err = match reason {
            Some(r) => Error::ShutDown(r),
            None => Error::shut_down(),
        };
        self.drain_channels(rx, &err);
        tracing::debug!("shutdown: channels drained");
        if self.mpi_unclean {
            // a rank stopped responding: NCCL communicators are aborted, not destroyed (that
            // may wait for the missing rank)
            self.rt.abort_gpu_work();
        }
        // before the finisher: NCCL streams whose work cannot finish (another rank failed)
        // abort it when dropped, so that the finisher's waits end. All at once: one set's abort
        // may wait for the device, which another's stuck kernels keep busy.
        std::thread::scope(|s| {
            for set in self.sets.member.values_mut() {
                if let Some(streams) = set.executor.gpu.take() {
                    s.spawn(move || drop(streams));
                }
            }
        });
        tracing::debug!("shutdown: NCCL streams closed");
        self.launcher.close_finisher();
        tracing::debug!("shutdown: GPU completions finished");
        for mut set in std::mem::take(&mut self.sets.member).into_values() {
            if set.fail_p2p(&err) {
                // a send nobody received, or a receive under way from a rank that stopped
                self.mpi_unclean = true;
            }
            for e in set.entries {
                e.complete(Err(err.clone()), None);
            }
        }
        if let Some(t) = self.timeline.take() {
            t.close();
        }
    }
}
