//! Completion of enqueued operations: by handle (poll, wait with timeout) and by callback.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::hashing::HashMap;
use crate::message::Request;
use crate::transport::cuda::{ForeignStream, Gpu, Signal};

pub type HandleId = u64;

/// Called once, on the background thread, when every tensor of the operation has completed.
pub type DoneCallback = Box<dyn FnOnce(HandleId, &Result<()>) + Send>;

/// What one tensor produced, when the library owns the output memory.
#[derive(Clone, Debug, Default)]
pub struct TensorResult {
    pub output: Option<Vec<u8>>,
    pub shape: Vec<i64>,
    pub received_splits: Vec<i32>,
}

#[derive(Default)]
struct State {
    remaining: usize,
    outcome: Option<Result<()>>,
    results: Vec<TensorResult>,
    /// Join: last joined rank. Add process set: the new id.
    value: i32,
    callback: Option<DoneCallback>,
    /// Threads blocked in `wait`: completion signals the condition variable only for them (a
    /// signal is a system call, and a step completes hundreds of handles).
    waiters: usize,
    /// Callers' streams waiting on the device for this operation (`wait_on_device`): given
    /// when it completes.
    signals: Vec<(Arc<Gpu>, Signal)>,
}

/// How long `wait` polls before it blocks, when polling is on: most waits end within it (a
/// GPU step's buckets, a fused allreduce), and waking a blocked thread costs the waker a
/// system call and the woken thread a trip through the scheduler (BENCHMARKS.md, "Figures
/// moved out of comments"). The poll yields the core to any other runnable thread,
/// as CUDA's default host synchronisation spins where cores are spare.
const WAIT_POLL: Duration = Duration::from_millis(1);

static POLLING: AtomicBool = AtomicBool::new(false);

/// Whether waiting threads poll before they sleep. Polling pays where every rank has cores
/// to spare; where ranks share few cores (CI, oversubscribed jobs) it takes them from the
/// threads being waited for.
pub(crate) fn set_polling(on: bool) {
    POLLING.store(on, Ordering::Relaxed);
}

pub(crate) fn polling() -> bool {
    POLLING.load(Ordering::Relaxed)
}

thread_local! {
    /// Handles whose done callback runs on this thread now.
    static CALLING: std::cell::RefCell<Vec<Arc<Handle>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The handle `id` if its done callback is running on this thread: callbacks can read their
/// results and errors without the runtime (which is gone when a shutdown fails them).
pub fn in_callback(id: HandleId) -> Option<Arc<Handle>> {
    CALLING
        .try_with(|c| c.borrow().iter().rev().find(|h| h.id == id).cloned())
        .ok()
        .flatten()
}

pub struct Handle {
    pub id: HandleId,
    state: Mutex<State>,
    cv: Condvar,
    /// Set with the last tensor's completion (lets `wait` poll without the lock).
    done: AtomicBool,
    /// Whether the operation succeeded, valid once `done` is set (a successful wait then
    /// takes no lock).
    ok: AtomicBool,
    /// GPU operations: the event recorded on ferrovod's stream after the work (what a GPU
    /// consumer waits on instead of the host).
    event: Mutex<Option<Arc<crate::transport::cuda::Event>>>,
    /// GPU operations: the process set and the first tensor's request, which say what its
    /// batch may still have to connect (`Runtime::wait_on_device`).
    origin: OnceLock<(i32, Arc<Request>)>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // every operation completes before its last owner goes; should one not, no stream
        // waits for it for ever
        let signals = self
            .state
            .get_mut()
            .map(|s| std::mem::take(&mut s.signals))
            .unwrap_or_default();
        for (gpu, signal) in signals {
            let _ = gpu.release_signal(signal, None);
        }
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handle({})", self.id)
    }
}

impl Handle {
    /// Records that some of this operation's GPU work ends at `event`. An operation whose
    /// tensors ran in several batches (other streams, with channels) gets an event that fires
    /// after all of them.
    pub fn add_event(
        &self,
        gpu: &crate::transport::cuda::Gpu,
        event: &Arc<crate::transport::cuda::Event>,
    ) {
        let mut slot = self.event.lock().expect("handle event");
        let joined = match slot.as_ref() {
            Some(old) if !Arc::ptr_eq(old, event) => match gpu.join_events(&[old, event]) {
                Ok(j) => Arc::new(j),
                Err(e) => {
                    tracing::error!("cannot join completion events: {e}");
                    event.clone()
                }
            },
            _ => event.clone(),
        };
        *slot = Some(joined);
    }

    /// The completion event (a `CUevent`), once the GPU work has been enqueued.
    pub fn event(&self) -> Option<Arc<crate::transport::cuda::Event>> {
        self.event.lock().expect("handle event").clone()
    }

    /// Records tensor `index`; the operation completes (callback, waiters) with the last one.
    /// The first error of any tensor is the operation's error.
    pub fn complete_one(
        self: &Arc<Self>,
        index: usize,
        result: Result<TensorResult>,
        value: Option<i32>,
    ) {
        let mut s = self.state.lock().expect("handle lock");
        if s.remaining == 0 {
            return;
        }
        let error = match result {
            Ok(r) => {
                if let Some(slot) = s.results.get_mut(index) {
                    *slot = r;
                }
                None
            }
            Err(e) => Some(e),
        };
        self.count_down(s, error, value);
    }

    /// Stores tensor `index`'s result ahead of its completion: the GPU finisher does this
    /// while the batch runs, so that when its event fires, completing a tensor only counts
    /// it down (`complete_staged`).
    pub fn stage(&self, index: usize, result: TensorResult) {
        let mut s = self.state.lock().expect("handle lock");
        if s.remaining > 0
            && let Some(slot) = s.results.get_mut(index)
        {
            *slot = result;
        }
    }

    /// Completes a tensor whose result was staged (on error the staged result is moot).
    pub fn complete_staged(self: &Arc<Self>, outcome: Result<()>) {
        let s = self.state.lock().expect("handle lock");
        if s.remaining == 0 {
            return;
        }
        self.count_down(s, outcome.err(), None);
    }

    fn count_down(
        self: &Arc<Self>,
        mut s: std::sync::MutexGuard<'_, State>,
        error: Option<Error>,
        value: Option<i32>,
    ) {
        if let Some(e) = error
            && !matches!(s.outcome, Some(Err(_)))
        {
            s.outcome = Some(Err(e));
        }
        if let Some(v) = value {
            s.value = v;
        }
        s.remaining -= 1;
        if s.remaining > 0 {
            return;
        }
        let outcome = s.outcome.take().unwrap_or(Ok(()));
        s.outcome = Some(outcome.clone());
        self.ok.store(outcome.is_ok(), Ordering::Relaxed);
        self.done.store(true, Ordering::Release);
        if s.waiters > 0 {
            self.cv.notify_all();
        }
        let callback = s.callback.take();
        let signals = std::mem::take(&mut s.signals);
        drop(s);
        if !signals.is_empty() {
            // a failed operation's kernels may never end: its waiters go on at once
            let after = if outcome.is_ok() { self.event() } else { None };
            for (gpu, signal) in signals {
                if let Err(e) = gpu.release_signal(signal, after.as_deref()) {
                    tracing::error!(
                        "handle {}: cannot release a stream waiting for it: {e}",
                        self.id
                    );
                }
            }
        }
        if let Some(cb) = callback {
            // the callback may query its handle after shutdown removed the runtime
            CALLING.with(|c| c.borrow_mut().push(self.clone()));
            cb(self.id, &outcome);
            CALLING.with(|c| c.borrow_mut().pop());
        }
    }

    /// Makes the caller's `stream` (on `gpu`) wait on the device until this operation's work
    /// has run, before it is launched; false when it cannot (done already: the caller waits on
    /// `event`; or the stream cannot wait so, see `Gpu::place_signal`).
    pub fn wait_on_device(
        &self,
        gpu: &Arc<Gpu>,
        stream: ForeignStream,
        limit: Duration,
    ) -> Result<bool> {
        let mut s = self.state.lock().expect("handle lock");
        if s.remaining == 0 {
            return Ok(false);
        }
        // under the lock: completion, which gives the signals, cannot come in between
        match gpu.place_signal(stream, limit)? {
            Some(signal) => {
                s.signals.push((gpu.clone(), signal));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Records a GPU operation's set and first request (once; at submission).
    pub fn set_origin(&self, set: i32, request: Arc<Request>) {
        let _ = self.origin.set((set, request));
    }

    pub fn origin(&self) -> Option<&(i32, Arc<Request>)> {
        self.origin.get()
    }

    /// Whether every tensor of the operation has completed.
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    fn succeeded(&self) -> bool {
        self.is_done() && self.ok.load(Ordering::Relaxed)
    }

    /// `None` while in progress.
    pub fn poll(&self) -> Option<Result<()>> {
        let s = self.state.lock().expect("handle lock");
        if s.remaining == 0 {
            s.outcome.clone()
        } else {
            None
        }
    }

    /// Waits until completion or `timeout` (None: forever). On the background thread (inside a
    /// callback) an unfinished operation can never complete, so that is an error, not a hang.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        if self.succeeded() {
            return Ok(());
        }
        if crate::runtime::on_background_thread() {
            if let Some(done) = self.poll() {
                return done;
            }
            return Err(Error::InvalidArgument(
                "cannot wait for an operation from a ferrovod callback: the background thread would wait for itself".into(),
            ));
        }
        let start = Instant::now();
        // a timeout past what the clock can hold is a wait for ever
        let deadline = timeout.and_then(|t| start.checked_add(t));
        let poll = if polling() { WAIT_POLL } else { Duration::ZERO };
        let poll_until = start + timeout.map_or(poll, |t| t.min(poll));
        while !self.done.load(Ordering::Acquire) && Instant::now() < poll_until {
            std::thread::yield_now();
        }
        if self.succeeded() {
            return Ok(());
        }
        let mut s = self.state.lock().expect("handle lock");
        while s.remaining > 0 {
            s.waiters += 1;
            s = match deadline {
                None => self.cv.wait(s).expect("handle lock"),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        s.waiters -= 1;
                        return Err(Error::Timeout);
                    }
                    self.cv.wait_timeout(s, d - now).expect("handle lock").0
                }
            };
            s.waiters -= 1;
        }
        s.outcome.clone().unwrap_or(Ok(()))
    }

    /// Sets the value the operation reports unless its completion says otherwise.
    pub fn set_value(&self, v: i32) {
        self.state.lock().expect("handle lock").value = v;
    }

    pub fn value(&self) -> i32 {
        self.state.lock().expect("handle lock").value
    }

    pub fn result(&self, index: usize) -> Option<TensorResult> {
        self.state
            .lock()
            .expect("handle lock")
            .results
            .get(index)
            .cloned()
    }

    /// Moves tensor `index`'s library-owned output out of the handle.
    pub fn take_output(&self, index: usize) -> Option<Vec<u8>> {
        self.state
            .lock()
            .expect("handle lock")
            .results
            .get_mut(index)
            .and_then(|r| r.output.take())
    }

    /// Runs `f` on tensor `index`'s result without copying it.
    pub fn with_result<R>(&self, index: usize, f: impl FnOnce(&TensorResult) -> R) -> Option<R> {
        self.state
            .lock()
            .expect("handle lock")
            .results
            .get(index)
            .map(f)
    }
}

/// Every live handle of this process, by id, whichever runtime made it: ids never restart
/// (a binding's registry from before a shutdown and init cannot meet a new operation under an
/// old id), and an operation still in flight while its runtime shuts down stays reachable
/// until it completes.
pub static HANDLES: std::sync::LazyLock<HandleTable> =
    std::sync::LazyLock::new(HandleTable::default);

/// Live handles by id. Ids are never reused within a process.
#[derive(Default)]
pub struct HandleTable {
    next: AtomicU64,
    map: Mutex<HashMap<HandleId, Arc<Handle>>>,
}

impl HandleTable {
    pub fn create(&self, tensors: usize, callback: Option<DoneCallback>) -> Arc<Handle> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let h = Arc::new(Handle {
            id,
            state: Mutex::new(State {
                remaining: tensors.max(1),
                results: vec![TensorResult::default(); tensors.max(1)],
                callback,
                ..State::default()
            }),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
            ok: AtomicBool::new(false),
            event: Mutex::new(None),
            origin: OnceLock::new(),
        });
        self.map.lock().expect("handles").insert(id, h.clone());
        h
    }

    pub fn get(&self, id: HandleId) -> Result<Arc<Handle>> {
        self.map
            .lock()
            .expect("handles")
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("unknown handle {id}")))
    }

    pub fn release(&self, id: HandleId) -> Result<()> {
        self.map
            .lock()
            .expect("handles")
            .remove(&id)
            .map(|_| ())
            .ok_or_else(|| Error::InvalidArgument(format!("unknown handle {id}")))
    }

    pub fn len(&self) -> usize {
        self.map.lock().expect("handles").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn completes_after_last_tensor_with_first_error() {
        let table = HandleTable::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let h = table.create(
            3,
            Some(Box::new(move |_, r| {
                assert!(r.is_err());
                c.fetch_add(1, Ordering::SeqCst);
            })),
        );
        h.complete_one(0, Ok(TensorResult::default()), None);
        assert!(h.poll().is_none());
        assert_eq!(h.wait(Some(Duration::from_millis(10))), Err(Error::Timeout));
        h.complete_one(1, Err(Error::Precondition("a".into())), None);
        h.complete_one(2, Err(Error::Precondition("b".into())), Some(7));
        assert_eq!(h.poll(), Some(Err(Error::Precondition("a".into()))));
        assert_eq!(h.wait(None), Err(Error::Precondition("a".into())));
        assert_eq!(h.value(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        h.complete_one(2, Ok(TensorResult::default()), None); // late duplicate: ignored
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(table.release(h.id).is_ok());
        assert!(table.get(h.id).is_err());
        assert!(table.release(h.id).is_err());
    }

    #[test]
    fn staged_results_are_seen_once_the_tensors_complete() {
        let table = HandleTable::default();
        let h = table.create(2, None);
        let shaped = |d: i64| TensorResult {
            shape: vec![d],
            ..TensorResult::default()
        };
        h.stage(0, shaped(3));
        h.stage(1, shaped(5));
        assert!(h.poll().is_none() && !h.is_done());
        h.complete_staged(Ok(()));
        assert!(!h.is_done());
        h.complete_staged(Ok(()));
        assert_eq!(h.wait(Some(Duration::ZERO)), Ok(()));
        assert_eq!(h.result(1).map(|r| r.shape), Some(vec![5]));
        // a failed batch fails the operation whatever was staged
        let f = table.create(1, None);
        f.stage(0, shaped(3));
        f.complete_staged(Err(Error::Aborted("gone".into())));
        assert!(f.is_done());
        assert_eq!(f.wait(None), Err(Error::Aborted("gone".into())));
        // staging after completion changes nothing
        f.stage(0, shaped(9));
        assert_eq!(f.result(0).map(|r| r.shape), Some(vec![3]));
    }

    #[test]
    fn a_waiting_thread_sees_completion_polling_or_blocked() {
        for poll in [false, true] {
            set_polling(poll);
            let table = HandleTable::default();
            for delay in [0, 1, 5] {
                let h = table.create(1, None);
                let waiter = {
                    let h = h.clone();
                    std::thread::spawn(move || h.wait(None))
                };
                // completed at once (before or while the waiter polls), or after it blocked
                std::thread::sleep(Duration::from_millis(delay));
                h.complete_one(0, Ok(TensorResult::default()), Some(delay as i32));
                assert_eq!(waiter.join().unwrap(), Ok(()), "poll {poll}, delay {delay}");
                assert_eq!(h.wait(Some(Duration::ZERO)), Ok(()));
                assert_eq!(h.state.lock().unwrap().waiters, 0);
            }
        }
        set_polling(false);
    }
}
