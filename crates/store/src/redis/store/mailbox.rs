//! Mailboxes on [`MailboxStore`]: pages of `mb:{s}:<user>` (with the shard's watermark in
//! the same pipeline, or up to a hinted bound), the ack (`ack_mailbox.lua`) and the acked seq.

use redis::Value;

use super::reply::{as_i64, decode_read_reply, parse_acks};
use super::{check_u48, MailboxStore};
use crate::error::{Error, Result};
use crate::keys;
use crate::redis::watermark::ShardWatermark;

/// Most acks in one `ack_mailbox.lua` call (ADR-0053). A call holds its instance for about
/// 3 µs per ack; 128 keep one under half a millisecond, while a 10 ms ack round at 10,000
/// acks/s (about 100 acks) is still one call.
pub const ACKS_PER_CALL: usize = 128;

impl MailboxStore {
    /// Reads the shard's watermark and a page of a mailbox in one pipeline (watermark first,
    /// so every entry at or below the lane's W is already in the page's range). Returns the
    /// watermark and `(seq, entry)` pairs after `after`; the caller filters by the lane's W.
    pub async fn read_watermark_and_mailbox(
        &mut self,
        shard: u32,
        user: &str,
        after: u64,
        limit: usize,
    ) -> Result<(ShardWatermark, Vec<(u64, Vec<u8>)>)> {
        let wm_cmd = self.read_watermarks_cmd(&[shard]);
        let mut range = redis::cmd("ZRANGEBYSCORE");
        range
            .arg(keys::mailbox(shard, user))
            .arg(format!("({after}"))
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let replies = self
            .invoke_pipeline(&[(shard, wm_cmd), (shard, range)])
            .await?;
        let wm = decode_read_reply(&[shard], &replies[0])?
            .pop()
            .expect("one shard")?;
        let entries = parse_withscores(&replies[1])?;
        Ok((wm, entries))
    }

    /// A page of a mailbox with `after < seq <= upto` (no watermark read: the caller knows
    /// from a hint that everything up to `upto` is visible).
    pub async fn read_mailbox_range(
        &mut self,
        shard: u32,
        user: &str,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        let v: Value = redis::cmd("ZRANGEBYSCORE")
            .arg(keys::mailbox(shard, user))
            .arg(format!("({after}"))
            .arg(upto)
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut self.conn)
            .await?;
        parse_withscores(&v)
    }

    /// Records `user`'s ack of `seq` (monotonic) and trims entries at or below it.
    /// Returns the acked seq after the call.
    pub async fn ack_mailbox(&mut self, shard: u32, user: &str, seq: u64) -> Result<u64> {
        self.ack_mailboxes(&[(shard, user, seq)])
            .await?
            .pop()
            .expect("one answer per ack")
    }

    /// [`MailboxStore::ack_mailbox`] for many mailboxes at once (`(shard, user, seq)` each):
    /// [`ACKS_PER_CALL`] acks per `ack_mailbox.lua` call (ADR-0053; on a cluster a call
    /// holds one shard's acks), the calls in one pipeline (on a cluster, one per shard). One
    /// answer per ack, in order. Each ack stands alone: one that fails (a seq above u48, a
    /// key of another type) fails only itself; a call that fails as a whole fails its acks.
    /// NOSCRIPT anywhere reloads the scripts and repeats the pipeline, those calls as `EVAL`
    /// (an ack is a max, so repeating one is harmless). On a Redis Cluster a shard whose node
    /// fails or does not answer within [`crate::endpoint::SHARD_CALL_TIMEOUT`] fails that
    /// shard's acks alone (ADR-0124). The outer `Err` is the pipeline itself failing (one
    /// instance's connection).
    pub async fn ack_mailboxes(&mut self, acks: &[(u32, &str, u64)]) -> Result<Vec<Result<u64>>> {
        let mut out: Vec<Option<Result<u64>>> = Vec::with_capacity(acks.len());
        // the acks of each call (their indices in `acks`), tagged with a shard of theirs
        let mut calls: Vec<(u32, Vec<usize>)> = Vec::new();
        let cluster = self.conn.is_cluster();
        for (i, &(shard, _, seq)) in acks.iter().enumerate() {
            if let Err(e) = check_u48("seq", seq) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            // on a cluster a call's keys share one slot: the open call of this shard
            let open = if cluster {
                calls
                    .iter()
                    .rposition(|(s, _)| *s == shard)
                    .filter(|&c| calls[c].1.len() < ACKS_PER_CALL)
            } else {
                calls
                    .len()
                    .checked_sub(1)
                    .filter(|&c| calls[c].1.len() < ACKS_PER_CALL)
            };
            match open {
                Some(c) => calls[c].1.push(i),
                None => calls.push((shard, vec![i])),
            }
        }
        let cmds: Vec<(u32, redis::Cmd)> = calls
            .iter()
            .map(|(tag, idx)| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&self.set.ack_mailbox.sha).arg(2 * idx.len());
                for &i in idx {
                    let (shard, user, _) = acks[i];
                    c.arg(keys::Key::acks(shard))
                        .arg(keys::Key::mailbox(shard, user));
                }
                for &i in idx {
                    let (_, user, seq) = acks[i];
                    c.arg(user).arg(seq);
                }
                (*tag, c)
            })
            .collect();
        let mut replies = self.exec_reloading(&cmds).await?.into_iter();
        for (_, idx) in &calls {
            let answers = match replies.next() {
                Some(Ok(v)) => {
                    let of: Vec<(u32, &str)> =
                        idx.iter().map(|&i| (acks[i].0, acks[i].1)).collect();
                    parse_acks(&of, &v)
                }
                Some(Err(e)) => idx.iter().map(|_| Err(Error::from(e.clone()))).collect(),
                None => idx
                    .iter()
                    .map(|_| {
                        Err(Error::UnexpectedReply {
                            script: "ack_mailbox",
                            detail: "fewer replies than calls".into(),
                        })
                    })
                    .collect(),
            };
            for (&i, a) in idx.iter().zip(answers) {
                out[i] = Some(a);
            }
        }
        Ok(out
            .into_iter()
            .map(|a| a.expect("every ack answered"))
            .collect())
    }

    /// `user`'s acked seq (0 when never acked).
    pub async fn acked(&mut self, shard: u32, user: &str) -> Result<u64> {
        let v: Option<u64> = redis::cmd("HGET")
            .arg(keys::acks(shard))
            .arg(user)
            .query_async(&mut self.conn)
            .await?;
        Ok(v.unwrap_or(0))
    }
}

/// Parses a `ZRANGEBYSCORE … WITHSCORES` reply into `(seq, member)` pairs.
pub fn parse_withscores(v: &Value) -> Result<Vec<(u64, Vec<u8>)>> {
    let bad = || Error::UnexpectedReply {
        script: "ZRANGEBYSCORE",
        detail: format!("{v:?}"),
    };
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let mut out = Vec::with_capacity(items.len() / 2);
    for pair in items.chunks(2) {
        match pair {
            [Value::BulkString(m), score] => {
                let s = match score {
                    Value::Double(d) => *d as u64,
                    other => as_i64(other).ok_or_else(bad)? as u64,
                };
                out.push((s, m.clone()));
            }
            _ => return Err(bad()),
        }
    }
    Ok(out)
}
