//! The workload trace format of the Marconi artifact: JSONL, one request per line. The replay
//! (`scheduler::workload`) and the simulator (`ssm_snapshot::sim`) both read it through
//! [`TraceReader`], so they accept and refuse exactly the same files with the same messages.
//!
//! A line is one JSON object (other fields are ignored; blank lines are skipped):
//!
//! ```json
//! {"session_id": 7, "turn_id": 0, "ts": 1.5, "num_input_tokens": 3, "num_output_tokens": 1,
//!  "input_tokens": [1, 2, 3], "output_tokens": [4]}
//! ```
//!
//! - `session_id`: the conversation, a non-negative integer or a string (`7` and `"7"` are two
//!   sessions);
//! - `turn_id`: the turn within the session, a non-negative integer;
//! - `ts`: the arrival time in seconds, a number;
//! - `input_tokens`: the whole context sent (earlier turns included), at least one token id;
//! - `output_tokens`: the recorded output (may be empty: nothing to replay for that turn);
//! - `num_input_tokens` / `num_output_tokens`: the lengths of the two lists, which must agree.
//!
//! Token ids are non-negative integers. Read with a vocabulary ([`ReadOptions::vocab_size`]),
//! an id at or above it is an error unless [`ReadOptions::fold_token_ids`] asks to fold it
//! (`id % vocab_size`); read without one, an id must fit in 32 bits. A file without any record
//! is an error.
//!
//! Every error is a [`TraceError`] naming the file and the 1-based line, and its [`Problem`]
//! speaks of the record's fields, never of the reader's internal types:
//!
//! ```text
//! chat.jsonl:3: field `input_tokens[3]`: expected a token id (a non-negative integer), got "x"
//! ```
//!
//! # Example
//!
//! ```
//! use workload_trace::{ReadOptions, TraceReader};
//!
//! let text = r#"{"session_id": "a", "turn_id": 0, "ts": 0.5, "num_input_tokens": 2, "num_output_tokens": 1, "input_tokens": [1, 2], "output_tokens": [300]}"#;
//! let options = ReadOptions { vocab_size: Some(256), fold_token_ids: false };
//! let err = TraceReader::new("chat.jsonl", text.as_bytes(), options)
//!     .collect::<Result<Vec<_>, _>>()
//!     .unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "chat.jsonl:1: token id 300 at `output_tokens[0]` is not below the vocabulary size 256"
//! );
//!
//! let folded = ReadOptions { fold_token_ids: true, ..options };
//! let entries = TraceReader::new("chat.jsonl", text.as_bytes(), folded)
//!     .collect::<Result<Vec<_>, _>>()?;
//! assert_eq!(entries[0].line, 1);
//! assert_eq!(entries[0].record.output_tokens, [300 % 256]);
//! # Ok::<(), workload_trace::TraceError>(())
//! ```
#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A session id: the artifact writes numbers or strings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SessionId {
    /// A numeric id.
    Number(u64),
    /// A textual id.
    Text(String),
}

/// One request of a trace (one line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// The conversation the request belongs to.
    pub session_id: SessionId,
    /// The turn within the session.
    pub turn_id: u64,
    /// Arrival time in seconds.
    pub ts: f64,
    /// `input_tokens.len()`.
    pub num_input_tokens: usize,
    /// `output_tokens.len()`.
    pub num_output_tokens: usize,
    /// The context sent (the whole conversation so far).
    pub input_tokens: Vec<u32>,
    /// The recorded output.
    pub output_tokens: Vec<u32>,
}

impl TraceRecord {
    /// A record whose declared counts are the lists' lengths.
    pub fn new(
        session_id: SessionId,
        turn_id: u64,
        ts: f64,
        input_tokens: Vec<u32>,
        output_tokens: Vec<u32>,
    ) -> TraceRecord {
        TraceRecord {
            session_id,
            turn_id,
            ts,
            num_input_tokens: input_tokens.len(),
            num_output_tokens: output_tokens.len(),
            input_tokens,
            output_tokens,
        }
    }
}

/// How token ids are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadOptions {
    /// The model's vocabulary size: ids must be below it. `None` (a simulator without a model):
    /// ids need only fit in 32 bits.
    pub vocab_size: Option<u32>,
    /// With a vocabulary, fold ids at or above it into it (`id % vocab_size`) instead of
    /// refusing them.
    pub fold_token_ids: bool,
}

/// The fields every record must have, in the order they are checked.
pub const FIELDS: [&str; 7] = [
    "session_id",
    "turn_id",
    "ts",
    "num_input_tokens",
    "num_output_tokens",
    "input_tokens",
    "output_tokens",
];

/// What is wrong with a trace (see [`TraceError`] for where).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The file could not be opened or read (or is not UTF-8): the system's message. (A string,
    /// so that errors stay `Clone` and comparable, as the crates that wrap them are.)
    #[error("cannot read: {0}")]
    Io(String),
    /// The line is not JSON.
    #[error("not valid JSON: {0}")]
    NotJson(String),
    /// The line is JSON but not an object.
    #[error("expected a JSON object with the fields session_id, turn_id, ts, num_input_tokens, num_output_tokens, input_tokens and output_tokens")]
    NotAnObject,
    /// A required field is absent.
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    /// A field (or one element of a token list, `input_tokens[3]`) has the wrong kind of value.
    #[error("field `{field}`: expected {expected}, got {got}")]
    BadField {
        /// The field, with the index for a list element.
        field: String,
        /// What it must be.
        expected: &'static str,
        /// What it is (the JSON text, shortened).
        got: String,
    },
    /// A declared count disagrees with its list.
    #[error("field `{field}` lists {actual} tokens but `{count_field}` says {declared}")]
    CountMismatch {
        /// `input_tokens` or `output_tokens`.
        field: &'static str,
        /// `num_input_tokens` or `num_output_tokens`.
        count_field: &'static str,
        /// The declared count.
        declared: u64,
        /// The list's length.
        actual: usize,
    },
    /// A request without input.
    #[error("field `input_tokens` is empty: a request needs at least one input token")]
    EmptyInput,
    /// A token id at or above the vocabulary (and folding was not asked for).
    #[error("token id {id} at `{field}` is not below the vocabulary size {vocab_size}")]
    OutOfVocabulary {
        /// The list and index (`input_tokens[3]`).
        field: String,
        /// The id.
        id: u64,
        /// The vocabulary size.
        vocab_size: u32,
    },
    /// The vocabulary size given to the reader is 0.
    #[error("vocabulary size 0: no token id can be valid")]
    ZeroVocabulary,
    /// The trace has no record.
    #[error("no records (the file is empty or has only blank lines)")]
    NoRecords,
}

/// A trace that could not be read: the file, the line (when one is at fault) and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}{}: {problem}", line.map(|line| format!(":{line}")).unwrap_or_default())]
pub struct TraceError {
    /// The file (or the name the reader was given).
    pub file: String,
    /// The 1-based line at fault; `None` for problems of the whole file.
    pub line: Option<usize>,
    /// What is wrong.
    #[source]
    pub problem: Problem,
}

/// One record and the line it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The 1-based line number in the file.
    pub line: usize,
    /// The record, its token ids checked (or folded) as [`ReadOptions`] says.
    pub record: TraceRecord,
}

/// Reads a trace record by record, in file order; it stops after the first error.
#[derive(Debug)]
pub struct TraceReader<R> {
    file: String,
    lines: std::io::Lines<R>,
    options: ReadOptions,
    line: usize,
    records: usize,
    done: bool,
}

impl TraceReader<BufReader<File>> {
    /// Opens the trace at `path`.
    pub fn open(path: &Path, options: ReadOptions) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|err| TraceError {
            file: path.display().to_string(),
            line: None,
            problem: Problem::Io(err.to_string()),
        })?;
        Ok(TraceReader::new(
            path.display().to_string(),
            BufReader::new(file),
            options,
        ))
    }
}

impl<R: BufRead> TraceReader<R> {
    /// Reads `reader`, calling it `file` in errors.
    pub fn new(file: impl Into<String>, reader: R, options: ReadOptions) -> Self {
        TraceReader {
            file: file.into(),
            lines: reader.lines(),
            options,
            line: 0,
            records: 0,
            done: false,
        }
    }

    fn fail(&mut self, line: Option<usize>, problem: Problem) -> Option<Result<Entry, TraceError>> {
        self.done = true;
        Some(Err(TraceError {
            file: self.file.clone(),
            line,
            problem,
        }))
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<Entry, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        if self.options.vocab_size == Some(0) {
            return self.fail(None, Problem::ZeroVocabulary);
        }
        loop {
            match self.lines.next() {
                None => {
                    self.done = true;
                    if self.records == 0 {
                        return self.fail(None, Problem::NoRecords);
                    }
                    return None;
                }
                Some(Err(err)) => {
                    let line = self.line + 1;
                    return self.fail(Some(line), Problem::Io(err.to_string()));
                }
                Some(Ok(text)) => {
                    self.line += 1;
                    if text.trim().is_empty() {
                        continue;
                    }
                    return match parse_line(&text, self.options) {
                        Ok(record) => {
                            self.records += 1;
                            Some(Ok(Entry {
                                line: self.line,
                                record,
                            }))
                        }
                        Err(problem) => self.fail(Some(self.line), problem),
                    };
                }
            }
        }
    }
}

/// Writes records as JSONL (what [`TraceReader`] reads back).
pub fn write_trace(mut writer: impl Write, records: &[TraceRecord]) -> std::io::Result<()> {
    for record in records {
        serde_json::to_writer(&mut writer, record)?;
        writer.write_all(b"\n")?;
    }
    writer.flush()
}

/// A line as serde reads it when it is well formed (the fast path); token ids are checked after.
#[derive(Deserialize)]
struct RawRecord {
    session_id: SessionId,
    turn_id: u64,
    ts: f64,
    num_input_tokens: u64,
    num_output_tokens: u64,
    input_tokens: Vec<u64>,
    output_tokens: Vec<u64>,
}

fn parse_line(text: &str, options: ReadOptions) -> Result<TraceRecord, Problem> {
    let raw: RawRecord = serde_json::from_str(text).map_err(|err| diagnose(text, &err))?;
    for (field, count_field, declared, actual) in [
        (
            "input_tokens",
            "num_input_tokens",
            raw.num_input_tokens,
            raw.input_tokens.len(),
        ),
        (
            "output_tokens",
            "num_output_tokens",
            raw.num_output_tokens,
            raw.output_tokens.len(),
        ),
    ] {
        if declared != actual as u64 {
            return Err(Problem::CountMismatch {
                field,
                count_field,
                declared,
                actual,
            });
        }
    }
    if raw.input_tokens.is_empty() {
        return Err(Problem::EmptyInput);
    }
    Ok(TraceRecord::new(
        raw.session_id,
        raw.turn_id,
        raw.ts,
        token_ids("input_tokens", &raw.input_tokens, options)?,
        token_ids("output_tokens", &raw.output_tokens, options)?,
    ))
}

fn token_ids(field: &str, ids: &[u64], options: ReadOptions) -> Result<Vec<u32>, Problem> {
    ids.iter()
        .enumerate()
        .map(|(index, &id)| match options.vocab_size {
            Some(vocab) if options.fold_token_ids => Ok((id % u64::from(vocab)) as u32),
            Some(vocab) if id >= u64::from(vocab) => Err(Problem::OutOfVocabulary {
                field: format!("{field}[{index}]"),
                id,
                vocab_size: vocab,
            }),
            _ => u32::try_from(id).map_err(|_| Problem::BadField {
                field: format!("{field}[{index}]"),
                expected: "a token id below 2^32",
                got: id.to_string(),
            }),
        })
        .collect()
}

/// Why serde refused `text`, said in terms of the record's fields.
fn diagnose(text: &str, err: &serde_json::Error) -> Problem {
    let value: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(err) => return Problem::NotJson(without_location(&err)),
    };
    let Some(object) = value.as_object() else {
        return Problem::NotAnObject;
    };
    let bad = |field: &str, expected: &'static str, got: &Value| Problem::BadField {
        field: field.to_string(),
        expected,
        got: shown(got),
    };
    for field in FIELDS {
        let Some(value) = object.get(field) else {
            return Problem::MissingField(field);
        };
        match field {
            "session_id" if !(value.is_u64() || value.is_string()) => {
                return bad(field, "a non-negative integer or a string", value)
            }
            "ts" if !value.is_number() => return bad(field, "a number (seconds)", value),
            "turn_id" | "num_input_tokens" | "num_output_tokens" if !value.is_u64() => {
                return bad(field, "a non-negative integer", value)
            }
            "input_tokens" | "output_tokens" => {
                let Some(ids) = value.as_array() else {
                    return bad(field, "an array of token ids", value);
                };
                if let Some((index, id)) = ids.iter().enumerate().find(|(_, id)| !id.is_u64()) {
                    return bad(
                        &format!("{field}[{index}]"),
                        "a token id (a non-negative integer)",
                        id,
                    );
                }
            }
            _ => {}
        }
    }
    // Every field has the right kind of value, yet serde refused the line: say what it said.
    Problem::NotJson(without_location(err))
}

/// serde's message without its ` at line 1 column N` (a trace line is parsed on its own, so
/// only the column means anything).
fn without_location(err: &serde_json::Error) -> String {
    let message = err.to_string();
    let text = match message.rsplit_once(" at line ") {
        Some((text, _)) => text.to_string(),
        None => message,
    };
    if err.column() > 0 {
        format!("{text} (column {})", err.column())
    } else {
        text
    }
}

/// A value as the user wrote it, shortened to 40 characters.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() > 40 {
        let head: String = text.chars().take(37).collect();
        format!("{head}...")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"session_id": "a", "turn_id": 0, "ts": 1.5, "num_input_tokens": 3, "num_output_tokens": 1, "input_tokens": [1, 2, 1003], "output_tokens": [2000]}"#;

    fn read(text: &str, options: ReadOptions) -> Result<Vec<Entry>, TraceError> {
        TraceReader::new("t.jsonl", text.as_bytes(), options).collect()
    }

    /// The error `text` gives, as printed.
    fn error(text: &str) -> String {
        read(text, ReadOptions::default()).unwrap_err().to_string()
    }

    /// `GOOD` with `field` replaced by `value` (JSON text), or removed when `value` is `None`.
    fn with(field: &str, value: Option<&str>) -> String {
        let mut object: serde_json::Map<String, Value> = serde_json::from_str(GOOD).unwrap();
        match value {
            Some(value) => {
                object.insert(field.to_string(), serde_json::from_str(value).unwrap());
            }
            None => {
                object.remove(field);
            }
        }
        Value::Object(object).to_string()
    }

    #[test]
    fn records_read_with_their_line_numbers() {
        let text = format!(
            "\n{GOOD}\n  \n{}\n",
            r#"{"session_id": 7, "turn_id": 2, "ts": 0, "num_input_tokens": 1, "num_output_tokens": 0, "input_tokens": [5], "output_tokens": [], "extra": true}"#
        );
        let entries = read(&text, ReadOptions::default()).unwrap();
        assert_eq!(
            entries,
            vec![
                Entry {
                    line: 2,
                    record: TraceRecord::new(
                        SessionId::Text("a".into()),
                        0,
                        1.5,
                        vec![1, 2, 1003],
                        vec![2000]
                    ),
                },
                Entry {
                    line: 4,
                    record: TraceRecord::new(SessionId::Number(7), 2, 0.0, vec![5], vec![]),
                },
            ]
        );
    }

    #[test]
    fn bad_lines_name_the_file_line_and_field() {
        let cases: Vec<(String, &str)> = vec![
            ("{".into(), "t.jsonl:1: not valid JSON: EOF while parsing an object (column 1)"),
            ("[1, 2]".into(), "t.jsonl:1: expected a JSON object with the fields session_id, turn_id, ts, num_input_tokens, num_output_tokens, input_tokens and output_tokens"),
            (with("turn_id", None), "t.jsonl:1: missing field `turn_id`"),
            (with("session_id", Some("[1]")), "t.jsonl:1: field `session_id`: expected a non-negative integer or a string, got [1]"),
            (with("session_id", Some("-3")), "t.jsonl:1: field `session_id`: expected a non-negative integer or a string, got -3"),
            (with("turn_id", Some("1.5")), "t.jsonl:1: field `turn_id`: expected a non-negative integer, got 1.5"),
            (with("ts", Some("\"noon\"")), "t.jsonl:1: field `ts`: expected a number (seconds), got \"noon\""),
            (with("input_tokens", Some("\"1 2 3\"")), "t.jsonl:1: field `input_tokens`: expected an array of token ids, got \"1 2 3\""),
            (with("output_tokens", Some("[4, -1]")), "t.jsonl:1: field `output_tokens[1]`: expected a token id (a non-negative integer), got -1"),
            (with("num_input_tokens", Some("2")), "t.jsonl:1: field `input_tokens` lists 3 tokens but `num_input_tokens` says 2"),
            (with("output_tokens", Some("[4, 4294967296]")).replace("\"num_output_tokens\":1", "\"num_output_tokens\":2"), "t.jsonl:1: field `output_tokens[1]`: expected a token id below 2^32, got 4294967296"),
            (
                with("input_tokens", Some("[]")).replace("\"num_input_tokens\":3", "\"num_input_tokens\":0"),
                "t.jsonl:1: field `input_tokens` is empty: a request needs at least one input token",
            ),
            ("\n \n".into(), "t.jsonl: no records (the file is empty or has only blank lines)"),
        ];
        for (text, expected) in cases {
            assert_eq!(error(&text), expected, "for {text}");
        }
        // The line number counts blank lines; reading stops at the first error.
        let text = format!("{GOOD}\n\n{{\"session_id\": 1}}\n{{");
        let mut reader = TraceReader::new("t.jsonl", text.as_bytes(), ReadOptions::default());
        assert!(reader.next().unwrap().is_ok());
        assert_eq!(
            reader.next().unwrap().unwrap_err().to_string(),
            "t.jsonl:3: missing field `turn_id`"
        );
        assert!(reader.next().is_none());
    }

    #[test]
    fn token_ids_are_checked_against_the_vocabulary_or_folded() {
        let refuse = ReadOptions {
            vocab_size: Some(1000),
            fold_token_ids: false,
        };
        let err = read(GOOD, refuse).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.jsonl:1: token id 1003 at `input_tokens[2]` is not below the vocabulary size 1000"
        );
        assert!(matches!(
            err.problem,
            Problem::OutOfVocabulary {
                id: 1003,
                vocab_size: 1000,
                ..
            }
        ));
        let fold = ReadOptions {
            fold_token_ids: true,
            ..refuse
        };
        let record = &read(GOOD, fold).unwrap()[0].record;
        assert_eq!(record.input_tokens, [1, 2, 3]);
        assert_eq!(record.output_tokens, [0]);
        let zero = ReadOptions {
            vocab_size: Some(0),
            fold_token_ids: true,
        };
        assert_eq!(
            read(GOOD, zero).unwrap_err().to_string(),
            "t.jsonl: vocabulary size 0: no token id can be valid"
        );
    }

    #[test]
    fn files_round_trip_and_a_missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let records = vec![
            TraceRecord::new(SessionId::Number(3), 0, 0.25, vec![1, 2], vec![3]),
            TraceRecord::new(SessionId::Text("x".into()), 1, 2.0, vec![4], vec![]),
        ];
        write_trace(File::create(&path).unwrap(), &records).unwrap();
        let back: Vec<TraceRecord> = TraceReader::open(&path, ReadOptions::default())
            .unwrap()
            .map(|entry| entry.map(|entry| entry.record))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(back, records);

        let missing = dir.path().join("missing.jsonl");
        let err = TraceReader::open(&missing, ReadOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("{}: cannot read: ", missing.display())),
            "{err}"
        );
        assert_eq!(err.line, None);
    }
}
