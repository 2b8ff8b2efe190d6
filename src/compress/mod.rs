//! Compression: how a batch's values travel on the wire. The stage between fusion and the
//! collective: a codec is chosen per batch from agreed data only, so every rank encodes and
//! decodes the same batches alike. Only `none` exists yet.

use crate::message::Response;

/// How a batch's values travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Codec {
    /// As the caller's dtype.
    #[default]
    None,
}

/// The codec of a batch: a pure function of its agreed responses (identical on every rank).
pub fn choose(resps: &[&Response]) -> Codec {
    debug_assert!(!resps.is_empty());
    Codec::None
}
