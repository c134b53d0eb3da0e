//! Memory: sealed shared-memory files and their mappings, and what is built from them: the
//! arena, a worker's window onto it, and the thread that frees it.
//!
//! - [`shm`]: sealed memfds and their mappings (the arena's parts, worker segments), and the
//!   address-space calls made in pieces;
//! - [`forked_child`]: what a forked child sees of this process's shared mappings (the arenas
//!   privately, other writable mappings read-only; whether a fork happened at all is
//!   [`crate::system::forks`]'s);
//! - [`arena`]: the one block of host memory (pinned through the CUDA driver, or plain);
//! - [`window`]: a zero-copy worker's lasting mapping of arena extents, inaccessible between
//!   batches;
//! - [`device_choice`]: which device an arena binds to when none is named (the rank's own);
//! - [`freeing`]: the thread that frees a dropped pool's arena, so no caller waits for it.
//!
//! Invariant: this layer uses only [`crate::system`] (and [`crate::error`]). It knows nothing
//! of slots: who may touch which bytes, and when, is decided by the layers above.

pub mod arena;
pub mod device_choice;
pub mod forked_child;
pub mod freeing;
pub mod shm;
pub mod window;
