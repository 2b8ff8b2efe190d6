//! Per-name state with a bound. Stores keyed by tensor name (the `u8` codec's residuals,
//! gossip's rounds and public copies) would otherwise grow by one entry for every name ever
//! seen: unnamed operations get a fresh name on every call. Two rules keep them bounded:
//! - an unnamed operation's name (`is_unnamed`) never repeats, so its state is never kept;
//! - an entry unused for a window of the store's uses is evicted. For an entry that recurs
//!   the window is at least `MIN_WINDOW` uses and four times the entries that recur, so a
//!   model's tensors (each used once a step) are never evicted between their steps however
//!   many there are; an entry used once so far goes sooner (`ONCE_WINDOW`, or twice the
//!   entries that recur), so that names used once (distinct names, each its own residual)
//!   hold little. A name that comes back after its eviction (a first step longer than that
//!   window) recurs from then on: the store remembers the latest `REMEMBERED` evicted names,
//!   by hash.
//!
//! Eviction depends only on the order of uses: a store used in the agreed batch order evicts
//! alike on every rank.

use std::hash::Hash;
use std::sync::Mutex;

use crate::hashing::HashMap;

/// Uses of a store without which an entry that recurs is never evicted.
pub const MIN_WINDOW: u64 = 4096;

/// Uses without which an entry used once so far is evicted (unless more entries recur).
pub const ONCE_WINDOW: u64 = 128;

/// Evicted names remembered (8 bytes each), to recognise one that comes back.
const REMEMBERED: usize = 1 << 16;

/// A key's hash, the same on every rank and in every run.
pub(crate) fn fingerprint<K: Hash>(key: &K) -> u64 {
    use std::hash::Hasher;
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// Horovod's convention for the names the bindings give unnamed operations: `<op>.noname.<n>`,
/// a grouped one's tensors `<op>.noname.<n>_<i>of<k>`; such a name is used once. (Names that
/// only contain `.noname.`, as `DistributedOptimizer`'s `allreduce.noname.<i>.<j>` for
/// parameters without names, recur every step.)
pub fn is_unnamed(name: &str) -> bool {
    let Some((_, tail)) = name.rsplit_once(".noname.") else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match tail.split_once('_') {
        None => digits(tail),
        Some((n, part)) => {
            digits(n)
                && part
                    .split_once("of")
                    .is_some_and(|(i, k)| digits(i) && digits(k))
        }
    }
}

/// A codec's host state per tensor name (`Recent` behind a lock: shared by a process set's
/// communicators, whichever runs a tensor's batch). An unnamed tensor's state is never kept; a
/// value taken out leaves its entry, so that a steady step allocates neither the name nor the
/// value again.
pub struct Named<V>(Mutex<Recent<String, V>>);

impl<V> Default for Named<V> {
    fn default() -> Named<V> {
        Named(Mutex::new(Recent::default()))
    }
}

impl<V: Default> Named<V> {
    /// `name`'s value, taken out, where `fits` says it still fits the tensor; else `fresh()`.
    pub fn take_or(
        &self,
        name: &str,
        fits: impl FnOnce(&V) -> bool,
        fresh: impl FnOnce() -> V,
    ) -> V {
        let mut map = self.0.lock().expect("per-name store");
        match map.take(&name.to_owned()).0 {
            Some(v) if fits(&v) => v,
            _ => fresh(),
        }
    }

    pub fn put(&self, name: &str, value: V) {
        if is_unnamed(name) {
            return;
        }
        let mut map = self.0.lock().expect("per-name store");
        match map.touch(&name.to_owned()) {
            Some(slot) => *slot = value,
            None => map.put(name.to_owned(), value),
        }
    }

    /// What `look` makes of `name`'s value (None: it has none), counted as no use.
    pub fn peek<R>(&self, name: &str, look: impl FnOnce(Option<&V>) -> R) -> R {
        let map = self.0.lock().expect("per-name store");
        look(map.peek(&name.to_owned()))
    }

    /// Names holding a value.
    pub fn len(&self) -> usize {
        self.0.lock().expect("per-name store").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Entry<V> {
    value: V,
    /// The store's clock at the latest use.
    last: u64,
    /// Whether the entry was used more than once.
    recurs: bool,
}

/// A map whose entries are evicted once unused for the store's window (see the module).
pub struct Recent<K, V> {
    map: HashMap<K, Entry<V>>,
    /// Uses so far.
    clock: u64,
    /// Entries used more than once.
    recurring: usize,
    /// The clock at the latest sweep.
    swept: u64,
    /// Fingerprints of the latest evicted keys, oldest first, and as a set.
    evicted: std::collections::VecDeque<u64>,
    evicted_set: std::collections::HashSet<u64>,
}

impl<K, V> Default for Recent<K, V> {
    fn default() -> Self {
        Recent {
            map: HashMap::default(),
            clock: 0,
            recurring: 0,
            swept: 0,
            evicted: Default::default(),
            evicted_set: Default::default(),
        }
    }
}

impl<K: Hash + Eq + Clone, V> Recent<K, V> {
    /// Uses without which an entry is evicted.
    pub fn window(&self) -> u64 {
        MIN_WINDOW.max(4 * self.recurring as u64)
    }

    /// Uses without which an entry used once so far is evicted.
    pub fn once_window(&self) -> u64 {
        ONCE_WINDOW.max(2 * self.recurring as u64)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Takes `key`'s value out (its entry stays, so a steady step allocates nothing anew) and
    /// counts a use. Returns what the use evicted, for owners whose values need releasing.
    pub fn take(&mut self, key: &K) -> (Option<V>, Vec<V>)
    where
        V: Default,
    {
        let value = self.touch(key).map(std::mem::take);
        (value, self.sweep())
    }

    /// `key`'s value, not marked used.
    pub fn peek(&self, key: &K) -> Option<&V> {
        self.map.get(key).map(|e| &e.value)
    }

    /// `key`'s value, marked used, or `None` (then nothing is counted: `put` counts it).
    pub fn touch(&mut self, key: &K) -> Option<&mut V> {
        let clock = self.clock;
        let e = self.map.get_mut(key)?;
        if !e.recurs {
            e.recurs = true;
            self.recurring += 1;
        }
        e.last = clock;
        self.clock += 1;
        Some(&mut e.value)
    }

    /// Stores `value` under `key` (a use if `key` is new).
    pub fn put(&mut self, key: K, value: V) {
        match self.map.get_mut(&key) {
            Some(e) => e.value = value,
            None => {
                // back after its eviction: it recurs, and the window was too short for it
                let recurs = self.evicted_set.contains(&fingerprint(&key));
                self.recurring += usize::from(recurs);
                self.map.insert(
                    key,
                    Entry {
                        value,
                        last: self.clock,
                        recurs,
                    },
                );
                self.clock += 1;
            }
        }
    }

    /// Removes `key` for good.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let e = self.map.remove(key)?;
        self.recurring -= usize::from(e.recurs);
        Some(e.value)
    }

    /// Evicts the entries unused for their window, scanning every half `once_window` of uses
    /// or every quarter of the entries' count, whichever is more (a few lookups per use).
    /// Returns their values.
    pub fn sweep(&mut self) -> Vec<V> {
        self.sweep_keys().into_iter().map(|(_, v)| v).collect()
    }

    /// `sweep`, with the evicted keys, for stores whose keys name state elsewhere.
    pub fn sweep_keys(&mut self) -> Vec<(K, V)> {
        let (window, once) = (self.window(), self.once_window());
        // every so many uses that a scan costs at most a few lookups per use
        if self.clock - self.swept < (once / 2).max(self.map.len() as u64 / 4) {
            return Vec::new();
        }
        self.swept = self.clock;
        let clock = self.clock;
        let stale: Vec<K> = (self.map.iter())
            .filter(|(_, e)| clock - e.last > if e.recurs { window } else { once })
            .map(|(k, _)| k.clone())
            .collect();
        for k in &stale {
            let f = fingerprint(k);
            if self.evicted_set.insert(f) {
                self.evicted.push_back(f);
            }
            if self.evicted.len() > REMEMBERED
                && let Some(old) = self.evicted.pop_front()
            {
                self.evicted_set.remove(&old);
            }
        }
        stale
            .into_iter()
            .filter_map(|k| self.remove(&k).map(|v| (k, v)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_used_once_leave_and_recurring_ones_stay() {
        let mut s: Recent<String, u32> = Recent::default();
        // 300 recurring names, used once a step, and a fresh name every use in between
        for step in 0..100u32 {
            for t in 0..300 {
                let name = format!("grad.{t}");
                if s.touch(&name).is_none() {
                    s.put(name, step);
                }
                s.put(format!("once.{step}.{t}"), 0);
                s.sweep();
            }
        }
        let recurring = (0..300).filter(|t| s.touch(&format!("grad.{t}")).is_some());
        assert_eq!(recurring.count(), 300, "a recurring name was evicted");
        assert!(
            s.len() <= 300 + 3 * 600 + 1,
            "{} entries: names used once were kept",
            s.len()
        );
    }

    #[test]
    fn the_window_grows_with_the_names_that_recur() {
        let mut s: Recent<u32, ()> = Recent::default();
        let n = 3 * MIN_WINDOW as u32;
        // the first step is longer than the window: its first names are evicted, come back,
        // and from then on recur
        let mut evicted = 0;
        for step in 0..4 {
            for t in 0..n {
                if s.touch(&t).is_none() {
                    s.put(t, ());
                    evicted += usize::from(step > 0);
                }
                s.sweep();
            }
            if step == 1 {
                evicted = 0;
            }
        }
        assert_eq!(evicted, 0, "a model's tensors were evicted between steps");
        assert_eq!(s.len(), n as usize);
        assert!(s.window() >= 4 * n as u64);
    }

    #[test]
    fn unnamed_is_horovods_noname() {
        assert!(is_unnamed("allreduce.noname.17"));
        assert!(is_unnamed("grouped_allreduce.noname.5_1of2"));
        assert!(!is_unnamed("allreduce.grad.0"));
        assert!(!is_unnamed("noname"));
        // a parameter's gradient without a name recurs every step
        assert!(!is_unnamed("allreduce.allreduce.noname.0.1"));
        assert!(!is_unnamed("allreduce.bucket.3.allreduce.noname.0.5"));
        assert!(!is_unnamed("allreduce.noname.3_x"));
    }
}
