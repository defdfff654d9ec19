//! Grouped acks (ADR-0038, ADR-0074): the WebSocket connections' acks, written to each
//! mailbox instance in pipelines once per ack interval instead of one round trip each.
//!
//! An ack is not on anyone's latency path: it only lets Redis trim what a client has
//! processed and tells a reconnecting client where to resume. So it may wait: every mailbox
//! instance has a queue; the first ack into an empty queue starts a flush task, which waits
//! the gateway's `ack_interval` ([`DEFAULT_ACK_INTERVAL`]), takes everything queued, writes it
//! with [`MailboxStore::ack_mailboxes`] (pipelines of at most [`MAX_ACK_BATCH`]), answers each
//! ack, and repeats until the queue is empty. When the gateway stops, the wait ends at once.
//!
//! A connection keeps at most one ack in flight (`ws::reader`): acks that arrive meanwhile
//! are coalesced into the highest, written when the one in flight is answered. So a
//! connection's cursor is written at most once per interval, however many entries it acks
//! in it (ADR-0074: at 5 deliveries/s per connection and one second, about one write per five
//! acks). An ack that is never written (the gateway crashes in the interval) only means those
//! entries are delivered again (at least once on the wire); a closing connection writes its
//! pending ack straight (`ws::reader::flush_ack`).

use std::sync::Arc;
use std::time::Duration;

use tidemark_store::redis::store::MailboxStore;
use tidemark_store::Error as StoreError;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Queues};

/// `GatewayOptions::ack_interval`'s default: how long the first ack into an empty queue waits
/// for others before they are written, and so the shortest time between two writes of one
/// connection's cursor (ADR-0074).
pub const DEFAULT_ACK_INTERVAL: Duration = Duration::from_secs(1);

/// Most acks in one pipeline (a flush writes everything queued, in pipelines of this many).
pub const MAX_ACK_BATCH: usize = 512;

/// An ack's answer: the acked seq after it, or why it was not written.
pub(crate) type AckAnswer = oneshot::Receiver<Result<u64, StoreError>>;

/// One queued ack: `(shard, user, seq)`.
type Ack = (u32, String, u64);

struct Inner {
    /// One per mailbox instance (index = instance).
    stores: Vec<MailboxStore>,
    queues: Queues<Ack, Result<u64, StoreError>>,
    /// How long a flush waits before it takes what is queued.
    interval: Duration,
    /// Cancelled when the gateway stops: a flush then writes what is queued without waiting.
    stop: CancellationToken,
    tracker: TaskTracker,
}

/// The per-instance ack queues (cheap to clone).
#[derive(Clone)]
pub(crate) struct AckQueue {
    inner: Arc<Inner>,
}

impl AckQueue {
    /// Queues for `stores` (index = mailbox instance), written every `interval` (at once
    /// after `stop`); flush tasks go on `tracker`.
    pub(crate) fn new(
        stores: Vec<MailboxStore>,
        interval: Duration,
        stop: CancellationToken,
        tracker: TaskTracker,
    ) -> AckQueue {
        let queues = Queues::new(stores.len());
        AckQueue {
            inner: Arc::new(Inner {
                stores,
                queues,
                interval,
                stop,
                tracker,
            }),
        }
    }

    /// Queues `user`'s ack of `seq` (shard `shard`, on mailbox instance `instance`); the
    /// answer comes with the next flush of that instance.
    pub(crate) fn submit(&self, instance: usize, shard: u32, user: &str, seq: u64) -> AckAnswer {
        let (rx, start) = self
            .inner
            .queues
            .push(instance, (shard, user.to_string(), seq));
        if start {
            self.inner
                .tracker
                .spawn(flush(Arc::clone(&self.inner), instance));
        }
        rx
    }
}

/// Writes the instance's queue, everything queued once per interval, until it is empty.
async fn flush(inner: Arc<Inner>, instance: usize) {
    let _running = inner.queues.running(instance);
    let mut store = inner.stores[instance].clone();
    loop {
        tokio::select! {
            () = tokio::time::sleep(inner.interval) => {}
            () = inner.stop.cancelled() => {}
        }
        let Some(queued) = inner.queues.take_all(instance) else {
            return;
        };
        let mut queued = queued.into_iter();
        loop {
            let batch: Vec<_> = queued.by_ref().take(MAX_ACK_BATCH).collect();
            if batch.is_empty() {
                break;
            }
            let acks: Vec<(u32, &str, u64)> = batch
                .iter()
                .map(|w| (w.item.0, w.item.1.as_str(), w.item.2))
                .collect();
            crate::telemetry::hot()
                .ack_batch_size
                .record(acks.len() as f64);
            let results = store.ack_mailboxes(&acks).await;
            drop(acks);
            answer(batch, results);
        }
    }
}
