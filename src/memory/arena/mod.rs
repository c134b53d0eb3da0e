//! The arena: one fixed block of host memory, allocated once at start-up and never grown.
//!
//! The arena is a shared-memory [`Region`]: several sealed memfds mapped back to back (so
//! fresh pages can be faulted in by many threads at once, and worker processes can map the
//! slots), each part a whole number of slots, and on `cuda-register` each part registered with
//! the driver as soon as it is faulted in. `cuda-hostalloc` is one `cuMemHostAlloc` instead.
//!
//! Invariants:
//! - The arena's bytes stay mapped (and, on a CUDA backend, page-locked and known to the
//!   driver) for the arena's whole life; they are released exactly once, in `Drop`.
//! - `backend()` says truthfully how the memory was obtained and `residency()` whether it is
//!   pinned for the GPU, merely locked, or ordinary pageable memory; every fallback from what
//!   was asked is explained in `notes()`.
//! - Construction never panics: a missing driver, an absent device or a failed call is an
//!   [`Error`]. A device given is used or refused (the caller's `device=None` may fall back
//!   to host memory before the arena is made: [`crate::memory::device_choice`]).
//! - Every byte of the arena is faulted in at start-up, so an arena larger than the memory
//!   available (see [`available_memory`]) is refused before anything is mapped: faulting it
//!   in would end in the kernel's out-of-memory killer, not in an error.
//! - Made with [`Arena::new_partial`], only the first bytes asked for are faulted in (and
//!   locked; on `cuda-register`, the whole first part, registered) before the constructor
//!   returns; the rest is made ready in order, up to a part's end at a time, by
//!   [`Arena::prepare_next`], and [`Arena::ready_len`] bytes from the start are ready. Bytes
//!   past that are mapped but must not be used: the pool hands out only slots inside it.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::memory::shm::Region;
use crate::system::cuda::Device;

mod headroom;
mod making;

pub use headroom::available_memory;

/// How the arena's memory is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// One `cuMemHostAlloc(PORTABLE)` in the device's primary context.
    CudaHostAlloc,
    /// A memfd mapping, pre-faulted in parallel, then `cuMemHostRegister(PORTABLE)`.
    CudaRegister,
    /// A memfd mapping, `mlock`ed when the limit allows; no CUDA.
    Host,
}

impl Backend {
    /// The name reported as `pool.backend`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::CudaHostAlloc => "cuda-hostalloc",
            Backend::CudaRegister => "cuda-register",
            Backend::Host => "host",
        }
    }

    /// Parses a backend name; `"auto"` gives `None` (choose at construction).
    pub fn parse(name: &str) -> Result<Option<Self>> {
        match name {
            "auto" => Ok(None),
            "cuda-hostalloc" => Ok(Some(Backend::CudaHostAlloc)),
            "cuda-register" => Ok(Some(Backend::CudaRegister)),
            "host" => Ok(Some(Backend::Host)),
            other => Err(Error::Invalid(format!(
                "unknown backend {other:?}: expected 'auto', 'cuda-register', \
                 'cuda-hostalloc' or 'host'"
            ))),
        }
    }

    /// The CUDA backend `auto` picks when a device is usable: the faster start-up (the figures
    /// are in `docs/performance.md`).
    pub const CUDA_DEFAULT: Backend = Backend::CudaRegister;
}

/// Whether the arena's pages can move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Page-locked and registered with the CUDA driver: DMA-able, `is_pinned()` in torch.
    Pinned,
    /// `mlock`ed, unknown to CUDA.
    Locked,
    /// Ordinary memory.
    Pageable,
}

impl Residency {
    /// The name reported as `pool.memory`.
    pub fn name(self) -> &'static str {
        match self {
            Residency::Pinned => "pinned",
            Residency::Locked => "locked",
            Residency::Pageable => "pageable",
        }
    }
}

enum Storage {
    HostAlloc {
        ptr: *mut u8,
        device: Arc<Device>,
    },
    /// Each part of the region registered on its own (`registered` holds their offsets).
    Registered {
        region: Region,
        registered: Mutex<Vec<usize>>,
        device: Arc<Device>,
    },
    Host {
        region: Region,
    },
}

/// One fixed block of host memory.
pub struct Arena {
    storage: Storage,
    /// Bytes from the start made ready (all for `cuda-hostalloc`); held while the next ones
    /// are prepared.
    prepared: Mutex<usize>,
    /// Bytes from the start that are ready.
    ready_len: AtomicUsize,
    /// Whether each part is to be `mlock`ed once populated (host backend, within the limit).
    lock_parts: bool,
    len: usize,
    backend: Backend,
    residency: Residency,
    notes: Vec<String>,
    timings: Vec<(&'static str, f64)>,
}

// SAFETY: the arena is plain memory plus driver handles (thread-safe); access to its bytes is
// coordinated by the slot table.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("len", &self.len)
            .field("backend", &self.backend)
            .field("residency", &self.residency)
            .finish()
    }
}

impl Arena {
    /// The first byte.
    pub fn base(&self) -> *mut u8 {
        match &self.storage {
            Storage::HostAlloc { ptr, .. } => *ptr,
            Storage::Registered { region, .. } | Storage::Host { region } => region.as_ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: arenas are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How the memory was obtained.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Whether it is pinned, locked or pageable.
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// Why the arena differs from what was asked, if it does.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// How long each start-up step took, in seconds (`map`, `populate`, `cuMemHostRegister`,
    /// `cuMemHostAlloc`, `device`).
    pub fn timings(&self) -> &[(&'static str, f64)] {
        &self.timings
    }

    /// The CUDA device, on a CUDA backend.
    pub fn device(&self) -> Option<&Arc<Device>> {
        match &self.storage {
            Storage::HostAlloc { device, .. } | Storage::Registered { device, .. } => Some(device),
            Storage::Host { .. } => None,
        }
    }

    /// This arena, taken again by a new pool: its start-up steps are no longer its own.
    pub fn taken_again(mut self) -> Self {
        self.timings = vec![("kept from a pool dropped before", 0.0)];
        self
    }

    /// Whether a pool asking for an arena of `len` bytes in parts of whole `align`s, for
    /// `device` with `backend` (None: the default), can take this one as it is: of that size,
    /// for that device and backend, every part a whole number of `align` (its parts not made
    /// ready yet are made as a new arena's would be). (`cuda-hostalloc`, one block of the
    /// driver's, is never taken again.)
    pub fn reusable_for(
        &self,
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
    ) -> bool {
        let wanted =
            backend.unwrap_or(if device.is_some() { Backend::CUDA_DEFAULT } else { Backend::Host });
        let same_device = match (self.device(), device) {
            (Some(d), Some(ordinal)) => d.ordinal() == ordinal,
            (None, None) => true,
            _ => wanted == Backend::Host && self.backend == Backend::Host,
        };
        let mut starts = self.part_starts();
        starts.push(self.len);
        let mut last = 0;
        let aligned = align > 0
            && starts.iter().all(|&s| {
                let whole = (s - last) % align == 0;
                last = s;
                whole
            });
        self.len == len
            && self.backend == wanted
            && self.backend != Backend::CudaHostAlloc
            && same_device
            && aligned
    }

    /// Where each part after the first starts (none for `cuda-hostalloc`, one block): no slot
    /// may straddle two parts, which are separate memfds and driver registrations.
    pub fn part_starts(&self) -> Vec<usize> {
        match self.region() {
            Some(region) => region.parts().iter().skip(1).map(|p| p.offset).collect(),
            None => Vec::new(),
        }
    }

    /// The memfd holding arena byte `offset`, and where that memfd starts in the arena and
    /// how long it is (so other processes can map it). None for `cuda-hostalloc`.
    pub fn part_at(&self, offset: usize) -> Option<(BorrowedFd<'_>, usize, usize)> {
        match &self.storage {
            Storage::Registered { region, .. } | Storage::Host { region } => {
                region.part_at(offset).map(|p| (p.fd.as_fd(), p.offset, p.len))
            }
            Storage::HostAlloc { .. } => None,
        }
    }

    /// The inode number of the memfd holding arena byte `offset` (read when the memfd was
    /// made). None for `cuda-hostalloc`.
    pub fn part_inode_at(&self, offset: usize) -> Option<u64> {
        match &self.storage {
            Storage::Registered { region, .. } | Storage::Host { region } => {
                region.part_at(offset).map(|p| p.inode)
            }
            Storage::HostAlloc { .. } => None,
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        match &self.storage {
            Storage::HostAlloc { ptr, device } => {
                // SAFETY: `ptr` came from `host_alloc` and the arena, its only owner, is dying.
                let _ = unsafe { device.free_host(*ptr) };
            }
            Storage::Registered { region, registered, device } => {
                let registered = registered.lock().unwrap_or_else(|e| e.into_inner());
                for &offset in registered.iter() {
                    // SAFETY: registered in `new`; the region itself is unmapped afterwards,
                    // when it drops.
                    let _ = unsafe { device.host_unregister(region.as_ptr().add(offset)) };
                }
            }
            Storage::Host { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests;
