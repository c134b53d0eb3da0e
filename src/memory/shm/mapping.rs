//! A [`Mapping`]: one `mmap` of a sealed memfd (a worker's segment, a test's arena), made here
//! or received as a file descriptor.
//!
//! Invariants:
//! - A mapping owns exactly one `mmap` of `len > 0` bytes; dropping it unmaps that range once,
//!   in pieces. Nothing else unmaps it.
//! - A mapping made from a received fd is never longer than the file behind it, and the file
//!   is a memfd sealed against shrinking (checked, seals first, before `mmap`).
//! - Forked children do not inherit a writable mapping (`MADV_DONTFORK`), or, where the kernel
//!   refuses the advice, get it read-only.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use super::in_pieces::{populate_range, unmap_in_chunks};
use super::memfd::{check_sealed, page_size, sealed_memfd};
use crate::error::{Error, Result};
use crate::memory::forked_child;

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

impl Drop for Mapping {
    fn drop(&mut self) {
        // Children forked from now on leave the range alone (before it can be reused).
        self.read_only_in_children = None;
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `map`, unmapped only here.
        unsafe { unmap_in_chunks(self.ptr.as_ptr(), self.len) };
    }
}
