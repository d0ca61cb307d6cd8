//! What the policy examples share: the `--model`, `--pin-scope` and `--jitter-rate` parsers,
//! writing their report to stdout and their cells as data (`--json`).

use std::io::{self, ErrorKind, Write};

use ssm_snapshot::grid::compare::{CellRecord, Report, ReportKind};
use ssm_snapshot::{CostModel, PinScope, SnapshotError};

/// A built-in cost model by name (`--model`).
pub fn cost_model(text: &str) -> Result<CostModel, String> {
    CostModel::by_name(text).map_err(|e| e.to_string())
}

/// `--pin-scope`: `path` ([`PinScope::Path`], the default) or `hit` ([`PinScope::HitCheckpoint`]).
pub fn pin_scope(text: &str) -> Result<PinScope, String> {
    match text {
        "path" => Ok(PinScope::Path),
        "hit" => Ok(PinScope::HitCheckpoint),
        other => Err(format!("unknown pin scope `{other}` (path or hit)")),
    }
}

/// The name `--pin-scope` takes for `scope` (a report records it).
pub fn pin_scope_name(scope: PinScope) -> &'static str {
    match scope {
        PinScope::Path => "path",
        PinScope::HitCheckpoint => "hit",
    }
}

/// What a report records of the run that wrote it (`--json`).
pub struct RunOf<'a> {
    /// The example.
    pub kind: ReportKind,
    /// `--model`.
    pub model: &'a CostModel,
    /// `--pin-scope`.
    pub pin_scope: PinScope,
    /// `--jitter`.
    pub jitter: u64,
    /// `--jitter-rate`.
    pub jitter_rate: f64,
}

/// Writes `cells` of the run `run` to `path` as a report (`--json FILE`).
pub fn write_report(
    path: &std::path::Path,
    run: RunOf<'_>,
    cells: Vec<CellRecord>,
) -> Result<(), SnapshotError> {
    Report {
        kind: run.kind,
        model: run.model.name().to_string(),
        pin_scope: pin_scope_name(run.pin_scope).to_string(),
        jitter: run.jitter,
        jitter_rate: run.jitter_rate,
        cells,
    }
    .write(path)
}

/// `--jitter-rate`: a probability, 0 to 1 (NaN and anything outside refused).
pub fn probability(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{text}` is not a probability (0 to 1)")),
    }
}

/// Writes `lines` to `out`, one per line, and flushes. A reader that closed the pipe early
/// (`simulate ... | head`) ends the output there without an error, as with any Unix tool
/// (`println!` panics on it); every other write error is returned.
pub fn write_lines(mut out: impl Write, lines: &[String]) -> io::Result<()> {
    let written = lines
        .iter()
        .try_for_each(|line| writeln!(out, "{line}"))
        .and_then(|()| out.flush());
    match written {
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Writes a progress line to stderr, best effort: a reader that went away (`2>&1 | head`) does
/// not stop the run, whose report still comes on stdout.
pub fn progress(line: &str) {
    // A progress line that cannot be written is dropped; the run's result does not depend on it.
    let _ = writeln!(io::stderr().lock(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes `room` bytes, then fails every write with `kind`.
    struct Closing {
        taken: Vec<u8>,
        room: usize,
        kind: ErrorKind,
    }

    impl Write for Closing {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.taken.len() >= self.room {
                return Err(io::Error::from(self.kind));
            }
            let n = buf.len().min(self.room - self.taken.len());
            self.taken.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_pipe_ends_the_report_quietly_and_other_errors_are_returned() {
        let lines = vec!["first".to_string(), "second".to_string()];
        let mut all = Vec::new();
        write_lines(&mut all, &lines).unwrap();
        assert_eq!(all, b"first\nsecond\n");

        let mut closed = Closing {
            taken: Vec::new(),
            room: 8,
            kind: ErrorKind::BrokenPipe,
        };
        write_lines(&mut closed, &lines).unwrap();
        assert_eq!(closed.taken, b"first\nse");

        let mut full = Closing {
            taken: Vec::new(),
            room: 8,
            kind: ErrorKind::StorageFull,
        };
        let e = write_lines(&mut full, &lines).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::StorageFull);
    }
}
