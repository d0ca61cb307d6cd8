//! The decorator's overhead per call: `apply` and `launch` + `await_result` through
//! `TracingDeviceIo` with the in-memory sink, against the bare scripted router.

use criterion::{criterion_group, criterion_main, Criterion};
use device_io::testing::{seq, ScriptedConfig, ScriptedRouter, ScriptedSeq};
use device_io::{DeviceIo, Effect, Readback, StepPlan};
use device_trace::{TraceSink, TracingDeviceIo};

fn prefilled<D: DeviceIo<Seq = ScriptedSeq>>(router: &D) -> ScriptedSeq {
    let mut s: ScriptedSeq = seq(1, &[1, 2, 3]);
    let plan = StepPlan::Prefill {
        budgets: &[3],
        readback: Readback::Argmax,
    };
    let ticket = router.launch(plan, &mut [&mut s]).expect("prefill");
    router.await_result(ticket).expect("settle");
    s
}

fn calls<D: DeviceIo<Seq = ScriptedSeq>>(
    c: &mut Criterion,
    name: &str,
    router: D,
    clear: impl Fn(&D),
) {
    let mut seq = prefilled(&router);
    c.bench_function(&format!("{name}/apply_quiesce"), |b| {
        b.iter(|| {
            router
                .apply(Effect::Quiesce { stream: 1 })
                .expect("quiesce");
            clear(&router);
        })
    });
    c.bench_function(&format!("{name}/decode_launch_await"), |b| {
        b.iter(|| {
            let ticket = router.launch(
                StepPlan::Decode {
                    tokens: &[7],
                    readback: Readback::Argmax,
                },
                &mut [&mut seq],
            );
            let step = router
                .await_result(ticket.expect("launch"))
                .expect("settle");
            clear(&router);
            step
        })
    });
}

fn overhead(c: &mut Criterion) {
    // A pool large enough that the benchmark's decode steps never run it dry.
    let config = ScriptedConfig {
        num_blocks: 1 << 30,
        block_size: 1 << 20,
        ..ScriptedConfig::default()
    };
    // The scripted router records every effect's label; the record is emptied after each call
    // (in both runs) so that neither figure includes growing that record.
    calls(c, "bare", ScriptedRouter::new(config), |router| {
        router.take_effects();
    });
    let (sink, buffer) = TraceSink::memory();
    // The buffer is emptied after each call so that the figure is the decorator's cost, not the
    // cost of growing an ever longer vector.
    calls(
        c,
        "traced",
        TracingDeviceIo::new(ScriptedRouter::new(config), sink),
        move |router| {
            router.inner().take_effects();
            buffer.take();
        },
    );
}

criterion_group!(benches, overhead);
criterion_main!(benches);
