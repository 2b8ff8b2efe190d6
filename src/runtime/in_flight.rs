//! Which tensor names are being processed, per process set: Horovod refuses a tensor whose
//! name is still in flight. A name is in flight while the operation it was last submitted in
//! has not completed, so completing a tensor costs nothing here, and a name submitted every
//! step keeps its key (no string copied per submission). The same map remembers where a GPU
//! tensor's memory was at its name's last submission: a fused batch is replayed from a CUDA
//! graph only while its tensors stay where they were (`collective::replay`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use crate::hashing::{HashMap, HashSet};
use crate::runtime::handle::Handle;

#[derive(Default)]
pub(crate) struct InFlight {
    sets: HashMap<i32, Names>,
}

/// A GPU tensor's input and output addresses.
pub(crate) type Place = [u64; 2];

#[derive(Default)]
struct Names {
    last: HashMap<String, Last>,
    /// Size at which names of finished operations are dropped (names that are never submitted
    /// again, as Horovod's numbered `noname` tensors, would otherwise pile up).
    prune_at: usize,
}

/// A name's last submission.
struct Last {
    op: Weak<Handle>,
    place: Option<Place>,
}

fn busy(last: &Last) -> bool {
    last.op.upgrade().is_some_and(|h| !h.is_done())
}

/// Held by a GPU tensor submitted at other addresses than its name's last submission (or for
/// the first time), until its batch is launched: while any is held, this rank's votes say
/// that tensors moved, and no batch agreed in them is replayed from a graph.
pub(crate) struct MovedMark(Arc<AtomicUsize>);

impl MovedMark {
    pub fn new(held: &Arc<AtomicUsize>) -> MovedMark {
        held.fetch_add(1, Ordering::SeqCst);
        MovedMark(held.clone())
    }
}

impl Drop for MovedMark {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

const MIN_PRUNE_AT: usize = 1024;

impl InFlight {
    /// Claims `names` (with a GPU tensor's place) for `op` in process set `set`. None,
    /// claiming nothing, when one of them is in flight or appears twice; else whether some GPU
    /// tensor moved: its place differs from its name's last submission, or the name is new.
    pub fn claim<'a, I>(&mut self, set: i32, names: I, op: &Arc<Handle>) -> Option<bool>
    where
        I: IntoIterator<Item = (&'a str, Option<Place>)>,
        I::IntoIter: Clone,
    {
        let names = names.into_iter();
        let held = self.sets.entry(set).or_default();
        let many = names.clone().nth(1).is_some();
        let mut seen = HashSet::default();
        for (n, _) in names.clone() {
            if held.last.get(n).is_some_and(busy) || (many && !seen.insert(n)) {
                return None;
            }
        }
        let weak = Arc::downgrade(op);
        let mut moved = false;
        for (n, place) in names {
            let now = Last {
                op: weak.clone(),
                place,
            };
            match held.last.get_mut(n) {
                Some(slot) => {
                    moved |= place.is_some() && slot.place != place;
                    *slot = now;
                }
                None => {
                    moved |= place.is_some();
                    held.last.insert(n.to_string(), now);
                }
            }
        }
        if held.last.len() >= held.prune_at.max(MIN_PRUNE_AT) {
            held.last.retain(|_, last| busy(last));
            held.prune_at = 2 * held.last.len();
        }
        Some(moved)
    }

    /// Names held, over all sets (for tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.sets.values().map(|n| n.last.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::handle::{HandleTable, TensorResult};

    impl InFlight {
        /// Host tensors (no places): whether the claim succeeded.
        fn claim_host<const N: usize>(
            &mut self,
            set: i32,
            names: [&str; N],
            op: &Arc<Handle>,
        ) -> bool {
            let names = names.into_iter().map(|n| (n, None));
            self.claim(set, names, op) == Some(false)
        }
    }

    #[test]
    fn a_gpu_tensor_moved_when_new_or_at_other_addresses() {
        let table = HandleTable::default();
        let mut f = InFlight::default();
        let done = |f: &mut InFlight, names: &[(&str, Option<Place>)]| {
            let h = table.create(names.len(), None);
            let moved = f.claim(0, names.iter().copied(), &h);
            for i in 0..names.len() {
                h.complete_one(i, Ok(TensorResult::default()), None);
            }
            moved
        };
        assert_eq!(done(&mut f, &[("a", Some([1, 1]))]), Some(true), "new");
        assert_eq!(done(&mut f, &[("a", Some([1, 1]))]), Some(false));
        assert_eq!(
            done(&mut f, &[("a", Some([1, 1])), ("b", None)]),
            Some(false),
            "host tensors never move"
        );
        assert_eq!(
            done(&mut f, &[("a", Some([1, 2]))]),
            Some(true),
            "output moved"
        );
        assert_eq!(done(&mut f, &[("a", Some([1, 2]))]), Some(false));
        let held = Arc::new(AtomicUsize::new(0));
        let marks = [MovedMark::new(&held), MovedMark::new(&held)];
        assert_eq!(held.load(Ordering::SeqCst), 2);
        drop(marks);
        assert_eq!(held.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_name_is_free_again_once_its_operation_completes() {
        let table = HandleTable::default();
        let mut f = InFlight::default();
        let a = table.create(2, None);
        assert!(f.claim_host(0, ["x", "y"], &a));
        let b = table.create(1, None);
        assert!(!f.claim_host(0, ["y"], &b), "y is in flight");
        assert!(f.claim_host(1, ["y"], &b), "another process set");
        assert!(!f.claim_host(0, ["z", "z"], &b), "twice in one operation");
        assert!(f.claim_host(0, ["z"], &b), "the refused claim took nothing");
        a.complete_one(0, Ok(TensorResult::default()), None);
        assert!(
            !f.claim_host(0, ["x"], &table.create(1, None)),
            "the operation is not done"
        );
        a.complete_one(1, Ok(TensorResult::default()), None);
        assert!(f.claim_host(0, ["x", "y"], &table.create(1, None)));
        // an operation nobody holds any more is not in flight either
        let c = table.create(1, None);
        assert!(f.claim_host(0, ["w"], &c));
        table.release(c.id).unwrap();
        drop(c);
        assert!(f.claim_host(0, ["w"], &table.create(1, None)));
    }

    #[test]
    fn names_of_finished_operations_do_not_pile_up() {
        let table = HandleTable::default();
        let mut f = InFlight::default();
        let pending = table.create(1, None);
        assert!(f.claim_host(0, ["kept"], &pending));
        for i in 0..10 * MIN_PRUNE_AT {
            let h = table.create(1, None);
            assert!(f.claim_host(0, [format!("noname.{i}").as_str()], &h));
            h.complete_one(0, Ok(TensorResult::default()), None);
        }
        assert!(f.held() <= MIN_PRUNE_AT, "{} names held", f.held());
        assert!(!f.claim_host(0, ["kept"], &table.create(1, None)));
    }
}
