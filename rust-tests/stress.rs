//! Concurrency stress tests of the pool: many threads, fewer slots than threads.
//!
//! Sizes are chosen for a debug build (what `cargo test` uses) on a 2-core machine: the whole
//! file runs in a few seconds there.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use pinpool::allocation::slots::SlotTable;
use pinpool::system::cuda::StreamHandle;
use pinpool::transfer::fence::{FenceId, Fences, ManualFences};
use pinpool::{Error, Pool, PoolConfig, Result, SlotId};

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

/// The marker a thread writes at the start of a slot: who holds it and for which round.
fn marker(thread: usize, round: usize) -> u64 {
    ((thread as u64 + 1) << 32) | round as u64
}

/// Fills the slot `slot` with `fill`, puts `mark` in its first 8 bytes.
fn stamp(pool: &Pool, slot: SlotId, fill: u8, mark: u64) {
    let p = pool.slot_ptr(slot).expect("a live checkout has memory");
    // SAFETY: `p` is the start of the slot `slot`; the slot is `slot_bytes` long,
    // page-aligned (so 8-byte aligned), and ours until we release the checkout.
    unsafe {
        std::ptr::write_bytes(p, fill, pool.slot_bytes());
        p.cast::<u64>().write_volatile(mark);
    }
}

/// Checks that the slot `slot` still holds what [`stamp`] wrote.
fn verify(pool: &Pool, slot: SlotId, expected: &[u8], mark: u64) {
    let p = pool.slot_ptr(slot).expect("a live checkout has memory");
    // SAFETY: as in `stamp`: the whole slot is readable and ours while the checkout is live.
    let (got_mark, body) = unsafe {
        (p.cast::<u64>().read_volatile(), std::slice::from_raw_parts(p.add(8), expected.len()))
    };
    assert_eq!(got_mark, mark, "slot {} was written by someone else", slot.index);
    assert!(body == expected, "slot {} body was overwritten by someone else", slot.index);
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
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
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
                let mut last: Option<SlotId> = None;
                start.wait();
                let mut round = 0;
                while round < ROUNDS {
                    let slot = match rng.below(8) {
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
                            Err(Error::Exhausted { held, .. }) => {
                                assert_eq!(held.entries, SLOTS);
                                timeouts.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            Err(e) => panic!("unexpected checkout error: {e}"),
                        },
                        2 => pool.checkout(None).unwrap(),
                        _ => pool.checkout(Some(Duration::from_secs(30))).unwrap(),
                    };
                    take_owner(&owners, slot.index, me);
                    let mark = marker(me, round);
                    stamp(&pool, slot, fill, mark);
                    if rng.below(4) == 0 {
                        // FlushBlocker the slot a little longer, so others pile up behind it.
                        thread::yield_now();
                    }
                    // A stale checkout (our previous checkout, possibly of this very slot, or
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
                    verify(&pool, slot, &expected, mark);
                    drop_owner(&owners, slot.index, me);
                    pool.release(slot, None).unwrap();
                    last = Some(slot);
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
    let all: Vec<SlotId> = (0..SLOTS).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
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

/// [`ManualFences`] that also index every fence they record by stream, so the test can ask
/// "which fences were recorded on stream `s` between these two moments" cheaply.
struct TracedFences {
    manual: Arc<ManualFences>,
    trace: Mutex<Trace>,
}

#[derive(Default)]
struct Trace {
    /// Fences recorded so far (the next fence's id).
    count: usize,
    /// The ids of the fences recorded on each stream, in order.
    by_stream: HashMap<StreamHandle, Vec<FenceId>>,
}

impl TracedFences {
    fn new(manual: &Arc<ManualFences>) -> Self {
        TracedFences { manual: Arc::clone(manual), trace: Mutex::new(Trace::default()) }
    }

    /// How many fences were recorded so far: every fence recorded from now on has an id at
    /// least this.
    fn recorded(&self) -> usize {
        self.trace.lock().unwrap().count
    }

    /// The fences recorded on `stream` with an id in `from..to`, in order.
    fn on_stream(&self, stream: StreamHandle, from: FenceId, to: FenceId) -> Vec<FenceId> {
        let trace = self.trace.lock().unwrap();
        let ids = trace.by_stream.get(&stream).map_or(&[][..], Vec::as_slice);
        let (lo, hi) = (ids.partition_point(|&id| id < from), ids.partition_point(|&id| id < to));
        ids[lo..hi.max(lo)].to_vec()
    }

    /// The last fence recorded on `stream`, if any.
    fn last_on(&self, stream: StreamHandle) -> Option<FenceId> {
        self.trace.lock().unwrap().by_stream.get(&stream).and_then(|ids| ids.last().copied())
    }

    fn is_done(&self, id: FenceId) -> bool {
        self.manual.is_complete(id).unwrap()
    }
}

impl Fences for TracedFences {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        let mut trace = self.trace.lock().unwrap();
        let id = self.manual.record(stream)?;
        assert_eq!(id, trace.count, "fence ids are handed out in order");
        trace.count += 1;
        trace.by_stream.entry(stream).or_default().push(id);
        Ok(id)
    }

    fn is_complete(&self, id: FenceId) -> Result<bool> {
        self.manual.is_complete(id)
    }

    fn recycle(&self, id: FenceId) {
        self.manual.recycle(id)
    }

    fn wait_all(&self) -> Result<()> {
        self.manual.wait_all()
    }
}

/// The last fenced release of a slot, as the releasing worker saw it.
#[derive(Debug, Clone, Copy)]
struct FencedRelease {
    slot: SlotId,
    stream: StreamHandle,
    /// Fences recorded before the release began: the fence covering it has an id at least this.
    from: FenceId,
    /// Set once the worker has run a retire of its own after the release: the fence covering
    /// the release is then recorded, with an id below this.
    to: Option<FenceId>,
    /// `wait_all` calls before the release began.
    waits: u64,
}

/// Checks, when slot `index` is handed out again, that its last fenced release is over: the
/// fence recorded on its stream after it has completed (or the device was waited for since).
///
/// Each worker releases on streams of its own, and nobody else does. So for a release on `s`
/// the fences on `s` with an id in `from..` cover it or later releases (and at most one
/// fence, recorded by a retire that took the queue just before the release, covers only
/// earlier ones). With `to` known the check is exact: the worker released nothing else on `s`
/// between the release and its retire, so the covering fence is the *last* one on `s` in
/// `from..to`. Without `to`, it is at least the first one on `s` from `from` on; fences on a
/// stream complete in order, so that one must have completed at least.
fn assert_release_over(fences: &TracedFences, index: u32, r: &FencedRelease) {
    if fences.manual.waits() > r.waits {
        return; // The device was waited for after the release began: every fence completed.
    }
    let ids = fences.on_stream(r.stream, r.from, r.to.unwrap_or(FenceId::MAX));
    let covered = match r.to {
        Some(_) => ids.last().is_some_and(|&id| fences.is_done(id)),
        None => ids.first().is_some_and(|&id| fences.is_done(id)),
    };
    assert!(
        covered,
        "slot {index} handed out before the fence after its release on stream {} completed \
         ({r:?}; fences on that stream since: {:?})",
        r.stream,
        ids.iter().map(|&id| (id, fences.is_done(id))).collect::<Vec<_>>()
    );
}

/// Streams each worker of the fenced stress test releases on (its own, shared with nobody).
const STREAMS_PER_WORKER: usize = 3;

fn worker_stream(me: usize, k: usize) -> StreamHandle {
    1000 + me * 10 + k
}

/// Workers check out, stamp and release slots behind fences on their own streams; a "GPU"
/// thread completes random streams (and now and then everything). Every checkout checks that
/// the slot's last fenced release is over (see [`assert_release_over`]). With `failing`, the
/// GPU thread also makes fence records fail for a moment now and then: those slots come back
/// only after a device wait.
fn fenced_stress(threads: usize, rounds: usize, slots: usize, failing: bool) {
    let manual = Arc::new(ManualFences::new());
    let fences = Arc::new(TracedFences::new(&manual));
    let pool =
        Pool::with_fences(&PoolConfig::host(4096, slots), Box::new(Arc::clone(&fences))).unwrap();
    let owners: Arc<Vec<AtomicUsize>> = Arc::new((0..slots).map(|_| AtomicUsize::new(0)).collect());
    let last: Arc<Vec<Mutex<Option<FencedRelease>>>> =
        Arc::new((0..slots).map(|_| Mutex::new(None)).collect());
    let fenced = Arc::new(AtomicU64::new(0));
    let pinned = Arc::new(AtomicU64::new(0));
    let checked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));

    // The "GPU": at random moments, finishes the work queued so far on random streams (and
    // now and then on all of them).
    let gpu = {
        let (manual, fences, done) = (Arc::clone(&manual), Arc::clone(&fences), Arc::clone(&done));
        thread::spawn(move || {
            let mut rng = Rng::new(0xF00D);
            let streams: Vec<StreamHandle> = (0..threads)
                .flat_map(|me| (0..STREAMS_PER_WORKER).map(move |k| worker_stream(me, k)))
                .collect();
            // Per stream: fences below this id are known complete (skips needless scans).
            let mut complete_below: HashMap<StreamHandle, FenceId> = HashMap::new();
            let mut completions = 0u64;
            // With `failing`, records fail from the start until one has failed (and a device
            // wait followed), so that path runs however the threads are scheduled (a single
            // yield's window can miss every record on a loaded machine); then for a moment
            // now and then.
            let mut first_failure = failing;
            manual.fail_records(first_failure);
            while !done.load(Ordering::Acquire) {
                if first_failure && manual.waits() > 0 {
                    manual.fail_records(false);
                    first_failure = false;
                }
                match rng.below(64) {
                    0 => manual.complete_all(),
                    1 if failing && !first_failure => {
                        manual.fail_records(true);
                        thread::yield_now();
                        manual.fail_records(false);
                    }
                    _ => {
                        for &s in &streams {
                            let Some(last) = fences.last_on(s) else { continue };
                            let below = complete_below.entry(s).or_default();
                            if last >= *below && rng.below(3) == 0 {
                                manual.complete_stream(s);
                                *below = last + 1;
                                completions += 1;
                            }
                        }
                    }
                }
                thread::yield_now();
            }
            manual.fail_records(false);
            manual.complete_all();
            completions
        })
    };

    let workers: Vec<_> = (0..threads)
        .map(|me| {
            let (pool, fences, owners, last) =
                (Arc::clone(&pool), Arc::clone(&fences), Arc::clone(&owners), Arc::clone(&last));
            let (fenced, pinned, checked) =
                (Arc::clone(&fenced), Arc::clone(&pinned), Arc::clone(&checked));
            thread::spawn(move || {
                let mut rng = Rng::new(100 + me as u64);
                let fill = 0x40 + me as u8;
                let expected = vec![fill; pool.slot_bytes() - 8];
                for round in 0..rounds {
                    let slot = pool.checkout(Some(Duration::from_secs(30))).unwrap();
                    let i = slot.index;
                    take_owner(&owners, i, me);
                    if let Some(r) = last[i as usize].lock().unwrap().take() {
                        assert_release_over(&fences, i, &r);
                        checked.fetch_add(1, Ordering::Relaxed);
                    }
                    let mark = marker(me, round);
                    stamp(&pool, slot, fill, mark);
                    verify(&pool, slot, &expected, mark);
                    drop_owner(&owners, i, me);
                    if rng.below(4) == 0 {
                        // An unfenced release: back at once.
                        pool.release(slot, None).unwrap();
                        continue;
                    }
                    let stream = worker_stream(me, rng.below(STREAMS_PER_WORKER as u64) as usize);
                    let release = FencedRelease {
                        slot,
                        stream,
                        from: fences.recorded(),
                        to: None,
                        waits: fences.manual.waits(),
                    };
                    *last[i as usize].lock().unwrap() = Some(release);
                    pool.release(slot, Some(stream)).unwrap();
                    fenced.fetch_add(1, Ordering::Relaxed);
                    if rng.below(2) == 0 {
                        // A retire that began after the release has recorded its fence, or
                        // failed to: then the slot comes back only after a device wait. That
                        // wait runs outside the tracker's lock, on the thread whose retire
                        // took the release, so it may start only after our retire returned
                        // (seen under ThreadSanitizer): wait for it.
                        pool.retire_fences();
                        let to = fences.recorded();
                        if fences.on_stream(stream, release.from, to).is_empty() {
                            assert!(
                                failing,
                                "a retire left a release on stream {stream} without a fence"
                            );
                            let deadline = Instant::now() + Duration::from_secs(10);
                            while fences.manual.waits() <= release.waits {
                                assert!(
                                    Instant::now() < deadline,
                                    "a release on stream {stream} got no fence and no device wait"
                                );
                                thread::yield_now();
                            }
                        }
                        let mut kept = last[i as usize].lock().unwrap();
                        // Unless the slot came back and was checked out again meanwhile.
                        if let Some(r) = kept.as_mut().filter(|r| r.slot == slot) {
                            r.to = Some(to);
                            pinned.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // A second release of a fenced checkout is refused.
                    if rng.below(16) == 0 {
                        assert_eq!(
                            pool.release(slot, Some(stream + 1)),
                            Err(Error::SlotReleased { index: i as usize })
                        );
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Release);
    let completions = gpu.join().unwrap();

    // The background thread records and retires the last fences.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.stats().slots.free != slots {
        assert!(Instant::now() < deadline, "slots never came back: {:?}", pool.stats());
        manual.complete_all();
        thread::sleep(Duration::from_millis(1));
    }
    let stats = pool.stats();
    let fenced = fenced.load(Ordering::Relaxed);
    let recorded = manual.recorded();
    assert_eq!(stats.checkouts, (threads * rounds) as u64, "{stats:?}");
    assert_eq!(stats.releases, stats.checkouts, "{stats:?}");
    assert!(owners.iter().all(|o| o.load(Ordering::Relaxed) == 0));
    assert!(recorded.iter().all(|f| f.1), "a fence never completed");
    // One fence per stream per retire, each for at least one release.
    assert!(recorded.len() as u64 <= fenced, "{} fences for {fenced} releases", recorded.len());
    if failing {
        // Every failed record counts; the failures of one retire share one device wait.
        assert!(manual.waits() > 0, "no failed record waited for the device");
        assert!(
            stats.fence_errors >= manual.waits(),
            "{} errors, {} waits",
            stats.fence_errors,
            manual.waits()
        );
    } else {
        assert_eq!(stats.fence_errors, 0);
        assert_eq!(manual.waits(), 0);
    }
    eprintln!(
        "fenced stress{}: {} checkouts ({} waits), {} fenced releases ({} pinned), {} fences, \
         {} checked at slot, {} failed records, {} stream completions",
        if failing { " with failing records" } else { "" },
        stats.checkouts,
        stats.waits,
        fenced,
        pinned.load(Ordering::Relaxed),
        recorded.len(),
        checked.load(Ordering::Relaxed),
        stats.fence_errors,
        completions
    );
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn fenced_slots_return_only_after_their_fence_completes() {
    fenced_stress(6, 5_000, 4, false);
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn fenced_slots_whose_fence_cannot_be_recorded_return_after_a_device_wait() {
    fenced_stress(4, 2_000, 3, true);
}

/// Fences that can never be recorded, on a device whose work takes a while to finish: every
/// fenced release ends in a long device wait.
struct BusyDevice;

impl Fences for BusyDevice {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        Err(Error::Invalid(format!("cannot record on stream {stream}")))
    }

    fn is_complete(&self, _id: FenceId) -> Result<bool> {
        Ok(true)
    }

    fn recycle(&self, _id: FenceId) {}

    fn wait_all(&self) -> Result<()> {
        thread::sleep(Duration::from_millis(500));
        Ok(())
    }
}

/// The tracker waits for the device while holding the lock every retire takes, and a checkout
/// that finds no free slot retires: so `try_checkout` blocks, and `checkout` overruns its
/// timeout, for as long as the device takes to finish its work.
#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn checkouts_do_not_wait_for_a_device_wait() {
    let pool = Pool::with_fences(&PoolConfig::host(4096, 2), Box::new(BusyDevice)).unwrap();
    let a = pool.checkout(None).unwrap();
    let _b = pool.checkout(None).unwrap();
    // The fence thread takes the release, fails to record its fence, waits for the device.
    pool.release(a, Some(7)).unwrap();
    thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let got = pool.checkout(Some(Duration::from_millis(20)));
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(250), "checkout(20 ms) took {took:?}: {got:?}");
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn close_wakes_every_blocked_checkout() {
    const WAITERS: usize = 8;
    let pool = Pool::new(&PoolConfig::host(4096, 2)).unwrap();
    let held: Vec<SlotId> = (0..2).map(|_| pool.checkout(None).unwrap()).collect();
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

/// The slot table alone (no arena, so Miri can run it too, with its data-race detector and
/// weak-memory emulation): threads take slots with `try_checkout`, wait when none is free,
/// and release them; no slot is ever held by two threads, and none is lost.
#[test]
fn slot_table_threads_never_share_a_slot() {
    let (threads, rounds) = if cfg!(miri) { (3, 100) } else { (6, 20_000) };
    const SLOTS: usize = 2;
    let table = Arc::new(SlotTable::new(SLOTS).unwrap());
    let owners: Arc<Vec<AtomicUsize>> = Arc::new((0..SLOTS).map(|_| AtomicUsize::new(0)).collect());
    let workers: Vec<_> = (0..threads)
        .map(|me| {
            let (table, owners) = (Arc::clone(&table), Arc::clone(&owners));
            thread::spawn(move || {
                let mut rng = Rng::new(7 + me as u64);
                let mut done = 0;
                while done < rounds {
                    let seen = table.epoch();
                    let Some(t) = table.try_checkout() else {
                        table.wait(seen, Duration::from_millis(10));
                        continue;
                    };
                    take_owner(&owners, t.index, me);
                    if rng.below(4) == 0 {
                        thread::yield_now();
                    }
                    drop_owner(&owners, t.index, me);
                    table.release(t, false).unwrap();
                    assert!(table.release(t, false).is_err(), "a second release is refused");
                    done += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(table.counts().free, SLOTS);
    let all: Vec<SlotId> = (0..SLOTS).map(|_| table.try_checkout().unwrap()).collect();
    assert!(table.try_checkout().is_none());
    assert_eq!(all.len(), SLOTS);
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
                table.wait(table.epoch(), Duration::from_secs(60));
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
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
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
