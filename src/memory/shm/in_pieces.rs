//! Address-space calls made in pieces: unmapping and populating [`MM_CALL_BYTES`] at a time,
//! so no call holds the process's address-space lock (which every `mmap` and `munmap`
//! elsewhere, one under the GIL too, waits for) for long.
//!
//! Invariants:
//! - No `munmap` or populating `madvise` call covers more than [`MM_CALL_BYTES`].
//! - On a background thread ([`crate::system::priority::is_background`]) [`unmap_in_chunks`]
//!   pauses [`MM_PAUSE`] between two calls, so a thread waiting for the lock goes first.
//! - Nothing here owns a mapping: the caller's contract (each `unsafe fn`'s `# Safety`) says
//!   which ranges may be touched.

use super::memfd::page_size;
use crate::error::{Error, Result};

const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Faults `[ptr, ptr + len)` in for writing without changing a byte of it: `MADV_POPULATE_WRITE`
/// in pieces of [`MM_CALL_BYTES`] (the page-table entries made writable and dirty, so that a
/// later write, even after an `mprotect` round trip, takes no fault), or, on kernels before
/// 5.14, which lack it, a read of one byte per page (entries made, a later write may still
/// take a minor fault). Unlike [`super::Mapping::populate`], for memory that holds data already.
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
pub(super) fn populate_range(addr: usize, len: usize, page: usize) -> std::result::Result<(), i32> {
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
