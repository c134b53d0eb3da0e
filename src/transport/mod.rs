//! How a batch travels from a worker process to the main process in copy mode: the worker's
//! reusable segments and the main process's cache of their mappings ([`segment`]), and the
//! reclaimer that maps and counts them and unmaps retired ones off the caller's thread
//! ([`reclaim`]); the thread that writes each worker's batch indices to its pipe
//! ([`pipe_writer`]) and the reading of the workers' results one whole message at a time
//! ([`pipe_reader`]); and, in zero-copy mode, the desk where workers ask for room in the arena
//! ([`grant_desk`]).
//!
//! Layer invariant: this folder uses [`crate::pool`] and the layers below it; nothing but the
//! Python layer uses it (the pool never does).
//!
//! Invariants: see each module. Everything here maps only sealed memfds
//! ([`crate::memory::shm::check_sealed`]), and nothing here unmaps on a thread that may hold the
//! GIL.

pub mod grant_desk;
pub mod pipe_reader;
pub mod pipe_writer;
pub mod reclaim;
pub mod segment;
