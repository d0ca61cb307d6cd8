//! The runtime's error type: why a device could not be opened, and what a device call refused.

/// An error of a [`Runtime`](crate::Runtime) or of opening one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library could not be loaded (no NVIDIA driver on this machine).
    #[error("no CUDA driver: none of the driver library names could be loaded ({searched})")]
    NoDriver {
        /// The library names that were tried.
        searched: String,
    },
    /// The driver is older than the checked-in PTX needs.
    #[error(
        "the CUDA driver supports CUDA {}.{}, the kernels need {}.{} or newer (update the driver)",
        found / 1000, (found % 1000) / 10, needed / 1000, (needed % 1000) / 10
    )]
    DriverTooOld {
        /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12020).
        found: i32,
        /// The oldest version that can JIT the PTX.
        needed: i32,
    },
    /// The driver loaded but reports no usable device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A kernel module has no checked-in PTX (run `cargo xtask codegen`).
    #[error("kernel module {module} has no PTX; run `cargo xtask codegen`")]
    MissingPtx {
        /// The module (`kernels/<module>.cu`).
        module: String,
    },
    /// A driver, cuBLAS or emulation call failed.
    #[error("{call} failed: {message}")]
    Call {
        /// The call that failed.
        call: &'static str,
        /// What it said.
        message: String,
    },
    /// Device (or pinned host) memory ran out.
    #[error("out of {what} memory: {requested} bytes requested")]
    OutOfMemory {
        /// `device` or `pinned host`.
        what: &'static str,
        /// The size of the failed allocation.
        requested: usize,
    },
    /// A range does not lie inside one live allocation, or two ranges that must not overlap do.
    #[error("bad memory range: {0}")]
    BadRange(String),
    /// A kernel launch was refused before it started (unknown kernel, bad grid or block).
    #[error("bad launch of {kernel}: {detail}")]
    BadLaunch {
        /// The kernel.
        kernel: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// An event handle that this runtime did not create, or that was destroyed.
    #[error("unknown event {0}")]
    UnknownEvent(u32),
    /// An earlier asynchronous operation failed; the runtime is unusable (a sticky error, as CUDA's).
    #[error("the device failed earlier: {0}")]
    Sticky(String),
}

/// The runtime's result type.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;
