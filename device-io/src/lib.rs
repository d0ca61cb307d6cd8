//! The `DeviceIo` contract between the engine core and a router.
#![forbid(unsafe_code)]
