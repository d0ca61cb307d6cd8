//! What the replay prints and writes as JSON: what was configured ([`Setup`]), each pass's
//! [`ReplayReport`], and with `--verify` the comparison of the two passes ([`Verdict`]).

use serde::Serialize;

use scheduler::backend::{self, BackendOptions, ModelConfig};
use scheduler::replay::{CacheStats, Replay, ReplayReport, TurnOutcome};
use scheduler::workload::Workload;
use scheduler::{EngineConfig, Preemption, SpillTarget};

use crate::Plan;

/// What was configured, as the report's first lines and the JSON's `setup`.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// The router (`cpu`: the host router), and whether it is traced.
    pub router: String,
    /// Where the model came from.
    pub model: String,
    /// The model's layer pattern (`M` Mamba2, `*` attention, `-` MLP, `E` MoE).
    pub pattern: String,
    /// The model's width.
    pub hidden_size: usize,
    /// The model's vocabulary.
    pub vocab_size: usize,
    /// KV blocks in the pool.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of the KV pool (all attention layers, f32).
    pub kv_bytes: u64,
    /// The longest sequence the router accepts (the workload's longest turn, in whole blocks).
    pub max_context: usize,
    /// Turns in flight at once (also the router's live slots).
    pub max_in_flight: usize,
    /// The prefix cache is on (the first pass of `--verify`).
    pub prefix_cache: bool,
    /// How SSM checkpoints are evicted: `marconi` (FLOP-aware, tuned), `lru`, or `none` when the
    /// model has no Mamba layers or the prefix cache is off.
    pub ssm_checkpoint_eviction: String,
    /// SSM checkpoint slots of the prefix cache (hybrid models).
    pub checkpoint_slots: usize,
    /// Bytes of one SSM state slot (live, checkpoint or snapshot).
    pub state_slot_bytes: u64,
    /// Pipelining depth: steps in flight (1: each step is read before the next is launched).
    pub depth: usize,
    /// Threads of the model's forward pass.
    pub threads: usize,
    /// How preempted turns come back (`recompute`, or `spill (to a fresh directory under DIR)`).
    pub preemption: String,
    /// Token ids at or above the vocabulary were folded into it (`--fold-token-ids`).
    pub fold_token_ids: bool,
    /// The LoRA adapters (`--adapter`), loaded under ids 1, 2, ... in this order; sessions take
    /// them round-robin.
    pub adapters: Vec<String>,
}

impl Setup {
    /// The facts of a pass about to be built.
    pub fn new(
        plan: &Plan,
        model: &ModelConfig,
        options: &BackendOptions,
        config: &EngineConfig,
    ) -> Setup {
        let args = &plan.args;
        let hybrid = model.has(backend::LayerKind::Mamba);
        let prefix_cache = options.prefix_cache && backend::PREFIX_CACHE_COMPILED;
        let marconi = options.marconi && backend::MARCONI_COMPILED;
        let eviction = match (hybrid, prefix_cache, marconi) {
            (false, _, _) => "none (no Mamba layers: hash-chain prefix cache)",
            (true, false, _) => "none (prefix cache off)",
            (true, true, true) => "marconi (FLOP-aware, tuned by shadow stores)",
            (true, true, false) => "lru (SGLang's path recency)",
        };
        let traced = if cfg!(feature = "trace") {
            match &args.trace {
                Some(path) => format!(", traced to {}", path.display()),
                None => ", traced to tracing events".to_string(),
            }
        } else {
            String::new()
        };
        let router = match options.device {
            backend::Device::Cpu => "cpu (host router)".to_string(),
            #[cfg(feature = "cuda")]
            backend::Device::CudaSim => "cuda-sim (the CUDA router on SimRuntime)".to_string(),
            #[allow(unreachable_patterns)] // `Device::Cuda` exists only with the `cuda` feature.
            _ => "cuda".to_string(),
        } + &traced;
        let preemption = match &config.preemption {
            Preemption::Recompute => "recompute".to_string(),
            Preemption::Spill(SpillTarget::Directory(dir)) => {
                format!("spill (to a fresh directory under {})", dir.display())
            }
            #[allow(unreachable_patterns)] // other spill targets, should the engine add them.
            Preemption::Spill(_) => "spill".to_string(),
        };
        let kv_block_bytes = backend::kv_block_bytes(model, options.block_size);
        Setup {
            router,
            model: match &args.model {
                Some(dir) => dir.display().to_string(),
                None => format!(
                    "embedded {} (seeded random weights, seed {})",
                    args.embedded.name(),
                    args.seed
                ),
            },
            pattern: model.pattern(),
            hidden_size: model.hidden_size,
            vocab_size: model.vocab_size,
            kv_blocks: options.kv_blocks,
            block_size: options.block_size,
            kv_bytes: kv_block_bytes.saturating_mul(options.kv_blocks as u64),
            // The replay always sets it (see `main`); the pool's size is the router's default.
            max_context: options
                .max_context
                .unwrap_or(options.kv_blocks * options.block_size),
            max_in_flight: options.max_seqs,
            prefix_cache,
            ssm_checkpoint_eviction: eviction.to_string(),
            checkpoint_slots: if hybrid && prefix_cache {
                options.checkpoint_slots
            } else {
                0
            },
            state_slot_bytes: backend::state_slot_bytes(model),
            depth: options.max_depth,
            threads: options.threads,
            preemption,
            fold_token_ids: args.fold_token_ids,
            adapters: args
                .adapters
                .iter()
                .map(|dir| dir.display().to_string())
                .collect(),
        }
    }

    /// Prints the configuration lines.
    pub fn print(&self) {
        println!("== setup ==");
        println!("router              {}", self.router);
        println!(
            "model               {} (pattern {}, hidden {}, vocab {})",
            self.model, self.pattern, self.hidden_size, self.vocab_size
        );
        println!(
            "KV pool             {} blocks of {} tokens, {} (max context {} tokens)",
            self.kv_blocks,
            self.block_size,
            bytes(self.kv_bytes),
            self.max_context
        );
        println!(
            "in flight           at most {} turns; pipelining depth {}; preemption by {}",
            self.max_in_flight, self.depth, self.preemption
        );
        println!("compute threads     {}", self.threads);
        println!(
            "prefix cache        {}; SSM checkpoint eviction: {}; {} checkpoint slots of {}",
            if self.prefix_cache { "on" } else { "off" },
            self.ssm_checkpoint_eviction,
            self.checkpoint_slots,
            bytes(self.state_slot_bytes)
        );
        if !self.adapters.is_empty() {
            println!(
                "LoRA adapters       {} (sessions take them round-robin)",
                self.adapters.len()
            );
        }
    }
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub fn bytes(count: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if count < 1024 {
        return format!("{count} B");
    }
    let mut value = count as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Prints one pass's report; `adapters` are the `--adapter` folders (id `i + 1` is `adapters[i]`).
pub fn print(title: &str, report: &ReplayReport, adapters: &[std::path::PathBuf]) {
    println!("== {title}: workload {} ==", report.workload);
    let skipped = if report.skipped > 0 {
        " (no recorded output to force)"
    } else {
        ""
    };
    println!(
        "requests            {} ({} completed, {} failed, {} skipped{skipped})",
        report.requests, report.completed, report.failed, report.skipped
    );
    println!(
        "tokens              {} input, {} output",
        report.input_tokens, report.output_tokens
    );
    println!(
        "prefill             {} computed, {} from cache (token hit rate {:.1}%)",
        report.prefill_tokens_computed,
        report.prefill_tokens_cached,
        100.0 * report.token_hit_rate
    );
    println!(
        "cache hits          {} requests served partly from cache (each restored a Marconi checkpoint on a hybrid model); {} MarconiCheckpoint effects after decode",
        report.prefix_hits, report.marconi_checkpoint_effects
    );
    if let Some(cache) = &report.cache {
        println!(
            "router cache        {} lookups, {} hit tokens",
            cache.lookups, cache.hit_tokens
        );
        match cache.marconi_alpha {
            Some(_) => println!(
                "SSM checkpoints     {} taken, {} hit, {} evicted, {} held at the end",
                cache.checkpoints_taken,
                cache.checkpoint_hits,
                cache.checkpoints_evicted,
                cache.checkpoints_held
            ),
            None => println!("SSM checkpoints     none (no Marconi store in this pass)"),
        }
        if let Some(line) = eviction_line(cache) {
            println!("eviction            {line}");
        }
        if let Some(line) = head_line(cache) {
            println!("MTP head at hits    {line}");
        }
    }
    println!(
        "TTFT                p50 {:.1} ms, p95 {:.1} ms",
        report.ttft_p50_ms, report.ttft_p95_ms
    );
    println!(
        "TPOT                p50 {:.2} ms, p95 {:.2} ms",
        report.tpot_p50_ms, report.tpot_p95_ms
    );
    println!(
        "throughput          {:.0} output tok/s, {:.0} total tok/s over {:.1} s ({} steps, mean decode batch {:.1})",
        report.output_tokens_per_s,
        report.total_tokens_per_s,
        report.wall_s,
        report.steps,
        report.mean_decode_batch
    );
    println!(
        "preemption          {} preemptions ({} spills, {} restores, {} recomputes)",
        report.preemptions, report.spills, report.restores, report.recomputes
    );
    if report.verify_steps > 0 {
        println!(
            "speculation         {} verification steps; {} drafts, {} accepted (acceptance {:.1}%); mean accepted length {:.2}; {:.2} tokens per target step",
            report.verify_steps,
            report.drafted,
            report.accepted,
            100.0 * report.acceptance_rate,
            report.mean_accepted_length,
            report.tokens_per_target_step
        );
        if report.draft_steps > 0 || report.draft_failures > 0 {
            println!(
                "MTP drafting        {} draft steps ({} refused); {} rows drafted nothing though they had a budget",
                report.draft_steps, report.draft_failures, report.draft_misses
            );
        }
    }
    if report.fed_steps > 0 || report.pipeline_drains > 0 {
        println!(
            "pipelining          {} steps launched ahead, {} drains, {} over-runs rolled back",
            report.fed_steps, report.pipeline_drains, report.rollbacks
        );
    }
    for hits in &report.adapters {
        let dir = usize::try_from(hits.adapter)
            .ok()
            .and_then(|id| adapters.get(id.wrapping_sub(1)))
            .map_or_else(String::new, |dir| format!(" {}", dir.display()));
        println!(
            "adapter {}{dir}   {} sessions, {} turns, {} of {} prompt tokens from cache (token hit rate {:.1}%)",
            hits.adapter,
            hits.sessions,
            hits.completed,
            hits.cached_tokens,
            hits.prompt_tokens,
            100.0 * hits.token_hit_rate
        );
    }
}

/// How the Marconi store evicted, and what its tuner did (`None` without a Marconi store).
pub fn eviction_line(cache: &CacheStats) -> Option<String> {
    let alpha = cache.marconi_alpha?;
    let setting = format!(
        "alpha {alpha:.2}, {} recency, {} FLOPs, guarded admission {}",
        cache.marconi_recency.unwrap_or("?"),
        cache.marconi_flop_basis.unwrap_or("?"),
        if cache.marconi_guard == Some(true) {
            "on"
        } else {
            "off"
        }
    );
    Some(match cache.tuner_switches {
        Some(switches) => format!(
            "Marconi, tuned: {switches} setting change(s) during the pass; at the end {setting}"
        ),
        None => format!("by recency, no tuner (--no-marconi): {setting}"),
    })
}

/// What the checkpoint hits made of the MTP head (`None` when the router counted none: no head,
/// or no rerun at a hit).
pub fn head_line(cache: &CacheStats) -> Option<String> {
    let (exact, unvouched, unmarked, skipped) = (
        cache.head_exact_hits,
        cache.head_unvouched_hits,
        cache.head_unmarked_hits,
        cache.head_skipped_hits,
    );
    (exact + unvouched + unmarked + skipped > 0).then(|| {
        format!(
            "{exact} hits left a cold run's head; not so after {unvouched} on blocks whose head \
             K/V another path wrote, {unmarked} on unmarked checkpoints and {skipped} without \
             the rerun the pool had no room for"
        )
    })
}

/// One turn whose digests differ between the passes.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    /// The turn's session (dense index).
    pub session: u64,
    /// The turn's number within the session.
    pub turn: u64,
    /// Its digest in the first pass, and how it ended.
    pub first: (Option<u64>, &'static str),
    /// Its digest in the second pass, and how it ended.
    pub second: (Option<u64>, &'static str),
}

/// `--verify`'s comparison of two passes (caches on and off, or depth 1 and 2).
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// What the two passes were (`caches on vs off at depth 1`).
    pub passes: String,
    /// Every digest matched and no turn failed in either pass.
    pub verified: bool,
    /// Turns with identical digests.
    pub identical: usize,
    /// Turns without a digest in both passes because both skipped them.
    pub skipped: usize,
    /// Turns whose digests differ (or that ended differently).
    pub mismatched: usize,
    /// The first ten mismatched turns.
    pub first_mismatches: Vec<Mismatch>,
}

fn outcome_word(outcome: &TurnOutcome) -> &'static str {
    match outcome {
        TurnOutcome::Done { .. } => "done",
        TurnOutcome::Failed(_) => "failed",
        TurnOutcome::Skipped => "skipped",
    }
}

impl Verdict {
    /// Compares every turn's digest between two passes (`passes` names them).
    pub fn compare(workload: &Workload, passes: String, on: &Replay, off: &Replay) -> Verdict {
        let mut verdict = Verdict {
            passes,
            verified: false,
            identical: 0,
            skipped: 0,
            mismatched: 0,
            first_mismatches: Vec::new(),
        };
        for (index, (a, b)) in on.digests().iter().zip(off.digests()).enumerate() {
            let (on_outcome, off_outcome) = (&on.outcomes[index], &off.outcomes[index]);
            match (a, b) {
                (Some(a), Some(b)) if *a == b => verdict.identical += 1,
                (None, None)
                    if matches!(on_outcome, TurnOutcome::Skipped)
                        && matches!(off_outcome, TurnOutcome::Skipped) =>
                {
                    verdict.skipped += 1
                }
                _ => {
                    verdict.mismatched += 1;
                    if verdict.first_mismatches.len() < 10 {
                        let turn = &workload.turns[index];
                        verdict.first_mismatches.push(Mismatch {
                            session: turn.session,
                            turn: turn.turn,
                            first: (*a, outcome_word(on_outcome)),
                            second: (b, outcome_word(off_outcome)),
                        });
                    }
                }
            }
        }
        verdict.verified =
            verdict.mismatched == 0 && on.report.failed == 0 && off.report.failed == 0;
        verdict
    }

    /// Prints the mismatches and the verdict line.
    pub fn print(&self) {
        for m in &self.first_mismatches {
            println!(
                "MISMATCH ({}) session {} turn {}: {:?} ({}) vs {:?} ({})",
                self.passes, m.session, m.turn, m.first.0, m.first.1, m.second.0, m.second.1
            );
        }
        println!(
            "verify ({}): {} turns with identical logits digests, {} mismatched: {}",
            self.passes,
            self.identical,
            self.mismatched,
            if self.verified { "OK" } else { "FAILED" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eviction_line_says_whether_the_tuner_ran() {
        let marconi = CacheStats {
            marconi_alpha: Some(0.5),
            marconi_recency: Some("adaptive"),
            marconi_flop_basis: Some("marginal"),
            marconi_guard: Some(true),
            tuner_switches: Some(2),
            ..CacheStats::default()
        };
        assert_eq!(
            eviction_line(&marconi).unwrap(),
            "Marconi, tuned: 2 setting change(s) during the pass; at the end alpha 0.50, \
             adaptive recency, marginal FLOPs, guarded admission on"
        );
        let lru = CacheStats {
            marconi_alpha: Some(0.0),
            marconi_recency: Some("path"),
            marconi_flop_basis: Some("marginal"),
            marconi_guard: Some(false),
            tuner_switches: None,
            ..CacheStats::default()
        };
        assert_eq!(
            eviction_line(&lru).unwrap(),
            "by recency, no tuner (--no-marconi): alpha 0.00, path recency, marginal FLOPs, \
             guarded admission off"
        );
        assert_eq!(eviction_line(&CacheStats::default()), None);
    }

    #[test]
    fn the_head_line_counts_each_kind_of_hit() {
        let counted = CacheStats {
            head_exact_hits: 5,
            head_unvouched_hits: 2,
            head_unmarked_hits: 1,
            head_skipped_hits: 3,
            ..CacheStats::default()
        };
        assert_eq!(
            head_line(&counted).unwrap(),
            "5 hits left a cold run's head; not so after 2 on blocks whose head K/V another path \
             wrote, 1 on unmarked checkpoints and 3 without the rerun the pool had no room for"
        );
        let skipped_only = CacheStats {
            head_skipped_hits: 1,
            ..CacheStats::default()
        };
        assert!(head_line(&skipped_only).is_some());
        assert_eq!(head_line(&CacheStats::default()), None);
    }

    #[test]
    fn byte_counts_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(12 << 20), "12.0 MiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }
}
