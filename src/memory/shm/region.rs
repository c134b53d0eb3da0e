//! A [`Region`]: several sealed memfds ("parts") mapped back to back as one contiguous range,
//! so fresh pages can be faulted in by many threads at once (the arena is one).
//!
//! Invariants:
//! - The parts cover the region exactly, back to back; each part is a whole number of
//!   `part_align` bytes (the last one the rest, whole pages), so no slot straddles two parts.
//! - Every part is registered with [`crate::memory::forked_child`] while it is mapped:
//!   forked children get it privately, never shared.
//! - Dropping the region unmaps it once, in pieces, after children stopped mapping its parts
//!   again and each part's descriptor was let go of.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;

use super::in_pieces::{populate_range, unmap_in_chunks};
use super::memfd::{page_size, sealed_memfd};
use crate::error::{Error, Result};
use crate::memory::forked_child;

/// Several sealed memfds ("parts") mapped back to back as one contiguous range.
///
/// Faulting fresh pages into one shared-memory file does not scale with threads (they contend on
/// the file); faulting several files does (`benchmarks/arena_populate.py` measures it). Each part
/// holds a whole number of `part_align` bytes (the last one the rest, a whole number of pages,
/// besides), so a slot of up to `part_align` never straddles two parts and none is wasted.
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
    /// The memfd's inode number (read once: what a zero-copy grant names, per batch).
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
    /// with the driver while other parts are still being faulted in).
    pub fn populate_then(
        &self,
        threads: usize,
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
                        self.populate(part.offset, part.len, per_part)?;
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

    /// Faults the pages of `[offset, offset+len)` in, with `threads` threads; `offset` and
    /// `len` are whole pages inside the region.
    pub fn populate(&self, offset: usize, len: usize, threads: usize) -> Result<()> {
        let page = page_size();
        if offset % page != 0
            || len % page != 0
            || offset.checked_add(len).is_none_or(|e| e > self.len)
        {
            return Err(Error::Invalid(format!("cannot populate {len} bytes at {offset}")));
        }
        let base = self.base.as_ptr() as usize + offset;
        let step = (len / page).div_ceil(threads.max(1)).max(1) * page;
        let faulted: std::result::Result<(), i32> = std::thread::scope(|inner| {
            let workers: Vec<_> = (0..len)
                .step_by(step)
                .map(|start| {
                    let n = step.min(len - start);
                    inner.spawn(move || populate_range(base + start, n, page))
                })
                .collect();
            workers.into_iter().try_for_each(|w| w.join().unwrap_or(Err(0)))
        });
        faulted.map_err(|errno| Error::Os { call: "madvise(MADV_POPULATE_WRITE)", errno })
    }
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
