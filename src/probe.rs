//! Stage timestamps for benchmarks: when votes began (with the tensors waiting) and ended
//! (with the tensors agreed), GPU batches were launched, their events fired and their tensors
//! completed. Off unless a benchmark switches it on; far cheaper than the timeline, which
//! writes JSON for every tensor, so it can look inside one step.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static MARKS: Mutex<Vec<Mark>> = Mutex::new(Vec::new());

/// One stage reached: what, when, and how many tensors it concerned.
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    pub at: Instant,
    pub what: &'static str,
    pub tensors: usize,
}

pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

pub(crate) fn mark(what: &'static str, tensors: usize) {
    if ON.load(Ordering::Relaxed) {
        let m = Mark {
            at: Instant::now(),
            what,
            tensors,
        };
        MARKS.lock().expect("probe marks").push(m);
    }
}

/// The marks so far, oldest first; clears them.
pub fn take() -> Vec<Mark> {
    std::mem::take(&mut *MARKS.lock().expect("probe marks"))
}
