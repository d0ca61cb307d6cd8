//! Speculative decoding on the host router, on both MTP fixtures (`nemotron-h-tiny/mtp`,
//! `nemotron-h-alt/mtp`): a `Verify` gives every position the bits of a decode step; keeping the
//! accepted positions (`TruncateKv`, `SsmSnapshotRestore`) leaves the sequence exactly where plain
//! decoding would, so the tokens and logits that follow are the same bits; `Draft` gives the NumPy
//! reference's draft ids (after the prompt, and after five decoded tokens caught up through
//! `SaveHiddenCatchup`); every block and slot comes back; skipping the SSM restore is refused, and
//! so is restoring the snapshot of a rejected position.

mod common;

use std::path::PathBuf;

use common::{argmax, assert_nothing_held, bits, prefill, release, seq};
use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{DeviceError, DeviceIo, Effect, Readback, Sequence, StepPlan};
use model::parity::MtpCase;
use model::Model;

fn mtp_dir(fixture: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(fixture)
        .join("mtp")
}

fn cases(fixture: &str) -> Vec<MtpCase> {
    model::parity::mtp_cases(&mtp_dir(fixture)).unwrap()
}

fn router(fixture: &str) -> CpuRouter {
    let model = Model::load(&mtp_dir(fixture).join("model")).unwrap();
    assert!(model.has_mtp());
    let mut config = CpuRouterConfig::new(64, 4);
    config.max_context = Some(256);
    config.prefix_cache = false;
    config.snapshot_slots = 16;
    CpuRouter::new(model, config).unwrap()
}

/// Plain greedy decoding: `steps` tokens and their logits (the prefill's row first).
fn plain(fixture: &str, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let r = router(fixture);
    let mut s = seq(1, prompt);
    let (mut logits, _) = prefill(&r, &mut s, 64);
    let mut tokens = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..steps {
        let token = argmax(&logits);
        tokens.push(token);
        rows.push(logits.clone());
        logits = common::decode(&r, &mut [&mut s], &[token]);
    }
    release(&r, &mut s, false);
    (tokens, rows)
}

/// One speculative step: verify `token` and `drafts`, keep the accepted prefix and the bonus;
/// returns the emitted tokens and the logits row each was chosen from.
fn speculate(
    r: &CpuRouter,
    s: &mut CpuSeq,
    token: u32,
    drafts: &[u32],
    restore: bool,
) -> Result<(Vec<u32>, Vec<Vec<f32>>), DeviceError> {
    let vocab = r.facts().vocab_size;
    let c = s.computed_len();
    let mut input = vec![token];
    input.extend_from_slice(drafts);
    let slots: Vec<usize> = (0..drafts.len()).collect();
    let mut host = Vec::new();
    let ticket = r.launch(
        StepPlan::Verify {
            inputs: &[&input],
            snapshots: &[&slots],
            readback: Readback::HostLogits { into: &mut host },
        },
        &mut [&mut *s],
    )?;
    let result = r.await_result(ticket)?;
    let run = result.rows[0].run.unwrap();
    assert_eq!(run.len, input.len());
    let targets = &result.tokens[run.start..run.start + run.len];
    let mut accepted = 0;
    while accepted < drafts.len() && drafts[accepted] == targets[accepted] {
        accepted += 1;
    }
    let mut emitted = drafts[..accepted].to_vec();
    emitted.push(targets[accepted]);
    let rows: Vec<Vec<f32>> = (0..=accepted)
        .map(|j| host[(run.start + j) * vocab..(run.start + j + 1) * vocab].to_vec())
        .collect();
    for (j, row) in rows.iter().enumerate() {
        assert_eq!(argmax(row), targets[j]);
    }
    for pos in c..=c + accepted {
        r.apply(Effect::SaveHiddenCatchup { row: 0, pos })?;
    }
    r.apply(Effect::TruncateKv {
        seq: s,
        len: c + accepted + 1,
    })?;
    if accepted < drafts.len() && restore {
        r.apply(Effect::SsmSnapshotRestore {
            seq: s,
            slot: accepted,
        })?;
    }
    Ok((emitted, rows))
}

/// Speculates with drafts that are right for `right` tokens and then wrong (per step, cycling),
/// until `steps` tokens: the same tokens and logits as plain decoding.
fn check_verify(fixture: &str) {
    for (index, case) in cases(fixture).iter().enumerate() {
        let steps = 12;
        let (want_tokens, want_rows) = plain(fixture, &case.prompt, steps + 5);
        for k in 1..=4 {
            let r = router(fixture);
            let initial = r.facts();
            let mut s = seq(1, &case.prompt);
            let (logits, _) = prefill(&r, &mut s, 64);
            let mut tokens = vec![argmax(&logits)];
            let mut rows = vec![logits];
            let mut step = 0;
            while tokens.len() < steps {
                // Right for `step % (k + 1)` drafts, then one wrong one.
                let n = tokens.len();
                let right = step % (k + 1);
                let drafts: Vec<u32> = (0..k)
                    .map(|j| {
                        let truth = want_tokens.get(n + j).copied().unwrap_or(0);
                        if j < right {
                            truth
                        } else {
                            (truth + 1) % 256
                        }
                    })
                    .collect();
                let (emitted, emitted_rows) =
                    speculate(&r, &mut s, tokens[n - 1], &drafts, true).unwrap();
                assert_eq!(
                    emitted.len(),
                    right.min(k) + 1,
                    "{fixture} case {index} k {k}"
                );
                tokens.extend(emitted);
                rows.extend(emitted_rows);
                step += 1;
            }
            tokens.truncate(steps);
            rows.truncate(steps);
            assert_eq!(tokens, want_tokens[..steps], "{fixture} case {index} k {k}");
            assert_eq!(
                bits(&rows),
                bits(&want_rows[..steps]),
                "{fixture} case {index} k {k}: logits"
            );
            release(&r, &mut s, false);
            assert_eq!(r.facts(), initial, "{fixture} case {index} k {k}");
        }
    }
}

#[test]
fn verification_with_rollback_gives_the_bits_of_plain_decoding_on_the_tiny_mtp_fixture() {
    check_verify("nemotron-h-tiny");
}

#[test]
fn verification_with_rollback_gives_the_bits_of_plain_decoding_on_the_alt_mtp_fixture() {
    check_verify("nemotron-h-alt");
}

/// The router's drafts are the reference's: after the prompt, and after five decoded tokens
/// whose hidden states the core kept.
fn check_drafts(fixture: &str) {
    for (index, case) in cases(fixture).iter().enumerate() {
        let r = router(fixture);
        let initial = r.facts();
        let mut s = seq(1, &case.prompt);
        prefill(&r, &mut s, 64);
        let draft = |s: &mut CpuSeq, token: u32| -> Vec<u32> {
            let ticket = r
                .launch(
                    StepPlan::Draft {
                        tokens: &[token],
                        k: 4,
                    },
                    &mut [s],
                )
                .unwrap();
            let result = r.await_result(ticket).unwrap();
            let run = result.rows[0].run.unwrap();
            result.tokens[run.start..run.start + run.len].to_vec()
        };
        assert_eq!(
            draft(&mut s, case.greedy[0]),
            case.draft0,
            "{fixture} {index}"
        );
        let n = case.prompt.len();
        for j in 0..5 {
            common::decode(&r, &mut [&mut s], &[case.greedy[j]]);
            r.apply(Effect::SaveHiddenCatchup { row: 0, pos: n + j })
                .unwrap();
        }
        assert_eq!(
            draft(&mut s, case.greedy[5]),
            case.draft1,
            "{fixture} {index}"
        );
        release(&r, &mut s, false);
        assert_eq!(r.facts(), initial);
    }
}

#[test]
fn drafts_match_the_numpy_reference_on_the_tiny_mtp_fixture() {
    check_drafts("nemotron-h-tiny");
}

#[test]
fn drafts_match_the_numpy_reference_on_the_alt_mtp_fixture() {
    check_drafts("nemotron-h-alt");
}

/// A catch-up ring that overflows (a sequence that has not drafted for a while) forgets its
/// oldest positions; the head still drafts.
#[test]
fn an_overflowing_catchup_ring_still_drafts() {
    let case = &cases("nemotron-h-tiny")[1];
    let r = router("nemotron-h-tiny");
    let initial = r.facts();
    let mut s = seq(1, &case.prompt);
    let (logits, _) = prefill(&r, &mut s, 64);
    let mut token = argmax(&logits);
    for _ in 0..20 {
        let pos = s.computed_len();
        let logits = common::decode(&r, &mut [&mut s], &[token]);
        r.apply(Effect::SaveHiddenCatchup { row: 0, pos }).unwrap();
        token = argmax(&logits);
    }
    let ticket = r
        .launch(
            StepPlan::Draft {
                tokens: &[token],
                k: 3,
            },
            &mut [&mut s],
        )
        .unwrap();
    let result = r.await_result(ticket).unwrap();
    assert_eq!(result.rows[0].run.unwrap().len, 3);
    assert_eq!(result.tokens.len(), 3);
    release(&r, &mut s, false);
    assert_eq!(r.facts(), initial);
}

/// The alt fixture's third case prefilled on a fresh router: the case, the router, the sequence,
/// its next token and a first draft that is not the greedy one.
fn alt_after_prefill() -> (MtpCase, CpuRouter, CpuSeq, u32, u32) {
    let case = cases("nemotron-h-alt").swap_remove(2);
    let r = router("nemotron-h-alt");
    let mut s = seq(1, &case.prompt);
    let (logits, _) = prefill(&r, &mut s, 64);
    let token = argmax(&logits);
    let wrong = (case.greedy[1] + 1) % 256;
    (case, r, s, token, wrong)
}

/// Skipping the SSM restore after a rejected draft (the planted bug) is caught: the router
/// refuses to compute the sequence rather than compute on a state past its length.
#[test]
fn a_skipped_ssm_restore_is_refused() {
    let (case, r, mut s, token, wrong) = alt_after_prefill();
    speculate(&r, &mut s, token, &[wrong, 0], false).unwrap();
    let err = speculate(&r, &mut s, case.greedy[1], &[0], true).unwrap_err();
    assert!(
        matches!(err, DeviceError::Invalid { what: "Verify", ref detail } if detail.contains("past its length")),
        "{err:?}"
    );
    release(&r, &mut s, false);
}

/// `TruncateKv` forgets the ring's snapshots of the rejected positions: restoring one is refused
/// (it is of a draft that was not kept), the snapshot at the kept length still restores.
#[test]
fn snapshots_of_rejected_positions_are_forgotten() {
    let (case, r, mut s, token, wrong) = alt_after_prefill();
    // Slots 0, 1, 2 hold the states after the token and the first two drafts; none is accepted.
    let (emitted, _) = speculate(&r, &mut s, token, &[wrong, 0, 0], false).unwrap();
    assert_eq!(emitted, vec![case.greedy[1]]);
    for slot in [1, 2] {
        let err = r
            .apply(Effect::SsmSnapshotRestore { seq: &mut s, slot })
            .unwrap_err();
        assert_eq!(
            err,
            DeviceError::Invalid {
                what: "SsmSnapshotRestore",
                detail: format!("ring slot {slot} holds no snapshot"),
            }
        );
    }
    r.apply(Effect::SsmSnapshotRestore {
        seq: &mut s,
        slot: 0,
    })
    .unwrap();
    let logits = common::decode(&r, &mut [&mut s], &[case.greedy[1]]);
    assert_eq!(argmax(&logits), case.greedy[2]);
    release(&r, &mut s, false);
}

/// Bad verifications and truncations are typed errors that change nothing.
#[test]
fn bad_verifications_and_truncations_are_refused() {
    let r = router("nemotron-h-tiny");
    let mut s = seq(1, &[1, 2, 3, 4, 5]);
    prefill(&r, &mut s, 64);
    let before = (s.computed_len(), s.tokens().to_vec(), r.facts());
    let verify = |s: &mut CpuSeq, inputs: &[&[u32]], snapshots: &[&[usize]]| {
        r.launch(
            StepPlan::Verify {
                inputs,
                snapshots,
                readback: Readback::Argmax,
            },
            &mut [s],
        )
        .unwrap_err()
    };
    for (inputs, snapshots, needle) in [
        (&[&[][..]][..], &[][..], "feeds no token"),
        (&[&[1, 999][..]][..], &[][..], "outside the vocabulary"),
        (
            &[&[1, 2, 3][..]][..],
            &[&[0][..]][..],
            "snapshot slots for 2 drafts",
        ),
        (&[&[1, 2, 3][..]][..], &[&[0, 0][..]][..], "named twice"),
        (
            &[&[1, 2][..]][..],
            &[&[99][..]][..],
            "outside the 16 snapshot slots",
        ),
    ] {
        let err = verify(&mut s, inputs, snapshots);
        assert!(
            matches!(&err, DeviceError::Invalid { detail, .. } if detail.contains(needle)),
            "{needle}: {err:?}"
        );
    }
    assert_eq!(
        r.apply(Effect::TruncateKv {
            seq: &mut s,
            len: 5
        })
        .unwrap_err(),
        DeviceError::Invalid {
            what: "TruncateKv",
            detail: "sequence 1 has no reservation to truncate".to_string()
        }
    );
    assert_eq!((s.computed_len(), s.tokens().to_vec(), r.facts()), before);
    // A truncation outside the reservation.
    r.await_result(
        r.launch(
            StepPlan::Verify {
                inputs: &[&[7, 8]],
                snapshots: &[],
                readback: Readback::Argmax,
            },
            &mut [&mut s],
        )
        .unwrap(),
    )
    .unwrap();
    for len in [4, 8] {
        let err = r
            .apply(Effect::TruncateKv { seq: &mut s, len })
            .unwrap_err();
        assert!(matches!(
            err,
            DeviceError::Invalid {
                what: "TruncateKv",
                ..
            }
        ));
    }
    assert_eq!(s.computed_len(), 7);
    release(&r, &mut s, false);
}

/// A router with a prefix cache (block size 8) or without one, for the prefix-hit test.
fn caching_router(fixture: &str, prefix_cache: bool) -> CpuRouter {
    let model = Model::load(&mtp_dir(fixture).join("model")).unwrap();
    let mut config = CpuRouterConfig::new(64, 4);
    config.block_size = 8;
    config.max_context = Some(256);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(16);
    config.prefix_cache = prefix_cache;
    config.snapshot_slots = 16;
    CpuRouter::new(model, config).unwrap()
}

/// What a sequence's MTP head holds after its prefill, read from its spill image.
#[derive(Debug, PartialEq)]
struct HeadView {
    /// The `k` drafts after the greedy next token.
    drafts: Vec<u32>,
    /// Per computed position: the K/V bits of every attention layer (the MTP head's last).
    kv: Vec<Vec<u32>>,
    /// The Mamba state's bits (main layers, then the head's).
    state: Vec<u32>,
    /// The tokens the prefill had cached.
    cached: usize,
}

impl HeadView {
    /// The positions whose K/V differ from `cold`'s.
    fn kv_differ(&self, cold: &HeadView) -> Vec<usize> {
        assert_eq!(self.kv.len(), cold.kv.len());
        (0..self.kv.len())
            .filter(|&pos| self.kv[pos] != cold.kv[pos])
            .collect()
    }
}

/// Prefills `s`, drafts `k` tokens after the greedy next token, and answers what its head holds
/// ([`HeadView`]).
fn draft_after_prefill(fixture: &str, r: &CpuRouter, s: &mut CpuSeq, k: usize) -> HeadView {
    let (logits, report) = prefill(r, s, 64);
    let ticket = r
        .launch(
            StepPlan::Draft {
                tokens: &[argmax(&logits)],
                k,
            },
            &mut [&mut *s],
        )
        .unwrap();
    let result = r.await_result(ticket).unwrap();
    let run = result.rows[0].run.unwrap();
    let drafts = result.tokens[run.start..run.start + run.len].to_vec();
    let mut bytes = Vec::new();
    r.apply(Effect::SaveSequenceState {
        seq: s,
        writer: &mut bytes,
    })
    .unwrap();
    let model = Model::load(&mtp_dir(fixture).join("model")).unwrap();
    let config = model.config();
    let block_size = 8;
    let pool = model::KvPool::new(config, 1, block_size).unwrap();
    let layout = router_book::image::Layout {
        fingerprint: model.fingerprint(),
        block_size,
        floats_per_block: pool.floats_per_block(),
        floats_per_slot: model::MambaStates::new(config, 0)
            .unwrap()
            .floats_per_slot(),
        max_context: 256,
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
    };
    let image = router_book::image::decode(&layout, &bytes).unwrap();
    // Block layout (`model::state`): per attention layer, K then V, each [block, kv heads, dim].
    let width = config.num_key_value_heads * config.head_dim;
    let mut kv = Vec::new();
    for pos in 0..s.computed_len() {
        let block = &image.kv[pos / block_size * layout.floats_per_block..];
        let mut at_pos = Vec::new();
        for layer in 0..pool.attention_layers() {
            let keys = layer * 2 * block_size * width + pos % block_size * width;
            for at in [keys, keys + block_size * width] {
                at_pos.extend(block[at..at + width].iter().map(|x| x.to_bits()));
            }
        }
        kv.push(at_pos);
    }
    HeadView {
        drafts,
        kv,
        state: image.state.iter().map(|x| x.to_bits()).collect(),
        cached: report.cached,
    }
}

/// After a prefix hit the MTP head is a cold run's: the hit's checkpoint carries the main
/// model's hidden state before it, and the head reruns that position with this sequence's next
/// token (the caching sequence's differs) on a copy of the shared block, so the head's K/V at
/// every computed position and its drafts equal those of the same prompt on a router with no
/// cache. Without the rerun the K/V at the position before the hit were the caching sequence's
/// in all 4 cases (this test failed there), and 2 of the 16 drafts differed from the cold run's.
/// The alt fixture's head has a Mamba layer, whose state the checkpoint holds: there the head
/// lags one position at the checkpoint (`router_book::BookShape::head_lags`); without the lag
/// and rerun its K/V and Mamba state differed from the cold run's in 4 of 4 cases and 3 of its 16
/// drafts differed.
#[test]
fn the_mtp_head_after_a_prefix_hit_is_a_cold_runs() {
    let mut drafts_compared = 0;
    // The tiny fixture's head is attention + MLP; the alt fixture's has a Mamba layer (`M*-`).
    for fixture in ["nemotron-h-tiny", "nemotron-h-alt"] {
        for seed in 0..4u32 {
            let shared = common::tokens(seed, 24);
            let mut caching = shared.clone();
            caching.extend([(seed * 7 + 1) % 256, 5]);
            let mut prompt = shared.clone();
            prompt.extend([(seed * 7 + 2) % 256, 9, 17]);
            let hot = caching_router(fixture, true);
            let mut first = seq(1, &caching);
            prefill(&hot, &mut first, 64);
            release(&hot, &mut first, true);
            let mut s = seq(2, &prompt);
            let hot_view = draft_after_prefill(fixture, &hot, &mut s, 4);
            assert_eq!(
                hot_view.cached, 24,
                "{fixture} seed {seed}: a hit at the shared blocks"
            );
            release(&hot, &mut s, true);
            let cold = caching_router(fixture, false);
            let mut c = seq(2, &prompt);
            let cold_view = draft_after_prefill(fixture, &cold, &mut c, 4);
            assert_eq!(cold_view.cached, 0);
            release(&cold, &mut c, false);
            assert!(
                hot_view.kv == cold_view.kv && hot_view.state == cold_view.state,
                "{fixture} seed {seed}: the K/V or state differ"
            );
            assert_eq!(hot_view.drafts, cold_view.drafts, "{fixture} seed {seed}");
            drafts_compared += hot_view.drafts.len();
            // Every block the hit copied went back or is cached; no slot is held.
            assert_nothing_held(&hot);
        }
    }
    assert_eq!(drafts_compared, 32);
}

/// Drafts `k` tokens after `token` for `s` (the MTP head's catch-up first).
fn draft_once(r: &CpuRouter, s: &mut CpuSeq, token: u32, k: usize) -> Vec<u32> {
    let ticket = r
        .launch(
            StepPlan::Draft {
                tokens: &[token],
                k,
            },
            &mut [s],
        )
        .unwrap();
    let result = r.await_result(ticket).unwrap();
    let run = result.rows[0].run.unwrap();
    result.tokens[run.start..run.start + run.len].to_vec()
}

/// A checkpoint a `MarconiCheckpoint` takes during speculative decoding carries the hidden
/// states its catch-up ring holds from the head's position: a hit on it reruns the head there
/// (over the last position, whose K/V the caching sequence's last draft step wrote), so the
/// head's K/V and drafts are a cold run's. Before (no rerun on that checkpoint) the K/V at the
/// position before the hit were the caching sequence's draft's.
#[test]
fn the_mtp_head_after_a_hit_on_an_output_checkpoint_is_a_cold_runs() {
    let fixture = "nemotron-h-tiny";
    let prompt = common::tokens(11, 20);
    let (greedy, _) = plain(fixture, &prompt, 8);
    let hot = caching_router(fixture, true);
    let mut first = seq(1, &prompt);
    prefill(&hot, &mut first, 64);
    // Two steps of three positions each with the true continuation as drafts (all accepted);
    // the second carries the sequence past the block boundary at 24.
    for step in 0..2 {
        let token = greedy[3 * step];
        draft_once(&hot, &mut first, token, 2);
        let drafts = &greedy[3 * step + 1..3 * step + 3];
        let (emitted, _) = speculate(&hot, &mut first, token, drafts, true).unwrap();
        assert_eq!(emitted, greedy[3 * step + 1..3 * step + 4]);
    }
    assert_eq!(first.computed_len(), 26);
    hot.apply(Effect::MarconiCheckpoint { seq: &mut first })
        .unwrap();
    assert_eq!(first.checkpoints_held(), (Some(16), Some(24)));
    release(&hot, &mut first, true);
    // A prompt sharing the first 24 positions, then leaving the caching sequence's path.
    let mut prompt2 = first_tokens(&prompt, &greedy, 24);
    prompt2.extend([(greedy[4] + 1) % 256, 3, 4]);
    let mut s = seq(2, &prompt2);
    let hot_view = draft_after_prefill(fixture, &hot, &mut s, 3);
    assert_eq!(hot_view.cached, 24);
    release(&hot, &mut s, true);
    let cold = caching_router(fixture, false);
    let mut c = seq(2, &prompt2);
    let cold_view = draft_after_prefill(fixture, &cold, &mut c, 3);
    release(&cold, &mut c, false);
    assert!(
        hot_view.kv == cold_view.kv && hot_view.state == cold_view.state,
        "the K/V or state differ"
    );
    assert_eq!(hot_view.drafts, cold_view.drafts);
}

/// The first `n` tokens of a prompt followed by its greedy continuation.
fn first_tokens(prompt: &[u32], greedy: &[u32], n: usize) -> Vec<u32> {
    prompt.iter().chain(greedy).take(n).copied().collect()
}

/// One sequence of a prefix-hit scenario: its prompt, how many tokens it decodes greedily
/// without drafting (so its head never consumes them), and whether its head after the prefill
/// is compared with a cold run's (it then drafts once).
struct Turn {
    prompt: Vec<u32>,
    decode: usize,
    compare: bool,
    /// The prefill's chunk (a plan per chunk).
    chunk: usize,
}

/// What a compared turn's hit made of its head: the router's count
/// (`router_book::CacheStats::head_exact_hits` and the next two; `None`: no count moved), the
/// positions whose head K/V differ from a cold run's, and whether its head's Mamba state and
/// drafts equal the cold run's.
#[derive(Debug, PartialEq)]
struct HitOutcome {
    cached: usize,
    counted: Option<router_book::HeadHit>,
    kv_differ: Vec<usize>,
    state_equal: bool,
    drafts_equal: bool,
}

/// Runs `turns` one after another on a caching router, each released to the cache; answers,
/// per compared turn, what its hit made of its head ([`HitOutcome`]).
fn head_scenario(fixture: &str, turns: &[Turn]) -> Vec<HitOutcome> {
    let hot = caching_router(fixture, true);
    let mut outcomes = Vec::new();
    for (id, turn) in turns.iter().enumerate() {
        let mut s = seq(id as u64 + 1, &turn.prompt);
        if turn.compare {
            let before = hot.cache_stats().unwrap();
            let hot_view = draft_after_prefill(fixture, &hot, &mut s, 3);
            let after = hot.cache_stats().unwrap();
            let moved = [
                after.head_exact_hits - before.head_exact_hits,
                after.head_unvouched_hits - before.head_unvouched_hits,
                after.head_unmarked_hits - before.head_unmarked_hits,
            ];
            let counted = match moved {
                [0, 0, 0] => None,
                [1, 0, 0] => Some(router_book::HeadHit::Exact),
                [0, 1, 0] => Some(router_book::HeadHit::Unvouched),
                [0, 0, 1] => Some(router_book::HeadHit::Unmarked),
                other => panic!("one hit counted {other:?}"),
            };
            let cold = caching_router(fixture, false);
            let mut c = seq(1, &turn.prompt);
            let cold_view = draft_after_prefill(fixture, &cold, &mut c, 3);
            release(&cold, &mut c, false);
            outcomes.push(HitOutcome {
                cached: hot_view.cached,
                counted,
                kv_differ: hot_view.kv_differ(&cold_view),
                state_equal: hot_view.state == cold_view.state,
                drafts_equal: hot_view.drafts == cold_view.drafts,
            });
        } else {
            let (logits, _) = prefill(&hot, &mut s, turn.chunk);
            common::generate(&hot, &mut s, logits, turn.decode);
        }
        release(&hot, &mut s, true);
    }
    outcomes
}

fn turn(prompt: Vec<u32>, decode: usize, compare: bool) -> Turn {
    Turn {
        prompt,
        decode,
        compare,
        chunk: 64,
    }
}

fn concat(a: &[u32], b: impl IntoIterator<Item = u32>) -> Vec<u32> {
    a.iter().copied().chain(b).collect()
}

/// The MTP head after a prefix hit is counted a cold run's only when it is one, also when the
/// Marconi tree serves the hit's checkpoint with blocks another sequence wrote: the tree keeps
/// the blocks it adopted first, so a checkpoint a sequence marked may sit on blocks whose head
/// K/V their writer computed with another next token (the original of a block the marking
/// sequence copied for its own rerun) or never (a writer that did not draft). Before the
/// router checked the blocks (`router_book::Caches::head_vouched`), such hits reran only the
/// marked positions and left the head inexact at the positions listed below (tiny and alt
/// fixtures alike; 3 of the 6 inexact hits' drafts differed), and the sequence then marked its
/// own checkpoint, so the next hit on it was inexact too.
#[test]
fn the_mtp_head_after_a_hit_on_blocks_another_sequence_wrote_is_counted_as_it_is() {
    use router_book::HeadHit::{Exact, Unmarked, Unvouched};
    let outcome = |cached, counted, kv_differ: &[usize]| HitOutcome {
        cached,
        counted: Some(counted),
        kv_differ: kv_differ.to_vec(),
        state_equal: true,
        drafts_equal: kv_differ.is_empty(),
    };
    for fixture in ["nemotron-h-tiny", "nemotron-h-alt"] {
        let shared = common::tokens(3, 16);
        let z = concat(&shared, [201, 1, 2, 3]);
        // A hits Z's checkpoint at 16 with another token at 16: its rerun rewrites position 15
        // on a copy of Z's block 1, which the tree does not keep. C hits A's checkpoint at 24
        // (on Z's block 1, A's block 2); D hits C's at 32 (on A's block 2, whose position 23 A
        // computed with its own token at 24, not C's).
        let a = concat(&shared, [202, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]);
        let c = concat(&a[..24], 20..32);
        let d = concat(&c[..32], [30, 31, 32]);
        let mut outcomes = head_scenario(
            fixture,
            &[
                turn(z.clone(), 0, false),
                turn(a, 0, false),
                turn(c, 0, true),
                turn(d, 0, true),
            ],
        );
        // B decodes 13 tokens without drafting: its head never consumed positions 19.. of its
        // blocks. A hits B's checkpoint at 16 and takes one at 24, which the tree puts on B's
        // block 2; C hits it.
        let hot = caching_router(fixture, true);
        let mut b = seq(1, &z);
        let (logits, _) = prefill(&hot, &mut b, 64);
        common::generate(&hot, &mut b, logits, 13);
        let b_tokens = b.tokens().to_vec();
        release(&hot, &mut b, false);
        outcomes.extend(head_scenario(
            fixture,
            &[
                turn(z.clone(), 13, false),
                turn(concat(&b_tokens[..26], [40]), 0, false),
                turn(concat(&b_tokens[..24], [41, 42, 43]), 0, true),
            ],
        ));
        // The control: A continues Z's prompt, so every cached position is vouched for.
        let a = concat(&z, [4, 5, 6, 7, 8, 9, 10]);
        outcomes.extend(head_scenario(
            fixture,
            &[
                turn(z.clone(), 0, false),
                turn(a.clone(), 0, false),
                turn(concat(&a[..24], [50, 51, 52]), 0, true),
            ],
        ));
        for outcome in &mut outcomes {
            // The drafts of an inexact head may or may not differ; an exact one's never do.
            if !outcome.kv_differ.is_empty() {
                outcome.drafts_equal = false;
            }
        }
        // C is not a cold run's, so it marks no checkpoint: D's hit reruns nothing. On the alt
        // fixture C's head lagged at 32 (its checkpoint holds the head's state before 31), so
        // D's head skips 31: its Mamba state, and the K/V after it, differ too.
        let d = match fixture {
            "nemotron-h-alt" => HitOutcome {
                state_equal: false,
                ..outcome(32, Unmarked, &[15, 23, 31, 32, 33, 34])
            },
            _ => outcome(32, Unmarked, &[15, 23, 31]),
        };
        assert_eq!(
            outcomes,
            [
                outcome(24, Unvouched, &[15]),
                d,
                outcome(24, Unvouched, &[19, 20, 21, 22]),
                outcome(24, Exact, &[]),
            ],
            "{fixture}"
        );
    }
}

/// A checkpoint where a row's prefill plan ends is marked on a head with Mamba layers too: the
/// head consumed the position before it (it cannot lag into a plan that does not follow), so
/// the mark names the token after the checkpoint instead of a rerun (`router_book::HeadMark::next`).
/// A hit with that token there finds the head a cold run's (K/V, Mamba state and drafts); one
/// with another token is counted as not vouched for. On the tiny fixture (an attention head) the
/// mark is a rerun as anywhere, and both hits are a cold run's. Before, the alt fixture's
/// checkpoint stayed unmarked: both hits counted unmarked, though the first was exact.
#[test]
fn a_mamba_heads_checkpoint_where_the_prefill_plan_ended_is_marked() {
    use router_book::HeadHit::{Exact, Unvouched};
    let z = common::tokens(5, 27);
    // The first plan ends at the checkpoint at 24 (the last block boundary before the prompt's
    // last token).
    let cached = Turn {
        chunk: 24,
        ..turn(z.clone(), 0, false)
    };
    let same = concat(&z[..25], [60, 61]);
    let other = concat(&z[..24], [(z[24] + 1) % 256, 62, 63]);
    for fixture in ["nemotron-h-tiny", "nemotron-h-alt"] {
        let mut outcomes = Vec::new();
        for prompt in [&same, &other] {
            let cached = Turn {
                prompt: cached.prompt.clone(),
                ..cached
            };
            outcomes.extend(head_scenario(
                fixture,
                &[cached, turn(prompt.clone(), 0, true)],
            ));
        }
        let exact = || HitOutcome {
            cached: 24,
            counted: Some(Exact),
            kv_differ: Vec::new(),
            state_equal: true,
            drafts_equal: true,
        };
        let expected = match fixture {
            // The head consumed 23 with the caching sequence's token at 24: its K/V there, its
            // Mamba state, and so the K/V of the positions after differ.
            "nemotron-h-alt" => vec![
                exact(),
                HitOutcome {
                    cached: 24,
                    counted: Some(Unvouched),
                    kv_differ: vec![23, 24, 25, 26],
                    state_equal: false,
                    drafts_equal: false,
                },
            ],
            _ => vec![exact(), exact()],
        };
        assert_eq!(outcomes, expected, "{fixture}");
    }
}
