//! The engine core: requests, admission, batching, chunked prefill, sampling, stop conditions,
//! preemption and compaction, generic over any `DeviceIo`.
//!
//! ```text
//!   EngineClient ──submit──▶ Engine<D: DeviceIo> ──plans / effects──▶ router (D)
//!   RequestHandle ◀─tokens, Finished / Error──┘
//! ```
//!
//! - [`Request`] is what a client asks for; [`Limits::validate`] refuses bad input with a
//!   [`RequestError`] before anything reaches the router.
//! - [`Engine`] owns the queue and the running sequences and advances them with
//!   [`Engine::step`] (deterministic; tests drive it directly), or on its own thread through
//!   [`EngineThread`] and a cloneable [`EngineClient`].
//! - Each request's [`RequestHandle`] streams [`Event`]s: tokens, then `Finished` with a
//!   [`FinishReason`] and [`Usage`], or `Error` with a [`ServeError`].
//! - [`backend`] is the only module that names concrete routers (selected by cargo features).
//! - [`workload`] and [`replay`] replay multi-turn traces with forced outputs, the workspace's
//!   end-to-end job.
#![forbid(unsafe_code)]

pub mod backend;
mod engine;
mod event;
mod handle;
mod metrics;
pub mod replay;
mod request;
mod sampling;
mod spill;
pub mod workload;

pub use engine::{Engine, EngineConfig, EngineError, Preemption};
pub use event::{Event, FinishReason, ServeError, Usage};
pub use handle::{Completion, EngineClient, EngineThread, RequestHandle, ShutdownMode};
pub use metrics::{Metrics, StepReport};
pub use request::{Limits, RandomSampling, Request, RequestError, Sampling};
pub use spill::SpillTarget;
