//! Plans (one forward step over a batch of rows), tickets, and what a settled step answers.

use std::fmt;

/// The handle of one launched step; awaited exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ticket {}", self.0)
    }
}

/// How the result of a step's token position comes back to the host.
#[derive(Debug)]
pub enum Readback<'a> {
    /// The device takes the argmax of each row's logits ([`RowOutput::token`]).
    Argmax,
    /// The device takes the argmax over the allowed ids of each row: `masks[i][t]` says whether
    /// token `t` is allowed for row `i` (one mask per row, each `vocab_size` long).
    ArgmaxMasked {
        /// One mask per row.
        masks: &'a [&'a [bool]],
    },
    /// The host gets every logit: the router replaces `into` with one row of `vocab_size` f32 per
    /// row that reached a token position (all rows of a decode; the prefill rows whose prompt
    /// completed), in row order, before `launch` returns. On a pipelined router this makes the step
    /// a synchronisation point, as host sampling needs the logits before the next inputs exist.
    /// The device keeps them too ([`StepResult::logits`]), for [`Effect::ReadLogits`](crate::Effect::ReadLogits).
    HostLogits {
        /// Where the f32 logits go, row-major.
        into: &'a mut Vec<f32>,
    },
}

impl Readback<'_> {
    /// The variant's name, as in labels.
    pub fn name(&self) -> &'static str {
        match self {
            Readback::Argmax => "Argmax",
            Readback::ArgmaxMasked { .. } => "ArgmaxMasked",
            Readback::HostLogits { .. } => "HostLogits",
        }
    }
}

/// One forward step over a batch of rows, passed to [`DeviceIo::launch`](crate::DeviceIo::launch)
/// with the rows' sequences (in the same order as any per-row slice here).
#[derive(Debug)]
pub enum StepPlan<'a> {
    /// Advance each row's prompt by up to `budgets[i]` computed tokens. On a row's first chunk the
    /// router first attaches the longest cached prefix (KV blocks, and on a hybrid model the SSM
    /// checkpoint at its end), which costs no budget. A row whose prompt completes produces its
    /// first token position, read back as `readback` says.
    Prefill {
        /// The most tokens each row may compute this step (at least 1).
        budgets: &'a [usize],
        /// How the completed rows' next token comes back.
        readback: Readback<'a>,
    },
    /// Feed one token per row (`tokens[i]` to row `i`) and compute its next position.
    Decode {
        /// One input token per row.
        tokens: &'a [u32],
        /// How the result comes back.
        readback: Readback<'a>,
    },
    /// Run-ahead decode: row `i`'s input is the device argmax of row `sources[i]` of the previous
    /// step, which the host has not read yet. `masks`, when not empty, restricts each row's argmax
    /// as in [`Readback::ArgmaxMasked`]. Only a router with `max_depth() >= 2` supports it.
    DecodeFed {
        /// For each row, the row of the previous step whose argmax is its input.
        sources: &'a [usize],
        /// Empty, or one mask per row.
        masks: &'a [&'a [bool]],
    },
}

impl StepPlan<'_> {
    /// How many rows the plan covers.
    pub fn rows(&self) -> usize {
        match self {
            StepPlan::Prefill { budgets, .. } => budgets.len(),
            StepPlan::Decode { tokens, .. } => tokens.len(),
            StepPlan::DecodeFed { sources, .. } => sources.len(),
        }
    }
}

/// How a row's prefill advanced in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillReport {
    /// Tokens served from the prefix cache this step (only on a row's first chunk).
    pub cached: usize,
    /// Tokens computed this step.
    pub computed: usize,
    /// Whether the row's prompt is now complete.
    pub done: bool,
}

/// What one row of a settled step produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowOutput {
    /// The device argmax, when the row reached a token position and the readback was an argmax.
    pub token: Option<u32>,
    /// The row's index into the host logits, when the readback was `HostLogits` and the row
    /// reached a token position.
    pub logits_row: Option<usize>,
    /// For prefill rows, how the prompt advanced.
    pub prefill: Option<PrefillReport>,
}

/// A settled step.
#[derive(Debug)]
pub struct StepResult<P> {
    /// The ticket that was awaited.
    pub ticket: Ticket,
    /// One output per row, in row order.
    pub rows: Vec<RowOutput>,
    /// The device's handle to the step's logits, when the router keeps them.
    pub logits: Option<P>,
}
