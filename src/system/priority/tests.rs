//! Unit tests of `priority`, kept apart from the code they test.

use super::*;

#[test]
// Miri: getpriority/setpriority are foreign calls Miri cannot run.
#[cfg_attr(miri, ignore)]
fn lowers_only_the_calling_thread_and_never_raises() {
    let before = current_nice();
    let seen = std::thread::spawn(|| {
        lower_priority(IDLE_NICE);
        let lowered = current_nice();
        lower_priority(IDLE_NICE - 5); // a smaller nice would raise it: refused
        let child = std::thread::spawn(current_nice).join().unwrap();
        (lowered, current_nice(), child)
    })
    .join()
    .unwrap();
    assert_eq!(seen, (IDLE_NICE.max(before), IDLE_NICE.max(before), IDLE_NICE.max(before)));
    assert_eq!(current_nice(), before, "the spawning thread changed too");
}

#[test]
#[cfg_attr(miri, ignore)]
fn only_a_thread_that_becomes_background_is_one() {
    assert!(!is_background());
    let (own, child) = std::thread::spawn(|| {
        become_background();
        (is_background(), std::thread::spawn(is_background).join().unwrap())
    })
    .join()
    .unwrap();
    assert!(own, "the thread that became background");
    assert!(!child, "a thread it starts is not marked (only its priority is inherited)");
    assert!(!is_background(), "the spawning thread changed too");
}
