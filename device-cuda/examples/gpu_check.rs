//! `cargo xtask gpu-check` runs this on a machine with an NVIDIA GPU: every kernel on the
//! `CudaRuntime` against the same inputs on `SimRuntime`, router steps (prefill, decode, and a
//! speculative verification with its rewind) on both, the router's
//! effects on both from the same spill images (outcomes, images and state rows bit for bit), and the
//! device-to-device bandwidth of the copies the effects make (slot compaction, snapshot copies,
//! the spill gather) against one plain `cuMemcpyDtoDAsync` of the same bytes (target: at least
//! 80%). Without a usable device it prints the runtime's typed reason and exits with status 2,
//! having checked nothing.

use std::time::Instant;

use device_cuda::kernels::{self, BlockShape};
use device_cuda::{
    CudaRouter, CudaRouterConfig, CudaRuntime, DType, DeviceBuffer, Gemm, Runtime, SimRuntime,
    Stream,
};
use model::{Config, Model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const S: Stream = Stream::Compute;

fn upload(rt: &dyn Runtime, bytes: &[u8]) -> DeviceBuffer {
    let buffer = rt.alloc(bytes.len()).expect("alloc");
    rt.upload(buffer.all(), bytes, S).expect("upload");
    buffer
}

fn download(rt: &dyn Runtime, buffer: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buffer.bytes()];
    rt.download(&mut out, buffer.all(), S).expect("download");
    out
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Runs `case` on both runtimes and compares the output bytes: exactly, or as f32 within `tol`.
fn compare(
    name: &str,
    gpu: &dyn Runtime,
    sim: &dyn Runtime,
    tol: Option<f32>,
    case: &dyn Fn(&dyn Runtime) -> Vec<u8>,
) -> bool {
    let a = case(gpu);
    let b = case(sim);
    let ok = match tol {
        None => a == b,
        Some(tol) => floats(&a)
            .iter()
            .zip(floats(&b))
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs())),
    };
    println!(
        "gpu-check: kernel {name:<28} {}",
        if ok { "ok" } else { "MISMATCH" }
    );
    ok
}

fn kernel_checks(gpu: &dyn Runtime, sim: &dyn Runtime) -> bool {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let (rows, dim, vocab) = (7usize, 1000usize, 4099usize);
    let x: Vec<f32> = (0..rows * dim)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let w: Vec<f32> = (0..dim).map(|_| rng.random_range(-2.0..2.0)).collect();
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.random_range(-9.0..9.0))
        .collect();
    let mask: Vec<u8> = (0..rows * vocab)
        .map(|_| u8::from(rng.random_bool(0.4)))
        .collect();
    let pool: Vec<u8> = (0..64 * 1024 * 4).map(|_| rng.random()).collect();
    let ids: Vec<u32> = vec![5, 63, 0, 17, 17, 40];
    let mut ok = true;
    ok &= compare("rmsnorm_f32", gpu, sim, Some(1e-5), &|rt| {
        let (xb, wb, out) = (
            upload(rt, &f32_bytes(&x)),
            upload(rt, &f32_bytes(&w)),
            rt.alloc(rows * dim * 4).unwrap(),
        );
        kernels::rmsnorm(
            rt,
            S,
            out.all(),
            xb.all(),
            wb.all(),
            DType::F32,
            rows,
            dim,
            1e-5,
        )
        .unwrap();
        download(rt, &out)
    });
    ok &= compare("argmax_rows", gpu, sim, None, &|rt| {
        let (l, out, feed) = (
            upload(rt, &f32_bytes(&logits)),
            rt.alloc(rows * 4).unwrap(),
            rt.alloc(rows * 4).unwrap(),
        );
        kernels::argmax(
            rt,
            S,
            l.all(),
            None,
            rows,
            vocab,
            out.all(),
            Some(feed.all()),
        )
        .unwrap();
        [download(rt, &out), download(rt, &feed)].concat()
    });
    ok &= compare("argmax_masked_rows", gpu, sim, None, &|rt| {
        let (l, m, out) = (
            upload(rt, &f32_bytes(&logits)),
            upload(rt, &mask),
            rt.alloc(rows * 4).unwrap(),
        );
        kernels::argmax(rt, S, l.all(), Some(m.all()), rows, vocab, out.all(), None).unwrap();
        download(rt, &out)
    });
    ok &= compare("embedding_gather_bf16", gpu, sim, None, &|rt| {
        let table: Vec<u8> = pool[..vocab.min(64) * 2 * 256].to_vec();
        let t = upload(rt, &table);
        let tokens: Vec<u8> = [3u32, 0, 63, 64, 9]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let tb = upload(rt, &tokens);
        let out = rt.alloc(5 * 256 * 4).unwrap();
        kernels::embedding_gather(rt, S, out.all(), t.all(), DType::Bf16, tb.all(), 5, 256, 64)
            .unwrap();
        download(rt, &out)
    });
    ok &= compare("gather/scatter_blocks", gpu, sim, None, &|rt| {
        let p = upload(rt, &pool);
        let idb = upload(
            rt,
            &ids.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let shape = BlockShape {
            count: ids.len(),
            words: 1024,
            pool_blocks: 64,
        };
        let staging = rt.alloc(ids.len() * 4096).unwrap();
        kernels::gather_blocks(rt, S, staging.all(), p.all(), idb.all(), shape).unwrap();
        let fresh = rt.alloc(pool.len()).unwrap();
        kernels::scatter_blocks(rt, S, fresh.all(), staging.all(), idb.all(), shape).unwrap();
        [download(rt, &staging), download(rt, &fresh)].concat()
    });
    ok &= compare("f32_to_bf16_n", gpu, sim, None, &|rt| {
        let input = upload(rt, &f32_bytes(&x));
        let out = rt.alloc(x.len() * 2).unwrap();
        kernels::f32_to_bf16(rt, S, out.all(), input.all(), x.len()).unwrap();
        download(rt, &out)
    });
    ok &= compare("gemm f32 (cuBLAS)", gpu, sim, Some(1e-4), &|rt| {
        let (a, b) = (
            upload(rt, &f32_bytes(&x[..rows * 256])),
            upload(rt, &f32_bytes(&logits[..33 * 256])),
        );
        let c = rt.alloc(rows * 33 * 4).unwrap();
        rt.gemm(
            &Gemm {
                m: rows,
                n: 33,
                k: 256,
                dtype: DType::F32,
                a: a.all(),
                b: b.all(),
                c: c.all(),
            },
            S,
        )
        .unwrap();
        download(rt, &c)
    });
    ok
}

/// Seconds per repetition of `work`, after one warm-up, over `reps` repetitions.
fn time(rt: &dyn Runtime, reps: u32, work: &dyn Fn()) -> f64 {
    work();
    rt.sync_stream(S).unwrap();
    let start = Instant::now();
    for _ in 0..reps {
        work();
    }
    rt.sync_stream(S).unwrap();
    start.elapsed().as_secs_f64() / f64::from(reps)
}

fn bandwidth(rt: &dyn Runtime) -> bool {
    // NemotronH-8B-like state slot: 27 Mamba layers of ((4-1) x 8448 + 128 x 64 x 128) f32.
    let slot = 27 * (3 * 8448 + 128 * 64 * 128) * 4;
    let slots = 16;
    let states = rt.alloc(slot * slots * 2).unwrap();
    let total = slot * slots;
    let (src, dst) = (
        states.range(0, total).unwrap(),
        states.range(total, total).unwrap(),
    );
    let plain = time(rt, 20, &|| rt.copy(dst, src, S).unwrap());
    let per_slot = time(rt, 20, &|| {
        for i in 0..slots {
            rt.copy(
                dst.range(i * slot, slot).unwrap(),
                src.range(i * slot, slot).unwrap(),
                S,
            )
            .unwrap();
        }
    });
    // Spill gather: 2048 KV blocks of 8B-like size (4 attention layers x K,V x 16 x 8 x 128 f32)
    // out of a pool of 4096, in a scattered order.
    let words = 4 * 2 * 16 * 8 * 128;
    let pool = rt.alloc(4096 * words * 4).unwrap();
    let staging = rt.alloc(2048 * words * 4).unwrap();
    let ids: Vec<u8> = (0..2048u32)
        .flat_map(|i| ((i * 2654435761) % 4096).to_le_bytes())
        .collect();
    let id_buf = upload(rt, &ids);
    let shape = BlockShape {
        count: 2048,
        words,
        pool_blocks: 4096,
    };
    let gather = time(rt, 10, &|| {
        kernels::gather_blocks(rt, S, staging.all(), pool.all(), id_buf.all(), shape).unwrap()
    });
    let gather_plain = time(rt, 10, &|| {
        rt.copy(staging.all(), pool.range(0, staging.bytes()).unwrap(), S)
            .unwrap()
    });
    let gbs = |bytes: usize, secs: f64| 2.0 * bytes as f64 / secs / 1e9;
    let mut ok = true;
    for (what, bytes, secs, reference) in [
        (
            "compaction/snapshot (per-slot copies)",
            total,
            per_slot,
            plain,
        ),
        (
            "spill gather (gather_blocks kernel)",
            staging.bytes(),
            gather,
            gather_plain,
        ),
    ] {
        let ratio = reference / secs;
        println!(
            "gpu-check: bandwidth {what:<38} {:8.1} GB/s read+write, plain cuMemcpyDtoDAsync {:8.1} GB/s, ratio {:5.1}% (target >= 80%) {}",
            gbs(bytes, secs),
            gbs(bytes, reference),
            100.0 * ratio,
            if ratio >= 0.8 { "ok" } else { "BELOW TARGET" }
        );
        ok &= ratio >= 0.8;
    }
    ok
}

/// Router steps on both runtimes, bf16 weights: a 21-token prefill with host logits, a decode,
/// then a speculative verification (the next token and three drafts in one run, the Mamba
/// state after each draft written to the ring), `TruncateKv` keeping two positions with the
/// `SsmSnapshotRestore` of the snapshot there, and one more decode with host logits; the logits
/// agree within 1e-3 relative and the tokens are the same.
fn step_check(gpu: CudaRuntime) -> bool {
    use device_io::{DeviceIo, Effect, Readback, SeqSpec, Sequence, StepPlan};
    let model = Model::random(Config::tiny_demo(), 7).unwrap();
    let config = CudaRouterConfig {
        max_step_tokens: 64,
        ..CudaRouterConfig::new(256 << 20, 4, 256)
    };
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 256).collect();
    let run = |router: &CudaRouter| -> (Vec<f32>, Option<(u32, Vec<u32>)>) {
        let mut seq = router_book::RouterSeq::create(SeqSpec {
            id: 1,
            prompt: &prompt,
            adapter: None,
            cache_salt: None,
        });
        let mut logits = Vec::new();
        let plan = StepPlan::Prefill {
            budgets: &[64],
            readback: Readback::HostLogits { into: &mut logits },
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        router.await_result(ticket).unwrap();
        let plan = StepPlan::Decode {
            tokens: &[model::parity::argmax(&logits)],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        let token = router.await_result(ticket).unwrap().rows[0].token;
        let next = token.unwrap_or(0);
        let inputs = [next, 7, 11, 13];
        let mut verified = Vec::new();
        let plan = StepPlan::Verify {
            inputs: &[&inputs],
            snapshots: &[&[0, 1, 2]],
            readback: Readback::HostLogits {
                into: &mut verified,
            },
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        let argmax = router.await_result(ticket).unwrap().tokens;
        let keep = seq.computed_len - 2;
        router
            .apply(Effect::TruncateKv {
                seq: &mut seq,
                len: keep,
            })
            .unwrap();
        router
            .apply(Effect::SsmSnapshotRestore {
                seq: &mut seq,
                slot: 1,
            })
            .unwrap();
        let mut after = Vec::new();
        let plan = StepPlan::Decode {
            tokens: &[argmax[1]],
            readback: Readback::HostLogits { into: &mut after },
        };
        let ticket = router.launch(plan, &mut [&mut seq]).unwrap();
        router.await_result(ticket).unwrap();
        router
            .apply(Effect::ReleaseSeq {
                seq: &mut seq,
                cache: false,
                what: "done",
            })
            .unwrap();
        logits.extend(verified);
        logits.extend(after);
        (logits, token.map(|t| (t, argmax)))
    };
    let on_gpu = CudaRouter::new(&model, Box::new(gpu), config.clone()).unwrap();
    let on_sim = CudaRouter::sim(&model, config).unwrap();
    let (a, ta) = run(&on_gpu);
    let (b, tb) = run(&on_sim);
    let ok = ta == tb
        && a.len() == b.len()
        && a.iter()
            .zip(&b)
            .all(|(x, y)| (x - y).abs() <= 1e-3 * (1.0 + y.abs()));
    println!(
        "gpu-check: router prefill, decode and verify steps (bf16 weights) vs SimRuntime {}",
        if ok { "ok" } else { "MISMATCH" }
    );
    ok
}

/// An image of sequence `id` in the shared spill format, with random KV and state.
fn random_image(router: &CudaRouter, model: &Model, id: u64, computed: usize) -> Vec<u8> {
    let plan = router.plan();
    let layout = router_book::image::Layout {
        fingerprint: model.fingerprint(),
        block_size: plan.block_size,
        floats_per_block: (plan.kv_block_bytes / 4) as usize,
        floats_per_slot: (plan.state_slot_bytes / 4) as usize,
        max_context: router.router_config().max_context,
        vocab_size: model.config().vocab_size,
        hidden_size: if model.has_mtp() {
            model.config().hidden_size
        } else {
            0
        },
    };
    let mut rng = ChaCha8Rng::seed_from_u64(id);
    let blocks = computed.div_ceil(plan.block_size);
    let tokens: Vec<u32> = (0..computed).map(|_| rng.random_range(0..256)).collect();
    let kv: Vec<f32> = (0..blocks * layout.floats_per_block)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let state: Vec<f32> = (0..layout.floats_per_slot)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let header = router_book::image::ImageHeader {
        seq_id: id,
        prompt_len: computed,
        computed_len: computed,
        adapter: None,
        cache_salt: None,
    };
    router_book::image::encode(&layout, &header, &tokens, blocks, &kv, &state, None)
}

/// One script of effects; answers every outcome, the images saved and the state rows.
fn effects_script(router: &CudaRouter, model: &Model) -> Vec<String> {
    use device_io::{DeviceIo, Effect, SeqSpec, Sequence};
    let mut log = Vec::new();
    let mut seqs: Vec<device_cuda::CudaSeq> = (1..=3)
        .map(|id| {
            device_cuda::CudaSeq::create(SeqSpec {
                id,
                prompt: &[1],
                adapter: None,
                cache_salt: None,
            })
        })
        .collect();
    for (s, computed) in seqs.iter_mut().zip([37, 32, 5]) {
        let image = random_image(router, model, s.id(), computed);
        let outcome = router.apply(Effect::RestoreSequenceState {
            seq: s,
            reader: &mut &image[..],
        });
        log.push(format!("restore {}: {outcome:?}", s.id()));
    }
    let [a, b, c] = &mut seqs[..] else {
        unreachable!("three sequences")
    };
    let ring = router.plan().live_slots + router.plan().checkpoint_slots;
    log.push(format!(
        "{:?}",
        router.apply(Effect::SsmSnapshotSave { seq: a, slot: 0 })
    ));
    let zeros = vec![0u8; router.plan().state_slot_bytes as usize];
    router
        .write_state_row(0, &zeros)
        .expect("write a state row");
    log.push(format!(
        "{:?}",
        router.apply(Effect::SsmSnapshotRestore { seq: a, slot: 0 })
    ));
    b.checkpoint_due = true;
    log.push(format!(
        "{:?}",
        router.apply(Effect::MarconiCheckpoint { seq: b })
    ));
    log.push(format!(
        "{:?}",
        router.apply(Effect::ReleaseSeq {
            seq: a,
            cache: true,
            what: "finish"
        })
    ));
    log.push(format!(
        "{:?}",
        router.apply(Effect::CompactSlot { seq: c, target: 0 })
    ));
    log.push(format!("{:?}", router.apply(Effect::DetachSlot { seq: b })));
    log.push(format!("{:?}", router.apply(Effect::ReserveKv { seq: c })));
    log.push(format!("{:?}", router.apply(Effect::Rollback { seq: c })));
    log.push(format!("{:?}", router.apply(Effect::SyncSecondary)));
    for stream in [0, 1] {
        log.push(format!("{:?}", router.apply(Effect::Quiesce { stream })));
    }
    let mut image = Vec::new();
    log.push(format!(
        "{:?}",
        router.apply(Effect::SaveSequenceState {
            seq: c,
            writer: &mut image
        })
    ));
    log.push(format!("image of c: {image:?}"));
    for row in 0..ring + router.plan().snapshot_slots {
        log.push(format!("row {row}: {:?}", router.read_state_row(row)));
    }
    log.push(format!("{:?}", router.facts()));
    for s in [b, c] {
        log.push(format!(
            "{:?}",
            router.apply(Effect::ReleaseSeq {
                seq: s,
                cache: false,
                what: "finish"
            })
        ));
    }
    log
}

/// The router's effects on the GPU and on `SimRuntime`, from the same spill images: every
/// outcome, the image saved and every state row must be the same bits.
fn effects_check(gpu: Box<dyn Runtime>) -> bool {
    use device_io::DeviceIo;
    let model = Model::random(Config::tiny_demo(), 7).unwrap();
    let config = CudaRouterConfig {
        max_step_tokens: 64,
        ..CudaRouterConfig::new(64 << 20, 4, 256)
    };
    let on_gpu = CudaRouter::new(&model, gpu, config.clone()).unwrap();
    let on_sim = CudaRouter::sim(&model, config).unwrap();
    let a = effects_script(&on_gpu, &model);
    let b = effects_script(&on_sim, &model);
    let ok = a == b;
    println!(
        "gpu-check: effects (restore, snapshots, checkpoint, release, compaction, detach, reserve/rollback, streams, spill) vs SimRuntime {}",
        if ok { "ok" } else { "MISMATCH" }
    );
    if !ok {
        for (x, y) in a.iter().zip(&b) {
            if x != y {
                println!(
                    "gpu-check:   GPU {}\n gpu-check:   sim {}",
                    &x[..x.len().min(200)],
                    &y[..y.len().min(200)]
                );
                break;
            }
        }
    }
    let torn = Box::new(on_gpu).teardown().is_ok() && Box::new(on_sim).teardown().is_ok();
    ok && torn
}

fn main() {
    let gpu = match CudaRuntime::new() {
        Ok(rt) => rt,
        Err(err) => {
            println!("gpu-check: no usable GPU, checked nothing: {err}");
            std::process::exit(2);
        }
    };
    println!(
        "gpu-check: device {} (driver CUDA {})",
        gpu.device_name(),
        gpu.driver_version()
    );
    let sim = SimRuntime::new().unwrap();
    let mut ok = kernel_checks(&gpu, &sim);
    ok &= bandwidth(&gpu);
    ok &= step_check(gpu);
    match CudaRuntime::new() {
        Ok(gpu) => ok &= effects_check(Box::new(gpu)),
        Err(err) => {
            println!("gpu-check: effects: could not open the device again: {err}");
            ok = false;
        }
    }
    if ok {
        println!("gpu-check: all checks passed");
    } else {
        println!("gpu-check: FAILED");
        std::process::exit(1);
    }
}
