//! The pipelined router (`max_depth: 2`) against the synchronous one: fed steps give the same
//! tokens and logits bits, a rollback leaves the prefix cache and the Marconi checkpoints exactly
//! as if the over-run had never been launched, masked argmax equals masking on the host, spill
//! images taken while a step computes are the synchronous ones byte for byte, and the depth,
//! ordering, ledger and teardown rules hold.

mod common;

use common::*;
use device_cpu::{CacheStats, CheckpointBudget, CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{
    DeviceError, DeviceIo, Effect, EffectOutcome, Feed, Readback, Sequence, StepPlan, Ticket,
};

const BLOCK: usize = 4;

fn router(depth: usize) -> CpuRouter {
    let mut config = CpuRouterConfig::new(64, 4);
    config.block_size = BLOCK;
    config.max_context = Some(200);
    config.checkpoints = CheckpointBudget::Slots(16);
    config.max_depth = depth;
    CpuRouter::new(hybrid_model(), config).unwrap()
}

/// The logits of a settled step, copied with `ReadLogits` (as the core does for digests).
fn read_logits(router: &CpuRouter, handle: device_cpu::LogitsHandle, rows: usize) -> Vec<f32> {
    let mut bytes = Vec::new();
    router
        .apply(Effect::ReadLogits {
            logits: handle,
            rows,
            into: &mut bytes,
        })
        .unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn checkpoints(router: &CpuRouter, seqs: &mut [&mut CpuSeq]) {
    for seq in seqs.iter_mut() {
        if seq.checkpoint_due() {
            router.apply(Effect::MarconiCheckpoint { seq }).unwrap();
        }
    }
}

/// What a run produced: every row's logits per step, the cache counters and facts at the end,
/// and a follow-up request's cached tokens and logits.
#[derive(Debug, PartialEq)]
struct Outcome {
    logits: Vec<Vec<u32>>,
    tokens: Vec<Vec<u32>>,
    held: Vec<(Option<usize>, Option<usize>)>,
    stats: CacheStats,
    facts: device_io::DeviceFacts,
    follow_up: (usize, Vec<u32>),
}

fn prompts() -> [Vec<u32>; 2] {
    [tokens(1, 21), tokens(2, 30)]
}

/// Both prompts' sequences (ids 1 and 2) prefilled on `r` in chunks of 64: the sequences, each
/// one's last prompt logits (as bits) and its first greedy token.
fn prefill_both(r: &CpuRouter) -> ([CpuSeq; 2], Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let [pa, pb] = prompts();
    let (mut a, mut b) = (seq(1, &pa), seq(2, &pb));
    let mut logits = vec![Vec::new(), Vec::new()];
    let mut out = vec![Vec::new(), Vec::new()];
    for (i, s) in [&mut a, &mut b].into_iter().enumerate() {
        let (row, _) = prefill(r, s, 64);
        out[i].push(argmax(&row));
        logits[i].extend(row.iter().map(|x| x.to_bits()));
    }
    ([a, b], logits, out)
}

/// The synchronous reference: prefill both, `steps` greedy decode steps each reading host
/// logits, checkpoints when due; then release (cached) and prefill a follow-up that extends the
/// first sequence's history.
fn synchronous(steps: usize) -> Outcome {
    let r = router(1);
    let ([mut a, mut b], mut logits, mut out) = prefill_both(&r);
    for _ in 0..steps {
        let inputs = [*out[0].last().unwrap(), *out[1].last().unwrap()];
        let host = decode(&r, &mut [&mut a, &mut b], &inputs);
        let vocab = host.len() / 2;
        for i in 0..2 {
            let row = &host[i * vocab..(i + 1) * vocab];
            out[i].push(argmax(row));
            logits[i].extend(row.iter().map(|x| x.to_bits()));
        }
    }
    finish(&r, a, b, logits, out)
}

fn finish(
    r: &CpuRouter,
    mut a: CpuSeq,
    mut b: CpuSeq,
    logits: Vec<Vec<u32>>,
    tokens: Vec<Vec<u32>>,
) -> Outcome {
    let held = vec![a.checkpoints_held(), b.checkpoints_held()];
    // The history the host knows: the prompt, then every token it fed.
    let fed = a.computed_len() - a.prompt_len();
    let mut history = prompts()[0].clone();
    history.extend_from_slice(&tokens[0][..fed]);
    release(r, &mut a, true);
    release(r, &mut b, true);
    let mut prompt = history;
    prompt.extend(common::tokens(9, 7));
    let mut c = seq(3, &prompt);
    let (row, report) = prefill(r, &mut c, 64);
    release(r, &mut c, true);
    Outcome {
        logits,
        tokens,
        held,
        stats: r.cache_stats().unwrap(),
        facts: r.facts(),
        follow_up: (report.cached, row.iter().map(|x| x.to_bits()).collect()),
    }
}

/// What happens after the last step of a pipelined run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OverRun {
    /// Nothing runs ahead.
    None,
    /// One more fed step runs; the host then learns the rows had stopped, having taken the
    /// checkpoint that step asked for (as a core would before a cancel), and rolls both back.
    RolledBack,
    /// The same, but the rollbacks are skipped (the negative control).
    Kept,
}

/// The same run pipelined: step k+1 is launched (fed from step k's argmax on the device) before
/// step k is awaited; logits are read with `ReadLogits` while the next step computes.
fn pipelined(steps: usize, over_run: OverRun) -> Outcome {
    let overrun = over_run != OverRun::None;
    let r = router(2);
    let ([mut a, mut b], mut logits, mut out) = prefill_both(&r);
    let launches = steps + usize::from(overrun);
    let mut in_flight: Option<Ticket> = None;
    for k in 0..launches {
        for s in [&mut a, &mut b] {
            let reserved = r.apply(Effect::ReserveKv { seq: s }).unwrap();
            assert!(matches!(reserved, EffectOutcome::Reserved { .. }));
        }
        let sources = if k == 0 {
            [
                Feed::Host(*out[0].last().unwrap()),
                Feed::Host(*out[1].last().unwrap()),
            ]
        } else {
            [Feed::Row(0), Feed::Row(1)]
        };
        let plan = StepPlan::DecodeFed {
            sources: &sources,
            masks: &[],
        };
        let ticket = r.launch(plan, &mut [&mut a, &mut b]).unwrap();
        if let Some(previous) = in_flight.replace(ticket) {
            settle(&r, previous, &mut logits, &mut out);
        }
        if k < steps {
            checkpoints(&r, &mut [&mut a, &mut b]);
        }
    }
    let last = in_flight.take().unwrap();
    if overrun {
        // The over-run's position reached a block boundary for `a`: the checkpoint a core
        // would take before it learns the row stopped.
        assert!(a.checkpoint_due());
        checkpoints(&r, &mut [&mut a, &mut b]);
        let step = r.await_result(last).unwrap();
        assert_eq!(step.rows.len(), 2);
        if over_run == OverRun::RolledBack {
            for s in [&mut a, &mut b] {
                r.apply(Effect::Rollback { seq: s }).unwrap();
            }
        }
    } else {
        settle(&r, last, &mut logits, &mut out);
    }
    finish(&r, a, b, logits, out)
}

fn settle(r: &CpuRouter, ticket: Ticket, logits: &mut [Vec<u32>], out: &mut [Vec<u32>]) {
    let step = r.await_result(ticket).unwrap();
    let host = read_logits(r, step.logits.unwrap(), 2);
    let vocab = host.len() / 2;
    for i in 0..2 {
        let row = &host[i * vocab..(i + 1) * vocab];
        assert_eq!(step.rows[i].token, Some(argmax(row)));
        out[i].push(step.rows[i].token.unwrap());
        logits[i].extend(row.iter().map(|x| x.to_bits()));
    }
}

#[test]
fn fed_steps_give_the_synchronous_tokens_logits_and_cache() {
    // Prompts of 21 and 30 tokens and 6 steps: `a` ends at 27 computed positions, with its
    // output checkpoint at 24.
    let reference = synchronous(6);
    assert_eq!(reference.held[0], (Some(20), Some(24)));
    assert!(reference.follow_up.0 > 0, "{reference:?}");
    assert_eq!(pipelined(6, OverRun::None), reference);
}

#[test]
fn a_rolled_back_over_run_leaves_no_trace() {
    // The over-run computes position 27 of `a` (reaching the boundary at 28, checkpointed) and
    // position 36 of `b`; the rollbacks must leave the blocks, the cached prefixes and the
    // checkpoints exactly as the synchronous run left them.
    let reference = synchronous(6);
    assert_eq!(pipelined(6, OverRun::RolledBack), reference);
}

/// The negative control of the test above: without the rollbacks the released sequences
/// remember the over-run (one more cached block of `a`, its checkpoint at 28), and the follow-up
/// request is served differently.
#[test]
fn without_the_rollback_the_over_run_is_remembered() {
    let reference = synchronous(6);
    let kept = pipelined(6, OverRun::Kept);
    assert_eq!(kept.tokens, reference.tokens);
    assert_eq!(kept.logits, reference.logits);
    assert_eq!(reference.held[0], (Some(20), Some(24)));
    assert_eq!(kept.held[0], (Some(20), Some(28)));
    assert_ne!(kept.stats, reference.stats);
    assert_ne!(kept.follow_up.0, reference.follow_up.0);
}

#[test]
fn a_rollback_without_a_reservation_is_a_typed_error_that_changes_nothing() {
    let r = router(2);
    let mut a = seq(1, &prompts()[0]);
    prefill(&r, &mut a, 64);
    let before = (r.facts(), a.computed_len(), a.blocks().to_vec());
    let err = r.apply(Effect::Rollback { seq: &mut a }).unwrap_err();
    assert!(
        matches!(&err, DeviceError::Invalid { what: "Rollback", detail } if detail.contains("no reservation")),
        "{err}"
    );
    assert_eq!((r.facts(), a.computed_len(), a.blocks().to_vec()), before);
    // A reservation no step used: the rollback gives its block back; a second has nothing left.
    assert_eq!(
        r.apply(Effect::ReserveKv { seq: &mut a }).unwrap(),
        EffectOutcome::Reserved { blocks: 0 }
    );
    r.apply(Effect::Rollback { seq: &mut a }).unwrap();
    assert!(r.apply(Effect::Rollback { seq: &mut a }).is_err());
    assert_eq!((r.facts(), a.computed_len(), a.blocks().to_vec()), before);
    // At a block boundary the reservation adds a block, and the rollback returns it.
    let mut b = seq(2, &tokens(3, 24));
    prefill(&r, &mut b, 64);
    let before = r.facts();
    assert_eq!(
        r.apply(Effect::ReserveKv { seq: &mut b }).unwrap(),
        EffectOutcome::Reserved { blocks: 1 }
    );
    assert_eq!(r.facts().kv_blocks_free, before.kv_blocks_free - 1);
    r.apply(Effect::Rollback { seq: &mut b }).unwrap();
    assert_eq!(r.facts(), before);
    // A sequence rolled back past a computed position may only be released.
    r.apply(Effect::ReserveKv { seq: &mut b }).unwrap();
    let plan = StepPlan::DecodeFed {
        sources: &[Feed::Host(5)],
        masks: &[],
    };
    let ticket = r.launch(plan, &mut [&mut b]).unwrap();
    r.await_result(ticket).unwrap();
    r.apply(Effect::Rollback { seq: &mut b }).unwrap();
    assert_eq!(b.computed_len(), 24);
    let plan = StepPlan::Decode {
        tokens: &[5],
        readback: Readback::Argmax,
    };
    let err = r.launch(plan, &mut [&mut b]).unwrap_err();
    assert!(err.to_string().contains("rolled back"), "{err}");
    let mut image = Vec::new();
    let err = r
        .apply(Effect::SaveSequenceState {
            seq: &b,
            writer: &mut image,
        })
        .unwrap_err();
    assert!(err.to_string().contains("rolled back"), "{err}");
    release(&r, &mut a, true);
    release(&r, &mut b, true);
}

#[test]
fn masked_argmax_is_the_argmax_of_the_masked_host_logits() {
    for depth in [1, 2] {
        let r = router(depth);
        let mut a = seq(1, &prompts()[0]);
        let (row, _) = prefill(&r, &mut a, 64);
        let vocab = row.len();
        // Allow every third token, except the unmasked winner.
        let winner = argmax(&row) as usize;
        let mask: Vec<bool> = (0..vocab).map(|t| t % 3 == 0 && t != winner).collect();
        let masks: [&[bool]; 1] = [&mask];
        let mut host = Vec::new();
        let plan = StepPlan::Decode {
            tokens: &[7],
            readback: Readback::HostLogits { into: &mut host },
        };
        // The reference: the same step on a twin sequence, logits to the host, masked there.
        let twin_router = router(1);
        let mut twin = seq(1, &prompts()[0]);
        prefill(&twin_router, &mut twin, 64);
        let ticket = twin_router.launch(plan, &mut [&mut twin]).unwrap();
        twin_router.await_result(ticket).unwrap();
        let expected = (0..vocab)
            .filter(|&t| mask[t])
            .fold(None::<usize>, |best, t| match best {
                Some(b) if host[b] >= host[t] => Some(b),
                _ => Some(t),
            })
            .unwrap() as u32;
        let plan = StepPlan::Decode {
            tokens: &[7],
            readback: Readback::ArgmaxMasked { masks: &masks },
        };
        let ticket = r.launch(plan, &mut [&mut a]).unwrap();
        let step = r.await_result(ticket).unwrap();
        assert_eq!(step.rows[0].token, Some(expected), "depth {depth}");
        assert_ne!(expected, argmax(&host));
        if depth == 2 {
            // A fed step with masks feeds the masked token and masks its own answer.
            r.apply(Effect::ReserveKv { seq: &mut a }).unwrap();
            let plan = StepPlan::DecodeFed {
                sources: &[Feed::Row(0)],
                masks: &masks,
            };
            let ticket = r.launch(plan, &mut [&mut a]).unwrap();
            let step = r.await_result(ticket).unwrap();
            let token = step.rows[0].token.unwrap();
            assert!(mask[token as usize]);
            release(&r, &mut a, true);
        }
        release(&twin_router, &mut twin, false);
        if depth == 1 {
            release(&r, &mut a, true);
        }
    }
}

#[test]
fn a_spill_image_taken_while_a_step_computes_is_the_synchronous_image() {
    let image = |depth: usize| {
        let r = router(depth);
        let mut a = seq(1, &prompts()[1]);
        let (row, _) = prefill(&r, &mut a, 64);
        let mut token = argmax(&row);
        for k in 0..5 {
            let ticket = if depth == 1 {
                let plan = StepPlan::Decode {
                    tokens: &[token],
                    readback: Readback::Argmax,
                };
                r.launch(plan, &mut [&mut a]).unwrap()
            } else {
                r.apply(Effect::ReserveKv { seq: &mut a }).unwrap();
                let source = if k == 0 {
                    Feed::Host(token)
                } else {
                    Feed::Row(0)
                };
                let plan = StepPlan::DecodeFed {
                    sources: &[source],
                    masks: &[],
                };
                r.launch(plan, &mut [&mut a]).unwrap()
            };
            if depth == 2 && k == 4 {
                // Saved before the last step is awaited: the router waits for it.
                let mut bytes = Vec::new();
                r.apply(Effect::SaveSequenceState {
                    seq: &a,
                    writer: &mut bytes,
                })
                .unwrap();
                r.await_result(ticket).unwrap();
                release(&r, &mut a, false);
                return bytes;
            }
            token = r.await_result(ticket).unwrap().rows[0].token.unwrap();
        }
        let mut bytes = Vec::new();
        r.apply(Effect::SaveSequenceState {
            seq: &a,
            writer: &mut bytes,
        })
        .unwrap();
        release(&r, &mut a, false);
        bytes
    };
    assert_eq!(image(2), image(1));
}

#[test]
fn depth_order_and_logits_lifetime_are_enforced() {
    let r = router(2);
    assert_eq!(r.max_depth(), 2);
    let (mut a, mut b) = (seq(1, &prompts()[0]), seq(2, &prompts()[1]));
    prefill(&r, &mut a, 64);
    prefill(&r, &mut b, 64);
    let launch = |s: &mut CpuSeq, feed: Feed| {
        r.apply(Effect::ReserveKv { seq: s }).unwrap();
        let plan = StepPlan::DecodeFed {
            sources: &[feed],
            masks: &[],
        };
        r.launch(plan, &mut [s])
    };
    let t1 = launch(&mut a, Feed::Host(3)).unwrap();
    // `b` was not a row of the previous step: it cannot feed from it.
    let err = launch(&mut b, Feed::Row(0)).unwrap_err();
    assert!(err.to_string().contains("another sequence"), "{err}");
    let t2 = launch(&mut a, Feed::Row(0)).unwrap();
    let err = launch(&mut a, Feed::Row(0)).unwrap_err();
    assert!(
        matches!(err, DeviceError::Invalid { what: "launch", .. }),
        "{err}"
    );
    let err = r.await_result(t2).unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::Invalid {
                what: "await_result",
                ..
            }
        ),
        "{err}"
    );
    let first = r.await_result(t1).unwrap();
    let handle = first.logits.unwrap();
    // Step 1's logits stay readable while step 2 is unsettled and after it settles...
    let logits = read_logits(&r, handle, 1);
    assert_eq!(step_token(&logits), first.rows[0].token);
    let second = r.await_result(t2).unwrap();
    read_logits(&r, handle, 1);
    // ...until a third step is launched.
    let t3 = launch(&mut a, Feed::Row(0)).unwrap();
    r.await_result(t3).unwrap();
    let err = r
        .apply(Effect::ReadLogits {
            logits: handle,
            rows: 1,
            into: &mut Vec::new(),
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("holds the logits of step"),
        "{err}"
    );
    read_logits(&r, second.logits.unwrap(), 1);
    assert_eq!(
        r.await_result(t1).unwrap_err(),
        DeviceError::UnknownTicket(t1)
    );
    release(&r, &mut a, true);
    release(&r, &mut b, true);
    Box::new(r).teardown().unwrap();
}

fn step_token(logits: &[f32]) -> Option<u32> {
    Some(argmax(logits))
}

#[test]
fn teardown_waits_for_the_worker_and_names_an_unclaimed_step() {
    let r = router(2);
    let mut a = seq(1, &prompts()[0]);
    prefill(&r, &mut a, 64);
    r.apply(Effect::ReserveKv { seq: &mut a }).unwrap();
    let plan = StepPlan::DecodeFed {
        sources: &[Feed::Host(1)],
        masks: &[],
    };
    let ticket = r.launch(plan, &mut [&mut a]).unwrap();
    release(&r, &mut a, false);
    let err = Box::new(r).teardown().unwrap_err();
    let text = err.to_string();
    assert!(text.contains(&format!("never awaited: {ticket}")), "{text}");
}
