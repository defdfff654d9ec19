//! What every handler shares: the topology, one connection per Redis instance (each a
//! multiplexed `ConnectionManager`, cloned per task), the commit semaphore, the per-user
//! table, the wake hub and the admin status sampler.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::topology::ShardMap;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::acks::AckQueue;
use super::commit::CommitPath;
use super::mailbox::Mailbox;
use super::users::Users;
use super::wake::WakeHub;
use super::{GatewayError, GatewayOptions};
use crate::health::HealthBoard;

/// State shared by every request and connection.
pub(crate) struct Shared {
    /// The validated topology: routing and the shard → instance tables.
    pub map: ShardMap,
    pub opts: GatewayOptions,
    pub health: Arc<HealthBoard>,
    /// The commit path (one connection per core instance).
    pub commit: CommitPath,
    /// One per mailbox instance (index = instance).
    mailboxes: Vec<MailboxStore>,
    /// The WebSocket connections' acks, grouped per mailbox instance (ADR-0038).
    pub acks: AckQueue,
    /// Permits = commits that may be in flight (or queued on a connection) gateway-wide.
    pub commits: Arc<Semaphore>,
    /// Per-user connection counts, commit shares and send buckets.
    pub users: Arc<Users>,
    pub hub: Arc<WakeHub>,
    /// Cancelled when the gateway stops.
    pub stop: CancellationToken,
    /// Every task the gateway spawns.
    pub tracker: TaskTracker,
    pub metrics: PrometheusHandle,
    /// The previous admin status snapshot (rates).
    pub sampler: super::admin::Sampler,
}

impl Shared {
    pub(crate) async fn connect(
        map: ShardMap,
        opts: GatewayOptions,
        health: Arc<HealthBoard>,
        stop: CancellationToken,
        tracker: TaskTracker,
    ) -> Result<Arc<Shared>, GatewayError> {
        let metrics = crate::telemetry::metrics_handle();
        let commit = CommitPath::connect_tracked(
            map.clone(),
            &opts.core_wait,
            opts.commit_linger,
            health.clone(),
            tracker.clone(),
            opts.feed.clone(),
        )
        .await?;
        let mut mailboxes = Vec::with_capacity(map.mailbox_urls().len());
        for url in map.mailbox_urls() {
            mailboxes.push(MailboxStore::connect(url, map.layout()).await?);
        }
        let permits = opts.max_inflight_commits.clamp(1, Semaphore::MAX_PERMITS);
        let users = Arc::new(Users::new(
            opts.max_connections_per_user,
            permits,
            opts.max_inflight_commits_per_user,
            opts.send_rate_per_user,
            f64::from(opts.send_burst_per_user),
        ));
        let acks = AckQueue::new(
            mailboxes.clone(),
            opts.ack_interval,
            stop.clone(),
            tracker.clone(),
        );
        let hub = opts
            .local
            .as_ref()
            .map(|l| l.hub.clone())
            .unwrap_or_default();
        Ok(Arc::new(Shared {
            map,
            opts,
            health,
            commit,
            mailboxes,
            acks,
            commits: Arc::new(Semaphore::new(permits)),
            users,
            hub,
            stop,
            tracker,
            metrics,
            sampler: super::admin::Sampler::default(),
        }))
    }

    /// Total permits of the commit semaphore.
    pub(crate) fn commit_permits(&self) -> usize {
        self.opts
            .max_inflight_commits
            .clamp(1, Semaphore::MAX_PERMITS)
    }

    /// The deployment's status (`tidemark status`'s reading) over this gateway's connections.
    pub(crate) async fn status(
        &self,
    ) -> Result<tidemark_store::status::Status, tidemark_store::Error> {
        let mut cores: Vec<LogStore> = self.commit.cores().to_vec();
        let mut mailboxes = self.mailboxes.clone();
        tidemark_store::status::gather(&self.map, &mut cores, &mut mailboxes).await
    }

    /// A connection to mailbox instance `index`.
    pub(crate) fn mailbox_store(&self, index: usize) -> MailboxStore {
        self.mailboxes[index].clone()
    }

    /// `user`'s mailbox (its shard, lane and a connection to its mailbox instance).
    pub(crate) fn mailbox(&self, user: &str) -> Mailbox {
        let r = self.map.route(user);
        let store = self.mailboxes[r.mailbox].clone();
        Mailbox::new(user.to_string(), r, store)
    }
}
