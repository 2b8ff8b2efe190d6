//! Which tensor names are being processed, per process set: Horovod refuses a tensor whose
//! name is still in flight. A name is in flight while the operation it was last submitted in
//! has not completed, so completing a tensor costs nothing here, and a name submitted every
//! step keeps its key (no string copied per submission).

use std::sync::{Arc, Weak};

use crate::hashing::{HashMap, HashSet};
use crate::runtime::handle::Handle;

#[derive(Default)]
pub(crate) struct InFlight {
    sets: HashMap<i32, Names>,
}

#[derive(Default)]
struct Names {
    last: HashMap<String, Weak<Handle>>,
    /// Size at which names of finished operations are dropped (names that are never submitted
    /// again, as Horovod's numbered `noname` tensors, would otherwise pile up).
    prune_at: usize,
}

fn busy(op: &Weak<Handle>) -> bool {
    op.upgrade().is_some_and(|h| !h.is_done())
}

const MIN_PRUNE_AT: usize = 1024;

impl InFlight {
    /// Claims `names` for `op` in process set `set`. False, claiming nothing, when one of them
    /// is in flight or appears twice.
    pub fn claim<'a, I>(&mut self, set: i32, names: I, op: &Arc<Handle>) -> bool
    where
        I: IntoIterator<Item = &'a str>,
        I::IntoIter: Clone,
    {
        let names = names.into_iter();
        let held = self.sets.entry(set).or_default();
        let many = names.clone().nth(1).is_some();
        let mut seen = HashSet::default();
        for n in names.clone() {
            if held.last.get(n).is_some_and(busy) || (many && !seen.insert(n)) {
                return false;
            }
        }
        let weak = Arc::downgrade(op);
        for n in names {
            match held.last.get_mut(n) {
                Some(slot) => *slot = weak.clone(),
                None => {
                    held.last.insert(n.to_string(), weak.clone());
                }
            }
        }
        if held.last.len() >= held.prune_at.max(MIN_PRUNE_AT) {
            held.last.retain(|_, op| busy(op));
            held.prune_at = 2 * held.last.len();
        }
        true
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

    #[test]
    fn a_name_is_free_again_once_its_operation_completes() {
        let table = HandleTable::default();
        let mut f = InFlight::default();
        let a = table.create(2, None);
        assert!(f.claim(0, ["x", "y"], &a));
        let b = table.create(1, None);
        assert!(!f.claim(0, ["y"], &b), "y is in flight");
        assert!(f.claim(1, ["y"], &b), "another process set");
        assert!(!f.claim(0, ["z", "z"], &b), "twice in one operation");
        assert!(f.claim(0, ["z"], &b), "the refused claim took nothing");
        a.complete_one(0, Ok(TensorResult::default()), None);
        assert!(
            !f.claim(0, ["x"], &table.create(1, None)),
            "the operation is not done"
        );
        a.complete_one(1, Ok(TensorResult::default()), None);
        assert!(f.claim(0, ["x", "y"], &table.create(1, None)));
        // an operation nobody holds any more is not in flight either
        let c = table.create(1, None);
        assert!(f.claim(0, ["w"], &c));
        table.release(c.id).unwrap();
        drop(c);
        assert!(f.claim(0, ["w"], &table.create(1, None)));
    }

    #[test]
    fn names_of_finished_operations_do_not_pile_up() {
        let table = HandleTable::default();
        let mut f = InFlight::default();
        let pending = table.create(1, None);
        assert!(f.claim(0, ["kept"], &pending));
        for i in 0..10 * MIN_PRUNE_AT {
            let h = table.create(1, None);
            assert!(f.claim(0, [format!("noname.{i}").as_str()], &h));
            h.complete_one(0, Ok(TensorResult::default()), None);
        }
        assert!(f.held() <= MIN_PRUNE_AT, "{} names held", f.held());
        assert!(!f.claim(0, ["kept"], &table.create(1, None)));
    }
}
