//! Shared memory: anonymous memfd regions and mappings of regions received as file descriptors.
//!
//! Invariants:
//! - A [`Mapping`] owns exactly one `mmap` of `len > 0` bytes; dropping it `munmap`s that range
//!   once. Nothing else unmaps it.
//! - A mapping made from a received fd is never longer than the file behind it (checked with
//!   `fstat` before `mmap`), so reading any byte of it cannot raise `SIGBUS` unless the sender
//!   shrinks the file afterwards; memfds made here are sealed against shrinking and growing.
//! - Regions are created with `MFD_CLOEXEC` and no name in any filesystem: nothing appears in
//!   `/dev/shm`, and only processes that are handed the fd can map them.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
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

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

impl Mapping {
    /// Creates a sealed memfd of `len` bytes and maps it read-write, `MAP_SHARED`.
    pub fn memfd(name: &str, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("a shared region needs at least one byte".into()));
        }
        let cname = CString::new(name).map_err(|_| Error::Invalid("NUL in region name".into()))?;
        // SAFETY: `cname` is a valid C string; the flags are plain integers.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size =
            libc::off_t::try_from(len).map_err(|_| Error::Invalid("region too large".into()))?;
        // SAFETY: `fd` is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(Error::last_os("ftruncate"));
        }
        // SAFETY: `fd` is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(Error::last_os("fcntl(F_ADD_SEALS)"));
        }
        Self::map(fd, len, true)
    }

    /// Maps `len` bytes of the file behind `fd` (taking ownership of `fd`), `MAP_SHARED`.
    /// Fails if the file is shorter than `len`.
    pub fn from_fd(fd: OwnedFd, len: usize, writable: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("cannot map an empty segment".into()));
        }
        // SAFETY: `st` is plain old data, fully written by fstat on success.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a valid open descriptor and `st` a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os("fstat"));
        }
        let file_len = usize::try_from(st.st_size).unwrap_or(0);
        if file_len < len {
            return Err(Error::OutOfRange { what: "segment file", offset: 0, len, size: file_len });
        }
        Self::map(fd, len, writable)
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
        Ok(Mapping { ptr, len, fd: Some(fd) })
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

    /// Checks that `[offset, offset+len)` lies inside the mapping.
    pub fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        check_range(what, offset, len, self.len)
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

    /// Asks for transparent huge pages (a hint: ignored where shared-memory THP is off).
    pub fn advise_huge_pages(&self) {
        // SAFETY: the range is a live mapping owned by self; MADV_HUGEPAGE only changes how
        // the kernel backs it, never its contents.
        unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE) };
    }

    /// `mlock`s the whole mapping.
    pub fn lock(&self) -> Result<()> {
        // SAFETY: the range is a live mapping owned by self.
        if unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) } != 0 {
            return Err(Error::last_os("mlock"));
        }
        Ok(())
    }
}

const MADV_POPULATE_WRITE: libc::c_int = 23;

fn populate_range(addr: usize, len: usize, page: usize) -> std::result::Result<(), i32> {
    // SAFETY: `[addr, addr+len)` is inside a live writable mapping owned by the caller.
    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    if errno != libc::EINVAL {
        return Err(errno);
    }
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
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `map`, unmapped only here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Checks that `[offset, offset+len)` fits in `size` bytes, without overflow.
pub fn check_range(what: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfRange { what, offset, len, size }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_round_trip_and_seals() {
        let m = Mapping::memfd("pinpool-test", 3 * page_size()).unwrap();
        m.populate(2).unwrap();
        // SAFETY: test-only writes inside the mapping.
        unsafe { *m.as_ptr().add(5) = 42 };
        let dup = m.fd().unwrap().try_clone_to_owned().unwrap();
        let again = Mapping::from_fd(dup, m.len(), false).unwrap();
        // SAFETY: reading inside the second mapping of the same file.
        assert_eq!(unsafe { *again.as_ptr().add(5) }, 42);
        let fd = m.fd().unwrap().as_raw_fd();
        // SAFETY: fcntl on a live fd.
        assert_eq!(unsafe { libc::ftruncate(fd, 1) }, -1, "shrinking a sealed memfd must fail");
    }

    #[test]
    fn from_fd_refuses_longer_than_file() {
        let m = Mapping::memfd("pinpool-test", page_size()).unwrap();
        let dup = m.fd().unwrap().try_clone_to_owned().unwrap();
        let err = Mapping::from_fd(dup, 2 * page_size(), false).unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
    }

    #[test]
    fn range_checks_do_not_overflow() {
        assert!(check_range("x", usize::MAX, 2, 10).is_err());
        assert!(check_range("x", 4, 6, 10).is_ok());
        assert!(check_range("x", 4, 7, 10).is_err());
        assert!(check_range("x", 10, 0, 10).is_ok());
    }
}
