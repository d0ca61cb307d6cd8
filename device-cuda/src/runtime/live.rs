//! The table of live memory both runtimes keep, and the checks every copy, memset, launch and
//! GEMM makes before it touches memory: one definition, so `CudaRuntime` and `SimRuntime` refuse
//! the same calls with the same errors.
//!
//! # Invariants of `LiveMemory`
//!
//! - `allocations` maps every live device buffer's address to its length; the ranges are
//!   disjoint (each is one allocation of the runtime's allocator).
//! - `pinned` maps every live pinned buffer's id to its address, its length and what the runtime
//!   tracks of the copies in flight on it; ids are never reused (`next_pinned` only grows).

use std::collections::BTreeMap;

use crate::error::{CudaError, Result};
use crate::kernels::Kernel;
use crate::runtime::{DeviceBuffer, DeviceSlice, Gemm, KernelArg, PinnedBuffer};

/// One live pinned buffer.
#[derive(Debug)]
pub(crate) struct Pinned<C> {
    /// Its host address.
    pub(crate) address: u64,
    /// Its length in bytes.
    pub(crate) bytes: usize,
    /// What the runtime tracks of the copies in flight on it, so host access waits for exactly
    /// those: on a device, the event recorded after the latest copy on each stream; on the host
    /// runtime, the number of queued copies.
    pub(crate) in_flight: C,
}

/// The live device and pinned buffers of a runtime. See the module docs.
#[derive(Debug)]
pub(crate) struct LiveMemory<C> {
    pub(crate) allocations: BTreeMap<u64, usize>,
    pub(crate) pinned: BTreeMap<u32, Pinned<C>>,
    next_pinned: u32,
}

impl<C> Default for LiveMemory<C> {
    fn default() -> Self {
        LiveMemory {
            allocations: BTreeMap::new(),
            pinned: BTreeMap::new(),
            next_pinned: 0,
        }
    }
}

impl<C> LiveMemory<C> {
    /// Enters a new device allocation.
    pub(crate) fn insert_allocation(&mut self, ptr: u64, bytes: usize) -> DeviceBuffer {
        self.allocations.insert(ptr, bytes);
        DeviceBuffer { ptr, bytes }
    }

    /// Takes `buffer` out of the table; answers its length, or an error when it is not live.
    pub(crate) fn remove_allocation(&mut self, buffer: &DeviceBuffer) -> Result<usize> {
        self.allocations.remove(&buffer.ptr).ok_or_else(|| {
            CudaError::BadRange(format!(
                "free of {:#x}, which is not a live allocation",
                buffer.ptr
            ))
        })
    }

    /// Whether `slice` lies inside one live allocation; the error names `what` it was for.
    pub(crate) fn check_live(&self, slice: DeviceSlice, what: &str) -> Result<()> {
        // The last allocation starting at or below the slice is the only one that can hold it.
        match self.allocations.range(..=slice.ptr).next_back() {
            Some((&base, &len)) if slice.ptr + slice.bytes as u64 <= base + len as u64 => Ok(()),
            _ => Err(CudaError::BadRange(format!(
                "{what}: {} bytes at {:#x} are not inside a live allocation",
                slice.bytes, slice.ptr
            ))),
        }
    }

    /// Whether every pointer argument of a launch of `kernel` lies inside one live allocation.
    pub(crate) fn check_kernel_args(&self, kernel: Kernel, args: &[KernelArg]) -> Result<()> {
        for arg in args {
            if let KernelArg::Ptr(slice) = arg {
                self.check_live(*slice, kernel.name())?;
            }
        }
        Ok(())
    }

    /// Whether the three matrices of `gemm` lie inside live allocations.
    pub(crate) fn check_gemm(&self, gemm: &Gemm) -> Result<()> {
        self.check_live(gemm.a, "GEMM a")?;
        self.check_live(gemm.b, "GEMM b")?;
        self.check_live(gemm.c, "GEMM c")
    }

    /// Enters a new pinned buffer under the next id.
    pub(crate) fn insert_pinned(
        &mut self,
        address: u64,
        bytes: usize,
        in_flight: C,
    ) -> PinnedBuffer {
        let id = self.next_pinned;
        self.next_pinned += 1;
        self.pinned.insert(
            id,
            Pinned {
                address,
                bytes,
                in_flight,
            },
        );
        PinnedBuffer { id, bytes }
    }

    /// Takes `buffer` out of the table, or an error when it is not live.
    pub(crate) fn remove_pinned(&mut self, buffer: &PinnedBuffer) -> Result<Pinned<C>> {
        self.pinned
            .remove(&buffer.id)
            .ok_or_else(|| not_live_pinned(buffer))
    }

    /// The host address of `bytes` bytes at `offset` of the live pinned `buffer`, or an error when
    /// the buffer is not live or the range runs past its end.
    pub(crate) fn pinned_range(
        &self,
        buffer: &PinnedBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<u64> {
        let pinned = self
            .pinned
            .get(&buffer.id)
            .ok_or_else(|| not_live_pinned(buffer))?;
        sub_range(
            pinned.address,
            pinned.bytes,
            offset,
            bytes,
            "a pinned buffer",
        )
    }
}

fn not_live_pinned(buffer: &PinnedBuffer) -> CudaError {
    CudaError::BadRange(format!("pinned buffer {} is not live", buffer.id))
}

/// The address of `bytes` bytes at `offset` of the `len` bytes at `base`, or an error naming
/// `region` (what those `len` bytes are) when the range runs past their end.
pub(crate) fn sub_range(
    base: u64,
    len: usize,
    offset: usize,
    bytes: usize,
    region: &str,
) -> Result<u64> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(base + offset as u64),
        _ => Err(CudaError::BadRange(format!(
            "{bytes} bytes at offset {offset} of {region} of {len}"
        ))),
    }
}

/// An upload copies exactly the host bytes it is given.
pub(crate) fn check_upload(dst: DeviceSlice, src: &[u8]) -> Result<()> {
    if dst.bytes != src.len() {
        return Err(CudaError::BadRange(format!(
            "upload of {} host bytes into {} device bytes",
            src.len(),
            dst.bytes
        )));
    }
    Ok(())
}

/// A download fills exactly the host bytes it is given.
pub(crate) fn check_download(dst: &[u8], src: DeviceSlice) -> Result<()> {
    if dst.len() != src.bytes {
        return Err(CudaError::BadRange(format!(
            "download of {} device bytes into {} host bytes",
            src.bytes,
            dst.len()
        )));
    }
    Ok(())
}

/// A device copy is between two slices of the same length that share no byte.
pub(crate) fn check_copy(dst: DeviceSlice, src: DeviceSlice) -> Result<()> {
    if dst.bytes != src.bytes || dst.overlaps(&src) {
        return Err(CudaError::BadRange(format!(
            "copy of {} bytes into {} bytes (or overlapping)",
            src.bytes, dst.bytes
        )));
    }
    Ok(())
}
