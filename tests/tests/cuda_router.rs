//! The CUDA router (on `SimRuntime`) against the host router, with the fixture checkpoint: real
//! sequence states computed by the host router move into the CUDA router through the shared
//! spill image and back, and the same script of effects (restore, snapshots, release with the
//! cache offer, compaction, detaching, a Marconi checkpoint, reservations and rollbacks up to a
//! dry pool, misuse) leaves both routers with the same answers, the same facts, the same cache
//! events and the same images, bit for bit. Both routers have the same pool and checkpoint region, so even block
//! counts must agree. (The states come from the host router; the CUDA router's own steps against
//! the host router's are `cuda_steps.rs`.)

use device_cpu::CpuRouter;
use device_cuda::{CudaRouter, CudaRouterConfig};
use device_io::testing::{release, seq};
use device_io::{DeviceFacts, DeviceIo, Effect, EffectOutcome, Readback, Sequence, StepPlan};
use model::Model;
use router_book::{LogitsHandle, RouterSeq};
use tests::cuda_sim;

const SLOTS: usize = 4;
const CONTEXT: usize = 128;

fn fixture() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../model/tests/fixtures/nemotron-h-tiny/model"
        );
        Model::load(std::path::Path::new(dir)).unwrap()
    })
}

fn cuda_config(budget: u64) -> CudaRouterConfig {
    CudaRouterConfig {
        max_step_tokens: 64,
        ..CudaRouterConfig::new(budget, SLOTS, CONTEXT)
    }
}

/// A CUDA router with a small pool (so a script can run it dry) and the host router with the
/// same pool, slots, checkpoint region and ring.
fn pair() -> (CpuRouter, CudaRouter) {
    let model = fixture();
    let cuda = cuda_sim::with_blocks(model, cuda_config, 22);
    let plan = *cuda.plan();
    assert!(
        plan.checkpoint_slots >= 1 && plan.num_blocks < 20,
        "{plan:?}"
    );
    let cpu = cuda_sim::host_like(model, &cuda);
    assert_eq!(cpu.facts(), cuda.facts());
    (cpu, cuda)
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|i| (i * 7 + salt) % 200 + 3).collect()
}

/// Prefills `s` on the host router and decodes `decodes` tokens; answers the next token.
fn run_on_host(router: &CpuRouter, s: &mut RouterSeq, decodes: usize) -> u32 {
    let plan = StepPlan::Prefill {
        budgets: &[CONTEXT],
        readback: Readback::Argmax,
    };
    let ticket = router.launch(plan, &mut [s]).unwrap();
    let mut token = router.await_result(ticket).unwrap().rows[0].token.unwrap();
    for _ in 0..decodes {
        let plan = StepPlan::Decode {
            tokens: &[token],
            readback: Readback::Argmax,
        };
        let ticket = router.launch(plan, &mut [s]).unwrap();
        token = router.await_result(ticket).unwrap().rows[0].token.unwrap();
    }
    token
}

fn save<D: DeviceIo<Seq = RouterSeq, Ptr = LogitsHandle>>(
    router: &D,
    s: &RouterSeq,
) -> device_io::Result<Vec<u8>> {
    let mut out = Vec::new();
    router.apply(Effect::SaveSequenceState {
        seq: s,
        writer: &mut out,
    })?;
    Ok(out)
}

fn restore<D: DeviceIo<Seq = RouterSeq, Ptr = LogitsHandle>>(
    router: &D,
    s: &mut RouterSeq,
    image: &[u8],
) -> device_io::Result<EffectOutcome> {
    router.apply(Effect::RestoreSequenceState {
        seq: s,
        reader: &mut &image[..],
    })
}

/// Host-computed images: a (37-token prompt, 3 decoded: 40 positions), b (31-token prompt and
/// one decoded: 32 positions, at a block boundary) and c (a 10-token prompt).
fn host_images() -> [(u64, Vec<u32>, Vec<u8>); 3] {
    let (host, _) = pair();
    [(1, 37, 3), (2, 31, 1), (3, 10, 0)].map(|(id, len, decodes)| {
        let p = prompt(len, id as u32);
        let mut s = seq(id, &p);
        run_on_host(&host, &mut s, decodes);
        let image = save(&host, &s).unwrap();
        release(&host, &mut s, false);
        (id, p, image)
    })
}

#[test]
fn a_host_state_moves_to_the_cuda_router_and_back_bit_for_bit() {
    let (host, cuda) = pair();
    let p = prompt(37, 11);
    let mut original = seq(7, &p);
    run_on_host(&host, &mut original, 3);
    let image = save(&host, &original).unwrap();

    let mut on_cuda = seq(7, &p);
    restore(&cuda, &mut on_cuda, &image).unwrap();
    assert_eq!(on_cuda.computed_len(), 40);
    let back = save(&cuda, &on_cuda).unwrap();
    assert_eq!(back, image, "the CUDA router's image of a host state");

    // The image the CUDA router wrote resumes on the host exactly where the original is.
    let next = |s: &mut RouterSeq, token: u32| {
        let plan = StepPlan::Decode {
            tokens: &[token],
            readback: Readback::Argmax,
        };
        let ticket = host.launch(plan, &mut [s]).unwrap();
        let mut logits = Vec::new();
        let result = host.await_result(ticket).unwrap();
        host.apply(Effect::ReadLogits {
            logits: result.logits.unwrap(),
            rows: 1,
            into: &mut logits,
        })
        .unwrap();
        (result.rows[0].token.unwrap(), logits)
    };
    let last = 17;
    let want = next(&mut original, last);
    release(&host, &mut original, false);
    let mut resumed = seq(7, &p);
    restore(&host, &mut resumed, &back).unwrap();
    assert_eq!(next(&mut resumed, last), want, "token and logits bits");
    release(&host, &mut resumed, false);
    release(&cuda, &mut on_cuda, false);
    Box::new(host).teardown().unwrap();
    Box::new(cuda).teardown().unwrap();
}

/// One line per call: what it answered, then the router's facts.
fn script<D: DeviceIo<Seq = RouterSeq, Ptr = LogitsHandle>>(
    router: &D,
    images: &[(u64, Vec<u32>, Vec<u8>); 3],
) -> (Vec<String>, Vec<Vec<u8>>) {
    let mut log = Vec::new();
    let mut saved = Vec::new();
    // Every cache event, in order, goes into the log too.
    let (events_tx, events) = std::sync::mpsc::channel();
    router
        .subscribe_cache_events(Box::new(Forward(events_tx)))
        .unwrap();
    let facts = |log: &mut Vec<String>, what: &str, outcome: String| {
        let f: DeviceFacts = router.facts();
        log.push(format!("{what}: {outcome} | {f:?}"));
    };
    let [(ia, pa, a_img), (ib, pb, b_img), (ic, pc, c_img)] = images;
    let (mut a, mut b, mut c) = (seq(*ia, pa), seq(*ib, pb), seq(*ic, pc));
    for (name, s, image) in [
        ("a", &mut a, a_img),
        ("b", &mut b, b_img),
        ("c", &mut c, c_img),
    ] {
        let outcome = restore(router, s, image);
        facts(
            &mut log,
            &format!("restore {name}"),
            format!("{outcome:?} slot {:?}", s.slot()),
        );
    }
    // A restore into a sequence that holds resources, and a corrupt image, are refused.
    let outcome = restore(router, &mut a, a_img);
    facts(&mut log, "restore a again", format!("{outcome:?}"));
    let mut bad = a_img.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x40;
    let mut d = seq(*ia, pa);
    let outcome = restore(router, &mut d, &bad);
    facts(&mut log, "corrupt image", format!("{outcome:?}"));

    let outcome = router.apply(Effect::SsmSnapshotSave { seq: &a, slot: 0 });
    facts(&mut log, "snapshot a", format!("{outcome:?}"));
    let outcome = router.apply(Effect::SsmSnapshotRestore {
        seq: &mut b,
        slot: 0,
    });
    facts(
        &mut log,
        "snapshot restore b from a's",
        format!("{outcome:?}"),
    );
    let outcome = router.apply(Effect::SsmSnapshotRestore {
        seq: &mut a,
        slot: 0,
    });
    facts(&mut log, "snapshot restore a", format!("{outcome:?}"));
    saved.push(save(router, &a).unwrap());

    // b sits at a block boundary: the checkpoint a decode step would have asked for.
    b.checkpoint_due = true;
    let outcome = router.apply(Effect::MarconiCheckpoint { seq: &mut b });
    facts(
        &mut log,
        "checkpoint b",
        format!("{outcome:?} {:?}", b.checkpoints_held()),
    );

    let outcome = router.apply(Effect::ReleaseSeq {
        seq: &mut a,
        cache: true,
        what: "finish",
    });
    facts(&mut log, "release a (cached)", format!("{outcome:?}"));
    let outcome = router.apply(Effect::CompactSlot {
        seq: &mut c,
        target: 1,
    });
    facts(&mut log, "compact c onto b", format!("{outcome:?}"));
    let outcome = router.apply(Effect::CompactSlot {
        seq: &mut c,
        target: 0,
    });
    facts(
        &mut log,
        "compact c to 0",
        format!("{outcome:?} slot {:?}", c.slot()),
    );
    saved.push(save(router, &c).unwrap());
    let outcome = router.apply(Effect::DetachSlot { seq: &mut c });
    facts(&mut log, "detach c", format!("{outcome:?}"));
    let outcome = router.apply(Effect::CompactSlot {
        seq: &mut b,
        target: 0,
    });
    facts(
        &mut log,
        "compact b into c's old slot",
        format!("{outcome:?}"),
    );
    let outcome = router.apply(Effect::ReleaseSeq {
        seq: &mut c,
        cache: false,
        what: "cancel",
    });
    facts(&mut log, "release detached c", format!("{outcome:?}"));
    saved.push(save(router, &b).unwrap());

    // The ledger: reserve, roll back, roll back again; then reserve until the pool is dry.
    for what in ["reserve b", "rollback b", "rollback b again"] {
        let outcome = if what.starts_with("reserve") {
            router.apply(Effect::ReserveKv { seq: &mut b })
        } else {
            router.apply(Effect::Rollback { seq: &mut b })
        };
        facts(&mut log, what, format!("{outcome:?}"));
    }
    let mut more: Vec<RouterSeq> = Vec::new();
    for round in 0..40 {
        let mut s = seq(*ic, pc);
        let outcome = restore(router, &mut s, c_img);
        facts(
            &mut log,
            &format!("restore c #{round}"),
            format!("{outcome:?}"),
        );
        if outcome.is_err() {
            break;
        }
        loop {
            let outcome = router.apply(Effect::ReserveKv { seq: &mut s });
            facts(
                &mut log,
                "reserve",
                format!("{outcome:?} len {}", s.blocks().len()),
            );
            match outcome {
                Ok(EffectOutcome::Reserved { .. }) => {
                    // As if a step had computed up to the end of the reserved block: the next
                    // reservation is for the block after it.
                    s.computed_len = s.blocks().len() * 16;
                    s.tokens.resize(s.computed_len, 5);
                }
                _ => break,
            }
        }
        more.push(s);
        if router.facts().kv_blocks_free == 0 {
            break;
        }
    }
    for mut s in more {
        let outcome = router.apply(Effect::Rollback { seq: &mut s });
        facts(&mut log, "rollback", format!("{outcome:?}"));
        let outcome = router.apply(Effect::ReleaseSeq {
            seq: &mut s,
            cache: false,
            what: "finish",
        });
        facts(&mut log, "release", format!("{outcome:?}"));
    }
    let outcome = router.apply(Effect::ReleaseSeq {
        seq: &mut b,
        cache: true,
        what: "finish",
    });
    facts(&mut log, "release b (cached)", format!("{outcome:?}"));
    let outcome = router.clear_prefix_cache();
    facts(&mut log, "clear", format!("{outcome:?}"));
    // Keys are seeded per cache instance (kv-cache draws a seed), so they are compared by the
    // order they first appear in.
    let mut keys: Vec<String> = Vec::new();
    for event in events.try_iter() {
        let text = format!("{event:?}");
        let mut out = String::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("BlockKey(") {
            let (head, tail) = rest.split_at(at + "BlockKey(".len());
            let end = tail.find(')').unwrap();
            let key = tail[..end].to_owned();
            let index = match keys.iter().position(|k| *k == key) {
                Some(index) => index,
                None => {
                    keys.push(key);
                    keys.len() - 1
                }
            };
            out.push_str(head);
            out.push_str(&format!("#{index}"));
            rest = &tail[end..];
        }
        out.push_str(rest);
        log.push(out);
    }
    (log, saved)
}

/// A cache-event sink that forwards to a channel.
struct Forward(std::sync::mpsc::Sender<device_io::CacheEvent>);

impl device_io::CacheEventSink for Forward {
    fn deliver(&mut self, event: device_io::CacheEvent) -> bool {
        self.0.send(event).is_ok()
    }
}

#[test]
fn the_same_effects_leave_the_same_state_on_both_routers() {
    let images = host_images();
    let (host, cuda) = pair();
    let (host_log, host_saved) = script(&host, &images);
    let (cuda_log, cuda_saved) = script(&cuda, &images);
    for (i, (h, c)) in host_log.iter().zip(&cuda_log).enumerate() {
        assert_eq!(h, c, "line {i}");
    }
    assert_eq!(host_log.len(), cuda_log.len());
    assert!(
        host_log.iter().any(|l| l.contains("Ok(Exhausted)")),
        "{host_log:#?}"
    );
    assert!(
        host_log.iter().any(|l| l.contains("over max_context")),
        "{host_log:#?}"
    );
    assert!(host_log.iter().any(|l| l.contains("BadImage")));
    assert!(
        host_log.iter().any(|l| l.starts_with("BlockStored")),
        "{host_log:#?}"
    );
    assert_eq!(host_saved.len(), 3);
    for (i, (h, c)) in host_saved.iter().zip(&cuda_saved).enumerate() {
        assert!(h == c, "image {i} differs");
    }
    // What was saved is what was restored: a after its snapshot round trip, c after two
    // compactions, b after its checkpoint and a compaction.
    assert!(host_saved[0] == images[0].2);
    assert!(host_saved[1] == images[2].2);
    assert!(host_saved[2] == images[1].2);
    Box::new(host).teardown().unwrap();
    Box::new(cuda).teardown().unwrap();
}
