//! `SimRuntime`: the runtime on the host, so the CUDA router and its kernels run in CI.
//!
//! # Design
//!
//! - **Memory.** Device and pinned buffers are host allocations (256-byte aligned, zeroed),
//!   addressed by integers; a table of live allocations validates every slice.
//! - **Streams.** Each stream is an in-order queue. One worker thread drains both queues: it runs
//!   the oldest command at the head of a queue that is not blocked, so the two streams interleave
//!   as on a device, a stream waiting on an event really stops until the other stream has passed
//!   the record, and no two commands ever touch memory at the same time (no data races between
//!   streams, whatever the router does).
//! - **Events.** An event counts its records (`recorded`, at the call) and the records the worker
//!   has passed (`completed`). Waiting on an event waits for the record that was latest when the
//!   wait was issued, as `cuStreamWaitEvent` does; waiting on a never-recorded event is a no-op.
//! - **Kernels** run on the worker through the C++ launchers of the SIMT emulation.
//! - **Errors.** A command that fails makes the runtime's error sticky (as CUDA's are): every later
//!   call answers [`CudaError::Sticky`].
//!
//! # Invariants of `State`
//!
//! - `memory` holds the live device and pinned buffers (see `live`); of each pinned buffer it
//!   keeps the number of queued copies that touch it.
//! - `queued[s]` counts the commands of stream `s` not yet finished (queued or running).
//! - `events[e].completed <= events[e].recorded`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::{CudaError, Result};
use crate::kernels::Kernel;
use crate::raw::sim::{self as raw, HostAddress, SimKernel};
use crate::runtime::live::{check_copy, check_download, check_upload, LiveMemory};
use crate::runtime::{
    DType, DeviceBuffer, DeviceSlice, Event, Gemm, KernelArg, LaunchDims, PinnedBuffer, Runtime,
    RuntimeKind, Stream,
};

/// Which way a copy between device memory and a pinned buffer goes.
#[derive(Debug, Clone, Copy)]
enum PinnedCopy {
    /// Device memory to the pinned buffer.
    ToPinned,
    /// The pinned buffer to device memory.
    FromPinned,
}

#[derive(Debug)]
enum Op {
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
        pinned: Option<u32>,
    },
    Fill {
        dst: u64,
        value: u8,
        bytes: usize,
    },
    Upload {
        dst: u64,
        data: Vec<u8>,
    },
    Download {
        dst: HostAddress,
        src: u64,
        bytes: usize,
        id: u64,
    },
    Record {
        event: u32,
        generation: u64,
    },
    Wait {
        event: u32,
        generation: u64,
    },
    Launch {
        kernel: SimKernel,
        dims: LaunchDims,
        args: Vec<u64>,
    },
    Gemm(Gemm),
}

#[derive(Debug)]
struct Queued {
    seq: u64,
    op: Op,
}

#[derive(Debug, Clone, Copy, Default)]
struct EventState {
    recorded: u64,
    completed: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Of each pinned buffer, the number of queued copies that touch it.
    memory: LiveMemory<usize>,
    events: BTreeMap<u32, EventState>,
    next_event: u32,
    queues: [VecDeque<Queued>; 2],
    queued: [usize; 2],
    next_seq: u64,
    downloads: BTreeMap<u64, Result<()>>,
    error: Option<String>,
    shutdown: bool,
    schedule: Schedule,
    paused: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when work is queued or shutdown is asked.
    work: Condvar,
    /// Signalled when a command finished.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock can only come from a bug here; the state is still
        // consistent enough to report and shut down, so the poison is not propagated.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Which stream the worker prefers when both have runnable work.
///
/// `Fifo` runs commands in the order they were issued, except where a wait holds a stream back.
/// The other two let one stream overtake the other wherever no event orders them, which is what a
/// device may do: a router that forgets an event computes wrong results under one of them, so
/// tests run under all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// The oldest runnable command first.
    #[default]
    Fifo,
    /// The compute stream's runnable commands first.
    ComputeFirst,
    /// The copy stream's runnable commands first.
    CopyFirst,
}

/// The host runtime. See the module docs.
#[derive(Debug)]
pub struct SimRuntime {
    shared: Arc<Shared>,
    kernels: Vec<SimKernel>,
    worker: Option<JoinHandle<()>>,
}

fn sticky(state: &State) -> Result<()> {
    match &state.error {
        Some(message) => Err(CudaError::Sticky(message.clone())),
        None => Ok(()),
    }
}

/// Runs one command on the worker thread.
fn execute(op: &Op, scratch: &mut (Vec<f32>, Vec<f32>)) -> Result<()> {
    match op {
        Op::Copy {
            dst, src, bytes, ..
        } => {
            // SAFETY: both ranges were validated against live allocations (or a live pinned
            // buffer) when the command was queued; buffers are freed only after their streams
            // drained, and this worker is the only thread touching device memory.
            unsafe { raw::copy(*dst, *src, *bytes) };
            Ok(())
        }
        Op::Fill { dst, value, bytes } => {
            // SAFETY: as for `Copy`.
            unsafe { raw::fill(*dst, *value, *bytes) };
            Ok(())
        }
        Op::Upload { dst, data } => {
            // SAFETY: as for `Copy`; the source is the command's own vector.
            unsafe { raw::copy(*dst, data.as_ptr() as u64, data.len()) };
            Ok(())
        }
        Op::Download {
            dst, src, bytes, ..
        } => {
            // SAFETY: the source as for `Copy`; the destination is the host slice whose owner
            // blocks in `download` until this command reports, so it stays valid and unshared.
            unsafe { raw::copy(dst.0, *src, *bytes) };
            Ok(())
        }
        Op::Launch { kernel, dims, args } => {
            // SAFETY: `Runtime::launch`'s caller guaranteed the arguments and the memory the
            // kernel touches; this worker is the only thread running device work.
            unsafe { raw::launch(kernel, dims, args) }
        }
        Op::Gemm(gemm) => {
            let (a_f32, b_f32) = scratch;
            match gemm.dtype {
                DType::F32 => {
                    // SAFETY: `Gemm::check` and `check_live` validated the three slices' sizes,
                    // liveness and that c overlaps neither input; this worker is alone.
                    unsafe {
                        raw::sgemm_abt(gemm.m, gemm.n, gemm.k, gemm.a.ptr, gemm.b.ptr, gemm.c.ptr)
                    };
                }
                DType::Bf16 => {
                    // SAFETY: as above; the inputs hold m*k and n*k bf16 values.
                    unsafe {
                        raw::widen_bf16(gemm.a.ptr, gemm.m * gemm.k, a_f32);
                        raw::widen_bf16(gemm.b.ptr, gemm.n * gemm.k, b_f32);
                    }
                    // SAFETY: the temporaries hold exactly m*k and n*k f32 values; c as above.
                    unsafe {
                        raw::sgemm_abt(
                            gemm.m,
                            gemm.n,
                            gemm.k,
                            raw::address_of(a_f32),
                            raw::address_of(b_f32),
                            gemm.c.ptr,
                        );
                    }
                }
            }
            Ok(())
        }
        Op::Record { .. } | Op::Wait { .. } => Ok(()),
    }
}

/// The index of the queue whose head runs next: the oldest runnable head.
fn next_runnable(state: &State) -> Option<usize> {
    let mut best: Option<((u64, u64), usize)> = None;
    for (index, queue) in state.queues.iter().enumerate() {
        let Some(head) = queue.front() else {
            continue;
        };
        if let Op::Wait { event, generation } = head.op {
            let passed = state
                .events
                .get(&event)
                .is_none_or(|e| e.completed >= generation);
            if !passed {
                continue;
            }
        }
        let rank = match state.schedule {
            Schedule::Fifo => 0,
            Schedule::ComputeFirst => index,
            Schedule::CopyFirst => 1 - index,
        };
        let key = (rank as u64, head.seq);
        if best.is_none_or(|(best_key, _)| key < best_key) {
            best = Some((key, index));
        }
    }
    best.map(|(_, index)| index)
}

fn worker(shared: Arc<Shared>) {
    let mut scratch = (Vec::new(), Vec::new());
    let mut state = shared.lock();
    loop {
        let next = if state.paused {
            None
        } else {
            next_runnable(&state)
        };
        let Some(index) = next else {
            if state.shutdown && (state.paused || state.queues.iter().all(VecDeque::is_empty)) {
                return;
            }
            state = shared
                .work
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        };
        let Some(queued) = state.queues[index].pop_front() else {
            continue;
        };
        let skip = state.error.is_some();
        drop(state);
        let result = if skip {
            Ok(())
        } else {
            execute(&queued.op, &mut scratch)
        };
        state = shared.lock();
        if let Err(err) = &result {
            if state.error.is_none() {
                tracing::error!(%err, "SimRuntime command failed; the runtime is now unusable");
                state.error = Some(err.to_string());
            }
        }
        match queued.op {
            Op::Record { event, generation } => {
                if let Some(e) = state.events.get_mut(&event) {
                    e.completed = e.completed.max(generation);
                }
            }
            Op::Copy {
                pinned: Some(id), ..
            } => {
                if let Some(p) = state.memory.pinned.get_mut(&id) {
                    p.in_flight -= 1;
                }
            }
            Op::Download { id, .. } => {
                let outcome = match (&result, &state.error) {
                    (Err(err), _) => Err(err.clone()),
                    (Ok(()), Some(message)) => Err(CudaError::Sticky(message.clone())),
                    (Ok(()), None) => Ok(()),
                };
                state.downloads.insert(id, outcome);
            }
            _ => {}
        }
        state.queued[index] -= 1;
        shared.done.notify_all();
    }
}

impl SimRuntime {
    /// A host runtime with its worker thread, running commands in issue order.
    pub fn new() -> Result<Self> {
        Self::with_schedule(Schedule::Fifo)
    }

    /// A host runtime whose worker prefers streams as `schedule` says.
    pub fn with_schedule(schedule: Schedule) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        shared.lock().schedule = schedule;
        let kernels = Kernel::ALL
            .iter()
            .map(|kernel| {
                raw::SIM_KERNELS
                    .iter()
                    .find(|k| k.name == kernel.name())
                    .copied()
                    .ok_or_else(|| CudaError::BadLaunch {
                        kernel: kernel.name(),
                        detail: "no such kernel in kernels/*.cu".to_owned(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let for_worker = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("sim-runtime".to_owned())
            .spawn(move || worker(for_worker))
            .map_err(|err| CudaError::Call {
                call: "spawning the SimRuntime worker",
                message: err.to_string(),
            })?;
        Ok(SimRuntime {
            shared,
            kernels,
            worker: Some(worker),
        })
    }

    /// Holds the worker before its next command, so that a test can issue work on both streams
    /// and then let the schedule alone decide the order. Host calls that wait for the device
    /// (downloads, synchronisations) must not be made while paused.
    pub fn pause(&self) {
        self.shared.lock().paused = true;
    }

    /// Lets the worker go on after [`SimRuntime::pause`].
    pub fn resume(&self) {
        self.shared.lock().paused = false;
        self.shared.work.notify_all();
    }

    fn enqueue(&self, state: &mut State, stream: Stream, op: Op) {
        let seq = state.next_seq;
        state.next_seq += 1;
        state.queues[stream.index()].push_back(Queued { seq, op });
        state.queued[stream.index()] += 1;
        self.shared.work.notify_one();
    }

    /// The copy between `device` and `pinned` at `offset` that `way` names, in stream order;
    /// the buffer counts it in flight until the worker ran it.
    fn copy_pinned(
        &self,
        way: PinnedCopy,
        device: DeviceSlice,
        pinned: &PinnedBuffer,
        offset: usize,
        stream: Stream,
    ) -> Result<()> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let what = match way {
            PinnedCopy::ToPinned => "copy to pinned",
            PinnedCopy::FromPinned => "copy from pinned",
        };
        state.memory.check_live(device, what)?;
        let address = state.memory.pinned_range(pinned, offset, device.bytes)?;
        if let Some(p) = state.memory.pinned.get_mut(&pinned.id) {
            p.in_flight += 1;
        }
        let (dst, src) = match way {
            PinnedCopy::ToPinned => (address, device.ptr),
            PinnedCopy::FromPinned => (device.ptr, address),
        };
        self.enqueue(
            &mut state,
            stream,
            Op::Copy {
                dst,
                src,
                bytes: device.bytes,
                pinned: Some(pinned.id),
            },
        );
        Ok(())
    }

    fn wait_until<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        done: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        while !done(&state) {
            state = self
                .shared
                .done
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        state
    }

    fn drain_all(&self) -> MutexGuard<'_, State> {
        let state = self.shared.lock();
        self.wait_until(state, |s| s.queued.iter().all(|&n| n == 0))
    }
}

impl Drop for SimRuntime {
    fn drop(&mut self) {
        {
            let mut state = self.shared.lock();
            state.shutdown = true;
            self.shared.work.notify_all();
        }
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                tracing::error!("the SimRuntime worker panicked");
                return;
            }
        }
        let mut state = self.shared.lock();
        for (address, bytes) in std::mem::take(&mut state.memory.allocations) {
            // SAFETY: the worker has exited, so nothing touches the memory; the table holds each
            // live allocation once with its length.
            unsafe { raw::free(address, bytes) };
        }
        for (_, pinned) in std::mem::take(&mut state.memory.pinned) {
            // SAFETY: as above, for pinned buffers.
            unsafe { raw::free(pinned.address, pinned.bytes) };
        }
    }
}

impl Runtime for SimRuntime {
    fn kind(&self) -> RuntimeKind {
        RuntimeKind::Sim
    }

    fn device_name(&self) -> String {
        "SimRuntime (host SIMT emulation)".to_owned()
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let ptr = raw::alloc_zeroed(bytes)?;
        Ok(state.memory.insert_allocation(ptr, bytes))
    }

    fn free(&self, buffer: DeviceBuffer) -> Result<()> {
        let mut state = self.drain_all();
        let bytes = state.memory.remove_allocation(&buffer)?;
        // SAFETY: both streams are drained (nothing queued touches it) and the entry is gone from
        // the table, so no later command can be validated against it.
        unsafe { raw::free(buffer.ptr, bytes) };
        Ok(())
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let address = raw::alloc_zeroed(bytes).map_err(|_| CudaError::OutOfMemory {
            what: "pinned host",
            requested: bytes,
        })?;
        Ok(state.memory.insert_pinned(address, bytes, 0))
    }

    fn free_pinned(&self, buffer: PinnedBuffer) -> Result<()> {
        let state = self.shared.lock();
        let mut state = self.wait_until(state, |s| {
            s.memory
                .pinned
                .get(&buffer.id)
                .is_none_or(|p| p.in_flight == 0)
        });
        let pinned = state.memory.remove_pinned(&buffer)?;
        // SAFETY: no queued copy touches it any more and it left the table.
        unsafe { raw::free(pinned.address, pinned.bytes) };
        Ok(())
    }

    fn memset(&self, dst: DeviceSlice, value: u8, stream: Stream) -> Result<()> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_live(dst, "memset")?;
        self.enqueue(
            &mut state,
            stream,
            Op::Fill {
                dst: dst.ptr,
                value,
                bytes: dst.bytes,
            },
        );
        Ok(())
    }

    fn upload(&self, dst: DeviceSlice, src: &[u8], stream: Stream) -> Result<()> {
        check_upload(dst, src)?;
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_live(dst, "upload")?;
        self.enqueue(
            &mut state,
            stream,
            Op::Upload {
                dst: dst.ptr,
                data: src.to_vec(),
            },
        );
        Ok(())
    }

    fn download(&self, dst: &mut [u8], src: DeviceSlice, stream: Stream) -> Result<()> {
        check_download(dst, src)?;
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_live(src, "download")?;
        let id = state.next_seq;
        self.enqueue(
            &mut state,
            stream,
            Op::Download {
                dst: HostAddress::of(dst),
                src: src.ptr,
                bytes: src.bytes,
                id,
            },
        );
        let mut state = self.wait_until(state, |s| s.downloads.contains_key(&id));
        state.downloads.remove(&id).unwrap_or(Ok(()))
    }

    fn copy(&self, dst: DeviceSlice, src: DeviceSlice, stream: Stream) -> Result<()> {
        check_copy(dst, src)?;
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_live(dst, "copy destination")?;
        state.memory.check_live(src, "copy source")?;
        self.enqueue(
            &mut state,
            stream,
            Op::Copy {
                dst: dst.ptr,
                src: src.ptr,
                bytes: src.bytes,
                pinned: None,
            },
        );
        Ok(())
    }

    fn copy_to_pinned(
        &self,
        dst: &PinnedBuffer,
        offset: usize,
        src: DeviceSlice,
        stream: Stream,
    ) -> Result<()> {
        self.copy_pinned(PinnedCopy::ToPinned, src, dst, offset, stream)
    }

    fn copy_from_pinned(
        &self,
        dst: DeviceSlice,
        src: &PinnedBuffer,
        offset: usize,
        stream: Stream,
    ) -> Result<()> {
        self.copy_pinned(PinnedCopy::FromPinned, dst, src, offset, stream)
    }

    fn read_pinned(&self, src: &PinnedBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        let state = self.shared.lock();
        let state = self.wait_until(state, |s| {
            s.memory
                .pinned
                .get(&src.id)
                .is_none_or(|p| p.in_flight == 0)
        });
        sticky(&state)?;
        let address = state.memory.pinned_range(src, offset, dst.len())?;
        // SAFETY: the range lies inside the live pinned buffer, no queued copy touches it (its count
        // is 0 and a new one cannot be queued while this thread holds the lock), and `dst` is a
        // distinct host slice.
        unsafe { raw::copy(HostAddress::of(dst).0, address, dst.len()) };
        Ok(())
    }

    fn write_pinned(&self, dst: &PinnedBuffer, offset: usize, src: &[u8]) -> Result<()> {
        let state = self.shared.lock();
        let state = self.wait_until(state, |s| {
            s.memory
                .pinned
                .get(&dst.id)
                .is_none_or(|p| p.in_flight == 0)
        });
        sticky(&state)?;
        let address = state.memory.pinned_range(dst, offset, src.len())?;
        // SAFETY: as in `read_pinned`, with `src` the distinct host slice.
        unsafe { raw::copy(address, src.as_ptr() as u64, src.len()) };
        Ok(())
    }

    fn new_event(&self) -> Result<Event> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let id = state.next_event;
        state.next_event += 1;
        state.events.insert(id, EventState::default());
        Ok(Event { id })
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        let mut state = self.shared.lock();
        state
            .events
            .remove(&event.id)
            .map(|_| ())
            .ok_or(CudaError::UnknownEvent(event.id))
    }

    fn record(&self, event: &Event, stream: Stream) -> Result<()> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let entry = state
            .events
            .get_mut(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        entry.recorded += 1;
        let generation = entry.recorded;
        self.enqueue(
            &mut state,
            stream,
            Op::Record {
                event: event.id,
                generation,
            },
        );
        Ok(())
    }

    fn wait_event(&self, stream: Stream, event: &Event) -> Result<()> {
        let mut state = self.shared.lock();
        sticky(&state)?;
        let generation = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?
            .recorded;
        self.enqueue(
            &mut state,
            stream,
            Op::Wait {
                event: event.id,
                generation,
            },
        );
        Ok(())
    }

    fn sync_event(&self, event: &Event) -> Result<()> {
        let state = self.shared.lock();
        let target = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?
            .recorded;
        let state = self.wait_until(state, |s| {
            s.error.is_some()
                || s.events
                    .get(&event.id)
                    .is_none_or(|e| e.completed >= target)
        });
        sticky(&state)
    }

    fn event_done(&self, event: &Event) -> Result<bool> {
        let state = self.shared.lock();
        sticky(&state)?;
        let entry = state
            .events
            .get(&event.id)
            .ok_or(CudaError::UnknownEvent(event.id))?;
        Ok(entry.completed >= entry.recorded)
    }

    fn sync_stream(&self, stream: Stream) -> Result<()> {
        let state = self.shared.lock();
        let state = self.wait_until(state, |s| s.queued[stream.index()] == 0);
        sticky(&state)
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
        let sim = self.kernels[kernel as usize];
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_kernel_args(kernel, args)?;
        self.enqueue(
            &mut state,
            stream,
            Op::Launch {
                kernel: sim,
                dims,
                args: args.iter().map(KernelArg::storage).collect(),
            },
        );
        Ok(())
    }

    fn gemm(&self, gemm: &Gemm, stream: Stream) -> Result<()> {
        gemm.check()?;
        let mut state = self.shared.lock();
        sticky(&state)?;
        state.memory.check_gemm(gemm)?;
        self.enqueue(&mut state, stream, Op::Gemm(*gemm));
        Ok(())
    }
}
