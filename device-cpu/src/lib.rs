//! The host router: `DeviceIo` over the host model with `kv-cache` and `ssm-snapshot`
//! bookkeeping; the default backend and the oracle every other router is compared with.
#![forbid(unsafe_code)]
