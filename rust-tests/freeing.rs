//! A pool made right after one of its shape was dropped takes that arena instead of faulting
//! in a new one; one of another shape frees it; and the freeing thread, however far behind, is
//! caught up with by the thread making a pool. (One test: the kept arena is one per process.)

use std::time::Duration;

use pinpool::memory::freeing;
use pinpool::{Pool, PoolConfig};

const PAGE: usize = 4096;

#[test]
fn a_new_pool_takes_the_arena_of_the_last_one_dropped_if_it_has_its_shape() {
    let config = PoolConfig::host(16 * PAGE, 5);
    let first = Pool::new(&config).unwrap();
    let base = first.arena().base() as usize;
    drop(first);
    // The freeing thread may not have run the drop's job yet: the new pool runs it itself.
    let second = Pool::new(&config).unwrap();
    assert_eq!(second.arena().base() as usize, base, "not the dropped pool's arena");
    assert_eq!(second.stats().bytes.free, 5 * 16 * PAGE, "every byte free again");
    let t = second.checkout(None).unwrap();
    second.release(t, None).unwrap();
    drop(second);
    // Another shape: a new arena, and the kept one freed on the way.
    let other = Pool::new(&PoolConfig::host(16 * PAGE, 6)).unwrap();
    assert_ne!(other.arena().base() as usize, base);
    assert!(freeing::take_shelved(|_| true).is_none(), "the kept arena outlived a new pool");
    drop(other);
    // Dropped ones come back whole: a flush frees the one kept.
    assert!(freeing::flush(Some(Duration::from_secs(30))));
    assert!(freeing::take_shelved(|_| true).is_none());
    assert!(freeing::recent().iter().any(|r| r.bytes == 6 * 16 * PAGE));
}
