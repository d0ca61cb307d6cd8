//! A scripted router for testing code written against the contract (feature `testing`).
//!
//! [`ScriptedRouter`] computes nothing. It keeps honest bookkeeping of slots and blocks (so
//! exhaustion, compaction, spills and leaks are observable through [`DeviceFacts`]), answers each
//! token position with a token from its script (or, once the script is empty, a deterministic
//! function of the sequence id and position), records every effect's label, and can inject a
//! fault into the next launch, the next await or the next effect of a given name.
//!
//! It refuses every misuse the host router refuses, so code tested against it cannot rely on a
//! leniency the real router lacks: a prefill of a complete prompt, of a zero budget, of a prompt
//! over the context or with ids outside the vocabulary; a decode of a sequence without a slot or
//! past the context; effects on a sequence that holds no slot; snapshot ring slots outside the
//! ring ([`SNAPSHOT_SLOTS`]) or holding another sequence's snapshot; logits handles of steps
//! whose logits are gone, or more rows than the step had. A release resets the sequence (it
//! starts afresh if prefilled again), as on the host router. `tests/tests/router_conformance.rs`
//! runs the same misuse on both and compares.
//!
//! It models speculative verification as the host router does: [`StepPlan::Verify`] answers
//! every position from the script (or the fallback) and opens each row's ledger entry; snapshot
//! ring slots record the position after each draft; [`Effect::TruncateKv`] keeps the accepted
//! positions (releasing the blocks past them, forgetting the ring's snapshots past them) and
//! leaves the sequence refused by every plan, spill and snapshot until
//! [`Effect::SsmSnapshotRestore`] of the snapshot at its length.
//! [`StepPlan::Draft`] is [`DeviceError::Unsupported`]: a script has no MTP head.
//!
//! At `max_depth: 2` it models the pipelined contract: [`StepPlan::DecodeFed`] takes each row's
//! input from the previous launched step's answer for that row ([`Feed::Row`], validated: same
//! sequence, a token position) or from the host ([`Feed::Host`]); `ReserveKv` opens a ledger
//! entry and `Rollback` undoes exactly the latest one (the position it computed and the blocks it
//! added), refusing a sequence with no entry. [`ScriptedRouter::inputs`] records every input
//! token a sequence consumed (dropped again by a rollback), and [`ScriptedRouter::rollbacks`]
//! names the sequences rolled back, so a test can check that the device fed exactly what the host
//! emitted. With [`ScriptedRouter::with_step_time`] it simulates a device that takes that long per
//! step: steps run one after another on a simulated device timeline from their launch, and
//! `await_result` sleeps until its step is done, so host work between a launch and its await
//! overlaps the simulated compute as it would on an accelerator.
//!
//! Invariants of its state: a slot is owned by at most one sequence; `blocks_used` equals the sum
//! of the blocks every live sequence holds; a settled ticket is removed, so it cannot be claimed
//! twice; at most `max_depth` steps are unsettled, and they are awaited in launch order.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Read;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::{
    AdapterInfo, CacheEventSink, DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, Feed,
    Label, LoraAck, LoraCommand, LoraError, Phase, PrefillReport, Readback, Result, RowOutput,
    SeqSpec, Sequence, StepPlan, StepResult, Ticket,
};

/// A reservation ledger entry: the position reserved and the blocks the reservation added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reservation {
    at: usize,
    blocks: usize,
}

/// A new sequence of any router (`S::create`): `id`, `prompt`, no adapter, no cache salt.
pub fn seq<S: Sequence>(id: u64, prompt: &[u32]) -> S {
    S::create(SeqSpec {
        id,
        prompt,
        adapter: None,
        cache_salt: None,
    })
}

/// Releases `seq` on any router as a finished request (`ReleaseSeq`, labelled `finish`), offering
/// its KV to the prefix cache first when `cache`.
///
/// # Panics
/// When the router refuses the release (a test helper: the test's sequence must be releasable).
pub fn release<D: DeviceIo + ?Sized>(router: &D, seq: &mut D::Seq, cache: bool) {
    router
        .apply(Effect::ReleaseSeq {
            seq,
            cache,
            what: "finish",
        })
        .unwrap();
}

/// Asserts that no sequence holds anything on `router`: no live slot is used, and every block is
/// free or cached.
///
/// # Panics
/// When a slot or a block is still held (the assertion).
#[track_caller]
pub fn assert_nothing_held<D: DeviceIo + ?Sized>(router: &D) {
    let now = router.facts();
    assert_eq!(now.live_slots_used, 0, "{now:?}");
    assert_eq!(
        now.kv_blocks_free + now.kv_blocks_cached,
        now.kv_blocks_total,
        "{now:?}"
    );
}

/// Asserts [`assert_nothing_held`], then clears the prefix cache and asserts that the router's
/// facts are `initial` again (taken when nothing ran and nothing was cached).
///
/// # Panics
/// When something is still held, the cache cannot be cleared, or the facts differ.
#[track_caller]
pub fn assert_back_to_initial<D: DeviceIo + ?Sized>(router: &D, initial: DeviceFacts) {
    assert_nothing_held(router);
    router.clear_prefix_cache().unwrap();
    assert_eq!(router.facts(), initial);
}

/// The per-sequence bookkeeping of a [`ScriptedRouter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedSeq {
    id: u64,
    prompt_len: usize,
    /// The prompt, then every token fed since (`tokens[..computed]` are the computed positions').
    tokens: Vec<u32>,
    computed: usize,
    slot: Option<usize>,
    blocks: usize,
    reservation: Option<Reservation>,
    /// A rollback dropped a position: the (modelled) live state is past `computed`.
    state_ahead: bool,
    /// The LoRA adapter the sequence names.
    adapter: Option<u32>,
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
            tokens: spec.prompt.to_vec(),
            computed: 0,
            slot: None,
            blocks: 0,
            reservation: None,
            state_ahead: false,
            adapter: spec.adapter,
        }
    }
    fn id(&self) -> u64 {
        self.id
    }
    fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn computed_len(&self) -> usize {
        self.computed
    }
    fn slot(&self) -> Option<usize> {
        self.slot
    }
}

/// A decoded spill image of a [`ScriptedSeq`].
#[derive(Debug)]
struct ScriptedImage {
    id: u64,
    prompt_len: usize,
    computed: usize,
    tokens: Vec<u32>,
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
    /// 1, or 2 to accept `DecodeFed` and `Rollback` and keep two steps in flight.
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
    /// The next `launch` (it changes nothing).
    Launch,
    /// The next `await_result`: that step is lost (its ticket is consumed and its rows are left
    /// as launched, for the core to release), and so is a fed step launched after it that took
    /// inputs from it.
    Await,
    /// The next effect with this name (`"ReleaseSeq"`, `"CompactSlot"`, ...).
    Effect(&'static str),
}

/// A launched, unclaimed step.
#[derive(Debug)]
struct Unsettled {
    result: StepResult<u64>,
    /// When the simulated device finishes it.
    ready_at: Option<Instant>,
    /// The step it took fed inputs from, if any.
    fed_from: Option<u64>,
}

#[derive(Debug)]
struct State {
    slots: Vec<bool>,
    blocks_used: usize,
    next_ticket: u64,
    unsettled: BTreeMap<u64, Unsettled>,
    /// Steps whose await failed: a fed step that took inputs from one fails too.
    lost: BTreeSet<u64>,
    /// The sequence and answer of each row of the latest launched step.
    last_rows: Vec<(u64, Option<u32>)>,
    /// When the simulated device is free again.
    device_free_at: Option<Instant>,
    script: VecDeque<u32>,
    faults: Vec<(FaultAt, DeviceError)>,
    effects: Vec<String>,
    /// Every decode input a sequence consumed, by id and position.
    inputs: BTreeMap<u64, BTreeMap<usize, u32>>,
    rollbacks: Vec<u64>,
    /// The snapshot ring: which sequence saved into each slot, at which length.
    ring: [Option<(u64, usize)>; SNAPSHOT_SLOTS],
    /// The steps whose logits are held (the latest `max_depth`), with their token-position rows.
    logits: VecDeque<(u64, usize)>,
    /// The adapter slots: the id and folder of the adapter each holds.
    adapters: Vec<Option<(u32, std::path::PathBuf)>>,
    /// The adapter of each live sequence that names one, by sequence id.
    adapter_users: BTreeMap<u64, u32>,
    /// Every LoRA command, with the number of unsettled steps when it arrived.
    lora_log: Vec<(String, usize)>,
}

impl State {
    /// Records that `seq` consumed `token` at its next position: the router's input log, and the
    /// sequence's tokens (past the prompt, whatever a rollback left beyond it is replaced).
    fn consume(&mut self, seq: &mut ScriptedSeq, token: u32) {
        self.inputs
            .entry(seq.id)
            .or_default()
            .insert(seq.computed, token);
        seq.tokens.truncate(seq.computed.max(seq.prompt_len));
        seq.tokens.push(token);
    }
}

/// Slots of the snapshot ring (`SsmSnapshotSave` / `SsmSnapshotRestore`), as many as the host
/// router has by default.
pub const SNAPSHOT_SLOTS: usize = 4;

/// Adapter slots of a new scripted router (see [`ScriptedRouter::with_lora_slots`]).
pub const LORA_SLOTS: usize = 4;

/// A router that answers from a script; see the module docs.
#[derive(Debug)]
pub struct ScriptedRouter {
    config: ScriptedConfig,
    step_time: Duration,
    state: Mutex<State>,
}

fn invalid(what: &'static str, detail: String) -> DeviceError {
    DeviceError::Invalid { what, detail }
}

impl ScriptedRouter {
    /// An empty router of the given shape.
    pub fn new(config: ScriptedConfig) -> Self {
        let state = State {
            slots: vec![false; config.num_slots],
            blocks_used: 0,
            next_ticket: 1,
            unsettled: BTreeMap::new(),
            lost: BTreeSet::new(),
            last_rows: Vec::new(),
            ring: [None; SNAPSHOT_SLOTS],
            logits: VecDeque::new(),
            device_free_at: None,
            script: VecDeque::new(),
            faults: Vec::new(),
            effects: Vec::new(),
            inputs: BTreeMap::new(),
            rollbacks: Vec::new(),
            adapters: vec![None; LORA_SLOTS],
            adapter_users: BTreeMap::new(),
            lora_log: Vec::new(),
        };
        ScriptedRouter {
            config,
            step_time: Duration::ZERO,
            state: Mutex::new(state),
        }
    }

    /// Simulates a device that computes each step for `step_time` (see the module docs).
    pub fn with_step_time(mut self, step_time: Duration) -> Self {
        self.step_time = step_time;
        self
    }

    /// Gives the router `slots` adapter slots (it has [`LORA_SLOTS`] by default; 0 refuses every
    /// LoRA command as unsupported). It keeps the bookkeeping of a real router (which id is in
    /// which slot, which live sequence uses which adapter) and computes nothing with them.
    pub fn with_lora_slots(self, slots: usize) -> Self {
        self.lock().adapters = vec![None; slots];
        self
    }

    /// Every LoRA command received, as its label with the number of launched, unsettled steps
    /// at that moment (0 when the command arrived at quiescence).
    pub fn lora_log(&self) -> Vec<(String, usize)> {
        self.lock().lora_log.clone()
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

    /// Every decode input token the sequence with id `id` consumed, as `(position, token)` in
    /// position order (a later tenure of the same id overwrites; a rollback removes what it
    /// dropped).
    pub fn inputs(&self, id: u64) -> Vec<(usize, u32)> {
        self.lock()
            .inputs
            .get(&id)
            .map(|inputs| inputs.iter().map(|(&pos, &token)| (pos, token)).collect())
            .unwrap_or_default()
    }

    /// The ids of the sequences whose over-run a `Rollback` undid (it dropped a computed
    /// position; a rollback of a reservation no step used is not listed), in order.
    pub fn rollbacks(&self) -> Vec<u64> {
        self.lock().rollbacks.clone()
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

    /// Refuses a sequence that holds no live slot (released, detached or never prefilled).
    fn live_slot(seq: &ScriptedSeq, what: &'static str) -> Result<usize> {
        seq.slot
            .ok_or_else(|| invalid(what, format!("sequence {} holds no live slot", seq.id)))
    }

    /// Refuses a snapshot ring slot outside the ring.
    fn ring_slot(slot: usize, what: &'static str) -> Result<()> {
        if slot >= SNAPSHOT_SLOTS {
            let detail = format!("ring slot {slot} is outside the {SNAPSHOT_SLOTS} snapshot slots");
            return Err(invalid(what, detail));
        }
        Ok(())
    }

    /// Reads and checks a spill image (`id prompt_len computed token...`, decimal, one line):
    /// every field a number, the lengths consistent, the tokens inside the vocabulary and the
    /// whole no longer than a sequence of the pool's size needs.
    fn read_image(&self, reader: &mut dyn std::io::Read) -> Result<ScriptedImage> {
        let max_tokens = self.config.num_blocks * self.config.block_size;
        // Each field is at most 20 digits and a separator.
        let limit = 21 * (3 + max_tokens as u64);
        let mut text = String::new();
        reader
            .take(limit + 1)
            .read_to_string(&mut text)
            .map_err(|err| DeviceError::BadImage(format!("reading failed: {err}")))?;
        if text.len() as u64 > limit {
            return Err(DeviceError::BadImage(format!(
                "the image is longer than {limit} bytes"
            )));
        }
        let mut fields = text.split_ascii_whitespace().map(|field| {
            field
                .parse::<u64>()
                .map_err(|_| DeviceError::BadImage(format!("{field:?} is not a number")))
        });
        let mut next = |name: &str| {
            fields
                .next()
                .unwrap_or_else(|| Err(DeviceError::BadImage(format!("no {name}"))))
        };
        let id = next("sequence id")?;
        let prompt_len = next("prompt length")? as usize;
        let computed = next("computed length")? as usize;
        let tokens = fields
            .map(|field| {
                let token = field?;
                u32::try_from(token)
                    .ok()
                    .filter(|&token| (token as usize) < self.config.vocab_size)
                    .ok_or_else(|| {
                        DeviceError::BadImage(format!(
                            "token {token} is outside the vocabulary of {}",
                            self.config.vocab_size
                        ))
                    })
            })
            .collect::<Result<Vec<u32>>>()?;
        let want = prompt_len.max(computed);
        if prompt_len == 0 || computed > max_tokens || tokens.len() != want {
            return Err(DeviceError::BadImage(format!(
                "lengths are inconsistent: prompt {prompt_len}, computed {computed}, {} tokens",
                tokens.len()
            )));
        }
        Ok(ScriptedImage {
            id,
            prompt_len,
            computed,
            tokens,
        })
    }

    /// The answer at the row's token position, masked: the first allowed id at or after the
    /// unmasked answer (cyclically), a deterministic stand-in for a masked argmax.
    fn answer(&self, state: &mut State, seq: &ScriptedSeq, mask: Option<&[bool]>) -> u32 {
        let token = state
            .script
            .pop_front()
            .unwrap_or_else(|| self.fallback_token(seq.id, seq.computed));
        let Some(mask) = mask else {
            return token;
        };
        let vocab = self.config.vocab_size as u32;
        (0..vocab)
            .map(|offset| (token + offset) % vocab)
            .find(|&candidate| mask[candidate as usize])
            .unwrap_or(token)
    }

    /// `Verify`: each row's positions answered from the script (or the fallback) in order, a
    /// ledger entry per row, and ring entries at the positions after each draft.
    fn verify(
        &self,
        state: &mut State,
        inputs: &[&[u32]],
        snapshots: &[&[usize]],
        readback: Readback<'_>,
        rows: &mut [&mut ScriptedSeq],
    ) -> Result<Ticket> {
        const WHAT: &str = "Verify";
        match readback {
            Readback::Argmax => {}
            Readback::HostLogits { .. } => {
                return Err(DeviceError::Unsupported { what: "HostLogits" })
            }
            Readback::ArgmaxMasked { .. } => {
                return Err(DeviceError::Unsupported {
                    what: "Verify with ArgmaxMasked",
                })
            }
        }
        if !snapshots.is_empty() && snapshots.len() != rows.len() {
            let detail = format!("{} snapshot lists for {} rows", snapshots.len(), rows.len());
            return Err(invalid(WHAT, detail));
        }
        let vocab = self.config.vocab_size;
        let max_context = self.config.num_blocks * self.config.block_size;
        let mut named = [false; SNAPSHOT_SLOTS];
        for (i, (seq, input)) in rows.iter().zip(inputs).enumerate() {
            let id = seq.id;
            if input.is_empty() {
                return Err(invalid(WHAT, format!("row {i} feeds no token")));
            }
            if seq.state_ahead {
                let detail = format!("row {i} (sequence {id}) was rolled back; release it");
                return Err(invalid(WHAT, detail));
            }
            if seq.slot.is_none() || seq.computed < seq.prompt_len {
                let detail = format!("row {i} (sequence {id}) has no complete prompt");
                return Err(invalid(WHAT, detail));
            }
            if seq.computed + input.len() > max_context {
                let detail = format!(
                    "row {i} (sequence {id}) would reach {} tokens, over max_context                      {max_context}",
                    seq.computed + input.len()
                );
                return Err(invalid(WHAT, detail));
            }
            if let Some(&bad) = input.iter().find(|&&t| t as usize >= vocab) {
                let detail = format!("row {i} feeds token {bad}, vocabulary {vocab}");
                return Err(invalid(WHAT, detail));
            }
            if let Some(slots) = snapshots.get(i) {
                if slots.len() != input.len() - 1 {
                    let detail = format!(
                        "row {i} names {} snapshot slots for {} drafts",
                        slots.len(),
                        input.len() - 1
                    );
                    return Err(invalid(WHAT, detail));
                }
                for &slot in slots.iter() {
                    Self::ring_slot(slot, WHAT)?;
                    if std::mem::replace(&mut named[slot], true) {
                        return Err(invalid(WHAT, format!("ring slot {slot} is named twice")));
                    }
                }
            }
        }
        let needs: Vec<usize> = rows
            .iter()
            .zip(inputs)
            .map(|(seq, input)| {
                self.blocks_for(seq.computed + input.len())
                    .saturating_sub(seq.blocks)
            })
            .collect();
        let needed: usize = needs.iter().sum();
        let free = self.config.num_blocks - state.blocks_used;
        if needed > free {
            return Err(DeviceError::KvExhausted { needed, free });
        }
        let mut outputs = Vec::with_capacity(rows.len());
        let mut tokens = Vec::new();
        for (i, ((seq, input), blocks)) in rows.iter_mut().zip(inputs).zip(needs).enumerate() {
            let at = seq.computed;
            state.blocks_used += blocks;
            seq.blocks += blocks;
            seq.reservation = Some(Reservation { at, blocks });
            if let Some(slots) = snapshots.get(i) {
                for (j, &slot) in slots.iter().enumerate() {
                    state.ring[slot] = Some((seq.id, at + j + 1));
                }
            }
            let start = tokens.len();
            for &token in input.iter() {
                state.consume(seq, token);
                seq.computed += 1;
                tokens.push(self.answer(state, seq, None));
            }
            outputs.push(RowOutput {
                run: Some(crate::TokenRun {
                    start,
                    len: input.len(),
                }),
                ..RowOutput::default()
            });
        }
        // A verification reaches no feed cell (the core truncates its rows).
        state.last_rows = rows.iter().map(|seq| (seq.id, None)).collect();
        Ok(self.enqueue_step(state, 0, None, |ticket| StepResult {
            ticket,
            rows: outputs,
            logits: None,
            tokens,
        }))
    }

    /// Enters a launched step under the next ticket: its logits (`token_rows` rows; the latest
    /// `max_depth` steps' are held), when the simulated device finishes it, and its result, built
    /// by `result` from the ticket.
    fn enqueue_step(
        &self,
        state: &mut State,
        token_rows: usize,
        fed_from: Option<u64>,
        result: impl FnOnce(Ticket) -> StepResult<u64>,
    ) -> Ticket {
        let ticket = Ticket(state.next_ticket);
        state.next_ticket += 1;
        state.logits.push_back((ticket.0, token_rows));
        while state.logits.len() > self.config.max_depth.max(1) {
            state.logits.pop_front();
        }
        let ready_at = (!self.step_time.is_zero()).then(|| {
            let now = Instant::now();
            let start = state.device_free_at.map_or(now, |free| free.max(now));
            start + self.step_time
        });
        if ready_at.is_some() {
            state.device_free_at = ready_at;
        }
        state.unsettled.insert(
            ticket.0,
            Unsettled {
                result: result(ticket),
                ready_at,
                fed_from,
            },
        );
        ticket
    }

    fn check_masks(&self, masks: &[&[bool]], rows: usize, what: &'static str) -> Result<()> {
        if masks.len() != rows {
            let detail = format!("{} masks for {rows} rows", masks.len());
            return Err(invalid(what, detail));
        }
        for (i, mask) in masks.iter().enumerate() {
            if mask.len() != self.config.vocab_size {
                let detail = format!(
                    "mask {i} has {} entries, the vocabulary {}",
                    mask.len(),
                    self.config.vocab_size
                );
                return Err(invalid(what, detail));
            }
            if !mask.iter().any(|allowed| *allowed) {
                return Err(invalid(what, format!("mask {i} allows no token")));
            }
        }
        Ok(())
    }

    /// Each decode row's input token (`None` for prefill), validated against the plan.
    fn inputs_of(
        &self,
        state: &State,
        plan: &StepPlan<'_>,
        rows: &[&mut ScriptedSeq],
    ) -> Result<Vec<Option<u32>>> {
        let vocab = self.config.vocab_size;
        let check_decode_row = |i: usize, seq: &ScriptedSeq, what: &'static str| {
            if seq.state_ahead {
                let detail = format!("row {i} (sequence {}) was rolled back; release it", seq.id);
                return Err(invalid(what, detail));
            }
            if seq.slot.is_none() || seq.computed < seq.prompt_len {
                let detail = format!("row {i} (sequence {}) has no complete prompt", seq.id);
                return Err(invalid(what, detail));
            }
            let max_context = self.config.num_blocks * self.config.block_size;
            if seq.computed + 1 > max_context {
                let detail = format!(
                    "row {i} (sequence {}) would reach {} tokens, over max_context {max_context}",
                    seq.id,
                    seq.computed + 1
                );
                return Err(invalid(what, detail));
            }
            Ok(())
        };
        match plan {
            // Handled by `verify`; a script has no drafter.
            StepPlan::Verify { .. } | StepPlan::Draft { .. } => {
                Err(DeviceError::Unsupported { what: "Draft" })
            }
            StepPlan::Prefill { readback, budgets } => {
                if let Readback::ArgmaxMasked { masks } = readback {
                    self.check_masks(masks, rows.len(), "Prefill")?;
                }
                let max_context = self.config.num_blocks * self.config.block_size;
                for (i, (seq, &budget)) in rows.iter().zip(budgets.iter()).enumerate() {
                    let id = seq.id;
                    let refuse = |detail: String| Err(invalid("Prefill", detail));
                    if budget == 0 {
                        return refuse(format!("row {i} has a budget of 0"));
                    }
                    if seq.computed >= seq.prompt_len {
                        return refuse(format!("row {i} (sequence {id}) has its prompt complete"));
                    }
                    if seq.prompt_len > max_context {
                        return refuse(format!(
                            "row {i} (sequence {id}) has a prompt of {} tokens, over max_context \
                             {max_context}",
                            seq.prompt_len
                        ));
                    }
                    if let Some(bad) = seq.tokens.iter().find(|&&t| t as usize >= vocab) {
                        return refuse(format!(
                            "row {i} (sequence {id}) has token id {bad}, vocabulary {vocab}"
                        ));
                    }
                }
                Ok(vec![None; rows.len()])
            }
            StepPlan::Decode { tokens, readback } => {
                if let Readback::ArgmaxMasked { masks } = readback {
                    self.check_masks(masks, rows.len(), "Decode")?;
                }
                let mut inputs = Vec::with_capacity(rows.len());
                for (i, (seq, &token)) in rows.iter().zip(tokens.iter()).enumerate() {
                    check_decode_row(i, seq, "Decode")?;
                    if token as usize >= vocab {
                        let detail = format!("row {i} feeds token {token}, vocabulary {vocab}");
                        return Err(invalid("Decode", detail));
                    }
                    inputs.push(Some(token));
                }
                Ok(inputs)
            }
            StepPlan::DecodeFed { sources, masks } => {
                if !masks.is_empty() {
                    self.check_masks(masks, rows.len(), "DecodeFed")?;
                }
                let mut inputs = Vec::with_capacity(rows.len());
                for (i, (seq, source)) in rows.iter().zip(sources.iter()).enumerate() {
                    check_decode_row(i, seq, "DecodeFed")?;
                    let token = match *source {
                        Feed::Host(token) if (token as usize) < vocab => token,
                        Feed::Host(token) => {
                            let detail = format!("row {i} feeds token {token}, vocabulary {vocab}");
                            return Err(invalid("DecodeFed", detail));
                        }
                        Feed::Row(r) => match state.last_rows.get(r) {
                            Some(&(id, Some(token))) if id == seq.id => token,
                            Some(&(id, _)) if id != seq.id => {
                                let detail = format!(
                                    "row {i} (sequence {}) feeds from row {r} of the previous \
                                     step, which was sequence {id}",
                                    seq.id
                                );
                                return Err(invalid("DecodeFed", detail));
                            }
                            Some(_) => {
                                let detail = format!(
                                    "row {i} feeds from row {r} of the previous step, which \
                                     reached no token position"
                                );
                                return Err(invalid("DecodeFed", detail));
                            }
                            None => {
                                let detail = format!(
                                    "row {i} feeds from row {r}; the previous step had {} rows",
                                    state.last_rows.len()
                                );
                                return Err(invalid("DecodeFed", detail));
                            }
                        },
                    };
                    inputs.push(Some(token));
                }
                Ok(inputs)
            }
        }
    }
}

impl DeviceIo for ScriptedRouter {
    type Seq = ScriptedSeq;
    type Ptr = u64;
    type Model = ScriptedConfig;
    type LoraCmd = LoraCommand;
    type LoraAck = LoraAck;

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
            snapshot_slots_total: SNAPSHOT_SLOTS,
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
            return Err(invalid("launch", detail));
        }
        if let StepPlan::DecodeFed { .. } = plan {
            if self.config.max_depth < 2 {
                return Err(DeviceError::Unsupported { what: "DecodeFed" });
            }
        }
        // A script has no MTP head to draft with.
        if let StepPlan::Draft { .. } = plan {
            return Err(DeviceError::Unsupported { what: "Draft" });
        }
        if state.unsettled.len() >= self.config.max_depth.max(1) {
            let detail = format!(
                "{} steps are unsettled and max_depth is {}",
                state.unsettled.len(),
                self.config.max_depth
            );
            return Err(invalid("launch", detail));
        }
        if let StepPlan::Verify {
            inputs,
            snapshots,
            readback,
        } = plan
        {
            return self.verify(&mut state, inputs, snapshots, readback, rows);
        }
        let masks: &[&[bool]] = match &plan {
            StepPlan::Prefill {
                readback: Readback::HostLogits { .. },
                ..
            }
            | StepPlan::Decode {
                readback: Readback::HostLogits { .. },
                ..
            } => return Err(DeviceError::Unsupported { what: "HostLogits" }),
            StepPlan::Prefill {
                readback: Readback::ArgmaxMasked { masks },
                ..
            }
            | StepPlan::Decode {
                readback: Readback::ArgmaxMasked { masks },
                ..
            }
            | StepPlan::DecodeFed { masks, .. } => masks,
            _ => &[],
        };
        let inputs = self.inputs_of(&state, &plan, rows)?;
        for (i, seq) in rows.iter().enumerate() {
            if let (None, Some(adapter)) = (seq.slot, seq.adapter) {
                if !state
                    .adapters
                    .iter()
                    .flatten()
                    .any(|(id, _)| *id == adapter)
                {
                    let detail = format!(
                        "row {i} (sequence {}) names adapter {adapter}, which is not loaded",
                        seq.id
                    );
                    return Err(invalid("launch", detail));
                }
            }
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
            // Refused by `inputs_of` above.
            StepPlan::Verify { .. } | StepPlan::Draft { .. } => vec![0; rows.len()],
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
        let mut last_rows = Vec::with_capacity(rows.len());
        for (i, ((seq, add), input)) in rows.iter_mut().zip(advance).zip(inputs).enumerate() {
            if seq.slot.is_none() {
                let slot = state
                    .slots
                    .iter()
                    .position(|used| !*used)
                    .unwrap_or_default();
                state.slots[slot] = true;
                seq.slot = Some(slot);
                state.inputs.remove(&seq.id);
                if let Some(adapter) = seq.adapter {
                    state.adapter_users.insert(seq.id, adapter);
                }
            }
            if let Some(token) = input {
                state.consume(seq, token);
            }
            let was_prefill = !seq.prefill_done();
            seq.computed += add;
            let blocks = self.blocks_for(seq.computed);
            state.blocks_used += blocks.saturating_sub(seq.blocks);
            seq.blocks = seq.blocks.max(blocks);
            let reached_token = seq.prefill_done();
            let mask = masks.get(i).copied();
            let token = reached_token.then(|| self.answer(&mut state, seq, mask));
            let prefill = was_prefill.then_some(PrefillReport {
                cached: 0,
                computed: add,
                done: reached_token,
            });
            outputs.push(RowOutput {
                token,
                logits_row: None,
                prefill,
                run: None,
            });
            last_rows.push((seq.id, token));
        }
        let fed_from = match &plan {
            StepPlan::DecodeFed { sources, .. }
                if sources.iter().any(|s| matches!(s, Feed::Row(_))) =>
            {
                Some(state.next_ticket - 1)
            }
            _ => None,
        };
        let token_rows = last_rows
            .iter()
            .filter(|(_, token)| token.is_some())
            .count();
        state.last_rows = last_rows;
        Ok(
            self.enqueue_step(&mut state, token_rows, fed_from, |ticket| StepResult {
                ticket,
                rows: outputs,
                logits: Some(ticket.0),
                tokens: Vec::new(),
            }),
        )
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<u64>> {
        let (step, ready_at) = {
            let mut state = self.lock();
            let Some(&oldest) = state.unsettled.keys().next() else {
                return Err(DeviceError::UnknownTicket(ticket));
            };
            if !state.unsettled.contains_key(&ticket.0) {
                return Err(DeviceError::UnknownTicket(ticket));
            }
            if oldest != ticket.0 {
                let detail = format!("{ticket} awaited before ticket {oldest}");
                return Err(invalid("await_result", detail));
            }
            let step = state.unsettled.remove(&ticket.0).expect("checked above");
            if let Some(err) = Self::take_fault(&mut state, &FaultAt::Await) {
                state.lost.insert(ticket.0);
                return Err(err);
            }
            if let Some(source) = step.fed_from.filter(|source| state.lost.contains(source)) {
                state.lost.insert(ticket.0);
                return Err(DeviceError::Failed {
                    phase: Phase::Forward,
                    message: format!("its inputs came from ticket {source}, which failed"),
                });
            }
            (step.result, step.ready_at)
        };
        if let Some(wait) = ready_at.and_then(|at| at.checked_duration_since(Instant::now())) {
            std::thread::sleep(wait);
        }
        Ok(step)
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
                state.adapter_users.remove(&seq.id);
                for entry in state.ring.iter_mut() {
                    if entry.is_some_and(|(id, _)| id == seq.id) {
                        *entry = None;
                    }
                }
                state.blocks_used -= seq.blocks;
                seq.blocks = 0;
                seq.reservation = None;
                seq.state_ahead = false;
                // As on the host router: a released sequence starts afresh if prefilled again.
                seq.computed = 0;
                seq.tokens.truncate(seq.prompt_len);
                Ok(EffectOutcome::Unit)
            }
            Effect::CompactSlot { seq, target } => {
                let Some(from) = seq.slot else {
                    return Err(invalid("CompactSlot", "sequence has no slot".into()));
                };
                match state.slots.get(target) {
                    Some(false) => {}
                    _ => {
                        let detail = format!("target slot {target} is not free");
                        return Err(invalid("CompactSlot", detail));
                    }
                }
                state.slots[from] = false;
                state.slots[target] = true;
                seq.slot = Some(target);
                Ok(EffectOutcome::Unit)
            }
            Effect::DetachSlot { seq } => {
                Self::live_slot(seq, "DetachSlot")?;
                seq.slot = None;
                Ok(EffectOutcome::Unit)
            }
            Effect::ReadLogits { logits, rows, into } => {
                let Some(&(_, held)) = state.logits.iter().find(|(step, _)| *step == logits) else {
                    let detail = format!("the handle names step {logits}, whose logits are gone");
                    return Err(invalid("ReadLogits", detail));
                };
                if rows > held {
                    let detail = format!("{rows} rows asked, step {logits} has {held}");
                    return Err(invalid("ReadLogits", detail));
                }
                into.clear();
                into.resize(rows * self.config.vocab_size * 4, 0);
                Ok(EffectOutcome::HostLogits { elem_bytes: 4 })
            }
            Effect::ReserveKv { seq } => {
                Self::live_slot(seq, "ReserveKv")?;
                let max_context = self.config.num_blocks * self.config.block_size;
                if seq.computed + 1 > max_context {
                    let detail = format!(
                        "sequence {} would reach {} tokens, over max_context {max_context}",
                        seq.id,
                        seq.computed + 1
                    );
                    return Err(invalid("ReserveKv", detail));
                }
                let blocks = self.blocks_for(seq.computed + 1).saturating_sub(seq.blocks);
                if blocks > self.config.num_blocks - state.blocks_used {
                    return Ok(EffectOutcome::Exhausted);
                }
                state.blocks_used += blocks;
                seq.blocks += blocks;
                seq.reservation = Some(Reservation {
                    at: seq.computed,
                    blocks,
                });
                Ok(EffectOutcome::Reserved { blocks })
            }
            Effect::Rollback { seq } => {
                if self.config.max_depth < 2 {
                    return Err(DeviceError::Unsupported { what: "Rollback" });
                }
                let Some(reservation) = seq.reservation.take() else {
                    let detail = format!("sequence {} has no reservation to undo", seq.id);
                    return Err(invalid("Rollback", detail));
                };
                if seq.computed > reservation.at {
                    seq.computed = reservation.at;
                    seq.tokens.truncate(seq.computed.max(seq.prompt_len));
                    seq.state_ahead = true;
                    if let Some(inputs) = state.inputs.get_mut(&seq.id) {
                        inputs.retain(|&pos, _| pos < reservation.at);
                    }
                    state.rollbacks.push(seq.id);
                }
                state.blocks_used -= reservation.blocks;
                seq.blocks -= reservation.blocks;
                Ok(EffectOutcome::Unit)
            }
            Effect::SaveSequenceState { writer, seq } => {
                Self::live_slot(seq, "SaveSequenceState")?;
                if seq.state_ahead {
                    let detail = format!("sequence {} was rolled back; release it", seq.id);
                    return Err(invalid("SaveSequenceState", detail));
                }
                let mut image = format!("{} {} {}", seq.id, seq.prompt_len, seq.computed);
                for token in &seq.tokens {
                    image.push_str(&format!(" {token}"));
                }
                image.push('\n');
                writer
                    .write_all(image.as_bytes())
                    .map_err(|err| DeviceError::Failed {
                        phase: Phase::Effect,
                        message: err.to_string(),
                    })?;
                Ok(EffectOutcome::Unit)
            }
            Effect::RestoreSequenceState { seq, reader } => {
                if seq.slot.is_some() || seq.blocks != 0 {
                    return Err(DeviceError::Invalid {
                        what: "RestoreSequenceState",
                        detail: format!(
                            "sequence {} still holds resources; release it first",
                            seq.id
                        ),
                    });
                }
                let image = self.read_image(reader)?;
                if image.id != seq.id {
                    return Err(DeviceError::BadImage(format!(
                        "the image is of sequence {}, not {}",
                        image.id, seq.id
                    )));
                }
                let blocks = self.blocks_for(image.computed);
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
                if let Some(adapter) = seq.adapter {
                    if !state
                        .adapters
                        .iter()
                        .flatten()
                        .any(|(id, _)| *id == adapter)
                    {
                        return Err(invalid(
                            "RestoreSequenceState",
                            format!(
                                "sequence {} names adapter {adapter}, which is not loaded",
                                seq.id
                            ),
                        ));
                    }
                    state.adapter_users.insert(seq.id, adapter);
                }
                state.slots[slot] = true;
                state.blocks_used += blocks;
                *seq = ScriptedSeq {
                    id: image.id,
                    prompt_len: image.prompt_len,
                    tokens: image.tokens,
                    computed: image.computed,
                    slot: Some(slot),
                    blocks,
                    reservation: None,
                    state_ahead: false,
                    adapter: seq.adapter,
                };
                Ok(EffectOutcome::Unit)
            }
            Effect::TruncateKv { seq, len } => {
                Self::live_slot(seq, "TruncateKv")?;
                let Some(reservation) = seq.reservation else {
                    let detail = format!("sequence {} has no reservation to truncate", seq.id);
                    return Err(invalid("TruncateKv", detail));
                };
                if len < reservation.at || len > seq.computed {
                    let detail = format!(
                        "sequence {} keeps {len} positions; its reservation covers {}..={}",
                        seq.id, reservation.at, seq.computed
                    );
                    return Err(invalid("TruncateKv", detail));
                }
                seq.reservation = None;
                if len < seq.computed {
                    seq.computed = len;
                    seq.tokens.truncate(len.max(seq.prompt_len));
                    seq.state_ahead = true;
                    if let Some(inputs) = state.inputs.get_mut(&seq.id) {
                        inputs.retain(|&pos, _| pos < len);
                    }
                }
                // The blocks the reservation added wholly past `len` go back.
                let keep = (seq.blocks - reservation.blocks).max(self.blocks_for(len));
                let freed = seq.blocks - keep;
                state.blocks_used -= freed;
                seq.blocks = keep;
                // The snapshots of rejected positions are forgotten.
                for entry in state.ring.iter_mut() {
                    if entry.is_some_and(|(id, pos)| id == seq.id && pos > len) {
                        *entry = None;
                    }
                }
                Ok(EffectOutcome::Unit)
            }
            Effect::MarconiCheckpoint { seq } if seq.state_ahead => {
                let detail = format!("sequence {} was rolled back; release it", seq.id);
                Err(invalid("MarconiCheckpoint", detail))
            }
            Effect::MarconiCheckpoint { seq } => {
                Self::live_slot(seq, "MarconiCheckpoint")?;
                Ok(EffectOutcome::Unit)
            }
            Effect::SsmSnapshotSave { seq, slot } => {
                Self::ring_slot(slot, "SsmSnapshotSave")?;
                Self::live_slot(seq, "SsmSnapshotSave")?;
                if seq.state_ahead {
                    let detail = format!("sequence {} was rolled back; release it", seq.id);
                    return Err(invalid("SsmSnapshotSave", detail));
                }
                state.ring[slot] = Some((seq.id, seq.computed));
                Ok(EffectOutcome::Unit)
            }
            Effect::SsmSnapshotRestore { seq, slot } => {
                Self::ring_slot(slot, "SsmSnapshotRestore")?;
                Self::live_slot(seq, "SsmSnapshotRestore")?;
                let Some((id, pos)) = state.ring[slot].filter(|(id, _)| *id == seq.id) else {
                    let detail =
                        format!("ring slot {slot} holds no snapshot of sequence {}", seq.id);
                    return Err(invalid("SsmSnapshotRestore", detail));
                };
                // The snapshot at exactly the sequence's length puts a truncated state in step.
                if id == seq.id && pos == seq.computed {
                    seq.state_ahead = false;
                }
                Ok(EffectOutcome::Unit)
            }
            Effect::SaveHiddenCatchup { .. }
            | Effect::SyncSecondary
            | Effect::EpShutdown
            | Effect::Quiesce { .. } => Ok(EffectOutcome::Unit),
        }
    }

    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<LoraAck, LoraError> {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let in_flight = state.unsettled.len();
        state.lora_log.push((cmd.label(), in_flight));
        if state.adapters.is_empty() {
            return Err(LoraError::Unsupported {
                what: "LoRA (the scripted router has no adapter slots)",
            });
        }
        if in_flight > 0 {
            return Err(LoraError::Busy { in_flight });
        }
        let users = |state: &State, adapter: u32| -> Vec<u64> {
            state
                .adapter_users
                .iter()
                .filter(|(_, &a)| a == adapter)
                .map(|(&id, _)| id)
                .collect()
        };
        let info = |state: &State, slot: usize, adapter: u32, path: &std::path::Path| AdapterInfo {
            adapter,
            slot,
            path: path.to_owned(),
            rank: 0,
            modules: 0,
            sequences: users(state, adapter).len(),
        };
        let slot_of = |state: &State, adapter: u32| {
            state
                .adapters
                .iter()
                .position(|entry| entry.as_ref().is_some_and(|(id, _)| *id == adapter))
        };
        match cmd {
            LoraCommand::Load { adapter, path } => {
                if let Some(slot) = slot_of(state, adapter) {
                    return Err(LoraError::AlreadyLoaded { adapter, slot });
                }
                let Some(slot) = state.adapters.iter().position(Option::is_none) else {
                    return Err(LoraError::NoFreeSlot {
                        slots: state.adapters.len(),
                    });
                };
                let ack = LoraAck::Loaded(info(state, slot, adapter, &path));
                state.adapters[slot] = Some((adapter, path));
                Ok(ack)
            }
            LoraCommand::Unload { adapter } => {
                let slot = slot_of(state, adapter).ok_or(LoraError::NotLoaded { adapter })?;
                let sequences = users(state, adapter);
                if !sequences.is_empty() {
                    return Err(LoraError::InUse { adapter, sequences });
                }
                state.adapters[slot] = None;
                Ok(LoraAck::Unloaded { adapter, slot })
            }
            LoraCommand::List => Ok(LoraAck::Listed {
                slots: state.adapters.len(),
                adapters: state
                    .adapters
                    .iter()
                    .enumerate()
                    .filter_map(|(slot, entry)| {
                        entry
                            .as_ref()
                            .map(|(adapter, path)| info(state, slot, *adapter, path))
                    })
                    .collect(),
            }),
        }
    }

    fn teardown(self: Box<Self>) -> Result<()> {
        let state = self.lock();
        let live = state.slots.iter().filter(|used| **used).count();
        let unsettled = state.unsettled.len();
        if live > 0 || state.blocks_used > 0 || unsettled > 0 {
            let message = format!(
                "{live} slots, {} blocks and {unsettled} unsettled steps still held",
                state.blocks_used
            );
            return Err(DeviceError::Failed {
                phase: Phase::Teardown,
                message,
            });
        }
        Ok(())
    }
}

/// What a test puts around a [`ScriptedRouter`]'s launches, awaits and effects (see [`Hooked`]):
/// a gate, a counter, an injected panic, other answers. Each method forwards the call to the
/// router unchanged unless the test overrides it.
pub trait Hooks: std::fmt::Debug + Send + Sync {
    /// Around [`DeviceIo::launch`].
    fn launch(
        &self,
        router: &ScriptedRouter,
        plan: StepPlan<'_>,
        rows: &mut [&mut ScriptedSeq],
    ) -> Result<Ticket> {
        router.launch(plan, rows)
    }

    /// Around [`DeviceIo::await_result`].
    fn await_result(&self, router: &ScriptedRouter, ticket: Ticket) -> Result<StepResult<u64>> {
        router.await_result(ticket)
    }

    /// Around [`DeviceIo::apply`].
    fn apply(
        &self,
        router: &ScriptedRouter,
        effect: Effect<'_, ScriptedSeq, u64>,
    ) -> Result<EffectOutcome> {
        router.apply(effect)
    }
}

/// A [`ScriptedRouter`] with a test's [`Hooks`] around its launches, awaits and effects; every
/// other call goes to the router unchanged.
#[derive(Debug)]
pub struct Hooked<H> {
    /// The router the calls reach.
    pub router: ScriptedRouter,
    /// What the test does around them.
    pub hooks: H,
}

impl<H: Hooks> DeviceIo for Hooked<H> {
    type Seq = ScriptedSeq;
    type Ptr = u64;
    type Model = ScriptedConfig;
    type LoraCmd = LoraCommand;
    type LoraAck = LoraAck;

    fn model(&self) -> &ScriptedConfig {
        self.router.model()
    }

    fn facts(&self) -> DeviceFacts {
        self.router.facts()
    }

    fn max_depth(&self) -> usize {
        self.router.max_depth()
    }

    fn computes_on_host(&self) -> bool {
        self.router.computes_on_host()
    }

    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut ScriptedSeq]) -> Result<Ticket> {
        self.hooks.launch(&self.router, plan, rows)
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<u64>> {
        self.hooks.await_result(&self.router, ticket)
    }

    fn apply(&self, effect: Effect<'_, ScriptedSeq, u64>) -> Result<EffectOutcome> {
        self.hooks.apply(&self.router, effect)
    }

    fn clear_prefix_cache(&self) -> Result<()> {
        self.router.clear_prefix_cache()
    }

    fn subscribe_cache_events(&self, sink: Box<dyn CacheEventSink>) -> Result<()> {
        self.router.subscribe_cache_events(sink)
    }

    fn lora(&mut self, cmd: LoraCommand) -> std::result::Result<LoraAck, LoraError> {
        self.router.lora(cmd)
    }

    fn teardown(self: Box<Self>) -> Result<()> {
        Box::new(self.router).teardown()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn depth_two() -> ScriptedRouter {
        ScriptedRouter::new(ScriptedConfig {
            max_depth: 2,
            ..ScriptedConfig::default()
        })
    }

    /// Prefills `seq` completely; answers its first token.
    fn prefilled(router: &ScriptedRouter, seq: &mut ScriptedSeq) -> u32 {
        let plan = StepPlan::Prefill {
            budgets: &[64],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [seq]).unwrap();
        router.await_result(ticket).unwrap().rows[0].token.unwrap()
    }

    #[test]
    fn rollback_is_unsupported_at_depth_one_and_exact_at_depth_two() {
        let sync = ScriptedRouter::new(ScriptedConfig::default());
        let mut a = seq(1, &[1]);
        let err = sync.apply(Effect::Rollback { seq: &mut a }).unwrap_err();
        assert_eq!(err, DeviceError::Unsupported { what: "Rollback" });

        // A reservation that no step used: the rollback gives its block back.
        let ahead = depth_two();
        let mut b = seq(2, &[1, 2, 3, 4]);
        let first = prefilled(&ahead, &mut b);
        let before = (ahead.facts(), b.clone());
        assert_eq!(
            ahead.apply(Effect::ReserveKv { seq: &mut b }).unwrap(),
            EffectOutcome::Reserved { blocks: 1 }
        );
        assert_eq!(
            ahead.apply(Effect::Rollback { seq: &mut b }).unwrap(),
            EffectOutcome::Unit
        );
        assert_eq!((ahead.facts(), b.clone()), before);

        // A run-ahead that computed its position: the position and its block go, and the
        // sequence can only be released afterwards.
        ahead.apply(Effect::ReserveKv { seq: &mut b }).unwrap();
        let plan = StepPlan::DecodeFed {
            sources: &[Feed::Host(first)],
            masks: &[],
        };
        let ticket = ahead.launch(plan, &mut [&mut b]).unwrap();
        ahead.await_result(ticket).unwrap();
        assert_eq!(ahead.inputs(2), vec![(4, first)]);
        assert_eq!(b.computed_len(), 5);
        ahead.apply(Effect::Rollback { seq: &mut b }).unwrap();
        assert_eq!((ahead.facts(), b.computed_len()), (before.0, 4));
        assert_eq!(ahead.inputs(2), vec![]);
        assert_eq!(ahead.rollbacks(), vec![2]);
        let plan = StepPlan::Decode {
            tokens: &[first],
            readback: Readback::Argmax,
        };
        let err = ahead.launch(plan, &mut [&mut b]).unwrap_err();
        assert!(
            matches!(err, DeviceError::Invalid { what: "Decode", .. }),
            "{err}"
        );

        // A second rollback has nothing to undo: a typed error that changes nothing.
        let before = (ahead.facts(), b.clone());
        let err = ahead.apply(Effect::Rollback { seq: &mut b }).unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::Invalid {
                    what: "Rollback",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!((ahead.facts(), b.clone()), before);
        assert_eq!(ahead.rollbacks(), vec![2]);
        release(&ahead, &mut b, true);
        Box::new(ahead).teardown().unwrap();
    }

    #[test]
    fn fed_rows_take_the_previous_steps_answers_on_the_device() {
        let router = depth_two();
        let (mut a, mut b) = (seq(1, &[1, 2, 3]), seq(2, &[4, 5]));
        let plan = StepPlan::Prefill {
            budgets: &[8, 8],
            readback: Readback::Argmax,
        };
        let t1 = router.launch(plan, &mut [&mut a, &mut b]).unwrap();
        // Step 2 runs ahead of step 1: b first, fed from row 1 of step 1, and a from row 0.
        for s in [&mut a, &mut b] {
            router.apply(Effect::ReserveKv { seq: s }).unwrap();
        }
        let plan = StepPlan::DecodeFed {
            sources: &[Feed::Row(1), Feed::Row(0)],
            masks: &[],
        };
        let t2 = router.launch(plan, &mut [&mut b, &mut a]).unwrap();
        // A third step would exceed the depth.
        let plan = StepPlan::DecodeFed {
            sources: &[Feed::Row(0)],
            masks: &[],
        };
        let err = router.launch(plan, &mut [&mut b]).unwrap_err();
        assert!(
            matches!(err, DeviceError::Invalid { what: "launch", .. }),
            "{err}"
        );
        // Tickets are awaited in launch order.
        let err = router.await_result(t2).unwrap_err();
        assert!(matches!(err, DeviceError::Invalid { .. }), "{err}");
        let first = router.await_result(t1).unwrap();
        let second = router.await_result(t2).unwrap();
        let (a1, b1) = (first.rows[0].token.unwrap(), first.rows[1].token.unwrap());
        assert_eq!(router.inputs(1), vec![(3, a1)]);
        assert_eq!(router.inputs(2), vec![(2, b1)]);
        assert_eq!(second.rows[0].token, Some(router.fallback_token(2, 3)));

        // A source row of another sequence, a missing row and a foreign token are refused.
        let bad: [(&[Feed], &str); 3] = [
            (&[Feed::Row(1)], "which was sequence 1"),
            (&[Feed::Row(2)], "the previous step had 2 rows"),
            (&[Feed::Host(999)], "vocabulary"),
        ];
        for (sources, needle) in bad {
            let before = (router.facts(), b.clone());
            let plan = StepPlan::DecodeFed {
                sources,
                masks: &[],
            };
            let err = router.launch(plan, &mut [&mut b]).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
            assert_eq!((router.facts(), b.clone()), before);
        }
    }

    #[test]
    fn masks_restrict_the_answer_and_must_allow_a_token() {
        let router = depth_two();
        let mut a = seq(1, &[1, 2]);
        prefilled(&router, &mut a);
        let natural = router.fallback_token(1, 3);
        let mut mask = vec![false; 256];
        mask[(natural as usize + 5) % 256] = true;
        let masks: [&[bool]; 1] = [&mask];
        let plan = StepPlan::DecodeFed {
            sources: &[Feed::Row(0)],
            masks: &masks,
        };
        let ticket = router.launch(plan, &mut [&mut a]).unwrap();
        let step = router.await_result(ticket).unwrap();
        assert_eq!(step.rows[0].token, Some((natural + 5) % 256));
        let none = vec![false; 256];
        let masks: [&[bool]; 1] = [&none];
        let plan = StepPlan::Decode {
            tokens: &[0],
            readback: Readback::ArgmaxMasked { masks: &masks },
        };
        let err = router.launch(plan, &mut [&mut a]).unwrap_err();
        assert!(err.to_string().contains("allows no token"), "{err}");
    }

    #[test]
    fn a_lost_step_takes_the_fed_step_after_it_along() {
        let router = depth_two();
        let mut a = seq(1, &[1, 2]);
        let token = prefilled(&router, &mut a);
        let plan = StepPlan::Decode {
            tokens: &[token],
            readback: Readback::Argmax,
        };
        let t1 = router.launch(plan, &mut [&mut a]).unwrap();
        router.apply(Effect::ReserveKv { seq: &mut a }).unwrap();
        let plan = StepPlan::DecodeFed {
            sources: &[Feed::Row(0)],
            masks: &[],
        };
        let t2 = router.launch(plan, &mut [&mut a]).unwrap();
        router.inject(FaultAt::Await, DeviceError::DeviceLost("test".into()));
        assert!(matches!(
            router.await_result(t1),
            Err(DeviceError::DeviceLost(_))
        ));
        let err = router.await_result(t2).unwrap_err();
        assert!(err.to_string().contains("ticket 2"), "{err}");
        router
            .apply(Effect::ReleaseSeq {
                seq: &mut a,
                cache: false,
                what: "fault",
            })
            .unwrap();
        Box::new(router).teardown().unwrap();
    }

    #[test]
    fn a_simulated_step_time_holds_await_back_from_launch_on() {
        let step_time = Duration::from_millis(3);
        let router = ScriptedRouter::new(ScriptedConfig::default()).with_step_time(step_time);
        let mut a = seq(1, &[1, 2]);
        let launched = Instant::now();
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [&mut a]).unwrap();
        router.await_result(ticket).unwrap();
        // A lower bound only: the simulated device never finishes early.
        assert!(launched.elapsed() >= step_time);
    }

    #[test]
    fn teardown_reports_an_unsettled_step() {
        let router = ScriptedRouter::new(ScriptedConfig::default());
        let mut a = seq(1, &[1, 2]);
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        router.launch(plan, &mut [&mut a]).unwrap();
        let err = Box::new(router).teardown().unwrap_err();
        assert!(err.to_string().contains("1 unsettled steps"), "{err}");
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
        // Three blocks of 4, one of them held by b: a's 9 tokens fit the context, not the pool.
        let router = ScriptedRouter::new(ScriptedConfig {
            num_blocks: 3,
            ..ScriptedConfig::default()
        });
        let mut b = seq(2, &[1, 2, 3]);
        let plan = StepPlan::Prefill {
            budgets: &[8],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [&mut b]).unwrap();
        router.await_result(ticket).unwrap();
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
