//! The open-loop scheduler: message `i` is queued at its intended time `t0 + i / rate`
//! (never waiting for an ack) from client `i % clients` to `fanout` distinct other clients
//! drawn by a seeded RNG ([`pick`]: same seed, same traffic). A scheduler that falls behind
//! sends late, and its largest lag is returned, while latency still counts from the
//! intended time.
//!
//! The generator is part of what a local run measures, so a send costs as little as it can:
//! the frame is written straight into one string from the recipients' names, JSON-quoted
//! once per run ([`Frames`]), and nobody waits for its answer here: the `send_ack` (or the
//! `error` with its id) comes back on the sender's event stream, which its receiving task
//! reads anyway (`clients.rs`), so there is no task, timer or waiter per message.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::ClientHandle;
use tokio::time::{sleep_until, Instant};

use super::shared::Shared;
use crate::load::LoadOptions;

/// Sends the run's `shared.total` messages from `handles` (one per user of `users`),
/// counting each in `sent`; returns how late the scheduler was at worst.
pub(super) async fn send_all(
    opts: &LoadOptions,
    shared: &Arc<Shared>,
    users: &[String],
    handles: &[ClientHandle],
    sent: &AtomicU64,
) -> Duration {
    let frames = Frames::new(users);
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut max_lag = Duration::ZERO;
    let n = opts.clients;
    for i in 0..shared.total {
        let intended = shared.intended(i);
        if intended > Instant::now() {
            sleep_until(intended).await;
        }
        let from = (i % n as u64) as usize;
        let to = pick(&mut rng, n, from, opts.fanout);
        let frame = frames.send(i, &to);
        shared.queued(from);
        let result = handles[from].send_raw_text(frame).await;
        max_lag = max_lag.max(Instant::now().saturating_duration_since(intended));
        sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = result {
            shared.answered(from);
            shared.error(e.code());
        }
    }
    max_lag
}

/// The `send` frames of a run: every user's name as a JSON string, quoted once.
pub(super) struct Frames {
    quoted: Vec<String>,
}

impl Frames {
    pub(super) fn new(users: &[String]) -> Frames {
        Frames {
            quoted: users
                .iter()
                .map(|u| serde_json::to_string(u).expect("a string serialises"))
                .collect(),
        }
    }

    /// `{"type":"send","id":"m<i>","to":[…],"body":"i:<i>"}` to the users at `to`.
    pub(super) fn send(&self, i: u64, to: &[usize]) -> String {
        let names: usize = to.iter().map(|&r| self.quoted[r].len() + 1).sum();
        let mut s = String::with_capacity(64 + names);
        s.push_str(r#"{"type":"send","id":"m"#);
        let _ = write!(s, "{i}");
        s.push_str(r#"","to":["#);
        for (k, &r) in to.iter().enumerate() {
            if k > 0 {
                s.push(',');
            }
            s.push_str(&self.quoted[r]);
        }
        s.push_str(r#"],"body":"i:"#);
        let _ = write!(s, "{i}");
        s.push_str(r#""}"#);
        s
    }
}

/// `k` distinct clients out of `n`, none of them `from`.
pub(super) fn pick(rng: &mut StdRng, n: usize, from: usize, k: usize) -> Vec<usize> {
    let skip = |j: usize| if j >= from { j + 1 } else { j };
    if k == 1 {
        return vec![skip(rng.random_range(0..n - 1))];
    }
    rand::seq::index::sample(rng, n - 1, k)
        .into_iter()
        .map(skip)
        .collect()
}
