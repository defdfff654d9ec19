//! After each step: one wake hint per shard that moved (pipelined per mailbox instance), and
//! once a second per shard (every `gc_idle_interval` while the shard is quiet: caught up,
//! nothing pending, held or retrying) `gc_completed_dispatch`, the head checked against W and
//! the log checked to continue from W. The log's trim to the lowest W is queued and sent with
//! other shards' trims in one call (ADR-0088: one `fdatasync` of core Redis for many).

use std::time::Instant;

use tidemark_store::redis::store::Gc;
use tidemark_store::redis::watermark::U48_MAX;
use tidemark_store::wake::{publish_wake, HintSeq, WakeHint};

use super::stall::MAILBOX_CALL_TIMEOUT;
use super::worker::Worker;
use super::{Error, GC_SHARDS_PER_LOOP};
use crate::health::ShardStatus;

impl Worker {
    pub(super) async fn publish_and_gc(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        // one pipeline of PUBLISH per mailbox instance, not one round trip per shard
        // indexed by the instance's number (a `Vec`, not a map built per step: ADR-0078)
        let mut pubs: Vec<Vec<(u32, WakeHint)>> = Vec::new();
        let mut gc_due = Vec::new();
        // per mailbox instance: every hint goes out now (ADR-0047: anything but a process
        // whose own gateway was handed the moves as local runs, alone on the instance's
        // channels, between two flushes)
        let local = self.opts.local.is_some();
        let linger = self.opts.hint_linger;
        let flush: Vec<bool> = self
            .hint_pace
            .iter()
            .map(|p| {
                !local
                    || p.others
                    || linger.is_zero()
                    || p.waiting_since.is_some_and(|t| now >= t + linger)
            })
            .collect();
        let mut deferred = 0u64;
        // A shard is due when its last GC is at or before these (one subtraction per step,
        // not a `duration_since` per shard: that was 2 % of the server's instructions at
        // 300 msg/s, 64 shards a step); `None` (the clock is younger than the interval):
        // none is due, as no interval has passed.
        let busy_cut = now.checked_sub(self.opts.gc_interval);
        let quiet_cut = now.checked_sub(self.opts.gc_idle_interval.max(self.opts.gc_interval));
        for sh in self.owned.values_mut() {
            // a shard with nothing going on is collected slowly (the idle cost, issue 15)
            if sh.moved || !sh.pending.is_empty() || sh.retry.is_some() || sh.held.is_some() {
                sh.quiet = false;
            }
            // a shard stopped in this step may still have moved before: hint it. Its health
            // is updated for every move; a shard whose hint the last pass deferred and that
            // has not moved since (its W is the one shown, and nothing unhanded came) is not
            // updated again on every step until the flush (ADR-0077)
            let carried = sh.deferred && !sh.unhanded && sh.shown_w == Some(sh.min_w);
            if sh.moved && !carried {
                sh.shown_w = Some(sh.min_w);
                let min_w = sh.min_w;
                self.health.update(sh.shard, |h| {
                    h.min_w = min_w;
                    h.last_progress = now;
                });
            }
            sh.deferred = sh.moved && !sh.unhanded && !flush[sh.mb];
            if sh.deferred {
                // handed to this process's connections; no one else listens: at the flush
                deferred += 1;
                self.hint_pace[sh.mb].waiting_since.get_or_insert(now);
            } else if sh.moved {
                sh.moved = false;
                sh.unhanded = false;
                let touched = std::mem::take(&mut sh.touched);
                // numbered per shard (ADR-0035): a gateway that sees a number skipped, another
                // epoch or a 0 (a new claim) re-checks every connection of the shard
                let seq = HintSeq {
                    epoch: sh.epoch,
                    seq: sh.hint_seq,
                };
                sh.hint_seq += 1;
                let lost = self
                    .opts
                    .fault
                    .as_ref()
                    .is_some_and(|f| f.lose_hint(sh.shard, seq.seq));
                if !lost {
                    super::grown_to(&mut pubs, sh.mb).push((
                        sh.shard,
                        WakeHint {
                            min_w: sh.min_w,
                            seq: Some(seq),
                            recipients: touched.into_iter().collect(),
                        },
                    ));
                }
            }
            // stopped shards too: their head and lag stay live (messages still wait there)
            // (never a shard whose lease is no longer ours: trimming writes the core log)
            let ours = self
                .opts
                .lease_gate
                .as_ref()
                .is_none_or(|g| g.may_write(sh.shard));
            let cut = if sh.quiet && !sh.stopped {
                quiet_cut
            } else {
                busy_cut
            };
            // not on an instance left alone for not answering (ADR-0129): its shards stay due,
            // and are collected once it answers, without taking the others' turns meanwhile
            if ours && cut.is_some_and(|cut| sh.last_gc <= cut) && !self.stalls.stalled(sh.mb, now)
            {
                gc_due.push((sh.last_gc, sh.shard));
            }
        }
        // a few shards per loop (oldest first), so GC round trips never stall a batch
        gc_due.sort_unstable();
        gc_due.truncate(GC_SHARDS_PER_LOOP);
        let gc_due: Vec<u32> = gc_due.into_iter().map(|(_, s)| s).collect();
        for s in &gc_due {
            if let Some(sh) = self.owned.get_mut(s) {
                sh.last_gc = now;
            }
        }
        if deferred > 0 {
            crate::telemetry::hot()
                .wake_hints_deferred
                .increment(deferred);
        }
        for (pace, due) in self.hint_pace.iter_mut().zip(&flush) {
            if *due {
                pace.waiting_since = None;
            }
        }
        for (mb, hints) in pubs.into_iter().enumerate() {
            if hints.is_empty() {
                continue;
            }
            // bounded (ADR-0129); an instance left alone for not answering keeps its hints
            let call = publish_wake(&self.mailboxes[mb], &hints);
            let published = self.stalls.within(mb, MAILBOX_CALL_TIMEOUT, call).await;
            if let Some(Ok(reached)) = published {
                // more than this process's own gateway (one subscription per instance)
                self.hint_pace[mb].others = reached > u64::from(local);
            } else {
                // not published: merged into the next hint of each shard (its recipients are
                // kept, the next loop publishes again), so no recipient goes unnamed; the
                // numbers already spent show the gateways a gap, which is safe either way
                if let Some(Err(e)) = published {
                    tracing::debug!(error = %e, "wake hints not published; merged into the next");
                    metrics::counter!("tidemark_errors_total", "code" => "wake_publish")
                        .increment(1);
                }
                for (s, hint) in hints {
                    if let Some(sh) = self.owned.get_mut(&s) {
                        sh.moved = true;
                        sh.unhanded = true;
                        sh.touched.extend(hint.recipients);
                    }
                }
            }
        }
        for s in gc_due {
            // GC only frees space: a failure is retried at the next interval, nothing else
            match self.gc_shard(s).await {
                Ok(Some(upto)) => self.trim_later(s, upto, now),
                Ok(None) => {}
                Err(e) => gc_failed(s, &e),
            }
        }
        let due = self.trims.len() >= super::TRIMS_PER_CALL
            || self
                .trims_since
                .is_some_and(|t| now.saturating_duration_since(t) >= self.opts.gc_interval);
        if due {
            self.send_trims().await;
        }
        Ok(())
    }

    /// Queues the trim of shard `s`'s log to `upto` (a later one of the same shard replaces
    /// it: trims only go up).
    fn trim_later(&mut self, s: u32, upto: u64, now: Instant) {
        match self.trims.iter_mut().find(|t| t.0 == s) {
            Some(t) => t.1 = t.1.max(upto),
            None => self.trims.push((s, upto)),
        }
        self.trims_since.get_or_insert(now);
    }

    /// Sends the queued trims in one call (ADR-0088). Each is checked again first: a shard
    /// stopped since (fenced, corrupt) or whose lease is no longer ours is not trimmed, as
    /// [`Self::gc_shard`] would not have trimmed it now. A failed trim is only logged and
    /// counted: the next GC of its shard finds it due again.
    async fn send_trims(&mut self) {
        self.trims_since = None;
        let mut trims = std::mem::take(&mut self.trims);
        trims.retain(|&(s, _)| {
            self.owned.get(&s).is_some_and(|sh| !sh.stopped)
                && self.opts.lease_gate.as_ref().is_none_or(|g| g.may_write(s))
        });
        if trims.is_empty() {
            return;
        }
        match self.core.trim_many(&trims).await {
            Ok(results) => {
                for (&(s, _), r) in trims.iter().zip(results) {
                    if let Err(e) = r {
                        gc_failed(s, &e.into());
                    }
                }
            }
            Err(e) => {
                let e: Error = e.into();
                for &(s, _) in &trims {
                    gc_failed(s, &e);
                }
            }
        }
    }

    /// One shard's GC; returns how far its log may be trimmed (`Some(upto)`: the records at or
    /// below `upto` are on every mailbox lane and, where asked, on the mailbox replicas),
    /// which the caller queues ([`Self::trim_later`]).
    pub(super) async fn gc_shard(&mut self, s: u32) -> Result<Option<u64>, Error> {
        let mb = self.owned[&s].mb;
        if self.owned[&s].stopped {
            // no GC for a stopped shard (fenced, corrupt): only its head and lag
            let head = self.core.head(s).await?;
            self.health.update(s, |h| {
                h.head = head;
                h.log_exhausted = head >= U48_MAX;
            });
            return Ok(None);
        }
        if self.owned[&s].epoch == 0 {
            // not claimed yet (ADR-0097; in retry until `resync` claims it): the epoch on its
            // watermark is not another owner's, and nothing of it is trimmed before it is ours
            return Ok(None);
        }
        // each mailbox call bounded (ADR-0129): one on an instance that does not answer fails
        // the shard's GC within a second, and the instance is left alone for a while
        let call = self.mailboxes[mb].gc_completed(s, 1000);
        let gc = self.stalls.within(mb, MAILBOX_CALL_TIMEOUT, call).await;
        let gc = match gc.ok_or_else(|| self.stalls.error(mb))? {
            Err(e) if e.code() == "no_watermark" => {
                // the watermark is gone (the mailbox instance lost the shard's keys): the
                // resync creates it again and re-materialises (the quiet path: no record may
                // ever come to find it); a retry already waiting is left to run when due (a
                // new one each GC would push it back for ever)
                if self.owned[&s].retry.is_none() {
                    self.schedule_retry(s, "watermark missing");
                }
                return Ok(None);
            }
            other => other?,
        };
        // how far the log may be trimmed (the caller trims it)
        let mut trim = None;
        match gc {
            Gc::Done { min_w, epoch, .. } => {
                if let Some(current) = epoch.filter(|&e| e != self.owned[&s].epoch) {
                    // another owner claimed the shard (ADR-0046): an owner whose shard gets no
                    // more records (or whose records the new owner applied and trimmed
                    // first) learns it here, not never (the quiet path); nothing more is
                    // written, not even the log's trim
                    // (an epoch below ours is a watermark that went back: `stop` retries it)
                    tracing::warn!(
                        shard = s,
                        epoch = self.owned[&s].epoch,
                        current,
                        "gc found another epoch on the shard's watermark"
                    );
                    self.stop(
                        s,
                        ShardStatus::Fenced {
                            current_epoch: Some(current),
                        },
                    );
                    return Ok(None);
                }
                let min_w = min_w.unwrap_or(0);
                if min_w < self.owned[&s].min_w {
                    // W went backwards under us (a promoted mailbox replica that lacked our
                    // last writes): re-read and re-materialise now, not at the next record
                    // (the quiet path: no new traffic may ever come for this shard)
                    // (the resync logs and counts it). A retry already waiting is left to run
                    // when due: scheduled again at each GC, it was pushed back for ever
                    // (ADR-0100), and the shard never recovered on the quiet path.
                    if self.owned[&s].retry.is_none() {
                        self.schedule_retry(s, "watermark went backwards");
                    }
                    return Ok(None);
                }
                // the log below W goes only once W is on the replicas asked for: a replica
                // promoted after a mailbox primary's loss re-materialises from the log
                if min_w > 0 {
                    let call = self.mailboxes[mb].confirm_replicated(s, min_w);
                    let confirmed = self.stalls.within(mb, MAILBOX_CALL_TIMEOUT, call).await;
                    if let Some(w) = confirmed.ok_or_else(|| self.stalls.error(mb))?? {
                        if w > 0 {
                            trim = Some(w);
                        }
                    } else {
                        metrics::counter!("tidemark_trim_deferred_total").increment(1);
                        tracing::warn!(
                            shard = s,
                            w = min_w,
                            "log not trimmed: W not yet confirmed on the mailbox replicas"
                        );
                    }
                }
                let mut head = self.core.head(s).await?;
                if head < min_w {
                    // the core instance lost commits the mailbox side already holds (restored
                    // to an earlier point, or an AOF that lost writes): the next commit would
                    // get an offset at or below W and be taken for a replay. Raise the head.
                    let call = self.mailboxes[mb].read_watermark(s);
                    let read = self.stalls.within(mb, MAILBOX_CALL_TIMEOUT, call).await;
                    let max_w = read
                        .ok_or_else(|| self.stalls.error(mb))??
                        .lanes
                        .max_present_w()
                        .unwrap_or(min_w);
                    if let Some(old) = self.core.raise_head(s, max_w).await? {
                        tracing::error!(
                            shard = s,
                            head = old,
                            w = max_w,
                            "core log head below W (core restored to an earlier point?); \
                             head raised to W so new commits follow it"
                        );
                        metrics::counter!("tidemark_head_raised_total").increment(1);
                        head = max_w;
                    }
                }
                let sh = self.shard_mut(s);
                let idle = sh.pending.is_empty() && head <= min_w;
                sh.quiet = idle && sh.retry.is_none() && sh.held.is_none();
                if idle && sh.held.is_some() {
                    // caught up with the head (a rebase moved W to it): nothing is held
                    self.clear_held(s);
                }
                let sh = self.shard_mut(s);
                if head > min_w && sh.pending.is_empty() && sh.retry.is_none() {
                    // behind the head with nothing in flight: the log must hold W + 1
                    let next = self.core.read_after(s, min_w, 1).await?;
                    let next = next.first().map(|r| r.offset);
                    if next != Some(min_w + 1) {
                        self.hold_discontinuity(s, min_w, next);
                    }
                }
                self.health.update(s, |h| {
                    h.head = head;
                    h.min_w = min_w;
                    h.log_exhausted = head >= U48_MAX;
                    if idle {
                        h.last_progress = Instant::now();
                    }
                });
            }
            Gc::Corrupt(v) => {
                self.stop(
                    s,
                    ShardStatus::Corrupt(format!("{} lane {:?}", v.code, v.lane)),
                );
            }
        }
        Ok(trim)
    }
}

/// A shard's GC that failed: logged and counted; it is retried at the next interval.
fn gc_failed(s: u32, e: &Error) {
    tracing::warn!(shard = s, error = %e, "gc failed; retried later");
    metrics::counter!("tidemark_errors_total", "code" => "gc").increment(1);
}
