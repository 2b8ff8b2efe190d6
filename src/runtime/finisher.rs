//! The finisher: a thread that completes GPU tensors once their batch's event has fired, so
//! the background thread never waits for the GPU; at shutdown it waits a bounded time, then
//! aborts the NCCL communicators.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender, unbounded};

use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::runtime::entry::TensorEntry;
use crate::runtime::gpu::Recorded;
use crate::transport::cuda::Event;

/// A batch whose tensors the finisher completes once its event has fired.
pub(crate) struct Finish {
    pub recorded: Recorded,
    pub entries: Vec<TensorEntry>,
}

/// Completes GPU tensors after their batch's event, on its own thread, in submission order.
pub(crate) struct Finisher {
    tx: Option<Sender<Finish>>,
    thread: Option<JoinHandle<()>>,
}

impl Finisher {
    pub fn spawn(rt: Arc<Runtime>) -> Result<Finisher> {
        let (tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name("ferrovod-gpu-finisher".into())
            .spawn(move || finish_loop(rt, rx))
            .map_err(|e| Error::Internal(format!("cannot start the GPU finisher thread: {e}")))?;
        Ok(Finisher {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn send(&self, f: Finish) {
        if let Some(tx) = &self.tx {
            // the thread ends only after the sender is dropped
            let _ = tx.send(f);
        }
    }

    /// Finishes what was sent (each batch within the stall shutdown time) and ends the thread.
    pub fn close(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits for `event` without holding a core for long: spins briefly (most batches are short),
/// then yields, then sleeps, calling `between` on every round. Gives up after `limit`: a rank
/// that failed before its NCCL call leaves the others' NCCL calls waiting, and their tensors
/// must still complete (failed).
fn wait_for(event: &Event, limit: Option<Duration>, between: &mut dyn FnMut()) -> Result<()> {
    let start = Instant::now();
    loop {
        if event.query()? {
            return Ok(());
        }
        let waited = start.elapsed();
        if let Some(l) = limit
            && waited > l
        {
            return Err(Error::Aborted(format!(
                "GPU collective did not finish within {} s (another rank may have failed before its NCCL call)",
                l.as_secs()
            )));
        }
        between();
        if waited < Duration::from_micros(200) {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// After a batch's completion timed out and the failure was reported: whether its work stopped,
/// i.e. its event fired once the shutdown aborted its NCCL communicators. Gives up `limit`
/// after the abort, or when no abort came within `abort_wait(limit)`.
fn stopped_by_abort(
    recorded: &Recorded,
    limit: Option<Duration>,
    between: &mut dyn FnMut(),
) -> bool {
    let start = Instant::now();
    let mut aborted_at = None;
    loop {
        if recorded.event.query().unwrap_or(false) {
            return true;
        }
        if aborted_at.is_none() && recorded.aborted.load(Ordering::SeqCst) {
            aborted_at = Some(Instant::now());
        }
        let after_abort = limit.unwrap_or(Duration::from_secs(600));
        match aborted_at {
            Some(t) if t.elapsed() > after_abort => return false,
            None if start.elapsed() > abort_wait(limit) => return false,
            _ => {}
        }
        between();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long a batch that timed out waits for the shutdown to abort its communicators: the
/// shutdown vote may itself wait out the stall limit, then the channels are drained (at most
/// 30 s) before the streams are dropped.
fn abort_wait(limit: Option<Duration>) -> Duration {
    limit.unwrap_or(Duration::from_secs(600)) * 2 + Duration::from_secs(40)
}

/// Hands a batch's handles their results and event while the batch runs, so that once its
/// event fires completing each tensor only counts it down (doing all of it then delayed the
/// last handle; BENCHMARKS.md, "Figures moved out of comments").
fn stage(mut f: Finish) -> Finish {
    // joining a handle's events needs the device's context
    if f.recorded.gpu.bind().is_ok() {
        for e in f.entries.iter_mut() {
            e.stage_on_device(&f.recorded.gpu, &f.recorded.event);
        }
    }
    f
}

fn finish_loop(rt: Arc<Runtime>, rx: Receiver<Finish>) {
    super::ON_BACKGROUND_THREAD.with(|f| f.set(true));
    let limit = rt.stall().limit();
    // batches sent and staged, oldest first: their events fire in this order
    let mut queue: VecDeque<Finish> = VecDeque::new();
    // entries of completed batches, freed when the next batch arrives (when the last batch of
    // a step completes, its caller frees the handles at that moment)
    let mut spent: Vec<Vec<TensorEntry>> = Vec::new();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(f) => {
                    spent.clear();
                    queue.push_back(stage(f));
                }
                Err(_) => return,
            }
        }
        let Some(f) = queue.pop_front() else {
            continue;
        };
        let recorded = &f.recorded;
        let mut arrived = Vec::new();
        let mut take_arrivals = || {
            while let Ok(next) = rx.try_recv() {
                spent.clear();
                arrived.push(stage(next));
            }
        };
        let mut fired = recorded
            .gpu
            .bind()
            .and_then(|()| wait_for(&recorded.event, limit, &mut take_arrivals));
        if let Err(e @ Error::Aborted(_)) = &fired {
            // The job cannot go on: every rank learns it through the shutdown vote and aborts
            // its NCCL communicators. The callers may free these tensors once told, so they
            // are told only after the work is stopped (the abort lets the event fire).
            tracing::error!("{e}");
            rt.report_gpu_failure(&e.to_string());
            if !stopped_by_abort(recorded, limit, &mut take_arrivals) {
                // telling the callers now would let them free buffers the GPU may still write
                crate::transport::mpi::abort_job(
                    "ferrovod: a GPU collective did not stop after its NCCL communicators were aborted; ending the job rather than report its tensors' memory free while the GPU may still write it",
                );
            }
            fired = Err(e.clone());
        }
        let Finish {
            mut recorded,
            entries,
        } = f;
        let outcome = fired.and_then(|()| recorded.outcome());
        crate::probe::mark("fired", entries.len());
        let n = entries.len();
        spent.push(complete_staged(entries, outcome));
        crate::probe::mark("completed", n);
        queue.extend(arrived);
    }
}

/// Completes tensors staged by `stage`; returns the spent entries, to be dropped once every
/// handle is told.
fn complete_staged(mut entries: Vec<TensorEntry>, outcome: Result<()>) -> Vec<TensorEntry> {
    for e in &mut entries {
        e.finish_staged(outcome.clone());
    }
    entries
}

/// Completes GPU tensors with their batch's event attached to the handles; returns the spent
/// entries, to be dropped once every handle is told.
pub(crate) fn complete(
    mut entries: Vec<TensorEntry>,
    outcome: Result<()>,
    recorded: Option<&Recorded>,
) -> Vec<TensorEntry> {
    for e in &mut entries {
        e.complete_on_device(outcome.clone(), None, recorded.map(|r| (&r.gpu, &r.event)));
    }
    entries
}
