//! Multi-turn workloads: traces in the Marconi artifact's JSONL format, and seeded built-in
//! generators (`chat`, `agentic`).
//!
//! A [`Workload`] is a list of [`Turn`]s in arrival order. Each turn's input is the whole
//! context the client sends (earlier turns' inputs and outputs included, as the trace recorded
//! it), and its output is the tokens the trace recorded, which replay forces. Traces are read by
//! `workload_trace` (the reader the simulator shares): an id at or above the model's vocabulary
//! is an error unless [`TokenIds::Fold`] folds it (`id % vocab_size`).
//!
//! Invariants: `turns` is sorted by `ts` (stable, so equal times keep file order); within a
//! session turns appear in increasing `turn` order; every token id is below the vocabulary size
//! the workload was built for; `session` values are dense indices `0..sessions`.

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use workload_trace::{Entry, ReadOptions, SessionId, TraceError, TraceReader};

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The session (dense index, in order of first appearance).
    pub session: u64,
    /// The turn's number within its session, as the trace gives it.
    pub turn: u64,
    /// Arrival time in seconds, as the trace gives it.
    pub ts: f64,
    /// The context sent: all earlier history plus the new message.
    pub input: Vec<u32>,
    /// The recorded output.
    pub output: Vec<u32>,
    /// The 1-based line of the trace file it came from (`None` for a generated workload).
    pub source_line: Option<usize>,
}

/// A workload: turns in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Where it came from (`chat`, `agentic`, or the file name).
    pub name: String,
    /// The turns, sorted by arrival time.
    pub turns: Vec<Turn>,
}

/// What to do with a trace's token ids at or above the model's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenIds {
    /// Refuse the trace, naming the line and the id (the default: a trace recorded with another
    /// tokenizer is a mistake to report, not to paper over).
    #[default]
    Refuse,
    /// Fold each such id into the vocabulary (`id % vocab_size`), for traces whose ids are
    /// only placeholders (the Marconi artifact's synthetic traces).
    Fold,
}

/// Why a workload could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace could not be read (the file, the line and the field at fault).
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The vocabulary size is 0.
    #[error("vocabulary size 0: token ids cannot be mapped")]
    ZeroVocab,
    /// A generator option (or the vocabulary size) is out of range.
    #[error("generator option {field} = {value} ({rule})")]
    BadOption {
        /// The field of [`GenOptions`], or `vocab_size`.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The name is neither a file nor a built-in workload.
    #[error(
        "no workload file {0:?} and no built-in workload of that name (built-ins: chat, agentic)"
    )]
    Unknown(String),
}

fn read_options(vocab_size: usize, ids: TokenIds) -> Result<ReadOptions, WorkloadError> {
    if vocab_size == 0 {
        return Err(WorkloadError::ZeroVocab);
    }
    let vocab = u32::try_from(vocab_size).map_err(|_| WorkloadError::BadOption {
        field: "vocab_size",
        value: vocab_size.to_string(),
        rule: "token ids are u32",
    })?;
    Ok(ReadOptions {
        vocab_size: Some(vocab),
        fold_token_ids: ids == TokenIds::Fold,
    })
}

impl Workload {
    /// Parses a trace in the Marconi artifact's JSONL format (see `workload_trace`; `name` names
    /// it in errors and becomes the workload's name), checking token ids against a vocabulary of
    /// `vocab_size` as `ids` says.
    pub fn from_jsonl(
        name: &str,
        text: &str,
        vocab_size: usize,
        ids: TokenIds,
    ) -> Result<Workload, WorkloadError> {
        let options = read_options(vocab_size, ids)?;
        Workload::from_entries(name, TraceReader::new(name, text.as_bytes(), options))
    }

    fn from_entries(
        name: &str,
        entries: impl Iterator<Item = Result<Entry, TraceError>>,
    ) -> Result<Workload, WorkloadError> {
        let mut sessions: HashMap<SessionId, u64> = HashMap::new();
        let mut turns = Vec::new();
        for entry in entries {
            let Entry { line, record } = entry?;
            let next = sessions.len() as u64;
            let session = *sessions.entry(record.session_id).or_insert(next);
            turns.push(Turn {
                session,
                turn: record.turn_id,
                ts: record.ts,
                input: record.input_tokens,
                output: record.output_tokens,
                source_line: Some(line),
            });
        }
        Ok(Workload::sorted(name.to_string(), turns))
    }

    /// Reads a JSONL trace file (see [`Workload::from_jsonl`]); errors name the file by `path`,
    /// the workload by its file name.
    pub fn load(path: &Path, vocab_size: usize, ids: TokenIds) -> Result<Workload, WorkloadError> {
        let options = read_options(vocab_size, ids)?;
        let reader = TraceReader::open(path, options)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Workload::from_entries(&name, reader)
    }

    /// A file path, or the name of a built-in workload (generated with `seed`).
    pub fn resolve(
        spec: &str,
        vocab_size: usize,
        seed: u64,
        ids: TokenIds,
    ) -> Result<Workload, WorkloadError> {
        match spec {
            "chat" => Workload::chat(&GenOptions::chat(seed), vocab_size),
            "agentic" => Workload::agentic(&GenOptions::agentic(seed), vocab_size),
            path if Path::new(path).is_file() => Workload::load(Path::new(path), vocab_size, ids),
            other => Err(WorkloadError::Unknown(other.to_string())),
        }
    }

    fn sorted(name: String, mut turns: Vec<Turn>) -> Workload {
        turns.sort_by(|a, b| {
            a.ts.total_cmp(&b.ts)
                .then(a.session.cmp(&b.session))
                .then(a.turn.cmp(&b.turn))
        });
        Workload { name, turns }
    }

    /// Multi-turn chat: every session opens with one of a few shared system prompts, then each
    /// turn appends a user message to the history (previous inputs and outputs).
    pub fn chat(options: &GenOptions, vocab_size: usize) -> Result<Workload, WorkloadError> {
        options.check(vocab_size)?;
        let mut draws = Draws::new(options, vocab_size);
        let openers: Vec<Vec<u32>> = (0..options.shared_prefixes)
            .map(|_| draws.tokens(options.prefix_len))
            .collect();
        let mut turns = Vec::new();
        for session in 0..options.sessions as u64 {
            let opener = &openers[draws.rng.random_range(0..openers.len())];
            let mut history = opener.clone();
            let mut ts = session as f64 * options.session_gap_s;
            for turn in 0..options.turns as u64 {
                turns.push(draws.turn(&mut history, session, turn, ts));
                ts += options.think_time_s;
            }
        }
        Ok(Workload::sorted("chat".to_string(), turns))
    }

    /// Agentic sessions: one long system prompt shared by every session; each turn appends a
    /// tool result to the history, and now and then the agent edits its history (drops the
    /// last tool result and the reply to it), so the next input branches off an earlier point.
    pub fn agentic(options: &GenOptions, vocab_size: usize) -> Result<Workload, WorkloadError> {
        options.check(vocab_size)?;
        let mut draws = Draws::new(options, vocab_size);
        let system = draws.tokens(options.prefix_len);
        let mut turns = Vec::new();
        for session in 0..options.sessions as u64 {
            let mut history = system.clone();
            history.extend(draws.message());
            let mut before_last_step = history.len();
            let mut ts = session as f64 * options.session_gap_s;
            for turn in 0..options.turns as u64 {
                if turn >= 2 && draws.rng.random_bool(0.25) {
                    // Edit: forget the last tool result and the reply to it.
                    history.truncate(before_last_step);
                }
                before_last_step = history.len();
                turns.push(draws.turn(&mut history, session, turn, ts));
                ts += options.think_time_s;
            }
        }
        Ok(Workload::sorted("agentic".to_string(), turns))
    }

    /// Keeps the first `n` turns in arrival order.
    pub fn truncate(&mut self, n: usize) {
        self.turns.truncate(n);
    }

    /// Input tokens over all turns.
    pub fn input_tokens(&self) -> usize {
        self.turns.iter().map(|t| t.input.len()).sum()
    }

    /// Output tokens over all turns.
    pub fn output_tokens(&self) -> usize {
        self.turns.iter().map(|t| t.output.len()).sum()
    }

    /// The longest input plus output of any turn.
    pub fn longest_turn(&self) -> usize {
        self.turns
            .iter()
            .map(|t| t.input.len() + t.output.len())
            .max()
            .unwrap_or(0)
    }
}

/// The random draws of a generated workload, from one seeded generator. A workload is a function
/// of its options: every draw's order is part of it, so the generators draw only through here.
struct Draws<'a> {
    rng: ChaCha8Rng,
    options: &'a GenOptions,
    vocab_size: usize,
}

impl<'a> Draws<'a> {
    fn new(options: &'a GenOptions, vocab_size: usize) -> Self {
        Draws {
            rng: ChaCha8Rng::seed_from_u64(options.seed),
            options,
            vocab_size,
        }
    }

    /// `len` tokens of the vocabulary.
    fn tokens(&mut self, len: usize) -> Vec<u32> {
        (0..len)
            .map(|_| self.rng.random_range(0..self.vocab_size as u32))
            .collect()
    }

    /// A new message (a user message, a task or a tool result): its length, then its tokens.
    fn message(&mut self) -> Vec<u32> {
        let (low, high) = self.options.message_len;
        let len = self.rng.random_range(low..=high);
        self.tokens(len)
    }

    /// One turn at `ts`: a new message joins `history`, which is the turn's input; then a new
    /// output (its length, then its tokens) is recorded and joins `history` too.
    fn turn(&mut self, history: &mut Vec<u32>, session: u64, turn: u64, ts: f64) -> Turn {
        history.extend(self.message());
        let (low, high) = self.options.output_len;
        let output_len = self.rng.random_range(low..=high);
        let output = self.tokens(output_len);
        let recorded = Turn {
            session,
            turn,
            ts,
            input: history.clone(),
            output: output.clone(),
            source_line: None,
        };
        history.extend(output);
        recorded
    }
}

/// The shape of a generated workload. Lengths are in tokens; ranges are inclusive.
#[derive(Debug, Clone, PartialEq)]
pub struct GenOptions {
    /// Seed of the generator: the same options give the same workload.
    pub seed: u64,
    /// Sessions.
    pub sessions: usize,
    /// Turns per session.
    pub turns: usize,
    /// Shared openers (chat; at least 1) — the agentic generator always shares one.
    pub shared_prefixes: usize,
    /// Length of each shared opener / system prompt.
    pub prefix_len: usize,
    /// Length of each new message (user message or tool result).
    pub message_len: (usize, usize),
    /// Length of each recorded output.
    pub output_len: (usize, usize),
    /// Seconds between session starts.
    pub session_gap_s: f64,
    /// Seconds between turns of a session.
    pub think_time_s: f64,
}

impl GenOptions {
    fn check(&self, vocab_size: usize) -> Result<(), WorkloadError> {
        if vocab_size == 0 {
            return Err(WorkloadError::ZeroVocab);
        }
        let bad = |field: &'static str, value: String, rule: &'static str| {
            Err(WorkloadError::BadOption { field, value, rule })
        };
        if self.shared_prefixes == 0 {
            return bad("shared_prefixes", "0".into(), "at least 1");
        }
        for (field, (low, high)) in [
            ("message_len", self.message_len),
            ("output_len", self.output_len),
        ] {
            if low > high {
                return bad(field, format!("({low}, {high})"), "low <= high");
            }
        }
        if u32::try_from(vocab_size).is_err() {
            return bad("vocab_size", vocab_size.to_string(), "token ids are u32");
        }
        Ok(())
    }

    /// The default `chat` workload: 24 sessions of 4 turns over 3 shared 96-token openers.
    pub fn chat(seed: u64) -> Self {
        GenOptions {
            seed,
            sessions: 24,
            turns: 4,
            shared_prefixes: 3,
            prefix_len: 96,
            message_len: (16, 48),
            output_len: (8, 24),
            session_gap_s: 0.5,
            think_time_s: 2.0,
        }
    }

    /// The default `agentic` workload: 12 sessions of 6 turns over one 256-token system prompt.
    pub fn agentic(seed: u64) -> Self {
        GenOptions {
            seed,
            sessions: 12,
            turns: 6,
            shared_prefixes: 1,
            prefix_len: 256,
            message_len: (24, 64),
            output_len: (8, 24),
            session_gap_s: 1.0,
            think_time_s: 1.5,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_records_parse_and_map_into_the_vocabulary() {
        let text = r#"{"session_id": "a", "turn_id": 0, "ts": 1.5, "num_input_tokens": 3, "num_output_tokens": 1, "input_tokens": [1, 2, 1003], "output_tokens": [2000]}

{"session_id": 7, "turn_id": 0, "ts": 0.5, "num_input_tokens": 1, "num_output_tokens": 0, "input_tokens": [5], "output_tokens": []}
{"session_id": "a", "turn_id": 1, "ts": 3.0, "num_input_tokens": 4, "num_output_tokens": 1, "input_tokens": [1, 2, 3, 0], "output_tokens": [4]}
"#;
        // Ids at or above the vocabulary are refused unless folding is asked for.
        let err = Workload::from_jsonl("t.jsonl", text, 1000, TokenIds::Refuse).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.jsonl:1: token id 1003 at `input_tokens[2]` is not below the vocabulary size 1000"
        );
        let workload = Workload::from_jsonl("t", text, 1000, TokenIds::Fold).unwrap();
        type Seen = (u64, u64, Vec<u32>, Vec<u32>, Option<usize>);
        let got: Vec<Seen> = workload
            .turns
            .iter()
            .map(|t| {
                (
                    t.session,
                    t.turn,
                    t.input.clone(),
                    t.output.clone(),
                    t.source_line,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 0, vec![5], vec![], Some(3)),
                (0, 0, vec![1, 2, 3], vec![0], Some(1)),
                (0, 1, vec![1, 2, 3, 0], vec![4], Some(4)),
            ]
        );
        assert_eq!(workload.input_tokens(), 8);
        assert_eq!(workload.output_tokens(), 2);
        assert_eq!(workload.longest_turn(), 5);
    }

    #[test]
    fn bad_records_name_the_line() {
        // The shared reader's messages (its own tests cover every rule).
        let check = |text: &str, expected: &str| {
            let err = Workload::from_jsonl("t.jsonl", text, 10, TokenIds::Refuse).unwrap_err();
            assert!(matches!(err, WorkloadError::Trace(_)), "{err:?}");
            assert_eq!(err.to_string(), expected);
        };
        check(
            r#"{"session_id": 1, "turn_id": 0, "ts": 0, "num_input_tokens": 2, "num_output_tokens": 0, "input_tokens": [5], "output_tokens": []}"#,
            "t.jsonl:1: field `input_tokens` lists 1 tokens but `num_input_tokens` says 2",
        );
        check(
            "\n{\"session_id\": 1}",
            "t.jsonl:2: missing field `turn_id`",
        );
        check(
            r#"{"session_id": 1, "turn_id": 0, "ts": 0, "num_input_tokens": 0, "num_output_tokens": 0, "input_tokens": [], "output_tokens": []}"#,
            "t.jsonl:1: field `input_tokens` is empty: a request needs at least one input token",
        );
        check(
            "",
            "t.jsonl: no records (the file is empty or has only blank lines)",
        );
        assert!(matches!(
            Workload::from_jsonl("t", "", 0, TokenIds::Fold),
            Err(WorkloadError::ZeroVocab)
        ));
        assert!(matches!(
            Workload::resolve("no-such-workload", 10, 0, TokenIds::Refuse),
            Err(WorkloadError::Unknown(_))
        ));
        let no_openers = GenOptions {
            shared_prefixes: 0,
            ..GenOptions::chat(0)
        };
        assert!(matches!(
            Workload::chat(&no_openers, 10),
            Err(WorkloadError::BadOption {
                field: "shared_prefixes",
                ..
            })
        ));
        let backwards = GenOptions {
            output_len: (5, 2),
            ..GenOptions::agentic(0)
        };
        let err = Workload::agentic(&backwards, 10).unwrap_err();
        assert_eq!(
            err.to_string(),
            "generator option output_len = (5, 2) (low <= high)"
        );
    }

    fn check_history(workload: &Workload, vocab: usize) {
        let mut last: HashMap<u64, (Vec<u32>, u64)> = HashMap::new();
        for turn in &workload.turns {
            assert!(turn
                .input
                .iter()
                .chain(&turn.output)
                .all(|&t| (t as usize) < vocab));
            if let Some((previous, number)) = last.get(&turn.session) {
                assert_eq!(turn.turn, number + 1);
                // The new input shares a non-empty prefix with the previous turn's history.
                let shared = previous
                    .iter()
                    .zip(&turn.input)
                    .take_while(|(a, b)| a == b)
                    .count();
                assert!(shared > 0);
            }
            let mut history = turn.input.clone();
            history.extend(&turn.output);
            last.insert(turn.session, (history, turn.turn));
        }
    }

    #[test]
    fn generators_are_seeded_and_multi_turn() {
        let chat = Workload::chat(&GenOptions::chat(1), 500).unwrap();
        assert_eq!(chat, Workload::chat(&GenOptions::chat(1), 500).unwrap());
        assert_ne!(chat, Workload::chat(&GenOptions::chat(2), 500).unwrap());
        assert_eq!(chat.turns.len(), 24 * 4);
        check_history(&chat, 500);
        // Chat turns extend the whole previous history.
        let first = &chat
            .turns
            .iter()
            .find(|t| t.session == 0 && t.turn == 0)
            .unwrap();
        let second = &chat
            .turns
            .iter()
            .find(|t| t.session == 0 && t.turn == 1)
            .unwrap();
        let mut history = first.input.clone();
        history.extend(&first.output);
        assert_eq!(&second.input[..history.len()], &history[..]);

        let agentic = Workload::agentic(&GenOptions::agentic(1), 500).unwrap();
        assert_eq!(agentic.turns.len(), 12 * 6);
        check_history(&agentic, 500);
        // Every agentic session starts with the same system prompt.
        let system = &agentic.turns[0].input[..256];
        assert!(agentic.turns.iter().all(|t| &t.input[..256] == system));
        // Some turn edits its history (its input does not extend the previous turn's history).
        let edited = agentic.turns.iter().any(|t| {
            agentic.turns.iter().any(|p| {
                p.session == t.session
                    && p.turn + 1 == t.turn
                    && !t
                        .input
                        .starts_with(&[p.input.clone(), p.output.clone()].concat())
            })
        });
        assert!(edited);
    }
}
