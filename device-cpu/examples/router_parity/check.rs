//! The fixture parity check through `DeviceIo` only, shared by the `parity` example and the
//! crate's fixture test: every case is run twice on one router with the prefix cache on (the second
//! run is served from what the first left in the cache), and both runs are compared with the
//! reference logits and greedy ids.

use std::path::Path;

use device_cpu::{CpuRouter, CpuRouterConfig, CpuSeq};
use device_io::{DeviceIo, Effect, Readback, SeqSpec, Sequence, StepPlan};
use model::parity::{argmax, max_abs_diff};
use model::Model;

/// The outcome of one run of one case.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The case's index in `cases.json`.
    pub case: usize,
    /// 1 for the first run, 2 for the run served from the cache.
    pub run: usize,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached: usize,
    /// Max |router - reference| over the last prompt position's logits.
    pub prompt_diff: f32,
    /// Max |router - reference| over the 12 decode steps' logits.
    pub decode_diff: f32,
    /// Whether every greedy id matched.
    pub greedy_ok: bool,
    /// Whether this run's logits have the same bits as the first run's.
    pub same_bits_as_first: bool,
}

impl RunReport {
    /// Whether the run passed at tolerance `tol`.
    pub fn ok(&self, tol: f32) -> bool {
        self.prompt_diff <= tol
            && self.decode_diff <= tol
            && self.greedy_ok
            && self.same_bits_as_first
    }
}

struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    prompt_last: Vec<f32>,
    decode: Vec<Vec<f32>>,
}

fn read_tensor(
    tensors: &safetensors::SafeTensors<'_>,
    name: &str,
) -> Result<(Vec<usize>, Vec<f32>), String> {
    let view = tensors
        .tensor(name)
        .map_err(|e| format!("tensor {name}: {e}"))?;
    if view.dtype() != safetensors::Dtype::F32 {
        return Err(format!("tensor {name} is {:?}, expected F32", view.dtype()));
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((view.shape().to_vec(), data))
}

fn ids(value: &serde_json::Value, field: &str) -> Result<Vec<u32>, String> {
    value[field]
        .as_array()
        .ok_or_else(|| format!("cases.json: `{field}` is not a list"))?
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| format!("cases.json: `{field}` holds {v}, not a token id"))
        })
        .collect()
}

fn load_cases(dir: &Path) -> Result<Vec<Case>, String> {
    let json =
        std::fs::read_to_string(dir.join("cases.json")).map_err(|e| format!("cases.json: {e}"))?;
    let json: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| format!("cases.json: {e}"))?;
    let bytes = std::fs::read(dir.join("expected.safetensors"))
        .map_err(|e| format!("expected.safetensors: {e}"))?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("expected.safetensors: {e}"))?;
    let cases = json["cases"]
        .as_array()
        .ok_or("cases.json: no `cases` list")?;
    let mut out = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let prompt = ids(case, "prompt_ids")?;
        let greedy = ids(case, "greedy_ids")?;
        let (shape, prompt_logits) = read_tensor(&tensors, &format!("case{i}.prompt_logits"))?;
        let vocab = shape[1];
        let last = prompt_logits[(shape[0] - 1) * vocab..].to_vec();
        let (dshape, decode_logits) = read_tensor(&tensors, &format!("case{i}.decode_logits"))?;
        let decode = decode_logits
            .chunks_exact(dshape[1])
            .map(<[f32]>::to_vec)
            .collect();
        out.push(Case {
            prompt,
            greedy,
            prompt_last: last,
            decode,
        });
    }
    Ok(out)
}

/// Runs one case as the core would: prefill in chunks of `chunk`, then 12 decode steps feeding the
/// reference's greedy ids, taking the Marconi checkpoints the router asks for, then a cached
/// release. Returns the logits of every token position and the cached token count.
fn run_case(
    router: &CpuRouter,
    id: u64,
    case: &Case,
    chunk: usize,
) -> Result<(Vec<Vec<f32>>, usize), String> {
    let mut seq = CpuSeq::create(SeqSpec {
        id,
        prompt: &case.prompt,
        adapter: None,
        cache_salt: None,
    });
    let mut host = Vec::new();
    let mut cached = 0;
    let mut rows = Vec::new();
    while !seq.prefill_done() {
        let ticket = router
            .launch(
                StepPlan::Prefill {
                    budgets: &[chunk],
                    readback: Readback::HostLogits { into: &mut host },
                },
                &mut [&mut seq],
            )
            .map_err(|e| format!("prefill: {e}"))?;
        let result = router
            .await_result(ticket)
            .map_err(|e| format!("await: {e}"))?;
        let report = result.rows[0]
            .prefill
            .ok_or("prefill row without a report")?;
        cached += report.cached;
        if report.done {
            rows.push(host.clone());
        }
    }
    for &token in &case.greedy[..case.decode.len()] {
        let ticket = router
            .launch(
                StepPlan::Decode {
                    tokens: &[token],
                    readback: Readback::HostLogits { into: &mut host },
                },
                &mut [&mut seq],
            )
            .map_err(|e| format!("decode: {e}"))?;
        router
            .await_result(ticket)
            .map_err(|e| format!("await: {e}"))?;
        rows.push(host.clone());
        if seq.checkpoint_due() {
            router
                .apply(Effect::MarconiCheckpoint { seq: &mut seq })
                .map_err(|e| format!("checkpoint: {e}"))?;
        }
    }
    router
        .apply(Effect::ReleaseSeq {
            seq: &mut seq,
            cache: true,
            what: "finish",
        })
        .map_err(|e| format!("release: {e}"))?;
    Ok((rows, cached))
}

/// Checks every case of the fixture folder `dir` (`dir/model/`, `dir/expected.safetensors`,
/// `dir/cases.json`), each case twice, on one router with the prefix cache on.
pub fn check_fixture(dir: &Path) -> Result<Vec<RunReport>, String> {
    let model = Model::load(&dir.join("model")).map_err(|e| format!("model: {e}"))?;
    let cases = load_cases(dir)?;
    let longest = cases
        .iter()
        .map(|c| c.prompt.len() + c.decode.len() + 1)
        .max()
        .unwrap_or(1);
    let mut config = CpuRouterConfig::new(8 * longest.div_ceil(16) + 8, 4);
    config.max_context = Some(longest.div_ceil(16) * 16);
    let router = CpuRouter::new(model, config).map_err(|e| format!("router: {e}"))?;
    let mut reports = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut first = None;
        for run in 1..=2 {
            // The first run prefills in one chunk, the second in chunks of 7 after its cached prefix.
            let chunk = if run == 1 { case.prompt.len() } else { 7 };
            let (rows, cached) = run_case(&router, (2 * i + run) as u64, case, chunk)?;
            let prompt_diff = max_abs_diff(&rows[0], &case.prompt_last);
            let decode_diff = rows[1..]
                .iter()
                .zip(&case.decode)
                .map(|(a, b)| max_abs_diff(a, b))
                .fold(0.0, f32::max);
            let mut greedy_ok = rows.len() == case.decode.len() + 1;
            for (j, row) in rows.iter().enumerate().take(case.decode.len()) {
                greedy_ok &= argmax(row) == case.greedy[j];
            }
            let bits: Vec<u32> = rows.iter().flatten().map(|x| x.to_bits()).collect();
            let same_bits_as_first = match &first {
                None => {
                    first = Some(bits);
                    true
                }
                Some(first) => *first == bits,
            };
            reports.push(RunReport {
                case: i,
                run,
                prompt_len: case.prompt.len(),
                cached,
                prompt_diff,
                decode_diff,
                greedy_ok,
                same_bits_as_first,
            });
        }
    }
    Ok(reports)
}
