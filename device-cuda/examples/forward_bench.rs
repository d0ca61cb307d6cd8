//! `cargo run --release -p device-cuda --example forward_bench` (part of `cargo xtask gpu-check`):
//! the device forward step on the GPU.
//!
//! 1. Parity: both fixtures (`model/tests/fixtures/`), every prompt case, through
//!    `DeviceModel::forward` on the `CudaRuntime` against the host model: the whole prompt, then
//!    8 greedy decode steps; f32 weights within 1e-4 and bf16 weights with the same greedy ids
//!    (the criterion of `tests/forward.rs`, whose bf16 bound needs the host model with bf16
//!    matrices; here the figure is printed).
//! 2. Throughput: NemotronH-8B's shape (the published `nvidia/Nemotron-H-8B-Base-8K` config:
//!    hidden 4096, 52 layers `M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`, 128 Mamba heads
//!    of 64, state 128 in 8 groups, 32 query / 8 KV heads of 128, MLP 21504, vocabulary 131072)
//!    with seeded random bf16 weights built on the device: decode tokens/s at batch 1, 64 and
//!    256 with a 1024-token context (the KV of the context is the pool's zeroed blocks: the bytes
//!    read are those of real context, their values do not matter for timing), prefill tokens/s of
//!    a 4096-token prompt in chunks of 2048, and the fraction of the memory-bandwidth limit at
//!    batch 1: (weight bytes read per token + the context's KV + the Mamba state read) divided by
//!    the d2d copy bandwidth (2 × bytes / time of a 2 GiB `cuMemcpyDtoD`, as CUDA's bandwidthTest
//!    counts it), over the measured step time. Target: at least 60%.
//!
//! 3. The MTP head on the GPU (both fixtures' `mtp` checkpoints, f32): the head over every prompt
//!    position, fed by `forward_hidden`, against the host model's `Model::mtp`, within 1e-4 and
//!    with the same argmax on every row.
//!
//! `-- --sim` runs the same script on `SimRuntime` with a small config instead of the 8B shape (a
//! check of the script, not a measurement). `-- --probe` only opens the device and says which it
//! is. Without a usable device it prints the runtime's typed reason and exits with status 2,
//! having checked nothing.

use std::path::PathBuf;
use std::time::Instant;

use device_cuda::{
    CudaRuntime, DType, DeviceBuffer, DeviceModel, DeviceSlice, DeviceState, ForwardLimits,
    HiddenRows, Runtime, SimRuntime, StepArgs, StepOutput, StepRun, Stream, WeightImage, Workspace,
};
use model::{Config, KvPool, MambaStates, Model, PrefillRow, Scratch};

const S: Stream = Stream::Compute;

/// nvidia/Nemotron-H-8B-Base-8K's config.json (the fields the forward reads).
const NEMOTRON_H_8B: &str = r#"{
  "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
  "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 52,
  "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
  "layer_norm_epsilon": 1e-5, "mamba_num_heads": 128, "mamba_head_dim": 64,
  "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
  "use_bias": false, "use_conv_bias": true, "mamba_hidden_act": "silu",
  "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "intermediate_size": 21504, "mlp_bias": false, "mlp_hidden_act": "relu2"
}"#;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(name)
}

fn prompts(name: &str) -> Vec<Vec<u32>> {
    model::parity::prompts(&fixture(name)).expect("the fixture's cases.json")
}

/// The device's pool, slots and workspace for one model.
struct Device {
    model: DeviceModel,
    ws: Workspace,
    buffers: Vec<DeviceBuffer>,
    state: DeviceState,
}

impl Device {
    fn new(
        rt: &dyn Runtime,
        model: DeviceModel,
        blocks: usize,
        block_size: usize,
        slots: usize,
        limits: ForwardLimits,
    ) -> Device {
        let config = model.config().clone();
        let block_floats = KvPool::new(&config, 1, block_size)
            .expect("pool")
            .floats_per_block();
        let slot_floats = MambaStates::new(&config, 0)
            .expect("states")
            .floats_per_slot();
        let ws = Workspace::new(&config, limits).expect("workspace");
        let buffers = vec![
            rt.alloc((blocks * block_floats * 4).max(4))
                .expect("KV pool"),
            rt.alloc((slots * slot_floats * 4).max(4))
                .expect("state slots"),
            rt.alloc(ws.bytes()).expect("workspace"),
        ];
        let state = DeviceState {
            kv: buffers[0].range(0, blocks * block_floats * 4).expect("kv"),
            num_blocks: blocks,
            block_size,
            block_floats,
            states: buffers[1]
                .range(0, slots * slot_floats * 4)
                .expect("states"),
            num_slots: slots,
            slot_floats,
        };
        Device {
            model,
            ws,
            buffers,
            state,
        }
    }

    /// `model` uploaded with `dtype` matrices, for one sequence of up to 128 tokens a step over
    /// a pool of `blocks` blocks of `block_size` (the parity checks).
    fn one_sequence(
        rt: &dyn Runtime,
        model: &Model,
        dtype: DType,
        blocks: usize,
        block_size: usize,
    ) -> Device {
        let image = WeightImage::new(model, dtype).expect("image");
        let device_model = DeviceModel::upload(rt, model, &image).expect("upload");
        let limits = ForwardLimits {
            max_rows: 128,
            max_runs: 1,
            max_table: blocks,
        };
        Device::new(rt, device_model, blocks, block_size, 1, limits)
    }

    /// The arguments of a step over `runs` on this device's workspace and state.
    fn args<'a>(
        &'a self,
        runs: &'a [StepRun<'a>],
        tokens: DeviceSlice,
        out: StepOutput<'a>,
    ) -> StepArgs<'a> {
        StepArgs {
            workspace: self.buffers[2].all(),
            workspace_layout: &self.ws,
            state: &self.state,
            runs,
            tokens,
            out,
        }
    }

    /// One step; answers the logits of `logit_rows`.
    fn step(
        &self,
        rt: &dyn Runtime,
        runs: &[StepRun<'_>],
        tokens: &[u32],
        logit_rows: &[u32],
    ) -> Vec<f32> {
        let vocab = self.model.config().vocab_size;
        let token_buf = rt.alloc(tokens.len() * 4).expect("tokens");
        rt.upload(token_buf.all(), bytemuck::cast_slice(tokens), S)
            .expect("upload");
        let logits = rt
            .alloc((logit_rows.len() * vocab * 4).max(4))
            .expect("logits");
        let out = logits
            .range(0, logit_rows.len() * vocab * 4)
            .expect("logits");
        let step_out = StepOutput {
            logit_rows,
            logits: out,
        };
        self.model
            .forward(rt, &self.args(runs, token_buf.all(), step_out))
            .expect("forward");
        let mut bytes = vec![0u8; out.bytes()];
        rt.download(&mut bytes, out, S).expect("download");
        rt.free(token_buf).expect("free");
        rt.free(logits).expect("free");
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn free(self, rt: &dyn Runtime) {
        for buffer in self.buffers {
            rt.free(buffer).expect("free");
        }
        self.model.free(rt).expect("free");
    }
}

/// Every case of a fixture: the whole prompt, then 8 greedy decode steps, on the device and the
/// host; answers (max |device - host|, greedy ids identical).
fn parity(rt: &dyn Runtime, name: &str, dtype: DType) -> (f32, bool) {
    let model = Model::load(&fixture(name).join("model")).expect("fixture");
    let config = model.config().clone();
    let (block_size, blocks) = (16, 8);
    let device = Device::one_sequence(rt, &model, dtype, blocks, block_size);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut worst = 0.0f32;
    let mut same = true;
    for prompt in prompts(name) {
        let mut kv = KvPool::new(&config, blocks, block_size).expect("pool");
        let mut states = MambaStates::new(&config, 1).expect("states");
        let mut scratch = Scratch::new(&config);
        rt.memset(device.state.states, 0, S).expect("memset");
        let mut tokens = prompt.clone();
        let mut pos = 0;
        for _ in 0..9 {
            let mut host = Vec::new();
            model
                .prefill(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    PrefillRow {
                        tokens: &tokens,
                        start_pos: pos,
                        blocks: &table,
                        slot: 0,
                    },
                    false,
                    &mut host,
                )
                .expect("host");
            let runs = [StepRun {
                start_pos: pos,
                len: tokens.len(),
                slot: 0,
                blocks: &table,
                snapshots: &[],
            }];
            let ours = device.step(rt, &runs, &tokens, &[tokens.len() as u32 - 1]);
            for (a, b) in ours.iter().zip(&host) {
                worst = worst.max((a - b).abs());
            }
            let (h, d) = (model::parity::argmax(&host), model::parity::argmax(&ours));
            same &= h == d;
            pos += tokens.len();
            tokens = vec![h];
        }
    }
    device.free(rt);
    (worst, same)
}

/// The MTP head of `name/mtp` over every prompt position of every case, on the device (fed by
/// `forward_hidden`) and the host (`Model::mtp` fed by `forward_runs`); answers (max |device -
/// host|, argmax identical on every row).
fn mtp_parity(rt: &dyn Runtime, name: &str) -> (f32, bool) {
    let dir = fixture(name).join("mtp");
    let model = Model::load(&dir.join("model")).expect("MTP fixture");
    let config = model.config().clone();
    let (d, vocab) = (config.hidden_size, config.vocab_size);
    let (block_size, blocks) = (16usize, 16usize);
    let device = Device::one_sequence(rt, &model, DType::F32, blocks, block_size);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let (mut worst, mut same) = (0.0f32, true);
    for case in model::parity::mtp_cases(&dir).expect("the MTP fixture's cases.json") {
        let (prompt, greedy) = (case.prompt, case.greedy);
        let n = prompt.len();
        let mut next = prompt[1..].to_vec();
        next.push(greedy[0]);
        // The host: the main stack's hidden rows, then the head.
        let mut kv = KvPool::new(&config, blocks, block_size).expect("pool");
        let mut states = MambaStates::new(&config, 1).expect("states");
        let mut scratch = Scratch::new(&config);
        fn run<'a>(tokens: &'a [u32], table: &'a [u32]) -> model::RunRow<'a> {
            model::RunRow {
                tokens,
                start_pos: 0,
                blocks: table,
                slot: 0,
                snapshots: &[],
            }
        }
        let (mut logits, mut hidden) = (Vec::new(), Vec::new());
        model
            .forward_runs(
                &mut scratch,
                &mut kv,
                &mut states,
                &[run(&prompt, &table)],
                model::RunOutputs::All,
                &mut logits,
                Some(&mut hidden),
            )
            .expect("host main");
        let (mut host, mut host_out) = (Vec::new(), Vec::new());
        model
            .mtp(
                &mut scratch,
                &mut kv,
                &mut states,
                &[run(&next, &table)],
                &hidden,
                model::RunOutputs::All,
                &mut host,
                &mut host_out,
            )
            .expect("host MTP");
        // The device, from zeroed state.
        rt.memset(device.state.states, 0, S).expect("memset");
        let rows: Vec<u32> = (0..n as u32).collect();
        let buffers = [n * 4, n * vocab * 4, n * d * 4, n * d * 4]
            .map(|bytes| rt.alloc(bytes).expect("alloc"));
        let [tokens, device_logits, main_hidden, mtp_hidden] = &buffers;
        let runs = [StepRun {
            start_pos: 0,
            len: n,
            slot: 0,
            blocks: &table,
            snapshots: &[],
        }];
        let out = StepOutput {
            logit_rows: &rows,
            logits: device_logits.all(),
        };
        rt.upload(tokens.all(), bytemuck::cast_slice(&prompt), S)
            .expect("upload");
        let args = device.args(&runs, tokens.all(), out);
        device
            .model
            .forward_hidden(rt, &args, HiddenRows::Logit, main_hidden.all())
            .expect("device main");
        rt.upload(tokens.all(), bytemuck::cast_slice(&next), S)
            .expect("upload");
        device
            .model
            .mtp(rt, &args, main_hidden.all(), mtp_hidden.all())
            .expect("device MTP");
        let mut bytes = vec![0u8; n * vocab * 4];
        rt.download(&mut bytes, device_logits.all(), S)
            .expect("download");
        let ours: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for (a, b) in ours.iter().zip(&host) {
            worst = worst.max((a - b).abs());
        }
        for (a, b) in ours.chunks(vocab).zip(host.chunks(vocab)) {
            same &= model::parity::argmax(a) == model::parity::argmax(b);
        }
        for buffer in buffers {
            rt.free(buffer).expect("free");
        }
    }
    device.free(rt);
    (worst, same)
}

fn seconds(rt: &dyn Runtime, work: &mut dyn FnMut()) -> f64 {
    rt.sync_stream(S).expect("sync");
    let start = Instant::now();
    work();
    rt.sync_stream(S).expect("sync");
    start.elapsed().as_secs_f64()
}

fn bench(rt: &dyn Runtime, config: &Config, big: bool) -> bool {
    let (batches, context, prompt, chunk, steps) = if big {
        (
            vec![1usize, 64, 256],
            1024usize,
            4096usize,
            2048usize,
            20usize,
        )
    } else {
        (vec![1, 4], 48, 64, 32, 2)
    };
    let started = Instant::now();
    let model = DeviceModel::random(rt, config, DType::Bf16, 7).expect("random model");
    println!(
        "forward_bench: random bf16 model {} on the device, {:.2} GB, built in {:.1}s",
        config.pattern(),
        model.weight_bytes() as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    let block_size = 16;
    let max_batch = *batches.iter().max().expect("batches");
    let per_seq = (context + steps + 1).div_ceil(block_size);
    let blocks = (max_batch * per_seq).max(prompt.div_ceil(block_size));
    let device = Device::new(
        rt,
        model,
        blocks,
        block_size,
        max_batch,
        ForwardLimits {
            max_rows: chunk.max(max_batch),
            max_runs: max_batch,
            max_table: blocks,
        },
    );
    let vocab = config.vocab_size;
    let tables: Vec<Vec<u32>> = (0..max_batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let mut decode_1 = None;
    for &batch in &batches {
        // The step's tokens and logits stay on the device (a server reads back the argmax only).
        let token_buf = rt.alloc(batch * 4).expect("tokens");
        let logits = rt.alloc(batch * vocab * 4).expect("logits");
        let tokens: Vec<u32> = (0..batch as u32).map(|t| t * 7 % vocab as u32).collect();
        rt.upload(token_buf.all(), bytemuck::cast_slice(&tokens), S)
            .expect("upload");
        let rows: Vec<u32> = (0..batch as u32).collect();
        let step_at = |pos: usize| {
            let runs: Vec<StepRun<'_>> = (0..batch)
                .map(|s| StepRun {
                    start_pos: pos,
                    len: 1,
                    slot: s,
                    blocks: &tables[s],
                    snapshots: &[],
                })
                .collect();
            let out = StepOutput {
                logit_rows: &rows,
                logits: logits.all(),
            };
            device
                .model
                .forward(rt, &device.args(&runs, token_buf.all(), out))
                .expect("forward");
        };
        step_at(context); // warm-up
        let t = seconds(rt, &mut || {
            for i in 0..steps {
                step_at(context + 1 + i);
            }
        });
        rt.free(token_buf).expect("free");
        rt.free(logits).expect("free");
        let per_step = t / steps as f64;
        println!(
            "forward_bench: decode batch {batch:>3}, context {context}: {:.2} ms/step, {:.0} tokens/s",
            per_step * 1e3,
            batch as f64 / per_step
        );
        if batch == 1 {
            decode_1 = Some(per_step);
        }
    }
    // Prefill of one prompt in chunks, in slot 0 from a zero state.
    rt.memset(device.state.states, 0, S).expect("memset");
    let table: Vec<u32> = (0..prompt.div_ceil(block_size) as u32).collect();
    let tokens: Vec<u32> = (0..prompt as u32).map(|t| t * 13 % vocab as u32).collect();
    let t = seconds(rt, &mut || {
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let runs = [StepRun {
                start_pos: i * chunk,
                len: part.len(),
                slot: 0,
                blocks: &table,
                snapshots: &[],
            }];
            device.step(rt, &runs, part, &[part.len() as u32 - 1]);
        }
    });
    println!(
        "forward_bench: prefill of {prompt} tokens in chunks of {chunk}: {:.1} ms, {:.0} tokens/s",
        t * 1e3,
        prompt as f64 / t
    );
    // The bandwidth limit at batch 1.
    let copy_bytes = if big { 1usize << 31 } else { 1 << 20 };
    let a = rt.alloc(copy_bytes).expect("alloc");
    let b = rt.alloc(copy_bytes).expect("alloc");
    rt.copy(b.all(), a.all(), S).expect("copy");
    let reps = 10;
    let t = seconds(rt, &mut || {
        for _ in 0..reps {
            rt.copy(b.all(), a.all(), S).expect("copy");
        }
    });
    rt.free(a).expect("free");
    rt.free(b).expect("free");
    let bandwidth = 2.0 * copy_bytes as f64 * reps as f64 / t;
    let kv_bytes = config.count(model::LayerKind::Attention)
        * context
        * 2
        * config.num_key_value_heads
        * config.head_dim
        * 4;
    let state_bytes = device.state.slot_floats * 4;
    let weight_bytes = device.model.weight_bytes_per_token();
    let bytes = (weight_bytes + kv_bytes + state_bytes) as f64;
    let limit = bytes / bandwidth;
    let step = decode_1.expect("batch 1 ran");
    let fraction = limit / step;
    println!(
        "forward_bench: batch 1 reads {:.2} GB a token (weights {:.2}, KV {:.3}, state {:.3}); d2d bandwidth {:.0} GB/s; limit {:.2} ms, measured {:.2} ms: {:.0}% of the limit (target 60%)",
        bytes / 1e9,
        weight_bytes as f64 / 1e9,
        kv_bytes as f64 / 1e9,
        state_bytes as f64 / 1e9,
        bandwidth / 1e9,
        limit * 1e3,
        step * 1e3,
        fraction * 100.0
    );
    device.free(rt);
    !big || fraction >= 0.6
}

fn main() {
    let sim = std::env::args().any(|a| a == "--sim");
    let probe = std::env::args().any(|a| a == "--probe");
    let runtime: Box<dyn Runtime> = if sim {
        Box::new(SimRuntime::new().expect("SimRuntime"))
    } else {
        match CudaRuntime::new() {
            Ok(rt) => Box::new(rt),
            Err(err) => {
                println!("forward_bench: no usable GPU, checked nothing: {err}");
                std::process::exit(2);
            }
        }
    };
    let rt = runtime.as_ref();
    println!("forward_bench: on {}", rt.device_name());
    if probe {
        return;
    }
    let mut ok = true;
    for name in ["nemotron-h-tiny", "nemotron-h-alt"] {
        for dtype in [DType::F32, DType::Bf16] {
            let (diff, same) = parity(rt, name, dtype);
            let pass = same && (dtype == DType::Bf16 || diff <= 1e-4);
            println!(
                "forward_bench: parity {name} {dtype:?}: max |device - host| {diff:e}, greedy ids {}: {}",
                if same { "identical" } else { "DIFFER" },
                if pass { "ok" } else { "FAILED" }
            );
            ok &= pass;
        }
    }
    let config = if sim {
        let mut c = Config::tiny_demo();
        c.vocab_size = 512;
        c
    } else {
        Config::from_json_str(NEMOTRON_H_8B).expect("the 8B config")
    };
    for name in ["nemotron-h-tiny", "nemotron-h-alt"] {
        let (diff, same) = mtp_parity(rt, name);
        let pass = same && diff <= 1e-4;
        println!(
            "forward_bench: MTP head {name}/mtp F32: max |device - host| {diff:e}, argmax {}: {}",
            if same { "identical" } else { "DIFFER" },
            if pass { "ok" } else { "FAILED" }
        );
        ok &= pass;
    }
    let bench_ok = bench(rt, &config, !sim);
    if !bench_ok {
        println!("forward_bench: batch-1 decode is below 60% of the bandwidth limit");
    }
    println!(
        "forward_bench: {}",
        if ok { "parity ok" } else { "parity FAILED" }
    );
    if !ok {
        std::process::exit(1);
    }
}
