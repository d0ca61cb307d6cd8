//! `TracingDeviceIo` forwards every call unchanged and records one deterministic line before and
//! one after each traced call, on every sink.

use std::sync::{Arc, Mutex};

use device_io::testing::{seq, FaultAt, ScriptedConfig, ScriptedRouter, ScriptedSeq};
use device_io::{
    DeviceError, DeviceIo, Effect, EffectOutcome, LoraCommand, Readback, StepPlan, Ticket,
};
use device_trace::{TraceSink, TracingDeviceIo};

/// Generic code written against the contract: every method of `DeviceIo` is called.
fn scenario<D: DeviceIo<Seq = ScriptedSeq>>(mut router: D) -> Vec<String>
where
    D::LoraCmd: From<LoraCommand>,
    D::LoraAck: std::fmt::Debug,
{
    let mut outcomes = Vec::new();
    let mut a = seq(1, &[5, 6, 7, 8, 9]);
    let _ = router.model();
    outcomes.push(format!("depth {}", router.max_depth()));
    let ticket = router
        .launch(
            StepPlan::Prefill {
                budgets: &[8],
                readback: Readback::Argmax,
            },
            &mut [&mut a],
        )
        .expect("prefill");
    let step = router.await_result(ticket).expect("settle");
    outcomes.push(format!("{:?}", step.rows));
    outcomes.push(format!("{:?}", router.await_result(ticket).err()));
    outcomes.push(format!(
        "{:?}",
        router.apply(Effect::ReserveKv { seq: &mut a })
    ));
    outcomes.push(format!(
        "{:?}",
        router.apply(Effect::Rollback { seq: &mut a })
    ));
    outcomes.push(format!(
        "{:?}",
        router.lora(LoraCommand::Unload { adapter: 3 }.into())
    ));
    outcomes.push(format!(
        "{:?}",
        router.apply(Effect::ReleaseSeq {
            seq: &mut a,
            cache: true,
            what: "finish"
        })
    ));
    outcomes.push(format!("{:?}", router.facts()));
    outcomes.push(format!("{:?}", Box::new(router).teardown()));
    outcomes
}

#[test]
fn the_decorator_forwards_everything_unchanged() {
    let bare = scenario(ScriptedRouter::new(ScriptedConfig::default()));
    let (sink, _buffer) = TraceSink::memory();
    let traced = scenario(TracingDeviceIo::new(
        ScriptedRouter::new(ScriptedConfig::default()),
        sink,
    ));
    assert_eq!(bare, traced);
}

#[test]
fn the_memory_sink_records_one_line_before_and_after_each_call() {
    let (sink, buffer) = TraceSink::memory();
    scenario(TracingDeviceIo::new(
        ScriptedRouter::new(ScriptedConfig::default()),
        sink,
    ));
    let expected = "\
fx launch Prefill{n=1, budget=8, readback=Argmax}
-> ticket 1
fx await ticket 1
-> settled ticket 1 rows=1
fx await ticket 1
-> err UnknownTicket{1}
fx apply ReserveKv
-> Reserved{blocks=0}
fx apply Rollback
-> err Unsupported{Rollback}
fx lora Unload{adapter=3}
-> err NotLoaded{adapter=3}
fx apply ReleaseSeq{cache=true, finish}
-> Unit
fx teardown
-> ok
";
    assert_eq!(buffer.text(), expected);
}

#[test]
fn callback_and_writer_sinks_see_the_same_lines_and_errors_pass_through() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen_by_callback = Arc::clone(&seen);
    let sink =
        TraceSink::callback(move |line| seen_by_callback.lock().unwrap().push(line.to_owned()));
    let router = TracingDeviceIo::new(ScriptedRouter::new(ScriptedConfig::default()), sink);
    router.inner().inject(
        FaultAt::Effect("Quiesce"),
        DeviceError::DeviceLost("gone".into()),
    );
    assert_eq!(
        router.apply(Effect::Quiesce { stream: 1 }),
        Err(DeviceError::DeviceLost("gone".into()))
    );
    assert_eq!(
        router.apply(Effect::Quiesce { stream: 1 }),
        Ok(EffectOutcome::Unit)
    );
    assert_eq!(
        router.await_result(Ticket(5)).err(),
        Some(DeviceError::UnknownTicket(Ticket(5)))
    );
    let expected = [
        "fx apply Quiesce{stream=1}",
        "-> err DeviceLost",
        "fx apply Quiesce{stream=1}",
        "-> Unit",
        "fx await ticket 5",
        "-> err UnknownTicket{5}",
    ];
    assert_eq!(*seen.lock().unwrap(), expected);

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let bytes = Shared::default();
    let router = TracingDeviceIo::new(
        ScriptedRouter::new(ScriptedConfig::default()),
        TraceSink::writer(bytes.clone()),
    );
    router.apply(Effect::SyncSecondary).unwrap();
    assert_eq!(
        String::from_utf8(bytes.0.lock().unwrap().clone()).unwrap(),
        "fx apply SyncSecondary\n-> Unit\n"
    );
}

#[test]
fn the_tracing_sink_does_not_disturb_the_router() {
    let router = TracingDeviceIo::new(
        ScriptedRouter::new(ScriptedConfig::default()),
        TraceSink::tracing(),
    );
    assert_eq!(router.apply(Effect::EpShutdown), Ok(EffectOutcome::Unit));
    assert_eq!(router.inner().effects(), ["EpShutdown"]);
}

fn assert_send<T: Send>() {}

#[test]
fn handles_are_send() {
    assert_send::<TracingDeviceIo<ScriptedRouter>>();
    assert_send::<TraceSink>();
    assert_send::<device_trace::TraceBuffer>();
}

#[test]
fn a_panicking_sink_loses_its_lines_not_the_call() {
    // The callback panics on every second line it is given.
    let calls = Arc::new(Mutex::new(0usize));
    let counted = Arc::clone(&calls);
    let sink = TraceSink::callback(move |_| {
        let calls = {
            let mut calls = counted.lock().unwrap();
            *calls += 1;
            *calls
        };
        if calls % 2 == 0 {
            panic!("sink failure {calls}");
        }
    });
    let router = TracingDeviceIo::new(ScriptedRouter::new(ScriptedConfig::default()), sink);
    let outcomes =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| scenario_calls(&router)));
    let outcomes = outcomes.expect("a panicking sink took the router call down with it");
    assert_eq!(
        outcomes,
        scenario_calls(&ScriptedRouter::new(ScriptedConfig::default()))
    );
    // Eight calls, two lines each: every second line was dropped.
    assert_eq!(*calls.lock().unwrap(), 16);
    assert_eq!(router.dropped_lines(), 8);

    // A writer that panics is isolated the same way.
    struct Exploding;
    impl std::io::Write for Exploding {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            panic!("writer failure")
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let router = TracingDeviceIo::new(
        ScriptedRouter::new(ScriptedConfig::default()),
        TraceSink::writer(Exploding),
    );
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        router.apply(Effect::SyncSecondary)
    }));
    assert_eq!(
        result.expect("the writer's panic escaped"),
        Ok(EffectOutcome::Unit)
    );
    assert_eq!(router.dropped_lines(), 2);
}

/// Eight traced calls through `&router` (launch, two awaits, four effects, one more launch).
fn scenario_calls<D: DeviceIo<Seq = ScriptedSeq>>(router: &D) -> Vec<String> {
    let mut a = seq(1, &[5, 6, 7, 8, 9]);
    let mut outcomes = Vec::new();
    let ticket = router
        .launch(
            StepPlan::Prefill {
                budgets: &[8],
                readback: Readback::Argmax,
            },
            &mut [&mut a],
        )
        .unwrap();
    outcomes.push(format!("{:?}", router.await_result(ticket).map(|s| s.rows)));
    outcomes.push(format!("{:?}", router.await_result(ticket).err()));
    outcomes.push(format!(
        "{:?}",
        router.apply(Effect::ReserveKv { seq: &mut a })
    ));
    outcomes.push(format!("{:?}", router.apply(Effect::SyncSecondary)));
    outcomes.push(format!("{:?}", router.apply(Effect::Quiesce { stream: 0 })));
    outcomes.push(format!(
        "{:?}",
        router.apply(Effect::ReleaseSeq {
            seq: &mut a,
            cache: false,
            what: "finish"
        })
    ));
    let mut b = seq(2, &[1]);
    let plan = StepPlan::Prefill {
        budgets: &[8],
        readback: Readback::Argmax,
    };
    outcomes.push(format!(
        "{:?}",
        router.launch(plan, &mut [&mut b]).map(|_| ())
    ));
    outcomes
}
