//! The NemotronH model family on the host: `config.json` and safetensors loading, seeded random
//! weights, and the reference forward math (prefill chunk, batched decode) over paged KV and
//! per-sequence Mamba2 state that the caller owns.
#![forbid(unsafe_code)]
