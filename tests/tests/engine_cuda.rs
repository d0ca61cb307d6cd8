//! The engine on the CUDA router (on `SimRuntime`), generic over `DeviceIo` as on the host
//! router: greedy requests sharing a 40-token opener, with the prefix cache and Marconi
//! checkpoints on and off (prefix hits restoring the checkpoint on the device), at pipeline depth
//! 1 and 2 (fed decode steps), with slot compaction, in a pool that holds one of them at a time,
//! and in one where the engine spills a sequence mid-decode and restores it, give the host
//! router's tokens, each path counted exactly; speculative decoding (drafters in the core, and
//! the MTP head's drafts on the device) gives plain decoding's bits.
//!
//! Against the host router: tokens (the device's forward is within 1e-4 of the host's, not the
//! same bits; `cuda_steps.rs` bounds the logits). Among the CUDA router's own runs: tokens and
//! logits digests, bit for bit, since the device forward computes every position the same way
//! however the work is cut (prefix hits, chunking, decode rows; issue 18).

use device_cpu::{CpuRouter, CpuRouterConfig};
use device_cuda::{CudaRouter, CudaRouterConfig, DType};
use device_io::testing::assert_nothing_held;
use device_io::DeviceIo;
use model::{Config, Model};
use router_book::CacheStats;
use scheduler::{
    Drafter, Engine, EngineConfig, LoraAck, LoraCommand, Metrics, Preemption, Request,
    ShutdownMode, SpecOverlap, Speculation, SpillTarget,
};
use tests::cuda_sim;

const CONTEXT: usize = 96;

fn model() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| Model::random(Config::tiny_demo(), 7).unwrap())
}

/// Three prompts: one 40-token opener, then tails of 5, 9 and 13 tokens.
fn prompts() -> Vec<Vec<u32>> {
    let opener: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 256).collect();
    [5u32, 9, 13]
        .iter()
        .map(|&tail| {
            let mut p = opener.clone();
            p.extend((0..tail).map(|i| (i * 31 + tail * 7) % 256));
            p
        })
        .collect()
}

/// A CUDA router (f32 weights, 2 slots) with `blocks` more KV blocks' worth of budget than the
/// smallest that holds one sequence of the context.
fn cuda(caches: bool, depth: usize, blocks: u64) -> CudaRouter {
    cuda_for(model(), caches, depth, blocks)
}

/// [`cuda`] for `model`.
fn cuda_for(model: &Model, caches: bool, depth: usize, blocks: u64) -> CudaRouter {
    let config = |budget| CudaRouterConfig {
        weights: DType::F32,
        max_step_tokens: 48,
        prefix_cache: caches,
        marconi: caches,
        max_depth: depth,
        ..CudaRouterConfig::new(budget, 2, CONTEXT)
    };
    let smallest = cuda_sim::smallest(model, config);
    let budget = smallest.router_config().budget_bytes;
    let kv = smallest.plan().kv_block_bytes;
    Box::new(smallest).teardown().unwrap();
    CudaRouter::sim(model, config(budget + blocks * kv * 4 / 3)).unwrap()
}

/// The prompts' greedy tokens (8 each, all submitted at once, then the first again), their
/// logits digests and the engine's metrics.
fn generate<D>(router: D) -> (Vec<Vec<u32>>, Vec<Option<u64>>, Metrics)
where
    D: DeviceIo<Seq = router_book::RouterSeq, LoraCmd = LoraCommand, LoraAck = LoraAck>,
{
    generate_with(router, None)
}

/// [`generate`] with speculative decoding as `speculation` says.
fn generate_with<D>(
    router: D,
    speculation: Option<Speculation>,
) -> (Vec<Vec<u32>>, Vec<Option<u64>>, Metrics)
where
    D: DeviceIo<Seq = router_book::RouterSeq, LoraCmd = LoraCommand, LoraAck = LoraAck>,
{
    let mut prompts = prompts();
    prompts.push(prompts[0].clone());
    let (tokens, digests, metrics, ()) = generate_prompts(router, speculation, &prompts, |_| ());
    (tokens, digests, metrics)
}

/// [`generate`] on the CUDA router, with its prefix-cache counters at the end.
fn generate_cuda(router: CudaRouter) -> (Vec<Vec<u32>>, Vec<Option<u64>>, Metrics, CacheStats) {
    let mut prompts = prompts();
    prompts.push(prompts[0].clone());
    generate_prompts(router, None, &prompts, |router| {
        router.cache_stats().unwrap()
    })
}

/// Each prompt's greedy tokens (8 each, all submitted at once), with `speculation`; `probe`
/// looks at the router once the engine is idle.
fn generate_prompts<D, T>(
    router: D,
    speculation: Option<Speculation>,
    prompts: &[Vec<u32>],
    probe: impl FnOnce(&D) -> T,
) -> (Vec<Vec<u32>>, Vec<Option<u64>>, Metrics, T)
where
    D: DeviceIo<Seq = router_book::RouterSeq, LoraCmd = LoraCommand, LoraAck = LoraAck>,
{
    let config = EngineConfig {
        max_running: 2,
        max_step_tokens: 48,
        max_prefill_chunk: 32,
        preemption: Preemption::Spill(SpillTarget::Memory),
        speculation,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut request = Request::greedy(p.clone(), 8);
            request.logits_digest = true;
            engine.submit(request).unwrap()
        })
        .collect();
    engine.run_until_idle();
    let (tokens, digests) = handles
        .into_iter()
        .map(|handle| {
            let done = handle.wait().unwrap();
            (done.tokens, done.logits_digest)
        })
        .unzip();
    let metrics = *engine.metrics();
    let probed = probe(engine.router());
    assert_nothing_held(engine.router());
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (tokens, digests, metrics, probed)
}

#[test]
fn the_engine_on_the_cuda_router_gives_the_host_routers_tokens() {
    let mut host_config = CpuRouterConfig::new(48, 2);
    host_config.max_context = Some(CONTEXT);
    host_config.prefix_cache = false;
    host_config.marconi = false;
    host_config.threads = 1;
    let (reference, _, _) = generate(CpuRouter::new(model().clone(), host_config).unwrap());
    let (cold, cold_digests, metrics, _) = generate_cuda(cuda(false, 1, 32));
    assert_eq!(metrics.prefill_tokens_cached, 0);
    assert_eq!(cold, reference, "caches off, depth 1");
    assert!(cold_digests.iter().all(Option::is_some));
    // A sequence finishing in slot 0 moves the other one down (three times over the run).
    assert_eq!(metrics.compactions, 3, "{metrics:?}");
    // Caches on and off, depth 1 and 2: the same bits (prefix hits start prefill runs mid-prompt,
    // restoring the Marconi checkpoint there on the device).
    for (caches, depth) in [(true, 2), (false, 2)] {
        let (tokens, digests, metrics, stats) = generate_cuda(cuda(caches, depth, 32));
        let label = format!("caches {caches}, depth {depth}");
        // With the caches on, the second wave's two requests each hit the 32-token prefix
        // (two blocks) and restore the Marconi checkpoint at its end on the device.
        let hits = if caches { 2 } else { 0 };
        assert_eq!(metrics.prefix_hits, hits, "{label}: {metrics:?}");
        assert_eq!(
            metrics.prefill_tokens_cached,
            32 * hits,
            "{label}: {metrics:?}"
        );
        assert_eq!(stats.checkpoint_hits, hits, "{label}: {stats:?}");
        assert_eq!(metrics.fed_launches > 0, depth == 2, "{label}: {metrics:?}");
        assert_eq!(tokens, reference, "{label}");
        assert_eq!(digests, cold_digests, "{label}: logits digests");
    }
    // Two sequences of up to 61 tokens (4 blocks each) do not fit in the smallest pool (the
    // blocks of one sequence of the context, 6): the engine runs them one at a time.
    let (tight, digests, metrics, _) = generate_cuda(cuda(true, 2, 0));
    assert_eq!(metrics.decode_rows, metrics.decode_launches, "{metrics:?}");
    assert_eq!(tight, reference, "a pool for one sequence");
    assert_eq!(
        digests, cold_digests,
        "a pool for one sequence: logits digests"
    );
    // One more block: two sequences are admitted, and twice one is spilled when the pool runs
    // dry mid-decode, then restored from its image.
    let (spilled, digests, metrics, _) = generate_cuda(cuda(true, 2, 1));
    assert_eq!(
        (metrics.preemptions, metrics.spills, metrics.restores),
        (2, 2, 2),
        "{metrics:?}"
    );
    assert_eq!(spilled, reference, "spill and restore");
    assert_eq!(digests, cold_digests, "spill and restore: logits digests");
}

/// The backend builds the same engine for `Device::CudaSim` as for the host router, with the
/// pool sizes asked for (KV blocks, checkpoint, live and ring slots: on the CUDA router a byte
/// budget that holds them and exactly them), and both give the same greedy tokens.
#[test]
fn the_backend_builds_the_engine_on_the_cuda_router() {
    use scheduler::backend::{self, BackendOptions, Device};
    let mut outputs = Vec::new();
    for device in [Device::Cpu, Device::CudaSim] {
        let options = BackendOptions {
            device,
            max_context: Some(CONTEXT),
            threads: 1,
            checkpoint_slots: 5,
            snapshot_slots: 3,
            ..BackendOptions::new(24, 2)
        };
        let mut engine =
            backend::build_engine(model().clone(), options, EngineConfig::default()).unwrap();
        assert!(backend::is_hybrid(engine.router()));
        let facts = engine.router().facts();
        assert_eq!(
            (
                facts.kv_blocks_total,
                facts.checkpoint_slots_total,
                facts.live_slots_total,
                facts.snapshot_slots_total
            ),
            (24, 5, 2, 3),
            "{device:?}"
        );
        let handle = engine
            .submit(Request::greedy(prompts()[0].clone(), 6))
            .unwrap();
        engine.run_until_idle();
        outputs.push(handle.wait().unwrap().tokens);
        let stats = backend::cache_stats(engine.router()).unwrap();
        assert_eq!(stats.lookups, 1);
        engine.shutdown(ShutdownMode::Drain).unwrap();
    }
    assert_eq!(outputs[0], outputs[1]);
}

/// Speculative decoding on the CUDA router (`Verify` with the Mamba state after each draft
/// written to the ring on the device, `TruncateKv` and `SsmSnapshotRestore` after acceptance),
/// with drafters that do not depend on an MTP head: a perfect one (the plain run's
/// continuations) with the caches off at depth 1, and an adversarial one (always wrong) with the
/// caches on at depth 2 (prefix hits; cohorts, one verifying while the other settles), k = 3:
/// the tokens and logits digests of plain decoding on the same router, every block and slot
/// back (`generate` checks).
#[test]
fn speculation_on_the_cuda_router_gives_plain_decodings_bits() {
    let (plain, plain_digests, _) = generate(cuda(false, 1, 32));
    let mut prompts = prompts();
    prompts.push(prompts[0].clone());
    let known: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&plain)
        .map(|(prompt, out)| prompt.iter().chain(out).copied().collect())
        .collect();
    let known = std::sync::Arc::new(known);
    for (wrong, caches, depth) in [(false, false, 1), (true, true, 2)] {
        let speculation = Speculation {
            k: 3,
            drafter: Drafter::Known {
                sequences: std::sync::Arc::clone(&known),
                wrong,
            },
            // The CUDA router does not compute on the host's cores: cohorts at depth 2.
            overlap: SpecOverlap::Auto,
        };
        let label = format!("wrong {wrong}, caches {caches}, depth {depth}");
        let (tokens, digests, m) = generate_with(cuda(caches, depth, 32), Some(speculation));
        assert_eq!(tokens, plain, "{label}");
        assert_eq!(digests, plain_digests, "{label}: logits digests");
        assert!(m.verify_launches > 0 && m.drafted > 0, "{label}: {m:?}");
        if wrong {
            assert_eq!(m.accepted, 0, "{label}: {m:?}");
            assert_eq!(m.spec_rollbacks, m.spec_rows, "{label}: {m:?}");
        } else {
            assert_eq!(m.accepted, m.drafted, "{label}: {m:?}");
            assert_eq!(m.spec_rollbacks, 0, "{label}: {m:?}");
        }
        assert_eq!(m.spec_tokens, m.spec_rows + m.accepted, "{label}: {m:?}");
        // The paths the label names were taken: prefix hits, and cohorts in flight at depth 2.
        assert_eq!(m.prefix_hits > 0, caches, "{label}: {m:?}");
        assert_eq!(m.spec_flights > 0, depth == 2, "{label}: {m:?}");
    }
}

/// Speculative decoding with the MTP head on the CUDA router (`Draft` on the device: the
/// catch-up rings kept by the prefills and `SaveHiddenCatchup`, the drafts fed on the device),
/// on the tiny MTP fixture: k = 2 with the caches off at depth 1, k = 3 with the caches on at
/// depth 2 (cohorts, each drafting while the other's verification settles): the tokens and
/// logits digests of plain decoding on the same router.
#[test]
fn mtp_speculation_on_the_cuda_router_gives_plain_decodings_bits() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny/mtp");
    let model = Model::load(&dir.join("model")).unwrap();
    let prompts = model::parity::prompts(&dir).unwrap()[1..4].to_vec();
    let (plain, plain_digests, _, ()) =
        generate_prompts(cuda_for(&model, false, 1, 32), None, &prompts, |_| ());
    for (k, caches, depth) in [(2, false, 1), (3, true, 2)] {
        let label = format!("k {k}, caches {caches}, depth {depth}");
        let (tokens, digests, m, ()) = generate_prompts(
            cuda_for(&model, caches, depth, 32),
            Some(Speculation::mtp(k)),
            &prompts,
            |_| (),
        );
        assert_eq!(tokens, plain, "{label}");
        assert_eq!(digests, plain_digests, "{label}: logits digests");
        assert!(m.draft_launches > 0 && m.drafted > 0, "{label}: {m:?}");
        assert_eq!(m.draft_failures, 0, "{label}: {m:?}");
        assert_eq!(m.spec_tokens, m.spec_rows + m.accepted, "{label}: {m:?}");
        eprintln!(
            "{label}: drafted {}, accepted {}, verify launches {}",
            m.drafted, m.accepted, m.verify_launches
        );
    }
}

/// A finished turn: its greedy tokens and logits digest.
type Turn = (Vec<u32>, Option<u64>);

/// Turns of `(prompt, max_tokens)` on one engine, each submitted once the one before has
/// finished: each turn's greedy tokens and logits digest, and the engine's metrics.
fn turns(
    router: CudaRouter,
    turns: &[(&[u32], usize)],
    speculation: Option<Speculation>,
) -> (Vec<Turn>, Metrics) {
    let config = EngineConfig {
        max_running: 2,
        max_step_tokens: 48,
        max_prefill_chunk: 32,
        speculation,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    let outputs = turns
        .iter()
        .map(|&(prompt, max_tokens)| {
            let mut request = Request::greedy(prompt.to_vec(), max_tokens);
            request.logits_digest = true;
            let handle = engine.submit(request).unwrap();
            engine.run_until_idle();
            let done = handle.wait().unwrap();
            (done.tokens, done.logits_digest)
        })
        .collect();
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (outputs, metrics)
}

/// A block boundary that a `Verify` run carried the sequence past is checkpointed from the
/// snapshot the run wrote for it (`MarconiCheckpoint` takes the main layers from the ring): a
/// follow-up turn gets as many prompt tokens from the caches as after plain decoding. Before the
/// CUDA router took such boundaries, speculation left them out and the follow-up got fewer.
#[test]
fn a_boundary_inside_a_verify_run_is_checkpointed_on_the_cuda_router() {
    let first = prompts()[0].clone();
    let (plain_first, _) = turns(cuda(true, 1, 32), &[(&first, 30)], None);
    let first_full: Vec<u32> = first.iter().chain(&plain_first[0].0).copied().collect();
    let follow: Vec<u32> = first_full.iter().chain(&[3, 1, 4]).copied().collect();
    let both: &[(&[u32], usize)] = &[(&first, 30), (&follow, 4)];
    let (plain, plain_m) = turns(cuda(true, 1, 32), both, None);
    let follow_full: Vec<u32> = follow.iter().chain(&plain[1].0).copied().collect();
    let perfect = Speculation {
        k: 3,
        drafter: Drafter::Known {
            sequences: std::sync::Arc::new(vec![first_full, follow_full]),
            wrong: false,
        },
        overlap: SpecOverlap::Auto,
    };
    let (spec, m) = turns(cuda(true, 1, 32), both, Some(perfect));
    assert_eq!(spec, plain);
    assert_eq!(m.accepted, m.drafted, "{m:?}");
    assert!(m.verify_launches > 0, "{m:?}");
    // The follow-up hits a checkpoint past the first prompt's prefill (decode checkpoints).
    assert!(
        plain_m.prefill_tokens_cached > first.len() as u64,
        "{plain_m:?}"
    );
    assert_eq!(
        m.prefill_tokens_cached, plain_m.prefill_tokens_cached,
        "{m:?}"
    );
    assert_eq!(m.marconi_checkpoints, plain_m.marconi_checkpoints, "{m:?}");
}
