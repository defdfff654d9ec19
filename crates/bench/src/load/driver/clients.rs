//! The clients of a run: their user names (unique to the run), connecting them all before
//! the first send ([`connect_all`], a bounded number at a time, retryable failures retried),
//! and each client's receiving task ([`receive`]: deliveries and their e2e latency, the
//! answers to its own sends and their SEND_ACK latency, periodic acks, error frames).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tidemark_client::{Auth, Client, Event};
use tokio::time::{sleep, sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use super::progress::bar;
use super::shared::{lock, record, Shared};
use super::Setup;
use crate::load::{bump, Error, LoadOptions};

/// Clients connecting at once.
const CONNECT_CONCURRENCY: usize = 32;
/// Attempts per client connection (retryable failures only).
const CONNECT_ATTEMPTS: usize = 3;
/// How often a receiver acks the highest seq it processed (at most).
const ACK_EVERY: Duration = Duration::from_millis(100);

/// Users unique to this run, so a remote deployment's older mailboxes never interfere.
pub(super) fn run_users(clients: usize) -> Vec<String> {
    let tag = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64 & 0xff_ffff)
        .unwrap_or(0);
    (0..clients).map(|i| format!("lg{tag:06x}-{i}")).collect()
}

/// Connects a client for each of `users`, in order, with a progress bar.
pub(super) async fn connect_all(
    opts: &LoadOptions,
    setup: &Setup,
    users: &[String],
) -> Result<Vec<Client>, Error> {
    let ttl = opts.duration + opts.drain_grace + Duration::from_secs(3600);
    let auth_of = |user: &str| match &setup.token_secret {
        Some(secret) => Auth::Token(
            tidemark_client::make_token(secret, user, ttl)
                .expect("a run's token lifetime is non-zero and far from overflowing"),
        ),
        None => Auth::DevUser(user.to_owned()),
    };

    let pb = bar(
        opts,
        opts.clients as u64,
        "{prefix} [{bar:30}] {pos}/{len} clients",
    );
    pb.set_prefix(format!("{} connecting", setup.layout));
    let mut connected: Vec<Option<Client>> = (0..opts.clients).map(|_| None).collect();
    {
        let mut stream = futures::stream::iter(users.iter().enumerate())
            .map(|(i, user)| {
                let auth = auth_of(user);
                let url = setup.ws_urls[i % setup.ws_urls.len()].clone();
                async move { (i, connect_one(&url, &auth, user).await) }
            })
            .buffer_unordered(CONNECT_CONCURRENCY);
        while let Some((i, result)) = stream.next().await {
            connected[i] = Some(result?);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    Ok(connected
        .into_iter()
        .map(|c| c.expect("connected"))
        .collect())
}

async fn connect_one(url: &str, auth: &Auth, user: &str) -> Result<Client, Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match Client::connect(url, auth).await {
            Ok(c) => return Ok(c),
            Err(e) if e.retryable() && attempt < CONNECT_ATTEMPTS => {
                sleep(Duration::from_millis(200 * attempt as u64)).await;
            }
            Err(source) => {
                return Err(Error::Client {
                    user: user.to_owned(),
                    source,
                })
            }
        }
    }
}

/// One client's receiving side (client `index`): deliveries (e2e latency, window count),
/// the answers to its own sends (SEND_ACK latency, or the error's code), periodic acks of
/// what was delivered, other error frames.
pub(super) async fn receive(
    mut client: Client,
    index: usize,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let handle = client.handle();
    let mut highest = client.ready_after();
    // the messages this client got, by index: one delivered again under another seq (an
    // exactly-once failure) is an error, not a second delivery that could make up for a
    // lost one in the delivered share
    let mut got = std::collections::HashSet::new();
    let mut unacked: Option<u64> = None;
    let mut last_ack = Instant::now();
    // One timer, set when something is first left unacked (not one per event).
    let ack_timer = sleep_until(last_ack);
    tokio::pin!(ack_timer);
    loop {
        let event = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            e = client.next_event() => e,
            _ = &mut ack_timer, if unacked.is_some() => {
                if let Some(seq) = unacked.take() {
                    let _ = handle.ack(seq).await;
                }
                last_ack = Instant::now();
                continue;
            }
        };
        match event {
            Some(Event::Deliver(entry)) => {
                let now = Instant::now();
                if entry.seq <= highest {
                    continue; // a repeat (at least once on the wire)
                }
                highest = entry.seq;
                if unacked.replace(entry.seq).is_none() {
                    ack_timer.as_mut().reset(last_ack + ACK_EVERY);
                }
                match entry
                    .body
                    .strip_prefix("i:")
                    .and_then(|n| n.parse::<u64>().ok())
                    .filter(|&n| n < shared.total)
                {
                    Some(i) if !got.insert(i) => shared.error("duplicate"),
                    Some(i) if now <= shared.deadline => {
                        shared.record_e2e(i, now.saturating_duration_since(shared.intended(i)));
                        shared.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(_) => {} // after the window
                    None => shared.error("foreign_body"),
                }
            }
            Some(Event::SendAck { id, .. }) => {
                let now = Instant::now();
                // An ack after the window: its send counts as timed out.
                if let Some(i) = shared.message_of(&id).filter(|_| now <= shared.deadline) {
                    record(
                        &shared.send_ack,
                        now.saturating_duration_since(shared.intended(i)),
                    );
                    shared.acks.arrived(now);
                    shared.answered(index);
                }
            }
            Some(Event::Error { code, id, .. }) => {
                shared.error(&code);
                let ours = id.as_deref().and_then(|id| shared.message_of(id));
                if ours.is_some() && Instant::now() <= shared.deadline {
                    shared.answered(index);
                }
            }
            Some(Event::Closed) | None => {
                if !shared.stopping.load(Ordering::SeqCst) {
                    // the connection, and every send of it still unanswered
                    bump(
                        &mut lock(&shared.errors),
                        "closed",
                        1 + shared.closed(index),
                    );
                }
                break;
            }
        }
    }
    // Dropping the client aborts its tasks: no close handshake needed at the end of a run.
    drop(client);
}
