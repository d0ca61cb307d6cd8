//! Per-sequence state the caller owns: the paged K/V pool of all attention layers ([`KvPool`]) and
//! the Mamba2 conv + SSM state of all Mamba layers, one flat slot per sequence ([`MambaStates`]).
//! With an MTP head ([`Config::mtp`]) both also hold the MTP layers' K/V and Mamba state: the MTP
//! head's layers count after the main stack's, so one block table and one slot serve both.
//!
//! **KV layout.** Block `b` is one contiguous run of [`KvPool::floats_per_block`] floats at
//! `b * floats_per_block`. Inside it, attention layer `a` (counting attention layers only, in stack
//! order, the MTP head's last) owns `2 * block_size * kv_heads * head_dim` floats: first K, then V, each
//! `[block_size, kv_heads, head_dim]`. Token position `p` of a sequence lives in block
//! `table[p / block_size]` at offset `p % block_size`. Keys are stored as projected (no RoPE).
//!
//! **Mamba layout.** Slot `s` is one contiguous run of [`MambaStates::floats_per_slot`] floats.
//! Inside it, Mamba layer `m` (counting Mamba layers only, the MTP head's last) owns
//! `conv_floats + ssm_floats`: first the last `K - 1` pre-conv `xBC` vectors, oldest first
//! (`[K-1, conv_dim]`), then the SSM state `[H, P, N]`. A store built with hidden rows
//! ([`MambaStates::with_hidden_rows`]) ends each slot with that many rows of `hidden_size` floats,
//! which the model never reads or writes itself: a router keeps the MTP head's hidden-state inputs
//! there (its catch-up ring), so that whatever copies, spills or checkpoints a slot carries them
//! along. A slot must be all zeros before a sequence's first token ([`MambaStates::zero_slot`]);
//! the model never zeroes it, because a prefill starting at position p > 0 legitimately continues
//! from a restored state.

use std::ops::Range;

use crate::{Config, LayerKind, ModelError};

/// `len` zeros, or an error (instead of an abort) when the allocation cannot be made.
fn zeroed(len: usize, what: &'static str) -> Result<Vec<f32>, ModelError> {
    let mut data = Vec::new();
    data.try_reserve_exact(len)
        .map_err(|_| ModelError::AllocationFailed {
            what,
            bytes: (len as u64).saturating_mul(std::mem::size_of::<f32>() as u64),
        })?;
    data.resize(len, 0.0);
    Ok(data)
}

/// K/V for every attention layer of a model, in fixed-size blocks addressed by block id.
#[derive(Debug, Clone)]
pub struct KvPool {
    data: Vec<f32>,
    num_blocks: usize,
    block_size: usize,
    attention_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    floats_per_block: usize,
}

impl KvPool {
    /// A zeroed pool of `num_blocks` blocks of `block_size` tokens for `config`'s attention layers.
    pub fn new(config: &Config, num_blocks: usize, block_size: usize) -> Result<Self, ModelError> {
        config.validate()?;
        if block_size == 0 {
            return Err(ModelError::InvalidConfig {
                field: "block_size",
                value: "0".into(),
                reason: "a KV block holds at least one token".into(),
            });
        }
        if num_blocks > u32::MAX as usize + 1 {
            return Err(ModelError::InvalidConfig {
                field: "num_blocks",
                value: num_blocks.to_string(),
                reason: "block ids are u32".into(),
            });
        }
        let attention_layers = config.stored_count(LayerKind::Attention);
        let (kv_heads, head_dim) = if attention_layers == 0 {
            (0, 0)
        } else {
            (config.num_key_value_heads, config.head_dim)
        };
        let floats_per_block = attention_layers
            .checked_mul(2 * block_size)
            .and_then(|x| x.checked_mul(kv_heads))
            .and_then(|x| x.checked_mul(head_dim))
            .ok_or(ModelError::SizeOverflow("KV floats per block"))?;
        let total = floats_per_block
            .checked_mul(num_blocks)
            .ok_or(ModelError::SizeOverflow("KV pool size"))?;
        Ok(Self {
            data: zeroed(total, "KV pool")?,
            num_blocks,
            block_size,
            attention_layers,
            kv_heads,
            head_dim,
            floats_per_block,
        })
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Floats of one block: all attention layers, K and V.
    pub fn floats_per_block(&self) -> usize {
        self.floats_per_block
    }

    /// Attention layers covered.
    pub fn attention_layers(&self) -> usize {
        self.attention_layers
    }

    fn check(&self, block: u32) -> Result<usize, ModelError> {
        let b = block as usize;
        if b < self.num_blocks {
            Ok(b * self.floats_per_block)
        } else {
            Err(ModelError::BadBlock {
                block,
                num_blocks: self.num_blocks,
            })
        }
    }

    /// Copies block `src` over block `dst` (copy-on-write for forked sequences).
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ModelError> {
        let from = self.check(src)?;
        let to = self.check(dst)?;
        self.data
            .copy_within(from..from + self.floats_per_block, to);
        Ok(())
    }

    /// The floats of one block (all layers, K and V), for spilling.
    pub fn block(&self, block: u32) -> Result<&[f32], ModelError> {
        let start = self.check(block)?;
        Ok(&self.data[start..start + self.floats_per_block])
    }

    /// Appends the block's floats (all layers) to `out`.
    pub fn export_block(&self, block: u32, out: &mut Vec<f32>) -> Result<(), ModelError> {
        out.extend_from_slice(self.block(block)?);
        Ok(())
    }

    /// Overwrites a block with floats produced by [`KvPool::export_block`].
    pub fn import_block(&mut self, block: u32, data: &[f32]) -> Result<(), ModelError> {
        let start = self.check(block)?;
        if data.len() != self.floats_per_block {
            return Err(ModelError::LengthMismatch {
                what: "imported KV block",
                expected: self.floats_per_block,
                actual: data.len(),
            });
        }
        self.data[start..start + self.floats_per_block].copy_from_slice(data);
        Ok(())
    }

    /// The floats of token offset `offset` (`< block_size`) inside a block, relative to the
    /// block's start: per attention layer its K, then its V (`2 × attention_layers` ranges of
    /// `kv_heads × head_dim` floats). A router that keeps this layout on a device finds one
    /// position's K/V there.
    pub fn offset_ranges(&self, offset: usize) -> Vec<Range<usize>> {
        let width = self.kv_heads * self.head_dim;
        let mut ranges = Vec::with_capacity(2 * self.attention_layers);
        if offset >= self.block_size {
            return ranges;
        }
        for layer in 0..self.attention_layers {
            let key = layer * 2 * self.block_size * width + offset * width;
            ranges.push(key..key + width);
            ranges.push(key + self.value_offset()..key + self.value_offset() + width);
        }
        ranges
    }

    /// Overwrites token offset `offset` of block `block` with `value` in every attention layer,
    /// K and V (what a failed device step leaves where it wrote: a router's fault injection).
    pub fn fill_offset(&mut self, block: u32, offset: usize, value: f32) -> Result<(), ModelError> {
        let start = self.check(block)?;
        if offset >= self.block_size {
            return Err(ModelError::PositionBeyondBlocks {
                position: offset,
                blocks: 1,
                block_size: self.block_size,
                capacity: self.block_size,
            });
        }
        for range in self.offset_ranges(offset) {
            self.data[start + range.start..start + range.end].fill(value);
        }
        Ok(())
    }

    /// Errors unless the pool was built for `config`'s attention geometry.
    pub(crate) fn check_layout(&self, config: &Config) -> Result<(), ModelError> {
        let layers = config.stored_count(LayerKind::Attention);
        if layers == 0 {
            return Ok(());
        }
        if (self.attention_layers, self.kv_heads, self.head_dim)
            != (layers, config.num_key_value_heads, config.head_dim)
        {
            return Err(ModelError::LayoutMismatch {
                what: "KvPool",
                detail: format!(
                    "pool has {} attention layers x {} KV heads x {} dims, model needs {} x {} x {}",
                    self.attention_layers,
                    self.kv_heads,
                    self.head_dim,
                    layers,
                    config.num_key_value_heads,
                    config.head_dim
                ),
            });
        }
        Ok(())
    }

    /// Index of `K[layer][offset][head][0]` in block `block` (ids already validated).
    #[inline]
    pub(crate) fn key_index(&self, layer: usize, block: u32, offset: usize, head: usize) -> usize {
        block as usize * self.floats_per_block
            + layer * 2 * self.block_size * self.kv_heads * self.head_dim
            + (offset * self.kv_heads + head) * self.head_dim
    }

    /// Distance from a key to its value.
    #[inline]
    pub(crate) fn value_offset(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }

    pub(crate) fn data(&self) -> &[f32] {
        &self.data
    }

    pub(crate) fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

/// Sizes of one Mamba state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MambaLayout {
    /// Mamba layers in the model.
    pub mamba_layers: usize,
    /// Floats of one layer's conv history: `(conv_kernel - 1) * conv_dim`.
    pub conv_floats: usize,
    /// Floats of one layer's SSM state: `H * P * N`.
    pub ssm_floats: usize,
    /// Floats of the hidden rows at the end of a slot (0 unless asked for).
    pub hidden_floats: usize,
}

impl MambaLayout {
    /// The layout `config` (validated) needs: its Mamba layers (the MTP head's too), no hidden
    /// rows.
    pub fn of(config: &Config) -> Result<Self, ModelError> {
        let mamba_layers = config.stored_count(LayerKind::Mamba);
        if mamba_layers == 0 {
            return Ok(Self {
                mamba_layers: 0,
                conv_floats: 0,
                ssm_floats: 0,
                hidden_floats: 0,
            });
        }
        let conv_floats = config
            .conv_kernel
            .saturating_sub(1)
            .checked_mul(config.mamba_conv_dim())
            .ok_or(ModelError::SizeOverflow("Mamba conv state"))?;
        let ssm_floats = config
            .mamba_inner()
            .checked_mul(config.ssm_state_size)
            .ok_or(ModelError::SizeOverflow("Mamba SSM state"))?;
        let layout = Self {
            mamba_layers,
            conv_floats,
            ssm_floats,
            hidden_floats: 0,
        };
        layout
            .layer_floats()
            .checked_mul(mamba_layers)
            .ok_or(ModelError::SizeOverflow("Mamba state slot"))?;
        Ok(layout)
    }

    /// Floats of one layer (conv history then SSM state).
    pub fn layer_floats(&self) -> usize {
        self.conv_floats + self.ssm_floats
    }

    /// Floats of the Mamba layers of one slot (what the model reads and writes).
    pub fn state_floats(&self) -> usize {
        self.layer_floats() * self.mamba_layers
    }

    /// Floats of one slot (all Mamba layers, then the hidden rows).
    pub fn floats_per_slot(&self) -> usize {
        self.state_floats() + self.hidden_floats
    }
}

/// Conv and SSM state of every Mamba layer, one flat slot per live sequence.
#[derive(Debug, Clone)]
pub struct MambaStates {
    data: Vec<f32>,
    num_slots: usize,
    layout: MambaLayout,
    /// Floats of one hidden row (`hidden_size`).
    hidden_width: usize,
}

impl MambaStates {
    /// `num_slots` zeroed slots for `config`.
    pub fn new(config: &Config, num_slots: usize) -> Result<Self, ModelError> {
        Self::with_hidden_rows(config, num_slots, 0)
    }

    /// `num_slots` zeroed slots for `config`, each ending with `hidden_rows` rows of
    /// `hidden_size` floats for the caller (see the module docs).
    pub fn with_hidden_rows(
        config: &Config,
        num_slots: usize,
        hidden_rows: usize,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let mut layout = MambaLayout::of(config)?;
        layout.hidden_floats = hidden_rows
            .checked_mul(config.hidden_size)
            .ok_or(ModelError::SizeOverflow("hidden rows of a state slot"))?;
        layout
            .state_floats()
            .checked_add(layout.hidden_floats)
            .ok_or(ModelError::SizeOverflow("Mamba state slot"))?;
        let total = layout
            .floats_per_slot()
            .checked_mul(num_slots)
            .ok_or(ModelError::SizeOverflow("Mamba state store"))?;
        Ok(Self {
            data: zeroed(total, "Mamba state store")?,
            num_slots,
            layout,
            hidden_width: if hidden_rows > 0 {
                config.hidden_size
            } else {
                0
            },
        })
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Floats per slot.
    pub fn floats_per_slot(&self) -> usize {
        self.layout.floats_per_slot()
    }

    /// The slot layout.
    pub fn layout(&self) -> MambaLayout {
        self.layout
    }

    fn range(&self, slot: usize) -> Result<std::ops::Range<usize>, ModelError> {
        if slot >= self.num_slots {
            return Err(ModelError::BadSlot {
                slot,
                num_slots: self.num_slots,
            });
        }
        let n = self.floats_per_slot();
        Ok(slot * n..(slot + 1) * n)
    }

    /// One sequence's whole state (for checkpoints and spills).
    pub fn slot(&self, slot: usize) -> Result<&[f32], ModelError> {
        let range = self.range(slot)?;
        Ok(&self.data[range])
    }

    /// One sequence's whole state, writable (for restoring checkpoints).
    pub fn slot_mut(&mut self, slot: usize) -> Result<&mut [f32], ModelError> {
        let range = self.range(slot)?;
        Ok(&mut self.data[range])
    }

    /// Zeroes a slot; required before a new sequence's first token.
    pub fn zero_slot(&mut self, slot: usize) -> Result<(), ModelError> {
        self.slot_mut(slot)?.fill(0.0);
        Ok(())
    }

    /// Copies slot `src` over slot `dst`.
    pub fn copy_slot(&mut self, src: usize, dst: usize) -> Result<(), ModelError> {
        let from = self.range(src)?;
        let to = self.range(dst)?;
        self.data.copy_within(from, to.start);
        Ok(())
    }

    /// Appends a slot's floats to `out`.
    pub fn export_slot(&self, slot: usize, out: &mut Vec<f32>) -> Result<(), ModelError> {
        out.extend_from_slice(self.slot(slot)?);
        Ok(())
    }

    /// Overwrites a slot with floats produced by [`MambaStates::export_slot`].
    pub fn import_slot(&mut self, slot: usize, data: &[f32]) -> Result<(), ModelError> {
        let expected = self.floats_per_slot();
        let target = self.slot_mut(slot)?;
        if data.len() != expected {
            return Err(ModelError::LengthMismatch {
                what: "imported Mamba state slot",
                expected,
                actual: data.len(),
            });
        }
        target.copy_from_slice(data);
        Ok(())
    }

    /// Row `row` of the hidden rows of `slot` (`hidden_size` floats).
    pub fn hidden_row(&self, slot: usize, row: usize) -> Result<&[f32], ModelError> {
        let range = self.hidden_range(slot, row)?;
        Ok(&self.data[range])
    }

    /// Row `row` of the hidden rows of `slot`, writable.
    pub fn hidden_row_mut(&mut self, slot: usize, row: usize) -> Result<&mut [f32], ModelError> {
        let range = self.hidden_range(slot, row)?;
        Ok(&mut self.data[range])
    }

    /// Hidden rows per slot.
    pub fn hidden_rows(&self) -> usize {
        self.layout
            .hidden_floats
            .checked_div(self.hidden_width)
            .unwrap_or(0)
    }

    fn hidden_range(&self, slot: usize, row: usize) -> Result<std::ops::Range<usize>, ModelError> {
        let slot_range = self.range(slot)?;
        let rows = self.hidden_rows();
        if row >= rows {
            return Err(ModelError::BadHiddenRow { row, rows });
        }
        let start = slot_range.start + self.layout.state_floats() + row * self.hidden_width;
        Ok(start..start + self.hidden_width)
    }

    /// Errors unless the store was built for `config` (its Mamba layers; hidden rows are the
    /// caller's).
    pub(crate) fn check_layout(&self, config: &Config) -> Result<(), ModelError> {
        let mut needed = MambaLayout::of(config)?;
        needed.hidden_floats = self.layout.hidden_floats;
        if needed != self.layout {
            return Err(ModelError::LayoutMismatch {
                what: "MambaStates",
                detail: format!("store has {:?}, model needs {:?}", self.layout, needed),
            });
        }
        Ok(())
    }

    /// Copies the Mamba layers `layers` (conv history and SSM state; not the hidden rows) of slot
    /// `src` over slot `dst`.
    pub fn copy_layers(
        &mut self,
        src: usize,
        dst: usize,
        layers: std::ops::Range<usize>,
    ) -> Result<(), ModelError> {
        let from = self.range(src)?;
        let to = self.range(dst)?;
        if layers.end > self.layout.mamba_layers || layers.start > layers.end {
            return Err(ModelError::BadLayers {
                start: layers.start,
                end: layers.end,
                layers: self.layout.mamba_layers,
            });
        }
        let per = self.layout.layer_floats();
        let span = layers.start * per..layers.end * per;
        self.data.copy_within(
            from.start + span.start..from.start + span.end,
            to.start + span.start,
        );
        Ok(())
    }

    /// Copies the conv history of Mamba layer `layer` of slot `src` over slot `dst` (both
    /// validated); the forward pass copies the SSM state head by head.
    pub(crate) fn copy_conv(&mut self, src: usize, dst: usize, layer: usize) {
        let per = self.layout.layer_floats();
        let n = self.floats_per_slot();
        let from = src * n + layer * per;
        self.data
            .copy_within(from..from + self.layout.conv_floats, dst * n + layer * per);
    }

    /// Conv history of Mamba layer `layer` in `slot` (slot already validated).
    pub(crate) fn conv(&self, slot: usize, layer: usize) -> &[f32] {
        let start = slot * self.floats_per_slot() + layer * self.layout.layer_floats();
        &self.data[start..start + self.layout.conv_floats]
    }

    /// Conv history and SSM state of Mamba layer `layer` in `slot` (slot already validated).
    pub(crate) fn layer_mut(&mut self, slot: usize, layer: usize) -> (&mut [f32], &mut [f32]) {
        let start = slot * self.floats_per_slot() + layer * self.layout.layer_floats();
        let region = &mut self.data[start..start + self.layout.layer_floats()];
        region.split_at_mut(self.layout.conv_floats)
    }

    /// The SSM state of Mamba layer `layer`, cut into its heads' `P x N` parts, for each slot of
    /// `slots` in that order: `slots.len() * heads` disjoint slices, slot-major. Slots must be
    /// valid and distinct (the caller validated them), and `heads` must divide the state.
    pub(crate) fn ssm_heads_mut(
        &mut self,
        layer: usize,
        slots: impl Iterator<Item = usize>,
        heads: usize,
    ) -> Vec<&mut [f32]> {
        let ssm = self.layout.ssm_floats;
        self.layers_mut(layer, slots)
            .into_iter()
            .flat_map(|(_, state)| state.chunks_exact_mut((ssm / heads).max(1)))
            .collect()
    }

    /// The conv history and the SSM state of Mamba layer `layer` for each slot of `slots`, in
    /// that order. Slots must be valid and distinct (the caller validated them).
    pub(crate) fn layers_mut(
        &mut self,
        layer: usize,
        slots: impl Iterator<Item = usize>,
    ) -> Vec<(&mut [f32], &mut [f32])> {
        let per_slot = self.floats_per_slot();
        let start = layer * self.layout.layer_floats();
        let (conv, ssm) = (self.layout.conv_floats, self.layout.ssm_floats);
        let mut wanted: Vec<(usize, usize)> = slots.enumerate().map(|(i, s)| (s, i)).collect();
        wanted.sort_unstable();
        let mut found: Vec<(usize, &mut [f32])> = Vec::with_capacity(wanted.len());
        let mut next = wanted.iter().peekable();
        for (slot, region) in self.data.chunks_exact_mut(per_slot.max(1)).enumerate() {
            if let Some(&(_, order)) = next.next_if(|&&(s, _)| s == slot) {
                found.push((order, &mut region[start..start + conv + ssm]));
            }
        }
        assert_eq!(
            found.len(),
            wanted.len(),
            "slots must be valid and distinct"
        );
        found.sort_unstable_by_key(|&(order, _)| order);
        found
            .into_iter()
            .map(|(_, region)| region.split_at_mut(conv))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_blocks_copy_export_import() {
        let config = Config::tiny_demo();
        let mut pool = KvPool::new(&config, 3, 4).unwrap();
        // 2 attention layers x K,V x 4 tokens x 2 heads x 16 dims.
        assert_eq!(pool.floats_per_block(), 2 * 2 * 4 * 2 * 16);
        let pattern: Vec<f32> = (0..pool.floats_per_block()).map(|i| i as f32).collect();
        pool.import_block(1, &pattern).unwrap();
        pool.copy_block(1, 2).unwrap();
        let mut out = Vec::new();
        pool.export_block(2, &mut out).unwrap();
        assert_eq!(out, pattern);
        assert!(pool.block(0).unwrap().iter().all(|&x| x == 0.0));
        assert!(matches!(
            pool.copy_block(1, 3),
            Err(ModelError::BadBlock {
                block: 3,
                num_blocks: 3
            })
        ));
        assert!(matches!(
            pool.import_block(0, &pattern[1..]),
            Err(ModelError::LengthMismatch { .. })
        ));
        assert!(pool.block(0).unwrap().iter().all(|&x| x == 0.0));
        // One offset's K/V in every layer: exactly those floats change.
        pool.fill_offset(1, 2, -1.0).unwrap();
        let filled = pool.block(1).unwrap();
        let changed: Vec<usize> = (0..filled.len())
            .filter(|&i| filled[i] != pattern[i])
            .collect();
        // Layer l, K or V (kv), offset 2: (l * 2 + kv) * 4 * 32 + 2 * 32 .. + 32.
        let expected: Vec<usize> = (0..4)
            .flat_map(|layer_kv| (0..32).map(move |i| layer_kv * 128 + 64 + i))
            .collect();
        assert_eq!(changed, expected);
        assert!(changed.iter().all(|&i| filled[i] == -1.0));
        assert_eq!(
            pool.offset_ranges(2),
            [64..96, 192..224, 320..352, 448..480]
        );
        assert!(matches!(
            pool.fill_offset(1, 4, 0.0),
            Err(ModelError::PositionBeyondBlocks { position: 4, .. })
        ));
        assert!(KvPool::new(&config, 3, 0).is_err());
        // An impossible pool is an error that says so, not an abort.
        let err = KvPool::new(&config, u32::MAX as usize, 1 << 20).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::AllocationFailed {
                    what: "KV pool",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().starts_with("could not allocate "), "{err}");
        assert!(matches!(
            KvPool::new(&config, u32::MAX as usize + 2, 16),
            Err(ModelError::InvalidConfig {
                field: "num_blocks",
                ..
            })
        ));
    }

    #[test]
    fn mamba_slots_copy_zero_import() {
        let config = Config::tiny_demo();
        let mut states = MambaStates::new(&config, 2).unwrap();
        // 4 Mamba layers x (3 x 128 conv + 4 x 16 x 16 SSM).
        assert_eq!(states.floats_per_slot(), 4 * (3 * 128 + 1024));
        let pattern: Vec<f32> = (0..states.floats_per_slot()).map(|i| i as f32).collect();
        states.import_slot(0, &pattern).unwrap();
        states.copy_slot(0, 1).unwrap();
        assert_eq!(states.slot(1).unwrap(), &pattern[..]);
        states.zero_slot(0).unwrap();
        assert!(states.slot(0).unwrap().iter().all(|&x| x == 0.0));
        assert!(matches!(
            states.copy_slot(0, 2),
            Err(ModelError::BadSlot {
                slot: 2,
                num_slots: 2
            })
        ));
        let mut out = Vec::new();
        states.export_slot(1, &mut out).unwrap();
        assert_eq!(out, pattern);
    }
}
