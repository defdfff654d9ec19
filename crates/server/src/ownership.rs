//! Which node owns which shard when several `serve` processes (nodes) run against one
//! deployment (issue 13, ADR-0030).
//!
//! Every node registers in core Redis (instance 0) with a heartbeat. In **leases** mode each
//! node computes the same balanced assignment from the live nodes
//! ([`tidemark_store::assign::balanced`]) and takes the shards assigned to it by winning their
//! leases (`lease:{s}` on the shard's core instance, compare-and-set with a Redis-side expiry);
//! a node that holds a shard assigned elsewhere hands it over (stops writing, then releases).
//! Winning a lease is not what makes writes safe: the worker that then starts claims the shard,
//! which raises `wm_epoch` past every epoch seen, and every write is fenced by that epoch.
//!
//! ```text
//!  every tick (lease TTL / 3):
//!   heartbeat ──▶ live nodes ──▶ target = balanced(S, live leases nodes) − static owners' shards
//!   renew held leases      (lost or past the deadline ──▶ stop writing at once: gate closed)
//!   held but not target    ──▶ restart that core's worker without it, then release
//!   target but not held    ──▶ acquire; won ──▶ gate opened, worker restarted with it (claims)
//!   held, but fenced       ──▶ worker restarted (claims it again: the lease is ours)
//! ```
//!
//! The assignment is over the live nodes that write the newest watermark layout among them
//! (ADR-0033): during a rolling upgrade (packed-v1 → packed-v2) a node of the old layout hands
//! all its shards over as soon as an upgraded node is live, so converted data is never
//! assigned to code that cannot own it.
//!
//! Only leases nodes share the assignment (ADR-0131): every heartbeat says how its node owns
//! shards, and a static owner which ones. A static owner's shards are left to it while it is
//! live and taken once it stops; a node whose heartbeat does not say (a build before) is not
//! counted, and keeps the leases it holds. So no shard is left without an owner in a mixed
//! deployment (a migration from static owners to leases, a rolling upgrade).
//!
//! The loop ticks on a fixed interval, and each tick's lease calls go as one pipeline per core
//! instance, all instances at once (ADR-0132): the time between two renewals of a lease is a
//! tick, whatever the number of shards, where one call per shard made it a tick plus a round
//! trip per shard (longer than the TTL at a few hundred shards over a slow core instance).
//!
//! A worker runs each shard under one winning of its lease: a lease lost and won back, even
//! within one tick, restarts the worker, which claims the shard again (another node may have
//! claimed it in between). `/healthz` names a leased shard that no worker materialises.
//!
//! A node knows its own deadline for each lease: the time it *sent* the last successful
//! renewal plus the TTL, minus a margin of a third of the TTL. The [`LeaseGate`] closes at that
//! deadline and the worker writes nothing for a shard whose gate is closed, so a node that
//! cannot renew (Redis unreachable, a GC pause, SIGSTOP) stops before its lease can expire and
//! another node take the shard — and if it resumes later anyway, its scripts meet a higher
//! epoch and it stops that shard (fenced).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::{Beat, Lease, LeaseOp, Ownership};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::topology::ShardMap;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::HealthBoard;
use crate::materializer::MaterializerOptions;

/// How long a stopping node tries to release its leases and remove its record.
const RELEASE_WITHIN: Duration = Duration::from_secs(2);

/// A shard refused by [`crate::run::check_ownable`] is tried again after this long.
const REFUSED_RECHECK: Duration = Duration::from_secs(30);

/// True when a failed [`crate::run::check_ownable`] says this code may not own the shard (a
/// watermark it cannot read: old code on newer data), which is not retried for
/// [`REFUSED_RECHECK`]; false for a failure that may pass by itself (Redis trouble), retried
/// at the next tick.
fn may_not_own(e: &crate::run::Error) -> bool {
    matches!(e, crate::run::Error::Store(s) if s.is_corrupt())
}

/// Default lease TTL (`serve --lease-ttl`).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(3);

/// What a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Gateway and materializers.
    #[default]
    All,
    /// Only the client protocol: owns no shard.
    Gateway,
    /// Only materializers (the listener serves `/healthz` and `/metrics`).
    Materializer,
}

impl Role {
    /// The name used in the registry and `tidemark status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Gateway => "gateway",
            Role::Materializer => "materializer",
        }
    }

    /// True when the node runs materializers.
    pub fn materializes(self) -> bool {
        self != Role::Gateway
    }
}

/// A node's identity and how it obtains shards.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Node id (`--node-id`; default: a random id printed at start).
    pub id: String,
    /// Public client URL (`--advertise`; default from `--listen`).
    pub advertise: String,
    /// What the node runs.
    pub role: Role,
    /// Lease TTL; renewals every third of it.
    pub lease_ttl: Duration,
    /// Leases mode (the balanced assignment over live nodes); false: static ownership (the
    /// node only registers).
    pub leases: bool,
}

/// Per-shard write permission of a node in leases mode: open until the node's own deadline
/// for the lease (see the module documentation). The materializer asks it before every step.
#[derive(Debug, Default)]
pub struct LeaseGate {
    deadlines: Mutex<HashMap<u32, Instant>>,
}

impl LeaseGate {
    /// True while this node may write `shard`.
    pub fn may_write(&self, shard: u32) -> bool {
        self.deadlines
            .lock()
            .expect("gate lock")
            .get(&shard)
            .is_some_and(|&d| Instant::now() < d)
    }

    fn open_until(&self, shard: u32, deadline: Instant) {
        self.deadlines
            .lock()
            .expect("gate lock")
            .insert(shard, deadline);
    }

    fn close(&self, shard: u32) {
        self.deadlines.lock().expect("gate lock").remove(&shard);
    }

    fn deadline(&self, shard: u32) -> Option<Instant> {
        self.deadlines
            .lock()
            .expect("gate lock")
            .get(&shard)
            .copied()
    }
}

/// A random node id: `node-` and 8 hex digits.
pub fn random_node_id() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(format!("node-{:08x}", u32::from_be_bytes(b)))
}

/// Takes the outcome of a background connect to core instance `i` (ADR-0102) into `slot`.
fn take_connection(
    i: usize,
    slot: &mut Option<LogStore>,
    done: Result<Result<LogStore, tidemark_store::Error>, tokio::task::JoinError>,
) {
    match done {
        Ok(Ok(s)) => *slot = Some(s),
        Ok(Err(e)) => tracing::warn!(core = i, error = %e, "lease loop: core unreachable"),
        Err(e) => tracing::warn!(core = i, error = %e, "lease loop: connect task failed"),
    }
}

/// Everything the lease loop needs to start and stop workers.
pub(crate) struct LeaseLoop {
    pub node: NodeOptions,
    pub map: ShardMap,
    pub mailboxes: Vec<MailboxStore>,
    pub materializer: MaterializerOptions,
    pub health: Arc<HealthBoard>,
    pub gate: Arc<LeaseGate>,
    pub tracker: TaskTracker,
}

/// One core instance's running worker: its shards, each with the lease it was started under
/// (see [`Won`]), and how to stop it.
struct RunningWorker {
    shards: Vec<(u32, Won)>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

/// A worker asked to stop that had not ended within a call's wait (ADR-0121): its call to a
/// mailbox instance that does not answer is under way. The lease loop goes on without it;
/// it ends by itself within [`crate::run::WorkerSpec::STOP_GRACE`]. Until then no new worker is
/// started for its core instance (the two would report the same shards to the health board),
/// and the shards it ran that this node gives away are not released.
struct Draining {
    core: usize,
    done: tokio::task::JoinHandle<()>,
}

/// True while a worker of core instance `core` is still stopping.
fn draining_on(draining: &[Draining], core: usize) -> bool {
    draining.iter().any(|d| d.core == core)
}

/// Which winning of a shard's lease a worker runs the shard under: a number that grows with
/// every lease this node wins. A lease lost and won back — even within one tick — is a new
/// `Won`, so the worker that ran the shard before is restarted and claims it again: while the
/// lease was not ours another node may have claimed the shard (raising the epoch), and the
/// old worker would run on with its old epoch, fenced (nodes.rs once stalled on exactly
/// that: a node resumed from SIGSTOP found its leases released by the node that had taken
/// them, won them back in the same tick, and kept its worker).
type Won = u64;

impl LeaseLoop {
    /// Runs until `cancel`: heartbeats, converges on the balanced assignment, renews. On
    /// `cancel`: stops every worker (in-flight writes finish, or are dropped after the
    /// worker's grace: ADR-0121), releases every lease and deregisters, so the other nodes
    /// take the shards at once. No tick waits for a worker to stop longer than one call.
    pub(crate) async fn run(self, cancel: CancellationToken) {
        let ttl = self.node.lease_ttl;
        let ttl_ms = ttl.as_millis() as u64;
        let tick = ttl / 3;
        // ADR-0102: no call of a tick waits longer than this. A core instance that hangs (its
        // host gone without a reset, a stopped process) held the whole loop for the client's
        // response timeout (30 s, with retries): the leases on the instances that answered
        // lapsed meanwhile, and their shards stopped too.
        let call = tick / 2;
        // instances that let a call of this tick time out: not called again until the next
        // tick (their connection is kept: a hung server's answers come in order once it
        // resumes, and a dead one's connection fails by itself)
        let mut stalled = vec![false; self.map.core_urls().len()];
        let mut cores: Vec<Option<LogStore>> = vec![None; self.map.core_urls().len()];
        // connections being made in the background (a hung instance's connect never holds the
        // loop): taken once done
        let mut connecting: Vec<
            Option<tokio::task::JoinHandle<Result<LogStore, tidemark_store::Error>>>,
        > = (0..self.map.core_urls().len()).map(|_| None).collect();
        // the leases this node holds, each with the winning its worker runs it under
        let mut held: BTreeMap<u32, Won> = BTreeMap::new();
        let mut wins: Won = 0;
        let mut workers: BTreeMap<usize, RunningWorker> = BTreeMap::new();
        // workers stopped that had not ended within a call's wait (ADR-0121)
        let mut draining: Vec<Draining> = Vec::new();
        // shards no longer held whose worker may still be stopping: forgotten by the health
        // board, and released when `true` (given away; `false`: the lease was lost), once no
        // worker of their core instance is draining (ADR-0121)
        let mut handing: BTreeMap<u32, bool> = BTreeMap::new();
        // ADR-0132: ticks on a fixed interval. Before, the loop slept a tick *after* its
        // work, so the time between two renewals of a shard was a tick plus the whole tick's
        // work; a tick that overruns (a slow core instance) is followed at once by the next,
        // and the interval counts on from there.
        let mut ticks = tokio::time::interval(tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // shards this code may not own (old code on newer data): not retried for a while
        let mut refused: HashMap<u32, Instant> = HashMap::new();
        // a node of a newer layout is live: this one owns nothing (logged when it changes)
        let mut yielding = false;
        // shards whose worker was last restarted because it was fenced (see 6b)
        let mut reclaimed: HashMap<u32, Instant> = HashMap::new();
        // shards lost because their lease could not be renewed, since when (ADR-0102):
        // reported by /healthz until held again or assigned to another node
        let mut unrenewed: BTreeMap<u32, Instant> = BTreeMap::new();
        // since when each core instance has not answered this node (ADR-0113): one that has
        // not for a lease TTL is named in the heartbeat, and its shards go to nodes that
        // reach it (before, they stayed assigned here, unowned, while others could run them)
        let mut failing_since: Vec<Option<Instant>> = vec![None; self.map.core_urls().len()];
        let mut unreached: Vec<usize> = Vec::new();
        // ADR-0114: this process, as its heartbeat tells it from another process of the same
        // node id (a replacement started while this one was paused, or a copy started by
        // mistake): leases are keyed by node id, so two such processes would both renew them
        // and their workers fence each other for ever
        let incarnation = random_node_id().map_or_else(
            |_| format!("{:?}", Instant::now()),
            |id| id.replace("node-", "inc-"),
        );
        // the heartbeat was refused: another live process has this id; hold nothing
        let mut replaced = false;
        // the live nodes beside this one that are not leases nodes, as last logged (ADR-0131):
        // static owners, and nodes that do not say (a build before)
        let mut beside: (Vec<String>, Vec<String>) = Default::default();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = ticks.tick() => {}
            }
            stalled.iter_mut().for_each(|x| *x = false);
            // 1. connections (re-made after a failure), each in its own task: waited for up to
            //    `call` when started, then taken at a later tick once done (ADR-0102)
            for (i, c) in cores.iter_mut().enumerate() {
                if c.is_some() {
                    continue;
                }
                let (mut h, fresh) = match connecting[i].take() {
                    Some(h) => (h, false),
                    None => {
                        let url = self.map.core_urls()[i].clone();
                        (
                            tokio::spawn(async move { LogStore::connect(&url).await }),
                            true,
                        )
                    }
                };
                let done = if fresh {
                    // a healthy instance answers well within `call`
                    tokio::time::timeout(call, &mut h).await.ok()
                } else if h.is_finished() {
                    Some((&mut h).await)
                } else {
                    None
                };
                match done {
                    Some(done) => take_connection(i, c, done),
                    None => {
                        if fresh {
                            tracing::warn!(
                                core = i,
                                "lease loop: core not answering; still connecting"
                            );
                        }
                        connecting[i] = Some(h);
                    }
                }
            }
            // 1b. which instances answer (ADR-0113): one PING each (instance 0 answers the
            //     heartbeat), all at once, so that the probe costs at most one call's wait
            //     however many instances hang; a node that does not reach one for a lease TTL
            //     says so below
            let pings = (1..cores.len()).filter_map(|i| {
                let mut c = cores[i].clone()?;
                Some(async move { (i, tokio::time::timeout(call, c.ping()).await) })
            });
            let mut answered = vec![false; cores.len()];
            for (i, r) in futures::future::join_all(pings).await {
                match r {
                    Ok(Ok(())) => answered[i] = true,
                    Ok(Err(e)) => {
                        if matches!(e, tidemark_store::Error::Redis(_)) {
                            cores[i] = None;
                        }
                    }
                    Err(_) => stalled[i] = true,
                }
            }
            for i in 1..cores.len() {
                if answered[i] {
                    failing_since[i] = None;
                } else {
                    failing_since[i].get_or_insert_with(Instant::now);
                }
            }
            let now_unreached: Vec<usize> = (1..cores.len())
                .filter(|&i| failing_since[i].is_some_and(|t| t.elapsed() >= ttl))
                .collect();
            if now_unreached != unreached {
                if now_unreached.is_empty() {
                    tracing::info!("every core instance answers again: its shards may come back");
                } else {
                    tracing::warn!(
                        cores = ?now_unreached,
                        "core instances not answering for a lease TTL: their shards go to the \
                         nodes that reach them"
                    );
                }
                unreached = now_unreached;
            }
            // 2. heartbeat and the live set (instance 0)
            let live = match cores[0].as_mut() {
                Some(c0) => {
                    let beat = tokio::time::timeout(
                        call,
                        c0.beat(&Beat {
                            id: &self.node.id,
                            ttl_ms,
                            url: &self.node.advertise,
                            role: self.node.role.as_str(),
                            layout: self.map.layout(),
                            unreached: &unreached,
                            incarnation: &incarnation,
                            // ADR-0131: the other leases nodes count this one in
                            ownership: Some(&Ownership::Leases),
                        }),
                    )
                    .await;
                    let in_use = matches!(beat, Ok(Err(tidemark_store::Error::NodeIdInUse { .. })));
                    if in_use != replaced {
                        replaced = in_use;
                        self.health.set_id_in_use(in_use);
                        if in_use {
                            tracing::error!(
                                node = %self.node.id,
                                "another live process has this node id: this one holds no \
                                 lease until it stops (give each process its own --node-id)"
                            );
                        } else {
                            tracing::info!(node = %self.node.id, "node id registered again");
                        }
                    }
                    let live = match beat {
                        Ok(Ok(_)) => tokio::time::timeout(call, c0.live_nodes()).await,
                        Ok(Err(e)) => Ok(Err(e)),
                        Err(elapsed) => Err(elapsed),
                    };
                    match live {
                        Ok(Ok(live)) => Some(live),
                        Ok(Err(_)) if in_use => None,
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "heartbeat failed");
                            cores[0] = None;
                            None
                        }
                        Err(_) => {
                            tracing::warn!("heartbeat timed out");
                            stalled[0] = true;
                            None
                        }
                    }
                }
                None => None,
            };
            // 3. renew what is held: one pipeline per core instance, all at once (ADR-0132;
            //    one renewal after another took longer than the TTL at a few hundred shards
            //    over a slow core). A lease lost or past its deadline closes its gate now. The
            //    deadline counts from before the pipelines are sent (ADR-0030, ADR-0102).
            let sent = Instant::now();
            let mut renewed = self
                .lease_calls(LeaseOp::Renew, held.keys(), &mut cores, &mut stalled, call)
                .await;
            let mut lost = Vec::new();
            for &s in held.keys() {
                let ci = self.map.core_of(s);
                let renewed = renewed.remove(&s).unwrap_or_else(|| {
                    Err(tidemark_store::Error::InvalidArgument(
                        if cores[ci].is_none() {
                            "no connection"
                        } else {
                            "core instance not answering this tick"
                        }
                        .into(),
                    ))
                });
                match renewed {
                    Ok(Lease::Held { .. }) => self.gate.open_until(s, sent + ttl - ttl / 3),
                    Ok(other) => {
                        tracing::warn!(shard = s, ?other, "lease lost; shard stopped");
                        metrics::counter!("tidemark_lease_losses_total").increment(1);
                        self.gate.close(s);
                        lost.push(s);
                    }
                    Err(e) => {
                        if self.gate.deadline(s).is_none_or(|d| Instant::now() >= d) {
                            tracing::warn!(shard = s, error = %e, "lease not renewed in time; shard stopped");
                            metrics::counter!("tidemark_lease_losses_total").increment(1);
                            self.gate.close(s);
                            lost.push(s);
                            unrenewed.entry(s).or_insert_with(Instant::now);
                        }
                    }
                }
            }
            for &s in &lost {
                held.remove(&s);
            }
            metrics::counter!("tidemark_lease_renewals_total").increment(held.len() as u64);
            // 4. the target: balanced over the live materializing nodes (this one included)
            //    that write the newest layout among them (ADR-0033: during a rolling upgrade
            //    the shards go to the upgraded nodes; old code is never handed converted data)
            let target: BTreeSet<u32> = match &live {
                // another process has this id: its leases are keyed by it too; hold none
                _ if replaced => BTreeSet::new(),
                Some(nodes) => {
                    // ADR-0131: the assignment is over the leases nodes only. A static owner
                    // never takes a lease: a share given to it stayed unowned. Its shards are
                    // left to it while it is live (below); a node that does not say how it
                    // owns (a build before) is not counted either, and keeps what it holds.
                    let materializing = || {
                        nodes
                            .iter()
                            .filter(|n| n.role != Role::Gateway.as_str() && n.id != self.node.id)
                    };
                    let others =
                        || materializing().filter(|n| n.ownership == Some(Ownership::Leases));
                    let now_beside = (
                        materializing()
                            .filter(|n| matches!(n.ownership, Some(Ownership::Static { .. })))
                            .map(|n| n.id.clone())
                            .collect::<Vec<_>>(),
                        materializing()
                            .filter(|n| n.ownership.is_none())
                            .map(|n| n.id.clone())
                            .collect::<Vec<_>>(),
                    );
                    if now_beside != beside {
                        log_beside(&now_beside);
                        beside = now_beside;
                    }
                    let statically = |s: u32| {
                        nodes.iter().any(|n| {
                            n.id != self.node.id
                                && n.ownership.as_ref().is_some_and(|o| o.owns_statically(s))
                        })
                    };
                    let mut all: Vec<(String, Option<String>)> =
                        others().map(|n| (n.id.clone(), n.layout.clone())).collect();
                    let mine = self.map.layout().as_str().to_string();
                    all.push((self.node.id.clone(), Some(mine)));
                    let ids = tidemark_store::assign::eligible(&all);
                    let yields = !ids.contains(&self.node.id.as_str());
                    if yields != yielding {
                        yielding = yields;
                        if yields {
                            tracing::warn!(
                                layout = self.map.layout().as_str(),
                                "a node writing a newer watermark layout is live: this node \
                                 hands its shards over to the upgraded nodes (rolling upgrade, \
                                 ADR-0033)"
                            );
                        }
                    }
                    if yields {
                        BTreeSet::new()
                    } else {
                        let ids: Vec<String> = ids.into_iter().map(str::to_string).collect();
                        let mut owner = tidemark_store::assign::balanced(self.map.shards(), &ids);
                        let cut: Vec<Vec<usize>> = ids
                            .iter()
                            .map(|id| {
                                if *id == self.node.id {
                                    unreached.clone()
                                } else {
                                    others()
                                        .find(|n| n.id == *id)
                                        .map_or_else(Vec::new, |n| n.unreached.clone())
                                }
                            })
                            .collect();
                        tidemark_store::assign::around_unreached(&mut owner, &ids, &cut, |s| {
                            self.map.core_of(s)
                        });
                        self.map
                            .all_shards()
                            .filter(|&s| ids[owner[s as usize]] == self.node.id && !statically(s))
                            .collect()
                    }
                }
                // registry unreachable: keep what is held, take nothing new
                None => held.keys().copied().collect(),
            };
            // 5. hand over what is held but assigned elsewhere: stop writing first
            let give: Vec<u32> = held
                .keys()
                .filter(|s| !target.contains(s))
                .copied()
                .collect();
            for &s in &give {
                self.gate.close(s);
                held.remove(&s);
            }
            // 6. take what is assigned here and free: the acquisitions in one pipeline per
            //    core instance, all at once, then the ownership check of every shard won, all
            //    at once (ADR-0132)
            let free: Vec<u32> = target
                .iter()
                .filter(|s| !held.contains_key(s))
                .filter(|s| {
                    refused
                        .get(s)
                        .is_none_or(|t| t.elapsed() >= REFUSED_RECHECK)
                })
                .copied()
                .collect();
            let sent = Instant::now();
            let acquired = self
                .lease_calls(
                    LeaseOp::Acquire,
                    free.iter(),
                    &mut cores,
                    &mut stalled,
                    call,
                )
                .await;
            let won: Vec<(u32, LogStore)> = acquired
                .into_iter()
                .filter_map(|(s, r)| match r {
                    Ok(Lease::Held { .. }) => Some(s),
                    Ok(_) => None, // still held by its previous owner: next tick
                    Err(e) => {
                        tracing::debug!(shard = s, error = %e, "lease not acquired");
                        None
                    }
                })
                .filter_map(|s| Some((s, cores[self.map.core_of(s)].clone()?)))
                .collect();
            let layout = self.map.layout();
            let checks = won.into_iter().map(|(s, mut c)| {
                let mut mb = self.mailboxes[self.map.mailbox_of(s)].clone();
                async move {
                    let checked = tokio::time::timeout(
                        call,
                        crate::run::check_ownable(layout, &mut mb, &mut c, s),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        Err(crate::run::Error::Store(
                            tidemark_store::Error::InvalidArgument(
                                "the ownership check timed out".into(),
                            ),
                        ))
                    });
                    (s, checked)
                }
            });
            let mut unchecked = Vec::new();
            for (s, checked) in futures::future::join_all(checks).await {
                if let Err(e) = checked {
                    // leave it, write nothing
                    unchecked.push(s);
                    if may_not_own(&e) {
                        // old code on newer data: not retried for a while
                        tracing::error!(shard = s, error = %e, "shard not taken: this code may not own it");
                        refused.insert(s, Instant::now());
                    } else {
                        // Redis trouble (a failover, a script cache to fill): the next tick
                        // tries again (ADR-0059; refused for 30 s, a NOSCRIPT after a failover
                        // left the shard unowned that long)
                        tracing::warn!(shard = s, error = %e, "shard not taken yet: its check failed; trying again");
                    }
                    continue;
                }
                refused.remove(&s);
                self.gate.open_until(s, sent + ttl - ttl / 3);
                wins += 1;
                held.insert(s, wins);
            }
            // not released in time: it expires after the TTL
            let _ = self
                .lease_calls(
                    LeaseOp::Release,
                    unchecked.iter(),
                    &mut cores,
                    &mut stalled,
                    call,
                )
                .await;
            let lost_for_good: Vec<u32> =
                lost.into_iter().filter(|s| !held.contains_key(s)).collect();
            // 6b. a shard held here whose worker was fenced: someone claimed it although the
            //     lease is ours (a former owner's claim that arrived late, after a pause). Its
            //     worker is restarted, which claims it again — else it would stay stopped, and
            //     the lease renewed, for ever. The claimer no longer holds the lease and does
            //     not claim again; at most once per TTL per shard all the same.
            //     Only a shard its running worker runs under the same winning: one just won
            //     again gets a new worker anyway.
            let running: Vec<u32> = held
                .iter()
                .filter(|&(&s, &won)| {
                    workers
                        .get(&self.map.core_of(s))
                        .is_some_and(|w| w.shards.contains(&(s, won)))
                })
                .map(|(&s, _)| s)
                .collect();
            for s in self.health.fenced_among(running) {
                if !self.gate.may_write(s) || reclaimed.get(&s).is_some_and(|t| t.elapsed() < ttl) {
                    continue;
                }
                tracing::warn!(
                    shard = s,
                    "shard fenced although its lease is ours; claiming it again"
                );
                metrics::counter!("tidemark_lease_reclaims_total").increment(1);
                reclaimed.insert(s, Instant::now());
                wins += 1;
                held.insert(s, wins);
            }
            reclaimed.retain(|s, _| held.contains_key(s));
            // held again, or assigned to another node by a live set read this tick
            unrenewed
                .retain(|s, _| !held.contains_key(s) && (live.is_none() || target.contains(s)));
            self.health.set_unrenewed(&unrenewed);
            tracing::debug!(?held, ?target, ?give, live = live.is_some(), "lease tick");
            // 7. workers follow `held` (each core's worker restarted when its set changed, or
            //    when one of its shards was lost and won again); one that does not stop within
            //    a call's wait is left draining, never waited for here (ADR-0121)
            self.apply(&held, &mut workers, &mut draining, &cancel)
                .await;
            // 8. what is no longer held, once its worker is done: forgotten by /healthz (its
            //    worker no longer runs it), and released if given away
            handing.extend(lost_for_good.into_iter().map(|s| (s, false)));
            handing.extend(give.into_iter().map(|s| (s, true)));
            handing.retain(|s, _| !held.contains_key(s));
            let done: Vec<(u32, bool)> = handing
                .iter()
                .filter(|(&s, _)| !draining_on(&draining, self.map.core_of(s)))
                .map(|(&s, &r)| (s, r))
                .collect();
            let mut releases = Vec::new();
            for (s, release) in done {
                handing.remove(&s);
                if release {
                    releases.push(s);
                    tracing::info!(shard = s, "shard handed over");
                }
                self.health.forget(s);
            }
            // a lease of this id may be the other process's by now: not released (ADR-0114);
            // one not released in time expires after the TTL. One pipeline per core instance
            // (ADR-0132): a rebalance hands over many shards at once.
            if !replaced {
                let _ = self
                    .lease_calls(LeaseOp::Release, &releases, &mut cores, &mut stalled, call)
                    .await;
            }
            // /healthz reports a shard leased here that no worker runs
            self.health.set_leased(held.keys().copied());
            metrics::gauge!("tidemark_node_shards_owned").set(held.len() as f64);
        }
        // connects still under way are not waited for
        for h in connecting.into_iter().flatten() {
            h.abort();
        }
        self.health.set_leased([]);
        self.health.set_unrenewed(&BTreeMap::new());
        // stop: workers first (in-flight writes finish), then leases and the registry record
        for s in held.keys() {
            self.gate.close(*s);
        }
        self.apply(&BTreeMap::new(), &mut workers, &mut draining, &cancel)
            .await;
        // each ends within its grace (ADR-0121): a worker whose call hangs is dropped then
        for d in draining {
            let _ = d.done.await;
        }
        // shards given away whose worker was still stopping: released with the others
        let given: Vec<u32> = handing
            .into_iter()
            .filter_map(|(s, release)| release.then_some(s))
            .collect();
        // bounded: core Redis may be gone already (Ctrl-C on `up` reaches its redis-servers
        // too), and each call to a dead server retries; leases not released expire by TTL
        let id = &self.node.id;
        let release = async {
            // one pipeline per core instance (ADR-0132)
            let shards: Vec<u32> = held.keys().chain(&given).copied().collect();
            let mut stalled = vec![false; cores.len()];
            let _ = self
                .lease_calls(
                    LeaseOp::Release,
                    &shards,
                    &mut cores,
                    &mut stalled,
                    RELEASE_WITHIN,
                )
                .await;
            // the record of this id is the other process's (ADR-0114)
            if let Some(c0) = cores[0].as_mut().filter(|_| !replaced) {
                let _ = c0.deregister(id).await;
            }
        };
        if tokio::time::timeout(RELEASE_WITHIN, release).await.is_err() {
            tracing::warn!(node = %id, "leases not released in time; they expire after the TTL");
            return;
        }
        tracing::info!(node = %id, released = held.len(), "node stopped; leases released");
    }

    /// `op` of the leases of `shards`: one pipeline per core instance
    /// ([`LogStore::lease_many`]), all sent at once, each waited for at most `call`
    /// (ADR-0102). Each shard's result, its failure its own. ADR-0132: one call per shard, one
    /// after another, made the renewals of a few hundred shards over a slow core instance
    /// (or one with `appendfsync always`) longer than the TTL, and the leases lapsed.
    ///
    /// A shard of an instance without a connection, or not answering this tick (`stalled`),
    /// has no result: it is not called. A pipeline not answered within `call` stalls its
    /// instance for the rest of the tick (its connection is kept: ADR-0102), and each of its
    /// shards is answered that. One whose connection failed drops the connection (made again
    /// at the next tick), and each of its shards is answered that error.
    async fn lease_calls<'a>(
        &self,
        op: LeaseOp,
        shards: impl IntoIterator<Item = &'a u32>,
        cores: &mut [Option<LogStore>],
        stalled: &mut [bool],
        call: Duration,
    ) -> BTreeMap<u32, Result<Lease, tidemark_store::Error>> {
        let mut by_core: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for &s in shards {
            let ci = self.map.core_of(s);
            if cores[ci].is_some() && !stalled[ci] {
                by_core.entry(ci).or_default().push(s);
            }
        }
        let (node, ttl_ms) = (&self.node.id, self.node.lease_ttl.as_millis() as u64);
        // on a Redis Cluster each shard's pipeline is cut off before the whole call is: a node
        // that hangs costs its own shards, not the instance's others
        let within = Some(call * 3 / 4);
        let calls = by_core.iter().filter_map(|(&ci, shards)| {
            let mut c = cores[ci].clone()?;
            Some(async move {
                let many = c.lease_many(op, shards, node, ttl_ms, within);
                (ci, shards, tokio::time::timeout(call, many).await)
            })
        });
        let mut out = BTreeMap::new();
        for (ci, shards, r) in futures::future::join_all(calls).await {
            match r {
                Ok(Ok(each)) => out.extend(shards.iter().copied().zip(each)),
                Ok(Err(e)) => {
                    tracing::warn!(core = ci, ?op, error = %e, "lease calls failed");
                    if matches!(e, tidemark_store::Error::Redis(_)) {
                        cores[ci] = None;
                    }
                    out.extend(shards.iter().map(|&s| (s, Err(e.clone()))));
                }
                Err(_) => {
                    tracing::warn!(core = ci, ?op, "lease calls timed out");
                    stalled[ci] = true;
                    let e = tidemark_store::Error::InvalidArgument(format!(
                        "core instance {ci} did not answer within {call:?}"
                    ));
                    out.extend(shards.iter().map(|&s| (s, Err(e.clone()))));
                }
            }
        }
        out
    }

    /// Makes each core instance's worker own exactly `held`'s shards of that instance, each
    /// under the winning of its lease given in `held`: a worker whose set changed, or one of
    /// whose shards was won again since it started, is stopped and a new one started (it
    /// claims its shards).
    ///
    /// ADR-0121: the workers stopped are waited for together, at most one call's wait of the
    /// lease loop (a sixth of the TTL). One still running then (its call to a mailbox
    /// instance that does not answer waits for the response timeout) goes to `draining`, and
    /// its core instance gets its new worker at a later tick, once it has ended (within
    /// [`crate::run::WorkerSpec::STOP_GRACE`]). Before, the loop joined it: no lease of the node
    /// was renewed meanwhile, and all of them lapsed.
    async fn apply(
        &self,
        held: &BTreeMap<u32, Won>,
        workers: &mut BTreeMap<usize, RunningWorker>,
        draining: &mut Vec<Draining>,
        cancel: &CancellationToken,
    ) {
        draining.retain(|d| !d.done.is_finished());
        let want_of = |core: usize| -> Vec<(u32, Won)> {
            held.iter()
                .map(|(&s, &won)| (s, won))
                .filter(|&(s, _)| self.map.core_of(s) == core)
                .collect()
        };
        // 1. stop every worker whose set changed, all at once
        let mut stopping: Vec<(usize, tokio::task::JoinHandle<()>)> = Vec::new();
        for core in 0..self.map.core_urls().len() {
            let want = want_of(core);
            if workers.get(&core).is_some_and(|w| w.shards != want) {
                let old = workers.remove(&core).expect("checked");
                old.stop.cancel();
                stopping.push((core, old.done));
            }
        }
        if !stopping.is_empty() {
            let call = self.node.lease_ttl / 6;
            let all = futures::future::join_all(stopping.iter_mut().map(|(_, done)| done));
            let _ = tokio::time::timeout(call, all).await;
            for (core, done) in stopping {
                if !done.is_finished() {
                    tracing::warn!(
                        core,
                        "materializer worker not stopped yet (a mailbox instance not \
                         answering?): its core instance's new worker waits for it"
                    );
                    draining.push(Draining { core, done });
                }
            }
        }
        // 2. start the missing ones
        for core in 0..self.map.core_urls().len() {
            let want = want_of(core);
            if want.is_empty() || workers.contains_key(&core) || cancel.is_cancelled() {
                continue;
            }
            if draining_on(draining, core) {
                tracing::debug!(core, "new worker waits for the old one to end");
                continue;
            }
            // what the old worker reported (fenced, …) is not the new one's: starting until it
            // has claimed (and 6b does not take an old worker's fence for the new one's)
            for &(s, _) in &want {
                self.health
                    .update(s, |h| h.status = crate::health::ShardStatus::Starting);
            }
            let stop = cancel.child_token();
            let done = self.tracker.spawn(crate::run::supervise_worker(
                None,
                crate::run::WorkerSpec {
                    map: self.map.clone(),
                    core,
                    mailboxes: self.mailboxes.clone(),
                    shards: want.iter().map(|&(s, _)| s).collect(),
                    opts: self.materializer.clone(),
                    stop_grace: crate::run::WorkerSpec::STOP_GRACE,
                },
                self.health.clone(),
                stop.clone(),
            ));
            workers.insert(
                core,
                RunningWorker {
                    shards: want,
                    stop,
                    done,
                },
            );
        }
    }
}

/// Logs which live nodes beside a leases node are not leases nodes (ADR-0131), when that
/// changes: `beside` is (static owners, nodes that do not say how they own shards).
fn log_beside(beside: &(Vec<String>, Vec<String>)) {
    let (statics, unsaid) = beside;
    if !statics.is_empty() {
        tracing::warn!(
            nodes = ?statics,
            "static owners are live beside this leases node: the shards they own are left to \
             them, the others shared by the leases nodes; their shards are taken once they \
             stop (a mixed deployment is meant for a migration only)"
        );
    }
    if !unsaid.is_empty() {
        tracing::warn!(
            nodes = ?unsaid,
            "live nodes that do not say whether they own shards by leases or statically (a \
             build before ADR-0131) are not counted as leases nodes: the leases they hold stay \
             theirs, and no shard is left to them"
        );
    }
    if statics.is_empty() && unsaid.is_empty() {
        tracing::info!("every live materializing node is a leases node");
    }
}

/// The registry heartbeat of a node that does not run the lease loop (leases mode beats in
/// [`LeaseLoop`]): a static owner of `owns` (empty for a node that materialises nothing), or
/// a leases-mode gateway. Every third of the lease TTL until `cancel`, then the record is
/// removed. Failures are logged and retried.
///
/// ADR-0131: the heartbeat says how the node owns shards, and which it owns. Before, a static
/// owner's record looked like a leases node's, and the leases nodes gave it a share of the
/// shards that it never took.
pub(crate) async fn heartbeat_loop(
    node: NodeOptions,
    map: ShardMap,
    owns: Vec<u32>,
    cancel: CancellationToken,
) {
    let ttl_ms = node.lease_ttl.as_millis() as u64;
    let ownership = if node.leases {
        Ownership::Leases
    } else {
        Ownership::owning(&owns)
    };
    let mut core0: Option<LogStore> = None;
    loop {
        if core0.is_none() {
            core0 = LogStore::connect(&map.core_urls()[0]).await.ok();
        }
        if let Some(c) = core0.as_mut() {
            let beat = Beat {
                id: &node.id,
                ttl_ms,
                url: &node.advertise,
                role: node.role.as_str(),
                layout: map.layout(),
                unreached: &[],
                incarnation: "",
                ownership: Some(&ownership),
            };
            if let Err(e) = c.beat(&beat).await {
                tracing::debug!(error = %e, "heartbeat failed");
                core0 = None;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(node.lease_ttl / 3) => {}
        }
    }
    if let Some(c) = core0.as_mut() {
        // bounded, like the lease loop's release (core Redis may be gone already)
        let _ = tokio::time::timeout(RELEASE_WITHIN, c.deregister(&node.id)).await;
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::may_not_own;
    use crate::run::Error;
    use tidemark_store::redis::watermark::CorruptCause;

    /// Only a watermark this code cannot read keeps a shard refused for 30 s; a Redis error
    /// at the claim (here the NOSCRIPT of a new primary) is retried at the next tick.
    #[test]
    fn only_a_watermark_this_code_cannot_read_refuses_a_shard() {
        let corrupt = Error::Store(tidemark_store::Error::Corrupt {
            shard: 1,
            cause: CorruptCause::UnknownLayout {
                value: "packed-v9".into(),
            },
        });
        assert!(may_not_own(&corrupt));
        let noscript = Error::Store(tidemark_store::Error::Redis(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript),
            "No matching script",
        ))));
        assert!(!may_not_own(&noscript));
        let io = Error::Store(tidemark_store::Error::Redis(redis::RedisError::from(
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        )));
        assert!(!may_not_own(&io));
    }
}
