//! Making an arena: refusing one larger than the memory available, choosing how its memory
//! is obtained, mapping its parts and making them ready (faulted in, then registered with the
//! driver or locked), all at once or one part at a time.
//!
//! Invariants:
//! - Nothing is mapped for an arena larger than [`super::available_memory`].
//! - A device named is used or refused, never quietly replaced by host memory.
//! - Parts are made ready in order; [`Arena::ready_len`] only grows, and only once a part is
//!   faulted in and finished (registered or locked).
//! - A failure part way drops the arena, which unregisters what was registered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{available_memory, Arena, Backend, Residency, Storage};
use crate::error::{Error, Result};
use crate::memory::shm::{page_size, round_up, Region};
use crate::system::cuda::{self, Device};

/// The first part of an arena made ready part by part, and how much of it is made ready
/// before the arena is returned.
#[derive(Clone, Copy)]
struct First {
    part: usize,
    ready: usize,
}

/// About how big the parts of an arena made ready in the background are (whole slots).
const BACKGROUND_PART: usize = 128 << 20;

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

    /// As [`Arena::new`], but only the first `first` bytes are made ready before it returns;
    /// [`Arena::prepare_next`] does the rest. The first part is `first` rounded up to a whole
    /// `align` (at most the arena's whole `align`s); on the host backend only `first` rounded
    /// up to a page is made ready at once (locking needs no whole part), on `cuda-register`
    /// the whole first part. `cuda-hostalloc` (one driver call) is always made ready whole.
    pub fn new_partial(
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
        threads: usize,
        first: usize,
    ) -> Result<Self> {
        let align = align.max(1);
        let part = first.div_ceil(align).max(1).saturating_mul(align).min(len / align * align);
        let ready = first.max(1).div_ceil(page_size()).saturating_mul(page_size()).min(part);
        Self::build(len, align, device, backend, threads, Some(First { part, ready }))
    }

    fn build(
        len: usize,
        align: usize,
        device: Option<usize>,
        backend: Option<Backend>,
        threads: usize,
        first: Option<First>,
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
                let ptr = timed(&mut timings, "cuMemHostAlloc", || device.host_alloc(len))?;
                Ok(Arena {
                    storage: Storage::HostAlloc { ptr, device },
                    prepared: Mutex::new(len),
                    ready_len: AtomicUsize::new(len),
                    lock_parts: false,
                    len,
                    backend,
                    residency: Residency::Pinned,
                    notes,
                    timings,
                })
            }
            Backend::CudaRegister => {
                let device = timed(&mut timings, "device", || Device::open(device.unwrap_or(0)))?;
                let region = region(len, align, threads, first.map(|f| f.part), &mut timings)?;
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
                    notes,
                    timings,
                };
                // On failure the arena drops, unregistering what was registered.
                // (Registrations are whole parts: the first part is made ready whole.)
                arena.prepare_start(
                    threads,
                    first.map(|f| f.part),
                    "populate+cuMemHostRegister",
                )?;
                Ok(arena)
            }
            Backend::Host => {
                let region = region(len, align, threads, first.map(|f| f.part), &mut timings)?;
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
                    notes,
                    timings,
                };
                if let Err(e) = arena.prepare_start(threads, first.map(|f| f.ready), "populate") {
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
                    arena.prepare_start(threads, first.map(|f| f.ready), "populate")?;
                }
                Ok(arena)
            }
        }
    }

    /// Makes the first `first` bytes ready, or every part when `first` is None, timing it as
    /// `what`.
    fn prepare_start(
        &mut self,
        threads: usize,
        first: Option<usize>,
        what: &'static str,
    ) -> Result<()> {
        let start = std::time::Instant::now();
        match first {
            Some(first) => {
                let mut at = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
                if *at < first {
                    self.prepare_range(&mut at, first, threads)?;
                }
            }
            None => self.prepare_all(threads)?,
        }
        self.timings.push((what, start.elapsed().as_secs_f64()));
        Ok(())
    }

    /// Faults every part in, in parallel, finishing each (registering or locking it) on its
    /// own thread as soon as it is populated, while the others still are.
    fn prepare_all(&self, threads: usize) -> Result<()> {
        let Some(region) = self.region() else { return Ok(()) };
        let mut prepared = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        region.populate_then(threads, |part| self.finish_part(part.offset, part.len))?;
        *prepared = self.len;
        self.ready_len.store(self.len, Ordering::Release);
        Ok(())
    }

    /// Makes the next bytes that are not ready yet ready, up to the end of the part they are
    /// in and at most `at_most` of them where parts are not registered whole (faulted in with
    /// `threads` threads, then registered or locked); returns their `(offset, len)`, or None
    /// when every byte is ready.
    pub fn prepare_next(&self, threads: usize, at_most: usize) -> Result<Option<(usize, usize)>> {
        let Some(region) = self.region() else { return Ok(None) };
        let mut at = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut end) = region.part_at(*at).map(|p| p.offset + p.len) else { return Ok(None) };
        if self.backend == Backend::Host {
            let step =
                round_up(at.saturating_add(at_most.max(1)), page_size()).unwrap_or(usize::MAX);
            end = end.min(step);
        }
        let offset = *at;
        self.prepare_range(&mut at, end, threads)?;
        Ok(Some((offset, end - offset)))
    }

    /// Makes `[*at, end)` ready (inside one part; a whole part where parts are registered),
    /// then moves `*at` and the ready length to `end`.
    fn prepare_range(&self, at: &mut usize, end: usize, threads: usize) -> Result<()> {
        let Some(region) = self.region() else { return Ok(()) };
        region.populate(*at, end - *at, threads)?;
        self.finish_part(*at, end - *at)?;
        *at = end;
        self.ready_len.store(end, Ordering::Release);
        Ok(())
    }

    /// Bytes from the start that are ready for use.
    pub fn ready_len(&self) -> usize {
        self.ready_len.load(Ordering::Acquire)
    }

    /// Registers (`cuda-register`: a whole part) or locks (host, when asked: any pages) a range
    /// just faulted in.
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

    pub(super) fn region(&self) -> Option<&Region> {
        match &self.storage {
            Storage::Registered { region, .. } | Storage::Host { region } => Some(region),
            Storage::HostAlloc { .. } => None,
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
