//! Unit tests of `segment`, kept apart from the code they test.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::header::{read_header, CAPACITY_AT, MAGIC, NONCE_AT, STATE_AT};
use super::*;
use crate::pool::slot::Slot;
use crate::pool::Pool;
use crate::pool::PoolConfig;
use crate::transfer::copy::CopyRange;
use crate::transport::reclaim::Reclaimer;
use proptest::prelude::*;

/// A cache over `pool` with a reclaimer of its own.
fn cache_over(pool: &Arc<Pool>) -> SegmentCache {
    SegmentCache::new(Arc::clone(pool), Arc::new(Reclaimer::start().unwrap()))
}

fn dup(seg: &WorkerSegment) -> OwnedFd {
    seg.fd().unwrap().try_clone_to_owned().unwrap()
}

/// What `check_header` must answer, written independently of it: accepted exactly when the
/// header is whole, the segment has a data area, and the magic, capacity and nonce fields
/// are the bytes `encode_header` writes for that segment.
fn oracle(header: &[u8], total_len: usize, nonce: u64) -> Option<usize> {
    let capacity = total_len.checked_sub(DATA_OFFSET).filter(|&c| c > 0)?;
    let want = encode_header(capacity, nonce);
    let fields = [0..8, CAPACITY_AT..CAPACITY_AT + 8, NONCE_AT..NONCE_AT + 8];
    (header.len() >= HEADER_LEN && fields.iter().all(|f| header[f.clone()] == want[f.clone()]))
        .then_some(capacity)
}

/// Checks one answer of `check_header`: against the oracle, and, on acceptance, that the
/// capacity it returns fits in the segment the header names.
fn check_against_oracle(
    header: &[u8],
    total_len: usize,
    nonce: u64,
) -> std::result::Result<(), TestCaseError> {
    let got = check_header(header, total_len, nonce);
    prop_assert_eq!(got.ok(), oracle(header, total_len, nonce));
    if let Ok(capacity) = got {
        prop_assert!(header.len() >= HEADER_LEN);
        prop_assert!(capacity > 0);
        prop_assert_eq!(capacity.checked_add(DATA_OFFSET), Some(total_len));
    } else if header.len() < HEADER_LEN {
        prop_assert_eq!(got, Err(BadHeader::Short { len: header.len() }));
    }
    Ok(())
}

/// Segment lengths: none or tiny, ordinary, and near the top of the address space.
fn total_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        0..=DATA_OFFSET + 1,
        DATA_OFFSET..DATA_OFFSET + (1 << 20),
        any::<usize>(),
        (usize::MAX - 2 * DATA_OFFSET)..=usize::MAX,
    ]
}

/// A claimed capacity relative to `total_len`: `kind` picks exact, off by `delta`, the
/// whole file (header included), a huge value, or anything.
fn claimed_capacity(total_len: usize, kind: u8, delta: i64, any: u64) -> u64 {
    let exact = total_len.wrapping_sub(DATA_OFFSET) as u64;
    match kind % 6 {
        0 | 1 => exact,
        2 => exact.wrapping_add_signed(delta),
        3 => total_len as u64,
        4 => u64::MAX - (any % 4096),
        _ => any,
    }
}

proptest! {
    #![proptest_config(crate::proptest_config(2048))]

    /// Any bytes, any claimed length, any nonce: no panic, and nothing accepted that the
    /// oracle refuses (random bytes are all but always refused).
    #[test]
    fn header_parser_takes_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        total_len in total_len(),
        nonce in any::<u64>(),
    ) {
        check_against_oracle(&bytes, total_len, nonce)?;
        // The same bytes behind a valid magic: then mostly capacity and nonce decide.
        let mut magic = bytes.clone();
        let n = magic.len().min(MAGIC.len());
        magic[..n].copy_from_slice(&MAGIC[..n]);
        check_against_oracle(&magic, total_len, nonce)?;
    }

    /// Whole headers with arbitrary fields: a corrupted magic, any state, a capacity that
    /// is exact, off by a little, huge or arbitrary, the right or a wrong nonce, any
    /// padding, trailing bytes. Accepted exactly when the oracle says so.
    #[test]
    fn header_parser_checks_every_field(
        total_len in total_len(),
        (cap_kind, delta, cap_any) in (any::<u8>(), -8192i64..8192, any::<u64>()),
        (magic_at, magic_xor) in (0..16usize, any::<u8>()),
        state in any::<u32>(),
        (nonce, nonce_xor) in (any::<u64>(), prop_oneof![Just(0u64), Just(1u64), any::<u64>()]),
        padding in proptest::collection::vec(any::<u8>(), HEADER_LEN - 32),
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut h = encode_header(0, nonce ^ nonce_xor).to_vec();
        // magic_at >= 8: the magic stays intact.
        if let Some(b) = h.get_mut(..MAGIC.len()).and_then(|m| m.get_mut(magic_at)) {
            *b ^= magic_xor;
        }
        h[STATE_AT..STATE_AT + 4].copy_from_slice(&state.to_ne_bytes());
        let capacity = claimed_capacity(total_len, cap_kind, delta, cap_any);
        h[CAPACITY_AT..CAPACITY_AT + 8].copy_from_slice(&capacity.to_ne_bytes());
        h[32..].copy_from_slice(&padding);
        h.extend_from_slice(&tail);
        check_against_oracle(&h, total_len, nonce)?;
        // Any prefix shorter than a whole header is refused, never read past.
        let cut = (cap_any as usize) % HEADER_LEN;
        prop_assert_eq!(check_header(&h[..cut], total_len, nonce), Err(BadHeader::Short { len: cut }));
    }

    /// What a worker writes is what the main process accepts, for any capacity and nonce,
    /// whatever the state word says; one flipped bit in a checked field, another nonce or
    /// another length is refused.
    #[test]
    fn header_round_trip(
        capacity in prop_oneof![1..(1usize << 40), 1..=usize::MAX - DATA_OFFSET],
        nonce in any::<u64>(),
        state in any::<u32>(),
        bit in 0..(24 * 8usize),
        wrong_nonce in 1..=u64::MAX,
        wrong_len in prop_oneof![Just(0usize), 1..DATA_OFFSET + 1, any::<usize>()],
    ) {
        let total_len = capacity + DATA_OFFSET;
        let mut h = encode_header(capacity, nonce);
        prop_assert_eq!(check_header(&h, total_len, nonce), Ok(capacity));
        h[STATE_AT..STATE_AT + 4].copy_from_slice(&state.to_ne_bytes());
        prop_assert_eq!(check_header(&h, total_len, nonce), Ok(capacity));
        prop_assert!(check_header(&h, total_len, nonce ^ wrong_nonce).is_err());
        if wrong_len != total_len {
            prop_assert!(check_header(&h, wrong_len, nonce).is_err());
        }
        // Bits of the magic (bytes 0..8), the capacity and the nonce (16..32).
        let byte = if bit < 64 { bit / 8 } else { 16 + (bit - 64) / 8 };
        h[byte] ^= 1 << (bit % 8);
        prop_assert!(check_header(&h, total_len, nonce).is_err());
    }
}

#[test]
fn header_parser_edge_cases() {
    let h = encode_header(4096, 7);
    assert_eq!(check_header(&h, DATA_OFFSET + 4096, 7), Ok(4096));
    assert_eq!(check_header(&[], usize::MAX, 0), Err(BadHeader::Short { len: 0 }));
    assert_eq!(check_header(&h[..63], DATA_OFFSET + 4096, 7), Err(BadHeader::Short { len: 63 }));
    for total_len in [0, 1, DATA_OFFSET - 1, DATA_OFFSET] {
        assert_eq!(check_header(&h, total_len, 7), Err(BadHeader::NoDataArea { total_len }));
    }
    // A capacity of zero never passes, even when it matches (no data area).
    assert!(check_header(&encode_header(0, 7), DATA_OFFSET, 7).is_err());
    // A header claiming the largest possible segment is accepted only for that length.
    let max = usize::MAX - DATA_OFFSET;
    assert_eq!(check_header(&encode_header(max, 1), usize::MAX, 1), Ok(max));
    assert!(check_header(&encode_header(max, 1), usize::MAX - 1, 1).is_err());
    assert!(matches!(
        check_header(&encode_header(u64::MAX as usize, 1), DATA_OFFSET + 1, 1),
        Err(BadHeader::Mismatch { capacity: u64::MAX, nonce: 1 })
    ));
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn worker_to_slot_round_trip() {
    let pool = Pool::new(&PoolConfig::host(1 << 16, 2)).unwrap();
    let cache = cache_over(&pool);
    let seg = WorkerSegment::create(10_000).unwrap();
    assert_eq!(read_header(&seg.map), encode_header(seg.capacity(), seg.nonce()));
    assert_eq!(check_header(&read_header(&seg.map), seg.total_len(), seg.nonce()), Ok(12_288));
    assert!(seg.try_begin());
    assert!(!seg.try_begin(), "no second batch begins in a segment in flight");
    // SAFETY: test writes inside the segment's data area.
    unsafe { std::ptr::write_bytes(seg.data_ptr(), 0xAB, 10_000) };
    cache.insert((7, 0), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
    let t = pool.checkout(None).unwrap();
    let n = cache.copy_to_slot((7, 0), t, &[CopyRange { src: 0, dst: 64, len: 10_000 }]).unwrap();
    assert_eq!(n, 10_000);
    // SAFETY: reading inside the slot we hold.
    let slot = unsafe { std::slice::from_raw_parts(pool.slot_ptr(t).unwrap(), 10_064) };
    assert!(slot[64..].iter().all(|&b| b == 0xAB));
    cache.hand_back((7, 0)).unwrap();
    assert!(seg.try_begin(), "released by the main process, the worker may reuse it");
    assert!(cache.retire((7, 0)));
    cache.reclaimer().flush();
    assert_eq!(cache.reclaimer().stats().unmapped, 1);
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_background_copy_hands_the_segment_back_and_outlives_the_slots_owner() {
    let pool = Pool::new(&PoolConfig::host(1 << 20, 2)).unwrap();
    let cache = cache_over(&pool);
    let seg = WorkerSegment::create(600_000).unwrap();
    assert!(seg.try_begin());
    // SAFETY: test writes inside the segment's data area.
    unsafe {
        for i in 0..600_000 {
            *seg.data_ptr().add(i) = (i % 251) as u8;
        }
    }
    cache.insert((3, 0), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
    for round in 0..20 {
        let slot = Arc::new(Slot::new(Arc::clone(&pool), pool.checkout(None).unwrap()));
        let hold = slot.hold_owned(&pool).unwrap();
        let range = [CopyRange { src: 0, dst: 8, len: 600_000 }];
        let done = cache.copy_to_slot_then_hand_back((3, 0), hold, &range).unwrap();
        if round % 2 == 1 {
            // The owner dies at once (its batch dropped unread): the slot must stay out
            // of the pool until the copy is over, then come back exactly once.
            slot.finish(|| Ok(None));
            done.wait();
            assert_eq!(pool.stats().slots.free, 2, "round {round}");
            assert!(seg.try_begin(), "the segment was not handed back");
            continue;
        }
        done.wait();
        assert!(done.is_done());
        let ptr = slot.address().unwrap();
        // SAFETY: reading inside the slot the lease holds, after the copy is done.
        let got = unsafe { std::slice::from_raw_parts(ptr.add(8), 600_000) };
        assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "round {round}");
        assert!(seg.try_begin(), "the segment was not handed back");
        slot.release(None).unwrap();
        assert_eq!(pool.stats().slots.free, 2);
    }
    assert_eq!(pool.stats().releases, 20, "a slot given back twice, or not at all");
    // A bad range is refused before anything runs; the hold goes with the error.
    let slot = Arc::new(Slot::new(Arc::clone(&pool), pool.checkout(None).unwrap()));
    let past_end = [CopyRange { src: 0, dst: (1 << 20) - 4, len: 8 }];
    let hold = slot.hold_owned(&pool).unwrap();
    assert!(cache.copy_to_slot_then_hand_back((3, 0), hold, &past_end).is_err());
    let hold = slot.hold_owned(&pool).unwrap();
    assert!(cache.copy_to_slot_then_hand_back((8, 8), hold, &[]).is_err(), "unknown segment");
    slot.release(None).unwrap();
    assert_eq!(pool.stats().slots.free, 2, "a refused copy kept its hold");
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn corrupt_requests_are_errors() {
    let pool = Pool::new(&PoolConfig::host(1 << 16, 1)).unwrap();
    let cache = cache_over(&pool);
    let seg = WorkerSegment::create(4096).unwrap();
    // Claiming a longer file than exists.
    assert!(cache.insert((1, 1), dup(&seg), seg.total_len() + 4096, seg.nonce()).is_err());
    // The right file under the wrong nonce.
    assert!(cache.insert((1, 4), dup(&seg), seg.total_len(), seg.nonce() ^ 1).is_err());
    // A plain memfd without our header.
    let plain = Mapping::memfd("pinpool-test", 3 * 4096).unwrap();
    let fd = plain.fd().unwrap().try_clone_to_owned().unwrap();
    assert!(cache.insert((1, 2), fd, plain.len(), 0).is_err());
    cache.insert((1, 3), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
    let t = pool.checkout(None).unwrap();
    let past_end = [CopyRange { src: 4000, dst: 0, len: 200 }];
    assert!(cache.copy_to_slot((1, 3), t, &past_end).is_err());
    let wrap = [CopyRange { src: usize::MAX - 10, dst: 0, len: 20 }];
    assert!(cache.copy_to_slot((1, 3), t, &wrap).is_err());
    assert!(cache.copy_to_slot((9, 9), t, &[]).is_err(), "unknown segment");
    let tally = cache.reclaimer().tally().clone();
    drop(cache);
    tally.flush();
    let s = tally.stats();
    assert_eq!(s.mapped, s.unmapped);
}
