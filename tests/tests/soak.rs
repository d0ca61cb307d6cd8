//! A small soak in CI (the full one is `cargo xtask soak`): load on the host router with both
//! caches on, the same workload under memory pressure (spill to memory, spill to a directory,
//! recompute), and random faults on the scripted router (every request queued before the engine
//! steps, so the run repeats exactly, then submitted by clients while it steps); then the
//! features that landed later, together: depth 2, MTP speculation, seeded sampled rows, logits
//! digests, LoRA adapters, later turns of conversations and stop tokens on the host router (with
//! random faults on it, steps failed inside the router among them, and LoRA commands and
//! prefix-cache clears while steps are in flight), and depth 2 with speculation, sampled rows,
//! later turns and stop tokens on the CUDA router on `SimRuntime`, with random faults (and plain
//! fed steps over failed ones).
//! Every run must end with every failure count at zero: no lost final event, no mismatch against
//! the request served alone, no leaked block or slot, no bystander failure, no fed step served
//! over a failed one.

use model::{Config, LayerKind, Model};
use scheduler::SpecOverlap;
use tests::soak::{
    self, DraftSource, PressureMode, RouterKind, RouterOptions, SoakReport, Submission,
    WorkloadOptions,
};

/// A small hybrid model (Mamba, attention, MoE and MLP layers, hidden 32), so the soak stays
/// quick in a debug build.
fn small_model() -> Model {
    use LayerKind::{Attention, Mamba, Mlp, Moe};
    let config = Config {
        hidden_size: 32,
        num_hidden_layers: 4,
        layer_kinds: vec![Mamba, Attention, Moe, Mlp],
        ..Config::tiny_demo()
    };
    Model::random(config, 11).unwrap()
}

/// [`small_model`] with an MTP head (an attention and an MoE layer, as the tiny fixture's).
fn small_mtp_model() -> Model {
    use LayerKind::{Attention, Mamba, Mlp, Moe};
    let config = Config {
        hidden_size: 32,
        num_hidden_layers: 4,
        layer_kinds: vec![Mamba, Attention, Moe, Mlp],
        mtp: true,
        mtp_layer_kinds: vec![Attention, Moe],
        ..Config::tiny_demo()
    };
    Model::random(config, 11).unwrap()
}

fn check(report: &SoakReport) {
    // Shown when the test fails (or with --nocapture).
    eprintln!("{}", serde_json::to_string(report).unwrap());
    assert!(report.clean(), "{report:?}");
    assert_eq!(
        report.completed + report.cancelled + report.failed + report.dropped + report.stopped,
        report.requests,
        "{report:?}"
    );
}

/// 48 greedy requests from 4 clients: prompts of 1 to 40 tokens sharing 3 prefixes, up to 8
/// tokens each, 10% cancelled and 5% dropped.
fn load_workload() -> WorkloadOptions {
    WorkloadOptions {
        requests: 48,
        clients: 4,
        prompt_len: 1..=40,
        max_tokens: 1..=8,
        cancel_percent: 10,
        drop_percent: 5,
        prefixes: 3,
        vocab_size: 256,
        sampled_percent: 0,
        adapters: 0,
        digest_percent: 0,
        command_every_ms: 0,
        abort_after_ms: 0,
        followup_percent: 0,
        stop_percent: 0,
        submission: Submission::Clients,
        seed: 11,
    }
}

#[test]
fn load_and_memory_pressure_on_the_host_router_leave_nothing_behind() {
    let load = load_workload();
    let host = RouterOptions::host(small_model(), 32, 4, 48);
    let report = soak::soak_load(&load, &host);
    check(&report);
    // Short prompts and long outputs on 4 blocks of 16: requests are admitted, then outgrow the
    // pool while decoding.
    let pressure = WorkloadOptions {
        prompt_len: 1..=12,
        max_tokens: 16..=32,
        seed: 13,
        ..load
    };
    let small = RouterOptions {
        kv_blocks: 4,
        ..host
    };
    let modes = [
        PressureMode::SpillMemory,
        PressureMode::SpillDirectory,
        PressureMode::Recompute,
    ];
    let reports = soak::soak_pressure(&pressure, &small, &modes);
    for report in &reports {
        check(report);
        assert!(report.preemptions >= 10, "{report:?}");
    }
    assert!(
        reports[0].spills > 0 && reports[1].spills > 0,
        "{reports:?}"
    );
    assert_eq!(reports[2].spills, 0);
}

#[test]
fn random_faults_on_the_scripted_router_cost_only_the_requests_they_hit() {
    let workload = WorkloadOptions {
        requests: 400,
        max_tokens: 1..=12,
        prefixes: 4,
        vocab_size: 1000,
        seed: 12,
        ..load_workload()
    };
    // 16 blocks of 4 tokens: the longest request (51 positions) fits, four at once do not, so
    // faults meet preemption (spills, restores) too; at depth 2 they meet fed steps.
    let run = |workload: &WorkloadOptions, depth| {
        let report = soak::soak_faults(
            workload,
            depth,
            (16, 4),
            3,
            scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
        );
        check(&report);
        assert!(report.faults_injected > 0, "{report:?}");
        assert!(report.failed > 0, "{report:?}");
        assert!(report.completed > 0, "{report:?}");
        assert_eq!(report.fed_launches > 0, depth == 2, "{report:?}");
        report
    };
    for depth in [1, 2] {
        // Every request queued before the engine steps and none cancelled: nothing the engine
        // sees depends on the client threads' timing, so the run repeats exactly (checked), and
        // with 400 requests waiting from the first step on, four running outgrow the pool.
        let queued = WorkloadOptions {
            cancel_percent: 0,
            submission: Submission::Queued,
            ..workload.clone()
        };
        let report = run(&queued, depth);
        assert!(report.preemptions > 0, "{report:?}");
        assert!(report.spills > 0, "{report:?}");
        // At depth 2 some fed steps read a step that then failed, and failed too.
        assert_eq!(report.fed_over_failures > 0, depth == 2, "{report:?}");
        let again = run(&queued, depth);
        assert_eq!(
            SoakReport {
                wall_s: 0.0,
                ..again
            },
            SoakReport {
                wall_s: 0.0,
                ..report
            }
        );
        // The clients submitting while the engine steps, with cancels: how far requests overlap
        // (and so whether they preempt, or a cancel lands before the request ends) depends on
        // the threads' timing, so only what does not is asked of it.
        run(&workload, depth);
    }
}

/// The workload of the feature runs: [`load_workload`]'s prompts (long enough for prefix hits
/// at 16-token blocks), a third of the requests sampled, a fifth asking for logits digests,
/// `adapters` adapters bound at random, 30% later turns of an earlier request's conversation
/// and a quarter with stop tokens.
fn feature_workload(requests: usize, adapters: u32, seed: u64) -> WorkloadOptions {
    WorkloadOptions {
        requests,
        prompt_len: 8..=40,
        max_tokens: 4..=16,
        prefixes: 1,
        sampled_percent: 34,
        adapters,
        digest_percent: 20,
        followup_percent: 30,
        stop_percent: 25,
        seed,
        ..load_workload()
    }
}

/// `router` at depth 2 with the MTP head drafting 2 tokens per row, 4 slots, sequences of 56.
fn mtp_at_depth_two(router: RouterKind, kv_blocks: usize, overlap: SpecOverlap) -> RouterOptions {
    RouterOptions {
        router,
        depth: 2,
        mtp: 2,
        drafter: DraftSource::Head,
        overlap,
        ..RouterOptions::host(small_mtp_model(), kv_blocks, 4, 56)
    }
}

/// Checks a load run of [`feature_workload`] and that it took the paths it is there for: sampled
/// rows, prefix hits, and drafts verified by cohorts (one in flight while the other settles).
fn check_features(report: &SoakReport) {
    check(report);
    assert!(report.sampled > 0, "{report:?}");
    assert!(report.prefix_hits > 0, "{report:?}");
    assert!(report.later_turns > 0, "{report:?}");
    assert!(report.stopped_on_token > 0, "{report:?}");
    assert!(report.drafted > 0 && report.spec_flights > 0, "{report:?}");
}

#[test]
fn depth_two_speculation_sampling_and_lora_under_load_and_faults_on_the_host_router() {
    let workload = feature_workload(48, 2, 21);
    let options = mtp_at_depth_two(RouterKind::Host, 24, SpecOverlap::Cohorts);
    let report = soak::soak_load(&workload, &options);
    check_features(&report);
    assert!(report.with_adapter > 0, "{report:?}");
    // Memory pressure and random faults on the router: drafts that are all accepted (a drafter
    // knowing the reference output), spilled sequences, with LoRA commands and prefix-cache
    // clears arriving while steps are in flight; then plain fed decoding at depth 2, preempted
    // sequences recomputed.
    let perfect = RouterOptions {
        kv_blocks: 4,
        mtp: 3,
        drafter: DraftSource::Perfect,
        fault_per_mille: 20,
        ..options
    };
    // Short prompts and long outputs: admitted, then outgrowing the pool while decoding.
    let pressure = WorkloadOptions {
        prompt_len: 1..=12,
        max_tokens: 16..=32,
        ..workload
    };
    let commanded = WorkloadOptions {
        command_every_ms: 20,
        ..pressure.clone()
    };
    let spilled = soak::soak_pressure(&commanded, &perfect, &[PressureMode::SpillMemory]);
    check(&spilled[0]);
    assert!(spilled[0].spills > 0, "{spilled:?}");
    assert!(spilled[0].accepted > 0, "{spilled:?}");
    assert!(spilled[0].commands > 0, "{spilled:?}");
    let plain = RouterOptions { mtp: 0, ..perfect };
    let recomputed = soak::soak_pressure(&pressure, &plain, &[PressureMode::Recompute]);
    check(&recomputed[0]);
    assert!(recomputed[0].preemptions > 0, "{recomputed:?}");
    assert!(recomputed[0].fed_launches > 0, "{recomputed:?}");
    for report in [&spilled[0], &recomputed[0]] {
        assert!(report.faults_injected > 0, "{report:?}");
    }
    // About 4 per run: asked of both together, so that chance alone (e^-8) does not fail it.
    assert!(
        spilled[0].device_faults + recomputed[0].device_faults > 0,
        "{spilled:?} {recomputed:?}"
    );
}

#[test]
fn depth_two_speculation_and_sampling_under_load_and_faults_on_the_cuda_router() {
    let workload = feature_workload(24, 0, 22);
    // The CUDA router does not compute on the host's cores: cohorts by default.
    let options = mtp_at_depth_two(RouterKind::CudaSim, 16, SpecOverlap::Auto);
    check_features(&soak::soak_load(&workload, &options));
    // Random faults: launches and effects refused, and steps failed inside the router as a
    // device error would (what they wrote overwritten, their rows marked failed). At 5% most
    // requests fail, so the paths above are not asked for again; only that faults struck
    // inside the router (about 8 in 48 requests) and every failure count is zero.
    let faulty = RouterOptions {
        fault_per_mille: 50,
        ..options
    };
    let report = soak::soak_load(&feature_workload(48, 0, 24), &faulty);
    check(&report);
    assert!(report.device_faults > 0, "{report:?}");
    // Plain fed decoding at depth 2 with those faults (short prompts, long outputs), every
    // request queued before the engine steps and none cancelled, so the run repeats exactly: a
    // fed step reads the outputs of a step that then fails at the device, and fails too (the
    // contract; a router that served it would fail `check`).
    let fed = RouterOptions { mtp: 0, ..faulty };
    let queued = WorkloadOptions {
        prompt_len: 1..=8,
        max_tokens: 16..=32,
        sampled_percent: 0,
        followup_percent: 0,
        cancel_percent: 0,
        submission: Submission::Queued,
        ..feature_workload(12, 0, 25)
    };
    let report = soak::soak_load(&queued, &fed);
    check(&report);
    assert!(report.fed_over_failures > 0, "{report:?}");
}

/// An abort with requests waiting, running and in flight (verifications by cohorts, LoRA
/// commands arriving): every stream still ends with one final event, what completed is exact,
/// and the router's teardown finds nothing held.
#[test]
fn an_abort_under_load_at_depth_two_with_speculation_leaves_nothing_behind() {
    let workload = WorkloadOptions {
        command_every_ms: 20,
        abort_after_ms: 300,
        ..feature_workload(48, 2, 23)
    };
    let options = mtp_at_depth_two(RouterKind::Host, 24, SpecOverlap::Cohorts);
    let report = soak::soak_load(&workload, &options);
    check(&report);
    assert!(report.stopped > 0, "{report:?}");
}
