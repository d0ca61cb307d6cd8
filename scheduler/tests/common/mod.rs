//! What the engine's tests against `device_io::testing::ScriptedRouter` share: the router and
//! engine configuration most of them use, prompts, and the exact answers the scripted router
//! gives (its tokens, its facts when idle).

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use device_io::testing::{ScriptedConfig, ScriptedRouter};
use device_io::{DeviceFacts, DeviceIo};
use scheduler::EngineConfig;

/// A scripted router of blocks of 4 tokens and a vocabulary of 1000 at `max_depth`.
pub fn router_at_depth(max_depth: usize, num_blocks: usize, num_slots: usize) -> ScriptedRouter {
    ScriptedRouter::new(ScriptedConfig {
        block_size: 4,
        num_blocks,
        num_slots,
        vocab_size: 1000,
        max_depth,
    })
}

/// The scripted router at depth 1.
pub fn router(num_blocks: usize, num_slots: usize) -> ScriptedRouter {
    router_at_depth(1, num_blocks, num_slots)
}

/// Up to 8 sequences, 64 tokens a step, prefill chunks of 16.
pub fn config() -> EngineConfig {
    EngineConfig {
        max_running: 8,
        max_step_tokens: 64,
        max_prefill_chunk: 16,
        ..EngineConfig::default()
    }
}

/// `len` tokens of the vocabulary, different for each `salt`.
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + salt) % 1000).collect()
}

/// The tokens the scripted router answers for request `id` with a prompt of `prompt` tokens.
pub fn expected(router: &ScriptedRouter, id: u64, prompt: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| router.fallback_token(id, prompt + i))
        .collect()
}

/// `router`'s facts with every block free and no slot used: what it reports once every sequence
/// has been released.
pub fn idle_facts(router: &ScriptedRouter) -> DeviceFacts {
    let facts = router.facts();
    DeviceFacts {
        kv_blocks_free: facts.kv_blocks_total,
        live_slots_used: 0,
        ..facts
    }
}
