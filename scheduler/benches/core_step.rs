//! Core overhead per decode step: 256 running rows over a router that computes nothing, so the
//! time measured is the engine's own work (batch assembly, launch/settle bookkeeping, token
//! acceptance, streaming, stop checks, compaction scan). Target: at most 30 µs per step.
//!
//! `cargo bench -p scheduler --bench core_step`

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use device_io::{
    DeviceError, DeviceFacts, DeviceIo, Effect, EffectOutcome, LoraAck, LoraCommand, LoraError,
    PrefillReport, RowOutput, SeqSpec, Sequence, StepPlan, StepResult, Ticket,
};
use scheduler::{Engine, EngineConfig, Event, Request, RequestHandle};

const VOCAB: usize = 32_000;

/// A sequence of the no-compute router: lengths and a slot, nothing else.
#[derive(Debug)]
struct NullSeq {
    id: u64,
    prompt_len: usize,
    tokens: Vec<u32>,
    computed: usize,
    slot: Option<usize>,
}

impl Sequence for NullSeq {
    fn create(spec: SeqSpec<'_>) -> Self {
        NullSeq {
            id: spec.id,
            prompt_len: spec.prompt.len(),
            tokens: spec.prompt.to_vec(),
            computed: 0,
            slot: None,
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

#[derive(Debug)]
struct NullState {
    slots: Vec<bool>,
    next_ticket: u64,
    settled: Option<StepResult<u64>>,
}

/// A router that does the contract's bookkeeping (slots, lengths, tickets) and no compute; its
/// argmax is a fixed function of id and position. KV is unlimited.
#[derive(Debug)]
struct NullRouter {
    slots: usize,
    state: Mutex<NullState>,
}

impl NullRouter {
    fn new(slots: usize) -> Self {
        NullRouter {
            slots,
            state: Mutex::new(NullState {
                slots: vec![false; slots],
                next_ticket: 1,
                settled: None,
            }),
        }
    }
}

impl DeviceIo for NullRouter {
    type Seq = NullSeq;
    type Ptr = u64;
    type Model = ();
    type LoraCmd = LoraCommand;
    type LoraAck = LoraAck;

    fn model(&self) -> &() {
        &()
    }

    fn facts(&self) -> DeviceFacts {
        let state = self.state.lock().unwrap();
        DeviceFacts {
            block_size: 16,
            vocab_size: VOCAB,
            max_context: 1 << 30,
            kv_blocks_total: 1 << 30,
            kv_blocks_free: 1 << 30,
            kv_blocks_cached: 0,
            live_slots_total: self.slots,
            live_slots_used: state.slots.iter().filter(|used| **used).count(),
            checkpoint_slots_total: 0,
            checkpoint_slots_used: 0,
            snapshot_slots_total: 0,
        }
    }

    fn max_depth(&self) -> usize {
        1
    }

    fn launch(&self, plan: StepPlan<'_>, rows: &mut [&mut NullSeq]) -> Result<Ticket, DeviceError> {
        let mut state = self.state.lock().unwrap();
        let mut outputs = Vec::with_capacity(rows.len());
        for (index, seq) in rows.iter_mut().enumerate() {
            let prefill = match &plan {
                StepPlan::Prefill { budgets, .. } => {
                    if seq.slot.is_none() {
                        let slot = state
                            .slots
                            .iter()
                            .position(|used| !*used)
                            .ok_or(DeviceError::SlotsExhausted { total: self.slots })?;
                        state.slots[slot] = true;
                        seq.slot = Some(slot);
                    }
                    let add = budgets[index].min(seq.prompt_len - seq.computed);
                    seq.computed += add;
                    Some(PrefillReport {
                        cached: 0,
                        computed: add,
                        done: seq.computed >= seq.prompt_len,
                    })
                }
                StepPlan::Decode { tokens, .. } => {
                    seq.tokens.push(tokens[index]);
                    seq.computed += 1;
                    None
                }
                _ => {
                    seq.computed += 1;
                    None
                }
            };
            let token = (seq.computed >= seq.prompt_len)
                .then(|| ((seq.id as usize * 31 + seq.computed) % VOCAB) as u32);
            outputs.push(RowOutput {
                token,
                logits_row: None,
                prefill,
                run: None,
            });
        }
        let ticket = Ticket(state.next_ticket);
        state.next_ticket += 1;
        state.settled = Some(StepResult {
            ticket,
            rows: outputs,
            logits: None,
            tokens: Vec::new(),
        });
        Ok(ticket)
    }

    fn await_result(&self, ticket: Ticket) -> Result<StepResult<u64>, DeviceError> {
        let mut state = self.state.lock().unwrap();
        match state.settled.take() {
            Some(result) if result.ticket == ticket => Ok(result),
            _ => Err(DeviceError::UnknownTicket(ticket)),
        }
    }

    fn apply(&self, effect: Effect<'_, NullSeq, u64>) -> Result<EffectOutcome, DeviceError> {
        let mut state = self.state.lock().unwrap();
        match effect {
            Effect::ReleaseSeq { seq, .. } => {
                if let Some(slot) = seq.slot.take() {
                    state.slots[slot] = false;
                }
            }
            Effect::CompactSlot { seq, target } => {
                if let Some(slot) = seq.slot.replace(target) {
                    state.slots[slot] = false;
                }
                state.slots[target] = true;
            }
            _ => {}
        }
        Ok(EffectOutcome::Unit)
    }

    fn lora(&mut self, _cmd: LoraCommand) -> Result<LoraAck, LoraError> {
        Err(LoraError::Unsupported {
            what: "LoRA (the benchmark's router has no adapters)",
        })
    }

    fn teardown(self: Box<Self>) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// An engine kept at `rows` decoding rows: requests that end are replaced (untimed).
struct Harness {
    engine: Engine<NullRouter>,
    handles: Vec<RequestHandle>,
    rows: usize,
    next_prompt: u32,
}

impl Harness {
    fn new(rows: usize) -> Self {
        let config = EngineConfig {
            max_running: rows,
            max_step_tokens: rows * 16 + 1,
            max_prefill_chunk: 16,
            ..EngineConfig::default()
        };
        Harness {
            engine: Engine::new(NullRouter::new(rows), config).unwrap(),
            handles: Vec::new(),
            rows,
            next_prompt: 0,
        }
    }

    fn refill(&mut self) {
        while self.engine.running_len() + self.engine.waiting_len() < self.rows {
            self.next_prompt = (self.next_prompt + 1) % VOCAB as u32;
            let prompt = vec![self.next_prompt; 8];
            self.handles
                .push(self.engine.submit(Request::greedy(prompt, 2048)).unwrap());
        }
        // Prefill the newcomers so the timed steps are pure decode steps.
        loop {
            let report = self.engine.step();
            if self.engine.waiting_len() == 0 && report.prefill_rows == 0 {
                break;
            }
        }
    }

    fn timed_step(&mut self) -> Duration {
        if self.engine.running_len() < self.rows {
            self.refill();
        }
        let started = Instant::now();
        let report = self.engine.step();
        let elapsed = started.elapsed();
        debug_assert_eq!(report.decode_rows, self.rows);
        // Consume the streams (client work, untimed) so memory stays flat.
        self.handles.retain(|handle| {
            let mut open = true;
            while let Ok(event) = handle.events().try_recv() {
                open &= matches!(event, Event::Token(_));
            }
            open
        });
        elapsed
    }
}

fn decode_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("core_decode_step");
    for rows in [1usize, 64, 256] {
        let mut harness = Harness::new(rows);
        harness.refill();
        group.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, _| {
            b.iter_custom(|iters| (0..iters).map(|_| harness.timed_step()).sum())
        });
    }
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
