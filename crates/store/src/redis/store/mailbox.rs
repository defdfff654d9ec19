//! Mailboxes on [`MailboxStore`]: pages of `mb:{s}:<user>` (with the shard's watermark in
//! the same pipeline, or up to a hinted bound), the ack (`ack_mailbox.lua`) and the acked seq.

use redis::Value;

use super::reply::{as_i64, decode_read_reply, parse_ack};
use super::{check_u48, MailboxStore};
use crate::error::{Error, Result};
use crate::keys;
use crate::redis::watermark::ShardWatermark;

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
        check_u48("seq", seq)?;
        let a = keys::acks(shard);
        let mb = keys::mailbox(shard, user);
        let s = seq.to_string();
        let cmd = Self::evalsha(
            &self.set.ack_mailbox,
            &[a.as_bytes(), mb.as_bytes()],
            &[user.as_bytes(), s.as_bytes()],
        );
        let v = self.invoke(&cmd).await?;
        parse_ack(&v)
    }

    /// [`MailboxStore::ack_mailbox`] for many mailboxes at once (`(shard, user, seq)` each),
    /// in one pipeline (on a cluster, one per shard): one answer per ack, in order. Each ack
    /// stands alone: one that fails (a seq above u48, a script error) fails only itself.
    /// NOSCRIPT anywhere reloads the scripts and repeats the pipeline (an ack is idempotent).
    /// The outer `Err` is the call itself failing (connection).
    pub async fn ack_mailboxes(&mut self, acks: &[(u32, &str, u64)]) -> Result<Vec<Result<u64>>> {
        let mut out: Vec<Option<Result<u64>>> = Vec::with_capacity(acks.len());
        let mut cmds = Vec::with_capacity(acks.len());
        for &(shard, user, seq) in acks {
            if let Err(e) = check_u48("seq", seq) {
                out.push(Some(Err(e)));
                continue;
            }
            let a = keys::acks(shard);
            let mb = keys::mailbox(shard, user);
            let s = seq.to_string();
            cmds.push((
                shard,
                Self::evalsha(
                    &self.set.ack_mailbox,
                    &[a.as_bytes(), mb.as_bytes()],
                    &[user.as_bytes(), s.as_bytes()],
                ),
            ));
            out.push(None);
        }
        let mut replies = Vec::new();
        for attempt in 0..2 {
            replies = self.conn.exec_each(&cmds).await?;
            let noscript = replies
                .iter()
                .any(|r| matches!(r, Err(e) if e.code() == Some("NOSCRIPT")));
            if !noscript {
                break;
            }
            if attempt == 0 {
                self.load_scripts().await?;
            }
        }
        let mut replies = replies.into_iter();
        Ok(out
            .into_iter()
            .map(|slot| match slot {
                Some(refused) => refused,
                None => match replies.next() {
                    Some(Ok(v)) => parse_ack(&v),
                    Some(Err(e)) => Err(e.into()),
                    None => Err(Error::UnexpectedReply {
                        script: "ack_mailbox",
                        detail: "fewer replies than acks".into(),
                    }),
                },
            })
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
