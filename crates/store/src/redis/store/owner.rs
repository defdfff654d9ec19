//! Owner marks on [`MailboxStore`]: `owner:{s}` holds the epoch of the process materialising
//! shard `s`, set with a [`OWNER_MARK_TTL_MS`] expiry and refreshed while it runs, deleted on a
//! clean stop. Only offline tools read it (is an owner live?); nothing on the data path does:
//! fencing is the epoch in `wm:{s}`, never this mark.

use super::MailboxStore;
use crate::error::Result;
use crate::keys;

/// How long an owner mark (`owner:{s}`) lives without a refresh.
pub const OWNER_MARK_TTL_MS: u64 = 30_000;

/// Deletes the mark only while it still holds the caller's epoch (a newer owner's stays).
const CLEAR_MARK_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 1";

impl MailboxStore {
    /// Sets `owner:{s}` to the epoch, expiring after [`OWNER_MARK_TTL_MS`], for every
    /// `(shard, epoch)` of `marks`, in one pipeline (on a cluster, one per shard, each
    /// bounded by [`crate::endpoint::SHARD_CALL_TIMEOUT`]: a hung node holds the caller, the
    /// materializer's loop, that long at most, ADR-0124). The first failed mark is the error;
    /// the others are set.
    pub async fn refresh_owner_marks(&self, marks: &[(u32, u64)]) -> Result<()> {
        let cmds: Vec<(u32, redis::Cmd)> = marks
            .iter()
            .map(|&(shard, epoch)| {
                let mut c = redis::cmd("SET");
                c.arg(keys::owner(shard))
                    .arg(epoch)
                    .arg("PX")
                    .arg(OWNER_MARK_TTL_MS);
                (shard, c)
            })
            .collect();
        let mut conn = self.connection();
        let bound = conn.shard_bound();
        for r in conn.exec_each_within(&cmds, bound).await? {
            r?;
        }
        Ok(())
    }

    /// Removes `owner:{shard}` if it still holds `epoch`.
    pub async fn clear_owner_mark(&self, shard: u32, epoch: u64) -> Result<()> {
        static CLEAR_MARK: std::sync::LazyLock<crate::redis::scripts::Script> =
            std::sync::LazyLock::new(|| {
                crate::redis::scripts::Script::new("clear_owner_mark", CLEAR_MARK_LUA.to_string())
            });
        let _: i64 = CLEAR_MARK
            .key(keys::owner(shard))
            .arg(epoch.to_string())
            .invoke(&mut self.connection())
            .await?;
        Ok(())
    }

    /// The epoch of the live owner of `shard`, if one refreshed its mark within
    /// [`OWNER_MARK_TTL_MS`].
    pub async fn live_owner(&self, shard: u32) -> Result<Option<u64>> {
        let v: Option<String> = redis::cmd("GET")
            .arg(keys::owner(shard))
            .query_async(&mut self.connection())
            .await?;
        Ok(v.and_then(|e| e.parse().ok()))
    }
}
