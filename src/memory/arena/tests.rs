//! Unit tests of `arena`, kept apart from the code they test.

use super::*;
use crate::memory::shm::page_size;
use crate::system::cuda;

#[test]
// Miri: the arena is a memfd mapping, which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn a_partial_arena_becomes_ready_part_by_part_in_order() {
    let (slot, page) = (64 * 1024, page_size());
    for (first, ready_at_once) in [(1, page), (slot + 1, slot + page), (3 * slot, 3 * slot)] {
        let arena =
            Arena::new_partial(slot * 10, slot, None, Some(Backend::Host), 4, first).unwrap();
        // The host backend makes only the pages asked for ready; the first part is whole slots.
        assert_eq!(arena.ready_len(), ready_at_once, "first {first}");
        let first_part = arena.part_starts().first().copied().unwrap_or(arena.len());
        assert_eq!(first_part, ready_at_once.next_multiple_of(slot), "first {first}");
        let mut end = ready_at_once;
        let mut chunks = Vec::new();
        while let Some((offset, len)) = arena.prepare_next(2, usize::MAX).unwrap() {
            assert_eq!(offset, end, "made ready out of order");
            assert!(len > 0 && len % page == 0);
            end += len;
            chunks.push((offset, len));
            assert_eq!(arena.ready_len(), end);
            // Each step ends at a part's end: the rest of the first part, then whole parts.
            assert!(end == arena.len() || arena.part_starts().contains(&end), "ended at {end}");
        }
        assert_eq!(end, arena.len());
        if ready_at_once < first_part {
            assert_eq!(chunks[0], (ready_at_once, first_part - ready_at_once));
        }
        // Every byte is usable once ready.
        // SAFETY: the whole arena is mapped, writable and ready; nothing else uses it.
        unsafe { std::ptr::write_bytes(arena.base(), 7, arena.len()) };
    }
}

#[test]
// Miri: reads /proc/meminfo, which isolation forbids.
#[cfg_attr(miri, ignore)]
fn an_arena_larger_than_memory_is_refused_before_mapping() {
    let available = available_memory().expect("/proc/meminfo is readable here");
    let page = crate::memory::shm::page_size();
    // Twice what is available now: other processes may free memory between this reading
    // and the arena's own (make test runs the Rust tests beside the Python build).
    let len = (available / page * 2 + 1) * page;
    let err = Arena::new(len, page, None, Some(Backend::Host), 1).unwrap_err();
    assert!(matches!(err, Error::NotEnoughMemory { wanted, .. } if wanted == len), "{err}");
}

#[test]
// Miri: maps memory with mmap (PROT_NONE reservations, MAP_SHARED memfds), which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn host_arena_is_usable_and_reports_itself() {
    let a = Arena::new(1 << 20, 1 << 16, None, None, 2).unwrap();
    assert_eq!(a.backend(), Backend::Host);
    let (fd, start, len) = a.part_at((1 << 20) - 1).unwrap();
    assert!(start + len == 1 << 20 && len % (1 << 16) == 0);
    let inode = rustix::fs::fstat(fd).unwrap().st_ino;
    assert_eq!(a.part_inode_at((1 << 20) - 1), Some(inode), "the inode kept is the memfd's");
    // SAFETY: test-only write inside the arena.
    unsafe { a.base().add(a.len() - 1).write(7) };
    assert_ne!(a.residency(), Residency::Pinned);
}

#[test]
// Miri: loads the CUDA driver with dlopen, a foreign call Miri cannot run.
#[cfg_attr(miri, ignore)]
fn cuda_backend_without_device_is_an_error_not_a_panic() {
    let err = Arena::new(4096, 4096, None, Some(Backend::CudaRegister), 1).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)));
    if cuda::device_count().unwrap_or(0) == 0 {
        // A device named, with or without a backend: refused, saying why, never host
        // memory in its place.
        for backend in [Some(Backend::CudaHostAlloc), Some(Backend::CudaRegister), None] {
            let err = Arena::new(4096, 4096, Some(0), backend, 1).unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "{err}");
            let text = err.to_string();
            assert!(text.contains("CUDA device 0 was asked for"), "{text}");
            assert!(text.contains("device=\"cpu\""), "{text}");
        }
    }
}

#[test]
fn parse_backend_names() {
    assert_eq!(Backend::parse("auto").unwrap(), None);
    for b in [Backend::CudaHostAlloc, Backend::CudaRegister, Backend::Host] {
        assert_eq!(Backend::parse(b.name()).unwrap(), Some(b));
    }
    assert!(Backend::parse("gpu").is_err());
}
