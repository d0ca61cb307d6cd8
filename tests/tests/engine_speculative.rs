//! Speculative decoding through the engine on the host router, on both MTP fixtures
//! (`nemotron-h-tiny/mtp`, `nemotron-h-alt/mtp`): every request's tokens and logits digest (the
//! xxh3 of the bits of every logits row it emitted from) are the same with speculation off and
//! on, for k = 1..4, with the caches off and on (in CI each k once, k = 1 and 3 with the caches
//! off, 2 and 4 on; `SPECULATION_FULL=1 cargo test -p tests --test engine_speculative` runs the
//! whole matrix); with the MTP head's drafts, a perfect and an
//! adversarial drafter (and a stop token inside an accepted run); in batches mixing greedy, sampled and forced rows; when a tight pool
//! preempts mid-speculation (by spill and by recompute) and when a request is cancelled
//! mid-run; and on a pipelined router (depth 2), where one cohort's verification computes while
//! the other's settles, with preemption and a cancel while a verification is in flight (and at
//! depth 1 there, the host router's default). Every block and slot is back at the end. Draft
//! quality: the MTP head's drafts survive a dry pool at a cohort's launch, and a block boundary
//! inside a kept run is checkpointed as plain decoding does it. A prefix hit on a pool of exactly
//! one longest sequence is served as a cold run (the head's rerun copies only where the pool
//! has room for them). Skipping the SSM restore after a
//! rejected draft, and a ring shared between the cohorts at depth 2 (the planted bugs), are
//! caught.

use std::path::PathBuf;
use std::sync::Arc;

use device_cpu::{CheckpointBudget, CpuRouter, CpuRouterConfig};
use device_io::testing::assert_back_to_initial;
use device_io::DeviceIo;
use model::Model;
use scheduler::{
    Drafter, Engine, EngineConfig, EngineError, Metrics, Preemption, RandomSampling, Request,
    RequestHandle, Sampling, ShutdownMode, SpecFault, SpecOverlap, Speculation, SpillTarget,
};

const BLOCK: usize = 16;
const MAX_TOKENS: usize = 10;

fn mtp_dir(fixture: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(fixture)
        .join("mtp")
}

fn model(fixture: &str) -> Model {
    let model = Model::load(&mtp_dir(fixture).join("model")).unwrap();
    assert!(model.has_mtp());
    model
}

/// The fixture's prompts (the NumPy reference's cases), each a greedy request with a digest,
/// plus a repeat of the longest two (prefix-cache hits when the caches are on).
fn greedy_requests(fixture: &str) -> Vec<Request> {
    let mut prompts = model::parity::prompts(&mtp_dir(fixture)).unwrap();
    let mut longest = prompts.clone();
    longest.sort_by_key(|p| std::cmp::Reverse(p.len()));
    prompts.extend(longest.into_iter().take(2));
    prompts
        .into_iter()
        .map(|p| Request::greedy(p, MAX_TOKENS).with_logits_digest(true))
        .collect()
}

/// [`greedy_requests`] with 30 tokens each, so the rows outgrow a tight pool between flights.
fn long_requests(fixture: &str) -> Vec<Request> {
    greedy_requests(fixture)
        .into_iter()
        .map(|mut r| {
            r.max_tokens = 30;
            r
        })
        .collect()
}

struct Setup {
    caches: bool,
    num_blocks: usize,
    max_running: usize,
    preemption: Preemption,
    speculation: Option<Speculation>,
    fault: Option<SpecFault>,
    depth: usize,
    /// Snapshot ring slots (`None`: four rows' drafts per step).
    ring: Option<usize>,
    /// Steps the router fails at the device.
    step_faults: Option<device_cpu::StepFaults>,
}

impl Setup {
    fn plain() -> Self {
        Setup {
            caches: false,
            num_blocks: 64,
            max_running: 4,
            preemption: Preemption::Recompute,
            speculation: None,
            fault: None,
            depth: 1,
            ring: None,
            step_faults: None,
        }
    }

    fn mtp(k: usize) -> Self {
        Setup {
            speculation: Some(Speculation::mtp(k)),
            ..Setup::plain()
        }
    }
}

type Outcome = Result<(Vec<u32>, Option<u64>), String>;

/// `spec`, run ahead by cohorts on a router of depth 2 (the host router's default is depth 1).
fn cohorts(spec: Speculation) -> Speculation {
    Speculation {
        overlap: SpecOverlap::Cohorts,
        ..spec
    }
}

/// Each request's prompt followed by its output in `outcomes` (which must be `Ok`): what a
/// perfect drafter knows.
fn full_sequences(requests: &[Request], outcomes: &[Outcome]) -> Arc<Vec<Vec<u32>>> {
    let sequences = requests
        .iter()
        .zip(outcomes)
        .map(|(r, out)| {
            r.prompt
                .iter()
                .chain(&out.as_ref().unwrap().0)
                .copied()
                .collect()
        })
        .collect();
    Arc::new(sequences)
}

/// `k` drafts a row from a drafter that knows `sequences` (or, `wrong`, always proposes
/// something else), overlapped as `overlap` says.
fn known_drafter(
    k: usize,
    sequences: &Arc<Vec<Vec<u32>>>,
    wrong: bool,
    overlap: SpecOverlap,
) -> Speculation {
    Speculation {
        k,
        drafter: Drafter::Known {
            sequences: Arc::clone(sequences),
            wrong,
        },
        overlap,
    }
}

fn engine(model: &Model, setup: &Setup) -> Engine<CpuRouter> {
    // The engine reads the ring's size from the router: four rows' drafts per step.
    let ring = (setup.ring).unwrap_or_else(|| setup.speculation.as_ref().map_or(4, |s| 4 * s.k));
    let router_config = CpuRouterConfig {
        block_size: BLOCK,
        num_blocks: setup.num_blocks,
        max_seqs: setup.max_running,
        checkpoints: CheckpointBudget::Slots(16),
        snapshot_slots: ring,
        prefix_cache: setup.caches,
        marconi: setup.caches,
        max_context: Some(8 * BLOCK),
        max_depth: setup.depth,
        threads: 1,
        ..CpuRouterConfig::new(setup.num_blocks, setup.max_running)
    };
    let router = CpuRouter::new(model.clone(), router_config).unwrap();
    if let Some(faults) = &setup.step_faults {
        router.inject_step_faults(faults.clone()).unwrap();
    }
    let config = EngineConfig {
        max_running: setup.max_running,
        max_step_tokens: 64,
        max_prefill_chunk: 32,
        preemption: setup.preemption.clone(),
        speculation: setup.speculation.clone(),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(router, config).unwrap();
    if let Some(fault) = setup.fault {
        engine.inject_spec_fault(fault);
    }
    engine
}

/// Serves `requests` (submitted together, run in arrival order as slots allow); answers each
/// one's tokens and digest, and the engine's metrics; checks every block and slot came back.
fn serve(model: &Model, setup: Setup, requests: &[Request]) -> (Vec<Outcome>, Metrics) {
    serve_waves(model, setup, &[requests])
}

/// Serves each wave of requests until idle, then the next (a later wave finds the earlier
/// ones' prefixes cached).
fn serve_waves(model: &Model, setup: Setup, waves: &[&[Request]]) -> (Vec<Outcome>, Metrics) {
    let mut engine = engine(model, &setup);
    let initial = engine.router().facts();
    let mut handles = Vec::new();
    for wave in waves {
        handles.extend(wave.iter().map(|r| engine.submit(r.clone()).unwrap()));
        engine.run_until_idle();
    }
    let outcomes = handles
        .into_iter()
        .map(|h| {
            h.wait()
                .map(|c| (c.tokens, c.logits_digest))
                .map_err(|e| e.to_string())
        })
        .collect();
    assert_back_to_initial(engine.router(), initial);
    let metrics = *engine.metrics();
    engine.shutdown(ShutdownMode::Drain).unwrap();
    (outcomes, metrics)
}

/// Waits for every request of `handles`: the first, cancelled, ends as such with a prefix of its
/// output in `reference`; every other one gives its output in `reference`.
fn check_first_cancelled(handles: Vec<RequestHandle>, reference: &[Outcome]) {
    for (i, (handle, want)) in handles.into_iter().zip(reference).enumerate() {
        let got = handle.wait();
        if i == 0 {
            let completion = got.unwrap();
            assert_eq!(completion.reason, scheduler::FinishReason::Cancelled);
            let want = &want.as_ref().unwrap().0;
            assert!(want.starts_with(&completion.tokens));
        } else {
            let got = got
                .map(|c| (c.tokens, c.logits_digest))
                .map_err(|e| e.to_string());
            assert_eq!(&got, want, "request {i}");
        }
    }
}

fn check_mtp(fixture: &str) {
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    // The repeats (the last two) come in a second wave, after the first is cached.
    let waves: &[&[Request]] = &[
        &requests[..requests.len() - 2],
        &requests[requests.len() - 2..],
    ];
    let (reference, plain) = serve_waves(&model, Setup::plain(), waves);
    assert!(reference.iter().all(Result::is_ok), "{reference:?}");
    assert_eq!(plain.verify_launches, 0);
    // CI covers every k once per fixture, half with the caches on; `SPECULATION_FULL=1` runs
    // every k with the caches off and on.
    let full = std::env::var_os("SPECULATION_FULL").is_some();
    for caches in [false, true] {
        for k in 1..=4 {
            if !full && (k % 2 == 0) != caches {
                continue;
            }
            let setup = Setup {
                caches,
                ..Setup::mtp(k)
            };
            let (outcomes, m) = serve_waves(&model, setup, waves);
            assert_eq!(outcomes, reference, "{fixture} caches {caches} k {k}");
            assert!(m.draft_launches > 0 && m.drafted > 0, "{m:?}");
            assert!(m.accepted <= m.drafted);
            assert_eq!(m.spec_tokens, m.spec_rows + m.accepted, "{m:?}");
            if caches {
                assert!(m.prefill_tokens_cached > 0, "{m:?}");
            }
        }
    }
}

#[test]
fn mtp_speculation_gives_the_tokens_and_logits_of_plain_greedy_decoding_on_the_tiny_fixture() {
    check_mtp("nemotron-h-tiny");
}

#[test]
fn mtp_speculation_gives_the_tokens_and_logits_of_plain_greedy_decoding_on_the_alt_fixture() {
    check_mtp("nemotron-h-alt");
}

/// A drafter that knows the answer (acceptance 100%: k + 1 tokens per target step, where the
/// remaining output allows) and one that is always wrong (acceptance 0%): both give the output
/// of plain decoding.
#[test]
fn perfect_and_adversarial_drafters_change_nothing_but_the_steps() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let mut requests = greedy_requests(fixture);
    // A request whose stop token comes inside an accepted run of the perfect drafter.
    let (first, _) = serve(&model, Setup::plain(), &requests[..1]);
    let stop = first[0].as_ref().unwrap().0[4];
    let stopped = requests[0].clone().with_stop_tokens(vec![stop]);
    requests.push(stopped);
    let (reference, plain) = serve(&model, Setup::plain(), &requests);
    let stopped_output = &reference.last().unwrap().as_ref().unwrap().0;
    assert!(stopped_output.len() < MAX_TOKENS && stopped_output.last() == Some(&stop));
    let known = full_sequences(&requests[..requests.len() - 1], &reference);
    let k = 3;
    for wrong in [false, true] {
        let setup = Setup {
            speculation: Some(known_drafter(k, &known, wrong, SpecOverlap::Auto)),
            ..Setup::plain()
        };
        let (outcomes, m) = serve(&model, setup, &requests);
        assert_eq!(outcomes, reference, "wrong {wrong}");
        assert!(m.drafted > 0);
        if wrong {
            assert_eq!(m.accepted, 0, "{m:?}");
            assert_eq!(m.spec_tokens, m.spec_rows);
            assert_eq!(m.spec_rollbacks, m.spec_rows);
        } else {
            // Every draft is right; only the run the stop token cut short keeps fewer.
            assert!(m.accepted + k as u64 >= m.drafted, "{m:?}");
            assert!(m.spec_rollbacks <= 1, "{m:?}");
            // Every request's output takes ceil(MAX_TOKENS / (k + 1)) verifications at most
            // after its first token: far fewer decode steps than plain decoding.
            assert!(
                m.decode_launches * 2 < plain.decode_launches,
                "{m:?} vs {plain:?}"
            );
        }
    }
}

/// Greedy rows speculate next to randomly sampled rows (a draft is accepted when the row's own
/// seeded draw at its position equals it: speculative rejection sampling against a greedy
/// drafter) and forced rows (whose drafts are accepted while they equal the forced tokens):
/// every row's tokens and digest are those of plain decoding, the sampled rows' included.
#[test]
fn mixed_batches_keep_every_row_exact() {
    let fixture = "nemotron-h-tiny";
    let model = model(fixture);
    let mut requests = greedy_requests(fixture);
    let sampled = |seed| {
        Request::greedy(vec![3, 1, 4, 1, 5, 9, 2, 6], MAX_TOKENS)
            .with_sampling(Sampling::Random(RandomSampling::new(0.8, seed)))
            .with_logits_digest(true)
    };
    requests.insert(1, sampled(5));
    requests.insert(4, sampled(6));
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let forced_output = reference[0].as_ref().unwrap().0.clone();
    requests.insert(
        2,
        Request::forced(requests[0].prompt.clone(), forced_output.clone()).with_logits_digest(true),
    );
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    assert_eq!(reference[2].as_ref().unwrap().0, forced_output);
    for k in [2, 4] {
        let (outcomes, m) = serve(&model, Setup::mtp(k), &requests);
        assert_eq!(outcomes, reference, "k {k}");
        assert!(m.drafted > 0);
    }
    // Sampled rows alone, with a perfect drafter (the plain run's continuations): their drafts
    // are accepted exactly when the draw agrees, and the output is the plain run's.
    let sampled_only: Vec<Request> = (0..4u32)
        .map(|i| {
            let mut request = sampled(u64::from(i) + 20);
            request.prompt.push(i + 10);
            request
        })
        .collect();
    let (plain_sampled, _) = serve(&model, Setup::plain(), &sampled_only);
    let known = full_sequences(&sampled_only, &plain_sampled);
    let perfect = |fault| Setup {
        speculation: Some(known_drafter(3, &known, false, SpecOverlap::Auto)),
        fault,
        ..Setup::plain()
    };
    let (outcomes, m) = serve(&model, perfect(None), &sampled_only);
    assert_eq!(outcomes, plain_sampled);
    assert!(m.accepted > 0 && m.accepted == m.drafted, "{m:?}");
    // The negative control: trusting a sampled row's draft without its draw (a wrong acceptance
    // rule) changes the output. Drafts always wrong make it visible.
    let wrong = Setup {
        speculation: Some(known_drafter(3, &known, true, SpecOverlap::Auto)),
        fault: Some(SpecFault::TrustSampledDrafts),
        ..Setup::plain()
    };
    let (outcomes, _) = serve(&model, wrong, &sampled_only);
    assert_ne!(outcomes, plain_sampled);
}

/// A pool too small for every request at once preempts mid-speculation, by spill to memory and
/// by recompute: the output is that of plain decoding, and everything comes back.
#[test]
fn preemption_mid_speculation_keeps_the_output() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    for preemption in [
        Preemption::Spill(SpillTarget::Memory),
        Preemption::Recompute,
    ] {
        for caches in [false, true] {
            let setup = Setup {
                caches,
                num_blocks: 9,
                preemption: preemption.clone(),
                ..Setup::mtp(3)
            };
            let (outcomes, m) = serve(&model, setup, &requests);
            assert_eq!(outcomes, reference, "{preemption:?} caches {caches}");
            assert!(m.preemptions > 0, "{preemption:?}: {m:?}");
            assert!(m.drafted > 0);
        }
    }
}

/// On a pipelined router (depth 2) the engine runs ahead by cohorts: one half of the rows
/// drafts and launches its verification while the other half's settles. Tokens and logits
/// digests are those of plain decoding at depth 1, with the MTP head and with the perfect and
/// adversarial drafters, caches off and on, in batches mixing greedy, sampled and forced rows;
/// every block and slot comes back.
#[test]
fn speculation_runs_ahead_on_a_pipelined_router() {
    let fixture = "nemotron-h-tiny";
    let model = model(fixture);
    let mut requests = greedy_requests(fixture);
    requests.insert(
        1,
        Request::greedy(vec![3, 1, 4, 1, 5, 9, 2, 6], MAX_TOKENS)
            .with_sampling(Sampling::Random(RandomSampling::new(0.8, 5)))
            .with_logits_digest(true),
    );
    let (first, _) = serve(&model, Setup::plain(), &requests[..1]);
    let forced_output = first[0].as_ref().unwrap().0.clone();
    requests.insert(
        3,
        Request::forced(requests[0].prompt.clone(), forced_output).with_logits_digest(true),
    );
    // Greedy rows without a digest read the device argmax only (no synchronising host logits).
    requests.push(Request::greedy(requests[0].prompt.clone(), MAX_TOKENS));
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let known = full_sequences(&requests, &reference);
    let cases = [
        ("mtp k 3, caches", cohorts(Speculation::mtp(3)), true),
        (
            "perfect",
            known_drafter(3, &known, false, SpecOverlap::Cohorts),
            false,
        ),
        (
            "adversarial, caches",
            known_drafter(3, &known, true, SpecOverlap::Cohorts),
            true,
        ),
    ];
    for (name, speculation, caches) in cases {
        let setup = Setup {
            depth: 2,
            caches,
            speculation: Some(speculation),
            ..Setup::plain()
        };
        let (outcomes, m) = serve(&model, setup, &requests);
        assert_eq!(outcomes, reference, "{name}");
        assert!(m.spec_flights > 0 && m.drafted > 0, "{name}: {m:?}");
        assert_eq!(m.fed_launches, 0);
        assert_eq!(m.spec_discards, 0);
        if name == "perfect" {
            assert!(m.accepted > 0, "{m:?}");
        }
    }
    // The default on the host router, which computes on the host's cores: depth 1, exact too.
    let setup = Setup {
        depth: 2,
        speculation: Some(Speculation::mtp(3)),
        ..Setup::plain()
    };
    let (outcomes, m) = serve(&model, setup, &requests);
    assert_eq!(outcomes, reference, "auto");
    assert_eq!(m.spec_flights, 0, "{m:?}");
    assert!(m.verify_launches > 0 && m.drafted > 0, "{m:?}");
}

/// At depth 2, a tight pool preempts (spill and recompute) between flights (a cohort's launch
/// finds the pool dry, the flight drains and the depth-1 step preempts): the output is that of
/// plain decoding and everything comes back.
#[test]
fn preemption_at_depth_two_keeps_the_output() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let requests = long_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let known = full_sequences(&requests, &reference);
    for preemption in [
        Preemption::Spill(SpillTarget::Memory),
        Preemption::Recompute,
    ] {
        let setup = Setup {
            caches: matches!(preemption, Preemption::Recompute),
            num_blocks: 9,
            preemption: preemption.clone(),
            depth: 2,
            speculation: Some(known_drafter(3, &known, false, SpecOverlap::Cohorts)),
            ..Setup::plain()
        };
        let (outcomes, m) = serve(&model, setup, &requests);
        assert_eq!(outcomes, reference, "{preemption:?}");
        assert!(
            m.preemptions > 0 && m.spec_flights > 0,
            "{preemption:?}: {m:?}"
        );
    }
}

/// At depth 2 with the MTP drafter, a cohort whose verification finds the pool dry keeps the
/// drafts its head proposed for the depth-1 step that follows (the head consumed the rows'
/// catch-up rings to propose them, so drafting again there would give nothing). With recompute
/// preemption every sequence keeps its catch-up state, so no row that may draft goes without:
/// `draft_misses` is 0. A sequence restored from a spill image has it too (the image carries
/// the head's catch-up ring since version 2; before, one miss per restore: 3 for 3).
#[test]
fn mtp_drafts_survive_a_dry_pool_at_a_cohort_launch() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let requests = long_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    for preemption in [
        Preemption::Recompute,
        Preemption::Spill(SpillTarget::Memory),
    ] {
        let setup = Setup {
            caches: true,
            num_blocks: 9,
            preemption: preemption.clone(),
            depth: 2,
            speculation: Some(cohorts(Speculation::mtp(3))),
            ..Setup::plain()
        };
        let (outcomes, m) = serve(&model, setup, &requests);
        assert_eq!(outcomes, reference, "{preemption:?}");
        assert!(m.preemptions > 0 && m.spec_flights > 0, "{m:?}");
        if !matches!(preemption, Preemption::Recompute) {
            // Restored rows draft at their first step here.
            assert!(m.restores > 0, "{m:?}");
        }
        assert_eq!(m.draft_misses, 0, "{m:?}");
    }
}

/// A verification whose kept positions carry a sequence past a block boundary leaves the Marconi
/// checkpoint there that plain decoding would have taken (from the verification's snapshot): a
/// follow-up turn (the first turn's prompt and output, then more) finds the same cached prefix
/// with speculation as without. With the perfect drafter at k = 3 each step keeps 4 positions,
/// so the boundaries at 16 and 32 fall inside runs; before, the follow-up hit only the prompt's.
#[test]
fn a_boundary_inside_a_verify_run_is_checkpointed() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    // A prompt of 7: the runs keep positions 7..11, 11..15, 15..19, ..., 31..35.
    let prompt = (greedy_requests(fixture).into_iter())
        .map(|r| r.prompt)
        .find(|p| p.len() == 7)
        .unwrap();
    let first = Request::greedy(prompt.clone(), 30).with_logits_digest(true);
    let (out, _) = serve(&model, Setup::plain(), std::slice::from_ref(&first));
    let first_full: Vec<u32> = prompt
        .iter()
        .chain(&out[0].as_ref().unwrap().0)
        .copied()
        .collect();
    let follow_prompt: Vec<u32> = first_full.iter().chain(&[3, 1, 4]).copied().collect();
    let follow = Request::greedy(follow_prompt.clone(), 4).with_logits_digest(true);
    let waves: &[&[Request]] = &[std::slice::from_ref(&first), std::slice::from_ref(&follow)];
    let caches = |speculation| Setup {
        caches: true,
        speculation,
        ..Setup::plain()
    };
    let (reference, plain) = serve_waves(&model, caches(None), waves);
    let follow_full: Vec<u32> = (follow_prompt.iter())
        .chain(&reference[1].as_ref().unwrap().0)
        .copied()
        .collect();
    let perfect = known_drafter(
        3,
        &Arc::new(vec![first_full, follow_full]),
        false,
        SpecOverlap::Auto,
    );
    let (outcomes, m) = serve_waves(&model, caches(Some(perfect)), waves);
    assert_eq!(outcomes, reference);
    assert_eq!(m.accepted, m.drafted, "{m:?}");
    // The first turn computed 36 positions; the follow-up hits the boundary at 32.
    assert_eq!(plain.prefill_tokens_cached, 32, "{plain:?}");
    assert_eq!(
        m.prefill_tokens_cached, plain.prefill_tokens_cached,
        "{m:?}"
    );
}

/// The depth-2 negative control: a cohort whose verification names the ring slots of the one
/// in flight overwrites the snapshots those rows restore from; the router refuses the restore
/// and requests fail, so the tests above would catch a shared ring.
#[test]
fn a_ring_shared_between_cohorts_is_caught() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    // Drafts always wrong: every row restores a snapshot; with a drafter in the core the next
    // cohort's verification launches before the one in flight settles.
    let known = full_sequences(&requests, &reference);
    let setup = |fault| Setup {
        depth: 2,
        fault,
        speculation: Some(known_drafter(2, &known, true, SpecOverlap::Cohorts)),
        ..Setup::plain()
    };
    // Without the fault this is the adversarial case of the depth-2 test above (exact).
    let setup = setup(Some(SpecFault::ReuseFlightRing));
    let (outcomes, m) = serve(&model, setup, &requests);
    assert!(m.spec_flights > 0 && m.spec_rollbacks > 0, "{m:?}");
    assert_ne!(outcomes, reference);
    assert!(outcomes.iter().any(Result::is_err), "{outcomes:?}");
}

/// A request cancelled while its verification is in flight (depth 2): the verification's output
/// for it is discarded and every position it computed dropped; the others keep their output,
/// and every block and slot comes back.
#[test]
fn cancel_while_a_verification_is_in_flight() {
    let fixture = "nemotron-h-tiny";
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let setup = Setup {
        depth: 2,
        caches: true,
        speculation: Some(cohorts(Speculation::mtp(3))),
        ..Setup::plain()
    };
    let mut engine = engine(&model, &setup);
    let initial = engine.router().facts();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    // The first flight's cohort is the first half of the running rows: request 0 among them.
    while engine.metrics().spec_flights == 0 {
        engine.step();
    }
    assert!(engine.step_in_flight());
    handles[0].cancel();
    engine.run_until_idle();
    assert_eq!(engine.metrics().spec_discards, 1);
    check_first_cancelled(handles, &reference);
    assert_back_to_initial(engine.router(), initial);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

/// A request cancelled while it speculates ends at once; the others keep their output and every
/// block and slot comes back.
#[test]
fn cancel_mid_speculation_releases_everything() {
    let fixture = "nemotron-h-tiny";
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let mut engine = engine(&model, &Setup::mtp(3));
    let initial = engine.router().facts();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    // Run until the first request has speculated at least once, then cancel it.
    while engine.metrics().spec_rows == 0 {
        engine.step();
    }
    handles[0].cancel();
    engine.run_until_idle();
    check_first_cancelled(handles, &reference);
    assert_back_to_initial(engine.router(), initial);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

/// The negative control: an engine that skips the SSM restore after a rejected draft does not
/// give the output of plain decoding (the router refuses to compute on a state past the
/// sequence's length, and the request fails), so the tests above would catch that bug.
#[test]
fn a_skipped_ssm_restore_is_caught() {
    let fixture = "nemotron-h-alt";
    let model = model(fixture);
    let requests = greedy_requests(fixture);
    let (reference, _) = serve(&model, Setup::plain(), &requests);
    let setup = Setup {
        fault: Some(SpecFault::SkipSsmRestore),
        ..Setup::mtp(2)
    };
    let (outcomes, m) = serve(&model, setup, &requests);
    assert!(m.spec_rollbacks > 0);
    assert_ne!(outcomes, reference);
    assert!(outcomes.iter().any(Result::is_err), "{outcomes:?}");
}

/// The engine reads the snapshot ring's size from the router: a ring smaller than `k` is a typed
/// error at engine start, naming both numbers.
#[test]
fn a_snapshot_ring_smaller_than_k_is_refused_at_engine_start() {
    let model = model("nemotron-h-tiny");
    let config = |k| EngineConfig {
        max_running: 4,
        speculation: Some(Speculation::mtp(k)),
        ..EngineConfig::default()
    };
    let router = |slots| {
        let mut router_config = CpuRouterConfig::new(16, 4);
        router_config.snapshot_slots = slots;
        CpuRouter::new(model.clone(), router_config).unwrap()
    };
    let err = Engine::new(router(2), config(3)).unwrap_err();
    assert!(
        matches!(err, EngineError::SnapshotRing { k: 3, slots: 2 }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "speculation with k = 3 drafts per row needs at least 3 snapshot ring slots; the router has 2"
    );
    let engine = Engine::new(router(3), config(3)).unwrap();
    assert_eq!(engine.router().facts().snapshot_slots_total, 3);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

/// A `Draft` that fails on the device (the host router's fault injection fails the first draft
/// step: the head ran, and what it wrote is garbage) fails the row it drafted for, whose state is
/// now unspecified; the row that was not in the draft (the ring holds one row's drafts) is
/// verified and served exactly, and everything comes back. Before, the engine verified the
/// failed row without drafts next to the other one, and the router refused that verification,
/// failing both.
#[test]
fn a_draft_that_failed_on_the_device_fails_only_the_row_it_drafted_for() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let model = model("nemotron-h-tiny");
    let requests = [
        Request::greedy(vec![5, 6, 7, 8, 9], MAX_TOKENS).with_logits_digest(true),
        Request::greedy(vec![11, 12, 13], MAX_TOKENS).with_logits_digest(true),
    ];
    let serve_with = |fail_ticket: u64| {
        let launched = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&launched);
        let setup = Setup {
            // One row's drafts per step: the other row decodes plainly in the same verification.
            ring: Some(2),
            step_faults: Some(device_cpu::StepFaults::new(move |ticket| {
                seen.fetch_add(1, Ordering::SeqCst);
                ticket == fail_ticket
            })),
            ..Setup::mtp(2)
        };
        let (outcomes, metrics) = serve(&model, setup, &requests);
        (outcomes, metrics, launched.load(Ordering::SeqCst))
    };
    let (reference, plain, _) = serve_with(0);
    assert!(reference.iter().all(Result::is_ok), "{reference:?}");
    assert!(plain.draft_launches > 0, "{plain:?}");
    // Step 1 prefills both prompts; step 2 is the first draft, for the first request only.
    let (outcomes, metrics, launched) = serve_with(2);
    assert_eq!(
        outcomes[0],
        Err(
            "device error during Draft: forward failed: an injected device fault \
             (StepFaults) in step 2"
                .to_string()
        )
    );
    assert_eq!(outcomes[1], reference[1]);
    assert_eq!(metrics.draft_failures, 1, "{metrics:?}");
    assert!(launched > 2, "{metrics:?}");
}

/// A prefix hit never needs more of the pool than a run from scratch: on a pool of exactly one
/// sequence of `max_context` tokens, a follow-up turn that fills the context and hits the first
/// turn's marked checkpoint is served (the MTP head's rerun would copy the hit's last block and
/// hold the original, pinned, for the sequence's lifetime: one block more than the pool has),
/// with a cold run's tokens and logits, with speculation off and on, and every block back.
#[test]
fn a_prefix_hit_on_a_pool_of_one_longest_sequence_is_served() {
    let fixture = "nemotron-h-tiny";
    let model = model(fixture);
    let prompts = model::parity::prompts(&mtp_dir(fixture)).unwrap();
    // A first turn whose end-of-input checkpoint (at 16) falls inside its prefill plan: the
    // head lags there and marks it; and one whose output checkpoint (at 64) the drafting head
    // marks (with speculation off it is unmarked and the hit needs no copy).
    for (prompt_len, first_tokens) in [(17, MAX_TOKENS), (40, 30)] {
        let prompt = prompts.iter().find(|p| p.len() == prompt_len).unwrap();
        // Exactly one longest sequence: the hit is taken without the rerun's copy (skipped).
        check_hit_on_a_full_pool(&model, prompt, first_tokens, 8, (0, 0, 0, 1));
        // One block more: the head reruns over the copy and is a cold run's.
        check_hit_on_a_full_pool(&model, prompt, first_tokens, 9, (1, 0, 0, 0));
    }
}

/// Serves `prompt` for `first_tokens`, then a follow-up that replays it and fills the context,
/// on a pool of `num_blocks`: the follow-up gives a cold run's output, and its hit counts as
/// `head_hit` ((exact, unvouched, unmarked, skipped) head hits).
fn check_hit_on_a_full_pool(
    model: &Model,
    prompt: &[u32],
    first_tokens: usize,
    num_blocks: usize,
    head_hit: (u64, u64, u64, u64),
) {
    let pool = Setup {
        num_blocks,
        max_running: 1,
        ..Setup::plain()
    };
    let first = Request::greedy(prompt.to_vec(), first_tokens).with_logits_digest(true);
    let (out, _) = serve(model, pool, std::slice::from_ref(&first));
    let first_full: Vec<u32> = prompt
        .iter()
        .chain(&out[0].as_ref().unwrap().0)
        .copied()
        .collect();
    // The follow-up's prompt and output fill `max_context` (8 blocks) exactly.
    let follow_len = 8 * BLOCK - MAX_TOKENS;
    let follow_prompt: Vec<u32> = (first_full.iter())
        .chain(prompt.iter().cycle())
        .take(follow_len)
        .copied()
        .collect();
    let follow = Request::greedy(follow_prompt, MAX_TOKENS).with_logits_digest(true);
    let case = format!("a first turn of {} + {first_tokens}", prompt.len());
    for speculation in [None, Some(Speculation::mtp(2))] {
        let cold = Setup {
            num_blocks,
            max_running: 1,
            speculation: speculation.clone(),
            ..Setup::plain()
        };
        let (reference, _) = serve(model, cold, std::slice::from_ref(&follow));
        assert!(reference[0].is_ok(), "{case}: {reference:?}");
        let cached = Setup {
            caches: true,
            num_blocks,
            max_running: 1,
            speculation: speculation.clone(),
            ..Setup::plain()
        };
        let mut engine = engine(model, &cached);
        let initial = engine.router().facts();
        let mut outcomes = Vec::new();
        for request in [&first, &follow] {
            let handle = engine.submit(request.clone()).unwrap();
            engine.run_until_idle();
            let got = handle.wait();
            outcomes.push(
                got.map(|c| (c.tokens, c.logits_digest))
                    .map_err(|e| e.to_string()),
            );
        }
        let stats = engine.router().cache_stats().unwrap();
        let m = *engine.metrics();
        assert_eq!(outcomes[1], reference[0], "{case}, {speculation:?}: {m:?}");
        assert_eq!(outcomes[0], out[0], "{case}: {m:?}");
        // The follow-up hit the first turn's last checkpoint (the first turn found nothing).
        assert_eq!(m.prefix_hits, 1, "{m:?}");
        assert_eq!(
            m.prefill_tokens_cached as usize,
            (first_full.len() - 1) / BLOCK * BLOCK,
            "{m:?}"
        );
        let counted = (
            stats.head_exact_hits,
            stats.head_unvouched_hits,
            stats.head_unmarked_hits,
            stats.head_skipped_hits,
        );
        let want = match speculation {
            // Without drafts the head marks no output checkpoint.
            None if first_tokens > MAX_TOKENS => (0, 0, 1, 0),
            _ => head_hit,
        };
        assert_eq!(counted, want, "{case}, {speculation:?}: {stats:?}");
        assert_back_to_initial(engine.router(), initial);
        engine.shutdown(ShutdownMode::Drain).unwrap();
    }
}
