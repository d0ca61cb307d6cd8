//! The one module that names concrete routers: which one is built, and how, is decided here by
//! cargo features and [`BackendOptions`]; the rest of the crate is generic over `DeviceIo`.
//!
//! - `cpu` (default): [`Router`] is [`Routers`]: `device_cpu::CpuRouter` over a `model::Model`,
//!   or, with `cuda`, the CUDA router.
//! - `trace`: [`Router`] wraps it in `device_trace::TracingDeviceIo` (sink from
//!   `BackendOptions::trace`, or `tracing` events when none is given).
//! - `prefix-cache`, `marconi` (default): allow the router's prefix cache and its Marconi
//!   eviction policy; [`BackendOptions::prefix_cache`] / [`BackendOptions::marconi`] switch them
//!   per run. Without the feature the switch is ignored (always off).
//! - `cuda`: adds `Device::Cuda`, which opens `device_cuda::CudaRouter` on device 0 with the same
//!   sizes (where there is no driver or device that is [`BackendError::Cuda`] saying which), and
//!   `Device::CudaSim`, the same router on `device_cuda::SimRuntime` (its kernels run on the
//!   host: slow, for checking the CUDA path end to end without a GPU). The CUDA router keeps
//!   bf16 weights, has no LoRA adapter slots and no speculative decoding; the thread, expert
//!   worker and adapter options are the host router's and do not apply to it.
//!
//! With `cpu`, this module also re-exports what a program needs to build an engine while
//! depending on `scheduler` alone: the model's [`ModelConfig`], [`Model`] and [`LayerKind`], the
//! host router [`CpuRouter`], and the `model` and `device_cpu` crates themselves; with `trace`,
//! `device_trace`'s `TraceSink` and `TracingDeviceIo`.

#[cfg(feature = "cpu")]
pub use cpu::*;

/// Which device a router runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The host router.
    #[default]
    Cpu,
    /// The CUDA router on device 0 (see the module docs for what it can do yet).
    #[cfg(feature = "cuda")]
    Cuda,
    /// The CUDA router on `SimRuntime`: its kernels run on the host.
    #[cfg(feature = "cuda")]
    CudaSim,
}

/// Why a router (or the engine over it) could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The CUDA router could not be opened (no driver, no device, a driver too old) or cannot
    /// serve this model yet.
    #[error("CUDA router: {0}")]
    Cuda(String),
    /// The model could not be loaded or built.
    #[error("model: {0}")]
    Model(String),
    /// The router refused its configuration.
    #[error("router: {0}")]
    Router(String),
    /// The engine refused its configuration.
    #[error(transparent)]
    Engine(#[from] crate::EngineError),
}

/// Whether this build lets the router keep a prefix cache (feature `prefix-cache`).
pub const PREFIX_CACHE_COMPILED: bool = cfg!(feature = "prefix-cache");
/// Whether this build lets the router run the Marconi policy (feature `marconi`).
pub const MARCONI_COMPILED: bool = cfg!(feature = "marconi");

#[cfg(feature = "cpu")]
mod cpu {
    use std::path::Path;

    use device_cpu::{CheckpointBudget, CpuRouterConfig};
    use device_io::DeviceIo;

    /// The host router crate, for what the names below do not cover.
    pub use device_cpu;
    pub use device_cpu::{default_threads, CpuRouter, StepFaults};
    #[cfg(feature = "trace")]
    pub use device_trace::{TraceSink, TracingDeviceIo};
    /// The model crate, for what the names below do not cover.
    pub use model;
    pub use model::{Config as ModelConfig, LayerKind, Model};

    use super::{BackendError, Device, MARCONI_COMPILED, PREFIX_CACHE_COMPILED};
    use crate::replay::CacheStats;
    use crate::{Engine, EngineConfig};

    /// The router this build constructs.
    #[cfg(not(feature = "trace"))]
    pub type Router = Routers;
    /// The router this build constructs.
    #[cfg(feature = "trace")]
    pub type Router = device_trace::TracingDeviceIo<Routers>;

    /// The router [`BackendOptions::device`] picks: both keep the same per-sequence record
    /// (`router_book::RouterSeq`) and logits handle, so the engine drives either through one
    /// type.
    #[derive(Debug)]
    // One router per engine, built once: the size of the host router's variant costs nothing.
    #[allow(clippy::large_enum_variant)]
    pub enum Routers {
        /// The host router.
        Cpu(CpuRouter),
        /// The CUDA router, on a GPU or on `SimRuntime`.
        #[cfg(feature = "cuda")]
        Cuda(Box<device_cuda::CudaRouter>),
    }

    /// Runs `$body` with `$r` bound to whichever router `$routers` holds.
    macro_rules! each {
        ($routers:expr, $r:ident => $body:expr) => {
            match $routers {
                Routers::Cpu($r) => $body,
                #[cfg(feature = "cuda")]
                Routers::Cuda($r) => $body,
            }
        };
    }

    impl DeviceIo for Routers {
        type Seq = device_cpu::CpuSeq;
        type Ptr = device_cpu::LogitsHandle;
        /// The model's config (the CUDA router keeps its weights on the device only).
        type Model = model::Config;
        type LoraCmd = device_io::LoraCommand;
        type LoraAck = device_io::LoraAck;

        fn model(&self) -> &model::Config {
            match self {
                Routers::Cpu(router) => router.model().config(),
                #[cfg(feature = "cuda")]
                Routers::Cuda(router) => router.model(),
            }
        }

        fn facts(&self) -> device_io::DeviceFacts {
            each!(self, r => r.facts())
        }

        fn max_depth(&self) -> usize {
            each!(self, r => r.max_depth())
        }

        fn computes_on_host(&self) -> bool {
            each!(self, r => r.computes_on_host())
        }

        fn launch(
            &self,
            plan: device_io::StepPlan<'_>,
            rows: &mut [&mut Self::Seq],
        ) -> device_io::Result<device_io::Ticket> {
            each!(self, r => r.launch(plan, rows))
        }

        fn await_result(
            &self,
            ticket: device_io::Ticket,
        ) -> device_io::Result<device_io::StepResult<Self::Ptr>> {
            each!(self, r => r.await_result(ticket))
        }

        fn apply(
            &self,
            effect: device_io::Effect<'_, Self::Seq, Self::Ptr>,
        ) -> device_io::Result<device_io::EffectOutcome> {
            each!(self, r => r.apply(effect))
        }

        fn clear_prefix_cache(&self) -> device_io::Result<()> {
            each!(self, r => r.clear_prefix_cache())
        }

        fn subscribe_cache_events(
            &self,
            sink: Box<dyn device_io::CacheEventSink>,
        ) -> device_io::Result<()> {
            each!(self, r => r.subscribe_cache_events(sink))
        }

        fn lora(
            &mut self,
            cmd: device_io::LoraCommand,
        ) -> Result<device_io::LoraAck, device_io::LoraError> {
            each!(self, r => r.lora(cmd))
        }

        fn teardown(self: Box<Self>) -> device_io::Result<()> {
            match *self {
                Routers::Cpu(router) => Box::new(router).teardown(),
                #[cfg(feature = "cuda")]
                Routers::Cuda(router) => router.teardown(),
            }
        }
    }

    /// How to build the router.
    #[derive(Debug)]
    pub struct BackendOptions {
        /// The device.
        pub device: Device,
        /// KV blocks in the pool.
        pub kv_blocks: usize,
        /// Tokens per block.
        pub block_size: usize,
        /// Live-state slots (the most sequences running at once).
        pub max_seqs: usize,
        /// The longest sequence the router accepts; `None`: the model's `max_position_embeddings`
        /// (or what the pool holds, when that is less or the model does not say).
        pub max_context: Option<usize>,
        /// SSM checkpoint slots of the prefix cache (hybrid models).
        pub checkpoint_slots: usize,
        /// Snapshot ring slots (`SsmSnapshotSave`, and speculative decoding's rewind points: at
        /// least [`crate::Speculation::k`]; the engine reads them from the router's facts, and
        /// a step speculates on as many rows as the ring holds drafts for).
        pub snapshot_slots: usize,
        /// Keep a prefix cache (needs feature `prefix-cache`).
        pub prefix_cache: bool,
        /// Run the Marconi (FLOP-aware) eviction policy for SSM checkpoints (needs feature
        /// `marconi`); off, checkpoints are evicted by recency.
        pub marconi: bool,
        /// Pipeline depth: 1 (synchronous) or 2 (the router computes on a worker thread and the
        /// engine keeps one decode step in flight while it reads the previous one).
        pub max_depth: usize,
        /// Threads of the model's forward pass (the machine's available parallelism by default).
        pub threads: usize,
        /// Expert-parallel worker threads for MoE layers (0, the default: none).
        pub expert_workers: usize,
        /// LoRA adapter slots: the most adapters loaded at once (load them with
        /// [`crate::EngineClient::lora`] or [`crate::Engine::lora`]).
        pub lora_slots: usize,
        /// Where traced calls go (feature `trace`); `None` sends them to `tracing` events.
        #[cfg(feature = "trace")]
        pub trace: Option<device_trace::TraceSink>,
        /// Fault injection at the device, for soaks and recovery tests: the steps it picks fail
        /// as a device error after the commit would ([`StepFaults`]). `None` (the default): none.
        pub step_faults: Option<StepFaults>,
    }

    impl BackendOptions {
        /// A pool of `kv_blocks` blocks of 16 tokens, `max_seqs` slots, four checkpoint slots
        /// per slot, the model's context (or the pool's, when smaller), both caches on (where
        /// compiled), depth 1, [`device_cpu::DEFAULT_LORA_SLOTS`] adapter slots.
        pub fn new(kv_blocks: usize, max_seqs: usize) -> Self {
            let block_size = device_cpu::DEFAULT_BLOCK_SIZE;
            BackendOptions {
                device: Device::Cpu,
                kv_blocks,
                block_size,
                max_seqs,
                max_context: None,
                checkpoint_slots: 4 * max_seqs,
                snapshot_slots: device_cpu::DEFAULT_SNAPSHOT_SLOTS,
                prefix_cache: true,
                marconi: true,
                max_depth: 1,
                threads: device_cpu::default_threads(),
                expert_workers: 0,
                lora_slots: device_cpu::DEFAULT_LORA_SLOTS,
                #[cfg(feature = "trace")]
                trace: None,
                step_faults: None,
            }
        }
    }

    /// Loads a NemotronH checkpoint in Hugging Face layout (`config.json` + safetensors).
    pub fn load_model(dir: &Path) -> Result<Model, BackendError> {
        Model::load(dir).map_err(|err| BackendError::Model(err.to_string()))
    }

    /// Seeded random weights for `config`.
    pub fn random_model(config: model::Config, seed: u64) -> Result<Model, BackendError> {
        Model::random(config, seed).map_err(|err| BackendError::Model(err.to_string()))
    }

    /// Bytes of one KV block of `block_size` tokens for `config` (every attention layer's K and V,
    /// f32), as the host router lays it out; 0 for a configuration the router would refuse.
    pub fn kv_block_bytes(config: &model::Config, block_size: usize) -> u64 {
        model::KvPool::new(config, 0, block_size)
            .map(|pool| (pool.floats_per_block() * std::mem::size_of::<f32>()) as u64)
            .unwrap_or(0)
    }

    /// Bytes of one SSM state slot for `config` (every Mamba layer's conv and SSM state, f32):
    /// what each live sequence, Marconi checkpoint and preemption snapshot holds.
    pub fn state_slot_bytes(config: &model::Config) -> u64 {
        model::MambaLayout::of(config)
            .map(|layout| (layout.floats_per_slot() * std::mem::size_of::<f32>()) as u64)
            .unwrap_or(0)
    }

    /// Builds the router for `model`.
    pub fn build_router(model: Model, options: BackendOptions) -> Result<Router, BackendError> {
        let router = match options.device {
            Device::Cpu => Routers::Cpu(build_host(model, &options)?),
            #[cfg(feature = "cuda")]
            Device::Cuda | Device::CudaSim => Routers::Cuda(Box::new(open_cuda(&model, &options)?)),
        };
        if let Some(faults) = options.step_faults.clone() {
            each!(&router, r => r.inject_step_faults(faults))
                .map_err(|err| BackendError::Router(err.to_string()))?;
        }
        #[cfg(feature = "trace")]
        let router = {
            let sink = options
                .trace
                .unwrap_or_else(device_trace::TraceSink::tracing);
            device_trace::TracingDeviceIo::new(router, sink)
        };
        Ok(router)
    }

    /// The host router for `model` with the sizes of `options`.
    fn build_host(model: Model, options: &BackendOptions) -> Result<CpuRouter, BackendError> {
        let config = CpuRouterConfig {
            block_size: options.block_size,
            num_blocks: options.kv_blocks,
            max_seqs: options.max_seqs,
            checkpoints: CheckpointBudget::Slots(options.checkpoint_slots),
            snapshot_slots: options.snapshot_slots,
            prefix_cache: options.prefix_cache && PREFIX_CACHE_COMPILED,
            marconi: options.marconi && MARCONI_COMPILED,
            max_context: options.max_context,
            max_depth: options.max_depth,
            threads: options.threads,
            expert_workers: options.expert_workers,
            lora_slots: options.lora_slots,
        };
        CpuRouter::new(model, config).map_err(|err| BackendError::Router(err.to_string()))
    }

    /// Opens the CUDA router for `model` with the sizes of `options` (bf16 weights), on device 0
    /// (`Device::Cuda`: the typed error of opening it where there is no driver, no device, or
    /// a driver too old) or on `SimRuntime` (`Device::CudaSim`).
    #[cfg(feature = "cuda")]
    fn open_cuda(
        model: &Model,
        options: &BackendOptions,
    ) -> Result<device_cuda::CudaRouter, BackendError> {
        let c = model.config();
        // Without an explicit limit, the longest sequence the pool holds.
        let max_context = options
            .max_context
            .unwrap_or(options.kv_blocks * options.block_size);
        let state = device_cuda::MemoryPlan::from_budget(
            c,
            0,
            // A probe for the fixed regions' sizes (they do not depend on the budget; 1 TiB keeps
            // the block count within u32 for any block of 256 bytes or more).
            &device_cuda::CudaRouterConfig {
                block_size: options.block_size,
                snapshot_slots: options.snapshot_slots,
                ..device_cuda::CudaRouterConfig::new(1 << 40, options.max_seqs, max_context)
            },
        );
        // This build's host sizes (blocks, checkpoint slots) exactly, and a byte budget that
        // holds them: the fixed regions, the KV pool, the checkpoint slots with the MTP head's
        // stored rows, the bf16 weights, and 1 MiB for the regions' alignment.
        let pool = device_cuda::PoolSizes {
            kv_blocks: options.kv_blocks,
            checkpoint_slots: options.checkpoint_slots,
        };
        let budget = state.map_or(u64::MAX, |plan| {
            let kv = plan.kv_block_bytes * options.kv_blocks as u64;
            let checkpoints =
                (plan.state_slot_bytes + plan.mark_bytes) * options.checkpoint_slots as u64;
            let weights = 2 * model_parameters(model);
            plan.workspace_bytes
                + plan.logits_bytes
                + plan.io_bytes
                + plan.state_slot_bytes
                    * (options.max_seqs + options.snapshot_slots + plan.scratch_slots) as u64
                + plan.mtp_bytes
                + weights
                + kv
                + checkpoints
                + (1 << 20)
        });
        let config = device_cuda::CudaRouterConfig {
            block_size: options.block_size,
            snapshot_slots: options.snapshot_slots,
            prefix_cache: options.prefix_cache && PREFIX_CACHE_COMPILED,
            marconi: options.marconi && MARCONI_COMPILED,
            max_depth: options.max_depth,
            pool: Some(pool),
            ..device_cuda::CudaRouterConfig::new(budget, options.max_seqs, max_context)
        };
        let opened = match options.device {
            Device::CudaSim => device_cuda::CudaRouter::sim(model, config),
            _ => device_cuda::CudaRouter::open(model, config),
        };
        opened.map_err(|err| BackendError::Cuda(err.to_string()))
    }

    /// Parameters of `model` (for the bf16 weight bytes of the CUDA budget).
    #[cfg(feature = "cuda")]
    fn model_parameters(model: &Model) -> u64 {
        let mut count = 0u64;
        model.visit_tensors(&mut |_, _, data| count += data.len() as u64);
        count
    }

    /// Builds the router for `model` and an engine over it.
    pub fn build_engine(
        model: Model,
        options: BackendOptions,
        config: EngineConfig,
    ) -> Result<Engine<Router>, BackendError> {
        let router = build_router(model, options)?;
        Ok(Engine::new(router, config)?)
    }

    fn routers(router: &Router) -> &Routers {
        #[cfg(feature = "trace")]
        return router.inner();
        #[cfg(not(feature = "trace"))]
        return router;
    }

    /// The router's cache counters (`None` when it cannot say).
    pub fn cache_stats(router: &Router) -> Option<CacheStats> {
        let stats = each!(routers(router), r => r.cache_stats()).ok()?;
        Some(CacheStats {
            lookups: stats.lookups,
            hit_tokens: stats.hit_tokens,
            checkpoints_held: stats.checkpoints,
            checkpoints_taken: stats.checkpoints_taken,
            checkpoint_hits: stats.checkpoint_hits,
            checkpoints_evicted: stats.checkpoints_evicted,
            marconi_alpha: stats.alpha,
            marconi_recency: stats.recency,
            marconi_flop_basis: stats.flop_basis,
            marconi_guard: stats.guard,
            tuner_switches: stats.tuner_switches,
            head_exact_hits: stats.head_exact_hits,
            head_unvouched_hits: stats.head_unvouched_hits,
            head_unmarked_hits: stats.head_unmarked_hits,
            head_skipped_hits: stats.head_skipped_hits,
        })
    }

    /// Whether the router's model is hybrid (has Mamba layers, so prefix reuse goes through
    /// Marconi checkpoints).
    pub fn is_hybrid(router: &Router) -> bool {
        each!(routers(router), r => r.is_hybrid())
    }
}
