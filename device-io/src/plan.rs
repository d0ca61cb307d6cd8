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
    /// token `t` is allowed for row `i` (one mask per row, each `vocab_size` long and allowing at
    /// least one token; a prefill row that reaches no token position ignores its). The token is the one the
    /// host would get by setting every disallowed logit to minus infinity and taking the argmax
    /// (the first index on ties).
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
    /// Run-ahead decode: like [`StepPlan::Decode`], but row `i`'s input is named by `sources[i]`
    /// instead of a host token, so the step can be launched before the host has read the
    /// previous one. Only a router with `max_depth() >= 2` supports it (others answer
    /// [`DeviceError::Unsupported`](crate::DeviceError::Unsupported)).
    ///
    /// [`Feed::Row`] takes the input on the device from a *feed cell*: every step that reaches
    /// a token position leaves each such row's argmax there (the masked argmax when its readback
    /// was [`Readback::ArgmaxMasked`] or it was a fed step with masks), and the host never reads it
    /// first. [`Feed::Host`] joins a row with a token the host knows (a row new to the pipeline,
    /// or one whose last token the host chose, e.g. a forced one).
    ///
    /// The router refuses with [`DeviceError::Invalid`](crate::DeviceError::Invalid), changing
    /// nothing, a `Feed::Row(r)` whose row `r` of the previous launched step does not exist, was
    /// another sequence, or reached no token position; a host token outside the vocabulary; and
    /// masks of the wrong count or length, or with no allowed token.
    ///
    /// Every row reaches a token position; row `i`'s token comes back in
    /// [`RowOutput::token`] and its logits are row `i` of the step's logits
    /// ([`StepResult::logits`]).
    DecodeFed {
        /// Where each row's input token comes from.
        sources: &'a [Feed],
        /// Empty, or one mask per row restricting its argmax as in [`Readback::ArgmaxMasked`].
        masks: &'a [&'a [bool]],
    },
    /// Speculative decoding, the target's half: row `i` feeds `inputs[i][0]` (its next token, as
    /// a [`StepPlan::Decode`] row would) at its next position `c` and its `k_i` drafts
    /// `inputs[i][1..]` at `c + 1..=c + k_i`, all in one launch; every position's logits are the
    /// bits a decode step of that token would give. Each position's device argmax comes back in
    /// [`StepResult::tokens`] (the row's [`RowOutput::run`]), and with
    /// [`Readback::HostLogits`] every position's logits, the row's rows consecutive from
    /// [`RowOutput::logits_row`]. [`Readback::ArgmaxMasked`] is
    /// [`DeviceError::Unsupported`](crate::DeviceError::Unsupported) (a mask depends on the
    /// tokens before it).
    ///
    /// Like `ReserveKv`, the step opens each row's reservation ledger entry at `c`, holding the
    /// blocks it added; [`Effect::TruncateKv`](crate::Effect::TruncateKv) then keeps the accepted
    /// positions and releases the rest through that entry. On a model with Mamba layers,
    /// `snapshots[i][j]` (a snapshot ring slot) receives the row's SSM state as it is after input
    /// `j` (`j < k_i`), the state to restore with
    /// [`Effect::SsmSnapshotRestore`](crate::Effect::SsmSnapshotRestore) when exactly `j` drafts
    /// are accepted; `snapshots` is empty or has one slice of `k_i` slots per row. The router
    /// also keeps every position's hidden state for [`Effect::SaveHiddenCatchup`](crate::Effect::SaveHiddenCatchup).
    Verify {
        /// Per row: its next token, then its drafts (at least one token).
        inputs: &'a [&'a [u32]],
        /// Empty, or per row the snapshot ring slots of its rewind points.
        snapshots: &'a [&'a [usize]],
        /// How the positions' results come back.
        readback: Readback<'a>,
    },
    /// Speculative decoding, the drafter's half (a router whose model has an MTP head; others
    /// answer [`DeviceError::Unsupported`](crate::DeviceError::Unsupported)): each row first
    /// catches its MTP head up with the main model over the positions whose hidden states its
    /// catch-up ring holds (the last of them with `tokens[i]`, the row's next token, which no step
    /// has computed yet), then drafts `k` tokens greedily, each from the one before (device
    /// argmax); row `i`'s drafts are `StepResult::tokens[i * k..(i + 1) * k]`. The MTP head's K/V
    /// at the draft positions is speculative and is overwritten by the next catch-up; the
    /// sequence's `computed_len` does not change.
    Draft {
        /// Per row: its next token.
        tokens: &'a [u32],
        /// Drafts per row, at least 1.
        k: usize,
    },
}

/// Where a row of a [`StepPlan::DecodeFed`] takes its input token from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feed {
    /// The argmax that row `r` of the previous launched step left in its device-side feed
    /// cell; that row must be the same sequence.
    Row(usize),
    /// A token the host knows.
    Host(u32),
}

impl StepPlan<'_> {
    /// How many rows the plan covers.
    pub fn rows(&self) -> usize {
        match self {
            StepPlan::Prefill { budgets, .. } => budgets.len(),
            StepPlan::Decode { tokens, .. } => tokens.len(),
            StepPlan::DecodeFed { sources, .. } => sources.len(),
            StepPlan::Verify { inputs, .. } => inputs.len(),
            StepPlan::Draft { tokens, .. } => tokens.len(),
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
    /// For `Verify` and `Draft` rows, where the row's tokens are in [`StepResult::tokens`] (and,
    /// for a `Verify` with host logits, how many consecutive logits rows it has).
    pub run: Option<TokenRun>,
}

/// A row's span of [`StepResult::tokens`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenRun {
    /// Index of the row's first token.
    pub start: usize,
    /// Its tokens.
    pub len: usize,
}

/// A settled step.
#[derive(Debug)]
pub struct StepResult<P> {
    /// The ticket that was awaited.
    pub ticket: Ticket,
    /// One output per row, in row order.
    pub rows: Vec<RowOutput>,
    /// The device's handle to the step's logits (one row per row that reached a token position,
    /// in row order), when the router keeps them. They stay readable with
    /// [`Effect::ReadLogits`](crate::Effect::ReadLogits) until `max_depth()` newer steps have
    /// been launched, so at depth 2 the host can copy step t's logits while step t+1 computes.
    pub logits: Option<P>,
    /// `Verify`: the device argmax of every position, row after row; `Draft`: the drafts, row
    /// after row; empty for other plans.
    pub tokens: Vec<u32>,
}
