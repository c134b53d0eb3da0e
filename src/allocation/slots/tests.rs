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
