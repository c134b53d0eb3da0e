//! A sealed memfd: how one is made (sealed against shrinking and growing, close-on-exec,
//! owner-only), how a file handed over is checked before it is mapped, and the page size
//! mappings are cut in.
//!
//! Invariants:
//! - A memfd made here is sealed against shrinking and growing before anyone can map it.
//! - [`check_sealed`] accepts only a memfd sealed against shrinking: no other file can be
//!   mapped, so no mapping of one can raise `SIGBUS`.

use std::ffi::CString;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::fs::{MemfdFlags, Mode, SealFlags};

use crate::error::{Error, Result};

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// Rounds `n` up to a multiple of `align` (a power of two), or `None` on overflow.
pub fn round_up(n: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    n.checked_add(align - 1).map(|m| m & !(align - 1))
}

const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// A sealed (no shrinking, no growing), close-on-exec memfd of `len` bytes.
pub(super) fn sealed_memfd(name: &str, len: usize) -> Result<OwnedFd> {
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
