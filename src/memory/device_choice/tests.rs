//! Unit tests of `device_choice`, kept apart from the code they test.

use super::*;

#[test]
fn no_device_means_no_cuda_whatever_else_is_known() {
    assert_eq!(choose(None, None, 0).unwrap(), None);
    assert_eq!(choose(Some(0), Some("3"), 0).unwrap(), None);
    // Not even a bad LOCAL_RANK is looked at: there is nothing to choose from.
    assert_eq!(choose(None, Some("x"), 0).unwrap(), None);
}

#[test]
fn the_current_context_wins() {
    let c = choose(Some(1), Some("0"), 2).unwrap().unwrap();
    assert_eq!(c, ChosenDevice { ordinal: 1, reason: ChoiceReason::CurrentContext });
    let c = choose(Some(0), Some("5"), 8).unwrap().unwrap();
    assert_eq!(c, ChosenDevice { ordinal: 0, reason: ChoiceReason::CurrentContext });
}

#[test]
fn a_current_context_past_the_device_count_is_ignored() {
    let c = choose(Some(4), Some("1"), 2).unwrap().unwrap();
    assert_eq!(c, ChosenDevice { ordinal: 1, reason: ChoiceReason::LocalRank(1) });
}

#[test]
fn local_rank_modulo_the_device_count() {
    for (rank, count, expected) in [(0, 1, 0), (3, 4, 3), (5, 4, 1), (7, 2, 1), (6, 8, 6)] {
        let text = rank.to_string();
        let c = choose(None, Some(&text), count).unwrap().unwrap();
        assert_eq!(c, ChosenDevice { ordinal: expected, reason: ChoiceReason::LocalRank(rank) });
    }
    let c = choose(None, Some(" 2\n"), 4).unwrap().unwrap();
    assert_eq!(c.ordinal, 2, "surrounding blanks are fine");
}

#[test]
fn otherwise_the_first_device() {
    for local_rank in [None, Some(""), Some("  ")] {
        let c = choose(None, local_rank, 3).unwrap().unwrap();
        assert_eq!(c, ChosenDevice { ordinal: 0, reason: ChoiceReason::FirstDevice });
    }
}

#[test]
fn a_local_rank_that_is_not_a_rank_is_an_error() {
    for bad in ["-1", "one", "1.5", "0x1"] {
        let err = choose(None, Some(bad), 2).unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{bad}: {err}");
        assert!(err.to_string().contains("LOCAL_RANK") && err.to_string().contains(bad));
    }
    // A current context makes LOCAL_RANK irrelevant, even a bad one.
    assert_eq!(choose(Some(1), Some("one"), 2).unwrap().unwrap().ordinal, 1);
}

#[test]
// Miri: loads the CUDA driver with dlopen, a foreign call Miri cannot run.
#[cfg_attr(miri, ignore)]
fn explicit_requests_pass_through_without_the_driver() {
    assert_eq!(DeviceRequest::Cpu.resolve(None).unwrap().ordinal, None);
    assert_eq!(DeviceRequest::Ordinal(3).resolve(None).unwrap().ordinal, Some(3));
    let host = DeviceRequest::Automatic.resolve(Some(Backend::Host)).unwrap();
    assert_eq!(host, PoolDevice { ordinal: None, notes: Vec::new(), reason: None });
}

#[test]
// Miri: loads the CUDA driver with dlopen, a foreign call Miri cannot run.
#[cfg_attr(miri, ignore)]
fn automatic_without_a_device_is_host_memory_with_a_note() {
    if cuda::device_count().unwrap_or(0) > 0 {
        return; // checks the machine without CUDA
    }
    let r = DeviceRequest::Automatic.resolve(None).unwrap();
    assert_eq!(r.ordinal, None);
    assert!(r.notes.len() == 1 && r.notes[0].contains("CUDA"), "{:?}", r.notes);
    // CUDA asked for by name: refused, naming what was asked and how to get host memory.
    for backend in [Backend::CudaRegister, Backend::CudaHostAlloc] {
        let err = DeviceRequest::Automatic.resolve(Some(backend)).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Invalid(_)), "{err}");
        assert!(text.contains(&format!("backend={:?} was asked for", backend.name())));
        assert!(text.contains("backend=\"auto\""), "{text}");
    }
    let err = DeviceRequest::Cuda.resolve(None).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    assert!(err.to_string().contains("device=\"cuda\" was asked for"), "{err}");
}

#[test]
// Miri: loads the CUDA driver with dlopen, a foreign call Miri cannot run.
#[cfg_attr(miri, ignore)]
fn without_a_driver_the_loader_says_why_and_no_code_is_made_up() {
    let Some(reason) = cuda::driver_load_error() else {
        return; // checks a machine without libcuda
    };
    let err = cuda::device_count().unwrap_err();
    assert!(matches!(err, Error::NoDriver { .. }), "{err}");
    assert_eq!(err.to_string(), format!("libcuda.so.1 could not be loaded: {reason}"));
    // The dynamic loader's own words name the library it could not find.
    assert!(reason.contains("libcuda"), "{reason}");
    let err = DeviceRequest::Cuda.resolve(None).unwrap_err().to_string();
    assert!(err.contains("libcuda.so.1 could not be loaded: "), "{err}");
    assert!(!err.contains("CUDA_ERROR"), "{err}");
}
