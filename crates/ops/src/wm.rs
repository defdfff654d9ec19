//! `tidemark wm …`: the watermarks (`wm:{s}`) of a mailbox instance. [`init`] creates them,
//! [`inspect`] and [`verify`] read them (through `read_log_watermarks.lua`, like an owner),
//! [`downgrade`] rewrites them as packed-v1 (offline, ADR-0015), and [`explain_missing`] says
//! why one is missing, from the deployment identity the instance records.

use serde_json::json;
use tidemark_store::error::{Error, Result};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::store::OWNER_MARK_TTL_MS;
use tidemark_store::redis::watermark::{Layout, ShardWatermark, LANES};
use tidemark_store::{deployment, redact_url};

/// What `wm init` did, or why it wrote nothing.
#[derive(Debug, PartialEq, Eq)]
pub enum InitOutcome {
    /// Watermarks written.
    Done(InitReport),
    /// `force` without `force_offline`, and these shards have a live owner (`owner:{s}`
    /// holding an epoch at or above the shard's, as `wm downgrade` judges it): `(shard, the
    /// owner's epoch)`. Nothing was written.
    LiveOwners(Vec<(u32, u64)>),
}

/// What `wm init` wrote.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct InitReport {
    /// Shards given a watermark (new, or overwritten with `force`).
    pub created: u32,
    /// Shards that already had one and were left as they are (without `force`).
    pub present: u32,
    /// Overwritten shards whose epoch was raised above the one asked for, to one above the
    /// epoch they had (ADR-0110: an overwrite never moves an epoch back): `(shard, epoch
    /// written)`.
    pub raised: Vec<(u32, u64)>,
}

/// `tidemark wm init`: fresh watermarks for shards `0..shards`, all lanes present at 0.
/// An existing watermark is left as it is (counted) unless `force`, which overwrites it
/// (checked per shard, atomically), at an epoch above the one it had (ADR-0110). With
/// `force`, shards whose owner is live ([`live_owner_of`]) are refused, all before anything is
/// written ([`InitOutcome::LiveOwners`]), unless `force_offline`.
pub async fn init(
    url: &str,
    shards: u32,
    layout: Layout,
    epoch: u64,
    force: bool,
    force_offline: bool,
) -> Result<InitOutcome> {
    let mut store = MailboxStore::connect(url, Layout::PackedV2).await?;
    if force && !force_offline {
        let mut live = Vec::new();
        for s in 0..shards {
            if let Some(e) = live_owner_of(&mut store, s).await? {
                live.push((s, e));
            }
        }
        if !live.is_empty() {
            return Ok(InitOutcome::LiveOwners(live));
        }
    }
    let mut report = InitReport::default();
    for s in 0..shards {
        match store.init_watermark_epoch(s, layout, epoch, 0, force).await {
            Ok(written) => {
                report.created += 1;
                if written != epoch {
                    report.raised.push((s, written));
                }
            }
            Err(Error::AlreadyExists { .. }) => report.present += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(InitOutcome::Done(report))
}

/// The epoch of a live owner of `shard` that can still write it: its `owner:{s}` mark
/// (refreshed by every running materializer, gone [`OWNER_MARK_TTL_MS`] after it stopped
/// refreshing, removed on a clean stop), unless the watermark's epoch is above it (the owner
/// is fenced). A mark beside a missing or unreadable watermark counts.
pub async fn live_owner_of(store: &mut MailboxStore, shard: u32) -> Result<Option<u64>> {
    let Some(e) = store.live_owner(shard).await? else {
        return Ok(None);
    };
    Ok(match store.read_watermark(shard).await {
        Ok(wm) if wm.epoch > e => None,
        _ => Some(e),
    })
}

/// Why `wm:{shard}` is missing on `url`, in words an operator can act on (from the
/// deployment identity the instance records, when it has one).
pub async fn explain_missing(url: &str, shard: u32) -> String {
    let id = async {
        let mut conn = deployment::connect(url).await.ok()?;
        deployment::read_at(&mut conn, &deployment::key(url, deployment::Role::Mailbox))
            .await
            .ok()
    }
    .await;
    match id {
        Some(Some(id)) if id.role == deployment::Role::Core => format!(
            "{url} is core instance {} of a {}-shard deployment (dispatch logs); watermarks \
             live on the mailbox instances: pass a mailbox URL",
            id.index, id.shards
        ),
        Some(Some(id)) if shard >= id.shards => format!(
            "the deployment has {} shards (0..={}); there is no shard {shard}",
            id.shards,
            id.shards - 1
        ),
        Some(Some(id)) if !id.holds.contains(&shard) => format!(
            "{url} is mailbox instance {}, which holds shards {}; shard {shard} lives on \
             another mailbox instance",
            id.index,
            deployment::format_ranges(&id.holds)
        ),
        Some(Some(id)) => format!(
            "{url} is mailbox instance {}, which should hold shard {shard}: its watermark was \
             deleted or never created. `tidemark serve` creates missing watermarks when it \
             starts; if the shard held data, restore the instance instead (docs/operations.md, \
             Restores)",
            id.index
        ),
        _ => format!(
            "{url} records no Tidemark deployment: check the URL (`tidemark wm verify --redis \
             URL` says what an instance holds)"
        ),
    }
}

/// `tidemark wm inspect`: the decoded watermark of one shard.
pub async fn inspect(url: &str, shard: u32) -> Result<ShardWatermark> {
    let mut store = MailboxStore::connect(url, Layout::PackedV2).await?;
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

/// What `wm downgrade` did.
#[derive(Debug, Default)]
pub struct DowngradeReport {
    /// Shards rewritten as packed-v1, with their watermark as it was.
    pub converted: Vec<(u32, ShardWatermark)>,
    /// Shards left alone, and why (a live owner).
    pub skipped: Vec<(u32, String)>,
}

/// `tidemark wm downgrade`: the ADR's offline downgrade of the given shards (19 → 1216 bytes,
/// layout packed-v1). A shard whose owner is live and holds the current epoch is skipped
/// (it would write packed-v2 again right after) unless `force_offline`; a fenced owner (its
/// epoch below the shard's) cannot write and does not count. Stops at the first corrupt or
/// missing watermark.
pub async fn downgrade(url: &str, shards: &[u32], force_offline: bool) -> Result<DowngradeReport> {
    let mut store = MailboxStore::connect(url, Layout::PackedV2).await?;
    let mut report = DowngradeReport::default();
    for &s in shards {
        if !force_offline {
            let wm = store.read_watermark(s).await?;
            if let Some(e) = store.live_owner(s).await? {
                if e >= wm.epoch {
                    report.skipped.push((
                        s,
                        format!(
                            "a live owner holds epoch {e} (seen within {} s): stop it first, or \
                             fence the shard (`tidemark shard fence`) and run this again",
                            OWNER_MARK_TTL_MS / 1000
                        ),
                    ));
                    continue;
                }
            }
        }
        report.converted.push((s, store.downgrade_to_v1(s).await?));
    }
    Ok(report)
}

/// Shards that have a `wm:{s}` key on this instance (SCAN), sorted.
pub async fn discover_shards(url: &str) -> Result<Vec<u32>> {
    if tidemark_store::endpoint::is_cluster(url) {
        return Err(Error::InvalidArgument(format!(
            "{}: finding shards by SCAN is not supported on a Redis Cluster yet; name the \
             shards (--shards)",
            redact_url(url)
        )));
    }
    let mut conn = deployment::connect(url).await?;
    deployment::watermark_shards(&mut conn).await
}

/// One finding of `wm verify`.
#[derive(Debug)]
pub struct VerifyFinding {
    /// Instance URL (its password redacted).
    pub url: String,
    /// Shard number (None: a finding about the instance).
    pub shard: Option<u32>,
    /// What is wrong.
    pub problem: String,
}

/// `tidemark wm verify`: every shard of every instance, decoded and checked; returns the
/// number of shards checked and every finding. An instance that records a deployment identity
/// ([`deployment`]) is also checked against it: a core instance is reported as such, and
/// a `wm:{s}` that the deployment does not place on this instance is a finding.
pub async fn verify(urls: &[String]) -> Result<(usize, Vec<VerifyFinding>)> {
    let mut checked = 0;
    let mut findings = Vec::new();
    for url in urls {
        let shards = discover_shards(url).await?;
        let mut store = MailboxStore::connect(url, Layout::PackedV2).await?;
        let identity = deployment::read_at(
            &mut store.connection(),
            &deployment::key(url, deployment::Role::Mailbox),
        )
        .await?;
        if identity.is_none() && shards.is_empty() {
            findings.push(VerifyFinding {
                url: redact_url(url),
                shard: None,
                problem: "no watermark and no deployment identity here: not a mailbox instance \
                          of a Tidemark deployment (a core instance, or never initialised)"
                    .into(),
            });
            continue;
        }
        if let Some(id) = &identity {
            if id.role == deployment::Role::Core {
                findings.push(VerifyFinding {
                    url: redact_url(url),
                    shard: None,
                    problem: format!(
                        "this is core instance {} of a {}-shard deployment (dispatch logs), not \
                         a mailbox instance: pass the mailbox URLs",
                        id.index, id.shards
                    ),
                });
                continue;
            }
            for s in shards.iter().filter(|s| !id.holds.contains(s)) {
                findings.push(VerifyFinding {
                    url: redact_url(url),
                    shard: Some(*s),
                    problem: format!(
                        "wm:{{{s}}} does not belong here: this is mailbox instance {} of a \
                         {}-shard deployment, holding shards {}",
                        id.index,
                        id.shards,
                        deployment::format_ranges(&id.holds)
                    ),
                });
            }
            let missing: Vec<u32> = id
                .holds
                .iter()
                .copied()
                .filter(|s| shards.binary_search(s).is_err())
                .collect();
            if !missing.is_empty() {
                findings.push(VerifyFinding {
                    url: redact_url(url),
                    shard: None,
                    problem: format!(
                        "no watermark for shards {} that this instance holds",
                        deployment::format_ranges(&missing)
                    ),
                });
            }
        }
        for chunk in shards.chunks(256) {
            let read = match store.read_watermarks(chunk).await {
                Ok(read) => read,
                // a `wm:{s}` that is not a hash fails the whole read: shard by shard, that one
                // a corrupt finding
                Err(e) if is_wrong_type(&e) => {
                    let mut read = Vec::with_capacity(chunk.len());
                    for &s in chunk {
                        read.push(match store.read_watermarks(&[s]).await {
                            Ok(mut one) => one.pop().expect("one shard asked, one answer"),
                            Err(e) if is_wrong_type(&e) => Err(e),
                            Err(e) => return Err(e),
                        });
                    }
                    read
                }
                Err(e) => return Err(e),
            };
            for (s, r) in chunk.iter().zip(read) {
                checked += 1;
                if let Err(e) = r {
                    findings.push(VerifyFinding {
                        url: redact_url(url),
                        shard: Some(*s),
                        problem: if is_wrong_type(&e) {
                            wrong_type_problem(*s)
                        } else {
                            e.to_string()
                        },
                    });
                }
            }
        }
    }
    Ok((checked, findings))
}

/// Whether `e` is Redis's `WRONGTYPE`: a `wm:{s}` key that is not a hash, which the read
/// script (`HGETALL`) cannot read. A corrupt watermark, not a failure of the tool.
pub fn is_wrong_type(e: &Error) -> bool {
    matches!(e, Error::Redis(re) if re.to_string().contains("WRONGTYPE"))
}

/// What `wm verify` and `wm inspect` say of a `wm:{shard}` that is not a hash.
pub fn wrong_type_problem(shard: u32) -> String {
    format!(
        "shard {shard}: corrupt: wm:{{{shard}}} is not a hash (WRONGTYPE): a watermark is a hash \
         of wm_layout, wm_epoch and wm_blob"
    )
}
