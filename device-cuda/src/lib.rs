//! The CUDA router on `cudarc` will live here: device pools, streams and events, kernels, NCCL
//! expert parallelism. It is the only crate of the workspace that may hold `unsafe` code (each
//! block with a `// SAFETY:` comment). Until its issue lands it holds no code: the host router in
//! `device-cpu` is the backend every build uses.
