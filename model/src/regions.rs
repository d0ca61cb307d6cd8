//! Wall time of each parallel region of the forward pass and of each pool thread's work in it
//! (feature `region-timing`, for `examples/throughput.rs --regions`; never built by default).
//!
//! A region is one fork and join of [`crate::gemm::Kernels`] (`for_each_chunk`,
//! `for_each_chunk_pair`, `for_each_task`, `for_each_uneven_task`), named by the source line
//! that asked for it (the functions in between are `#[track_caller]`) and, for a matrix product,
//! by its shape. Per region it adds up: the calls, the wall time from fork to join on the forking
//! thread, each pool thread's busy time (the sum of its tasks), the delay until each thread
//! started its first task (a helper's wake-up or steal latency), and the wait of each thread
//! between its last task and the join (imbalance). The serial time before a region (since the
//! previous region of the same forward pass joined) is charged to that region's line, and the
//! serial time after the last region to the line `forward end`.
//!
//! Only outermost regions count: a region opened inside a task (the experts' single-threaded
//! products) is part of its task's busy time. Recording costs two clock reads per task and a
//! lock per region; it adds a few percent to a forward pass and changes no output bit.

use std::cell::Cell;
use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Threads told apart: slot 0 is the thread that forked the region, slots `1..` the other pool
/// threads in pool order (modulo `MAX_THREADS - 1`).
pub const MAX_THREADS: usize = 8;

/// One line of the report: a region's source line and shape, and its totals in nanoseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionTotals {
    /// `file:line` of the code that forked, or `forward end` for the serial tail.
    pub site: String,
    /// `rows x in -> out` for a matrix product, else empty.
    pub shape: String,
    /// Regions recorded.
    pub calls: u64,
    /// Fork to join on the forking thread.
    pub wall_ns: u64,
    /// Serial time on the forking thread before the fork (since the previous join).
    pub serial_before_ns: u64,
    /// Per thread slot (see [`MAX_THREADS`]): the sum of its tasks' durations.
    pub busy_ns: [u64; MAX_THREADS],
    /// Per pool thread: fork to the start of its first task, summed over the regions where it
    /// ran a task.
    pub start_delay_ns: [u64; MAX_THREADS],
    /// Per pool thread: the end of its last task to the join, summed like `start_delay_ns`.
    pub end_wait_ns: [u64; MAX_THREADS],
    /// Per pool thread: the regions where it ran at least one task.
    pub regions_worked: [u64; MAX_THREADS],
}

/// What one region's tasks write while it runs: per thread, nanoseconds since the fork.
pub(crate) struct Probe {
    site: &'static Location<'static>,
    shape: Option<Shape>,
    forker: Option<usize>,
    fork: Instant,
    busy: [AtomicU64; MAX_THREADS],
    first: [AtomicU64; MAX_THREADS],
    last: [AtomicU64; MAX_THREADS],
}

thread_local! {
    /// Set while this thread runs a recorded region or one of its tasks: nested regions are
    /// not recorded.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// The shape the next region on this thread belongs to (set by the matrix product).
    static SHAPE: Cell<Option<Shape>> = const { Cell::new(None) };
}

/// A product's `(rows, in, out)`.
type Shape = (usize, usize, usize);

#[derive(Default)]
struct Book {
    totals: HashMap<(&'static Location<'static>, Option<Shape>), RegionTotals>,
    last_join: Option<Instant>,
    tail_ns: u64,
    tail_calls: u64,
}

static BOOK: Mutex<Option<Book>> = Mutex::new(None);

fn with_book<R>(f: impl FnOnce(&mut Book) -> R) -> R {
    let mut guard = BOOK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    f(guard.get_or_insert_with(Book::default))
}

/// Marks the start of a forward pass: the serial time before its first region starts here.
pub(crate) fn forward_start() {
    let now = Instant::now();
    with_book(|book| book.last_join = Some(now));
}

/// Marks the end of a forward pass: the serial time since its last region is the tail.
pub(crate) fn forward_end() {
    let now = Instant::now();
    with_book(|book| {
        if let Some(last) = book.last_join.take() {
            book.tail_ns += nanos(now - last);
            book.tail_calls += 1;
        }
    });
}

/// Names the shape of the matrix product whose region this thread opens next.
pub(crate) fn set_shape(rows: usize, in_dim: usize, out_dim: usize) {
    SHAPE.with(|shape| shape.set(Some((rows, in_dim, out_dim))));
}

/// Opens a region for the caller's caller's line, or `None` inside another region.
#[track_caller]
pub(crate) fn open() -> Option<Probe> {
    let shape = SHAPE.with(|shape| shape.take());
    if INSIDE.with(Cell::get) {
        return None;
    }
    INSIDE.with(|inside| inside.set(true));
    Some(Probe {
        site: Location::caller(),
        shape,
        forker: rayon::current_thread_index(),
        fork: Instant::now(),
        busy: Default::default(),
        first: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
        last: Default::default(),
    })
}

impl Probe {
    /// Runs one task of the region, timing it on the thread that runs it.
    pub(crate) fn task<R>(&self, f: impl FnOnce() -> R) -> R {
        let was_inside = INSIDE.with(|inside| inside.replace(true));
        let start = Instant::now();
        let result = f();
        let end = Instant::now();
        INSIDE.with(|inside| inside.set(was_inside));
        // The other threads are numbered in pool order, skipping the forker.
        let thread = match (rayon::current_thread_index(), self.forker) {
            (Some(index), Some(forker)) if index != forker => {
                1 + (index - usize::from(index > forker)) % (MAX_THREADS - 1)
            }
            (Some(index), None) => 1 + index % (MAX_THREADS - 1),
            _ => 0,
        };
        let (start, end) = (nanos(start - self.fork), nanos(end - self.fork));
        self.busy[thread].fetch_add(end - start, Ordering::Relaxed);
        self.first[thread].fetch_min(start, Ordering::Relaxed);
        self.last[thread].fetch_max(end, Ordering::Relaxed);
        result
    }

    /// Joins the region: adds it to the totals.
    pub(crate) fn close(self) {
        let join = Instant::now();
        INSIDE.with(|inside| inside.set(false));
        let wall = nanos(join - self.fork);
        with_book(|book| {
            let serial = book.last_join.map_or(0, |last| nanos(self.fork - last));
            book.last_join = Some(join);
            let totals = book
                .totals
                .entry((self.site, self.shape))
                .or_insert_with(|| RegionTotals {
                    site: format!("{}:{}", self.site.file(), self.site.line()),
                    shape: self
                        .shape
                        .map(|(m, k, n)| format!("{m}x{k}->{n}"))
                        .unwrap_or_default(),
                    ..RegionTotals::default()
                });
            totals.calls += 1;
            totals.wall_ns += wall;
            totals.serial_before_ns += serial;
            for t in 0..MAX_THREADS {
                let first = self.first[t].load(Ordering::Relaxed);
                if first == u64::MAX {
                    continue;
                }
                totals.busy_ns[t] += self.busy[t].load(Ordering::Relaxed);
                totals.start_delay_ns[t] += first;
                totals.end_wait_ns[t] += wall.saturating_sub(self.last[t].load(Ordering::Relaxed));
                totals.regions_worked[t] += 1;
            }
        });
    }
}

fn nanos(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// The totals since the last call (or the start), one line per region site and shape, then the
/// serial tail as `forward end`; clears them.
pub fn take() -> Vec<RegionTotals> {
    with_book(|book| {
        let mut lines: Vec<RegionTotals> = book.totals.drain().map(|(_, totals)| totals).collect();
        lines.sort_by(|a, b| (&a.site, &a.shape).cmp(&(&b.site, &b.shape)));
        lines.push(RegionTotals {
            site: "forward end".into(),
            calls: book.tail_calls,
            serial_before_ns: book.tail_ns,
            ..RegionTotals::default()
        });
        book.tail_ns = 0;
        book.tail_calls = 0;
        book.last_join = None;
        lines
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{matmul, Kernels, Packed};

    /// The lines of this file in a report (other tests of the crate may record regions of their
    /// own at the same time; they are never at this file's lines).
    fn this_files(lines: Vec<RegionTotals>) -> Vec<RegionTotals> {
        let prefix = format!("{}:", file!());
        lines
            .into_iter()
            .filter(|line| line.site.starts_with(&prefix))
            .collect()
    }

    /// Each outermost fork/join is one call of the line that asked for it, with its product's
    /// shape; a region opened inside a task is part of that task, never a line of its own.
    #[test]
    fn each_outermost_region_is_one_call_of_its_line_and_shape() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let kernels = Kernels {
            threads: 2,
            ..Kernels::single()
        };
        let (k, n) = (8, 40);
        let weight: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32).collect();
        let w = Packed::from_rows(&weight, n, k);
        let x = vec![1.0f32; 3 * k];
        let mut out = vec![0.0; 3 * n];
        let mut tmp = Vec::new();
        let mut tasks = vec![0u64; 10];
        let mut here = 0;
        pool.install(|| {
            for _ in 0..3 {
                here = line!();
                kernels.for_each_task(&mut tasks, |task| {
                    let mut inner = [1u64; 4];
                    kernels.for_each_task(&mut inner, |x| *x += 1);
                    *task += inner.iter().sum::<u64>();
                });
                matmul(&kernels, &x, 3, &w, None, &mut tmp, &mut out, None);
            }
        });
        assert_eq!(tasks, vec![24; 10]);
        assert_eq!(
            out[..n],
            (0..n)
                .map(|o| weight[o * k..][..k].iter().sum())
                .collect::<Vec<f32>>()
        );
        // The two calls are on the first and the sixth line after `here`.
        let (task_line, product_line) = (here + 1, here + 6);
        let lines = this_files(take());
        let sites: Vec<(String, &str, u64)> = lines
            .iter()
            .map(|line| (line.site.clone(), line.shape.as_str(), line.calls))
            .collect();
        assert_eq!(
            sites,
            [
                (format!("{}:{task_line}", file!()), "", 3),
                (format!("{}:{product_line}", file!()), "3x8->40", 3),
            ]
        );
        for line in &lines {
            // Every region ran its tasks on one or both of the two threads.
            let worked: u64 = line.regions_worked.iter().sum();
            assert!((3..=6).contains(&worked), "{line:?}");
            assert_eq!(line.regions_worked[2..], [0; MAX_THREADS - 2], "{line:?}");
        }
        assert!(this_files(take()).is_empty(), "take clears the totals");
    }
}
