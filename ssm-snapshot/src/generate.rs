//! Synthetic traces in the Marconi JSONL format (`simulate --generate`, the policy grid): chat
//! with short replies, ShareGPT-like long replies, agentic sessions with edited histories,
//! long-reply chat with bursty think times, a mix of all four, and an adversarial workload whose
//! regime flips back and forth.
//!
//! Every generator is a pure function of its seed (ChaCha8). Inputs replay the whole history of
//! their session (as a chat template would), except where the agentic kinds edit it. Requests are
//! sorted by arrival time; session ids are unique within a trace.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::SnapshotError;
use crate::sim::{SessionId, TraceRecord};

/// The synthetic workloads of `--generate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKind {
    /// Multi-turn chat: 10 to 20 turns, short replies, some popular shared openers.
    Chat,
    /// Long-reply chat (ShareGPT-like): 2 to 8 turns, replies of 300 to 1200 tokens.
    ShareGpt,
    /// Agentic sessions: a long system prompt shared by all, a repository context shared by the
    /// sessions on the same repository, 15 to 30 turns of tool calls and results, with history
    /// edits (compaction, dropped tool results) instead of pure extension.
    Agentic,
    /// Long-reply chat: 10 to 30 turns (median 11) whose replies have a long tail (log-logistic,
    /// median 350 tokens, mean about 460, capped at 3,000), short user turns, few shared openers
    /// (one session in ten), and bursty think times (exponential, mean 35 s: some turns follow
    /// at once, some after minutes). Inputs grow by about 540 tokens a turn (mean input about
    /// 3,700 tokens).
    LongChat,
    /// All of the above in one trace over the same span: 40% of the sessions chat, 30% long-reply
    /// chat, 20% ShareGPT-like, 10% agentic.
    Mix,
    /// An adversarial workload against a tuner that follows the recent past: phases of 500 s
    /// alternate between serial agent sessions (one shared 4,000-token system prompt, one session
    /// at a time, so the prompt's node has a single child most of the time: recency by path keeps
    /// it, recency by hit does not) and a crowd of long-reply chats with bursty think times that
    /// pause during the agent phases (so they resume after a gap longer than any reuse the
    /// agent phase measured). `sessions` is the number of chats.
    Shifting,
}

impl TraceKind {
    /// Every kind with its name.
    pub const ALL: [(&'static str, TraceKind); 6] = [
        ("chat", TraceKind::Chat),
        ("sharegpt", TraceKind::ShareGpt),
        ("agentic", TraceKind::Agentic),
        ("longchat", TraceKind::LongChat),
        ("mix", TraceKind::Mix),
        ("shifting", TraceKind::Shifting),
    ];

    /// Parses a kind by name (`chat`, `sharegpt`, `agentic`, `longchat`, `mix`, `shifting`).
    pub fn parse(text: &str) -> Result<Self, SnapshotError> {
        Self::ALL
            .iter()
            .find(|(name, _)| *name == text)
            .map(|&(_, kind)| kind)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(name, _)| *name).collect();
                SnapshotError::BadArgument(format!(
                    "trace kind `{text}` (expected {})",
                    names.join(", ")
                ))
            })
    }
}

const VOCAB: u32 = 50_000;

/// Seconds of arrival span per session: about the same number of sessions is live at any time
/// whatever the session count.
const SPAN_PER_SESSION: f64 = 20.0;

fn random_tokens(rng: &mut ChaCha8Rng, lo: usize, hi: usize) -> Vec<u32> {
    let len = rng.random_range(lo..=hi);
    tokens_of_len(rng, len)
}

/// `len` random tokens.
fn tokens_of_len(rng: &mut ChaCha8Rng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(0..VOCAB)).collect()
}

/// A length with a long tail: log-logistic with median `median` and shape `shape` (the tail
/// falls like `x^-shape`; the mean is `median · (π/shape) / sin(π/shape)`), drawn by inverting its
/// distribution function, clamped to `lo..=hi`.
fn long_tailed(rng: &mut ChaCha8Rng, median: f64, shape: f64, lo: usize, hi: usize) -> usize {
    let u: f64 = rng.random_range(1e-9..1.0 - 1e-9);
    let x = median * (u / (1.0 - u)).powf(1.0 / shape);
    (x.round() as usize).clamp(lo, hi)
}

/// An exponential wait of mean `mean` (inverse distribution function).
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    let u: f64 = rng.random_range(1e-12..1.0);
    -u.ln() * mean
}

/// Picks `0..n` with weight `1 / (i + 1)` (a Zipf-like popularity).
fn zipf(rng: &mut ChaCha8Rng, n: usize) -> usize {
    let total: f64 = (0..n).map(|i| 1.0 / (i + 1) as f64).sum();
    let mut x = rng.random::<f64>() * total;
    for i in 0..n {
        x -= 1.0 / (i + 1) as f64;
        if x <= 0.0 {
            return i;
        }
    }
    n - 1
}

/// Generates a synthetic trace of `sessions` sessions, sorted by arrival time.
pub fn generate(kind: TraceKind, sessions: usize, seed: u64) -> Vec<TraceRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut records = Vec::new();
    let span = sessions as f64 * SPAN_PER_SESSION;
    match kind {
        TraceKind::Chat => chat(&mut rng, true, 0..sessions, span, &mut records),
        TraceKind::ShareGpt => chat(&mut rng, false, 0..sessions, span, &mut records),
        TraceKind::Agentic => agentic(&mut rng, 0..sessions, span, &mut records),
        TraceKind::LongChat => long_chat(&mut rng, 0..sessions, span, &mut records, |v| v),
        TraceKind::Mix => {
            // Each part draws from its own stream, so the parts do not depend on each other.
            let counts = [
                sessions * 4 / 10,
                sessions * 3 / 10,
                sessions * 2 / 10,
                (sessions / 10).max(1),
            ];
            let mut first = 0;
            for (stream, &count) in counts.iter().enumerate() {
                let mut part = ChaCha8Rng::seed_from_u64(seed);
                part.set_stream(stream as u64 + 1);
                let ids = first..first + count;
                match stream {
                    0 => chat(&mut part, true, ids, span, &mut records),
                    1 => long_chat(&mut part, ids, span, &mut records, |v| v),
                    2 => chat(&mut part, false, ids, span, &mut records),
                    _ => agentic(&mut part, ids, span, &mut records),
                }
                first += count;
            }
        }
        TraceKind::Shifting => shifting(&mut rng, sessions, span, &mut records),
    }
    records.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    records
}

/// `trace` with a few pairs of adjacent requests of different sessions served in the other
/// order: each such pair is swapped with probability `rate` (a pair just swapped is not swapped
/// again), and every position keeps its arrival time, so each session's requests keep their
/// order and the times stay sorted. A small arrival-time jitter: replaying a trace and its
/// jittered copies under one policy measures how much of a cell's figure is the chaos of which
/// sequence an eviction happened to hit (`short_grid --jitter`), not the policy. The same
/// `seed` gives the same copy. A `rate` above 1 counts as 1; one below 0, or NaN, as 0.
pub fn jitter(trace: &[TraceRecord], rate: f64, seed: u64) -> Vec<TraceRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = trace.to_vec();
    let rate = if rate > 0.0 { rate.min(1.0) } else { 0.0 };
    let mut i = 0;
    while i + 1 < out.len() {
        if out[i].session_id != out[i + 1].session_id && rng.random_bool(rate) {
            out.swap(i, i + 1);
            let (earlier, later) = (out[i + 1].ts, out[i].ts);
            out[i].ts = earlier;
            out[i + 1].ts = later;
            i += 2;
        } else {
            i += 1;
        }
    }
    out
}

/// Chat (`chat`) or ShareGPT-like (`!chat`) sessions with ids `ids`, arriving over `span`.
fn chat(
    rng: &mut ChaCha8Rng,
    chat: bool,
    ids: std::ops::Range<usize>,
    span: f64,
    records: &mut Vec<TraceRecord>,
) {
    let openers: Vec<Vec<u32>> = (0..8).map(|_| random_tokens(rng, 200, 800)).collect();
    for session in ids {
        let mut history = if rng.random_bool(if chat { 0.6 } else { 0.2 }) {
            openers[zipf(rng, openers.len())].clone()
        } else {
            random_tokens(rng, 50, 300)
        };
        let turns = if chat {
            rng.random_range(10..=20)
        } else {
            rng.random_range(2..=8)
        };
        let mut ts = rng.random::<f64>() * span;
        for turn in 0..turns {
            let user = if chat {
                random_tokens(rng, 20, 300)
            } else {
                random_tokens(rng, 20, 200)
            };
            history.extend_from_slice(&user);
            let reply = if chat {
                random_tokens(rng, 50, 400)
            } else {
                random_tokens(rng, 300, 1200)
            };
            records.push(record(session, turn, ts, &history, &reply));
            history.extend_from_slice(&reply);
            ts += rng.random_range(10.0..60.0);
        }
    }
}

/// Long-reply chat sessions with ids `ids` (see [`TraceKind::LongChat`]); session time `v`
/// (arrival within `span`, then think times) happens at `when(v)`.
fn long_chat(
    rng: &mut ChaCha8Rng,
    ids: std::ops::Range<usize>,
    span: f64,
    records: &mut Vec<TraceRecord>,
    when: impl Fn(f64) -> f64,
) {
    let openers: Vec<Vec<u32>> = (0..8).map(|_| random_tokens(rng, 200, 800)).collect();
    for session in ids {
        let mut history = if rng.random_bool(0.1) {
            openers[zipf(rng, openers.len())].clone()
        } else {
            random_tokens(rng, 50, 300)
        };
        // Most sessions are short, a few run to 30 turns.
        let turns = long_tailed(rng, 11.0, 4.0, 10, 30);
        let mut v = rng.random::<f64>() * span;
        for turn in 0..turns {
            let user = random_tokens(rng, 10, 150);
            history.extend_from_slice(&user);
            let len = long_tailed(rng, 350.0, 2.4, 20, 3000);
            let reply = tokens_of_len(rng, len);
            records.push(record(session, turn, when(v), &history, &reply));
            history.extend_from_slice(&reply);
            v += exponential(rng, 35.0);
        }
    }
}

/// Agentic sessions with ids `ids` (see [`TraceKind::Agentic`]), arriving over `span`.
fn agentic(
    rng: &mut ChaCha8Rng,
    ids: std::ops::Range<usize>,
    span: f64,
    records: &mut Vec<TraceRecord>,
) {
    let system = random_tokens(rng, 3000, 3000);
    let repos: Vec<Vec<u32>> = (0..(ids.len() / 4).max(1))
        .map(|_| random_tokens(rng, 2000, 6000))
        .collect();
    for session in ids {
        let repo = &repos[zipf(rng, repos.len())];
        // The history as messages; the first two are the shared system prompt and repo.
        let mut messages: Vec<Vec<u32>> =
            vec![system.clone(), repo.clone(), random_tokens(rng, 50, 300)];
        let turns = rng.random_range(15..=30);
        let mut ts = rng.random::<f64>() * span;
        for turn in 0..turns {
            if turn >= 2 && rng.random_bool(0.15) {
                // Edit the history: keep a prefix of the messages (past the shared ones) and
                // replace the rest by a summary.
                let keep = rng.random_range(3..messages.len());
                messages.truncate(keep);
                messages.push(random_tokens(rng, 100, 400));
            }
            let input: Vec<u32> = messages.concat();
            let call = random_tokens(rng, 30, 200);
            records.push(record(session, turn, ts, &input, &call));
            messages.push(call);
            messages.push(random_tokens(rng, 50, 800));
            ts += rng.random_range(2.0..20.0);
        }
    }
}

/// Seconds per phase of [`TraceKind::Shifting`].
const PHASE: f64 = 500.0;

/// [`TraceKind::Shifting`]: `chats` long-reply chats whose session time runs only in the odd
/// phases, and serial agent sessions filling the even phases.
fn shifting(rng: &mut ChaCha8Rng, chats: usize, span: f64, records: &mut Vec<TraceRecord>) {
    // Session time v of the chats maps into the odd phases: [PHASE, 2 PHASE), [3 PHASE, ...
    let when = |v: f64| {
        let phase = (v / PHASE).floor();
        (2.0 * phase + 1.0) * PHASE + (v - phase * PHASE)
    };
    let mut chat_records = Vec::new();
    long_chat(rng, 0..chats, span, &mut chat_records, when);
    let end = chat_records.iter().map(|r| r.ts).fold(0.0, f64::max);
    records.append(&mut chat_records);
    // The agent phases up to the end of the chats: one session at a time, each starting
    // where the previous one ended, cut off at the end of its phase.
    let system = random_tokens(rng, 4000, 4000);
    let mut session = chats;
    let mut start = 0.0;
    while start < end {
        let mut ts = start;
        while ts < start + PHASE {
            let mut messages: Vec<Vec<u32>> = vec![system.clone(), random_tokens(rng, 50, 300)];
            let turns = rng.random_range(6..=12);
            for turn in 0..turns {
                let input: Vec<u32> = messages.concat();
                let call = random_tokens(rng, 30, 200);
                records.push(record(session, turn, ts, &input, &call));
                messages.push(call);
                messages.push(random_tokens(rng, 50, 500));
                ts += rng.random_range(2.0..8.0);
                if ts >= start + PHASE {
                    break;
                }
            }
            session += 1;
        }
        start += 2.0 * PHASE;
    }
}

fn record(session: usize, turn: usize, ts: f64, input: &[u32], output: &[u32]) -> TraceRecord {
    TraceRecord {
        session_id: SessionId::Number(session as u64),
        turn_id: turn as u64,
        ts,
        num_input_tokens: input.len(),
        num_output_tokens: output.len(),
        input_tokens: input.to_vec(),
        output_tokens: output.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each session's requests in the order they appear, as (turn, input length).
    fn by_session(trace: &[TraceRecord]) -> Vec<(SessionId, Vec<(u64, usize)>)> {
        let mut sessions: Vec<(SessionId, Vec<(u64, usize)>)> = Vec::new();
        for r in trace {
            match sessions.iter_mut().find(|(id, _)| *id == r.session_id) {
                Some((_, turns)) => turns.push((r.turn_id, r.input_tokens.len())),
                None => sessions.push((
                    r.session_id.clone(),
                    vec![(r.turn_id, r.input_tokens.len())],
                )),
            }
        }
        sessions.sort_by_key(|(id, _)| format!("{id:?}"));
        sessions
    }

    #[test]
    fn jitter_swaps_neighbours_of_different_sessions_and_keeps_each_sessions_order() {
        let trace = generate(TraceKind::Mix, 20, 3);
        let copy = jitter(&trace, 0.05, 7);
        assert_eq!(copy.len(), trace.len());
        // The same requests, each session's in its order, the times where they were.
        assert_eq!(by_session(&copy), by_session(&trace));
        let times: Vec<f64> = trace.iter().map(|r| r.ts).collect();
        assert_eq!(copy.iter().map(|r| r.ts).collect::<Vec<_>>(), times);
        // Positions that changed come in swapped neighbour pairs of different sessions.
        let mut moved = 0;
        let mut i = 0;
        while i < trace.len() {
            if copy[i].input_tokens == trace[i].input_tokens {
                i += 1;
                continue;
            }
            assert_eq!(copy[i].input_tokens, trace[i + 1].input_tokens);
            assert_eq!(copy[i + 1].input_tokens, trace[i].input_tokens);
            assert_ne!(trace[i].session_id, trace[i + 1].session_id);
            moved += 1;
            i += 2;
        }
        assert!(
            moved > 0,
            "a rate of 0.05 over {} requests swapped none",
            trace.len()
        );
        // Deterministic in its seed; another seed, another copy; rate 0, the trace itself.
        let inputs =
            |t: &[TraceRecord]| t.iter().map(|r| r.input_tokens.clone()).collect::<Vec<_>>();
        assert_eq!(inputs(&jitter(&trace, 0.05, 7)), inputs(&copy));
        assert_ne!(inputs(&jitter(&trace, 0.05, 8)), inputs(&copy));
        assert_eq!(inputs(&jitter(&trace, 0.0, 7)), inputs(&trace));
        // Rates outside a probability are bounded, not a panic: NaN and below 0 swap nothing,
        // above 1 swaps as 1 does (every other eligible pair from the start).
        assert_eq!(inputs(&jitter(&trace, f64::NAN, 7)), inputs(&trace));
        assert_eq!(inputs(&jitter(&trace, -1.0, 7)), inputs(&trace));
        assert_eq!(
            inputs(&jitter(&trace, 7.0, 7)),
            inputs(&jitter(&trace, 1.0, 7))
        );
    }
}
