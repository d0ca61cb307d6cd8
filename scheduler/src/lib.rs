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
//! - [`sampling`] is the host sampler (greedy, seeded temperature / top-k / top-p / min-p,
//!   forced tokens) the engine runs when a step reads back host logits.
//! - [`backend`] is the only module that names concrete routers (selected by cargo features).
//! - [`workload`] and [`replay`] replay multi-turn traces with forced outputs, the workspace's
//!   end-to-end job.
//!
//! # Example
//!
//! Serve a tiny seeded model on the host router, on the engine's own thread, and stream the
//! tokens of one request:
//!
//! ```
//! # #[cfg(feature = "cpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use scheduler::backend::{self, BackendOptions};
//! use scheduler::{EngineConfig, EngineThread, Event, Request, ShutdownMode};
//!
//! let model = backend::random_model(backend::ModelConfig::tiny_demo(), 0)?;
//! // 64 KV blocks of 16 tokens, 4 live slots, prefix cache and Marconi on.
//! let engine = backend::build_engine(model, BackendOptions::new(64, 4), EngineConfig::default())?;
//! let thread = EngineThread::spawn(engine)?;
//!
//! let client = thread.client(); // cloneable and `Send`: hand it to any thread
//! let handle = client.submit(Request::greedy(vec![1, 2, 3, 4], 8))?;
//! let mut tokens = Vec::new();
//! for event in handle.events() {
//!     match event {
//!         Event::Token(token) => tokens.push(token),
//!         Event::Finished { reason, usage, .. } => {
//!             println!("{tokens:?} ({reason:?}, {} generated)", usage.generated_tokens);
//!             break;
//!         }
//!         Event::Error(err) => return Err(err.into()),
//!     }
//! }
//! assert_eq!(tokens.len(), 8);
//! thread.shutdown(ShutdownMode::Drain)?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cpu"))]
//! # fn main() {}
//! ```
#![forbid(unsafe_code)]

pub mod backend;
pub mod cache_events;
mod engine;
mod event;
mod guard;
mod handle;
mod metrics;
pub mod replay;
mod request;
pub mod sampling;
pub mod spill;
pub mod workload;

/// The LoRA command types of the contract, for [`EngineClient::lora`] and [`Engine::lora`].
pub use device_io::{AdapterInfo, LoraAck, LoraCommand, LoraError};
/// The prefix cache's events and their keys ([`cache_events`]).
pub use device_io::{BlockKey, CacheEvent};
pub use engine::{
    Drafter, Engine, EngineConfig, EngineError, Preemption, SpecOverlap, Speculation, MAX_DRAFTS,
};
#[doc(hidden)]
pub use engine::{PipelineFault, SpecFault};
pub use event::{Event, FinishReason, ServeError, Usage};
pub use handle::{
    Completion, ControlError, EngineClient, EngineStats, EngineThread, RequestHandle, ShutdownMode,
};
pub use metrics::{Metrics, StepReport};
pub use request::{AdapterSet, Limits, RandomSampling, Request, RequestError, Sampling};
pub use spill::{SpillError, SpillTarget};
/// The trace format's reader, shared with the simulator ([`workload::Workload::load`] uses it).
pub use workload_trace;
