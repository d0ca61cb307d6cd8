//! `TracingDeviceIo`: a `DeviceIo` decorator that records every call.
#![forbid(unsafe_code)]
