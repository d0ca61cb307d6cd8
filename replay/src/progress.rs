//! Progress of one replay pass: a bar on a terminal, or (when stderr is not a terminal, as in a
//! piped or logged run) one line on stderr at a steady interval with the turns done, the tokens
//! per second and the time elapsed.
//!
//! Either way the pass ends with one summary line on stderr, after the bar has been cleared, so
//! the report that follows on stdout never shares a line with the bar.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::ProgressMode;

/// How often the line mode prints.
pub const LINE_INTERVAL: Duration = Duration::from_secs(10);

/// What the pass has done so far (shared with the line printer's thread).
#[derive(Debug, Default)]
struct Counts {
    turns: AtomicU64,
    failed: AtomicU64,
    output_tokens: AtomicU64,
}

#[derive(Debug)]
enum Display {
    Bar(ProgressBar),
    Lines {
        stop: mpsc::Sender<()>,
        printer: JoinHandle<()>,
    },
    Off,
}

/// The progress of one pass.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    started: Instant,
    counts: Arc<Counts>,
    display: Display,
}

fn line(label: &str, total: u64, counts: &Counts, elapsed: Duration) -> String {
    let turns = counts.turns.load(Ordering::Relaxed);
    let failed = counts.failed.load(Ordering::Relaxed);
    let tokens = counts.output_tokens.load(Ordering::Relaxed);
    let seconds = elapsed.as_secs_f64();
    let rate = if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    };
    let failed = if failed > 0 {
        format!(" ({failed} failed)")
    } else {
        String::new()
    };
    format!(
        "{label}: {turns}/{total} turns{failed}, {tokens} output tokens, {rate:.0} tok/s, {seconds:.0} s elapsed"
    )
}

impl Progress {
    /// Starts showing the progress of a pass over `total` turns.
    pub fn start(label: &str, total: u64, mode: ProgressMode) -> Progress {
        let counts = Arc::new(Counts::default());
        let terminal = std::io::stderr().is_terminal();
        let display = match mode {
            ProgressMode::Off => Display::Off,
            ProgressMode::Bar => Display::Bar(bar(label, total)),
            ProgressMode::Auto if terminal => Display::Bar(bar(label, total)),
            ProgressMode::Auto | ProgressMode::Lines => {
                let (stop, stopped) = mpsc::channel::<()>();
                let label = label.to_string();
                let shared = Arc::clone(&counts);
                let started = Instant::now();
                // Ends on the stop message, or when the sender is dropped.
                let printer = std::thread::spawn(move || {
                    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(LINE_INTERVAL) {
                        eprintln!("{}", line(&label, total, &shared, started.elapsed()));
                    }
                });
                Display::Lines { stop, printer }
            }
        };
        Progress {
            label: label.to_string(),
            total,
            started: Instant::now(),
            counts,
            display,
        }
    }

    /// One turn ended (`generated` output tokens; `failed` if it was refused or failed).
    pub fn turn_done(&self, generated: u64, failed: bool) {
        self.counts.turns.fetch_add(1, Ordering::Relaxed);
        self.counts
            .output_tokens
            .fetch_add(generated, Ordering::Relaxed);
        if failed {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
        }
        if let Display::Bar(bar) = &self.display {
            bar.inc(1);
            let failed = self.counts.failed.load(Ordering::Relaxed);
            let tokens = self.counts.output_tokens.load(Ordering::Relaxed);
            let rate = tokens as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
            let failed = if failed > 0 {
                format!(", {failed} failed")
            } else {
                String::new()
            };
            bar.set_message(format!("{rate:.0} tok/s{failed}"));
        }
    }

    /// Ends the display and prints the pass's summary line on stderr.
    pub fn finish(self) {
        match self.display {
            Display::Bar(bar) => bar.finish_and_clear(),
            Display::Lines { stop, printer } => {
                // The printer ends on the message or when the sender is gone; either way it ends.
                let _ = stop.send(());
                let _ = printer.join();
            }
            Display::Off => return,
        }
        eprintln!(
            "{}",
            line(
                &self.label,
                self.total,
                &self.counts,
                self.started.elapsed()
            )
        );
    }
}

fn bar(label: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{prefix:>10} [{elapsed_precise}] {bar:40} {pos}/{len} turns, {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(label.to_string());
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_turns_rate_and_time() {
        let counts = Counts::default();
        counts.turns.store(12, Ordering::Relaxed);
        counts.output_tokens.store(300, Ordering::Relaxed);
        assert_eq!(
            line("caches on", 96, &counts, Duration::from_secs(10)),
            "caches on: 12/96 turns, 300 output tokens, 30 tok/s, 10 s elapsed"
        );
        counts.failed.store(2, Ordering::Relaxed);
        assert_eq!(
            line("caches off", 96, &counts, Duration::ZERO),
            "caches off: 12/96 turns (2 failed), 300 output tokens, 0 tok/s, 0 s elapsed"
        );
    }
}
