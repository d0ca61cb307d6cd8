//! `Sequence`: what the core needs of any router's per-sequence bookkeeping.

/// What the core passes to create a sequence for a request.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpec<'a> {
    /// The request's id, unique among live sequences.
    pub id: u64,
    /// The prompt's token ids (validated by the core: non-empty, inside the vocabulary).
    pub prompt: &'a [u32],
    /// The LoRA adapter, part of the prefix cache's key.
    pub adapter: Option<u32>,
    /// The tenant's cache salt, part of the prefix cache's key: two tenants never share a cached
    /// block unless they share a salt.
    pub cache_salt: Option<u64>,
}

/// What the core needs of a router's [`DeviceIo::Seq`](crate::DeviceIo::Seq).
///
/// A new sequence holds no device resources; its first `Prefill` step gives it a live slot and
/// blocks. Preemption by recompute releases it and creates a new one whose prompt is the old
/// prompt plus the tokens generated so far.
pub trait Sequence: Send + Sized {
    /// Creates the bookkeeping for a request; touches no device memory.
    fn create(spec: SeqSpec<'_>) -> Self;
    /// The request's id.
    fn id(&self) -> u64;
    /// The prompt's length in tokens.
    fn prompt_len(&self) -> usize;
    /// The prompt, then every token fed to the sequence since: `tokens()[..computed_len()]` are
    /// the tokens whose KV and state exist. The core checks a restored sequence against what it
    /// spilled with it. A position fed on the device by a `DecodeFed` step ([`crate::Feed::Row`])
    /// may hold a placeholder until the router has been handed the sequence again after that
    /// step finished (a pipelined router learns the token only then).
    fn tokens(&self) -> &[u32];
    /// Positions whose KV and state exist on the device (cached, computed or decoded).
    fn computed_len(&self) -> usize;
    /// Whether the whole prompt has been computed (or served from cache).
    fn prefill_done(&self) -> bool {
        self.computed_len() >= self.prompt_len()
    }
    /// The live-state slot the sequence owns, if any.
    fn slot(&self) -> Option<usize>;
    /// Whether the prefix cache's policy asked for an [`Effect::MarconiCheckpoint`](crate::Effect::MarconiCheckpoint)
    /// of this sequence's current state (set by the router after a step that reached a block
    /// boundary the policy admits; cleared by the effect).
    fn checkpoint_due(&self) -> bool {
        false
    }
}
