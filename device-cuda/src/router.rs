//! `CudaRouter`: the model's weights and the memory plan's regions on a [`Runtime`], and the part
//! of the forward step that part 1's kernels compute.
//!
//! What exists now: opening (typed errors where there is no driver or device), the memory plan
//! ([`MemoryPlan`]), the weights uploaded in the configured element type, every region
//! allocated (KV pool, live / checkpoint / ring state rows, workspace, logits and per-row
//! buffers, feed cells), the model's head on the device ([`CudaRouter::head`]: embedding gather,
//! final RMSNorm, `lm_head` GEMM, argmax into the feed cells), and `DeviceIo` with every effect
//! real on the device and the bookkeeping of `router_book` (see the `io` module).
//!
//! What does not exist yet: the plans' bookkeeping and the call into the forward kernels
//! (`DeviceModel::forward`, part 2), so a model step answers [`DeviceError::Unsupported`] naming
//! the first layer kind ([`CudaRouter::forward_support`]).

use std::sync::Mutex;

use device_io::DeviceError;
use model::{Config, LayerKind, Model};
use router_book::image::Layout;
use router_book::{BookShape, CacheConfig, Caches};

use crate::error::CudaError;
use crate::io::Inner;
use crate::kernels;
use crate::memory::{CudaRouterConfig, MemoryPlan, PlanError, ALIGN};
use crate::runtime::{DType, DeviceBuffer, DeviceSlice, Event, Gemm, Runtime, Stream};
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

/// One weight tensor on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    /// Its checkpoint name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its byte offset in the weights buffer (a multiple of [`ALIGN`]).
    pub offset: usize,
    /// Its bytes.
    pub bytes: usize,
}

/// The device buffers of the plan.
#[derive(Debug)]
pub(crate) struct Buffers {
    pub weights: DeviceBuffer,
    pub kv: DeviceBuffer,
    pub states: DeviceBuffer,
    pub workspace: DeviceBuffer,
    pub logits: DeviceBuffer,
    pub io: DeviceBuffer,
}

/// The CUDA router. See the module docs.
#[derive(Debug)]
pub struct CudaRouter {
    runtime: Box<dyn Runtime>,
    config: Config,
    fingerprint: u64,
    router: CudaRouterConfig,
    plan: MemoryPlan,
    tensors: Vec<TensorPlace>,
    buffers: Option<Buffers>,
    book_shape: BookShape,
    inner: Mutex<Inner>,
    /// Recorded on one stream and waited on by the other, to order them.
    join: Option<Event>,
}

fn align(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN as usize) * ALIGN as usize
}

/// The weights of `model` as device bytes in `dtype`, each tensor at an aligned offset.
fn weight_image(model: &Model, dtype: DType) -> (Vec<u8>, Vec<TensorPlace>) {
    let mut bytes = Vec::new();
    let mut places = Vec::new();
    model.visit_tensors(&mut |name, shape, data| {
        let offset = align(bytes.len());
        bytes.resize(offset, 0);
        match dtype {
            DType::F32 => bytes.extend(data.iter().flat_map(|v| v.to_le_bytes())),
            DType::Bf16 => bytes.extend(
                data.iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()),
            ),
        }
        places.push(TensorPlace {
            name: name.to_owned(),
            shape: shape.to_vec(),
            offset,
            bytes: data.len() * dtype.bytes(),
        });
    });
    (bytes, places)
}

/// What a layer kind needs that the router does not do yet: its forward kernels exist
/// (`DeviceModel::forward`), but the plans do not call them.
fn missing_kernels(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::Mamba => "CUDA forward of a Mamba2 layer (the CUDA router does not run its forward kernels yet)",
        LayerKind::Attention => "CUDA forward of an attention layer (the CUDA router does not run its forward kernels yet)",
        LayerKind::Mlp => "CUDA forward of an MLP layer (the CUDA router does not run its forward kernels yet)",
        LayerKind::Moe => "CUDA forward of a MoE layer (the CUDA router does not run its forward kernels yet)",
    }
}

impl CudaRouter {
    /// Builds the router for `model` on `runtime`: plans the budget, uploads the weights and
    /// allocates every region.
    pub fn new(
        model: &Model,
        runtime: Box<dyn Runtime>,
        router: CudaRouterConfig,
    ) -> Result<CudaRouter, CudaRouterError> {
        let (image, tensors) = weight_image(model, router.weights);
        let plan = MemoryPlan::from_budget(model.config(), image.len() as u64, &router)?;
        let book_shape = BookShape {
            block_size: plan.block_size,
            max_seqs: plan.live_slots,
            checkpoint_slots: plan.checkpoint_slots,
            snapshot_slots: plan.snapshot_slots,
            max_context: router.max_context,
            max_depth: 2,
            hybrid: plan.state_slot_bytes > 0,
            layout: Layout {
                fingerprint: model.fingerprint(),
                block_size: plan.block_size,
                floats_per_block: (plan.kv_block_bytes / 4) as usize,
                floats_per_slot: (plan.state_slot_bytes / 4) as usize,
                max_context: router.max_context,
                vocab_size: model.config().vocab_size,
            },
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
        let mut built = CudaRouter {
            runtime,
            config: model.config().clone(),
            fingerprint: model.fingerprint(),
            router,
            plan,
            tensors,
            buffers: None,
            book_shape,
            inner: Mutex::new(Inner::new(cache, plan.live_slots, plan.snapshot_slots)),
            join: Some(join),
        };
        built.allocate(&image)?;
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

    fn allocate(&mut self, image: &[u8]) -> Result<(), CudaError> {
        let rt = self.runtime.as_ref();
        let plan = self.plan;
        let size = |bytes: u64| usize::try_from(bytes).unwrap_or(usize::MAX);
        let weights = rt.alloc(image.len())?;
        rt.upload(weights.all(), image, Stream::Copy)?;
        let buffers = Buffers {
            weights,
            kv: rt.alloc(size(plan.kv_bytes()))?,
            states: rt.alloc(size(plan.state_bytes()))?,
            workspace: rt.alloc(size(plan.workspace_bytes))?,
            logits: rt.alloc(size(plan.logits_bytes))?,
            io: rt.alloc(size(plan.io_bytes))?,
        };
        rt.sync_stream(Stream::Copy)?;
        self.buffers = Some(buffers);
        Ok(())
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

    /// Where each weight tensor lives in the weights buffer.
    pub fn tensors(&self) -> &[TensorPlace] {
        &self.tensors
    }

    /// Whether this build can run a forward step of the model: `Ok` when every layer kind has
    /// kernels, else [`DeviceError::Unsupported`] naming the first layer kind that has none.
    pub fn forward_support(&self) -> Result<(), DeviceError> {
        match self.config.layer_kinds.first() {
            Some(&kind) => Err(DeviceError::Unsupported {
                what: missing_kernels(kind),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn buffers(&self) -> Result<&Buffers, CudaError> {
        self.buffers
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the router was torn down".to_owned()))
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

    fn tensor(&self, name: &str) -> Result<DeviceSlice, CudaError> {
        let buffers = self.buffers()?;
        let place = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| CudaError::BadRange(format!("no weight tensor {name}")))?;
        buffers.weights.range(place.offset, place.bytes)
    }

    /// The model's head alone on the device: embedding gather of `tokens`, the final RMSNorm,
    /// the `lm_head` GEMM and the argmax (also left in the feed cells). Answers the logits
    /// (`tokens.len()` rows of `vocab_size`) and the argmax of each row. Part 2 puts the layers
    /// between the gather and the norm; this is what part 1's kernels compute end to end.
    pub fn head(&self, tokens: &[u32]) -> Result<(Vec<f32>, Vec<u32>), CudaError> {
        let rows = tokens.len();
        let hidden = self.config.hidden_size;
        let vocab = self.config.vocab_size;
        if rows == 0 || rows > self.plan.live_slots {
            return Err(CudaError::BadRange(format!(
                "{rows} rows: a step has 1..={} rows",
                self.plan.live_slots
            )));
        }
        let rt = self.runtime.as_ref();
        let buffers = self
            .buffers
            .as_ref()
            .ok_or_else(|| CudaError::Sticky("the router was torn down".to_owned()))?;
        let dtype = self.router.weights;
        let s = Stream::Compute;
        // Workspace: residual [rows, hidden] f32, normed [rows, hidden] f32, then the bf16 copy.
        let act = rows * hidden * 4;
        let x = buffers.workspace.range(0, act)?;
        let normed = buffers.workspace.range(align(act), act)?;
        let io = &buffers.io;
        let token_buf = io.range(0, rows * 4)?;
        let out = io.range(align(rows * 4), rows * 4)?;
        let feed = io.range(2 * align(self.plan.live_slots * 4), rows * 4)?;
        let logits = buffers.logits.range(0, rows * vocab * 4)?;
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        rt.upload(token_buf, &ids, s)?;
        kernels::embedding_gather(
            rt,
            s,
            x,
            self.tensor("backbone.embeddings.weight")?,
            dtype,
            token_buf,
            rows,
            hidden,
            vocab,
        )?;
        let eps = self.config.layer_norm_epsilon as f32;
        kernels::rmsnorm(
            rt,
            s,
            normed,
            x,
            self.tensor("backbone.norm_f.weight")?,
            dtype,
            rows,
            hidden,
            eps,
        )?;
        let a = match dtype {
            DType::F32 => normed,
            DType::Bf16 => {
                let half = buffers.workspace.range(2 * align(act), rows * hidden * 2)?;
                kernels::f32_to_bf16(rt, s, half, normed, rows * hidden)?;
                half
            }
        };
        rt.gemm(
            &Gemm {
                m: rows,
                n: vocab,
                k: hidden,
                dtype,
                a,
                b: self.tensor("lm_head.weight")?,
                c: logits,
            },
            s,
        )?;
        kernels::argmax(rt, s, logits, None, rows, vocab, out, Some(feed))?;
        let mut logit_bytes = vec![0u8; rows * vocab * 4];
        rt.download(&mut logit_bytes, logits, s)?;
        let mut out_bytes = vec![0u8; rows * 4];
        rt.download(&mut out_bytes, out, s)?;
        Ok((
            logit_bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            out_bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }

    /// Waits for both streams and frees every region and the event; answers the bookkeeping
    /// (for teardown's report) and the first device error.
    pub(crate) fn into_parts(mut self) -> (Result<Inner, String>, Result<(), CudaError>) {
        let rt = self.runtime.as_ref();
        let mut freed = Stream::ALL
            .iter()
            .try_for_each(|&stream| rt.sync_stream(stream));
        if let Some(buffers) = self.buffers.take() {
            for buffer in [
                buffers.weights,
                buffers.kv,
                buffers.states,
                buffers.workspace,
                buffers.logits,
                buffers.io,
            ] {
                let done = rt.free(buffer);
                freed = freed.and(done);
            }
        }
        if let Some(event) = self.join.take() {
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
