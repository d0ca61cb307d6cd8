//! Raw operations of `SimRuntime`: device memory is host memory addressed by integers, kernels are
//! the C++ launchers that `build.rs` generated from `kernels/*.cu`, the GEMM is matrixmultiply's.
//!
//! Every function here takes addresses the caller validated against its allocation table (see
//! `runtime::sim`); the `# Safety` sections say exactly what that must guarantee.

use std::alloc::Layout;

use crate::error::{CudaError, Result};

/// Alignment of every allocation (as `cudaMalloc`'s, at least 256 bytes).
pub(crate) const ALIGN: usize = 256;

/// A host launcher generated from a `__global__` function.
pub(crate) type SimLaunch =
    unsafe extern "C" fn(u32, u32, u32, u32, u32, u32, u32, *const *mut core::ffi::c_void) -> i32;

/// One kernel of the emulation.
#[derive(Clone, Copy)]
pub(crate) struct SimKernel {
    /// The file it lives in (`kernels/<module>.cu`).
    pub module: &'static str,
    /// Its `extern "C"` name.
    pub name: &'static str,
    /// Its host launcher.
    pub launch: SimLaunch,
}

impl std::fmt::Debug for SimKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}::{}", self.module, self.name)
    }
}

include!(concat!(env!("OUT_DIR"), "/sim_kernels.rs"));

fn layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| CudaError::OutOfMemory {
        what: "device",
        requested: bytes,
    })
}

/// Allocates `bytes` zeroed bytes aligned to [`ALIGN`]; answers the address.
pub(crate) fn alloc_zeroed(bytes: usize) -> Result<u64> {
    let layout = layout(bytes)?;
    // SAFETY: `layout` has a non-zero size (at least 1 byte) and a valid power-of-two alignment.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(CudaError::OutOfMemory {
            what: "device",
            requested: bytes,
        });
    }
    Ok(ptr as u64)
}

/// Frees an allocation of [`alloc_zeroed`].
///
/// # Safety
///
/// 1. `address` came from `alloc_zeroed(bytes)` with this very `bytes` and was not freed since.
/// 2. Nothing reads or writes the memory any more.
pub(crate) unsafe fn free(address: u64, bytes: usize) {
    let Ok(layout) = layout(bytes) else {
        return;
    };
    // SAFETY: by 1 the pointer and layout are the allocation's; by 2 no access follows.
    unsafe { std::alloc::dealloc(address as *mut u8, layout) };
}

/// Copies `bytes` bytes from `src` to `dst`.
///
/// # Safety
///
/// Both ranges lie inside live allocations (or valid host memory), do not overlap, and no other
/// thread accesses them during the call.
pub(crate) unsafe fn copy(dst: u64, src: u64, bytes: usize) {
    // SAFETY: the caller guarantees valid, disjoint, unshared ranges.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
}

/// Sets `bytes` bytes at `dst` to `value`.
///
/// # Safety
///
/// The range lies inside a live allocation and no other thread accesses it during the call.
pub(crate) unsafe fn fill(dst: u64, value: u8, bytes: usize) {
    // SAFETY: the caller guarantees a valid, unshared range.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
}

/// A host address that crosses to the worker thread while the host thread waits for the work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostAddress(pub u64);

impl HostAddress {
    /// The address of a host slice's first byte.
    pub fn of(bytes: &mut [u8]) -> Self {
        HostAddress(bytes.as_mut_ptr() as u64)
    }
}

/// Runs a kernel's grid on the calling thread.
///
/// # Safety
///
/// `args` holds one 8-byte cell per kernel parameter, each holding the parameter's bytes in native
/// order (the parameter types are those of the kernel, as [`crate::Runtime::launch`] requires), and
/// every address the kernel computes from them lies in live memory no other thread touches while
/// it runs.
pub(crate) unsafe fn launch(
    kernel: &SimKernel,
    dims: &crate::LaunchDims,
    args: &[u64],
) -> Result<()> {
    let mut cells: Vec<u64> = args.to_vec();
    let pointers: Vec<*mut core::ffi::c_void> = cells
        .iter_mut()
        .map(|cell| (cell as *mut u64).cast::<core::ffi::c_void>())
        .collect();
    let [gx, gy, gz] = dims.grid;
    let [bx, by, bz] = dims.block;
    // SAFETY: each pointer addresses an 8-byte cell of `cells`, alive for the call, from which
    // the launcher reads one parameter of at most 8 bytes; the caller guarantees the rest.
    let launch = kernel.launch;
    // SAFETY: (see above) the cells outlive the call; the caller guarantees the kernel's memory.
    let status = unsafe { launch(gx, gy, gz, bx, by, bz, dims.shared_bytes, pointers.as_ptr()) };
    match status {
        0 => Ok(()),
        1 => Err(CudaError::BadLaunch {
            kernel: kernel.name,
            detail: format!(
                "the emulation refused grid {:?} block {:?}",
                dims.grid, dims.block
            ),
        }),
        2 => Err(CudaError::Call {
            call: kernel.name,
            message: "deadlock: some threads wait at a barrier the others never reach".to_owned(),
        }),
        other => Err(CudaError::Call {
            call: kernel.name,
            message: format!("the emulation failed with status {other}"),
        }),
    }
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ` in f32 (row-major).
///
/// # Safety
///
/// `a`, `b` and `c` address `m*k`, `n*k` and `m*n` f32 values in live memory; `c` overlaps
/// neither input; no other thread accesses them during the call.
pub(crate) unsafe fn sgemm_abt(m: usize, n: usize, k: usize, a: u64, b: u64, c: u64) {
    // SAFETY: the strides describe row-major a [m, k], b viewed as bᵀ [k, n] (column stride k),
    // and c [m, n]; the caller guarantees the memory.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a as *const f32,
            k as isize,
            1,
            b as *const f32,
            1,
            k as isize,
            0.0,
            c as *mut f32,
            n as isize,
            1,
        );
    }
}

/// Widens `count` bf16 values at `src` into f32 values in `out`.
///
/// # Safety
///
/// `src` addresses `count` u16 values of live memory that no other thread writes during the call.
pub(crate) unsafe fn widen_bf16(src: u64, count: usize, out: &mut Vec<f32>) {
    // SAFETY: the caller guarantees `count` readable u16 values at `src`; the allocation is
    // 256-byte aligned and slices handed here start at even offsets, so the pointer is aligned.
    let bits = unsafe { std::slice::from_raw_parts(src as *const u16, count) };
    out.clear();
    out.extend(bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()));
}

/// The address of a host vector's data, for [`sgemm_abt`] on temporaries.
pub(crate) fn address_of(values: &[f32]) -> u64 {
    values.as_ptr() as u64
}
