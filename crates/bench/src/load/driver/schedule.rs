//! The open-loop scheduler: message `i` is queued at its intended time `t0 + i / rate`
//! (never waiting for an ack) from client `i % clients` to `fanout` distinct other clients
//! drawn by a seeded RNG ([`pick`]: same seed, same traffic). Each ack is awaited by its own
//! task until the end of the window; a scheduler that falls behind sends late, and its
//! largest lag is returned, while latency still counts from the intended time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::ClientHandle;
use tokio::time::{sleep_until, Instant};

use super::shared::{record, Shared};
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
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut max_lag = Duration::ZERO;
    let n = opts.clients;
    for i in 0..shared.total {
        let intended = shared.intended(i);
        if intended > Instant::now() {
            sleep_until(intended).await;
        }
        let from = (i % n as u64) as usize;
        let to: Vec<String> = pick(&mut rng, n, from, opts.fanout)
            .into_iter()
            .map(|r| users[r].clone())
            .collect();
        let id = format!("m{i}");
        let body = format!("i:{i}");
        let result = handles[from].start_send(&id, &to, &body).await;
        max_lag = max_lag.max(Instant::now().saturating_duration_since(intended));
        sent.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(pending) => {
                shared.outstanding.fetch_add(1, Ordering::Relaxed);
                let shared = shared.clone();
                tokio::spawn(async move {
                    let left = shared.deadline.saturating_duration_since(Instant::now());
                    match pending.wait(left).await {
                        Ok(_) => {
                            let now = Instant::now();
                            record(&shared.send_ack, now.saturating_duration_since(intended));
                            shared.acks.arrived(now);
                        }
                        Err(e) => shared.error(e.code()),
                    }
                    shared.outstanding.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Err(e) => shared.error(e.code()),
        }
    }
    max_lag
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
