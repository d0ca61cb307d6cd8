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
//!   --jobs-per-thread J  jobs each parallel region is cut into per thread (default: the
//!                      model's, 8; see `Scratch::set_jobs_per_thread`)
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
//! Output: one line per item, `prefill 2048 tok/s 1234.5` or `decode 32 tok/s 567.8`.

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
            "--regions" if cfg!(feature = "region-timing") => args.regions = true,
            "--regions" => {
                return Err("--regions needs the build's `--features region-timing`".into())
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(args)
}

/// A prompt of `len` tokens (deterministic; the same formula as `vs_transformers.py`).
fn prompt(len: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| ((t * 31 + seed * 7 + 3) % vocab) as u32)
        .collect()
}

fn prefill_rate(model: &Model, scratch: &mut Scratch, n: usize, logits: &mut Vec<f32>) -> f64 {
    let config = model.config();
    let blocks = n.div_ceil(BLOCK_SIZE);
    let mut kv = KvPool::new(config, blocks, BLOCK_SIZE).expect("pool");
    let mut states = MambaStates::new(config, 1).expect("states");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let tokens = prompt(n, 0, config.vocab_size);
    let row = PrefillRow {
        tokens: &tokens,
        start_pos: 0,
        blocks: &table,
        slot: 0,
    };
    discard_regions();
    let started = Instant::now();
    model
        .prefill(scratch, &mut kv, &mut states, row, false, logits)
        .expect("prefill");
    n as f64 / started.elapsed().as_secs_f64()
}

/// Tokens per second of one `CHUNK`-token prefill chunk at positions `start..start + CHUNK`, the
/// earlier positions' keys and values and the Mamba state being zeros.
fn chunk_rate(model: &Model, scratch: &mut Scratch, start: usize, logits: &mut Vec<f32>) -> f64 {
    let config = model.config();
    let blocks = (start + CHUNK).div_ceil(BLOCK_SIZE);
    let mut kv = KvPool::new(config, blocks, BLOCK_SIZE).expect("pool");
    let mut states = MambaStates::new(config, 1).expect("states");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let tokens = prompt(CHUNK, 0, config.vocab_size);
    let row = PrefillRow {
        tokens: &tokens,
        start_pos: start,
        blocks: &table,
        slot: 0,
    };
    discard_regions();
    let started = Instant::now();
    model
        .prefill(scratch, &mut kv, &mut states, row, false, logits)
        .expect("prefill");
    CHUNK as f64 / started.elapsed().as_secs_f64()
}

/// Tokens per second of `steps` greedy decode steps of `batch` sequences at positions 128 on; each
/// sequence's 128 prompt tokens are prefilled first when `warm`, else the steps run over a zeroed
/// KV cache and Mamba state from the prompt's last token. `last` receives the last step's logits.
fn decode_rate(
    model: &Model,
    scratch: &mut Scratch,
    (batch, steps): (usize, usize),
    warm: bool,
    last: &mut Vec<f32>,
) -> f64 {
    let config = model.config();
    let per_seq = (DECODE_CONTEXT + steps).div_ceil(BLOCK_SIZE);
    let mut kv = KvPool::new(config, batch * per_seq, BLOCK_SIZE).expect("pool");
    let mut states = MambaStates::new(config, batch).expect("states");
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let mut logits = Vec::new();
    let mut next = Vec::with_capacity(batch);
    for (slot, table) in tables.iter().enumerate() {
        let tokens = prompt(DECODE_CONTEXT, slot + 1, config.vocab_size);
        if !warm {
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
            .expect("prefill");
        next.push(model::parity::argmax(&logits));
    }
    let vocab = config.vocab_size;
    discard_regions();
    let started = Instant::now();
    for step in 0..steps {
        let rows: Vec<DecodeRow<'_>> = tables
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
            .decode(scratch, &mut kv, &mut states, &rows, &mut logits)
            .expect("decode");
        for (slot, token) in next.iter_mut().enumerate() {
            *token = model::parity::argmax(&logits[slot * vocab..(slot + 1) * vocab]);
        }
    }
    let rate = (batch * steps) as f64 / started.elapsed().as_secs_f64();
    *last = logits;
    rate
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
    let mut scratch =
        Scratch::with_threads(model.config(), args.threads).map_err(|e| e.to_string())?;
    if let Some(jobs) = args.jobs_per_thread {
        scratch
            .set_jobs_per_thread(jobs)
            .map_err(|e| e.to_string())?;
    }
    let mut logits = Vec::new();
    let mut decode_logits = Vec::new();
    for item in &args.work {
        let mut regions = Vec::new();
        let best = (0..args.repeat)
            .map(|_| {
                let rate = match *item {
                    Item::Prefill(n) => prefill_rate(&model, &mut scratch, n, &mut logits),
                    Item::Decode(b) => decode_rate(
                        &model,
                        &mut scratch,
                        (b, args.steps),
                        true,
                        &mut decode_logits,
                    ),
                    Item::Step(b) => decode_rate(
                        &model,
                        &mut scratch,
                        (b, args.steps),
                        false,
                        &mut decode_logits,
                    ),
                    Item::Chunk(s) => chunk_rate(&model, &mut scratch, s, &mut logits),
                };
                keep_regions(&mut regions);
                rate
            })
            .fold(0.0f64, f64::max);
        match item {
            Item::Prefill(n) => println!("prefill {n} tok/s {best:.1}"),
            Item::Decode(b) => println!("decode {b} tok/s {best:.1}"),
            Item::Chunk(s) => println!("chunk {s} tok/s {best:.1}"),
            Item::Step(b) => println!("step {b} tok/s {best:.1}"),
        }
        if args.regions {
            let name = match item {
                Item::Prefill(n) => format!("prefill:{n}"),
                Item::Decode(b) => format!("decode:{b}"),
                Item::Chunk(s) => format!("chunk:{s}"),
                Item::Step(b) => format!("step:{b}"),
            };
            print_regions(&name, &regions, args.threads);
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

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
