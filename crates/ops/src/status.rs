//! `tidemark status`: the live nodes of a deployment (the registry on core instance 0) and,
//! per shard, its lease holder, epoch, W (lowest and highest over the lanes), log head, lag,
//! layout and blob size. Read-only.
//!
//! The reading is [`tidemark_store::status`] (shared with the gateway's
//! `GET /v1/admin/status`); this module connects for one read and prints it.
//!
//! JSON (`--json`), one object:
//!
//! ```text
//! {"nodes":[{"id","url","role","layout","reads","age_ms"}],
//!  "shards":[{"shard","owner","epoch","w_min","w_max","head","lag","layout","blob_bytes"}]}
//! ```
//!
//! `owner` is the node holding the shard's lease (null in static ownership, where no lease is
//! taken, or while nobody holds it); a shard whose watermark cannot be read has null W fields
//! and an `error`.

use tidemark_store::error::Result;
use tidemark_store::topology::ShardMap;

pub use tidemark_store::status::{ShardStatus, Status};

/// Reads the status of every shard of `map` and the live nodes (one connection per instance,
/// for this read).
pub async fn status(map: &ShardMap) -> Result<Status> {
    tidemark_store::status::read(map).await
}

fn or_dash<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or("-".to_string(), T::to_string)
}

/// Two tables: nodes, then shards.
pub fn to_human(status: &Status) -> String {
    let mut out = format!("{} live node(s)\n", status.nodes.len());
    out.push_str(&format!(
        "{:<24} {:<12} {:<10} {:>5} {:>8}  url\n",
        "node", "role", "layout", "reads", "age_ms"
    ));
    for n in &status.nodes {
        out.push_str(&format!(
            "{:<24} {:<12} {:<10} {:>5} {:>8}  {}\n",
            n.id,
            n.role,
            n.layout.as_deref().unwrap_or("-"),
            n.reads.map_or("-".to_string(), |v| v.to_string()),
            n.age_ms,
            n.url
        ));
    }
    out.push_str(&format!(
        "\n{:>5} {:<24} {:>6} {:>10} {:>10} {:>10} {:>8} {:<10} {:>5}\n",
        "shard", "owner", "epoch", "w_min", "w_max", "head", "lag", "layout", "blob"
    ));
    for s in &status.shards {
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
