//! Grid and scan reports as data, and the comparison of two of them.
//!
//! The `grid` and `short_grid` examples write their cells with `--json FILE` (a [`Report`]);
//! the `compare` example reads two and prints what a change to the default policy is judged on
//! ([`Comparison`]): for each report, the cells failing their check (below `lru` or SGLang+ by
//! more than [`LRU_TOLERANCE`], below the paper's Marconi by more than
//! [`PAPER_MARCONI_TOLERANCE`]), on their traces and on their jittered copies' mean; the mean of
//! `marconi − lru`; its paired change between the two reports with its standard error; and the
//! cells whose `marconi` moved. A session's keep rule is written in those figures before the
//! candidate runs (ssm-snapshot/MEASUREMENTS.md), and a fresh machine needs nothing else to
//! judge it.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{CellFigures, References, LRU_TOLERANCE, PAPER_MARCONI_TOLERANCE, PAPER_OVERSHOOT};
use crate::error::SnapshotError;

/// Which example wrote a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportKind {
    /// The full grid (`grid`): block size 1, the paper simulator's policies as references too.
    Grid,
    /// The short-trace scan (`short_grid`): the engine's block size, `lru` the only reference.
    Scan,
}

/// The cells of one run of `grid` or `short_grid`, as `--json FILE` writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The example that wrote it.
    pub kind: ReportKind,
    /// The cost model's name (`--model`).
    pub model: String,
    /// The pin scope (`--pin-scope`: `path` or `hit`).
    pub pin_scope: String,
    /// Jittered copies per cell (`--jitter`; 0: none).
    pub jitter: u64,
    /// The chance of a swap in a jittered copy (`--jitter-rate`).
    pub jitter_rate: f64,
    /// The cells, in the report's order.
    pub cells: Vec<CellRecord>,
}

impl Report {
    /// Reads a report written by [`Report::write`].
    pub fn read(path: &Path) -> Result<Report, SnapshotError> {
        super::read_json(path)
    }

    /// Writes the report to `path` as JSON (figures round-trip bit for bit).
    pub fn write(&self, path: &Path) -> Result<(), SnapshotError> {
        super::write_json(path, self)
    }
}

/// One cell of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellRecord {
    /// The trace family (`chat`, `longchat50`, ...).
    pub family: String,
    /// Sessions in the trace.
    pub sessions: usize,
    /// The generator's seed.
    pub seed: u64,
    /// The store's capacity.
    pub capacity_bytes: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Requests in the trace.
    pub requests: usize,
    /// The cell on its trace.
    pub figures: Figures,
    /// The cell on its jittered copies: the mean of their figures (none without copies).
    pub copies: Option<Figures>,
    /// `(request count, setting)` of every switch the tuner made on the trace, the setting as
    /// `Setting` displays it (the scan; the grid does not record them).
    pub switches: Option<Vec<(usize, String)>>,
}

impl CellRecord {
    /// The cell's name: `family/sessions/seed/capacity/block size`, unique in a report.
    pub fn key(&self) -> String {
        format!(
            "{}/{}/{}/{}/{}",
            self.family, self.sessions, self.seed, self.capacity_bytes, self.block_size
        )
    }

    /// The cell as the reports print it: `chat 40/2 1 GB`.
    pub fn name(&self) -> String {
        format!(
            "{} {}/{} {} GB",
            self.family,
            self.sessions,
            self.seed,
            self.capacity_bytes as f64 / 1e9
        )
    }
}

/// A cell's token hit rates: the default `marconi`, `lru`, and the paper simulator's policies
/// where the report has them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// The store's `lru` policy.
    pub lru: f64,
    /// The store's default `marconi` policy.
    pub marconi: f64,
    /// The paper simulator's policies (the full grid only).
    pub paper: Option<PaperFigures>,
}

/// The paper simulator's figures of a cell.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PaperFigures {
    /// SGLang+: token hit rate.
    pub sglang: f64,
    /// The paper's Marconi: token hit rate.
    pub marconi: f64,
    /// The most bytes SGLang+ held.
    pub sglang_max_bytes: u64,
    /// The most bytes the paper's Marconi held.
    pub marconi_max_bytes: u64,
}

/// Whether a paper policy that held at most `max_bytes` kept within [`PAPER_OVERSHOOT`] times
/// `capacity_bytes` (and so is a reference for its cell).
pub fn within_overshoot(max_bytes: u64, capacity_bytes: u64) -> bool {
    max_bytes as f64 <= PAPER_OVERSHOOT * capacity_bytes as f64
}

impl Figures {
    /// `marconi − lru`.
    pub fn vs_lru(&self) -> f64 {
        self.marconi - self.lru
    }

    /// Which of the three checks `marconi` fails at `capacity_bytes`: below `lru` by more than
    /// [`LRU_TOLERANCE`], below SGLang+ by more than that (when it kept to the budget), below
    /// the paper's Marconi by more than [`PAPER_MARCONI_TOLERANCE`] (when it kept to the
    /// budget). Without paper figures only the first can fail.
    pub fn failed_checks(&self, capacity_bytes: u64) -> [bool; 3] {
        let below = |reference: f64, tolerance: f64| self.marconi - reference < -tolerance;
        let paper = |check: &dyn Fn(&PaperFigures) -> bool| self.paper.as_ref().is_some_and(check);
        [
            below(self.lru, LRU_TOLERANCE),
            paper(&|p| {
                within_overshoot(p.sglang_max_bytes, capacity_bytes)
                    && below(p.sglang, LRU_TOLERANCE)
            }),
            paper(&|p| {
                within_overshoot(p.marconi_max_bytes, capacity_bytes)
                    && below(p.marconi, PAPER_MARCONI_TOLERANCE)
            }),
        ]
    }
}

impl From<&CellFigures> for Figures {
    fn from(f: &CellFigures) -> Figures {
        let r: &References = &f.references;
        Figures {
            lru: r.lru,
            marconi: f.marconi,
            paper: Some(PaperFigures {
                sglang: r.paper_sglang,
                marconi: r.paper_marconi,
                sglang_max_bytes: r.paper_sglang_max_bytes,
                marconi_max_bytes: r.paper_marconi_max_bytes,
            }),
        }
    }
}

/// How many cells fail their check, and how many fail each of its three parts (below `lru`,
/// SGLang+, the paper's Marconi), and the mean of `marconi − lru`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tally {
    /// Cells counted.
    pub cells: usize,
    /// Cells failing any check.
    pub failing: usize,
    /// Cells failing each check: below `lru`, below SGLang+, below the paper's Marconi.
    pub below: [usize; 3],
    /// The mean of `marconi − lru`.
    pub mean_vs_lru: f64,
}

impl Tally {
    /// The tally of two sets of cells together (the mean weighted by their cells).
    pub fn plus(&self, other: &Tally) -> Tally {
        let cells = self.cells + other.cells;
        let sum = self.mean_vs_lru * self.cells as f64 + other.mean_vs_lru * other.cells as f64;
        Tally {
            cells,
            failing: self.failing + other.failing,
            below: [0, 1, 2].map(|i| self.below[i] + other.below[i]),
            mean_vs_lru: sum / cells.max(1) as f64,
        }
    }

    /// The tally of `cells`, each `(figures, capacity)`.
    pub fn of(cells: impl Iterator<Item = (Figures, u64)>) -> Tally {
        let mut tally = Tally {
            cells: 0,
            failing: 0,
            below: [0; 3],
            mean_vs_lru: 0.0,
        };
        let mut sum = 0.0;
        for (figures, capacity) in cells {
            let failed = figures.failed_checks(capacity);
            tally.cells += 1;
            tally.failing += usize::from(failed.contains(&true));
            for (count, failed) in tally.below.iter_mut().zip(failed) {
                *count += usize::from(failed);
            }
            sum += figures.vs_lru();
        }
        tally.mean_vs_lru = sum / tally.cells.max(1) as f64;
        tally
    }
}

/// A paired change: the mean of per-cell differences and its standard error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    /// Cells paired.
    pub cells: usize,
    /// The mean difference (second − first).
    pub mean: f64,
    /// Its standard error (sample standard deviation / √cells); `None` below two cells.
    pub standard_error: Option<f64>,
}

impl Paired {
    /// The paired change of `differences`.
    pub fn of(differences: &[f64]) -> Paired {
        let n = differences.len();
        let mean = differences.iter().sum::<f64>() / n.max(1) as f64;
        let standard_error = (n >= 2).then(|| {
            let squares: f64 = differences.iter().map(|d| (d - mean).powi(2)).sum();
            (squares / (n - 1) as f64).sqrt() / (n as f64).sqrt()
        });
        Paired {
            cells: n,
            mean,
            standard_error,
        }
    }
}

/// A cell whose `marconi` moved between the reports, or whose check on its copies' mean
/// changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Moved {
    /// The cell (the first report's record).
    pub cell: CellRecord,
    /// Its figures in the second report.
    pub second: Figures,
    /// Its copies' mean in the second report.
    pub second_copies: Option<Figures>,
}

/// What two reports of the same cells say about the change between them.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Cells in both reports.
    pub matched: usize,
    /// Cells of the first report only (keys).
    pub only_first: Vec<String>,
    /// Cells of the second report only (keys).
    pub only_second: Vec<String>,
    /// Matched cells whose `lru` figure differs between the reports (the store itself changed).
    pub lru_differs: usize,
    /// The first report's matched cells on their traces.
    pub first: Tally,
    /// The second report's.
    pub second: Tally,
    /// On the copies' mean (when both reports have copies for every matched cell).
    pub copies: Option<(Tally, Tally)>,
    /// The paired change of `marconi − lru` on the traces.
    pub paired: Paired,
    /// The paired change of `marconi − lru` on the copies' mean.
    pub paired_copies: Option<Paired>,
    /// The matched cells whose `marconi` moved or whose checks (on the trace or the copies'
    /// mean) changed, in the first report's order.
    pub moved: Vec<Moved>,
}

/// Compares two reports cell by cell (matched by [`CellRecord::key`]). Refuses reports of
/// different kinds, models, pin scopes or jitter (their cells are not the same cells), and a
/// report that names a cell twice.
pub fn compare(first: &Report, second: &Report) -> Result<Comparison, SnapshotError> {
    let differ = |what: &str, a: String, b: String| {
        SnapshotError::BadArgument(format!(
            "the reports differ in {what} ({a} vs {b}): their cells are not the same cells"
        ))
    };
    if first.kind != second.kind {
        return Err(differ(
            "kind",
            format!("{:?}", first.kind),
            format!("{:?}", second.kind),
        ));
    }
    if first.model != second.model {
        return Err(differ("model", first.model.clone(), second.model.clone()));
    }
    if first.pin_scope != second.pin_scope {
        return Err(differ(
            "pin scope",
            first.pin_scope.clone(),
            second.pin_scope.clone(),
        ));
    }
    if (first.jitter, first.jitter_rate.to_bits()) != (second.jitter, second.jitter_rate.to_bits())
    {
        return Err(differ(
            "jittered copies",
            format!("{} at {}", first.jitter, first.jitter_rate),
            format!("{} at {}", second.jitter, second.jitter_rate),
        ));
    }
    let by_key = |report: &Report, which: &str| {
        let mut map = HashMap::new();
        for (i, cell) in report.cells.iter().enumerate() {
            if map.insert(cell.key(), i).is_some() {
                return Err(SnapshotError::BadArgument(format!(
                    "the {which} report has cell {} twice",
                    cell.key()
                )));
            }
        }
        Ok(map)
    };
    let second_index = by_key(second, "second")?;
    let first_index = by_key(first, "first")?;
    let pairs: Vec<(&CellRecord, &CellRecord)> = first
        .cells
        .iter()
        .filter_map(|a| second_index.get(&a.key()).map(|&j| (a, &second.cells[j])))
        .collect();
    let only = |report: &Report, other: &HashMap<String, usize>| -> Vec<String> {
        report
            .cells
            .iter()
            .map(CellRecord::key)
            .filter(|k| !other.contains_key(k))
            .collect()
    };
    let firsts = || pairs.iter().map(|(a, _)| *a);
    let seconds = || pairs.iter().map(|(_, b)| *b);
    let on_trace = |c: &CellRecord| Some((c.figures, c.capacity_bytes));
    let on_copies = |c: &CellRecord| c.copies.map(|f| (f, c.capacity_bytes));
    let first_tally = Tally::of(firsts().filter_map(on_trace));
    let second_tally = Tally::of(seconds().filter_map(on_trace));
    let with_copies = !pairs.is_empty()
        && pairs
            .iter()
            .all(|(a, b)| a.copies.is_some() && b.copies.is_some());
    let copies = with_copies.then(|| {
        (
            Tally::of(firsts().filter_map(on_copies)),
            Tally::of(seconds().filter_map(on_copies)),
        )
    });
    let differences = |pick: &dyn Fn(&CellRecord) -> Option<Figures>| -> Vec<f64> {
        pairs
            .iter()
            .filter_map(|(a, b)| Some(pick(b)?.vs_lru() - pick(a)?.vs_lru()))
            .collect()
    };
    let paired = Paired::of(&differences(&|c| Some(c.figures)));
    let paired_copies = with_copies.then(|| Paired::of(&differences(&|c| c.copies)));
    let checks_of =
        |figures: Option<&Figures>, capacity| figures.map(|f| f.failed_checks(capacity));
    let moved = pairs
        .iter()
        .filter(|(a, b)| {
            a.figures.marconi.to_bits() != b.figures.marconi.to_bits()
                || checks_of(a.copies.as_ref(), a.capacity_bytes)
                    != checks_of(b.copies.as_ref(), b.capacity_bytes)
        })
        .map(|(a, b)| Moved {
            cell: (*a).clone(),
            second: b.figures,
            second_copies: b.copies,
        })
        .collect();
    Ok(Comparison {
        matched: pairs.len(),
        only_first: only(first, &second_index),
        only_second: only(second, &first_index),
        lru_differs: pairs
            .iter()
            .filter(|(a, b)| a.figures.lru.to_bits() != b.figures.lru.to_bits())
            .count(),
        first: first_tally,
        second: second_tally,
        copies,
        paired,
        paired_copies,
        moved,
    })
}

/// Several comparisons summed (a keep rule judged over several held-out sets): the first
/// reports' tally and the second reports', on the traces and, over the comparisons that have
/// copies, on the copies' mean (with how many comparisons had them).
pub fn summed(comparisons: &[Comparison]) -> (Tally, Tally, Option<(usize, Tally, Tally)>) {
    let zero = Tally::of(std::iter::empty());
    let mut sums = (zero, zero, None::<(usize, Tally, Tally)>);
    for c in comparisons {
        sums.0 = sums.0.plus(&c.first);
        sums.1 = sums.1.plus(&c.second);
        if let Some((a, b)) = &c.copies {
            let (n, sa, sb) = sums.2.unwrap_or((0, zero, zero));
            sums.2 = Some((n + 1, sa.plus(a), sb.plus(b)));
        }
    }
    sums
}

/// The lines of [`summed`] for `comparisons`, in the form of [`Comparison::lines`]'s table.
pub fn summed_lines(comparisons: &[Comparison]) -> Vec<String> {
    let (first, second, copies) = summed(comparisons);
    let mut lines = vec![
        format!(
            "summed over {} comparisons ({} cells):",
            comparisons.len(),
            first.cells
        ),
        String::new(),
    ];
    let copies = copies.map(|(n, a, b)| {
        let label = format!("on the copies' mean ({n} comparisons, {} cells)", a.cells);
        (label, a, b)
    });
    lines.extend(tally_table(&first, &second, copies.as_ref()));
    lines
}

/// The two sides' tallies as a markdown table: failing cells (below lru / SGLang+ / paper
/// Marconi) and mean `marconi − lru`, on the traces and, when given, on the copies' mean under
/// its label.
fn tally_table(
    first: &Tally,
    second: &Tally,
    copies: Option<&(String, Tally, Tally)>,
) -> Vec<String> {
    let rows = |label: &str, a: &Tally, b: &Tally| {
        let failing = |t: &Tally| {
            format!(
                "{} ({} / {} / {})",
                t.failing, t.below[0], t.below[1], t.below[2]
            )
        };
        [
            format!(
                "| {label}failing (below lru / SGLang+ / paper Marconi) | {} | {} |",
                failing(a),
                failing(b)
            ),
            format!(
                "| {label}mean marconi − lru | {:+.4} | {:+.4} |",
                a.mean_vs_lru, b.mean_vs_lru
            ),
        ]
    };
    let mut lines = vec![
        "| | first | second |".to_string(),
        "|---|---|---|".to_string(),
    ];
    lines.extend(rows("", first, second));
    if let Some((label, a, b)) = copies {
        lines.extend(rows(&format!("{label}: "), a, b));
    }
    lines
}

impl Comparison {
    /// The comparison as markdown lines: the two reports' tallies side by side, the paired
    /// changes, and a row per moved cell.
    pub fn lines(&self) -> Vec<String> {
        let paired = |p: &Paired| match p.standard_error {
            Some(se) => format!("{:+.5} (se {se:.5})", p.mean),
            None => format!("{:+.5}", p.mean),
        };
        let mut lines = vec![format!(
            "{} cells in both reports ({} only in the first, {} only in the second; lru differs on {})",
            self.matched,
            self.only_first.len(),
            self.only_second.len(),
            self.lru_differs
        )];
        lines.push(String::new());
        let copies = self
            .copies
            .map(|(a, b)| ("on the copies' mean".to_string(), a, b));
        lines.extend(tally_table(&self.first, &self.second, copies.as_ref()));
        lines.push(String::new());
        lines.push(format!(
            "paired change of marconi − lru (second − first): {} over {} cells",
            paired(&self.paired),
            self.paired.cells
        ));
        if let Some(p) = &self.paired_copies {
            lines.push(format!(
                "on the copies' mean: {} over {} cells",
                paired(p),
                p.cells
            ));
        }
        if self.moved.is_empty() {
            return lines;
        }
        let fails = |checks: [bool; 3]| -> String {
            let names = ["lru", "SGLang+", "paper Marconi"];
            let failed: Vec<&str> = names
                .iter()
                .zip(checks)
                .filter(|(_, f)| *f)
                .map(|(n, _)| *n)
                .collect();
            if failed.is_empty() {
                String::new()
            } else {
                format!(" (below {})", failed.join(", "))
            }
        };
        let copies = |c: Option<&Figures>, capacity| {
            c.map_or(String::new(), |c| {
                format!(" | {:+.4}{}", c.vs_lru(), fails(c.failed_checks(capacity)))
            })
        };
        lines.push(String::new());
        let copies_head = if self.copies.is_some() {
            " | copies − lru: first | second"
        } else {
            ""
        };
        lines.push(format!(
            "| moved cell | lru | marconi: first | second | − lru: first | second{copies_head} |"
        ));
        lines.push(format!(
            "|---|---|---|---|---|---|{}",
            if self.copies.is_some() {
                "---|---|"
            } else {
                ""
            }
        ));
        for m in &self.moved {
            let c = &m.cell;
            let cap = c.capacity_bytes;
            lines.push(format!(
                "| {} | {:.4} | {:.4} | {:.4} | {:+.4}{} | {:+.4}{}{}{} |",
                c.name(),
                c.figures.lru,
                c.figures.marconi,
                m.second.marconi,
                c.figures.vs_lru(),
                fails(c.figures.failed_checks(cap)),
                m.second.vs_lru(),
                fails(m.second.failed_checks(cap)),
                copies(c.copies.as_ref(), cap),
                copies(m.second_copies.as_ref(), cap),
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(
        family: &str,
        seed: u64,
        lru: f64,
        marconi: f64,
        copies: Option<(f64, f64)>,
    ) -> CellRecord {
        CellRecord {
            family: family.into(),
            sessions: 20,
            seed,
            capacity_bytes: 1_000_000_000,
            block_size: 16,
            requests: 100,
            figures: Figures {
                lru,
                marconi,
                paper: None,
            },
            copies: copies.map(|(lru, marconi)| Figures {
                lru,
                marconi,
                paper: None,
            }),
            switches: Some(vec![(60, "1/adaptive/marginal/guard".into())]),
        }
    }

    fn report(cells: Vec<CellRecord>) -> Report {
        Report {
            kind: ReportKind::Scan,
            model: "nvidia-hybrid-7b".into(),
            pin_scope: "path".into(),
            jitter: 8,
            jitter_rate: 0.02,
            cells,
        }
    }

    #[test]
    fn a_grid_cell_fails_the_checks_of_the_paper_policies_that_kept_to_the_budget() {
        let capacity = 1_000;
        let figures = |sglang_peak| Figures {
            lru: 0.5,
            marconi: 0.499,
            paper: Some(PaperFigures {
                sglang: 0.51,
                marconi: 0.515,
                sglang_max_bytes: sglang_peak,
                marconi_max_bytes: 1_500,
            }),
        };
        // 0.001 below lru: within the tolerance; 0.011 below SGLang+ (kept to 1.2x): fails;
        // 0.016 below the paper's Marconi (1.5x: still a reference): fails.
        assert_eq!(figures(1_200).failed_checks(capacity), [false, true, true]);
        // SGLang+ held 1.6x its budget: not a reference.
        assert_eq!(figures(1_600).failed_checks(capacity), [false, false, true]);
        let scan = Figures {
            lru: 0.5,
            marconi: 0.4975,
            paper: None,
        };
        assert_eq!(scan.failed_checks(capacity), [true, false, false]);
    }

    #[test]
    fn two_reports_compare_by_cell_with_exact_counts_and_paired_changes() {
        let first = report(vec![
            cell("chat", 1, 0.25, 0.25, Some((0.25, 0.25))),
            cell("chat", 2, 0.5, 0.4375, Some((0.5, 0.46875))),
            cell("mix", 1, 0.5, 0.5, Some((0.5, 0.5))),
            cell("mix", 2, 0.125, 0.125, Some((0.125, 0.125))),
        ]);
        let second = report(vec![
            // Reordered, one cell gone, one new.
            cell("mix", 1, 0.5, 0.5, Some((0.5, 0.5))),
            cell("chat", 2, 0.5, 0.5, Some((0.5, 0.4375))),
            cell("chat", 1, 0.25, 0.3125, Some((0.25, 0.25))),
            cell("agentic", 1, 0.5, 0.5, Some((0.5, 0.5))),
        ]);
        let c = compare(&first, &second).unwrap();
        assert_eq!(c.matched, 3);
        assert_eq!(c.only_first, vec!["mix/20/2/1000000000/16".to_string()]);
        assert_eq!(
            c.only_second,
            vec!["agentic/20/1/1000000000/16".to_string()]
        );
        assert_eq!(c.lru_differs, 0);
        assert_eq!(
            c.first,
            Tally {
                cells: 3,
                failing: 1,
                below: [1, 0, 0],
                mean_vs_lru: -0.0625 / 3.0
            }
        );
        assert_eq!(
            c.second,
            Tally {
                cells: 3,
                failing: 0,
                below: [0, 0, 0],
                mean_vs_lru: 0.0625 / 3.0
            }
        );
        let (a, b) = c.copies.unwrap();
        assert_eq!((a.failing, b.failing), (1, 1));
        // Differences on the traces: +0.0625, +0.0625, 0 (in the first report's order).
        assert_eq!(c.paired.cells, 3);
        assert_eq!(c.paired.mean, 0.125 / 3.0);
        let se = ((2.0 * (0.0625f64 - 0.125 / 3.0).powi(2) + (0.125f64 / 3.0).powi(2)) / 2.0)
            .sqrt()
            / 3f64.sqrt();
        assert_eq!(c.paired.standard_error, Some(se));
        // On the copies: 0, −0.03125, 0.
        let copies = c.paired_copies.unwrap();
        assert_eq!(copies.mean, -0.03125 / 3.0);
        // chat 1 and chat 2 moved on their traces; mix 1 did not.
        let moved: Vec<String> = c.moved.iter().map(|m| m.cell.key()).collect();
        assert_eq!(
            moved,
            vec!["chat/20/1/1000000000/16", "chat/20/2/1000000000/16"]
        );
        let lines = c.lines();
        assert!(lines.contains(&"| failing (below lru / SGLang+ / paper Marconi) | 1 (1 / 0 / 0) | 0 (0 / 0 / 0) |".to_string()), "{lines:#?}");
        assert!(lines.contains(&"| chat 20/2 1 GB | 0.5000 | 0.4375 | 0.5000 | -0.0625 (below lru) | +0.0000 | -0.0312 (below lru) | -0.0625 (below lru) |".to_string()), "{lines:#?}");
    }

    #[test]
    fn comparisons_sum_their_counts_and_weight_their_means_by_cells() {
        let with_copies = compare(
            &report(vec![
                cell("chat", 1, 0.5, 0.25, Some((0.5, 0.25))),
                cell("chat", 2, 0.5, 0.5, Some((0.5, 0.5))),
            ]),
            &report(vec![
                cell("chat", 1, 0.5, 0.5, Some((0.5, 0.5))),
                cell("chat", 2, 0.5, 0.5, Some((0.5, 0.5))),
            ]),
        )
        .unwrap();
        let mut one = report(vec![cell("mix", 1, 0.5, 0.375, None)]);
        one.jitter = 0;
        let without = compare(&one, &one).unwrap();
        let (first, second, copies) = summed(&[with_copies, without]);
        assert_eq!(
            first,
            Tally {
                cells: 3,
                failing: 2,
                below: [2, 0, 0],
                mean_vs_lru: -0.125
            }
        );
        assert_eq!(
            second,
            Tally {
                cells: 3,
                failing: 1,
                below: [1, 0, 0],
                mean_vs_lru: -0.125 / 3.0
            }
        );
        let (n, a, b) = copies.unwrap();
        assert_eq!((n, a.cells, a.failing, b.failing), (1, 2, 1, 0));
        assert_eq!(summed(&[]).0.cells, 0);
    }

    #[test]
    fn a_cell_whose_copies_cross_the_check_is_listed_though_its_trace_did_not_move() {
        let first = report(vec![cell("chat", 1, 0.5, 0.5, Some((0.5, 0.499)))]);
        let second = report(vec![cell("chat", 1, 0.5, 0.5, Some((0.5, 0.49)))]);
        let c = compare(&first, &second).unwrap();
        assert_eq!(c.moved.len(), 1);
        assert_eq!(c.paired.mean, 0.0);
        assert_eq!(c.paired_copies.unwrap().standard_error, None);
    }

    #[test]
    fn reports_of_other_cells_or_with_a_cell_twice_are_refused() {
        let one = report(vec![cell("chat", 1, 0.5, 0.5, None)]);
        let mut other_model = one.clone();
        other_model.model = "nemotron-h-8b".into();
        let e = compare(&one, &other_model).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad argument: the reports differ in model (nvidia-hybrid-7b vs nemotron-h-8b): their cells are not the same cells"
        );
        let mut fewer_copies = one.clone();
        fewer_copies.jitter = 4;
        assert!(compare(&one, &fewer_copies).is_err());
        let twice = report(vec![
            cell("chat", 1, 0.5, 0.5, None),
            cell("chat", 1, 0.5, 0.25, None),
        ]);
        let e = compare(&one, &twice).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad argument: the second report has cell chat/20/1/1000000000/16 twice"
        );
    }

    #[test]
    fn a_report_reads_back_from_its_file_exactly() {
        let dir = std::env::temp_dir().join(format!("ssm-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("report.json");
        let mut written = report(vec![
            cell(
                "chat",
                1,
                4_702_863.0 / 4_955_381.0,
                1.0 / 3.0,
                Some((0.1, 0.7)),
            ),
            cell("mix", 2, 2.0 / 7.0, 0.5, None),
        ]);
        written.cells[1].figures.paper = Some(PaperFigures {
            sglang: 987_654_321.0 / 1_234_567_891.0,
            marconi: 0.3,
            sglang_max_bytes: 1_700_000_000,
            marconi_max_bytes: 900_000_000,
        });
        written.cells[1].switches = None;
        written.write(&path).unwrap();
        assert_eq!(Report::read(&path).unwrap(), written);
        std::fs::write(&path, "{").unwrap();
        let e = Report::read(&path).unwrap_err();
        assert!(matches!(e, SnapshotError::Io { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
