//! Tensor fusion: many small responses become one collective over a fusion buffer.

pub mod autotune;
pub mod planner;
