//! Context limits end to end on the host router: a request is refused at submission exactly when
//! the router could not hold it (its longest sequence on the device is the prompt plus
//! `max_tokens - 1` positions, since the last token is never fed back), and one that reaches the
//! limit exactly runs to completion.

use device_cpu::{CpuRouter, CpuRouterConfig};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Request, RequestError, ShutdownMode};

fn engine(max_context: usize) -> Engine<CpuRouter> {
    let mut config = CpuRouterConfig::new(16, 2);
    config.max_context = Some(max_context);
    let router = CpuRouter::new(Model::random(Config::tiny_demo(), 2).unwrap(), config).unwrap();
    Engine::new(router, EngineConfig::default()).unwrap()
}

#[test]
fn a_request_that_reaches_the_context_limit_exactly_is_served() {
    let mut engine = engine(40);
    // 38 + 3 - 1 = 40 positions, and 40 + 1 - 1 = 40.
    let reaching = engine.submit(Request::greedy(vec![7; 38], 3)).unwrap();
    let whole_prompt = engine.submit(Request::greedy(vec![9; 40], 1)).unwrap();
    engine.run_until_idle();
    assert_eq!(reaching.wait().unwrap().tokens.len(), 3);
    assert_eq!(whole_prompt.wait().unwrap().tokens.len(), 1);
    // One position more is refused, naming the numbers.
    assert_eq!(
        engine.submit(Request::greedy(vec![7; 38], 4)).unwrap_err(),
        RequestError::ExceedsContext {
            prompt: 38,
            max_tokens: 4,
            max_context: 40
        }
    );
    assert_eq!(
        engine.submit(Request::greedy(vec![9; 41], 1)).unwrap_err(),
        RequestError::PromptTooLong {
            len: 41,
            max_context: 40
        }
    );
    engine.shutdown(ShutdownMode::Drain).unwrap();
}

fn fixture() -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/nemotron-h-tiny/model");
    Model::load(&dir).unwrap()
}

#[test]
fn the_models_context_length_bounds_what_the_router_accepts() {
    // The fixture's config.json says max_position_embeddings = 4096; the pool could hold 4800.
    let router = CpuRouter::new(fixture(), CpuRouterConfig::new(300, 2)).unwrap();
    let mut engine = Engine::new(router, EngineConfig::default()).unwrap();
    assert_eq!(engine.limits().max_context, 4096);
    assert_eq!(
        engine
            .submit(Request::greedy(vec![1; 4097], 1))
            .unwrap_err(),
        RequestError::PromptTooLong {
            len: 4097,
            max_context: 4096
        }
    );
    engine.shutdown(ShutdownMode::Drain).unwrap();
}
