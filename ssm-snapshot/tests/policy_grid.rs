//! A small policy grid (the full one is the `grid` example): the default `marconi` policy must
//! never fall below plain `lru` by more than [`LRU_TOLERANCE`] of token hit rate, and must keep
//! a win where leaving LRU pays. Engine block size (16) and short traces keep it to seconds.
//! The cells: longchat (30 sessions, seeds 1 and 2) at 1 GB, where the shadow tuner used to lose
//! to its own LRU candidate in the long-reply small-capacity regime (seed 2: 0.160 against
//! 0.248); agentic (12 sessions, seed 2) at 0.5 GB, where adaptive recency used to lose
//! everything (0.002 against 0.269); and two cells where the tuner that switched the live store
//! as soon as a shadow led lost to LRU through the switch itself (the live store kept what the
//! old setting had built): agentic (12 sessions, seed 1) at 2 GB, 0.6851 against 0.7148, and
//! sharegpt (40 sessions, seed 2) at 1 GB, 0.1953 against 0.2012. And one where the tuner
//! that switched as soon as a trial's copy (started 100 requests earlier) led lost through the
//! switch from the live store's later contents (α = 5 evicted the prefix every request reused):
//! agentic (12 sessions, seed 2) at 1 GB, 0.4406 against 0.4582. And one where the tuner left
//! LRU only for a FLOP-aware setting late in the trace and lost as its sessions drained: mix
//! (30 sessions, seed 4) at 2 GB, 0.3611 against 0.3993 (switched to α = 3 guarded at request
//! 316 of 375); an α = 0 setting needs less evidence to leave LRU now, and the tuner moves to
//! guarded α = 0 at request 248. And one where a guarded setting adopted late locked the
//! drain's returning conversations out: mix (20 sessions, seed 4) at 2 GB, 0.4324 against
//! 0.4456 (guarded α = 1 at request 224 of 252); a
//! guarded trial needs 2.5 standard errors now, and the tuner stays at LRU. And one where an
//! α = 3 prefix setting evicted the shared prefix that every request hit, with one cached
//! conversation below it, as the least efficient entry (its KV, which its eviction does not
//! free, was counted): agentic (20 sessions, seed 5) at 1 GB, 0.3893 against 0.3961; a node
//! with one child is valued by its checkpoint now. One cell at token granularity (sharegpt,
//! 200 sessions, 2 GB) keeps the win of guarded admission whose trial stays below its bar. Two
//! more at token granularity: chat (100 sessions, seed 2) at 10 GB, where the first eviction
//! comes late and the paper's Marconi, which holds own-use recency from the first request, led
//! the tuner that left LRU only on its shadows' evidence (0.9407 against 0.9468); and mix (100
//! sessions, seed 8) at 5 GB, where a guarded setting spent the lead of the one before it
//! before the ledger, which counted from the first departure, saw a deficit (0.6793 against
//! `lru`'s 0.6824). And mix (30 sessions, seed 9) at 2 GB, where guarded admission kept a
//! conversation that had lost its entry out for 11 turns in a row while the cache held the
//! entries of conversations that had ended (0.4152 against 0.4561); such a conversation may
//! take the room of entries colder than it now, and the tuner ends at 0.5062. And three cells
//! priced at Nemotron-H-8B's costs (a checkpoint weighs eight times as many tokens of KV as at
//! the 7B costs the policy was tuned at), where the tuner leaves LRU and must hold to it, one
//! there where it leaves LRU at the first eviction because checkpoints hold most of the store's
//! bytes, and four at Nemotron-H-56B's (28 times), where it switches, falls back or switches
//! twice.
#![forbid(unsafe_code)]

use ssm_snapshot::grid::{run_cell, run_short_cell, LRU_TOLERANCE};
use ssm_snapshot::sim::{generate, TraceKind};
use ssm_snapshot::{CostModel, PinScope};

const BLOCK: u32 = 16;

/// `(lru, marconi)` token hit rates of one cell at `block_size` under `cost`, and the check that
/// `marconi` kept to its byte budget.
fn cell_priced(
    kind: TraceKind,
    sessions: usize,
    seed: u64,
    capacity: u64,
    block_size: u32,
    cost: &CostModel,
) -> (f64, f64) {
    let trace = generate(kind, sessions, seed);
    let figures =
        run_short_cell(&trace, capacity, block_size, None, cost, PinScope::Path).expect("replays");
    assert!(
        figures.marconi_max_bytes <= capacity,
        "{kind:?} {seed} {capacity}"
    );
    (figures.lru, figures.marconi)
}

/// [`cell_priced`] under the paper's 7B costs (what the policy was tuned at).
fn cell_at(
    kind: TraceKind,
    sessions: usize,
    seed: u64,
    capacity: u64,
    block_size: u32,
) -> (f64, f64) {
    let cost = CostModel::nvidia_hybrid_7b();
    cell_priced(kind, sessions, seed, capacity, block_size, &cost)
}

/// [`cell_at`] at the engine's block size.
fn cell(kind: TraceKind, sessions: usize, seed: u64, capacity: u64) -> (f64, f64) {
    cell_at(kind, sessions, seed, capacity, BLOCK)
}

/// Fails naming every cell `(kind, sessions, seed, capacity)`, at the engine's block size under
/// `cost`, where `marconi` falls more than [`LRU_TOLERANCE`] below `lru`.
fn assert_never_below_lru(cells: &[(TraceKind, usize, u64, u64)], cost: &CostModel) {
    let mut failures = Vec::new();
    for &(kind, sessions, seed, capacity) in cells {
        let (lru, marconi) = cell_priced(kind, sessions, seed, capacity, BLOCK, cost);
        if marconi < lru - LRU_TOLERANCE {
            failures.push(format!(
                "{kind:?} {sessions} sessions seed {seed} at {capacity} B: marconi {marconi:.4} < lru {lru:.4}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn marconi_never_falls_below_lru_on_long_replies_small_caches_and_transitions() {
    let cells = [
        (TraceKind::LongChat, 30, 1, 1_000_000_000),
        (TraceKind::LongChat, 30, 2, 1_000_000_000),
        (TraceKind::Agentic, 12, 2, 500_000_000),
        (TraceKind::Agentic, 12, 1, 2_000_000_000),
        (TraceKind::ShareGpt, 40, 2, 1_000_000_000),
        (TraceKind::Agentic, 12, 2, 1_000_000_000),
        (TraceKind::Mix, 30, 4, 2_000_000_000),
        (TraceKind::Mix, 20, 4, 2_000_000_000),
        (TraceKind::Agentic, 20, 5, 1_000_000_000),
        (TraceKind::Mix, 30, 9, 2_000_000_000),
    ];
    assert_never_below_lru(&cells, &CostModel::nvidia_hybrid_7b());
}

#[test]
fn marconi_keeps_a_win_where_leaving_lru_pays() {
    // Chat at a small capacity: LRU cycles the whole working set; a FLOP-aware setting keeps a
    // more useful part. The tuner that switched at once reached 2.5 times LRU's hit rate here
    // (0.1355 against 0.0536); trialling the switch first costs 100 requests of this 582-request
    // trace and a later switch to guarded admission that the trial does not confirm, so 1.57
    // times (0.0841); a tuner that never left LRU would fail.
    let (lru, marconi) = cell(TraceKind::Chat, 40, 1, 1_000_000_000);
    assert!(marconi > 1.5 * lru, "marconi {marconi:.4}, lru {lru:.4}");
}

#[test]
fn marconi_adopts_guarded_admission_whose_trial_ran_its_length_ahead() {
    // ShareGPT-like chat, 200 sessions, seed 3, at 2 GB and token granularity (a cell of the
    // `grid` example): guarded α = 0.5 (marginal FLOPs) from the first request reaches 0.552
    // against LRU's 0.457, but its trial from the live store's contents, begun at request 296,
    // stays below `GUARDED_TRIAL_Z` standard errors for its whole length (2.3 at 596). A guarded
    // trial that ran its length ahead while its shadow leads LRU significantly passes: the live
    // store switches at 606 and reaches 0.4852. (Seed 1 showed this first, 0.5000 against
    // 0.4577; since guarded admission lets a returning conversation in, the first confirmation
    // falls behind there, a later guarded switch falls back, and the live store ends at LRU's
    // rate; before that change, seed 3 ended 0.0038 below LRU.)
    let (lru, marconi) = cell_at(TraceKind::ShareGpt, 200, 3, 2_000_000_000, 1);
    assert!(marconi > lru + 0.02, "marconi {marconi:.4}, lru {lru:.4}");
}

#[test]
fn marconi_matches_the_papers_marconi_where_the_first_eviction_comes_late() {
    // Chat, 100 sessions, seed 2, at 10 GB and token granularity (a cell of the `grid`
    // example): the store first evicts at request 186, and the paper's Marconi, α = 0 with
    // own-use recency from the first request, reaches 0.9468 against `lru`'s 0.8886. The tuner
    // that left LRU only on its shadows' evidence switched at request 541 and reached 0.9407;
    // one that takes α = 0 with adaptive recency at a late first eviction matches it.
    let trace = generate(TraceKind::Chat, 100, 2);
    let cost = CostModel::nvidia_hybrid_7b();
    let figures = run_cell(&trace, 10_000_000_000, &cost, PinScope::Path).expect("replays");
    assert!(figures.marconi_max_bytes <= 10_000_000_000);
    assert!(
        figures.vs_paper_marconi() >= -LRU_TOLERANCE,
        "marconi {:.4}, paper Marconi {:.4}",
        figures.marconi,
        figures.references.paper_marconi
    );
}

#[test]
fn marconi_stays_above_lru_when_a_setting_spends_the_lead_of_the_one_before() {
    // Mix, 100 sessions, seed 8, at 5 GB and token granularity: α = 0 adaptive from the late
    // first eviction (request 68) gained on LRU; a guarded α = 1.5 setting adopted at 441 then
    // lost to it, and a ledger counted from the first departure let it spend that gain for 600
    // requests (0.6793 against `lru`'s 0.6824). A ledger restarted at every switch away from
    // LRU judges each setting on its own.
    let (lru, marconi) = cell_at(TraceKind::Mix, 100, 8, 5_000_000_000, 1);
    assert!(
        marconi >= lru - LRU_TOLERANCE,
        "marconi {marconi:.4}, lru {lru:.4}"
    );
}

#[test]
fn marconi_holds_to_lru_at_another_models_costs() {
    // Nemotron-H-8B's costs: a checkpoint weighs as much as 3,192 tokens of KV (the paper's 7B,
    // which the policy was tuned at: 409). Three cells of the short-trace scan where the tuner
    // leaves LRU at these costs: longchat (20 and 30 sessions, seed 1) at 1 GB, which switch to
    // α = 0 with adaptive recency (0.6684 against `lru`'s 0.6428; 0.5249 against 0.5103), and
    // chat (30 sessions, seed 2) at 1 GB, where the ledger takes the live store back to LRU twice
    // (0.2238 against 0.2213).
    let cost = CostModel::by_name("nemotron-h-8b").expect("built in");
    let cells = [
        (TraceKind::LongChat, 20, 1, 1_000_000_000),
        (TraceKind::LongChat, 30, 1, 1_000_000_000),
        (TraceKind::Chat, 30, 2, 1_000_000_000),
    ];
    assert_never_below_lru(&cells, &cost);
}

#[test]
fn a_checkpoint_heavy_store_leaves_lru_at_its_first_eviction() {
    // Nemotron-H-8B's costs, where a store's checkpoints hold 0.7-0.9 of its bytes when it first
    // evicts (at the 7B costs, at most 0.5): sharegpt (20 sessions, seed 1) at 2 GB evicts first
    // at request 30, and the tuner takes α = 0 with shared recency there, without a shadow's
    // lead, and keeps it (0.9188 against `lru`'s 0.8697, as with adaptive recency there; a
    // tuner that left LRU only at a first eviction after 50 requests never left it here and had
    // 0.8697).
    use ssm_snapshot::tuning::CHECKPOINT_HEAVY_START;
    let cost = CostModel::by_name("nemotron-h-8b").expect("built in");
    let trace = generate(TraceKind::ShareGpt, 20, 1);
    let figures =
        run_short_cell(&trace, 2_000_000_000, BLOCK, None, &cost, PinScope::Path).expect("replays");
    assert!(figures.marconi_max_bytes <= 2_000_000_000);
    assert_eq!(figures.switches, vec![(30, CHECKPOINT_HEAVY_START)]);
    assert!(
        figures.marconi >= figures.lru + 0.04,
        "marconi {:.4}, lru {:.4}",
        figures.marconi,
        figures.lru
    );
}

#[test]
fn marconi_holds_to_lru_at_a_large_models_costs() {
    // Nemotron-H-56B's costs: a checkpoint weighs as much as 11,275 tokens of KV, 28 times the
    // ratio the policy was tuned at, and at 0.5-2 GB a store holds one to four checkpoints; these
    // cells are from the short-trace scan at 16 times those capacities (`short_grid --model
    // nemotron-h-56b --capacities 8e9,1.6e10,3.2e10`, never tuned on), close to `lru` where the
    // tuner moves: longchat (40 sessions, seed 3) at 8 GB, α = 2 with marginal FLOPs at request
    // 323 (0.5073 against 0.5017); mix (20 sessions, seed 1) at 8 GB, α = 0 adaptive at 144 then
    // α = 3 marginal at 255 (0.6363 against 0.6312); sharegpt (60 sessions, seed 3) at 32 GB,
    // where the ledger takes the live store back to LRU at 163 (0.9341 against 0.9345); agentic
    // (20 sessions, seed 3) at 32 GB, out, back and out again (0.9111 against 0.9103).
    let cost = CostModel::by_name("nemotron-h-56b").expect("built in");
    let cells = [
        (TraceKind::LongChat, 40, 3, 8_000_000_000),
        (TraceKind::Mix, 20, 1, 8_000_000_000),
        (TraceKind::ShareGpt, 60, 3, 32_000_000_000),
        (TraceKind::Agentic, 20, 3, 32_000_000_000),
    ];
    assert_never_below_lru(&cells, &cost);
}
