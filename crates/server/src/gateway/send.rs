//! Admitting and committing a send. The commit itself (recipients grouped by shard, one
//! `commit_dispatch` per shard, failures) is [`CommitPath`](super::commit::CommitPath)'s.
//!
//! Admission ([`reserve`]): the sender's send rate first (`rate_limited`), then the sender's
//! share of commit permits, then the gateway's; both permit waits together last at most
//! [`PERMIT_WAIT`] (`overloaded`). A user's waiters queue on the user's own semaphore, so the
//! gateway's FIFO queue holds at most a share's worth of one user: a user who floods does
//! not push the others back.
//!
//! A send to more shards than the share (possible only with a share set below the number of
//! recipients a send may have) takes the whole share, so it goes only when its user has
//! nothing else in flight, and one gateway permit per shard, so the gateway's bound on commits
//! in flight holds (ADR-0127). While it waits or is in flight, its user holds (or queues for)
//! more gateway permits than the share: at most one per recipient a send may have. Committing
//! its shards a share at a time would keep both bounds; that is the commit path's to do.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::{ErrorCode, SendRequest};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

pub(crate) use super::commit::SendFailure;
use super::state::Shared;
use super::users::UserRef;

/// How long a send waits for room among the commits in flight before `overloaded`.
pub(crate) const PERMIT_WAIT: Duration = Duration::from_millis(100);

/// Room for one send's commits: permits of the sender's share and of the gateway.
pub(crate) struct CommitPermit {
    user_permits: Option<OwnedSemaphorePermit>,
    permits: Option<OwnedSemaphorePermit>,
    /// The sender's entry, let go of after the permits (so it can be seen idle).
    user: UserRef,
}

impl Drop for CommitPermit {
    fn drop(&mut self) {
        self.permits.take();
        self.user_permits.take();
        // then `user` lets go of the entry
    }
}

/// Takes `n` permits of `sem`, waiting until `deadline` at most.
async fn acquire(sem: Arc<Semaphore>, n: u32, deadline: Instant) -> Option<OwnedSemaphorePermit> {
    tokio::time::timeout_at(deadline, sem.acquire_many_owned(n))
        .await
        .ok()?
        .ok()
}

/// A send admitted by its rate whose commit permits were not all free at once:
/// [`PendingPermit::wait`] takes the rest, waiting [`PERMIT_WAIT`] at most.
pub(crate) struct PendingPermit {
    permit: CommitPermit,
    /// The gateway's semaphore (the user's share is the permit's user's).
    gateway: Arc<Semaphore>,
    /// Permits of the user's share and of the gateway.
    mine: u32,
    n: u32,
}

impl PendingPermit {
    /// Takes the permits still missing, or says `overloaded`.
    pub(crate) async fn wait(mut self) -> Result<CommitPermit, SendFailure> {
        let deadline = Instant::now() + PERMIT_WAIT;
        if self.permit.user_permits.is_none() {
            let user_sem = Arc::clone(self.permit.user.entry().commits());
            self.permit.user_permits = acquire(user_sem, self.mine, deadline).await;
            if self.permit.user_permits.is_none() {
                return Err(user_overloaded());
            }
        }
        if self.permit.permits.is_none() {
            self.permit.permits = acquire(self.gateway.clone(), self.n, deadline).await;
            if self.permit.permits.is_none() {
                return Err((
                    ErrorCode::Overloaded,
                    "too many commits in flight; retry with the same id".to_string(),
                ));
            }
        }
        Ok(self.permit)
    }
}

fn user_overloaded() -> SendFailure {
    (
        ErrorCode::Overloaded,
        "too many of this user's commits in flight; retry with the same id".to_string(),
    )
}

/// Admits `req` from `user` without waiting: a token of the user's send rate
/// (`rate_limited`), then room for its commits (one permit per shard touched) in the user's
/// share and in the gateway. `Ok(Err(pending))` when some permits were not free at once
/// (the caller awaits [`PendingPermit::wait`]; ADR-0061: the reader handles a frame without
/// an allocation when nothing waits). `user` is the connection's own reference to the
/// user's entry (ADR-0072: no lookup in the user table).
pub(crate) fn try_reserve(
    shared: &Shared,
    user: &UserRef,
    req: &SendRequest,
) -> Result<Result<CommitPermit, PendingPermit>, SendFailure> {
    let entry = user.entry();
    if let Err(wait) = shared.users.take_send(entry) {
        return Err((
            ErrorCode::RateLimited,
            format!(
                "too many sends from this user; retry in {} ms with the same id",
                wait.as_millis().max(1)
            ),
        ));
    }
    let shards = shards_touched(&req.to, &shared.map);
    let n = shards.clamp(1, shared.commit_permits()) as u32;
    let mine = n.min(shared.users.commit_share() as u32);
    let user_permits = Arc::clone(entry.commits())
        .try_acquire_many_owned(mine)
        .ok();
    let gateway = &shared.commits;
    let permits = match user_permits {
        Some(_) => Arc::clone(gateway).try_acquire_many_owned(n).ok(),
        None => None,
    };
    let permit = CommitPermit {
        user_permits,
        permits,
        user: user.clone_ref(),
    };
    if permit.permits.is_some() {
        return Ok(Ok(permit));
    }
    Ok(Err(PendingPermit {
        permit,
        gateway: Arc::clone(gateway),
        mine,
        n,
    }))
}

/// How many shards the recipients `to` are in (one recipient: one shard, nothing built).
fn shards_touched(to: &[String], map: &tidemark_store::topology::ShardMap) -> usize {
    match to {
        [] => 0,
        [_] => 1,
        _ => {
            let mut shards: Vec<u32> = to.iter().map(|r| map.route(r).shard).collect();
            shards.sort_unstable();
            shards.dedup();
            shards.len()
        }
    }
}

/// Admits `req` from `user` ([`try_reserve`]), waiting for permits [`PERMIT_WAIT`] at most
/// (`overloaded` if no room frees up meanwhile). For a send without a connection (HTTP):
/// looks the user up in the table.
pub(crate) async fn reserve(
    shared: &Shared,
    user: &str,
    req: &SendRequest,
) -> Result<CommitPermit, SendFailure> {
    let user = shared.users.user_ref(user);
    match try_reserve(shared, &user, req)? {
        Ok(permit) => Ok(permit),
        Err(pending) => pending.wait().await,
    }
}

/// Commits the send `req` from `sender` to every shard it touches
/// ([`CommitPath::commit`](super::commit::CommitPath::commit)), taking its recipients and
/// body; returns its id (for the answer) and shard → offset.
pub(crate) async fn commit(
    shared: &Shared,
    sender: &str,
    req: SendRequest,
) -> (String, Result<BTreeMap<u32, u64>, SendFailure>) {
    let SendRequest { id, to, body } = req;
    let res = shared.commit.commit(sender, &id, to, body).await;
    (id, res)
}
