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
//! - Made with [`Arena::new_partial`], only the first part is faulted in (and pinned) before
//!   the constructor returns; the others are made ready one by one, in order, by
//!   [`Arena::prepare_next`], and [`Arena::ready_len`] bytes from the start are ready. Bytes
//!   past that are mapped but must not be used: the pool hands out only slots inside it.
//! - On a CUDA backend, the arena is placed on its GPU's NUMA node ([`crate::memory::numa`]) before
//!   its first page is touched: the mapping's policy is set before any part is faulted in, or
//!   the thread's around `cuMemHostAlloc`; the threads that fault it in run on the node's
//!   CPUs. `placement()` says where it went; a failure to place it is a note, never an error.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::memory::numa::Placement;
use crate::memory::shm::Region;
use crate::system::cuda::{self, Device};

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
    /// How many parts of the region, from the first, are ready (all for `cuda-hostalloc`);
    /// held while the next one is prepared.
    prepared: Mutex<usize>,
    /// Bytes from the start that are ready.
    ready_len: AtomicUsize,
    /// Whether each part is to be `mlock`ed once populated (host backend, within the limit).
    lock_parts: bool,
    len: usize,
    backend: Backend,
    residency: Residency,
    /// Which NUMA node the pages were asked for on, and where the fault threads run.
    placement: Placement,
    notes: Vec<String>,
    timings: Vec<(&'static str, f64)>,
}

/// About how big the parts of an arena made ready in the background are (whole slots).
const BACKGROUND_PART: usize = 128 << 20;

/// Bytes of memory this process could still fault in: the kernel's `MemAvailable`, and,
/// inside a cgroup (v2) with a memory limit, no more than that limit minus what the cgroup
/// already uses. `None` when neither can be read.
pub fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    let cgroup = cgroup_headroom();
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `memory.max` minus the memory in use (`memory.current` less the reclaimable
/// `inactive_file` page cache) of this process's cgroup (v2), if it has a limit.
fn cgroup_headroom() -> Option<usize> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = format!("/sys/fs/cgroup{path}");
    let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).ok();
    let max: usize = read("memory.max")?.trim().parse().ok()?; // "max" (no limit) fails here
    let current: usize = read("memory.current")?.trim().parse().ok()?;
    let inactive_file: usize = read("memory.stat")
        .and_then(|stat| {
            let line = stat.lines().find(|l| l.starts_with("inactive_file "))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(inactive_file)))
}

/// Runs `f`, appending its duration in seconds to `timings` under `name`.
fn timed<T>(
    timings: &mut Vec<(&'static str, f64)>,
    name: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let start = std::time::Instant::now();
    let out = f()?;
    timings.push((name, start.elapsed().as_secs_f64()));
    Ok(out)
}

/// A region of `len` bytes in parts of whole `align` units, one part per thread.
fn region(
    len: usize,
    align: usize,
    threads: usize,
    first: Option<usize>,
    timings: &mut Vec<(&'static str, f64)>,
) -> Result<Region> {
    // Made ready in the background, part by part: small parts, so that what is ready grows
    // steadily and the work can stop soon after the pool is no longer wanted.
    let parts = match first {
        Some(_) => threads.max(len.div_ceil(BACKGROUND_PART)),
        None => threads,
    };
    let region = timed(timings, "map", || {
        Region::with_first("pinpool-arena", len, align, first.unwrap_or(0), parts)
    })?;
    region.advise_huge_pages();
    Ok(region)
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
    /// Allocates `len` bytes, a multiple of `align` (the slot size: no slot straddles two
    /// memfds or registrations). `device = None` means no CUDA; `backend = None` means choose:
    /// the CUDA default when a device is usable, else host memory (with a note saying why).
    /// `threads` fault the pages in, in parallel.
    pub fn new(
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
        threads: usize,
    ) -> Result<Self> {
        Self::build(len, align, device, backend, threads, None)
    }

    /// As [`Arena::new`], but only the first `first` bytes (a multiple of `align`, rounded up
    /// to one, and at most the arena's whole `align`s) are made ready before it returns;
    /// [`Arena::prepare_next`] does the rest.
    /// `cuda-hostalloc` (one driver call) is always made ready whole.
    pub fn new_partial(
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
        threads: usize,
        first: usize,
    ) -> Result<Self> {
        let align = align.max(1);
        let first = first.div_ceil(align).max(1).saturating_mul(align).min(len / align * align);
        Self::build(len, align, device, backend, threads, Some(first))
    }

    fn build(
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
        threads: usize,
        first: Option<usize>,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("the arena needs at least one byte".into()));
        }
        if let Some(available) = available_memory() {
            if len > available {
                return Err(Error::NotEnoughMemory {
                    what: "the arena (slot_bytes= x num_slots=, or arena_bytes=: ask for less)"
                        .into(),
                    wanted: len,
                    available,
                });
            }
        }
        let mut timings = Vec::new();
        let backend = match (backend, device) {
            (Some(Backend::Host), _) => Backend::Host,
            (Some(b), None) => {
                return Err(Error::Invalid(format!(
                    "backend {:?} needs a CUDA device, but none was asked for (device=\"cpu\")",
                    b.name()
                )))
            }
            (None, None) => Backend::Host,
            // A device named is used or refused, never quietly replaced by host memory.
            (backend, Some(ordinal)) => {
                cuda::require_device(ordinal)?;
                backend.unwrap_or(Backend::CUDA_DEFAULT)
            }
        };
        let mut notes = Vec::new();
        match backend {
            Backend::CudaHostAlloc => {
                let device = timed(&mut timings, "device", || Device::open(device.unwrap_or(0)))?;
                let mut placement = Placement::for_gpu(device.pci_bus_id());
                // The driver allocates the pages: this thread's policy decides their node.
                let ptr = timed(&mut timings, "cuMemHostAlloc", || {
                    placement.allocate(|| device.host_alloc(len).map(|ptr| (ptr, ptr, len)))
                })?;
                notes.extend_from_slice(placement.notes());
                Ok(Arena {
                    storage: Storage::HostAlloc { ptr, device },
                    prepared: Mutex::new(0),
                    ready_len: AtomicUsize::new(len),
                    lock_parts: false,
                    len,
                    backend,
                    residency: Residency::Pinned,
                    placement,
                    notes,
                    timings,
                })
            }
            Backend::CudaRegister => {
                let device = timed(&mut timings, "device", || Device::open(device.unwrap_or(0)))?;
                let mut placement = Placement::for_gpu(device.pci_bus_id());
                let threads = placement.thread_count(threads);
                let region = region(len, align, threads, first, &mut timings)?;
                // Before the first touch, and so before the driver registers (and pins) a page.
                placement.bind(region.as_ptr(), region.len());
                notes.extend_from_slice(placement.notes());
                let mut arena = Arena {
                    storage: Storage::Registered {
                        region,
                        registered: Mutex::new(Vec::new()),
                        device,
                    },
                    prepared: Mutex::new(0),
                    ready_len: AtomicUsize::new(0),
                    lock_parts: false,
                    len,
                    backend,
                    residency: Residency::Pinned,
                    placement,
                    notes,
                    timings,
                };
                // On failure the arena drops, unregistering what was registered.
                arena.prepare_start(threads, first.is_some(), "populate+cuMemHostRegister")?;
                Ok(arena)
            }
            Backend::Host => {
                let region = region(len, align, threads, first, &mut timings)?;
                let lock_parts = lock_limit_allows(len);
                if !lock_parts {
                    notes.push(format!(
                        "could not lock {len} bytes (over the limit; see `ulimit -l`): \
                         the arena is ordinary pageable memory"
                    ));
                }
                let mut arena = Arena {
                    storage: Storage::Host { region },
                    prepared: Mutex::new(0),
                    ready_len: AtomicUsize::new(0),
                    lock_parts,
                    len,
                    backend,
                    residency: if lock_parts { Residency::Locked } else { Residency::Pageable },
                    placement: Placement::unplaced("host memory, no GPU"),
                    notes,
                    timings,
                };
                if let Err(e) = arena.prepare_start(threads, first.is_some(), "populate") {
                    if !matches!(e, Error::Os { call: "mlock", .. }) {
                        return Err(e);
                    }
                    // Locking failed after all (a cgroup, say): plain memory, as before.
                    arena.lock_parts = false;
                    arena.residency = Residency::Pageable;
                    arena.notes.push(format!(
                        "could not lock {len} bytes ({e}; see `ulimit -l`): \
                         the arena is ordinary pageable memory"
                    ));
                    arena.prepare_start(threads, first.is_some(), "populate")?;
                }
                Ok(arena)
            }
        }
    }

    /// Makes the first part (`partial`) or every part ready, timing it as `what`.
    fn prepare_start(&mut self, threads: usize, partial: bool, what: &'static str) -> Result<()> {
        let start = std::time::Instant::now();
        if partial {
            self.prepare_next(threads)?;
        } else {
            self.prepare_all(threads)?;
        }
        self.timings.push((what, start.elapsed().as_secs_f64()));
        Ok(())
    }

    /// Faults every part in, in parallel, finishing each (registering or locking it) on its
    /// own thread as soon as it is populated, while the others still are.
    fn prepare_all(&self, threads: usize) -> Result<()> {
        let Some(region) = self.region() else { return Ok(()) };
        let mut prepared = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        region.populate_then(
            self.placement.thread_count(threads),
            &|| self.placement.pin_calling_thread(),
            |part| self.finish_part(part.offset, part.len),
        )?;
        *prepared = region.parts().len();
        self.ready_len.store(self.len, Ordering::Release);
        Ok(())
    }

    /// Makes the next part that is not ready yet ready (faulted in with `threads` threads,
    /// then registered or locked); returns its `(offset, len)`, or None when every part is.
    pub fn prepare_next(&self, threads: usize) -> Result<Option<(usize, usize)>> {
        let Some(region) = self.region() else { return Ok(None) };
        let mut next = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        if *next >= region.parts().len() {
            return Ok(None);
        }
        let part = region.populate_part_at(*next, self.placement.thread_count(threads), &|| {
            self.placement.pin_calling_thread()
        })?;
        let (offset, len) = (part.offset, part.len);
        self.finish_part(offset, len)?;
        *next += 1;
        self.ready_len.store(offset + len, Ordering::Release);
        Ok(Some((offset, len)))
    }

    /// Bytes from the start that are ready for use.
    pub fn ready_len(&self) -> usize {
        self.ready_len.load(Ordering::Acquire)
    }

    /// Registers (`cuda-register`) or locks (host, when asked) a part just faulted in.
    fn finish_part(&self, offset: usize, len: usize) -> Result<()> {
        match &self.storage {
            Storage::Registered { region, registered, device } => {
                // SAFETY: the part lies inside the region, mapped until the arena drops, where
                // every registered part is unregistered first.
                unsafe { device.host_register(region.as_ptr().add(offset), len)? };
                registered.lock().unwrap_or_else(|e| e.into_inner()).push(offset);
                Ok(())
            }
            Storage::Host { region } if self.lock_parts => lock(region, offset, len),
            Storage::Host { .. } | Storage::HostAlloc { .. } => Ok(()),
        }
    }

    fn region(&self) -> Option<&Region> {
        match &self.storage {
            Storage::Registered { region, .. } | Storage::Host { region } => Some(region),
            Storage::HostAlloc { .. } => None,
        }
    }

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

    /// Where the arena's pages went and where its threads run (see [`crate::memory::numa`]).
    pub fn placement(&self) -> &Placement {
        &self.placement
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

/// Whether `mlock` of `len` more bytes may succeed: no limit, or the soft limit is high
/// enough (a process with `CAP_IPC_LOCK` may lock past it; then `mlock` itself decides).
fn lock_limit_allows(len: usize) -> bool {
    // `None`: no limit.
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
    limit.is_none_or(|soft| len as u64 <= soft) || rustix::process::geteuid().is_root()
}

/// `mlock`s `[offset, offset+len)` of `region`.
fn lock(region: &Region, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > region.len()) {
        return Err(Error::Invalid(format!("cannot lock {len} bytes at {offset}")));
    }
    // SAFETY: the range lies inside the region (checked above), which is mapped and ours.
    if unsafe { libc::mlock(region.as_ptr().add(offset).cast(), len) } != 0 {
        return Err(Error::last_os("mlock"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
