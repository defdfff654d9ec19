//! `tidemark shard …`: maintenance of one shard. [`fence`] raises its epoch so an old owner
//! fails closed; [`rebase`] moves the lanes up to the log's start after a restore left the
//! mailbox side behind the trimmed core log.

use tidemark_store::error::Result;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

/// What `tidemark shard rebase` found or did.
#[derive(Debug)]
pub struct Rebase {
    /// Lowest present W before.
    pub min_w: u64,
    /// The W the lanes below it were (or would be) moved to: the offset before the first
    /// record the log holds (the head when the log is empty).
    pub to: u64,
    /// True when the watermark was written.
    pub done: bool,
}

/// `tidemark shard rebase`: after a restore moved the mailbox side's W back behind a trimmed
/// core log (the owner reports a log discontinuity), moves every lane below the log's start up
/// to it, giving up the offsets in between (their mailbox entries went with the restore; the
/// log no longer holds them). Only with `accept_loss`; without it, reports what it would do.
pub async fn rebase(
    mailbox_url: &str,
    core_url: &str,
    shard: u32,
    accept_loss: bool,
) -> Result<Rebase> {
    let mut store = MailboxStore::connect(mailbox_url, Layout::PackedV2).await?;
    let wm = store.read_watermark(shard).await?;
    let min_w = wm.lanes.min_present_w().unwrap_or(0);
    let mut core = LogStore::connect(core_url).await?;
    let to = match core.read_after(shard, 0, 1).await?.first() {
        Some(first) => first.offset - 1,
        None => core.head(shard).await?,
    };
    if min_w >= to || !accept_loss {
        return Ok(Rebase {
            min_w,
            to,
            done: false,
        });
    }
    store.rebase_lanes(shard, to).await?;
    Ok(Rebase {
        min_w,
        to,
        done: true,
    })
}

/// `tidemark shard fence`: raises the shard's epoch by one; returns the new epoch.
pub async fn fence(url: &str, shard: u32) -> Result<u64> {
    let mut store = MailboxStore::connect(url, Layout::PackedV2).await?;
    store.claim(shard).await
}
