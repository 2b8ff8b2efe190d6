//! Deciding, identically on every rank, which submitted tensors are ready and in which order.
//!
//! Online negotiation (Horovod's scheme): a name seen for the first time goes through a
//! coordinator round (gather to set rank 0, validate, broadcast responses); a name already
//! cached is agreed by one bitwise-AND allreduce per cycle.

pub mod cache;
pub mod coordinator;
pub mod online;
pub mod ready_bitmap;
pub mod validate;
pub mod wire;
