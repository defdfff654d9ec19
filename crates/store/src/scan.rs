//! `SCAN … MATCH … COUNT 1000` over the whole keyspace, one batch at a time: the one cursor
//! loop behind every "which keys are there" question (watermarks of an instance, mailboxes
//! holding an entry). A key may come twice (SCAN's guarantee); callers sort and dedupe.

use redis::aio::ConnectionLike;
use redis::FromRedisValue;

use crate::error::Result;

/// Keys per SCAN call (a hint to Redis, not a limit).
const COUNT: u32 = 1000;

/// A SCAN over the keys matching `pattern`.
pub(crate) struct KeyScan {
    pattern: String,
    cursor: u64,
    done: bool,
}

impl KeyScan {
    pub(crate) fn new(pattern: impl Into<String>) -> Self {
        KeyScan {
            pattern: pattern.into(),
            cursor: 0,
            done: false,
        }
    }

    /// The next batch of keys (possibly empty), or `None` once the scan is complete.
    pub(crate) async fn next_batch<K: FromRedisValue>(
        &mut self,
        conn: &mut impl ConnectionLike,
    ) -> Result<Option<Vec<K>>> {
        if self.done {
            return Ok(None);
        }
        let (next, batch): (u64, Vec<K>) = redis::cmd("SCAN")
            .arg(self.cursor)
            .arg("MATCH")
            .arg(&self.pattern)
            .arg("COUNT")
            .arg(COUNT)
            .query_async(conn)
            .await?;
        self.cursor = next;
        self.done = next == 0;
        Ok(Some(batch))
    }
}
