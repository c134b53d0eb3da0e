//! How a batch travels from a worker process to the main process in copy mode: the worker's
//! reusable segments and the main process's cache of their mappings ([`segment`]), and the
//! thread that unmaps retired ones off the caller's thread ([`reclaim`]).
//!
//! Invariants: see each module. Everything here maps only sealed memfds
//! ([`crate::shm::check_sealed`]), and nothing here unmaps on a thread that may hold the GIL.

pub mod reclaim;
pub mod segment;
