//! One batch checked out as several slots, where no free range holds it whole.
//!
//! The arena's free bytes can add up to a batch and still lie in ranges each too short for
//! it: batches checked out for later turns cut the free bytes into pieces, and none of them
//! comes back before the consumer has taken the batch it waits for. That batch may then be
//! cut where the caller allows (between its leaves: no array is split) and checked out as
//! one slot per piece.
//!
//! Which pieces go where is a small search (`Search::plan`): pieces as long as possible, into
//! the longest ranges first, backing up where a later leaf would find no room, within a bounded
//! number of steps and over the [`RANGES_TRIED`] longest ranges (a batch has few leaves; past
//! the bound the answer is "no", as if the ranges could not hold the batch).
//!
//! Invariants:
//! - All or nothing: either every piece gets a slot, or no byte and no entry is taken (the
//!   search runs on a copy of the free ranges; the extents go back to the map, under the
//!   same lock, if one could not be taken after all).
//! - The pieces cover the batch: each is the bytes `[cuts[a], cuts[b])` for two cuts with
//!   `a < b`, the next piece starts where it ends, the first at 0 and the last ends at the
//!   last cut; each is one checkout, whole pages, inside one free range (so one part).
//! - No room is kept for anyone: this is the batch the consumer waits for.

use std::cmp::Reverse;

use super::{SlotId, SlotTable};
use crate::error::{Error, Result};

/// The most steps [`Search::plan`] takes before it answers "no".
const SEARCH_STEPS: usize = 4096;
/// The most free ranges the search places pieces in: the longest ones (every step sorts them,
/// under the table's lock; an arena cut by many small kept batches has many short holes).
const RANGES_TRIED: usize = 64;

/// One piece as planned: where it starts in the batch, and its extent in the arena.
type Placed = (usize, (usize, usize));

impl SlotTable {
    /// Checks out the bytes `[0, cuts.last())` as consecutive pieces, cut only at `cuts`
    /// (strictly increasing, from 0): `(start, slot)` for each piece in order, or None
    /// (nothing taken) when the free ranges cannot hold the pieces (or the search gave up)
    /// or too few entries are spare. Never blocks.
    pub fn try_checkout_split(&self, cuts: &[usize]) -> Result<Option<Vec<(usize, SlotId)>>> {
        check_cuts(cuts)?;
        let mut inner = self.lock();
        let unit = inner.map.unit();
        if cuts[cuts.len() - 1].checked_next_multiple_of(unit).is_none() {
            return Ok(None);
        }
        let mut free = inner.map.free_ranges().to_vec();
        free.sort_unstable_by_key(|r| Reverse(r.1));
        free.truncate(RANGES_TRIED);
        let mut placed = Vec::new();
        let mut steps = SEARCH_STEPS;
        let most = inner.spare.len();
        let search = Search { cuts, unit, most };
        if !search.plan(0, &mut free, &mut placed, &mut steps) {
            return Ok(None);
        }
        let mut taken: Vec<Placed> = Vec::with_capacity(placed.len());
        for &(start, (offset, len)) in &placed {
            match inner.map.alloc_at(len, 0, &[offset]) {
                Some(extent) => taken.push((start, extent)),
                None => {
                    debug_assert!(false, "a planned extent was not free: {placed:?}");
                    for (_, (offset, len)) in taken {
                        let freed = inner.map.free(offset, len);
                        debug_assert!(freed.is_ok(), "{freed:?}");
                    }
                    return Ok(None);
                }
            }
        }
        Ok(Some(
            taken
                .into_iter()
                .map(|(start, (offset, len))| (start, self.check_out(&mut inner, offset, len)))
                .collect(),
        ))
    }
}

/// What the search places: the batch's cuts (a piece from cut `a` to cut `b` takes
/// `cuts[b] - cuts[a]` bytes rounded up to whole `unit`s), and the most pieces.
struct Search<'a> {
    cuts: &'a [usize],
    unit: usize,
    /// Spare entries: the most pieces.
    most: usize,
}

impl Search<'_> {
    /// Places the pieces from cut `at` on into `free` (shrinking the ranges it uses from their
    /// start), pushing each onto `placed`; true once the last cut is reached. Depth first:
    /// ranges longest first, each piece as long as its range allows, then shorter.
    fn plan(
        &self,
        at: usize,
        free: &mut Vec<(usize, usize)>,
        placed: &mut Vec<Placed>,
        steps: &mut usize,
    ) -> bool {
        let last = self.cuts.len() - 1;
        if at == last {
            return true;
        }
        if *steps == 0 || placed.len() == self.most {
            return false;
        }
        *steps -= 1;
        let start = self.cuts[at];
        // (Cannot overflow: the last cut rounded up fits, checked before the search.)
        let size = |end: usize| (self.cuts[end] - start).next_multiple_of(self.unit);
        let left: usize = free.iter().map(|r| r.1).sum();
        if self.cuts[last] - start > left {
            return false;
        }
        let mut order: Vec<usize> = (0..free.len()).filter(|&i| free[i].1 > 0).collect();
        order.sort_by_key(|&i| Reverse(free[i].1));
        order.dedup_by_key(|i| free[*i].1); // (ranges of one length are alike here)
        for i in order {
            let (offset, len) = free[i];
            for end in (at + 1..=last).rev() {
                let n = size(end);
                if n > len {
                    continue;
                }
                free[i] = (offset + n, len - n);
                placed.push((start, (offset, n)));
                if self.plan(end, free, placed, steps) {
                    return true;
                }
                placed.pop();
                free[i] = (offset, len);
            }
        }
        false
    }
}

/// Fails unless `cuts` has two or more offsets, the first 0, each larger than the one before.
pub fn check_cuts(cuts: &[usize]) -> Result<()> {
    if cuts.len() < 2 || cuts[0] != 0 || cuts.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Invalid(format!(
            "a batch's cuts must start at 0 and increase, with at least one piece: {cuts:?}"
        )));
    }
    Ok(())
}
