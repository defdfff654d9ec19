//! Per-user limits, so one user cannot take what everybody shares: open WebSockets
//! (`max_connections_per_user`), commits in flight (a per-user share of the gateway's commit
//! permits) and the send rate (a token bucket, off by default).
//!
//! One table, keyed by user id, holds what is live for each user; an entry goes once nothing
//! refers to it (no connection, no commit in flight, a full bucket).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

/// The user table.
pub(crate) struct Users {
    max_connections: usize,
    /// Commit permits one user may hold.
    commit_share: usize,
    /// Sends per second and burst (`None`: no rate limit).
    rate: Option<(f64, f64)>,
    table: Mutex<Table>,
}

struct Table {
    users: HashMap<String, UserState>,
    /// Sweep idle entries once the table grows to this size.
    sweep_at: usize,
}

struct UserState {
    connections: usize,
    /// The user's share of commit permits (held while a send commits or waits in a queue).
    commits: Arc<Semaphore>,
    /// Send tokens and when they were last refilled.
    tokens: f64,
    refilled: Instant,
}

const SWEEP_MIN: usize = 1024;

impl Users {
    /// `commit_share` 0: an eighth of `max_inflight_commits`. `rate` ≤ 0: no rate limit;
    /// `burst` 0: one second's worth.
    pub(crate) fn new(
        max_connections: usize,
        max_inflight_commits: usize,
        commit_share: usize,
        rate: f64,
        burst: f64,
    ) -> Users {
        let commit_share = if commit_share == 0 {
            max_inflight_commits / 8
        } else {
            commit_share
        };
        let rate = (rate > 0.0).then(|| (rate, if burst >= 1.0 { burst } else { rate.max(1.0) }));
        Users {
            max_connections: max_connections.max(1),
            commit_share: commit_share.clamp(1, Semaphore::MAX_PERMITS),
            rate,
            table: Mutex::new(Table {
                users: HashMap::new(),
                sweep_at: SWEEP_MIN,
            }),
        }
    }

    /// Commit permits one user may hold.
    pub(crate) fn commit_share(&self) -> usize {
        self.commit_share
    }

    /// Runs `f` on `user`'s entry (created if missing), refilled to now.
    fn with<T>(&self, user: &str, f: impl FnOnce(&mut UserState) -> T) -> T {
        let mut t = self.table.lock().expect("user table lock");
        if !t.users.contains_key(user) {
            if t.users.len() >= t.sweep_at {
                let now = Instant::now();
                let rate = self.rate;
                t.users.retain(|_, u| !u.idle(now, rate));
                t.sweep_at = (t.users.len() * 2).max(SWEEP_MIN);
            }
            let burst = self.rate.map_or(0.0, |(_, b)| b);
            t.users.insert(
                user.to_string(),
                UserState {
                    connections: 0,
                    commits: Arc::new(Semaphore::new(self.commit_share)),
                    tokens: burst,
                    refilled: Instant::now(),
                },
            );
        }
        let u = t.users.get_mut(user).expect("just inserted");
        if let Some((rate, burst)) = self.rate {
            let now = Instant::now();
            let dt = now.saturating_duration_since(u.refilled).as_secs_f64();
            u.tokens = (u.tokens + dt * rate).min(burst);
            u.refilled = now;
        }
        f(u)
    }

    /// Drops `user`'s entry if nothing refers to it any more.
    fn tidy(&self, user: &str) {
        let mut t = self.table.lock().expect("user table lock");
        if t.users
            .get(user)
            .is_some_and(|u| u.idle(Instant::now(), self.rate))
        {
            t.users.remove(user);
        }
    }

    /// Opens a WebSocket of `user`, or `None` when the user has `max_connections_per_user`.
    pub(crate) fn connect(self: &Arc<Self>, user: &str) -> Option<UserConnection> {
        let ok = self.with(user, |u| {
            if u.connections >= self.max_connections {
                return false;
            }
            u.connections += 1;
            true
        });
        if !ok {
            self.tidy(user);
            return None;
        }
        Some(UserConnection {
            users: Arc::clone(self),
            user: user.to_string(),
        })
    }

    /// Takes one send from `user`'s bucket, or says how long until one is there.
    pub(crate) fn take_send(&self, user: &str) -> Result<(), Duration> {
        let Some((rate, _)) = self.rate else {
            return Ok(());
        };
        self.with(user, |u| {
            if u.tokens >= 1.0 {
                u.tokens -= 1.0;
                Ok(())
            } else {
                Err(Duration::from_secs_f64((1.0 - u.tokens) / rate))
            }
        })
    }

    /// `user`'s commit semaphore (a share of the gateway's permits).
    pub(crate) fn commits(&self, user: &str) -> Arc<Semaphore> {
        self.with(user, |u| Arc::clone(&u.commits))
    }

    /// Called when a holder of `user`'s commit semaphore is done with it.
    pub(crate) fn commits_released(&self, user: &str) {
        self.tidy(user);
    }
}

impl UserState {
    fn idle(&self, now: Instant, rate: Option<(f64, f64)>) -> bool {
        let bucket_full = rate.is_none_or(|(rate, burst)| {
            let dt = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.tokens + dt * rate >= burst
        });
        // The table holds one reference; any other is a commit or a waiter.
        self.connections == 0 && Arc::strong_count(&self.commits) == 1 && bucket_full
    }
}

/// An open WebSocket of a user; the count drops with it.
pub(crate) struct UserConnection {
    users: Arc<Users>,
    user: String,
}

impl Drop for UserConnection {
    fn drop(&mut self) {
        self.users.with(&self.user, |u| {
            u.connections = u.connections.saturating_sub(1)
        });
        self.users.tidy(&self.user);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_capped_per_user_and_released() {
        let users = Arc::new(Users::new(2, 4096, 0, 0.0, 0.0));
        let a1 = users.connect("a").unwrap();
        let _a2 = users.connect("a").unwrap();
        assert!(users.connect("a").is_none());
        let _b = users.connect("b").unwrap();
        drop(a1);
        let _a3 = users.connect("a").unwrap();
        assert_eq!(users.commit_share(), 512);
    }

    #[test]
    fn the_bucket_refills_at_the_rate() {
        let users = Users::new(16, 4096, 0, 20.0, 3.0);
        for _ in 0..3 {
            users.take_send("a").unwrap();
        }
        let wait = users.take_send("a").unwrap_err();
        assert!(wait <= Duration::from_millis(50), "{wait:?}");
        users.take_send("b").unwrap(); // another user's bucket
        std::thread::sleep(Duration::from_millis(60));
        users.take_send("a").unwrap();
        // off: never limited
        let off = Users::new(16, 4096, 0, 0.0, 0.0);
        for _ in 0..10_000 {
            off.take_send("a").unwrap();
        }
        assert!(off.table.lock().unwrap().users.is_empty());
    }

    #[test]
    fn idle_entries_are_dropped() {
        let users = Arc::new(Users::new(16, 64, 4, 0.0, 0.0));
        let c = users.connect("a").unwrap();
        let sem = users.commits("a");
        drop(c);
        assert_eq!(
            users.table.lock().unwrap().users.len(),
            1,
            "a commit holds it"
        );
        drop(sem);
        users.commits_released("a");
        assert!(users.table.lock().unwrap().users.is_empty());
    }
}
