//! The CUDA router's memory plan and what part 1 runs of it on `SimRuntime`: the weights on the
//! device, the model's head (embedding gather, final RMSNorm, lm_head GEMM, argmax) against a
//! host reference, `Unsupported` naming the first layer kind without kernels, and a typed error
//! where there is no GPU.

use device_cuda::{
    CudaError, CudaRouter, CudaRouterConfig, CudaRouterError, DType, MemoryPlan, PlanError,
};
use device_io::{DeviceError, DeviceIo};
use model::{Config, Model};

fn tiny() -> Model {
    Model::random(Config::tiny_demo(), 7).unwrap()
}

fn config(dtype: DType) -> CudaRouterConfig {
    CudaRouterConfig {
        weights: dtype,
        max_step_tokens: 64,
        ..CudaRouterConfig::new(64 << 20, 4, 256)
    }
}

#[test]
fn the_budget_is_split_as_documented() {
    let model = tiny();
    let c = model.config();
    let router = config(DType::F32);
    let plan = MemoryPlan::from_budget(c, 1 << 20, &router).unwrap();
    // tiny_demo: 2 attention layers x K,V x 16 positions x 2 KV heads x 16 dims x 4 bytes.
    assert_eq!(plan.kv_block_bytes, 2 * 2 * 16 * 2 * 16 * 4);
    // 4 Mamba layers x ((4 - 1) x conv_dim 128 + 4 heads x 16 x 16) floats x 4 bytes.
    assert_eq!(plan.state_slot_bytes, 4 * (3 * 128 + 4 * 16 * 16) * 4);
    let fixed = (1u64 << 20)
        + (plan.state_slot_bytes * 8).div_ceil(256) * 256
        + plan.workspace_bytes
        + plan.logits_bytes
        + plan.io_bytes;
    let rest = router.budget_bytes - fixed;
    assert_eq!(
        plan.num_blocks as u64,
        (rest - rest / 4) / plan.kv_block_bytes
    );
    assert_eq!(
        plan.checkpoint_slots as u64,
        (rest / 4) / plan.state_slot_bytes
    );
    assert!(plan.total_bytes() <= router.budget_bytes);
    // Logits of two steps of 4 rows of 256 f32.
    assert_eq!(plan.logits_bytes, 2 * 4 * 256 * 4);

    let small = CudaRouterConfig {
        budget_bytes: fixed + 8 * plan.kv_block_bytes,
        ..router.clone()
    };
    assert_eq!(
        MemoryPlan::from_budget(c, 1 << 20, &small).unwrap_err(),
        PlanError::BudgetTooSmall {
            budget: fixed + 8 * plan.kv_block_bytes,
            what: "the fixed regions and the KV of one max_context sequence",
            needed: fixed + 16 * plan.kv_block_bytes * 4 / 3,
        }
    );
    let tiny_budget = CudaRouterConfig {
        budget_bytes: 1000,
        ..router.clone()
    };
    assert!(matches!(
        MemoryPlan::from_budget(c, 1 << 20, &tiny_budget),
        Err(PlanError::BudgetTooSmall { budget: 1000, .. })
    ));
    let no_rows = CudaRouterConfig {
        max_seqs: 0,
        ..router
    };
    assert_eq!(
        MemoryPlan::from_budget(c, 0, &no_rows)
            .unwrap_err()
            .to_string(),
        "invalid CUDA router config: max_seqs = 0 (must be at least 1)"
    );
}

/// The host's view of the head: rows of `embed[token]`, RMSNorm with `norm_f`, times `lm_headᵀ`,
/// in f64, with the weights (and, for bf16, the GEMM input) rounded as the device rounds them.
fn host_head(model: &Model, tokens: &[u32], dtype: DType) -> Vec<f64> {
    let c = model.config();
    let (h, v) = (c.hidden_size, c.vocab_size);
    let round = |x: f32| match dtype {
        DType::F32 => x,
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
    };
    let mut tensors = std::collections::HashMap::new();
    model.visit_tensors(&mut |name, _, data| {
        tensors.insert(
            name.to_owned(),
            data.iter().map(|&x| round(x)).collect::<Vec<f32>>(),
        );
    });
    let embed = &tensors["backbone.embeddings.weight"];
    let norm = &tensors["backbone.norm_f.weight"];
    let head = &tensors["lm_head.weight"];
    let mut out = Vec::new();
    for &t in tokens {
        let x = &embed[t as usize * h..(t as usize + 1) * h];
        let mean: f64 = x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>() / h as f64;
        let inv = 1.0 / (mean + c.layer_norm_epsilon).sqrt();
        let normed: Vec<f64> = x
            .iter()
            .zip(norm)
            .map(|(&a, &w)| f64::from(round((f64::from(w) * f64::from(a) * inv) as f32)))
            .collect();
        for row in 0..v {
            out.push(
                (0..h)
                    .map(|i| normed[i] * f64::from(head[row * h + i]))
                    .sum(),
            );
        }
    }
    out
}

#[test]
fn the_head_runs_on_the_sim_as_on_the_host() {
    let model = tiny();
    let tokens = [0u32, 1, 255, 42];
    for dtype in [DType::F32, DType::Bf16] {
        let router = CudaRouter::sim(&model, config(dtype)).unwrap();
        let (logits, argmax) = router.head(&tokens).unwrap();
        let want = host_head(&model, &tokens, dtype);
        let v = model.config().vocab_size;
        assert_eq!(logits.len(), tokens.len() * v);
        for (i, (&got, &want)) in logits.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{dtype:?} logit {i}: {got} vs {want}"
            );
        }
        for (r, &token) in argmax.iter().enumerate() {
            assert_eq!(
                token,
                model::parity::argmax(&logits[r * v..(r + 1) * v]),
                "{dtype:?} row {r}"
            );
        }
        // One row, and a step wider than the live slots is refused.
        let (one, _) = router.head(&tokens[..1]).unwrap();
        assert_eq!(one, logits[..v].to_vec());
        assert!(matches!(router.head(&[1; 5]), Err(CudaError::BadRange(_))));
        Box::new(router).teardown().unwrap();
    }
}

#[test]
fn a_model_step_names_the_missing_layer_kernels() {
    let router = CudaRouter::sim(&tiny(), config(DType::Bf16)).unwrap();
    assert_eq!(
        router.forward_support(),
        Err(DeviceError::Unsupported {
            what: "CUDA forward of a Mamba2 layer (the CUDA router does not run its forward kernels yet)"
        })
    );
    let facts = router.facts();
    assert_eq!(facts.kv_blocks_total, router.plan().num_blocks);
    assert_eq!(facts.kv_blocks_free, router.plan().num_blocks);
    assert_eq!(facts.live_slots_total, 4);
    assert_eq!(facts.checkpoint_slots_total, router.plan().checkpoint_slots);
    assert_eq!(facts.vocab_size, 256);
    // bf16 weights take half the bytes of f32 ones (each tensor 256-byte aligned).
    let f32_router = CudaRouter::sim(&tiny(), config(DType::F32)).unwrap();
    assert!(router.plan().weight_bytes < f32_router.plan().weight_bytes);
    assert_eq!(router.tensors().len(), f32_router.tensors().len());
}

/// Here there is no NVIDIA driver: opening the router is a typed error, never a panic.
#[test]
fn opening_without_a_gpu_is_a_typed_error() {
    match CudaRouter::open(&tiny(), config(DType::Bf16)) {
        Ok(router) => println!(
            "a CUDA device is present: {}",
            router.runtime().device_name()
        ),
        Err(CudaRouterError::Runtime(
            err @ (CudaError::NoDriver { .. }
            | CudaError::NoDevice(_)
            | CudaError::DriverTooOld { .. }),
        )) => println!("no GPU: {err}"),
        Err(other) => panic!("unexpected error: {other:?}"),
    }
}
