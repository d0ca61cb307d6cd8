//! The router's flow against a real `kv_cache::BlockPool`: lookup, prefill with a branch
//! checkpoint, finish, KV pressure, and references that balance so every block is free again at
//! the end.
#![forbid(unsafe_code)]

use kv_cache::{BlockId, BlockPool, BlockState, KvError};
use ssm_snapshot::{BranchOutcome, CostModel, Namespace, SnapshotStore, StoreConfig, StoreDelta};

const B: usize = 4;

/// A running sequence as a router keeps it: its block table (one reference per block).
struct Sequence {
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
}

/// Prefills `prompt`: reuses the hit's blocks (taking a reference on each), allocates the rest,
/// takes the branch checkpoint if asked; then "decodes" `output` and finishes.
fn run(
    store: &mut SnapshotStore,
    pool: &mut BlockPool,
    prompt: &[u32],
    output: &[u32],
) -> (usize, Option<usize>) {
    let mut delta = StoreDelta::default();
    let mut hit_blocks = Vec::new();
    // The last prompt token is always computed, for its logits.
    let hit = store.lookup(
        Namespace::default(),
        &prompt[..prompt.len() - 1],
        &mut hit_blocks,
    );
    assert_eq!(hit_blocks.len(), hit.hit_tokens / B);
    let mut seq = Sequence {
        tokens: prompt.to_vec(),
        blocks: Vec::new(),
    };
    for &b in &hit_blocks {
        pool.retain(b).unwrap();
        seq.blocks.push(b);
    }
    if let Some(pos) = hit.branch_at {
        // The router stops the prefill chunk at `pos`, copies the SSM state, continues.
        let slot = store
            .reserve_checkpoint(&mut delta)
            .expect("room for a checkpoint");
        assert_eq!(
            store
                .commit_branch(&hit.pin, prompt, pos, slot, &mut delta)
                .unwrap(),
            BranchOutcome::Admitted
        );
    }
    seq.tokens.extend_from_slice(output);
    let needed = seq.tokens.len().div_ceil(B);
    while seq.blocks.len() < needed {
        seq.blocks.push(pool.allocate().expect("pool has room"));
    }
    // Finish: checkpoint at the end of the full blocks (the router keeps the state at the last
    // block boundary while decoding).
    let end = *store
        .finish_positions(hit.hit_tokens, seq.tokens.len())
        .end()
        * B;
    let slot = store
        .reserve_checkpoint(&mut delta)
        .expect("room for a checkpoint");
    store
        .finish(
            hit.pin,
            &seq.tokens,
            &seq.blocks,
            &[(end, slot)],
            &mut delta,
        )
        .unwrap();
    delta.apply_to_pool(pool).unwrap();
    for b in seq.blocks {
        pool.release(b).unwrap();
    }
    store.check_invariants().unwrap();
    (hit.hit_tokens, hit.branch_at)
}

#[test]
fn references_balance_through_a_conversation_and_eviction() {
    let mut pool = BlockPool::new(64, B).unwrap();
    let cost = CostModel::nvidia_hybrid_7b();
    let mut store = SnapshotStore::new(StoreConfig::engine(
        cost.clone(),
        B as u32,
        8 * cost.checkpoint_bytes(),
    ))
    .unwrap();
    assert_eq!(store.slots().len(), 8);

    let turn1: Vec<u32> = (0..10).collect();
    let reply1: Vec<u32> = (100..107).collect();
    assert_eq!(run(&mut store, &mut pool, &turn1, &reply1), (0, None));
    // 17 tokens: 4 full blocks cached (16 tokens), the partial fifth freed with the sequence.
    assert_eq!(store.held_block_count(), 4);
    assert_eq!(pool.used_blocks(), 4);

    // The next turn extends turn 1 + reply 1: a hit at 16.
    let mut turn2 = turn1.clone();
    turn2.extend(&reply1);
    turn2.extend(200..210);
    assert_eq!(run(&mut store, &mut pool, &turn2, &[300, 301]), (16, None));

    // A regenerate of turn 1 with a different question diverges at token 8: a branch at 8.
    let mut other: Vec<u32> = (0..8).collect();
    other.extend(900..912);
    assert_eq!(run(&mut store, &mut pool, &other, &[1, 2, 3]), (0, Some(8)));
    // A third variant now hits the branch checkpoint.
    let mut third: Vec<u32> = (0..8).collect();
    third.extend(500..505);
    assert_eq!(run(&mut store, &mut pool, &third, &[]), (8, None));

    // KV pressure: the router asks for 64 blocks; the tree gives up every leaf.
    let mut delta = StoreDelta::default();
    let released = store.evict_for_kv(64, &mut delta);
    assert_eq!(released, delta.release_blocks.len());
    delta.apply_to_pool(&mut pool).unwrap();
    delta.clear();
    store.clear_unpinned(&mut delta);
    delta.apply_to_pool(&mut pool).unwrap();
    assert_eq!(store.held_block_count(), 0);
    assert_eq!(store.slots().free_count(), 8);
    assert_eq!(pool.free_blocks(), 64);
    assert!((0..64).all(|i| pool.state(BlockId(i)) == Some(BlockState::Free)));
}

#[test]
fn a_delta_that_does_not_fit_the_pool_changes_nothing() {
    let mut pool = BlockPool::new(4, B).unwrap();
    let held = pool.allocate().unwrap();
    let delta = StoreDelta {
        retain_blocks: vec![held, BlockId(3)],
        release_blocks: vec![],
        freed_slots: vec![],
    };
    assert_eq!(
        delta.apply_to_pool(&mut pool).unwrap_err(),
        KvError::RetainFree { block: BlockId(3) }
    );
    assert_eq!(pool.ref_count(held), 1);
    let delta = StoreDelta {
        retain_blocks: vec![held],
        release_blocks: vec![BlockId(2)],
        freed_slots: vec![],
    };
    assert_eq!(
        delta.apply_to_pool(&mut pool).unwrap_err(),
        KvError::NotHeld { block: BlockId(2) }
    );
    assert_eq!(pool.ref_count(held), 1);
}

#[test]
fn a_detached_copy_holds_the_cache_without_the_sequences_in_flight() {
    let mut pool = BlockPool::new(64, B).unwrap();
    let cost = CostModel::nvidia_hybrid_7b();
    let mut store = SnapshotStore::new(StoreConfig::engine(
        cost.clone(),
        B as u32,
        8 * cost.checkpoint_bytes(),
    ))
    .unwrap();
    let turn1: Vec<u32> = (0..10).collect();
    let reply1: Vec<u32> = (100..107).collect();
    run(&mut store, &mut pool, &turn1, &reply1);
    let mut other: Vec<u32> = (0..8).collect();
    other.extend(900..912);
    run(&mut store, &mut pool, &other, &[1, 2, 3]);
    // A sequence in flight: its hit path is pinned and it holds a reserved checkpoint slot.
    let mut delta = StoreDelta::default();
    let mut hit_blocks = Vec::new();
    let prompt: Vec<u32> = (0..8).chain(500..505).collect();
    let hit = store.lookup(Namespace::default(), &prompt, &mut hit_blocks);
    assert_eq!(hit.hit_tokens, 8);
    let slot = store.reserve_checkpoint(&mut delta).expect("room");
    let cached = store.cached_checkpoints();
    assert_eq!(cached.len(), 3);

    let mut copy = store.detached_copy();
    copy.check_invariants().unwrap();
    assert_eq!(copy.cached_checkpoints(), cached);
    assert_eq!(copy.held_block_count(), store.held_block_count());
    assert_eq!(store.slots().reserved_count(), 1);
    assert_eq!(copy.slots().reserved_count(), 0);
    assert_eq!(copy.bytes(), store.bytes() - cost.checkpoint_bytes());
    // Nothing is pinned in the copy: all of it can go, while the original keeps the hit path
    // (the node at 8, its checkpoint and its two blocks) for the running sequence.
    let mut copy_delta = StoreDelta::default();
    copy.clear_unpinned(&mut copy_delta);
    copy.check_invariants().unwrap();
    assert_eq!(copy.held_block_count(), 0);
    assert_eq!(copy.slots().cached_count(), 0);
    delta.clear();
    store.clear_unpinned(&mut delta);
    assert_eq!(store.held_block_count(), 2);
    assert_eq!(store.slots().cached_count(), 1);
    // The original's sequence is unaffected by the copy: it finishes with its reserved slot.
    let mut table = hit_blocks.clone();
    table.push(pool.allocate().expect("pool has room"));
    store
        .finish(hit.pin, &prompt, &table, &[(12, slot)], &mut delta)
        .unwrap();
    store.check_invariants().unwrap();
    assert_eq!(store.slots().reserved_count(), 0);
    assert_eq!(store.slots().cached_count(), 2);
}
