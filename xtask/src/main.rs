//! Project automation: `cargo xtask ci` runs exactly what CI runs.
#![forbid(unsafe_code)]

fn main() {}
