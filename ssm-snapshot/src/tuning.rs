//! Tuning the eviction score: choose α (the weight of FLOP efficiency against recency) and the
//! recency basis by measuring, on the recent requests, what each setting of a grid would have
//! saved, and keep the best.
//!
//! - [`TuningMode::Bootstrap`] is Marconi's scheme: the requests seen until the first eviction,
//!   extended to `window_factor` times as many, are replayed once from the store as it was at the
//!   start under every setting; the best is fixed afterwards.
//! - [`TuningMode::Periodic`] retunes every `window` requests: it keeps a copy of the store as it
//!   was when the window began and replays the window from that copy, so the replay sees the same
//!   cache contents the live store saw (no cold-start bias), and follows a drifting workload.
//! - [`TuningMode::Shadow`] runs one shadow store per setting on every request (tokens only, no
//!   device work: a few microseconds each), scores each by an exponentially decayed sum of what
//!   it saved, and switches the live store to the leader when it leads the current setting's
//!   shadow by more than `margin`. Unlike a replay from a snapshot, a shadow's score includes the
//!   long-run effect of a setting on what stays cached.
//!
//! Invariants: in `Periodic` and `Bootstrap` modes, `snapshot` is the store as it was before the
//! first request of `window` was served; once a bootstrap tuning ran, `done` is set and nothing
//! more is recorded. In `Shadow` mode, `shadows[i]` has run every observed request under
//! `grid[i]`.

use crate::error::SnapshotError;
use crate::sim::{serve_request, SyntheticBlocks};
use crate::store::{FlopBasis, Namespace, Recency, SnapshotStore, StoreDelta};

/// The α values tried by default.
pub const DEFAULT_ALPHAS: &[f64] = &[0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0];

/// One point of a tuning grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    /// Weight of FLOP efficiency.
    pub alpha: f64,
    /// Recency basis.
    pub recency: Recency,
    /// FLOP basis.
    pub flop_basis: FlopBasis,
    /// Guarded admission ([`crate::StoreConfig::guard`]).
    pub guard: bool,
}

/// [`DEFAULT_ALPHAS`] under each of `recencies` and `bases`, plain admission.
pub fn grid(recencies: &[Recency], bases: &[FlopBasis]) -> Vec<Setting> {
    grid_of(DEFAULT_ALPHAS, recencies, bases, &[false])
}

/// Every combination of `alphas`, `recencies`, `bases` and admission `guards`.
pub fn grid_of(
    alphas: &[f64],
    recencies: &[Recency],
    bases: &[FlopBasis],
    guards: &[bool],
) -> Vec<Setting> {
    let mut out = Vec::new();
    for &guard in guards {
        for &recency in recencies {
            for &flop_basis in bases {
                out.extend(alphas.iter().map(|&alpha| Setting {
                    alpha,
                    recency,
                    flop_basis,
                    guard,
                }));
            }
        }
    }
    out
}

/// The default grid (40 settings): [`DEFAULT_ALPHAS`] with [`Recency::Adaptive`], both FLOP
/// bases, guarded admission off and on. Guarded admission is what wins at small capacities;
/// the α values and bases what wins at middle ones (see the crate report for the measurements).
pub fn default_grid() -> Vec<Setting> {
    grid_of(
        DEFAULT_ALPHAS,
        &[Recency::Adaptive],
        &[FlopBasis::Prefix, FlopBasis::Marginal],
        &[false, true],
    )
}

/// The grid of the first version (20 settings): [`DEFAULT_ALPHAS`] under path and own recency,
/// marginal FLOPs, plain admission. Kept for comparisons.
pub fn legacy_grid() -> Vec<Setting> {
    grid(&[Recency::Path, Recency::Own], &[FlopBasis::Marginal])
}

/// Default shadow half-life, in requests (150 to 300 measured alike; 200 best).
pub const DEFAULT_HALF_LIFE: usize = 200;
/// Default lead a shadow needs over the live setting's shadow to take over.
pub const DEFAULT_MARGIN: f64 = 0.02;
/// Default requests between two switches (and before the first).
pub const DEFAULT_COOLDOWN: usize = 300;

/// The default tuning: shadows over [`default_grid`], half-life [`DEFAULT_HALF_LIFE`], a lead of
/// [`DEFAULT_MARGIN`] and [`DEFAULT_COOLDOWN`] requests between switches (what measured best on
/// the generated traces against the paper simulator's policies; see the crate report).
pub fn default_tuning() -> TuningMode {
    TuningMode::Shadow {
        grid: default_grid(),
        half_life: DEFAULT_HALF_LIFE,
        margin: DEFAULT_MARGIN,
        cooldown: DEFAULT_COOLDOWN,
    }
}

/// How the score is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum TuningMode {
    /// The store's setting stays as configured.
    Fixed,
    /// Marconi: tune once, on the requests up to `window_factor` times the count seen before the
    /// first eviction.
    Bootstrap {
        /// Settings to try.
        grid: Vec<Setting>,
        /// Window length as a multiple of the requests seen before the first eviction.
        window_factor: usize,
    },
    /// Retune every `window` requests on the last window.
    Periodic {
        /// Settings to try.
        grid: Vec<Setting>,
        /// Requests per window.
        window: usize,
    },
    /// Follow the best of continuously running shadow stores.
    Shadow {
        /// Settings to shadow.
        grid: Vec<Setting>,
        /// Requests after which a shadow's past savings count half.
        half_life: usize,
        /// Relative lead a shadow needs over the current setting's to take over.
        margin: f64,
        /// Requests between two switches (and before the first).
        cooldown: usize,
    },
}

/// What a tuning maximises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// FLOPs saved by hits (Marconi).
    Flops,
    /// Tokens reused (the token hit rate).
    HitTokens,
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

#[derive(Debug, Clone)]
struct Shadow {
    store: SnapshotStore,
    blocks: SyntheticBlocks,
    score: f64,
    hit_tokens: u64,
}

/// Chooses the eviction setting of a store (see the module docs).
#[derive(Debug, Clone)]
pub struct AlphaTuner {
    mode: TuningMode,
    objective: Objective,
    snapshot: Option<SnapshotStore>,
    window: Vec<RecordedRequest>,
    shadows: Vec<Shadow>,
    seen: usize,
    first_eviction_at: Option<usize>,
    last_switch: usize,
    done: bool,
    history: Vec<(usize, Setting)>,
    delta: StoreDelta,
}

impl AlphaTuner {
    /// A tuner for `store`, which must be in the state the first observed request will find.
    pub fn new(mode: TuningMode, store: &SnapshotStore) -> Result<Self, SnapshotError> {
        let mut shadows = Vec::new();
        match &mode {
            TuningMode::Fixed => {}
            TuningMode::Bootstrap {
                grid,
                window_factor,
            } => {
                check_grid(grid)?;
                check_positive("window_factor", *window_factor)?;
            }
            TuningMode::Periodic { grid, window } => {
                check_grid(grid)?;
                check_positive("window", *window)?;
            }
            TuningMode::Shadow {
                grid,
                half_life,
                margin,
                ..
            } => {
                check_grid(grid)?;
                check_positive("half_life", *half_life)?;
                if !margin.is_finite() || *margin < 0.0 {
                    return Err(SnapshotError::BadConfig {
                        field: "margin",
                        value: margin.to_string(),
                        limit: "finite and non-negative",
                    });
                }
                for setting in grid {
                    let mut shadow = store.clone();
                    apply(&mut shadow, *setting)?;
                    shadows.push(Shadow {
                        store: shadow,
                        blocks: SyntheticBlocks::new(u32::MAX / 2),
                        score: 0.0,
                        hit_tokens: 0,
                    });
                }
            }
        }
        let snapshot = matches!(
            mode,
            TuningMode::Bootstrap { .. } | TuningMode::Periodic { .. }
        )
        .then(|| store.clone());
        Ok(Self {
            mode,
            objective: Objective::Flops,
            snapshot,
            window: Vec::new(),
            shadows,
            seen: 0,
            first_eviction_at: None,
            last_switch: 0,
            done: false,
            history: Vec::new(),
            delta: StoreDelta::default(),
        })
    }

    /// Sets what tuning maximises (FLOPs saved by default).
    pub fn with_objective(mut self, objective: Objective) -> Self {
        self.objective = objective;
        self
    }

    /// In shadow mode, each shadow's setting and the tokens it reused so far (what the live
    /// store would have reused under that setting alone).
    pub fn shadow_hit_tokens(&self) -> Vec<(Setting, u64)> {
        match &self.mode {
            TuningMode::Shadow { grid, .. } => grid
                .iter()
                .zip(&self.shadows)
                .map(|(s, shadow)| (*s, shadow.hit_tokens))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `(request count, setting)` for every change of setting so far.
    pub fn history(&self) -> &[(usize, Setting)] {
        &self.history
    }

    /// Records a request `store` just served; when a tuning is due, applies the best setting to
    /// `store` and returns it.
    pub fn observe(
        &mut self,
        store: &mut SnapshotStore,
        request: RecordedRequest,
    ) -> Result<Option<Setting>, SnapshotError> {
        self.seen += 1;
        let current = Setting {
            alpha: store.config().alpha,
            recency: store.config().recency,
            flop_basis: store.config().flop_basis,
            guard: store.config().guard,
        };
        self.note_first_eviction(store);
        let (grid, due) = match &self.mode {
            TuningMode::Fixed => return Ok(None),
            TuningMode::Shadow {
                half_life,
                margin,
                grid,
                cooldown,
            } => {
                let decay = 0.5f64.powf(1.0 / *half_life as f64);
                for shadow in &mut self.shadows {
                    self.delta.clear();
                    let outcome = serve_request(
                        &mut shadow.store,
                        request.namespace,
                        &request.input,
                        &request.full,
                        &mut shadow.blocks,
                        &mut self.delta,
                    )?;
                    shadow.score = shadow.score * decay + value(self.objective, outcome);
                    shadow.hit_tokens += outcome.hit_tokens as u64;
                }
                let mut best = 0;
                for (i, shadow) in self.shadows.iter().enumerate() {
                    if shadow.score > self.shadows[best].score {
                        best = i;
                    }
                }
                let current_score = grid
                    .iter()
                    .position(|s| *s == current)
                    .map_or(f64::NEG_INFINITY, |i| self.shadows[i].score);
                // Switch only on evidence: a lead of `margin`, and at least `cooldown` requests
                // since the last switch (a cache reshaped by one setting pays off slowly, so
                // churning between close settings loses to any of them).
                let settled = self.seen >= self.last_switch + cooldown;
                if settled
                    && grid[best] != current
                    && self.shadows[best].score > current_score * (1.0 + margin)
                {
                    self.last_switch = self.seen;
                    apply(store, grid[best])?;
                    self.history.push((self.seen, grid[best]));
                    return Ok(Some(grid[best]));
                }
                return Ok(None);
            }
            TuningMode::Bootstrap { .. } | TuningMode::Periodic { .. } if self.done => {
                return Ok(None)
            }
            TuningMode::Bootstrap {
                grid,
                window_factor,
            } => {
                self.window.push(request);
                let due = self
                    .first_eviction_at
                    .is_some_and(|k| self.window.len() >= k * window_factor);
                (grid.clone(), due)
            }
            TuningMode::Periodic { grid, window } => {
                self.window.push(request);
                (grid.clone(), self.window.len() >= *window)
            }
        };
        if !due {
            return Ok(None);
        }
        let mut chosen = None;
        if self.first_eviction_at.is_some() {
            if let Some(snapshot) = &self.snapshot {
                let best = best_setting(snapshot, &self.window, &grid, current, self.objective)?;
                if best != current {
                    apply(store, best)?;
                    self.history.push((self.seen, best));
                    chosen = Some(best);
                }
                tracing::debug!(
                    requests = self.seen,
                    alpha = best.alpha,
                    "eviction score tuned"
                );
            }
        }
        self.window.clear();
        if matches!(self.mode, TuningMode::Bootstrap { .. }) {
            self.done = true;
            self.snapshot = None;
        } else {
            self.snapshot = Some(store.clone());
        }
        Ok(chosen)
    }

    fn note_first_eviction(&mut self, store: &SnapshotStore) {
        let stats = store.stats();
        if self.first_eviction_at.is_none()
            && stats.evicted_leaves + stats.evicted_checkpoints_only > 0
        {
            self.first_eviction_at = Some(self.seen);
        }
    }
}

fn apply(store: &mut SnapshotStore, setting: Setting) -> Result<(), SnapshotError> {
    store.set_alpha(setting.alpha)?;
    store.set_recency(setting.recency);
    store.set_flop_basis(setting.flop_basis);
    store.set_guard(setting.guard);
    Ok(())
}

fn value(objective: Objective, outcome: crate::sim::RequestOutcome) -> f64 {
    match objective {
        Objective::Flops => outcome.flops_saved,
        Objective::HitTokens => outcome.hit_tokens as f64,
    }
}

fn check_positive(field: &'static str, value: usize) -> Result<(), SnapshotError> {
    if value == 0 {
        return Err(SnapshotError::BadConfig {
            field,
            value: "0".into(),
            limit: "at least 1",
        });
    }
    Ok(())
}

fn check_grid(grid: &[Setting]) -> Result<(), SnapshotError> {
    if grid.is_empty() {
        return Err(SnapshotError::BadConfig {
            field: "grid",
            value: "[]".into(),
            limit: "at least one setting",
        });
    }
    for setting in grid {
        if !setting.alpha.is_finite() || setting.alpha < 0.0 {
            return Err(SnapshotError::BadConfig {
                field: "grid",
                value: setting.alpha.to_string(),
                limit: "α finite and non-negative",
            });
        }
    }
    Ok(())
}

/// Replays `requests` from `start` under each setting of `grid`; the setting scoring best on
/// `objective` wins, ties going to `current`, then to the earlier setting of the grid.
pub fn best_setting(
    start: &SnapshotStore,
    requests: &[RecordedRequest],
    grid: &[Setting],
    current: Setting,
    objective: Objective,
) -> Result<Setting, SnapshotError> {
    let mut best: Option<(f64, Setting)> = None;
    let mut delta = StoreDelta::default();
    for &setting in grid {
        let mut store = start.clone();
        apply(&mut store, setting)?;
        let mut blocks = SyntheticBlocks::new(u32::MAX / 2);
        let mut total = 0.0;
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
            total += value(objective, outcome);
        }
        let better = match best {
            None => true,
            Some((best_total, best_setting)) => {
                total > best_total
                    || (total == best_total && setting == current && best_setting != current)
            }
        };
        if better {
            best = Some((total, setting));
        }
    }
    Ok(best.map_or(current, |(_, setting)| setting))
}
