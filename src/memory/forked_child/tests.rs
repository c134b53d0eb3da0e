//! Unit tests of `forked_child`, kept apart from the code they test.

use crate::memory::shm::Region;

#[test]
#[cfg_attr(miri, ignore)] // (Miri cannot fork or map memfds)
fn a_child_writes_its_own_copy_and_reads_the_parents_bytes() {
    let page = crate::memory::shm::page_size();
    let region = Region::new("pinpool-test", 4 * page, page, 2).unwrap();
    let base = region.as_ptr();
    // SAFETY: the region is ours, mapped read-write, 4 pages long.
    unsafe { base.write_bytes(7, 4 * page) };
    // SAFETY: the child only reads and writes the region (mapped in it, privately) and
    // leaves with `_exit`, which is safe in a forked child of a multi-threaded process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: as above.
        let code = unsafe {
            let saw = *base.add(3 * page);
            base.write_bytes(9, 4 * page);
            let fd = region.parts()[0].fd.as_raw_fd();
            let mut st: libc::stat = std::mem::zeroed();
            let null = libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFCHR;
            if saw == 7 && null {
                0
            } else {
                1
            }
        };
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{status}");
    // SAFETY: the region is ours and still mapped.
    let bytes = unsafe { std::slice::from_raw_parts(base, 4 * page) };
    assert!(bytes.iter().all(|&b| b == 7), "the child's writes reached the parent");
}

#[test]
#[cfg_attr(miri, ignore)] // (Miri cannot fork or map memfds)
fn a_child_reads_a_segment_mapping_but_cannot_write_it() {
    let page = crate::memory::shm::page_size();
    let m = crate::memory::shm::Mapping::memfd("pinpool-test", 2 * page).unwrap();
    let base = m.as_ptr();
    // SAFETY: the mapping is ours, read-write, 2 pages long.
    unsafe { base.write_bytes(5, 2 * page) };
    // SAFETY: the child reads, then writes, the mapping (read-only in it) and leaves with
    // `_exit` if the write did not fault.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: as above; the write is volatile so that it happens.
        unsafe {
            if *base.add(page) != 5 {
                libc::_exit(2);
            }
            base.add(page).write_volatile(6);
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
        "the child's write did not fault: {status}"
    );
    // SAFETY: the mapping is ours and still mapped.
    assert_eq!(unsafe { *base.add(page) }, 5);
}

#[test]
#[cfg_attr(miri, ignore)] // (Miri cannot fork or map memfds)
fn a_child_has_nothing_of_another_processs_segment() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let page = crate::memory::shm::page_size();
    // A worker's segment, mapped in this process from its descriptor, as the segment
    // cache maps it.
    let worker = crate::memory::shm::Mapping::memfd("pinpool-test", 2 * page).unwrap();
    let fd = worker.fd().unwrap().as_raw_fd();
    // SAFETY: `dup` of a descriptor we hold; the new one is owned by `OwnedFd` alone.
    let dup = unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) };
    let m = crate::memory::shm::Mapping::from_fd(dup, 2 * page, true).unwrap();
    let base = m.as_ptr();
    // SAFETY: the child only asks the kernel about the range (`msync` fails with ENOMEM
    // where nothing is mapped) and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let r = libc::msync(base.cast(), 2 * page, libc::MS_ASYNC);
            let unmapped = r != 0 && *libc::__errno_location() == libc::ENOMEM;
            libc::_exit(if unmapped { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child has the segment mapped: {status}"
    );
    // SAFETY: still mapped here, 2 pages, read-write.
    unsafe { base.write_bytes(3, 2 * page) };
    drop(worker);
}

use std::os::fd::AsRawFd;
