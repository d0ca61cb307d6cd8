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
//! # LoRA and teardown
//!
//! [`DeviceIo::lora`] takes `&mut self`: the core calls it only at quiescence (no step in flight).
//! Teardown order: drain every in-flight ticket, apply [`Effect::EpShutdown`], apply
//! [`Effect::Quiesce`] for each stream, then [`DeviceIo::teardown`], which releases device memory
//! and reports sequences that still held resources.
#![forbid(unsafe_code)]

mod effect;
mod error;
mod facts;
mod label;
mod plan;
mod sequence;
#[cfg(feature = "testing")]
pub mod testing;

pub use effect::{Effect, EffectOutcome};
pub use error::{DeviceError, Phase, Result};
pub use facts::DeviceFacts;
pub use label::{Label, LoraCommand};
pub use plan::{Feed, PrefillReport, Readback, RowOutput, StepPlan, StepResult, Ticket};
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

    /// Applies a LoRA command; called only at quiescence.
    fn lora(&mut self, cmd: Self::LoraCmd) -> std::result::Result<Self::LoraAck, String>;

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
    }
}
