//! The packed per-shard watermark `wm:{s}` (ADR-0015): lane records, layouts, codec.
//!
//! A shard's watermark is a Redis hash with exactly three fields:
//!
//! ```text
//! wm:{s}  (HLEN == 3, else corrupt)
//! ├── wm_layout = "packed-v1" | "packed-v2"      exact, case-sensitive
//! ├── wm_epoch  = decimal u64                    0 | [1-9][0-9]*, at most 18446744073709551615
//! └── wm_blob   = lane records, by layout:
//!        packed-v1: 1216 bytes = 64 lanes × 19 bytes, lane 0 first
//!        packed-v2:   19 bytes = one record that every one of the 64 lanes equals (uniform)
//!                or 1216 bytes = 64 lanes × 19 bytes (diverged)
//!
//! one lane record, 19 bytes, all integers big-endian:
//!  0        1                 7                 13                19
//!  +--------+-----------------+-----------------+-----------------+
//!  |presence|        W        |     W_floor     |  W_recomputed   |
//!  |  u8    |      u48 BE     |      u48 BE     |      u48 BE     |
//!  +--------+-----------------+-----------------+-----------------+
//!
//! invariants (every lane, not only the first):
//!   presence ∈ {0, 1}
//!   presence == 0  ⇒  the other 18 bytes are zero          (empty lane)
//!   presence == 1  ⇒  W == W_recomputed  and  W >= W_floor (present lane)
//! ```
//!
//! `W` of a lane: every record of `dlog:{s}` at or below `W` is fully materialised for the
//! mailboxes of that lane. Anything that breaks the rules above is *corrupt* and is refused
//! with a [`CorruptCause`] naming what broke; nothing is guessed or repaired. The same checks,
//! in the same order, are made by the Lua scripts (`lua/common/_lanes.lua` with the layout
//! prelude `lua/v2/_layout.lua` or `lua/v1/_layout.lua`; the self-contained hot path
//! `lua/v{1,2}/materialize_fresh_single_recipient.lua` repeats them), so that Rust and Lua give
//! identical verdicts on identical bytes (tested with one table of vectors).
//!
//! Check order (first failure wins): the key's type (a hash; checked by the read script,
//! ADR-0123), field count, missing field (layout, epoch, blob),
//! unknown layout, blob length for the layout, epoch syntax, then lanes 0..63, and within a
//! lane: presence, non-zero empty lane, `W != W_recomputed`, `W < W_floor`.
//!
//! Writers always produce the canonical packed-v2 form: 19 bytes exactly when all 64 lanes are
//! identical ([`encode_packed_v2`]). [`encode_packed_v1`] exists for the offline downgrade.

use std::fmt;

/// Number of lanes per shard (fixed by ADR-0015).
pub const LANES: usize = 64;
/// Bytes of one lane record (fixed by ADR-0015).
pub const LANE_BYTES: usize = 19;
/// Bytes of a full (per-lane) blob: 64 × 19.
pub const FULL_BLOB_BYTES: usize = LANES * LANE_BYTES;
/// Largest value of a u48 offset.
pub const U48_MAX: u64 = (1 << 48) - 1;

/// Hash field names of `wm:{s}` (fixed by ADR-0015).
pub const FIELD_LAYOUT: &str = "wm_layout";
/// Field holding the owner's epoch.
pub const FIELD_EPOCH: &str = "wm_epoch";
/// Field holding the packed lane records.
pub const FIELD_BLOB: &str = "wm_blob";

/// Storage layout of `wm_blob`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Layout {
    /// Always 1216 bytes (pre-ADR-0015; still read, and written by the downgrade).
    #[serde(rename = "packed-v1")]
    PackedV1,
    /// 19 bytes when uniform, 1216 when diverged (ADR-0015).
    #[serde(rename = "packed-v2")]
    PackedV2,
}

impl Layout {
    /// The exact string stored in `wm_layout`.
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::PackedV1 => "packed-v1",
            Layout::PackedV2 => "packed-v2",
        }
    }

    /// Exact, case-sensitive parse of a `wm_layout` value.
    pub fn from_bytes(b: &[u8]) -> Option<Layout> {
        match b {
            b"packed-v1" => Some(Layout::PackedV1),
            b"packed-v2" => Some(Layout::PackedV2),
            _ => None,
        }
    }

    /// Whether a blob of `len` bytes is legal for this layout.
    pub fn allows_len(self, len: usize) -> bool {
        match self {
            Layout::PackedV1 => len == FULL_BLOB_BYTES,
            Layout::PackedV2 => len == LANE_BYTES || len == FULL_BLOB_BYTES,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Layout::from_bytes(s.as_bytes())
            .ok_or_else(|| format!("unknown layout {s:?} (expected packed-v1 or packed-v2)"))
    }
}

/// One lane's record. An empty lane is `LaneRecord::EMPTY` (19 zero bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaneRecord {
    /// Whether the lane holds a watermark at all.
    pub present: bool,
    /// Highest log offset fully materialised for this lane.
    pub w: u64,
    /// Lowest offset the lane may hold (set at creation or re-base).
    pub w_floor: u64,
    /// `W` as recomputed from durable completion state when the lane last moved.
    pub w_recomputed: u64,
}

impl LaneRecord {
    /// The empty lane: presence 0, all offsets 0.
    pub const EMPTY: LaneRecord = LaneRecord {
        present: false,
        w: 0,
        w_floor: 0,
        w_recomputed: 0,
    };

    /// A present lane at `w` with floor `w_floor` (and `W_recomputed == W`).
    pub fn at(w: u64, w_floor: u64) -> LaneRecord {
        LaneRecord {
            present: true,
            w,
            w_floor,
            w_recomputed: w,
        }
    }

    /// Writes the 19-byte encoding into `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(u8::from(self.present));
        put_u48(out, self.w);
        put_u48(out, self.w_floor);
        put_u48(out, self.w_recomputed);
    }

    /// Decodes and validates one 19-byte record; `lane` names it in errors.
    pub fn decode(bytes: &[u8], lane: usize) -> Result<LaneRecord, CorruptCause> {
        debug_assert_eq!(bytes.len(), LANE_BYTES);
        let presence = bytes[0];
        match presence {
            0 => {
                if bytes[1..].iter().any(|&b| b != 0) {
                    return Err(CorruptCause::NonZeroEmptyLane { lane });
                }
                Ok(LaneRecord::EMPTY)
            }
            1 => {
                let w = get_u48(&bytes[1..7]);
                let w_floor = get_u48(&bytes[7..13]);
                let w_recomputed = get_u48(&bytes[13..19]);
                if w != w_recomputed {
                    return Err(CorruptCause::WMismatch {
                        lane,
                        w,
                        w_recomputed,
                    });
                }
                if w < w_floor {
                    return Err(CorruptCause::WBelowFloor { lane, w, w_floor });
                }
                Ok(LaneRecord {
                    present: true,
                    w,
                    w_floor,
                    w_recomputed,
                })
            }
            other => Err(CorruptCause::BadPresence { lane, byte: other }),
        }
    }
}

fn put_u48(out: &mut Vec<u8>, v: u64) {
    debug_assert!(v <= U48_MAX, "u48 overflow: {v}");
    out.extend_from_slice(&v.to_be_bytes()[2..8]);
}

fn get_u48(b: &[u8]) -> u64 {
    let mut x = [0u8; 8];
    x[2..8].copy_from_slice(b);
    u64::from_be_bytes(x)
}

/// The 64 lane records of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneWatermarks(pub [LaneRecord; LANES]);

impl LaneWatermarks {
    /// All 64 lanes equal to `rec`.
    pub fn uniform(rec: LaneRecord) -> Self {
        LaneWatermarks([rec; LANES])
    }

    /// True when all 64 lanes are identical (whatever the encoding they came from).
    pub fn is_uniform(&self) -> bool {
        self.0.iter().all(|r| *r == self.0[0])
    }

    /// Lowest `W` among present lanes; `None` when no lane is present.
    pub fn min_present_w(&self) -> Option<u64> {
        self.0.iter().filter(|r| r.present).map(|r| r.w).min()
    }

    /// Highest `W` among present lanes.
    pub fn max_present_w(&self) -> Option<u64> {
        self.0.iter().filter(|r| r.present).map(|r| r.w).max()
    }

    /// The record of lane `l`.
    pub fn lane(&self, l: usize) -> &LaneRecord {
        &self.0[l]
    }
}

/// A decoded, validated `wm:{s}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardWatermark {
    /// Layout found in `wm_layout`.
    pub layout: Layout,
    /// Owner epoch found in `wm_epoch`.
    pub epoch: u64,
    /// The 64 lanes (expanded when the blob was 19 bytes).
    pub lanes: LaneWatermarks,
    /// Length of the stored blob (19 or 1216), kept so tools can show the encoding.
    pub blob_len: usize,
}

/// Why a watermark is corrupt. `code()` is stable and shared with the Lua scripts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorruptCause {
    /// `wm:{s}` is not a hash (ADR-0123): `read_log_watermarks.lua` names its Redis type
    /// (`string`, `list`, …) instead of failing the whole read with `WRONGTYPE`, so that the
    /// other shards of the read are still read. Found by the read script, never by
    /// [`decode_lane_watermarks`] (it is given fields, so a hash).
    WrongType { found: String },
    /// `HLEN != 3`.
    FieldCount { got: usize },
    /// One of `wm_layout`, `wm_epoch`, `wm_blob` is absent (another field took its place).
    MissingField { field: &'static str },
    /// `wm_layout` is not a layout the reader knows: not exactly `packed-v1` or `packed-v2`
    /// (or, for a packed-v1 store claiming a shard, not `packed-v1`).
    UnknownLayout { value: String },
    /// The blob length is not legal for the layout.
    BadLength { layout: Layout, len: usize },
    /// `wm_epoch` is not a canonical decimal u64.
    BadEpoch { value: String },
    /// A presence byte other than 0 or 1.
    BadPresence { lane: usize, byte: u8 },
    /// An empty lane with a non-zero byte.
    NonZeroEmptyLane { lane: usize },
    /// A present lane whose `W` and `W_recomputed` differ.
    WMismatch {
        lane: usize,
        w: u64,
        w_recomputed: u64,
    },
    /// A present lane whose `W` is below its floor.
    WBelowFloor { lane: usize, w: u64, w_floor: u64 },
}

impl CorruptCause {
    /// Stable code; the Lua scripts return the same strings (see [`CorruptCode`]).
    pub fn code(&self) -> CorruptCode {
        match self {
            CorruptCause::WrongType { .. } => CorruptCode::WrongType,
            CorruptCause::FieldCount { .. } => CorruptCode::FieldCount,
            CorruptCause::MissingField { .. } => CorruptCode::MissingField,
            CorruptCause::UnknownLayout { .. } => CorruptCode::UnknownLayout,
            CorruptCause::BadLength { .. } => CorruptCode::BadLength,
            CorruptCause::BadEpoch { .. } => CorruptCode::BadEpoch,
            CorruptCause::BadPresence { .. } => CorruptCode::BadPresence,
            CorruptCause::NonZeroEmptyLane { .. } => CorruptCode::NonZeroEmptyLane,
            CorruptCause::WMismatch { .. } => CorruptCode::WMismatch,
            CorruptCause::WBelowFloor { .. } => CorruptCode::WBelowFloor,
        }
    }

    /// The lane concerned, for lane-level causes.
    pub fn lane(&self) -> Option<usize> {
        match self {
            CorruptCause::BadPresence { lane, .. }
            | CorruptCause::NonZeroEmptyLane { lane }
            | CorruptCause::WMismatch { lane, .. }
            | CorruptCause::WBelowFloor { lane, .. } => Some(*lane),
            _ => None,
        }
    }

    /// The `(code, lane)` pair that Rust and Lua verdicts are compared on.
    pub fn verdict(&self) -> (&'static str, Option<usize>) {
        (self.code().as_str(), self.lane())
    }
}

/// The stable code of a [`CorruptCause`], without its details: what the Lua scripts return
/// in a corrupt reply (`{-1, code, lane}`) and what the Rust decoder reports. One variant per
/// `CorruptCause` variant; the strings are checked against the Lua sources by a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CorruptCode {
    /// `wrong_type`: `wm:{s}` is not a hash (returned by `read_log_watermarks.lua` only; the
    /// other scripts fail that one call with Redis's `WRONGTYPE`, ADR-0123).
    WrongType,
    /// `field_count`: `HLEN != 3`.
    FieldCount,
    /// `missing_field`: `wm_layout`, `wm_epoch` or `wm_blob` is absent.
    MissingField,
    /// `unknown_layout`: `wm_layout` is not a layout the reader knows.
    UnknownLayout,
    /// `bad_length`: the blob length is not legal for the layout.
    BadLength,
    /// `bad_epoch`: `wm_epoch` is not a canonical decimal u64.
    BadEpoch,
    /// `bad_presence`: a presence byte other than 0 or 1.
    BadPresence,
    /// `nonzero_empty_lane`: an empty lane with a non-zero byte.
    NonZeroEmptyLane,
    /// `w_mismatch`: a present lane whose `W` and `W_recomputed` differ.
    WMismatch,
    /// `w_below_floor`: a present lane whose `W` is below its floor.
    WBelowFloor,
}

impl CorruptCode {
    /// Every code, in check order.
    pub const ALL: [CorruptCode; 10] = [
        CorruptCode::WrongType,
        CorruptCode::FieldCount,
        CorruptCode::MissingField,
        CorruptCode::UnknownLayout,
        CorruptCode::BadLength,
        CorruptCode::BadEpoch,
        CorruptCode::BadPresence,
        CorruptCode::NonZeroEmptyLane,
        CorruptCode::WMismatch,
        CorruptCode::WBelowFloor,
    ];

    /// The stable string, as the Lua scripts return it.
    pub fn as_str(self) -> &'static str {
        match self {
            CorruptCode::WrongType => "wrong_type",
            CorruptCode::FieldCount => "field_count",
            CorruptCode::MissingField => "missing_field",
            CorruptCode::UnknownLayout => "unknown_layout",
            CorruptCode::BadLength => "bad_length",
            CorruptCode::BadEpoch => "bad_epoch",
            CorruptCode::BadPresence => "bad_presence",
            CorruptCode::NonZeroEmptyLane => "nonzero_empty_lane",
            CorruptCode::WMismatch => "w_mismatch",
            CorruptCode::WBelowFloor => "w_below_floor",
        }
    }

    /// True for the causes that concern one lane (a verdict then names the lane).
    pub fn is_lane_level(self) -> bool {
        matches!(
            self,
            CorruptCode::BadPresence
                | CorruptCode::NonZeroEmptyLane
                | CorruptCode::WMismatch
                | CorruptCode::WBelowFloor
        )
    }

    /// A human sentence for the code, used when only the code is known (Lua verdicts).
    pub fn describe(self) -> &'static str {
        match self {
            CorruptCode::WrongType => "wm:{s} is not a hash",
            CorruptCode::FieldCount => "wm:{s} does not have exactly 3 fields",
            CorruptCode::MissingField => "wm_layout, wm_epoch or wm_blob is missing",
            CorruptCode::UnknownLayout => "wm_layout is not packed-v1 or packed-v2",
            CorruptCode::BadLength => "wm_blob length is not legal for the layout",
            CorruptCode::BadEpoch => "wm_epoch is not a canonical decimal u64",
            CorruptCode::BadPresence => "a lane's presence byte is not 0 or 1",
            CorruptCode::NonZeroEmptyLane => "an empty lane has non-zero bytes",
            CorruptCode::WMismatch => "a lane's W differs from W_recomputed",
            CorruptCode::WBelowFloor => "a lane's W is below W_floor",
        }
    }
}

impl fmt::Display for CorruptCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not a [`CorruptCode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownCorruptCode(pub String);

impl fmt::Display for UnknownCorruptCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown corruption code {:?}", self.0)
    }
}

impl std::error::Error for UnknownCorruptCode {}

impl std::str::FromStr for CorruptCode {
    type Err = UnknownCorruptCode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CorruptCode::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownCorruptCode(s.to_string()))
    }
}

impl fmt::Display for CorruptCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CorruptCause::WrongType { found } => write!(
                f,
                "wrong_type: wm is a {found}, not a hash (a watermark is a hash of wm_layout, \
                 wm_epoch and wm_blob)"
            ),
            CorruptCause::FieldCount { got } => {
                write!(f, "field_count: wm has {got} fields, expected exactly 3")
            }
            CorruptCause::MissingField { field } => write!(f, "missing_field: {field} is absent"),
            CorruptCause::UnknownLayout { value } => {
                write!(
                    f,
                    "unknown_layout: {value:?} is not a layout this code reads"
                )
            }
            CorruptCause::BadLength { layout, len } => {
                let legal = match layout {
                    Layout::PackedV1 => "1216",
                    Layout::PackedV2 => "19 or 1216",
                };
                write!(
                    f,
                    "bad_length: {layout} blob of {len} bytes (legal: {legal})"
                )
            }
            CorruptCause::BadEpoch { value } => {
                write!(f, "bad_epoch: {value:?} is not a canonical decimal u64")
            }
            CorruptCause::BadPresence { lane, byte } => {
                write!(f, "bad_presence: lane {lane} presence byte {byte}")
            }
            CorruptCause::NonZeroEmptyLane { lane } => {
                write!(
                    f,
                    "nonzero_empty_lane: lane {lane} is empty but not zero-filled"
                )
            }
            CorruptCause::WMismatch {
                lane,
                w,
                w_recomputed,
            } => write!(
                f,
                "w_mismatch: lane {lane} W={w} W_recomputed={w_recomputed}"
            ),
            CorruptCause::WBelowFloor { lane, w, w_floor } => {
                write!(f, "w_below_floor: lane {lane} W={w} < W_floor={w_floor}")
            }
        }
    }
}

impl std::error::Error for CorruptCause {}

/// Strict epoch parse: `0` or `[1-9][0-9]*`, no sign, no spaces, fits u64.
pub fn parse_epoch(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if b.len() > 1 && b[0] == b'0' {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse::<u64>().ok()
}

/// Decodes the lane records of a blob whose length is already known to be 19 or 1216.
fn decode_blob(blob: &[u8]) -> Result<LaneWatermarks, CorruptCause> {
    if blob.len() == LANE_BYTES {
        let rec = LaneRecord::decode(blob, 0)?;
        return Ok(LaneWatermarks::uniform(rec));
    }
    let mut lanes = [LaneRecord::EMPTY; LANES];
    for (l, chunk) in blob.chunks_exact(LANE_BYTES).enumerate() {
        lanes[l] = LaneRecord::decode(chunk, l)?;
    }
    Ok(LaneWatermarks(lanes))
}

/// Decodes `wm:{s}` from its raw hash fields (as `HGETALL` returns them, in any order).
///
/// Accepts exactly: `HLEN == 3`; packed-v1 with 1216 bytes; packed-v2 with 19 or 1216 bytes;
/// a canonical decimal u64 epoch; valid lanes. Everything else is a [`CorruptCause`].
/// An empty field list (no key) is the caller's concern: it is reported as `FieldCount{0}`
/// here, and `store.rs` turns a missing key into its own error before calling this.
pub fn decode_lane_watermarks<K, V>(fields: &[(K, V)]) -> Result<ShardWatermark, CorruptCause>
where
    K: AsRef<[u8]>,
    V: AsRef<[u8]>,
{
    if fields.len() != 3 {
        return Err(CorruptCause::FieldCount { got: fields.len() });
    }
    let find = |name: &'static str| {
        fields
            .iter()
            .find(|(k, _)| k.as_ref() == name.as_bytes())
            .map(|(_, v)| v.as_ref())
            .ok_or(CorruptCause::MissingField { field: name })
    };
    let layout_raw = find(FIELD_LAYOUT)?;
    let epoch_raw = find(FIELD_EPOCH)?;
    let blob = find(FIELD_BLOB)?;
    let layout = Layout::from_bytes(layout_raw).ok_or_else(|| CorruptCause::UnknownLayout {
        value: String::from_utf8_lossy(layout_raw).into_owned(),
    })?;
    if !layout.allows_len(blob.len()) {
        return Err(CorruptCause::BadLength {
            layout,
            len: blob.len(),
        });
    }
    let epoch = parse_epoch(epoch_raw).ok_or_else(|| CorruptCause::BadEpoch {
        value: String::from_utf8_lossy(epoch_raw).into_owned(),
    })?;
    let lanes = decode_blob(blob)?;
    Ok(ShardWatermark {
        layout,
        epoch,
        lanes,
        blob_len: blob.len(),
    })
}

/// Canonical packed-v2 blob: 19 bytes exactly when all lanes are identical, else 1216.
pub fn encode_packed_v2(lanes: &LaneWatermarks) -> Vec<u8> {
    if lanes.is_uniform() {
        let mut out = Vec::with_capacity(LANE_BYTES);
        lanes.0[0].encode_into(&mut out);
        out
    } else {
        encode_packed_v1(lanes)
    }
}

/// packed-v1 blob: always 1216 bytes (lane 0 first).
pub fn encode_packed_v1(lanes: &LaneWatermarks) -> Vec<u8> {
    let mut out = Vec::with_capacity(FULL_BLOB_BYTES);
    for r in &lanes.0 {
        r.encode_into(&mut out);
    }
    out
}

/// Encodes a blob for `layout` (canonical for v2).
pub fn encode_blob(layout: Layout, lanes: &LaneWatermarks) -> Vec<u8> {
    match layout {
        Layout::PackedV1 => encode_packed_v1(lanes),
        Layout::PackedV2 => encode_packed_v2(lanes),
    }
}

#[cfg(test)]
mod tests;

/// Fuzzing support shared by the `cargo fuzz` target and the corpus replay test.
#[doc(hidden)]
pub mod fuzzing;
