//! Reading and acking one user's mailbox, never above the lane's W.
//!
//! A reader sees an entry only when its seq is at or below the W of the mailbox's lane (and
//! the lane is present): entries above W may still be joined by entries below them (a lane
//! chunk of an earlier record that has not landed yet), so showing them could put a later
//! delivery below one already made.

use tidemark_protocol::entry::{decode_entry, Entry};
use tidemark_store::redis::store::Store;
use tidemark_store::routing::Route;

/// One page read after a cursor.
pub(crate) struct Page {
    /// Visible entries in ascending seq: decoded, or the seq of an entry that does not decode.
    pub entries: Vec<Result<Entry, u64>>,
    /// True when the page was full and all of it visible: more may follow right away.
    pub more: bool,
    /// Whether the user's lane was present when read.
    pub lane_present: bool,
}

/// A user's mailbox: where it lives and a connection to its instance.
pub(crate) struct Mailbox {
    pub user: String,
    pub route: Route,
    store: Store,
}

impl Mailbox {
    pub(crate) fn new(user: String, route: Route, store: Store) -> Mailbox {
        Mailbox { user, route, store }
    }

    /// Entries with seq > `after`, at most `limit`, at or below the lane's W.
    pub(crate) async fn read_visible(
        &mut self,
        after: u64,
        limit: usize,
    ) -> Result<Page, tidemark_store::Error> {
        let (wm, raw) = self
            .store
            .read_watermark_and_mailbox(self.route.shard, &self.user, after, limit)
            .await?;
        let lane = wm.lanes.lane(self.route.lane);
        let w = if lane.present { Some(lane.w) } else { None };
        Ok(self.page(raw, after, w, limit))
    }

    /// Entries with `after < seq <= upto`, at most `limit`, without reading the watermark:
    /// for a reader woken by a hint whose lowest present W is `upto` (every present lane is
    /// at or above it), when the last full read saw this lane present.
    pub(crate) async fn read_hinted(
        &mut self,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Result<Page, tidemark_store::Error> {
        let raw = self
            .store
            .read_mailbox_range(self.route.shard, &self.user, after, upto, limit)
            .await?;
        Ok(self.page(raw, after, Some(upto), limit))
    }

    /// Decodes a raw page, keeping only entries above `after` and at or below `w`.
    fn page(&self, raw: Vec<(u64, Vec<u8>)>, after: u64, w: Option<u64>, limit: usize) -> Page {
        let full = raw.len() >= limit;
        let mut entries = Vec::with_capacity(raw.len());
        let mut all_visible = true;
        for (seq, bytes) in raw {
            if seq <= after {
                continue; // defensive: the range is exclusive of `after`
            }
            if w.is_none_or(|w| seq > w) {
                all_visible = false;
                break; // ascending: nothing after this is visible either
            }
            entries.push(match decode_entry(&bytes) {
                Ok(e) if e.seq == seq => Ok(e),
                Ok(e) => {
                    tracing::error!(user = %self.user, seq, entry_seq = e.seq, "mailbox entry seq differs from its score");
                    Err(seq)
                }
                Err(err) => {
                    tracing::error!(user = %self.user, seq, error = %err, "undecodable mailbox entry");
                    Err(seq)
                }
            });
        }
        Page {
            entries,
            more: full && all_visible,
            lane_present: w.is_some(),
        }
    }

    /// The mailbox's acked cursor.
    pub(crate) async fn acked(&mut self) -> Result<u64, tidemark_store::Error> {
        self.store.acked(self.route.shard, &self.user).await
    }

    /// Acks `seq` (monotonic; trims entries at or below it). Returns the cursor after.
    pub(crate) async fn ack(&mut self, seq: u64) -> Result<u64, tidemark_store::Error> {
        self.store
            .ack_mailbox(self.route.shard, &self.user, seq)
            .await
    }

    /// The lane's W (0 when the lane is not present): the highest seq a reader may see.
    pub(crate) async fn visible_w(&mut self) -> Result<u64, tidemark_store::Error> {
        let wm = self.store.read_watermark(self.route.shard).await?;
        let lane = wm.lanes.lane(self.route.lane);
        Ok(if lane.present { lane.w } else { 0 })
    }
}
