//! What the slot table reports: how many slots, and how many of the arena's bytes, are in
//! each state, and whether waiting for the slots that will come back can bring room.
//!
//! Invariant: every figure is exact, taken under the table's lock; none changes the table.

use std::sync::atomic::Ordering;

use super::{split, Bytes, Counts, SlotId, SlotTable, State};

impl SlotTable {
    /// How many slots are in each state (exact: taken under the lock).
    pub fn counts(&self) -> Counts {
        let inner = self.lock();
        let unready: usize = inner.unready.iter().map(|r| r.1).sum();
        Counts {
            free: inner.spare.len().min(inner.map.fits(self.default_bytes)),
            checked_out: inner.out,
            fenced: inner.fenced,
            preparing: unready / self.default_bytes,
        }
    }

    /// The arena's bytes by state (exact: taken under the lock).
    pub fn bytes(&self) -> Bytes {
        let inner = self.lock();
        Bytes {
            arena: inner.map.len(),
            free: inner.map.free_bytes(),
            largest_free: inner.map.largest_free(),
            holes: inner.map.holes(),
            checked_out: inner.out_bytes,
            fenced: inner.fenced_bytes,
            preparing: inner.unready.iter().map(|r| r.1).sum(),
            largest_part: inner.map.largest_part(),
        }
    }

    /// Whether a slot of `bytes` with `keep` bytes left in one range (and, with `keep`, a
    /// spare entry) could be checked out once every fenced slot, every byte not ready yet and
    /// the slots of `also` (checkouts that will be released: those that are still live count)
    /// have come back, merged with their free neighbours: what waiting for them can bring.
    /// Ranges, not byte counts: free bytes cut into pieces by slots someone keeps hold no
    /// larger slot however long one waits.
    pub fn room_once_back(&self, bytes: usize, keep: usize, also: &[SlotId]) -> bool {
        let inner = self.lock();
        let mut map = inner.map.clone();
        let mut entries = inner.spare.len();
        // The fenced entries (a walk of the table only while there are any: a sized arena has
        // an entry for each 64 KiB of it), then the live checkouts of `also`, each once.
        let walked = if inner.fenced > 0 { self.words.len() } else { 0 };
        let fenced = (0..walked)
            .filter(|&i| split(self.words[i].load(Ordering::Acquire)).1 == State::Fenced);
        let live = also.iter().filter(|c| c.table == self.id).filter_map(|c| {
            let word = self.words.get(c.index as usize)?.load(Ordering::Acquire);
            (split(word) == (c.generation, State::CheckedOut)).then_some(c.index as usize)
        });
        for i in fenced.chain(live) {
            let (offset, len) = inner.extents[i];
            if map.free(offset, len).is_ok() {
                entries += 1;
            }
        }
        if entries < if keep > 0 { 2 } else { 1 } {
            return false;
        }
        for &(offset, len) in &inner.unready {
            let _ = map.free(offset, len);
        }
        map.alloc(bytes, keep).is_some()
    }

    /// Free entries: how many more slots can be out at once.
    pub fn spare_entries(&self) -> usize {
        self.lock().spare.len()
    }
}
