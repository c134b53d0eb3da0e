//! Unit tests of `claim`, kept apart from the code they test.

use std::sync::Arc;

use super::*;
use crate::pool::PoolConfig;
use crate::transfer::fence::ManualFences;

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn claims_follow_the_loaders_rules() {
    let fences = Arc::new(ManualFences::new());
    let pool = Pool::with_fences(&PoolConfig::host(4096, 2), Box::new(fences.clone())).unwrap();
    let quick = Some(Duration::from_millis(30));
    let ahead = ClaimRules { reserve: 4096, timeout: quick, overflow: false, defer: true };
    let own = ClaimRules { reserve: 0, timeout: quick, overflow: true, defer: false };
    let strict = ClaimRules { reserve: 0, timeout: quick, overflow: false, defer: false };
    // Two free: ahead takes one, then leaves the last one to the consumer.
    let Claim::Slot(a) = pool.claim(4096, &ahead).unwrap() else { panic!("no slot") };
    assert_eq!(pool.claim(4096, &ahead).unwrap(), Claim::Later);
    let Claim::Slot(b) = pool.claim(4096, &own).unwrap() else { panic!("no slot") };
    // Every slot held by the consumer, none on its way: later, overflow, or a timeout.
    assert_eq!(pool.claim(4096, &ahead).unwrap(), Claim::Later);
    assert_eq!(pool.claim(4096, &own).unwrap(), Claim::Overflow);
    assert!(matches!(pool.claim(4096, &strict), Err(Error::Exhausted { .. })));
    // A slot on its way behind a fence: waited for, not overflowed, and a completed
    // fence wakes the waiter.
    pool.release(a, Some(11)).unwrap();
    let waiter = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let rules = ClaimRules { timeout: Some(Duration::from_secs(30)), ..own };
            pool.claim(4096, &rules)
        })
    };
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "did not wait for the fenced slot");
    pool.retire_fences();
    fences.complete_stream(11);
    let Ok(Claim::Slot(c)) = waiter.join().unwrap() else { panic!("no slot after the fence") };
    assert_eq!(c.index, a.index);
    pool.release(b, None).unwrap();
    pool.release(c, None).unwrap();
}

#[test]
// Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_claim_the_holes_cannot_hold_is_answered_at_once() {
    // Eight pages, every other one kept by the consumer: four free pages in four holes.
    let page = crate::memory::shm::page_size();
    let fences = Arc::new(ManualFences::new());
    let pool = Pool::with_fences(&PoolConfig::host(page, 8), Box::new(fences.clone())).unwrap();
    let held: Vec<SlotId> = (0..8).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
    for t in held.iter().step_by(2) {
        pool.release(*t, None).unwrap();
    }
    let long = Some(Duration::from_secs(30));
    let ahead = ClaimRules { reserve: 0, timeout: long, overflow: false, defer: true };
    let own = ClaimRules { reserve: 0, timeout: long, overflow: true, defer: false };
    let t0 = Instant::now();
    assert_eq!(pool.claim(2 * page, &ahead).unwrap(), Claim::Later);
    assert_eq!(pool.claim(2 * page, &own).unwrap(), Claim::Overflow);
    assert!(t0.elapsed() < Duration::from_secs(5), "waited {:?}", t0.elapsed());
    // A fenced neighbour would join two holes: that is worth waiting for, and a claim
    // kept for the reserve is answered at once if the join cannot hold both.
    pool.release(held[1], Some(3)).unwrap();
    let keep = ClaimRules { reserve: 2 * page, ..ahead.clone() };
    assert_eq!(pool.claim(3 * page, &keep).unwrap(), Claim::Later);
    let waiter = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.claim(3 * page, &own))
    };
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "did not wait for the fenced neighbour");
    pool.retire_fences();
    fences.complete_stream(3);
    let Ok(Claim::Slot(c)) = waiter.join().unwrap() else { panic!("no slot after the fence") };
    assert_eq!(pool.extent(c).unwrap(), (0, 3 * page));
}
