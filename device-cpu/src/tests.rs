//! Unit tests that look inside the router: the snapshot ring's state copies, when a Marconi
//! checkpoint is due, the byte-budget rule, config validation, and `facts()` while sequences run.

use device_io::testing::{self, release};
use device_io::{DeviceIo, Effect, EffectOutcome, Readback, Sequence, StepPlan};
use model::{Config, KvPool, MambaStates, Model};

use crate::{CheckpointBudget, CpuRouter, CpuRouterConfig, CpuSeq, RouterError};

fn hybrid() -> Model {
    Model::random(Config::tiny_demo(), 11).unwrap()
}

fn router(prefix_cache: bool) -> CpuRouter {
    let mut config = CpuRouterConfig::new(32, 3);
    config.checkpoints = CheckpointBudget::Slots(6);
    config.prefix_cache = prefix_cache;
    CpuRouter::new(hybrid(), config).unwrap()
}

fn seq(id: u64, len: u32) -> CpuSeq {
    let prompt: Vec<u32> = (0..len).map(|i| (i * 13 + 5) % 256).collect();
    testing::seq(id, &prompt)
}

fn run(router: &CpuRouter, plan: StepPlan<'_>, s: &mut CpuSeq) {
    let ticket = router.launch(plan, &mut [s]).unwrap();
    router.await_result(ticket).unwrap();
}

fn prefill(router: &CpuRouter, s: &mut CpuSeq) {
    let budgets = [s.prompt_len()];
    run(
        router,
        StepPlan::Prefill {
            budgets: &budgets,
            readback: Readback::Argmax,
        },
        s,
    );
}

fn decode(router: &CpuRouter, s: &mut CpuSeq, token: u32) {
    run(
        router,
        StepPlan::Decode {
            tokens: &[token],
            readback: Readback::Argmax,
        },
        s,
    );
}

/// State row `row` once every device work item submitted so far has run.
fn state_row(router: &CpuRouter, row: usize) -> Vec<f32> {
    router
        .inner
        .lock()
        .unwrap()
        .fence(&router.model, &router.device)
        .unwrap();
    let device = router.device.lock().unwrap();
    device.states.slot(row).unwrap().to_vec()
}

fn live_state(router: &CpuRouter, s: &CpuSeq) -> Vec<f32> {
    state_row(router, s.slot.unwrap())
}

#[test]
fn the_snapshot_ring_saves_and_restores_the_live_state() {
    let r = router(false);
    let mut s = seq(1, 20);
    prefill(&r, &mut s);
    r.apply(Effect::SsmSnapshotSave { seq: &s, slot: 2 })
        .unwrap();
    let saved = live_state(&r, &s);
    decode(&r, &mut s, 9);
    decode(&r, &mut s, 10);
    assert_ne!(live_state(&r, &s), saved);
    assert_eq!(
        r.apply(Effect::SsmSnapshotRestore {
            seq: &mut s,
            slot: 2
        })
        .unwrap(),
        EffectOutcome::Unit
    );
    assert_eq!(live_state(&r, &s), saved);
    release(&r, &mut s, false);
    assert!(r.inner.lock().unwrap().ring.iter().all(Option::is_none));
}

#[test]
fn a_marconi_checkpoint_is_due_exactly_at_a_block_boundary_a_decode_reaches() {
    let r = router(true);
    let mut s = seq(1, 14);
    prefill(&r, &mut s);
    // No end-of-input checkpoint: the prompt has no full block.
    assert_eq!(s.checkpoints_held(), (None, None));
    decode(&r, &mut s, 1);
    assert!(!s.checkpoint_due());
    decode(&r, &mut s, 2);
    assert_eq!(s.computed_len(), 16);
    assert!(s.checkpoint_due());
    r.apply(Effect::MarconiCheckpoint { seq: &mut s }).unwrap();
    assert!(!s.checkpoint_due());
    assert_eq!(s.checkpoints_held(), (None, Some(16)));
    assert_eq!(r.facts().checkpoint_slots_used, 1);
    // The checkpoint holds exactly the live state at 16.
    let (_, slot) = s.output_checkpoint.unwrap();
    let row = r.shape.book().checkpoint_row(slot.index());
    assert_eq!(state_row(&r, row), live_state(&r, &s));
    // A boundary passed without the effect is gone: the effect then takes nothing.
    for t in 0..16 {
        decode(&r, &mut s, t);
    }
    assert_eq!(s.computed_len(), 32);
    assert!(s.checkpoint_due());
    decode(&r, &mut s, 3);
    assert!(!s.checkpoint_due());
    r.apply(Effect::MarconiCheckpoint { seq: &mut s }).unwrap();
    assert_eq!(s.checkpoints_held(), (None, Some(16)));
    r.apply(Effect::ReleaseSeq {
        seq: &mut s,
        cache: false,
        what: "cancel",
    })
    .unwrap();
    assert_eq!(r.facts().checkpoint_slots_used, 0);
}

#[test]
fn facts_follow_running_sequences() {
    let r = router(true);
    let initial = r.facts();
    assert_eq!(
        (
            initial.block_size,
            initial.vocab_size,
            initial.max_context,
            initial.kv_blocks_total,
            initial.kv_blocks_free,
            initial.live_slots_total,
            initial.checkpoint_slots_total
        ),
        (16, 256, 512, 32, 32, 3, 6)
    );
    let mut s = seq(1, 40);
    prefill(&r, &mut s);
    let facts = r.facts();
    assert_eq!(facts.kv_blocks_free, 29);
    assert_eq!(facts.live_slots_used, 1);
    // The end-of-input checkpoint at 32, held by the sequence until its release.
    assert_eq!(s.checkpoints_held(), (Some(32), None));
    assert_eq!(facts.checkpoint_slots_used, 1);
    release(&r, &mut s, true);
    let facts = r.facts();
    // The tree keeps the two full blocks up to the checkpoint; the partial third is free.
    assert_eq!(
        (
            facts.kv_blocks_cached,
            facts.kv_blocks_free,
            facts.live_slots_used
        ),
        (2, 30, 0)
    );
    assert_eq!(facts.checkpoint_slots_used, 1);
    r.clear_prefix_cache().unwrap();
    assert_eq!(r.facts(), initial);
}

#[test]
fn a_byte_budget_is_split_by_the_documented_rule() {
    let config = Config::tiny_demo();
    let state = 4 * MambaStates::new(&config, 0).unwrap().floats_per_slot() as u64;
    let block = 4 * KvPool::new(&config, 1, 16).unwrap().floats_per_block() as u64;
    let budget = 4 << 20;
    let split = CpuRouterConfig::from_byte_budget(&config, budget, 8, 1024).unwrap();
    let rest = budget - state * (8 + 4);
    assert_eq!(split.checkpoints, CheckpointBudget::Bytes(rest / 4));
    assert_eq!(split.num_blocks as u64, (rest - rest / 4) / block);
    assert_eq!(split.checkpoint_slots(state), (rest / 4 / state) as usize);
    assert_eq!((split.max_seqs, split.max_context), (8, Some(1024)));
    CpuRouter::new(Model::random(config.clone(), 1).unwrap(), split).unwrap();

    let err = CpuRouterConfig::from_byte_budget(&config, state, 8, 1024).unwrap_err();
    assert!(matches!(
        err,
        RouterError::BudgetTooSmall {
            what: "the live slots and the snapshot ring",
            ..
        }
    ));
    let err = CpuRouterConfig::from_byte_budget(&config, state * 12 + 100, 8, 1024).unwrap_err();
    assert!(matches!(
        err,
        RouterError::BudgetTooSmall {
            what: "one sequence of max_context tokens",
            ..
        }
    ));
}

#[test]
fn bad_configs_name_the_field() {
    let check = |edit: fn(&mut CpuRouterConfig), field: &str| {
        let mut config = CpuRouterConfig::new(8, 2);
        edit(&mut config);
        match CpuRouter::new(hybrid(), config) {
            Err(RouterError::BadConfig { field: got, .. }) => assert_eq!(got, field),
            other => panic!("{field}: {other:?}"),
        }
    };
    check(|c| c.block_size = 0, "block_size");
    check(|c| c.max_seqs = 0, "max_seqs");
    check(|c| c.max_context = Some(0), "max_context");
    check(|c| c.max_context = Some(8 * 16 + 1), "num_blocks");
    let err = CpuRouter::new(hybrid(), {
        let mut c = CpuRouterConfig::new(8, 2);
        c.max_context = Some(200);
        c
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid router config: num_blocks = 8 (must hold one sequence of max_context 200 tokens: at least 13)"
    );
}

#[test]
fn max_context_defaults_to_the_models_context_and_may_not_exceed_it() {
    let config = Config {
        max_position_embeddings: Some(100),
        ..Config::tiny_demo()
    };
    let model = Model::random(config, 11).unwrap();
    let context = |max_context: Option<usize>, num_blocks: usize| {
        let mut c = CpuRouterConfig::new(num_blocks, 2);
        c.max_context = max_context;
        CpuRouter::new(model.clone(), c).map(|r| r.facts().max_context)
    };
    // The model's 100 tokens, unless the pool holds less; a smaller value may be asked for.
    assert_eq!(context(None, 32).unwrap(), 100);
    assert_eq!(context(None, 4).unwrap(), 64);
    assert_eq!(context(Some(80), 32).unwrap(), 80);
    assert_eq!(
        context(Some(101), 32).unwrap_err().to_string(),
        "invalid router config: max_context = 101 (must not exceed the model's \
         max_position_embeddings 100)"
    );
    // Without a declared context the pool decides, as before.
    let mut c = CpuRouterConfig::new(32, 2);
    c.max_context = None;
    assert_eq!(
        CpuRouter::new(hybrid(), c).unwrap().facts().max_context,
        512
    );
}

#[test]
fn a_model_without_attention_caches_through_checkpoints_alone() {
    let mut config = Config::tiny_demo();
    config.layer_kinds = vec![
        model::LayerKind::Mamba,
        model::LayerKind::Mlp,
        model::LayerKind::Mamba,
    ];
    config.num_hidden_layers = 3;
    let model = Model::random(config, 5).unwrap();
    let build = |prefix_cache| {
        let mut c = CpuRouterConfig::new(16, 2);
        c.prefix_cache = prefix_cache;
        CpuRouter::new(model.clone(), c).unwrap()
    };
    let (on, off) = (build(true), build(false));
    assert_eq!(on.shape.layout.floats_per_block, 0);
    let logits = |r: &CpuRouter, id| {
        let mut s = seq(id, 40);
        let mut host = Vec::new();
        let ticket = r
            .launch(
                StepPlan::Prefill {
                    budgets: &[40],
                    readback: Readback::HostLogits { into: &mut host },
                },
                &mut [&mut s],
            )
            .unwrap();
        let cached = r.await_result(ticket).unwrap().rows[0]
            .prefill
            .unwrap()
            .cached;
        release(r, &mut s, true);
        (cached, host.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    let (first, want) = logits(&off, 1);
    assert_eq!(first, 0);
    assert_eq!(logits(&on, 1), (0, want.clone()));
    assert_eq!(logits(&on, 2), (32, want));
}
