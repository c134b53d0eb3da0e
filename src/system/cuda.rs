//! The CUDA driver, reached through cudarc's dynamic loading.
//!
//! Invariants:
//! - `libcuda` is never touched before [`driver_present`] has confirmed it can be loaded, so a
//!   machine without a GPU or a driver never reaches cudarc's "library not found" panic.
//! - Every driver call runs inside [`guarded`], which turns a driver error into
//!   [`Error::Cuda`] carrying the driver's own error name and code, and an unexpected panic
//!   inside cudarc into [`Error::Invalid`] naming the call: no panic leaves this module, and
//!   no name or code is made up. A driver that cannot be loaded at all made no call and has no
//!   code: that is [`Error::NoDriver`], with the dynamic loader's own message.
//! - Every call that needs a context first binds the device's *primary* context (the one torch
//!   uses) to the calling thread, so our pinned memory and events live in torch's context.
//! - Asking which context is current ([`current_context_device`]) changes nothing: it binds no
//!   context, so torch's current device on the calling thread stays what it was.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// A raw `CUstream` as an integer: what `torch.cuda.Stream.cuda_stream` returns. 0 is the
/// legacy default stream.
pub type StreamHandle = usize;

/// Runs one driver call, converting its error and any panic into [`Error::Cuda`].
pub fn guarded<T>(
    call: &'static str,
    f: impl FnOnce() -> std::result::Result<T, DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(driver_error(call, err)),
        Err(panic) => {
            let msg = crate::error::panic_message(&*panic);
            Err(Error::Invalid(format!("internal error in pinpool's binding of {call}: {msg}")))
        }
    }
}

fn driver_error(call: &'static str, err: DriverError) -> Error {
    let name = catch_unwind(AssertUnwindSafe(|| {
        err.error_name().map(|n| n.to_string_lossy().into_owned()).ok()
    }))
    .ok()
    .flatten()
    // (A code this driver has no name for: `cuGetErrorName` failed. The code is still its.)
    .unwrap_or_else(|| "unnamed CUresult".to_owned());
    Error::Cuda { call, name, code: err.0 as u32 }
}

/// The driver library, by the name an error gives (the last of the names cudarc tries, and
/// the one the driver's packages install).
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// Why `libcuda` cannot be loaded, in the dynamic loader's words, or None when it can
/// (checked once per process).
pub fn driver_load_error() -> Option<&'static str> {
    static FAILURE: OnceLock<Option<String>> = OnceLock::new();
    FAILURE
        .get_or_init(|| {
            let present = catch_unwind(|| {
                // SAFETY: `is_culib_present` only tries to dlopen the driver library by its
                // candidate names and drops the handle; it has no other precondition.
                unsafe { sys::is_culib_present() }
            })
            .unwrap_or(false);
            (!present).then(|| loader_message(DRIVER_LIBRARY))
        })
        .as_deref()
}

/// Whether `libcuda` can be loaded at all (checked once per process).
pub fn driver_present() -> bool {
    driver_load_error().is_none()
}

/// What the dynamic loader says when asked for `library` (which cudarc could not load).
fn loader_message(library: &str) -> String {
    let Ok(name) = std::ffi::CString::new(library) else {
        return format!("{library:?} is not a library name");
    };
    // SAFETY: `name` is a NUL-terminated string that outlives the call; a handle returned is
    // closed at once, and `dlerror` returns null or a NUL-terminated string owned by the
    // loader, valid until the next `dl*` call on this thread, copied out before that.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if !handle.is_null() {
            libc::dlclose(handle);
            return format!("{library} loads, but cudarc could not load the driver from it");
        }
        let message = libc::dlerror();
        if message.is_null() {
            "the dynamic loader gave no reason".to_owned()
        } else {
            CStr::from_ptr(message).to_string_lossy().into_owned()
        }
    }
}

/// The number of CUDA devices, or an error saying why there are none to use: the driver
/// could not be loaded ([`Error::NoDriver`]), or `cuInit` or `cuDeviceGetCount` failed (the
/// driver's own error; a machine with a driver and no GPU gives `CUDA_ERROR_NO_DEVICE`).
pub fn device_count() -> Result<usize> {
    if let Some(reason) = driver_load_error() {
        return Err(Error::NoDriver { library: DRIVER_LIBRARY, reason: reason.to_owned() });
    }
    guarded("cuInit", result::init)?;
    let n = guarded("cuDeviceGetCount", result::device::get_count)?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// What an error about a device asked for by name says about getting host memory instead.
pub const HOST_MEMORY_HINT: &str = "device=\"cpu\" gives host memory, and device=None (the \
     default) a GPU where there is one and host memory elsewhere";

/// Checks that device `ordinal`, asked for by name, exists: [`Error::Invalid`] otherwise,
/// saying why (the driver's own error, or why the driver could not be loaded) and how to get
/// host memory instead. Nothing falls back to host memory quietly when a device was named.
pub fn require_device(ordinal: usize) -> Result<()> {
    match device_count() {
        Ok(count) if ordinal < count => Ok(()),
        Ok(0) => Err(Error::Invalid(format!(
            "CUDA device {ordinal} was asked for, but the driver reports no CUDA device: \
             {HOST_MEMORY_HINT}"
        ))),
        Ok(count) => Err(Error::Invalid(format!(
            "CUDA device {ordinal} does not exist: this machine has {count} CUDA device(s)"
        ))),
        Err(e) => Err(Error::Invalid(format!(
            "CUDA device {ordinal} was asked for, but CUDA cannot be used here ({e}): \
             {HOST_MEMORY_HINT}"
        ))),
    }
}

/// The ordinal of the device whose context is current on the calling thread
/// (`torch.cuda.set_device(n)` makes device n's primary context current there), or `None`:
/// no driver, no current context, or a driver call that failed. Binds nothing.
pub fn current_context_device() -> Option<usize> {
    if !driver_present() {
        return None;
    }
    guarded("cuInit", result::init).ok()?;
    guarded("cuCtxGetCurrent", result::ctx::get_current).ok()??;
    let device = guarded("cuCtxGetDevice", || {
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid, writable out-pointer. A context is current (checked just
        // above, and only this thread can change its own); without one the driver would
        // return an error, which is passed on.
        unsafe { sys::cuCtxGetDevice(&mut device) }.result().map(|()| device)
    })
    .ok()?;
    usize::try_from(device).ok()
}

/// The calling thread's current CUDA context when made, made current again when dropped (if
/// it changed meanwhile). pinpool calls the driver from its callers' threads (a slot
/// released on the training thread records its fence there), and the current context of a
/// thread is torch's current device on it: pinpool must leave it as it found it.
#[must_use = "the thread's context is put back when this is dropped"]
pub struct Restore {
    previous: sys::CUcontext,
}

impl Restore {
    fn now() -> Result<Self> {
        let previous = guarded("cuCtxGetCurrent", result::ctx::get_current)?;
        Ok(Restore { previous: previous.unwrap_or(std::ptr::null_mut()) })
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        let now = guarded("cuCtxGetCurrent", result::ctx::get_current);
        if matches!(now, Ok(current) if current.unwrap_or(std::ptr::null_mut()) != self.previous) {
            // SAFETY: `previous` is a handle the driver gave this thread (`cuCtxGetCurrent`)
            // or null, which unbinds; the call only makes it current, and a context destroyed
            // meanwhile is reported by the driver as an error, ignored here.
            let _ =
                guarded("cuCtxSetCurrent", || unsafe { result::ctx::set_current(self.previous) });
        }
    }
}

/// One CUDA device, holding a reference on its primary context.
pub struct Device {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal()).finish()
    }
}

impl Device {
    /// Retains the primary context of device `ordinal`.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        require_device(ordinal)?;
        // cudarc makes the context current on this thread: the caller's own goes back.
        let _restore = Restore::now()?;
        let ctx = guarded("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        Ok(Arc::new(Device { ctx }))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes the primary context current on the calling thread until the returned guard is
    /// dropped, which makes the thread's own current again: the calling thread may be the
    /// caller's, whose current context is torch's current device.
    pub fn bind(&self) -> Result<Restore> {
        let restore = Restore::now()?;
        guarded("cuCtxSetCurrent", || self.ctx.bind_to_thread())?;
        Ok(restore)
    }

    /// `cuMemHostAlloc(PORTABLE)`: page-locked, cached (not write-combined) host memory.
    pub fn host_alloc(&self, len: usize) -> Result<*mut u8> {
        let _bound = self.bind()?;
        guarded("cuMemHostAlloc", || {
            // SAFETY: a plain allocation call; the returned pointer is owned by the caller,
            // who frees it with `free_host`.
            unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
        })
        .map(|p| p.cast::<u8>())
    }

    /// Frees memory from [`Device::host_alloc`].
    ///
    /// # Safety
    /// `ptr` came from `host_alloc` on this device and is not used afterwards.
    pub unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees `ptr` is a live `cuMemHostAlloc` allocation.
        guarded("cuMemFreeHost", || unsafe { result::free_host(ptr.cast::<c_void>()) })
    }

    /// `cuMemHostRegister(PORTABLE)` of an existing mapping.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is a live mapping that stays mapped until `host_unregister(ptr)`.
    pub unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let _bound = self.bind()?;
        guarded("cuMemHostRegister", || {
            // SAFETY: the caller guarantees the range is mapped for the registration's life.
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.cast::<c_void>(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
                .result()
            }
        })
    }

    /// Undoes [`Device::host_register`].
    ///
    /// # Safety
    /// `ptr` was registered with `host_register` and no GPU work still reads it.
    pub unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees `ptr` is the base of a registered range.
        guarded("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(ptr.cast::<c_void>()).result()
        })
    }

    /// Blocks until all work in the context has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the context is current on this thread (bound just above).
        guarded("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize().result() })
    }

    /// Queues a copy of `len` bytes from host memory at `src` to device memory at `dst` on
    /// `stream`, then records a fresh event after it there (one context binding for both);
    /// returns the event.
    ///
    /// # Safety
    /// `[src, src+len)` is pinned host memory that stays allocated and unwritten until the
    /// copy has run (the caller fences its reuse on `stream`); `[dst, dst+len)` is device
    /// memory of this device that stays allocated until then and that nothing else writes.
    pub unsafe fn send(
        self: &Arc<Self>,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        let _bound = self.bind()?;
        // SAFETY: the caller vouches for both ranges; a bad stream handle is reported by the
        // driver as an error, which we return.
        guarded("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, stream as sys::CUstream)
                .result()
        })?;
        let raw = guarded("cuEventCreate", || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        })?;
        let event = Event { raw, device: Arc::clone(self) };
        // SAFETY: `raw` is a live event of this context, the stream as above.
        guarded("cuEventRecord", || unsafe {
            result::event::record(raw, stream as sys::CUstream)
        })?;
        Ok(event)
    }

    /// A fresh event without timing (cheaper to record and query).
    pub fn new_event(self: &Arc<Self>) -> Result<Event> {
        let _bound = self.bind()?;
        let raw = guarded("cuEventCreate", || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(Event { raw, device: Arc::clone(self) })
    }
}

/// An owned CUDA event.
pub struct Event {
    raw: sys::CUevent,
    device: Arc<Device>,
}

// SAFETY: a CUevent is an opaque driver handle; the driver API is thread-safe and the handle
// may be recorded, queried and destroyed from any thread that binds its context.
unsafe impl Send for Event {}
// SAFETY: as above; `&Event` only permits driver calls, which the driver serialises.
unsafe impl Sync for Event {}

impl Event {
    /// Records the event on `stream` (a raw `CUstream`, 0 for the legacy default stream).
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        let _bound = self.device.bind()?;
        // SAFETY: `raw` is a live event of this context; a bad stream handle is reported by
        // the driver as an error, which we return.
        guarded("cuEventRecord", || unsafe {
            result::event::record(self.raw, stream as sys::CUstream)
        })
    }

    /// The device the event belongs to.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Makes the work queued on `stream` from now on wait until this event's work is done
    /// (`cuStreamWaitEvent`; the calling thread does not wait).
    pub fn make_wait(&self, stream: StreamHandle) -> Result<()> {
        let _bound = self.device.bind()?;
        // SAFETY: `raw` is a live event of this context; a bad stream handle is reported by
        // the driver as an error, which we return.
        guarded("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream as sys::CUstream, self.raw, 0).result()
        })
    }

    /// Whether all work captured by the last record has completed.
    pub fn is_complete(&self) -> Result<bool> {
        let _bound = self.device.bind()?;
        // SAFETY: `raw` is a live event of this context.
        match guarded("cuEventQuery", || unsafe { result::event::query(self.raw) }) {
            Ok(()) => Ok(true),
            Err(Error::Cuda { code, .. }) if code == sys::CUresult::CUDA_ERROR_NOT_READY as u32 => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_bound) = self.device.bind() {
            // SAFETY: `raw` is live and dropped once; destroying a pending event is allowed
            // (the driver releases it when the work completes).
            let _ = guarded("cuEventDestroy", || unsafe { result::event::destroy(self.raw) });
        }
    }
}
