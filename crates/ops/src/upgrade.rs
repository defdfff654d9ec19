//! `tidemark upgrade`: raises a deployment's identity version from 2 to 3 (ADR-0056), so that
//! a deployment created before ADR-0055 writes packed log records too.
//!
//! Version 3 allows one thing version 2 does not: packed records in the dispatch logs, which
//! code that knows only versions 1 and 2 cannot read. Code that cannot read them refuses to
//! start on a version-3 deployment, so the version must be raised only while no such process
//! runs. Before writing anything, [`plan`] checks what can be checked:
//!
//! - every instance (core and mailbox) has an identity of version 2 or 3 (version 1 cannot be
//!   raised: its logs may hold dedupe records without a claim, ADR-0040);
//! - every live node of the registry (leases mode) reads version 3 (its heartbeat says so
//!   since ADR-0056; a record without it is older code);
//! - no shard has a live owner mark (`owner:{s}`, refreshed by every materializer) unless
//!   its lease is held by such a node: a materializer of static ownership does not say which
//!   code it runs, so it must be stopped (a clean stop deletes its marks; after a kill they
//!   expire within 30 s).
//!
//! A gateway without a materializer holds no mark and is not seen; it is harmless: it only
//! writes records, in the six-field form every version reads. Processes already running keep
//! the form they chose at start (six fields) until they restart; a process started after the
//! raise writes packed records.
//!
//! [`upgrade`] raises each instance with a compare-and-set (2 → 3; a second run, or a run
//! interrupted half-way and run again, finishes the rest), then looks again: a process that
//! started during the raise is reported, as it must be stopped before any process restarts.

use serde::Serialize;
use tidemark_store::deployment::{self, Raise, Role, VERSION_CURRENT};
use tidemark_store::error::Result;
use tidemark_store::redact_url;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::topology::ShardMap;

/// One instance's identity version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InstanceVersion {
    /// `core` or `mailbox`.
    pub role: &'static str,
    /// Its position in its pool.
    pub index: usize,
    /// Its URL, password redacted.
    pub url: String,
    /// The recorded version (`None`: no identity).
    pub version: Option<u32>,
}

/// Why the version may not be raised now. Each is a normal condition, reported to the
/// operator, never an error of the tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Blocker {
    /// The instance has no identity: no process of this deployment has started on it yet.
    NoIdentity { role: &'static str, index: usize },
    /// The deployment is of version 1, which cannot be raised by a flag (ADR-0040).
    VersionOne { role: &'static str, index: usize },
    /// A live node whose code does not read the new version (`reads: None`: its heartbeat
    /// does not say, a build from before ADR-0056).
    NodeReadsOlder { id: String, reads: Option<u32> },
    /// A materializer owns `shard` (its mark is live) and is not a live node known to read
    /// the new version: static ownership, or code before ADR-0056.
    UnknownOwner {
        shard: u32,
        epoch: u64,
        lease_holder: Option<String>,
    },
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Blocker::NoIdentity { role, index } => write!(
                f,
                "{role} instance {index} has no deployment identity: start the service on it \
                 once (it records the deployment's version) and run the upgrade again"
            ),
            Blocker::VersionOne { role, index } => write!(
                f,
                "{role} instance {index} is of version 1: a version-1 deployment may hold \
                 dedupe records without a claim (ADR-0040) and cannot be raised"
            ),
            Blocker::NodeReadsOlder { id, reads } => match reads {
                Some(v) => write!(f, "node {id} is live and reads versions up to {v} only"),
                None => write!(
                    f,
                    "node {id} is live and does not say which versions it reads (a build \
                     before this upgrade command): stop it, or replace it with this build"
                ),
            },
            Blocker::UnknownOwner {
                shard,
                epoch,
                lease_holder,
            } => write!(
                f,
                "shard {shard} is owned by a running materializer (epoch {epoch}{}) that does \
                 not say which versions it reads: stop every process of static ownership \
                 (a clean stop clears its marks at once, a killed one's expire within {} s)",
                lease_holder
                    .as_ref()
                    .map(|h| format!(", lease held by {h}, not a live node"))
                    .unwrap_or_default(),
                tidemark_store::redis::store::OWNER_MARK_TTL_MS / 1000
            ),
        }
    }
}

/// What [`plan`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Every instance's version, core pool first.
    pub instances: Vec<InstanceVersion>,
    /// The version the upgrade records ([`VERSION_CURRENT`]).
    pub to: u32,
    /// Why it may not be done now (empty: it may).
    pub blockers: Vec<Blocker>,
}

impl Plan {
    /// Whether every instance is already at [`Plan::to`].
    pub fn done(&self) -> bool {
        self.instances.iter().all(|i| i.version == Some(self.to))
    }
}

/// What [`upgrade`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The plan it checked first.
    pub plan: Plan,
    /// Instances raised by this run (0 when the plan was blocked or already done).
    pub raised: usize,
    /// Instances found at another version than 2 or 3 at the moment of the raise (changed by
    /// someone else meanwhile), as `role index: version`.
    pub skipped: Vec<String>,
    /// Blockers that appeared while the versions were raised: a process that started
    /// meanwhile may run code that cannot read packed records.
    pub late: Vec<Blocker>,
}

/// Reads every instance's identity version and checks the live nodes and owner marks (one
/// connection per instance, read-only).
pub async fn plan(map: &ShardMap) -> Result<Plan> {
    let mut instances = Vec::new();
    let mut blockers = Vec::new();
    for (role, urls) in [
        (Role::Core, map.core_urls()),
        (Role::Mailbox, map.mailbox_urls()),
    ] {
        for (index, url) in urls.iter().enumerate() {
            let mut conn = deployment::connect(url).await?;
            let id = deployment::read_at(&mut conn, &deployment::key(url, role)).await?;
            let version = id.map(|i| i.version);
            match version {
                None => blockers.push(Blocker::NoIdentity {
                    role: role.as_str(),
                    index,
                }),
                Some(1) => blockers.push(Blocker::VersionOne {
                    role: role.as_str(),
                    index,
                }),
                Some(_) => {}
            }
            instances.push(InstanceVersion {
                role: role.as_str(),
                index,
                url: redact_url(url),
                version,
            });
        }
    }
    let mut plan = Plan {
        instances,
        to: VERSION_CURRENT,
        blockers,
    };
    // processes matter only while something is left to raise
    if !plan.done() {
        plan.blockers.extend(processes(map).await?);
    }
    Ok(plan)
}

/// Live nodes that do not read [`VERSION_CURRENT`], and shards owned by a materializer that
/// is not such a node.
async fn processes(map: &ShardMap) -> Result<Vec<Blocker>> {
    let mut out = Vec::new();
    let mut cores = Vec::new();
    for url in map.core_urls() {
        cores.push(LogStore::connect(url).await?);
    }
    let nodes = cores[0].live_nodes().await?;
    let reading: Vec<&str> = nodes
        .iter()
        .filter(|n| n.reads.is_some_and(|v| v >= VERSION_CURRENT))
        .map(|n| n.id.as_str())
        .collect();
    for n in &nodes {
        if !reading.contains(&n.id.as_str()) {
            out.push(Blocker::NodeReadsOlder {
                id: n.id.clone(),
                reads: n.reads,
            });
        }
    }
    // the lease holder of each shard, from its core instance
    let mut holders: Vec<Option<String>> = vec![None; map.shards() as usize];
    for (i, core) in cores.iter_mut().enumerate() {
        let shards = map.shards_on_core(i);
        for (s, (_, holder)) in shards.iter().zip(core.heads_and_holders(&shards).await?) {
            holders[*s as usize] = holder;
        }
    }
    for (i, url) in map.mailbox_urls().iter().enumerate() {
        let mb = MailboxStore::connect(url, map.layout()).await?;
        for s in map.shards_on_mailbox(i) {
            let Some(epoch) = mb.live_owner(s).await? else {
                continue;
            };
            let holder = holders[s as usize].clone();
            if holder.as_deref().is_some_and(|h| reading.contains(&h)) {
                continue;
            }
            out.push(Blocker::UnknownOwner {
                shard: s,
                epoch,
                lease_holder: holder,
            });
        }
    }
    Ok(out)
}

/// Checks ([`plan`]) and, when nothing blocks and something is left to raise, raises every
/// instance from [`deployment::VERSION_UPGRADABLE`] to [`VERSION_CURRENT`] (core pool first), then checks
/// the processes again. `check_only`: the plan alone, nothing written.
pub async fn upgrade(map: &ShardMap, check_only: bool) -> Result<Report> {
    let plan = plan(map).await?;
    let mut report = Report {
        plan,
        raised: 0,
        skipped: Vec::new(),
        late: Vec::new(),
    };
    if check_only || !report.plan.blockers.is_empty() || report.plan.done() {
        return Ok(report);
    }
    raise_all(map, &mut report).await?;
    report.late = processes(map).await?;
    Ok(report)
}

async fn raise_all(map: &ShardMap, report: &mut Report) -> Result<()> {
    for (role, index, found) in
        deployment::raise_every_instance(map.core_urls(), map.mailbox_urls()).await?
    {
        match found {
            Raise::Raised => report.raised += 1,
            Raise::Found(v) if v == VERSION_CURRENT.to_string() => {}
            Raise::Found(v) => report.skipped.push(format!(
                "{} instance {index}: version {}",
                role.as_str(),
                if v.is_empty() { "none" } else { &v }
            )),
        }
    }
    Ok(())
}

/// The plan or report in words, one line each.
pub fn to_human(r: &Report, check_only: bool) -> String {
    let mut s = String::new();
    for i in &r.plan.instances {
        s.push_str(&format!(
            "{} {} {}: version {}\n",
            i.role,
            i.index,
            i.url,
            i.version.map_or("none".to_string(), |v| v.to_string())
        ));
    }
    // one line for the shards of unknown owners (a static owner holds every shard)
    let mut unknown = Vec::new();
    for b in &r.plan.blockers {
        match b {
            Blocker::UnknownOwner { shard, .. } => unknown.push(*shard),
            b => s.push_str(&format!("blocked: {b}\n")),
        }
    }
    if !unknown.is_empty() {
        unknown.sort_unstable();
        s.push_str(&format!(
            "blocked: shard(s) {} are owned by running materializers that do not say which \
             versions they read (static ownership, or a build before this command): stop them \
             (a clean stop clears their owner marks at once, a killed one's expire within {} s)\n",
            deployment::format_ranges(&unknown),
            tidemark_store::redis::store::OWNER_MARK_TTL_MS / 1000
        ));
    }
    if !r.plan.blockers.is_empty() {
        s.push_str("nothing was written\n");
    } else if r.plan.done() {
        s.push_str(&format!(
            "every instance is at version {}: nothing to do\n",
            r.plan.to
        ));
    } else if check_only {
        s.push_str(&format!(
            "nothing blocks a raise to version {} (--check: nothing was written)\n",
            r.plan.to
        ));
    } else {
        s.push_str(&format!(
            "raised {} instances to version {}; processes started from now on write packed \
             log records, running ones keep six-field records until they restart\n",
            r.raised, r.plan.to
        ));
    }
    for k in &r.skipped {
        s.push_str(&format!("not raised (changed meanwhile): {k}\n"));
    }
    for b in &r.late {
        s.push_str(&format!(
            "warning: appeared during the raise: {b}; stop it before restarting any process\n"
        ));
    }
    s
}
