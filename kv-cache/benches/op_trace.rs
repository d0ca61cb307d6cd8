//! The prefix cache's operation trace: a multi-turn chat workload replayed one request at a time
//! through lookup, allocate, insert and free, timed per request, with the hits checked against a
//! naive model. This is the benchmark the crate docs quote.
//!
//! Run: `cargo bench -p kv-cache --bench op_trace` (pin it for stable figures:
//! `taskset -c 0 cargo bench -p kv-cache --bench op_trace`). Options, after `--`:
//! `--rounds R` (default 7), `--sessions S` (default 115), `--seed N` (default 1), `--scales 1,8`
//! (prompt scales to run), `--kind 64|128` (key width, default 64), `--trace FILE` (replay a JSON
//! lines trace with `input_tokens` and `output_tokens`, e.g. from `ssm-snapshot`'s
//! `simulate --generate chat`), `--write-trace FILE` (save the generated trace in that format).
//!
//! # The operation trace
//!
//! Block size 16; a pool of N blocks, block 0 reserved (held for the whole run, never handed out).
//! For each request, in trace order, with input I, output O and T = I ++ O:
//! 1. lookup: the longest run of cached full blocks at the start of I (only input blocks count);
//! 2. allocate: the request holds ⌈|T|/16⌉ blocks: the hit blocks, plus new ones (free blocks
//!    first, then evicting unpinned cached blocks);
//! 3. insert: all ⌊|T|/16⌋ full blocks of T are registered;
//! 4. free: the request releases its blocks (last first); the full ones stay cached and
//!    evictable, a partial tail block returns free.
//!
//! Timed per request: all four steps, including every hash of the request's tokens (the keys are
//! computed once, by the lookup up to its first miss and by the insert for the rest). Each round
//! replays the whole trace on a fresh cache; the robust figure takes each request's median over
//! the rounds and sums them. Printed per configuration: hit tokens, a digest of the per-request
//! hits, ns per block op (time / Σ⌈|T|/16⌉), median and p99 µs per request, evictions, and the
//! heap allocations made inside the timed operations (a counting global allocator).
//!
//! Configurations: pools that evict (N = 16,384 × scale) and that never evict
//! (N = 262,144 × scale), on the generated trace (about 1,400 requests and 3.1M input tokens)
//! and on the same trace with 8× longer prompts (each token t becomes 8t, 8t+1, ..., 8t+7, which
//! keeps every prefix relation). At the never-evicting size the per-request hits must equal those
//! of a naive model (a map from (parent prefix, block tokens) to prefix, with no hashing of our
//! own and no eviction); the bench stops with an error otherwise.
//!
//! The items are public so that an outside harness can include this file as a module and replay
//! the same trace through another cache side by side.

use std::alloc::System;
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Instant;

use kv_cache::{BlockId, BlockKeys, ExtraKey, HashKind, KvCache, KvCacheConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Tokens per block.
pub const BLOCK: usize = 16;
/// The evicting pool at scale 1.
pub const EVICTING_BLOCKS: usize = 16_384;
/// The never-evicting pool at scale 1.
pub const ROOMY_BLOCKS: usize = 262_144;

/// One request: `tokens` is T = I ++ O, the first `input_len` of them the input I.
#[derive(Debug, Clone)]
pub struct Request {
    /// Input then output.
    pub tokens: Arc<Vec<u32>>,
    /// |I|.
    pub input_len: usize,
}

impl Request {
    /// Blocks the request holds: ⌈|T| / 16⌉.
    pub fn blocks(&self) -> usize {
        self.tokens.len().div_ceil(BLOCK)
    }
}

// ----- the trace -----

const VOCAB: u32 = 50_000;

fn random_tokens(rng: &mut ChaCha8Rng, lo: usize, hi: usize) -> Vec<u32> {
    let len = rng.random_range(lo..=hi);
    (0..len).map(|_| rng.random_range(0..VOCAB)).collect()
}

/// Picks `0..n` with weight `1 / (i + 1)`.
fn zipf(rng: &mut ChaCha8Rng, n: usize) -> usize {
    let total: f64 = (0..n).map(|i| 1.0 / (i + 1) as f64).sum();
    let mut x = rng.random::<f64>() * total;
    for i in 0..n {
        x -= 1.0 / (i + 1) as f64;
        if x <= 0.0 {
            return i;
        }
    }
    n - 1
}

/// A multi-turn chat trace: `sessions` conversations arriving over time, 60% of them opening
/// with one of 8 shared system prompts (200 to 800 tokens, Zipf-popular), the others with their
/// own (50 to 300); 8 to 16 turns of a user message (20 to 250 tokens) and a reply (50 to 300);
/// each turn's input is the whole conversation so far. Requests are in arrival order, so
/// conversations interleave.
pub fn generate_chat(sessions: usize, seed: u64) -> Vec<Request> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let openers: Vec<Vec<u32>> = (0..8).map(|_| random_tokens(&mut rng, 200, 800)).collect();
    let span = sessions as f64 * 20.0;
    let mut timed: Vec<(f64, Request)> = Vec::new();
    for _ in 0..sessions {
        let mut history = if rng.random_bool(0.6) {
            openers[zipf(&mut rng, openers.len())].clone()
        } else {
            random_tokens(&mut rng, 50, 300)
        };
        let turns = rng.random_range(8..=16);
        let mut ts = rng.random::<f64>() * span;
        for _ in 0..turns {
            history.extend(random_tokens(&mut rng, 20, 250));
            let input_len = history.len();
            history.extend(random_tokens(&mut rng, 50, 300));
            timed.push((
                ts,
                Request {
                    tokens: Arc::new(history.clone()),
                    input_len,
                },
            ));
            ts += rng.random_range(10.0..60.0);
        }
    }
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    timed.into_iter().map(|(_, r)| r).collect()
}

/// The trace with each token t replaced by 8t, 8t+1, ..., 8t+7 (for `factor` 8): prompts
/// `factor` times longer with every prefix relation kept.
pub fn scale_trace(trace: &[Request], factor: usize) -> Vec<Request> {
    if factor == 1 {
        return trace.to_vec();
    }
    trace
        .iter()
        .map(|r| Request {
            tokens: Arc::new(
                r.tokens
                    .iter()
                    .flat_map(|&t| (0..factor as u32).map(move |k| t * factor as u32 + k))
                    .collect(),
            ),
            input_len: r.input_len * factor,
        })
        .collect()
}

/// Reads a JSON lines trace (`input_tokens`, `output_tokens` per line; other fields ignored).
pub fn read_trace(path: &str) -> Result<Vec<Request>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
    let mut trace = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{path}: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("{path}:{}: {e}", n + 1))?;
        let field = |name: &str| -> Result<Vec<u32>, String> {
            value[name]
                .as_array()
                .ok_or_else(|| format!("{path}:{}: no `{name}` array", n + 1))?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| format!("{path}:{}: `{name}` holds {t}, not a u32", n + 1))
                })
                .collect()
        };
        let mut tokens = field("input_tokens")?;
        let input_len = tokens.len();
        tokens.extend(field("output_tokens")?);
        trace.push(Request {
            tokens: Arc::new(tokens),
            input_len,
        });
    }
    Ok(trace)
}

/// Writes the trace as JSON lines in `ssm-snapshot`'s trace format.
pub fn write_trace(path: &str, trace: &[Request]) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| format!("cannot create {path}: {e}"))?;
    let mut out = std::io::BufWriter::new(file);
    for (i, r) in trace.iter().enumerate() {
        let (input, output) = r.tokens.split_at(r.input_len);
        let line = serde_json::json!({
            "session_id": 0, "turn_id": i, "ts": i as f64,
            "num_input_tokens": input.len(), "num_output_tokens": output.len(),
            "input_tokens": input, "output_tokens": output,
        });
        writeln!(out, "{line}").map_err(|e| format!("{path}: {e}"))?;
    }
    out.flush().map_err(|e| format!("{path}: {e}"))
}

// ----- the naive model -----

/// Per-request hit tokens of the operation trace on a cache that never evicts, computed the
/// plain way: a map from (the node of the prefix before a block, the block's tokens) to the node
/// of the prefix through it, so a prefix is cached exactly when its chain of nodes exists.
pub fn naive_hits(trace: &[Request]) -> Vec<u32> {
    let mut nodes: HashMap<(u32, Vec<u32>), u32> = HashMap::new();
    let mut hits = Vec::with_capacity(trace.len());
    for r in trace {
        // Node 0 is the empty prefix.
        let mut node = 0;
        let mut hit = 0;
        for block in r.tokens[..r.input_len].chunks_exact(BLOCK) {
            match nodes.get(&(node, block.to_vec())) {
                Some(&next) => {
                    node = next;
                    hit += BLOCK;
                }
                None => break,
            }
        }
        hits.push(hit as u32);
        let mut node = 0;
        for block in r.tokens.chunks_exact(BLOCK) {
            let fresh = nodes.len() as u32 + 1;
            node = *nodes.entry((node, block.to_vec())).or_insert(fresh);
        }
    }
    hits
}

/// A digest of per-request hits, to compare runs and caches at a glance.
pub fn digest(hits: &[u32]) -> u64 {
    let bytes: Vec<u8> = hits.iter().flat_map(|h| h.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

// ----- replaying -----

/// A cache under test: replays one request of the operation trace, returns its hit tokens.
pub trait Replay {
    /// Lookup, allocate, insert and free for `request` (the `index`-th of the trace).
    fn request(&mut self, index: usize, request: &Request) -> u32;
    /// Cached blocks evicted so far.
    fn evictions(&self) -> u64;
}

/// `kv-cache` on the operation trace.
#[derive(Debug)]
pub struct Ours {
    kv: KvCache,
    keys: BlockKeys,
    blocks: Vec<BlockId>,
    /// Nanoseconds per phase (lookup with its hashing, allocate, insert with the rest of the
    /// hashing, free), when timing phases.
    pub phases: Option<[u64; 4]>,
}

impl Ours {
    /// A fresh cache of `num_blocks` blocks with block 0 reserved, and buffers large enough for
    /// requests of `max_blocks` blocks.
    pub fn new(num_blocks: usize, kind: HashKind, max_blocks: usize) -> Self {
        let mut kv = KvCache::new(KvCacheConfig {
            hash_kind: kind,
            seed: Some(0x5eed),
            ..KvCacheConfig::new(num_blocks, BLOCK)
        })
        .expect("a valid pool");
        let reserved = kv.pool_mut().allocate().expect("a fresh pool has block 0");
        assert_eq!(reserved, BlockId(0));
        let mut keys = kv.keys(ExtraKey::NONE);
        keys.reserve(max_blocks);
        Self {
            kv,
            keys,
            blocks: Vec::with_capacity(max_blocks),
            phases: None,
        }
    }

    /// The cache, for its counters.
    pub fn cache(&self) -> &KvCache {
        &self.kv
    }
}

impl Replay for Ours {
    fn request(&mut self, _index: usize, request: &Request) -> u32 {
        let tokens = &request.tokens[..];
        let start = self.phases.map(|_| Instant::now());
        self.kv.reset_keys(&mut self.keys, ExtraKey::NONE);
        let hit = self.kv.match_keys(
            &mut self.keys,
            &tokens[..request.input_len],
            &mut self.blocks,
        );
        let looked_up = start.map(|_| Instant::now());
        let new_blocks = request.blocks() - self.blocks.len();
        if let Err(e) = self
            .kv
            .pool_mut()
            .allocate_many(new_blocks, &mut self.blocks)
        {
            panic!("the pool is too small for the trace: {e}");
        }
        let allocated = start.map(|_| Instant::now());
        if let Err(e) = self.kv.insert_keys(&mut self.keys, tokens, &self.blocks) {
            panic!("insert refused a request's own blocks: {e}");
        }
        let inserted = start.map(|_| Instant::now());
        for &id in self.blocks.iter().rev() {
            if let Err(e) = self.kv.pool_mut().release(id) {
                panic!("a request's block was not held: {e}");
            }
        }
        if let (Some(phases), Some(t0), Some(t1), Some(t2), Some(t3)) =
            (&mut self.phases, start, looked_up, allocated, inserted)
        {
            let t4 = Instant::now();
            for (phase, (a, b)) in phases
                .iter_mut()
                .zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4)])
            {
                *phase += (b - a).as_nanos() as u64;
            }
        }
        hit as u32
    }

    fn evictions(&self) -> u64 {
        self.kv.pool().counters().evictions
    }
}

/// One cache's figures on one configuration.
#[derive(Debug, Clone)]
pub struct Figures {
    /// The cache's name.
    pub name: String,
    /// Per-request hit tokens (from the first round; every round must agree).
    pub hits: Vec<u32>,
    /// Per-request nanoseconds, each request's median over the rounds.
    pub median_ns: Vec<u64>,
    /// Evictions in one round.
    pub evictions: u64,
    /// Heap allocations made inside the timed operations, all rounds together.
    pub allocations: usize,
}

impl Figures {
    /// Sum of the per-request medians.
    pub fn total_ns(&self) -> u64 {
        self.median_ns.iter().sum()
    }

    /// The `q`-quantile of the per-request medians, in µs.
    pub fn quantile_us(&self, q: f64) -> f64 {
        let mut sorted = self.median_ns.clone();
        sorted.sort_unstable();
        let at = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted[at] as f64 / 1000.0
    }
}

/// A cache to measure: its name and how to build a fresh one of `num_blocks` blocks.
pub struct Engine<'a> {
    /// The name printed.
    pub name: String,
    /// A fresh cache.
    pub make: Box<dyn Fn(usize) -> Box<dyn Replay> + 'a>,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Replays `trace` through every engine, `rounds` times each, rounds interleaved (engine A,
/// engine B, engine A, ...), each round on a fresh cache of `num_blocks` blocks.
pub fn measure(
    engines: &[Engine<'_>],
    trace: &[Request],
    num_blocks: usize,
    rounds: usize,
) -> Vec<Figures> {
    let n = trace.len();
    let mut times = vec![vec![Vec::with_capacity(rounds); n]; engines.len()];
    let mut figures: Vec<Figures> = engines
        .iter()
        .map(|e| Figures {
            name: e.name.clone(),
            hits: Vec::new(),
            median_ns: Vec::new(),
            evictions: 0,
            allocations: 0,
        })
        .collect();
    let mut round_ns = vec![0u64; n];
    let mut round_hits = vec![0u32; n];
    for _ in 0..rounds {
        for (e, engine) in engines.iter().enumerate() {
            let mut cache = (engine.make)(num_blocks);
            let region = Region::new(GLOBAL);
            for (i, request) in trace.iter().enumerate() {
                let start = Instant::now();
                let hit = cache.request(i, request);
                round_ns[i] = start.elapsed().as_nanos() as u64;
                round_hits[i] = hit;
            }
            let change = region.change();
            figures[e].allocations += change.allocations + change.reallocations;
            for (i, &t) in round_ns.iter().enumerate() {
                times[e][i].push(t);
            }
            if figures[e].hits.is_empty() {
                figures[e].hits = round_hits.clone();
                figures[e].evictions = cache.evictions();
            } else {
                assert_eq!(
                    figures[e].hits, round_hits,
                    "{}: hits differ between rounds",
                    engine.name
                );
            }
            drop(cache);
        }
    }
    for (e, per_request) in times.iter_mut().enumerate() {
        figures[e].median_ns = per_request
            .iter_mut()
            .map(|t| {
                t.sort_unstable();
                t[t.len() / 2]
            })
            .collect();
    }
    figures
}

/// One line of figures.
pub fn report(label: &str, trace: &[Request], f: &Figures) -> String {
    let block_ops: usize = trace.iter().map(Request::blocks).sum();
    let input: usize = trace.iter().map(|r| r.input_len).sum();
    let hit: u64 = f.hits.iter().map(|&h| u64::from(h)).sum();
    format!(
        "{label} {:<10} {:>7.1} ns/block op  median {:>6.2} µs/request  p99 {:>7.2} µs  \
         hit {hit}/{input} tokens  digest {:016x}  evictions {}  allocations in timed ops {}",
        f.name,
        f.total_ns() as f64 / block_ops as f64,
        f.quantile_us(0.5),
        f.quantile_us(0.99),
        digest(&f.hits),
        f.evictions,
        f.allocations,
    )
}

struct Options {
    rounds: usize,
    sessions: usize,
    seed: u64,
    scales: Vec<usize>,
    kind: HashKind,
    trace: Option<String>,
    write_trace: Option<String>,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        rounds: 7,
        sessions: 115,
        seed: 1,
        scales: vec![1, 8],
        kind: HashKind::Xxh3x64,
        trace: None,
        write_trace: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        // `cargo bench` passes `--bench`.
        if arg == "--bench" {
            continue;
        }
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        let number = |text: String| {
            text.parse::<u64>()
                .map_err(|_| format!("{arg} takes a number, got `{text}`"))
        };
        match arg.as_str() {
            "--rounds" => options.rounds = number(value()?)?.max(1) as usize,
            "--sessions" => options.sessions = number(value()?)? as usize,
            "--seed" => options.seed = number(value()?)?,
            "--scales" => {
                options.scales = value()?
                    .split(',')
                    .map(|s| number(s.to_owned()).map(|n| n.max(1) as usize))
                    .collect::<Result<_, _>>()?;
            }
            "--kind" => {
                options.kind = match value()?.as_str() {
                    "64" => HashKind::Xxh3x64,
                    "128" => HashKind::Xxh3x128,
                    other => return Err(format!("--kind takes 64 or 128, got `{other}`")),
                }
            }
            "--trace" => options.trace = Some(value()?),
            "--write-trace" => options.write_trace = Some(value()?),
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    Ok(options)
}

/// Generates or reads the trace the options ask for.
fn base_trace(options: &Options) -> Result<Vec<Request>, String> {
    let trace = match &options.trace {
        Some(path) => read_trace(path)?,
        None => generate_chat(options.sessions, options.seed),
    };
    if let Some(path) = &options.write_trace {
        write_trace(path, &trace)?;
    }
    Ok(trace)
}

fn run() -> Result<(), String> {
    let options = parse_options()?;
    let base = base_trace(&options)?;
    let input: usize = base.iter().map(|r| r.input_len).sum();
    println!(
        "op_trace: {} requests, {input} input tokens, block {BLOCK}, {} rounds, keys {:?}",
        base.len(),
        options.rounds,
        options.kind
    );
    for &scale in &options.scales {
        let trace = scale_trace(&base, scale);
        let max_blocks = trace.iter().map(Request::blocks).max().unwrap_or(0);
        let expected = naive_hits(&trace);
        for (size, blocks) in [("evicting", EVICTING_BLOCKS), ("roomy", ROOMY_BLOCKS)] {
            let num_blocks = blocks * scale;
            let kind = options.kind;
            let engines = [Engine {
                name: "kv-cache".to_owned(),
                make: Box::new(move |n| {
                    Box::new(Ours::new(n, kind, max_blocks)) as Box<dyn Replay>
                }),
            }];
            let figures = measure(&engines, &trace, num_blocks, options.rounds);
            let label = format!("{scale}x N={num_blocks:<7} ({size})");
            println!("{}", report(&label, &trace, &figures[0]));
            if size == "roomy" {
                if figures[0].evictions != 0 {
                    return Err(format!("{label}: the roomy pool evicted"));
                }
                if figures[0].hits != expected {
                    return Err(format!("{label}: hits differ from the naive model"));
                }
                println!(
                    "{label} hits equal the naive model's on all {} requests",
                    trace.len()
                );
            }
            // Where the time goes: each phase timed, per request the median over the rounds.
            let mut per_request = vec![Vec::with_capacity(options.rounds); trace.len()];
            for _ in 0..options.rounds {
                let mut ours = Ours::new(num_blocks, kind, max_blocks);
                for (i, request) in trace.iter().enumerate() {
                    ours.phases = Some([0; 4]);
                    ours.request(i, request);
                    per_request[i].push(ours.phases.unwrap_or_default());
                }
            }
            let block_ops: usize = trace.iter().map(Request::blocks).sum();
            let mut phases = [0f64; 4];
            for rounds in &mut per_request {
                for (p, phase) in phases.iter_mut().enumerate() {
                    let mut ns: Vec<u64> = rounds.iter().map(|r| r[p]).collect();
                    ns.sort_unstable();
                    *phase += ns[ns.len() / 2] as f64 / block_ops as f64;
                }
            }
            let [lookup, allocate, insert, free] = phases;
            println!(
                "{label} phases (ns/block op): lookup {lookup:.1}, allocate {allocate:.1}, \
                 insert {insert:.1}, free {free:.1}"
            );
        }
    }
    Ok(())
}

fn main() {
    if let Err(message) = run() {
        eprintln!("op_trace: {message}");
        std::process::exit(2);
    }
}
