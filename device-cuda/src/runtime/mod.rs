//! The runtime trait the CUDA router is written against (one trait, two backends, in the spirit of
//! wgpu-hal): device memory, pinned host buffers, two streams with events between them, kernel
//! launch by name with a grid, a block, shared memory and arguments, and a GEMM.
//!
//! - [`CudaRuntime`](crate::CudaRuntime): the driver API and cuBLAS through `cudarc`, loaded at
//!   run time.
//! - [`SimRuntime`](crate::SimRuntime): the host. Device memory is host memory, each stream is a
//!   worker thread draining an in-order queue, events are real (a stream waiting on an event
//!   blocks until the other stream has passed the record), the GEMM is a host sgemm, and kernels
//!   are the same CUDA C sources compiled as C++ against the SIMT emulation header.
//!
//! # Safety model
//!
//! Memory is handed out as [`DeviceBuffer`]s; a [`DeviceSlice`] is a checked view of one. Every
//! copy, memset and GEMM validates its slices against the runtime's table of live allocations, so
//! those calls are safe. A kernel can read and write anywhere its pointers lead, so
//! [`Runtime::launch`] is `unsafe`: the typed wrappers of [`crate::kernels`] check sizes and call
//! it. Freeing a buffer waits for both streams first (as `cuMemFree` does).
//!
//! # Ordering
//!
//! Work on one stream runs in order; the two streams run concurrently. [`Runtime::upload`] returns
//! once the host bytes are consumed, [`Runtime::download`] once the bytes arrived. Copies to and
//! from pinned buffers are asynchronous; [`Runtime::read_pinned`] and [`Runtime::write_pinned`]
//! first wait for every copy issued on that buffer.

use std::fmt;

use crate::error::{CudaError, Result};
use crate::kernels::Kernel;

pub(crate) mod cuda;
mod live;
pub(crate) mod sim;

/// One of the router's two streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Steps (kernels and GEMMs) and the copies that belong to them.
    Compute,
    /// Spill and restore traffic, so it overlaps compute.
    Copy,
}

impl Stream {
    /// Both streams, in index order.
    pub const ALL: [Stream; 2] = [Stream::Compute, Stream::Copy];

    /// The stream's index (its number in `Quiesce { stream }`).
    pub fn index(self) -> usize {
        match self {
            Stream::Compute => 0,
            Stream::Copy => 1,
        }
    }

    /// The stream with index `index`.
    pub fn from_index(index: u64) -> Option<Stream> {
        match index {
            0 => Some(Stream::Compute),
            1 => Some(Stream::Copy),
            _ => None,
        }
    }
}

/// An allocation of device memory. Not `Clone`: it is freed once, with [`Runtime::free`] (a runtime
/// frees whatever is left when it is dropped).
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

impl DeviceBuffer {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The whole buffer as a slice.
    pub fn all(&self) -> DeviceSlice {
        DeviceSlice {
            ptr: self.ptr,
            bytes: self.bytes,
        }
    }

    /// `bytes` bytes at `offset`, or an error when that runs past the end.
    pub fn range(&self, offset: usize, bytes: usize) -> Result<DeviceSlice> {
        let ptr = live::sub_range(self.ptr, self.bytes, offset, bytes, "a buffer")?;
        Ok(DeviceSlice { ptr, bytes })
    }
}

/// A view of device memory: an address and a length. Runtimes check it against live allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

impl DeviceSlice {
    /// Its length in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device address (for kernel arguments).
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// `bytes` bytes at `offset` inside this slice.
    pub fn range(&self, offset: usize, bytes: usize) -> Result<DeviceSlice> {
        let ptr = live::sub_range(self.ptr, self.bytes, offset, bytes, "a slice")?;
        Ok(DeviceSlice { ptr, bytes })
    }

    /// Whether the two slices share a byte.
    pub fn overlaps(&self, other: &DeviceSlice) -> bool {
        self.ptr < other.ptr + other.bytes as u64 && other.ptr < self.ptr + self.bytes as u64
    }
}

/// A page-locked host buffer, the source and target of asynchronous copies (spill images, logits).
#[derive(Debug, PartialEq, Eq)]
pub struct PinnedBuffer {
    pub(crate) id: u32,
    pub(crate) bytes: usize,
}

impl PinnedBuffer {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// An event: recorded on a stream, waited on by the other stream or by the host.
#[derive(Debug, PartialEq, Eq)]
pub struct Event {
    pub(crate) id: u32,
}

/// Grid and block dimensions and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchDims {
    /// A one-dimensional launch.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchDims {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_bytes: 0,
        }
    }

    /// Checks the limits every CUDA device of compute capability 8.0 and later has.
    pub(crate) fn check(&self, kernel: &'static str) -> Result<()> {
        let threads = self.block.iter().map(|&d| u64::from(d)).product::<u64>();
        let bad = |detail: String| CudaError::BadLaunch { kernel, detail };
        if self.grid.contains(&0) || self.block.contains(&0) {
            return Err(bad(format!(
                "empty grid {:?} or block {:?}",
                self.grid, self.block
            )));
        }
        if threads > 1024 || self.block[2] > 64 {
            return Err(bad(format!(
                "block {:?} has {threads} threads (at most 1024, z at most 64)",
                self.block
            )));
        }
        if self.grid[1] > 65535 || self.grid[2] > 65535 {
            return Err(bad(format!(
                "grid {:?}: y and z are at most 65535",
                self.grid
            )));
        }
        if self.shared_bytes > 227 * 1024 {
            return Err(bad(format!(
                "{} bytes of dynamic shared memory (at most 227 KiB)",
                self.shared_bytes
            )));
        }
        Ok(())
    }
}

/// One kernel argument, passed by value as CUDA does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// A device pointer.
    Ptr(DeviceSlice),
    /// A null pointer (optional outputs).
    Null,
    /// `unsigned int`.
    U32(u32),
    /// `int`.
    I32(i32),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl KernelArg {
    /// The argument's bytes as the kernel reads them (8 bytes of storage, native order).
    pub(crate) fn storage(&self) -> u64 {
        match *self {
            KernelArg::Ptr(slice) => slice.ptr,
            KernelArg::Null => 0,
            KernelArg::U32(v) => u64::from(v),
            KernelArg::I32(v) => u64::from(v as u32),
            KernelArg::U64(v) => v,
            KernelArg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

/// The element type of a GEMM's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16 (raw 16 bits), accumulated in f32.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ` (all row-major): activations times a weight matrix stored
/// `[out, in]` as checkpoints store it. `a` and `b` have element type `dtype`, `c` is f32 and
/// overlaps neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// Rows of `a` and `c`.
    pub m: usize,
    /// Rows of `b`, columns of `c`.
    pub n: usize,
    /// The shared inner dimension.
    pub k: usize,
    /// Element type of `a` and `b`.
    pub dtype: DType,
    /// `[m, k]`.
    pub a: DeviceSlice,
    /// `[n, k]`.
    pub b: DeviceSlice,
    /// `[m, n]` f32, overwritten.
    pub c: DeviceSlice,
}

impl Gemm {
    /// Checks the slices' sizes against the shape.
    pub(crate) fn check(&self) -> Result<()> {
        let elem = self.dtype.bytes();
        let need = |rows: usize, cols: usize, elem: usize| {
            rows.checked_mul(cols).and_then(|x| x.checked_mul(elem))
        };
        let bad = |what: &str, have: usize, need: Option<usize>| {
            CudaError::BadRange(format!(
                "GEMM {}x{}x{}: {what} has {have} bytes, needs {}",
                self.m,
                self.n,
                self.k,
                need.map_or("more than memory".to_owned(), |n| n.to_string())
            ))
        };
        for (what, slice, rows, cols, elem) in [
            ("a", self.a, self.m, self.k, elem),
            ("b", self.b, self.n, self.k, elem),
            ("c", self.c, self.m, self.n, 4),
        ] {
            let needed = need(rows, cols, elem);
            if needed != Some(slice.bytes) {
                return Err(bad(what, slice.bytes, needed));
            }
        }
        for (what, slice, align) in [("a", self.a, elem), ("b", self.b, elem), ("c", self.c, 4)] {
            if slice.ptr % align as u64 != 0 {
                return Err(CudaError::BadRange(format!(
                    "GEMM {what} at {:#x} is not {align}-byte aligned",
                    slice.ptr
                )));
            }
        }
        if self.c.overlaps(&self.a) || self.c.overlaps(&self.b) {
            return Err(CudaError::BadRange(
                "GEMM output overlaps an input".to_owned(),
            ));
        }
        if self.m == 0
            || self.n == 0
            || self.k == 0
            || i32::try_from(self.m.max(self.n).max(self.k)).is_err()
        {
            return Err(CudaError::BadRange(format!(
                "GEMM {}x{}x{}: every dimension must be in 1..=2^31-1",
                self.m, self.n, self.k
            )));
        }
        Ok(())
    }
}

/// Which backend a runtime is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeKind {
    /// The host emulation.
    Sim,
    /// A CUDA device.
    Cuda,
}

/// Device memory, pinned buffers, streams, events, kernels and GEMMs. See the module docs.
pub trait Runtime: Send + Sync + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> RuntimeKind;

    /// The device's name, for logs and reports.
    fn device_name(&self) -> String;

    /// `bytes` bytes of device memory, zeroed.
    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer>;

    /// Frees a buffer after both streams have finished their work.
    fn free(&self, buffer: DeviceBuffer) -> Result<()>;

    /// `bytes` bytes of pinned host memory, zeroed.
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer>;

    /// Frees a pinned buffer after the copies issued on it have finished.
    fn free_pinned(&self, buffer: PinnedBuffer) -> Result<()>;

    /// Sets every byte of `dst` to `value`, in stream order.
    fn memset(&self, dst: DeviceSlice, value: u8, stream: Stream) -> Result<()>;

    /// Copies host bytes to `dst` (same length), in stream order; returns once `src` is consumed.
    fn upload(&self, dst: DeviceSlice, src: &[u8], stream: Stream) -> Result<()>;

    /// Copies `src` to host bytes (same length) in stream order and waits for them.
    fn download(&self, dst: &mut [u8], src: DeviceSlice, stream: Stream) -> Result<()>;

    /// Copies device bytes (same length, no overlap), in stream order.
    fn copy(&self, dst: DeviceSlice, src: DeviceSlice, stream: Stream) -> Result<()>;

    /// Copies `src` into `dst` at `offset`, asynchronously in stream order.
    fn copy_to_pinned(
        &self,
        dst: &PinnedBuffer,
        offset: usize,
        src: DeviceSlice,
        stream: Stream,
    ) -> Result<()>;

    /// Copies `dst.bytes()` bytes of `src` at `offset` into `dst`, asynchronously in stream order.
    fn copy_from_pinned(
        &self,
        dst: DeviceSlice,
        src: &PinnedBuffer,
        offset: usize,
        stream: Stream,
    ) -> Result<()>;

    /// Reads pinned bytes at `offset` after the copies issued on the buffer have finished.
    fn read_pinned(&self, src: &PinnedBuffer, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Writes pinned bytes at `offset` after the copies issued on the buffer have finished.
    fn write_pinned(&self, dst: &PinnedBuffer, offset: usize, src: &[u8]) -> Result<()>;

    /// A new event (not yet recorded: waiting on it returns at once).
    fn new_event(&self) -> Result<Event>;

    /// Destroys an event.
    fn destroy_event(&self, event: Event) -> Result<()>;

    /// Records `event` at the current end of `stream`.
    fn record(&self, event: &Event, stream: Stream) -> Result<()>;

    /// Makes `stream` wait, before its later work, until `event`'s latest record has passed.
    fn wait_event(&self, stream: Stream, event: &Event) -> Result<()>;

    /// Blocks the host until `event`'s latest record has passed.
    fn sync_event(&self, event: &Event) -> Result<()>;

    /// Whether `event`'s latest record has passed.
    fn event_done(&self, event: &Event) -> Result<bool>;

    /// Blocks the host until `stream` has no work left.
    fn sync_stream(&self, stream: Stream) -> Result<()>;

    /// Launches `kernel` on `stream`.
    ///
    /// # Safety
    ///
    /// 1. `args` match the kernel's parameters in number, order and type.
    /// 2. Every address the kernel computes from its pointer arguments lies inside a live
    ///    allocation of this runtime, for the whole time the kernel runs (until a later
    ///    [`Runtime::sync_stream`] or event says it finished).
    /// 3. No other stream writes memory the kernel reads, or touches memory it writes, meanwhile.
    unsafe fn launch(
        &self,
        kernel: Kernel,
        dims: LaunchDims,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<()>;

    /// Runs a GEMM on `stream` (see [`Gemm`]).
    fn gemm(&self, gemm: &Gemm, stream: Stream) -> Result<()>;
}
