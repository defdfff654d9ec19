//! Admitting and committing a send. The commit itself (recipients grouped by shard, one
//! `commit_dispatch` per shard, failures) is [`CommitPath`](super::commit::CommitPath)'s.
//!
//! Admission ([`reserve`]): the sender's send rate first (`rate_limited`), then the sender's
//! share of commit permits, then the gateway's; both permit waits together last at most
//! [`PERMIT_WAIT`] (`overloaded`). A user's waiters queue on the user's own semaphore, so the
//! gateway's FIFO queue holds at most a share's worth of one user: a user who floods does
//! not push the others back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::{ErrorCode, SendRequest};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

pub(crate) use super::commit::{group_by_shard, SendFailure};
use super::state::Shared;
use super::users::Users;

/// How long a send waits for room among the commits in flight before `overloaded`.
pub(crate) const PERMIT_WAIT: Duration = Duration::from_millis(100);

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

/// Commits `req` from `sender` to every shard it touches ([`CommitPath::commit`](super::commit::CommitPath::commit)). Returns
/// shard → offset.
pub(crate) async fn commit(
    shared: &Shared,
    sender: &str,
    req: &SendRequest,
) -> Result<BTreeMap<u32, u64>, SendFailure> {
    shared.commit.commit(sender, req).await
}
