//! What a request's stream carries: tokens as they are produced, then exactly one final event.
//!
//! Invariant: every accepted request's stream ends with exactly one [`Event::Finished`] or
//! [`Event::Error`], after which nothing more is sent; no token follows the final event.

use std::time::Duration;

use device_io::DeviceError;

/// One item of a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The request completed; this is the last event.
    Finished {
        /// Why it stopped.
        reason: FinishReason,
        /// What it used.
        usage: Usage,
        /// xxh3-64 over the bits (little-endian f32) of every logits row the request produced,
        /// in order, when it asked for one ([`crate::Request::logits_digest`]).
        logits_digest: Option<u64>,
    },
    /// The request failed; this is the last event.
    Error(ServeError),
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_tokens` tokens.
    Length,
    /// It generated this stop token (the last token of its output).
    Stop(u32),
    /// It was cancelled through its handle (or its handle was dropped).
    Cancelled,
}

/// What a request used. Times are wall-clock on the engine's thread.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt (or, after a recompute, prompt plus generated) tokens served from the prefix cache
    /// instead of computed.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// From submission until the request was first scheduled.
    pub queue_time: Duration,
    /// From submission until its first token; `None` when it produced none.
    pub time_to_first_token: Option<Duration>,
    /// Mean time between its tokens after the first; `None` with fewer than two tokens.
    pub time_per_output_token: Option<Duration>,
    /// How many times it was preempted.
    pub preemptions: usize,
}

/// Why an accepted request failed while being served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// The router failed a step or an effect this request was part of.
    #[error("device error during {during}: {source}")]
    Device {
        /// The plan or effect that failed (`"Decode"`, `"Prefill"`, `"CompactSlot"`, ...).
        during: &'static str,
        /// The router's error.
        #[source]
        source: DeviceError,
    },
    /// The KV pool could not hold the request even with nothing else running.
    #[error(
        "the KV pool cannot hold this request even alone: needed {needed} blocks, {free} free"
    )]
    CannotFit {
        /// Blocks the step needed.
        needed: usize,
        /// Blocks that were free.
        free: usize,
    },
    /// Spilling or restoring the request's state failed.
    #[error("spill store: {0}")]
    Spill(String),
    /// The device was lost (a router call answered `DeviceLost`, or panicked) while the request
    /// was waiting or running; the engine serves nothing more.
    #[error("the device was lost: {0}")]
    DeviceLost(String),
    /// The engine shut down before the request completed.
    #[error("the engine shut down before the request completed")]
    Shutdown,
    /// The engine had stopped taking requests (a shutdown had begun) when the request reached
    /// it, or the engine is gone and the stream was cut.
    #[error("the engine stopped before serving the request")]
    EngineStopped,
    /// The request's LoRA adapter was unloaded between the client's check and the engine taking
    /// the request in.
    #[error("LoRA adapter {adapter} was unloaded before the engine took the request in")]
    AdapterNotLoaded {
        /// The adapter's id.
        adapter: u32,
    },
}
