//! The spill image of one sequence (`SaveSequenceState` / `RestoreSequenceState`): format, writer, and
//! a validating reader.
//!
//! # Format (version 2, all integers and floats little-endian)
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `b"HYBSEQ\0\x01"` |
//! | 4 | format version (`2`; `1` is read too) |
//! | 8 | model fingerprint ([`model::Model::fingerprint`]) |
//! | 4 | block size (tokens per KV block) |
//! | 8 | floats per KV block (all attention layers, K and V) |
//! | 8 | floats per live-state slot (all Mamba layers, conv and SSM state) |
//! | 8 | sequence id |
//! | 8 | prompt length |
//! | 8 | computed length (positions with KV and state) |
//! | 8 | token count (`tokens.len()`, at least the computed length and the prompt length) |
//! | 1 + 4 | LoRA adapter: flag (0/1), id |
//! | 1 + 8 | cache salt: flag (0/1), salt |
//! | 8 | block count (exactly `ceil(computed / block_size)`) |
//! | 1 | MTP section: flag (0/1) (version 2 only, as the next three) |
//! | 8 | MTP head: positions consumed (0 without the section) |
//! | 8 | MTP head: positions exact (at most those consumed) |
//! | 8 | MTP catch-up ring: row count (at most [`CATCHUP_RING`]) |
//! | 4 × token count | token ids |
//! | 4 × block count × floats per block | the KV of each block, in position order |
//! | 4 × floats per slot | the live state |
//! | (8 + 4 × hidden size) × row count | the ring's rows: position, then the main model's hidden state there (version 2) |
//! | 8 | xxh3-64 of every byte before it |
//!
//! The MTP section carries the sequence's MTP head (`crate::spec::MtpTrack`) on a model with one:
//! how far its K/V and state (in the KV and the live state above) have consumed the sequence, how
//! far exactly, and the hidden states of its catch-up ring, so a restored sequence drafts at its
//! first step as it would have without the spill. Ring positions increase strictly and lie in
//! `consumed..computed`. A version 1 image (written before the section existed) has none: the
//! restored head drafts from its next kept hidden state on.
//!
//! The reader checks, before anything is touched: the magic, the version, the fingerprint, the block
//! size and both float counts against this router; that the lengths are consistent with each other
//! (and the MTP section with them and with the router's hidden size); that the body has exactly
//! the announced length; and the checksum. Only then does the router look for blocks and a slot.

use xxhash_rust::xxh3::xxh3_64;

use crate::spec::CATCHUP_RING;

/// The first eight bytes of every image.
pub const MAGIC: [u8; 8] = *b"HYBSEQ\0\x01";
/// The format version this crate writes.
pub const VERSION: u32 = 2;
/// The oldest format version this crate reads (no MTP section).
pub const OLDEST_VERSION: u32 = 1;

/// Bytes of the fixed header of a version 1 image (everything before the token ids).
const HEADER_V1_BYTES: usize = 8 + 4 + 8 + 4 + 8 + 8 + 8 + 8 + 8 + 8 + 5 + 9 + 8;
/// Bytes of the fixed header (version 2: the MTP section's fields after version 1's).
const HEADER_BYTES: usize = HEADER_V1_BYTES + 1 + 8 + 8 + 8;

/// The longest image a router of `layout` can accept (a sequence of `max_context` tokens, a
/// full catch-up ring); readers stop there, so a runaway stream cannot exhaust memory.
pub fn max_len(layout: &Layout) -> u64 {
    let blocks = layout.max_context.div_ceil(layout.block_size) as u64;
    let floats = blocks * layout.floats_per_block as u64 + layout.floats_per_slot as u64;
    let ring = CATCHUP_RING as u64 * (8 + 4 * layout.hidden_size as u64);
    HEADER_BYTES as u64 + 4 * layout.max_context as u64 + 4 * floats + ring + 8
}

/// What the router must match for an image to be accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub fingerprint: u64,
    pub block_size: usize,
    pub floats_per_block: usize,
    pub floats_per_slot: usize,
    pub max_context: usize,
    pub vocab_size: usize,
    /// Floats of one hidden state of the MTP head's catch-up ring (the model's hidden size; 0
    /// without an MTP head, whose images carry no MTP section).
    pub hidden_size: usize,
}

/// An image's MTP section: the sequence's MTP head (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct MtpSection {
    /// The head's K/V and state cover positions `..consumed`.
    pub consumed: usize,
    /// Exactly (`crate::spec::MtpTrack::exact`).
    pub exact: usize,
    /// The catch-up ring: position and the main model's hidden state there, positions
    /// increasing.
    pub ring: Vec<(usize, Vec<f32>)>,
}

/// The sequence-level fields of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageHeader {
    pub seq_id: u64,
    pub prompt_len: usize,
    pub computed_len: usize,
    pub adapter: Option<u32>,
    pub cache_salt: Option<u64>,
}

/// A decoded, validated image.
#[derive(Debug)]
pub struct Image {
    pub header: ImageHeader,
    pub tokens: Vec<u32>,
    /// `num_blocks * floats_per_block` floats.
    pub kv: Vec<f32>,
    pub num_blocks: usize,
    /// `floats_per_slot` floats.
    pub state: Vec<f32>,
    /// The MTP head, when the image carries it.
    pub mtp: Option<MtpSection>,
}

/// Encodes an image (the current version). `kv` holds the blocks' floats back to back; `mtp`
/// (rows of `hidden_size` floats, at most [`CATCHUP_RING`]) is the MTP section.
pub fn encode(
    layout: &Layout,
    header: &ImageHeader,
    tokens: &[u32],
    num_blocks: usize,
    kv: &[f32],
    state: &[f32],
    mtp: Option<&MtpSection>,
) -> Vec<u8> {
    debug_assert_eq!(kv.len(), num_blocks * layout.floats_per_block);
    debug_assert_eq!(state.len(), layout.floats_per_slot);
    let ring = mtp.map_or(&[][..], |mtp| &mtp.ring[..]);
    debug_assert!(ring.len() <= CATCHUP_RING);
    debug_assert!(ring.iter().all(|(_, row)| row.len() == layout.hidden_size));
    let body =
        4 * (tokens.len() + kv.len() + state.len()) + ring.len() * (8 + 4 * layout.hidden_size);
    let mut out = Vec::with_capacity(HEADER_BYTES + body + 8);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&layout.fingerprint.to_le_bytes());
    out.extend_from_slice(&(layout.block_size as u32).to_le_bytes());
    out.extend_from_slice(&(layout.floats_per_block as u64).to_le_bytes());
    out.extend_from_slice(&(layout.floats_per_slot as u64).to_le_bytes());
    out.extend_from_slice(&header.seq_id.to_le_bytes());
    out.extend_from_slice(&(header.prompt_len as u64).to_le_bytes());
    out.extend_from_slice(&(header.computed_len as u64).to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    out.push(u8::from(header.adapter.is_some()));
    out.extend_from_slice(&header.adapter.unwrap_or(0).to_le_bytes());
    out.push(u8::from(header.cache_salt.is_some()));
    out.extend_from_slice(&header.cache_salt.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&(num_blocks as u64).to_le_bytes());
    out.push(u8::from(mtp.is_some()));
    for field in [
        mtp.map_or(0, |mtp| mtp.consumed),
        mtp.map_or(0, |mtp| mtp.exact),
        ring.len(),
    ] {
        out.extend_from_slice(&(field as u64).to_le_bytes());
    }
    debug_assert_eq!(out.len(), HEADER_BYTES);
    for token in tokens {
        out.extend_from_slice(&token.to_le_bytes());
    }
    for value in kv.iter().chain(state) {
        out.extend_from_slice(&value.to_le_bytes());
    }
    for (pos, row) in ring {
        out.extend_from_slice(&(*pos as u64).to_le_bytes());
        for value in row {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    let checksum = xxh3_64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

/// A cursor over the image bytes that reports truncation by field name.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.at..end];
                self.at = end;
                Ok(out)
            }
            None => Err(format!(
                "truncated: {field} needs {n} bytes at offset {}, the image has {}",
                self.at,
                self.bytes.len()
            )),
        }
    }

    fn u8(&mut self, field: &str) -> Result<u8, String> {
        Ok(self.take(1, field)?[0])
    }

    fn u32(&mut self, field: &str) -> Result<u32, String> {
        let bytes = self.take(4, field)?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, field: &str) -> Result<u64, String> {
        let bytes = self.take(8, field)?;
        Ok(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
    }

    fn usize(&mut self, field: &str) -> Result<usize, String> {
        let value = self.u64(field)?;
        usize::try_from(value).map_err(|_| format!("{field} {value} does not fit in memory"))
    }

    fn flag(&mut self, field: &str) -> Result<bool, String> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(format!("{field} flag is {other}, expected 0 or 1")),
        }
    }
}

fn expect_eq(field: &str, got: u64, want: u64) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{field} is {got}, this router has {want}"))
    }
}

/// Decodes and validates an image against `layout`; the error says exactly what is wrong.
pub fn decode(layout: &Layout, bytes: &[u8]) -> Result<Image, String> {
    let mut cur = Cursor { bytes, at: 0 };
    let magic = cur.take(8, "magic")?;
    if magic != MAGIC {
        return Err(format!("magic is {magic:02x?}, expected {MAGIC:02x?}"));
    }
    let version = cur.u32("version")?;
    if !(OLDEST_VERSION..=VERSION).contains(&version) {
        return Err(format!(
            "format version {version} is not supported (this router reads {OLDEST_VERSION} \
             to {VERSION})"
        ));
    }
    let fingerprint = cur.u64("model fingerprint")?;
    if fingerprint != layout.fingerprint {
        return Err(format!(
            "model fingerprint {fingerprint:#018x} is not this router's model ({:#018x})",
            layout.fingerprint
        ));
    }
    expect_eq(
        "block size",
        u64::from(cur.u32("block size")?),
        layout.block_size as u64,
    )?;
    expect_eq(
        "floats per block",
        cur.u64("floats per block")?,
        layout.floats_per_block as u64,
    )?;
    expect_eq(
        "floats per slot",
        cur.u64("floats per slot")?,
        layout.floats_per_slot as u64,
    )?;
    let seq_id = cur.u64("sequence id")?;
    let prompt_len = cur.usize("prompt length")?;
    let computed_len = cur.usize("computed length")?;
    let token_count = cur.usize("token count")?;
    let has_adapter = cur.flag("adapter")?;
    let adapter = cur.u32("adapter id")?;
    let has_salt = cur.flag("cache salt")?;
    let salt = cur.u64("cache salt")?;
    let num_blocks = cur.usize("block count")?;
    let (has_mtp, consumed, exact, ring_rows) = if version >= 2 {
        (
            cur.flag("MTP section")?,
            cur.usize("MTP positions consumed")?,
            cur.usize("MTP positions exact")?,
            cur.usize("MTP ring row count")?,
        )
    } else {
        (false, 0, 0, 0)
    };

    if prompt_len == 0 {
        return Err("prompt length is 0".to_string());
    }
    if token_count > layout.max_context {
        return Err(format!(
            "token count {token_count} exceeds the router's max context {}",
            layout.max_context
        ));
    }
    if computed_len > token_count || prompt_len > token_count {
        return Err(format!(
            "lengths are inconsistent: prompt {prompt_len}, computed {computed_len}, tokens {token_count}"
        ));
    }
    if computed_len < prompt_len && token_count != prompt_len {
        return Err(format!(
            "lengths are inconsistent: an unfinished prefill (computed {computed_len} < prompt \
             {prompt_len}) must carry exactly the prompt, not {token_count} tokens"
        ));
    }
    if computed_len >= prompt_len && token_count != computed_len {
        return Err(format!(
            "lengths are inconsistent: a decoding sequence computed {computed_len} positions but \
             carries {token_count} tokens"
        ));
    }
    let want_blocks = computed_len.div_ceil(layout.block_size);
    if num_blocks != want_blocks {
        return Err(format!(
            "block count {num_blocks} does not cover {computed_len} positions of {} tokens \
             (expected {want_blocks})",
            layout.block_size
        ));
    }

    if has_mtp {
        if layout.hidden_size == 0 {
            return Err("an MTP section, but this router's model has no MTP head".to_string());
        }
        if consumed > computed_len || exact > consumed {
            return Err(format!(
                "MTP positions are inconsistent: consumed {consumed}, exact {exact}, computed \
                 {computed_len}"
            ));
        }
        if ring_rows > CATCHUP_RING {
            return Err(format!(
                "MTP ring row count {ring_rows} exceeds the ring's {CATCHUP_RING}"
            ));
        }
    } else if consumed != 0 || exact != 0 || ring_rows != 0 {
        return Err(format!(
            "no MTP section, but MTP fields consumed {consumed}, exact {exact}, rows {ring_rows}"
        ));
    }

    // Every size below is bounded by the context limit (and the ring's) checked above, so these
    // products fit.
    let body_floats = num_blocks * layout.floats_per_block + layout.floats_per_slot;
    let header_bytes = if version >= 2 {
        HEADER_BYTES
    } else {
        HEADER_V1_BYTES
    };
    let ring_bytes = ring_rows * (8 + 4 * layout.hidden_size);
    let expected_len = header_bytes + 4 * token_count + 4 * body_floats + ring_bytes + 8;
    if bytes.len() != expected_len {
        return Err(if bytes.len() < expected_len {
            format!(
                "truncated: the header announces {expected_len} bytes, the image has {}",
                bytes.len()
            )
        } else {
            format!(
                "{} trailing bytes after the announced {expected_len}",
                bytes.len() - expected_len
            )
        });
    }
    let (payload, tail) = bytes.split_at(expected_len - 8);
    let stored = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
    let actual = xxh3_64(payload);
    if stored != actual {
        return Err(format!(
            "checksum mismatch: stored {stored:#018x}, computed {actual:#018x}"
        ));
    }

    let mut tokens = Vec::with_capacity(token_count);
    for _ in 0..token_count {
        let token = cur.u32("token")?;
        if token as usize >= layout.vocab_size {
            return Err(format!(
                "token id {token} is outside the vocabulary of {}",
                layout.vocab_size
            ));
        }
        tokens.push(token);
    }
    let mut read_floats = |n: usize, field: &str| -> Result<Vec<f32>, String> {
        let raw = cur.take(4 * n, field)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    };
    let kv = read_floats(num_blocks * layout.floats_per_block, "KV")?;
    let state = read_floats(layout.floats_per_slot, "live state")?;
    let mut ring: Vec<(usize, Vec<f32>)> = Vec::with_capacity(ring_rows);
    for _ in 0..ring_rows {
        let pos = cur.usize("MTP ring position")?;
        let after = ring.last().map_or(consumed, |&(last, _)| last + 1);
        if pos < after || pos >= computed_len {
            return Err(format!(
                "MTP ring position {pos} is out of order or range (next at least {after}, \
                 computed {computed_len})"
            ));
        }
        let row = cur.take(4 * layout.hidden_size, "MTP ring row")?;
        ring.push((
            pos,
            row.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        ));
    }
    let mtp = has_mtp.then_some(MtpSection {
        consumed,
        exact,
        ring,
    });
    Ok(Image {
        header: ImageHeader {
            seq_id,
            prompt_len,
            computed_len,
            adapter: has_adapter.then_some(adapter),
            cache_salt: has_salt.then_some(salt),
        },
        tokens,
        kv,
        num_blocks,
        state,
        mtp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            fingerprint: 0xfeed,
            block_size: 4,
            floats_per_block: 3,
            floats_per_slot: 2,
            max_context: 64,
            vocab_size: 100,
            hidden_size: 2,
        }
    }

    fn section() -> MtpSection {
        MtpSection {
            consumed: 3,
            exact: 2,
            ring: vec![(3, vec![0.25, -4.0]), (4, vec![8.0, 1.5])],
        }
    }

    /// `image` (of a sequence with no MTP section) as version 1 wrote it: no MTP fields.
    fn as_version_1(image: &[u8]) -> Vec<u8> {
        let mut old = image[..HEADER_V1_BYTES].to_vec();
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        old.extend_from_slice(&image[HEADER_BYTES..image.len() - 8]);
        let checksum = xxh3_64(&old);
        old.extend_from_slice(&checksum.to_le_bytes());
        old
    }

    fn sample() -> Vec<u8> {
        sample_with(Some(&section()))
    }

    fn sample_with(mtp: Option<&MtpSection>) -> Vec<u8> {
        let header = ImageHeader {
            seq_id: 9,
            prompt_len: 3,
            computed_len: 5,
            adapter: Some(2),
            cache_salt: None,
        };
        let kv: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        encode(
            &layout(),
            &header,
            &[1, 2, 3, 4, 5],
            2,
            &kv,
            &[7.0, -1.0],
            mtp,
        )
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let image = decode(&layout(), &sample()).unwrap();
        assert_eq!(image.header.seq_id, 9);
        assert_eq!(image.header.prompt_len, 3);
        assert_eq!(image.header.computed_len, 5);
        assert_eq!(image.header.adapter, Some(2));
        assert_eq!(image.header.cache_salt, None);
        assert_eq!(image.tokens, vec![1, 2, 3, 4, 5]);
        assert_eq!(image.num_blocks, 2);
        assert_eq!(image.kv, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        assert_eq!(image.state, vec![7.0, -1.0]);
        assert_eq!(image.mtp, Some(section()));
        assert_eq!(decode(&layout(), &sample_with(None)).unwrap().mtp, None);
    }

    /// An image written before the MTP section existed (version 1) still loads, with no section.
    #[test]
    fn version_1_images_load() {
        let current = decode(&layout(), &sample_with(None)).unwrap();
        let old = decode(&layout(), &as_version_1(&sample_with(None))).unwrap();
        assert_eq!(old.header, current.header);
        assert_eq!(old.tokens, current.tokens);
        assert_eq!(old.kv, current.kv);
        assert_eq!(old.state, current.state);
        assert_eq!(old.mtp, None);
        let mut cut = as_version_1(&sample_with(None));
        cut.pop();
        check_err(&cut, &layout(), "truncated: the header announces");
    }

    /// Malformed MTP sections are named.
    #[test]
    fn every_bad_mtp_section_is_named() {
        let l = layout();
        check_err(
            &sample(),
            &Layout {
                hidden_size: 0,
                ..l
            },
            "an MTP section, but this router's model has no MTP head",
        );
        let with = |mtp: MtpSection| sample_with(Some(&mtp));
        check_err(
            &with(MtpSection {
                consumed: 6,
                ..section()
            }),
            &l,
            "MTP positions are inconsistent: consumed 6, exact 2, computed 5",
        );
        check_err(
            &with(MtpSection {
                exact: 4,
                ..section()
            }),
            &l,
            "MTP positions are inconsistent: consumed 3, exact 4",
        );
        check_err(
            &with(MtpSection {
                ring: vec![(4, vec![0.0; 2]), (3, vec![0.0; 2])],
                ..section()
            }),
            &l,
            "MTP ring position 3 is out of order or range (next at least 5",
        );
        check_err(
            &with(MtpSection {
                ring: vec![(2, vec![0.0; 2])],
                ..section()
            }),
            &l,
            "MTP ring position 2 is out of order or range (next at least 3",
        );
        check_err(
            &with(MtpSection {
                ring: vec![(5, vec![0.0; 2])],
                ..section()
            }),
            &l,
            "MTP ring position 5 is out of order or range (next at least 3, computed 5)",
        );
        // The row count in the header (offset: the last eight header bytes) past the ring.
        let mut many = sample();
        many[HEADER_BYTES - 8..HEADER_BYTES].copy_from_slice(&17u64.to_le_bytes());
        check_err(&many, &l, "MTP ring row count 17 exceeds the ring's 16");
        let mut stray = sample_with(None);
        stray[HEADER_BYTES - 8..HEADER_BYTES].copy_from_slice(&1u64.to_le_bytes());
        check_err(
            &stray,
            &l,
            "no MTP section, but MTP fields consumed 0, exact 0, rows 1",
        );
    }

    fn check_err(bytes: &[u8], layout: &Layout, expected_start: &str) {
        let err = decode(layout, bytes).unwrap_err();
        assert!(
            err.starts_with(expected_start),
            "error {err:?} should start with {expected_start:?}"
        );
    }

    #[test]
    fn every_bad_image_is_named() {
        let good = sample();
        let l = layout();
        check_err(&good[..5], &l, "truncated: magic");
        check_err(
            &good[..good.len() - 1],
            &l,
            "truncated: the header announces",
        );
        let mut longer = good.clone();
        longer.push(0);
        check_err(&longer, &l, "1 trailing bytes");
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        check_err(&bad_magic, &l, "magic is");
        let mut bad_version = good.clone();
        bad_version[8] = 3;
        check_err(&bad_version, &l, "format version 3 is not supported");
        check_err(
            &good,
            &Layout {
                fingerprint: 1,
                ..l
            },
            "model fingerprint 0x000000000000feed",
        );
        check_err(
            &good,
            &Layout { block_size: 8, ..l },
            "block size is 4, this router has 8",
        );
        check_err(
            &good,
            &Layout {
                floats_per_slot: 3,
                ..l
            },
            "floats per slot is 2",
        );
        check_err(
            &good,
            &Layout { vocab_size: 4, ..l },
            "token id 4 is outside",
        );
        check_err(
            &good,
            &Layout {
                max_context: 4,
                ..l
            },
            "token count 5 exceeds",
        );
        let mut flipped = good.clone();
        let last_float = flipped.len() - 9;
        flipped[last_float] ^= 1;
        check_err(&flipped, &l, "checksum mismatch");
    }

    /// One way to damage an image: a byte replaced, the image cut or extended, or a header
    /// field (by byte offset) overwritten with an arbitrary little-endian u64 (token counts of
    /// 10^12, absurd block counts...).
    #[derive(Debug, Clone)]
    enum Mutation {
        Byte(usize, u8),
        Cut(usize),
        Append(Vec<u8>),
        Field(usize, u64),
    }

    fn mutation() -> impl proptest::strategy::Strategy<Value = Mutation> {
        use proptest::prelude::*;
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
            any::<usize>().prop_map(Mutation::Cut),
            proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Append),
            (
                0..HEADER_BYTES,
                prop_oneof![any::<u64>(), 0u64..100, Just(1_000_000_000_000)]
            )
                .prop_map(|(at, v)| Mutation::Field(at, v)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 10_000,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Mutated images decode to an image consistent with the layout or to an error, never
        /// a panic, and never to buffers larger than the image itself.
        #[test]
        fn mutated_images_decode_or_give_an_error(
            mutations in proptest::collection::vec(mutation(), 1..4),
        ) {
            let mut bytes = sample();
            for m in &mutations {
                match m {
                    Mutation::Byte(at, b) => {
                        let len = bytes.len().max(1);
                        if let Some(byte) = bytes.get_mut(at % len) {
                            *byte = *b;
                        }
                    }
                    Mutation::Cut(at) => bytes.truncate(at % (bytes.len() + 1)),
                    Mutation::Append(tail) => bytes.extend_from_slice(tail),
                    Mutation::Field(at, value) => {
                        let end = (at + 8).min(bytes.len());
                        let n = end.saturating_sub(*at);
                        if n > 0 {
                            bytes[*at..end].copy_from_slice(&value.to_le_bytes()[..n]);
                        }
                    }
                }
            }
            let l = layout();
            if let Ok(image) = decode(&l, &bytes) {
                let ring = image.mtp.as_ref().map_or(0, |mtp| mtp.ring.len());
                proptest::prop_assert!(ring <= CATCHUP_RING);
                let floats = image.kv.len() + image.state.len() + ring * l.hidden_size;
                proptest::prop_assert!(4 * (image.tokens.len() + floats) <= bytes.len());
                proptest::prop_assert_eq!(image.kv.len(), image.num_blocks * l.floats_per_block);
                proptest::prop_assert_eq!(image.state.len(), l.floats_per_slot);
                proptest::prop_assert!(image.tokens.len() <= l.max_context);
            }
        }
    }
}
