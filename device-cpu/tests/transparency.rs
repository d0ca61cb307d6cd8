//! Every optimisation is invisible in the output, bit for bit: prefix-cache hits (hash chain on an
//! attention-only model, Marconi checkpoints on a hybrid one), spill and restore, compaction.

mod common;

use common::*;
use device_cpu::CpuRouter;
use device_io::{DeviceIo, Effect, Sequence};

/// Runs one request to `steps` greedy tokens and releases it with `cache: true`; returns its
/// logits rows and the prompt tokens served from the cache.
fn request(
    router: &CpuRouter,
    id: u64,
    prompt: &[u32],
    steps: usize,
    chunk: usize,
) -> (Vec<Vec<f32>>, usize) {
    let mut s = seq(id, prompt);
    let (logits, report) = prefill(router, &mut s, chunk);
    assert_eq!(report.cached + report.computed, prompt.len());
    let rows = generate(router, &mut s, logits, steps);
    release(router, &mut s, true);
    (rows, report.cached)
}

/// Runs `request` on `cached` (whose cache state the earlier requests built) and on a fresh
/// router with the prefix cache off; the logits must have the same bits. Returns the cached count.
fn check_same_bits(
    cached: &CpuRouter,
    plain: &CpuRouter,
    id: u64,
    prompt: &[u32],
    steps: usize,
) -> usize {
    let (with_cache, hit) = request(cached, id, prompt, steps, 16);
    let (without, none) = request(plain, id, prompt, steps, 16);
    assert_eq!(none, 0);
    assert_eq!(
        bits(&with_cache),
        bits(&without),
        "request {id}: logits differ with the cache on"
    );
    hit
}

#[test]
fn attention_only_prefix_hits_are_bit_identical_to_caching_off() {
    let on = router(attention_model(), 16, true);
    let off = router(attention_model(), 16, false);
    let initial = on.facts();
    assert_eq!(
        initial.checkpoint_slots_total, 0,
        "no checkpoints on an attention-only model"
    );
    let first = tokens(1, 40);
    let (rows, hit) = request(&on, 1, &first, 5, 40);
    assert_eq!(hit, 0);
    // The finished request's two full blocks are cached (45 positions computed).
    assert_eq!(on.facts().kv_blocks_cached, 2);

    // A request sharing 35 prompt tokens reuses two blocks.
    let mut shared = first[..35].to_vec();
    shared.extend(tokens(2, 20));
    assert_eq!(check_same_bits(&on, &off, 2, &shared, 6), 32);
    // The next turn of the first conversation (prompt + output + new tokens).
    let mut next_turn = first.clone();
    next_turn.extend(rows[..5].iter().map(|r| argmax(r)));
    next_turn.extend(tokens(3, 10));
    assert_eq!(check_same_bits(&on, &off, 3, &next_turn, 4), 32);
    // Another tenant (cache salt) shares nothing.
    let mut salted = device_cpu::CpuSeq::create(device_io::SeqSpec {
        id: 4,
        prompt: &first,
        adapter: None,
        cache_salt: Some(99),
    });
    let (_, report) = prefill(&on, &mut salted, 64);
    assert_eq!(report.cached, 0);
    release(&on, &mut salted, false);

    assert_back_to_initial(&on, initial);
    assert_back_to_initial(&off, initial_of(&off));
}

fn initial_of(router: &CpuRouter) -> device_io::DeviceFacts {
    let mut facts = router.facts();
    facts.kv_blocks_free = facts.kv_blocks_total;
    facts.kv_blocks_cached = 0;
    facts.checkpoint_slots_used = 0;
    facts
}

#[test]
fn hybrid_hits_restored_from_marconi_checkpoints_are_bit_identical_to_caching_off() {
    let on = router(hybrid_model(), 16, true);
    let off = router(hybrid_model(), 16, false);
    let initial = on.facts();
    assert_eq!(initial.checkpoint_slots_total, 16);
    let first = tokens(5, 40);
    // 40 prompt tokens and 12 decoded: checkpoints at 32 (end of input) and 48 (end of output).
    let (rows, hit) = request(&on, 1, &first, 12, 40);
    assert_eq!(hit, 0);
    assert_eq!(on.facts().checkpoint_slots_used, 2);
    assert_eq!(on.facts().kv_blocks_cached, 3);

    // Next turn: the whole conversation so far plus new tokens restores the state at 48.
    let mut next_turn = first.clone();
    next_turn.extend(rows[..12].iter().map(|r| argmax(r)));
    next_turn.extend(tokens(6, 10));
    assert_eq!(check_same_bits(&on, &off, 2, &next_turn, 6), 48);
    // A request that leaves the first one after 35 tokens restores the end-of-input state at 32.
    let mut edited = first[..35].to_vec();
    edited.extend(tokens(7, 20));
    assert_eq!(check_same_bits(&on, &off, 3, &edited, 6), 32);
    // One that leaves it after 20 tokens hits nothing, but reveals a branch point at 16 where the
    // router checkpoints during its prefill ...
    let mut branch = first[..20].to_vec();
    branch.extend(tokens(8, 20));
    assert_eq!(check_same_bits(&on, &off, 4, &branch, 3), 0);
    // ... so the next request through that branch point restores the state at 16.
    let mut sibling = first[..20].to_vec();
    sibling.extend(tokens(9, 30));
    assert_eq!(check_same_bits(&on, &off, 5, &sibling, 3), 16);

    assert_back_to_initial(&on, initial);
    assert_back_to_initial(&off, initial_of(&off));
}

/// Spills a sequence mid-generation, releases it, restores the image into a new sequence object
/// and continues: the logits equal an uninterrupted run's.
fn spill_restore_matches(model: model::Model) {
    let plain = router(model.clone(), 16, true);
    let spilling = router(model, 16, true);
    let initial = spilling.facts();
    let prompt = tokens(11, 30);
    let mut a = seq(1, &prompt);
    let (logits, _) = prefill(&plain, &mut a, 30);
    let want = generate(&plain, &mut a, logits, 10);
    release(&plain, &mut a, false);

    let mut b = seq(1, &prompt);
    let (logits, _) = prefill(&spilling, &mut b, 12);
    let mut got = generate(&spilling, &mut b, logits, 4);
    let mut image = Vec::new();
    spilling
        .apply(Effect::SaveSequenceState {
            seq: &b,
            writer: &mut image,
        })
        .unwrap();
    release(&spilling, &mut b, false);
    assert_eq!(spilling.facts().live_slots_used, 0);
    // Another sequence takes the freed slot and blocks meanwhile.
    let mut other = seq(2, &tokens(12, 50));
    let (other_logits, _) = prefill(&spilling, &mut other, 50);
    generate(&spilling, &mut other, other_logits, 2);

    let mut restored = seq(1, &prompt);
    spilling
        .apply(Effect::RestoreSequenceState {
            seq: &mut restored,
            reader: &mut image.as_slice(),
        })
        .unwrap();
    assert_eq!(restored.computed_len(), 34);
    assert_eq!(restored.slot(), Some(1));
    let last = got.pop().unwrap();
    got.extend(generate(&spilling, &mut restored, last, 6));
    assert_eq!(bits(&got), bits(&want));
    release(&spilling, &mut restored, true);
    release(&spilling, &mut other, true);
    assert_back_to_initial(&spilling, initial);
}

#[test]
fn spill_release_restore_continue_equals_never_spilled_hybrid() {
    spill_restore_matches(hybrid_model());
}

#[test]
fn spill_release_restore_continue_equals_never_spilled_attention_only() {
    spill_restore_matches(attention_model());
}

#[test]
fn compaction_mid_generation_equals_no_compaction() {
    let model = hybrid_model();
    let plain = router(model.clone(), 16, false);
    let compacting = router(model, 16, false);
    let initial = compacting.facts();
    let prompts = [tokens(21, 9), tokens(22, 23), tokens(23, 17)];

    // The same three sequences on both routers; on the second, the first one finishes after 3
    // steps and the third moves from slot 2 to slot 0.
    let run = |r: &CpuRouter, compact: bool| -> Vec<Vec<f32>> {
        let mut seqs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| seq(i as u64, p))
            .collect();
        let mut next = Vec::new();
        for s in seqs.iter_mut() {
            let (logits, _) = prefill(r, s, 64);
            next.push(argmax(&logits));
        }
        let mut out = Vec::new();
        for step in 0..8 {
            if step == 3 {
                release(r, &mut seqs[0], false);
                if compact {
                    r.apply(Effect::CompactSlot {
                        seq: &mut seqs[2],
                        target: 0,
                    })
                    .unwrap();
                    assert_eq!(seqs[2].slot(), Some(0));
                }
            }
            let live: Vec<usize> = if step < 3 { vec![0, 1, 2] } else { vec![1, 2] };
            let tokens: Vec<u32> = live.iter().map(|&i| next[i]).collect();
            let (first, rest) = seqs.split_at_mut(1);
            let mut rows: Vec<&mut device_cpu::CpuSeq> = if step < 3 {
                std::iter::once(&mut first[0])
                    .chain(rest.iter_mut())
                    .collect()
            } else {
                rest.iter_mut().collect()
            };
            let logits = decode(r, &mut rows, &tokens);
            let vocab = logits.len() / live.len();
            for (k, &i) in live.iter().enumerate() {
                let row = logits[k * vocab..(k + 1) * vocab].to_vec();
                next[i] = argmax(&row);
                if i != 0 {
                    out.push(row);
                }
            }
        }
        for s in seqs.iter_mut() {
            release(r, s, false);
        }
        out
    };
    assert_eq!(bits(&run(&compacting, true)), bits(&run(&plain, false)));
    assert_back_to_initial(&compacting, initial);
}

#[test]
fn batched_chunked_prefill_equals_one_row_at_a_time() {
    let model = hybrid_model();
    let batched = router(model.clone(), 16, false);
    let single = router(model, 16, false);
    let prompts = [tokens(31, 37), tokens(32, 5), tokens(33, 50)];
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut s = seq(i as u64, p);
        let (logits, _) = prefill(&single, &mut s, 64);
        want.push(generate(&single, &mut s, logits, 3));
        release(&single, &mut s, false);
    }

    // All three rows in each step with a budget of 12: row 1 completes in the first step, row 0 in
    // the fourth, row 2 in the fifth; host logits hold only the rows that completed, in row order.
    let mut seqs: Vec<device_cpu::CpuSeq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| seq(i as u64, p))
        .collect();
    let mut last = vec![Vec::new(); 3];
    let mut host = Vec::new();
    let mut step = 0;
    while seqs.iter().any(|s| !s.prefill_done()) {
        step += 1;
        let pending: Vec<usize> = (0..3).filter(|&i| !seqs[i].prefill_done()).collect();
        let budgets = vec![12; pending.len()];
        let mut rows: Vec<&mut device_cpu::CpuSeq> =
            seqs.iter_mut().filter(|s| !s.prefill_done()).collect();
        let ticket = batched
            .launch(
                device_io::StepPlan::Prefill {
                    budgets: &budgets,
                    readback: device_io::Readback::HostLogits { into: &mut host },
                },
                &mut rows,
            )
            .unwrap();
        let result = batched.await_result(ticket).unwrap();
        let done: Vec<usize> = result
            .rows
            .iter()
            .zip(&pending)
            .filter(|(r, _)| r.prefill.unwrap().done)
            .map(|(_, &i)| i)
            .collect();
        assert_eq!(host.len(), done.len() * 256, "step {step}");
        assert_eq!(result.logits.is_some(), !done.is_empty());
        for (k, (out, &i)) in result.rows.iter().zip(&pending).enumerate() {
            let report = out.prefill.unwrap();
            assert_eq!(report.cached, 0);
            assert_eq!(out.token, None);
            if report.done {
                let row = out.logits_row.unwrap();
                last[i] = host[row * 256..(row + 1) * 256].to_vec();
            } else {
                assert_eq!((out.logits_row, report.computed), (None, 12), "row {k}");
            }
        }
        match step {
            1 => assert_eq!(done, vec![1]),
            4 => assert_eq!(done, vec![0]),
            5 => assert_eq!(done, vec![2]),
            _ => assert!(done.is_empty()),
        }
    }
    assert_eq!(step, 5);
    for (i, s) in seqs.iter_mut().enumerate() {
        let got = generate(&batched, s, last[i].clone(), 3);
        assert_eq!(bits(&got), bits(&want[i]), "sequence {i}");
        release(&batched, s, false);
    }
}

/// A step that fails at the device after it took a Marconi checkpoint at the tree's branch
/// point (its prefill ran through the branch point, copied the state there, and then failed,
/// leaving garbage wherever it wrote): nothing it wrote is served. The next request through that
/// branch point computes from scratch and has a cold run's bits, and every block and checkpoint
/// slot comes back.
#[test]
fn a_checkpoint_taken_by_a_step_that_failed_at_the_device_is_never_served() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let on = router(hybrid_model(), 16, true);
    let off = router(hybrid_model(), 16, false);
    let fail_next = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&fail_next);
    on.inject_step_faults(device_cpu::StepFaults::new(move |_| {
        flag.swap(false, Ordering::SeqCst)
    }))
    .unwrap();
    let initial = on.facts();
    let first = tokens(5, 40);
    request(&on, 1, &first, 12, 40);
    // Leaves the first request after 20 tokens: its one prefill step runs to the branch point
    // at 16, checkpoints there, runs on, and fails.
    let mut branch = first[..20].to_vec();
    branch.extend(tokens(8, 20));
    let mut failing = seq(4, &branch);
    fail_next.store(true, Ordering::SeqCst);
    let mut host = Vec::new();
    let err = on
        .launch(
            device_io::StepPlan::Prefill {
                budgets: &[64],
                readback: device_io::Readback::HostLogits { into: &mut host },
            },
            &mut [&mut failing],
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            device_io::DeviceError::Failed {
                phase: device_io::Phase::Forward,
                ..
            }
        ),
        "{err}"
    );
    assert!(failing.failed());
    release(&on, &mut failing, false);
    // The sibling through the branch point finds no checkpoint there: nothing cached, cold bits.
    let mut sibling = first[..20].to_vec();
    sibling.extend(tokens(9, 30));
    assert_eq!(check_same_bits(&on, &off, 5, &sibling, 3), 0);
    // Its own prefill took the branch checkpoint again; the next one through it hits it.
    let mut third = first[..20].to_vec();
    third.extend(tokens(10, 30));
    assert_eq!(check_same_bits(&on, &off, 6, &third, 3), 16);
    assert_back_to_initial(&on, initial);
}
