//! The Marconi store for hybrid models: a radix tree over tokens whose nodes hold KV block
//! references and SSM checkpoints; admission (where to checkpoint), FLOP-aware eviction under a
//! strict byte budget, the checkpoint slot pool, and a trace-driven simulator.
#![forbid(unsafe_code)]
