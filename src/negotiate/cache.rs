//! The response cache: names already negotiated get a bit, and readiness of cached names is then
//! agreed by one bitwise AND instead of a coordinator round. Every mutation (put, touch, erase)
//! happens in the same order on every rank, so bit assignment is identical everywhere without
//! ever being communicated.

use std::sync::Arc;

use crate::hashing::HashMap;
use crate::message::{OpKind, Request, Response};

/// Outcome of looking a request up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Same name and same parameters as when cached: may vote on `bit`.
    Hit(usize),
    /// Same name, different parameters: `bit` must be erased on every rank.
    Invalid(usize),
    Miss,
}

struct Entry {
    /// Shared with the cycles that take it: a vote that agrees on a learned bucket hands out
    /// its 130 responses without copying a name or shape.
    response: Arc<Response>,
    /// This rank's own request when the response was cached (None if it had none, e.g. joined).
    local: Option<Request>,
    last_used: u64,
}

pub struct ResponseCache {
    capacity: usize,
    slots: Vec<Option<Entry>>,
    by_name: HashMap<String, usize>,
    clock: u64,
    evicted: bool,
    /// Bumped whenever a name may have gained or lost its bit.
    generation: u64,
}

/// Whether `req` asks for exactly what `cached` (this rank's earlier request) asked for.
/// Alltoall's first dimension is exchanged with the data, so it may change between steps.
fn same_parameters(req: &Request, cached: &Request) -> bool {
    let (mut a, mut b) = (req.params(), cached.params());
    if req.kind == OpKind::Alltoall && a.shape.len() == b.shape.len() && !a.shape.is_empty() {
        a.shape = &a.shape[1..];
        b.shape = &b.shape[1..];
    }
    a == b
}

impl ResponseCache {
    pub fn new(capacity: usize) -> Self {
        ResponseCache {
            capacity,
            slots: Vec::new(),
            by_name: HashMap::default(),
            clock: 0,
            evicted: false,
            generation: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Number of bits in use; the bit vector exchanged each cycle has this many cache bits.
    pub fn num_bits(&self) -> usize {
        self.slots.len()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Changes whenever the name-to-bit mapping may have changed (what is derived from it can
    /// be kept while it stays the same).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn lookup(&self, req: &Request) -> Lookup {
        let Some(&bit) = self.by_name.get(&req.name) else {
            return Lookup::Miss;
        };
        let entry = self.slots[bit].as_ref().expect("indexed slot is occupied");
        match &entry.local {
            Some(local) if same_parameters(req, local) => Lookup::Hit(bit),
            _ => Lookup::Invalid(bit),
        }
    }

    /// The bit of the cached response named `name`.
    pub fn bit_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Bits of cached allreduce responses: what a joined rank votes ready for.
    pub fn allreduce_bits(&self) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, Some(e) if e.response.kind == OpKind::Allreduce))
            .map(|(i, _)| i)
            .collect()
    }

    /// The cached response for `bit`, marking it most recently used.
    pub fn take_response(&mut self, bit: usize) -> Option<Arc<Response>> {
        self.clock += 1;
        let clock = self.clock;
        self.slots.get_mut(bit)?.as_mut().map(|e| {
            e.last_used = clock;
            e.response.clone()
        })
    }

    pub fn erase(&mut self, bit: usize) {
        self.generation += 1;
        if let Some(Some(e)) = self.slots.get_mut(bit).map(Option::take) {
            self.by_name.remove(&e.response.name);
        }
    }

    /// Caches `response` (a negotiated, error-free, cacheable response). Replaces an entry of
    /// the same name; otherwise takes the lowest free bit, or evicts the least recently used.
    /// Returns true when it had to evict.
    pub fn put(&mut self, response: &Response, local: Option<Request>) -> bool {
        if !self.enabled() || !response.kind.cacheable() || response.error.is_some() {
            return false;
        }
        self.clock += 1;
        self.generation += 1;
        let entry = Entry {
            response: Arc::new(response.clone()),
            local,
            last_used: self.clock,
        };
        if let Some(&bit) = self.by_name.get(&response.name) {
            self.slots[bit] = Some(entry);
            return false;
        }
        let mut evicted = false;
        let bit = if let Some(free) = self.slots.iter().position(Option::is_none) {
            free
        } else if self.slots.len() < self.capacity {
            self.slots.push(None);
            self.slots.len() - 1
        } else {
            let lru = self
                .slots
                .iter()
                .enumerate()
                .min_by_key(|(_, s)| s.as_ref().map(|e| e.last_used).unwrap_or(0))
                .map(|(i, _)| i)
                .expect("capacity > 0");
            self.erase(lru);
            evicted = true;
            lru
        };
        if evicted && !self.evicted {
            self.evicted = true;
            tracing::warn!(
                "A response has been evicted from cache which may indicate reduced performance. Better performance may be obtained by disabling caching (HOROVOD_CACHE_CAPACITY=0) or increasing the cache capacity (HOROVOD_CACHE_CAPACITY>{}).",
                self.capacity
            );
        }
        self.by_name.insert(response.name.clone(), bit);
        self.slots[bit] = Some(entry);
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;

    fn req(name: &str, shape: &[i64]) -> Request {
        Request::test(name, OpKind::Allreduce, DataType::F32, shape)
    }

    fn put(c: &mut ResponseCache, r: &Request) -> bool {
        c.put(&Response::from_request(r), Some(r.clone()))
    }

    #[test]
    fn hit_invalid_miss() {
        let mut c = ResponseCache::new(4);
        let a = req("a", &[2, 3]);
        assert_eq!(c.lookup(&a), Lookup::Miss);
        put(&mut c, &a);
        assert_eq!(c.lookup(&a), Lookup::Hit(0));
        assert_eq!(c.lookup(&req("a", &[3, 2])), Lookup::Invalid(0));
        let mut scaled = a.clone();
        scaled.postscale = 0.5;
        assert_eq!(c.lookup(&scaled), Lookup::Invalid(0));
        c.erase(0);
        assert_eq!(c.lookup(&a), Lookup::Miss);
        assert!(c.is_empty());
    }

    #[test]
    fn identical_mutation_sequences_give_identical_bits() {
        // Two ranks with different local requests (allgather dim0) but the same response order
        // must assign the same bits.
        let mut c1 = ResponseCache::new(3);
        let mut c2 = ResponseCache::new(3);
        let names = ["a", "b", "c", "d", "b", "e", "a"];
        for (i, n) in names.iter().enumerate() {
            let r1 = req(n, &[i as i64 + 1]);
            let r2 = req(n, &[i as i64 + 7]);
            let resp = Response::from_request(&r1);
            c1.put(&resp, Some(r1.clone()));
            c2.put(&resp, Some(r2.clone()));
            if i == 3 {
                c1.take_response(c1.lookup(&req("c", &[3])).bit());
                c2.take_response(c2.by_name["c"]);
            }
            assert_eq!(c1.by_name, c2.by_name, "after step {i}");
        }
        assert_eq!(c1.len(), 3);
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut c = ResponseCache::new(2);
        put(&mut c, &req("a", &[1]));
        put(&mut c, &req("b", &[1]));
        c.take_response(0); // touch a
        assert!(put(&mut c, &req("c", &[1])));
        assert_eq!(c.lookup(&req("b", &[1])), Lookup::Miss);
        assert_eq!(c.lookup(&req("c", &[1])), Lookup::Hit(1));
        assert_eq!(c.lookup(&req("a", &[1])), Lookup::Hit(0));
    }

    #[test]
    fn disabled_and_uncacheable() {
        let mut c = ResponseCache::new(0);
        assert!(!put(&mut c, &req("a", &[1])));
        assert_eq!(c.lookup(&req("a", &[1])), Lookup::Miss);
        let mut c = ResponseCache::new(4);
        let mut j = req("join", &[]);
        j.kind = OpKind::Join;
        put(&mut c, &j);
        assert!(c.is_empty());
        let mut e = Response::from_request(&req("x", &[1]));
        e.error = Some("bad".into());
        c.put(&e, None);
        assert!(c.is_empty());
    }

    #[test]
    fn alltoall_ignores_first_dimension() {
        let mut c = ResponseCache::new(4);
        let mut a = req("a2a", &[4, 3]);
        a.kind = OpKind::Alltoall;
        put(&mut c, &a);
        let mut b = a.clone();
        b.shape = vec![9, 3];
        assert_eq!(c.lookup(&b), Lookup::Hit(0));
        b.shape = vec![9, 4];
        assert_eq!(c.lookup(&b), Lookup::Invalid(0));
    }

    impl Lookup {
        fn bit(self) -> usize {
            match self {
                Lookup::Hit(b) | Lookup::Invalid(b) => b,
                Lookup::Miss => panic!("miss"),
            }
        }
    }
}
