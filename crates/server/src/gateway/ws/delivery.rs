//! The delivery loop of a connection: pushes every visible mailbox entry after the cursor, in
//! seq order, then waits for a wake hint (or a wake of every connection of its shard, see
//! `gateway::wake`), a `sync`, or the optional re-check tick.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tidemark_protocol::{ErrorCode, ServerFrame};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::going_away::GoingAway;
use super::outbox::{Out, Outbox};
use super::{error_frame, until_cancelled, PAGE};
use crate::gateway::http::largest_entry;
use crate::gateway::mailbox::{Mailbox, PageSizer};
use crate::gateway::state::Shared;
use crate::gateway::wake::{LocalEntry, LocalRun, LocalRuns};
use tidemark_protocol::entry::Entry;

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
    mut local: LocalRuns,
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
    // Every entry of the mailbox at or below `seen` has been pushed (or acked): the end of
    // the last complete read, or of the last local run taken (ADR-0041). `cursor <= seen`.
    let mut seen = cursor;
    // `seen` was last moved by a local run: a hint up to it needs no read.
    let mut seen_local = false;
    // The hub's count of wakes of every connection, as last looked at.
    let mut woke_all_seen = shared.hub.woke_all_times();
    let mut failing = false;
    let mut retry_after = READ_RETRY_FIRST;
    // Woken by a hint: read up to the hinted lowest W without reading the watermark (one
    // command instead of a pipeline of two), once a full read has shown the lane present.
    let mut hinted = false;
    let mut lane_present = false;
    let push = |out: Out| until_cancelled(&conn, tx.send(out));
    // registered once, not per wait (see `until_cancelled`), and no lock per poll (ADR-0073)
    let going_away = GoingAway::new(conn.clone());
    tokio::pin!(going_away);
    // Pages of about what the queue holds: a client that does not read holds little.
    let target = shared
        .opts
        .max_page_bytes
        .min(shared.opts.max_queued_bytes)
        .max(1);
    let mut sizer = PageSizer::new(PAGE, target, largest_entry(&shared.opts.limits));
    // false after local runs alone: nothing to read
    let mut need_read = true;
    // What this connection has caught up to, for the hub's sweep (ADR-0067).
    let progress = local.progress.clone();
    loop {
        // the first read after a wait: one the sweep forced (below) that finds entries means
        // a wake was given and not acted on
        let mut first_read = true;
        // Read until caught up with what is visible.
        'read: loop {
            if !need_read {
                break 'read;
            }
            // the sweep found this connection below what it was owed a whole sweep ago: read
            // in full, trusting no hint and no local run
            let forced = progress.recheck.swap(false, Ordering::AcqRel);
            if let Some(after) = latest_sync(&mut sync_rx) {
                cursor = after;
                (seen, seen_local) = (after, false);
            }
            let bound = shared.hub.hinted_w(mailbox.route.shard);
            // a wake of every connection (a subscriber came back: hints were lost) is never
            // taken as covered
            let woke_all = shared.hub.woke_all_times();
            let all_woken = woke_all != woke_all_seen;
            woke_all_seen = woke_all;
            // a local run already took this connection past the hinted W: nothing to read,
            // unless a run was lost since (dropped, or not decodable: the wake that says so
            // comes before the move's hint, which is then handed and wakes no one; ADR-0111)
            if hinted
                && lane_present
                && seen_local
                && !all_woken
                && !forced
                && bound <= seen
                && !local.lost.load(Ordering::Acquire)
            {
                break 'read;
            }
            // A run lost before here is covered by a full read (the lane's W is at or past
            // the end of every run handed out, which were applied before); one lost from
            // here on sets the flag again.
            let lost = local.lost.swap(false, Ordering::AcqRel);
            // A wake of every connection (a resubscription: hints were lost) says nothing of
            // W: the hinted W is from before, and the lost hints' moves are above it. Reading
            // only up to it found nothing, and the next hint, first of the new subscription,
            // showed no gap: the entry waited for the user's next one (a chaos run's delivery
            // missing after 120 s of quiet).
            let use_hint =
                hinted && lane_present && !lost && !forced && !all_woken && bound > cursor;
            // a connection whose reads were failing was behind for that reason, not a lost wake
            let was_failing = failing;
            let page = tokio::select! {
                _ = &mut going_away => return,
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
                    if let Some(upto) = p.complete_to {
                        seen = seen.max(upto);
                        seen_local = false;
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
            if forced && first_read && !was_failing && !page.entries.is_empty() {
                // what the sweep is for: the entries were owed and the wake did not bring them
                metrics::counter!("tidemark_wake_sweep_recovered_total").increment(1);
                tracing::warn!(
                    user = %mailbox.user,
                    shard = mailbox.route.shard,
                    seen,
                    entries = page.entries.len(),
                    "the wake sweep found entries a wake did not deliver"
                );
            }
            first_read = false;
            for entry in page.entries {
                if let Ok(e) = &entry {
                    delivery_fault(&shared, &mailbox.user, e.seq);
                }
                let out = match entry {
                    Ok(e) => (e.seq, deliver(e, &mut highest, connected_at_us)),
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
                seen = seen.max(cursor);
                if !sync_rx.is_empty() {
                    continue 'read; // restart after the seq the client named
                }
            }
            if !page.more {
                break 'read;
            }
        }
        hinted = false;
        need_read = true;
        progress.seen.store(seen, Ordering::Release);
        tokio::select! {
            // local runs first: a hint that follows a run then finds nothing to read
            biased;
            _ = &mut going_away => return,
            Some(run) = local.recv() => {
                // runs that continue what this connection has seen are pushed as they are;
                // otherwise (a run lost, a move not handed here) the mailbox is read
                let mut next = Some(run);
                need_read = false;
                while let Some(run) = next.take() {
                    let lost = local.lost.load(Ordering::Acquire);
                    let Some(entries) = take_run(&mut seen, &mut seen_local, run, lost) else {
                        need_read = true;
                        break;
                    };
                    for e in entries {
                        delivery_fault(&shared, &mailbox.user, e.seq);
                        cursor = e.seq;
                        if !push(deliver_local(e, &mut highest, connected_at_us)).await {
                            return;
                        }
                    }
                    if !sync_rx.is_empty() {
                        need_read = true; // restart after the seq the client named
                        break;
                    }
                    next = local.try_recv();
                }
            }
            _ = notify.notified() => {
                if ignore_wake(&shared, &mailbox.user, progress.recheck.load(Ordering::Acquire)) {
                    need_read = false;
                } else {
                    hinted = true;
                }
            }
            _ = async { tick.as_mut().expect("only polled with a tick").tick().await }, if tick.is_some() => {}
            // a failed read is retried by itself (no hint may come: the quiet path)
            _ = tokio::time::sleep(retry_after), if failing => {
                retry_after = (retry_after * 2).min(READ_RETRY_MAX);
            }
            s = sync_rx.recv() => match s {
                Some(after) => {
                    cursor = latest_sync(&mut sync_rx).unwrap_or(after);
                    (seen, seen_local) = (cursor, false);
                }
                None => return,
            },
        }
    }
}

/// Takes a local run (ADR-0041) on a connection that has seen every entry up to `seen`:
/// the entries to push (those above `seen`; `seen` moves to the run's end), or `None` when
/// the run cannot be trusted and the mailbox must be read: a run was lost (`lost`), or the
/// run's chain starts above `seen` (a move this connection was not handed).
fn take_run(
    seen: &mut u64,
    by_run: &mut bool,
    run: LocalRun,
    lost: bool,
) -> Option<Vec<LocalEntry>> {
    if lost || run.chain_from > *seen {
        return None;
    }
    let from = *seen;
    if run.to > *seen {
        (*seen, *by_run) = (run.to, true);
    }
    Some(run.entries.into_iter().filter(|e| e.seq > from).collect())
}

/// Panics when a test's fault says so ([`SendFault::panic_delivery`](crate::gateway::SendFault::panic_delivery)).
fn delivery_fault(shared: &Shared, user: &str, seq: u64) {
    if let Some(f) = &shared.opts.send_fault {
        assert!(!f.panic_delivery(user, seq), "delivery fault: {user} {seq}");
    }
}

/// Whether a test's fault drops this wake ([`SendFault::ignore_wake`](crate::gateway::SendFault::ignore_wake)).
fn ignore_wake(shared: &Shared, user: &str, forced: bool) -> bool {
    shared
        .opts
        .send_fault
        .as_ref()
        .is_some_and(|f| f.ignore_wake(user, forced))
}

/// The deliver frame of `e` (read from the mailbox), counted, its latency measured when it
/// is live.
fn deliver(e: Entry, highest: &mut u64, connected_at_us: u64) -> Out {
    count_delivery(e.seq, e.sent_at_us, highest, connected_at_us);
    Out::Deliver {
        seq: e.seq,
        text: ServerFrame::Deliver(e).to_json().into(),
    }
}

/// The deliver frame of a local run's entry (serialised once by the hub), counted, its
/// latency measured when it is live.
fn deliver_local(e: LocalEntry, highest: &mut u64, connected_at_us: u64) -> Out {
    count_delivery(e.seq, e.sent_at_us, highest, connected_at_us);
    Out::Deliver {
        seq: e.seq,
        text: e.frame,
    }
}

/// Counts a delivery of `seq`, and measures its latency when it is live: an entry committed
/// before this connection opened is a replay (a reconnect, a late reader), whose age says
/// nothing about the delivery path; so is one at or below the highest seq pushed.
fn count_delivery(seq: u64, sent_at_us: u64, highest: &mut u64, connected_at_us: u64) {
    if seq > *highest {
        *highest = seq;
        if sent_at_us >= connected_at_us {
            let lat = now_us().saturating_sub(sent_at_us) as f64 / 1e6;
            crate::telemetry::hot().delivery_latency_seconds.record(lat);
        }
    }
    crate::telemetry::hot().deliveries.increment(1);
}

/// The last of the queued `sync`s, if any.
fn latest_sync(rx: &mut mpsc::Receiver<u64>) -> Option<u64> {
    let mut last = None;
    while let Ok(a) = rx.try_recv() {
        last = Some(a);
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> LocalEntry {
        LocalEntry::new(Entry {
            seq,
            from: "alice".into(),
            body: format!("m{seq}"),
            sent_at_us: 1,
        })
    }

    fn run(chain_from: u64, to: u64, seqs: &[u64]) -> LocalRun {
        LocalRun {
            chain_from,
            to,
            entries: seqs.iter().map(|&s| entry(s)).collect(),
            bytes: 0,
        }
    }

    fn seqs(v: Option<Vec<LocalEntry>>) -> Option<Vec<u64>> {
        v.map(|v| v.into_iter().map(|e| e.seq).collect())
    }

    #[test]
    fn runs_are_taken_only_where_they_continue_what_was_seen() {
        let (mut seen, mut by_run) = (10, false);
        // a chain that starts at or below what was seen: its entries above it
        assert_eq!(
            seqs(take_run(
                &mut seen,
                &mut by_run,
                run(4, 14, &[9, 12, 14]),
                false
            )),
            Some(vec![12, 14])
        );
        assert_eq!((seen, by_run), (14, true));
        // a run wholly seen: nothing, nothing moves back
        assert_eq!(
            seqs(take_run(&mut seen, &mut by_run, run(4, 12, &[12]), false)),
            Some(vec![])
        );
        assert_eq!(seen, 14);
        // a chain that starts above what was seen (a move not handed here): read instead
        assert_eq!(
            seqs(take_run(&mut seen, &mut by_run, run(15, 20, &[20]), false)),
            None
        );
        assert_eq!(seen, 14);
        // a lost run: even a run of the same chain is not trusted until a read
        assert_eq!(
            seqs(take_run(&mut seen, &mut by_run, run(4, 20, &[20]), true)),
            None
        );
        assert_eq!(seen, 14);
    }
}
