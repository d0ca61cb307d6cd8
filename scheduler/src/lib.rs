//! The engine core: requests, admission, batching, chunked prefill, sampling, stop conditions,
//! preemption and compaction, generic over any `DeviceIo`.
#![forbid(unsafe_code)]
