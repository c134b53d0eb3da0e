//! Shared memory: anonymous memfd regions and mappings of regions received as file descriptors.
//!
//! `memfd` makes and checks a sealed memfd; `mapping` is one mapped ([`Mapping`]), `region`
//! several mapped back to back (the arena's parts, [`Region`]), and `in_pieces` the
//! address-space calls made a piece at a time.
//!
//! Invariants:
//! - A [`Mapping`] owns exactly one `mmap` of `len > 0` bytes; dropping it `munmap`s that range
//!   once. Nothing else unmaps it.
//! - A mapping made from a received fd is never longer than the file behind it (checked with
//!   `fstat` before `mmap`), and the file must be a memfd sealed against shrinking
//!   (`F_SEAL_SHRINK`, checked before `fstat`): nobody can truncate it under the mapping, so
//!   reading any byte of it cannot raise `SIGBUS`. Memfds made here are sealed against
//!   shrinking and growing.
//! - Regions are created with `MFD_CLOEXEC` and no name in any filesystem: nothing appears in
//!   `/dev/shm`, and only processes that are handed the fd can map them.
//! - Mappings and regions are unmapped [`MM_CALL_BYTES`] bytes per `munmap` call
//!   ([`unmap_in_chunks`]): the kernel holds the process's address-space lock for the whole of
//!   one call, and every `mmap` or `munmap` elsewhere in the process waits for it meanwhile,
//!   including one made by a thread that holds the GIL (a freed semaphore, a large buffer).
//!   On pinpool's background threads it pauses between two calls ([`MM_PAUSE`]), so such a
//!   thread does not wait for all of them.

mod in_pieces;
mod mapping;
mod memfd;
mod region;

pub use in_pieces::{prefault_shared, unmap_in_chunks, MM_CALL_BYTES, MM_PAUSE};
pub use mapping::Mapping;
pub use memfd::{check_range, check_sealed, page_size, round_up};
pub use region::{Part, Region};

#[cfg(test)]
mod tests;
