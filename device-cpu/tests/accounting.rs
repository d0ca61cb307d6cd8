//! Accounting: a mixed workload through `TracingDeviceIo` releases every sequence exactly once
//! and returns `facts()` to its initial counts; cache eviction under KV and checkpoint pressure
//! keeps the counts balanced and the outputs exact; the no-op effects change nothing.

mod common;

use common::*;
use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{DeviceIo, Effect, EffectOutcome, Sequence};
use device_trace::{TraceSink, TracingDeviceIo};

#[test]
fn a_mixed_workload_releases_everything_exactly_once() {
    let (sink, buffer) = TraceSink::memory();
    let r = TracingDeviceIo::new(router(hybrid_model(), 16, true), sink);
    let initial = r.facts();
    let shared = tokens(1, 40);
    let mut seqs: Vec<CpuSeq> = (0..4)
        .map(|i| {
            let mut p = shared[..20 + 5 * i].to_vec();
            p.extend(tokens(10 + i as u32, 10));
            seq(i as u64, &p)
        })
        .collect();
    for s in seqs.iter_mut() {
        prefill(&r, s, 13);
    }
    for step in 0..20u32 {
        let mut rows: Vec<&mut CpuSeq> = seqs.iter_mut().collect();
        let tokens: Vec<u32> = (0..rows.len() as u32)
            .map(|i| (step * 7 + i) % 256)
            .collect();
        decode(&r, &mut rows, &tokens);
    }
    // Finish 0 (cached), preempt 1 by spilling it, move 3 into 0's slot, detach 2 and hand its
    // slot to the restored 1.
    let (a, rest) = seqs.split_at_mut(1);
    release(&r, &mut a[0], true);
    let mut image = Vec::new();
    r.apply(Effect::SaveSequenceState {
        seq: &rest[0],
        writer: &mut image,
    })
    .unwrap();
    r.apply(Effect::ReleaseSeq {
        seq: &mut rest[0],
        cache: false,
        what: "preempt",
    })
    .unwrap();
    r.apply(Effect::CompactSlot {
        seq: &mut rest[2],
        target: 0,
    })
    .unwrap();
    r.apply(Effect::DetachSlot { seq: &mut rest[1] }).unwrap();
    let mut restored = seq(1, &[0]);
    r.apply(Effect::RestoreSequenceState {
        seq: &mut restored,
        reader: &mut image.as_slice(),
    })
    .unwrap();
    assert_eq!(restored.slot(), Some(1));
    decode(&r, &mut [&mut restored, &mut rest[2]], &[3, 4]);
    assert_eq!(r.facts().live_slots_used, 2);
    release(&r, &mut rest[1], true);
    release(&r, &mut rest[2], true);
    release(&r, &mut restored, true);

    let lines = buffer.lines();
    let releases: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("fx apply ReleaseSeq"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(releases.len(), 5, "one release per sequence tenure");
    for &i in &releases {
        assert_eq!(lines[i + 1], "-> Unit", "{}", lines[i]);
    }
    assert!(!lines.iter().any(|l| l.starts_with("-> err")), "{lines:#?}");
    assert!(lines.iter().any(|l| l == "fx apply MarconiCheckpoint"));
    assert_back_to_initial(r.inner(), initial);
    Box::new(r).teardown().unwrap();
}

#[test]
fn a_second_release_changes_nothing() {
    let r = router(attention_model(), 16, true);
    let mut a = seq(1, &tokens(1, 40));
    prefill(&r, &mut a, 40);
    release(&r, &mut a, true);
    let after = r.facts();
    release(&r, &mut a, true);
    release(&r, &mut a, false);
    assert_eq!(r.facts(), after);
    assert_eq!((a.slot(), a.computed_len(), a.blocks().len()), (None, 0, 0));
}

/// A pool that cannot hold both the cache and the new request: the Marconi tree (hybrid) or the
/// hash chain (attention-only) gives blocks back, and the outputs stay exact.
fn eviction_keeps_outputs_exact(model: model::Model) {
    let mut config = CpuRouterConfig::new(12, 2);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(3);
    let r = CpuRouter::new(model.clone(), config.clone()).unwrap();
    config.prefix_cache = false;
    let plain = CpuRouter::new(model, config).unwrap();
    let initial = r.facts();
    for i in 0..6u32 {
        let prompt = tokens(100 + i, 70);
        let mut s = seq(u64::from(i), &prompt);
        let (logits, _) = prefill(&r, &mut s, 70);
        let got = generate(&r, &mut s, logits, 3);
        release(&r, &mut s, true);
        let mut p = seq(u64::from(i), &prompt);
        let (logits, _) = prefill(&plain, &mut p, 70);
        let want = generate(&plain, &mut p, logits, 3);
        release(&plain, &mut p, false);
        assert_eq!(bits(&got), bits(&want));
        let facts = r.facts();
        assert!(
            facts.checkpoint_slots_used <= facts.checkpoint_slots_total,
            "{facts:?}"
        );
        assert_nothing_held(&r);
    }
    // The latest request is still cached and hits.
    let mut again = seq(9, &tokens(105, 70));
    let (_, report) = prefill(&r, &mut again, 70);
    assert_eq!(report.cached, 64);
    release(&r, &mut again, false);
    assert_back_to_initial(&r, initial);
}

#[test]
fn eviction_under_kv_pressure_keeps_outputs_exact_hybrid() {
    eviction_keeps_outputs_exact(hybrid_model());
}

#[test]
fn eviction_under_kv_pressure_keeps_outputs_exact_attention_only() {
    eviction_keeps_outputs_exact(attention_model());
}

#[test]
fn effects_without_work_on_this_router_change_nothing() {
    let with = router(hybrid_model(), 16, true);
    let without = router(hybrid_model(), 16, true);
    let run = |r: &CpuRouter, noops: bool| -> Vec<Vec<f32>> {
        let mut s = seq(1, &tokens(3, 30));
        let (mut last, _) = prefill(r, &mut s, 30);
        let mut rows = Vec::new();
        for step in 0..4 {
            if noops {
                let before = r.facts();
                let effects: Vec<Effect<'_, CpuSeq, device_cpu::LogitsHandle>> = vec![
                    Effect::SaveHiddenCatchup {
                        row: 0,
                        pos: 30 + step,
                    },
                    Effect::SyncSecondary,
                    Effect::Quiesce { stream: 0 },
                    Effect::Quiesce { stream: 1 },
                    Effect::EpShutdown,
                ];
                for effect in effects {
                    assert_eq!(r.apply(effect).unwrap(), EffectOutcome::Unit);
                }
                assert_eq!(r.facts(), before);
            }
            last = decode(r, &mut [&mut s], &[argmax(&last)]);
            rows.push(last.clone());
        }
        release(r, &mut s, false);
        rows
    };
    assert_eq!(bits(&run(&with, true)), bits(&run(&without, false)));
}
