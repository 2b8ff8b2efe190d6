//! ferrovod: the communication core of data-parallel training, with Horovod's semantics.
//!
//! Data flow (see DESIGN.md): C API → runtime queue → background thread cycles →
//! negotiate → fuse → execute over a transport → complete.
#![deny(unsafe_code)]

pub mod collective;
pub mod compress;
pub mod config;
pub mod dtype;
pub mod elementwise;
pub mod error;
pub mod fusion;
mod hashing;
pub mod message;
pub mod negotiate;
pub mod probe;
pub mod runtime;
pub mod sim;
pub mod store;

#[allow(unsafe_code)]
pub mod capi;
#[allow(unsafe_code)]
pub mod transport;

pub use dtype::DataType;
pub use error::{Error, Result, Status};
pub use message::{OpKind, ReduceOp};

/// Tensors are submitted on framework threads and freed on ferrovod's: with glibc's allocator
/// those cross-thread frees contend for the submitting thread's arena, a tail of slow enqueues
/// (BENCHMARKS.md, "Figures moved out of comments"). mimalloc frees across threads without a
/// shared lock.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The crate version, as the C API reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
