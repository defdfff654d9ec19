//! A deployment's status, read from Redis: the live nodes (the registry on core instance 0)
//! and, per shard, its lease holder, epoch, every lane's W, log head, lag, layout and blob
//! size. Read-only.
//!
//! Shared by `tidemark status` (the `tidemark-ops` crate, which connects for one read) and
//! the gateway's `GET /v1/admin/status` (which reads over the connections it holds, once a
//! second per viewer): [`gather`] takes the connections, [`read`] makes them. Per read: one
//! `node_list` call, one pipeline per core instance (heads and lease holders) and one
//! `read_log_watermarks` call per mailbox instance.

use serde::Serialize;

use crate::error::Result;
use crate::redis::dlog::LogStore;
use crate::redis::lease::NodeInfo;
use crate::redis::store::MailboxStore;
use crate::redis::watermark::LANES;
use crate::topology::ShardMap;

/// One shard's line.
#[derive(Debug, Clone, Serialize)]
pub struct ShardStatus {
    /// The shard.
    pub shard: u32,
    /// The node holding its lease, if any.
    pub owner: Option<String>,
    /// `wm_epoch`.
    pub epoch: Option<u64>,
    /// Lowest present W over the lanes.
    pub w_min: Option<u64>,
    /// Highest present W over the lanes.
    pub w_max: Option<u64>,
    /// `head:{s}`: the last offset committed.
    pub head: u64,
    /// `head - w_min`: records committed, not yet in every mailbox.
    pub lag: Option<u64>,
    /// `packed-v1` or `packed-v2`.
    pub layout: Option<String>,
    /// Stored blob: 19 bytes (uniform) or 1216 (diverged lanes).
    pub blob_bytes: Option<usize>,
    /// Why the watermark could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// W of each of the 64 lanes (`None`: the lane is empty); empty when the watermark could
    /// not be read. Not in `tidemark status --json` (64 numbers a shard); the gateway's admin
    /// status carries it.
    #[serde(skip)]
    pub lanes: Vec<Option<u64>>,
}

/// The whole status.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Live nodes, by id.
    pub nodes: Vec<NodeInfo>,
    /// Every shard of the map, ascending.
    pub shards: Vec<ShardStatus>,
}

/// Connects to every instance of `map` and reads the status ([`gather`]).
pub async fn read(map: &ShardMap) -> Result<Status> {
    let mut cores = Vec::new();
    for url in map.core_urls() {
        cores.push(LogStore::connect(url).await?);
    }
    let mut mailboxes = Vec::new();
    for url in map.mailbox_urls() {
        mailboxes.push(MailboxStore::connect(url, map.layout()).await?);
    }
    gather(map, &mut cores, &mut mailboxes).await
}

/// Reads the status of every shard of `map` and the live nodes over `cores` and `mailboxes`
/// (one connection per instance of `map`, by index).
pub async fn gather(
    map: &ShardMap,
    cores: &mut [LogStore],
    mailboxes: &mut [MailboxStore],
) -> Result<Status> {
    let nodes = cores[0].live_nodes().await?;
    let mut logs = Vec::with_capacity(map.shards() as usize);
    for (i, core) in cores.iter_mut().enumerate() {
        let shards = map.shards_on_core(i);
        let read = core.heads_and_holders(&shards).await?;
        logs.extend(shards.into_iter().zip(read));
    }
    logs.sort_by_key(|(s, _)| *s);
    let mut wms = Vec::with_capacity(map.shards() as usize);
    for (i, store) in mailboxes.iter_mut().enumerate() {
        let shards = map.shards_on_mailbox(i);
        let read = store.read_watermarks(&shards).await?;
        wms.extend(shards.into_iter().zip(read));
    }
    wms.sort_by_key(|(s, _)| *s);
    let mut shards = Vec::with_capacity(wms.len());
    for ((s, wm), (s2, (head, owner))) in wms.into_iter().zip(logs) {
        debug_assert_eq!(s, s2);
        let line = match wm {
            Ok(wm) => {
                let w_min = wm.lanes.min_present_w();
                ShardStatus {
                    shard: s,
                    owner,
                    epoch: Some(wm.epoch),
                    w_min,
                    w_max: wm.lanes.max_present_w(),
                    head,
                    lag: w_min.map(|w| head.saturating_sub(w)),
                    layout: Some(wm.layout.to_string()),
                    blob_bytes: Some(wm.blob_len),
                    error: None,
                    lanes: (0..LANES)
                        .map(|l| {
                            let r = wm.lanes.lane(l);
                            r.present.then_some(r.w)
                        })
                        .collect(),
                }
            }
            Err(e) => ShardStatus {
                shard: s,
                owner,
                epoch: None,
                w_min: None,
                w_max: None,
                head,
                lag: None,
                layout: None,
                blob_bytes: None,
                error: Some(e.to_string()),
                lanes: Vec::new(),
            },
        };
        shards.push(line);
    }
    Ok(Status { nodes, shards })
}
