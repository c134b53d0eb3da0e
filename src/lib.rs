//! pinpool: one fixed arena of CUDA pinned host memory, cut into slots that are handed out and
//! taken back without the GIL, with reuse fenced by CUDA events.
//!
//! The core is plain Rust, testable with `cargo test` on a machine without a GPU:
//!
//! - [`arena`]: the one block of host memory (pinned through the CUDA driver, or plain);
//! - [`slots`]: the slot state machine: each checkout's state and extent;
//! - [`extents`]: where in the arena each slot's bytes go (first fit, no part crossed);
//! - [`fence`]: what keeps a released slot out of circulation until the GPU is done with it;
//! - [`pool`]: arena + slot table + fences, checkout and release, the object users hold; its
//!   claim policy ([`pool::claim`]), copies into slots and to the device
//!   ([`pool::transfer`]), stats ([`pool::stats`]), background threads and teardown;
//! - [`lease`]: one checked-out slot held by one owner: pins and deferred release;
//! - [`copy`]: multi-threaded copies of byte ranges;
//! - [`shm`]: sealed shared-memory files and their mappings (the arena's parts, segments);
//! - [`pkeys`]: memory protection keys, a thread's own switch for its access to a mapping;
//! - [`grants`]: zero-copy slots of exactly a batch's size, granted to the worker that
//!   collated it when it asks (at the grant desk, [`transport::grant_desk`]);
//! - [`window`]: a zero-copy worker's lasting mapping of arena extents, inaccessible between
//!   batches;
//! - [`transport`]: batches from worker processes in shared-memory segments, and the
//!   reclaimer that maps, counts and unmaps them on a background thread;
//! - [`freeing`]: the thread that frees a dropped pool's arena, so no caller waits for it;
//! - [`handoff`]: a job handed to another thread and waited for, taken back if not begun in
//!   time;
//! - [`priority`]: pinpool's background threads give way to the training thread;
//! - [`forks`]: whether this is still the process that made a pool, without a system call;
//! - [`fork_private`]: a forked child gets the arenas as private copy-on-write memory;
//! - [`cuda`]: the few driver calls we need, loaded at run time, never panicking;
//! - [`device_choice`]: which device a pool binds to when none is named (the rank's own);
//! - [`topology`]: the machine's NUMA nodes as sysfs tells them, and the node of a GPU;
//! - [`numa`]: putting an arena's pages and pinpool's threads on that node.
//!
//! The PyO3 layer (`python`, behind the `python` feature) only translates types and errors and
//! releases the GIL around anything that can block.

pub mod arena;
pub mod copy;
pub mod cuda;
pub mod device_choice;
pub mod error;
pub mod extents;
pub mod fence;
pub mod fork_private;
pub mod forks;
pub mod freeing;
pub mod grants;
pub mod handoff;
pub mod lease;
pub mod numa;
pub mod pkeys;
pub mod pool;
pub mod priority;
pub mod shm;
pub mod slots;
pub mod topology;
pub mod transport;
pub mod window;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use pool::{Claim, ClaimRules, Pool, PoolConfig, Stats};
pub use slots::Checkout;

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
