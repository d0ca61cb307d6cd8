//! The CUDA router's memory plan and a step of it on `SimRuntime`: a prefill through `DeviceIo`
//! against the host model, `Unsupported` for the speculative plans, and a typed error where
//! there is no GPU. (The whole router against the host router: `tests/tests/cuda_steps.rs`.)

use device_cuda::{
    CudaError, CudaRouter, CudaRouterConfig, CudaRouterError, DType, MemoryPlan, PlanError,
    PoolSizes,
};
use device_io::{testing, DeviceError, DeviceIo, Readback, StepPlan};
use model::{Config, KvPool, MambaStates, Model, PrefillRow, Scratch};
use router_book::RouterSeq;

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
    // Logits of two steps of 4 rows and 4 verified drafts (one per ring slot) of 256 f32.
    assert_eq!(plan.logit_rows(), 8);
    assert_eq!(plan.logits_bytes, 2 * 8 * 256 * 4);

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

/// Exact pool sizes (`CudaRouterConfig::pool`): the plan has exactly the blocks and checkpoint
/// slots asked for when the budget holds them, whatever else it holds; a budget short of them by
/// one byte, or fewer blocks than one `max_context` sequence, is a typed error.
#[test]
fn exact_pool_sizes_are_kept_or_refused() {
    let model = tiny();
    let c = model.config();
    let split = MemoryPlan::from_budget(c, 1 << 20, &config(DType::F32)).unwrap();
    let sizes = PoolSizes {
        kv_blocks: 20,
        checkpoint_slots: 3,
    };
    let exact = CudaRouterConfig {
        pool: Some(sizes),
        ..config(DType::F32)
    };
    let plan = MemoryPlan::from_budget(c, 1 << 20, &exact).unwrap();
    assert_eq!((plan.num_blocks, plan.checkpoint_slots), (20, 3));
    assert!(
        split.num_blocks > 20 && split.checkpoint_slots > 3,
        "{split:?}"
    );
    // The budget that holds exactly those sizes, and one byte less.
    let needed = plan.total_bytes();
    let fits = CudaRouterConfig {
        budget_bytes: needed,
        ..exact.clone()
    };
    let plan = MemoryPlan::from_budget(c, 1 << 20, &fits).unwrap();
    assert_eq!((plan.num_blocks, plan.checkpoint_slots), (20, 3));
    let short = CudaRouterConfig {
        budget_bytes: needed - 1,
        ..exact.clone()
    };
    assert_eq!(
        MemoryPlan::from_budget(c, 1 << 20, &short).unwrap_err(),
        PlanError::BudgetTooSmall {
            budget: needed - 1,
            what: "the fixed regions, the KV pool and the checkpoint slots asked for",
            needed,
        }
    );
    // Without the prefix cache there are no checkpoint slots, asked or not.
    let no_cache = CudaRouterConfig {
        prefix_cache: false,
        ..exact.clone()
    };
    let plan = MemoryPlan::from_budget(c, 1 << 20, &no_cache).unwrap();
    assert_eq!((plan.num_blocks, plan.checkpoint_slots), (20, 0));
    // max_context 256 needs 16 blocks of 16.
    let too_few = CudaRouterConfig {
        pool: Some(PoolSizes {
            kv_blocks: 15,
            ..sizes
        }),
        ..exact
    };
    assert_eq!(
        MemoryPlan::from_budget(c, 1 << 20, &too_few)
            .unwrap_err()
            .to_string(),
        "invalid CUDA router config: pool.kv_blocks = 15 (must hold one max_context sequence \
         and fit block ids of u32)"
    );
}

/// The host model's logits of the last position of `prompt` (one prefill from position 0).
fn host_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let c = model.config();
    let mut kv = KvPool::new(c, 64, 16).unwrap();
    let mut states = MambaStates::new(c, 1).unwrap();
    let mut scratch = Scratch::new(c);
    let blocks: Vec<u32> = (0..prompt.len().div_ceil(16) as u32).collect();
    let mut logits = Vec::new();
    model
        .prefill(
            &mut scratch,
            &mut kv,
            &mut states,
            PrefillRow {
                tokens: prompt,
                start_pos: 0,
                blocks: &blocks,
                slot: 0,
            },
            false,
            &mut logits,
        )
        .unwrap();
    logits
}

/// A prefill through `DeviceIo` on the router's own weights (the forward step's image, the
/// only copy on the device) gives the host model's logits: within 1e-4 with f32 weights, and
/// within the bf16 rounding of the weights' own size with bf16 ones, with the same argmax.
#[test]
fn a_prefill_step_runs_on_the_sim_as_on_the_host() {
    let model = tiny();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 256).collect();
    let want = host_logits(&model, &prompt);
    for (dtype, tolerance) in [(DType::F32, 1e-4), (DType::Bf16, 2e-2)] {
        let router = CudaRouter::sim(&model, config(dtype)).unwrap();
        let mut seq: RouterSeq = testing::seq(1, &prompt);
        let mut logits = Vec::new();
        let plan = StepPlan::Prefill {
            budgets: &[64],
            readback: Readback::HostLogits { into: &mut logits },
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        let step = router.await_result(ticket).unwrap();
        assert_eq!(step.rows[0].logits_row, Some(0));
        assert_eq!(logits.len(), want.len());
        let worst = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= tolerance, "{dtype:?}: max |device - host| {worst}");
        let plan = StepPlan::Decode {
            tokens: &[model::parity::argmax(&want)],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        assert!(router.await_result(ticket).unwrap().rows[0].token.is_some());
        testing::release(&router, &mut seq, false);
        Box::new(router).teardown().unwrap();
    }
}

#[test]
fn speculative_plans_are_unsupported_and_facts_are_the_plans() {
    let router = CudaRouter::sim(&tiny(), config(DType::Bf16)).unwrap();
    let mut seq: RouterSeq = testing::seq(1, &[1, 2, 3]);
    let plan = StepPlan::Draft { tokens: &[1], k: 2 };
    assert_eq!(
        router.launch(plan, &mut [&mut seq]).unwrap_err(),
        DeviceError::Unsupported { what: "Draft" }
    );
    let facts = router.facts();
    assert_eq!(facts.kv_blocks_total, router.plan().num_blocks);
    assert_eq!(facts.kv_blocks_free, router.plan().num_blocks);
    assert_eq!(facts.live_slots_total, 4);
    assert_eq!(facts.checkpoint_slots_total, router.plan().checkpoint_slots);
    assert_eq!(facts.vocab_size, 256);
    // bf16 weights take fewer bytes than f32 ones (norms and the SSM's parameters stay f32).
    let f32_router = CudaRouter::sim(&tiny(), config(DType::F32)).unwrap();
    assert!(router.plan().weight_bytes < f32_router.plan().weight_bytes);
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
