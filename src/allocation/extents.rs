//! Where in the arena each checkout's bytes go: a first-fit allocator of byte ranges.
//!
//! (Steps 2 and 6 of "the life of a slot" in [`crate::pool`]: a checkout carves its bytes
//! here, and they come back here once its fence has completed.)
//!
//! Why first fit in address order: a DataLoader's batches are mostly consumed in the order
//! they were made, so the ranges freed first are the oldest, at the low end, and the next
//! batch lands there again; a batch the consumer keeps (for logging, say) holds only its own
//! bytes, and the others flow around it. A ring would stop at such a batch until it came
//! back; size classes or a buddy scheme would round every batch up (to a power of two, as
//! torch's caching allocator does) and waste up to half the arena. Address-ordered first fit
//! keeps holes few (freed neighbours coalesce at once) and a live extent list short (the
//! batches in flight), so a linear walk of the free list is cheap.
//!
//! Invariants:
//! - Offsets and lengths are whole numbers of `unit` (the page size): every extent is
//!   page-aligned and a worker process can map exactly it.
//! - The free list is sorted by offset; its ranges are disjoint, non-empty, inside
//!   `[0, len)`, and none crosses a boundary (the arena's parts: separate memfds and driver
//!   registrations, which one copy or mapping must not straddle). Two free ranges that touch
//!   are merged unless a boundary lies between them.
//! - An extent handed out by [`ExtentMap::alloc`] or [`ExtentMap::alloc_preferring`] lies
//!   inside one free range, which loses exactly its bytes (what is left of it, before and
//!   after the extent, stays free as up to two ranges): no two live extents overlap.
//!   [`ExtentMap::free`] refuses a range that overlaps free bytes (a double free), changing
//!   nothing.
//! - `free_bytes` is the sum of the free list's lengths.
//!
//! A preferred place: [`ExtentMap::alloc_preferring`] takes an extent exactly where the
//! caller asks, when that place is free, before it falls back to first fit. A zero-copy
//! worker keeps a mapping of the extents it wrote its last batches into; handing it those
//! same bytes again spares it mapping (and faulting in) new ones.
//!
//! What fragmentation can do: a request for `n` bytes may find `free_bytes() >= n` but no
//! single range of `n` (see [`ExtentMap::largest_free`]). The allocator never moves a live
//! extent; the caller decides (the pool waits while freed or fenced bytes are on their way,
//! which coalesce with their neighbours as they come back).

use crate::error::{Error, Result};

/// Free byte ranges of an arena of `len` bytes.
#[derive(Debug, Clone)]
pub struct ExtentMap {
    len: usize,
    unit: usize,
    /// Sorted by offset: `(offset, len)`.
    free: Vec<(usize, usize)>,
    /// Sorted offsets (other than 0) where a part starts.
    boundaries: Vec<usize>,
    free_bytes: usize,
}

impl ExtentMap {
    /// An arena of `len` bytes (a multiple of `unit`, a power of two) with parts starting at
    /// `boundaries`, of which nothing is free yet (see [`ExtentMap::free`]).
    pub fn new(len: usize, unit: usize, boundaries: &[usize]) -> Result<Self> {
        if unit == 0 || !unit.is_power_of_two() || len % unit != 0 {
            return Err(Error::Invalid(format!(
                "an arena of {len} bytes cannot be cut in units of {unit}"
            )));
        }
        let mut bounds: Vec<usize> =
            boundaries.iter().copied().filter(|&b| b > 0 && b < len).collect();
        bounds.sort_unstable();
        bounds.dedup();
        if bounds.iter().any(|b| b % unit != 0) {
            return Err(Error::Invalid("part boundaries must be whole units".into()));
        }
        Ok(ExtentMap { len, unit, free: Vec::with_capacity(16), boundaries: bounds, free_bytes: 0 })
    }

    /// The arena's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena has no bytes (never: kept for clippy's `len` rule).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation unit.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// `n` rounded up to whole units, or None past the address space.
    pub fn round(&self, n: usize) -> Option<usize> {
        n.max(1).checked_next_multiple_of(self.unit)
    }

    /// Free bytes, in all.
    pub fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// The longest free range.
    pub fn largest_free(&self) -> usize {
        self.free.iter().map(|r| r.1).max().unwrap_or(0)
    }

    /// How many free ranges there are.
    pub fn holes(&self) -> usize {
        self.free.len()
    }

    /// How many extents of `size` bytes (rounded to units) fit in the free ranges as they are.
    pub fn fits(&self, size: usize) -> usize {
        match self.round(size) {
            Some(s) => self.free.iter().map(|r| r.1 / s).sum(),
            None => 0,
        }
    }

    /// The longest part: no extent can be longer.
    pub fn largest_part(&self) -> usize {
        let mut last = 0;
        let mut most = 0;
        for &b in self.boundaries.iter().chain(std::iter::once(&self.len)) {
            most = most.max(b - last);
            last = b;
        }
        most
    }

    /// Takes `n` bytes (rounded up to units) from the first free range that holds them, with
    /// at least `keep` bytes left in one range afterwards (in another range, or what remains
    /// of this one). Returns the extent's `(offset, len)`, or None if there is no such range.
    pub fn alloc(&mut self, n: usize, keep: usize) -> Option<(usize, usize)> {
        let size = self.round(n)?;
        let keep = if keep == 0 { 0 } else { self.round(keep)? };
        let at = self.free.iter().position(|r| r.1 >= size)?;
        let offset = self.free[at].0;
        if !self.keeps(at, offset, size, keep) {
            return None;
        }
        self.take(at, offset, size);
        Some((offset, size))
    }

    /// As [`ExtentMap::alloc`], but first tries each offset of `prefer`, in order: the first
    /// that is a whole number of units and starts `n` bytes (rounded up to units) lying
    /// wholly inside one free range (so crossing no part), with at least `keep` bytes left
    /// in one range afterwards, is taken, exactly there. If none is, first fit, as
    /// [`ExtentMap::alloc`]. Returns the extent's `(offset, len)`, or None.
    pub fn alloc_preferring(
        &mut self,
        n: usize,
        keep: usize,
        prefer: &[usize],
    ) -> Option<(usize, usize)> {
        match self.alloc_at(n, keep, prefer) {
            Some(extent) => Some(extent),
            None => self.alloc(n, keep),
        }
    }

    /// As [`ExtentMap::alloc_preferring`], without the first fit: None unless the extent can
    /// start at one of the offsets of `prefer`.
    pub fn alloc_at(&mut self, n: usize, keep: usize, prefer: &[usize]) -> Option<(usize, usize)> {
        let size = self.round(n)?;
        let keep = if keep == 0 { 0 } else { self.round(keep)? };
        for &offset in prefer {
            if offset % self.unit != 0 {
                continue;
            }
            let Some(end) = offset.checked_add(size) else { continue };
            // The free range that could hold it: the last one starting at or before it.
            let Some(at) = self.free.partition_point(|r| r.0 <= offset).checked_sub(1) else {
                continue;
            };
            let (start, len) = self.free[at];
            if end <= start + len && self.keeps(at, offset, size, keep) {
                self.take(at, offset, size);
                return Some((offset, size));
            }
        }
        None
    }

    /// Whether taking `[offset, offset + size)` out of free range `at` (which holds it) would
    /// leave `keep` bytes free in one range: a piece of that range, before or after the
    /// extent, or another range.
    fn keeps(&self, at: usize, offset: usize, size: usize, keep: usize) -> bool {
        if keep == 0 {
            return true;
        }
        let (start, len) = self.free[at];
        let before = offset - start;
        let after = start + len - (offset + size);
        before >= keep
            || after >= keep
            || self.free.iter().enumerate().any(|(i, r)| i != at && r.1 >= keep)
    }

    /// Takes `[offset, offset + size)` out of free range `at`, which holds it: what is left
    /// before and after it stays free (two ranges that do not touch, in the same part).
    fn take(&mut self, at: usize, offset: usize, size: usize) {
        let (start, len) = self.free[at];
        let before = offset - start;
        let after = start + len - (offset + size);
        match (before > 0, after > 0) {
            (false, false) => {
                self.free.remove(at);
            }
            (true, false) => self.free[at].1 = before,
            (false, true) => self.free[at] = (offset + size, after),
            (true, true) => {
                self.free[at].1 = before;
                self.free.insert(at + 1, (offset + size, after));
            }
        }
        self.free_bytes -= size;
    }

    /// Gives back `[offset, offset + len)` (whole units, inside the arena, no byte of it free
    /// already), merging it with free neighbours in the same part. A range that crosses parts
    /// is split at their boundaries (the arena's bytes becoming ready part by part).
    pub fn free(&mut self, offset: usize, len: usize) -> Result<()> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len);
        let Some(end) = end.filter(|_| len > 0 && offset % self.unit == 0 && len % self.unit == 0)
        else {
            return Err(Error::OutOfRange { what: "arena", offset, len, size: self.len });
        };
        // Where it goes: after every free range that starts before it.
        let at = self.free.partition_point(|r| r.0 < offset);
        let overlaps_prev = at > 0 && {
            let p = self.free[at - 1];
            p.0 + p.1 > offset
        };
        let overlaps_next = at < self.free.len() && self.free[at].0 < end;
        if overlaps_prev || overlaps_next {
            return Err(Error::Invalid(format!(
                "bytes [{offset}, {end}) of the arena were freed twice"
            )));
        }
        // Cut at part boundaries, then insert the pieces in order.
        let mut start = offset;
        let mut index = at;
        while start < end {
            let next_bound = self.boundaries[self.boundaries.partition_point(|&b| b <= start)..]
                .first()
                .copied()
                .unwrap_or(self.len)
                .min(end);
            index = self.insert(index, start, next_bound - start);
            start = next_bound;
        }
        self.free_bytes += len;
        Ok(())
    }

    /// Inserts a free range that lies inside one part at list position `at` (its sorted
    /// place), merging it with neighbours in the same part; returns the position after it.
    fn insert(&mut self, at: usize, offset: usize, len: usize) -> usize {
        let end = offset + len;
        let joins_prev = at > 0 && {
            let p = self.free[at - 1];
            p.0 + p.1 == offset && !self.is_boundary(offset)
        };
        let joins_next = at < self.free.len() && self.free[at].0 == end && !self.is_boundary(end);
        match (joins_prev, joins_next) {
            (true, true) => {
                let next_len = self.free[at].1;
                self.free[at - 1].1 += len + next_len;
                self.free.remove(at);
                at
            }
            (true, false) => {
                self.free[at - 1].1 += len;
                at
            }
            (false, true) => {
                self.free[at] = (offset, len + self.free[at].1);
                at + 1
            }
            (false, false) => {
                self.free.insert(at, (offset, len));
                at + 1
            }
        }
    }

    fn is_boundary(&self, offset: usize) -> bool {
        self.boundaries.binary_search(&offset).is_ok()
    }

    /// The free ranges, in order (for tests and checks).
    pub fn free_ranges(&self) -> &[(usize, usize)] {
        &self.free
    }
}

#[cfg(test)]
mod tests;
