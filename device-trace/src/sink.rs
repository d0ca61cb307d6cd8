//! Where trace lines go: a closure, an in-memory buffer, a line writer, or `tracing` events.

use std::fmt;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The destination of a [`TracingDeviceIo`](crate::TracingDeviceIo)'s lines.
///
/// Lines arrive from `&self` methods of the router, so every destination sits behind a mutex.
/// The trace is a diagnostic and must never take the router down with it: a destination that
/// panics (a callback, a writer) loses that line, which is counted ([`TraceSink::dropped_lines`])
/// and reported once through `tracing`, and the router's call goes on; the poisoned mutex it
/// leaves is recovered for the next line.
pub struct TraceSink {
    kind: SinkKind,
    dropped: AtomicU64,
}

type Callback = Box<dyn FnMut(&str) + Send>;

enum SinkKind {
    Callback(Mutex<Callback>),
    Memory(TraceBuffer),
    Writer(Mutex<Box<dyn Write + Send>>),
    Tracing,
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TraceSink {
    /// Calls `f` with each line.
    pub fn callback(f: impl FnMut(&str) + Send + 'static) -> Self {
        TraceSink {
            kind: SinkKind::Callback(Mutex::new(Box::new(f))),
            dropped: AtomicU64::new(0),
        }
    }

    /// Keeps the lines in memory; the returned buffer hands them back (for golden-trace tests).
    pub fn memory() -> (Self, TraceBuffer) {
        let buffer = TraceBuffer::default();
        (
            TraceSink {
                kind: SinkKind::Memory(buffer.clone()),
                dropped: AtomicU64::new(0),
            },
            buffer,
        )
    }

    /// Writes each line, newline-terminated, to `writer`. A write error is reported once through
    /// `tracing` and does not fail the router's call.
    pub fn writer(writer: impl Write + Send + 'static) -> Self {
        TraceSink {
            kind: SinkKind::Writer(Mutex::new(Box::new(writer))),
            dropped: AtomicU64::new(0),
        }
    }

    /// Emits each line as a `tracing` event at `INFO` with target `device_trace`.
    pub fn tracing() -> Self {
        TraceSink {
            kind: SinkKind::Tracing,
            dropped: AtomicU64::new(0),
        }
    }

    /// Lines lost because the destination panicked while taking them.
    pub fn dropped_lines(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn record(&self, line: &str) {
        // Nothing the closure touches is left half-updated by an unwind: the destinations sit
        // behind mutexes whose poisoning `lock` recovers from, and the line is simply lost.
        let written = catch_unwind(AssertUnwindSafe(|| match &self.kind {
            SinkKind::Callback(f) => (lock(f))(line),
            SinkKind::Memory(buffer) => lock(&buffer.lines).push(line.to_owned()),
            SinkKind::Writer(writer) => {
                if let Err(err) = writeln!(lock(writer), "{line}") {
                    tracing::warn!(target: "device_trace", %err, "trace line not written");
                }
            }
            SinkKind::Tracing => tracing::info!(target: "device_trace", "{line}"),
        }));
        if written.is_err() && self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                target: "device_trace",
                "the trace sink panicked; its lines are dropped (and counted), the router goes on"
            );
        }
    }
}

impl fmt::Debug for TraceSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            SinkKind::Callback(_) => "callback",
            SinkKind::Memory(_) => "memory",
            SinkKind::Writer(_) => "writer",
            SinkKind::Tracing => "tracing",
        };
        f.debug_struct("TraceSink").field("kind", &kind).finish()
    }
}

/// The lines an in-memory [`TraceSink`] recorded; cloning shares the same buffer.
#[derive(Debug, Clone, Default)]
pub struct TraceBuffer {
    lines: Arc<Mutex<Vec<String>>>,
}

impl TraceBuffer {
    /// A copy of the lines recorded so far.
    pub fn lines(&self) -> Vec<String> {
        lock(&self.lines).clone()
    }

    /// Takes the lines recorded so far, leaving the buffer empty.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.lines))
    }

    /// The lines recorded so far, each terminated by a newline.
    pub fn text(&self) -> String {
        lock(&self.lines)
            .iter()
            .fold(String::new(), |mut text, line| {
                text.push_str(line);
                text.push('\n');
                text
            })
    }
}
