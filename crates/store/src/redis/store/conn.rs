//! The connection side of [`MailboxStore`]: `SCRIPT LOAD` of the script set, one EVALSHA
//! command per call, and the NOSCRIPT recovery (reload the set where the call runs — on a
//! cluster, on that shard's primary alone — and repeat the call as `EVAL`, ADR-0059; for a
//! pipeline, repeat the whole pipeline in its original order, the calls that answered
//! NOSCRIPT as `EVAL`). No reply is decoded here: the values go to [`super::reply`].
//!
//! On a Redis Cluster every call waits for its shard's node at most
//! [`crate::endpoint::SHARD_CALL_TIMEOUT`] (ADR-0124): a node that hangs or is gone fails
//! its own shards' calls (outcome unknown), promptly, and no other shard's.

use redis::{Cmd, Value};

use super::MailboxStore;
use crate::endpoint::within;
use crate::error::{Error, Result};
use crate::redis::scripts::{as_eval, evalsha_sha, Script};

fn is_noscript(e: &redis::RedisError) -> bool {
    e.code() == Some("NOSCRIPT")
}

impl MailboxStore {
    /// `SCRIPT LOAD` of every script of the set (on a cluster, on every primary redis-rs
    /// knows: its slot map holds no replicas, so a replica promoted later starts without the
    /// scripts and answers NOSCRIPT, which [`Self::load_scripts_for`] repairs on that primary
    /// alone).
    pub async fn load_scripts(&mut self) -> Result<()> {
        self.load_set(None).await
    }

    pub(super) fn evalsha(script: &Script, keys: &[&[u8]], args: &[&[u8]]) -> Cmd {
        let mut c = redis::cmd("EVALSHA");
        c.arg(&script.sha).arg(keys.len());
        for k in keys {
            c.arg(*k);
        }
        for a in args {
            c.arg(*a);
        }
        c
    }

    /// Loads the script set where `cmd` runs (on a cluster, on the primary of its first key's
    /// slot alone: [`crate::endpoint::Conn::load_scripts_for`]).
    pub(super) async fn load_scripts_for(&mut self, cmd: &Cmd) -> Result<()> {
        self.load_set(Some(cmd)).await
    }

    /// `SCRIPT LOAD` of the set where `cmd` runs (`None`: everywhere) and the check of the
    /// SHA-1s it returns.
    async fn load_set(&mut self, cmd: Option<&Cmd>) -> Result<()> {
        let all = self.set.all();
        let sources: Vec<&str> = all.iter().map(|s| s.source.as_str()).collect();
        let shas = self.conn.load_scripts_for(cmd, &sources).await?;
        for (s, sha) in all.iter().zip(shas) {
            if sha != s.sha {
                return Err(Error::UnexpectedReply {
                    script: s.name,
                    detail: format!("SCRIPT LOAD returned {sha}, expected {}", s.sha),
                });
            }
        }
        Ok(())
    }

    /// Loads the script set where each of `cmds` that answered NOSCRIPT runs: once per shard
    /// on a cluster (one slot each), once on one instance.
    pub(super) async fn reload_for(&mut self, cmds: &[&(u32, Cmd)]) -> Result<()> {
        let mut done: Vec<u32> = Vec::new();
        for (shard, cmd) in cmds.iter().map(|c| (c.0, &c.1)) {
            if done.contains(&shard) {
                continue;
            }
            self.load_scripts_for(cmd).await?;
            if !self.conn.is_cluster() {
                break;
            }
            done.push(shard);
        }
        Ok(())
    }

    /// One script call (on a cluster, bounded by [`crate::endpoint::SHARD_CALL_TIMEOUT`]:
    /// the shard's node that hangs holds up its caller that long at most, ADR-0124).
    pub(super) async fn invoke(&mut self, cmd: &Cmd) -> Result<Value> {
        let bound = self.conn.shard_bound();
        let first = within(bound, cmd.query_async::<Value>(&mut self.conn)).await;
        match first {
            Err(e) if is_noscript(&e) => {
                self.load_scripts_for(cmd).await?;
                let again = self.eval_form(cmd);
                Ok(within(bound, again.query_async::<Value>(&mut self.conn)).await?)
            }
            other => Ok(other?),
        }
    }

    /// `cmd` as `EVAL` with the source of the set's script it names
    /// ([`crate::redis::scripts::as_eval`]); `cmd` itself when it names none.
    fn eval_form(&self, cmd: &Cmd) -> Cmd {
        let source = evalsha_sha(cmd).and_then(|sha| {
            self.set
                .all()
                .into_iter()
                .find(|s| s.sha.as_bytes() == sha)
                .map(|s| s.source.as_str())
        });
        match source {
            Some(src) => as_eval(cmd, src),
            None => cmd.clone(),
        }
    }

    /// Runs `cmds` (each tagged with its shard) as one pipeline — on a cluster, one per
    /// shard, each bounded by [`crate::endpoint::SHARD_CALL_TIMEOUT`]
    /// ([`crate::endpoint::Conn::exec_each_within`]: a shard whose node fails or does not
    /// answer is an error for its commands alone, ADR-0124) — and returns each command's
    /// result. On NOSCRIPT anywhere, loads the set where those calls ran and repeats the
    /// whole pipeline in order, the calls that answered NOSCRIPT as `EVAL` (safe: every
    /// command is a CAS or idempotent).
    pub(super) async fn exec_reloading(
        &mut self,
        cmds: &[(u32, Cmd)],
    ) -> Result<Vec<redis::RedisResult<Value>>> {
        let bound = self.conn.shard_bound();
        let replies = self.conn.exec_each_within(cmds, bound).await?;
        let failed: Vec<bool> = replies
            .iter()
            .map(|r| matches!(r, Err(e) if is_noscript(e)))
            .collect();
        if !failed.contains(&true) {
            return Ok(replies);
        }
        let noscript: Vec<&(u32, Cmd)> = cmds
            .iter()
            .zip(&failed)
            .filter(|(_, f)| **f)
            .map(|(c, _)| c)
            .collect();
        self.reload_for(&noscript).await?;
        let again: Vec<(u32, Cmd)> = cmds
            .iter()
            .zip(&failed)
            .map(|((s, c), f)| (*s, if *f { self.eval_form(c) } else { c.clone() }))
            .collect();
        Ok(self.conn.exec_each_within(&again, bound).await?)
    }

    /// [`Self::exec_reloading`], every command's reply or the first error.
    pub(super) async fn invoke_pipeline(&mut self, cmds: &[(u32, Cmd)]) -> Result<Vec<Value>> {
        let replies = self.exec_reloading(cmds).await?;
        replies
            .into_iter()
            .map(|r| r.map_err(Error::from))
            .collect()
    }
}
