//! Slots of any size in one pool: random sizes, random hold and release orders, fences that
//! complete late, checkouts that prefer where earlier slots were, and threads.
//!
//! Each slot is filled with a pattern of its own when it is checked out, and the pattern is
//! verified when it is released and again when its fence completes: two live slots that
//! overlapped, or bytes reused before their fence completed, would show as a wrong byte. At
//! the end every byte must be free again and every part usable whole.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use pinpool::allocation::slots::Preference;
use pinpool::memory::shm::page_size;
use pinpool::system::cuda::StreamHandle;
use pinpool::transfer::fence::ManualFences;
use pinpool::{Pool, PoolConfig, SlotId};
use proptest::prelude::*;

/// A slot the test holds: its checkout, where it is, and the byte it was filled with.
#[derive(Debug, Clone, Copy)]
struct Held {
    slot: SlotId,
    ptr: usize,
    len: usize,
    fill: u8,
}

fn fill(pool: &Pool, slot: SlotId, fill: u8) -> Held {
    let ptr = pool.slot_ptr(slot).unwrap();
    let len = pool.slot_len(slot).unwrap();
    // SAFETY: the slot is checked out to this test, `len` bytes long, inside the live arena.
    unsafe { std::ptr::write_bytes(ptr, fill, len) };
    Held { slot, ptr: ptr as usize, len, fill }
}

fn intact(h: &Held) -> bool {
    // SAFETY: the arena outlives the test's pool reference; the bytes are only read.
    let bytes = unsafe { std::slice::from_raw_parts(h.ptr as *const u8, h.len) };
    bytes.iter().all(|&b| b == h.fill)
}

#[derive(Debug, Clone)]
enum Op {
    /// Check out a slot of this many bytes.
    Take(usize),
    /// Check out a slot of this many bytes, preferring where slots released before were (by
    /// their positions in the list of released ones) and one arbitrary offset.
    TakePreferring(usize, Vec<usize>, usize),
    /// Release the held slot at this position, fenced on a stream (or not).
    Release(usize, Option<StreamHandle>),
    /// The GPU reaches every fence recorded on this stream.
    Complete(StreamHandle),
    /// Record queued fences and free what completed.
    Retire,
}

fn op(largest: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop_oneof![
            4 => 1usize..=4 * page_size(),
            2 => 1usize..=largest / 3,
            1 => 1usize..=largest,
        ]
        .prop_map(Op::Take),
        3 => (1usize..=largest, proptest::collection::vec(any::<usize>(), 0..4), any::<usize>())
            .prop_map(|(n, picks, any)| Op::TakePreferring(n, picks, any)),
        3 => (any::<usize>(), prop_oneof![Just(None), (0usize..3).prop_map(Some)])
            .prop_map(|(i, s)| Op::Release(i, s)),
        2 => (0usize..3).prop_map(Op::Complete),
        2 => Just(Op::Retire),
    ]
}

const PARTS: usize = 3;
const SLOT: usize = 16 << 12;

fn pool_with_manual_fences() -> (Arc<Pool>, Arc<ManualFences>) {
    let fences = Arc::new(ManualFences::new());
    let config = PoolConfig { arena_bytes: Some(PARTS * SLOT), ..PoolConfig::host(SLOT, 64) };
    let pool = Pool::with_fences(&config, Box::new(Arc::clone(&fences))).unwrap();
    (pool, fences)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn slots_of_random_sizes_never_overlap_nor_outrun_their_fences(
        ops in proptest::collection::vec(op(SLOT), 1..160),
    ) {
        let (pool, fences) = pool_with_manual_fences();
        let mut held: Vec<Held> = Vec::new();
        // Fenced slots, with whether their stream has completed since their release.
        let mut fenced: Vec<(Held, StreamHandle, bool)> = Vec::new();
        let mut next_fill = 1u8;
        // Arena offsets of the slots released so far.
        let mut released: Vec<usize> = Vec::new();
        for op in ops {
            match op {
                Op::Take(n) | Op::TakePreferring(n, ..) => {
                    let before = pool.bytes();
                    let prefer: Vec<usize> = match &op {
                        Op::TakePreferring(_, picks, any) => picks
                            .iter()
                            .filter(|_| !released.is_empty())
                            .map(|i| released[i % released.len()])
                            .chain([*any])
                            .collect(),
                        _ => Vec::new(),
                    };
                    match pool.try_checkout_bytes_preferring(n, 0, &prefer, Preference::Prefer).unwrap() {
                        Some(t) => {
                            next_fill = next_fill.wrapping_add(1).max(1);
                            let h = fill(&pool, t, next_fill);
                            prop_assert_eq!(h.len, n.div_ceil(page_size()) * page_size());
                            prop_assert_eq!(h.ptr % page_size(), 0);
                            held.push(h);
                        }
                        None => prop_assert!(
                            before.largest_free < n || pool.bytes().largest_free < n,
                            "refused {} bytes with a free range of {}", n, before.largest_free
                        ),
                    }
                }
                Op::Release(i, stream) if !held.is_empty() => {
                    let h = held.swap_remove(i % held.len());
                    prop_assert!(intact(&h), "slot {:?} overwritten while held", h.slot);
                    released.push(pool.extent(h.slot).unwrap().0);
                    pool.release(h.slot, stream).unwrap();
                    prop_assert!(pool.release(h.slot, stream).is_err());
                    if let Some(s) = stream {
                        fenced.push((h, s, false));
                    }
                }
                Op::Release(..) => {}
                Op::Complete(s) => {
                    fences.complete_stream(s);
                    for f in fenced.iter_mut().filter(|f| f.1 == s) {
                        f.2 = true;
                    }
                }
                Op::Retire => {
                    pool.retire_fences();
                }
            }
            // (The pool's fence thread retires fences too, at any moment.) A fenced slot's
            // bytes are untouched while it is fenced, whatever was checked out since; and it
            // is freed only after its stream completed.
            for (h, s, completed) in std::mem::take(&mut fenced) {
                if pool.is_fenced(h.slot) {
                    prop_assert!(intact(&h), "fenced slot {:?} reused early", h.slot);
                    fenced.push((h, s, completed));
                } else {
                    prop_assert!(completed, "slot {:?} freed before its fence", h.slot);
                }
            }
            for h in &held {
                prop_assert!(intact(h), "slot {:?} overwritten", h.slot);
            }
        }
        // The end: everything released, every fence completed; every byte comes back, and
        // each part can be taken whole.
        for h in held.drain(..) {
            prop_assert!(intact(&h));
            pool.release(h.slot, None).unwrap();
        }
        pool.retire_fences(); // (records a fence for every release still queued)
        fences.complete_all();
        pool.retire_fences();
        let b = pool.bytes();
        prop_assert_eq!((b.free, b.checked_out, b.fenced), (PARTS * SLOT, 0, 0));
        let whole: Vec<SlotId> = (0..PARTS)
            .map(|_| pool.try_checkout_bytes(SLOT, 0).unwrap().expect("a part's worth"))
            .collect();
        prop_assert!(pool.try_checkout_bytes(1, 0).unwrap().is_none());
        for t in whole {
            pool.release(t, None).unwrap();
        }
    }
}

/// A size too large for any part is an error at once, not a wait.
#[test]
fn a_slot_larger_than_any_part_is_refused_at_once() {
    let (pool, _) = pool_with_manual_fences();
    let largest = pool.largest_slot();
    assert!(largest >= SLOT, "a part is shorter than the slot size");
    let err = pool.checkout_bytes(largest + 1, None).unwrap_err();
    assert!(
        matches!(err, pinpool::Error::BatchTooLarge { needed, slot_bytes }
            if needed == largest + 1 && slot_bytes == largest),
        "{err}"
    );
}

/// A slot the consumer keeps does not block the rest: the others flow around it.
#[test]
fn a_slot_kept_for_long_does_not_block_the_others() {
    let (pool, _) = pool_with_manual_fences();
    let kept = pool.try_checkout_bytes(3 * page_size(), 0).unwrap().unwrap();
    for round in 0..1000 {
        let n = 1 + (round * 7919) % (2 * SLOT / 3);
        let t = pool
            .checkout_bytes(n, Some(Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("round {round}: {n} bytes: {e}"));
        pool.release(t, None).unwrap();
    }
    assert!(pool.slot_ptr(kept).is_ok());
    pool.release(kept, None).unwrap();
}

/// Eight threads take slots of random sizes (waiting when there is no room), fill them, check
/// them and give them back: no byte is ever shared, none is lost.
#[test]
fn threads_take_slots_of_random_sizes_without_sharing_a_byte() {
    const THREADS: usize = 8;
    let rounds = if cfg!(miri) { 20 } else { 3000 };
    let config = PoolConfig { arena_bytes: Some(4 * SLOT), ..PoolConfig::host(SLOT, 16) };
    let pool = Pool::new(&config).unwrap();
    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ me as u64;
                for round in 0..rounds {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let n = 1 + (x as usize) % (SLOT / 2);
                    let t = pool.checkout_bytes(n, Some(Duration::from_secs(30))).unwrap();
                    let h = fill(&pool, t, (me * 31 + round) as u8 | 1);
                    if round % 5 == 0 {
                        thread::yield_now();
                    }
                    assert!(intact(&h), "thread {me}: a slot was overwritten");
                    pool.release(t, None).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let b = pool.bytes();
    let parts = pool.arena().part_starts().len() + 1;
    assert_eq!((b.free, b.checked_out, b.holes), (4 * SLOT, 0, parts));
}
