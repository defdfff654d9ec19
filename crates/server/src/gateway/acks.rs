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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_store::redis::store::MailboxStore;
use tidemark_store::Error as StoreError;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

/// How long the first ack into an empty queue waits for others before they are written.
pub const ACK_LINGER: Duration = Duration::from_millis(10);

/// Most acks in one pipeline.
pub const MAX_ACK_BATCH: usize = 512;

/// An ack's answer: the acked seq after it, or why it was not written.
pub(crate) type AckAnswer = oneshot::Receiver<Result<u64, StoreError>>;

struct Waiting {
    shard: u32,
    user: String,
    seq: u64,
    tx: oneshot::Sender<Result<u64, StoreError>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// A flush task runs for this instance.
    running: bool,
}

struct Inner {
    /// One per mailbox instance (index = instance).
    stores: Vec<MailboxStore>,
    queues: Vec<Mutex<Queue>>,
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
        let queues = stores.iter().map(|_| Mutex::default()).collect();
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
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.inner.queues[instance].lock().expect("not poisoned");
            q.waiting.push(Waiting {
                shard,
                user: user.to_string(),
                seq,
                tx,
            });
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            self.inner
                .tracker
                .spawn(flush(Arc::clone(&self.inner), instance));
        }
        rx
    }
}

/// Ends a flush: on a panic the instance is free for the next one and the acks still queued
/// are dropped (their connections see an error and the client acks again).
struct Running<'a> {
    queue: &'a Mutex<Queue>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.waiting.clear();
            q.running = false;
        }
    }
}

/// Writes the instance's queue, one pipeline per [`ACK_LINGER`], until it is empty.
async fn flush(inner: Arc<Inner>, instance: usize) {
    let queue = &inner.queues[instance];
    let _running = Running { queue };
    let mut store = inner.stores[instance].clone();
    loop {
        tokio::time::sleep(ACK_LINGER).await;
        let batch: Vec<Waiting> = {
            let mut q = queue.lock().expect("not poisoned");
            if q.waiting.is_empty() {
                q.running = false;
                return;
            }
            let n = q.waiting.len().min(MAX_ACK_BATCH);
            q.waiting.drain(..n).collect()
        };
        let acks: Vec<(u32, &str, u64)> = batch
            .iter()
            .map(|w| (w.shard, w.user.as_str(), w.seq))
            .collect();
        metrics::histogram!("tidemark_ack_batch_size").record(acks.len() as f64);
        let results = store.ack_mailboxes(&acks).await;
        drop(acks);
        match results {
            Ok(results) => {
                for (w, r) in batch.into_iter().zip(results) {
                    let _ = w.tx.send(r);
                }
            }
            Err(e) => {
                for w in batch {
                    let _ = w.tx.send(Err(e.clone()));
                }
            }
        }
    }
}
