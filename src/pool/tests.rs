//! Unit tests of `pool`, kept apart from the code they test.

use super::*;
use std::time::{Duration, Instant};

use crate::allocation::slots::Preference;
use crate::memory::shm::page_size;

/// Stops `pool`'s fence thread and waits until it has ended (its weak reference gone), so
/// that only the test retires fences: otherwise that thread may record or retire a fence
/// between the test's steps.
fn without_fence_thread(pool: &Arc<Pool>) {
    pool.stopping.store(true, Ordering::Release);
    if let Some(t) = pool.retirer.get() {
        t.unpark();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Arc::weak_count(pool) > 0 {
        assert!(Instant::now() < deadline, "the fence thread did not end");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn slots_are_page_aligned_and_disjoint() {
    let pool = Pool::new(&PoolConfig::host(1000, 3)).unwrap();
    assert_eq!(pool.slot_bytes() % page_size(), 0);
    let a = pool.checkout(None).unwrap();
    let b = pool.checkout(None).unwrap();
    let (pa, pb) = (pool.slot_ptr(a).unwrap() as usize, pool.slot_ptr(b).unwrap() as usize);
    assert_eq!(pa % page_size(), 0);
    assert!(pa.abs_diff(pb) >= pool.slot_bytes());
    pool.release(a, None).unwrap();
    assert!(pool.slot_ptr(a).is_err(), "a released checkout has no memory");
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn checkout_times_out_with_exhausted() {
    let pool = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
    let _held = pool.checkout(None).unwrap();
    let t0 = Instant::now();
    let err = pool.checkout(Some(Duration::from_millis(30))).unwrap_err();
    assert!(matches!(err, Error::Exhausted { held: Held { checked_out: 1, .. }, .. }), "{err}");
    assert!(err.to_string().contains("1 slots checked out (4096 bytes)"), "{err}");
    assert!(t0.elapsed() >= Duration::from_millis(30));
    assert_eq!(pool.stats().waits, 1);
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_released_extent_is_handed_out_again_once_its_fence_is_retired() {
    let fences = Arc::new(crate::transfer::fence::ManualFences::new());
    let slot = 4 * page_size();
    let config = PoolConfig::host(slot, 4);
    let pool = Pool::with_fences(&config, Box::new(Arc::clone(&fences))).unwrap();
    without_fence_thread(&pool);
    let held: Vec<SlotId> = (0..4).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
    let at = |t| pool.extent(t).unwrap().0;
    let (first, wanted) = (at(held[0]), at(held[2]));
    assert_ne!(first, wanted);
    pool.release(held[0], None).unwrap();
    pool.release(held[2], Some(7)).unwrap();
    // Fenced: not handed out, even when asked for; first fit instead.
    let other = pool
        .try_checkout_bytes_preferring(slot, 0, &[wanted], Preference::Prefer)
        .unwrap()
        .unwrap();
    assert_eq!(at(other), first);
    pool.release(other, None).unwrap();
    // Once its fence completed and was retired, exactly that extent, though first fit
    // would give the lower one.
    pool.retire_fences(); // (records the queued fence)
    fences.complete_all();
    pool.retire_fences();
    let again = pool
        .try_checkout_bytes_preferring(slot, 0, &[wanted], Preference::Prefer)
        .unwrap()
        .unwrap();
    assert_eq!(pool.extent(again), Ok((wanted, slot)));
    assert_eq!(pool.extent(pool.try_checkout_bytes(slot, 0).unwrap().unwrap()).unwrap().0, first);
    // The arena full but for a fenced slot whose fence has completed: the checkout
    // retires it and takes it, where it was.
    pool.release(again, Some(7)).unwrap();
    assert!(pool.is_fenced(again));
    pool.retire_fences();
    fences.complete_all();
    let back = pool.try_checkout_bytes_preferring(slot, 0, &[wanted], Preference::Prefer).unwrap();
    assert_eq!(back.map(|t| pool.extent(t)), Some(Ok((wanted, slot))));
    // Every check of a checkout applies: too large, closed.
    let too_large =
        pool.try_checkout_bytes_preferring(pool.largest_slot() + 1, 0, &[0], Preference::Prefer);
    assert!(matches!(too_large, Err(Error::BatchTooLarge { .. })), "{too_large:?}");
    pool.close();
    assert_eq!(
        pool.try_checkout_bytes_preferring(slot, 0, &[wanted], Preference::Prefer),
        Err(Error::Closed)
    );
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_free_preferred_extent_is_taken_without_retiring_fences() {
    let fences = Arc::new(crate::transfer::fence::ManualFences::new());
    let slot = 4 * page_size();
    let pool =
        Pool::with_fences(&PoolConfig::host(slot, 4), Box::new(Arc::clone(&fences))).unwrap();
    without_fence_thread(&pool);
    let held: Vec<SlotId> = (0..4).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
    let at = |t| pool.extent(t).unwrap().0;
    let (fenced, free) = (at(held[2]), at(held[1]));
    pool.release(held[2], Some(7)).unwrap();
    pool.release(held[1], None).unwrap();
    // The fenced one is preferred first, but the free one is taken, and no fence is
    // recorded or queried on the way (the driver is not called on the asker's thread).
    let got = pool
        .try_checkout_bytes_preferring(slot, 0, &[fenced, free], Preference::OnlyThere)
        .unwrap();
    assert_eq!(got.map(at), Some(free));
    assert!(fences.recorded().is_empty(), "fences retired: {:?}", fences.recorded());
    assert!(pool.is_fenced(held[2]));
    // None preferred is free: the completed fences are retired, and the fenced one taken.
    pool.retire_fences();
    fences.complete_all();
    let back =
        pool.try_checkout_bytes_preferring(slot, 0, &[fenced], Preference::OnlyThere).unwrap();
    assert_eq!(back.map(at), Some(fenced));
    assert_eq!(fences.recorded().len(), 1);
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn close_wakes_waiters_and_refuses_checkouts() {
    let pool = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
    let held = pool.checkout(None).unwrap();
    let p2 = Arc::clone(&pool);
    let waiter = std::thread::spawn(move || p2.checkout(None));
    std::thread::sleep(Duration::from_millis(20));
    pool.close();
    assert_eq!(waiter.join().unwrap(), Err(Error::Closed));
    // A slot still out can be released after close.
    pool.release(held, None).unwrap();
    assert_eq!(pool.try_checkout(), Err(Error::Closed));
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_batch_in_pieces_is_counted_and_refused_once_closed() {
    let u = page_size();
    let pool = Pool::new(&PoolConfig::host(u, 4)).unwrap();
    let held: Vec<SlotId> = (0..4).map(|_| pool.checkout(None).unwrap()).collect();
    pool.release(held[0], None).unwrap();
    pool.release(held[2], None).unwrap();
    let before = pool.stats().checkouts;
    assert!(pool.try_checkout_bytes(2 * u, 0).unwrap().is_none());
    let pieces = pool.try_checkout_split(&[0, u, 2 * u]).unwrap().unwrap();
    assert_eq!(pieces.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, u]);
    assert_eq!(pool.stats().checkouts, before + 2);
    for (_, slot) in pieces {
        pool.slot_ptr(slot).unwrap();
        pool.release(slot, None).unwrap();
    }
    assert!(pool.try_checkout_split(&[0, 2 * u, u]).is_err(), "cuts that go back");
    pool.close();
    assert!(matches!(pool.try_checkout_split(&[0, u]), Err(Error::Closed)));
}
