//! Owner marks: `owner:{s}` holds the epoch of the process materialising shard `s`, written by
//! the materializer with a [`OWNER_MARK_TTL_MS`] expiry and refreshed while it runs. Only the
//! offline tools read it ([`live_owner`]: is an owner live?); fencing is the epoch in `wm:{s}`,
//! never this mark. The operator tools themselves are the `tidemark-ops` crate.

use crate::error::Result;
use crate::redis::store::Store;

/// How long an owner mark (`owner:{s}`) lives without a refresh.
pub const OWNER_MARK_TTL_MS: u64 = 5000;

/// The epoch of the live owner of `shard`, if one refreshed its mark within
/// [`OWNER_MARK_TTL_MS`].
pub async fn live_owner(store: &Store, shard: u32) -> Result<Option<u64>> {
    let v: Option<String> = redis::cmd("GET")
        .arg(crate::keys::owner(shard))
        .query_async(&mut store.connection())
        .await?;
    Ok(v.and_then(|e| e.parse().ok()))
}
