//! `tidemark trace`: follows one message from its commit in `dlog:{s}` (core Redis) to every
//! mailbox entry it produced (mailbox Redis), and says where it stands.
//!
//! ```text
//! core Redis                    mailbox Redis
//!   head:{s}      log head        wm:{s}          layout, epoch, lanes (read_log_watermarks)
//!   dlog:{s} o-0  the record      mb:{s}:<user>   ZRANGEBYSCORE o o  (the entry, if any)
//!                                 ack:{s}         HGET <user>        (acked seq)
//!                                 stg:{s}:<o>     HKEYS              (lanes with a durable chunk)
//! ```
//!
//! Everything is read-only (connecting loads the scripts into the script cache, nothing else).
//! When the record has been trimmed from the log — GC trims records at or below the lowest
//! present W, so a trimmed record is fully materialised — its recipients are no longer known;
//! the trace then lists the mailboxes of the shard that hold an entry with seq `o` (a SCAN of
//! `mb:{s}:*`). Recipients that acked the message and had it trimmed can no longer be found.
//!
//! A corrupt or missing watermark is an error ([`Error::Corrupt`], [`Error::NoWatermark`]):
//! the trace never guesses. Inconsistencies it finds (W passed a record whose entry is absent
//! and not acked, a record missing from the log above the lowest W, …) are listed in
//! [`Trace::problems`].

use serde::Serialize;

use crate::error::{Error, Result};
use crate::keys;
use crate::redis::dlog::LogStore;
use crate::redis::store::MailboxStore;
use crate::redis::watermark::{Layout, ShardWatermark, U48_MAX};
use crate::topology::ShardMap;

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

/// Traces record `offset` of shard `shard` of `map`: its log record on the shard's core
/// instance, the watermark and the mailboxes on its mailbox instance.
///
/// Errors: an offset of 0 or above the log head, or a shard outside the map
/// ([`Error::InvalidArgument`]); a missing or corrupt watermark; Redis failures.
pub async fn trace(map: &ShardMap, shard: u32, offset: u64) -> Result<Trace> {
    let shards = map.shards();
    map.check_shard(shard)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let core_url = map.core_urls()[map.core_of(shard)].as_str();
    let mailbox_url = map.mailbox_urls()[map.mailbox_of(shard)].as_str();
    if offset == 0 || offset > U48_MAX {
        return Err(Error::InvalidArgument(format!(
            "offset {offset}: log offsets are 1..={U48_MAX}"
        )));
    }
    // the shard count decides every recipient's lane: a wrong one would make the trace lie
    for url in [core_url, mailbox_url] {
        let client = ::redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        if let Some(id) = crate::deployment::read(&mut conn).await? {
            if id.shards != shards {
                return Err(Error::InvalidArgument(format!(
                    "{url} belongs to a {}-shard deployment, not {shards}: pass --shards {}",
                    id.shards, id.shards
                )));
            }
        }
    }
    let mut core = LogStore::connect(core_url).await?;
    let head = core.head(shard).await?;
    if offset > head {
        return Err(Error::InvalidArgument(format!(
            "shard {shard}: offset {offset} is above the log head {head} (head:{{{shard}}}): \
             nothing has been committed there"
        )));
    }
    let mut store = MailboxStore::connect(mailbox_url, Layout::PackedV2).await?;
    let wm = store.read_watermark(shard).await?;

    let record = core
        .read_after(shard, offset - 1, 1)
        .await?
        .into_iter()
        .find(|r| r.offset == offset);
    let log = LogState {
        head,
        first: log_first(&mut core, shard).await?,
        len: core.log_len(shard).await?,
    };
    let mut problems = Vec::new();
    let min_w = wm.lanes.min_present_w();

    let (record, recipients_from, users) = match record {
        Some(r) => {
            if r.prev != offset - 1 {
                problems.push(format!(
                    "record {offset} has prev {} (expected {})",
                    r.prev,
                    offset - 1
                ));
            }
            let users = r.recipients.clone();
            let rec = LogRecord {
                offset: r.offset,
                prev: r.prev,
                sender: r.sender,
                client_id: r.client_id,
                recipients: r.recipients,
                sent_at_us: r.sent_at_us,
                body_bytes: r.body.len(),
            };
            (Some(rec), RecipientSource::Log, users)
        }
        None => {
            if min_w.is_none_or(|w| offset > w) {
                problems.push(format!(
                    "record {offset} is missing from dlog:{{{shard}}} although the lowest \
                     present W is {} (GC trims only at or below it): the core log lost it",
                    min_w.map_or("none".to_string(), |w| w.to_string())
                ));
            }
            let users = mailboxes_holding(&store, shard, offset).await?;
            (None, RecipientSource::Mailboxes, users)
        }
    };

    let recipients = recipient_traces(&store, &wm, map, shard, offset, &users).await?;
    for r in &recipients {
        let routed = map.route(&r.user);
        if routed.shard != shard {
            problems.push(format!(
                "recipient {} routes to shard {} with {shards} shards, not {shard} (is the \
                 shard count right?)",
                one_line(&r.user),
                routed.shard
            ));
        }
        if r.state == RecipientState::Missing {
            problems.push(format!(
                "{}: lane {} W={} has passed the record but mb:{{{shard}}}:{} holds no entry \
                 {offset} and the user acked only up to {}",
                one_line(&r.user),
                r.lane,
                r.lane_w,
                one_line(&r.user),
                r.acked
            ));
        }
        if let (Some(rec), Some(e)) = (&record, &r.entry) {
            match &e.from {
                Some(f) if *f == rec.sender => {}
                Some(f) => problems.push(format!(
                    "{}: entry {offset} names sender {} but the record's sender is {}",
                    one_line(&r.user),
                    one_line(f),
                    one_line(&rec.sender)
                )),
                None => problems.push(format!(
                    "{}: entry {offset} does not decode",
                    one_line(&r.user)
                )),
            }
        }
    }

    let staging_lanes = staging(&store, shard, offset).await?;
    let status = match &record {
        None if min_w.is_none_or(|w| offset > w) => TraceStatus::Lost,
        None => TraceStatus::Materialised,
        Some(_) if recipients.iter().all(|r| r.state.is_materialised()) => {
            TraceStatus::Materialised
        }
        Some(_) => TraceStatus::Pending,
    };
    Ok(Trace {
        shard,
        offset,
        shards,
        core_url: crate::redact_url(core_url),
        mailbox_url: crate::redact_url(mailbox_url),
        log,
        trimmed: record.is_none(),
        record,
        watermark: WatermarkSummary {
            layout: wm.layout,
            epoch: wm.epoch,
            blob_bytes: wm.blob_len,
            uniform: wm.lanes.is_uniform(),
            min_w,
            max_w: wm.lanes.max_present_w(),
        },
        staging_lanes,
        recipients_from,
        recipients,
        status,
        problems,
    })
}

async fn log_first(core: &mut LogStore, shard: u32) -> Result<Option<u64>> {
    let mut conn = core.connection();
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(keys::dlog(shard))
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    let redis::Value::Array(entries) = v else {
        return Ok(None);
    };
    Ok(entries.first().and_then(|e| match e {
        redis::Value::Array(pair) => match pair.first() {
            Some(redis::Value::BulkString(id)) => std::str::from_utf8(id)
                .ok()?
                .strip_suffix("-0")?
                .parse()
                .ok(),
            _ => None,
        },
        _ => None,
    }))
}

/// Users of the shard whose mailbox holds an entry with seq `offset` (SCAN `mb:{s}:*`).
async fn mailboxes_holding(store: &MailboxStore, shard: u32, offset: u64) -> Result<Vec<String>> {
    let mut conn = store.connection();
    let prefix = keys::mailbox(shard, "");
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    let mut users = Vec::new();
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !batch.is_empty() {
            let mut pipe = redis::pipe();
            for k in &batch {
                pipe.cmd("ZCOUNT").arg(k).arg(offset).arg(offset);
            }
            let counts: Vec<u64> = pipe.query_async(&mut conn).await?;
            for (k, n) in batch.iter().zip(counts) {
                if n > 0 {
                    if let Some(u) = k
                        .strip_prefix(prefix.as_bytes())
                        .and_then(|u| std::str::from_utf8(u).ok())
                    {
                        users.push(u.to_string());
                    }
                }
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    users.sort();
    users.dedup();
    Ok(users)
}

async fn recipient_traces(
    store: &MailboxStore,
    wm: &ShardWatermark,
    map: &ShardMap,
    shard: u32,
    offset: u64,
    users: &[String],
) -> Result<Vec<RecipientTrace>> {
    if users.is_empty() {
        return Ok(Vec::new());
    }
    let mut conn = store.connection();
    let mut pipe = redis::pipe();
    for u in users {
        pipe.cmd("ZRANGEBYSCORE")
            .arg(keys::mailbox(shard, u))
            .arg(offset)
            .arg(offset);
        pipe.cmd("HGET").arg(keys::acks(shard)).arg(u);
    }
    let replies: Vec<redis::Value> = pipe.query_async(&mut conn).await?;
    let mut out = Vec::with_capacity(users.len());
    for (u, pair) in users.iter().zip(replies.chunks(2)) {
        let members: Vec<Vec<u8>> =
            redis::from_redis_value_ref(&pair[0]).map_err(redis::RedisError::from)?;
        let acked: Option<u64> =
            redis::from_redis_value_ref(&pair[1]).map_err(redis::RedisError::from)?;
        let acked = acked.unwrap_or(0);
        let entry = members.first().map(|m| {
            let d = decode_entry_head(m).filter(|d| d.0 == offset);
            EntryInfo {
                from: d.as_ref().map(|d| d.2.clone()),
                sent_at_us: d.as_ref().map(|d| d.1),
                bytes: m.len(),
            }
        });
        let lane = map.route(u).lane;
        let rec = wm.lanes.lane(lane);
        let state = if !rec.present {
            RecipientState::LaneNotPresent
        } else if rec.w >= offset {
            match (&entry, acked >= offset) {
                (Some(_), _) => RecipientState::Materialised,
                (None, true) => RecipientState::AckedPossiblyTrimmed,
                (None, false) => RecipientState::Missing,
            }
        } else if entry.is_some() {
            RecipientState::PendingEntryWritten
        } else {
            RecipientState::Pending
        };
        out.push(RecipientTrace {
            user: u.clone(),
            lane,
            lane_present: rec.present,
            lane_w: if rec.present { rec.w } else { 0 },
            entry,
            acked,
            state,
        });
    }
    Ok(out)
}

async fn staging(store: &MailboxStore, shard: u32, offset: u64) -> Result<Option<Vec<usize>>> {
    let mut conn = store.connection();
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(keys::staging(shard, offset))
        .query_async(&mut conn)
        .await?;
    if fields.is_empty() {
        return Ok(None);
    }
    let mut lanes: Vec<usize> = fields.iter().filter_map(|f| f.parse().ok()).collect();
    lanes.sort_unstable();
    Ok(Some(lanes))
}

/// `(seq, sent_at_us, from)` of a stored mailbox entry (layout of `tidemark_protocol::entry`:
/// seq u48 BE, sent_at u64 BE, from_len u8, from, body). `None` when it does not parse.
fn decode_entry_head(b: &[u8]) -> Option<(u64, u64, String)> {
    if b.len() < 15 {
        return None;
    }
    let mut seq = [0u8; 8];
    seq[2..].copy_from_slice(&b[..6]);
    let sent_at = u64::from_be_bytes(b[6..14].try_into().ok()?);
    let n = b[14] as usize;
    if n == 0 || b.len() < 15 + n {
        return None;
    }
    let from = String::from_utf8(b[15..15 + n].to_vec()).ok()?;
    Some((u64::from_be_bytes(seq), sent_at, from))
}

/// Control characters escaped, so that a user id stays on one line.
fn one_line(s: &str) -> String {
    if s.chars().any(char::is_control) {
        s.escape_debug().to_string()
    } else {
        s.to_string()
    }
}

/// Unix µs as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (UTC).
fn format_unix_us(us: u64) -> String {
    const US_PER_DAY: u64 = 86_400_000_000;
    let (days, in_day) = (us / US_PER_DAY, us % US_PER_DAY);
    // Howard Hinnant's civil_from_days (non-negative days)
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    let secs = in_day / 1_000_000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        in_day % 1_000_000
    )
}

impl RecipientTrace {
    /// One human sentence for the state.
    pub fn describe(&self) -> String {
        match self.state {
            RecipientState::Materialised => "materialised, entry present".into(),
            RecipientState::AckedPossiblyTrimmed => {
                format!(
                    "materialised; acked, possibly trimmed (acked {})",
                    self.acked
                )
            }
            RecipientState::Missing => format!(
                "MISSING: lane W = {} passed the record, no entry, acked only {}",
                self.lane_w, self.acked
            ),
            RecipientState::PendingEntryWritten => format!(
                "pending (lane W = {}); entry written, not yet visible",
                self.lane_w
            ),
            RecipientState::Pending => format!("pending (lane W = {})", self.lane_w),
            RecipientState::LaneNotPresent => "lane not present (nothing materialised)".into(),
        }
    }
}

impl Trace {
    /// The `--json` form: one object.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a trace serialises");
        if let Some(rs) = v.get_mut("recipients").and_then(|r| r.as_array_mut()) {
            for (j, r) in rs.iter_mut().enumerate() {
                r["materialised"] = self.recipients[j].state.is_materialised().into();
                r["detail"] = self.recipients[j].describe().into();
            }
        }
        v
    }

    /// The human form, several lines.
    pub fn to_human(&self) -> String {
        let (s, o) = (self.shard, self.offset);
        let mut out = format!(
            "trace shard {s} offset {o} ({} shards; core {}, mailbox {})\n",
            self.shards, self.core_url, self.mailbox_url
        );
        out.push_str(&format!(
            "log        dlog:{{{s}}} head {}, {}\n",
            self.log.head,
            match self.log.first {
                Some(f) => format!(
                    "holds offsets {f}..={} ({} records)",
                    self.log.head, self.log.len
                ),
                None => "empty (every record trimmed)".to_string(),
            }
        ));
        match &self.record {
            Some(r) => {
                out.push_str(&format!(
                    "record     offset {} prev {}, from {}, client id {}, sent_at {} ({} µs), \
                     body {} bytes\n",
                    r.offset,
                    r.prev,
                    one_line(&r.sender),
                    one_line(&r.client_id),
                    format_unix_us(r.sent_at_us),
                    r.sent_at_us,
                    r.body_bytes
                ));
                let names: Vec<String> = r.recipients.iter().map(|u| one_line(u)).collect();
                out.push_str(&format!(
                    "           recipients in this shard ({}): {}\n",
                    names.len(),
                    names.join(", ")
                ));
            }
            None => out.push_str(&format!(
                "record     offset {o}: record trimmed from the log (fully materialised); \
                 recipients below are the mailboxes of shard {s} that hold entry {o} (those \
                 that acked it and had it trimmed cannot be found)\n"
            )),
        }
        let w = &self.watermark;
        out.push_str(&format!(
            "watermark  wm:{{{s}}} {}, epoch {}, blob {} bytes, {}, W min {} max {}\n",
            w.layout,
            w.epoch,
            w.blob_bytes,
            if w.uniform { "uniform" } else { "diverged" },
            w.min_w.map_or("-".into(), |v| v.to_string()),
            w.max_w.map_or("-".into(), |v| v.to_string()),
        ));
        match &self.staging_lanes {
            Some(l) => {
                let l: Vec<String> = l.iter().map(|x| x.to_string()).collect();
                out.push_str(&format!(
                    "staging    stg:{{{s}}}:{o}: lanes durable: {}\n",
                    l.join(", ")
                ));
            }
            None => out.push_str(&format!(
                "staging    stg:{{{s}}}:{o}: none (hot path, or collected by GC)\n"
            )),
        }
        if self.recipients.is_empty() {
            out.push_str("recipients none found\n");
        } else {
            let width = self
                .recipients
                .iter()
                .map(|r| one_line(&r.user).chars().count())
                .max()
                .unwrap_or(4)
                .max(9);
            out.push_str(&format!(
                "  {:<width$}  lane  lane W  entry   acked  state\n",
                "recipient"
            ));
            for r in &self.recipients {
                out.push_str(&format!(
                    "  {:<width$}  {:>4}  {:>6}  {:<6}  {:>5}  {}\n",
                    one_line(&r.user),
                    r.lane,
                    if r.lane_present {
                        r.lane_w.to_string()
                    } else {
                        "-".into()
                    },
                    if r.entry.is_some() { "yes" } else { "no" },
                    r.acked,
                    r.describe()
                ));
            }
        }
        out.push_str(&format!(
            "status     {}\n",
            match self.status {
                TraceStatus::Materialised if self.trimmed =>
                    "materialised (record trimmed from the log)",
                TraceStatus::Materialised => "materialised for every recipient",
                TraceStatus::Pending => "pending: some lane W is still below the record",
                TraceStatus::Lost =>
                    "lost: not in the log, and the lowest W is below it (see the problems)",
            }
        ));
        for p in &self.problems {
            out.push_str(&format!("problem    {p}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_head_and_time() {
        let mut b = vec![0, 0, 0, 0, 1, 2];
        b.extend_from_slice(&1_764_489_600_000_000u64.to_be_bytes());
        b.push(5);
        b.extend_from_slice(b"alicehi");
        assert_eq!(
            decode_entry_head(&b),
            Some((258, 1_764_489_600_000_000, "alice".into()))
        );
        assert_eq!(decode_entry_head(&b[..16]), None);
        assert_eq!(
            format_unix_us(1_764_489_600_000_000),
            "2025-11-30T08:00:00.000000Z"
        );
    }
}
