//! Unit tests of `slots`, kept apart from the code they test.

use super::*;

#[test]
fn bytes_not_ready_are_handed_out_only_once_admitted() {
    let u = page_size();
    let t = SlotTable::with_ready(3, 1).unwrap();
    assert_eq!(t.counts(), Counts { free: 1, checked_out: 0, fenced: 0, preparing: 2 });
    let a = t.try_checkout().unwrap();
    assert_eq!(t.extent(a), Some((0, u)));
    assert!(t.try_checkout().is_none(), "bytes not ready were handed out");
    assert!(t.admit(2 * u, u));
    assert!(!t.admit(2 * u, u), "admitted twice");
    assert!(!t.admit(0, u), "ready bytes admitted again");
    assert!(!t.admit(7 * u, u), "bytes past the arena admitted");
    assert_eq!(t.extent(t.try_checkout().unwrap()), Some((2 * u, u)));
    assert!(t.try_checkout().is_none());
    assert!(t.admit(u, u));
    assert_eq!(t.extent(t.try_checkout().unwrap()), Some((u, u)));
    assert_eq!(t.counts(), Counts { free: 0, checked_out: 3, fenced: 0, preparing: 0 });
}

#[test]
fn bytes_given_up_are_no_longer_room_on_its_way() {
    let u = page_size();
    let t = SlotTable::with_ready(3, 1).unwrap();
    let a = t.try_checkout().unwrap();
    assert!(t.room_once_back(u, 0, &[]), "the bytes not ready yet are on their way");
    let epoch = t.epoch();
    assert_eq!(t.give_up_unready(), 2 * u);
    assert_ne!(t.epoch(), epoch, "waiters were not woken");
    assert!(!t.room_once_back(u, 0, &[]), "given-up bytes still count as on their way");
    assert!(!t.admit(u, u), "given-up bytes admitted");
    assert_eq!(t.counts().preparing, 0);
    t.release(a, false).unwrap();
    assert!(t.room_once_back(u, 0, &[]));
}

#[test]
fn checkout_release_cycle() {
    let t = SlotTable::new(2).unwrap();
    let a = t.try_checkout().unwrap();
    let b = t.try_checkout().unwrap();
    assert_ne!(a.index, b.index);
    assert!(t.try_checkout().is_none());
    t.release(a, false).unwrap();
    assert_eq!(t.release(a, false), Err(Error::SlotReleased { index: a.index as usize }));
    let c = t.try_checkout().unwrap();
    assert_eq!(c.index, a.index);
    assert_ne!(c.generation, a.generation);
    // The stale checkout cannot release the new checkout.
    assert!(t.release(a, false).is_err());
    assert!(t.is_live(c));
    assert!(t.extent(a).is_none());
    assert_eq!(t.counts(), Counts { free: 0, checked_out: 2, fenced: 0, preparing: 0 });
}

#[test]
fn slots_of_any_size_share_the_arena() {
    let u = page_size();
    let t = SlotTable::with_layout(Layout {
        entries: 8,
        arena: 16 * u,
        unit: u,
        default_bytes: u,
        boundaries: vec![8 * u],
        ready: 16 * u,
    })
    .unwrap();
    let big = t.try_checkout_bytes(7 * u + 1, 0).unwrap();
    assert_eq!(t.extent(big), Some((0, 8 * u)));
    assert!(t.try_checkout_bytes(9 * u, 0).is_none(), "larger than a part");
    let small = t.try_checkout_bytes(1, 0).unwrap();
    assert_eq!(t.extent(small), Some((8 * u, u)));
    assert!(t.try_checkout_bytes(4 * u, 4 * u).is_none(), "would leave less than `keep`");
    let b = t.bytes();
    assert_eq!(
        (b.checked_out, b.free, b.largest_free, b.largest_part),
        (9 * u, 7 * u, 7 * u, 8 * u)
    );
    t.release(big, true).unwrap();
    assert!(t.try_checkout_bytes(8 * u, 0).is_none(), "a fenced slot's bytes reused");
    assert_eq!(t.bytes().fenced, 8 * u);
    assert!(t.complete_fence(big));
    assert_eq!(t.extent(t.try_checkout_bytes(8 * u, 0).unwrap()), Some((0, 8 * u)));
}

#[test]
fn a_claim_that_keeps_room_keeps_the_last_entry_too() {
    let t = SlotTable::new(4).unwrap();
    let a = t.try_checkout_bytes(1, 1).unwrap();
    let b = t.try_checkout_bytes(1, 1).unwrap();
    let c = t.try_checkout_bytes(1, 1).unwrap();
    assert!(t.try_checkout_bytes(1, 1).is_none(), "the last entry was taken");
    let d = t.try_checkout_bytes(1, 0).unwrap();
    for x in [a, b, c, d] {
        t.release(x, false).unwrap();
    }
}

#[test]
fn a_preferred_extent_is_handed_out_again_once_free() {
    let u = page_size();
    let t = SlotTable::new(6).unwrap();
    let [a, b, c] = [(); 3].map(|_| t.try_checkout_bytes(u, 0).unwrap());
    assert_eq!([a, b, c].map(|x| t.extent(x).unwrap().0), [0, u, 2 * u]);
    t.release(a, false).unwrap();
    t.release(c, false).unwrap();
    // First fit would give a's page back; c's is asked for.
    let again = t.try_checkout_bytes_preferring(u, 0, &[2 * u], Preference::Prefer).unwrap();
    assert_eq!(t.extent(again), Some((2 * u, u)));
    // Held (b), fenced (again), or not a page boundary: first fit.
    t.release(again, true).unwrap();
    let other =
        t.try_checkout_bytes_preferring(u, 0, &[u, 2 * u, 3 * u + 1], Preference::Prefer).unwrap();
    assert_eq!(t.extent(other), Some((0, u)));
    assert!(t.complete_fence(again));
    let back = t.try_checkout_bytes_preferring(u, 0, &[2 * u], Preference::Prefer).unwrap();
    assert_eq!(t.extent(back), Some((2 * u, u)));
    // Two pages from a's (held by `other`) would overlap it: first fit, after `back`.
    let two = t.try_checkout_bytes_preferring(2 * u, 0, &[0], Preference::Prefer).unwrap();
    assert_eq!(t.extent(two), Some((3 * u, 2 * u)));
    // `keep` counts: the last free page is not taken if a page must stay free.
    assert!(
        t.try_checkout_bytes_preferring(u, u, &[5 * u], Preference::Prefer).is_none(),
        "`keep` ignored"
    );
    let last = t.try_checkout_bytes_preferring(u, 0, &[5 * u], Preference::Prefer).unwrap();
    assert_eq!(t.extent(last), Some((5 * u, u)));
    let b = t.bytes();
    assert_eq!((b.free, b.checked_out), (0, 6 * u));
}

#[test]
fn fenced_slots_are_not_handed_out() {
    let t = SlotTable::new(1).unwrap();
    let a = t.try_checkout().unwrap();
    t.release(a, true).unwrap();
    assert!(t.try_checkout().is_none());
    assert_eq!(t.counts().fenced, 1);
    assert!(t.release(a, true).is_err(), "second release of a fenced slot");
    assert!(t.complete_fence(a));
    assert!(!t.complete_fence(a), "a fence completes once");
    assert!(t.try_checkout().is_some());
}

#[test]
fn room_once_back_counts_ranges_not_bytes() {
    let u = page_size();
    let t = SlotTable::new(8).unwrap();
    let held: Vec<SlotId> = (0..8).map(|_| t.try_checkout().unwrap()).collect();
    // Every other page given back: four free pages, in four holes of one page.
    for c in held.iter().step_by(2) {
        t.release(*c, false).unwrap();
    }
    assert_eq!(t.bytes().free, 4 * u);
    assert!(t.room_once_back(u, 0, &[]));
    assert!(!t.room_once_back(2 * u, 0, &[]), "two pages in one-page holes");
    // A fenced neighbour comes back by itself and joins two holes into three pages.
    t.release(held[1], true).unwrap();
    assert!(t.room_once_back(3 * u, 0, &[]));
    assert!(!t.room_once_back(4 * u, 0, &[]));
    // Keeping a range of two pages besides: the other holes hold one page each.
    assert!(!t.room_once_back(3 * u, 2 * u, &[]));
    assert!(t.room_once_back(u, 2 * u, &[]));
    // A slot that will be released (a batch the consumer has not reached yet) counts too;
    // a stale checkout of it does not.
    assert!(t.room_once_back(5 * u, 0, &[held[3]]));
    let stale = SlotId { generation: held[3].generation + 1, ..held[3] };
    assert!(!t.room_once_back(5 * u, 0, &[stale]));
    assert!(t.complete_fence(held[1]));
}

#[test]
fn bad_index_is_refused() {
    let t = SlotTable::new(1).unwrap();
    let bogus = SlotId { table: t.id(), index: 9, generation: 1 };
    assert!(t.release(bogus, false).is_err());
    assert!(!t.complete_fence(bogus));
    let other = SlotTable::new(1).unwrap();
    let foreign = other.try_checkout().unwrap();
    assert!(t.release(foreign, false).is_err(), "a checkout of another table is refused");
    assert!(!t.is_live(foreign));
    assert!(other.is_live(foreign));
    assert!(SlotTable::new(0).is_err());
}

/// Eight one-page slots checked out, every other one given back: four one-page holes.
fn holes_of_one_page() -> (SlotTable, Vec<SlotId>) {
    let t = SlotTable::new(8).unwrap();
    let held: Vec<SlotId> = (0..8).map(|_| t.try_checkout().unwrap()).collect();
    for c in held.iter().step_by(2) {
        t.release(*c, false).unwrap();
    }
    (t, held)
}

#[test]
fn a_batch_no_range_holds_is_checked_out_in_pieces_between_its_leaves() {
    let u = page_size();
    let (t, _held) = holes_of_one_page();
    assert!(t.try_checkout_bytes(3 * u, 0).is_none(), "three pages in one-page holes");
    // Three leaves of a page: one slot each, in the holes, in the batch's order.
    let pieces = t.try_checkout_split(&[0, u, 2 * u, 3 * u]).unwrap().unwrap();
    let starts: Vec<usize> = pieces.iter().map(|p| p.0).collect();
    assert_eq!(starts, vec![0, u, 2 * u]);
    for (_, slot) in &pieces {
        assert_eq!(t.extent(*slot).unwrap().1, u);
    }
    assert_eq!(t.bytes().free, u);
    for (_, slot) in pieces {
        t.release(slot, false).unwrap();
    }
    assert_eq!(t.bytes().free, 4 * u);
}

#[test]
fn pieces_are_placed_so_that_a_later_leaf_finds_room_too() {
    let u = page_size();
    let t = SlotTable::new(8).unwrap();
    let one = t.try_checkout_bytes(u, 0).unwrap();
    let _two = t.try_checkout_bytes(u, 0).unwrap();
    // Free: one page at 0, six pages at 2u.
    t.release(one, false).unwrap();
    // Leaves of 1, 1, 1 and 4 pages: the first three together in the six pages would leave the
    // last no room; the search backs up and places every leaf.
    let pieces = t.try_checkout_split(&[0, u, 2 * u, 3 * u, 7 * u]).unwrap().unwrap();
    let mut end = 0;
    for (start, slot) in &pieces {
        assert_eq!(*start, end, "{pieces:?}");
        end += t.extent(*slot).unwrap().1;
        assert!([u, 2 * u, 3 * u, 7 * u].contains(&end), "a leaf cut: {pieces:?}");
    }
    assert_eq!(end, 7 * u);
    assert_eq!(t.bytes().free, 0);
}

#[test]
fn a_batch_checked_out_in_pieces_takes_all_or_nothing() {
    let u = page_size();
    let (t, _held) = holes_of_one_page();
    let before = t.bytes();
    // A leaf of two pages fits no hole: nothing is taken, not even the first piece.
    assert!(t.try_checkout_split(&[0, u, 3 * u]).unwrap().is_none());
    // More bytes than are free.
    assert!(t.try_checkout_split(&[0, u, 2 * u, 3 * u, 4 * u, 5 * u]).unwrap().is_none());
    assert_eq!(t.bytes(), before);
    assert_eq!(t.counts().checked_out, 4);
    // Too few entries: two ranges but one spare entry.
    let t = SlotTable::with_layout(Layout {
        entries: 3,
        arena: 8 * u,
        unit: u,
        default_bytes: u,
        boundaries: Vec::new(),
        ready: 8 * u,
    })
    .unwrap();
    let held: Vec<SlotId> = (0..3).map(|_| t.try_checkout().unwrap()).collect();
    t.release(held[1], false).unwrap(); // free: [u, 2u) and [3u, 8u); one entry spare
    let before = t.bytes();
    assert!(t.try_checkout_split(&[0, 5 * u, 6 * u]).unwrap().is_none());
    assert_eq!(t.bytes(), before);
    assert_eq!(t.try_checkout_split(&[0, 5 * u]).unwrap().map(|p| p.len()), Some(1));
}

#[test]
fn a_batch_finds_its_pieces_among_many_holes() {
    let u = page_size();
    let t = SlotTable::new(512).unwrap();
    let held: Vec<SlotId> = (0..512).map(|_| t.try_checkout().unwrap()).collect();
    // 200 one-page holes, then 112 pages in a row.
    for c in held[..400].iter().step_by(2).chain(&held[400..]) {
        t.release(*c, false).unwrap();
    }
    assert_eq!(t.bytes().holes, 201);
    // 120 one-page arrays: 112 in the long range, the rest in holes.
    let cuts: Vec<usize> = (0..=120).map(|k| k * u).collect();
    let pieces = t.try_checkout_split(&cuts).unwrap().unwrap();
    let total: usize = pieces.iter().map(|p| t.extent(p.1).unwrap().1).sum();
    assert_eq!(total, 120 * u);
    assert!(pieces.len() >= 9, "{}", pieces.len());
    assert_eq!(t.bytes().free, 192 * u);
}

#[test]
fn cuts_that_do_not_start_at_0_and_increase_are_refused() {
    let u = page_size();
    let t = SlotTable::new(4).unwrap();
    for cuts in [&[][..], &[0], &[u, 2 * u], &[0, u, u], &[0, 2 * u, u]] {
        assert!(t.try_checkout_split(cuts).is_err(), "{cuts:?}");
    }
    assert_eq!(t.counts().checked_out, 0);
}

proptest::proptest! {
    #![proptest_config(crate::proptest_config(256))]

    /// Random checkouts and releases cut the arena into holes; then a batch of random leaves is
    /// checked out in pieces. Taken: the pieces start at 0 and at cuts, in order, each one
    /// checkout of its bytes rounded to pages, overlapping no other live extent. Not taken:
    /// nothing changed; and never while one free range holds the whole batch (with an entry
    /// spare), nor taken while the batch's bytes exceed the free bytes or one leaf exceeds the
    /// longest free range.
    #[test]
    fn pieces_cover_the_batch_or_take_nothing(
        sizes in proptest::collection::vec(1usize..=4, 1..24),
        frees in proptest::collection::vec(proptest::bool::ANY, 24),
        leaves in proptest::collection::vec(1usize..=3 * 4096, 1..8),
    ) {
        let u = page_size();
        let t = SlotTable::new(32).unwrap();
        let mut live: Vec<SlotId> = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            if let Some(s) = t.try_checkout_bytes(n * u, 0) {
                if frees[i] { t.release(s, false).unwrap() } else { live.push(s) }
            }
        }
        let mut cuts = vec![0];
        for l in &leaves {
            cuts.push(cuts.last().unwrap() + l.div_ceil(u) * u);
        }
        let total = *cuts.last().unwrap();
        let before = t.bytes();
        let spare = t.len() - t.counts().checked_out;
        let widest = cuts.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        match t.try_checkout_split(&cuts).unwrap() {
            None => {
                proptest::prop_assert_eq!(t.bytes(), before);
                proptest::prop_assert!(before.largest_free < total || spare == 0);
            }
            Some(pieces) => {
                proptest::prop_assert!(total <= before.free && widest <= before.largest_free);
                proptest::prop_assert_eq!(pieces[0].0, 0);
                let ends: Vec<usize> =
                    pieces.iter().skip(1).map(|p| p.0).chain(std::iter::once(total)).collect();
                let extents: Vec<(usize, usize)> =
                    live.iter().map(|s| t.extent(*s).unwrap()).collect();
                for (k, (start, slot)) in pieces.iter().enumerate() {
                    proptest::prop_assert!(cuts.contains(start));
                    let (o, l) = t.extent(*slot).unwrap();
                    proptest::prop_assert_eq!(l, ends[k] - start);
                    for &(p, q) in &extents {
                        proptest::prop_assert!(o + l <= p || p + q <= o, "overlap");
                    }
                }
                proptest::prop_assert_eq!(t.bytes().free, before.free - total);
            }
        }
    }
}
