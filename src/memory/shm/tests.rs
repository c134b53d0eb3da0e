//! Unit tests of `shm`, kept apart from the code they test.

use rustix::fs::MemfdFlags;

use super::*;
use crate::error::Error;

#[test]
// Miri: memfd_create, fcntl seals and MAP_SHARED mappings are foreign calls Miri cannot run.
#[cfg_attr(miri, ignore)]
fn memfd_round_trip_and_seals() {
    let m = Mapping::memfd("pinpool-test", 3 * page_size()).unwrap();
    m.populate(2).unwrap();
    // SAFETY: test-only writes inside the mapping.
    unsafe { *m.as_ptr().add(5) = 42 };
    let dup = m.fd().unwrap().try_clone_to_owned().unwrap();
    let again = Mapping::from_fd(dup, m.len(), false).unwrap();
    // SAFETY: reading inside the second mapping of the same file.
    assert_eq!(unsafe { *again.as_ptr().add(5) }, 42);
    let shrunk = rustix::fs::ftruncate(m.fd().unwrap(), 1);
    assert!(shrunk.is_err(), "shrinking a sealed memfd must fail");
}

#[test]
// Miri: memfd_create, fcntl seals and MAP_SHARED mappings are foreign calls Miri cannot run.
#[cfg_attr(miri, ignore)]
fn from_fd_refuses_longer_than_file() {
    let m = Mapping::memfd("pinpool-test", page_size()).unwrap();
    let dup = m.fd().unwrap().try_clone_to_owned().unwrap();
    let err = Mapping::from_fd(dup, 2 * page_size(), false).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
}

#[test]
// Miri: memfd_create and fcntl seals are foreign calls Miri cannot run.
#[cfg_attr(miri, ignore)]
fn from_fd_refuses_files_that_could_shrink() {
    // An unsealed memfd and a regular file: either could be truncated after mapping.
    let unsealed = rustix::fs::memfd_create("pinpool-test-unsealed", MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&unsealed, 8192).unwrap();
    let err = Mapping::from_fd(unsealed, 4096, false).unwrap_err();
    assert!(err.to_string().contains("sealed"), "{err}");
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    let err = Mapping::from_fd(file.into(), 4096, false).unwrap_err();
    assert!(err.to_string().contains("sealed"), "{err}");
}

#[test]
// Miri: maps memory with mmap (PROT_NONE reservations, MAP_SHARED memfds), which Miri cannot
// run.
#[cfg_attr(miri, ignore)]
fn region_parts_are_contiguous_and_shared() {
    let page = page_size();
    let r = Region::new("pinpool-test", 10 * page, 2 * page, 3).unwrap();
    assert_eq!(r.parts().len(), 3);
    assert_eq!(r.parts().iter().map(|p| p.len).sum::<usize>(), 10 * page);
    assert!(r.parts().iter().all(|p| p.len % (2 * page) == 0));
    r.populate_then(4, |_| Ok(())).unwrap();
    // SAFETY: test writes inside the region.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 7, 10 * page) };
    let last = r.part_at(10 * page - 1).unwrap();
    let dup = last.fd.try_clone().unwrap();
    let seen = Mapping::from_fd(dup, last.len, false).unwrap();
    // SAFETY: reading the separate mapping of the same memfd.
    assert_eq!(unsafe { *seen.as_ptr().add(last.len - 1) }, 7);
    assert!(r.part_at(10 * page).is_none());
    // The pages past whole units go to the last part; less than one unit is refused.
    let odd = Region::new("pinpool-test", 7 * page, 2 * page, 2).unwrap();
    let lens: Vec<usize> = odd.parts().iter().map(|p| p.len).collect();
    assert_eq!(lens, vec![4 * page, 3 * page]);
    assert!(Region::new("pinpool-test", page, 2 * page, 1).is_err());
    assert!(Region::new("pinpool-test", 3 * page + 1, 2 * page, 1).is_err());
}

/// How many pages of this process are mapped from memfds named `name` (from
/// `/proc/self/maps`; other tests' mappings have other names).
fn pages_mapped_from(name: &str) -> usize {
    let tag = format!("/memfd:{name} ");
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|line| line.contains(&tag))
        .map(|line| {
            let range = line.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let a = usize::from_str_radix(a, 16).unwrap();
            (usize::from_str_radix(b, 16).unwrap() - a) / page_size()
        })
        .sum()
}

#[test]
#[cfg_attr(miri, ignore)]
fn chunked_unmapping_leaves_nothing_mapped() {
    // Whole chunks, a partial chunk, and a length that is not a whole number of pages.
    let lens = [MM_CALL_BYTES, 3 * MM_CALL_BYTES + 5 * page_size(), 2 * MM_CALL_BYTES + 12345, 100];
    for len in lens {
        let m = Mapping::memfd("pinpool-unmap-test", len).unwrap();
        let pages = round_up(len, page_size()).unwrap() / page_size();
        assert_eq!(pages_mapped_from("pinpool-unmap-test"), pages);
        drop(m);
        assert_eq!(pages_mapped_from("pinpool-unmap-test"), 0, "{len} bytes: pages left");
    }
    let r = Region::new("pinpool-unmap-region", 6 * MM_CALL_BYTES, MM_CALL_BYTES, 4).unwrap();
    assert_eq!(pages_mapped_from("pinpool-unmap-region"), 6 * MM_CALL_BYTES / page_size());
    drop(r);
    assert_eq!(pages_mapped_from("pinpool-unmap-region"), 0, "part of the region is left");
}

#[test]
#[cfg_attr(miri, ignore)]
fn a_background_thread_unmaps_everything_too() {
    // The same pieces, with a pause between them (the reclaimer's and freeing thread's way).
    std::thread::spawn(|| {
        crate::system::priority::become_background();
        let len = 3 * MM_CALL_BYTES + 5 * page_size();
        let m = Mapping::memfd("pinpool-unmap-background", len).unwrap();
        assert_eq!(pages_mapped_from("pinpool-unmap-background"), len / page_size());
        drop(m);
        assert_eq!(pages_mapped_from("pinpool-unmap-background"), 0, "pages left");
    })
    .join()
    .unwrap();
}

#[test]
fn range_checks_do_not_overflow() {
    assert!(check_range("x", usize::MAX, 2, 10).is_err());
    assert!(check_range("x", 4, 6, 10).is_ok());
    assert!(check_range("x", 4, 7, 10).is_err());
    assert!(check_range("x", 10, 0, 10).is_ok());
}
