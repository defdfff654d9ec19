//! Reading and acking one user's mailbox, never above the lane's W.
//!
//! A reader sees an entry only when its seq is at or below the W of the mailbox's lane (and
//! the lane is present): entries above W may still be joined by entries below them (a lane
//! chunk of an earlier record that has not landed yet), so showing them could put a later
//! delivery below one already made.
//!
//! A page is bounded in entries and in bytes (stored entry bytes): it ends with the entry
//! that reaches the byte cap, so one page holds at most the cap plus one entry. A
//! [`PageSizer`] picks how many entries to ask Redis for, so a read does not fetch far more
//! than the cap either.

use tidemark_protocol::entry::{decode_entry, Entry};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::topology::Route;

/// One page read after a cursor.
pub(crate) struct Page {
    /// Visible entries in ascending seq: decoded, or the seq of an entry that does not decode.
    pub entries: Vec<Result<Entry, u64>>,
    /// True when the page was full and all of it visible: more may follow right away.
    pub more: bool,
    /// Whether the user's lane was present when read.
    pub lane_present: bool,
    /// Stored bytes of the entries kept.
    pub bytes: usize,
    /// When the page is the read's last (not `more`) and the lane was present: the seq up to
    /// which the read saw every entry (the W it was bounded by).
    pub complete_to: Option<u64>,
}

/// How many entries to ask Redis for so that a page holds about `target` bytes: first as if
/// every entry had the largest size allowed, then following the average size seen.
pub(crate) struct PageSizer {
    count: usize,
    max: usize,
    target: usize,
}

impl PageSizer {
    /// At most `max` entries per read, aiming at `target` bytes; `largest` is the largest
    /// stored entry possible.
    pub(crate) fn new(max: usize, target: usize, largest: usize) -> PageSizer {
        let max = max.max(1);
        PageSizer {
            count: (target / largest.max(1)).clamp(1, max),
            max,
            target,
        }
    }

    /// Entries to ask for next.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Adapts to a page read: `entries` entries of `bytes` bytes in all.
    pub(crate) fn observe(&mut self, entries: usize, bytes: usize) {
        if let Some(avg) = bytes.checked_div(entries) {
            self.count = (self.target / avg.max(1)).clamp(1, self.max);
        }
    }
}

/// A user's mailbox: where it lives and a connection to its instance.
pub(crate) struct Mailbox {
    pub user: String,
    pub route: Route,
    store: MailboxStore,
}

impl Mailbox {
    pub(crate) fn new(user: String, route: Route, store: MailboxStore) -> Mailbox {
        Mailbox { user, route, store }
    }

    /// Entries with seq > `after`, at most `limit` and about `max_bytes`, at or below the
    /// lane's W.
    pub(crate) async fn read_visible(
        &mut self,
        after: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Page, tidemark_store::Error> {
        let (wm, raw) = self
            .store
            .read_watermark_and_mailbox(self.route.shard, &self.user, after, limit)
            .await?;
        let lane = wm.lanes.lane(self.route.lane);
        let w = if lane.present { Some(lane.w) } else { None };
        Ok(self.page(raw, after, w, limit, max_bytes))
    }

    /// Entries with `after < seq <= upto`, at most `limit` and about `max_bytes`, without
    /// reading the watermark:
    /// for a reader woken by a hint whose lowest present W is `upto` (every present lane is
    /// at or above it), when the last full read saw this lane present.
    pub(crate) async fn read_hinted(
        &mut self,
        after: u64,
        upto: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Page, tidemark_store::Error> {
        let raw = self
            .store
            .read_mailbox_range(self.route.shard, &self.user, after, upto, limit)
            .await?;
        Ok(self.page(raw, after, Some(upto), limit, max_bytes))
    }

    /// Decodes a raw page, keeping only entries above `after` and at or below `w`, until
    /// one reaches `max_bytes`.
    fn page(
        &self,
        raw: Vec<(u64, Vec<u8>)>,
        after: u64,
        w: Option<u64>,
        limit: usize,
        max_bytes: usize,
    ) -> Page {
        let full = raw.len() >= limit;
        let mut entries = Vec::with_capacity(raw.len());
        let mut all_visible = true;
        let mut capped = false;
        let mut total = 0usize;
        for (seq, bytes) in raw {
            if seq <= after {
                continue; // defensive: the range is exclusive of `after`
            }
            if w.is_none_or(|w| seq > w) {
                all_visible = false;
                break; // ascending: nothing after this is visible either
            }
            if total >= max_bytes && !entries.is_empty() {
                capped = true; // a visible entry is left for the next page
                break;
            }
            total += bytes.len();
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
        let more = capped || (full && all_visible);
        Page {
            entries,
            more,
            lane_present: w.is_some(),
            bytes: total,
            complete_to: if more { None } else { w },
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

#[cfg(test)]
mod tests {
    use super::PageSizer;

    #[test]
    fn the_sizer_starts_from_the_largest_entry_then_follows_the_average() {
        let mut s = PageSizer::new(256, 256 * 1024, 16 * 1024);
        assert_eq!(s.count(), 16);
        s.observe(16, 16 * 100); // small entries: as many as allowed
        assert_eq!(s.count(), 256);
        s.observe(256, 256 * 8 * 1024); // 8 KiB entries
        assert_eq!(s.count(), 32);
        s.observe(0, 0); // nothing learnt
        assert_eq!(s.count(), 32);
        let s = PageSizer::new(1000, 100, 16 * 1024); // a cap below one entry: one at a time
        assert_eq!(s.count(), 1);
    }
}
