//! Channels (multi-stream): `FERROVOD_CHANNELS` worker threads per process set, each with its
//! own duplicate of the set's communicator and its own fusion buffer, so that up to K fused
//! batches are in flight at once. The background thread hands batch number i of the set to
//! channel i mod K — the same channel on every rank, since batches are numbered in agreed
//! order — and each channel runs its batches in the order received, so every communicator sees
//! the same collectives in the same order on every rank. Results go back to the background
//! thread, which completes the tensors (callbacks keep running on one thread).

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, unbounded};

use crate::error::{Error, Result};
use crate::message::{OpKind, Response};
use crate::runtime::entry::TensorEntry;
use crate::runtime::executor::Executor;
use crate::runtime::{Command, Runtime};

/// One batch for a channel.
pub(crate) struct Job {
    pub id: u64,
    /// The batch's number within its set (the same on every rank).
    pub seq: u64,
    pub set: i32,
    pub resps: Vec<Response>,
    pub entries: Vec<TensorEntry>,
    /// How the batch runs (chosen when it was launched).
    pub plan: crate::collective::plan::BatchPlan,
    /// A fused GPU allreduce that may be replayed from a graph.
    pub replay: Option<crate::collective::replay::ReplayKey>,
}

/// A finished job, back to the background thread.
pub(crate) struct Done {
    pub id: u64,
    pub set: i32,
    pub resps: Vec<Response>,
    pub entries: Vec<TensorEntry>,
    pub outcome: Result<()>,
    /// A GPU batch: enqueued, with the event its tensors complete at.
    pub recorded: Option<Box<super::gpu::Recorded>>,
}

pub(crate) struct Channel {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The order in which a set's channels start their batches: batch `seq` starts only after
/// batch `seq - 1` has. GPU batches are only enqueued when they start, so every rank hands
/// its NCCL communicators their kernels in the same order (NCCL requires this of several
/// communicators on one GPU); host batches keep their own order per channel anyway.
#[derive(Default)]
pub(crate) struct LaunchTurn {
    next: Mutex<u64>,
    moved: Condvar,
}

impl LaunchTurn {
    fn wait_for(&self, seq: u64) {
        let mut next = self.next.lock().expect("launch turn");
        while *next < seq {
            next = self.moved.wait(next).expect("launch turn");
        }
    }

    fn done(&self, seq: u64) {
        let mut next = self.next.lock().expect("launch turn");
        *next = (*next).max(seq + 1);
        self.moved.notify_all();
    }
}

impl Channel {
    pub fn spawn(
        index: usize,
        executor: Executor,
        done: Sender<Command>,
        rt: Arc<Runtime>,
        turn: Arc<LaunchTurn>,
    ) -> Result<Channel> {
        let (tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name(format!("ferrovod-channel-{index}"))
            .spawn(move || run(executor, rx, done, rt, turn))
            .map_err(|e| Error::Internal(format!("cannot start channel thread: {e}")))?;
        Ok(Channel {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn send(&self, job: Job) {
        if let Some(tx) = &self.jobs {
            // the thread only ends after the sender is dropped, so this cannot fail
            let _ = tx.send(job);
        }
    }

    /// No more jobs: the thread ends after those already sent.
    pub fn close(&mut self) {
        self.jobs = None;
    }

    /// Waits for the thread (call once every job sent to it has come back).
    pub fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Kinds a channel runs: collectives on the set's data communicator with no effect on the
/// runtime's own state.
pub(crate) fn runs_on_channel(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::Allreduce
            | OpKind::Allgather
            | OpKind::Reducescatter
            | OpKind::Broadcast
            | OpKind::Alltoall
            | OpKind::Gossip
    )
}

fn run(
    mut executor: Executor,
    rx: Receiver<Job>,
    done: Sender<Command>,
    rt: Arc<Runtime>,
    turn: Arc<LaunchTurn>,
) {
    super::ON_BACKGROUND_THREAD.with(|f| f.set(true));
    // this channel's own communicator, fusion buffer and NCCL streams
    for mut job in rx {
        let refs: Vec<&Response> = job.resps.iter().collect();
        let on_device = crate::collective::plan::on_device(refs[0]);
        turn.wait_for(job.seq);
        if !on_device {
            turn.done(job.seq);
        }
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            executor.run(
                &rt,
                job.plan,
                &refs,
                &mut job.entries,
                job.replay,
                &mut |_| {},
            )
        }))
        // the batch must still come back, failed, rather than leave its waiters hanging
        .unwrap_or_else(|_| Err(Error::Internal("a ferrovod channel thread panicked".into())));
        turn.done(job.seq);
        let (outcome, recorded) = match result {
            Ok(r) => (Ok(()), r.map(Box::new)),
            Err(e) => (Err(e), None),
        };
        let _ = done.send(Command::BatchDone(Done {
            id: job.id,
            set: job.set,
            resps: job.resps,
            entries: job.entries,
            outcome,
            recorded,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::LaunchTurn;
    use std::sync::{Arc, Mutex};

    #[test]
    fn batches_start_in_number_order_whatever_thread_gets_there_first() {
        let turn = Arc::new(LaunchTurn::default());
        let started = Arc::new(Mutex::new(Vec::new()));
        // three "channels" holding batches 0..9 round-robin, started in reverse thread order
        let threads: Vec<_> = (0..3u64)
            .rev()
            .map(|k| {
                let (turn, started) = (turn.clone(), started.clone());
                std::thread::spawn(move || {
                    for seq in (k..9).step_by(3) {
                        turn.wait_for(seq);
                        started.lock().unwrap().push(seq);
                        turn.done(seq);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*started.lock().unwrap(), (0..9).collect::<Vec<u64>>());
    }
}
