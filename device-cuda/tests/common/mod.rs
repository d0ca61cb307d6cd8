//! What the device forward tests share: a `DeviceModel` set up on `SimRuntime` with its
//! workspace, KV blocks and state slots ([`DeviceForward`]), one step launched from host tokens
//! and read back.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use device_cuda::{
    DType, DeviceBuffer, DeviceModel, DeviceState, ForwardLimits, Runtime, SimRuntime, StepArgs,
    StepOutput, StepRun, Stream, WeightImage, Workspace,
};
use model::{KvPool, MambaStates, Model};

/// The stream every step and copy of these tests runs on.
pub const S: Stream = Stream::Compute;

/// The device memory of a [`DeviceForward`]: the KV pool's blocks and the state slots, and the
/// largest step its workspace serves.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub blocks: usize,
    pub block_size: usize,
    pub slots: usize,
    pub limits: ForwardLimits,
}

/// The device forward of a model on a runtime: the model uploaded, its workspace, a KV pool of
/// `blocks` blocks and `slots` state slots, all zeroed.
pub struct DeviceForward {
    pub rt: SimRuntime,
    pub device: DeviceModel,
    pub ws: Workspace,
    pub ws_buf: DeviceBuffer,
    pub kv: DeviceBuffer,
    pub states: DeviceBuffer,
    pub state: DeviceState,
}

/// A step issued by [`DeviceForward::launch`] and not yet read: its token and logits buffers.
pub struct Launched {
    tokens: DeviceBuffer,
    logits: DeviceBuffer,
}

impl DeviceForward {
    /// Uploads `model` with `dtype` matrices and attention split every `split_keys` keys, and
    /// allocates the memory of `shape` (block and slot sizes as the host pools of the model's
    /// config have them).
    pub fn new(
        rt: SimRuntime,
        model: &Model,
        dtype: DType,
        split_keys: usize,
        shape: Shape,
    ) -> DeviceForward {
        let config = model.config();
        let block_floats = KvPool::new(config, 1, shape.block_size)
            .unwrap()
            .floats_per_block();
        let slot_floats = MambaStates::new(config, 1).unwrap().floats_per_slot();
        let image = WeightImage::new(model, dtype).unwrap();
        let device = DeviceModel::upload(&rt, model, &image)
            .unwrap()
            .with_split_keys(split_keys);
        let ws = Workspace::new(config, shape.limits).unwrap();
        let ws_buf = rt.alloc(ws.bytes()).unwrap();
        // A model without attention (or without Mamba) layers has empty blocks (or slots); the
        // runtime allocates no empty buffer, so those get 4 bytes and the state a slice of 0.
        let (kv_bytes, states_bytes) = (
            shape.blocks * block_floats * 4,
            shape.slots * slot_floats * 4,
        );
        let kv = rt.alloc(kv_bytes.max(4)).unwrap();
        let states = rt.alloc(states_bytes.max(4)).unwrap();
        let state = DeviceState {
            kv: kv.range(0, kv_bytes).unwrap(),
            num_blocks: shape.blocks,
            block_size: shape.block_size,
            block_floats,
            states: states.range(0, states_bytes).unwrap(),
            num_slots: shape.slots,
            slot_floats,
        };
        DeviceForward {
            rt,
            device,
            ws,
            ws_buf,
            kv,
            states,
            state,
        }
    }

    /// The arguments of a step over `runs` on this forward's workspace and state.
    pub fn args<'a>(
        &'a self,
        runs: &'a [StepRun<'a>],
        tokens: &DeviceBuffer,
        out: StepOutput<'a>,
    ) -> StepArgs<'a> {
        StepArgs {
            workspace: self.ws_buf.all(),
            workspace_layout: &self.ws,
            state: &self.state,
            runs,
            tokens: tokens.all(),
            out,
        }
    }

    /// Uploads `tokens` (every run's, in row order) and issues one forward over `runs` that
    /// keeps every row's logits, without waiting for it.
    pub fn launch(&self, runs: &[StepRun<'_>], tokens: &[u32]) -> Launched {
        let rows = tokens.len();
        let vocab = self.device.config().vocab_size;
        let token_buf = self.rt.alloc(rows * 4).unwrap();
        self.rt
            .upload(token_buf.all(), bytemuck::cast_slice(tokens), S)
            .unwrap();
        let logits = self.rt.alloc(rows * vocab * 4).unwrap();
        let logit_rows: Vec<u32> = (0..rows as u32).collect();
        let out = StepOutput {
            logit_rows: &logit_rows,
            logits: logits.all(),
        };
        self.device
            .forward(&self.rt, &self.args(runs, &token_buf, out))
            .unwrap();
        Launched {
            tokens: token_buf,
            logits,
        }
    }

    /// Waits for a launched step's logits (every row's, as f32 bytes) and frees its buffers.
    pub fn read(&self, launched: Launched) -> Vec<u8> {
        let mut bytes = vec![0u8; launched.logits.bytes()];
        self.rt
            .download(&mut bytes, launched.logits.all(), S)
            .unwrap();
        self.rt.free(launched.tokens).unwrap();
        self.rt.free(launched.logits).unwrap();
        bytes
    }

    /// One forward over `runs`: every row's logits as f32 bytes.
    pub fn step(&self, runs: &[StepRun<'_>], tokens: &[u32]) -> Vec<u8> {
        let launched = self.launch(runs, tokens);
        self.read(launched)
    }

    /// Frees every buffer and the model's weights.
    pub fn free(self) {
        for buffer in [self.ws_buf, self.kv, self.states] {
            self.rt.free(buffer).unwrap();
        }
        self.device.free(&self.rt).unwrap();
    }
}
