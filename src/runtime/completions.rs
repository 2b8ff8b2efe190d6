//! A completion queue, for bindings whose own code would need a lock ferrovod's thread must not
//! wait for (Python's GIL): as an operation's done callback, `push` queues (user data, handle,
//! status) and returns at once; the binding's thread takes completions with `pop`. A thread
//! that waits for an operation and completes it itself says so first (`forget`), so that the
//! queue then wakes nobody for it.
//!
//! Owner: the binding that names `fv_queue_completion` as its callback and pops (one per
//! process). Bound: one entry per completed operation not yet popped, and one forgotten handle
//! per operation in flight that names this callback (dropped when its completion arrives:
//! every operation's callback runs once, also when a shutdown fails it, and also after its
//! handle was released); `fv_forget_completion` is for those operations only.

use std::collections::{HashSet, VecDeque};
use std::sync::{Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::handle::HandleId;

/// One completed operation, as its done callback was told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub user_data: usize,
    pub handle: HandleId,
    pub status: i32,
}

#[derive(Default)]
pub struct CompletionQueue {
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Completion>,
    /// Handles whose completion nobody takes: dropped on arrival.
    forgotten: HashSet<HandleId>,
}

/// The process's queue (the C API's `fv_queue_completion` and `fv_next_completion`).
pub static COMPLETIONS: LazyLock<CompletionQueue> = LazyLock::new(CompletionQueue::default);

impl CompletionQueue {
    pub fn push(&self, c: Completion) {
        let mut s = self.state.lock().expect("completions");
        if s.forgotten.remove(&c.handle) {
            return;
        }
        s.queue.push_back(c);
        drop(s);
        self.ready.notify_one();
    }

    /// The oldest completion, waiting up to `timeout` (None: for ever) for one.
    pub fn pop(&self, timeout: Option<Duration>) -> Option<Completion> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.state.lock().expect("completions");
        loop {
            if let Some(c) = s.queue.pop_front() {
                return Some(c);
            }
            s = match deadline {
                None => self.ready.wait(s).expect("completions"),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.ready.wait_timeout(s, left).expect("completions").0
                }
            };
        }
    }

    /// Handle `h`'s completion will not be taken: true if it is now never delivered (it was
    /// queued, or it has not arrived while `done` says the operation is unfinished); false if
    /// it may already have been popped or is on its way (`done` true), and is delivered.
    /// `done` is read under the queue's lock: an operation marks itself done before its
    /// callback pushes, so an unfinished one's push comes after and finds it forgotten.
    pub fn forget(&self, h: HandleId, done: impl FnOnce() -> bool) -> bool {
        let mut s = self.state.lock().expect("completions");
        if let Some(i) = s.queue.iter().position(|c| c.handle == h) {
            s.queue.remove(i);
            return true;
        }
        if done() {
            return false;
        }
        s.forgotten.insert(h);
        true
    }

    #[cfg(test)]
    fn forgotten(&self) -> usize {
        self.state.lock().unwrap().forgotten.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn c(user_data: usize, handle: HandleId) -> Completion {
        Completion {
            user_data,
            handle,
            status: 0,
        }
    }

    #[test]
    fn completions_come_out_in_the_order_they_went_in() {
        let q = CompletionQueue::default();
        q.push(c(7, 1));
        q.push(c(8, 2));
        assert_eq!(q.pop(Some(Duration::ZERO)), Some(c(7, 1)));
        assert_eq!(q.pop(None), Some(c(8, 2)));
        assert_eq!(q.pop(Some(Duration::from_millis(20))), None);
    }

    #[test]
    fn a_pop_waits_for_the_push_of_another_thread() {
        let q = Arc::new(CompletionQueue::default());
        let p = q.clone();
        let t = std::thread::spawn(move || p.pop(None));
        std::thread::sleep(Duration::from_millis(20));
        q.push(c(3, 9));
        assert_eq!(t.join().unwrap(), Some(c(3, 9)));
    }

    #[test]
    fn a_forgotten_completion_is_never_delivered() {
        let q = CompletionQueue::default();
        // not arrived, operation unfinished: dropped on arrival, and only that one
        assert!(q.forget(1, || false));
        q.push(c(10, 1));
        q.push(c(11, 2));
        assert_eq!(q.pop(Some(Duration::ZERO)), Some(c(11, 2)));
        assert_eq!(q.pop(Some(Duration::ZERO)), None);
        assert_eq!(q.forgotten(), 0);
        // already queued: taken out
        q.push(c(12, 3));
        assert!(q.forget(3, || true));
        assert_eq!(q.pop(Some(Duration::ZERO)), None);
        // finished but not queued (popped, or on its way): delivered, nothing remembered
        assert!(!q.forget(4, || true));
        assert_eq!(q.forgotten(), 0);
        q.push(c(13, 4));
        assert_eq!(q.pop(Some(Duration::ZERO)), Some(c(13, 4)));
    }
}
