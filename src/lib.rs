//! pinpool: one fixed arena of CUDA pinned host memory, cut into slots that are handed out and
//! taken back without the GIL, with reuse fenced by CUDA events.
//!
//! The core is plain Rust, testable with `cargo test` on a machine without a GPU:
//!
//! - [`arena`]: the one block of host memory (pinned through the CUDA driver, or plain);
//! - [`slots`]: the slot state machine and free list;
//! - [`fence`]: what keeps a released slot out of circulation until the GPU is done with it;
//! - [`pool`]: arena + slots + fences + copies, the object users hold;
//! - [`copy`]: multi-threaded copies of byte ranges;
//! - [`shm`], [`segment`], [`reclaim`]: shared memory from worker processes, and unmapping it
//!   on a background thread;
//! - [`cuda`]: the few driver calls we need, loaded at run time, never panicking.
//!
//! The PyO3 layer (`python`, behind the `python` feature) only translates types and errors and
//! releases the GIL around anything that can block.

pub mod arena;
pub mod copy;
pub mod cuda;
pub mod error;
pub mod fence;
pub mod pool;
pub mod reclaim;
pub mod segment;
pub mod shm;
pub mod slots;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use pool::{Pool, PoolConfig, Stats};
pub use slots::Ticket;
