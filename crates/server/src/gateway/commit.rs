//! The commit path of a send, without the client protocol around it: recipients grouped by
//! shard, the id claimed on the sender's shard, then each shard's part joins that shard's next
//! `commit_dispatch` call on its core instance (group commit, [`super::group_commit`]), all
//! shards concurrently; the send is committed when every shard committed.
//!
//! Failure of any shard is `internal` (retryable): the client resends the same id and the
//! (sender, id) dedupe of each shard returns the offsets it first assigned, so shards that
//! did commit are not committed twice. The one permanent failure is a shard whose log has
//! used up its offsets (head at 2^48-1): `log_exhausted`, not retryable, reported even when
//! another shard failed transiently (a retry could never complete the send).
//!
//! [`CommitPath`] is what the gateway's WebSocket and HTTP handlers call (through
//! [`super::send`], after admission), and what `tidemark bench commit` drives directly.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tidemark_protocol::ErrorCode;
use tidemark_store::redis::dlog::{Committed, LogStore, WaitPolicy, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio_util::task::TaskTracker;

use super::group_commit::{received, GroupCommit, Pending, RoundTicket};
use super::send::CommitPermit;
use super::GatewayError;
use crate::health::HealthBoard;

/// Upper bound on one send's commits (the store's own response timeout is longer).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// A send's failure: the code for the client and a message.
pub type SendFailure = (ErrorCode, String);

/// Recipients by shard, in the order given.
pub(crate) fn group_by_shard<'a>(to: &'a [String], map: &ShardMap) -> BTreeMap<u32, Vec<&'a str>> {
    let mut by: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for r in to {
        by.entry(map.route(r).shard).or_default().push(r.as_str());
    }
    by
}

/// The commit side of the gateway: one connection per core instance and the per-instance
/// group commit queues ([`GroupCommit`]). Cheap to clone (shared).
#[derive(Clone)]
pub struct CommitPath {
    map: ShardMap,
    /// One per core instance (index = instance).
    cores: Vec<LogStore>,
    health: Arc<HealthBoard>,
    groups: GroupCommit,
}

impl CommitPath {
    /// Connects to every core instance of `map`; each waits for the replicas `core_wait`
    /// resolves to before a commit counts (ADR-0032). The group commit has the gateway's
    /// default linger (ADR-0045); its flush tasks are spawned on a tracker of its own
    /// ([`CommitPath::connect_tracked`] takes the caller's).
    pub async fn connect(
        map: ShardMap,
        core_wait: &WaitPolicy,
        health: Arc<HealthBoard>,
    ) -> Result<CommitPath, GatewayError> {
        let linger = super::DEFAULT_COMMIT_LINGER;
        Self::connect_tracked(map, core_wait, linger, health, TaskTracker::new(), None).await
    }

    /// [`CommitPath::connect`] with the group commit's flush tasks spawned on `tracker` (the
    /// gateway joins them with its other tasks), and rounds of an instance at least
    /// `commit_linger` apart (ADR-0045; zero: none), and every record committed handed to
    /// `feed` (this process's materializers, ADR-0049).
    pub async fn connect_tracked(
        map: ShardMap,
        core_wait: &WaitPolicy,
        commit_linger: Duration,
        health: Arc<HealthBoard>,
        tracker: TaskTracker,
        feed: Option<crate::materializer::CommitFeed>,
    ) -> Result<CommitPath, GatewayError> {
        let mut cores = Vec::with_capacity(map.core_urls().len());
        for url in map.core_urls() {
            let mut core = LogStore::connect(url).await?;
            let wait = core_wait.resolve(&mut core.connection()).await?;
            if let Some(w) = wait {
                tracing::info!(
                    core = %tidemark_store::redact_url(url),
                    replicas = w.replicas,
                    timeout_ms = w.timeout.as_millis() as u64,
                    "commits wait for replicas before send_ack"
                );
            }
            core.set_replica_wait(wait);
            if let Some(feed) = &feed {
                // what the records handed over waited for (ADR-0094)
                feed.set_commit_wait(url, wait.map_or(0, |w| w.replicas));
            }
            cores.push(core);
        }
        let groups = GroupCommit::new(
            map.clone(),
            cores.clone(),
            DEFAULT_DEDUPE_TTL_S,
            commit_linger,
            tracker,
            feed,
        );
        Ok(CommitPath {
            map,
            cores,
            health,
            groups,
        })
    }

    /// The connections to the core instances (index = instance).
    pub fn cores(&self) -> &[LogStore] {
        &self.cores
    }

    /// A connection to the core instance of `shard`.
    pub fn core(&self, shard: u32) -> LogStore {
        self.cores[self.map.core_of(shard)].clone()
    }

    /// The quick path of a send (ADR-0089): when all of `to` is in one shard and that shard's
    /// commit call can claim the id too (ADR-0037: the sender's shard is on the same instance,
    /// or on a Redis Cluster is that shard), that shard and the sender's; else `None` (the
    /// send takes [`CommitPath::commit`]'s path: several shards, or a claim of its own first).
    pub(crate) fn quick_shard(&self, sender: &str, to: &[String]) -> Option<(u32, u32)> {
        let shard = one_shard(to, &self.map)?;
        let home = self.map.route(sender).shard;
        let core = &self.cores[self.map.core_of(shard)];
        (shard == home || (!core.is_cluster() && self.map.core_of(home) == self.map.core_of(shard)))
            .then_some((shard, home))
    }

    /// Begins a send on the quick path ([`CommitPath::quick_shard`] gave `shard` and `home`):
    /// it joins its instance's queue before this returns. A connection that begins its sends
    /// one after another therefore has them committed in that order, together in a round,
    /// while it waits for the first answer ([`Begun::finish`]).
    ///
    /// `conn` names the connection (0: none). With `round` (the ticket of the connection's
    /// sends still awaiting answers), the send joins that round only while it is still open;
    /// else [`Begin::NotNow`] hands the recipients and the body back, and the connection
    /// begins it once those answers are in (ADR-0089: no send overtakes an earlier one).
    /// `permit` (the send's room among the commits in flight) goes with the queued message
    /// and is let go of when it is answered (ADR-0095), or comes back with
    /// [`Begin::NotNow`].
    pub(crate) fn begin_quick(
        &self,
        (shard, home): (u32, u32),
        sender: &str,
        id: &str,
        (to, body): (Vec<String>, String),
        (conn, round): (u64, Option<RoundTicket>),
        permit: Option<CommitPermit>,
    ) -> Begin {
        // a shard stopped here because its watermark is corrupt takes no new message: refused
        // before anything commits (else it would wait, acknowledged, until a repair)
        if self.health.is_corrupt(shard) {
            return Begin::Begun(Begun::Refused(shard_stopped(shard)), None);
        }
        let digest = tidemark_store::redis::dlog::request_digest(&to, &body);
        let msg = Pending {
            shard,
            sender: sender.to_string(),
            client_id: id.to_string(),
            recipients: to,
            body,
            sent_at_us: now_us(),
            digest,
            claim_home: Some(home),
            conn,
            permit,
        };
        let deadline = tokio::time::Instant::now() + COMMIT_TIMEOUT;
        let (answer, ticket) = match self.groups.enqueue(msg, round) {
            Ok(queued) => queued,
            Err(msg) => {
                let Pending {
                    recipients,
                    body,
                    permit,
                    ..
                } = *msg;
                return Begin::NotNow(recipients, body, permit);
            }
        };
        Begin::Begun(
            Begun::Queued {
                shard,
                answer,
                deadline,
            },
            Some(ticket),
        )
    }

    /// Commits the send `id` from `sender` (recipients `to`, `body`) to every shard it
    /// touches. Returns shard → offset. The recipients and the body are taken, not borrowed:
    /// a send to one shard hands them to its commit as they are, without copies (ADR-0079),
    /// and builds no grouping, no list of parts and no join (ADR-0081).
    pub async fn commit(
        &self,
        sender: &str,
        id: &str,
        to: Vec<String>,
        mut body: String,
    ) -> Result<BTreeMap<u32, u64>, SendFailure> {
        // a send to one shard whose call claims its id too: the quick path (ADR-0089)
        if let Some(quick) = self.quick_shard(sender, &to) {
            return match self.begin_quick(quick, sender, id, (to, body), (0, None), None) {
                Begin::Begun(begun, _) => begun.finish(sender, id).await,
                Begin::NotNow(..) => unreachable!("a send without a round ticket is queued"),
            };
        }
        let sent_at_us = now_us();
        // nearly every send has its recipients in one shard (one recipient, most often):
        // found without grouping them; the others are grouped by shard
        let one = one_shard(&to, &self.map);
        let groups = match one {
            Some(_) => BTreeMap::new(),
            None => group_by_shard(&to, &self.map),
        };
        // a shard stopped here because its watermark is corrupt takes no new message: refused
        // before anything commits (else it would wait, acknowledged, until a repair)
        if let Some(bad) = one
            .into_iter()
            .chain(groups.keys().copied())
            .find(|&s| self.health.is_corrupt(s))
        {
            return Err(shard_stopped(bad));
        }
        // one digest for the whole message: a resend with the same id must be the same
        // message on every shard (the same recipients, the same body)
        let mut digest = tidemark_store::redis::dlog::request_digest(&to, &body);
        // the id is bound to the message on the sender's own shard first, so that a reuse is
        // refused before any shard commits (a shard the first message did not touch has no
        // dedupe record to compare with). (A send to one shard whose commit call can reach the
        // claim key, the same instance or on a Redis Cluster the same shard, claims inside
        // that call instead, one round trip, not two: ADR-0037, the quick path above.)
        let home = self.map.route(sender).shard;
        let claim = self
            .core(home)
            .claim_message_id(home, sender, id, &digest, DEFAULT_DEDUPE_TTL_S)
            .await
            .map_err(|e| {
                tracing::warn!(sender, id, error = %e, "message id claim failed");
                (
                    ErrorCode::Internal,
                    "commit failed; retry with the same id".to_string(),
                )
            })?;
        if claim == tidemark_store::redis::dlog::IdClaim::OtherMessage {
            return Err(id_reused(id));
        }
        let pending = |shard, recipients, body, digest| Pending {
            shard,
            sender: sender.to_string(),
            client_id: id.to_string(),
            recipients,
            body,
            sent_at_us,
            digest,
            claim_home: None,
            conn: 0,
            permit: None,
        };
        let timed_out = || timed_out(sender, id);
        if let Some(shard) = one {
            // one shard: its part takes the recipients, the body and the digest as they are
            drop(groups);
            let msg = pending(shard, to, body, digest);
            let r = tokio::time::timeout(COMMIT_TIMEOUT, self.groups.commit(msg))
                .await
                .map_err(|_| timed_out())?;
            return answer(sender, id, std::iter::once((shard, r)));
        }
        // several shards: each part copies its shard's recipients; the last part takes the
        // body and the digest, the others copies
        let last = groups.len().saturating_sub(1);
        let parts: Vec<(u32, Vec<String>)> = groups
            .into_iter()
            .map(|(shard, rcpts)| (shard, rcpts.into_iter().map(str::to_string).collect()))
            .collect();
        let mut take = |i: usize| {
            if i == last {
                (std::mem::take(&mut body), std::mem::take(&mut digest))
            } else {
                (body.clone(), digest.clone())
            }
        };
        // each shard's commit joins that shard's next group call
        let commits = parts
            .into_iter()
            .enumerate()
            .map(|(i, (shard, recipients))| {
                let (body, digest) = take(i);
                let msg = pending(shard, recipients, body, digest);
                let groups = &self.groups;
                async move { (shard, groups.commit(msg).await) }
            });
        let results = tokio::time::timeout(COMMIT_TIMEOUT, futures::future::join_all(commits))
            .await
            .map_err(|_| timed_out())?;
        answer(sender, id, results)
    }
}

/// What [`CommitPath::begin_quick`] did with a send.
pub(crate) enum Begin {
    /// Begun (queued, or refused before any queue), with the ticket of the round it is in.
    Begun(Begun, Option<RoundTicket>),
    /// Not queued: the round asked for was already taken. The recipients, the body and the
    /// permit, back.
    NotNow(Vec<String>, String, Option<CommitPermit>),
}

/// A send begun on the quick path ([`CommitPath::begin_quick`]).
pub(crate) enum Begun {
    /// Queued for its instance's next round: the answer comes on `answer`, by `deadline`.
    Queued {
        shard: u32,
        answer: tokio::sync::oneshot::Receiver<Result<Committed, StoreError>>,
        deadline: tokio::time::Instant,
    },
    /// Refused before anything was queued (its shard is stopped).
    Refused(SendFailure),
}

impl Begun {
    /// The send's answer: shard → offset, or why it failed.
    pub(crate) async fn finish(
        self,
        sender: &str,
        id: &str,
    ) -> Result<BTreeMap<u32, u64>, SendFailure> {
        match self {
            Begun::Refused(f) => Err(f),
            Begun::Queued {
                shard,
                answer: rx,
                deadline,
            } => {
                let r = tokio::time::timeout_at(deadline, rx)
                    .await
                    .map_err(|_| timed_out(sender, id))?;
                answer(sender, id, std::iter::once((shard, received(r))))
            }
        }
    }
}

/// Microseconds since the Unix epoch (a record's `sent_at_us`).
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// A send refused because `shard` is stopped (its watermark is corrupt).
fn shard_stopped(shard: u32) -> SendFailure {
    (
        ErrorCode::ShardUnavailable,
        format!(
            "shard {shard} is stopped (corrupt watermark) until an operator repairs it; nothing \
             was committed"
        ),
    )
}

/// A send whose commit did not answer within [`COMMIT_TIMEOUT`].
fn timed_out(sender: &str, id: &str) -> SendFailure {
    tracing::warn!(sender, id, "commit timed out");
    (
        ErrorCode::Internal,
        "commit timed out; retry with the same id".to_string(),
    )
}

/// The shard of `to` when all its recipients are in one shard; `None` when they are in
/// several, or there are none.
fn one_shard(to: &[String], map: &ShardMap) -> Option<u32> {
    let (first, rest) = to.split_first()?;
    let shard = map.route(first).shard;
    rest.iter()
        .all(|r| map.route(r).shard == shard)
        .then_some(shard)
}

/// A send's answer from its parts' results (shard, result): shard → offset when every part
/// committed; else the failure the client is told (`log_exhausted` wins: permanent).
fn answer(
    sender: &str,
    id: &str,
    results: impl IntoIterator<Item = (u32, Result<Committed, StoreError>)>,
) -> Result<BTreeMap<u32, u64>, SendFailure> {
    let mut offsets = BTreeMap::new();
    let mut duplicates = 0u64;
    let mut failure: Option<SendFailure> = None;
    for (shard, r) in results {
        match r {
            Ok(c) => {
                duplicates += u64::from(c.duplicate);
                offsets.insert(shard, c.offset);
            }
            Err(StoreError::IdReused { shard, offset }) => {
                tracing::info!(shard, offset, sender, id, "id reused for another message");
                // Permanent too: the id names another message.
                failure = Some(id_reused(id));
            }
            Err(StoreError::LogExhausted { shard }) => {
                tracing::error!(shard, sender, id, "dispatch log exhausted: commit refused");
                // Permanent: it wins over a transient failure of another shard.
                failure = Some((
                    ErrorCode::LogExhausted,
                    format!("shard {shard} has used up its log offsets; the send cannot complete"),
                ));
            }
            Err(e) => {
                tracing::warn!(shard, sender, id, code = e.code(), error = %e, "commit failed");
                if failure.is_none() {
                    failure = Some((
                        ErrorCode::Internal,
                        format!("commit to shard {shard} failed; retry with the same id"),
                    ));
                }
            }
        }
    }
    if let Some(f) = failure {
        return Err(f);
    }
    crate::telemetry::hot().commits.increment(1);
    if duplicates > 0 {
        crate::telemetry::hot().commit_duplicates.increment(1);
    }
    Ok(offsets)
}

fn id_reused(id: &str) -> SendFailure {
    (
        ErrorCode::IdReused,
        format!(
            "id {id:?} was already used for another message (other recipients or body) within \
             the last 24 hours; use a new id"
        ),
    )
}
