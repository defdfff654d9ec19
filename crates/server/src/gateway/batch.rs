//! The queue shape of grouped acks ([`super::acks`], per mailbox instance): items wait in a
//! keyed queue with their answer channel; the first item into an idle queue makes its caller
//! start one flush task for that key, which takes what is queued ([`Queues::take_all`]) until
//! the queue is empty, and answers every item ([`answer`]). At most one flush runs per key.
//! (Group commit, [`super::group_commit`], used it too until ADR-0045 gave it two flush
//! tasks per core instance and a linger; it shares [`Waiting`] and [`answer`].)

use std::sync::Mutex;

use tokio::sync::oneshot;

/// One queued item and where its answer goes.
pub(crate) struct Waiting<T, A> {
    pub item: T,
    pub tx: oneshot::Sender<A>,
}

struct Queue<T, A> {
    waiting: Vec<Waiting<T, A>>,
    /// A flush task runs for this key.
    running: bool,
}

/// One queue per key (`0..n`).
pub(crate) struct Queues<T, A> {
    queues: Vec<Mutex<Queue<T, A>>>,
}

impl<T, A> Queues<T, A> {
    pub(crate) fn new(n: usize) -> Queues<T, A> {
        Queues {
            queues: (0..n)
                .map(|_| {
                    Mutex::new(Queue {
                        waiting: Vec::new(),
                        running: false,
                    })
                })
                .collect(),
        }
    }

    /// Queues `item` under `key`: its answer, and whether the caller must start the key's
    /// flush task (none was running).
    pub(crate) fn push(&self, key: usize, item: T) -> (oneshot::Receiver<A>, bool) {
        let (tx, rx) = oneshot::channel();
        let mut q = self.queues[key].lock().expect("not poisoned");
        q.waiting.push(Waiting { item, tx });
        (rx, !std::mem::replace(&mut q.running, true))
    }

    /// Everything queued under `key`, oldest first; `None` when the queue is empty, and then
    /// the flush has ended (the next push starts another).
    pub(crate) fn take_all(&self, key: usize) -> Option<Vec<Waiting<T, A>>> {
        let mut q = self.queues[key].lock().expect("not poisoned");
        if q.waiting.is_empty() {
            q.running = false;
            return None;
        }
        Some(std::mem::take(&mut q.waiting))
    }

    /// Held by the flush task of `key`: if the task panics, the key is free for the next
    /// flush and what is still queued is dropped (those callers get an error; each caller's
    /// retry is safe: commits dedupe, acks are idempotent).
    pub(crate) fn running(&self, key: usize) -> Running<'_, T, A> {
        Running {
            queue: &self.queues[key],
        }
    }
}

/// See [`Queues::running`].
pub(crate) struct Running<'a, T, A> {
    queue: &'a Mutex<Queue<T, A>>,
}

impl<T, A> Drop for Running<'_, T, A> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.waiting.clear();
            q.running = false;
        }
    }
}

/// Answers a batch: each item its own result, or every item the call's error.
pub(crate) fn answer<T, R, E: Clone, I: IntoIterator<Item = Result<R, E>>>(
    batch: Vec<Waiting<T, Result<R, E>>>,
    results: Result<I, E>,
) {
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
