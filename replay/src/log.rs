//! The replay's log: each `tracing` event at or above a level becomes one line on stderr,
//! `LEVEL target: message field=value ...`, written through [`crate::progress::eprint_line`] so
//! that it never shares a line with a progress bar.
//!
//! The engine below the replay reports through `tracing` events only (warnings such as a failed
//! spill or a refused checkpoint, and at debug level a few more); it opens no spans, so this
//! subscriber keeps no span data: a span gets an id and nothing more. That is all the replay
//! needs of a subscriber, and `tracing-subscriber`'s formatter would add four crates to the main
//! job's first build for it.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

/// Where a finished line goes.
type Sink = Box<dyn Fn(&str) + Send + Sync>;

/// A subscriber that writes every event at or above a level as one line.
pub struct LineLog {
    max_level: LevelFilter,
    sink: Sink,
    next_span: AtomicU64,
}

impl fmt::Debug for LineLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LineLog")
            .field("max_level", &self.max_level)
            .finish_non_exhaustive()
    }
}

impl LineLog {
    /// Events at `max_level` or more severe, each line handed to `sink`.
    pub fn new(max_level: LevelFilter, sink: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self {
            max_level,
            sink: Box::new(sink),
            next_span: AtomicU64::new(1),
        }
    }

    /// Events at `max_level` or more severe, on stderr.
    pub fn stderr(max_level: LevelFilter) -> Self {
        Self::new(max_level, crate::progress::eprint_line)
    }
}

/// Collects an event's message and its other fields.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The line of `event`: level, target, message, then the other fields as `name=value`.
fn format_event(event: &Event<'_>) -> String {
    let mut line = Line::default();
    event.record(&mut line);
    let meta = event.metadata();
    format!(
        "{:>5} {}: {}{}",
        meta.level(),
        meta.target(),
        line.message,
        line.fields
    )
}

impl Subscriber for LineLog {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.enabled(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max_level
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max_level)
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        // Ids must be nonzero; a u64 counter does not wrap in practice.
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        (self.sink)(&format_event(event));
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The lines `emit` logs at `max_level`.
    fn logged(max_level: LevelFilter, emit: impl FnOnce()) -> Vec<String> {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let log = LineLog::new(max_level, move |line| {
            sink.lock().unwrap().push(line.to_string())
        });
        tracing::subscriber::with_default(log, emit);
        let lines = lines.lock().unwrap().clone();
        lines
    }

    #[test]
    fn events_at_or_above_the_level_are_one_line_each_with_their_fields() {
        let emit = || {
            let err = std::io::Error::other("disk full");
            tracing::error!(during = "lora", %err, "the device is lost");
            tracing::warn!(
                id = 7u64,
                path = "/tmp/x",
                "spill failed; recomputing instead"
            );
            tracing::info!(adapter = 2u32, "LoRA adapter unloaded");
            tracing::debug!(?err, "draft step refused");
        };
        let target = module_path!();
        assert_eq!(
            logged(LevelFilter::WARN, emit),
            [
                format!("ERROR {target}: the device is lost during=\"lora\" err=disk full"),
                format!(" WARN {target}: spill failed; recomputing instead id=7 path=\"/tmp/x\""),
            ]
        );
        assert_eq!(logged(LevelFilter::INFO, emit).len(), 3);
        let debug = logged(LevelFilter::DEBUG, emit);
        assert_eq!(
            debug[3],
            format!(
                "DEBUG {target}: draft step refused err=Custom {{ kind: Other, error: \"disk full\" }}"
            )
        );
    }

    #[test]
    fn spans_get_distinct_ids_and_events_inside_them_are_logged() {
        let lines = logged(LevelFilter::WARN, || {
            let outer = tracing::warn_span!("outer", step = 1u32);
            let _entered = outer.enter();
            let inner = tracing::warn_span!("inner");
            assert_ne!(outer.id(), inner.id());
            assert!(outer.id().is_some());
            tracing::warn!("inside");
        });
        assert_eq!(lines, [format!(" WARN {}: inside", module_path!())]);
    }
}
