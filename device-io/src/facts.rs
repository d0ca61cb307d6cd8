//! `DeviceFacts`: a snapshot of a router's resources.

/// A snapshot of a router's resources, for admission decisions and accounting checks.
///
/// Invariant: `kv_blocks_free + kv_blocks_cached <= kv_blocks_total`; the blocks neither free nor
/// cached are held by running sequences. A cached block may also be held by a running sequence
/// that shares it; `kv_blocks_cached` counts it once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceFacts {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Vocabulary size of the model served.
    pub vocab_size: usize,
    /// The longest sequence (prompt plus generated tokens) the router accepts.
    pub max_context: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// KV blocks nobody holds and no cache keeps.
    pub kv_blocks_free: usize,
    /// KV blocks the prefix cache keeps (held by a sequence or evictable).
    pub kv_blocks_cached: usize,
    /// Live-state slots (one per running sequence).
    pub live_slots_total: usize,
    /// Live-state slots owned by a sequence.
    pub live_slots_used: usize,
    /// SSM checkpoint slots of the prefix cache's region.
    pub checkpoint_slots_total: usize,
    /// SSM checkpoint slots that hold a checkpoint.
    pub checkpoint_slots_used: usize,
    /// Snapshot ring slots (`SsmSnapshotSave`, and the rewind points a `Verify` writes): a core
    /// that speculates with `k` drafts per row needs at least `k`.
    pub snapshot_slots_total: usize,
}
