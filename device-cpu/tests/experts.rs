//! The router's expert-parallel workers: the same logits as without them, `EpShutdown` stops
//! them (teardown relies on it), and a worker that dies fails the step as a lost device, after
//! which the router reports itself lost.

mod common;

use common::*;
use device_cpu::{CpuRouter, CpuRouterConfig};
use device_io::{DeviceError, DeviceIo, Effect, Readback, StepPlan};

fn router_with(expert_workers: usize) -> CpuRouter {
    let mut config = CpuRouterConfig::new(64, 4);
    config.max_context = Some(256);
    config.checkpoints = device_cpu::CheckpointBudget::Slots(16);
    config.expert_workers = expert_workers;
    CpuRouter::new(hybrid_model(), config).unwrap()
}

#[test]
fn expert_workers_change_no_bit_and_ep_shutdown_stops_them() {
    let prompt = tokens(3, 40);
    let mut outputs = Vec::new();
    for workers in [0, 1, 2, 4] {
        let router = router_with(workers);
        let mut s = seq(1, &prompt);
        let (last, _) = prefill(&router, &mut s, 16);
        let mut rows = vec![last.clone()];
        let mut token = argmax(&last);
        for _ in 0..3 {
            let logits = decode(&router, &mut [&mut s], &[token]);
            token = argmax(&logits);
            rows.push(logits);
        }
        outputs.push(bits(&rows));
        release(&router, &mut s, false);
        let pool = router.expert_pool().cloned();
        assert_eq!(
            pool.as_ref().map(|p| p.workers()),
            (workers > 0).then_some(workers)
        );
        router.apply(Effect::EpShutdown).unwrap();
        assert!(
            pool.is_none_or(|p| !p.running()),
            "EpShutdown stopped the workers"
        );
        Box::new(router).teardown().unwrap();
    }
    for (i, output) in outputs.iter().enumerate().skip(1) {
        assert!(
            *output == outputs[0],
            "run {i} differs from the run without workers"
        );
    }
}

#[test]
fn a_dead_expert_worker_loses_the_router() {
    let router = router_with(2);
    let mut s = seq(1, &tokens(4, 20));
    prefill(&router, &mut s, 32);
    router.expert_pool().unwrap().crash_worker(0);
    let mut host = Vec::new();
    let step = |router: &CpuRouter, s: &mut device_cpu::CpuSeq, host: &mut Vec<f32>| {
        let ticket = router.launch(
            StepPlan::Decode {
                tokens: &[5],
                readback: Readback::HostLogits { into: host },
            },
            &mut [s],
        )?;
        router.await_result(ticket).map(|_| ())
    };
    let err = step(&router, &mut s, &mut host).unwrap_err();
    assert!(matches!(err, DeviceError::DeviceLost(_)), "{err}");
    // The router stays lost: a new sequence's step fails the same way.
    let mut other = seq(2, &tokens(5, 8));
    let ticket = router.launch(
        StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::HostLogits { into: &mut host },
        },
        &mut [&mut other],
    );
    let err = ticket
        .and_then(|t| router.await_result(t).map(|_| ()))
        .unwrap_err();
    assert!(matches!(err, DeviceError::DeviceLost(_)), "{err}");
}
