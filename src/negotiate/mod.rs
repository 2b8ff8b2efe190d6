//! Deciding, identically on every rank, which submitted tensors are ready and in which order.
//!
//! Online negotiation (Horovod's scheme): a name seen for the first time goes through a
//! coordinator round (gather to set rank 0, validate, broadcast responses); a name already
//! cached is agreed by one bitwise-AND allreduce per cycle. Offline negotiation: a plan learned
//! from what online negotiation agreed (or loaded from a file) replaces the per-cycle vote.

pub mod cache;
pub mod coordinator;
pub mod learn;
pub mod offline;
pub mod online;
pub mod plan;
pub mod ready_bitmap;
pub mod set;
pub mod validate;
pub mod wire;
