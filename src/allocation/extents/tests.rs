//! Unit tests of `extents`, kept apart from the code they test.

use super::*;
use proptest::prelude::*;

const U: usize = 4096;

fn whole(len: usize, bounds: &[usize]) -> ExtentMap {
    let mut m = ExtentMap::new(len, U, bounds).unwrap();
    m.free(0, len).unwrap();
    m
}

#[test]
fn first_fit_reuses_the_lowest_hole_and_coalesces() {
    let mut m = whole(16 * U, &[]);
    let a = m.alloc(U, 0).unwrap();
    let b = m.alloc(3 * U - 1, 0).unwrap();
    let c = m.alloc(2 * U, 0).unwrap();
    assert_eq!((a, b, c), ((0, U), (U, 3 * U), (4 * U, 2 * U)));
    m.free(a.0, a.1).unwrap();
    m.free(c.0, c.1).unwrap();
    assert_eq!(m.free_ranges(), &[(0, U), (4 * U, 12 * U)]);
    // Too big for the first hole: the next one; then the first hole again.
    assert_eq!(m.alloc(2 * U, 0), Some((4 * U, 2 * U)));
    assert_eq!(m.alloc(1, 0), Some((0, U)));
    m.free(0, U).unwrap();
    m.free(U, 3 * U).unwrap();
    m.free(4 * U, 2 * U).unwrap();
    assert_eq!(m.free_ranges(), &[(0, 16 * U)]);
    assert_eq!(m.free_bytes(), 16 * U);
}

#[test]
fn no_extent_crosses_a_part_boundary() {
    let mut m = whole(8 * U, &[4 * U]);
    assert_eq!(m.free_ranges(), &[(0, 4 * U), (4 * U, 4 * U)]);
    assert_eq!(m.largest_part(), 4 * U);
    assert_eq!(m.alloc(5 * U, 0), None, "larger than a part");
    let a = m.alloc(3 * U, 0).unwrap();
    assert_eq!(m.alloc(2 * U, 0), Some((4 * U, 2 * U)), "the rest of part 0 is too short");
    m.free(a.0, a.1).unwrap();
    m.free(4 * U, 2 * U).unwrap();
    assert_eq!(m.free_ranges(), &[(0, 4 * U), (4 * U, 4 * U)], "merged across parts");
}

#[test]
fn double_and_bad_frees_are_refused() {
    let mut m = whole(4 * U, &[]);
    let a = m.alloc(U, 0).unwrap();
    m.free(a.0, a.1).unwrap();
    assert!(m.free(a.0, a.1).is_err());
    assert!(m.free(3 * U, 2 * U).is_err(), "past the end");
    assert!(m.free(1, U).is_err(), "not whole units");
    assert!(m.free(0, 0).is_err());
    assert!(m.free(usize::MAX - U + 1, U).is_err());
    assert_eq!(m.free_bytes(), 4 * U);
    assert!(m.alloc(usize::MAX, 0).is_none());
}

#[test]
fn keep_leaves_room_for_another() {
    let mut m = whole(4 * U, &[]);
    assert_eq!(m.alloc(3 * U, 2 * U), None, "would leave one unit");
    assert_eq!(m.alloc(2 * U, 2 * U), Some((0, 2 * U)));
    assert_eq!(m.alloc(U, 2 * U), None);
    assert_eq!(m.alloc(U, U), Some((2 * U, U)));
}

#[test]
fn a_preferred_free_offset_is_taken_exactly() {
    let mut m = whole(16 * U, &[]);
    // In the middle of the free range: it is cut in two around the extent.
    assert_eq!(m.alloc_preferring(2 * U - 5, 0, &[5 * U]), Some((5 * U, 2 * U)));
    assert_eq!(m.free_ranges(), &[(0, 5 * U), (7 * U, 9 * U)]);
    assert_eq!(m.free_bytes(), 14 * U);
    // At the start of a range, and at its very end.
    assert_eq!(m.alloc_preferring(U, 0, &[7 * U]), Some((7 * U, U)));
    assert_eq!(m.alloc_preferring(U, 0, &[15 * U]), Some((15 * U, U)));
    assert_eq!(m.free_ranges(), &[(0, 5 * U), (8 * U, 7 * U)]);
    // A whole range: it goes.
    assert_eq!(m.alloc_preferring(5 * U, 0, &[0]), Some((0, 5 * U)));
    assert_eq!(m.free_ranges(), &[(8 * U, 7 * U)]);
    // The first of several that works wins, not the lowest.
    assert_eq!(m.alloc_preferring(U, 0, &[0, 12 * U, 9 * U]), Some((12 * U, U)));
    assert_eq!(m.free_ranges(), &[(8 * U, 4 * U), (13 * U, 2 * U)]);
    assert_eq!(m.free_bytes(), 6 * U);
    // Every byte comes back into one range.
    for (o, l) in [(0, 5 * U), (5 * U, 2 * U), (7 * U, U), (15 * U, U), (12 * U, U)] {
        m.free(o, l).unwrap();
    }
    assert_eq!(m.free_ranges(), &[(0, 16 * U)]);
}

#[test]
fn a_busy_straddling_or_misaligned_preference_falls_back_to_first_fit() {
    let mut m = whole(8 * U, &[4 * U]);
    assert_eq!(m.alloc(U, 0), Some((0, U)));
    assert_eq!(m.alloc_preferring(U, 0, &[5 * U]), Some((5 * U, U)));
    assert_eq!(m.free_ranges(), &[(U, 3 * U), (4 * U, U), (6 * U, 2 * U)]);
    let refused = [
        0,                  // busy
        5 * U,              // busy
        4 * U,              // starts free, runs into the busy extent at 5U
        3 * U,              // straddles the part boundary at 4U
        7 * U,              // runs past the arena's end
        2 * U + 1,          // not a whole unit
        8 * U,              // past the end
        usize::MAX - U + 1, // its end overflows
    ];
    for (i, &p) in refused.iter().enumerate() {
        let mut n = m.clone();
        assert_eq!(n.alloc_preferring(2 * U, 0, &[p]), Some((U, 2 * U)), "offset #{i}");
        assert_eq!(n.free_ranges(), &[(3 * U, U), (4 * U, U), (6 * U, 2 * U)]);
        assert_eq!(n.free_bytes(), 4 * U);
        // Only there: nothing, and nothing taken.
        let mut n = m.clone();
        assert_eq!(n.alloc_at(2 * U, 0, &[p]), None, "offset #{i}");
        assert_eq!(n.free_ranges(), m.free_ranges());
        assert_eq!(n.free_bytes(), m.free_bytes());
    }
    // All of them together, then one that works: that one.
    let mut prefer = refused.to_vec();
    prefer.push(6 * U);
    assert_eq!(m.alloc_preferring(2 * U, 0, &prefer), Some((6 * U, 2 * U)));
    // No preference, or none that works, and no room at all: None, nothing changed.
    assert_eq!(m.alloc_preferring(4 * U, 0, &[U]), None);
    assert_eq!(m.alloc_preferring(4 * U, 0, &[]), None);
    assert_eq!(m.free_ranges(), &[(U, 3 * U), (4 * U, U)]);
}

#[test]
fn keep_is_honoured_when_preferring() {
    // The pieces around a preferred extent count, before or after it.
    let mut m = whole(8 * U, &[]);
    assert_eq!(m.alloc_preferring(2 * U, 2 * U, &[2 * U]), Some((2 * U, 2 * U)));
    let mut m = whole(8 * U, &[]);
    assert_eq!(m.alloc_preferring(2 * U, 4 * U, &[2 * U]), Some((2 * U, 2 * U)));
    // Neither piece holds `keep` (nor another range): first fit, which leaves it after.
    let mut m = whole(4 * U, &[]);
    assert_eq!(m.alloc_preferring(2 * U, 2 * U, &[U]), Some((0, 2 * U)));
    assert_eq!(m.free_ranges(), &[(2 * U, 2 * U)]);
    // ... unless first fit cannot either: None, nothing taken.
    let mut m = whole(2 * U, &[]);
    assert_eq!(m.alloc_preferring(U, 2 * U - 1, &[0, U]), None);
    assert_eq!(m.free_ranges(), &[(0, 2 * U)]);
    // Another range holds `keep`: the preferred extent may take all of its own.
    let mut m = whole(8 * U, &[4 * U]);
    assert_eq!(m.alloc_preferring(4 * U, 4 * U, &[4 * U]), Some((4 * U, 4 * U)));
    // (Now one range of 4 units.) At 1 unit it would leave 1 and 2; first fit leaves 3.
    assert_eq!(m.alloc_preferring(U, 3 * U, &[U]), Some((0, U)));
    assert_eq!(m.alloc_preferring(U, 3 * U, &[2 * U]), None, "3 units cannot stay free");
    assert_eq!(m.alloc_preferring(U, U, &[3 * U]), Some((3 * U, U)));
    assert_eq!(m.free_ranges(), &[(U, 2 * U)]);
}

/// One step of a random workload: allocate some units (first fit, or preferring some
/// offsets, with some bytes to keep), or free the live extent at some position in the
/// list of live ones.
#[derive(Debug, Clone)]
enum Step {
    Alloc(usize),
    Prefer(usize, usize, Vec<Pick>),
    Free(usize),
}

/// A preferred offset: of an extent freed before (by its position in the list of freed
/// ones), any whole unit, or any number at all.
#[derive(Debug, Clone)]
enum Pick {
    Freed(usize),
    Unit(usize),
    Any(usize),
}

fn picks() -> impl Strategy<Value = Vec<Pick>> {
    proptest::collection::vec(
        prop_oneof![
            4 => any::<usize>().prop_map(Pick::Freed),
            2 => (0usize..80).prop_map(Pick::Unit),
            1 => any::<usize>().prop_map(Pick::Any),
        ],
        0..5,
    )
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        prop_oneof![
            3 => (1usize..=6 * U).prop_map(Step::Alloc),
            1 => (1usize..=40 * U).prop_map(Step::Alloc),
            3 => (
                prop_oneof![1usize..=6 * U, 1usize..=40 * U],
                prop_oneof![Just(0usize), 1usize..=8 * U],
                picks(),
            )
                .prop_map(|(n, keep, picks)| Step::Prefer(n, keep, picks)),
            3 => any::<usize>().prop_map(Step::Free),
        ],
        1..200,
    )
}

/// What [`ExtentMap::alloc_preferring`] must return, worked out from the free ranges
/// alone: the first preferred offset whose extent lies in one free range with `keep` left
/// in one range, else what first fit returns.
fn expected(m: &ExtentMap, n: usize, keep: usize, prefer: &[usize]) -> Option<(usize, usize)> {
    let size = n.div_ceil(U) * U;
    let keep = keep.div_ceil(U) * U;
    let free = m.free_ranges();
    for &p in prefer {
        let Some(end) = p.checked_add(size).filter(|_| p % U == 0) else { continue };
        let Some(i) = free.iter().position(|&(o, l)| o <= p && end <= o + l) else {
            continue;
        };
        let (o, l) = free[i];
        let left = [p - o, o + l - end]
            .into_iter()
            .chain(free.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, r)| r.1));
        if keep == 0 || left.clone().any(|l| l >= keep) {
            return Some((p, size));
        }
    }
    m.clone().alloc(n, keep)
}

proptest! {
    #![proptest_config(crate::proptest_config(512))]

    /// Random sizes, random free orders, random parts, first fit and preferred offsets (freed
    /// before, random, misaligned) with random `keep`s: a preference is taken exactly when its
    /// extent is free and `keep` allows it, first fit otherwise; live extents never overlap and
    /// never cross a part; the free list stays sorted, disjoint, coalesced within parts; the byte
    /// count adds up; an allocation fails only when no free range could hold it; and once
    /// everything is freed, the whole arena is one range per part again.
    #[test]
    fn extents_stay_disjoint_and_every_byte_comes_back(
        parts in proptest::collection::vec(1usize..=24, 1..4),
        steps in steps(),
    ) {
        let len: usize = parts.iter().sum::<usize>() * U;
        let bounds: Vec<usize> = parts
            .iter()
            .scan(0, |at, p| { *at += p * U; Some(*at) })
            .collect();
        let mut m = whole(len, &bounds);
        let mut live: Vec<(usize, usize)> = Vec::new();
        // Offsets of extents freed so far, for preferences.
        let mut freed: Vec<usize> = Vec::new();
        let part_of = |o: usize| bounds.partition_point(|&b| b <= o);
        for step in steps {
            let got = match step {
                Step::Alloc(n) => {
                    let largest = m.largest_free();
                    let got = m.alloc(n, 0);
                    if got.is_none() {
                        prop_assert!(largest < n.div_ceil(U) * U);
                    }
                    got.map(|g| (g, n))
                }
                Step::Prefer(n, keep, picks) => {
                    let prefer: Vec<usize> = picks
                        .iter()
                        .map(|pick| match *pick {
                            Pick::Freed(i) if !freed.is_empty() => freed[i % freed.len()],
                            Pick::Freed(i) | Pick::Any(i) => i,
                            Pick::Unit(u) => u * U,
                        })
                        .collect();
                    let want = expected(&m, n, keep, &prefer);
                    let got = m.alloc_preferring(n, keep, &prefer);
                    prop_assert_eq!(got, want, "preferring {:?}", prefer);
                    got.map(|g| (g, n))
                }
                Step::Free(i) if !live.is_empty() => {
                    let (o, l) = live.swap_remove(i % live.len());
                    m.free(o, l).unwrap();
                    freed.push(o);
                    None
                }
                Step::Free(_) => None,
            };
            if let Some(((o, l), n)) = got {
                prop_assert_eq!(l, n.div_ceil(U) * U);
                prop_assert_eq!(o % U, 0);
                prop_assert!(o + l <= len);
                prop_assert_eq!(part_of(o), part_of(o + l - 1));
                for &(p, q) in &live {
                    prop_assert!(o + l <= p || p + q <= o, "overlap");
                }
                live.push((o, l));
            }
            let free = m.free_ranges();
            prop_assert_eq!(free.iter().map(|r| r.1).sum::<usize>(), m.free_bytes());
            prop_assert_eq!(
                m.free_bytes() + live.iter().map(|r| r.1).sum::<usize>(),
                len
            );
            for w in free.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "unsorted or overlapping");
                if w[0].0 + w[0].1 == w[1].0 {
                    prop_assert!(bounds.contains(&w[1].0), "touching ranges not merged");
                }
            }
            for &(o, l) in free {
                prop_assert_eq!(part_of(o), part_of(o + l - 1), "a free range crosses");
                for &(p, q) in &live {
                    prop_assert!(o + l <= p || p + q <= o, "a live extent's bytes are free");
                }
            }
        }
        for (o, l) in live {
            m.free(o, l).unwrap();
        }
        prop_assert_eq!(m.free_ranges().len(), parts.len());
        prop_assert_eq!(m.free_bytes(), len);
    }
}
