//! `CudaRouter`: the model's weights ([`WeightImage`], uploaded once as a [`DeviceModel`]) and
//! the memory plan's regions on a [`Runtime`].
//!
//! Opening answers a typed error where there is no driver or device. The memory plan
//! ([`MemoryPlan`]) sizes every region from one byte budget: the weights (the forward step's
//! image, the only copy on the device), the KV pool, the live / checkpoint / ring state rows, the
//! one activation workspace of the largest step (the forward step's [`Workspace`]), the logits of
//! two steps, the per-step inputs and outputs with the feed cells ([`IoLayout`]), and two pinned
//! buffers and events for the steps in flight. `DeviceIo` (the `io` module: effects; the `step`
//! module: plans) runs on them.

use std::sync::Mutex;

use model::{Config, Model};
use router_book::image::Layout;
use router_book::{BookShape, CacheConfig, Caches};

use crate::error::CudaError;
use crate::forward::{DeviceModel, WeightImage, Workspace};
use crate::io::Inner;
use crate::memory::{forward_limits, CudaRouterConfig, IoLayout, MemoryPlan, MtpLayout, PlanError};
use crate::runtime::{DeviceBuffer, Event, PinnedBuffer, Runtime, Stream};
use crate::{CudaRuntime, SimRuntime};

/// Why a CUDA router could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaRouterError {
    /// No driver, no device, a driver too old, or a device call failed.
    #[error("CUDA: {0}")]
    Runtime(#[from] CudaError),
    /// The budget or config does not give a usable plan.
    #[error("memory plan: {0}")]
    Plan(#[from] PlanError),
    /// The prefix cache refused its sizes.
    #[error("cache: {0}")]
    Cache(#[from] router_book::BookError),
}

/// The device buffers of the plan.
#[derive(Debug)]
pub(crate) struct Buffers {
    pub kv: DeviceBuffer,
    pub states: DeviceBuffer,
    pub workspace: DeviceBuffer,
    pub logits: DeviceBuffer,
    pub io: DeviceBuffer,
    /// Per half: where a step's argmax outputs come to the host.
    pub out_pinned: Vec<PinnedBuffer>,
    /// The MTP head's regions ([`MtpLayout`]), on a model with a head.
    pub mtp: Option<DeviceBuffer>,
    /// Per half: where a draft's tokens come to the host (on a model with a head).
    pub draft_pinned: Vec<PinnedBuffer>,
    /// Per checkpoint slot, the main model's hidden rows stored with it for the MTP head's
    /// rerun at a prefix hit (`MemoryPlan::mark_bytes` each), when the head reruns.
    pub marks: Option<DeviceBuffer>,
}

/// The CUDA router. See the module docs.
#[derive(Debug)]
pub struct CudaRouter {
    runtime: Box<dyn Runtime>,
    config: Config,
    fingerprint: u64,
    router: CudaRouterConfig,
    plan: MemoryPlan,
    io: IoLayout,
    mtp: MtpLayout,
    /// The weights, on the device.
    model: Option<DeviceModel>,
    workspace: Workspace,
    buffers: Option<Buffers>,
    book_shape: BookShape,
    inner: Mutex<Inner>,
    /// Recorded on one stream and waited on by the other, to order them.
    join: Option<Event>,
    /// Per half: recorded on the compute stream at the end of the step that uses it.
    step_events: Vec<Event>,
}

impl CudaRouter {
    /// Builds the router for `model` on `runtime`: plans the budget, uploads the weights and
    /// allocates every region.
    pub fn new(
        model: &Model,
        runtime: Box<dyn Runtime>,
        router: CudaRouterConfig,
    ) -> Result<CudaRouter, CudaRouterError> {
        let image = WeightImage::new(model, router.weights)?;
        let plan = MemoryPlan::from_budget(model.config(), image.bytes() as u64, &router)?;
        let workspace = Workspace::new(model.config(), forward_limits(&router))?;
        let io = IoLayout::new(
            router.max_step_tokens,
            router.max_seqs,
            plan.logit_rows(),
            model.config().vocab_size,
        );
        let mtp = MtpLayout::new(model.config(), &router);
        let book_shape = BookShape {
            block_size: plan.block_size,
            max_seqs: plan.live_slots,
            checkpoint_slots: plan.checkpoint_slots,
            snapshot_slots: plan.snapshot_slots,
            max_context: router.max_context,
            max_depth: router.max_depth,
            hybrid: plan.state_slot_bytes > 0,
            layout: Layout {
                fingerprint: model.fingerprint(),
                block_size: plan.block_size,
                floats_per_block: (plan.kv_block_bytes / 4) as usize,
                floats_per_slot: (plan.state_slot_bytes / 4) as usize,
                hidden_size: if model.has_mtp() {
                    model.config().hidden_size
                } else {
                    0
                },
                max_context: router.max_context,
                vocab_size: model.config().vocab_size,
            },
            // The MTP head's rerun at a prefix hit (`router_book::spec`): the hidden rows stored
            // with each checkpoint are the `marks` buffer's (`MemoryPlan::mark_bytes`).
            head_rerun: plan.mark_bytes > 0 && plan.checkpoint_slots > 0,
            head_lags: model
                .config()
                .mtp_kinds()
                .contains(&model::LayerKind::Mamba),
        };
        let cache = Caches::new(
            model,
            &CacheConfig {
                num_blocks: plan.num_blocks,
                block_size: plan.block_size,
                hybrid: plan.state_slot_bytes > 0,
                checkpoint_slots: plan.checkpoint_slots,
                prefix_cache: router.prefix_cache,
                marconi: router.marconi,
            },
        )?;
        let join = runtime.new_event()?;
        let step_events = vec![runtime.new_event()?, runtime.new_event()?];
        let mut built = CudaRouter {
            runtime,
            config: model.config().clone(),
            fingerprint: model.fingerprint(),
            router,
            plan,
            io,
            mtp,
            model: None,
            workspace,
            buffers: None,
            book_shape,
            inner: Mutex::new(Inner::new(
                cache,
                plan.live_slots,
                plan.snapshot_slots,
                mtp.num_cells,
            )),
            join: Some(join),
            step_events,
        };
        built.allocate(model, &image)?;
        tracing::info!(device = %built.runtime.device_name(), ?plan, "CUDA router ready");
        Ok(built)
    }

    /// The router on device 0 of this machine's CUDA driver. Where there is no driver, no device,
    /// or a driver too old, this is the typed error that says which.
    pub fn open(model: &Model, router: CudaRouterConfig) -> Result<CudaRouter, CudaRouterError> {
        let runtime = CudaRuntime::new()?;
        Self::new(model, Box::new(runtime), router)
    }

    /// The router on [`SimRuntime`] (the host emulation).
    pub fn sim(model: &Model, router: CudaRouterConfig) -> Result<CudaRouter, CudaRouterError> {
        let runtime = SimRuntime::new()?;
        Self::new(model, Box::new(runtime), router)
    }

    fn allocate(&mut self, model: &Model, image: &WeightImage) -> Result<(), CudaError> {
        let rt = self.runtime.as_ref();
        let plan = self.plan;
        let size = |bytes: u64| usize::try_from(bytes).unwrap_or(usize::MAX);
        let mut device_model = DeviceModel::upload(rt, model, image)?;
        device_model.set_mode(self.router.forward_mode);
        self.model = Some(device_model);
        let out_bytes = 4 * plan.logit_rows();
        let mtp = self.mtp;
        let buffers = Buffers {
            kv: rt.alloc(size(plan.kv_bytes()))?,
            states: rt.alloc(size(plan.state_bytes()))?,
            workspace: rt.alloc(size(plan.workspace_bytes))?,
            logits: rt.alloc(size(plan.logits_bytes))?,
            io: rt.alloc(size(plan.io_bytes))?,
            out_pinned: vec![rt.alloc_pinned(out_bytes)?, rt.alloc_pinned(out_bytes)?],
            mtp: if mtp.total > 0 {
                Some(rt.alloc(size(mtp.total))?)
            } else {
                None
            },
            draft_pinned: if mtp.total > 0 {
                let bytes = 4 * mtp.num_cells;
                vec![rt.alloc_pinned(bytes)?, rt.alloc_pinned(bytes)?]
            } else {
                Vec::new()
            },
            marks: if plan.marks_bytes() > 0 {
                Some(rt.alloc(size(plan.marks_bytes()))?)
            } else {
                None
            },
        };
        self.buffers = Some(buffers);
        Ok(())
    }

    /// Prefix-cache counters, for reports (the host router's, from the same bookkeeping).
    pub fn cache_stats(&self) -> Result<router_book::CacheStats, device_io::DeviceError> {
        let inner = self.inner.lock().map_err(|_| {
            device_io::DeviceError::DeviceLost("router state poisoned by a panic".to_owned())
        })?;
        Ok(inner.cache.stats())
    }

    /// Fails, from now on, the steps `faults` picks, as a device error after the commit would
    /// ([`router_book::StepFaults`]: the step runs, what it wrote is overwritten on the compute
    /// stream, and its await fails with its rows marked failed); for soaks and recovery tests.
    pub fn inject_step_faults(
        &self,
        faults: router_book::StepFaults,
    ) -> Result<(), device_io::DeviceError> {
        let mut inner = self.inner.lock().map_err(|_| {
            device_io::DeviceError::DeviceLost("router state poisoned by a panic".to_owned())
        })?;
        inner.step_faults = Some(faults);
        Ok(())
    }

    /// Whether the model has Mamba layers (and so uses the Marconi store for prefix reuse).
    pub fn is_hybrid(&self) -> bool {
        self.plan.state_slot_bytes > 0
    }

    /// The memory plan.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// The config the router was built with.
    pub fn router_config(&self) -> &CudaRouterConfig {
        &self.router
    }

    /// The model's fingerprint (spill images carry it).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &dyn Runtime {
        self.runtime.as_ref()
    }

    pub(crate) fn buffers(&self) -> Result<&Buffers, CudaError> {
        self.buffers
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the router was torn down".to_owned()))
    }

    /// The model on the device.
    pub(crate) fn device_model(&self) -> Result<&DeviceModel, CudaError> {
        self.model
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the router was torn down".to_owned()))
    }

    /// The forward step's workspace layout.
    pub(crate) fn workspace(&self) -> &Workspace {
        &self.workspace
    }

    /// The per-step buffer's layout.
    pub(crate) fn io_layout(&self) -> &IoLayout {
        &self.io
    }

    /// The MTP head's regions (empty without a head).
    pub(crate) fn mtp_layout(&self) -> &MtpLayout {
        &self.mtp
    }

    /// The event of half `half`'s step.
    pub(crate) fn step_event(&self, half: usize) -> &Event {
        &self.step_events[half]
    }

    pub(crate) fn book_shape(&self) -> &BookShape {
        &self.book_shape
    }

    pub(crate) fn inner(&self) -> &Mutex<Inner> {
        &self.inner
    }

    /// The model's config.
    pub fn model_config(&self) -> &Config {
        &self.config
    }

    /// The event that orders one stream after the other.
    pub(crate) fn join_event(&self) -> Result<&Event, CudaError> {
        self.join
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the router was torn down".to_owned()))
    }

    /// Waits for both streams and frees every region and the event; answers the bookkeeping
    /// (for teardown's report) and the first device error.
    pub(crate) fn into_parts(mut self) -> (Result<Inner, String>, Result<(), CudaError>) {
        let rt = self.runtime.as_ref();
        let mut freed = Stream::ALL
            .iter()
            .try_for_each(|&stream| rt.sync_stream(stream));
        if let Some(model) = self.model.take() {
            let done = model.free(rt);
            freed = freed.and(done);
        }
        if let Some(buffers) = self.buffers.take() {
            for pinned in buffers.out_pinned.into_iter().chain(buffers.draft_pinned) {
                let done = rt.free_pinned(pinned);
                freed = freed.and(done);
            }
            for buffer in [
                buffers.kv,
                buffers.states,
                buffers.workspace,
                buffers.logits,
                buffers.io,
            ]
            .into_iter()
            .chain(buffers.mtp)
            .chain(buffers.marks)
            {
                let done = rt.free(buffer);
                freed = freed.and(done);
            }
        }
        for event in self
            .join
            .take()
            .into_iter()
            .chain(self.step_events.drain(..))
        {
            let done = rt.destroy_event(event);
            freed = freed.and(done);
        }
        let inner = self
            .inner
            .into_inner()
            .map_err(|_| "router state poisoned by a panic".to_owned());
        (inner, freed)
    }
}
