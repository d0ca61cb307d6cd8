//! Every refusal is a typed error that changes nothing: dry pools, full slots, unsupported plans
//! and effects, unknown tickets, contract violations, bad spill images; plus LoRA and teardown.

mod common;

use common::*;
use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq, LogitsHandle};
use device_io::{
    DeviceError, DeviceIo, Effect, EffectOutcome, Phase, Readback, Sequence, StepPlan, Ticket,
};

/// A router of `num_blocks` blocks of 16 tokens, `max_seqs` slots, prefix cache off.
fn small(num_blocks: usize, max_seqs: usize) -> CpuRouter {
    let mut config = CpuRouterConfig::new(num_blocks, max_seqs);
    config.prefix_cache = false;
    config.checkpoints = device_cpu::CheckpointBudget::Slots(4);
    CpuRouter::new(hybrid_model(), config).unwrap()
}

fn prefill_plan(budgets: &[usize]) -> StepPlan<'_> {
    StepPlan::Prefill {
        budgets,
        readback: Readback::Argmax,
    }
}

const ONE: [u32; 1] = [1];
const OUT_OF_VOCAB: [u32; 1] = [256];

fn decode_plan(tokens: &[u32]) -> StepPlan<'_> {
    StepPlan::Decode {
        tokens,
        readback: Readback::Argmax,
    }
}

fn invalid(err: DeviceError) -> (&'static str, String) {
    match err {
        DeviceError::Invalid { what, detail } => (what, detail),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// What a sequence looks like from the outside, to check that a refusal left it alone.
fn view(s: &CpuSeq) -> (usize, Option<usize>, Vec<u32>, Vec<u32>) {
    (
        s.computed_len(),
        s.slot(),
        s.blocks().to_vec(),
        s.tokens().to_vec(),
    )
}

#[test]
fn a_dry_pool_refuses_a_prefill_and_changes_no_row() {
    let r = small(8, 4);
    let mut a = seq(1, &tokens(1, 100)); // 7 blocks
    prefill(&r, &mut a, 100);
    let before = r.facts();
    assert_eq!(before.kv_blocks_free, 1);
    let mut b = seq(2, &tokens(2, 10)); // 1 block: would fit alone
    let mut c = seq(3, &tokens(3, 40)); // 3 blocks
    let (vb, vc) = (view(&b), view(&c));
    let err = r
        .launch(prefill_plan(&[10, 40]), &mut [&mut b, &mut c])
        .unwrap_err();
    assert_eq!(err, DeviceError::KvExhausted { needed: 4, free: 1 });
    assert_eq!(r.facts(), before);
    assert_eq!((view(&b), view(&c)), (vb, vc));
    // The row that fits still runs alone afterwards.
    prefill(&r, &mut b, 10);
    for s in [&mut a, &mut b] {
        release(&r, s, false);
    }
}

#[test]
fn a_dry_pool_refuses_a_decode_and_reserve_kv_reports_exhausted() {
    let r = small(4, 4);
    let mut a = seq(1, &tokens(1, 32)); // exactly 2 blocks
    let mut b = seq(2, &tokens(2, 32));
    prefill(&r, &mut a, 32);
    prefill(&r, &mut b, 32);
    let before = r.facts();
    assert_eq!(before.kv_blocks_free, 0);
    let (va, vb) = (view(&a), view(&b));
    let err = r
        .launch(
            StepPlan::Decode {
                tokens: &[1, 2],
                readback: Readback::Argmax,
            },
            &mut [&mut a, &mut b],
        )
        .unwrap_err();
    assert_eq!(err, DeviceError::KvExhausted { needed: 2, free: 0 });
    assert_eq!(
        r.apply(Effect::ReserveKv { seq: &mut a }).unwrap(),
        EffectOutcome::Exhausted
    );
    assert_eq!((r.facts(), view(&a), view(&b)), (before, va, vb));
    // Freeing one sequence lets the other reserve and then decode without a new block.
    release(&r, &mut b, false);
    assert_eq!(
        r.apply(Effect::ReserveKv { seq: &mut a }).unwrap(),
        EffectOutcome::Reserved { blocks: 1 }
    );
    assert_eq!(
        r.apply(Effect::ReserveKv { seq: &mut a }).unwrap(),
        EffectOutcome::Reserved { blocks: 0 }
    );
    let free = r.facts().kv_blocks_free;
    decode(&r, &mut [&mut a], &[5]);
    assert_eq!(r.facts().kv_blocks_free, free);
    release(&r, &mut a, false);
    assert_eq!(r.facts().kv_blocks_free, 4);
}

#[test]
fn full_slots_refuse_a_new_sequence() {
    let r = small(16, 1);
    let mut a = seq(1, &tokens(1, 5));
    prefill(&r, &mut a, 5);
    let before = r.facts();
    let mut b = seq(2, &tokens(2, 5));
    assert_eq!(
        r.launch(prefill_plan(&[5]), &mut [&mut b]).unwrap_err(),
        DeviceError::SlotsExhausted { total: 1 }
    );
    assert_eq!((r.facts(), b.slot(), b.computed_len()), (before, None, 0));
    release(&r, &mut a, false);
}

#[test]
fn the_synchronous_router_refuses_fed_steps_and_rollbacks() {
    let r = small(16, 2);
    let mut a = seq(1, &tokens(1, 5));
    prefill(&r, &mut a, 5);
    let before = r.facts();
    assert_eq!(
        r.launch(
            StepPlan::DecodeFed {
                sources: &[device_io::Feed::Host(1)],
                masks: &[],
            },
            &mut [&mut a],
        )
        .unwrap_err(),
        DeviceError::Unsupported { what: "DecodeFed" }
    );
    assert_eq!(
        r.apply(Effect::Rollback { seq: &mut a }).unwrap_err(),
        DeviceError::Unsupported { what: "Rollback" }
    );
    assert_eq!((r.facts(), a.computed_len()), (before, 5));
    assert_eq!(r.max_depth(), 1);
    release(&r, &mut a, false);
}

#[test]
fn masks_of_the_wrong_shape_are_invalid_and_change_nothing() {
    let r = small(16, 2);
    let mut a = seq(1, &tokens(1, 5));
    prefill(&r, &mut a, 5);
    let before = (r.facts(), a.computed_len());
    let short = [true; 10];
    let none = [false; 256];
    let cases: [(&[&[bool]], &str); 3] = [
        (&[], "0 masks for 1 rows"),
        (&[&short], "mask 0 has 10 entries"),
        (&[&none], "mask 0 allows no token"),
    ];
    for (masks, needle) in cases {
        let err = r
            .launch(
                StepPlan::Decode {
                    tokens: &[1],
                    readback: Readback::ArgmaxMasked { masks },
                },
                &mut [&mut a],
            )
            .unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
        assert_eq!((r.facts(), a.computed_len()), before);
    }
    release(&r, &mut a, false);
}

#[test]
fn tickets_are_claimed_exactly_once_and_depth_is_one() {
    let r = small(16, 2);
    let mut a = seq(1, &tokens(1, 5));
    assert_eq!(
        r.await_result(Ticket(42)).unwrap_err(),
        DeviceError::UnknownTicket(Ticket(42))
    );
    let ticket = r.launch(prefill_plan(&[5]), &mut [&mut a]).unwrap();
    // A second launch before the first is awaited breaks depth 1.
    let (what, detail) = invalid(
        r.launch(
            StepPlan::Decode {
                tokens: &[1],
                readback: Readback::Argmax,
            },
            &mut [&mut a],
        )
        .unwrap_err(),
    );
    assert_eq!(what, "launch");
    assert!(detail.contains("not awaited"), "{detail}");
    assert_eq!(
        r.await_result(Ticket(ticket.0 + 1)).unwrap_err(),
        DeviceError::UnknownTicket(Ticket(ticket.0 + 1))
    );
    let result = r.await_result(ticket).unwrap();
    assert_eq!(result.ticket, ticket);
    assert_eq!(result.rows.len(), 1);
    assert!(result.rows[0].token.is_some());
    assert_eq!(
        r.await_result(ticket).unwrap_err(),
        DeviceError::UnknownTicket(ticket)
    );
    release(&r, &mut a, false);
}

#[test]
fn contract_violations_are_invalid_and_change_nothing() {
    let r = small(16, 3);
    let mut a = seq(1, &tokens(1, 20));
    let mut b = seq(2, &tokens(2, 20));
    let mut fresh = seq(3, &tokens(3, 8));
    let mut bad_token = seq(4, &[1, 2, 300]);
    let mut too_long = seq(5, &tokens(5, 300));
    prefill(&r, &mut a, 20);
    // b is mid-prefill: one chunk of 7.
    let ticket = r.launch(prefill_plan(&[7]), &mut [&mut b]).unwrap();
    r.await_result(ticket).unwrap();
    let before = r.facts();
    let checks: Vec<(DeviceError, &str, &str)> = vec![
        (
            r.launch(prefill_plan(&[5, 5]), &mut [&mut fresh])
                .unwrap_err(),
            "Prefill",
            "2 budgets for 1 rows",
        ),
        (
            r.launch(prefill_plan(&[0]), &mut [&mut fresh]).unwrap_err(),
            "Prefill",
            "budget of 0",
        ),
        (
            r.launch(prefill_plan(&[5]), &mut [&mut bad_token])
                .unwrap_err(),
            "Prefill",
            "token id 300",
        ),
        (
            r.launch(prefill_plan(&[5]), &mut [&mut too_long])
                .unwrap_err(),
            "Prefill",
            "over max_context",
        ),
        (
            r.launch(prefill_plan(&[5]), &mut [&mut a]).unwrap_err(),
            "Prefill",
            "complete",
        ),
        (
            r.launch(decode_plan(&ONE), &mut [&mut b]).unwrap_err(),
            "Decode",
            "computed 7 of its 20",
        ),
        (
            r.launch(decode_plan(&ONE), &mut [&mut fresh]).unwrap_err(),
            "Decode",
            "no live slot",
        ),
        (
            r.launch(decode_plan(&OUT_OF_VOCAB), &mut [&mut a])
                .unwrap_err(),
            "Decode",
            "token id 256",
        ),
        (
            r.launch(
                StepPlan::Decode {
                    tokens: &[1, 2],
                    readback: Readback::Argmax,
                },
                &mut [&mut a],
            )
            .unwrap_err(),
            "Decode",
            "2 tokens for 1 rows",
        ),
        (
            r.apply(Effect::CompactSlot {
                seq: &mut a,
                target: 1,
            })
            .unwrap_err(),
            "CompactSlot",
            "not free",
        ),
        (
            r.apply(Effect::CompactSlot {
                seq: &mut a,
                target: 3,
            })
            .unwrap_err(),
            "CompactSlot",
            "outside the 3",
        ),
        (
            r.apply(Effect::CompactSlot {
                seq: &mut fresh,
                target: 2,
            })
            .unwrap_err(),
            "CompactSlot",
            "no live slot",
        ),
        (
            r.apply(Effect::DetachSlot { seq: &mut fresh }).unwrap_err(),
            "DetachSlot",
            "no live slot",
        ),
        (
            r.apply(Effect::SsmSnapshotSave { seq: &a, slot: 4 })
                .unwrap_err(),
            "SsmSnapshotSave",
            "outside the 4",
        ),
        (
            r.apply(Effect::SsmSnapshotRestore {
                seq: &mut a,
                slot: 0,
            })
            .unwrap_err(),
            "SsmSnapshotRestore",
            "no snapshot",
        ),
        (
            r.apply(Effect::ReserveKv { seq: &mut fresh }).unwrap_err(),
            "ReserveKv",
            "no live slot",
        ),
        (
            r.apply(Effect::RestoreSequenceState {
                seq: &mut a,
                reader: &mut [].as_slice(),
            })
            .unwrap_err(),
            "RestoreSequenceState",
            "still holds resources",
        ),
        (
            r.apply(Effect::SaveSequenceState {
                seq: &fresh,
                writer: &mut Vec::new(),
            })
            .unwrap_err(),
            "SaveSequenceState",
            "no live slot",
        ),
    ];
    for (err, want_what, want_detail) in checks {
        let (what, detail) = invalid(err);
        assert_eq!(what, want_what);
        assert!(
            detail.contains(want_detail),
            "{what}: {detail:?} should contain {want_detail:?}"
        );
    }
    assert_eq!(r.facts(), before);
    // A snapshot of one sequence is not restored into another.
    r.apply(Effect::SsmSnapshotSave { seq: &a, slot: 1 })
        .unwrap();
    let mut c = seq(6, &tokens(6, 20));
    prefill(&r, &mut c, 20);
    release(&r, &mut b, false);
    let (what, detail) = invalid(
        r.apply(Effect::SsmSnapshotRestore {
            seq: &mut c,
            slot: 1,
        })
        .unwrap_err(),
    );
    assert_eq!(
        (what, detail.as_str()),
        (
            "SsmSnapshotRestore",
            "ring slot 1 holds another sequence's snapshot"
        )
    );
    // A detached sequence neither decodes nor frees the slot it gave away.
    r.apply(Effect::DetachSlot { seq: &mut c }).unwrap();
    assert_eq!(c.slot(), None);
    let (what, _) = invalid(r.launch(decode_plan(&ONE), &mut [&mut c]).unwrap_err());
    assert_eq!(what, "Decode");
    for s in [&mut a, &mut c, &mut fresh] {
        release(&r, s, false);
    }
    assert_eq!(r.facts().live_slots_used, 0);
    assert_eq!(r.facts().kv_blocks_free, 16);
}

#[test]
fn a_sequence_of_another_router_is_refused() {
    let mine = small(16, 2);
    let other = small(16, 8);
    let mut a = seq(1, &tokens(1, 20));
    prefill(&other, &mut a, 20);
    for _ in 0..4 {
        // Moves `a` to slot 7 on `other`, beyond `mine`'s two slots.
        let mut filler = seq(9, &tokens(9, 3));
        prefill(&other, &mut filler, 3);
        std::mem::forget(filler);
    }
    other
        .apply(Effect::CompactSlot {
            seq: &mut a,
            target: 7,
        })
        .unwrap();
    let before = mine.facts();
    let checks = [
        mine.apply(Effect::ReleaseSeq {
            seq: &mut a,
            cache: true,
            what: "finish",
        })
        .unwrap_err(),
        mine.launch(decode_plan(&ONE), &mut [&mut a]).unwrap_err(),
        mine.launch(prefill_plan(&[4]), &mut [&mut a]).unwrap_err(),
        mine.apply(Effect::CompactSlot {
            seq: &mut a,
            target: 0,
        })
        .unwrap_err(),
        mine.apply(Effect::ReserveKv { seq: &mut a }).unwrap_err(),
        mine.apply(Effect::SaveSequenceState {
            seq: &a,
            writer: &mut Vec::new(),
        })
        .unwrap_err(),
    ];
    for err in checks {
        let (_, detail) = invalid(err);
        assert!(
            detail == "sequence 1 holds resources of another router"
                || detail == "sequence 1 holds no live slot",
            "{detail}"
        );
    }
    assert_eq!(mine.facts(), before);
    assert_eq!(a.slot(), Some(7));
    release(&other, &mut a, false);
}

#[test]
fn read_logits_reads_the_latest_step_only() {
    let r = small(16, 2);
    let mut a = seq(1, &tokens(1, 9));
    let mut b = seq(2, &tokens(2, 12));
    let (la, _) = prefill(&r, &mut a, 9);
    let (lb, _) = prefill(&r, &mut b, 12);
    let tokens = [argmax(&la), argmax(&lb)];
    let ticket = r
        .launch(
            StepPlan::Decode {
                tokens: &tokens,
                readback: Readback::Argmax,
            },
            &mut [&mut a, &mut b],
        )
        .unwrap();
    let result = r.await_result(ticket).unwrap();
    let handle = result.logits.unwrap();
    assert_eq!(handle, LogitsHandle { step: ticket.0 });
    let mut bytes = vec![1, 2, 3];
    assert_eq!(
        r.apply(Effect::ReadLogits {
            logits: handle,
            rows: 2,
            into: &mut bytes
        })
        .unwrap(),
        EffectOutcome::HostLogits { elem_bytes: 4 }
    );
    assert_eq!(bytes.len(), 2 * 256 * 4);
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (row, out) in result.rows.iter().enumerate() {
        assert_eq!(Some(argmax(&floats[row * 256..(row + 1) * 256])), out.token);
        assert_eq!(out.logits_row, None);
    }
    let (what, detail) = invalid(
        r.apply(Effect::ReadLogits {
            logits: handle,
            rows: 3,
            into: &mut bytes,
        })
        .unwrap_err(),
    );
    assert_eq!(
        (what, detail.as_str()),
        (
            "ReadLogits",
            &*format!("3 rows asked, step {} has 2", ticket.0)
        )
    );
    // The next step replaces the logits: the old handle is stale.
    decode(&r, &mut [&mut a], &[7]);
    let (what, detail) = invalid(
        r.apply(Effect::ReadLogits {
            logits: handle,
            rows: 1,
            into: &mut bytes,
        })
        .unwrap_err(),
    );
    assert_eq!(what, "ReadLogits");
    assert!(
        detail.starts_with(&format!("the handle names step {}", ticket.0)),
        "{detail}"
    );
    for s in [&mut a, &mut b] {
        release(&r, s, false);
    }
}

#[test]
fn bad_images_are_refused_and_change_nothing() {
    let r = small(16, 2);
    let mut a = seq(1, &tokens(1, 20));
    let (logits, _) = prefill(&r, &mut a, 20);
    generate(&r, &mut a, logits, 3);
    let mut image = Vec::new();
    r.apply(Effect::SaveSequenceState {
        seq: &a,
        writer: &mut image,
    })
    .unwrap();
    release(&r, &mut a, false);
    let before = r.facts();

    let restore = |r: &CpuRouter, bytes: &[u8], id: u64| -> DeviceError {
        let mut target = seq(id, &tokens(1, 20));
        let err = r
            .apply(Effect::RestoreSequenceState {
                seq: &mut target,
                reader: &mut &bytes[..],
            })
            .unwrap_err();
        assert_eq!(
            (target.slot(), target.computed_len(), target.blocks().len()),
            (None, 0, 0)
        );
        err
    };
    let bad = |err: DeviceError| match err {
        DeviceError::BadImage(detail) => detail,
        other => panic!("expected BadImage, got {other:?}"),
    };
    assert!(bad(restore(&r, &image[..image.len() - 3], 1)).starts_with("truncated"));
    assert!(bad(restore(&r, &image[..10], 1)).starts_with("truncated: version needs 4 bytes"));
    let mut flipped = image.clone();
    let at = flipped.len() - 20;
    flipped[at] ^= 0x40;
    assert!(bad(restore(&r, &flipped, 1)).starts_with("checksum mismatch"));
    assert_eq!(
        bad(restore(&r, &image, 2)),
        "the image is of sequence 1, not 2"
    );
    // Another model (same shapes, other weights) refuses it by fingerprint.
    let mut config = CpuRouterConfig::new(16, 2);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(4);
    let mut other_config = model::Config::tiny_demo();
    other_config.layer_kinds = hybrid_model().config().layer_kinds.clone();
    let foreign = CpuRouter::new(model::Model::random(other_config, 3).unwrap(), config).unwrap();
    assert!(bad(restore(&foreign, &image, 1)).starts_with("model fingerprint"));
    assert_eq!(r.facts(), before);
    // A pool too small for the image answers KvExhausted, also changing nothing.
    let mut hog = seq(9, &tokens(9, 16 * 15));
    prefill(&r, &mut hog, 256);
    let busy = r.facts();
    assert_eq!(
        restore(&r, &image, 1),
        DeviceError::KvExhausted { needed: 2, free: 1 }
    );
    assert_eq!(r.facts(), busy);
    release(&r, &mut hog, false);
    // The intact image restores.
    let mut target = seq(1, &tokens(1, 20));
    r.apply(Effect::RestoreSequenceState {
        seq: &mut target,
        reader: &mut image.as_slice(),
    })
    .unwrap();
    assert_eq!(target.computed_len(), 23);
    release(&r, &mut target, false);
}

#[test]
fn unloading_an_unknown_adapter_is_refused_and_teardown_names_holders() {
    let mut r = small(16, 2);
    let err = r
        .lora(device_io::LoraCommand::Unload { adapter: 1 })
        .unwrap_err();
    assert_eq!(err, device_io::LoraError::NotLoaded { adapter: 1 });
    let mut a = seq(17, &tokens(1, 5));
    let mut b = seq(18, &tokens(2, 5));
    prefill(&r, &mut a, 5);
    prefill(&r, &mut b, 5);
    release(&r, &mut b, true);
    match Box::new(r).teardown().unwrap_err() {
        DeviceError::Failed {
            phase: Phase::Teardown,
            message,
        } => {
            assert_eq!(
                message,
                "1 sequence(s) still held resources at teardown: 17"
            )
        }
        other => panic!("{other:?}"),
    }
    let clean = small(16, 2);
    let mut c = seq(1, &tokens(1, 5));
    prefill(&clean, &mut c, 5);
    release(&clean, &mut c, true);
    Box::new(clean).teardown().unwrap();
}
