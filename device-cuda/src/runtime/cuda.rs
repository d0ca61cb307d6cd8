//! `CudaRuntime`: the runtime on a CUDA device, through `cudarc` with the driver and cuBLAS
//! loaded at run time.
//!
//! Opening it checks, in order, that the driver library loads ([`CudaError::NoDriver`]), that it
//! is recent enough for the checked-in PTX ([`CudaError::DriverTooOld`]), that a device exists
//! ([`CudaError::NoDevice`]), and that every kernel module has PTX ([`CudaError::MissingPtx`]);
//! then it retains device 0's primary context, creates the compute and copy streams, JIT-loads
//! the PTX and creates a cuBLAS handle. None of these steps panics.
//!
//! # Invariants of `State`
//!
//! - `memory` holds the live device and pinned buffers (see `live`); of each pinned buffer it
//!   keeps the events recorded after the latest copy that touched it on each stream (so host
//!   access waits for exactly those copies).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::error::{CudaError, Result};
use crate::kernels::Kernel;
use crate::raw::cuda::{
    self as raw, Blas, CopyKind, Device, Function, Module, RawEvent, RawStream,
};
use crate::runtime::live::{check_copy, check_download, check_upload, LiveMemory};
use crate::runtime::{
    DType, DeviceBuffer, DeviceSlice, Event, Gemm, KernelArg, LaunchDims, PinnedBuffer, Runtime,
    RuntimeKind, Stream,
};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx_modules.rs"));
}

/// The checked-in PTX of each kernel module (`None` where `cargo xtask codegen` has not run).
pub fn ptx_modules() -> &'static [(&'static str, Option<&'static str>)] {
    ptx::PTX_MODULES
}

/// Of each pinned buffer, the event recorded after the latest copy that touched it on each stream.
type AfterCopies = [Option<RawEvent>; 2];

#[derive(Debug, Default)]
struct State {
    memory: LiveMemory<AfterCopies>,
    events: BTreeMap<u32, RawEvent>,
    next_event: u32,
}

/// The runtime on a CUDA device. See the module docs.
///
/// Field order is drop order: everything created in the context goes before `device`, whose drop
/// releases the context.
#[derive(Debug)]
pub struct CudaRuntime {
    state: Mutex<State>,
    functions: Vec<Function>,
    blas: Blas,
    /// Kept loaded for as long as `functions` point into them.
    _modules: Vec<Module>,
    streams: [RawStream; 2],
    name: String,
    driver_version: i32,
    device: Device,
}

impl CudaRuntime {
    /// Opens device 0. Every failure is a typed error (see the module docs).
    pub fn new() -> Result<CudaRuntime> {
        let driver_version = raw::open_driver()?;
        for (module, ptx) in ptx_modules() {
            if ptx.is_none() {
                return Err(CudaError::MissingPtx {
                    module: (*module).to_owned(),
                });
            }
        }
        let device = Device::open(0)?;
        let name = device.name();
        let streams = [RawStream::new()?, RawStream::new()?];
        let mut modules = Vec::new();
        let mut loaded: BTreeMap<&str, usize> = BTreeMap::new();
        for (module, ptx) in ptx_modules() {
            let ptx = ptx.unwrap_or_default();
            loaded.insert(module, modules.len());
            modules.push(Module::load(ptx)?);
        }
        let functions =
            Kernel::ALL
                .iter()
                .map(|kernel| {
                    let index = loaded.get(kernel.module()).copied().ok_or_else(|| {
                        CudaError::MissingPtx {
                            module: kernel.module().to_owned(),
                        }
                    })?;
                    modules[index].function(kernel.name())
                })
                .collect::<Result<Vec<_>>>()?;
        let blas = Blas::new()?;
        tracing::info!(device = %name, driver_version, "CUDA runtime ready");
        Ok(CudaRuntime {
            state: Mutex::new(State::default()),
            functions,
            blas,
            _modules: modules,
            streams,
            name,
            driver_version,
            device,
        })
    }

    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12040).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.device.make_current()?;
        Ok(self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    fn stream(&self, stream: Stream) -> &RawStream {
        &self.streams[stream.index()]
    }

    fn sync_all(&self) -> Result<()> {
        for stream in &self.streams {
            stream.synchronize()?;
        }
        Ok(())
    }

    /// Records, on `stream`, the event after the latest copy touching pinned buffer `id`.
    fn mark_pinned(&self, state: &mut State, id: u32, stream: Stream) -> Result<()> {
        let Some(pinned) = state.memory.pinned.get_mut(&id) else {
            return Ok(());
        };
        let slot = &mut pinned.in_flight[stream.index()];
        if slot.is_none() {
            *slot = Some(RawEvent::new()?);
        }
        if let Some(event) = slot {
            event.record(self.stream(stream))?;
        }
        Ok(())
    }

    fn wait_pinned(state: &State, id: u32) -> Result<()> {
        if let Some(pinned) = state.memory.pinned.get(&id) {
            for event in pinned.in_flight.iter().flatten() {
                event.synchronize()?;
            }
        }
        Ok(())
    }
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        if self.device.make_current().is_err() {
            return;
        }
        if let Err(err) = self.sync_all() {
            tracing::warn!(%err, "draining the streams at drop failed");
        }
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for (address, _) in std::mem::take(&mut state.memory.allocations) {
            // SAFETY: both streams are drained, so no queued work touches the buffer.
            if let Err(err) = unsafe { raw::free(address) } {
                tracing::warn!(%err, "cuMemFree at drop failed");
            }
        }
        for (_, pinned) in std::mem::take(&mut state.memory.pinned) {
            // SAFETY: as above, for pinned buffers.
            if let Err(err) = unsafe { raw::free_pinned(pinned.address) } {
                tracing::warn!(%err, "cuMemFreeHost at drop failed");
            }
        }
        state.events.clear();
    }
}

impl Runtime for CudaRuntime {
    fn kind(&self) -> RuntimeKind {
        RuntimeKind::Cuda
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let mut state = self.lock()?;
        let ptr = raw::alloc(bytes)?;
        Ok(state.memory.insert_allocation(ptr, bytes))
    }

    fn free(&self, buffer: DeviceBuffer) -> Result<()> {
        let mut state = self.lock()?;
        state.memory.remove_allocation(&buffer)?;
        self.sync_all()?;
        // SAFETY: the buffer left the table (no new work can name it) and both streams drained.
        unsafe { raw::free(buffer.ptr) }
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        let mut state = self.lock()?;
        let address = raw::alloc_pinned(bytes)?;
        Ok(state.memory.insert_pinned(address, bytes, [None, None]))
    }

    fn free_pinned(&self, buffer: PinnedBuffer) -> Result<()> {
        let mut state = self.lock()?;
        Self::wait_pinned(&state, buffer.id)?;
        let pinned = state.memory.remove_pinned(&buffer)?;
        // SAFETY: every copy issued on the buffer finished (waited above) and it left the table.
        unsafe { raw::free_pinned(pinned.address) }
    }

    fn memset(&self, dst: DeviceSlice, value: u8, stream: Stream) -> Result<()> {
        let state = self.lock()?;
        state.memory.check_live(dst, "memset")?;
        // SAFETY: the range lies in a live allocation.
        unsafe { raw::memset_async(dst.ptr, value, dst.bytes, self.stream(stream)) }
    }

    fn upload(&self, dst: DeviceSlice, src: &[u8], stream: Stream) -> Result<()> {
        check_upload(dst, src)?;
        let state = self.lock()?;
        state.memory.check_live(dst, "upload")?;
        // SAFETY: the destination is live; the pageable source is staged by the driver before
        // `cuMemcpyHtoDAsync` returns, so `src` may be dropped afterwards.
        unsafe {
            raw::copy_async(
                CopyKind::HostToDevice,
                dst.ptr,
                src.as_ptr() as u64,
                src.len(),
                self.stream(stream),
            )
        }
    }

    fn download(&self, dst: &mut [u8], src: DeviceSlice, stream: Stream) -> Result<()> {
        check_download(dst, src)?;
        let state = self.lock()?;
        state.memory.check_live(src, "download")?;
        // SAFETY: the source is live; `dst` is borrowed mutably until the stream is synchronised
        // below, so the copy finishes before the borrow ends.
        unsafe {
            raw::copy_async(
                CopyKind::DeviceToHost,
                dst.as_mut_ptr() as u64,
                src.ptr,
                src.bytes,
                self.stream(stream),
            )?;
        }
        drop(state);
        self.stream(stream).synchronize()
    }

    fn copy(&self, dst: DeviceSlice, src: DeviceSlice, stream: Stream) -> Result<()> {
        check_copy(dst, src)?;
        let state = self.lock()?;
        state.memory.check_live(dst, "copy destination")?;
        state.memory.check_live(src, "copy source")?;
        // SAFETY: both ranges are live device memory of equal length.
        unsafe {
            raw::copy_async(
                CopyKind::DeviceToDevice,
                dst.ptr,
                src.ptr,
                src.bytes,
                self.stream(stream),
            )
        }
    }

    fn copy_to_pinned(
        &self,
        dst: &PinnedBuffer,
        offset: usize,
        src: DeviceSlice,
        stream: Stream,
    ) -> Result<()> {
        let mut state = self.lock()?;
        state.memory.check_live(src, "copy to pinned")?;
        let address = state.memory.pinned_range(dst, offset, src.bytes)?;
        // SAFETY: the source is live device memory and the destination lies in a live pinned
        // buffer, which host code touches only after waiting for the event recorded below, and
        // which is freed only after that wait.
        unsafe {
            raw::copy_async(
                CopyKind::DeviceToHost,
                address,
                src.ptr,
                src.bytes,
                self.stream(stream),
            )?
        };
        self.mark_pinned(&mut state, dst.id, stream)
    }

    fn copy_from_pinned(
        &self,
        dst: DeviceSlice,
        src: &PinnedBuffer,
        offset: usize,
        stream: Stream,
    ) -> Result<()> {
        let mut state = self.lock()?;
        state.memory.check_live(dst, "copy from pinned")?;
        let address = state.memory.pinned_range(src, offset, dst.bytes)?;
        // SAFETY: as in `copy_to_pinned`, the other way round.
        unsafe {
            raw::copy_async(
                CopyKind::HostToDevice,
                dst.ptr,
                address,
                dst.bytes,
                self.stream(stream),
            )?
        };
        self.mark_pinned(&mut state, src.id, stream)
    }

    fn read_pinned(&self, src: &PinnedBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        let state = self.lock()?;
        Self::wait_pinned(&state, src.id)?;
        let address = state.memory.pinned_range(src, offset, dst.len())?;
        // SAFETY: the range lies in the live pinned buffer, every copy issued on it finished, and
        // no new one can be issued while this thread holds the lock.
        unsafe { raw::host_copy(dst.as_mut_ptr() as u64, address, dst.len()) };
        Ok(())
    }

    fn write_pinned(&self, dst: &PinnedBuffer, offset: usize, src: &[u8]) -> Result<()> {
        let state = self.lock()?;
        Self::wait_pinned(&state, dst.id)?;
        let address = state.memory.pinned_range(dst, offset, src.len())?;
        // SAFETY: as in `read_pinned`, in the other direction.
        unsafe { raw::host_copy(address, src.as_ptr() as u64, src.len()) };
        Ok(())
    }

    fn new_event(&self) -> Result<Event> {
        let mut state = self.lock()?;
        let event = RawEvent::new()?;
        let id = state.next_event;
        state.next_event += 1;
        state.events.insert(id, event);
        Ok(Event { id })
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        let mut state = self.lock()?;
        state
            .events
            .remove(&event.id)
            .map(drop)
            .ok_or(CudaError::UnknownEvent(event.id))
    }

    fn record(&self, event: &Event, stream: Stream) -> Result<()> {
        let state = self.lock()?;
        let raw_event = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        raw_event.record(self.stream(stream))
    }

    fn wait_event(&self, stream: Stream, event: &Event) -> Result<()> {
        let state = self.lock()?;
        let raw_event = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        self.stream(stream).wait(raw_event)
    }

    fn sync_event(&self, event: &Event) -> Result<()> {
        let state = self.lock()?;
        let raw_event = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        raw_event.synchronize()
    }

    fn event_done(&self, event: &Event) -> Result<bool> {
        let state = self.lock()?;
        let raw_event = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        raw_event.done()
    }

    fn sync_stream(&self, stream: Stream) -> Result<()> {
        self.device.make_current()?;
        self.stream(stream).synchronize()
    }

    /// # Safety
    ///
    /// As [`Runtime::launch`] requires.
    unsafe fn launch(
        &self,
        kernel: Kernel,
        dims: LaunchDims,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<()> {
        dims.check(kernel.name())?;
        let state = self.lock()?;
        state.memory.check_kernel_args(kernel, args)?;
        let cells: Vec<u64> = args.iter().map(KernelArg::storage).collect();
        // SAFETY: the caller of `Runtime::launch` guarantees the arguments and memory; the
        // function belongs to a module this runtime keeps loaded.
        unsafe {
            raw::launch(
                self.functions[kernel as usize],
                dims.grid,
                dims.block,
                dims.shared_bytes,
                &cells,
                self.stream(stream),
            )
        }
    }

    fn gemm(&self, gemm: &Gemm, stream: Stream) -> Result<()> {
        gemm.check()?;
        let state = self.lock()?;
        state.memory.check_gemm(gemm)?;
        let dim = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
        // SAFETY: `Gemm::check` validated the sizes, alignment and that c overlaps neither input;
        // the three slices are live; the lock serialises the handle's stream binding.
        unsafe {
            self.blas.gemm_abt(
                dim(gemm.m),
                dim(gemm.n),
                dim(gemm.k),
                gemm.a.ptr,
                gemm.b.ptr,
                gemm.c.ptr,
                gemm.dtype == DType::Bf16,
                self.stream(stream),
            )
        }
    }
}
