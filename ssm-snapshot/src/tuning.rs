//! α tuning: choose the weight of FLOP efficiency in eviction scores by replaying recent requests
//! on a copy of the store under a grid of α values and keeping the α that saves the most FLOPs.
//!
//! - [`TuningMode::Bootstrap`] is Marconi's scheme: the requests seen until the first eviction,
//!   extended by `window_factor` times as many, are replayed once from the store as it was at the
//!   start; α is fixed afterwards.
//! - [`TuningMode::Periodic`] retunes every `window` requests: it keeps a copy of the store as it
//!   was when the window began and replays the window from that copy, so the replay sees the same
//!   cache contents the live store saw (no cold-start bias), and α follows a drifting workload.
//!
//! Invariants: `snapshot` is the store as it was before the first request in `window` was
//! served; once a bootstrap tuning ran, `done` is set and nothing more is recorded.

use crate::error::SnapshotError;
use crate::sim::{serve_request, SyntheticBlocks};
use crate::store::{Namespace, SnapshotStore, StoreDelta};

/// The α values tried by default.
pub const DEFAULT_GRID: &[f64] = &[0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0];

/// How α is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum TuningMode {
    /// α stays as configured.
    Fixed,
    /// Marconi: tune once, on the requests up to `window_factor` times the count seen before the
    /// first eviction.
    Bootstrap {
        /// α values to try.
        grid: Vec<f64>,
        /// Window length as a multiple of the requests seen before the first eviction.
        window_factor: usize,
    },
    /// Retune every `window` requests on the last window.
    Periodic {
        /// α values to try.
        grid: Vec<f64>,
        /// Requests per window.
        window: usize,
    },
}

/// A served request as the tuner replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// Its namespace.
    pub namespace: Namespace,
    /// The tokens looked up.
    pub input: Vec<u32>,
    /// Input plus output, inserted on finish.
    pub full: Vec<u32>,
}

/// Chooses α for a store by replaying recorded requests (see the module docs).
#[derive(Debug, Clone)]
pub struct AlphaTuner {
    mode: TuningMode,
    snapshot: Option<SnapshotStore>,
    window: Vec<RecordedRequest>,
    seen: usize,
    first_eviction_at: Option<usize>,
    done: bool,
    history: Vec<(usize, f64)>,
}

impl AlphaTuner {
    /// A tuner for `store`, which must be in the state the first observed request will find.
    pub fn new(mode: TuningMode, store: &SnapshotStore) -> Result<Self, SnapshotError> {
        match &mode {
            TuningMode::Fixed => {}
            TuningMode::Bootstrap {
                grid,
                window_factor,
            } => {
                check_grid(grid)?;
                if *window_factor == 0 {
                    return Err(SnapshotError::BadConfig {
                        field: "window_factor",
                        value: "0".into(),
                        limit: "at least 1",
                    });
                }
            }
            TuningMode::Periodic { grid, window } => {
                check_grid(grid)?;
                if *window == 0 {
                    return Err(SnapshotError::BadConfig {
                        field: "window",
                        value: "0".into(),
                        limit: "at least 1",
                    });
                }
            }
        }
        let snapshot = (mode != TuningMode::Fixed).then(|| store.clone());
        Ok(Self {
            mode,
            snapshot,
            window: Vec::new(),
            seen: 0,
            first_eviction_at: None,
            done: false,
            history: Vec::new(),
        })
    }

    /// `(request count, α)` for every tuning so far.
    pub fn history(&self) -> &[(usize, f64)] {
        &self.history
    }

    /// Records a request `store` just served; when a window is complete, replays it under every
    /// α of the grid, sets the best on `store` and returns it.
    pub fn observe(
        &mut self,
        store: &mut SnapshotStore,
        request: RecordedRequest,
    ) -> Result<Option<f64>, SnapshotError> {
        self.seen += 1;
        if self.done || self.mode == TuningMode::Fixed {
            return Ok(None);
        }
        let stats = store.stats();
        if self.first_eviction_at.is_none()
            && stats.evicted_leaves + stats.evicted_checkpoints_only > 0
        {
            self.first_eviction_at = Some(self.seen);
        }
        self.window.push(request);
        let (grid, due) = match &self.mode {
            TuningMode::Fixed => return Ok(None),
            TuningMode::Bootstrap {
                grid,
                window_factor,
            } => (
                grid.clone(),
                self.first_eviction_at
                    .is_some_and(|k| self.window.len() >= k * window_factor),
            ),
            TuningMode::Periodic { grid, window } => (grid.clone(), self.window.len() >= *window),
        };
        if !due {
            return Ok(None);
        }
        let mut chosen = None;
        if self.first_eviction_at.is_some() {
            if let Some(snapshot) = &self.snapshot {
                let alpha = best_alpha(snapshot, &self.window, &grid, store.config().alpha)?;
                store.set_alpha(alpha)?;
                self.history.push((self.seen, alpha));
                tracing::debug!(requests = self.seen, alpha, "alpha tuned");
                chosen = Some(alpha);
            }
        }
        self.window.clear();
        match self.mode {
            TuningMode::Bootstrap { .. } => {
                self.done = true;
                self.snapshot = None;
            }
            _ => self.snapshot = Some(store.clone()),
        }
        Ok(chosen)
    }
}

fn check_grid(grid: &[f64]) -> Result<(), SnapshotError> {
    if grid.is_empty() {
        return Err(SnapshotError::BadConfig {
            field: "grid",
            value: "[]".into(),
            limit: "at least one α",
        });
    }
    for &alpha in grid {
        if !alpha.is_finite() || alpha < 0.0 {
            return Err(SnapshotError::BadConfig {
                field: "grid",
                value: alpha.to_string(),
                limit: "finite and non-negative",
            });
        }
    }
    Ok(())
}

/// Replays `requests` from `start` under each α of `grid`; the α saving the most FLOPs wins,
/// ties going to `current`, then to the smaller α.
pub fn best_alpha(
    start: &SnapshotStore,
    requests: &[RecordedRequest],
    grid: &[f64],
    current: f64,
) -> Result<f64, SnapshotError> {
    let mut best: Option<(f64, f64)> = None;
    let mut delta = StoreDelta::default();
    for &alpha in grid {
        let mut store = start.clone();
        store.set_alpha(alpha)?;
        let mut blocks = SyntheticBlocks::new(u32::MAX / 2);
        let mut saved = 0.0;
        for request in requests {
            delta.clear();
            let outcome = serve_request(
                &mut store,
                request.namespace,
                &request.input,
                &request.full,
                &mut blocks,
                &mut delta,
            )?;
            saved += outcome.flops_saved;
        }
        let better = match best {
            None => true,
            Some((best_saved, best_alpha)) => {
                saved > best_saved
                    || (saved == best_saved && alpha == current && best_alpha != current)
            }
        };
        if better {
            best = Some((saved, alpha));
        }
    }
    Ok(best.map_or(current, |(_, alpha)| alpha))
}
