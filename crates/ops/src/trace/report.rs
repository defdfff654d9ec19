//! What a trace found: plain data, serialised as is for `tidemark trace --json` (see
//! [`Trace::to_json`] for the two fields added there).

use serde::Serialize;
use tidemark_store::redis::watermark::{LaneRecord, Layout};

/// The log around the traced offset.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LogState {
    /// `head:{s}`: the last offset assigned (0 when none).
    pub head: u64,
    /// Lowest offset still held by `dlog:{s}` (`None`: the log is empty).
    pub first: Option<u64>,
    /// Records held (`XLEN`).
    pub len: u64,
}

/// The record as committed (body left out: only its size is shown).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LogRecord {
    /// Offset (= MailboxSeq of its entries).
    pub offset: u64,
    /// Previous offset.
    pub prev: u64,
    /// Sender user id.
    pub sender: String,
    /// Client-chosen message id.
    pub client_id: String,
    /// Recipients in this shard.
    pub recipients: Vec<String>,
    /// Commit time, µs since the Unix epoch.
    pub sent_at_us: u64,
    /// Body size in bytes.
    pub body_bytes: usize,
}

/// The shard's watermark, summarised.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct WatermarkSummary {
    /// `wm_layout`.
    pub layout: Layout,
    /// `wm_epoch`.
    pub epoch: u64,
    /// Stored blob length (19 or 1216).
    pub blob_bytes: usize,
    /// All 64 lanes equal.
    pub uniform: bool,
    /// Lowest W of present lanes.
    pub min_w: Option<u64>,
    /// Highest W of present lanes.
    pub max_w: Option<u64>,
}

/// Where a recipient stands with respect to the traced record.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RecipientState {
    /// The lane's W is at or above the record and the entry is in the mailbox.
    Materialised,
    /// The lane's W is at or above the record, no entry, and the user acked at or above it:
    /// the entry was trimmed on ack (or never written: the two cannot be told apart).
    AckedPossiblyTrimmed,
    /// The lane's W is at or above the record, but there is no entry and no ack covers it.
    Missing,
    /// The lane's W is below the record; its entry is already written (a durable chunk
    /// waiting for the lane to move), not yet visible to readers.
    PendingEntryWritten,
    /// The lane's W is below the record; no entry yet.
    Pending,
    /// The lane holds no watermark (presence 0): nothing is materialised for it.
    LaneNotPresent,
}

impl RecipientState {
    /// The state of a recipient whose lane is `lane`, for the record at `offset`: whether its
    /// mailbox holds an entry at that seq, and up to where it acked.
    pub fn classify(lane: &LaneRecord, offset: u64, has_entry: bool, acked: u64) -> Self {
        if !lane.present {
            RecipientState::LaneNotPresent
        } else if lane.w >= offset {
            match (has_entry, acked >= offset) {
                (true, _) => RecipientState::Materialised,
                (false, true) => RecipientState::AckedPossiblyTrimmed,
                (false, false) => RecipientState::Missing,
            }
        } else if has_entry {
            RecipientState::PendingEntryWritten
        } else {
            RecipientState::Pending
        }
    }

    /// True when W has passed the record for this recipient.
    pub fn is_materialised(self) -> bool {
        matches!(
            self,
            RecipientState::Materialised
                | RecipientState::AckedPossiblyTrimmed
                | RecipientState::Missing
        )
    }
}

/// The entry found in a mailbox at seq `o`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EntryInfo {
    /// Sender, as stored in the entry (`None` when it does not decode).
    pub from: Option<String>,
    /// Commit time in the entry.
    pub sent_at_us: Option<u64>,
    /// Stored member size in bytes.
    pub bytes: usize,
}

/// One recipient of the record.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RecipientTrace {
    /// User id.
    pub user: String,
    /// Lane 0..64 (from the shard count given).
    pub lane: usize,
    /// Whether the lane holds a watermark.
    pub lane_present: bool,
    /// The lane's W (0 when not present).
    pub lane_w: u64,
    /// The entry with seq `o` in `mb:{s}:<user>`, if any.
    pub entry: Option<EntryInfo>,
    /// `ack:{s}` of the user (0 when never acked).
    pub acked: u64,
    /// Summary.
    pub state: RecipientState,
}

/// Where the recipient list came from.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RecipientSource {
    /// The log record.
    Log,
    /// The record is trimmed: the mailboxes of the shard holding an entry at the offset.
    Mailboxes,
}

/// Overall state of the record.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TraceStatus {
    /// Every recipient's lane W is at or above the record (or the record was trimmed).
    Materialised,
    /// Some recipient's lane is still below the record.
    Pending,
    /// The record is gone from the log although the lowest present W is below it: the core
    /// log lost it, or W moved back (a restore). Its recipients cannot be known; it may never
    /// be delivered (see `problems`).
    Lost,
}

/// Everything `tidemark trace` shows.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Trace {
    /// Shard traced.
    pub shard: u32,
    /// Offset traced.
    pub offset: u64,
    /// Shard count used for routing (lanes).
    pub shards: u32,
    /// Core instance read (its password redacted).
    pub core_url: String,
    /// Mailbox instance read (its password redacted).
    pub mailbox_url: String,
    /// The log.
    pub log: LogState,
    /// The record; `None` when trimmed from the log.
    pub record: Option<LogRecord>,
    /// True when the record is no longer in the log.
    pub trimmed: bool,
    /// The shard's watermark.
    pub watermark: WatermarkSummary,
    /// Lanes marked durable in `stg:{s}:<o>`; `None` when there is no staging state
    /// (hot path, or already collected by GC).
    pub staging_lanes: Option<Vec<usize>>,
    /// Where [`Trace::recipients`] came from.
    pub recipients_from: RecipientSource,
    /// Per recipient.
    pub recipients: Vec<RecipientTrace>,
    /// Overall state.
    pub status: TraceStatus,
    /// Inconsistencies found (empty when everything agrees).
    pub problems: Vec<String>,
}
