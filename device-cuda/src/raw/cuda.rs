//! Raw calls of `CudaRuntime`: the CUDA driver API and cuBLAS through `cudarc`'s `result` and
//! `sys` layers, loaded at run time. The handles are wrapped in small types whose methods are the
//! only places that call the driver; `runtime::cuda` builds the safe runtime on them.
//!
//! Threading: every driver call needs the runtime's context current on the calling thread, so
//! each entry point of `CudaRuntime` calls [`Device::make_current`] first. Driver handles may be
//! used from any thread once their context is current, which is why the wrappers are `Send` and
//! `Sync`; `CudaRuntime` serialises calls that share mutable state (the cuBLAS stream binding)
//! behind its mutex.

use std::ffi::{c_void, CString};

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::result as drv;
use cudarc::driver::sys;

use crate::error::{CudaError, Result};

/// The oldest driver (as `cuDriverGetVersion` reports it) that can JIT the checked-in PTX: the
/// PTX comes from NVRTC 12.4 (PTX ISA 8.4).
pub(crate) const MIN_DRIVER_VERSION: i32 = 12040;

fn call(call: &'static str) -> impl Fn(drv::DriverError) -> CudaError {
    move |err| {
        if err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            CudaError::OutOfMemory {
                what: "device",
                requested: 0,
            }
        } else {
            let name = err
                .error_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|_| format!("{:?}", err.0));
            CudaError::Call {
                call,
                message: name,
            }
        }
    }
}

fn blas_call(call: &'static str) -> impl Fn(blas::CublasError) -> CudaError {
    move |err| CudaError::Call {
        call,
        message: format!("{:?}", err.0),
    }
}

/// Whether the driver library can be loaded, and its version; a typed error otherwise.
pub(crate) fn open_driver() -> Result<i32> {
    // SAFETY: `is_culib_present` only tries to open the library by its known names (it keeps no
    // handle and calls nothing in it).
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver {
            searched: cudarc::get_lib_name_candidates("cuda").join(", "),
        });
    }
    let mut version: i32 = 0;
    // SAFETY: the library is present (checked above), `cuDriverGetVersion` exists in every driver
    // and writes one int through the valid pointer; it needs no initialisation.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(call("cuDriverGetVersion"))?;
    if version < MIN_DRIVER_VERSION {
        return Err(CudaError::DriverTooOld {
            found: version,
            needed: MIN_DRIVER_VERSION,
        });
    }
    drv::init().map_err(|err| {
        if err.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            CudaError::NoDevice("cuInit found no CUDA-capable device".to_owned())
        } else {
            call("cuInit")(err)
        }
    })?;
    let count = drv::device::get_count().map_err(call("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudaError::NoDevice(
            "the driver reports 0 devices".to_owned(),
        ));
    }
    Ok(version)
}

/// A device with its retained primary context.
#[derive(Debug)]
pub(crate) struct Device {
    device: sys::CUdevice,
    context: sys::CUcontext,
}

// SAFETY: a CUcontext and a CUdevice are opaque driver handles valid on any thread; every use
// makes the context current on the calling thread first.
unsafe impl Send for Device {}
// SAFETY: as above; the driver's calls on these handles are thread-safe.
unsafe impl Sync for Device {}

impl Device {
    /// Retains the primary context of device `ordinal` and makes it current.
    pub fn open(ordinal: i32) -> Result<Device> {
        let device = drv::device::get(ordinal).map_err(call("cuDeviceGet"))?;
        // SAFETY: `device` is a valid device handle from `cuDeviceGet`.
        let context = unsafe { drv::primary_ctx::retain(device) }
            .map_err(call("cuDevicePrimaryCtxRetain"))?;
        let opened = Device { device, context };
        opened.make_current()?;
        Ok(opened)
    }

    /// The device's name.
    pub fn name(&self) -> String {
        drv::device::get_name(self.device).unwrap_or_else(|_| "unknown CUDA device".to_owned())
    }

    /// Makes the context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context was retained in `open` and is released only in `drop`.
        unsafe { drv::ctx::set_current(self.context) }.map_err(call("cuCtxSetCurrent"))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the context was retained once in `open`; every object created in it was
        // destroyed by the runtime before this drop (its fields drop in order, the device last).
        if let Err(err) = unsafe { drv::primary_ctx::release(self.device) } {
            tracing::warn!(?err, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

/// A non-blocking stream.
#[derive(Debug)]
pub(crate) struct RawStream(sys::CUstream);

// SAFETY: a CUstream is an opaque handle usable from any thread with its context current.
unsafe impl Send for RawStream {}
// SAFETY: as above; stream operations are thread-safe in the driver.
unsafe impl Sync for RawStream {}

impl RawStream {
    pub fn new() -> Result<RawStream> {
        drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map(RawStream)
            .map_err(call("cuStreamCreate"))
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is live until `drop`.
        unsafe { drv::stream::synchronize(self.0) }.map_err(call("cuStreamSynchronize"))
    }

    pub fn wait(&self, event: &RawEvent) -> Result<()> {
        // SAFETY: both handles are live until their `drop`.
        unsafe {
            drv::stream::wait_event(
                self.0,
                event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(call("cuStreamWaitEvent"))
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        // SAFETY: the stream was created in `new` and is destroyed once, here.
        if let Err(err) = unsafe { drv::stream::destroy(self.0) } {
            tracing::warn!(?err, "cuStreamDestroy failed");
        }
    }
}

/// An event without timing.
#[derive(Debug)]
pub(crate) struct RawEvent(sys::CUevent);

// SAFETY: a CUevent is an opaque handle usable from any thread with its context current.
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    pub fn new() -> Result<RawEvent> {
        drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(RawEvent)
            .map_err(call("cuEventCreate"))
    }

    pub fn record(&self, stream: &RawStream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { drv::event::record(self.0, stream.0) }.map_err(call("cuEventRecord"))
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        unsafe { drv::event::synchronize(self.0) }.map_err(call("cuEventSynchronize"))
    }

    pub fn done(&self) -> Result<bool> {
        // SAFETY: the event is live.
        match unsafe { drv::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(err) if err.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(err) => Err(call("cuEventQuery")(err)),
        }
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        if let Err(err) = unsafe { drv::event::destroy(self.0) } {
            tracing::warn!(?err, "cuEventDestroy failed");
        }
    }
}

/// Zeroed device memory; answers its address.
pub(crate) fn alloc(bytes: usize) -> Result<u64> {
    // SAFETY: a plain allocation of a non-zero size in the current context.
    let allocated = unsafe { drv::malloc_sync(bytes.max(1)) };
    let ptr = allocated.map_err(|err| match call("cuMemAlloc")(err) {
        CudaError::OutOfMemory { what, .. } => CudaError::OutOfMemory {
            what,
            requested: bytes,
        },
        other => other,
    })?;
    // SAFETY: `ptr` addresses `bytes.max(1)` bytes just allocated.
    unsafe { drv::memset_d8_sync(ptr, 0, bytes.max(1)) }.map_err(call("cuMemsetD8"))?;
    Ok(ptr)
}

/// Frees device memory.
///
/// # Safety
///
/// `ptr` came from [`alloc`] and no queued work touches it any more.
pub(crate) unsafe fn free(ptr: u64) -> Result<()> {
    // SAFETY: as the caller guarantees.
    unsafe { drv::free_sync(ptr) }.map_err(call("cuMemFree"))
}

/// Zeroed pinned host memory; answers its address.
pub(crate) fn alloc_pinned(bytes: usize) -> Result<u64> {
    // SAFETY: a plain page-locked allocation of a non-zero size.
    let ptr = unsafe { drv::malloc_host(bytes.max(1), 0) }.map_err(|_| CudaError::OutOfMemory {
        what: "pinned host",
        requested: bytes,
    })?;
    // SAFETY: `ptr` addresses `bytes.max(1)` writable host bytes just allocated.
    unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes.max(1)) };
    Ok(ptr as u64)
}

/// Frees pinned host memory.
///
/// # Safety
///
/// `ptr` came from [`alloc_pinned`] and no queued copy touches it any more.
pub(crate) unsafe fn free_pinned(ptr: u64) -> Result<()> {
    // SAFETY: as the caller guarantees.
    unsafe { drv::free_host(ptr as *mut c_void) }.map_err(call("cuMemFreeHost"))
}

/// The kinds of asynchronous copy.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// Queues a copy of `bytes` bytes on `stream`.
///
/// # Safety
///
/// `dst` and `src` address `bytes` bytes of live memory of the kind `kind` names; host memory
/// stays valid until the copy has finished (pageable host-to-device sources are staged before
/// the call returns), and no host code accesses it meanwhile.
pub(crate) unsafe fn copy_async(
    kind: CopyKind,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &RawStream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: as the caller guarantees; the stream is live.
    unsafe {
        match kind {
            CopyKind::HostToDevice => {
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream.0)
                    .result()
                    .map_err(call("cuMemcpyHtoDAsync"))
            }
            CopyKind::DeviceToHost => {
                sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream.0)
                    .result()
                    .map_err(call("cuMemcpyDtoHAsync"))
            }
            CopyKind::DeviceToDevice => {
                drv::memcpy_dtod_async(dst, src, bytes, stream.0).map_err(call("cuMemcpyDtoDAsync"))
            }
        }
    }
}

/// Queues a memset of `bytes` bytes at `dst`.
///
/// # Safety
///
/// `dst` addresses `bytes` bytes of live device memory.
pub(crate) unsafe fn memset_async(
    dst: u64,
    value: u8,
    bytes: usize,
    stream: &RawStream,
) -> Result<()> {
    // SAFETY: as the caller guarantees.
    unsafe { drv::memset_d8_async(dst, value, bytes, stream.0) }.map_err(call("cuMemsetD8Async"))
}

/// A loaded PTX module.
#[derive(Debug)]
pub(crate) struct Module(sys::CUmodule);

// SAFETY: a CUmodule is an opaque handle usable from any thread with its context current.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

/// A kernel of a loaded module.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function(sys::CUfunction);

// SAFETY: a CUfunction is an opaque handle; it lives as long as its module, which the runtime
// keeps until after its last launch.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Module {
    /// JIT-compiles and loads PTX text.
    pub fn load(ptx: &str) -> Result<Module> {
        let text = CString::new(ptx).map_err(|_| CudaError::Call {
            call: "cuModuleLoadData",
            message: "the PTX contains a NUL byte".to_owned(),
        })?;
        // SAFETY: `text` is a NUL-terminated PTX image alive for the call.
        unsafe { drv::module::load_data(text.as_ptr().cast()) }
            .map(Module)
            .map_err(call("cuModuleLoadData"))
    }

    /// The function `name` of the module.
    pub fn function(&self, name: &str) -> Result<Function> {
        let name = CString::new(name).map_err(|_| CudaError::Call {
            call: "cuModuleGetFunction",
            message: "a kernel name contains a NUL byte".to_owned(),
        })?;
        // SAFETY: the module is live.
        unsafe { drv::module::get_function(self.0, name) }
            .map(Function)
            .map_err(call("cuModuleGetFunction"))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded in `load`, unloaded once here, after the runtime drained its streams.
        if let Err(err) = unsafe { drv::module::unload(self.0) } {
            tracing::warn!(?err, "cuModuleUnload failed");
        }
    }
}

/// Launches `function` with parameter cells `args` (one 8-byte cell per parameter).
///
/// # Safety
///
/// The cells hold the kernel's parameters (types as declared, native byte order, at most 8
/// bytes each), and every address the kernel computes lies in live device memory for as long as
/// it runs.
pub(crate) unsafe fn launch(
    function: Function,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: &[u64],
    stream: &RawStream,
) -> Result<()> {
    let mut cells: Vec<u64> = args.to_vec();
    let mut params: Vec<*mut c_void> = cells
        .iter_mut()
        .map(|cell| (cell as *mut u64).cast::<c_void>())
        .collect();
    // SAFETY: `params` points at cells alive for the call (the driver copies parameter values at
    // launch); the caller guarantees the rest.
    unsafe {
        drv::launch_kernel(
            function.0,
            (grid[0], grid[1], grid[2]),
            (block[0], block[1], block[2]),
            shared_bytes,
            stream.0,
            &mut params,
        )
    }
    .map_err(call("cuLaunchKernel"))
}

/// A cuBLAS handle.
#[derive(Debug)]
pub(crate) struct Blas(blas_sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread; the runtime serialises its use (binding a
// stream and enqueueing a GEMM) behind its mutex.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Blas {
    pub fn new() -> Result<Blas> {
        blas::create_handle()
            .map(Blas)
            .map_err(blas_call("cublasCreate"))
    }

    /// `c[m, n] = a[m, k] · b[n, k]ᵀ` (row-major) on `stream`. Row-major `c` is column-major
    /// `cᵀ` (n x m) `= b · aᵀ`, which cuBLAS computes as `op(B) · op(A)` with B = b's memory
    /// transposed (`CUBLAS_OP_T`) and A = a's memory as is (`CUBLAS_OP_N`).
    ///
    /// # Safety
    ///
    /// `a`, `b` and `c` address `m*k`, `n*k` (elements of `bf16` or f32) and `m*n` f32 of live
    /// device memory, and `c` overlaps neither input.
    #[allow(clippy::too_many_arguments)] // The GEMM's shape, pointers, type and stream.
    pub unsafe fn gemm_abt(
        &self,
        m: i32,
        n: i32,
        k: i32,
        a: u64,
        b: u64,
        c: u64,
        bf16: bool,
        stream: &RawStream,
    ) -> Result<()> {
        let input = if bf16 {
            blas_sys::cudaDataType::CUDA_R_16BF
        } else {
            blas_sys::cudaDataType::CUDA_R_32F
        };
        let alpha: f32 = 1.0;
        let beta: f32 = 0.0;
        // SAFETY: the handle is live; binding the stream is serialised by the caller's mutex.
        unsafe { blas::set_stream(self.0, stream.0.cast()) }
            .map_err(blas_call("cublasSetStream"))?;
        // SAFETY: column-major view: B (row-major [n, k]) is a k x n matrix, transposed to n x k
        // (lda = k); A (row-major [m, k]) is k x m, not transposed (ldb = k); C (row-major
        // [m, n]) is n x m (ldc = n). alpha and beta are host scalars alive for the call; the
        // caller guarantees the memory.
        unsafe {
            blas::gemm_ex(
                self.0,
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                (&alpha as *const f32).cast(),
                b as *const c_void,
                input,
                k,
                a as *const c_void,
                input,
                k,
                (&beta as *const f32).cast(),
                c as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                n,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_call("cublasGemmEx"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        if let Err(err) = unsafe { blas::destroy_handle(self.0) } {
            tracing::warn!(?err, "cublasDestroy failed");
        }
    }
}

/// Copies host bytes between two host addresses (pinned buffer access).
///
/// # Safety
///
/// Both ranges are valid for `bytes` bytes, do not overlap, and no device copy touches them.
pub(crate) unsafe fn host_copy(dst: u64, src: u64, bytes: usize) {
    // SAFETY: as the caller guarantees.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
}
