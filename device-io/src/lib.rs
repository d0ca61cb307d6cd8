//! The `DeviceIo` contract between the engine core and a router.
//!
//! The engine is split at one boundary. The **core** (crate `scheduler`) owns requests and policy;
//! a **router** (crates `device-cpu`, `device-cuda`, or your own) owns device memory and executes
//! what the core asks:
//!
//! - *plans* ([`StepPlan`]): one forward step over a batch of rows, started with
//!   [`DeviceIo::launch`] (which answers a [`Ticket`]) and settled with [`DeviceIo::await_result`];
//! - *effects* ([`Effect`]): bookkeeping on device memory between steps, [`DeviceIo::apply`].
//!
//! # Who validates what
//!
//! - The **core** validates requests (token ids inside the vocabulary, non-empty prompts, sampling
//!   parameters, context length) before it creates a sequence; the router may rely on
//!   [`DeviceFacts`] being what the core checked against.
//! - The **router** validates everything that depends on device state: a ticket that is unknown or
//!   already claimed ([`DeviceError::UnknownTicket`]), a slot that is not free
//!   ([`DeviceError::Invalid`]), a spill image that is truncated, corrupt or from another model
//!   ([`DeviceError::BadImage`]), a pool that is dry ([`DeviceError::KvExhausted`] from a plan,
//!   [`EffectOutcome::Exhausted`] from `ReserveKv`), an operation it does not implement
//!   ([`DeviceError::Unsupported`]).
//! - A failed call leaves the router as it was, except where the error says otherwise
//!   (a [`DeviceError::Failed`] in phase [`Phase::Forward`] leaves the rows of that step in an
//!   unspecified state: the core must release them with `ReleaseSeq { cache: false }`, which never
//!   offers their KV to the prefix cache).
//!
//! The core branches on the *variant* of a [`DeviceError`], never on its message text.
//!
//! # Depth
//!
//! [`DeviceIo::max_depth`] is how many launched steps may be unsettled at once. At depth 1 every
//! launch completes before the next one starts (the host router completes it before `launch`
//! returns). At depth 2 the core may launch step t+1 before it awaits step t: a
//! [`StepPlan::DecodeFed`] whose rows take their input on the device from step t's argmax
//! ([`Feed::Row`]) or from a token the host already knows ([`Feed::Host`]). The protocol:
//!
//! 1. [`Effect::ReserveKv`] for every row of step t+1 (its next KV block exists, and the position
//!    is recorded in the sequence's reservation ledger);
//! 2. launch step t+1, then await step t and do the host work for it while t+1 computes;
//! 3. for a row found finished at step t (or cancelled before its step-t output was read), the
//!    output of its run-ahead is discarded, never emitted, and [`Effect::Rollback`] undoes the
//!    run-ahead exactly before the row is released.
//!
//! Each ticket is awaited exactly once, in launch order; launching while `max_depth()` steps are
//! unsettled is [`DeviceError::Invalid`]. A step that fails (at launch, or when awaited) holds
//! nothing afterwards: its rows are in an unspecified state and are released with
//! `ReleaseSeq { cache: false }`, and a fed step whose source step failed fails too. Effects are
//! ordered after every step launched before them, as on one device stream; an effect that needs
//! data from the device (`SaveSequenceState`, `ReadLogits`) waits for them.
//!
//! # Cache events
//!
//! A router with a prefix cache publishes its changes (block stored, block removed, all cleared)
//! to subscribers, for cluster routers that route requests to the replica holding their prefix:
//! [`DeviceIo::subscribe_cache_events`] and the [`events`] module.
//!
//! # Speculative decoding
//!
//! One speculative step for a batch of decode rows (at depth 2 the core may launch another
//! batch's `Draft` or `Verify` before this one's `Verify` settles, over other sequences):
//!
//! 1. drafts: [`StepPlan::Draft`] runs the router's MTP head `k` times per row (or the core
//!    proposes tokens from any other drafter);
//! 2. [`StepPlan::Verify`] feeds each row's next token and its drafts, `k + 1` positions in one
//!    launch, opening the row's ledger entry and writing its SSM state after each draft position
//!    into the snapshot ring slots the core names;
//! 3. the core accepts `a` drafts per row (the longest prefix equal to the target's argmax for a
//!    greedy row; speculative rejection sampling for a sampled one), emits `a + 1` tokens (fewer
//!    when a stop condition ends the request inside the run), and for a row that keeps fewer
//!    positions than it fed applies [`Effect::TruncateKv`] and [`Effect::SsmSnapshotRestore`] of
//!    the snapshot at the kept length, so nothing of a rejected draft stays (no K/V the prefix
//!    cache could take, no checkpoint, no SSM state);
//! 4. with the MTP drafter, [`Effect::SaveHiddenCatchup`] for every kept position and one
//!    [`Effect::SyncSecondary`], so the MTP head's state follows the main model's.
//!
//! # LoRA and teardown
//!
//! [`DeviceIo::lora`] takes `&mut self`: the core calls it only at quiescence (no step in flight;
//! at depth 2 it drains first), and a router refuses it with [`LoraError::Busy`] otherwise. The
//! workspace's command is [`LoraCommand`] (load an adapter into a free slot, unload one, list
//! them), answered by a [`LoraAck`] or a typed [`LoraError`]; unloading an adapter that a live
//! sequence uses is [`LoraError::InUse`]. A sequence names its adapter in [`SeqSpec::adapter`],
//! which is also part of the prefix cache's key.
//! Teardown order: drain every in-flight ticket, apply [`Effect::EpShutdown`], apply
//! [`Effect::Quiesce`] for each stream, then [`DeviceIo::teardown`], which releases device memory
//! and reports sequences that still held resources.
//!
//! # Example
//!
//! Drive the scripted router of the `testing` feature the way a core drives any router: create a
//! sequence, prefill its prompt, feed each answered token back as a decode step, release it.
//!
//! ```
//! # #[cfg(feature = "testing")]
//! # fn main() -> device_io::Result<()> {
//! use device_io::testing::{ScriptedConfig, ScriptedRouter, ScriptedSeq};
//! use device_io::{DeviceIo, Effect, Readback, SeqSpec, Sequence, StepPlan};
//!
//! let router = ScriptedRouter::new(ScriptedConfig::default()); // blocks of 4 tokens
//! router.script(&[7, 8, 9]); // the tokens it answers, in order
//! let prompt = [5, 6, 7, 8, 9, 10];
//! let mut seq = ScriptedSeq::create(SeqSpec { id: 1, prompt: &prompt, adapter: None, cache_salt: None });
//!
//! // Prefill: the whole prompt fits the budget, so the step reaches its first token position.
//! let plan = StepPlan::Prefill { budgets: &[16], readback: Readback::Argmax };
//! let ticket = router.launch(plan, &mut [&mut seq])?;
//! let step = router.await_result(ticket)?;
//! let report = step.rows[0].prefill.expect("a prefill row reports how it advanced");
//! assert_eq!((report.computed, report.done), (6, true));
//! let mut token = step.rows[0].token.expect("the prompt completed");
//! let mut generated = vec![token];
//!
//! // Decode: one token in, the next one out.
//! for _ in 0..2 {
//!     let plan = StepPlan::Decode { tokens: &[token], readback: Readback::Argmax };
//!     let ticket = router.launch(plan, &mut [&mut seq])?;
//!     token = router.await_result(ticket)?.rows[0].token.expect("decode rows reach a token");
//!     generated.push(token);
//! }
//! assert_eq!(generated, [7, 8, 9]);
//! assert_eq!(router.facts().live_slots_used, 1);
//!
//! router.apply(Effect::ReleaseSeq { seq: &mut seq, cache: true, what: "finish" })?;
//! assert_eq!(router.facts().live_slots_used, 0);
//! Box::new(router).teardown()?; // nothing leaked
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "testing"))]
//! # fn main() {}
//! ```
#![forbid(unsafe_code)]

mod effect;
mod error;
pub mod events;
mod facts;
mod label;
mod plan;
mod sequence;
#[cfg(feature = "testing")]
pub mod testing;

pub use effect::{Effect, EffectOutcome};
pub use error::{DeviceError, Phase, Result};
pub use events::{BlockKey, CacheEvent, CacheEventBus, CacheEventSink};
pub use facts::DeviceFacts;
pub use label::{AdapterInfo, Label, LoraAck, LoraCommand, LoraError};
pub use plan::{Feed, PrefillReport, Readback, RowOutput, StepPlan, StepResult, Ticket, TokenRun};
pub use sequence::{SeqSpec, Sequence};

/// A router: owns device memory and executes the core's plans and effects.
///
/// Routers take `&self` and use interior mutability, so a decorator or the core can hold one
/// behind a shared reference while a step is in flight; a router is `Send` so the engine can run
/// it on its own thread.
pub trait DeviceIo: Send {
    /// The per-sequence device bookkeeping that plans and effects mutate.
    type Seq: Send;
    /// The device's handle to a step's logits (copied to the host by [`Effect::ReadLogits`]).
    type Ptr: Copy + Send;
    /// The model behind this router, for calls that go around plans and effects.
    type Model: ?Sized;
    /// A LoRA command this router understands (see [`LoraCommand`] for the common one).
    type LoraCmd;
    /// What a LoRA command answers.
    type LoraAck;

    /// The model this router serves.
    fn model(&self) -> &Self::Model;

    /// A snapshot of the router's resources.
    fn facts(&self) -> DeviceFacts;

    /// How many steps may be in flight at once; 1 means every step settles before the next launch.
    fn max_depth(&self) -> usize;

    /// Whether the router computes on the cores the core itself runs on (the host router), so
    /// the host's work between steps cannot overlap the device's: a core then gains nothing by
    /// splitting a step's rows to keep work in flight, and loses the batch. The default, `false`,
    /// is an accelerator's answer.
    fn computes_on_host(&self) -> bool {
        false
    }

    /// Starts one step over `rows` (in row order; each sequence appears at most once).
    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut Self::Seq]) -> Result<Ticket>;

    /// Settles a launched step and hands over its result; an unknown or already-claimed ticket is
    /// [`DeviceError::UnknownTicket`].
    fn await_result(&self, ticket: Ticket) -> Result<StepResult<Self::Ptr>>;

    /// Applies one effect between steps.
    fn apply(&self, effect: Effect<'_, Self::Seq, Self::Ptr>) -> Result<EffectOutcome>;

    /// Drops every cached prefix that no running sequence holds (vLLM's `reset_prefix_cache`):
    /// its KV blocks and checkpoint slots go back to the free pools. A router without a prefix
    /// cache has nothing to drop and answers `Ok` (the default).
    fn clear_prefix_cache(&self) -> Result<()> {
        Ok(())
    }

    /// Subscribes `sink` to the prefix cache's events ([`events`] documents the stream): first a
    /// `BlockStored` for every block cached now, parents first, then every change as it happens,
    /// never blocking on the sink. A router that keeps no prefix cache accepts the subscription
    /// and never delivers anything; one that cannot publish events answers
    /// [`DeviceError::Unsupported`] (the default).
    fn subscribe_cache_events(&self, sink: Box<dyn CacheEventSink>) -> Result<()> {
        drop(sink);
        Err(DeviceError::Unsupported {
            what: "subscribe_cache_events",
        })
    }

    /// Applies a LoRA command; called only at quiescence (a router answers
    /// [`LoraError::Busy`] while a launched step is not awaited). A refused command changed
    /// nothing.
    fn lora(&mut self, cmd: Self::LoraCmd) -> std::result::Result<Self::LoraAck, LoraError>;

    /// Releases device memory and consumes the router; reports sequences still holding resources.
    fn teardown(self: Box<Self>) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}

    #[test]
    fn public_values_are_send_and_sync() {
        assert_send::<DeviceError>();
        assert_sync::<DeviceError>();
        assert_send::<DeviceFacts>();
        assert_send::<StepResult<u64>>();
        assert_send::<Ticket>();
        assert_sync::<Ticket>();
        assert_send::<EffectOutcome>();
        assert_send::<CacheEvent>();
        assert_sync::<CacheEvent>();
        assert_send::<CacheEventBus>();
    }
}
