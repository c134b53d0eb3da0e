//! Allocation: how the arena is cut into slots, as bookkeeping over offsets (no memory is
//! touched here).
//!
//! - [`extents`]: where in the arena each slot's bytes go (address-ordered first fit, no part
//!   crossed);
//! - [`slots`]: the slot table: each checkout's state (free, checked out, fenced), generation
//!   and extent, and waiting for room.
//!
//! Invariant: this layer uses only [`crate::system`] and [`crate::memory`] (the page size), and
//! [`crate::error`]. No two live extents overlap, and no byte is handed out again before its
//! slot is free.

pub mod extents;
pub mod slots;
