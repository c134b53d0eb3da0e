//! Shared memory: anonymous memfd regions and mappings of regions received as file descriptors.
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

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, Mode, SealFlags};

use crate::error::{Error, Result};
use crate::memory::forked_child;

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// Rounds `n` up to a multiple of `align` (a power of two), or `None` on overflow.
pub fn round_up(n: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    n.checked_add(align - 1).map(|m| m & !(align - 1))
}

/// One `mmap`ed shared region, optionally with the fd it came from.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
    /// A writable mapping is read-only in forked children (see `forked_child`).
    read_only_in_children: Option<forked_child::Registration>,
}

// SAFETY: the mapping is plain memory owned by this value; who may read or write which bytes
// and when is decided by the slot and segment state machines built on top of it.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` exposes only the pointer and length; access is coordinated above.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping").field("len", &self.len).field("fd", &self.raw_fd()).finish()
    }
}

const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

impl Mapping {
    /// Creates a sealed memfd of `len` bytes and maps it read-write, `MAP_SHARED`.
    pub fn memfd(name: &str, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("a shared region needs at least one byte".into()));
        }
        Self::map(sealed_memfd(name, len)?, len, true)
    }

    /// Maps `len` bytes of the file behind `fd` (taking ownership of `fd`), `MAP_SHARED`, and
    /// keeps the mapping out of children forked from then on (`MADV_DONTFORK`: another
    /// process's segment is this process's to copy from, never a child's). Fails if the file is
    /// not a memfd sealed against shrinking (a plain file, or a memfd without `F_SEAL_SHRINK`,
    /// could be truncated under the mapping: a later read would raise `SIGBUS`), or if it is
    /// shorter than `len`.
    pub fn from_fd(fd: OwnedFd, len: usize, writable: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("cannot map an empty segment".into()));
        }
        check_sealed(fd.as_fd())?;
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat", e))?;
        let file_len = usize::try_from(st.st_size).unwrap_or(0);
        if file_len < len {
            return Err(Error::OutOfRange { what: "segment file", offset: 0, len, size: file_len });
        }
        let mut mapping = Self::map(fd, len, writable)?;
        mapping.keep_from_children();
        Ok(mapping)
    }

    /// Leaves the mapping out of children forked from now on (`MADV_DONTFORK`): a child has
    /// nothing at these addresses, neither to read nor to tear down when it exits (a
    /// DataLoader's workers of the next epoch are forked while the last epoch's segments are
    /// still mapped here). Where the kernel refuses the advice, children get the mapping
    /// read-only, as every writable mapping (see `forked_child`).
    fn keep_from_children(&mut self) {
        // SAFETY: `[ptr, ptr+len)` is exactly this value's own mapping; the advice changes
        // only what a later fork copies, not this process's access to it.
        let advised =
            unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTFORK) };
        if advised == 0 {
            // (A child forked between the advice and this finds no mapping to protect.)
            self.read_only_in_children = None;
        }
    }

    fn map(fd: OwnedFd, len: usize, writable: bool) -> Result<Self> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of a file at least `len`
        // bytes long; it aliases no Rust object.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::last_os("mmap"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(Error::Os { call: "mmap", errno: 0 })?;
        let read_only_in_children =
            writable.then(|| forked_child::register_read_only(ptr.as_ptr() as usize, len));
        Ok(Mapping { ptr, len, fd: Some(fd), read_only_in_children })
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The fd behind the mapping, while it is kept open.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|fd| fd.as_fd())
    }

    fn raw_fd(&self) -> Option<i32> {
        self.fd.as_ref().map(|fd| fd.as_raw_fd())
    }

    /// Closes the fd; the mapping stays valid.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }

    /// Drops this process's page-table entries for the whole mapping (`MADV_DONTNEED`), in
    /// pieces of [`MM_CALL_BYTES`]. The bytes stay where they are, in the shared file (every
    /// `Mapping` is `MAP_SHARED` over a file), and the next access faults them back in: what
    /// changes is what tearing the mapping down costs later, at `munmap` or at this process's
    /// exit, when the kernel walks every page still mapped.
    pub fn drop_page_tables(&self) -> Result<()> {
        // SAFETY: `[ptr, ptr+len)` is this value's own shared file mapping, page-aligned.
        unsafe { drop_page_tables_of(self.ptr.as_ptr(), self.len) }
    }

    /// Faults every page in, writing (so pages are allocated, not just mapped to the zero
    /// page), with `threads` threads in parallel.
    pub fn populate(&self, threads: usize) -> Result<()> {
        let page = page_size();
        let threads = threads.clamp(1, 64);
        let pages = self.len.div_ceil(page);
        let per = pages.div_ceil(threads).max(1) * page;
        let base = self.ptr.as_ptr() as usize;
        let len = self.len;
        let failed = std::sync::atomic::AtomicI32::new(0);
        std::thread::scope(|s| {
            for start in (0..len).step_by(per) {
                let end = (start + per).min(len);
                let failed = &failed;
                s.spawn(move || {
                    if let Err(errno) = populate_range(base + start, end - start, page) {
                        failed.store(errno, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        match failed.into_inner() {
            0 => Ok(()),
            errno => Err(Error::Os { call: "madvise(MADV_POPULATE_WRITE)", errno }),
        }
    }
}

/// Several sealed memfds ("parts") mapped back to back as one contiguous range.
///
/// Faulting fresh pages into one shared-memory file does not scale with threads (they contend
/// on the file); faulting several files does (`benchmarks/arena_populate.py` measures it; the
/// figures: `docs/performance.md`). Each part holds a whole number of `part_align` bytes (the
/// last one the rest, a whole number of pages, besides), so a slot of up to `part_align`
/// never straddles two parts and none is wasted.
pub struct Region {
    base: NonNull<u8>,
    len: usize,
    parts: Vec<Part>,
    /// Forked children get each part privately (see `forked_child`); dropped before unmapping.
    private_in_children: Vec<forked_child::Registration>,
}

/// One memfd of a [`Region`].
#[derive(Debug)]
pub struct Part {
    /// The memfd.
    pub fd: OwnedFd,
    /// Where the part starts in the region.
    pub offset: usize,
    /// Its length.
    pub len: usize,
    /// The memfd's inode number (read once: what a zero-copy reservation names, per batch).
    pub inode: u64,
}

// SAFETY: as for `Mapping`: plain memory owned by this value, accessed under the slot state
// machine's rules.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len).field("parts", &self.parts.len()).finish()
    }
}

impl Region {
    /// `len` bytes (a whole number of pages, at least `part_align`, itself a whole number of
    /// pages) in at most `max_parts` memfds.
    pub fn new(name: &str, len: usize, part_align: usize, max_parts: usize) -> Result<Self> {
        Self::with_first(name, len, part_align, 0, max_parts)
    }

    /// As [`Region::new`], but with a first part of exactly `first` bytes (a multiple of
    /// `part_align`; 0 for none) before the others, so it can be made ready on its own. What is
    /// left over after whole `part_align`s goes to the last part.
    pub fn with_first(
        name: &str,
        len: usize,
        part_align: usize,
        first: usize,
        max_parts: usize,
    ) -> Result<Self> {
        if len == 0
            || part_align == 0
            || len % page_size() != 0
            || len < part_align
            || part_align % page_size() != 0
            || first % part_align != 0
            || first > len
        {
            return Err(Error::Invalid(format!(
                "a region of {len} bytes cannot be cut into parts of {part_align} bytes \
                 (first part {first})"
            )));
        }
        let mut lens = Vec::new();
        if first > 0 {
            lens.push(first);
        }
        let rest = len - first;
        if rest > 0 {
            let units = rest / part_align;
            if units == 0 {
                lens.push(rest); // (after a first part: less than one more `part_align`)
            } else {
                let whole = units * part_align;
                let per_part = units.div_ceil(max_parts.clamp(1, units)) * part_align;
                let mut offset = 0;
                while offset < whole {
                    lens.push(per_part.min(whole - offset));
                    offset += per_part;
                }
                if let Some(last) = lens.last_mut() {
                    *last += rest - whole; // (the pages left over: the last part's)
                }
            }
        }
        // SAFETY: a fresh inaccessible reservation chosen by the kernel; it aliases nothing.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::last_os("mmap(reserve)"));
        }
        let base = NonNull::new(raw.cast::<u8>()).ok_or(Error::Os { call: "mmap", errno: 0 })?;
        // From here on, dropping `region` unmaps the whole reservation.
        let mut region = Region { base, len, parts: Vec::new(), private_in_children: Vec::new() };
        let mut offset = 0;
        for part_len in lens {
            let fd = sealed_memfd(name, part_len)?;
            let addr = base.as_ptr() as usize + offset;
            region.private_in_children.push(forked_child::register(addr, part_len, fd.as_raw_fd()));
            // SAFETY: `[base+offset, +part_len)` lies inside our reservation (the lengths sum
            // to len); MAP_FIXED replaces exactly that part of it with the memfd.
            let at = unsafe {
                libc::mmap(
                    base.as_ptr().add(offset).cast(),
                    part_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(Error::last_os("mmap(MAP_FIXED)"));
            }
            let inode = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat", e))?;
            region.parts.push(Part { fd, offset, len: part_len, inode: inode.st_ino });
            offset += part_len;
        }
        Ok(region)
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The part holding byte `offset`.
    pub fn part_at(&self, offset: usize) -> Option<&Part> {
        self.parts.iter().find(|p| offset >= p.offset && offset < p.offset + p.len)
    }

    /// Asks for transparent huge pages (a hint: ignored where shared-memory THP is off).
    pub fn advise_huge_pages(&self) {
        // SAFETY: the range is mapped (every part) and owned by self; a hint only.
        unsafe { libc::madvise(self.base.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE) };
    }

    /// Faults every page in with `threads` threads, each working inside one part, and runs
    /// `then(part)` on each part's thread right after that part is populated (to register it
    /// with the driver while other parts are still being faulted in). Every thread started
    /// here first runs `on_start` (to pin it to the CPUs near the memory, say).
    pub fn populate_then(
        &self,
        threads: usize,
        on_start: &(dyn Fn() + Sync),
        then: impl Fn(&Part) -> Result<()> + Sync,
    ) -> Result<()> {
        let per_part = threads.div_ceil(self.parts.len()).max(1);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .parts
                .iter()
                .map(|part| {
                    let then = &then;
                    s.spawn(move || {
                        on_start();
                        populate_part(self.base.as_ptr() as usize, part, per_part, on_start)?;
                        then(part)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(Error::Invalid("populate thread panicked".into()))))
                .collect()
        });
        results.into_iter().collect()
    }

    /// Faults every page of part `index` in, with `threads` threads, each of which first runs
    /// `on_start`. Pages of a part not yet handed out are zero, and populating keeps them so.
    pub fn populate_part_at(
        &self,
        index: usize,
        threads: usize,
        on_start: &(dyn Fn() + Sync),
    ) -> Result<&Part> {
        let part = self
            .parts
            .get(index)
            .ok_or_else(|| Error::Invalid(format!("the region has no part {index}")))?;
        populate_part(self.base.as_ptr() as usize, part, threads, on_start)?;
        Ok(part)
    }
}

/// Faults every page of `part` of the region at `base` in, with `threads` threads, each of
/// which first runs `on_start`.
fn populate_part(
    base: usize,
    part: &Part,
    threads: usize,
    on_start: &(dyn Fn() + Sync),
) -> Result<()> {
    let page = page_size();
    let pages = part.len / page;
    let step = pages.div_ceil(threads.max(1)).max(1) * page;
    let faulted: std::result::Result<(), i32> = std::thread::scope(|inner| {
        let workers: Vec<_> = (0..part.len)
            .step_by(step)
            .map(|start| {
                let len = step.min(part.len - start);
                inner.spawn(move || {
                    on_start();
                    populate_range(base + part.offset + start, len, page)
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().unwrap_or(Err(0)))
    });
    faulted.map_err(|errno| Error::Os { call: "madvise(MADV_POPULATE_WRITE)", errno })
}

impl Drop for Region {
    fn drop(&mut self) {
        // Children forked from here on leave the range alone (see `forked_child`).
        for registration in &self.private_in_children {
            registration.unmapping();
        }
        // SAFETY: `[base, base+len)` is exactly our reservation, with the parts mapped over
        // it; unmapping the range removes them all.
        unsafe { unmap_in_chunks(self.base.as_ptr(), self.len) };
        // The memfds go before their registrations, the descriptor numbers after them.
        for part in &self.parts {
            forked_child::let_go_of(part.fd.as_raw_fd());
        }
        self.private_in_children.clear();
    }
}

/// A sealed (no shrinking, no growing), close-on-exec memfd of `len` bytes.
fn sealed_memfd(name: &str, len: usize) -> Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| Error::Invalid("NUL in region name".into()))?;
    let fd =
        rustix::fs::memfd_create(cname.as_c_str(), MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| Error::os("memfd_create", e))?;
    // Owner-only, not the kernel's default 0777: reopening a memfd through
    // `/proc/<pid>/fd/<n>` checks this mode, so no other user may, whatever else allows it.
    rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR).map_err(|e| Error::os("fchmod", e))?;
    let size = i64::try_from(len).map_err(|_| Error::Invalid("region too large".into()))?;
    rustix::fs::ftruncate(&fd, size as u64).map_err(|e| Error::os("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| Error::os("fcntl(F_ADD_SEALS)", e))?;
    Ok(fd)
}

const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Drops this process's page-table entries for `[ptr, ptr + len)` (`MADV_DONTNEED`), in
/// pieces of [`MM_CALL_BYTES`]: see [`Mapping::drop_page_tables`].
///
/// # Safety
/// `ptr` must be page-aligned and `[ptr, ptr + len)` lie inside `MAP_SHARED` file mappings
/// of the caller's (on a private or anonymous mapping, `MADV_DONTNEED` would discard data).
pub unsafe fn drop_page_tables_of(ptr: *mut u8, len: usize) -> Result<()> {
    // SAFETY: the caller's shared file mappings; `MADV_DONTNEED` on a shared mapping discards
    // no data (the file keeps the pages), and any pointer into the range stays valid: a later
    // access refaults.
    unsafe { advise_in_pieces(ptr as usize, len, libc::MADV_DONTNEED) }
        .map_err(|(_, errno)| Error::Os { call: "madvise(MADV_DONTNEED)", errno })
}

/// Faults `[ptr, ptr + len)` in for writing without changing a byte of it: `MADV_POPULATE_WRITE`
/// in pieces of [`MM_CALL_BYTES`] (the page-table entries made writable and dirty, so that a
/// later write, even after an `mprotect` round trip, takes no fault), or, on kernels before
/// 5.14, which lack it, a read of one byte per page (entries made, a later write may still
/// take a minor fault). Unlike [`Mapping::populate`], for memory that holds data already.
///
/// # Safety
/// `ptr` must be page-aligned and `[ptr, ptr + len)` lie inside a readable and writable
/// `MAP_SHARED` mapping of the caller's, of a file at least that long (no `SIGBUS`).
pub unsafe fn prefault_shared(ptr: *mut u8, len: usize) -> Result<()> {
    let base = ptr as usize;
    // SAFETY: the caller's writable shared mapping; the advice only faults pages in, writing
    // nothing.
    match unsafe { advise_in_pieces(base, len, MADV_POPULATE_WRITE) } {
        Ok(()) => Ok(()),
        Err((0, libc::EINVAL)) => {
            for off in (0..len).step_by(page_size()) {
                // SAFETY: `base + off` lies inside the caller's readable mapping (off < len),
                // of a file at least that long; reading changes nothing.
                unsafe { std::ptr::read_volatile((base + off) as *const u8) };
            }
            Ok(())
        }
        Err((_, errno)) => Err(Error::Os { call: "madvise(MADV_POPULATE_WRITE)", errno }),
    }
}

/// `madvise(advice)` over `[base, base + len)` in pieces of [`MM_CALL_BYTES`] (each call holds
/// the process's address-space lock, which keeps every `mmap` or `munmap` elsewhere in the
/// process waiting). On a failure: the bytes done before it, and its errno.
///
/// # Safety
/// The range lies inside mappings of the caller's for which `advice` is harmless (see each
/// caller).
unsafe fn advise_in_pieces(
    base: usize,
    len: usize,
    advice: libc::c_int,
) -> std::result::Result<(), (usize, i32)> {
    let mut done = 0;
    while done < len {
        let n = MM_CALL_BYTES.min(len - done);
        // SAFETY: `[base+done, base+done+n)` lies inside the caller's range (the contract).
        let rc = unsafe { libc::madvise((base + done) as *mut libc::c_void, n, advice) };
        if rc != 0 {
            return Err((done, std::io::Error::last_os_error().raw_os_error().unwrap_or(0)));
        }
        done += n;
    }
    Ok(())
}

/// Faults `[addr, addr+len)` in, [`MM_CALL_BYTES`] bytes per `madvise` call: the kernel holds
/// the process's address-space lock (shared) for the whole of one call, which keeps every
/// `mmap` or `munmap` elsewhere in the process waiting.
fn populate_range(addr: usize, len: usize, page: usize) -> std::result::Result<(), i32> {
    // SAFETY: `[addr, addr+len)` is inside a live writable mapping owned by the caller; the
    // advice only faults its pages in.
    match unsafe { advise_in_pieces(addr, len, MADV_POPULATE_WRITE) } {
        Ok(()) => Ok(()),
        Err((0, libc::EINVAL)) => touch_pages(addr, len, page),
        Err((_, errno)) => Err(errno),
    }
}

fn touch_pages(addr: usize, len: usize, page: usize) -> std::result::Result<(), i32> {
    // Older kernels lack MADV_POPULATE_WRITE: touch one byte per page instead. The region is
    // freshly created (zero-filled), so writing zero preserves its contents.
    for off in (0..len).step_by(page) {
        // SAFETY: `addr + off` is inside the mapping (off < len) and the mapping is writable.
        unsafe { std::ptr::write_volatile((addr + off) as *mut u8, 0) };
    }
    Ok(())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Children forked from now on leave the range alone (before it can be reused).
        self.read_only_in_children = None;
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `map`, unmapped only here.
        unsafe { unmap_in_chunks(self.ptr.as_ptr(), self.len) };
    }
}

/// Bytes per `munmap` or populating `madvise` call. Each call holds the process's
/// address-space lock throughout, and every `mmap` or `munmap` on another thread (one made
/// under the GIL too) waits for it: unmapping a populated mapping in one call holds them up
/// for the whole call, in pieces of this size for one piece at a time. Freeing an arena gets
/// quicker too (the figures: "Unmapping in 4 MiB pieces" in `docs/performance.md`).
pub const MM_CALL_BYTES: usize = 4 << 20;

/// Unmaps `[ptr, ptr + len)` in pieces of [`MM_CALL_BYTES`] bytes, the last piece first (each
/// call then trims the mapping from its end rather than splitting it).
///
/// # Safety
/// `ptr` must be page-aligned and `[ptr, ptr + len)` mapped by the caller, who gives it up:
/// nothing may touch it afterwards.
pub unsafe fn unmap_in_chunks(ptr: *mut u8, len: usize) {
    let pause = crate::system::priority::is_background();
    let mut end = len;
    while end > 0 {
        // Every piece starts a whole number of chunks (so of pages) past `ptr`.
        let start = (end - 1) / MM_CALL_BYTES * MM_CALL_BYTES;
        // SAFETY: `[start, end)` lies inside the range the caller gave up, starts on a page
        // boundary, and was not unmapped yet (pieces go from the end towards `ptr`).
        unsafe { libc::munmap(ptr.add(start).cast(), end - start) };
        end = start;
        if pause && end > 0 {
            std::thread::sleep(MM_PAUSE);
        }
    }
}

/// How long a background thread ([`crate::system::priority::is_background`]) waits between two
/// `munmap` calls of [`unmap_in_chunks`]. Without it the thread takes the address-space lock
/// again the moment it lets it go, ahead of a thread already waiting for it, which the kernel
/// wakes but lets wait until it has waited about 4 ms (its lock hand-off rule). That waiting
/// thread can be the training thread, in its own `munmap` while holding the GIL: every Python
/// thread then stops while the reclaimer unmaps the segments of an epoch that has ended ("The
/// reclaimer's pause between unmaps" in `docs/performance.md`). A pause lets it go first;
/// freeing on a background thread has no one waiting for it.
pub const MM_PAUSE: std::time::Duration = std::time::Duration::from_micros(100);

/// Fails unless `fd` is a memfd sealed against shrinking (`F_SEAL_SHRINK`): any other file
/// could be truncated under a mapping of it, and the next read would raise `SIGBUS`.
pub fn check_sealed(fd: BorrowedFd<'_>) -> Result<()> {
    // On a file that is not a memfd, F_GET_SEALS fails with EINVAL.
    let sealed = rustix::fs::fcntl_get_seals(fd).is_ok_and(|s| s.contains(SealFlags::SHRINK));
    if !sealed {
        return Err(Error::Invalid(
            "only a memfd sealed against shrinking (F_SEAL_SHRINK) can be mapped: any other \
             file could be truncated under the mapping, and reading it would crash"
                .into(),
        ));
    }
    Ok(())
}

/// Checks that `[offset, offset+len)` fits in `size` bytes, without overflow.
pub fn check_range(what: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfRange { what, offset, len, size }),
    }
}

#[cfg(test)]
mod tests;
