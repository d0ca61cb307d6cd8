//! The `replay` binary as a user meets it: refusals before any work (exit status 2, the flag
//! named, nothing left behind), and a short run on the tiny fixture checkpoint whose report and
//! JSON say what was configured.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The tiny NemotronH fixture checkpoint (vocabulary 256).
fn fixture_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/nemotron-h-tiny/model")
}

fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_replay"))
        .args(args)
        .output()
        .expect("the replay binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// One Marconi-format trace line.
fn record(session: u64, turn: u64, input: &[u32], output: &[u32]) -> String {
    serde_json::json!({
        "session_id": session,
        "turn_id": turn,
        "ts": turn as f64,
        "num_input_tokens": input.len(),
        "num_output_tokens": output.len(),
        "input_tokens": input,
        "output_tokens": output,
    })
    .to_string()
}

#[test]
fn refusals_name_the_flag_and_exit_2_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture_model();
    let model = model.to_str().unwrap();

    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let out = replay(&["--model", model, "--workload", empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end(),
        format!(
            "replay: --workload {}: no records (the file is empty or has only blank lines)",
            empty.display()
        )
    );

    // Token ids past the model's vocabulary (256) are refused unless --fold-token-ids.
    let wide = dir.path().join("wide.jsonl");
    std::fs::write(&wide, record(1, 0, &[1, 999], &[3]) + "\n").unwrap();
    let out = replay(&["--model", model, "--workload", wide.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end(),
        format!(
            "replay: --workload {}:1: token id 999 at `input_tokens[1]` is not below the \
             vocabulary size 256 (the model's vocabulary; --fold-token-ids folds such ids into it)",
            wide.display()
        )
    );
    assert_eq!(stdout(&out), "");

    // The --json path is checked before the model is built.
    let unwritable = dir.path().join("no-such-dir").join("report.json");
    let out = replay(&["--json", unwritable.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with(&format!(
            "replay: --json {}: cannot write there:",
            unwritable.display()
        )),
        "{}",
        stderr(&out)
    );

    // A run refused after the --json file was opened leaves no empty file behind.
    let json = dir.path().join("report.json");
    let out = replay(&[
        "--json",
        json.to_str().unwrap(),
        "--model",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with(&format!("replay: --model {}:", dir.path().display())),
        "{}",
        stderr(&out)
    );
    assert!(!json.exists());

    // Past what block ids allow, the flag that sized the pool is named.
    let out = replay(&["--model", model, "--kv-blocks", "5000000000"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end(),
        "replay: --kv-blocks 5000000000: 5000000000 KV blocks is more than block ids allow (4294967295)"
    );

    // --plot is checked before any work too.
    let png = dir.path().join("plot.png");
    let out = replay(&["--model", model, "--plot", png.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let expected = if cfg!(feature = "plot") {
        format!(
            "replay: --plot {}: the plot is SVG; name the file FILE.svg",
            png.display()
        )
    } else {
        "replay: --plot needs the `plot` feature (cargo run --release -p replay --features plot -- ...)"
            .to_string()
    };
    assert_eq!(stderr(&out).trim_end(), expected);
    assert!(!png.exists());

    let out = replay(&["--kv-blocks", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("'--kv-blocks <N>'"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_short_run_reports_its_setup_and_writes_every_verify_pass() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let lines = [
        record(1, 0, &[5, 6, 7, 8, 9, 10, 11, 12], &[20, 21, 22]),
        record(
            1,
            1,
            &[5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22, 30, 31],
            &[40, 41],
        ),
        record(2, 0, &[5, 6, 7, 8, 1, 2], &[]),
    ];
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let json = dir.path().join("report.json");
    let out = replay(&[
        "--model",
        fixture_model().to_str().unwrap(),
        "--workload",
        trace.to_str().unwrap(),
        "--kv-blocks",
        "64",
        "--max-in-flight",
        "2",
        "--verify",
        "--depth",
        "2",
        "--progress",
        "lines",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    for expected in [
        "router              cpu (host router)",
        "KV pool             64 blocks of 16 tokens, ",
        "in flight           at most 2 turns; pipelining depth 2; preemption by recompute",
        "prefix cache        on; SSM checkpoint eviction: marconi (FLOP-aware, tuned by shadow stores)",
        "eviction            Marconi, tuned: 0 setting change(s) during the pass; at the end alpha 0.00, path recency, marginal FLOPs, guarded admission off",
        "requests            3 (2 completed, 0 failed, 1 skipped (no recorded output to force))",
        "verify (caches on vs off at depth 2): 2 turns with identical logits digests, 0 mismatched: OK",
        "verify (depth 2 vs depth 1, caches on): 2 turns with identical logits digests, 0 mismatched: OK",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    // The skipped turn is named before the replay; each pass ends with a summary line.
    let err = stderr(&out);
    assert!(
        err.starts_with(
            "note: 1 turn(s) record no output, so there is nothing to force and they are skipped: line 3\n"
        ),
        "{err}"
    );
    assert!(
        err.contains("caches on: 3/3 turns, 5 output tokens"),
        "{err}"
    );
    assert!(
        err.contains("caches off: 3/3 turns, 5 output tokens"),
        "{err}"
    );
    assert!(
        err.contains("depth 1, caches on: 3/3 turns, 5 output tokens"),
        "{err}"
    );

    let text = std::fs::read_to_string(&json).unwrap();
    // The top-level keys, in the order written (pretty-printed: indented by two spaces).
    let keys: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("  \""))
        .filter_map(|line| line.split_once('"').map(|(key, _)| key))
        .collect();
    assert_eq!(
        keys,
        [
            "setup",
            "workload",
            "caches_on",
            "caches_off",
            "depth_1_caches_on",
            "verify",
            "verify_depth"
        ]
    );
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(report["workload"]["turns"], 3);
    assert_eq!(report["workload"]["without_output"], 1);
    assert_eq!(report["caches_on"]["cache"]["tuner_switches"], 0);
    assert_eq!(
        report["caches_off"]["cache"]["tuner_switches"],
        serde_json::Value::Null
    );
    assert_eq!(report["setup"]["kv_blocks"], 64);
    assert_eq!(report["setup"]["max_in_flight"], 2);
    assert_eq!(report["setup"]["prefix_cache"], true);
    assert_eq!(report["setup"]["depth"], 2);
    assert_eq!(report["caches_on"]["completed"], 2);
    assert_eq!(report["caches_off"]["prefill_tokens_cached"], 0);
    assert_eq!(report["verify"]["verified"], true);
    assert_eq!(report["verify"]["identical"], 2);
    assert_eq!(report["verify"]["skipped"], 1);
    assert_eq!(report["verify"]["mismatched"], 0);
    assert_eq!(report["depth_1_caches_on"]["completed"], 2);
    assert_eq!(report["verify_depth"]["verified"], true);
    assert_eq!(report["verify_depth"]["identical"], 2);
}

/// The PEFT adapters made for the tiny fixture.
fn fixture_adapter(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny-lora")
        .join(name)
}

#[test]
fn adapters_go_round_robin_to_sessions_and_report_their_hit_rates() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    // Four sessions open with the same 20 tokens; each then asks a follow-up.
    let opening: Vec<u32> = (1..=20).collect();
    let mut lines = Vec::new();
    for session in 0..4u64 {
        lines.push(record(session, 0, &opening, &[30, 31, 32]));
    }
    for session in 0..4u64 {
        let mut follow_up = opening.clone();
        follow_up.extend([30, 31, 32]);
        follow_up.extend((0..10).map(|i| 100 + i + session as u32));
        lines.push(record(session, 1, &follow_up, &[40, 41]));
    }
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let json = dir.path().join("report.json");
    let a = fixture_adapter("adapter-a");
    let b = fixture_adapter("adapter-b");
    let out = replay(&[
        "--model",
        fixture_model().to_str().unwrap(),
        "--workload",
        trace.to_str().unwrap(),
        "--max-in-flight",
        "1",
        "--adapter",
        a.to_str().unwrap(),
        "--adapter",
        b.to_str().unwrap(),
        "--verify",
        "--progress",
        "off",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    for expected in [
        format!("adapter 1: {} (rank 8, scale 2, 20 linear layers)", a.display()),
        format!("adapter 2: {} (rank 4, scale 3, 5 linear layers)", b.display()),
        "LoRA adapters       2 (sessions take them round-robin)".to_string(),
        "verify (caches on vs off at depth 1): 8 turns with identical logits digests, 0 mismatched: OK".to_string(),
    ] {
        assert!(text.contains(&expected), "missing {expected:?} in\n{text}");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let hits = |pass: &str| {
        report[pass]["adapters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["adapter"].as_u64().unwrap(),
                    a["sessions"].as_u64().unwrap(),
                    a["completed"].as_u64().unwrap(),
                    a["prompt_tokens"].as_u64().unwrap(),
                    a["cached_tokens"].as_u64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    // Sessions 0 and 2 take adapter 1, 1 and 3 adapter 2 (20 + 20 + 33 + 33 prompt tokens
    // each). With one turn in flight, session 2's opening finds the first block of session 0's
    // (same adapter) and session 3's that of session 1's, never the other adapter's (session
    // 1's opening finds nothing, though session 0 computed the same tokens); each follow-up
    // finds its own history's first block (the Marconi checkpoint at the end of its input).
    assert_eq!(
        hits("caches_on"),
        [(1, 2, 4, 106, 16 + 16 + 16), (2, 2, 4, 106, 16 + 16 + 16)]
    );
    assert_eq!(hits("caches_off"), [(1, 2, 4, 106, 0), (2, 2, 4, 106, 0)]);
    assert_eq!(report["setup"]["adapters"].as_array().unwrap().len(), 2);
}

/// With `--mtp K` the report says how the MTP head drafted: its draft steps, the refused ones,
/// and the rows it proposed nothing for (the report had no such line before).
#[test]
fn an_mtp_run_reports_its_draft_steps_and_misses() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let lines = [
        record(
            1,
            0,
            &[5, 6, 7, 8, 9, 10, 11, 12],
            &[20, 21, 22, 23, 24, 25],
        ),
        record(2, 0, &[5, 6, 7, 8, 1, 2], &[30, 31, 32, 33]),
    ];
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let json = dir.path().join("report.json");
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny/mtp/model");
    let out = replay(&[
        "--model",
        model.to_str().unwrap(),
        "--workload",
        trace.to_str().unwrap(),
        "--kv-blocks",
        "64",
        "--mtp",
        "2",
        "--progress",
        "off",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let pass = &report["caches_on"];
    let steps = pass["draft_steps"].as_u64().unwrap();
    assert!(steps > 0, "{pass}");
    assert_eq!(pass["draft_failures"], 0);
    assert_eq!(pass["draft_misses"], 0);
    let line = format!(
        "MTP drafting        {steps} draft steps (0 refused); 0 rows drafted nothing though they had a budget"
    );
    let text = stdout(&out);
    assert!(text.contains(&line), "missing {line:?} in\n{text}");
}
