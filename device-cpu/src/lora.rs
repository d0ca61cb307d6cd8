//! The host router's LoRA adapter slots and the `LoraCommand`s that change them.
//!
//! The router holds a fixed number of slots ([`crate::CpuRouterConfig::lora_slots`]). A slot
//! holds one adapter (`model::LoraAdapter`, checked against the router's model when it is
//! loaded) under the id requests name it by. A sequence that names an adapter is *bound* to it
//! when it first takes router resources (its first prefill chunk, or a restore); a step computes
//! each row with the adapter it is bound to, never with merged weights.
//!
//! # Cache namespaces
//!
//! Every load gets a fresh *serial* (never reused while the router lives), and the prefix cache
//! keys a bound sequence's blocks and Marconi checkpoints by that serial, not by the id. So no
//! cached entry is ever shared across adapters, and entries computed with an adapter that was
//! unloaded are never served to a later adapter loaded under the same id (they age out of the
//! cache like any unused entry).
//!
//! # Invariants
//!
//! - An id is in at most one slot.
//! - A live sequence's binding names a loaded slot's serial: unloading an adapter that a live
//!   sequence (a tenure) uses is refused ([`LoraError::InUse`]).
//! - Commands run only at quiescence: with a launched step not yet awaited the router answers
//!   [`LoraError::Busy`] and changes nothing.

use std::path::PathBuf;
use std::sync::Arc;

use device_io::{AdapterInfo, LoraAck, LoraCommand, LoraError};
use model::{LoraAdapter, Model};

use crate::Inner;

/// A loaded adapter.
#[derive(Debug, Clone)]
pub(crate) struct LoadedAdapter {
    pub adapter: u32,
    pub serial: u32,
    pub path: PathBuf,
    pub weights: Arc<LoraAdapter>,
}

/// What a sequence bound to an adapter computes with (the shared record's binding).
pub(crate) use router_book::LoraBinding as Binding;

/// The adapter slots.
#[derive(Debug)]
pub(crate) struct LoraTable {
    slots: Vec<Option<LoadedAdapter>>,
    next_serial: u32,
}

impl LoraTable {
    pub fn new(slots: usize) -> Self {
        LoraTable {
            slots: vec![None; slots],
            next_serial: 1,
        }
    }

    fn find(&self, adapter: u32) -> Option<(usize, &LoadedAdapter)> {
        self.slots.iter().enumerate().find_map(|(slot, entry)| {
            entry
                .as_ref()
                .filter(|e| e.adapter == adapter)
                .map(|e| (slot, e))
        })
    }

    /// The binding of a sequence that names `adapter`: `Ok(None)` for none, `Err` with the
    /// reason when it is not loaded.
    pub fn bind(&self, adapter: Option<u32>) -> Result<Option<Binding>, String> {
        let Some(adapter) = adapter else {
            return Ok(None);
        };
        match self.find(adapter) {
            Some((_, loaded)) => Ok(Some(Binding {
                serial: loaded.serial,
                weights: Arc::clone(&loaded.weights),
            })),
            None => Err(format!("adapter {adapter} is not loaded")),
        }
    }
}

/// The ids of the live sequences that use `adapter`, ascending.
fn users(inner: &Inner, adapter: u32) -> Vec<u64> {
    let mut ids: Vec<u64> = inner
        .tenures
        .values()
        .filter(|t| t.adapter == Some(adapter))
        .map(|t| t.seq_id)
        .collect();
    ids.sort_unstable();
    ids
}

fn info(inner: &Inner, slot: usize, loaded: &LoadedAdapter) -> AdapterInfo {
    AdapterInfo {
        adapter: loaded.adapter,
        slot,
        path: loaded.path.clone(),
        rank: loaded.weights.rank(),
        modules: loaded.weights.module_count(),
        sequences: users(inner, loaded.adapter).len(),
    }
}

/// Runs one command (the caller checked quiescence).
pub(crate) fn command(
    model: &Model,
    inner: &mut Inner,
    cmd: LoraCommand,
) -> Result<LoraAck, LoraError> {
    if !inner.unsettled.is_empty() {
        return Err(LoraError::Busy {
            in_flight: inner.unsettled.len(),
        });
    }
    match cmd {
        LoraCommand::Load { adapter, path } => {
            if let Some((slot, _)) = inner.lora.find(adapter) {
                return Err(LoraError::AlreadyLoaded { adapter, slot });
            }
            let Some(slot) = inner.lora.slots.iter().position(Option::is_none) else {
                return Err(LoraError::NoFreeSlot {
                    slots: inner.lora.slots.len(),
                });
            };
            let weights = LoraAdapter::load(&path, model).map_err(|err| LoraError::BadAdapter {
                adapter,
                reason: err.to_string(),
            })?;
            let serial = inner.lora.next_serial;
            inner.lora.next_serial += 1;
            let loaded = LoadedAdapter {
                adapter,
                serial,
                path,
                weights: Arc::new(weights),
            };
            tracing::info!(
                adapter,
                slot,
                serial,
                rank = loaded.weights.rank(),
                modules = loaded.weights.module_count(),
                path = %loaded.path.display(),
                "LoRA adapter loaded"
            );
            let ack = LoraAck::Loaded(info(inner, slot, &loaded));
            inner.lora.slots[slot] = Some(loaded);
            Ok(ack)
        }
        LoraCommand::Unload { adapter } => {
            let (slot, _) = inner
                .lora
                .find(adapter)
                .ok_or(LoraError::NotLoaded { adapter })?;
            let sequences = users(inner, adapter);
            if !sequences.is_empty() {
                return Err(LoraError::InUse { adapter, sequences });
            }
            inner.lora.slots[slot] = None;
            tracing::info!(adapter, slot, "LoRA adapter unloaded");
            Ok(LoraAck::Unloaded { adapter, slot })
        }
        LoraCommand::List => Ok(LoraAck::Listed {
            slots: inner.lora.slots.len(),
            adapters: inner
                .lora
                .slots
                .iter()
                .enumerate()
                .filter_map(|(slot, entry)| entry.as_ref().map(|loaded| info(inner, slot, loaded)))
                .collect(),
        }),
    }
}
