//! Expert parallelism: the MoE layers' routed experts on 1, 2 or 4 worker threads give the same
//! bits as without workers (prefill and decode, alone and batched); a worker that dies fails the
//! step with a typed error; shutdown stops the workers and later MoE layers are refused.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{bits, tiny};
use model::{DecodeRow, ExpertPool, KvPool, MambaStates, Model, ModelError, PrefillRow, Scratch};

/// Two sequences (prompts of 37 and 20 tokens) prefilled, then decoded together for 4 steps;
/// every logit of every call, and the final states.
fn run(model: &Model, scratch: &mut Scratch) -> Result<(Vec<u32>, Vec<u32>), ModelError> {
    let config = model.config();
    let vocab = config.vocab_size as u32;
    let mut kv = KvPool::new(config, 8, 16)?;
    let mut states = MambaStates::new(config, 2)?;
    let tables: [Vec<u32>; 2] = [vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
    let mut all = Vec::new();
    let mut logits = Vec::new();
    let mut next = [0u32; 2];
    let lengths = [37usize, 20];
    for (slot, &len) in lengths.iter().enumerate() {
        let tokens: Vec<u32> = (0..len as u32)
            .map(|t| (t * 13 + 5 * slot as u32) % vocab)
            .collect();
        let row = PrefillRow {
            tokens: &tokens,
            start_pos: 0,
            blocks: &tables[slot],
            slot,
        };
        model.prefill(scratch, &mut kv, &mut states, row, true, &mut logits)?;
        all.extend_from_slice(&logits);
        next[slot] = model::parity::argmax(&logits[logits.len() - vocab as usize..]);
    }
    for step in 0..4 {
        let rows: Vec<DecodeRow<'_>> = (0..2)
            .map(|slot| DecodeRow {
                token: next[slot],
                pos: lengths[slot] + step,
                blocks: &tables[slot],
                slot,
            })
            .collect();
        model.decode(scratch, &mut kv, &mut states, &rows, &mut logits)?;
        all.extend_from_slice(&logits);
        for (slot, token) in next.iter_mut().enumerate() {
            *token = model::parity::argmax(&logits[slot * vocab as usize..][..vocab as usize]);
        }
    }
    let mut state = states.slot(0)?.to_vec();
    state.extend_from_slice(states.slot(1)?);
    Ok((bits(&all), bits(&state)))
}

#[test]
fn experts_on_workers_give_the_same_bits_for_any_worker_count() {
    let model = tiny();
    let reference = run(&model, &mut Scratch::new(model.config())).unwrap();
    for (workers, threads) in [(1, 1), (2, 2), (4, 3)] {
        let pool = Arc::new(ExpertPool::start(&model, workers).unwrap());
        assert_eq!(pool.workers(), workers);
        let mut scratch = Scratch::with_threads(model.config(), threads).unwrap();
        scratch.set_expert_pool(Some(Arc::clone(&pool)));
        let got = run(&model, &mut scratch).unwrap();
        assert!(
            got.0 == reference.0,
            "logits differ with {workers} expert workers"
        );
        assert!(
            got.1 == reference.1,
            "state differs with {workers} expert workers"
        );
        pool.shutdown();
        assert!(!pool.running());
    }
}

#[test]
fn a_dead_worker_fails_the_step_and_shutdown_refuses_later_layers() {
    let model = tiny();
    let pool = Arc::new(ExpertPool::start(&model, 2).unwrap());
    let mut scratch = Scratch::new(model.config());
    scratch.set_expert_pool(Some(Arc::clone(&pool)));
    run(&model, &mut scratch).unwrap();
    pool.crash_worker(1);
    let err = run(&model, &mut scratch).unwrap_err();
    assert!(
        matches!(err, ModelError::ExpertWorkerLost { worker: 1 }),
        "{err}"
    );
    pool.shutdown();
    assert!(!pool.running());
    let err = run(&model, &mut scratch).unwrap_err();
    assert!(matches!(err, ModelError::ExpertWorkersStopped), "{err}");
    // A pool of no workers is refused with a typed error.
    assert!(matches!(
        ExpertPool::start(&model, 0),
        Err(ModelError::InvalidConfig {
            field: "expert_workers",
            ..
        })
    ));
}

/// The MTP head's MoE layer (the tiny fixture's MTP pattern is `*E`) runs on the workers too:
/// a prompt's runs through the main stack and the MTP head give the same bits with 1 or 2
/// workers as without.
#[test]
fn the_mtp_heads_experts_run_on_the_workers_with_the_same_bits() {
    use model::{RunOutputs, RunRow};
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nemotron-h-tiny/mtp/model");
    let model = Model::load(&dir).unwrap();
    assert!(model.has_mtp());
    let config = model.config();
    let run = |scratch: &mut Scratch| -> Result<Vec<u32>, ModelError> {
        let mut kv = KvPool::new(config, 4, 16)?;
        let mut states = MambaStates::new(config, 1)?;
        let tokens: Vec<u32> = (0..21u32).map(|t| (t * 7 + 3) % 64).collect();
        let blocks = [0, 1];
        let run = RunRow {
            tokens: &tokens,
            start_pos: 0,
            blocks: &blocks,
            slot: 0,
            snapshots: &[],
        };
        let (mut logits, mut hidden) = (Vec::new(), Vec::new());
        let (mut mtp_logits, mut mtp_out) = (Vec::new(), Vec::new());
        model.forward_runs(
            scratch,
            &mut kv,
            &mut states,
            &[run],
            RunOutputs::All,
            &mut logits,
            Some(&mut hidden),
        )?;
        let next: Vec<u32> = tokens[1..].iter().copied().chain([9]).collect();
        let run = RunRow {
            tokens: &next,
            ..run
        };
        model.mtp(
            scratch,
            &mut kv,
            &mut states,
            &[run],
            &hidden,
            RunOutputs::All,
            &mut mtp_logits,
            &mut mtp_out,
        )?;
        let mut all = logits;
        all.extend_from_slice(&mtp_logits);
        all.extend_from_slice(&mtp_out);
        all.extend_from_slice(states.slot(0)?);
        Ok(bits(&all))
    };
    let reference = run(&mut Scratch::new(config)).unwrap();
    for workers in [1, 2] {
        let pool = Arc::new(ExpertPool::start(&model, workers).unwrap());
        let mut scratch = Scratch::new(config);
        scratch.set_expert_pool(Some(Arc::clone(&pool)));
        let got = run(&mut scratch).unwrap();
        assert!(
            got == reference,
            "bits differ with {workers} expert workers"
        );
        pool.shutdown();
    }
}
