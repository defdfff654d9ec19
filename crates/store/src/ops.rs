//! Operator commands on watermarks (`tidemark wm …`, `tidemark shard fence`): library code
//! behind the thin binary, returning values that the binary prints.

use serde_json::json;

use crate::error::{Error, Result};
use crate::redis::store::Store;
use crate::redis::watermark::{Layout, ShardWatermark, LANES};

/// `tidemark wm init`: fresh watermarks for shards `0..shards`, all lanes present at 0.
/// Refuses any existing one unless `force` (checked per shard, atomically).
pub async fn wm_init(
    url: &str,
    shards: u32,
    layout: Layout,
    epoch: u64,
    force: bool,
) -> Result<u32> {
    let mut store = Store::connect(url, Layout::PackedV2).await?;
    for s in 0..shards {
        store.init_watermark(s, layout, epoch, 0, force).await?;
    }
    Ok(shards)
}

/// `tidemark wm inspect`: the decoded watermark of one shard.
pub async fn wm_inspect(url: &str, shard: u32) -> Result<ShardWatermark> {
    let mut store = Store::connect(url, Layout::PackedV2).await?;
    store.read_watermark(shard).await
}

/// JSON form of `wm inspect --json`.
pub fn inspect_json(shard: u32, wm: &ShardWatermark) -> serde_json::Value {
    let lanes: Vec<_> = wm
        .lanes
        .0
        .iter()
        .enumerate()
        .map(|(l, r)| {
            json!({"lane": l, "presence": u8::from(r.present), "w": r.w,
                   "w_floor": r.w_floor, "w_recomputed": r.w_recomputed})
        })
        .collect();
    json!({
        "shard": shard,
        "layout": wm.layout.as_str(),
        "epoch": wm.epoch,
        "uniform": wm.lanes.is_uniform(),
        "lanes": lanes,
    })
}

/// Human form of `wm inspect`: a header, then lanes grouped into runs of equal records.
pub fn inspect_human(shard: u32, wm: &ShardWatermark) -> String {
    let mut out = format!(
        "shard {shard}: layout {}, epoch {}, blob {} bytes, {}\n",
        wm.layout,
        wm.epoch,
        wm.blob_len,
        if wm.lanes.is_uniform() {
            "uniform (all 64 lanes equal)"
        } else {
            "diverged"
        }
    );
    match (wm.lanes.min_present_w(), wm.lanes.max_present_w()) {
        (Some(lo), Some(hi)) => out.push_str(&format!("present W: min {lo}, max {hi}\n")),
        _ => out.push_str("no lane present\n"),
    }
    let mut start = 0;
    for l in 1..=LANES {
        if l == LANES || wm.lanes.0[l] != wm.lanes.0[start] {
            let r = wm.lanes.0[start];
            let range = if l - 1 == start {
                format!("lane {start}")
            } else {
                format!("lanes {start}-{}", l - 1)
            };
            if r.present {
                out.push_str(&format!(
                    "  {range:<12} W={} W_floor={} W_recomputed={}\n",
                    r.w, r.w_floor, r.w_recomputed
                ));
            } else {
                out.push_str(&format!("  {range:<12} empty\n"));
            }
            start = l;
        }
    }
    out
}

/// `tidemark wm downgrade`: the ADR's offline downgrade of the given shards (19 → 1216 bytes,
/// layout packed-v1). Stops at the first corrupt or missing watermark.
pub async fn wm_downgrade(url: &str, shards: &[u32]) -> Result<Vec<(u32, ShardWatermark)>> {
    let mut store = Store::connect(url, Layout::PackedV2).await?;
    let mut done = Vec::new();
    for &s in shards {
        done.push((s, store.downgrade_to_v1(s).await?));
    }
    Ok(done)
}

/// Shards that have a `wm:{s}` key on this instance (SCAN), sorted.
pub async fn discover_shards(url: &str) -> Result<Vec<u32>> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    let mut shards = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("wm:{*}")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        for k in batch {
            if let Some(n) = k
                .strip_prefix("wm:{")
                .and_then(|r| r.strip_suffix('}'))
                .and_then(|n| n.parse::<u32>().ok())
            {
                shards.push(n);
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    shards.sort_unstable();
    shards.dedup();
    Ok(shards)
}

/// One finding of `wm verify`.
#[derive(Debug)]
pub struct VerifyFinding {
    /// Instance URL (its password redacted).
    pub url: String,
    /// Shard number.
    pub shard: u32,
    /// What is wrong (the error's message).
    pub problem: Error,
}

/// `tidemark wm verify`: every shard of every instance, decoded and checked; returns the
/// number of shards checked and every finding.
pub async fn wm_verify(urls: &[String]) -> Result<(usize, Vec<VerifyFinding>)> {
    let mut checked = 0;
    let mut findings = Vec::new();
    for url in urls {
        let shards = discover_shards(url).await?;
        let mut store = Store::connect(url, Layout::PackedV2).await?;
        for chunk in shards.chunks(256) {
            for (s, r) in chunk.iter().zip(store.read_watermarks(chunk).await?) {
                checked += 1;
                if let Err(problem) = r {
                    findings.push(VerifyFinding {
                        url: crate::redact_url(url),
                        shard: *s,
                        problem,
                    });
                }
            }
        }
    }
    Ok((checked, findings))
}

/// `tidemark shard fence`: raises the shard's epoch by one; returns the new epoch.
pub async fn shard_fence(url: &str, shard: u32) -> Result<u64> {
    let mut store = Store::connect(url, Layout::PackedV2).await?;
    store.claim(shard).await
}

/// Parses a layout argument.
pub fn parse_layout(s: &str) -> std::result::Result<Layout, String> {
    s.parse()
}
