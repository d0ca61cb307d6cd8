//! Progress of one replay pass: a bar on a terminal, or (when stderr is not a terminal, as in a
//! piped or logged run) one line on stderr at a steady interval with the turns done, the tokens
//! per second and the time elapsed.
//!
//! Either way the pass ends with one summary line on stderr, after the bar has been cleared, so
//! the report that follows on stdout never shares a line with the bar.
//!
//! The bar is one line redrawn in place with a carriage return (no escape sequences, so a dumb
//! terminal shows it too), at most [`BAR_COLUMNS`] columns wide so that it never wraps on an
//! 80-column terminal (a wrapped line could not be redrawn in place). Everything else this
//! program writes to stderr while a bar may be drawn goes through [`eprint_line`], which clears
//! the bar first; the next tick draws it again below the line.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cli::ProgressMode;

/// How often the line mode prints.
pub const LINE_INTERVAL: Duration = Duration::from_secs(10);
/// How often the bar is redrawn.
const BAR_INTERVAL: Duration = Duration::from_millis(250);
/// The fewest and the most cells of the bar (`#` done, `-` to go).
const MIN_CELLS: usize = 10;
const MAX_CELLS: usize = 30;
/// The widest bar line: one column short of 80, so the cursor never reaches the margin.
pub const BAR_COLUMNS: usize = 79;

/// How many columns of stderr's current line a drawn bar holds (0: none). Every write to stderr
/// that may meet a bar takes this lock, so a bar and a line never interleave.
static BAR_ON_SCREEN: Mutex<usize> = Mutex::new(0);

/// Writes `text` and a newline to stderr on a line of its own: a bar on screen is cleared first
/// (and drawn again at the next tick, below the text).
pub fn eprint_line(text: &str) {
    let mut shown = BAR_ON_SCREEN.lock().unwrap_or_else(PoisonError::into_inner);
    let mut out = String::with_capacity(2 * *shown + text.len() + 3);
    clear_into(&mut out, *shown);
    out.push_str(text);
    out.push('\n');
    *shown = 0;
    // Nothing sensible is left to do when stderr itself cannot be written.
    let _ = std::io::stderr().lock().write_all(out.as_bytes());
}

/// Appends what erases a bar of `columns` columns and returns the cursor to the line's start.
fn clear_into(out: &mut String, columns: usize) {
    if columns > 0 {
        out.push('\r');
        out.extend(std::iter::repeat_n(' ', columns));
        out.push('\r');
    }
}

/// Draws `text` (at most [`BAR_COLUMNS`] columns) over the bar on screen.
fn draw_bar(text: &str) {
    let mut shown = BAR_ON_SCREEN.lock().unwrap_or_else(PoisonError::into_inner);
    let columns = text.chars().count();
    let mut out = String::with_capacity(text.len() + *shown + 1);
    out.push('\r');
    out.push_str(text);
    // Blank what a longer earlier bar left to the right, then come back to the bar's end.
    let stale = shown.saturating_sub(columns);
    out.extend(std::iter::repeat_n(' ', stale));
    out.extend(std::iter::repeat_n('\u{8}', stale));
    *shown = columns;
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(out.as_bytes());
    let _ = stderr.flush();
}

/// Erases the bar on screen, if any.
fn clear_bar() {
    let mut shown = BAR_ON_SCREEN.lock().unwrap_or_else(PoisonError::into_inner);
    let mut out = String::new();
    clear_into(&mut out, *shown);
    *shown = 0;
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(out.as_bytes());
    let _ = stderr.flush();
}

/// What the pass has done so far (shared with the printer's thread).
#[derive(Debug, Default)]
struct Counts {
    turns: AtomicU64,
    failed: AtomicU64,
    output_tokens: AtomicU64,
}

impl Counts {
    fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.turns.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.output_tokens.load(Ordering::Relaxed),
        )
    }
}

/// How the printer's thread shows the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// Redraws the bar in place every [`BAR_INTERVAL`].
    Bar,
    /// Prints a line every [`LINE_INTERVAL`].
    Lines,
}

#[derive(Debug)]
struct Printer {
    style: Style,
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

/// The progress of one pass.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    started: Instant,
    counts: Arc<Counts>,
    /// `None`: nothing shown until the summary line (`--progress off` prints not even that, see
    /// `summary`).
    printer: Option<Printer>,
    summary: bool,
}

/// Tokens per second over `elapsed` (0 before any time has passed).
fn rate(tokens: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

fn line(label: &str, total: u64, counts: &Counts, elapsed: Duration) -> String {
    let (turns, failed, tokens) = counts.snapshot();
    let failed = if failed > 0 {
        format!(" ({failed} failed)")
    } else {
        String::new()
    };
    format!(
        "{label}: {turns}/{total} turns{failed}, {tokens} output tokens, {rate:.0} tok/s, {seconds:.0} s elapsed",
        rate = rate(tokens, elapsed),
        seconds = elapsed.as_secs_f64(),
    )
}

/// The bar's text: label, elapsed time, the bar, turns done (and failed, if any), output tokens
/// per second. The bar takes what the rest leaves of [`BAR_COLUMNS`], between [`MIN_CELLS`]
/// and [`MAX_CELLS`] cells; a text that does not fit even so is cut.
fn bar_line(label: &str, total: u64, counts: &Counts, elapsed: Duration) -> String {
    let (turns, failed, tokens) = counts.snapshot();
    let seconds = elapsed.as_secs();
    let head = format!(
        "{label} [{:02}:{:02}:{:02}] [",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    );
    let mut tail = format!("] {turns}/{total} turns");
    if failed > 0 {
        let _ = write!(tail, " ({failed} failed)");
    }
    let _ = write!(tail, ", {:.0} tok/s", rate(tokens, elapsed));
    let room = BAR_COLUMNS.saturating_sub(head.chars().count() + tail.chars().count());
    let cells = room.clamp(MIN_CELLS, MAX_CELLS) as u64;
    // An empty pass is done.
    let done = (turns.min(total) * cells)
        .checked_div(total)
        .unwrap_or(cells);
    let mut text = head;
    text.extend((0..cells).map(|cell| if cell < done { '#' } else { '-' }));
    text.push_str(&tail);
    match text.char_indices().nth(BAR_COLUMNS) {
        Some((cut, _)) => text[..cut].to_string(),
        None => text,
    }
}

/// Which style `mode` asks for, given whether stderr is a terminal (`None`: nothing drawn).
fn style_for(mode: ProgressMode, terminal: bool) -> Option<Style> {
    match mode {
        ProgressMode::Off => None,
        ProgressMode::Bar if terminal => Some(Style::Bar),
        // A bar is drawn only on a terminal; the summary line still comes.
        ProgressMode::Bar => None,
        ProgressMode::Auto if terminal => Some(Style::Bar),
        ProgressMode::Auto | ProgressMode::Lines => Some(Style::Lines),
    }
}

impl Progress {
    /// Starts showing the progress of a pass over `total` turns.
    pub fn start(label: &str, total: u64, mode: ProgressMode) -> Progress {
        let counts = Arc::new(Counts::default());
        let started = Instant::now();
        let printer = style_for(mode, std::io::stderr().is_terminal()).map(|style| {
            let (stop, stopped) = mpsc::channel::<()>();
            let label = label.to_string();
            let shared = Arc::clone(&counts);
            let interval = match style {
                Style::Bar => BAR_INTERVAL,
                Style::Lines => LINE_INTERVAL,
            };
            // Ends on the stop message, or when the sender is dropped.
            let thread = std::thread::spawn(move || loop {
                if style == Style::Bar {
                    draw_bar(&bar_line(&label, total, &shared, started.elapsed()));
                }
                match stopped.recv_timeout(interval) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                }
                if style == Style::Lines {
                    eprint_line(&line(&label, total, &shared, started.elapsed()));
                }
            });
            Printer {
                style,
                stop,
                thread,
            }
        });
        Progress {
            label: label.to_string(),
            total,
            started,
            counts,
            printer,
            summary: mode != ProgressMode::Off,
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
    }

    /// Ends the display and prints the pass's summary line on stderr.
    pub fn finish(self) {
        if let Some(printer) = self.printer {
            // The printer ends on the message or when the sender is gone; either way it ends.
            let _ = printer.stop.send(());
            let _ = printer.thread.join();
            if printer.style == Style::Bar {
                clear_bar();
            }
        }
        if self.summary {
            eprint_line(&line(
                &self.label,
                self.total,
                &self.counts,
                self.started.elapsed(),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(turns: u64, failed: u64, tokens: u64) -> Counts {
        let counts = Counts::default();
        counts.turns.store(turns, Ordering::Relaxed);
        counts.failed.store(failed, Ordering::Relaxed);
        counts.output_tokens.store(tokens, Ordering::Relaxed);
        counts
    }

    #[test]
    fn the_line_names_turns_rate_and_time() {
        assert_eq!(
            line(
                "caches on",
                96,
                &counts(12, 0, 300),
                Duration::from_secs(10)
            ),
            "caches on: 12/96 turns, 300 output tokens, 30 tok/s, 10 s elapsed"
        );
        assert_eq!(
            line("caches off", 96, &counts(12, 2, 300), Duration::ZERO),
            "caches off: 12/96 turns (2 failed), 300 output tokens, 0 tok/s, 0 s elapsed"
        );
    }

    #[test]
    fn the_bar_shows_the_share_done_and_fits_80_columns() {
        let check = |label: &str, total, counts: Counts, elapsed, expected: &str| {
            let text = bar_line(label, total, &counts, Duration::from_secs(elapsed));
            assert_eq!(text, expected);
            assert!(text.chars().count() <= BAR_COLUMNS, "{text}");
        };
        // 30 cells where there is room.
        check(
            "caches on",
            96,
            counts(0, 0, 0),
            0,
            "caches on [00:00:00] [------------------------------] 0/96 turns, 0 tok/s",
        );
        check(
            "caches off",
            96,
            counts(12, 0, 300),
            10,
            "caches off [00:00:10] [###---------------------------] 12/96 turns, 30 tok/s",
        );
        check(
            "caches on",
            3,
            counts(3, 0, 5),
            1,
            "caches on [00:00:01] [##############################] 3/3 turns, 5 tok/s",
        );
        // Failures and a longer label take cells from the bar: 79 columns exactly.
        check(
            "MTP off, caches on",
            96,
            counts(95, 2, 36_000),
            3_723,
            "MTP off, caches on [01:02:03] [#############-] 95/96 turns (2 failed), 10 tok/s",
        );
        // Never fewer than 10 cells; what does not fit then is cut, not wrapped.
        check(
            "depth 1, caches on",
            960_000,
            counts(120_000, 7_000, 1_000_000_000),
            99,
            "depth 1, caches on [00:01:39] [#---------] 120000/960000 turns (7000 failed), 1",
        );
    }

    #[test]
    fn a_bar_is_drawn_only_on_a_terminal_and_lines_otherwise() {
        for (mode, terminal, expected) in [
            (ProgressMode::Auto, true, Some(Style::Bar)),
            (ProgressMode::Auto, false, Some(Style::Lines)),
            (ProgressMode::Bar, true, Some(Style::Bar)),
            (ProgressMode::Bar, false, None),
            (ProgressMode::Lines, true, Some(Style::Lines)),
            (ProgressMode::Lines, false, Some(Style::Lines)),
            (ProgressMode::Off, true, None),
            (ProgressMode::Off, false, None),
        ] {
            assert_eq!(style_for(mode, terminal), expected, "{mode:?} {terminal}");
        }
    }

    #[test]
    fn clearing_blanks_exactly_the_bar() {
        let mut out = String::new();
        clear_into(&mut out, 0);
        assert_eq!(out, "");
        clear_into(&mut out, 5);
        assert_eq!(out, "\r     \r");
    }
}
