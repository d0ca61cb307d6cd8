//! Requests: what a client submits, how its tokens are chosen, and the checks it must pass.
//!
//! A [`Request`] is plain data (public fields, no invariant until it is submitted). Submitting it
//! runs [`Limits::validate`], which either accepts it whole or answers one [`RequestError`] naming
//! the bad value and the limit it broke; a rejected request never reaches the router and changes
//! nothing in the engine.

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError, RwLock};

use device_io::DeviceFacts;

/// How the next token is chosen from a token position's logits.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// The most likely token (the device's argmax when no row of the step needs host logits).
    Greedy,
    /// Random sampling from the filtered, temperature-scaled distribution.
    Random(RandomSampling),
    /// The output is these tokens, in order, whatever the logits say (the model still computes
    /// every step). Workload replay uses it to reproduce a trace's recorded outputs exactly.
    Forced(Vec<u32>),
}

/// Parameters of [`Sampling::Random`]. Filters apply in the order top-k, top-p, min-p.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomSampling {
    /// Logits are divided by it; finite and in `(0, 100]`.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` keeps all. `Some(0)` is invalid.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; in `(0, 1]`.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; in `[0, 1]`.
    pub min_p: f32,
    /// Seed of the request's own ChaCha stream: the same seed gives the same tokens.
    pub seed: u64,
}

impl RandomSampling {
    /// Plain temperature sampling (no filters) with `seed`.
    pub fn new(temperature: f32, seed: u64) -> Self {
        RandomSampling {
            temperature,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            seed,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's token ids; non-empty, each below the vocabulary size.
    pub prompt: Vec<u32>,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// Stop after this many generated tokens (at least 1).
    pub max_tokens: usize,
    /// Stop after generating any of these (the stop token is part of the output).
    pub stop_tokens: Vec<u32>,
    /// The LoRA adapter to serve it with (its id); must be loaded when the request is
    /// submitted (see [`crate::EngineClient::lora`]).
    pub adapter: Option<u32>,
    /// The tenant's cache salt: requests share cached prefixes only under the same salt.
    pub cache_salt: Option<u64>,
    /// Hash every logits row the request produces into [`crate::Event::Finished`]'s digest
    /// (forces host logits readback for the steps it is in).
    pub logits_digest: bool,
}

impl Request {
    /// A greedy request with no stop tokens, adapter or salt.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            prompt,
            sampling: Sampling::Greedy,
            max_tokens,
            stop_tokens: Vec::new(),
            adapter: None,
            cache_salt: None,
            logits_digest: false,
        }
    }

    /// A request whose output is exactly `output` (see [`Sampling::Forced`]).
    pub fn forced(prompt: Vec<u32>, output: Vec<u32>) -> Self {
        let max_tokens = output.len();
        Request {
            sampling: Sampling::Forced(output),
            ..Request::greedy(prompt, max_tokens)
        }
    }

    /// The same request with `sampling`.
    pub fn with_sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// The same request with stop tokens.
    pub fn with_stop_tokens(mut self, stop_tokens: Vec<u32>) -> Self {
        self.stop_tokens = stop_tokens;
        self
    }

    /// The same request served with LoRA adapter `adapter`.
    pub fn with_adapter(mut self, adapter: u32) -> Self {
        self.adapter = Some(adapter);
        self
    }

    /// The same request under cache salt `salt`.
    pub fn with_cache_salt(mut self, salt: u64) -> Self {
        self.cache_salt = Some(salt);
        self
    }

    /// The same request with its logits digest switched on or off.
    pub fn with_logits_digest(mut self, on: bool) -> Self {
        self.logits_digest = on;
        self
    }
}

/// Why a request was refused at submission. Each variant names the bad value and the limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens is 0; at least 1 token must be generated")]
    ZeroMaxTokens,
    /// A token id is outside the vocabulary.
    #[error("{field}[{index}] = {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab {
        /// `"prompt"`, `"stop_tokens"` or `"forced"`.
        field: &'static str,
        /// Its position in that list.
        index: usize,
        /// The bad id.
        token: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The prompt alone is longer than the router's context.
    #[error("the prompt has {len} tokens; the maximum context is {max_context}")]
    PromptTooLong {
        /// Prompt tokens.
        len: usize,
        /// The router's maximum context.
        max_context: usize,
    },
    /// Prompt plus `max_tokens`, less the last token (which is never fed back), exceed the
    /// router's context.
    #[error("prompt ({prompt} tokens) plus max_tokens ({max_tokens}) need {} positions, over the maximum context of {max_context}", prompt.saturating_add(*max_tokens).saturating_sub(1))]
    ExceedsContext {
        /// Prompt tokens.
        prompt: usize,
        /// Requested generation length.
        max_tokens: usize,
        /// The router's maximum context.
        max_context: usize,
    },
    /// The request needs more KV blocks than the whole pool has, so it could never run.
    #[error("the request needs {needed} KV blocks at full length; the pool has {total}")]
    NeverFits {
        /// Blocks the request needs at its longest.
        needed: usize,
        /// Blocks in the whole pool.
        total: usize,
    },
    /// The temperature is NaN, infinite, not positive, or above 100.
    #[error("temperature {0} is outside (0, 100]")]
    Temperature(f32),
    /// `top_p` is NaN or outside `(0, 1]`.
    #[error("top_p {0} is outside (0, 1]")]
    TopP(f32),
    /// `min_p` is NaN or outside `[0, 1]`.
    #[error("min_p {0} is outside [0, 1]")]
    MinP(f32),
    /// `top_k` is `Some(0)`.
    #[error("top_k is 0; use None to keep every token")]
    TopK,
    /// Forced sampling lists fewer tokens than `max_tokens`.
    #[error("forced sampling lists {forced} tokens but max_tokens is {max_tokens}")]
    ForcedTooShort {
        /// Tokens listed.
        forced: usize,
        /// Requested generation length.
        max_tokens: usize,
    },
    /// The adapter is not loaded (never was, or was unloaded).
    #[error("unknown LoRA adapter {adapter}; the loaded adapters are {known:?}")]
    UnknownAdapter {
        /// The adapter asked for.
        adapter: u32,
        /// The adapters loaded when the request was checked.
        known: Vec<u32>,
    },
    /// The engine has stopped (or is shutting down) and takes no new requests.
    #[error("the engine has stopped and takes no new requests")]
    EngineStopped,
}

/// The LoRA adapters an engine serves now, by id: shared by the engine, which changes it as
/// adapters are loaded and unloaded (at quiescence, see [`crate::Engine::lora`]), and its
/// clients, which check submissions against it. Clones share one set.
#[derive(Debug, Clone, Default)]
pub struct AdapterSet {
    ids: Arc<RwLock<BTreeSet<u32>>>,
}

impl AdapterSet {
    /// A set holding `ids`.
    pub fn new(ids: impl IntoIterator<Item = u32>) -> Self {
        AdapterSet {
            ids: Arc::new(RwLock::new(ids.into_iter().collect())),
        }
    }

    /// Whether adapter `id` is loaded.
    pub fn contains(&self, id: u32) -> bool {
        self.ids
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&id)
    }

    /// The loaded ids, ascending.
    pub fn ids(&self) -> Vec<u32> {
        self.ids
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }

    pub(crate) fn insert(&self, id: u32) {
        self.ids
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id);
    }

    pub(crate) fn remove(&self, id: u32) {
        self.ids
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    pub(crate) fn replace(&self, ids: impl IntoIterator<Item = u32>) {
        *self.ids.write().unwrap_or_else(PoisonError::into_inner) = ids.into_iter().collect();
    }
}

/// Two sets are equal when they hold the same ids now.
impl PartialEq for AdapterSet {
    fn eq(&self, other: &Self) -> bool {
        self.ids() == other.ids()
    }
}

impl Eq for AdapterSet {}

/// What a request is checked against: the router's facts plus the adapters loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Vocabulary size of the model served.
    pub vocab_size: usize,
    /// The longest sequence the router accepts.
    pub max_context: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the whole pool.
    pub kv_blocks_total: usize,
    /// The LoRA adapters loaded now.
    pub adapters: AdapterSet,
}

impl Limits {
    /// The limits of a router with `facts`, with `adapters` loaded.
    pub fn new(facts: &DeviceFacts, adapters: Vec<u32>) -> Self {
        Limits {
            vocab_size: facts.vocab_size,
            max_context: facts.max_context,
            block_size: facts.block_size.max(1),
            kv_blocks_total: facts.kv_blocks_total,
            adapters: AdapterSet::new(adapters),
        }
    }

    /// Checks `request`; the first problem found is the error.
    pub fn validate(&self, request: &Request) -> Result<(), RequestError> {
        if request.prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        self.check_vocab("prompt", &request.prompt)?;
        self.check_vocab("stop_tokens", &request.stop_tokens)?;
        match &request.sampling {
            Sampling::Greedy => {}
            Sampling::Random(params) => check_random(params)?,
            Sampling::Forced(tokens) => {
                self.check_vocab("forced", tokens)?;
                if tokens.len() < request.max_tokens {
                    return Err(RequestError::ForcedTooShort {
                        forced: tokens.len(),
                        max_tokens: request.max_tokens,
                    });
                }
            }
        }
        if let Some(adapter) = request.adapter {
            if !self.adapters.contains(adapter) {
                return Err(RequestError::UnknownAdapter {
                    adapter,
                    known: self.adapters.ids(),
                });
            }
        }
        let prompt = request.prompt.len();
        if prompt > self.max_context {
            return Err(RequestError::PromptTooLong {
                len: prompt,
                max_context: self.max_context,
            });
        }
        // The last generated token is never fed back, so the longest the sequence gets on the
        // device is prompt + max_tokens - 1 positions: that is what must fit the context.
        if prompt.saturating_add(request.max_tokens - 1) > self.max_context {
            return Err(RequestError::ExceedsContext {
                prompt,
                max_tokens: request.max_tokens,
                max_context: self.max_context,
            });
        }
        let needed = self.blocks_for(prompt + request.max_tokens - 1);
        if needed > self.kv_blocks_total {
            return Err(RequestError::NeverFits {
                needed,
                total: self.kv_blocks_total,
            });
        }
        Ok(())
    }

    /// KV blocks that hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn check_vocab(&self, field: &'static str, tokens: &[u32]) -> Result<(), RequestError> {
        match tokens
            .iter()
            .position(|&token| token as usize >= self.vocab_size)
        {
            Some(index) => Err(RequestError::TokenOutOfVocab {
                field,
                index,
                token: tokens[index],
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }
}

fn check_random(params: &RandomSampling) -> Result<(), RequestError> {
    let t = params.temperature;
    if !(t.is_finite() && t > 0.0 && t <= 100.0) {
        return Err(RequestError::Temperature(t));
    }
    let p = params.top_p;
    if !(p > 0.0 && p <= 1.0) {
        return Err(RequestError::TopP(p));
    }
    let m = params.min_p;
    if !(0.0..=1.0).contains(&m) {
        return Err(RequestError::MinP(m));
    }
    if params.top_k == Some(0) {
        return Err(RequestError::TopK);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            vocab_size: 100,
            max_context: 64,
            block_size: 4,
            kv_blocks_total: 8,
            adapters: AdapterSet::new([3]),
        }
    }

    fn check(request: Request, expected: Result<(), RequestError>) {
        assert_eq!(limits().validate(&request), expected);
    }

    fn random(f: impl FnOnce(&mut RandomSampling)) -> Request {
        let mut params = RandomSampling::new(1.0, 7);
        f(&mut params);
        Request::greedy(vec![1, 2], 4).with_sampling(Sampling::Random(params))
    }

    #[test]
    fn good_requests_pass() {
        check(Request::greedy(vec![1, 2, 3], 4), Ok(()));
        check(Request::greedy(vec![1], 4).with_adapter(3), Ok(()));
        check(Request::forced(vec![1], vec![5, 6, 7]), Ok(()));
        check(random(|p| p.top_k = Some(5)), Ok(()));
        // 29 + 4 - 1 = 32 positions = exactly 8 blocks of 4.
        check(Request::greedy(vec![1; 29], 4), Ok(()));
    }

    #[test]
    fn bad_requests_name_the_value_and_limit() {
        check(Request::greedy(vec![], 4), Err(RequestError::EmptyPrompt));
        check(
            Request::greedy(vec![1], 0),
            Err(RequestError::ZeroMaxTokens),
        );
        check(
            Request::greedy(vec![1, 100], 4),
            Err(RequestError::TokenOutOfVocab {
                field: "prompt",
                index: 1,
                token: 100,
                vocab_size: 100,
            }),
        );
        check(
            Request::greedy(vec![1], 4).with_stop_tokens(vec![250]),
            Err(RequestError::TokenOutOfVocab {
                field: "stop_tokens",
                index: 0,
                token: 250,
                vocab_size: 100,
            }),
        );
        check(
            Request::greedy(vec![1; 65], 1),
            Err(RequestError::PromptTooLong {
                len: 65,
                max_context: 64,
            }),
        );
        check(
            Request::greedy(vec![1; 60], 6),
            Err(RequestError::ExceedsContext {
                prompt: 60,
                max_tokens: 6,
                max_context: 64,
            }),
        );
        check(
            Request::greedy(vec![1; 30], 4),
            Err(RequestError::NeverFits {
                needed: 9,
                total: 8,
            }),
        );
        check(
            Request::greedy(vec![1], 4).with_adapter(9),
            Err(RequestError::UnknownAdapter {
                adapter: 9,
                known: vec![3],
            }),
        );
        let mut forced = Request::forced(vec![1], vec![2, 3]);
        forced.max_tokens = 3;
        check(
            forced,
            Err(RequestError::ForcedTooShort {
                forced: 2,
                max_tokens: 3,
            }),
        );
    }

    #[test]
    fn sampling_parameters_are_range_checked() {
        for t in [0.0, -1.0, 101.0, f32::INFINITY] {
            check(
                random(|p| p.temperature = t),
                Err(RequestError::Temperature(t)),
            );
        }
        assert!(matches!(
            limits().validate(&random(|p| p.temperature = f32::NAN)),
            Err(RequestError::Temperature(t)) if t.is_nan()
        ));
        for top_p in [0.0, 1.5] {
            check(random(|p| p.top_p = top_p), Err(RequestError::TopP(top_p)));
        }
        assert!(matches!(
            limits().validate(&random(|p| p.top_p = f32::NAN)),
            Err(RequestError::TopP(v)) if v.is_nan()
        ));
        check(random(|p| p.min_p = -0.1), Err(RequestError::MinP(-0.1)));
        check(random(|p| p.top_k = Some(0)), Err(RequestError::TopK));
    }

    #[test]
    fn messages_name_values() {
        assert_eq!(
            RequestError::NeverFits {
                needed: 9,
                total: 8
            }
            .to_string(),
            "the request needs 9 KV blocks at full length; the pool has 8"
        );
        assert_eq!(
            RequestError::Temperature(-1.0).to_string(),
            "temperature -1 is outside (0, 100]"
        );
    }
}
