//! `tidemark serve`: checks everything that can fail, then claims the owned shards, starts a
//! supervised materializer worker per core instance and the gateway.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::secret::TokenSecret;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology, TopologyError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Error;
use crate::gateway::{self, GatewayOptions};
use crate::health::HealthBoard;
use crate::materializer::{MaterializerOptions, Worker};
use crate::ownership::{LeaseGate, LeaseLoop, NodeOptions};

/// What `serve` runs.
#[derive(Clone)]
pub struct ServeOptions {
    /// Instances and tables.
    pub topology: Topology,
    /// Gateway listen address.
    pub listen: SocketAddr,
    /// Gateway settings.
    pub gateway: GatewayOptions,
    /// Materializer settings.
    pub materializer: MaterializerOptions,
    /// Shards this process owns (None: all). Each shard must have exactly one owner.
    /// Ignored in leases mode.
    pub owned_shards: Option<Vec<u32>>,
    /// This process as a node of the deployment: registered in core Redis (`tidemark
    /// status`), and in leases mode owning the shards the balanced assignment gives it.
    /// `None`: not registered, static ownership.
    pub node: Option<NodeOptions>,
}

/// A running service: its addresses and its health board.
pub struct Running {
    /// The gateway's bound address.
    pub addr: SocketAddr,
    /// The admin listener's bound address (`/metrics`, `/healthz`), when there is one.
    pub admin_addr: Option<SocketAddr>,
    /// The gateway serves TLS (`wss://`, `https://`).
    pub tls: bool,
    /// Shard health, shared with `/healthz`.
    pub health: Arc<HealthBoard>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    errors: tokio::sync::mpsc::UnboundedReceiver<Error>,
}

impl Running {
    /// The WebSocket URL of the gateway (`wss://` with TLS).
    pub fn ws_url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!("{scheme}://{}/v1/ws", self.addr)
    }

    /// The console's URL (`/` on the gateway; `https://` with TLS).
    pub fn console_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}/", self.addr)
    }

    /// Where `/metrics` and `/healthz` are served: the admin listener when there is one, else
    /// the gateway (`https://` with TLS).
    pub fn admin_url(&self) -> String {
        match self.admin_addr {
            Some(a) => format!("http://{a}"),
            None if self.tls => format!("https://{}", self.addr),
            None => format!("http://{}", self.addr),
        }
    }

    /// Waits until `cancel` fires (or a task fails), then stops and joins every task.
    pub async fn wait(mut self) -> Result<(), Error> {
        let first = tokio::select! {
            _ = self.cancel.cancelled() => None,
            e = self.errors.recv() => e,
        };
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Stops and joins every task.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.cancel.cancel();
        self.wait().await
    }
}

/// Initialises the watermark of every shard that has none (never overwrites one).
pub async fn init_missing(map: &ShardMap) -> Result<u32, Error> {
    let mut created = 0;
    for (i, url) in map.mailbox_urls().iter().enumerate() {
        let mut store = MailboxStore::connect(url, map.layout()).await?;
        for s in map.shards_on_mailbox(i) {
            match store.init_watermark(s, map.layout(), 1, 0, false).await {
                Ok(()) => created += 1,
                Err(tidemark_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(created)
}

/// Checks the deployment identity recorded in every instance against `topology` and records
/// it where it is missing (see `tidemark_store::deployment`). Every instance is checked before
/// any is written, so a refused start writes nothing.
///
/// An instance without an identity in a deployment whose other instances have one (one
/// wiped and restarted empty) is recorded with the deployment's version, the lowest of theirs,
/// not this code's newest: the version says which processes may run on the deployment
/// (ADR-0040, ADR-0055), so one instance of a newer version would let this code write packed
/// records there while processes that cannot read them still run on the others.
pub async fn check_identity(map: &ShardMap) -> Result<(), Error> {
    use tidemark_store::deployment::{self, Identity, Role};
    let tables = deployment::tables_fingerprint(map.core_table(), map.mailbox_table());
    let mut missing = Vec::new();
    // the versions recorded on the instances that have an identity
    let mut recorded: Option<u32> = None;
    for (role, urls) in [
        (Role::Core, map.core_urls()),
        (Role::Mailbox, map.mailbox_urls()),
    ] {
        for (index, url) in urls.iter().enumerate() {
            let want = Identity {
                version: deployment::VERSION_CURRENT,
                shards: map.shards(),
                role,
                index,
                holds: match role {
                    Role::Core => map.shards_on_core(index),
                    Role::Mailbox => map.shards_on_mailbox(index),
                },
                tables: tables.clone(),
            };
            let connect_err = |source| Error::Connect {
                role: role.as_str(),
                url: redact_url(url),
                source,
            };
            let mut conn = deployment::connect(url).await.map_err(connect_err)?;
            let refuse = |what: String| {
                Error::Deployment(format!(
                    "{} Redis {} (instance {index}): {what}; refusing to start, nothing was \
                     written (start with the shard count and instance lists this deployment \
                     was created with)",
                    role.as_str(),
                    redact_url(url)
                ))
            };
            let key = deployment::key(url, role);
            match deployment::read_at(&mut conn, &key)
                .await
                .map_err(connect_err)?
            {
                Some(have) => {
                    recorded = Some(recorded.map_or(have.version, |v| v.min(have.version)));
                    let d = have.differences(&want);
                    if !d.is_empty() {
                        return Err(refuse(d.join("; ")));
                    }
                }
                None => {
                    // created before identities: what it holds must agree with the topology
                    // (a cluster deployment is newer than identities: nothing to scan)
                    if role == Role::Mailbox && !tidemark_store::endpoint::is_cluster(url) {
                        let foreign: Vec<u32> = deployment::watermark_shards(&mut conn)
                            .await
                            .map_err(connect_err)?
                            .into_iter()
                            .filter(|s| !want.holds.contains(s))
                            .collect();
                        if !foreign.is_empty() {
                            return Err(refuse(format!(
                                "it holds watermarks of shards {} which a {}-shard deployment \
                                 with these tables places elsewhere or does not have",
                                deployment::format_ranges(&foreign),
                                map.shards()
                            )));
                        }
                    }
                    missing.push((conn, key, want));
                }
            }
        }
    }
    for (mut conn, key, mut want) in missing {
        if let Some(v) = recorded {
            want.version = v;
        }
        let have = deployment::record_if_absent_at(&mut conn, &key, &want).await?;
        let d = have.differences(&want);
        if !d.is_empty() {
            return Err(Error::Deployment(format!(
                "another process recorded a different identity at the same time: {}",
                d.join("; ")
            )));
        }
    }
    Ok(())
}

/// Checks that this code may own shard `s` before it is claimed: its watermark is one this
/// code can own (a refusal — old code on newer data — fences nobody; a corrupt watermark under
/// new code is let through: only that shard stays stopped), and a core log head below W (a core
/// restored behind the mailbox side) is raised to W before anything is committed there.
pub(crate) async fn check_ownable(
    layout: Layout,
    mailbox: &mut MailboxStore,
    core: &mut LogStore,
    s: u32,
) -> Result<(), Error> {
    match mailbox.check_claimable(s).await {
        Ok(wm) => {
            // a new commit on a head below W would reuse a delivered offset (a replay,
            // never delivered)
            let max_w = wm.lanes.max_present_w().unwrap_or(0);
            if let Some(old) = core.raise_head(s, max_w).await? {
                tracing::error!(
                    shard = s,
                    head = old,
                    w = max_w,
                    "core log head was below W (core restored to an earlier point?); \
                     head raised to W so new commits follow it"
                );
                metrics::counter!("tidemark_head_raised_total").increment(1);
            }
            Ok(())
        }
        Err(e) if e.is_corrupt() && layout == Layout::PackedV2 => Ok(()),
        // No watermark: the mailbox instance lost the shard (ADR-0060). Nothing to check and
        // no head to raise (W = 0): the worker creates it again, as ADR-0058 does for a shard
        // it owns, once it has stayed missing for WATERMARK_LOST_AFTER. (Refused here, a
        // lease holder never took the shard again.)
        Err(tidemark_store::Error::NoWatermark { .. }) => Ok(()),
        Err(e) => Err(Error::Store(e)),
    }
}

/// `url` without its password (`redis://:secret@host` → `redis://:***@host`), for messages.
pub use tidemark_store::redact_url;

/// Starts the materializers and the gateway. Returns once the gateway is listening.
///
/// Start-up never hurts a running deployment: everything that can fail is checked before the
/// first shard is claimed (claiming raises the epoch, which fences the current owner):
/// the topology and the owned shards are validated, the listeners are bound, every core and
/// mailbox Redis must answer, and every owned shard's watermark must be one this code can own.
///
/// A token secret shorter than [`tidemark_protocol::secret::MIN_SECRET_BYTES`] is refused
/// before anything starts.
pub async fn serve(opts: ServeOptions, cancel: CancellationToken) -> Result<Running, Error> {
    if let Some(secret) = &opts.gateway.token_secret {
        TokenSecret::new(secret, "the gateway options")?;
    }
    // before any worker counts anything
    let _ = crate::telemetry::metrics_handle();
    let map = opts.topology.validate()?;
    let leases = opts.node.as_ref().is_some_and(|n| n.leases);
    let materializes = opts.node.as_ref().is_none_or(|n| n.role.materializes());
    // one process that materializes and serves clients: fresh entries go from the one to the
    // other without a read back (ADR-0041)
    let mut opts = opts;
    if materializes {
        crate::gateway::LocalDelivery::wire(&mut opts.gateway, &mut opts.materializer);
        // and the records its gateway commits go to its materializers (ADR-0049)
        let g = &mut opts.gateway;
        if g.clients && g.commit_feed && g.feed.is_none() && opts.materializer.feed.is_none() {
            let feed = crate::materializer::CommitFeed::default();
            g.feed = Some(feed.clone());
            opts.materializer.feed = Some(feed);
        }
    }
    let owned: Vec<u32> = match (&opts.owned_shards, map.owner_table(), &opts.node) {
        // leases mode takes its shards later, one lease at a time; a gateway takes none
        _ if leases || !materializes => Vec::new(),
        (Some(owned), _, _) => owned
            .iter()
            .map(|&s| map.check_shard(s))
            .collect::<Result<_, _>>()?,
        // the static owner table: exactly this node's shards
        (None, Some(_), Some(node)) => {
            let mine = map.shards_of_node(&node.id);
            if mine.is_empty() {
                return Err(TopologyError::Invalid(format!(
                    "owner_of_shard gives node {:?} no shard: start it with the --node-id of \
                     an owner in the table",
                    node.id
                ))
                .into());
            }
            mine
        }
        (None, Some(_), None) => {
            return Err(TopologyError::Invalid(
                "the topology has an owner table (owner_of_shard): a node id is required".into(),
            )
            .into())
        }
        (None, None, _) => map.all_shards().collect(),
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|source| Error::Listen {
            addr: opts.listen,
            source,
        })?;
    let admin = match opts.gateway.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen { addr, source })?,
        ),
        None => None,
    };
    let mut mailboxes = Vec::new();
    for url in map.mailbox_urls() {
        mailboxes.push(
            MailboxStore::connect(url, map.layout())
                .await
                .map_err(|source| Error::Connect {
                    role: "mailbox",
                    url: redact_url(url),
                    source,
                })?,
        );
    }
    check_identity(&map).await?;
    init_missing(&map).await?;
    let health = Arc::new(HealthBoard::default());
    // every owned shard must be ownable by this code before any is claimed: a refusal (old
    // code on newer data) then fences nobody. New code starts with a corrupt shard: only that
    // shard stays stopped and is reported (the worker does not claim it).
    let mut cores = Vec::new();
    for url in map.core_urls() {
        cores.push(
            LogStore::connect(url)
                .await
                .map_err(|source| Error::Connect {
                    role: "core",
                    url: redact_url(url),
                    source,
                })?,
        );
    }
    // In leases mode any shard may become this node's, and the gateway serves every shard at
    // once: every shard is checked (a core head below W is raised) before anything is served,
    // and old code on newer data refuses to start, like a static owner.
    let checked: Vec<u32> = if leases && materializes {
        map.all_shards().collect()
    } else {
        owned.clone()
    };
    for &s in &checked {
        let (mb, core) = (map.mailbox_of(s), map.core_of(s));
        check_ownable(map.layout(), &mut mailboxes[mb], &mut cores[core], s).await?;
    }
    let tracker = TaskTracker::new();
    let (err_tx, errors) = tokio::sync::mpsc::unbounded_channel();
    for core in 0..map.core_urls().len() {
        let shards: Vec<u32> = owned
            .iter()
            .copied()
            .filter(|&s| map.core_of(s) == core)
            .collect();
        if shards.is_empty() {
            continue;
        }
        // The first start is part of start-up (its errors stop `serve`); restarts are
        // supervised and retried.
        let worker = Worker::start(
            map.clone(),
            core,
            mailboxes.clone(),
            &shards,
            opts.materializer.clone(),
            health.clone(),
        )
        .await?;
        tracker.spawn(supervise_worker(
            Some(worker),
            WorkerSpec {
                map: map.clone(),
                core,
                mailboxes: mailboxes.clone(),
                shards,
                opts: opts.materializer.clone(),
                stop_grace: WorkerSpec::STOP_GRACE,
            },
            health.clone(),
            cancel.clone(),
        ));
    }
    if let Some(node) = &opts.node {
        if leases && materializes {
            let gate = Arc::new(LeaseGate::default());
            let lease_loop = LeaseLoop {
                node: node.clone(),
                map: map.clone(),
                mailboxes: mailboxes.clone(),
                materializer: MaterializerOptions {
                    lease_gate: Some(gate.clone()),
                    ..opts.materializer.clone()
                },
                health: health.clone(),
                gate,
                tracker: tracker.clone(),
            };
            // not restarted in place (its workers and leases are its state)
            let c = cancel.clone();
            tracker.spawn(stop_service_if_it_ends(
                "lease loop",
                async move {
                    lease_loop.run(c).await;
                    Ok(())
                },
                cancel.clone(),
                err_tx.clone(),
            ));
        } else {
            // supervised: a panic restarts it (a node that stopped beating would vanish
            // from `tidemark status` while it runs). A static owner names its shards: the
            // leases nodes leave them to it, and share only the others (ADR-0131).
            let (node, map, c) = (node.clone(), map.clone(), cancel.clone());
            let owns = owned.clone();
            tracker.spawn(crate::supervise::supervise(
                "node_heartbeat",
                cancel.clone(),
                Some(health.clone()),
                move || {
                    let (node, map, c) = (node.clone(), map.clone(), c.clone());
                    let owns = owns.clone();
                    async move {
                        crate::ownership::heartbeat_loop(node, map, owns, c).await;
                        Ok::<(), std::convert::Infallible>(())
                    }
                },
                |_| {},
            ));
        }
    }
    let addr = listener.local_addr()?;
    let admin_addr = admin.as_ref().map(|a| a.local_addr()).transpose()?;
    let tls = opts.gateway.tls.is_some();
    let (c, h, topo, gw) = (
        cancel.clone(),
        health.clone(),
        map.clone(),
        opts.gateway.clone(),
    );
    tracker.spawn(stop_service_if_it_ends(
        "gateway",
        async move {
            gateway::serve_listeners(listener, admin, topo, gw, h, c)
                .await
                .map_err(Error::from)
        },
        cancel.clone(),
        err_tx.clone(),
    ));
    Ok(Running {
        addr,
        admin_addr,
        tls,
        health,
        tracker,
        cancel,
        errors,
    })
}

/// Runs `task`, which cannot be restarted in place (the gateway, the lease loop). If it ends
/// before `cancel` — an error, a return or a panic — the whole service stops: the error (or
/// [`Error::TaskEnded`]) goes to `errors`, [`Running::wait`] returns it and the process exits
/// non-zero, so its own supervisor restarts it; never a live process with a dead task.
async fn stop_service_if_it_ends(
    task: &'static str,
    run: impl std::future::Future<Output = Result<(), Error>>,
    cancel: CancellationToken,
    errors: tokio::sync::mpsc::UnboundedSender<Error>,
) {
    let outcome = crate::supervise::catch_panic(run).await;
    if cancel.is_cancelled() {
        return;
    }
    let ended = match outcome {
        Ok(Err(e)) => {
            let _ = errors.send(e);
            return;
        }
        Ok(Ok(())) => crate::supervise::Ended::Exited("returned".into()),
        Err(msg) => crate::supervise::Ended::Panicked(msg),
    };
    tracing::error!(task, %ended, "task ended; stopping the service");
    let _ = errors.send(Error::TaskEnded { task, ended });
}

/// What a materializer worker is started from (again, after a panic).
pub(crate) struct WorkerSpec {
    pub(crate) map: ShardMap,
    /// The core instance (index in the map) whose logs the worker reads.
    pub(crate) core: usize,
    pub(crate) mailboxes: Vec<MailboxStore>,
    /// The owned shards of that core instance.
    pub(crate) shards: Vec<u32>,
    pub(crate) opts: MaterializerOptions,
    /// How long a running worker asked to stop may take before it is dropped
    /// ([`WorkerSpec::STOP_GRACE`]; shorter in tests).
    pub(crate) stop_grace: Duration,
}

impl WorkerSpec {
    /// How long a materializer worker asked to stop may take to end by itself (the step in
    /// flight finishing, its owner marks cleared) before it is dropped where it stands
    /// (ADR-0121). A healthy worker ends within milliseconds; one whose call waits on a
    /// mailbox instance that does not answer would wait for the connection's 30 s response
    /// timeout.
    pub(crate) const STOP_GRACE: Duration = Duration::from_secs(2);
}

/// Returns `grace` after `cancel` is cancelled (never before).
async fn after_stop(cancel: &CancellationToken, grace: Duration) {
    cancel.cancelled().await;
    tokio::time::sleep(grace).await;
}

/// Runs `first` and, whenever a worker panics or returns before `cancel`, reports its shards
/// down and starts a new one from `spec` (which re-claims the shards). Once `cancel` fires,
/// the running worker has `spec.stop_grace` ([`WorkerSpec::STOP_GRACE`]) to end, then it is
/// dropped: the returned future ends within that grace (a start under way is dropped at once,
/// ADR-0106).
pub(crate) async fn supervise_worker(
    first: Option<Worker>,
    spec: WorkerSpec,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) {
    let ids: Vec<u32> = spec.shards.clone();
    let mut first = first;
    let spec = Arc::new(spec);
    let (h, c) = (health.clone(), cancel.clone());
    crate::supervise::supervise(
        "materializer",
        cancel.clone(),
        // its shards are marked down while it restarts (`on_down`), and running again once
        // it has re-claimed them: `/healthz` follows its state through them
        None,
        move || {
            let first = first.take();
            let (spec, health, cancel) = (spec.clone(), h.clone(), c.clone());
            async move {
                let worker = match first {
                    Some(w) => w,
                    None => {
                        // ADR-0105: without a lease to say the shards are still ours (static
                        // ownership), a shard another owner claimed while this worker was down
                        // is left to it, not claimed back (the epochs held before come from
                        // the health board; in leases mode the lease decides)
                        let prior: std::collections::BTreeMap<u32, u64> =
                            if spec.opts.lease_gate.is_none() {
                                let board = health.snapshot();
                                spec.shards
                                    .iter()
                                    .filter_map(|s| board.get(s).map(|h| (*s, h.epoch)))
                                    .collect()
                            } else {
                                Default::default()
                            };
                        let start = Worker::start_after(
                            spec.map.clone(),
                            spec.core,
                            spec.mailboxes.clone(),
                            &spec.shards,
                            spec.opts.clone(),
                            health,
                            &prior,
                        );
                        // ADR-0106: a start is not waited for once the worker is to stop. It
                        // claims its shards one by one, each waiting up to the connection's
                        // response timeout on a hung mailbox instance: a shutdown, or the
                        // lease loop's handover, waited for all of them (and the claims were
                        // made after the stop was asked).
                        tokio::select! {
                            biased;
                            _ = cancel.cancelled() => return Ok(()),
                            w = start => w?,
                        }
                    }
                };
                // ADR-0121: nor is a running worker, once a short grace after the stop has
                // passed. It looks at its token only between calls, and a call to a mailbox
                // instance that does not answer waits for the connection's response timeout
                // (30 s): a shutdown, or the lease loop's handover, waited that long. Dropped
                // where it stands, it is like a call that timed out, or a panic: every write
                // it may have sent is fenced by its shard's epoch (or deletes only what a W
                // already covers), and a call already sent may still land, as after a timeout.
                let run = worker.run(cancel.clone());
                tokio::pin!(run);
                tokio::select! {
                    biased;
                    r = &mut run => r,
                    _ = after_stop(&cancel, spec.stop_grace) => {
                        tracing::warn!(
                            shards = ?spec.shards,
                            grace = ?spec.stop_grace,
                            "materializer worker still busy after its stop (a mailbox instance \
                             not answering?): dropped; its writes are fenced by epoch"
                        );
                        Ok(())
                    }
                }
            }
        },
        move |ended| {
            tracing::error!(shards = ?ids, %ended, "materializer worker down");
            health.mark_down(&ids, &format!("materializer worker {ended}; restarting"));
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tidemark_redis_proc::RedisProcess;

    /// ADR-0106: a worker being started again (its claims blocked on a mailbox instance that
    /// does not answer: SIGSTOP) is not waited for once it is to stop. Before, the supervisor
    /// awaited the start, whose claim waited for the connection's 30 s response timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_starting_against_a_hung_mailbox_stops_when_asked() {
        let core = RedisProcess::start().unwrap();
        let mailbox = RedisProcess::start().unwrap();
        let map = Topology::new(2, Layout::PackedV2, vec![core.url()], vec![mailbox.url()])
            .validate()
            .unwrap();
        let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
            .await
            .unwrap();
        for s in 0..2 {
            mb.init_watermark(s, Layout::PackedV2, 1, 0, false)
                .await
                .unwrap();
        }
        let pid = mailbox.pid().unwrap().to_string();
        let kill = |sig: &str| {
            let ok = std::process::Command::new("kill")
                .args([sig, pid.as_str()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {sig}");
        };
        kill("-STOP");
        let spec = WorkerSpec {
            map,
            core: 0,
            mailboxes: vec![mb],
            shards: vec![0, 1],
            opts: MaterializerOptions::default(),
            stop_grace: WorkerSpec::STOP_GRACE,
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(supervise_worker(
            None,
            spec,
            Arc::new(HealthBoard::default()),
            cancel.clone(),
        ));
        // the start is under way, its first claim waiting on the hung instance
        tokio::time::sleep(Duration::from_millis(500)).await;
        let asked = std::time::Instant::now();
        cancel.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(5), task).await;
        kill("-CONT");
        assert!(
            stopped.is_ok(),
            "the supervisor still waited for the start 5 s after the stop was asked"
        );
        assert!(asked.elapsed() < Duration::from_secs(5));
    }

    /// ADR-0121: a running worker whose step waits on a mailbox instance that does not answer
    /// (SIGSTOP) is dropped once its grace after the stop has passed. Before, the supervisor
    /// awaited the run, which looks at its token only between calls: the step's call waited
    /// for the connection's response timeout (30 s; the worker's own bound on a step's
    /// writes, where there is one, is still longer than the grace here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_running_worker_stuck_on_a_hung_mailbox_stops_within_its_grace() {
        use tidemark_store::redis::dlog::DEFAULT_DEDUPE_TTL_S;
        let core = RedisProcess::start().unwrap();
        let mailbox = RedisProcess::start().unwrap();
        let map = Topology::new(2, Layout::PackedV2, vec![core.url()], vec![mailbox.url()])
            .validate()
            .unwrap();
        let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
            .await
            .unwrap();
        for s in 0..2 {
            mb.init_watermark(s, Layout::PackedV2, 1, 0, false)
                .await
                .unwrap();
        }
        let health = Arc::new(HealthBoard::default());
        let opts = MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        };
        let worker = Worker::start(
            map.clone(),
            0,
            vec![mb.clone()],
            &[0, 1],
            opts.clone(),
            health.clone(),
        )
        .await
        .unwrap();
        let spec = WorkerSpec {
            map: map.clone(),
            core: 0,
            mailboxes: vec![mb.clone()],
            shards: vec![0, 1],
            opts,
            stop_grace: Duration::from_millis(100),
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(supervise_worker(Some(worker), spec, health, cancel.clone()));
        let bob = map.route("bob");
        let mut log = LogStore::connect(&core.url()).await.unwrap();
        let mut commit = async |n: u32| {
            log.commit(
                bob.shard,
                "alice",
                &format!("m{n}"),
                &["bob"],
                "body",
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
            .offset
        };
        // the worker runs: a first record is materialised
        let first = commit(1).await;
        let start = std::time::Instant::now();
        while mb
            .read_watermark(bob.shard)
            .await
            .unwrap()
            .lanes
            .lane(bob.lane)
            .w
            < first
        {
            assert!(start.elapsed() < Duration::from_secs(10), "record 1");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pid = mailbox.pid().unwrap().to_string();
        let kill = |sig: &str| {
            let ok = std::process::Command::new("kill")
                .args([sig, pid.as_str()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {sig}");
        };
        kill("-STOP");
        commit(2).await;
        // the worker's step for record 2 is under way, waiting on the hung instance
        tokio::time::sleep(Duration::from_millis(300)).await;
        let asked = std::time::Instant::now();
        cancel.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), task).await;
        let took = asked.elapsed();
        kill("-CONT");
        assert!(
            stopped.is_ok(),
            "the worker had not stopped 10 s after the stop was asked"
        );
        assert!(
            took < Duration::from_millis(1500),
            "the worker stopped {took:?} after the stop was asked (its grace: 100 ms)"
        );
    }
}
