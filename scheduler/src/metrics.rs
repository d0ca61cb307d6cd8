//! Counters the engine keeps over its lifetime, and what one step did.

use serde::Serialize;

/// Cumulative counters of an engine. Every field only grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Metrics {
    /// Steps run.
    pub steps: u64,
    /// `Prefill` plans that settled.
    pub prefill_launches: u64,
    /// `Decode` plans that settled.
    pub decode_launches: u64,
    /// Rows of the `Decode` plans that settled (over `decode_launches`: the mean decode batch).
    pub decode_rows: u64,
    /// Prompt tokens the router computed (including recompute after preemption).
    pub prefill_tokens_computed: u64,
    /// Prompt tokens the router served from the prefix cache.
    pub prefill_tokens_cached: u64,
    /// First prefill chunks that were served (partly) from the prefix cache; on a hybrid model
    /// each one restored a Marconi SSM checkpoint.
    pub prefix_hits: u64,
    /// Tokens generated (delivered to streams).
    pub generated_tokens: u64,
    /// Requests admitted for the first time.
    pub admitted: u64,
    /// Requests that finished normally (length or stop token).
    pub finished: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Requests that failed while being served.
    pub failed: u64,
    /// Preemptions (either kind).
    pub preemptions: u64,
    /// Preemptions that spilled the sequence's image.
    pub spills: u64,
    /// Spilled sequences restored.
    pub restores: u64,
    /// Preemptions that released the sequence for recompute (including failed spills or restores,
    /// and sequences requeued before they held anything).
    pub recomputes: u64,
    /// Spills or restores that failed and fell back to recompute.
    pub spill_fallbacks: u64,
    /// Spilled images refused at restore because they were not what the engine spilled (an
    /// earlier image of the same request, another store's, a file replaced or of the wrong
    /// kind, a corrupt envelope, or a restored sequence whose length or tokens differ); each
    /// fell back to recompute (also counted in `spill_fallbacks`).
    pub spill_images_rejected: u64,
    /// Times the spill directory had disappeared (or been replaced) and a fresh private one was
    /// created for the next spill.
    pub spill_directory_recreations: u64,
    /// `CompactSlot` effects applied.
    pub compactions: u64,
    /// `MarconiCheckpoint` effects applied.
    pub marconi_checkpoints: u64,
    /// `MarconiCheckpoint` effects the router refused (the request continues; only caching loses).
    pub marconi_checkpoint_failures: u64,
    /// Sequences whose release failed twice; the engine retries it every step (and before
    /// teardown) until the router takes them back.
    pub orphaned_sequences: u64,
    /// `DecodeFed` steps launched ahead of the host (depth 2); each also counts in
    /// `decode_launches` once it settles.
    pub fed_launches: u64,
    /// Over-runs discarded and undone with `Rollback` (rows that stopped or were cancelled while
    /// their next step was already computing).
    pub rollbacks: u64,
    /// `Rollback`s the router refused (those sequences are released without caching).
    pub rollback_failures: u64,
    /// Steps that found a step in flight and could not run ahead (admission, prefill work, a
    /// compaction, host logits, a dry pool), so awaited it first and ran at depth 1.
    pub pipeline_drains: u64,
    /// Cache-event subscriptions ended because their subscriber fell a whole backlog behind (see
    /// [`crate::cache_events`]); counted as of the latest step or control call.
    pub cache_event_lags: u64,
    /// LoRA commands applied (acknowledged by the router).
    pub lora_commands: u64,
    /// Steps in flight drained because a LoRA command arrived (depth 2).
    pub lora_drains: u64,
    /// `Verify` plans that settled (speculative decoding; each also counts in `decode_launches`).
    pub verify_launches: u64,
    /// `Draft` plans that settled (the router's MTP head).
    pub draft_launches: u64,
    /// `Draft` plans the router refused (those steps verified without drafts) or that failed on
    /// the device (their rows failed).
    pub draft_failures: u64,
    /// Rows a settled `Draft` proposed no drafts for, though they had a budget: the router's MTP
    /// head had no catch-up state for them (the hidden state of the row's latest position: the
    /// core kept none, or the row was restored from a version-1 spill image, which carries no
    /// catch-up ring); each costs that row's drafts for one step.
    pub draft_misses: u64,
    /// Verification rows that carried at least one draft.
    pub spec_rows: u64,
    /// Drafts verified.
    pub drafted: u64,
    /// Drafts accepted (equal to the token chosen at their position).
    pub accepted: u64,
    /// Tokens emitted by rows that carried drafts (accepted drafts plus the target's tokens);
    /// over `spec_rows`, the tokens per target step of a speculating row.
    pub spec_tokens: u64,
    /// Rows whose rejected positions were truncated (`TruncateKv` and `SsmSnapshotRestore`).
    pub spec_rollbacks: u64,
    /// `Verify` plans launched without being awaited at once (depth 2: another cohort's
    /// verification settles while this one computes); each also counts in `verify_launches`
    /// once it settles.
    pub spec_flights: u64,
    /// Rows of a verification in flight that had ended (cancelled) before it settled: their
    /// output was discarded and every position it computed dropped with `TruncateKv`.
    pub spec_discards: u64,
}

impl Metrics {
    /// What was counted since `earlier` (a snapshot of the same engine).
    pub fn since(&self, earlier: &Metrics) -> Metrics {
        Metrics {
            steps: self.steps - earlier.steps,
            prefill_launches: self.prefill_launches - earlier.prefill_launches,
            decode_launches: self.decode_launches - earlier.decode_launches,
            decode_rows: self.decode_rows - earlier.decode_rows,
            prefill_tokens_computed: self.prefill_tokens_computed - earlier.prefill_tokens_computed,
            prefill_tokens_cached: self.prefill_tokens_cached - earlier.prefill_tokens_cached,
            prefix_hits: self.prefix_hits - earlier.prefix_hits,
            generated_tokens: self.generated_tokens - earlier.generated_tokens,
            admitted: self.admitted - earlier.admitted,
            finished: self.finished - earlier.finished,
            cancelled: self.cancelled - earlier.cancelled,
            failed: self.failed - earlier.failed,
            preemptions: self.preemptions - earlier.preemptions,
            spills: self.spills - earlier.spills,
            restores: self.restores - earlier.restores,
            recomputes: self.recomputes - earlier.recomputes,
            spill_fallbacks: self.spill_fallbacks - earlier.spill_fallbacks,
            spill_images_rejected: self.spill_images_rejected - earlier.spill_images_rejected,
            spill_directory_recreations: self.spill_directory_recreations
                - earlier.spill_directory_recreations,
            compactions: self.compactions - earlier.compactions,
            marconi_checkpoints: self.marconi_checkpoints - earlier.marconi_checkpoints,
            marconi_checkpoint_failures: self.marconi_checkpoint_failures
                - earlier.marconi_checkpoint_failures,
            orphaned_sequences: self.orphaned_sequences - earlier.orphaned_sequences,
            fed_launches: self.fed_launches - earlier.fed_launches,
            rollbacks: self.rollbacks - earlier.rollbacks,
            rollback_failures: self.rollback_failures - earlier.rollback_failures,
            pipeline_drains: self.pipeline_drains - earlier.pipeline_drains,
            cache_event_lags: self.cache_event_lags - earlier.cache_event_lags,
            lora_commands: self.lora_commands - earlier.lora_commands,
            lora_drains: self.lora_drains - earlier.lora_drains,
            verify_launches: self.verify_launches - earlier.verify_launches,
            draft_launches: self.draft_launches - earlier.draft_launches,
            draft_failures: self.draft_failures - earlier.draft_failures,
            draft_misses: self.draft_misses - earlier.draft_misses,
            spec_rows: self.spec_rows - earlier.spec_rows,
            drafted: self.drafted - earlier.drafted,
            accepted: self.accepted - earlier.accepted,
            spec_tokens: self.spec_tokens - earlier.spec_tokens,
            spec_rollbacks: self.spec_rollbacks - earlier.spec_rollbacks,
            spec_flights: self.spec_flights - earlier.spec_flights,
            spec_discards: self.spec_discards - earlier.spec_discards,
        }
    }
}

/// What one [`crate::Engine::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepReport {
    /// Requests moved from the queue to running (new, restored or recomputing).
    pub admitted: usize,
    /// Rows of the settled `Decode` plan.
    pub decode_rows: usize,
    /// Rows of the settled `Prefill` plan.
    pub prefill_rows: usize,
    /// Prompt tokens computed by the `Prefill` plan.
    pub prefill_tokens: usize,
    /// Preemptions during the step.
    pub preempted: usize,
    /// Requests that ended during the step (finished, cancelled or failed).
    pub ended: usize,
}
