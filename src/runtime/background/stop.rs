//! The end of the background loop on this rank: channels drained, GPU work aborted or
//! finished, every tensor still pending failed with the reason, new work refused.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam::channel::Receiver;

use super::Background;
use crate::error::Error;
use crate::runtime::Command;

/// How long shutdown waits for the batches channels still hold.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

impl Background {
    /// Closes every channel and waits (at most 30 s) for the batches they still hold; tensors
    /// of batches that never come back fail with `err`.
    fn drain_channels(&mut self, rx: &Receiver<Command>, err: &Error) {
        for set in self.sets.member.values_mut() {
            for c in &mut set.channels {
                c.close();
            }
        }
        let deadline = Instant::now() + DRAIN_LIMIT;
        while self.launcher.on_channels() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(cmd) => self.receive(cmd),
                Err(_) => break,
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
        for set in std::mem::take(&mut self.sets.member).into_values() {
            for e in set.entries {
                e.complete(Err(err.clone()), None);
            }
        }
        if let Some(t) = self.timeline.take() {
            t.close();
        }
    }
}
