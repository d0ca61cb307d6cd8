//! LoRA on the host router: adapter slots and their commands (acks and typed errors), a row's
//! output with an adapter (against transformers + PEFT and against the model alone), mixed
//! batches (each row's bits alone), the prefix cache and the Marconi store never sharing entries
//! across adapters (hybrid and attention-only models), spill and restore with an adapter, and
//! commands refused while a step is in flight.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{
    AdapterInfo, DeviceError, DeviceIo, Effect, LoraAck, LoraCommand, LoraError, Readback, SeqSpec,
    Sequence, StepPlan,
};
use model::parity::max_abs_diff;
use model::{KvPool, LoraAdapter, LoraSpec, MambaStates, Model, PrefillRow, Scratch};

fn lora_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny-lora")
        .join(name)
}

fn seq_with(id: u64, prompt: &[u32], adapter: Option<u32>) -> CpuSeq {
    CpuSeq::create(SeqSpec {
        id,
        prompt,
        adapter,
        cache_salt: None,
    })
}

fn load(router: &mut CpuRouter, adapter: u32, path: &Path) -> Result<LoraAck, LoraError> {
    router.lora(LoraCommand::Load {
        adapter,
        path: path.to_owned(),
    })
}

/// Random adapters for `model`, saved in PEFT's format under `dir` (one folder per seed).
fn random_adapters(model: &Model, dir: &Path, seeds: &[u64]) -> Vec<PathBuf> {
    seeds
        .iter()
        .map(|&seed| {
            let mut spec = LoraSpec::all_linear(2 + seed as usize % 3);
            spec.b_range = 0.4;
            let adapter = LoraAdapter::random(model, &spec, seed).unwrap();
            let path = dir.join(format!("adapter-{seed}"));
            adapter.save(&path, model.config()).unwrap();
            path
        })
        .collect()
}

#[test]
fn slots_load_unload_and_list() {
    let mut config = CpuRouterConfig::new(64, 4);
    config.lora_slots = 2;
    let mut router = CpuRouter::new(hybrid_model(), config).unwrap();
    let a = lora_fixture("adapter-a");
    let b = lora_fixture("adapter-b");
    let info = |adapter, slot, path: &Path, rank, modules, sequences| AdapterInfo {
        adapter,
        slot,
        path: path.to_owned(),
        rank,
        modules,
        sequences,
    };
    assert_eq!(
        load(&mut router, 5, &a),
        Ok(LoraAck::Loaded(info(5, 0, &a, 8, 20, 0)))
    );
    assert_eq!(
        load(&mut router, 5, &b),
        Err(LoraError::AlreadyLoaded {
            adapter: 5,
            slot: 0
        })
    );
    // A bad folder: the error names the file and the problem, and takes no slot.
    let missing = lora_fixture("no-such-adapter");
    match load(&mut router, 6, &missing) {
        Err(LoraError::BadAdapter { adapter: 6, reason }) => assert_eq!(
            reason,
            format!(
                "LoRA adapter file {}: cannot read it: No such file or directory (os error 2)",
                missing.join("adapter_config.json").display()
            )
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        load(&mut router, 6, &b),
        Ok(LoraAck::Loaded(info(6, 1, &b, 4, 5, 0)))
    );
    assert_eq!(
        load(&mut router, 7, &b),
        Err(LoraError::NoFreeSlot { slots: 2 })
    );
    // A live sequence holds its adapter.
    let prompt = tokens(3, 20);
    let mut s = seq_with(42, &prompt, Some(6));
    prefill(&router, &mut s, 64);
    assert_eq!(
        router.lora(LoraCommand::List),
        Ok(LoraAck::Listed {
            slots: 2,
            adapters: vec![info(5, 0, &a, 8, 20, 0), info(6, 1, &b, 4, 5, 1)]
        })
    );
    assert_eq!(
        router.lora(LoraCommand::Unload { adapter: 6 }),
        Err(LoraError::InUse {
            adapter: 6,
            sequences: vec![42]
        })
    );
    release(&router, &mut s, true);
    assert_eq!(
        router.lora(LoraCommand::Unload { adapter: 6 }),
        Ok(LoraAck::Unloaded {
            adapter: 6,
            slot: 1
        })
    );
    assert_eq!(
        router.lora(LoraCommand::Unload { adapter: 6 }),
        Err(LoraError::NotLoaded { adapter: 6 })
    );
    // A sequence naming an adapter that is not loaded is refused and changes nothing.
    let before = router.facts();
    let mut s = seq_with(43, &prompt, Some(6));
    let err = router
        .launch(
            StepPlan::Prefill {
                budgets: &[64],
                readback: Readback::Argmax,
            },
            &mut [&mut s],
        )
        .unwrap_err();
    assert_eq!(
        err,
        DeviceError::Invalid {
            what: "Prefill",
            detail: "row 0 (sequence 43) names an adapter that cannot be used: adapter 6 is not \
                     loaded"
                .to_string()
        }
    );
    assert_eq!(router.facts(), before);
    assert!(!s.holds_resources());
    Box::new(router).teardown().unwrap();
}

#[test]
fn commands_are_refused_while_a_step_is_in_flight() {
    let mut config = CpuRouterConfig::new(64, 4);
    config.max_depth = 2;
    let mut router = CpuRouter::new(hybrid_model(), config).unwrap();
    let prompt = tokens(1, 10);
    let mut s = seq(1, &prompt);
    let ticket = router
        .launch(
            StepPlan::Prefill {
                budgets: &[64],
                readback: Readback::Argmax,
            },
            &mut [&mut s],
        )
        .unwrap();
    assert_eq!(
        load(&mut router, 1, &lora_fixture("adapter-a")),
        Err(LoraError::Busy { in_flight: 1 })
    );
    assert_eq!(
        router.lora(LoraCommand::List),
        Err(LoraError::Busy { in_flight: 1 })
    );
    router.await_result(ticket).unwrap();
    assert!(matches!(
        load(&mut router, 1, &lora_fixture("adapter-a")),
        Ok(LoraAck::Loaded(_))
    ));
    release(&router, &mut s, false);
    Box::new(router).teardown().unwrap();
}

/// Prompt logits rows and greedy decode through the router, with an adapter, against
/// transformers + PEFT (the fixture's reference), within 1e-4 and with its greedy ids.
#[test]
fn router_rows_with_an_adapter_match_peft() {
    let mut router = router(hybrid_model(), 16, true);
    load(&mut router, 1, &lora_fixture("adapter-a")).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(lora_fixture("cases.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(lora_fixture("expected.safetensors")).unwrap();
    let expected = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let case = &cases["adapters"][0]["cases"][3];
    let prompt: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(case["greedy_ids"].clone()).unwrap();
    let want = |name: &str| -> Vec<f32> {
        expected
            .tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let prompt_logits = want("a.case3.prompt_logits");
    let decode_logits = want("a.case3.decode_logits");
    let mut s = seq_with(1, &prompt, Some(1));
    let (last, _) = prefill(&router, &mut s, 13);
    let rows = generate(&router, &mut s, last, greedy.len());
    assert!(max_abs_diff(&rows[0], &prompt_logits[prompt_logits.len() - 256..]) < 1e-4);
    for (step, row) in rows.iter().take(greedy.len()).enumerate() {
        assert_eq!(argmax(row), greedy[step]);
        if step > 0 {
            let want = &decode_logits[(step - 1) * 256..step * 256];
            assert!(
                max_abs_diff(row, want) < 1e-4,
                "step {step}: {}",
                max_abs_diff(row, want)
            );
        }
    }
    release(&router, &mut s, true);
    Box::new(router).teardown().unwrap();
}

/// A decode batch of rows with three adapters and one without gives each row the bits it gets
/// alone on a router of its own; and a row's logits are those of the model with that adapter.
#[test]
fn a_mixed_batch_equals_each_row_alone() {
    let model = hybrid_model();
    let dir = tempfile::tempdir().unwrap();
    let paths = random_adapters(&model, dir.path(), &[1, 2, 3]);
    let adapters: [Option<u32>; 4] = [Some(11), None, Some(12), Some(13)];
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(10 + i, 9 + 5 * i as usize)).collect();
    let steps = 6;
    let setup = |router: &mut CpuRouter| {
        for (id, path) in [11, 12, 13].into_iter().zip(&paths) {
            load(router, id, path).unwrap();
        }
    };

    // Alone: a fresh router per row.
    let mut alone = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut router = router(model.clone(), 16, false);
        setup(&mut router);
        let mut s = seq_with(i as u64, prompt, adapters[i]);
        let (last, _) = prefill(&router, &mut s, 64);
        alone.push(generate(&router, &mut s, last, steps));
        release(&router, &mut s, false);
    }

    // Together: every decode step batches the four rows.
    let mut router = router(model.clone(), 16, false);
    setup(&mut router);
    let mut seqs: Vec<CpuSeq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| seq_with(i as u64, p, adapters[i]))
        .collect();
    let mut together: Vec<Vec<Vec<f32>>> = Vec::new();
    for s in seqs.iter_mut() {
        let (last, _) = prefill(&router, s, 64);
        together.push(vec![last]);
    }
    for _ in 0..steps {
        let inputs: Vec<u32> = together
            .iter()
            .map(|rows| argmax(rows.last().unwrap()))
            .collect();
        let mut rows: Vec<&mut CpuSeq> = seqs.iter_mut().collect();
        let logits = decode(&router, &mut rows, &inputs);
        for (i, row) in logits.chunks_exact(256).enumerate() {
            together[i].push(row.to_vec());
        }
    }
    for i in 0..4 {
        assert_eq!(bits(&together[i]), bits(&alone[i]), "row {i}");
    }

    // The rows with adapters are the model's rows with that adapter (prefill of the prompt).
    for (i, prompt) in prompts.iter().enumerate() {
        let adapter =
            adapters[i].map(|id| LoraAdapter::load(&paths[(id - 11) as usize], &model).unwrap());
        let config = model.config();
        let mut kv = KvPool::new(config, 4, 16).unwrap();
        let mut states = MambaStates::new(config, 1).unwrap();
        states.zero_slot(0).unwrap();
        let mut logits = Vec::new();
        let row = PrefillRow {
            tokens: prompt,
            start_pos: 0,
            blocks: &[0, 1, 2, 3],
            slot: 0,
        };
        model
            .prefill_with_adapter(
                &mut Scratch::new(config),
                &mut kv,
                &mut states,
                row,
                adapter.as_ref(),
                false,
                &mut logits,
            )
            .unwrap();
        assert_eq!(bits(&[logits]), bits(&alone[i][..1]), "row {i}");
    }
    // The control: the adapters change the rows.
    assert_ne!(bits(&alone[0][..1]), bits(&together[1][..1]));
    for s in seqs.iter_mut() {
        release(&router, s, false);
    }
    Box::new(router).teardown().unwrap();
}

/// Runs `prompt` under `adapter` to completion (two decode steps) and releases it to the cache;
/// answers how many prompt tokens came from the cache and the first token's logits.
fn serve(router: &CpuRouter, id: u64, prompt: &[u32], adapter: Option<u32>) -> (usize, Vec<f32>) {
    let mut s = seq_with(id, prompt, adapter);
    let (last, report) = prefill(router, &mut s, 64);
    let rows = generate(router, &mut s, last, 2);
    release(router, &mut s, true);
    (report.cached, rows[0].clone())
}

fn cache_isolation(model: Model) {
    let dir = tempfile::tempdir().unwrap();
    let paths = random_adapters(&model, dir.path(), &[4, 5, 6]);
    let mut router = router(model, 16, true);
    load(&mut router, 1, &paths[0]).unwrap();
    load(&mut router, 2, &paths[1]).unwrap();
    let prompt = tokens(7, 50); // three full blocks before the last token
    let (cached, with_1) = serve(&router, 1, &prompt, Some(1));
    assert_eq!(cached, 0);
    // Another adapter, and the base model, find nothing of adapter 1's entries.
    let (cached, with_2) = serve(&router, 2, &prompt, Some(2));
    assert_eq!(cached, 0);
    let (cached, base) = serve(&router, 3, &prompt, None);
    assert_eq!(cached, 0);
    // Each finds its own, with the same bits as computed.
    for (id, adapter, first) in [
        (4, Some(1), &with_1),
        (5, Some(2), &with_2),
        (6, None, &base),
    ] {
        let (cached, logits) = serve(&router, id, &prompt, adapter);
        assert_eq!(cached, 48, "adapter {adapter:?}");
        assert_eq!(bits(&[logits]), bits(std::slice::from_ref(first)));
    }
    assert_ne!(
        bits(std::slice::from_ref(&with_1)),
        bits(std::slice::from_ref(&with_2))
    );
    // Id 1 unloaded and another adapter loaded under it: the old entries are not served.
    router.lora(LoraCommand::Unload { adapter: 1 }).unwrap();
    load(&mut router, 1, &paths[2]).unwrap();
    let (cached, with_new_1) = serve(&router, 7, &prompt, Some(1));
    assert_eq!(cached, 0);
    assert_ne!(bits(&[with_new_1]), bits(&[with_1]));
    Box::new(router).teardown().unwrap();
}

/// The hybrid model: prefix reuse goes through the Marconi store.
#[test]
fn the_marconi_store_never_shares_entries_across_adapters() {
    cache_isolation(hybrid_model());
}

/// The attention-only model: prefix reuse goes through the hash-chain prefix cache.
#[test]
fn the_prefix_cache_never_shares_blocks_across_adapters() {
    cache_isolation(attention_model());
}

#[test]
fn spill_and_restore_keep_the_adapter() {
    let model = hybrid_model();
    let dir = tempfile::tempdir().unwrap();
    let paths = random_adapters(&model, dir.path(), &[8]);
    let mut router = router(model, 16, false);
    load(&mut router, 3, &paths[0]).unwrap();
    let prompt = tokens(9, 21);
    // Uninterrupted.
    let mut s = seq_with(1, &prompt, Some(3));
    let (last, _) = prefill(&router, &mut s, 64);
    let straight = generate(&router, &mut s, last, 6);
    release(&router, &mut s, false);
    // Spilled after three steps, restored, continued.
    let mut s = seq_with(2, &prompt, Some(3));
    let (last, _) = prefill(&router, &mut s, 64);
    let mut rows = generate(&router, &mut s, last, 3);
    let mut image = Vec::new();
    router
        .apply(Effect::SaveSequenceState {
            seq: &s,
            writer: &mut image,
        })
        .unwrap();
    release(&router, &mut s, false);
    let mut restored = seq_with(2, &prompt, Some(3));
    router
        .apply(Effect::RestoreSequenceState {
            seq: &mut restored,
            reader: &mut image.as_slice(),
        })
        .unwrap();
    let last = rows.pop().unwrap();
    rows.extend(generate(&router, &mut restored, last, 3));
    assert_eq!(bits(&rows), bits(&straight));
    // Unloaded, the adapter cannot come back with a restore.
    release(&router, &mut restored, false);
    router.lora(LoraCommand::Unload { adapter: 3 }).unwrap();
    let mut again = seq_with(2, &prompt, Some(3));
    let err = router
        .apply(Effect::RestoreSequenceState {
            seq: &mut again,
            reader: &mut image.as_slice(),
        })
        .unwrap_err();
    assert_eq!(
        err,
        DeviceError::Invalid {
            what: "RestoreSequenceState",
            detail: "sequence 2: adapter 3 is not loaded".to_string()
        }
    );
    assert!(!again.holds_resources());
    Box::new(router).teardown().unwrap();
}

/// On a model with an MTP head the router computes prompts and decode steps through the runs
/// path (it keeps hidden states for the head): a row with an adapter still gets the model's rows
/// with that adapter, and a row without one the base model's.
#[test]
fn rows_with_an_adapter_on_a_model_with_an_mtp_head_match_the_model() {
    let model = Model::load(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/nemotron-h-tiny/mtp/model"),
    )
    .unwrap();
    assert!(model.has_mtp());
    let dir = tempfile::tempdir().unwrap();
    let paths = random_adapters(&model, dir.path(), &[7]);
    let adapter = LoraAdapter::load(&paths[0], &model).unwrap();
    let prompt = tokens(3, 21);
    let steps = 4;
    for with in [Some(7u32), None] {
        let mut router = router(model.clone(), 16, false);
        load(&mut router, 7, &paths[0]).unwrap();
        let mut s = seq_with(1, &prompt, with);
        let (last, _) = prefill(&router, &mut s, 64);
        let served = generate(&router, &mut s, last, steps);
        release(&router, &mut s, false);
        Box::new(router).teardown().unwrap();

        // The model alone: the prompt, then greedy decode steps, with the same adapter.
        let used = with.map(|_| &adapter);
        let config = model.config();
        let vocab = config.vocab_size;
        let mut kv = KvPool::new(config, 4, 16).unwrap();
        let mut states = MambaStates::new(config, 1).unwrap();
        let mut scratch = Scratch::new(config);
        let blocks = [0, 1, 2, 3];
        let mut logits = Vec::new();
        let row = PrefillRow {
            tokens: &prompt,
            start_pos: 0,
            blocks: &blocks,
            slot: 0,
        };
        model
            .prefill_with_adapter(
                &mut scratch,
                &mut kv,
                &mut states,
                row,
                used,
                false,
                &mut logits,
            )
            .unwrap();
        let mut expected = vec![logits.clone()];
        for step in 0..steps {
            let token = argmax(&logits[..vocab]);
            let rows = [model::DecodeRow {
                token,
                pos: prompt.len() + step,
                blocks: &blocks,
                slot: 0,
            }];
            model
                .decode_with_adapters(
                    &mut scratch,
                    &mut kv,
                    &mut states,
                    &rows,
                    &[used],
                    &mut logits,
                )
                .unwrap();
            expected.push(logits.clone());
        }
        assert_eq!(bits(&served), bits(&expected), "adapter {with:?}");
    }
}
