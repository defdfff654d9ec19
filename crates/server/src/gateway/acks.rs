//! Grouped acks (ADR-0038): the WebSocket connections' acks, written to each mailbox instance
//! in one pipeline every [`ACK_LINGER`] instead of one round trip each.
//!
//! An ack is not on anyone's latency path: it only lets Redis trim what a client has
//! processed and tells a reconnecting client where to resume. So it may wait a little for
//! others: every mailbox instance has a queue; the first ack into an empty queue starts a
//! flush task, which waits [`ACK_LINGER`], takes everything queued (at most
//! [`MAX_ACK_BATCH`]) and writes it with [`MailboxStore::ack_mailboxes`], answers each ack,
//! and repeats until the queue is empty. At 5,000 acks/s that is about 50 acks per round
//! trip, per `fdatasync` of the mailbox instance, per wake-up of the gateway.
//!
//! A connection keeps at most one ack in flight (`ws::reader`): acks that arrive meanwhile
//! are coalesced into the highest, written when the one in flight is answered. An ack that
//! is never written (the gateway crashes in the linger) only means those entries are
//! delivered again (at least once on the wire), as before.

use std::sync::Arc;
use std::time::Duration;

use tidemark_store::redis::store::MailboxStore;
use tidemark_store::Error as StoreError;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Queues};

/// How long the first ack into an empty queue waits for others before they are written.
pub const ACK_LINGER: Duration = Duration::from_millis(10);

/// Most acks in one pipeline.
pub const MAX_ACK_BATCH: usize = 512;

/// An ack's answer: the acked seq after it, or why it was not written.
pub(crate) type AckAnswer = oneshot::Receiver<Result<u64, StoreError>>;

/// One queued ack: `(shard, user, seq)`.
type Ack = (u32, String, u64);

struct Inner {
    /// One per mailbox instance (index = instance).
    stores: Vec<MailboxStore>,
    queues: Queues<Ack, Result<u64, StoreError>>,
    tracker: TaskTracker,
}

/// The per-instance ack queues (cheap to clone).
#[derive(Clone)]
pub(crate) struct AckQueue {
    inner: Arc<Inner>,
}

impl AckQueue {
    /// Queues for `stores` (index = mailbox instance); flush tasks go on `tracker`.
    pub(crate) fn new(stores: Vec<MailboxStore>, tracker: TaskTracker) -> AckQueue {
        let queues = Queues::new(stores.len());
        AckQueue {
            inner: Arc::new(Inner {
                stores,
                queues,
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

/// Writes the instance's queue, one pipeline per [`ACK_LINGER`], until it is empty.
async fn flush(inner: Arc<Inner>, instance: usize) {
    let _running = inner.queues.running(instance);
    let mut store = inner.stores[instance].clone();
    loop {
        tokio::time::sleep(ACK_LINGER).await;
        let Some(batch) = inner.queues.next_batch(instance, MAX_ACK_BATCH) else {
            return;
        };
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
