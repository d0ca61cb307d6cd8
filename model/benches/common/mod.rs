//! The decode batch the host-forward benchmarks time (`forward.rs`, `lora.rs`): rows with a
//! `CONTEXT`-token context each, in blocks and a state slot of their own, that decode position
//! `CONTEXT` again on every iteration (overwriting its K/V), so the context length stays fixed
//! while the Mamba state keeps stepping.

use model::{DecodeRow, KvPool, LoraAdapter, MambaStates, Model, PrefillRow, Scratch};

pub const BLOCK_SIZE: usize = 16;
pub const CONTEXT: usize = 128;
/// Blocks a row needs: its context and the position it decodes.
pub const BLOCKS_PER_ROW: usize = (CONTEXT + 1).div_ceil(BLOCK_SIZE);

/// One block table per row: row `r` holds blocks `r * BLOCKS_PER_ROW..(r + 1) * BLOCKS_PER_ROW`.
pub fn block_tables(rows: usize) -> Vec<Vec<u32>> {
    (0..rows)
        .map(|r| ((r * BLOCKS_PER_ROW) as u32..((r + 1) * BLOCKS_PER_ROW) as u32).collect())
        .collect()
}

/// Row `slot`'s context: `CONTEXT` token ids in a fixed pattern.
pub fn context(slot: usize, vocab: u32) -> Vec<u32> {
    (0..CONTEXT as u32)
        .map(|t| (t * 31 + slot as u32 * 7) % vocab)
        .collect()
}

/// Prefills each row's [`context`] into its table of `tables` and state slot (the row's index),
/// with the row's adapter of `adapters` (none past its end).
pub fn prefill_contexts(
    model: &Model,
    scratch: &mut Scratch,
    kv: &mut KvPool,
    states: &mut MambaStates,
    tables: &[Vec<u32>],
    adapters: &[Option<&LoraAdapter>],
) {
    let vocab = model.config().vocab_size as u32;
    let mut logits = Vec::new();
    for (slot, table) in tables.iter().enumerate() {
        let tokens = context(slot, vocab);
        let row = PrefillRow {
            tokens: &tokens,
            start_pos: 0,
            blocks: table,
            slot,
        };
        let adapter = adapters.get(slot).copied().flatten();
        model
            .prefill_with_adapter(scratch, kv, states, row, adapter, false, &mut logits)
            .expect("prefill");
    }
}

/// The decode rows of the prefilled rows: row `slot` feeds a fixed token at position `CONTEXT`.
pub fn decode_rows(tables: &[Vec<u32>], vocab: u32) -> Vec<DecodeRow<'_>> {
    tables
        .iter()
        .enumerate()
        .map(|(slot, table)| DecodeRow {
            token: (slot as u32 * 13) % vocab,
            pos: CONTEXT,
            blocks: table,
            slot,
        })
        .collect()
}
