//! `Label`: a short, deterministic one-line form of every plan, effect, outcome and LoRA command,
//! used by traces and logs.

use crate::{DeviceError, Effect, EffectOutcome, StepPlan};

/// A short, deterministic, one-line description.
pub trait Label {
    /// The one-line form (`ReleaseSeq{cache=true, finish}`, `Decode{n=4, readback=Argmax}`).
    fn label(&self) -> String;
}

impl<S, P> Label for Effect<'_, S, P> {
    fn label(&self) -> String {
        match self {
            Effect::ReleaseSeq { cache, what, .. } => {
                format!("ReleaseSeq{{cache={cache}, {what}}}")
            }
            Effect::CompactSlot { target, .. } => format!("CompactSlot{{target={target}}}"),
            Effect::ReadLogits { rows, .. } => format!("ReadLogits{{rows={rows}}}"),
            Effect::SsmSnapshotSave { slot, .. } => format!("SsmSnapshotSave{{slot={slot}}}"),
            Effect::SsmSnapshotRestore { slot, .. } => format!("SsmSnapshotRestore{{slot={slot}}}"),
            Effect::SaveHiddenCatchup { row, pos } => {
                format!("SaveHiddenCatchup{{row={row}, pos={pos}}}")
            }
            Effect::Quiesce { stream } => format!("Quiesce{{stream={stream}}}"),
            Effect::TruncateKv { len, .. } => format!("TruncateKv{{len={len}}}"),
            other => other.name().to_string(),
        }
    }
}

impl Label for StepPlan<'_> {
    fn label(&self) -> String {
        match self {
            StepPlan::Prefill { budgets, readback } => {
                let tokens: usize = budgets.iter().sum();
                format!(
                    "Prefill{{n={}, budget={tokens}, readback={}}}",
                    budgets.len(),
                    readback.name()
                )
            }
            StepPlan::Decode { tokens, readback } => {
                format!("Decode{{n={}, readback={}}}", tokens.len(), readback.name())
            }
            StepPlan::DecodeFed { sources, masks } => {
                let fed = sources
                    .iter()
                    .filter(|source| matches!(source, crate::Feed::Row(_)))
                    .count();
                format!(
                    "DecodeFed{{n={}, fed={fed}, masked={}}}",
                    sources.len(),
                    !masks.is_empty()
                )
            }
            StepPlan::Verify {
                inputs,
                snapshots,
                readback,
            } => {
                let drafts: usize = inputs.iter().map(|i| i.len().saturating_sub(1)).sum();
                format!(
                    "Verify{{n={}, drafts={drafts}, snapshots={}, readback={}}}",
                    inputs.len(),
                    !snapshots.is_empty(),
                    readback.name()
                )
            }
            StepPlan::Draft { tokens, k } => format!("Draft{{n={}, k={k}}}", tokens.len()),
        }
    }
}

impl Label for EffectOutcome {
    fn label(&self) -> String {
        match self {
            EffectOutcome::Unit => "Unit".to_string(),
            EffectOutcome::HostLogits { elem_bytes } => {
                format!("HostLogits{{elem_bytes={elem_bytes}}}")
            }
            EffectOutcome::Reserved { blocks } => format!("Reserved{{blocks={blocks}}}"),
            EffectOutcome::Exhausted => "Exhausted".to_string(),
        }
    }
}

impl Label for DeviceError {
    fn label(&self) -> String {
        match self {
            DeviceError::KvExhausted { needed, free } => {
                format!("KvExhausted{{needed={needed}, free={free}}}")
            }
            DeviceError::SlotsExhausted { total } => format!("SlotsExhausted{{total={total}}}"),
            DeviceError::Unsupported { what } => format!("Unsupported{{{what}}}"),
            DeviceError::UnknownTicket(ticket) => format!("UnknownTicket{{{}}}", ticket.0),
            DeviceError::Failed { phase, .. } => format!("Failed{{{phase}}}"),
            // The detail of these may carry paths or numbers that vary; the name is stable.
            other => other.name().to_string(),
        }
    }
}

/// The LoRA command the workspace's routers understand.
///
/// A router holds a fixed number of adapter *slots*; requests name an adapter by its id
/// ([`crate::SeqSpec::adapter`]). Commands run only at quiescence (no step in flight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraCommand {
    /// Load the adapter in folder `path` (PEFT's `adapter_config.json` and
    /// `adapter_model.safetensors`) into a free slot, under id `adapter`.
    Load {
        /// The adapter's id, as requests name it.
        adapter: u32,
        /// Where its weights are.
        path: std::path::PathBuf,
    },
    /// Unload adapter `adapter`, freeing its slot; refused while a live sequence uses it.
    Unload {
        /// The adapter's id.
        adapter: u32,
    },
    /// List the loaded adapters.
    List,
}

impl Label for LoraCommand {
    fn label(&self) -> String {
        match self {
            LoraCommand::Load { adapter, .. } => format!("Load{{adapter={adapter}}}"),
            LoraCommand::Unload { adapter } => format!("Unload{{adapter={adapter}}}"),
            LoraCommand::List => "List".to_string(),
        }
    }
}

/// One loaded adapter, as [`LoraAck::Loaded`] and [`LoraAck::Listed`] report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    /// The adapter's id.
    pub adapter: u32,
    /// The slot it occupies.
    pub slot: usize,
    /// The folder it was loaded from.
    pub path: std::path::PathBuf,
    /// Its rank `r`.
    pub rank: usize,
    /// How many linear layers it adapts.
    pub modules: usize,
    /// Live sequences using it now.
    pub sequences: usize,
}

/// What a [`LoraCommand`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraAck {
    /// The adapter was loaded into a slot.
    Loaded(AdapterInfo),
    /// The adapter was unloaded and its slot freed.
    Unloaded {
        /// The adapter's id.
        adapter: u32,
        /// The slot freed.
        slot: usize,
    },
    /// The loaded adapters, by slot.
    Listed {
        /// The router's number of adapter slots.
        slots: usize,
        /// The loaded adapters, in slot order.
        adapters: Vec<AdapterInfo>,
    },
}

impl Label for LoraAck {
    fn label(&self) -> String {
        match self {
            LoraAck::Loaded(info) => format!(
                "Loaded{{adapter={}, slot={}, rank={}, modules={}}}",
                info.adapter, info.slot, info.rank, info.modules
            ),
            LoraAck::Unloaded { adapter, slot } => {
                format!("Unloaded{{adapter={adapter}, slot={slot}}}")
            }
            LoraAck::Listed { slots, adapters } => {
                let ids: Vec<String> = adapters.iter().map(|a| a.adapter.to_string()).collect();
                format!("Listed{{slots={slots}, adapters=[{}]}}", ids.join(", "))
            }
        }
    }
}

/// The ack of a router whose commands answer nothing.
impl Label for () {
    fn label(&self) -> String {
        "ok".to_string()
    }
}

/// Why a [`LoraCommand`] was refused. A refused command changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    /// The router serves no adapters (or not this command).
    #[error("{what} is not supported by this router")]
    Unsupported {
        /// The command.
        what: &'static str,
    },
    /// A step is in flight: commands run only at quiescence.
    #[error("{in_flight} launched step(s) are not awaited yet; LoRA commands run only when no step is in flight")]
    Busy {
        /// Steps launched and not awaited.
        in_flight: usize,
    },
    /// The id is already loaded.
    #[error("adapter {adapter} is already loaded (slot {slot}); unload it first")]
    AlreadyLoaded {
        /// The adapter's id.
        adapter: u32,
        /// Its slot.
        slot: usize,
    },
    /// Every slot holds an adapter.
    #[error("all {slots} adapter slots are in use; unload one first")]
    NoFreeSlot {
        /// The router's number of slots.
        slots: usize,
    },
    /// The id is not loaded.
    #[error("adapter {adapter} is not loaded")]
    NotLoaded {
        /// The adapter's id.
        adapter: u32,
    },
    /// Live sequences (or, said by an engine, unfinished requests) use the adapter.
    #[error("adapter {adapter} is in use by {} sequence(s) ({}); it can be unloaded once they end", .sequences.len(), list(.sequences))]
    InUse {
        /// The adapter's id.
        adapter: u32,
        /// The ids of the sequences (or requests) using it.
        sequences: Vec<u64>,
    },
    /// The adapter's files are missing, malformed, or do not fit the model.
    #[error("cannot load adapter {adapter}: {reason}")]
    BadAdapter {
        /// The adapter's id.
        adapter: u32,
        /// The router's explanation, naming the file and the problem.
        reason: String,
    },
    /// The device is gone.
    #[error("device lost: {0}")]
    DeviceLost(String),
}

fn list(ids: &[u64]) -> String {
    let shown: Vec<String> = ids.iter().take(8).map(u64::to_string).collect();
    if ids.len() > shown.len() {
        format!("{}, ...", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

impl Label for LoraError {
    fn label(&self) -> String {
        match self {
            LoraError::Unsupported { what } => format!("Unsupported{{{what}}}"),
            LoraError::Busy { in_flight } => format!("Busy{{in_flight={in_flight}}}"),
            LoraError::AlreadyLoaded { adapter, slot } => {
                format!("AlreadyLoaded{{adapter={adapter}, slot={slot}}}")
            }
            LoraError::NoFreeSlot { slots } => format!("NoFreeSlot{{slots={slots}}}"),
            LoraError::NotLoaded { adapter } => format!("NotLoaded{{adapter={adapter}}}"),
            LoraError::InUse { adapter, sequences } => {
                format!("InUse{{adapter={adapter}, sequences={}}}", sequences.len())
            }
            // The reason names paths, which vary.
            LoraError::BadAdapter { adapter, .. } => format!("BadAdapter{{adapter={adapter}}}"),
            LoraError::DeviceLost(_) => "DeviceLost".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Readback;

    type E<'a> = Effect<'a, u32, u64>;

    fn check(effect: E<'_>, expected: &str) {
        assert_eq!(effect.label(), expected);
    }

    #[test]
    fn every_effect_has_its_label() {
        let mut seq = 7u32;
        let mut sink: Vec<u8> = Vec::new();
        let mut bytes: Vec<u8> = Vec::new();
        let mut source: &[u8] = &[];
        check(
            E::ReleaseSeq {
                seq: &mut seq,
                cache: true,
                what: "finish",
            },
            "ReleaseSeq{cache=true, finish}",
        );
        check(
            E::CompactSlot {
                seq: &mut seq,
                target: 2,
            },
            "CompactSlot{target=2}",
        );
        check(E::DetachSlot { seq: &mut seq }, "DetachSlot");
        check(
            E::SaveSequenceState {
                seq: &seq,
                writer: &mut sink,
            },
            "SaveSequenceState",
        );
        check(
            E::RestoreSequenceState {
                seq: &mut seq,
                reader: &mut source,
            },
            "RestoreSequenceState",
        );
        check(
            E::ReadLogits {
                logits: 9,
                rows: 4,
                into: &mut bytes,
            },
            "ReadLogits{rows=4}",
        );
        check(E::MarconiCheckpoint { seq: &mut seq }, "MarconiCheckpoint");
        check(
            E::SsmSnapshotSave { seq: &seq, slot: 0 },
            "SsmSnapshotSave{slot=0}",
        );
        check(
            E::SsmSnapshotRestore {
                seq: &mut seq,
                slot: 1,
            },
            "SsmSnapshotRestore{slot=1}",
        );
        check(
            E::SaveHiddenCatchup { row: 0, pos: 17 },
            "SaveHiddenCatchup{row=0, pos=17}",
        );
        check(E::SyncSecondary, "SyncSecondary");
        check(E::EpShutdown, "EpShutdown");
        check(E::Quiesce { stream: 1 }, "Quiesce{stream=1}");
        check(E::ReserveKv { seq: &mut seq }, "ReserveKv");
        check(E::Rollback { seq: &mut seq }, "Rollback");
        check(
            E::TruncateKv {
                seq: &mut seq,
                len: 12,
            },
            "TruncateKv{len=12}",
        );
    }

    #[test]
    fn plans_outcomes_and_errors_have_labels() {
        let mut logits = Vec::new();
        let cases: Vec<(String, &str)> = vec![
            (
                StepPlan::Decode {
                    tokens: &[1, 2, 3, 4],
                    readback: Readback::Argmax,
                }
                .label(),
                "Decode{n=4, readback=Argmax}",
            ),
            (
                StepPlan::Prefill {
                    budgets: &[16, 8],
                    readback: Readback::HostLogits { into: &mut logits },
                }
                .label(),
                "Prefill{n=2, budget=24, readback=HostLogits}",
            ),
            (
                StepPlan::DecodeFed {
                    sources: &[
                        crate::Feed::Row(0),
                        crate::Feed::Row(1),
                        crate::Feed::Host(7),
                    ],
                    masks: &[],
                }
                .label(),
                "DecodeFed{n=3, fed=2, masked=false}",
            ),
            (
                StepPlan::Verify {
                    inputs: &[&[1, 2, 3], &[4]],
                    snapshots: &[&[0, 1], &[]],
                    readback: Readback::Argmax,
                }
                .label(),
                "Verify{n=2, drafts=2, snapshots=true, readback=Argmax}",
            ),
            (
                StepPlan::Draft {
                    tokens: &[1, 2],
                    k: 3,
                }
                .label(),
                "Draft{n=2, k=3}",
            ),
            (
                EffectOutcome::Reserved { blocks: 1 }.label(),
                "Reserved{blocks=1}",
            ),
            (
                EffectOutcome::HostLogits { elem_bytes: 4 }.label(),
                "HostLogits{elem_bytes=4}",
            ),
            (EffectOutcome::Unit.label(), "Unit"),
            (EffectOutcome::Exhausted.label(), "Exhausted"),
            (
                DeviceError::KvExhausted { needed: 2, free: 0 }.label(),
                "KvExhausted{needed=2, free=0}",
            ),
            (
                DeviceError::Unsupported { what: "Rollback" }.label(),
                "Unsupported{Rollback}",
            ),
            (
                DeviceError::UnknownTicket(crate::Ticket(3)).label(),
                "UnknownTicket{3}",
            ),
            (
                LoraCommand::Unload { adapter: 5 }.label(),
                "Unload{adapter=5}",
            ),
            (LoraCommand::List.label(), "List"),
            (
                LoraAck::Unloaded {
                    adapter: 5,
                    slot: 1,
                }
                .label(),
                "Unloaded{adapter=5, slot=1}",
            ),
            (
                LoraError::InUse {
                    adapter: 5,
                    sequences: vec![3, 4],
                }
                .label(),
                "InUse{adapter=5, sequences=2}",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn error_messages_name_the_values() {
        assert_eq!(
            LoraError::InUse {
                adapter: 2,
                sequences: vec![7, 9]
            }
            .to_string(),
            "adapter 2 is in use by 2 sequence(s) (7, 9); it can be unloaded once they end"
        );
        assert_eq!(
            LoraError::NoFreeSlot { slots: 4 }.to_string(),
            "all 4 adapter slots are in use; unload one first"
        );
        assert_eq!(
            DeviceError::KvExhausted { needed: 3, free: 1 }.to_string(),
            "KV cache exhausted: needed 3 blocks, 1 free"
        );
        assert_eq!(
            DeviceError::UnknownTicket(crate::Ticket(4)).to_string(),
            "unknown or already-claimed ticket 4"
        );
        assert_eq!(
            DeviceError::Unsupported { what: "Rollback" }.to_string(),
            "Rollback is not supported by this router"
        );
    }
}
