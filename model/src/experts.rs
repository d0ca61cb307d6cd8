//! Expert parallelism on host threads: the routed experts of every MoE layer sharded across `k`
//! worker threads that each own their experts' weights, fed over `crossbeam-channel`.
//!
//! A MoE layer sends each worker the input rows of the tokens routed to the experts it owns
//! (expert `e` lives on worker `e % k`), every worker runs its experts' MLPs on its own thread,
//! and the caller combines the outputs in ascending expert order per token, exactly as the
//! single-threaded layer does. An expert's product is the same bits whatever rows share it (see
//! `gemm`), so the output is bit-identical for every `k`, and to the layer without workers.
//!
//! Lifecycle: [`ExpertPool::start`] spawns the workers; [`ExpertPool::shutdown`] (the router's
//! `EpShutdown`) stops and joins them; dropping the pool does the same. The workers keep no
//! per-sequence state, so releasing a sequence needs no message. A worker that stops answering
//! (its thread ended, e.g. by a panic) fails the layer with [`ModelError::ExpertWorkerLost`];
//! every later layer fails the same way.

use std::sync::Mutex;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::gemm::Kernels;
use crate::math::Matmul;
use crate::weights::{Mixer, MlpWeights};
use crate::{Model, ModelError};

/// One expert's rows of one layer: `rows` inputs in, the same number of outputs back.
#[derive(Debug)]
pub(crate) struct ExpertBatch {
    pub expert: usize,
    pub rows: usize,
    /// `rows * expert_dim` inputs; replaced by the outputs on the way back.
    pub data: Vec<f32>,
}

enum ToWorker {
    Run {
        layer: usize,
        batches: Vec<ExpertBatch>,
    },
    /// Fault injection: the worker's thread ends as if it had crashed.
    Crash,
    Stop,
}

struct Worker {
    jobs: Sender<ToWorker>,
    results: Receiver<Vec<ExpertBatch>>,
    thread: Option<JoinHandle<()>>,
}

/// The expert-parallel workers of one model. See the module docs.
pub struct ExpertPool {
    workers: Mutex<Vec<Worker>>,
    count: usize,
}

impl std::fmt::Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool")
            .field("workers", &self.count)
            .field("running", &self.running())
            .finish()
    }
}

/// The experts worker `w` of `k` owns: `(layer, expert, weights)`.
type Shard = Vec<Vec<Option<MlpWeights>>>;

fn run_worker(shard: Shard, jobs: Receiver<ToWorker>, results: Sender<Vec<ExpertBatch>>) {
    let mut mm = Matmul::new(Kernels::single());
    let (mut act, mut out) = (Vec::new(), Vec::new());
    while let Ok(message) = jobs.recv() {
        match message {
            ToWorker::Run { layer, mut batches } => {
                for batch in &mut batches {
                    let Some(Some(w)) = shard.get(layer).and_then(|l| l.get(batch.expert)) else {
                        // Not this worker's expert: a caller bug; answering nothing fails the
                        // step as a lost worker would.
                        return;
                    };
                    crate::forward::mlp(
                        &mut mm,
                        w,
                        &batch.data,
                        batch.rows,
                        (&mut act, &mut out),
                        None,
                        None,
                    );
                    let len = batch.rows * w.down.out_dim;
                    batch.data.clear();
                    batch.data.extend_from_slice(&out[..len]);
                }
                if results.send(batches).is_err() {
                    return;
                }
            }
            ToWorker::Crash | ToWorker::Stop => return,
        }
    }
}

impl ExpertPool {
    /// Starts `workers` threads (at least 1) holding `model`'s routed experts (the MTP head's
    /// too), expert `e` on worker `e % workers`.
    pub fn start(model: &Model, workers: usize) -> Result<ExpertPool, ModelError> {
        if workers == 0 {
            return Err(ModelError::InvalidConfig {
                field: "expert_workers",
                value: "0".into(),
                reason: "expert parallelism needs at least one worker".into(),
            });
        }
        let mut started = Vec::with_capacity(workers);
        for w in 0..workers {
            // Layers numbered as the forward pass names them: the main stack's, then the MTP
            // head's.
            let mtp_layers = model.weights.mtp.iter().flat_map(|mtp| &mtp.layers);
            let shard: Shard = model
                .weights
                .layers
                .iter()
                .chain(mtp_layers)
                .map(|layer| match &layer.mixer {
                    Mixer::Moe(moe) => moe
                        .experts
                        .iter()
                        .enumerate()
                        .map(|(e, expert)| (e % workers == w).then(|| expert.clone()))
                        .collect(),
                    _ => Vec::new(),
                })
                .collect();
            let (job_tx, job_rx) = crossbeam_channel::unbounded();
            let (result_tx, result_rx) = crossbeam_channel::bounded(1);
            let thread = std::thread::Builder::new()
                .name(format!("model-experts-{w}"))
                .spawn(move || run_worker(shard, job_rx, result_tx))
                .map_err(|e| ModelError::InvalidConfig {
                    field: "expert_workers",
                    value: workers.to_string(),
                    reason: format!("worker {w} could not be started: {e}"),
                })?;
            started.push(Worker {
                jobs: job_tx,
                results: result_rx,
                thread: Some(thread),
            });
        }
        Ok(ExpertPool {
            workers: Mutex::new(started),
            count: workers,
        })
    }

    /// Workers the pool was started with.
    pub fn workers(&self) -> usize {
        self.count
    }

    /// Whether the workers are running (false after [`ExpertPool::shutdown`]).
    pub fn running(&self) -> bool {
        self.workers.lock().is_ok_and(|w| !w.is_empty())
    }

    /// Stops and joins every worker. Later layers fail with
    /// [`ModelError::ExpertWorkersStopped`]. Stopping twice does nothing.
    pub fn shutdown(&self) {
        let workers = match self.workers.lock() {
            Ok(mut workers) => std::mem::take(&mut *workers),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for worker in &workers {
            let _ = worker.jobs.send(ToWorker::Stop);
        }
        for mut worker in workers {
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
    }

    /// Fault injection for tests of the failure path: worker `worker`'s thread ends at once, as
    /// if it had crashed. The next layer that needs it fails with
    /// [`ModelError::ExpertWorkerLost`].
    pub fn crash_worker(&self, worker: usize) {
        if let Ok(workers) = self.workers.lock() {
            if let Some(w) = workers.get(worker) {
                let _ = w.jobs.send(ToWorker::Crash);
            }
        }
    }

    /// Runs `batches` (ascending expert order) of MoE layer `layer` on the workers and returns
    /// them with their outputs, in the same order.
    pub(crate) fn run(
        &self,
        layer: usize,
        batches: Vec<ExpertBatch>,
    ) -> Result<Vec<ExpertBatch>, ModelError> {
        let workers = self
            .workers
            .lock()
            .map_err(|_| ModelError::ExpertWorkersStopped)?;
        if workers.is_empty() {
            return Err(ModelError::ExpertWorkersStopped);
        }
        let k = workers.len();
        let mut per_worker: Vec<Vec<ExpertBatch>> = (0..k).map(|_| Vec::new()).collect();
        for batch in batches {
            per_worker[batch.expert % k].push(batch);
        }
        let busy: Vec<bool> = per_worker.iter().map(|b| !b.is_empty()).collect();
        for (w, batches) in per_worker.into_iter().enumerate() {
            if batches.is_empty() {
                continue;
            }
            workers[w]
                .jobs
                .send(ToWorker::Run { layer, batches })
                .map_err(|_| ModelError::ExpertWorkerLost { worker: w })?;
        }
        let mut done = Vec::new();
        let mut lost = None;
        for (w, worker) in workers.iter().enumerate() {
            if !busy[w] {
                continue;
            }
            // Every busy worker is awaited, even after one is found lost, so no answer is left
            // in a channel for the next layer to mistake for its own.
            match worker.results.recv() {
                Ok(batches) => done.extend(batches),
                Err(_) => lost = lost.or(Some(w)),
            }
        }
        if let Some(worker) = lost {
            return Err(ModelError::ExpertWorkerLost { worker });
        }
        done.sort_by_key(|batch| batch.expert);
        Ok(done)
    }
}

impl Drop for ExpertPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}
