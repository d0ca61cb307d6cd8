//! Every raw call of the crate, in one place: host memory and kernel launches of the SIMT
//! emulation ([`sim`]), and the CUDA driver and cuBLAS through `cudarc` ([`cuda`]). Each `unsafe`
//! block says why it is sound; the rest of the crate uses the safe types built on these.

pub(crate) mod cuda;
pub(crate) mod sim;
