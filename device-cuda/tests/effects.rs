//! The CUDA router's effects on `SimRuntime`, from spill images written with the shared format
//! (random KV and state, NaN payloads and negative zeros included): the spill round trip is bit
//! exact, compaction / detaching / snapshots / Marconi checkpoints copy exactly the state rows
//! they name, the reservation ledger adds and returns blocks, and every misuse is a typed error
//! that changes nothing. Each runs under the three stream schedules where streams are involved,
//! so a missing event between the compute and the copy stream shows up as wrong bytes.

use device_cuda::{CudaRouter, CudaRouterConfig, CudaSeq, DType, Schedule, SimRuntime};
use device_io::testing::{self, release};
use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, Readback, Sequence, StepPlan, Ticket,
};
use model::{Config, Model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use router_book::image::{self, ImageHeader, Layout};
use router_book::LogitsHandle;

const SLOTS: usize = 4;

fn model() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| Model::random(Config::tiny_demo(), 7).unwrap())
}

fn router_with(schedule: Schedule) -> CudaRouter {
    let config = CudaRouterConfig {
        weights: DType::Bf16,
        max_step_tokens: 64,
        ..CudaRouterConfig::new(8 << 20, SLOTS, 256)
    };
    let rt = SimRuntime::with_schedule(schedule).unwrap();
    CudaRouter::new(model(), Box::new(rt), config).unwrap()
}

fn router() -> CudaRouter {
    router_with(Schedule::Fifo)
}

fn layout(router: &CudaRouter) -> Layout {
    let plan = router.plan();
    Layout {
        fingerprint: model().fingerprint(),
        block_size: plan.block_size,
        floats_per_block: (plan.kv_block_bytes / 4) as usize,
        floats_per_slot: (plan.state_slot_bytes / 4) as usize,
        max_context: 256,
        vocab_size: 256,
        hidden_size: 0,
    }
}

/// A random value, sometimes a NaN with a payload or a negative zero (the copies move bits).
fn value(rng: &mut ChaCha8Rng) -> f32 {
    match rng.random_range(0..16) {
        0 => f32::from_bits(0x7fc0_1234),
        1 => -0.0,
        _ => rng.random_range(-2.0..2.0),
    }
}

/// An image of sequence `id` with `computed` positions of a `prompt`-token prompt, random KV and
/// state; answers the image and its state bytes.
fn image_of(
    router: &CudaRouter,
    id: u64,
    prompt: usize,
    computed: usize,
    seed: u64,
) -> (Vec<u8>, Vec<u8>) {
    let layout = layout(router);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tokens: Vec<u32> = (0..prompt.max(computed))
        .map(|_| rng.random_range(0..256))
        .collect();
    let blocks = computed.div_ceil(layout.block_size);
    let kv: Vec<f32> = (0..blocks * layout.floats_per_block)
        .map(|_| value(&mut rng))
        .collect();
    let state: Vec<f32> = (0..layout.floats_per_slot)
        .map(|_| value(&mut rng))
        .collect();
    let header = ImageHeader {
        seq_id: id,
        prompt_len: prompt,
        computed_len: computed,
        adapter: None,
        cache_salt: Some(9),
    };
    let bytes = image::encode(&layout, &header, &tokens, blocks, &kv, &state, None);
    (bytes, state.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// Sequence `id` with a 3-token prompt, for an image to be restored into.
fn seq(id: u64) -> CudaSeq {
    testing::seq(id, &[1, 2, 3])
}

fn restore(router: &CudaRouter, seq: &mut CudaSeq, image: &[u8]) -> device_io::Result<()> {
    router
        .apply(Effect::RestoreSequenceState {
            seq,
            reader: &mut &image[..],
        })
        .map(|_| ())
}

fn save(router: &CudaRouter, seq: &CudaSeq) -> device_io::Result<Vec<u8>> {
    let mut out = Vec::new();
    router.apply(Effect::SaveSequenceState {
        seq,
        writer: &mut out,
    })?;
    Ok(out)
}

fn used_blocks(facts: &DeviceFacts) -> usize {
    facts.kv_blocks_total - facts.kv_blocks_free
}

#[test]
fn the_spill_round_trip_is_bit_exact_under_every_schedule() {
    for schedule in [Schedule::Fifo, Schedule::ComputeFirst, Schedule::CopyFirst] {
        let router = router_with(schedule);
        let (a, state) = image_of(&router, 5, 30, 37, 1);
        let mut x = seq(5);
        restore(&router, &mut x, &a).unwrap();
        assert_eq!(x.computed_len(), 37);
        assert_eq!(x.slot(), Some(0));
        let facts = router.facts();
        assert_eq!((facts.live_slots_used, used_blocks(&facts)), (1, 3));
        assert_eq!(router.read_state_row(0).unwrap(), state, "{schedule:?}");
        assert_eq!(save(&router, &x).unwrap(), a, "{schedule:?}");
        // Moved to a second sequence of the same id on the same router: the same bytes again.
        release(&router, &mut x, false);
        assert_eq!(used_blocks(&router.facts()), 0);
        let mut again = seq(5);
        restore(&router, &mut again, &a).unwrap();
        assert_eq!(save(&router, &again).unwrap(), a, "{schedule:?}");
        release(&router, &mut again, false);
        Box::new(router).teardown().unwrap();
    }
}

#[test]
fn compaction_and_detaching_move_exactly_the_state_rows() {
    let router = router();
    let (ia, _) = image_of(&router, 1, 20, 20, 2);
    let (ib, sb) = image_of(&router, 2, 17, 40, 3);
    let (ic, sc) = image_of(&router, 3, 5, 5, 4);
    let (mut a, mut b, mut c) = (seq(1), seq(2), seq(3));
    restore(&router, &mut a, &ia).unwrap();
    restore(&router, &mut b, &ib).unwrap();
    assert_eq!((a.slot(), b.slot()), (Some(0), Some(1)));
    release(&router, &mut a, false);
    router
        .apply(Effect::CompactSlot {
            seq: &mut b,
            target: 0,
        })
        .unwrap();
    assert_eq!(b.slot(), Some(0));
    assert_eq!(router.read_state_row(0).unwrap(), sb);
    assert_eq!(save(&router, &b).unwrap(), ib);
    // A detached slot is free for the router and keeps its bytes until it is handed out.
    restore(&router, &mut c, &ic).unwrap();
    assert_eq!(c.slot(), Some(1));
    router.apply(Effect::DetachSlot { seq: &mut c }).unwrap();
    assert_eq!(c.slot(), None);
    assert_eq!(router.facts().live_slots_used, 1);
    assert_eq!(router.read_state_row(1).unwrap(), sc);
    router
        .apply(Effect::CompactSlot {
            seq: &mut b,
            target: 1,
        })
        .unwrap();
    assert_eq!(router.read_state_row(1).unwrap(), sb);
    // Releasing the detached sequence frees its blocks only: b keeps slot 1.
    let before = used_blocks(&router.facts());
    release(&router, &mut c, false);
    let facts = router.facts();
    assert_eq!(used_blocks(&facts), before - 1);
    assert_eq!(facts.live_slots_used, 1);
    assert_eq!(save(&router, &b).unwrap(), ib);
    release(&router, &mut b, false);
    Box::new(router).teardown().unwrap();
}

#[test]
fn snapshots_and_checkpoints_copy_the_live_state() {
    let router = router();
    let plan = *router.plan();
    let (ix, sx) = image_of(&router, 1, 20, 32, 5);
    let (iy, _) = image_of(&router, 2, 8, 8, 6);
    let (mut x, mut y) = (seq(1), seq(2));
    restore(&router, &mut x, &ix).unwrap();
    restore(&router, &mut y, &iy).unwrap();
    let ring = |slot: usize| plan.live_slots + plan.checkpoint_slots + slot;
    router
        .apply(Effect::SsmSnapshotSave { seq: &x, slot: 1 })
        .unwrap();
    assert_eq!(router.read_state_row(ring(1)).unwrap(), sx);
    // Overwrite the live row; the restore brings the snapshot back.
    router.write_state_row(0, &vec![0xab; sx.len()]).unwrap();
    router
        .apply(Effect::SsmSnapshotRestore {
            seq: &mut x,
            slot: 1,
        })
        .unwrap();
    assert_eq!(router.read_state_row(0).unwrap(), sx);
    assert!(matches!(
        router.apply(Effect::SsmSnapshotRestore {
            seq: &mut y,
            slot: 1
        }),
        Err(DeviceError::Invalid { .. })
    ));
    assert!(matches!(
        router.apply(Effect::SsmSnapshotSave {
            seq: &x,
            slot: plan.snapshot_slots
        }),
        Err(DeviceError::Invalid { .. })
    ));

    // A checkpoint the policy asked for (a decode step that reached a block boundary sets the
    // flag; no step runs before part 2, so the test sets it) copies the live state into a
    // checkpoint row, and the release offers both to the Marconi tree.
    assert_eq!(x.checkpoints_held(), (None, None));
    router
        .apply(Effect::MarconiCheckpoint { seq: &mut x })
        .unwrap();
    assert_eq!(x.checkpoints_held(), (None, None), "not due: nothing taken");
    x.checkpoint_due = true;
    router
        .apply(Effect::MarconiCheckpoint { seq: &mut x })
        .unwrap();
    let (_, Some(32)) = x.checkpoints_held() else {
        panic!("no output checkpoint: {:?}", x.checkpoints_held());
    };
    let slot = x.output_checkpoint.unwrap().1.index();
    assert_eq!(router.read_state_row(plan.live_slots + slot).unwrap(), sx);
    assert_eq!(router.facts().checkpoint_slots_used, 1);
    release(&router, &mut x, true);
    let facts = router.facts();
    assert_eq!(
        (facts.kv_blocks_cached, facts.checkpoint_slots_used),
        (2, 1)
    );
    // The cached checkpoint row is untouched by what comes next.
    router
        .apply(Effect::CompactSlot {
            seq: &mut y,
            target: 0,
        })
        .unwrap();
    assert_eq!(router.read_state_row(plan.live_slots + slot).unwrap(), sx);
    router.clear_prefix_cache().unwrap();
    let facts = router.facts();
    assert_eq!(
        (facts.kv_blocks_cached, facts.checkpoint_slots_used),
        (0, 0)
    );
    release(&router, &mut y, false);
    Box::new(router).teardown().unwrap();
}

#[test]
fn the_reservation_ledger_adds_and_returns_blocks() {
    let router = router();
    let (ix, _) = image_of(&router, 1, 20, 32, 7);
    let mut x = seq(1);
    restore(&router, &mut x, &ix).unwrap();
    let used = used_blocks(&router.facts());
    assert_eq!(
        router.apply(Effect::ReserveKv { seq: &mut x }).unwrap(),
        EffectOutcome::Reserved { blocks: 1 }
    );
    assert_eq!(used_blocks(&router.facts()), used + 1);
    // A second reservation at the same position commits the first and adds nothing.
    assert_eq!(
        router.apply(Effect::ReserveKv { seq: &mut x }).unwrap(),
        EffectOutcome::Reserved { blocks: 0 }
    );
    router.apply(Effect::Rollback { seq: &mut x }).unwrap();
    assert_eq!(
        used_blocks(&router.facts()),
        used + 1,
        "the committed block stays"
    );
    assert!(matches!(
        router.apply(Effect::Rollback { seq: &mut x }),
        Err(DeviceError::Invalid { .. })
    ));
    // The image is unchanged: no position was computed.
    assert_eq!(save(&router, &x).unwrap(), ix);
    release(&router, &mut x, false);
    assert_eq!(used_blocks(&router.facts()), 0);
    Box::new(router).teardown().unwrap();
}

#[test]
fn misuse_is_a_typed_error_that_changes_nothing() {
    let router = router();
    let (ix, _) = image_of(&router, 1, 20, 37, 8);
    let mut x = seq(1);
    restore(&router, &mut x, &ix).unwrap();
    let facts = router.facts();

    // Images that do not fit: truncated, corrupt, of another sequence, of another model.
    let mut other = seq(2);
    for (what, bad) in [
        ("truncated", ix[..ix.len() - 9].to_vec()),
        ("flipped", {
            let mut b = ix.clone();
            b[200] ^= 1;
            b
        }),
        ("another sequence", ix.clone()),
        ("empty", Vec::new()),
    ] {
        assert!(
            matches!(
                restore(&router, &mut other, &bad),
                Err(DeviceError::BadImage(_))
            ),
            "{what}"
        );
        assert_eq!(router.facts(), facts, "{what}");
        assert!(!other.holds_resources());
    }
    let foreign = Model::random(Config::tiny_demo(), 8).unwrap();
    let foreign_router = CudaRouter::sim(
        &foreign,
        CudaRouterConfig {
            max_step_tokens: 64,
            ..CudaRouterConfig::new(8 << 20, SLOTS, 256)
        },
    )
    .unwrap();
    let mut y = seq(1);
    assert!(matches!(
        restore(&foreign_router, &mut y, &ix),
        Err(DeviceError::BadImage(message)) if message.contains("fingerprint")
    ));
    // A sequence holding resources of this router is refused by another one, and vice versa.
    assert!(matches!(
        foreign_router.apply(Effect::CompactSlot {
            seq: &mut x,
            target: 1
        }),
        Err(DeviceError::Invalid { .. })
    ));
    assert!(matches!(
        foreign_router.apply(Effect::ReleaseSeq {
            seq: &mut x,
            cache: true,
            what: "finish"
        }),
        Err(DeviceError::Invalid { .. })
    ));
    assert!(matches!(
        restore(&router, &mut x, &ix),
        Err(DeviceError::Invalid { .. })
    ));

    // Slots: a taken or missing target, a sequence without a slot, all slots in use.
    let (iz, _) = image_of(&router, 3, 4, 4, 9);
    let mut z = seq(3);
    restore(&router, &mut z, &iz).unwrap();
    let facts = router.facts();
    for target in [1, SLOTS] {
        assert!(matches!(
            router.apply(Effect::CompactSlot {
                seq: &mut x,
                target
            }),
            Err(DeviceError::Invalid { .. })
        ));
    }
    let mut fresh = seq(9);
    for which in 0..3 {
        let effect = match which {
            0 => Effect::DetachSlot { seq: &mut fresh },
            1 => Effect::ReserveKv { seq: &mut fresh },
            _ => Effect::MarconiCheckpoint { seq: &mut fresh },
        };
        assert!(matches!(
            router.apply(effect),
            Err(DeviceError::Invalid { .. })
        ));
    }
    assert!(matches!(
        save(&router, &fresh),
        Err(DeviceError::Invalid { .. })
    ));
    assert_eq!(router.facts(), facts);
    let mut more: Vec<CudaSeq> = (10..12).map(seq).collect();
    for s in &mut more {
        let (image, _) = image_of(&router, s.id(), 4, 4, s.id());
        restore(&router, s, &image).unwrap();
    }
    let (last, _) = image_of(&router, 12, 4, 4, 12);
    let mut extra = seq(12);
    assert_eq!(
        restore(&router, &mut extra, &last),
        Err(DeviceError::SlotsExhausted { total: SLOTS })
    );
    for s in &mut more {
        release(&router, s, false);
    }

    // Streams, logits handles, tickets and plans.
    assert!(matches!(
        router.apply(Effect::Quiesce { stream: 2 }),
        Err(DeviceError::Invalid { .. })
    ));
    for effect in [
        Effect::Quiesce { stream: 0 },
        Effect::Quiesce { stream: 1 },
        Effect::SyncSecondary,
        Effect::EpShutdown,
    ] {
        assert_eq!(router.apply(effect).unwrap(), EffectOutcome::Unit);
    }
    let mut into = Vec::new();
    assert!(matches!(
        router.apply(Effect::ReadLogits {
            logits: LogitsHandle { step: 1 },
            rows: 1,
            into: &mut into
        }),
        Err(DeviceError::Invalid { .. })
    ));
    assert_eq!(
        router.await_result(Ticket(1)).unwrap_err(),
        DeviceError::UnknownTicket(Ticket(1))
    );
    let facts = router.facts();
    // A verification's mask would depend on the drafts before it; this model has no MTP head.
    let mask = vec![true; facts.vocab_size];
    let plan = StepPlan::Verify {
        inputs: &[&[3]],
        snapshots: &[],
        readback: Readback::ArgmaxMasked { masks: &[&mask] },
    };
    assert_eq!(
        router.launch(plan, &mut [&mut x]),
        Err(DeviceError::Unsupported {
            what: "Verify with ArgmaxMasked"
        })
    );
    let plan = StepPlan::Draft { tokens: &[3], k: 1 };
    assert_eq!(
        router.launch(plan, &mut [&mut x]),
        Err(DeviceError::Unsupported { what: "Draft" })
    );
    let plan = StepPlan::Decode {
        tokens: &[3, 4],
        readback: Readback::Argmax,
    };
    assert!(matches!(
        router.launch(plan, &mut [&mut x]),
        Err(DeviceError::Invalid { .. })
    ));
    assert_eq!(router.facts(), facts);
    assert_eq!(save(&router, &x).unwrap(), ix);

    // Teardown names the sequences that still hold resources.
    release(&router, &mut z, false);
    match Box::new(router).teardown() {
        Err(DeviceError::Failed { message, .. }) => {
            assert_eq!(message, "1 sequence(s) still held resources at teardown: 1")
        }
        other => panic!("teardown answered {other:?}"),
    }
}
