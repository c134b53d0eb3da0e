//! pinpool: one fixed arena of CUDA pinned host memory, cut into slots that are handed out and
//! taken back without the GIL, with reuse fenced by CUDA events.
//!
//! The core is plain Rust, testable with `cargo test` on a machine without a GPU. Its folders
//! are layers; each uses only the layers listed before it (and [`error`]):
//!
//! - [`system`]: the machine and the process: the CUDA driver, memory protection keys,
//!   thread priorities, forks, random numbers, and jobs handed between threads;
//! - [`memory`]: shared memory and what is built from it: sealed memfds and their mappings,
//!   what a forked child sees of them, the arena, a worker's window onto it, the device an
//!   arena binds to, and the thread that frees it;
//! - [`allocation`]: how the arena is cut up: the extent map (where each slot's bytes go) and
//!   the slot table (each checkout's state and extent);
//! - [`transfer`]: moving bytes: multi-threaded copies, and the fences that keep a released
//!   slot out of circulation until the GPU is done with it;
//! - [`pool`]: arena + slot table + fences, checkout and release, the object users hold; a
//!   slot held by one owner, zero-copy grants, the claim policy, copies into slots, stats,
//!   background threads and teardown;
//! - [`transport`]: batches from worker processes: shared-memory segments, the reclaimer that
//!   unmaps them, the writer of the workers' index pipes, and the grant desk.
//!
//! The PyO3 layer (`python`, behind the `python` feature) only translates types and errors and
//! releases the GIL around anything that can block.

pub mod allocation;
pub mod error;
pub mod memory;
pub mod pool;
pub mod system;
pub mod transfer;
pub mod transport;

#[cfg(feature = "python")]
mod python;

pub use allocation::slots::SlotId;
pub use error::{Error, Result};
pub use pool::claim::{Claim, ClaimRules};
pub use pool::{Pool, PoolConfig, Stats};

/// Proptest settings for the unit tests: `cases` cases; under Miri, which interprets every
/// step, a handful, and no regression files (file access is refused under Miri's isolation).
#[cfg(test)]
pub(crate) fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    #[cfg(miri)]
    let config = proptest::test_runner::Config {
        cases: cases.min(16),
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    };
    #[cfg(not(miri))]
    let config = proptest::test_runner::Config::with_cases(cases);
    config
}
