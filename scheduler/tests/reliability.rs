//! The engine's rare paths against `device_io::testing::ScriptedRouter`: a release the router
//! refuses twice, a submit racing a shutdown, a router call that panics, a lost device. In every
//! case a failure costs the requests it hit and nothing else, and every accepted request gets
//! exactly one final event.

use device_io::testing::{FaultAt, ScriptedConfig, ScriptedRouter};
use device_io::{DeviceError, DeviceFacts, DeviceIo, Phase};
use scheduler::{Engine, EngineConfig, Request, ServeError};

fn router(num_blocks: usize, num_slots: usize) -> ScriptedRouter {
    ScriptedRouter::new(ScriptedConfig {
        block_size: 4,
        num_blocks,
        num_slots,
        vocab_size: 1000,
        max_depth: 1,
    })
}

fn config() -> EngineConfig {
    EngineConfig {
        max_running: 8,
        max_step_tokens: 64,
        max_prefill_chunk: 16,
        ..EngineConfig::default()
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + salt) % 1000).collect()
}

/// The tokens the scripted router answers for request `id` with a prompt of `prompt` tokens.
fn expected(router: &ScriptedRouter, id: u64, prompt: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| router.fallback_token(id, prompt + i))
        .collect()
}

fn idle_facts(router: &ScriptedRouter) -> DeviceFacts {
    let facts = router.facts();
    DeviceFacts {
        kv_blocks_free: facts.kv_blocks_total,
        live_slots_used: 0,
        ..facts
    }
}

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
