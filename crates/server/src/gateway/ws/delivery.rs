//! The delivery loop of a connection: pushes every visible mailbox entry after the cursor, in
//! seq order, then waits for a wake hint (or a wake of every connection of its shard, see
//! `gateway::wake`), a `sync`, or the optional re-check tick.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tidemark_protocol::{ErrorCode, ServerFrame};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::outbox::{Out, Outbox};
use super::{error_frame, until_cancelled, PAGE};
use crate::gateway::http::largest_entry;
use crate::gateway::mailbox::{Mailbox, PageSizer};
use crate::gateway::state::Shared;

/// A failed mailbox read (or ack write, `reader.rs`) is retried after this, doubling up to
/// [`READ_RETRY_MAX`].
pub(super) const READ_RETRY_FIRST: Duration = Duration::from_millis(200);
pub(super) const READ_RETRY_MAX: Duration = Duration::from_secs(5);

pub(super) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Pushes the mailbox to the client: every visible entry after the cursor, in seq order,
/// then waits for a hint, the re-check tick or a `sync`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn delivery_loop(
    shared: Arc<Shared>,
    mut mailbox: Mailbox,
    mut cursor: u64,
    notify: Arc<Notify>,
    mut sync_rx: mpsc::Receiver<u64>,
    tx: Outbox,
    conn: CancellationToken,
    connected_at_us: u64,
) {
    // no periodic re-read unless asked for (ADR-0035: hints cannot be missed unnoticed)
    let mut tick = match shared.opts.recheck_interval {
        Some(every) => {
            let mut t = tokio::time::interval(every.max(Duration::from_millis(10)));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t.tick().await;
            Some(t)
        }
        None => None,
    };
    // Highest seq pushed so far (latency is measured once per entry and connection).
    let mut highest = cursor;
    let mut failing = false;
    let mut retry_after = READ_RETRY_FIRST;
    // Woken by a hint: read up to the hinted lowest W without reading the watermark (one
    // command instead of a pipeline of two), once a full read has shown the lane present.
    let mut hinted = false;
    let mut lane_present = false;
    let push = |out: Out| until_cancelled(&conn, tx.send(out));
    // Pages of about what the queue holds: a client that does not read holds little.
    let target = shared
        .opts
        .max_page_bytes
        .min(shared.opts.max_queued_bytes)
        .max(1);
    let mut sizer = PageSizer::new(PAGE, target, largest_entry(&shared.opts.limits));
    loop {
        // Read until caught up with what is visible.
        'read: loop {
            if let Some(after) = latest_sync(&mut sync_rx) {
                cursor = after;
            }
            let bound = shared.hub.hinted_w(mailbox.route.shard);
            let use_hint = hinted && lane_present && bound > cursor;
            let page = tokio::select! {
                _ = conn.cancelled() => return,
                p = async {
                    if use_hint {
                        mailbox.read_hinted(cursor, bound, sizer.count(), target).await
                    } else {
                        mailbox.read_visible(cursor, sizer.count(), target).await
                    }
                } => p,
            };
            let page = match page {
                Ok(p) => {
                    failing = false;
                    retry_after = READ_RETRY_FIRST;
                    sizer.observe(p.entries.len(), p.bytes);
                    if !use_hint {
                        lane_present = p.lane_present;
                    }
                    p
                }
                Err(e) => {
                    tracing::warn!(user = %mailbox.user, error = %e, "mailbox read failed; retrying");
                    if !failing {
                        failing = true;
                        if !push(error_frame(
                            ErrorCode::Internal,
                            "mailbox read failed; delivery resumes by itself",
                            None,
                        ))
                        .await
                        {
                            return;
                        }
                    }
                    break 'read;
                }
            };
            for entry in page.entries {
                let out = match entry {
                    Ok(e) => {
                        let seq = e.seq;
                        // latency of live deliveries only: an entry committed before this
                        // connection opened is a replay (a reconnect, a late reader), whose
                        // age says nothing about the delivery path
                        if seq > highest {
                            highest = seq;
                            if e.sent_at_us >= connected_at_us {
                                let lat = now_us().saturating_sub(e.sent_at_us) as f64 / 1e6;
                                metrics::histogram!("tidemark_delivery_latency_seconds")
                                    .record(lat);
                            }
                        }
                        metrics::counter!("tidemark_deliveries_total").increment(1);
                        (
                            seq,
                            Out::Deliver {
                                seq,
                                text: ServerFrame::Deliver(e).to_json(),
                            },
                        )
                    }
                    Err(seq) => (
                        seq,
                        error_frame(
                            ErrorCode::Internal,
                            format!("mailbox entry {seq} is unreadable and was skipped"),
                            None,
                        ),
                    ),
                };
                if !push(out.1).await {
                    return;
                }
                cursor = out.0;
                if !sync_rx.is_empty() {
                    continue 'read; // restart after the seq the client named
                }
            }
            if !page.more {
                break 'read;
            }
        }
        hinted = false;
        tokio::select! {
            _ = conn.cancelled() => return,
            _ = notify.notified() => hinted = true,
            _ = async { tick.as_mut().expect("only polled with a tick").tick().await }, if tick.is_some() => {}
            // a failed read is retried by itself (no hint may come: the quiet path)
            _ = tokio::time::sleep(retry_after), if failing => {
                retry_after = (retry_after * 2).min(READ_RETRY_MAX);
            }
            s = sync_rx.recv() => match s {
                Some(after) => cursor = latest_sync(&mut sync_rx).unwrap_or(after),
                None => return,
            },
        }
    }
}

/// The last of the queued `sync`s, if any.
fn latest_sync(rx: &mut mpsc::Receiver<u64>) -> Option<u64> {
    let mut last = None;
    while let Ok(a) = rx.try_recv() {
        last = Some(a);
    }
    last
}
