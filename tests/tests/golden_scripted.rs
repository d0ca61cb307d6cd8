//! A short scenario through `TracingDeviceIo<ScriptedRouter>`, compared with a checked-in golden
//! trace: every plan, effect, outcome and error the contract's code path produces, line by line.

use device_io::testing::{release, seq, FaultAt, ScriptedConfig, ScriptedRouter};
use device_io::{
    DeviceError, DeviceIo, Effect, EffectOutcome, Feed, LoraCommand, Readback, Sequence, StepPlan,
};
use device_trace::{TraceSink, TracingDeviceIo};

#[test]
fn scripted_scenario_matches_its_golden_trace() {
    let config = ScriptedConfig {
        block_size: 4,
        num_blocks: 6,
        num_slots: 4,
        vocab_size: 64,
        max_depth: 2,
    };
    let (sink, buffer) = TraceSink::memory();
    let mut router = TracingDeviceIo::new(ScriptedRouter::new(config), sink);
    router.inner().script(&[11, 12, 13]);

    // Two requests: a chunked prefill, then a decode step.
    let mut a = seq(1, &[1, 2, 3, 4, 5, 6]);
    let mut b = seq(2, &[7, 8, 9]);
    let plan = StepPlan::Prefill {
        budgets: &[4, 4],
        readback: Readback::Argmax,
    };
    let ticket = router.launch(plan, &mut [&mut a, &mut b]).unwrap();
    let first = router.await_result(ticket).unwrap();
    assert_eq!(first.rows[1].token, Some(11));
    let plan = StepPlan::Prefill {
        budgets: &[4],
        readback: Readback::Argmax,
    };
    let ticket = router.launch(plan, &mut [&mut a]).unwrap();
    assert_eq!(router.await_result(ticket).unwrap().rows[0].token, Some(12));
    let plan = StepPlan::Decode {
        tokens: &[12, 11],
        readback: Readback::Argmax,
    };
    let ticket = router.launch(plan, &mut [&mut a, &mut b]).unwrap();
    let step = router.await_result(ticket).unwrap();
    let mut bytes = Vec::new();
    let logits = step.logits.unwrap();
    assert_eq!(
        router
            .apply(Effect::ReadLogits {
                logits,
                rows: 2,
                into: &mut bytes
            })
            .unwrap(),
        EffectOutcome::HostLogits { elem_bytes: 4 }
    );

    // Run-ahead: reserve both rows, launch the fed step (a from its argmax on the device, b
    // from a host token), then a turns out to have stopped: its over-run is rolled back.
    assert_eq!(
        router.apply(Effect::ReserveKv { seq: &mut a }).unwrap(),
        EffectOutcome::Reserved { blocks: 0 }
    );
    assert_eq!(
        router.apply(Effect::ReserveKv { seq: &mut b }).unwrap(),
        EffectOutcome::Reserved { blocks: 1 }
    );
    let plan = StepPlan::DecodeFed {
        sources: &[Feed::Row(0), Feed::Host(5)],
        masks: &[],
    };
    let ticket = router.launch(plan, &mut [&mut a, &mut b]).unwrap();
    router.await_result(ticket).unwrap();
    router.apply(Effect::Rollback { seq: &mut a }).unwrap();
    assert_eq!(a.computed_len(), 7);

    // A fault strikes one launch; the next succeeds.
    router.inner().inject(
        FaultAt::Launch,
        DeviceError::KvExhausted { needed: 2, free: 0 },
    );
    let plan = StepPlan::Decode {
        tokens: &[1, 2],
        readback: Readback::Argmax,
    };
    assert!(router.launch(plan, &mut [&mut a, &mut b]).is_err());

    // Finish a, compact b into slot 0, spill and restore b.
    release(&router, &mut a, true);
    router
        .apply(Effect::CompactSlot {
            seq: &mut b,
            target: 0,
        })
        .unwrap();
    let mut image = Vec::new();
    router
        .apply(Effect::SaveSequenceState {
            seq: &b,
            writer: &mut image,
        })
        .unwrap();
    router
        .apply(Effect::ReleaseSeq {
            seq: &mut b,
            cache: false,
            what: "preempt",
        })
        .unwrap();
    router
        .apply(Effect::RestoreSequenceState {
            seq: &mut b,
            reader: &mut image.as_slice(),
        })
        .unwrap();
    assert_eq!(b.computed_len(), 5);
    release(&router, &mut b, true);

    // Teardown in the documented order.
    router.lora(LoraCommand::Unload { adapter: 1 }).unwrap_err();
    router.apply(Effect::EpShutdown).unwrap();
    router.apply(Effect::Quiesce { stream: 0 }).unwrap();
    Box::new(router).teardown().unwrap();

    tests::golden::check("scripted_scenario", &buffer.text());
}
