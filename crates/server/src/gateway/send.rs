//! Committing a send: recipients grouped by shard, one `commit_dispatch` per shard on the
//! shard's core instance, all concurrently; the send is acked when every shard committed.
//!
//! Failure of any shard is `internal` (retryable): the client resends the same id and the
//! (sender, id) dedupe of each shard returns the offsets it first assigned, so shards that
//! did commit are not committed twice. The one permanent failure is a shard whose log has
//! used up its offsets (head at 2^48-1): `log_exhausted`, not retryable, reported even when
//! another shard failed transiently (a retry could never complete the send).
//!
//! Admission ([`reserve`]): the sender's send rate first (`rate_limited`), then the sender's
//! share of commit permits, then the gateway's; both permit waits together last at most
//! [`PERMIT_WAIT`] (`overloaded`). A user's waiters queue on the user's own semaphore, so the
//! gateway's FIFO queue holds at most a share's worth of one user: a user who floods does
//! not push the others back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tidemark_protocol::{ErrorCode, SendRequest};
use tidemark_store::redis::dlog::DEFAULT_DEDUPE_TTL_S;
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::state::Shared;
use super::users::Users;

/// How long a send waits for room among the commits in flight before `overloaded`.
pub(crate) const PERMIT_WAIT: Duration = Duration::from_millis(100);

/// Upper bound on one send's commits (the store's own response timeout is longer).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// A send's failure: the code for the client and a message.
pub(crate) type SendFailure = (ErrorCode, String);

/// Recipients by shard, in the order given.
pub(crate) fn group_by_shard<'a>(to: &'a [String], map: &ShardMap) -> BTreeMap<u32, Vec<&'a str>> {
    let mut by: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for r in to {
        by.entry(map.route(r).shard).or_default().push(r.as_str());
    }
    by
}

/// Room for one send's commits: permits of the sender's share and of the gateway.
pub(crate) struct CommitPermit {
    user_permits: Option<OwnedSemaphorePermit>,
    permits: Option<OwnedSemaphorePermit>,
    users: Arc<Users>,
    user: String,
}

impl Drop for CommitPermit {
    fn drop(&mut self) {
        self.permits.take();
        self.user_permits.take();
        self.users.commits_released(&self.user);
    }
}

/// Takes `n` permits of `sem`, waiting until `deadline` at most.
async fn acquire(sem: Arc<Semaphore>, n: u32, deadline: Instant) -> Option<OwnedSemaphorePermit> {
    match sem.clone().try_acquire_many_owned(n) {
        Ok(p) => Some(p),
        Err(_) => tokio::time::timeout_at(deadline, sem.acquire_many_owned(n))
            .await
            .ok()?
            .ok(),
    }
}

/// Admits `req` from `user`: a token of the user's send rate, then room for its commits
/// (one permit per shard touched) in the user's share and in the gateway; `rate_limited`, or
/// `overloaded` if no room frees up within [`PERMIT_WAIT`].
pub(crate) async fn reserve(
    shared: &Shared,
    user: &str,
    req: &SendRequest,
) -> Result<CommitPermit, SendFailure> {
    if let Err(wait) = shared.users.take_send(user) {
        return Err((
            ErrorCode::RateLimited,
            format!(
                "too many sends from this user; retry in {} ms with the same id",
                wait.as_millis().max(1)
            ),
        ));
    }
    let shards = group_by_shard(&req.to, &shared.map).len();
    let n = shards.clamp(1, shared.commit_permits()) as u32;
    let deadline = Instant::now() + PERMIT_WAIT;
    let mut permit = CommitPermit {
        user_permits: None,
        permits: None,
        users: Arc::clone(&shared.users),
        user: user.to_string(),
    };
    let mine = n.min(shared.users.commit_share() as u32);
    permit.user_permits = acquire(shared.users.commits(user), mine, deadline).await;
    if permit.user_permits.is_none() {
        return Err((
            ErrorCode::Overloaded,
            "too many of this user's commits in flight; retry with the same id".to_string(),
        ));
    }
    permit.permits = acquire(Arc::clone(&shared.commits), n, deadline).await;
    if permit.permits.is_none() {
        return Err((
            ErrorCode::Overloaded,
            "too many commits in flight; retry with the same id".to_string(),
        ));
    }
    Ok(permit)
}

/// Commits `req` from `sender` to every shard it touches. Returns shard → offset.
pub(crate) async fn commit(
    shared: &Shared,
    sender: &str,
    req: &SendRequest,
) -> Result<BTreeMap<u32, u64>, SendFailure> {
    let sent_at_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    let groups = group_by_shard(&req.to, &shared.map);
    // a shard stopped here because its watermark is corrupt takes no new message: refused
    // before anything commits (else it would wait, acknowledged, until a repair)
    if let Some(&bad) = groups.keys().find(|&&s| shared.health.is_corrupt(s)) {
        return Err((
            ErrorCode::ShardUnavailable,
            format!(
                "shard {bad} is stopped (corrupt watermark) until an operator repairs it; \
                 nothing was committed"
            ),
        ));
    }
    // one digest for the whole message: a resend with the same id must be the same message
    // on every shard (the same recipients, the same body)
    let all: Vec<&str> = req.to.iter().map(String::as_str).collect();
    let digest = &tidemark_store::redis::dlog::request_digest(&all, &req.body);
    // the id is bound to the message on the sender's own shard first, so that a reuse is
    // refused before any shard commits (a shard the first message did not touch has no
    // dedupe record to compare with)
    let home = shared.map.route(sender).shard;
    let claim = shared
        .core(home)
        .claim_message_id(home, sender, &req.id, digest, DEFAULT_DEDUPE_TTL_S)
        .await
        .map_err(|e| {
            tracing::warn!(sender, id = %req.id, error = %e, "message id claim failed");
            (
                ErrorCode::Internal,
                "commit failed; retry with the same id".to_string(),
            )
        })?;
    if claim == tidemark_store::redis::dlog::IdClaim::OtherMessage {
        return Err((
            ErrorCode::IdReused,
            format!(
                "id {:?} was already used for another message (other recipients or body) \
                 within the last 24 hours; use a new id",
                req.id
            ),
        ));
    }
    let commits = groups.iter().map(|(&shard, rcpts)| {
        let mut core = shared.core(shard);
        async move {
            let r = core
                .commit_request(
                    shard,
                    sender,
                    &req.id,
                    rcpts,
                    &req.body,
                    sent_at_us,
                    DEFAULT_DEDUPE_TTL_S,
                    digest,
                )
                .await;
            (shard, r)
        }
    });
    let results = tokio::time::timeout(COMMIT_TIMEOUT, futures::future::join_all(commits))
        .await
        .map_err(|_| {
            tracing::warn!(sender, id = %req.id, "commit timed out");
            (
                ErrorCode::Internal,
                "commit timed out; retry with the same id".to_string(),
            )
        })?;
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
                tracing::info!(shard, offset, sender, id = %req.id, "id reused for another message");
                // Permanent too: the id names another message.
                failure = Some((
                    ErrorCode::IdReused,
                    format!(
                        "id {:?} was already used for another message (other recipients or \
                         body) within the last 24 hours; use a new id",
                        req.id
                    ),
                ));
            }
            Err(StoreError::LogExhausted { shard }) => {
                tracing::error!(shard, sender, id = %req.id, "dispatch log exhausted: commit refused");
                // Permanent: it wins over a transient failure of another shard.
                failure = Some((
                    ErrorCode::LogExhausted,
                    format!("shard {shard} has used up its log offsets; the send cannot complete"),
                ));
            }
            Err(e) => {
                tracing::warn!(shard, sender, id = %req.id, error = %e, "commit failed");
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
    metrics::counter!("tidemark_commits_total").increment(1);
    if duplicates > 0 {
        metrics::counter!("tidemark_commit_duplicates_total").increment(1);
    }
    Ok(offsets)
}
