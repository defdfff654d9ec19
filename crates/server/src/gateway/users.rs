//! Per-user limits, so one user cannot take what everybody shares: open WebSockets
//! (`max_connections_per_user`), commits in flight (a per-user share of the gateway's commit
//! permits) and the send rate (a token bucket, off by default).
//!
//! One table, keyed by user id, holds what is live for each user; an entry goes once nothing
//! refers to it (no connection, no commit in flight, a full bucket).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
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
    users: HashMap<Arc<str>, Arc<UserEntry>>,
    /// Sweep idle entries once the table grows to this size.
    sweep_at: usize,
}

/// What is live for one user. Held by the table, by each open connection of the user and by
/// each commit permit of the user's: a send on a connection reaches its user's semaphore and
/// bucket through the connection's handle, without the table's lock or a lookup by name
/// (ADR-0072: three lookups under the table's lock per send were 2 % of the server's CPU).
pub(crate) struct UserEntry {
    name: Arc<str>,
    /// Open WebSockets; changed only under the table's lock, where the cap is checked.
    connections: AtomicUsize,
    /// The user's share of commit permits (held while a send commits or waits in a queue).
    commits: Arc<Semaphore>,
    /// Send tokens and when they were last refilled (touched only with a rate limit).
    bucket: Mutex<Bucket>,
}

struct Bucket {
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

    /// `user`'s entry, created if missing, with the table locked.
    fn entry_locked(&self, t: &mut Table, user: &str) -> Arc<UserEntry> {
        if let Some(e) = t.users.get(user) {
            return Arc::clone(e);
        }
        if t.users.len() >= t.sweep_at {
            let now = Instant::now();
            t.users.retain(|_, u| !UserEntry::idle(u, now, self.rate));
            t.sweep_at = (t.users.len() * 2).max(SWEEP_MIN);
        }
        let name: Arc<str> = Arc::from(user);
        let entry = Arc::new(UserEntry {
            name: Arc::clone(&name),
            connections: AtomicUsize::new(0),
            commits: Arc::new(Semaphore::new(self.commit_share)),
            bucket: Mutex::new(Bucket {
                tokens: self.rate.map_or(0.0, |(_, b)| b),
                refilled: Instant::now(),
            }),
        });
        t.users.insert(name, Arc::clone(&entry));
        entry
    }

    /// A reference to `user`'s entry (created if missing), for a send that has no connection
    /// (HTTP).
    pub(crate) fn user_ref(self: &Arc<Self>, user: &str) -> UserRef {
        let mut t = self.table.lock().expect("user table lock");
        let entry = self.entry_locked(&mut t, user);
        UserRef {
            users: Arc::clone(self),
            entry: Some(entry),
        }
    }

    /// Lets go of `entry`; its table entry goes if nothing refers to it any more. Only the
    /// holder that takes the count to the table's one reference locks the table: while a
    /// connection of the user is open, no release of a commit does.
    fn release(&self, entry: Arc<UserEntry>) {
        let weak: Weak<UserEntry> = Arc::downgrade(&entry);
        let name = Arc::clone(&entry.name);
        drop(entry);
        // A holder that dropped at the same time sees the same count or a lower one: the
        // last one to drop always looks.
        if weak.strong_count() <= 1 {
            self.tidy(&name);
        }
    }

    /// Drops `user`'s entry if nothing refers to it any more.
    fn tidy(&self, user: &str) {
        let mut t = self.table.lock().expect("user table lock");
        if t.users
            .get(user)
            .is_some_and(|u| UserEntry::idle(u, Instant::now(), self.rate))
        {
            t.users.remove(user);
        }
    }

    /// Opens a WebSocket of `user`, or `None` when the user has `max_connections_per_user`.
    pub(crate) fn connect(self: &Arc<Self>, user: &str) -> Option<UserConnection> {
        let entry = {
            let mut t = self.table.lock().expect("user table lock");
            let entry = self.entry_locked(&mut t, user);
            if entry.connections.load(Ordering::Relaxed) >= self.max_connections {
                None
            } else {
                entry.connections.fetch_add(1, Ordering::Relaxed);
                Some(entry)
            }
        };
        match entry {
            Some(entry) => Some(UserConnection {
                user: UserRef {
                    users: Arc::clone(self),
                    entry: Some(entry),
                },
            }),
            None => {
                self.tidy(user);
                None
            }
        }
    }

    /// Takes one send from the bucket of `entry`'s user, or says how long until one is there.
    pub(crate) fn take_send(&self, entry: &UserEntry) -> Result<(), Duration> {
        let Some((rate, burst)) = self.rate else {
            return Ok(());
        };
        let mut b = entry.bucket.lock().expect("user bucket lock");
        let now = Instant::now();
        let dt = now.saturating_duration_since(b.refilled).as_secs_f64();
        b.tokens = (b.tokens + dt * rate).min(burst);
        b.refilled = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rate))
        }
    }
}

impl UserEntry {
    /// The user's commit semaphore (a share of the gateway's permits).
    pub(crate) fn commits(&self) -> &Arc<Semaphore> {
        &self.commits
    }

    /// Nothing refers to `this` but the table (no connection, no commit, no send on its way to
    /// a permit) and its bucket is full. `this` is the table's reference.
    fn idle(this: &Arc<UserEntry>, now: Instant, rate: Option<(f64, f64)>) -> bool {
        if Arc::strong_count(this) != 1
            || this.connections.load(Ordering::Relaxed) != 0
            || Arc::strong_count(&this.commits) != 1
        {
            return false;
        }
        rate.is_none_or(|(rate, burst)| {
            let b = this.bucket.lock().expect("user bucket lock");
            let dt = now.saturating_duration_since(b.refilled).as_secs_f64();
            b.tokens + dt * rate >= burst
        })
    }
}

/// A holder's reference to a user's entry: its drop lets go of the entry properly (the
/// table's entry goes with the last one, [`Users::release`]).
pub(crate) struct UserRef {
    users: Arc<Users>,
    /// `Some` until dropped.
    entry: Option<Arc<UserEntry>>,
}

impl UserRef {
    /// The user's entry.
    pub(crate) fn entry(&self) -> &Arc<UserEntry> {
        self.entry.as_ref().expect("held until dropped")
    }

    /// Another reference to the same entry (two reference counts, no lock).
    pub(crate) fn clone_ref(&self) -> UserRef {
        UserRef {
            users: Arc::clone(&self.users),
            entry: self.entry.clone(),
        }
    }
}

impl Drop for UserRef {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.users.release(entry);
        }
    }
}

/// An open WebSocket of a user; the count drops with it. It holds the user's entry, so the
/// connection's sends reach it without the table ([`UserConnection::user`]).
pub(crate) struct UserConnection {
    user: UserRef,
}

impl UserConnection {
    /// The connection's user.
    pub(crate) fn user(&self) -> &UserRef {
        &self.user
    }
}

impl Drop for UserConnection {
    fn drop(&mut self) {
        // under the lock, like the cap's check; then `user` lets go of the entry
        let _t = self.user.users.table.lock().expect("user table lock");
        self.user
            .entry()
            .connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(users: &Users) -> usize {
        users.table.lock().unwrap().users.len()
    }

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
        let users = Arc::new(Users::new(16, 4096, 0, 20.0, 3.0));
        let a = users.user_ref("a");
        for _ in 0..3 {
            users.take_send(a.entry()).unwrap();
        }
        let wait = users.take_send(a.entry()).unwrap_err();
        assert!(wait <= Duration::from_millis(50), "{wait:?}");
        // another user's bucket
        users.take_send(users.user_ref("b").entry()).unwrap();
        std::thread::sleep(Duration::from_millis(60));
        users.take_send(a.entry()).unwrap();
        // a connection's handle and a lookup by name reach the same bucket
        let c = users.connect("c").unwrap();
        for _ in 0..3 {
            users.take_send(c.user().entry()).unwrap();
        }
        assert!(users.take_send(users.user_ref("c").entry()).is_err());
        // off: never limited
        let off = Arc::new(Users::new(16, 4096, 0, 0.0, 0.0));
        let a = off.user_ref("a");
        for _ in 0..10_000 {
            off.take_send(a.entry()).unwrap();
        }
        drop(a);
        assert_eq!(entries(&off), 0);
    }

    #[test]
    fn idle_entries_are_dropped() {
        let users = Arc::new(Users::new(16, 64, 4, 0.0, 0.0));
        let c = users.connect("a").unwrap();
        // a commit of the connection's, as a send's permit holds it
        let commit = c.user().clone_ref();
        let permit = Arc::clone(commit.entry().commits())
            .try_acquire_owned()
            .unwrap();
        drop(c);
        assert_eq!(entries(&users), 1, "a commit holds it");
        drop(permit);
        assert_eq!(entries(&users), 1, "its reference holds it");
        drop(commit);
        assert_eq!(entries(&users), 0);
        // a full bucket is idle; one being refilled is kept for its user's next connection
        let limited = Arc::new(Users::new(16, 64, 4, 1.0, 2.0));
        let r = limited.user_ref("a");
        limited.take_send(r.entry()).unwrap();
        drop(r);
        assert_eq!(entries(&limited), 1, "the bucket is not full");
    }

    /// Connections and commits of one user come and go on several threads at once: when all
    /// are gone the entry is gone (the last holder to let go always looks at the table), and
    /// while one is held the count of connections is right.
    #[test]
    fn the_last_holder_lets_the_entry_go_under_concurrency() {
        let users = Arc::new(Users::new(1_000, 4096, 0, 0.0, 0.0));
        for round in 0..50 {
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let users = Arc::clone(&users);
                    std::thread::spawn(move || {
                        for i in 0..200 {
                            let c = users.connect("a").unwrap();
                            let refs: Vec<_> =
                                (0..(i + t) % 4).map(|_| c.user().clone_ref()).collect();
                            if i % 2 == 0 {
                                drop(c);
                                drop(refs);
                            } else {
                                drop(refs);
                                drop(c);
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(entries(&users), 0, "round {round}: an idle entry was left");
        }
        let c = users.connect("a").unwrap();
        assert_eq!(c.user().entry().connections.load(Ordering::Relaxed), 1);
    }
}
