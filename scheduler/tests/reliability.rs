//! The engine's rare paths against `device_io::testing::ScriptedRouter`: a release the router
//! refuses twice, a submit racing a shutdown, a router call that panics, a lost device. In every
//! case a failure costs the requests it hit and nothing else, and every accepted request gets
//! exactly one final event.

mod common;

use common::{config, expected, idle_facts, prompt, router};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use device_io::testing::{FaultAt, Hooked, Hooks, ScriptedRouter, ScriptedSeq};
use device_io::{DeviceError, DeviceIo, Effect, EffectOutcome, Phase, StepPlan, Ticket};
use device_trace::{TraceSink, TracingDeviceIo};
use scheduler::{
    ControlError, Engine, EngineError, EngineThread, Event, Request, RequestError, RequestHandle,
    ServeError, ShutdownMode,
};

fn injected() -> DeviceError {
    DeviceError::Failed {
        phase: Phase::Effect,
        message: "injected".into(),
    }
}

#[test]
fn a_twice_failed_release_fails_only_its_own_request() {
    // a finishes first and its release fails twice: it becomes an orphan that still holds slot 0.
    // Compaction must not move b, c or d into that slot.
    let mut engine = Engine::new(router(64, 8), config()).unwrap();
    let a = engine.submit(Request::greedy(prompt(4, 0), 1)).unwrap();
    let others: Vec<_> = (1..4)
        .map(|i| engine.submit(Request::greedy(prompt(4, i), 6)).unwrap())
        .collect();
    engine
        .router()
        .inject(FaultAt::Effect("ReleaseSeq"), injected());
    engine
        .router()
        .inject(FaultAt::Effect("ReleaseSeq"), injected());
    engine.run_until_idle();
    assert!(matches!(
        a.wait(),
        Err(ServeError::Device {
            during: "ReleaseSeq",
            ..
        })
    ));
    for handle in others {
        let id = handle.id();
        assert_eq!(
            handle.wait().map(|c| c.tokens),
            Ok(expected(engine.router(), id, 4, 6)),
            "request {id}"
        );
    }
    assert_eq!(engine.metrics().failed, 1);
    assert_eq!(engine.metrics().orphaned_sequences, 1);
    assert_eq!(engine.orphans_len(), 0);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}

/// Around a [`ScriptedRouter`]: holds `EpShutdown` until the test lets it go (so a test can act
/// while a shutdown is under way).
#[derive(Debug)]
struct ShutdownGate {
    /// Sends `()` when `EpShutdown` is reached.
    reached: Sender<()>,
    /// `EpShutdown` returns once this yields.
    release: Receiver<()>,
}

impl Hooks for ShutdownGate {
    fn apply(
        &self,
        router: &ScriptedRouter,
        effect: Effect<'_, ScriptedSeq, u64>,
    ) -> Result<EffectOutcome, DeviceError> {
        if let Effect::EpShutdown = effect {
            self.reached.send(()).unwrap();
            self.release.recv().unwrap();
        }
        router.apply(effect)
    }
}

/// The events of a stream up to its end (the stream must end: the engine is gone).
fn all_events(handle: &RequestHandle) -> Vec<Event> {
    handle.events().iter().collect()
}

#[test]
fn a_submit_while_shutdown_is_under_way_is_refused_or_gets_a_final_error() {
    for mode in [ShutdownMode::Drain, ShutdownMode::Abort] {
        let (reached_tx, reached) = crossbeam_channel::unbounded();
        let (release, release_rx) = crossbeam_channel::unbounded();
        let gated = Hooked {
            router: router(64, 8),
            hooks: ShutdownGate {
                reached: reached_tx,
                release: release_rx,
            },
        };
        let thread = EngineThread::spawn(Engine::new(gated, config()).unwrap()).unwrap();
        let client = thread.client();
        let first = client.submit(Request::greedy(prompt(4, 0), 3)).unwrap();
        assert_eq!(first.wait().unwrap().tokens.len(), 3);
        let shutting = std::thread::spawn(move || thread.shutdown(mode));
        // The engine now sits inside EpShutdown: it has drained its commands for the last time.
        reached.recv().unwrap();
        let late = client.submit(Request::greedy(prompt(4, 1), 3));
        release.send(()).unwrap();
        shutting.join().unwrap().unwrap();
        match late {
            Err(err) => assert_eq!(err, RequestError::EngineStopped, "{mode:?}"),
            Ok(handle) => assert_eq!(
                all_events(&handle),
                vec![Event::Error(ServeError::EngineStopped)],
                "{mode:?}: the stream ended without a final event"
            ),
        }
        // After the engine is gone, a submit is refused at once.
        assert_eq!(
            client.submit(Request::greedy(prompt(4, 2), 3)).unwrap_err(),
            RequestError::EngineStopped
        );
    }
}

/// Around a [`ScriptedRouter`]: counts launches, and panics at launch number `panic_at`
/// (counting from 1).
#[derive(Debug)]
struct Probe {
    launches: AtomicUsize,
    panic_at: Option<usize>,
}

impl Probe {
    fn around(router: ScriptedRouter, panic_at: Option<usize>) -> Hooked<Probe> {
        Hooked {
            router,
            hooks: Probe {
                launches: AtomicUsize::new(0),
                panic_at,
            },
        }
    }

    fn launches(&self) -> usize {
        self.launches.load(Ordering::SeqCst)
    }
}

impl Hooks for Probe {
    fn launch(
        &self,
        router: &ScriptedRouter,
        plan: StepPlan<'_>,
        rows: &mut [&mut ScriptedSeq],
    ) -> Result<Ticket, DeviceError> {
        let n = self.launches.fetch_add(1, Ordering::SeqCst) + 1;
        if self.panic_at == Some(n) {
            panic!("injected router panic at launch {n}");
        }
        router.launch(plan, rows)
    }
}

/// Whether `events` are some tokens followed by exactly one final event that says the device was
/// lost.
fn ends_with_device_lost(events: &[Event]) -> bool {
    let Some((last, tokens)) = events.split_last() else {
        return false;
    };
    tokens.iter().all(|e| matches!(e, Event::Token(_)))
        && matches!(last, Event::Error(ServeError::DeviceLost(_)))
}

#[test]
fn a_panicking_router_call_fails_every_request_with_a_typed_error_and_the_engine_stops_cleanly() {
    // Four requests running, two waiting (4 slots); the router panics at the 5th launch.
    let probe = Probe::around(router(64, 4), Some(5));
    let thread = EngineThread::spawn(Engine::new(probe, config()).unwrap()).unwrap();
    let client = thread.client();
    let handles: Vec<_> = (0..6)
        .map(|i| client.submit(Request::greedy(prompt(4, i), 20)).unwrap())
        .collect();
    for handle in &handles {
        let events = all_events(handle);
        assert!(
            ends_with_device_lost(&events),
            "request {}: {events:?}",
            handle.id()
        );
    }
    assert_eq!(
        client.submit(Request::greedy(prompt(4, 9), 2)).unwrap_err(),
        RequestError::EngineStopped
    );
    assert!(matches!(
        thread.shutdown(ShutdownMode::Drain),
        Err(EngineError::DeviceLost(DeviceError::DeviceLost(_)))
    ));
}

#[test]
fn a_lost_device_fails_every_live_and_waiting_request_and_nothing_more_is_launched() {
    let mut engine = Engine::new(Probe::around(router(64, 4), None), config()).unwrap();
    let handles: Vec<_> = (0..6)
        .map(|i| engine.submit(Request::greedy(prompt(4, i), 20)).unwrap())
        .collect();
    for _ in 0..3 {
        engine.step();
    }
    assert_eq!((engine.running_len(), engine.waiting_len()), (4, 2));
    engine
        .router()
        .router
        .inject(FaultAt::Launch, DeviceError::DeviceLost("gone".into()));
    engine.step();
    for handle in &handles {
        let events: Vec<Event> = handle.events().try_iter().collect();
        assert!(
            ends_with_device_lost(&events),
            "request {}: {events:?}",
            handle.id()
        );
    }
    assert!(engine.is_idle());
    assert_eq!(engine.metrics().failed, 6);
    assert_eq!(
        engine.submit(Request::greedy(prompt(4, 9), 2)).unwrap_err(),
        RequestError::EngineStopped
    );
    let launches = engine.router().hooks.launches();
    let effects = engine.router().router.effects().len();
    for _ in 0..3 {
        engine.step();
    }
    assert_eq!(engine.router().hooks.launches(), launches);
    assert_eq!(engine.router().router.effects().len(), effects);
    assert!(matches!(
        engine.shutdown(ShutdownMode::Drain),
        Err(EngineError::DeviceLost(DeviceError::DeviceLost(message))) if message == "gone"
    ));
}

#[test]
fn a_panicking_trace_sink_costs_trace_lines_not_requests() {
    // The sink panics on every third line; every request still completes on the engine thread.
    let lines = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&lines);
    let sink = TraceSink::callback(move |_| {
        if counted.fetch_add(1, Ordering::SeqCst) % 3 == 2 {
            panic!("sink failure");
        }
    });
    let traced = TracingDeviceIo::new(router(64, 8), sink);
    let engine = Engine::new(traced, config()).unwrap();
    let thread = EngineThread::spawn(engine).unwrap();
    let client = thread.client();
    let handles: Vec<_> = (0..16)
        .map(|i| client.submit(Request::greedy(prompt(4, i), 6)).unwrap())
        .collect();
    let reference = router(64, 8);
    for handle in handles {
        let id = handle.id();
        assert_eq!(
            handle.wait().map(|c| c.tokens),
            Ok(expected(&reference, id, 4, 6)),
            "request {id}"
        );
    }
    let metrics = thread.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(metrics.finished, 16);
    assert!(lines.load(Ordering::SeqCst) >= 3);
}

#[test]
fn a_client_reads_the_routers_facts_and_clears_its_prefix_cache() {
    let (sink, trace) = TraceSink::memory();
    let traced = TracingDeviceIo::new(router(64, 8), sink);
    let thread = EngineThread::spawn(Engine::new(traced, config()).unwrap()).unwrap();
    let client = thread.client();
    let idle = client.stats().unwrap();
    assert_eq!(idle.facts, idle_facts(&router(64, 8)));
    assert_eq!((idle.waiting, idle.running, idle.orphans), (0, 0, 0));
    assert_eq!(idle.device_lost, None);
    let handle = client.submit(Request::greedy(prompt(6, 0), 4)).unwrap();
    assert_eq!(handle.wait().unwrap().tokens.len(), 4);
    let after = client.stats().unwrap();
    assert_eq!(after.facts, idle.facts);
    assert_eq!(after.metrics.finished, 1);
    client.clear_prefix_cache().unwrap();
    assert!(
        trace
            .lines()
            .iter()
            .any(|line| line == "fx clear_prefix_cache"),
        "{:?}",
        trace.lines()
    );
    thread.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(client.stats().unwrap_err(), ControlError::EngineStopped);
    assert_eq!(
        client.clear_prefix_cache().unwrap_err(),
        ControlError::EngineStopped
    );
}

#[test]
fn an_idle_engine_keeps_releasing_its_orphans() {
    // The release of the only request fails three times: its release and the retry without
    // caching (so it becomes an orphan), then the orphan's release at the end of that step.
    // Nothing else arrives; the engine thread must still give the slot and blocks back.
    let scripted = router(64, 8);
    for _ in 0..3 {
        scripted.inject(FaultAt::Effect("ReleaseSeq"), injected());
    }
    let thread = EngineThread::spawn(Engine::new(scripted, config()).unwrap()).unwrap();
    let client = thread.client();
    let handle = client.submit(Request::greedy(prompt(4, 0), 2)).unwrap();
    assert!(matches!(
        handle.wait(),
        Err(ServeError::Device {
            during: "ReleaseSeq",
            ..
        })
    ));
    // Generous: the engine retries every few milliseconds; only a stuck orphan takes this long.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let stats = loop {
        let stats = client.stats().unwrap();
        if stats.orphans == 0 || std::time::Instant::now() > deadline {
            break stats;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(stats.orphans, 0, "{stats:?}");
    assert_eq!(stats.facts, idle_facts(&router(64, 8)));
    assert_eq!(stats.metrics.orphaned_sequences, 1);
    thread.shutdown(ShutdownMode::Drain).unwrap();
}

/// A dry pool preempts a victim whose release the router refuses twice: the victim fails (the
/// fault hit it) and becomes an orphan that still holds its blocks. The engine must retry that
/// release before it concludes that the request left alone cannot fit: that request is a
/// bystander and completes.
#[test]
fn a_victims_failed_release_does_not_fail_the_request_left_alone() {
    // 4 blocks of 4 tokens, 2 slots: a and b (4-token prompts, 12 tokens each) fit at first and
    // outgrow the pool together while decoding; b, the later arrival, is the victim.
    let mut engine = Engine::new(router(4, 2), config()).unwrap();
    let a = engine.submit(Request::greedy(prompt(4, 0), 12)).unwrap();
    let b = engine.submit(Request::greedy(prompt(4, 1), 12)).unwrap();
    for _ in 0..2 {
        engine
            .router()
            .inject(FaultAt::Effect("ReleaseSeq"), injected());
    }
    engine.run_until_idle();
    assert!(
        matches!(
            b.wait(),
            Err(ServeError::Device {
                during: "ReleaseSeq",
                ..
            })
        ),
        "b was the victim whose release failed"
    );
    let a_id = a.id();
    assert_eq!(
        a.wait().map(|c| c.tokens),
        Ok(expected(engine.router(), a_id, 4, 12))
    );
    let metrics = engine.metrics();
    assert_eq!(
        (
            metrics.preemptions,
            metrics.orphaned_sequences,
            metrics.failed
        ),
        (1, 1, 1)
    );
    assert_eq!(engine.orphans_len(), 0);
    assert_eq!(engine.router().facts(), idle_facts(engine.router()));
}
