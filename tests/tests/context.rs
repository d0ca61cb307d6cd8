//! Context limits end to end on the host router: a request is refused at submission exactly when
//! the router could not hold it (its longest sequence on the device is the prompt plus
//! `max_tokens - 1` positions, since the last token is never fed back), and one that reaches the
//! limit exactly runs to completion.

use device_cpu::{CpuRouter, CpuRouterConfig};
use model::{Config, Model};
use scheduler::{Engine, EngineConfig, Request, RequestError, ShutdownMode};

fn engine(max_context: usize) -> Engine<CpuRouter> {
    let mut config = CpuRouterConfig::new(16, 2);
    config.max_context = max_context;
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
