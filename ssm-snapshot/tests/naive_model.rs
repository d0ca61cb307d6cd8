//! Property tests of the store against a naive model: a map from cached token prefixes to their
//! checkpoint slots and KV blocks, kept up to date from the calls made and the deltas reported.
//! Checked after every call: lookups give exactly the longest prefix the model holds a checkpoint
//! for, with the model's blocks and slot; branch points and branch outcomes match the model's
//! prediction; block references balance (never two, never released unheld); the byte budget holds
//! and equals the model's byte count; the store's own invariants hold. The model does not predict
//! eviction victims, so every eviction setting is covered: α, FLOP basis, the four recency bases,
//! guarded admission (reservations through the sequence's pin).
#![forbid(unsafe_code)]

use std::collections::HashMap;

use kv_cache::BlockId;
use proptest::prelude::*;
use ssm_snapshot::{
    Admission, BranchOutcome, BudgetScope, CostCoefficients, CostModel, FlopBasis, Hit, Namespace,
    Pin, PinScope, Recency, SlotId, SnapshotStore, StoreConfig, StoreDelta,
};

#[derive(Debug, Clone)]
enum Op {
    /// Look up `input` in namespace `ns`; the sequence will finish with `input ++ output`.
    Start {
        ns: u32,
        input: Vec<u32>,
        output: Vec<u32>,
    },
    /// Take the branch checkpoint of running sequence `i` (mod the number running).
    Branch(usize),
    /// Finish running sequence `i`.
    Finish(usize),
    /// Abort running sequence `i`.
    Release(usize),
    /// Ask for `n` blocks of KV.
    EvictKv(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let tokens = |max| proptest::collection::vec(0u32..3, 0..max);
    prop_oneof![
        4 => (0u32..2, tokens(12), tokens(6)).prop_map(|(ns, input, output)| Op::Start { ns, input, output }),
        2 => (0usize..4).prop_map(Op::Branch),
        4 => (0usize..4).prop_map(Op::Finish),
        1 => (0usize..4).prop_map(Op::Release),
        1 => (0usize..6).prop_map(Op::EvictKv),
    ]
}

struct Running {
    pin: Pin,
    ns: Namespace,
    input: Vec<u32>,
    full: Vec<u32>,
    hit_tokens: usize,
    hit_blocks: Vec<BlockId>,
    branch_at: Option<usize>,
}

/// The naive model: what is cached, keyed by (namespace, token prefix).
#[derive(Default)]
struct Model {
    checkpoints: HashMap<(Namespace, Vec<u32>), SlotId>,
    slot_owner: HashMap<SlotId, (Namespace, Vec<u32>)>,
    blocks: HashMap<(Namespace, Vec<u32>), BlockId>,
    block_owner: HashMap<BlockId, (Namespace, Vec<u32>)>,
    references: HashMap<BlockId, u32>,
    reserved: usize,
}

impl Model {
    /// Applies a delta: every freed slot is either an evicted checkpoint of the model or one of
    /// `dropped` (slots the model predicted would be given back unused).
    fn apply(&mut self, delta: &StoreDelta, dropped: &[SlotId]) -> Result<(), TestCaseError> {
        for &b in &delta.retain_blocks {
            let count = self.references.entry(b).or_insert(0);
            *count += 1;
            prop_assert_eq!(*count, 1, "block {:?} retained twice", b);
        }
        for &b in &delta.release_blocks {
            prop_assert_eq!(
                self.references.remove(&b),
                Some(1),
                "block {:?} released but not held",
                b
            );
            let key = self.block_owner.remove(&b);
            prop_assert!(key.is_some(), "released block {:?} unknown to the model", b);
            if let Some(key) = key {
                self.blocks.remove(&key);
            }
        }
        for &slot in &delta.freed_slots {
            if let Some(key) = self.slot_owner.remove(&slot) {
                self.checkpoints.remove(&key);
            } else {
                prop_assert!(
                    dropped.contains(&slot),
                    "slot {:?} freed but neither cached nor dropped",
                    slot
                );
            }
        }
        Ok(())
    }

    fn has_kv(&self, ns: Namespace, tokens: &[u32], block: usize) -> bool {
        (1..=tokens.len() / block).all(|i| {
            self.blocks
                .contains_key(&(ns, tokens[..i * block].to_vec()))
        })
    }

    fn expected_hit(
        &self,
        ns: Namespace,
        tokens: &[u32],
        block: usize,
    ) -> (usize, Option<SlotId>, Vec<BlockId>) {
        let n = tokens.len() / block * block;
        let hit = (1..=n / block)
            .rev()
            .map(|i| i * block)
            .find(|&p| self.checkpoints.contains_key(&(ns, tokens[..p].to_vec())))
            .unwrap_or(0);
        let slot = (hit > 0).then(|| self.checkpoints[&(ns, tokens[..hit].to_vec())]);
        let blocks = (1..=hit / block)
            .filter_map(|i| {
                self.blocks
                    .get(&(ns, tokens[..i * block].to_vec()))
                    .copied()
            })
            .collect();
        (hit, slot, blocks)
    }

    fn check_store(&self, store: &SnapshotStore) -> Result<(), TestCaseError> {
        store.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert!(store.bytes() <= store.config().budget_bytes);
        let cost = &store.config().cost;
        let expected_bytes = (self.checkpoints.len() + self.reserved) as u64
            * cost.checkpoint_bytes()
            + self.blocks.len() as u64
                * cost.kv_bytes_per_token()
                * u64::from(store.config().block_size);
        prop_assert_eq!(store.bytes(), expected_bytes);
        let mut cached: Vec<(Namespace, Vec<u32>, SlotId)> = store
            .cached_checkpoints()
            .into_iter()
            .map(|c| (c.namespace, c.tokens, c.slot))
            .collect();
        cached.sort();
        let mut model: Vec<(Namespace, Vec<u32>, SlotId)> = self
            .checkpoints
            .iter()
            .map(|((ns, t), &s)| (*ns, t.clone(), s))
            .collect();
        model.sort();
        prop_assert_eq!(cached, model);
        let mut blocks: Vec<(Namespace, Vec<u32>, BlockId)> = store.cached_blocks();
        blocks.sort();
        let mut model: Vec<(Namespace, Vec<u32>, BlockId)> = self
            .blocks
            .iter()
            .map(|((ns, t), &b)| (*ns, t.clone(), b))
            .collect();
        model.sort();
        prop_assert_eq!(blocks, model);
        Ok(())
    }
}

fn unit_cost() -> CostModel {
    CostModel::new(CostCoefficients {
        name: "unit".into(),
        attention_layers: 1,
        mamba_layers: 1,
        mlp_layers: 1,
        attention_linear_flops_per_token: 1.0,
        attention_quadratic_flops: 0.5,
        mamba_flops_per_token: 1.0,
        mlp_flops_per_token: 1.0,
        kv_bytes_per_token: 1,
        checkpoint_bytes: 10,
    })
    .expect("valid cost")
}

#[allow(clippy::too_many_arguments)] // One call site: the proptest's generated parameters.
fn run(
    block_size: u32,
    slots: u32,
    budget: u64,
    alpha: f64,
    every_block: bool,
    marginal: bool,
    recency: Recency,
    guard: bool,
    pin_scope: PinScope,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let block = block_size as usize;
    let mut store = SnapshotStore::new(StoreConfig {
        block_size,
        checkpoint_slots: slots,
        budget_bytes: budget,
        budget_scope: BudgetScope::CheckpointsAndKv,
        admission: if every_block {
            Admission::EveryBlock
        } else {
            Admission::Marconi
        },
        alpha,
        recency,
        flop_basis: if marginal {
            FlopBasis::Marginal
        } else {
            FlopBasis::Prefix
        },
        guard,
        pin_scope,
        cost: unit_cost(),
    })
    .expect("valid config");
    let mut model = Model::default();
    let mut running: Vec<Running> = Vec::new();
    let mut delta = StoreDelta::default();
    let mut next_block = 0u32;
    for op in ops {
        delta.clear();
        match op {
            Op::Start { ns, input, output } => {
                let ns = Namespace {
                    adapter: ns,
                    salt: 7,
                };
                let mut table = Vec::new();
                let Hit {
                    pin,
                    hit_tokens,
                    checkpoint,
                    branch_at,
                    matched_tokens,
                } = store.lookup(ns, &input, &mut table);
                let (hit, slot, blocks) = model.expected_hit(ns, &input, block);
                prop_assert_eq!((hit_tokens, checkpoint, &table), (hit, slot, &blocks));
                let n = input.len() / block * block;
                let matched = (0..=n / block)
                    .rev()
                    .map(|i| i * block)
                    .find(|&p| model.has_kv(ns, &input[..p], block))
                    .unwrap_or(0);
                prop_assert_eq!(matched_tokens, matched);
                let bare = !model
                    .checkpoints
                    .contains_key(&(ns, input[..matched].to_vec()));
                let branch =
                    (!every_block && matched < n && matched > 0 && bare).then_some(matched);
                prop_assert_eq!(branch_at, branch);
                let mut full = input.clone();
                full.extend(output);
                running.push(Running {
                    pin,
                    ns,
                    input,
                    full,
                    hit_tokens,
                    hit_blocks: table,
                    branch_at,
                });
            }
            Op::Branch(i) if !running.is_empty() => {
                let i = i % running.len();
                let Some(pos) = running[i].branch_at.take() else {
                    continue;
                };
                let slot = if guard {
                    store
                        .reserve_checkpoint_for(&running[i].pin, &mut delta)
                        .expect("held pin")
                } else {
                    store.reserve_checkpoint(&mut delta)
                };
                let Some(slot) = slot else {
                    model.apply(&delta, &[])?;
                    model.check_store(&store)?;
                    continue;
                };
                model.apply(&delta, &[])?;
                delta.clear();
                let r = &running[i];
                let prefix = r.input[..pos].to_vec();
                let expected = if !model.has_kv(r.ns, &prefix, block) {
                    BranchOutcome::PathGone
                } else if model.checkpoints.contains_key(&(r.ns, prefix.clone())) {
                    BranchOutcome::Duplicate
                } else {
                    BranchOutcome::Admitted
                };
                let outcome = store
                    .commit_branch(&r.pin, &r.input, pos, slot, &mut delta)
                    .expect("valid branch");
                prop_assert_eq!(outcome, expected);
                if outcome == BranchOutcome::Admitted {
                    model.checkpoints.insert((r.ns, prefix.clone()), slot);
                    model.slot_owner.insert(slot, (r.ns, prefix));
                }
                model.apply(&delta, &[slot])?;
            }
            Op::Finish(i) if !running.is_empty() => {
                let r = running.swap_remove(i % running.len());
                let mut checkpoints = Vec::new();
                for index in store.finish_positions(r.hit_tokens, r.full.len()).rev() {
                    delta.clear();
                    let slot = if guard {
                        store
                            .reserve_checkpoint_for(&r.pin, &mut delta)
                            .expect("held pin")
                    } else {
                        store.reserve_checkpoint(&mut delta)
                    };
                    model.apply(&delta, &[])?;
                    match slot {
                        Some(slot) => {
                            model.reserved += 1;
                            checkpoints.push((index * block, slot));
                        }
                        None => break,
                    }
                    model.check_store(&store)?;
                }
                checkpoints.reverse();
                let n = r.full.len() / block;
                let mut table = r.hit_blocks.clone();
                while table.len() < n {
                    table.push(BlockId(next_block));
                    next_block += 1;
                }
                // The model's prediction: checkpoints at new positions are admitted, the rest
                // dropped; blocks up to the last checkpoint that the model lacks are adopted.
                let mut dropped = Vec::new();
                let mut adopted = Vec::new();
                let last = checkpoints.last().map_or(0, |&(p, _)| p);
                for b in 1..=last / block {
                    let key = (r.ns, r.full[..b * block].to_vec());
                    if !model.blocks.contains_key(&key) {
                        model.blocks.insert(key.clone(), table[b - 1]);
                        model.block_owner.insert(table[b - 1], key);
                        adopted.push(table[b - 1]);
                    }
                }
                for &(pos, slot) in &checkpoints {
                    let key = (r.ns, r.full[..pos].to_vec());
                    if model.checkpoints.contains_key(&key) {
                        dropped.push(slot);
                    } else {
                        model.checkpoints.insert(key.clone(), slot);
                        model.slot_owner.insert(slot, key);
                    }
                }
                model.reserved -= checkpoints.len();
                delta.clear();
                let report = store
                    .finish(r.pin, &r.full, &table, &checkpoints, &mut delta)
                    .expect("valid finish");
                prop_assert_eq!(report.dropped_checkpoints, dropped.len());
                prop_assert_eq!(
                    report.admitted_checkpoints,
                    checkpoints.len() - dropped.len()
                );
                prop_assert_eq!(&delta.retain_blocks, &adopted);
                model.apply(&delta, &dropped)?;
            }
            Op::Release(i) if !running.is_empty() => {
                let r = running.swap_remove(i % running.len());
                store.release(r.pin).expect("held pin");
            }
            Op::EvictKv(n) => {
                let released = store.evict_for_kv(n, &mut delta);
                prop_assert_eq!(released, delta.release_blocks.len());
                model.apply(&delta, &[])?;
                if released < n {
                    // Short only when no unpinned leaf is left.
                    delta.clear();
                    prop_assert_eq!(store.evict_for_kv(1, &mut delta), 0);
                }
            }
            _ => {}
        }
        model.check_store(&store)?;
    }
    for r in running.drain(..) {
        store.release(r.pin).expect("held pin");
    }
    delta.clear();
    store.clear_unpinned(&mut delta);
    model.apply(&delta, &[])?;
    prop_assert!(
        model.references.is_empty(),
        "references left: {:?}",
        model.references
    );
    prop_assert_eq!(store.bytes(), 0);
    prop_assert_eq!(store.node_count(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn store_agrees_with_the_naive_model(
        block_size in 1u32..4,
        slots in 2u32..8,
        budget in 20u64..120,
        alpha in prop_oneof![Just(0.0), 0.0f64..4.0],
        every_block in proptest::bool::weighted(0.25),
        marginal in any::<bool>(),
        recency in prop_oneof![
            Just(Recency::Path),
            Just(Recency::Own),
            Just(Recency::Shared),
            Just(Recency::Adaptive),
        ],
        guard in any::<bool>(),
        hit_pins in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let pin_scope = if hit_pins { PinScope::HitCheckpoint } else { PinScope::Path };
        run(block_size, slots, budget, alpha, every_block, marginal, recency, guard, pin_scope, ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Long runs under guarded admission: enough hits for the store to measure hit ages, so that
    /// live entries are protected and missed sequences are refused or evicted first.
    #[test]
    fn guarded_store_agrees_with_the_naive_model(
        block_size in 1u32..3,
        slots in 3u32..8,
        budget in 40u64..120,
        alpha in prop_oneof![Just(0.0), 0.0f64..4.0],
        recency in prop_oneof![Just(Recency::Path), Just(Recency::Adaptive)],
        hit_pins in any::<bool>(),
        ops in proptest::collection::vec(op(), 150..300),
    ) {
        let pin_scope = if hit_pins { PinScope::HitCheckpoint } else { PinScope::Path };
        run(block_size, slots, budget, alpha, false, true, recency, true, pin_scope, ops)?;
    }
}
