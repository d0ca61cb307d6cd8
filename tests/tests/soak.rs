//! A small soak in CI (the full one is `cargo xtask soak`): load on the host router with both
//! caches on, the same workload under memory pressure (spill to memory, spill to a directory,
//! recompute), and random faults on the scripted router. Every run must end with every failure
//! count at zero: no lost final event, no mismatch against the request served alone, no leaked
//! block or slot, no bystander failure.

use model::{Config, LayerKind, Model};
use tests::soak::{self, HostOptions, PressureMode, SoakReport, WorkloadOptions};

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

fn check(report: &SoakReport) {
    // Shown when the test fails (or with --nocapture).
    eprintln!("{}", serde_json::to_string(report).unwrap());
    assert!(report.clean(), "{report:?}");
    assert_eq!(
        report.completed + report.cancelled + report.failed + report.dropped,
        report.requests,
        "{report:?}"
    );
}

#[test]
fn load_and_memory_pressure_on_the_host_router_leave_nothing_behind() {
    let load = WorkloadOptions {
        requests: 48,
        clients: 4,
        prompt_len: 1..=40,
        max_tokens: 1..=8,
        cancel_percent: 10,
        drop_percent: 5,
        prefixes: 3,
        vocab_size: 256,
        seed: 11,
    };
    let host = HostOptions {
        model: small_model(),
        kv_blocks: 32,
        slots: 4,
        max_context: 48,
    };
    let report = soak::soak_host(&load, &host);
    check(&report);
    // Short prompts and long outputs on 4 blocks of 16: requests are admitted, then outgrow the
    // pool while decoding.
    let pressure = WorkloadOptions {
        prompt_len: 1..=12,
        max_tokens: 16..=32,
        seed: 13,
        ..load
    };
    let small = HostOptions {
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
        clients: 4,
        prompt_len: 1..=40,
        max_tokens: 1..=12,
        cancel_percent: 10,
        drop_percent: 5,
        prefixes: 4,
        vocab_size: 1000,
        seed: 12,
    };
    // 16 blocks of 4 tokens: the longest request (51 positions) fits, four at once do not, so
    // faults meet preemption (spills, restores) too.
    let report = soak::soak_faults(
        &workload,
        16,
        4,
        3,
        scheduler::Preemption::Spill(scheduler::SpillTarget::Memory),
    );
    check(&report);
    assert!(report.faults_injected > 0, "{report:?}");
    assert!(report.preemptions > 0, "{report:?}");
    assert!(report.failed > 0, "{report:?}");
    assert!(report.completed > 0, "{report:?}");
}
