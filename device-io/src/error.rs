//! The router's error type: which phase failed, plus the typed cases the core branches on.

use std::fmt;

use crate::Ticket;

/// The crate's result type.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// Where in a router's work an error arose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Launching or computing a step.
    Forward,
    /// Bringing a step's results to the host.
    Readback,
    /// Applying an effect.
    Effect,
    /// Tearing the router down.
    Teardown,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Readback => "readback",
            Phase::Effect => "effect",
            Phase::Teardown => "teardown",
        })
    }
}

/// A router's error. The core branches on the variant, never on the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The KV pool cannot hold what a step needs; nothing was changed. The core preempts.
    #[error("KV cache exhausted: needed {needed} blocks, {free} free")]
    KvExhausted {
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks that were free (or evictable).
        free: usize,
    },
    /// No free live-state slot for a new sequence; nothing was changed.
    #[error("no free sequence slot: all {total} slots are in use")]
    SlotsExhausted {
        /// The number of slots the router has.
        total: usize,
    },
    /// The router does not implement this operation (e.g. `Rollback` on a synchronous router).
    #[error("{what} is not supported by this router")]
    Unsupported {
        /// The plan, readback or effect that is not supported.
        what: &'static str,
    },
    /// The ticket was never issued, or was already claimed.
    #[error("unknown or already-claimed {0}")]
    UnknownTicket(Ticket),
    /// The call breaks the contract (a busy target slot, a row without a slot, a mismatched
    /// per-row slice); nothing was changed.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// The plan or effect that was invalid.
        what: &'static str,
        /// What exactly was wrong.
        detail: String,
    },
    /// A spill image was truncated, corrupt, or written by another model; nothing was changed.
    #[error("bad sequence image: {0}")]
    BadImage(String),
    /// The device is gone; every sequence on it is lost.
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// Anything else, with the phase that failed. After a `Forward` failure the rows of that step
    /// must be released with `ReleaseSeq { cache: false }`.
    #[error("{phase} failed: {message}")]
    Failed {
        /// The phase that failed.
        phase: Phase,
        /// What happened.
        message: String,
    },
}

impl DeviceError {
    /// The variant's name, as in traces.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceError::KvExhausted { .. } => "KvExhausted",
            DeviceError::SlotsExhausted { .. } => "SlotsExhausted",
            DeviceError::Unsupported { .. } => "Unsupported",
            DeviceError::UnknownTicket(_) => "UnknownTicket",
            DeviceError::Invalid { .. } => "Invalid",
            DeviceError::BadImage(_) => "BadImage",
            DeviceError::DeviceLost(_) => "DeviceLost",
            DeviceError::Failed { .. } => "Failed",
        }
    }
}
