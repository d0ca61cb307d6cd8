//! The crate's error type: every bad input (config field, tensor, id, position) is one typed case
//! whose message names the bad value and the limit it broke.

use std::path::PathBuf;

/// Everything that can go wrong in this crate. A call that returns an error has changed nothing
/// (no KV block, Mamba state slot or output buffer other than `logits` was touched).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// An expert-parallel worker stopped answering (its thread ended) during a MoE layer.
    #[error("expert-parallel worker {worker} is lost (its thread ended); the step's state is unspecified")]
    ExpertWorkerLost {
        /// The worker's index.
        worker: usize,
    },
    /// The expert-parallel workers were shut down (`EpShutdown`) and a MoE layer needed them.
    #[error("the expert-parallel workers were shut down; no MoE layer can run")]
    ExpertWorkersStopped,
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON for this config type.
    #[error("config.json does not parse: {0}")]
    ConfigJson(String),
    /// A field the forward pass needs is absent from `config.json`.
    #[error("config field `{field}` is missing (needed by {needed_by})")]
    MissingConfigField {
        /// The missing field.
        field: &'static str,
        /// The layer kind (or part of the model) that needs it.
        needed_by: &'static str,
    },
    /// A config field has a value the model cannot run with.
    #[error("config field `{field}` = {value} is invalid: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// The rule it breaks.
        reason: String,
    },
    /// A character of `hybrid_override_pattern` (or the MTP pattern) is not one of `M * - E`.
    #[error("unknown block letter {letter:?} at position {position} of `{field}` (expected one of M, *, -, E)")]
    UnknownBlockLetter {
        /// The pattern field.
        field: &'static str,
        /// The bad character.
        letter: char,
        /// Its 0-based index in the pattern.
        position: usize,
    },
    /// An entry of `layers_block_type` (or the MTP list) is not a known block type.
    #[error("unknown block type {name:?} at index {position} of `{field}` (expected linear_attention/mamba, full_attention/attention, mlp or moe)")]
    UnknownBlockType {
        /// The list field.
        field: &'static str,
        /// The bad entry.
        name: String,
        /// Its index in the list.
        position: usize,
    },
    /// A safetensors file is truncated or corrupt.
    #[error("safetensors file {path} is invalid: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// A tensor holds NaN or an infinity: the checkpoint is corrupt (a forward pass over it
    /// would produce garbage, e.g. the same token forever).
    #[error("tensor `{name}` in {path} holds a non-finite value ({value}) at element {index}")]
    NonFiniteWeight {
        /// The file.
        path: PathBuf,
        /// The checkpoint name.
        name: String,
        /// The first bad element (row-major).
        index: usize,
        /// Its value (NaN or ±inf).
        value: f32,
    },
    /// A tensor the config requires is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// The checkpoint name.
        name: String,
    },
    /// A tensor has a shape that does not match the config.
    #[error("tensor `{name}` in {path} has shape {actual:?}, the config requires {expected:?}")]
    TensorShape {
        /// The file.
        path: PathBuf,
        /// The checkpoint name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor is stored in a dtype other than f32, bf16 or f16.
    #[error("tensor `{name}` in {path} has dtype {dtype}, only F32, BF16 and F16 are supported")]
    TensorDtype {
        /// The file.
        path: PathBuf,
        /// The checkpoint name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// The checkpoint holds a tensor the config does not explain (e.g. a bias with `use_bias = false`).
    #[error("tensor `{name}` in {path} is not expected by the config")]
    UnexpectedTensor {
        /// The file.
        path: PathBuf,
        /// The checkpoint name.
        name: String,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {token} at input index {index} is out of range (vocab_size = {vocab_size})")]
    TokenOutOfRange {
        /// The bad id.
        token: u32,
        /// Where it was in the call's input.
        index: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A prefill with no tokens or a decode with no rows.
    #[error("empty input: {0}")]
    EmptyInput(&'static str),
    /// A block id is not in the KV pool.
    #[error("KV block id {block} is out of range (pool has {num_blocks} blocks)")]
    BadBlock {
        /// The bad id.
        block: u32,
        /// The pool size.
        num_blocks: usize,
    },
    /// A position lies beyond what the row's block table covers.
    #[error("position {position} is beyond the block table ({blocks} blocks x {block_size} tokens = {capacity} positions)")]
    PositionBeyondBlocks {
        /// The first uncovered position.
        position: usize,
        /// Blocks in the table.
        blocks: usize,
        /// Tokens per block.
        block_size: usize,
        /// Positions covered.
        capacity: usize,
    },
    /// A Mamba state slot id is out of range.
    #[error("Mamba state slot {slot} is out of range ({num_slots} slots)")]
    BadSlot {
        /// The bad slot.
        slot: usize,
        /// The number of slots.
        num_slots: usize,
    },
    /// A hidden row of a state slot that the store does not have.
    #[error("hidden row {row} does not exist: state slots hold {rows} hidden rows")]
    BadHiddenRow {
        /// The bad row.
        row: usize,
        /// Rows per slot.
        rows: usize,
    },
    /// A range of Mamba layers that the store does not have.
    #[error("Mamba layers {start}..{end} do not exist: state slots hold {layers} Mamba layers")]
    BadLayers {
        /// First layer of the range.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// Mamba layers per slot.
        layers: usize,
    },
    /// A run names snapshot slots, but not one per token.
    #[error("run {run} names {actual} snapshot slots for its {expected} tokens (one per token, or none)")]
    SnapshotCount {
        /// The run's index.
        run: usize,
        /// Its tokens.
        expected: usize,
        /// The snapshot slots it named.
        actual: usize,
    },
    /// The model carries no MTP head (its checkpoint had no `mtp.*` tensors).
    #[error("the model has no MTP head (the checkpoint carries no `mtp.*` tensors)")]
    NoMtpHead,
    /// Two rows of one decode batch name the same Mamba state slot.
    #[error("decode rows {first} and {second} both use Mamba state slot {slot}")]
    DuplicateSlot {
        /// The slot.
        slot: usize,
        /// The first row using it.
        first: usize,
        /// The second row using it.
        second: usize,
    },
    /// Two rows of one decode batch would write K/V into the same block position.
    #[error("decode rows {first} and {second} both write KV block {block} offset {offset}")]
    DuplicateKvWrite {
        /// The block.
        block: u32,
        /// The offset inside it.
        offset: usize,
        /// The first row.
        first: usize,
        /// The second row.
        second: usize,
    },
    /// A buffer handed in has the wrong length.
    #[error("{what} has {actual} floats, expected {expected}")]
    LengthMismatch {
        /// What the buffer is.
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The given length.
        actual: usize,
    },
    /// A KV pool or state store built for another config was passed to a model.
    #[error("{what} was built for another config: {detail}")]
    LayoutMismatch {
        /// `KvPool` or `MambaStates`.
        what: &'static str,
        /// Which dimension differs.
        detail: String,
    },
    /// A size computation overflowed `usize` (absurd config or pool size).
    #[error("size overflow computing {0}")]
    SizeOverflow(&'static str),
    /// The memory for a pool or store could not be allocated (more than the machine or its limits
    /// allow).
    #[error("could not allocate {bytes} bytes ({gib:.1} GiB) for the {what}", gib = *.bytes as f64 / f64::from(1u32 << 30))]
    AllocationFailed {
        /// `KV pool` or `Mamba state store`.
        what: &'static str,
        /// The size asked for.
        bytes: u64,
    },
    /// Writing a checkpoint failed.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A LoRA adapter is unusable: the file at fault and what is wrong with it.
    #[error("LoRA adapter file {path}: {problem}")]
    Adapter {
        /// The file (`adapter_config.json` or `adapter_model.safetensors`).
        path: PathBuf,
        /// What is wrong.
        problem: crate::AdapterProblem,
    },
    /// A LoRA adapter was checked against another base model than the one asked to run it.
    #[error("LoRA adapter {adapter} was loaded for the model with fingerprint {adapter_base:#018x}, not this one ({model:#018x})")]
    AdapterMismatch {
        /// The adapter's folder (or `<random adapter>`).
        adapter: String,
        /// The base fingerprint it was checked against.
        adapter_base: u64,
        /// The model's fingerprint.
        model: u64,
    },
    /// The per-row adapters handed to a forward call do not match its rows.
    #[error("{adapters} adapters given for {rows} rows")]
    AdapterRows {
        /// Adapters given.
        adapters: usize,
        /// Rows in the call.
        rows: usize,
    },
    /// A reference-fixture folder is malformed (parity checking only).
    #[error("fixture {path}: {reason}")]
    Fixture {
        /// The fixture folder or file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}
