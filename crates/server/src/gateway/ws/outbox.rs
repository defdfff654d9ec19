//! The writer side of a connection: the bounded queue every task sends frames into
//! ([`Outbox`], bounded in frames and bytes, with the slow-client grace) and the writer task
//! that alone owns the sink.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use futures::stream::SplitSink;
use futures::SinkExt;
use tidemark_protocol::CloseCode;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::going_away::GoingAway;
use super::{OUT_CAPACITY, WRITE_BATCH};

/// What the writer sends.
pub(super) enum Out {
    /// A server frame (already JSON).
    Text(String),
    /// A `deliver` frame of `seq` (shared with the other connections of a local run's entry).
    Deliver { seq: u64, text: Utf8Bytes },
    /// A ping (keep-alive probe).
    Ping,
    /// Close the socket after what is queued before.
    Close(CloseCode),
}

impl Out {
    /// Bytes this frame holds while queued.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Out::Text(t) => t.len(),
            Out::Deliver { text, .. } => text.len(),
            Out::Ping | Out::Close(_) => 0,
        }
    }
}

/// A frame in the writer's queue, with the byte permits it holds until it is written.
pub(super) struct Queued {
    pub(super) out: Out,
    pub(super) _bytes: Option<OwnedSemaphorePermit>,
}

/// The connection is gone (or its client stopped reading): nothing more is queued.
pub(super) struct Gone;

/// Why [`Outbox::try_queue`] did not queue a frame.
enum NoRoom {
    /// The writer is gone.
    Gone,
    /// No room right now: the frame, handed back.
    Full(Out),
}

/// The writer's queue: at most [`OUT_CAPACITY`] frames and about `max_queued_bytes` bytes
/// (one permit of `bytes` per byte; a frame larger than the budget takes all of it). A frame
/// that finds no room within the grace period marks the client as stalled and ends the
/// connection.
#[derive(Clone)]
pub(super) struct Outbox {
    pub(super) tx: mpsc::Sender<Queued>,
    pub(super) bytes: Arc<Semaphore>,
    pub(super) budget: usize,
    pub(super) grace: Duration,
    /// Set once a frame found no room within the grace (the client does not read). A flag,
    /// not a token of its own: the writer looks at it once per frame and a token's look
    /// takes a lock (ADR-0061).
    stalled: Arc<AtomicBool>,
    /// The connection's token, cancelled by a stall: the connection's tasks wait for this
    /// one token only, and the reader tells a stall from other ends by [`Outbox::is_stalled`].
    conn: CancellationToken,
}

impl Outbox {
    /// The stalled flag, for the writer (which has no `Outbox`: it holds the receiver).
    pub(super) fn stalled_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stalled)
    }

    pub(super) fn new(
        budget: usize,
        grace: Duration,
        conn: CancellationToken,
    ) -> (Outbox, mpsc::Receiver<Queued>) {
        let budget = budget.clamp(1, u32::MAX as usize >> 1);
        let (tx, rx) = mpsc::channel(OUT_CAPACITY);
        let outbox = Outbox {
            tx,
            bytes: Arc::new(Semaphore::new(budget)),
            budget,
            grace,
            stalled: Arc::new(AtomicBool::new(false)),
            conn,
        };
        (outbox, rx)
    }

    /// The client stopped reading (a frame found no room within the grace).
    pub(super) fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    /// Queues `out`, waiting for room at most the grace period.
    pub(super) async fn send(&self, out: Out) -> Result<(), Gone> {
        if self.is_stalled() {
            return Err(Gone);
        }
        // Room right now (nearly always): queued without reading the clock or arming the
        // grace timers (two `timeout_at`s were 1.4 % of the server's samples at 5,000 msg/s).
        let out = match self.try_queue(out) {
            Ok(()) => return Ok(()),
            Err(NoRoom::Gone) => return Err(Gone),
            Err(NoRoom::Full(out)) => out,
        };
        let n = self.permits(&out);
        let deadline = tokio::time::Instant::now() + self.grace;
        let permit =
            match tokio::time::timeout_at(deadline, self.bytes.clone().acquire_many_owned(n)).await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => return Err(Gone),
                Err(_) => return Err(self.stall()),
            };
        let queued = Queued {
            out,
            _bytes: Some(permit),
        };
        match tokio::time::timeout_at(deadline, self.tx.send(queued)).await {
            Ok(r) => r.map_err(|_| Gone),
            Err(_) => Err(self.stall()),
        }
    }

    /// Queues `out` if there is room right now.
    pub(super) fn try_send(&self, out: Out) -> bool {
        self.try_queue(out).is_ok()
    }

    /// The byte permits `out` takes while queued.
    fn permits(&self, out: &Out) -> u32 {
        out.bytes().clamp(1, self.budget) as u32
    }

    /// Queues `out` if there is room right now; otherwise says why, and hands a frame that
    /// found no room back (its permits given back meanwhile).
    fn try_queue(&self, out: Out) -> Result<(), NoRoom> {
        let permit = match self
            .bytes
            .clone()
            .try_acquire_many_owned(self.permits(&out))
        {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::Closed) => return Err(NoRoom::Gone),
            Err(tokio::sync::TryAcquireError::NoPermits) => return Err(NoRoom::Full(out)),
        };
        let queued = Queued {
            out,
            _bytes: Some(permit),
        };
        match self.tx.try_send(queued) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(NoRoom::Gone),
            Err(mpsc::error::TrySendError::Full(q)) => Err(NoRoom::Full(q.out)),
        }
    }

    /// Queues the close frame (outside the byte budget), waiting until `deadline`.
    pub(super) async fn close(&self, code: CloseCode, deadline: tokio::time::Instant) {
        let queued = Queued {
            out: Out::Close(code),
            _bytes: None,
        };
        let _ = tokio::time::timeout_at(deadline, self.tx.send(queued)).await;
    }

    /// Marks the client as stalled and ends the connection (counted once).
    pub(super) fn stall(&self) -> Gone {
        if !self.stalled.swap(true, Ordering::AcqRel) {
            metrics::counter!("tidemark_slow_clients_total").increment(1);
        }
        self.conn.cancel();
        Gone
    }
}

/// A test's fault for the writer, with the connection's user
/// ([`SendFault::panic_write`](crate::gateway::SendFault::panic_write)).
pub(super) type WriteFault = Option<(Arc<dyn crate::gateway::SendFault>, Arc<str>)>;

/// Owns the sink: writes queued frames (batched, one flush per batch) until the channel
/// closes or a `Close` is queued; `kill` aborts it. Once the client is stalled, queued frames
/// are dropped unwritten (only the close frame goes out).
pub(super) async fn writer(
    mut sink: SplitSink<WebSocket, Message>,
    mut rx: mpsc::Receiver<Queued>,
    written: Arc<AtomicU64>,
    conn: CancellationToken,
    kill: CancellationToken,
    stalled: Arc<AtomicBool>,
    fault: WriteFault,
) {
    let mut close = None;
    // One wait for `kill`, registered once: a `cancelled()` made anew in each `select!` took
    // a lock to register and one to unregister, three times per frame. The work comes first
    // in each `select!`: the wait is polled only when the work is pending (`kill` is
    // cancelled after the close grace, when the writer is stuck on a client that does not
    // read). Polling it takes no lock (ADR-0073).
    let killed = GoingAway::new(kill);
    tokio::pin!(killed);
    'outer: loop {
        let first = tokio::select! {
            biased;
            o = rx.recv() => o,
            _ = &mut killed => return,
        };
        let Some(first) = first else {
            break;
        };
        let mut next = Some(first);
        let mut batch = 0;
        while let Some(Queued { out, _bytes }) = next.take() {
            let dropped = stalled.load(Ordering::Acquire) && !matches!(out, Out::Close(_));
            let msg = match out {
                _ if dropped => {
                    next = rx.try_recv().ok();
                    continue;
                }
                Out::Text(t) => Message::Text(t.into()),
                Out::Deliver { seq, text } => {
                    if let Some((f, user)) = &fault {
                        assert!(!f.panic_write(user, seq), "write fault: {user} {seq}");
                    }
                    // Handed to the socket: from now on the client may ack it.
                    written.fetch_max(seq, Ordering::Relaxed);
                    Message::Text(text)
                }
                Out::Ping => Message::Ping(Default::default()),
                Out::Close(code) => {
                    close = Some(code);
                    break;
                }
            };
            let fed = tokio::select! {
                biased;
                r = sink.feed(msg) => r,
                _ = &mut killed => return,
            };
            if fed.is_err() {
                conn.cancel();
                return;
            }
            batch += 1;
            if batch < WRITE_BATCH {
                next = rx.try_recv().ok();
            }
        }
        let flushed = tokio::select! {
            biased;
            r = sink.flush() => r,
            _ = &mut killed => return,
        };
        if flushed.is_err() {
            conn.cancel();
            return;
        }
        if close.is_some() {
            break 'outer;
        }
    }
    let code = close.unwrap_or(CloseCode::Normal);
    let frame = Message::Close(Some(CloseFrame {
        code: code.as_u16(),
        reason: code.reason().into(),
    }));
    tokio::select! {
        biased;
        _ = &mut killed => {}
        _ = async {
            let _ = sink.send(frame).await;
            let _ = sink.close().await;
        } => {}
    }
}
