//! Supervision of long-running tasks: a panic or an unexpected exit never leaves the process
//! up and healthy-looking with a dead task.
//!
//! - [`supervise`] runs a task in its own tokio task and starts it again (after a capped
//!   backoff) when it panics or returns before cancellation; each restart is logged with the
//!   task's name and counted in `tidemark_task_restarts_total{task, reason}` (`reason` is
//!   `panic` or `exit`).
//! - [`catch_panic`] turns a panic of a future into an `Err` with the panic message, for tasks
//!   whose failure must end something else (a WebSocket connection whose delivery loop died is
//!   closed, so the client reconnects).
//!
//! Tasks that cannot be restarted in place (the gateway's listener) end the process instead:
//! see [`crate::run`].

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use crate::health::HealthBoard;

/// First delay before a restart.
pub const RESTART_MIN: Duration = Duration::from_millis(100);
/// Longest delay before a restart (the delay doubles while restarts keep failing fast).
pub const RESTART_MAX: Duration = Duration::from_secs(5);
/// A task that ran this long before failing restarts after [`RESTART_MIN`] again, and
/// starts a new streak on the health board ([`crate::health::RESTART_LOOP`]).
pub const HEALTHY_RUN: Duration = Duration::from_secs(30);

/// The text of a panic payload (`&str` or `String`; anything else is named as such).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `fut`, turning a panic into `Err(message)`.
pub async fn catch_panic<T>(fut: impl Future<Output = T>) -> Result<T, String> {
    AssertUnwindSafe(fut)
        .catch_unwind()
        .await
        .map_err(|p| panic_message(p.as_ref()))
}

/// How one run of a supervised task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// It panicked, with this message.
    Panicked(String),
    /// It returned before cancellation (with this description).
    Exited(String),
}

impl Ended {
    fn reason(&self) -> &'static str {
        match self {
            Ended::Panicked(_) => "panic",
            Ended::Exited(_) => "exit",
        }
    }
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Panicked(m) => write!(f, "panicked: {m}"),
            Ended::Exited(m) => write!(f, "exited: {m}"),
        }
    }
}

/// Runs `make()` until `cancel`, restarting it whenever it panics or returns before `cancel`
/// (its output, when not `Ok`, is described with `{:?}`). `on_down` is called with how it
/// ended before each restart (e.g. to report its shards unhealthy). `health`, when given, is
/// told of every run and end, so `/healthz` reports a task that keeps failing
/// ([`crate::health::RESTART_LOOP`]); a task whose failures `/healthz` shows otherwise (a
/// materializer worker's shards) passes `None`.
pub async fn supervise<F, Fut, T, E>(
    task: &'static str,
    cancel: CancellationToken,
    health: Option<Arc<HealthBoard>>,
    mut make: F,
    on_down: impl Fn(&Ended),
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let mut delay = RESTART_MIN;
    let board = health.map(|h| {
        let id = h.register_task(task);
        (h, id)
    });
    loop {
        let started = Instant::now();
        if let Some((h, id)) = &board {
            h.task_started(*id);
        }
        let outcome = tokio::spawn(make()).await;
        if cancel.is_cancelled() {
            if let Some((h, id)) = &board {
                h.task_stopped(*id);
            }
            return;
        }
        let ended = match outcome {
            Ok(Ok(_)) => Ended::Exited("returned".into()),
            Ok(Err(e)) => Ended::Exited(e.to_string()),
            Err(je) if je.is_panic() => Ended::Panicked(panic_message(je.into_panic().as_ref())),
            Err(je) => Ended::Exited(je.to_string()),
        };
        if started.elapsed() >= HEALTHY_RUN {
            delay = RESTART_MIN;
        }
        tracing::error!(task, %ended, restart_in = ?delay, "supervised task ended; restarting");
        metrics::counter!("tidemark_task_restarts_total", "task" => task, "reason" => ended.reason())
            .increment(1);
        if let Some((h, id)) = &board {
            h.task_ended(*id, &ended.to_string());
        }
        on_down(&ended);
        tokio::select! {
            _ = cancel.cancelled() => {
                if let Some((h, id)) = &board {
                    h.task_stopped(*id);
                }
                return;
            }
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(RESTART_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// How long a test waits for restarts before it says there were none: a bound for a
    /// restart that never comes, not a timing. Each panic prints its message, and with
    /// `RUST_BACKTRACE` set also a backtrace symbolized from the test binary's debug info on
    /// the runtime's thread; on a loaded box that took more than 5 s in CI.
    const NO_RESTART: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn a_panicking_task_is_restarted_until_cancelled() {
        let runs = Arc::new(AtomicU32::new(0));
        let downs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let cancel = CancellationToken::new();
        let (r, c) = (runs.clone(), cancel.clone());
        let d = downs.clone();
        let board = Arc::new(HealthBoard::default());
        let sup = tokio::spawn(supervise(
            "test",
            cancel.clone(),
            Some(board.clone()),
            move || {
                let n = r.fetch_add(1, Ordering::SeqCst);
                let c = c.clone();
                async move {
                    match n {
                        0 => panic!("boom {n}"),
                        1 => Err::<(), String>("gave up".into()),
                        _ => {
                            c.cancelled().await;
                            Ok(())
                        }
                    }
                }
            },
            move |e| d.lock().unwrap().push(e.clone()),
        ));
        let start = Instant::now();
        while runs.load(Ordering::SeqCst) < 3 {
            assert!(start.elapsed() < NO_RESTART, "not restarted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel.cancel();
        sup.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        assert_eq!(
            *downs.lock().unwrap(),
            vec![
                Ended::Panicked("boom 0".into()),
                Ended::Exited("gave up".into())
            ]
        );
    }

    #[tokio::test]
    async fn a_task_that_keeps_failing_is_reported_by_the_health_board() {
        let runs = Arc::new(AtomicU32::new(0));
        let cancel = CancellationToken::new();
        let board = Arc::new(HealthBoard::default());
        let (r, c) = (runs.clone(), cancel.clone());
        let sup = tokio::spawn(supervise(
            "looping",
            cancel.clone(),
            Some(board.clone()),
            move || {
                let n = r.fetch_add(1, Ordering::SeqCst);
                let c = c.clone();
                async move {
                    if n < crate::health::RESTART_LOOP {
                        panic!("boom {n}");
                    }
                    c.cancelled().await;
                    Ok::<(), String>(())
                }
            },
            |_| {},
        ));
        let start = Instant::now();
        while runs.load(Ordering::SeqCst) <= crate::health::RESTART_LOOP {
            assert!(start.elapsed() < NO_RESTART, "not restarted");
            // below the threshold it is a hiccup, not a problem
            if runs.load(Ordering::SeqCst) < crate::health::RESTART_LOOP {
                assert!(board.problems(Duration::from_secs(10)).is_empty());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let p = board.problems(Duration::from_secs(10));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("task looping: restarted 3 times in a row"),
            "{p:?}"
        );
        assert!(p[0].ends_with("last run panicked: boom 2"), "{p:?}");
        cancel.cancel();
        sup.await.unwrap();
        // asked to stop, it is no longer a problem
        let p = board.problems(Duration::from_secs(10));
        assert!(p.is_empty(), "{p:?}");
    }

    #[tokio::test]
    async fn a_task_stopped_while_waiting_to_restart_is_no_longer_reported() {
        let runs = Arc::new(AtomicU32::new(0));
        let cancel = CancellationToken::new();
        let board = Arc::new(HealthBoard::default());
        let r = runs.clone();
        let sup = tokio::spawn(supervise(
            "failing",
            cancel.clone(),
            Some(board.clone()),
            move || {
                r.fetch_add(1, Ordering::SeqCst);
                async { Err::<(), String>("refused".into()) }
            },
            |_| {},
        ));
        let start = Instant::now();
        while board.problems(Duration::from_secs(10)).is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "never reported");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // cancelled during a restart delay (the task is not running)
        cancel.cancel();
        sup.await.unwrap();
        let p = board.problems(Duration::from_secs(10));
        assert!(p.is_empty(), "{p:?}");
    }

    #[tokio::test]
    async fn catch_panic_returns_the_message() {
        let r = catch_panic(async { panic!("x{}", 1) }).await;
        assert_eq!(r, Err::<(), _>("x1".to_string()));
        assert_eq!(catch_panic(async { 7 }).await, Ok(7));
    }
}
