//! The hash maps of the per-tensor path (names, handle ids): FxHash, several times cheaper than
//! the standard SipHash on short keys. Their keys come from the job's own code, never from an
//! adversary, so a hash without flooding resistance is fine.

pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, rustc_hash::FxBuildHasher>;
pub(crate) type HashSet<T> = std::collections::HashSet<T, rustc_hash::FxBuildHasher>;
