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
//! Everything is read-only (connecting loads the scripts into the script cache, nothing else);
//! the reads are the store crate's ([`tidemark_store::inspect`]) and entries are decoded with
//! the protocol's decoder ([`tidemark_protocol::entry::decode_entry_head`]).
//! When the record has been trimmed from the log — GC trims records at or below the lowest
//! present W, so a trimmed record is fully materialised — its recipients are no longer known;
//! the trace then lists the mailboxes of the shard that hold an entry with seq `o` (a SCAN of
//! `mb:{s}:*`). Recipients that acked the message and had it trimmed can no longer be found.
//!
//! A corrupt or missing watermark is an error ([`Error::Corrupt`], [`Error::NoWatermark`]):
//! the trace never guesses. Inconsistencies it finds (W passed a record whose entry is absent
//! and not acked, a record missing from the log above the lowest W, …) are listed in
//! [`Trace::problems`].
//!
//! This file gathers the trace; `report.rs` holds what it found (the types re-exported
//! here), `render.rs` prints it.

mod render;
mod report;
#[cfg(test)]
mod tests;

use std::path::Path;

use tidemark_protocol::entry::decode_entry_head;
use tidemark_store::error::{Error, Result};
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::{Layout, ShardWatermark, U48_MAX};
use tidemark_store::topology::{ShardMap, Topology, TopologyError};
use tidemark_store::{deployment, inspect, redact_url};

use render::one_line;
pub use report::{
    EntryInfo, LogRecord, LogState, RecipientSource, RecipientState, RecipientTrace, Trace,
    TraceStatus, WatermarkSummary,
};

/// Where the traced shard's instances come from.
#[derive(Debug, Clone, Copy)]
pub enum Instances<'a> {
    /// A TOML deployment file: the shard's instances come from its tables.
    File(&'a Path),
    /// One core and one mailbox instance holding every shard of a `shards`-shard deployment.
    Single {
        /// Shards of the deployment (lanes are routed with it).
        shards: u32,
        /// The core Redis URL.
        core: &'a str,
        /// The mailbox Redis URL.
        mailbox: &'a str,
    },
}

impl Instances<'_> {
    /// The validated shard map to trace with. A trace only reads, and every watermark names
    /// its own layout, so a single pair of instances is taken as packed-v2.
    pub fn shard_map(self) -> std::result::Result<ShardMap, TopologyError> {
        let topology = match self {
            Instances::File(path) => Topology::from_file(path)?,
            Instances::Single {
                shards,
                core,
                mailbox,
            } => Topology::single(shards, Layout::PackedV2, core, mailbox),
        };
        topology.validate()
    }
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
    for (url, role) in [
        (core_url, deployment::Role::Core),
        (mailbox_url, deployment::Role::Mailbox),
    ] {
        let mut conn = deployment::connect(url).await?;
        if let Some(id) = deployment::read_at(&mut conn, &deployment::key(url, role)).await? {
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
        first: inspect::first_log_offset(&core, shard).await?,
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
            let users = inspect::mailboxes_holding(&store, shard, offset).await?;
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

    let staging_lanes = inspect::staging_lanes(&store, shard, offset).await?;
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
        core_url: redact_url(core_url),
        mailbox_url: redact_url(mailbox_url),
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

async fn recipient_traces(
    store: &MailboxStore,
    wm: &ShardWatermark,
    map: &ShardMap,
    shard: u32,
    offset: u64,
    users: &[String],
) -> Result<Vec<RecipientTrace>> {
    let found = inspect::entries_at(store, shard, offset, users).await?;
    let mut out = Vec::with_capacity(users.len());
    for (u, at) in users.iter().zip(found) {
        let entry = at.members.first().map(|m| {
            let head = decode_entry_head(m).ok().filter(|h| h.seq == offset);
            EntryInfo {
                from: head.map(|h| h.from.to_string()),
                sent_at_us: head.map(|h| h.sent_at_us),
                bytes: m.len(),
            }
        });
        let lane = map.route(u).lane;
        let rec = wm.lanes.lane(lane);
        out.push(RecipientTrace {
            user: u.clone(),
            lane,
            lane_present: rec.present,
            lane_w: if rec.present { rec.w } else { 0 },
            state: RecipientState::classify(rec, offset, entry.is_some(), at.acked),
            entry,
            acked: at.acked,
        });
    }
    Ok(out)
}
