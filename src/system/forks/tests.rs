//! Unit tests of `forks`, kept apart from the code they test.

#[test]
#[cfg_attr(miri, ignore)] // (Miri cannot fork)
fn a_forked_child_sees_a_new_count() {
    let before = super::current();
    // SAFETY: the child only reads an atomic and exits with `_exit`, which is safe in a
    // forked child of a multi-threaded process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = if super::current() != before { 0 } else { 1 };
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid place to write its status.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{status}");
    assert_eq!(super::current(), before, "the parent's count moved");
}
