//! LoRA commands through the engine, over the scripted router (which keeps the bookkeeping of
//! adapter slots and computes nothing with them): acks and typed errors, requests naming an
//! adapter that is not loaded refused at submit, an unload refused while an unfinished request
//! names the adapter, and commands applied only at quiescence: at depth 2 the engine drains the
//! step in flight first, which the `TracingDeviceIo` trace shows (no `lora` line while a launched
//! ticket is not awaited).

use std::path::PathBuf;
use std::time::Duration;

use device_io::testing::{ScriptedConfig, ScriptedRouter};
use device_io::DeviceIo;
use device_trace::{TraceSink, TracingDeviceIo};
use scheduler::{
    AdapterInfo, ControlError, Engine, EngineConfig, Event, LoraAck, LoraCommand, LoraError,
    Request, RequestError, ServeError, ShutdownMode,
};

fn router(depth: usize) -> ScriptedRouter {
    ScriptedRouter::new(ScriptedConfig {
        block_size: 4,
        num_blocks: 256,
        num_slots: 4,
        vocab_size: 1000,
        max_depth: depth,
    })
    .with_lora_slots(2)
}

fn config() -> EngineConfig {
    EngineConfig {
        max_running: 4,
        max_step_tokens: 64,
        max_prefill_chunk: 16,
        ..EngineConfig::default()
    }
}

fn load(adapter: u32) -> LoraCommand {
    LoraCommand::Load {
        adapter,
        path: PathBuf::from(format!("adapters/{adapter}")),
    }
}

fn info(adapter: u32, slot: usize, sequences: usize) -> AdapterInfo {
    AdapterInfo {
        adapter,
        slot,
        path: PathBuf::from(format!("adapters/{adapter}")),
        rank: 0,
        modules: 0,
        sequences,
    }
}

fn refused(err: LoraError) -> Result<LoraAck, ControlError> {
    Err(ControlError::Lora(err))
}

fn prompt(len: usize) -> Vec<u32> {
    (1..=len as u32).collect()
}

#[test]
fn commands_are_acked_and_requests_need_a_loaded_adapter() {
    let mut engine = Engine::new(router(1), config()).unwrap();
    assert_eq!(engine.lora(load(7)), Ok(LoraAck::Loaded(info(7, 0, 0))));
    assert_eq!(
        engine.lora(load(7)),
        refused(LoraError::AlreadyLoaded {
            adapter: 7,
            slot: 0
        })
    );
    assert_eq!(engine.lora(load(8)), Ok(LoraAck::Loaded(info(8, 1, 0))));
    assert_eq!(
        engine.lora(load(9)),
        refused(LoraError::NoFreeSlot { slots: 2 })
    );
    assert_eq!(
        engine.lora(LoraCommand::Unload { adapter: 9 }),
        refused(LoraError::NotLoaded { adapter: 9 })
    );
    assert_eq!(engine.limits().adapters.ids(), [7, 8]);

    // Submission checks the adapter.
    let err = engine
        .submit(Request::greedy(prompt(5), 3).with_adapter(9))
        .unwrap_err();
    assert_eq!(
        err,
        RequestError::UnknownAdapter {
            adapter: 9,
            known: vec![7, 8]
        }
    );
    let running = engine
        .submit(Request::greedy(prompt(5), 4).with_adapter(7))
        .unwrap();
    let queued = engine
        .submit(Request::greedy(prompt(6), 4).with_adapter(8))
        .unwrap();
    // Waiting requests hold adapter 8; after one step adapter 7's request is running.
    assert_eq!(
        engine.lora(LoraCommand::Unload { adapter: 8 }),
        refused(LoraError::InUse {
            adapter: 8,
            sequences: vec![queued.id()]
        })
    );
    engine.step();
    assert_eq!(engine.running_len(), 2);
    assert_eq!(
        engine.lora(LoraCommand::List),
        Ok(LoraAck::Listed {
            slots: 2,
            adapters: vec![info(7, 0, 1), info(8, 1, 1)]
        })
    );
    assert_eq!(
        engine.lora(LoraCommand::Unload { adapter: 7 }),
        refused(LoraError::InUse {
            adapter: 7,
            sequences: vec![running.id()]
        })
    );
    engine.run_until_idle();
    assert_eq!(running.wait().unwrap().tokens.len(), 4);
    assert_eq!(queued.wait().unwrap().tokens.len(), 4);
    // Nothing uses them now.
    assert_eq!(
        engine.lora(LoraCommand::Unload { adapter: 7 }),
        Ok(LoraAck::Unloaded {
            adapter: 7,
            slot: 0
        })
    );
    assert_eq!(engine.limits().adapters.ids(), [8]);
    assert!(matches!(
        engine.submit(Request::greedy(prompt(5), 3).with_adapter(7)),
        Err(RequestError::UnknownAdapter { adapter: 7, .. })
    ));
    // Acknowledged: the two loads, the list and the unload.
    assert_eq!(engine.metrics().lora_commands, 4);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

/// A client checked its request against the adapters loaded then; an unload applied before the
/// engine took the request in fails it with a typed error, and nothing reaches the router.
#[test]
fn a_submission_racing_an_unload_fails_typed() {
    let mut engine = Engine::new(router(1), config()).unwrap();
    engine.lora(load(3)).unwrap();
    let client = engine.client();
    let handle = client
        .submit(Request::greedy(prompt(5), 3).with_adapter(3))
        .unwrap();
    // The submission is still in the command channel: the engine does not know of it yet.
    assert_eq!(
        engine.lora(LoraCommand::Unload { adapter: 3 }),
        Ok(LoraAck::Unloaded {
            adapter: 3,
            slot: 0
        })
    );
    engine.step();
    assert_eq!(
        handle.wait(),
        Err(ServeError::AdapterNotLoaded { adapter: 3 })
    );
    assert!(engine.is_idle());
    assert_eq!(engine.router().facts().live_slots_used, 0);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

/// Replays a trace and checks that no `lora` call happened while a launched step was not
/// awaited; answers how many `lora` calls there were.
fn check_quiescent(lines: &[String]) -> usize {
    let mut unsettled: Vec<String> = Vec::new();
    let mut launching = false;
    let mut commands = 0;
    for line in lines {
        if line.starts_with("fx launch") {
            launching = true;
        } else if launching {
            launching = false;
            if let Some(ticket) = line.strip_prefix("-> ticket ") {
                unsettled.push(ticket.to_string());
            }
        } else if let Some(ticket) = line.strip_prefix("fx await ticket ") {
            unsettled.retain(|t| t != ticket);
        } else if line.starts_with("fx lora") {
            assert!(
                unsettled.is_empty(),
                "`{line}` while ticket(s) {unsettled:?} were in flight"
            );
            commands += 1;
        }
    }
    commands
}

#[test]
fn at_depth_2_commands_drain_the_step_in_flight_first() {
    let (sink, buffer) = TraceSink::memory();
    // A simulated device step of 2 ms keeps steps in flight while a client thread's command
    // travels to the engine.
    let traced = TracingDeviceIo::new(router(2).with_step_time(Duration::from_millis(2)), sink);
    let mut engine = Engine::new(traced, config()).unwrap();
    engine.lora(load(1)).unwrap();
    let client = engine.client();
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let request = Request::greedy(prompt(6 + i), 60);
            let request = if i == 0 {
                request
            } else {
                request.with_adapter(1)
            };
            engine.submit(request).unwrap()
        })
        .collect();
    let mut answers = Vec::new();
    while !engine.is_idle() {
        engine.step();
        if engine.step_in_flight() && answers.len() < 3 {
            // A command from a client thread while a decode step is in flight: the engine
            // takes it at the start of a step, drains, and only then calls the router.
            let client = client.clone();
            let cmd = if answers.len() == 1 {
                load(2)
            } else {
                LoraCommand::List
            };
            let thread = std::thread::spawn(move || client.lora(cmd));
            while !thread.is_finished() {
                engine.step();
            }
            answers.push(thread.join().unwrap());
        }
    }
    for handle in handles {
        assert_eq!(handle.wait().unwrap().tokens.len(), 60);
    }
    assert_eq!(answers.len(), 3);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let metrics = *engine.metrics();
    // Each client command found a step in flight and drained it.
    assert_eq!(metrics.lora_drains, 3);
    assert!(metrics.fed_launches > 10);
    // The first load, then the three client commands: none while a ticket was unsettled.
    assert_eq!(check_quiescent(&buffer.lines()), 4);
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

#[test]
fn the_quiescence_check_catches_a_command_in_flight() {
    // The negative control of `check_quiescent`: a trace with a lora call between a launch and
    // its await fails it.
    let lines: Vec<String> = [
        "fx launch DecodeFed{n=1, fed=0, masked=false}",
        "-> ticket 4",
        "fx lora List",
        "-> Listed{slots=2, adapters=[]}",
        "fx await ticket 4",
    ]
    .map(String::from)
    .to_vec();
    let caught = std::panic::catch_unwind(|| check_quiescent(&lines));
    assert!(caught.is_err());
}

#[test]
fn the_engine_thread_answers_client_commands() {
    // Steps of 2 ms: the request is still running when the unload arrives.
    let router = router(2).with_step_time(Duration::from_millis(2));
    let engine = Engine::new(router, config()).unwrap();
    let thread = scheduler::EngineThread::spawn(engine).unwrap();
    let client = thread.client();
    assert_eq!(client.lora(load(4)), Ok(LoraAck::Loaded(info(4, 0, 0))));
    let handle = client
        .submit(Request::greedy(prompt(9), 200).with_adapter(4))
        .unwrap();
    // Wait for the first token so the request is running, then try to unload.
    assert!(matches!(handle.events().recv(), Ok(Event::Token(_))));
    assert_eq!(
        client.lora(LoraCommand::Unload { adapter: 4 }),
        refused(LoraError::InUse {
            adapter: 4,
            sequences: vec![handle.id()]
        })
    );
    let mut tokens = 1;
    for event in handle.events() {
        match event {
            Event::Token(_) => tokens += 1,
            Event::Finished { .. } => break,
            Event::Error(err) => panic!("{err}"),
        }
    }
    assert_eq!(tokens, 200);
    assert_eq!(
        client.lora(LoraCommand::Unload { adapter: 4 }),
        Ok(LoraAck::Unloaded {
            adapter: 4,
            slot: 0
        })
    );
    thread.shutdown(ShutdownMode::Drain).unwrap();
}
