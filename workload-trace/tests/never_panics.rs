//! The trace reader never panics: 10,000 mutated traces (bytes flipped, inserted, cut; field
//! values replaced by arbitrary JSON, including huge counts and deep nesting) each give records
//! or a typed error, and every record it does give satisfies the format's rules.

use proptest::prelude::*;
use workload_trace::{ReadOptions, TraceReader, FIELDS};

const GOOD: &str = concat!(
    r#"{"session_id": "a", "turn_id": 0, "ts": 1.5, "num_input_tokens": 3, "num_output_tokens": 1, "input_tokens": [1, 2, 103], "output_tokens": [200]}"#,
    "\n",
    r#"{"session_id": 7, "turn_id": 1, "ts": 2.0, "num_input_tokens": 2, "num_output_tokens": 0, "input_tokens": [5, 6], "output_tokens": []}"#,
    "\n"
);

/// An arbitrary JSON value, small or absurd.
fn json_value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("1000000000000".to_string()),
        Just("18446744073709551616".to_string()),
        Just("1e308".to_string()),
        Just("-0.0".to_string()),
        "[a-z0-9\"\\\\ ]{0,8}".prop_map(|s| format!("{s:?}")),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| format!("[{}]", v.join(","))),
            proptest::collection::vec(inner, 0..3).prop_map(|v| format!(
                "{{{}}}",
                v.iter()
                    .enumerate()
                    .map(|(i, x)| format!("\"k{i}\":{x}"))
                    .collect::<Vec<_>>()
                    .join(",")
            )),
        ]
    })
}

/// One way to damage the good trace.
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the byte at this index (modulo the length).
    Byte(usize, u8),
    /// Insert a byte.
    Insert(usize, u8),
    /// Cut the text here.
    Cut(usize),
    /// Replace the value of this field (by index into [`FIELDS`]) of the first record.
    Field(usize, String),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        any::<usize>().prop_map(Mutation::Cut),
        (0..FIELDS.len(), json_value()).prop_map(|(i, v)| Mutation::Field(i, v)),
    ]
}

fn apply(text: &mut Vec<u8>, mutation: &Mutation) {
    let len = text.len().max(1);
    match mutation {
        Mutation::Byte(at, b) => {
            if let Some(byte) = text.get_mut(at % len) {
                *byte = *b;
            }
        }
        Mutation::Insert(at, b) => text.insert(at % (text.len() + 1), *b),
        Mutation::Cut(at) => text.truncate(at % (text.len() + 1)),
        Mutation::Field(i, value) => {
            let Ok(line) = std::str::from_utf8(text) else {
                return;
            };
            let Some(first) = line.lines().next() else {
                return;
            };
            let Ok(mut object) =
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(first)
            else {
                return;
            };
            let Ok(value) = serde_json::from_str(value) else {
                return;
            };
            object.insert(FIELDS[*i].to_string(), value);
            let rest = &line[first.len()..];
            *text = format!("{}{rest}", serde_json::Value::Object(object)).into_bytes();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_traces_give_records_or_typed_errors(
        mutations in proptest::collection::vec(mutation(), 1..4),
        vocab in prop_oneof![Just(None), Just(Some(256u32)), Just(Some(150u32))],
        fold: bool,
    ) {
        let mut text = GOOD.as_bytes().to_vec();
        for m in &mutations {
            apply(&mut text, m);
        }
        let options = ReadOptions { vocab_size: vocab, fold_token_ids: fold };
        for entry in TraceReader::new("t.jsonl", text.as_slice(), options) {
            let Ok(entry) = entry else { continue };
            let record = entry.record;
            prop_assert!(!record.input_tokens.is_empty());
            prop_assert_eq!(record.num_input_tokens, record.input_tokens.len());
            prop_assert_eq!(record.num_output_tokens, record.output_tokens.len());
            if let Some(vocab) = vocab {
                let all = record.input_tokens.iter().chain(&record.output_tokens);
                prop_assert!(all.into_iter().all(|&t| t < vocab));
            }
        }
    }
}
