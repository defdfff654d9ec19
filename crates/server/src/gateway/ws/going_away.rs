//! A wait for a connection's end that takes no lock when it is polled (ADR-0073).
//!
//! A connection's reader, writer and delivery loop each wait for the connection's
//! cancellation token in every `select!`. `tokio_util`'s wait for a token
//! (`WaitForCancellationFuture`) takes the token tree's mutex on every poll (`is_cancelled`)
//! and then the `Notify`'s mutex to update its waker: two locks each time the task wakes for
//! anything else. At 5,000 msg/s that was 2.1 % of the server's CPU samples.
//!
//! [`GoingAway`] polls the token's wait once, with a waker of its own. That waker only sets
//! a flag and wakes the task. Later polls register the task's waker (`AtomicWaker`, no lock)
//! and look at the flag. They poll the token's wait again only when its waker fired. So it
//! is ready exactly when the token's wait is ready, and it is woken by the same notification.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Resolves once `token` is cancelled, like `token.cancelled()`, without a lock per poll.
pub(crate) struct GoingAway {
    /// The token's own wait, polled only with `waker` (so it stays registered with it).
    wait: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Set by `waker` when the token's wait was notified (and at the start, so that the
    /// first poll polls the wait); the task's waker.
    signal: Arc<Signal>,
    waker: Waker,
}

struct Signal {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl GoingAway {
    pub(crate) fn new(token: CancellationToken) -> GoingAway {
        let signal = Arc::new(Signal {
            fired: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        GoingAway {
            wait: Box::pin(token.cancelled_owned()),
            waker: Waker::from(Arc::clone(&signal)),
            signal,
        }
    }
}

impl Future for GoingAway {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        // before the flag is read: a notification after the read wakes this task
        this.signal.task.register(cx.waker());
        if this.signal.fired.swap(false, Ordering::AcqRel) {
            let mut own = Context::from_waker(&this.waker);
            if this.wait.as_mut().poll(&mut own).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `f` once; true when it is ready.
    fn ready(f: Pin<&mut GoingAway>) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        f.poll(&mut cx).is_ready()
    }

    #[test]
    fn it_is_ready_once_the_token_or_its_parent_is_cancelled() {
        // cancelled before the first poll
        let t = CancellationToken::new();
        t.cancel();
        let mut f = Box::pin(GoingAway::new(t));
        assert!(ready(f.as_mut()));

        // the token itself, after polls that found nothing
        let t = CancellationToken::new();
        let mut f = Box::pin(GoingAway::new(t.clone()));
        for _ in 0..3 {
            assert!(!ready(f.as_mut()));
        }
        t.cancel();
        assert!(ready(f.as_mut()));

        // a parent (the server's stop) of the connection's token
        let stop = CancellationToken::new();
        let conn = stop.child_token();
        let mut f = Box::pin(GoingAway::new(conn));
        assert!(!ready(f.as_mut()));
        stop.cancel();
        assert!(ready(f.as_mut()));
    }

    /// The task waiting on it is woken by the cancellation: from another thread, from a
    /// parent, while the task is parked in a `select!` with other branches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_task_is_woken_by_the_cancellation() {
        for round in 0..200 {
            let stop = CancellationToken::new();
            let conn = stop.child_token();
            let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(4);
            let task = tokio::spawn(async move {
                let going = GoingAway::new(conn);
                tokio::pin!(going);
                let mut seen = 0;
                loop {
                    tokio::select! {
                        biased;
                        m = rx.recv() => match m {
                            Some(_) => seen += 1,
                            None => return (seen, false),
                        },
                        _ = &mut going => return (seen, true),
                    }
                }
            });
            // wake it for other things first, so the wait is polled again between them
            for i in 0..3 {
                tx.send(i).await.unwrap();
                tokio::task::yield_now().await;
            }
            if round % 2 == 0 {
                std::thread::spawn(move || stop.cancel()).join().unwrap();
            } else {
                stop.cancel();
            }
            let (seen, cancelled) = tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .unwrap_or_else(|_| panic!("round {round}: the cancellation did not wake it"))
                .unwrap();
            assert!(cancelled, "round {round}");
            assert!(seen <= 3);
            drop(tx);
        }
    }
}
