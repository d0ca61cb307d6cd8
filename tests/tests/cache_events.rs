//! The prefix cache's events through the engine, on the host router: multi-turn conversations
//! (three tenants, two of them salted, sharing a system prompt, in a pool small enough that the
//! cache evicts) on a hybrid model (the Marconi tree) and an attention-only one (the hash chain),
//! at depth 1 and 2. After every step, a subscriber's reconstruction (keys stored minus removed,
//! `AllBlocksCleared` removing all) equals the router's actual contents, key for key with parent,
//! tokens and namespace; no event is duplicated or lost (a second store of a key, or a removal of
//! an absent key, fails at once); every key is the hash chain of its block's whole prefix in its
//! namespace, on both indexes. A subscriber that joins late starts from the true contents and
//! stays exact. A subscriber that never reads is cut off at its backlog and counted, one that
//! drops its receiver is forgotten, and neither changes a single output token.

use std::collections::HashMap;
use std::num::NonZeroUsize;

use crossbeam_channel::{Receiver, TryRecvError};
use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_io::{BlockKey, CacheEvent, DeviceIo};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Request};

const BLOCK: usize = 4;

fn hybrid() -> Model {
    Model::random(Config::tiny_demo(), 31).unwrap()
}

fn attention_only() -> Model {
    tests::models::attention_only(32)
}

/// What a stored key stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    parent: Option<BlockKey>,
    tokens: Vec<u32>,
    lora_adapter: Option<u32>,
    cache_salt: Option<u64>,
}

/// A subscriber's view: the keys stored and not removed.
#[derive(Debug, Default)]
struct View {
    blocks: HashMap<BlockKey, Block>,
    events: usize,
    removed: usize,
    cleared: usize,
}

impl View {
    /// Applies every event received so far; answers whether the stream has ended.
    fn drain(&mut self, events: &Receiver<CacheEvent>) -> bool {
        loop {
            match events.try_recv() {
                Ok(event) => self.apply(event),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => return true,
            }
        }
    }

    fn apply(&mut self, event: CacheEvent) {
        self.events += 1;
        match event {
            CacheEvent::BlockStored {
                key,
                parent,
                tokens,
                lora_adapter,
                cache_salt,
            } => {
                if let Some(parent) = parent {
                    assert!(
                        self.blocks.contains_key(&parent),
                        "{key}: parent {parent} not stored"
                    );
                }
                let block = Block {
                    parent,
                    tokens,
                    lora_adapter,
                    cache_salt,
                };
                let earlier = self.blocks.insert(key, block);
                assert!(earlier.is_none(), "{key} stored twice");
            }
            CacheEvent::BlockRemoved { key } => {
                assert!(
                    self.blocks.remove(&key).is_some(),
                    "{key} removed but not stored"
                );
                self.removed += 1;
            }
            CacheEvent::AllBlocksCleared => {
                self.blocks.clear();
                self.cleared += 1;
            }
        }
    }

    /// The router's contents, as a view.
    fn of(router: &CpuRouter) -> View {
        let mut view = View::default();
        for event in router.cache_contents().unwrap() {
            view.apply(event);
        }
        view
    }

    /// The whole token prefix a stored key covers.
    fn prefix(&self, key: BlockKey) -> Vec<u32> {
        let block = &self.blocks[&key];
        let mut tokens = block.parent.map_or_else(Vec::new, |p| self.prefix(p));
        tokens.extend_from_slice(&block.tokens);
        tokens
    }
}

/// Checks `view` against the router: the same keys with the same contents, as many as the
/// router reports cached, each key the chain of its prefix.
fn check(view: &View, router: &CpuRouter, at: &str) {
    let actual = View::of(router);
    assert_eq!(view.blocks, actual.blocks, "{at}");
    assert_eq!(view.blocks.len(), router.facts().kv_blocks_cached, "{at}");
    for (&key, block) in &view.blocks {
        assert_eq!(block.tokens.len(), router.facts().block_size, "{at}");
        let prefix = view.prefix(key);
        let keys = router
            .block_keys(block.lora_adapter, block.cache_salt, &prefix)
            .unwrap();
        assert_eq!(
            keys.last(),
            Some(&key),
            "{at}: {key} is not its prefix's chain key"
        );
    }
}

fn system_prompt() -> Vec<u32> {
    (0..10).map(|i| (i * 13 + 5) % 200 + 1).collect()
}

fn message(session: usize, turn: usize) -> Vec<u32> {
    let len = 3 + (session + 2 * turn) % 5;
    (0..len as u32)
        .map(|i| (i * 31 + session as u32 * 71 + turn as u32 * 17 + 3) % 200 + 1)
        .collect()
}

/// The tenant of a session: sessions 0 and 3 unsalted, 1 and 4 salt 7, 2 salt 9.
fn salt(session: usize) -> Option<u64> {
    match session % 3 {
        0 => None,
        1 => Some(7),
        _ => Some(9),
    }
}

struct Run {
    /// Every turn's output tokens, in order.
    outputs: Vec<Vec<u32>>,
    /// Events the main subscriber received, and clears among them.
    events: usize,
    removed: usize,
    cleared: usize,
    lags: u64,
}

/// Which extra subscribers a run has.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Extras {
    None,
    /// One that never reads (backlog 2) and one that drops its receiver at once.
    SlowAndDropped,
}

/// Four rounds of five concurrent conversations; the prefix cache is cleared after round 2 (at idle)
/// and during round 3 (with sequences running). The
/// main subscriber joins before the first request; a second one joins after round 1.
fn converse(model: &Model, depth: usize, extras: Extras) -> Run {
    let config = CpuRouterConfig {
        block_size: BLOCK,
        num_blocks: 56,
        max_seqs: 4,
        checkpoints: CheckpointBudget::Slots(6),
        snapshot_slots: 1,
        prefix_cache: true,
        marconi: true,
        max_context: Some(96),
        max_depth: depth,
        threads: device_cpu::default_threads(),
        expert_workers: 0,
        lora_slots: 0,
    };
    let router = CpuRouter::new(model.clone(), config).unwrap();
    let engine_config = EngineConfig {
        max_running: 4,
        max_step_tokens: 32,
        max_prefill_chunk: 12,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, engine_config).unwrap();
    let events = engine.subscribe_cache_events().unwrap();
    let mut view = View::default();
    let mut slow = None;
    if extras == Extras::SlowAndDropped {
        slow = Some(
            engine
                .subscribe_cache_events_with_backlog(NonZeroUsize::new(2).unwrap())
                .unwrap(),
        );
        drop(engine.subscribe_cache_events().unwrap());
    }
    let mut late: Option<(Receiver<CacheEvent>, View)> = None;
    let sessions = 5;
    let mut histories: Vec<Vec<u32>> = vec![system_prompt(); sessions];
    let mut outputs = Vec::new();
    for round in 0..4 {
        let mut handles = Vec::new();
        for (session, history) in histories.iter_mut().enumerate() {
            history.extend(message(session, round));
            let mut request = Request::greedy(history.clone(), 4 + (session + round) % 4);
            if let Some(salt) = salt(session) {
                request = request.with_cache_salt(salt);
            }
            handles.push(engine.submit(request).unwrap());
        }
        let mut steps = 0;
        while !engine.is_idle() {
            engine.step();
            steps += 1;
            if round == 2 && steps == 3 {
                // With sequences running: the hash chain drops every key (held blocks come back
                // when their sequences finish), the Marconi tree keeps the running paths.
                engine.clear_prefix_cache().unwrap();
            }
            let at = format!(
                "depth {depth}, round {round}, step {}",
                engine.metrics().steps
            );
            assert!(!view.drain(&events), "{at}: the stream ended");
            check(&view, engine.router(), &at);
            if let Some((late_events, late_view)) = &mut late {
                assert!(!late_view.drain(late_events), "{at}: the late stream ended");
                check(
                    late_view,
                    engine.router(),
                    &format!("{at}, late subscriber"),
                );
            }
        }
        for (session, handle) in handles.into_iter().enumerate() {
            let done = handle.wait().unwrap();
            histories[session].extend(&done.tokens);
            outputs.push(done.tokens);
        }
        if round == 0 {
            let late_events = engine.subscribe_cache_events().unwrap();
            let mut late_view = View::default();
            late_view.drain(&late_events);
            check(&late_view, engine.router(), "late subscriber's start");
            late = Some((late_events, late_view));
        }
        if round == 1 {
            engine.clear_prefix_cache().unwrap();
            view.drain(&events);
            check(&view, engine.router(), "after the clear");
        }
    }
    if let Some(slow) = slow {
        // Cut off: at most its backlog, then the end of the stream.
        let mut got = 0;
        while let Ok(event) = slow.try_recv() {
            assert!(matches!(event, CacheEvent::BlockStored { .. }));
            got += 1;
        }
        assert_eq!(got, 2);
        assert_eq!(slow.try_recv(), Err(TryRecvError::Disconnected));
    }
    let lags = engine.stats().metrics.cache_event_lags;
    Run {
        outputs,
        events: view.events,
        removed: view.removed,
        cleared: view.cleared,
        lags,
    }
}

#[test]
fn a_subscriber_sees_exactly_what_the_cache_holds() {
    for (name, model) in [("hybrid", hybrid()), ("attention-only", attention_only())] {
        for depth in [1, 2] {
            let run = converse(&model, depth, Extras::None);
            // The pool is small: blocks were stored, evicted and cleared, not just stored.
            assert!(run.removed > 0, "{name} depth {depth}: nothing evicted");
            assert!(run.cleared >= 1, "{name} depth {depth}");
            assert_eq!(run.lags, 0, "{name} depth {depth}");
        }
    }
}

/// The engine side of a subscription does not depend on the router's index: one model serves.
#[test]
fn slow_and_dropped_subscribers_change_nothing() {
    let model = hybrid();
    let plain = converse(&model, 1, Extras::None);
    let extras = converse(&model, 1, Extras::SlowAndDropped);
    assert_eq!(extras.outputs, plain.outputs);
    assert_eq!(extras.events, plain.events);
    assert_eq!(extras.lags, 1);
}

/// The tracing decorator forwards a subscription and records no line for it (a monitor that
/// subscribes must not change a golden trace); the stream carries the prompt's full blocks.
#[test]
fn a_traced_router_forwards_subscriptions_silently() {
    use device_cpu::CpuSeq;
    use device_io::testing::{release, seq};
    use device_io::{Readback, StepPlan};
    use device_trace::{TraceSink, TracingDeviceIo};

    let router = CpuRouter::new(attention_only(), CpuRouterConfig::new(16, 2)).unwrap();
    let (sink, buffer) = TraceSink::memory();
    let traced = TracingDeviceIo::new(router, sink);
    let (events_sink, events) = scheduler_sink();
    traced.subscribe_cache_events(events_sink).unwrap();
    assert!(buffer.lines().is_empty());
    let prompt: Vec<u32> = (1..=40).collect();
    let mut a: CpuSeq = seq(1, &prompt);
    let plan = StepPlan::Prefill {
        budgets: &[64],
        readback: Readback::Argmax,
    };
    let ticket = traced.launch(plan, &mut [&mut a]).unwrap();
    traced.await_result(ticket).unwrap();
    release(&traced, &mut a, true);
    let mut view = View::default();
    view.drain(&events);
    assert_eq!(view.blocks.len(), 40 / 16);
    check(&view, traced.inner(), "traced");
}

/// A subscription the way the engine makes one, for a router driven directly.
fn scheduler_sink() -> (Box<dyn device_io::CacheEventSink>, Receiver<CacheEvent>) {
    struct Forward(crossbeam_channel::Sender<CacheEvent>);
    impl device_io::CacheEventSink for Forward {
        fn deliver(&mut self, event: CacheEvent) -> bool {
            self.0.send(event).is_ok()
        }
    }
    let (sender, receiver) = crossbeam_channel::unbounded();
    (Box::new(Forward(sender)), receiver)
}

/// A router without cache events (the scripted one) refuses a subscription with a typed error
/// through the client, and the engine goes on.
#[test]
fn a_router_without_events_refuses_with_a_typed_error() {
    use device_io::testing::{ScriptedConfig, ScriptedRouter};
    use device_io::DeviceError;
    use scheduler::{ControlError, EngineThread, ShutdownMode};

    let router = ScriptedRouter::new(ScriptedConfig::default());
    let engine = Engine::new(router, EngineConfig::default()).unwrap();
    let thread = EngineThread::spawn(engine).unwrap();
    let client = thread.client();
    assert_eq!(
        client.subscribe_cache_events().unwrap_err(),
        ControlError::Router(DeviceError::Unsupported {
            what: "subscribe_cache_events"
        })
    );
    assert!(client.stats().is_ok());
    thread.shutdown(ShutdownMode::Drain).unwrap();
}
