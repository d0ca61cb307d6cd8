//! `TracingDeviceIo`: a `DeviceIo` decorator that records every call to a `TraceSink`.
//!
//! The decorator is generic over the router it wraps and keeps its associated types, so code
//! written against `D` runs unchanged against `TracingDeviceIo<D>`. Before forwarding `launch`,
//! `await_result`, `apply`, `clear_prefix_cache`, `lora` and `teardown` it writes one line (`fx launch Decode{n=4,
//! readback=Argmax}`, `fx apply ReserveKv`); after the call, one line with what came back
//! (`-> ticket 3`, `-> Reserved{blocks=1}`, `-> err KvExhausted{needed=2, free=0}`,
//! `fx lora Unload{adapter=3}` then `-> err InUse{adapter=3, sequences=1}`). `model`,
//! `facts`, `max_depth` and `subscribe_cache_events` pass through silently (a subscription
//! changes nothing on the device, and a monitor that subscribes must not change a golden trace).
//! Errors pass through unchanged. A sink that
//! panics loses the line (counted in [`TracingDeviceIo::dropped_lines`]), never the call.
//!
//! Lines are deterministic (labels only, no timings, no addresses), so a recorded scenario is a
//! byte-stable golden file. Timings go to `tracing` spans (target `device_trace`), never into lines.
//!
//! # Example
//!
//! Wrap a router (here the scripted one of `device_io`'s `testing` feature), run one prefill
//! through the wrapper as any core would, and print what was recorded:
//!
//! ```
//! use device_io::testing::{ScriptedConfig, ScriptedRouter, ScriptedSeq};
//! use device_io::{DeviceIo, Effect, Readback, SeqSpec, Sequence, StepPlan};
//! use device_trace::{TraceSink, TracingDeviceIo};
//!
//! let (sink, buffer) = TraceSink::memory();
//! let router = TracingDeviceIo::new(ScriptedRouter::new(ScriptedConfig::default()), sink);
//!
//! let mut seq = ScriptedSeq::create(SeqSpec { id: 1, prompt: &[5, 6, 7], adapter: None, cache_salt: None });
//! let plan = StepPlan::Prefill { budgets: &[8], readback: Readback::Argmax };
//! let ticket = router.launch(plan, &mut [&mut seq])?;
//! router.await_result(ticket)?;
//! router.apply(Effect::ReleaseSeq { seq: &mut seq, cache: true, what: "finish" })?;
//!
//! print!("{}", buffer.text());
//! assert_eq!(
//!     buffer.lines(),
//!     [
//!         "fx launch Prefill{n=1, budget=8, readback=Argmax}",
//!         "-> ticket 1",
//!         "fx await ticket 1",
//!         "-> settled ticket 1 rows=1",
//!         "fx apply ReleaseSeq{cache=true, finish}",
//!         "-> Unit",
//!     ]
//! );
//! # Ok::<(), device_io::DeviceError>(())
//! ```
#![forbid(unsafe_code)]

mod sink;

pub use sink::{TraceBuffer, TraceSink};

use device_io::{
    CacheEventSink, DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, Label, LoraError,
    StepPlan, StepResult, Ticket,
};

/// A router that records every call to a [`TraceSink`] and forwards it unchanged.
#[derive(Debug)]
pub struct TracingDeviceIo<D: DeviceIo> {
    inner: D,
    sink: TraceSink,
}

impl<D: DeviceIo> TracingDeviceIo<D> {
    /// Wraps `inner`, writing its calls to `sink`.
    pub fn new(inner: D, sink: TraceSink) -> Self {
        TracingDeviceIo { inner, sink }
    }

    /// The wrapped router.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Trace lines lost because the sink panicked while taking them (the calls went on).
    pub fn dropped_lines(&self) -> u64 {
        self.sink.dropped_lines()
    }

    /// Unwraps the router, dropping the sink.
    pub fn into_inner(self) -> D {
        self.inner
    }

    fn after<T>(&self, result: &Result<T, DeviceError>, ok: impl FnOnce(&T) -> String) {
        match result {
            Ok(value) => self.sink.record(&format!("-> {}", ok(value))),
            Err(err) => self.sink.record(&format!("-> err {}", err.label())),
        }
    }
}

impl<D> DeviceIo for TracingDeviceIo<D>
where
    D: DeviceIo,
    D::LoraCmd: Label,
    D::LoraAck: Label,
{
    type Seq = D::Seq;
    type Ptr = D::Ptr;
    type Model = D::Model;
    type LoraCmd = D::LoraCmd;
    type LoraAck = D::LoraAck;

    fn model(&self) -> &Self::Model {
        self.inner.model()
    }

    fn facts(&self) -> DeviceFacts {
        self.inner.facts()
    }

    fn max_depth(&self) -> usize {
        self.inner.max_depth()
    }

    fn computes_on_host(&self) -> bool {
        self.inner.computes_on_host()
    }

    fn launch(
        &self,
        plan: StepPlan<'_>,
        rows: &mut [&mut Self::Seq],
    ) -> Result<Ticket, DeviceError> {
        let _span = tracing::debug_span!(target: "device_trace", "launch").entered();
        self.sink.record(&format!("fx launch {}", plan.label()));
        let result = self.inner.launch(plan, rows);
        self.after(&result, |ticket| ticket.to_string());
        result
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<Self::Ptr>, DeviceError> {
        let _span = tracing::debug_span!(target: "device_trace", "await_result").entered();
        self.sink.record(&format!("fx await {ticket}"));
        let result = self.inner.await_result(ticket);
        self.after(&result, |step| {
            format!("settled {} rows={}", step.ticket, step.rows.len())
        });
        result
    }

    fn apply(
        &self,
        effect: Effect<'_, Self::Seq, Self::Ptr>,
    ) -> Result<EffectOutcome, DeviceError> {
        let _span = tracing::debug_span!(target: "device_trace", "apply").entered();
        self.sink.record(&format!("fx apply {}", effect.label()));
        let result = self.inner.apply(effect);
        self.after(&result, |outcome| outcome.label());
        result
    }

    fn clear_prefix_cache(&self) -> Result<(), DeviceError> {
        let _span = tracing::debug_span!(target: "device_trace", "clear_prefix_cache").entered();
        self.sink.record("fx clear_prefix_cache");
        let result = self.inner.clear_prefix_cache();
        self.after(&result, |()| "ok".to_string());
        result
    }

    fn subscribe_cache_events(&self, sink: Box<dyn CacheEventSink>) -> Result<(), DeviceError> {
        self.inner.subscribe_cache_events(sink)
    }

    fn lora(&mut self, cmd: Self::LoraCmd) -> Result<Self::LoraAck, LoraError> {
        let _span = tracing::debug_span!(target: "device_trace", "lora").entered();
        self.sink.record(&format!("fx lora {}", cmd.label()));
        let result = self.inner.lora(cmd);
        match &result {
            Ok(ack) => self.sink.record(&format!("-> {}", ack.label())),
            Err(err) => self.sink.record(&format!("-> err {}", err.label())),
        }
        result
    }

    fn teardown(self: Box<Self>) -> Result<(), DeviceError> {
        let _span = tracing::debug_span!(target: "device_trace", "teardown").entered();
        let TracingDeviceIo { inner, sink } = *self;
        sink.record("fx teardown");
        let result = Box::new(inner).teardown();
        match &result {
            Ok(()) => sink.record("-> ok"),
            Err(err) => sink.record(&format!("-> err {}", err.label())),
        }
        result
    }
}
