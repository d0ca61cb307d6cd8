//! A scripted router for testing code written against the contract (feature `testing`).
//!
//! [`ScriptedRouter`] computes nothing. It keeps honest bookkeeping of slots and blocks (so
//! exhaustion, compaction, spills and leaks are observable through [`DeviceFacts`]), answers each
//! token position with a token from its script (or, once the script is empty, a deterministic
//! function of the sequence id and position), records every effect's label, and can inject a
//! fault into the next launch or into the next effect of a given name.
//!
//! Invariants of its state: a slot is owned by at most one sequence; `blocks_used` equals the sum
//! of the blocks every live sequence holds; a settled ticket is removed, so it cannot be claimed
//! twice.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, Label, LoraCommand, Phase,
    PrefillReport, Readback, Result, RowOutput, SeqSpec, Sequence, StepPlan, StepResult, Ticket,
};

/// The per-sequence bookkeeping of a [`ScriptedRouter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedSeq {
    id: u64,
    prompt_len: usize,
    computed: usize,
    slot: Option<usize>,
    blocks: usize,
    reserved: usize,
}

impl ScriptedSeq {
    /// Blocks the sequence holds.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

impl Sequence for ScriptedSeq {
    fn create(spec: SeqSpec<'_>) -> Self {
        ScriptedSeq {
            id: spec.id,
            prompt_len: spec.prompt.len(),
            computed: 0,
            slot: None,
            blocks: 0,
            reserved: 0,
        }
    }
    fn id(&self) -> u64 {
        self.id
    }
    fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    fn computed_len(&self) -> usize {
        self.computed
    }
    fn slot(&self) -> Option<usize> {
        self.slot
    }
}

/// The shape of a [`ScriptedRouter`].
#[derive(Debug, Clone, Copy)]
pub struct ScriptedConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Live-state slots.
    pub num_slots: usize,
    /// Vocabulary size (tokens answered are below it).
    pub vocab_size: usize,
    /// 1, or 2 to accept `DecodeFed` and keep a reservation ledger.
    pub max_depth: usize,
}

impl Default for ScriptedConfig {
    fn default() -> Self {
        ScriptedConfig {
            block_size: 4,
            num_blocks: 64,
            num_slots: 8,
            vocab_size: 256,
            max_depth: 1,
        }
    }
}

/// Where the next injected fault strikes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultAt {
    /// The next `launch`.
    Launch,
    /// The next effect with this name (`"ReleaseSeq"`, `"CompactSlot"`, ...).
    Effect(&'static str),
}

#[derive(Debug)]
struct State {
    slots: Vec<bool>,
    blocks_used: usize,
    next_ticket: u64,
    settled: BTreeMap<u64, StepResult<u64>>,
    script: VecDeque<u32>,
    faults: Vec<(FaultAt, DeviceError)>,
    effects: Vec<String>,
}

/// A router that answers from a script; see the module docs.
#[derive(Debug)]
pub struct ScriptedRouter {
    config: ScriptedConfig,
    state: Mutex<State>,
}

impl ScriptedRouter {
    /// An empty router of the given shape.
    pub fn new(config: ScriptedConfig) -> Self {
        let state = State {
            slots: vec![false; config.num_slots],
            blocks_used: 0,
            next_ticket: 1,
            settled: BTreeMap::new(),
            script: VecDeque::new(),
            faults: Vec::new(),
            effects: Vec::new(),
        };
        ScriptedRouter {
            config,
            state: Mutex::new(state),
        }
    }

    /// Queues tokens to answer, in order, before the deterministic fallback.
    pub fn script(&self, tokens: &[u32]) {
        self.lock().script.extend(tokens.iter().copied());
    }

    /// Makes the next call at `at` fail with `error` (and change nothing).
    pub fn inject(&self, at: FaultAt, error: DeviceError) {
        self.lock().faults.push((at, error));
    }

    /// The labels of every effect applied so far, successful or not.
    pub fn effects(&self) -> Vec<String> {
        self.lock().effects.clone()
    }

    /// Takes the labels of the effects applied so far, leaving the record empty.
    pub fn take_effects(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().effects)
    }

    /// The token answered when the script is empty: a fixed function of id and position.
    pub fn fallback_token(&self, id: u64, pos: usize) -> u32 {
        let mixed = id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        (mixed % self.config.vocab_size as u64) as u32
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn take_fault(state: &mut State, at: &FaultAt) -> Option<DeviceError> {
        let index = state
            .faults
            .iter()
            .position(|(fault_at, _)| fault_at == at)?;
        Some(state.faults.remove(index).1)
    }

    fn answer(&self, state: &mut State, seq: &ScriptedSeq) -> u32 {
        state
            .script
            .pop_front()
            .unwrap_or_else(|| self.fallback_token(seq.id, seq.computed))
    }
}

impl DeviceIo for ScriptedRouter {
    type Seq = ScriptedSeq;
    type Ptr = u64;
    type Model = ScriptedConfig;
    type LoraCmd = LoraCommand;
    type LoraAck = ();

    fn model(&self) -> &ScriptedConfig {
        &self.config
    }

    fn facts(&self) -> DeviceFacts {
        let state = self.lock();
        DeviceFacts {
            block_size: self.config.block_size,
            vocab_size: self.config.vocab_size,
            max_context: self.config.num_blocks * self.config.block_size,
            kv_blocks_total: self.config.num_blocks,
            kv_blocks_free: self.config.num_blocks - state.blocks_used,
            kv_blocks_cached: 0,
            live_slots_total: self.config.num_slots,
            live_slots_used: state.slots.iter().filter(|used| **used).count(),
            checkpoint_slots_total: 0,
            checkpoint_slots_used: 0,
        }
    }

    fn max_depth(&self) -> usize {
        self.config.max_depth
    }

    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut ScriptedSeq]) -> Result<Ticket> {
        let mut state = self.lock();
        if let Some(err) = Self::take_fault(&mut state, &FaultAt::Launch) {
            return Err(err);
        }
        if plan.rows() != rows.len() {
            let detail = format!(
                "plan has {} rows, {} sequences given",
                plan.rows(),
                rows.len()
            );
            return Err(DeviceError::Invalid {
                what: "launch",
                detail,
            });
        }
        if let StepPlan::DecodeFed { .. } = plan {
            if self.config.max_depth < 2 {
                return Err(DeviceError::Unsupported { what: "DecodeFed" });
            }
        }
        if let StepPlan::Prefill {
            readback: Readback::HostLogits { .. },
            ..
        }
        | StepPlan::Decode {
            readback: Readback::HostLogits { .. },
            ..
        } = plan
        {
            return Err(DeviceError::Unsupported { what: "HostLogits" });
        }
        // Work out every row's new length and the blocks and slots it needs before changing
        // anything, so that a dry pool leaves the router as it was.
        let advance: Vec<usize> = match &plan {
            StepPlan::Prefill { budgets, .. } => rows
                .iter()
                .zip(budgets.iter())
                .map(|(seq, budget)| (seq.prompt_len - seq.computed).min(*budget))
                .collect(),
            StepPlan::Decode { .. } | StepPlan::DecodeFed { .. } => vec![1; rows.len()],
        };
        let needed: usize = rows
            .iter()
            .zip(&advance)
            .map(|(seq, add)| {
                self.blocks_for(seq.computed + add)
                    .saturating_sub(seq.blocks)
            })
            .sum();
        let free = self.config.num_blocks - state.blocks_used;
        if needed > free {
            return Err(DeviceError::KvExhausted { needed, free });
        }
        let slots_needed = rows.iter().filter(|seq| seq.slot.is_none()).count();
        let slots_free = state.slots.iter().filter(|used| !**used).count();
        if slots_needed > slots_free {
            return Err(DeviceError::SlotsExhausted {
                total: self.config.num_slots,
            });
        }
        let mut outputs = Vec::with_capacity(rows.len());
        for (seq, add) in rows.iter_mut().zip(advance) {
            if seq.slot.is_none() {
                let slot = state
                    .slots
                    .iter()
                    .position(|used| !*used)
                    .unwrap_or_default();
                state.slots[slot] = true;
                seq.slot = Some(slot);
            }
            let was_prefill = !seq.prefill_done();
            seq.computed += add;
            let blocks = self.blocks_for(seq.computed);
            state.blocks_used += blocks.saturating_sub(seq.blocks);
            seq.blocks = seq.blocks.max(blocks);
            let reached_token = seq.prefill_done();
            let token = reached_token.then(|| self.answer(&mut state, seq));
            let prefill = was_prefill.then_some(PrefillReport {
                cached: 0,
                computed: add,
                done: reached_token,
            });
            outputs.push(RowOutput {
                token,
                logits_row: None,
                prefill,
            });
        }
        let ticket = Ticket(state.next_ticket);
        state.next_ticket += 1;
        state.settled.insert(
            ticket.0,
            StepResult {
                ticket,
                rows: outputs,
                logits: Some(ticket.0),
            },
        );
        Ok(ticket)
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<u64>> {
        self.lock()
            .settled
            .remove(&ticket.0)
            .ok_or(DeviceError::UnknownTicket(ticket))
    }

    fn apply(&self, effect: Effect<'_, ScriptedSeq, u64>) -> Result<EffectOutcome> {
        let mut state = self.lock();
        state.effects.push(effect.label());
        if let Some(err) = Self::take_fault(&mut state, &FaultAt::Effect(effect.name())) {
            return Err(err);
        }
        match effect {
            Effect::ReleaseSeq { seq, .. } => {
                if let Some(slot) = seq.slot.take() {
                    state.slots[slot] = false;
                }
                state.blocks_used -= seq.blocks;
                seq.blocks = 0;
                seq.reserved = 0;
                Ok(EffectOutcome::Unit)
            }
            Effect::CompactSlot { seq, target } => {
                let Some(from) = seq.slot else {
                    return Err(DeviceError::Invalid {
                        what: "CompactSlot",
                        detail: "sequence has no slot".into(),
                    });
                };
                match state.slots.get(target) {
                    Some(false) => {}
                    _ => {
                        let detail = format!("target slot {target} is not free");
                        return Err(DeviceError::Invalid {
                            what: "CompactSlot",
                            detail,
                        });
                    }
                }
                state.slots[from] = false;
                state.slots[target] = true;
                seq.slot = Some(target);
                Ok(EffectOutcome::Unit)
            }
            Effect::DetachSlot { seq } => {
                seq.slot = None;
                Ok(EffectOutcome::Unit)
            }
            Effect::ReadLogits { rows, into, .. } => {
                into.clear();
                into.resize(rows * self.config.vocab_size * 4, 0);
                Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
            }
            Effect::ReserveKv { seq } => {
                let blocks = self.blocks_for(seq.computed + 1).saturating_sub(seq.blocks);
                if blocks > self.config.num_blocks - state.blocks_used {
                    return Ok(EffectOutcome::Exhausted);
                }
                state.blocks_used += blocks;
                seq.blocks += blocks;
                seq.reserved = blocks;
                Ok(EffectOutcome::Reserved { blocks })
            }
            Effect::Rollback { seq } => {
                if self.config.max_depth < 2 {
                    return Err(DeviceError::Unsupported { what: "Rollback" });
                }
                state.blocks_used -= seq.reserved;
                seq.blocks -= seq.reserved;
                seq.reserved = 0;
                Ok(EffectOutcome::Unit)
            }
            Effect::SaveSequenceState { writer, seq } => {
                let image = format!("{} {} {}\n", seq.id, seq.prompt_len, seq.computed);
                writer
                    .write_all(image.as_bytes())
                    .map_err(|err| DeviceError::Failed {
                        phase: Phase::Effect,
                        message: err.to_string(),
                    })?;
                Ok(EffectOutcome::Unit)
            }
            Effect::RestoreSequenceState { seq, reader } => {
                let mut image = String::new();
                reader
                    .read_to_string(&mut image)
                    .map_err(|err| DeviceError::BadImage(err.to_string()))?;
                let fields: Vec<usize> = image
                    .split_whitespace()
                    .filter_map(|field| field.parse().ok())
                    .collect();
                let [id, prompt_len, computed] = fields[..] else {
                    return Err(DeviceError::BadImage(format!(
                        "expected 3 numbers, got {image:?}"
                    )));
                };
                if id as u64 != seq.id || seq.slot.is_some() || seq.blocks != 0 {
                    return Err(DeviceError::BadImage(format!(
                        "image of sequence {id} does not fit sequence {}",
                        seq.id
                    )));
                }
                let blocks = self.blocks_for(computed);
                let Some(slot) = state.slots.iter().position(|used| !*used) else {
                    return Err(DeviceError::SlotsExhausted {
                        total: self.config.num_slots,
                    });
                };
                if blocks > self.config.num_blocks - state.blocks_used {
                    return Err(DeviceError::KvExhausted {
                        needed: blocks,
                        free: self.config.num_blocks - state.blocks_used,
                    });
                }
                state.slots[slot] = true;
                state.blocks_used += blocks;
                *seq = ScriptedSeq {
                    id: id as u64,
                    prompt_len,
                    computed,
                    slot: Some(slot),
                    blocks,
                    reserved: 0,
                };
                Ok(EffectOutcome::Unit)
            }
            Effect::MarconiCheckpoint { .. }
            | Effect::SsmSnapshotSave { .. }
            | Effect::SsmSnapshotRestore { .. }
            | Effect::SaveHiddenCatchup { .. }
            | Effect::SyncSecondary
            | Effect::EpShutdown
            | Effect::Quiesce { .. } => Ok(EffectOutcome::Unit),
        }
    }

    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<(), String> {
        Err(format!(
            "{} refused: the scripted router has no adapters",
            cmd.label()
        ))
    }

    fn teardown(self: Box<Self>) -> Result<()> {
        let state = self.lock();
        let live = state.slots.iter().filter(|used| **used).count();
        if live > 0 || state.blocks_used > 0 {
            let message = format!("{live} slots and {} blocks still held", state.blocks_used);
            return Err(DeviceError::Failed {
                phase: Phase::Teardown,
                message,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, prompt: &[u32]) -> ScriptedSeq {
        ScriptedSeq::create(SeqSpec {
            id,
            prompt,
            adapter: None,
            cache_salt: None,
        })
    }

    #[test]
    fn a_ticket_is_claimed_once() {
        let router = ScriptedRouter::new(ScriptedConfig::default());
        let mut a = seq(1, &[1, 2, 3]);
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [&mut a]).unwrap();
        let step = router.await_result(ticket).unwrap();
        assert_eq!(
            step.rows[0].prefill,
            Some(PrefillReport {
                cached: 0,
                computed: 3,
                done: true
            })
        );
        assert_eq!(
            router.await_result(ticket).unwrap_err(),
            DeviceError::UnknownTicket(ticket)
        );
        assert_eq!(
            router.await_result(Ticket(99)).unwrap_err(),
            DeviceError::UnknownTicket(Ticket(99))
        );
    }

    #[test]
    fn rollback_is_unsupported_at_depth_one_and_exact_at_depth_two() {
        let sync = ScriptedRouter::new(ScriptedConfig::default());
        let mut a = seq(1, &[1]);
        let err = sync.apply(Effect::Rollback { seq: &mut a }).unwrap_err();
        assert_eq!(err, DeviceError::Unsupported { what: "Rollback" });

        let config = ScriptedConfig {
            max_depth: 2,
            ..ScriptedConfig::default()
        };
        let ahead = ScriptedRouter::new(config);
        let plan = StepPlan::Prefill {
            budgets: &[4],
            readback: Readback::Argmax,
        };
        let mut b = seq(2, &[1, 2, 3, 4]);
        let ticket = ahead.launch(plan, &mut [&mut b]).unwrap();
        ahead.await_result(ticket).unwrap();
        let before = ahead.facts();
        assert_eq!(
            ahead.apply(Effect::ReserveKv { seq: &mut b }).unwrap(),
            EffectOutcome::Reserved { blocks: 1 }
        );
        assert_eq!(
            ahead.apply(Effect::Rollback { seq: &mut b }).unwrap(),
            EffectOutcome::Unit
        );
        assert_eq!(ahead.facts(), before);
    }

    #[test]
    fn an_injected_fault_strikes_once_and_changes_nothing() {
        let router = ScriptedRouter::new(ScriptedConfig::default());
        router.inject(FaultAt::Launch, DeviceError::DeviceLost("test".into()));
        let mut a = seq(1, &[1, 2]);
        let before = router.facts();
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        assert!(matches!(
            router.launch(plan, &mut [&mut a]),
            Err(DeviceError::DeviceLost(_))
        ));
        assert_eq!(router.facts(), before);
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        assert!(router.launch(plan, &mut [&mut a]).is_ok());
    }

    #[test]
    fn a_dry_pool_is_a_typed_error_that_changes_nothing() {
        let router = ScriptedRouter::new(ScriptedConfig {
            num_blocks: 2,
            ..ScriptedConfig::default()
        });
        let prompt = [0u32; 9];
        let mut a = seq(1, &prompt);
        let plan = StepPlan::Prefill {
            budgets: &[9],
            readback: Readback::Argmax,
        };
        let err = router.launch(plan, &mut [&mut a]).unwrap_err();
        assert_eq!(err, DeviceError::KvExhausted { needed: 3, free: 2 });
        assert_eq!(a, seq(1, &prompt));
        assert_eq!(router.facts().kv_blocks_free, 2);
    }
}
