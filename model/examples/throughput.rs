//! Host forward throughput on one checkpoint: prefill of one prompt of N tokens, and greedy decode
//! of B sequences at once (each after a 128-token prompt), in tokens per second. The reference
//! side of `benches/vs_transformers.py`, which runs Hugging Face transformers on the same
//! checkpoint in the same run; it can also write the embedded model as a checkpoint for it.
//!
//! ```text
//! cargo run --release -p model --example throughput -- [options]
//!   --model DIR        a NemotronH checkpoint (default: the embedded `Config::small_512()` model,
//!                      seed 0, the replay's default)
//!   --save DIR         write the model as a checkpoint (config.json + model.safetensors) and exit
//!   --threads N        threads of the forward pass (default 1)
//!   --jobs-per-thread J  no job of a parallel region is more than 1/(J x threads) of it
//!                      (default: the model's, 8; see `Scratch::set_jobs_per_thread`)
//!   --work LIST        comma-separated `prefill:N`, `decode:B`, `chunk:S` and `step:B` items
//!                      (default prefill:128,prefill:512,prefill:2048,decode:1,decode:8,decode:32);
//!                      `chunk:S` prefills one 128-token chunk at positions S..S+128 over a
//!                      zeroed KV cache and Mamba state (the cost of a long prompt's chunk at
//!                      context S, without prefilling the S tokens first: for profilers);
//!                      `step:B` is `decode:B` over a zeroed KV cache and Mamba state instead of
//!                      128 prefilled tokens per sequence (the same positions and work per step,
//!                      without the 128 x B prefill tokens first: for profilers)
//!   --steps S          decode steps per measurement (default 32)
//!   --repeat R         measurements per item; the best is reported (default 3)
//!   --compare LIST     instead of one thread count, compare comma-separated settings in one
//!                      process: `T` (T threads), `TjJ` (T threads, `--jobs-per-thread J`), `Nx1`
//!                      (N one-thread passes at once, each on its own copy of the inputs, rates
//!                      added: what N cores give when nothing is shared but the machine, the
//!                      ceiling of any N-thread split). Each round measures every item once per
//!                      setting, back to back over the same inputs (the order reversed every
//!                      other round), so the machine's drift in per-core speed hits all settings
//!                      alike; the report gives each round's rates and load, then per item and
//!                      setting the median rate and the per-round ratio to the first setting
//!                      (median, quartiles, extremes). Every measurement's logits must be the
//!                      first one's bits, or the run fails (so it also checks that the settings
//!                      leave the output alone). `--threads`, `--jobs-per-thread` and
//!                      `--repeat` are not used; `--regions` is refused
//!   --rounds R         rounds of `--compare` (default 10)
//!   --logits FILE      also write the last prefill's final-position logits (f32 little-endian),
//!                      for a parity check against another implementation
//!   --decode-logits FILE  also write every row's logits of the last decode step of the last
//!                      `decode:B`/`step:B` item (f32 little-endian, row after row), to check that
//!                      a change of the forward pass leaves their bits alone
//!   --regions          after each item, one line per parallel region of the forward pass (build
//!                      with `--features region-timing`; see `model::regions`): `region ITEM SITE
//!                      SHAPE calls C wall_us W serial_us S`, then per pool thread `tT busy_us B
//!                      delay_us D wait_us A` (totals over the item's timed forward calls, all
//!                      repeats; `forward end` is the serial tail, its calls the forward calls)
//! ```
//!
//! Every measurement of an item starts from the same state, built once (a `decode:B` item's
//! prompts are prefilled then, untimed).
//!
//! Output: one line per item, `prefill 2048 tok/s 1234.5` or `decode 32 tok/s 567.8`; with
//! `--compare 1,2`, lines `round 3 prefill 2048 1 901.2 2 1650.3 load 0.52`, then
//! `median prefill 2048 2 tok/s 1640.1 ratio 1.812 iqr 1.790-1.830 min 1.700 max 1.880 rounds 10`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use model::{Config, DecodeRow, KvPool, MambaStates, Model, PrefillRow, Scratch};

const BLOCK_SIZE: usize = 16;
const DECODE_CONTEXT: usize = 128;
const CHUNK: usize = 128;

#[derive(Debug, Clone, Copy)]
enum Item {
    Prefill(usize),
    Decode(usize),
    Chunk(usize),
    Step(usize),
}

#[derive(Debug)]
struct Args {
    model: Option<PathBuf>,
    save: Option<PathBuf>,
    threads: usize,
    jobs_per_thread: Option<usize>,
    work: Vec<Item>,
    steps: usize,
    repeat: usize,
    logits: Option<PathBuf>,
    decode_logits: Option<PathBuf>,
    regions: bool,
    compare: Option<Vec<String>>,
    rounds: usize,
}

fn parse_work(text: &str) -> Result<Vec<Item>, String> {
    text.split(',')
        .map(|item| {
            let (kind, n) = item.split_once(':').ok_or(format!(
                "--work item {item:?}: expected prefill:N, decode:B, chunk:S or step:B"
            ))?;
            let n: usize = n
                .parse()
                .map_err(|e| format!("--work item {item:?}: {e}"))?;
            if n == 0 && kind != "chunk" {
                return Err(format!("--work item {item:?}: must be at least 1"));
            }
            match kind {
                "prefill" => Ok(Item::Prefill(n)),
                "decode" => Ok(Item::Decode(n)),
                "chunk" => Ok(Item::Chunk(n)),
                "step" => Ok(Item::Step(n)),
                _ => Err(format!(
                    "--work item {item:?}: expected prefill:N, decode:B, chunk:S or step:B"
                )),
            }
        })
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        model: None,
        save: None,
        threads: 1,
        jobs_per_thread: None,
        work: parse_work("prefill:128,prefill:512,prefill:2048,decode:1,decode:8,decode:32")?,
        steps: 32,
        repeat: 3,
        logits: None,
        decode_logits: None,
        regions: false,
        compare: None,
        rounds: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let count = |text: String| -> Result<usize, String> {
            match text.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                Ok(_) => Err(format!("{text:?}: must be at least 1")),
                Err(e) => Err(format!("{text:?}: {e}")),
            }
        };
        match flag.as_str() {
            "--model" => args.model = Some(PathBuf::from(value()?)),
            "--save" => args.save = Some(PathBuf::from(value()?)),
            "--threads" => args.threads = count(value()?)?,
            "--jobs-per-thread" => args.jobs_per_thread = Some(count(value()?)?),
            "--work" => args.work = parse_work(&value()?)?,
            "--steps" => args.steps = count(value()?)?,
            "--repeat" => args.repeat = count(value()?)?,
            "--logits" => args.logits = Some(PathBuf::from(value()?)),
            "--decode-logits" => args.decode_logits = Some(PathBuf::from(value()?)),
            "--compare" => args.compare = Some(value()?.split(',').map(str::to_string).collect()),
            "--rounds" => args.rounds = count(value()?)?,
            "--regions" if cfg!(feature = "region-timing") => args.regions = true,
            "--regions" => {
                return Err("--regions needs the build's `--features region-timing`".into())
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if args.compare.is_some() && args.regions {
        return Err("--regions times one setting: it does not go with --compare".into());
    }
    Ok(args)
}

/// A prompt of `len` tokens (deterministic; the same formula as `vs_transformers.py`).
fn prompt(len: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| ((t * 31 + seed * 7 + 3) % vocab) as u32)
        .collect()
}

/// The inputs of one item, built once: every measurement starts from a copy of its KV cache and
/// Mamba state, so each one does the same work from the same state (and gives the same bits).
struct Prepared {
    item: Item,
    kv: KvPool,
    states: MambaStates,
    /// Each sequence's block table (one for a prefill or chunk).
    tables: Vec<Vec<u32>>,
    /// The prompt of a prefill or chunk; each sequence's first decode token of a decode or step.
    tokens: Vec<u32>,
    steps: usize,
}

/// The state `item` starts from: an empty KV cache and Mamba state, but for `decode:B`, whose
/// sequences' 128-token prompts are prefilled here (untimed) on `scratch`.
fn prepare(
    model: &Model,
    scratch: &mut Scratch,
    item: Item,
    steps: usize,
) -> Result<Prepared, String> {
    let config = model.config();
    let vocab = config.vocab_size;
    let error = |e: model::ModelError| e.to_string();
    let single = |blocks: usize, tokens: Vec<u32>| -> Result<Prepared, String> {
        Ok(Prepared {
            item,
            kv: KvPool::new(config, blocks, BLOCK_SIZE).map_err(error)?,
            states: MambaStates::new(config, 1).map_err(error)?,
            tables: vec![(0..blocks as u32).collect()],
            tokens,
            steps,
        })
    };
    let batch = match item {
        Item::Prefill(n) => return single(n.div_ceil(BLOCK_SIZE), prompt(n, 0, vocab)),
        Item::Chunk(s) => return single((s + CHUNK).div_ceil(BLOCK_SIZE), prompt(CHUNK, 0, vocab)),
        Item::Decode(b) | Item::Step(b) => b,
    };
    let per_seq = (DECODE_CONTEXT + steps).div_ceil(BLOCK_SIZE);
    let mut kv = KvPool::new(config, batch * per_seq, BLOCK_SIZE).map_err(error)?;
    let mut states = MambaStates::new(config, batch).map_err(error)?;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let mut logits = Vec::new();
    let mut next = Vec::with_capacity(batch);
    for (slot, table) in tables.iter().enumerate() {
        let tokens = prompt(DECODE_CONTEXT, slot + 1, vocab);
        if matches!(item, Item::Step(_)) {
            next.push(tokens[DECODE_CONTEXT - 1]);
            continue;
        }
        let row = PrefillRow {
            tokens: &tokens,
            start_pos: 0,
            blocks: table,
            slot,
        };
        model
            .prefill(scratch, &mut kv, &mut states, row, false, &mut logits)
            .map_err(error)?;
        next.push(model::parity::argmax(&logits));
    }
    Ok(Prepared {
        item,
        kv,
        states,
        tables,
        tokens: next,
        steps,
    })
}

/// One timed measurement of `prepared`'s item on `scratch`, in tokens per second: the prefill
/// of its prompt (`logits`: the last position's), or its `steps` greedy decode steps (`logits`:
/// every row's logits of the last step).
fn measure(
    model: &Model,
    scratch: &mut Scratch,
    prepared: &Prepared,
    logits: &mut Vec<f32>,
) -> Result<f64, String> {
    let error = |e: model::ModelError| e.to_string();
    let mut kv = prepared.kv.clone();
    let mut states = prepared.states.clone();
    let start_pos = match prepared.item {
        Item::Chunk(s) => s,
        Item::Prefill(_) => 0,
        Item::Decode(_) | Item::Step(_) => {
            return decode_steps(model, scratch, prepared, (&mut kv, &mut states), logits);
        }
    };
    let row = PrefillRow {
        tokens: &prepared.tokens,
        start_pos,
        blocks: &prepared.tables[0],
        slot: 0,
    };
    discard_regions();
    let started = Instant::now();
    model
        .prefill(scratch, &mut kv, &mut states, row, false, logits)
        .map_err(error)?;
    Ok(prepared.tokens.len() as f64 / started.elapsed().as_secs_f64())
}

/// The decode steps of [`measure`], at positions 128 on.
fn decode_steps(
    model: &Model,
    scratch: &mut Scratch,
    prepared: &Prepared,
    (kv, states): (&mut KvPool, &mut MambaStates),
    last: &mut Vec<f32>,
) -> Result<f64, String> {
    let vocab = model.config().vocab_size;
    let mut next = prepared.tokens.clone();
    discard_regions();
    let started = Instant::now();
    for step in 0..prepared.steps {
        let rows: Vec<DecodeRow<'_>> = prepared
            .tables
            .iter()
            .enumerate()
            .map(|(slot, table)| DecodeRow {
                token: next[slot],
                pos: DECODE_CONTEXT + step,
                blocks: table,
                slot,
            })
            .collect();
        model
            .decode(scratch, kv, states, &rows, last)
            .map_err(|e| e.to_string())?;
        for (slot, token) in next.iter_mut().enumerate() {
            *token = model::parity::argmax(&last[slot * vocab..(slot + 1) * vocab]);
        }
    }
    Ok((next.len() * prepared.steps) as f64 / started.elapsed().as_secs_f64())
}

/// Region totals of one item (all its repeats), by site and shape.
#[cfg(feature = "region-timing")]
type Regions = Vec<model::regions::RegionTotals>;
#[cfg(not(feature = "region-timing"))]
type Regions = Vec<()>;

/// Forgets the regions recorded so far (the untimed set-up of a measurement).
fn discard_regions() {
    #[cfg(feature = "region-timing")]
    model::regions::take();
}

/// Adds the regions recorded since the last call to `regions`.
fn keep_regions(regions: &mut Regions) {
    #[cfg(feature = "region-timing")]
    for line in model::regions::take() {
        match regions
            .iter_mut()
            .find(|r| r.site == line.site && r.shape == line.shape)
        {
            Some(total) => {
                total.calls += line.calls;
                total.wall_ns += line.wall_ns;
                total.serial_before_ns += line.serial_before_ns;
                for t in 0..model::regions::MAX_THREADS {
                    total.busy_ns[t] += line.busy_ns[t];
                    total.start_delay_ns[t] += line.start_delay_ns[t];
                    total.end_wait_ns[t] += line.end_wait_ns[t];
                    total.regions_worked[t] += line.regions_worked[t];
                }
            }
            None => regions.push(line),
        }
    }
    #[cfg(not(feature = "region-timing"))]
    let _ = regions;
}

/// One line per region (see `--regions`).
fn print_regions(item: &str, regions: &Regions, threads: usize) {
    #[cfg(feature = "region-timing")]
    for r in regions {
        let us = |ns: u64| ns as f64 / 1e3;
        let shape = if r.shape.is_empty() { "-" } else { &r.shape };
        print!(
            "region {item} {} {shape} calls {} wall_us {:.1} serial_us {:.1}",
            r.site.replace(' ', "_"),
            r.calls,
            us(r.wall_ns),
            us(r.serial_before_ns)
        );
        for t in 0..threads.min(model::regions::MAX_THREADS) {
            print!(
                " t{t} busy_us {:.1} delay_us {:.1} wait_us {:.1} worked {}",
                us(r.busy_ns[t]),
                us(r.start_delay_ns[t]),
                us(r.end_wait_ns[t]),
                r.regions_worked[t]
            );
        }
        println!();
    }
    #[cfg(not(feature = "region-timing"))]
    let _ = (item, regions, threads);
}

impl Item {
    /// `prefill 2048`: how a report line names the item.
    fn label(self) -> String {
        match self {
            Item::Prefill(n) => format!("prefill {n}"),
            Item::Decode(b) => format!("decode {b}"),
            Item::Chunk(s) => format!("chunk {s}"),
            Item::Step(b) => format!("step {b}"),
        }
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let model = match &args.model {
        Some(dir) => Model::load(dir).map_err(|e| e.to_string())?,
        None => Model::random(Config::small_512(), 0).map_err(|e| e.to_string())?,
    };
    if let Some(dir) = &args.save {
        model.save(dir).map_err(|e| e.to_string())?;
        println!("saved {}", dir.display());
        return Ok(());
    }
    if let Some(settings) = &args.compare {
        return compare(&model, &args, settings);
    }
    let mut scratch = scratch_for(&model, args.threads, args.jobs_per_thread)?;
    let mut logits = Vec::new();
    let mut decode_logits = Vec::new();
    for &item in &args.work {
        let prepared = prepare(&model, &mut scratch, item, args.steps)?;
        let out = match item {
            Item::Prefill(_) | Item::Chunk(_) => &mut logits,
            Item::Decode(_) | Item::Step(_) => &mut decode_logits,
        };
        let mut regions = Vec::new();
        let mut best = 0.0f64;
        for _ in 0..args.repeat {
            best = best.max(measure(&model, &mut scratch, &prepared, out)?);
            keep_regions(&mut regions);
        }
        println!("{} tok/s {best:.1}", item.label());
        if args.regions {
            print_regions(&item.label().replace(' ', ":"), &regions, args.threads);
        }
    }
    for (path, values) in [
        (&args.logits, &logits),
        (&args.decode_logits, &decode_logits),
    ] {
        if let Some(path) = path {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// A scratch on `threads` threads, cut into `jobs` jobs per thread when given.
fn scratch_for(model: &Model, threads: usize, jobs: Option<usize>) -> Result<Scratch, String> {
    let mut scratch = Scratch::with_threads(model.config(), threads).map_err(|e| e.to_string())?;
    if let Some(jobs) = jobs {
        scratch
            .set_jobs_per_thread(jobs)
            .map_err(|e| e.to_string())?;
    }
    Ok(scratch)
}

/// One setting of `--compare`: its name as given, and the scratches it runs on (one, or one
/// per process-like pass for `Nx1`).
struct Contender {
    name: String,
    scratches: Vec<Scratch>,
}

/// Parses `T`, `TjJ` or `Nx1` (see `--compare`).
fn contender(model: &Model, name: &str) -> Result<Contender, String> {
    let number = |text: &str| -> Result<usize, String> {
        match text.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "--compare setting {name:?}: expected T, TjJ or Nx1 with counts of at least 1"
            )),
        }
    };
    let scratches = if let Some(apart) = name.strip_suffix("x1") {
        (0..number(apart)?)
            .map(|_| scratch_for(model, 1, None))
            .collect::<Result<_, _>>()?
    } else if let Some((threads, jobs)) = name.split_once('j') {
        vec![scratch_for(model, number(threads)?, Some(number(jobs)?))?]
    } else {
        vec![scratch_for(model, number(name)?, None)?]
    };
    Ok(Contender {
        name: name.to_string(),
        scratches,
    })
}

/// One measurement of `prepared` by `contender`: its scratches' passes run at the same time
/// (one OS thread each), and their rates add up. Each pass's logits must be `expected`'s bits
/// (the first measurement of the item sets them).
fn measure_contender(
    model: &Model,
    contender: &mut Contender,
    prepared: &Prepared,
    expected: &mut Option<Vec<f32>>,
) -> Result<f64, String> {
    let outcomes: Vec<Result<(f64, Vec<f32>), String>> = if contender.scratches.len() == 1 {
        let mut logits = Vec::new();
        let rate = measure(model, &mut contender.scratches[0], prepared, &mut logits);
        vec![rate.map(|rate| (rate, logits))]
    } else {
        let barrier = std::sync::Barrier::new(contender.scratches.len());
        std::thread::scope(|scope| {
            let handles: Vec<_> = contender
                .scratches
                .iter_mut()
                .map(|scratch| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        let mut logits = Vec::new();
                        barrier.wait();
                        measure(model, scratch, prepared, &mut logits).map(|rate| (rate, logits))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a pass panicked".into())))
                .collect()
        })
    };
    let mut total = 0.0;
    for outcome in outcomes {
        let (rate, logits) = outcome?;
        match expected {
            None => *expected = Some(logits),
            Some(bits) => {
                let same = bits.len() == logits.len()
                    && bits
                        .iter()
                        .zip(&logits)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(format!(
                        "{}: the logits of setting {} differ from the first measurement's bits",
                        prepared.item.label(),
                        contender.name
                    ));
                }
            }
        }
        total += rate;
    }
    Ok(total)
}

/// `--compare`: every round measures each item once per setting, back to back (the order
/// reversed every other round), so a drift of the machine's speed hits all settings alike;
/// then per item and setting the median rate, and the per-round ratio to the first setting
/// (median, quartiles, extremes).
fn compare(model: &Model, args: &Args, names: &[String]) -> Result<(), String> {
    let mut contenders = names
        .iter()
        .map(|name| contender(model, name))
        .collect::<Result<Vec<_>, _>>()?;
    let mut setup = Scratch::new(model.config());
    let prepared = args
        .work
        .iter()
        .map(|&item| prepare(model, &mut setup, item, args.steps))
        .collect::<Result<Vec<_>, _>>()?;
    // rates[item][setting][round]
    let mut rates = vec![vec![Vec::with_capacity(args.rounds); names.len()]; prepared.len()];
    let mut expected = vec![None; prepared.len()];
    for round in 1..=args.rounds {
        let mut order: Vec<usize> = (0..names.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        for (i, prepared) in prepared.iter().enumerate() {
            for &c in &order {
                let rate =
                    measure_contender(model, &mut contenders[c], prepared, &mut expected[i])?;
                rates[i][c].push(rate);
            }
            print!("round {round} {}", prepared.item.label());
            for (c, name) in names.iter().enumerate() {
                print!(" {name} {:.1}", rates[i][c][round - 1]);
            }
            println!(" load {}", load());
        }
    }
    for (i, prepared) in prepared.iter().enumerate() {
        for (c, name) in names.iter().enumerate() {
            let mut own = rates[i][c].clone();
            print!(
                "median {} {name} tok/s {:.1}",
                prepared.item.label(),
                quantile(&mut own, 0.5)
            );
            if c > 0 {
                let mut ratios: Vec<f64> = rates[i][c]
                    .iter()
                    .zip(&rates[i][0])
                    .map(|(r, base)| r / base)
                    .collect();
                print!(
                    " ratio {:.3} iqr {:.3}-{:.3} min {:.3} max {:.3}",
                    quantile(&mut ratios, 0.5),
                    quantile(&mut ratios, 0.25),
                    quantile(&mut ratios, 0.75),
                    quantile(&mut ratios, 0.0),
                    quantile(&mut ratios, 1.0)
                );
            }
            println!(" rounds {}", args.rounds);
        }
    }
    println!("bits equal in every measurement");
    Ok(())
}

/// The `p` quantile of `values` (linear between the two nearest ranks).
fn quantile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let Some(last) = values.len().checked_sub(1) else {
        return f64::NAN;
    };
    let at = p * last as f64;
    let (low, high) = (at.floor() as usize, at.ceil() as usize);
    values[low] + (values[high] - values[low]) * (at - low as f64)
}

/// The one-minute load average, or `-` where the system does not say.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "-".into())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
