//! Concurrency stress tests of the pool: many threads, fewer slots than threads.
//!
//! Sizes are chosen for a debug build (what `cargo test` uses) on a 2-core machine: the whole
//! file runs in a few seconds there.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use pinpool::cuda::StreamHandle;
use pinpool::fence::{Fences, ManualFences};
use pinpool::slots::SlotTable;
use pinpool::{Error, Pool, PoolConfig, Result, Ticket};

/// A small xorshift generator: enough randomness for schedules, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Lets the test keep a handle on the fences the pool owns.
struct SharedFences(Arc<ManualFences>);

impl Fences for SharedFences {
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()> {
        self.0.record(index, stream)
    }

    fn is_complete(&self, index: usize) -> Result<bool> {
        self.0.is_complete(index)
    }
}

/// The marker a thread writes at the start of a slot: who holds it and for which round.
fn marker(thread: usize, round: usize) -> u64 {
    ((thread as u64 + 1) << 32) | round as u64
}

/// Fills the slot of `ticket` with `fill`, puts `mark` in its first 8 bytes.
fn stamp(pool: &Pool, ticket: Ticket, fill: u8, mark: u64) {
    let p = pool.slot_ptr(ticket).expect("a live ticket has memory");
    // SAFETY: `p` is the start of the slot that `ticket` holds; the slot is `slot_bytes` long,
    // page-aligned (so 8-byte aligned), and ours until we release the ticket.
    unsafe {
        std::ptr::write_bytes(p, fill, pool.slot_bytes());
        p.cast::<u64>().write_volatile(mark);
    }
}

/// Checks that the slot of `ticket` still holds what [`stamp`] wrote.
fn verify(pool: &Pool, ticket: Ticket, expected: &[u8], mark: u64) {
    let p = pool.slot_ptr(ticket).expect("a live ticket has memory");
    // SAFETY: as in `stamp`: the whole slot is readable and ours while the ticket is live.
    let (got_mark, body) = unsafe {
        (p.cast::<u64>().read_volatile(), std::slice::from_raw_parts(p.add(8), expected.len()))
    };
    assert_eq!(got_mark, mark, "slot {} was written by someone else", ticket.index);
    assert!(body == expected, "slot {} body was overwritten by someone else", ticket.index);
}

/// Records that `me` holds slot `index`; panics if another thread holds it.
fn take_owner(owners: &[AtomicUsize], index: u32, me: usize) {
    if let Err(other) =
        owners[index as usize].compare_exchange(0, me + 1, Ordering::AcqRel, Ordering::Acquire)
    {
        panic!("slot {index} handed to thread {me} while thread {} holds it", other - 1);
    }
}

/// Records that `me` gives slot `index` back; panics if the slot was not `me`'s.
fn drop_owner(owners: &[AtomicUsize], index: u32, me: usize) {
    let prev = owners[index as usize].swap(0, Ordering::AcqRel);
    assert_eq!(prev, me + 1, "slot {index} owner changed while thread {me} held it");
}

#[test]
fn many_threads_few_slots_never_share_a_slot() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 20_000;
    const SLOTS: usize = 3;
    let pool = Pool::new(&PoolConfig::host(4096, SLOTS)).unwrap();
    let owners: Arc<Vec<AtomicUsize>> = Arc::new((0..SLOTS).map(|_| AtomicUsize::new(0)).collect());
    let timeouts = Arc::new(AtomicU64::new(0));
    let stale_refused = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(THREADS));

    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let (pool, owners, timeouts, stale_refused, start) = (
                Arc::clone(&pool),
                Arc::clone(&owners),
                Arc::clone(&timeouts),
                Arc::clone(&stale_refused),
                Arc::clone(&start),
            );
            thread::spawn(move || {
                let mut rng = Rng::new(me as u64 + 1);
                let fill = me as u8 + 1;
                let expected = vec![fill; pool.slot_bytes() - 8];
                let mut last: Option<Ticket> = None;
                start.wait();
                let mut round = 0;
                while round < ROUNDS {
                    let ticket = match rng.below(8) {
                        // Non-blocking: spin until a slot is free.
                        0 => match pool.try_checkout().unwrap() {
                            Some(t) => t,
                            None => {
                                thread::yield_now();
                                continue;
                            }
                        },
                        // A very short timeout: timing out is expected and must not leak.
                        1 => match pool.checkout(Some(Duration::from_micros(50))) {
                            Ok(t) => t,
                            Err(Error::Exhausted { num_slots, .. }) => {
                                assert_eq!(num_slots, SLOTS);
                                timeouts.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            Err(e) => panic!("unexpected checkout error: {e}"),
                        },
                        2 => pool.checkout(None).unwrap(),
                        _ => pool.checkout(Some(Duration::from_secs(30))).unwrap(),
                    };
                    take_owner(&owners, ticket.index, me);
                    let mark = marker(me, round);
                    stamp(&pool, ticket, fill, mark);
                    if rng.below(4) == 0 {
                        // Hold the slot a little longer, so others pile up behind it.
                        thread::yield_now();
                    }
                    // A stale ticket (our previous checkout, possibly of this very slot, or
                    // now held by another thread) must be refused and disturb nobody.
                    if let Some(old) = last {
                        if rng.below(8) == 0 {
                            assert_eq!(
                                pool.release(old, None),
                                Err(Error::SlotReleased { index: old.index as usize })
                            );
                            assert!(pool.slot_ptr(old).is_err());
                            stale_refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    verify(&pool, ticket, &expected, mark);
                    drop_owner(&owners, ticket.index, me);
                    pool.release(ticket, None).unwrap();
                    last = Some(ticket);
                    round += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }

    let stats = pool.stats();
    assert_eq!(stats.slots.free, SLOTS, "{stats:?}");
    assert_eq!(stats.slots.checked_out + stats.slots.fenced, 0, "{stats:?}");
    assert_eq!(stats.checkouts, (THREADS * ROUNDS) as u64, "{stats:?}");
    assert_eq!(stats.releases, stats.checkouts, "{stats:?}");
    assert!(owners.iter().all(|o| o.load(Ordering::Relaxed) == 0));
    // Every slot can still be checked out: nothing was lost from the free list.
    let all: Vec<Ticket> = (0..SLOTS).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
    assert_eq!(pool.try_checkout(), Ok(None));
    for t in all {
        pool.release(t, None).unwrap();
    }
    eprintln!(
        "stress: {} checkouts, {} waits, {} timeouts, {} stale releases refused",
        stats.checkouts,
        stats.waits,
        timeouts.load(Ordering::Relaxed),
        stale_refused.load(Ordering::Relaxed)
    );
}

/// What the test knows of each slot's fence, kept beside the pool's own bookkeeping.
const IDLE: u8 = 0; // Free, or its last fence has completed.
const HELD: u8 = 1; // Checked out by a worker.
const RELEASING: u8 = 2; // The worker is inside `release(ticket, Some(stream))`.
const PENDING: u8 = 3; // Released behind a fence that has not completed.

#[test]
fn fenced_slots_return_only_after_their_fence_completes() {
    const THREADS: usize = 6;
    const ROUNDS: usize = 5_000;
    const SLOTS: usize = 4;
    let manual = Arc::new(ManualFences::new(SLOTS));
    let pool = Pool::with_fences(
        &PoolConfig::host(4096, SLOTS),
        Box::new(SharedFences(Arc::clone(&manual))),
    )
    .unwrap();
    let phase: Arc<Vec<AtomicU8>> = Arc::new((0..SLOTS).map(|_| AtomicU8::new(IDLE)).collect());
    let fenced = Arc::new(AtomicU64::new(0));
    let completed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));

    // The "GPU": completes pending fences at random moments, in random order.
    let gpu = {
        let (manual, phase, completed, done) =
            (Arc::clone(&manual), Arc::clone(&phase), Arc::clone(&completed), Arc::clone(&done));
        thread::spawn(move || {
            let mut rng = Rng::new(0xF00D);
            loop {
                let finishing = done.load(Ordering::Acquire);
                for i in 0..SLOTS {
                    if (finishing || rng.below(3) == 0)
                        && phase[i]
                            .compare_exchange(PENDING, IDLE, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                    {
                        assert!(!manual.is_complete(i).unwrap(), "fence {i} complete too early");
                        manual.complete(i);
                        completed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if finishing {
                    return;
                }
                thread::yield_now();
            }
        })
    };

    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let (pool, manual, phase, fenced) =
                (Arc::clone(&pool), Arc::clone(&manual), Arc::clone(&phase), Arc::clone(&fenced));
            thread::spawn(move || {
                let mut rng = Rng::new(100 + me as u64);
                let fill = 0x40 + me as u8;
                let expected = vec![fill; pool.slot_bytes() - 8];
                for round in 0..ROUNDS {
                    let ticket = pool.checkout(Some(Duration::from_secs(30))).unwrap();
                    let i = ticket.index as usize;
                    let before = phase[i].swap(HELD, Ordering::AcqRel);
                    assert_eq!(
                        before, IDLE,
                        "slot {i} handed out while its last release was in phase {before}"
                    );
                    let mark = marker(me, round);
                    stamp(&pool, ticket, fill, mark);
                    verify(&pool, ticket, &expected, mark);
                    if rng.below(4) == 0 {
                        // An unfenced release: back at once.
                        phase[i].store(IDLE, Ordering::Release);
                        pool.release(ticket, None).unwrap();
                    } else {
                        let stream = 1000 + me;
                        phase[i].store(RELEASING, Ordering::Release);
                        pool.release(ticket, Some(stream)).unwrap();
                        // Nobody completes this fence before we mark it pending, so the slot
                        // cannot have been handed out again: its fence is still ours.
                        assert_eq!(manual.stream_of(i), stream);
                        assert!(!manual.is_complete(i).unwrap());
                        let moved = phase[i].compare_exchange(
                            RELEASING,
                            PENDING,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                        assert_eq!(moved, Ok(RELEASING), "slot {i} reused before its fence");
                        fenced.fetch_add(1, Ordering::Relaxed);
                        // A second release of a fenced ticket is refused.
                        if rng.below(16) == 0 {
                            assert_eq!(
                                pool.release(ticket, Some(stream + 1)),
                                Err(Error::SlotReleased { index: i })
                            );
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Release);
    gpu.join().unwrap();

    assert_eq!(fenced.load(Ordering::Relaxed), completed.load(Ordering::Relaxed));
    // The background thread retires the last completed fences.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.stats().slots.free != SLOTS {
        assert!(Instant::now() < deadline, "slots never came back: {:?}", pool.stats());
        thread::sleep(Duration::from_millis(1));
    }
    let stats = pool.stats();
    assert_eq!(stats.checkouts, (THREADS * ROUNDS) as u64, "{stats:?}");
    assert_eq!(stats.releases, stats.checkouts, "{stats:?}");
    assert_eq!(stats.fence_errors, 0);
    eprintln!(
        "fenced stress: {} checkouts, {} fenced releases, {} waits",
        stats.checkouts,
        fenced.load(Ordering::Relaxed),
        stats.waits
    );
}

#[test]
fn close_wakes_every_blocked_checkout() {
    const WAITERS: usize = 8;
    let pool = Pool::new(&PoolConfig::host(4096, 2)).unwrap();
    let held: Vec<Ticket> = (0..2).map(|_| pool.checkout(None).unwrap()).collect();
    let entered = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|k| {
            let (pool, entered) = (Arc::clone(&pool), Arc::clone(&entered));
            thread::spawn(move || {
                entered.fetch_add(1, Ordering::SeqCst);
                // Half wait forever, half with a timeout far longer than the test.
                let timeout = if k % 2 == 0 { None } else { Some(Duration::from_secs(60)) };
                let t0 = Instant::now();
                let got = pool.checkout(timeout);
                (got, t0.elapsed())
            })
        })
        .collect();
    while entered.load(Ordering::SeqCst) < WAITERS {
        thread::yield_now();
    }
    // Let them get into their waits (they would also be fine if they had not yet).
    thread::sleep(Duration::from_millis(50));
    let closed_at = Instant::now();
    pool.close();
    for w in waiters {
        let (got, _) = w.join().unwrap();
        assert_eq!(got, Err(Error::Closed));
    }
    assert!(
        closed_at.elapsed() < Duration::from_secs(5),
        "waiters took {:?} to notice the close",
        closed_at.elapsed()
    );
    // Slots still out can be released after the close; no checkout succeeds any more.
    for t in held {
        pool.release(t, None).unwrap();
    }
    assert_eq!(pool.try_checkout(), Err(Error::Closed));
    assert_eq!(pool.checkout(Some(Duration::from_secs(1))), Err(Error::Closed));
    let stats = pool.stats();
    assert_eq!(stats.slots.free, 2);
    assert_eq!(stats.checkouts, stats.releases);
}

#[test]
fn close_wakes_every_table_waiter() {
    const WAITERS: usize = 8;
    let table = Arc::new(SlotTable::new(1).unwrap());
    let _held = table.try_checkout().unwrap();
    let entered = Arc::new(Barrier::new(WAITERS + 1));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (table, entered) = (Arc::clone(&table), Arc::clone(&entered));
            thread::spawn(move || {
                entered.wait();
                let t0 = Instant::now();
                // Far longer than the test may take: only the close can end it early.
                table.wait(Duration::from_secs(60));
                t0.elapsed()
            })
        })
        .collect();
    entered.wait();
    thread::sleep(Duration::from_millis(50));
    table.close();
    for w in waiters {
        let slept = w.join().unwrap();
        assert!(slept < Duration::from_secs(10), "a waiter slept {slept:?} through the close");
    }
    assert!(table.is_closed());
}

#[test]
fn released_slot_wakes_a_blocked_checkout() {
    // One slot, one waiter blocked without timeout: each release must hand the slot over.
    const ROUNDS: usize = 200;
    let pool = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
    let passes = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..2)
        .map(|me| {
            let (pool, passes) = (Arc::clone(&pool), Arc::clone(&passes));
            thread::spawn(move || {
                for _ in 0..ROUNDS {
                    let t = pool.checkout(Some(Duration::from_secs(30))).unwrap();
                    stamp(&pool, t, me as u8, marker(me, 0));
                    passes.fetch_add(1, Ordering::Relaxed);
                    pool.release(t, None).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(passes.load(Ordering::Relaxed), 2 * ROUNDS);
    assert_eq!(pool.stats().slots.free, 1);
}
