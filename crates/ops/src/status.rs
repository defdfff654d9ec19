//! `tidemark status`: the live nodes of a deployment (the registry on core instance 0) and,
//! per shard, its lease holder, epoch, W (lowest and highest over the lanes), log head, lag,
//! layout and blob size. Read-only.
//!
//! JSON (`--json`), one object:
//!
//! ```text
//! {"nodes":[{"id","url","role","layout","age_ms"}],
//!  "shards":[{"shard","owner","epoch","w_min","w_max","head","lag","layout","blob_bytes"}]}
//! ```
//!
//! `owner` is the node holding the shard's lease (null in static ownership, where no lease is
//! taken, or while nobody holds it); a shard whose watermark cannot be read has null W fields
//! and an `error`.

use serde::Serialize;
use tidemark_store::error::Result;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::NodeInfo;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::topology::ShardMap;

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
}

/// The whole status.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Live nodes, by id.
    pub nodes: Vec<NodeInfo>,
    /// Every shard of the map.
    pub shards: Vec<ShardStatus>,
}

/// Reads the status of every shard of `map` and the live nodes.
pub async fn status(map: &ShardMap) -> Result<Status> {
    let mut cores = Vec::new();
    for url in map.core_urls() {
        cores.push(LogStore::connect(url).await?);
    }
    let nodes = cores[0].live_nodes().await?;
    let mut wms = Vec::new();
    for (i, url) in map.mailbox_urls().iter().enumerate() {
        let mut store = MailboxStore::connect(url, map.layout()).await?;
        let shards = map.shards_on_mailbox(i);
        let read = store.read_watermarks(&shards).await?;
        wms.extend(shards.into_iter().zip(read));
    }
    wms.sort_by_key(|(s, _)| *s);
    let mut shards = Vec::with_capacity(wms.len());
    for (s, wm) in wms {
        let core = &mut cores[map.core_of(s)];
        let head = core.head(s).await?;
        let owner = core.lease_holder(s).await?.map(|(o, _)| o);
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
            },
        };
        shards.push(line);
    }
    Ok(Status { nodes, shards })
}

fn or_dash<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or("-".to_string(), T::to_string)
}

impl Status {
    /// Two tables: nodes, then shards.
    pub fn to_human(&self) -> String {
        let mut out = format!("{} live node(s)\n", self.nodes.len());
        out.push_str(&format!(
            "{:<24} {:<12} {:<10} {:>8}  url\n",
            "node", "role", "layout", "age_ms"
        ));
        for n in &self.nodes {
            out.push_str(&format!(
                "{:<24} {:<12} {:<10} {:>8}  {}\n",
                n.id,
                n.role,
                n.layout.as_deref().unwrap_or("-"),
                n.age_ms,
                n.url
            ));
        }
        out.push_str(&format!(
            "\n{:>5} {:<24} {:>6} {:>10} {:>10} {:>10} {:>8} {:<10} {:>5}\n",
            "shard", "owner", "epoch", "w_min", "w_max", "head", "lag", "layout", "blob"
        ));
        for s in &self.shards {
            out.push_str(&format!(
                "{:>5} {:<24} {:>6} {:>10} {:>10} {:>10} {:>8} {:<10} {:>5}{}\n",
                s.shard,
                s.owner.as_deref().unwrap_or("-"),
                or_dash(&s.epoch),
                or_dash(&s.w_min),
                or_dash(&s.w_max),
                s.head,
                or_dash(&s.lag),
                s.layout.as_deref().unwrap_or("-"),
                or_dash(&s.blob_bytes),
                s.error
                    .as_ref()
                    .map(|e| format!("  error: {e}"))
                    .unwrap_or_default(),
            ));
        }
        out
    }
}
