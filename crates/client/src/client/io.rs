//! The connection's two tasks. The writer ([`write_loop`]) owns the sink: it writes whatever
//! is queued, flushing once per batch, sends a ping every ping interval, and stops at a close
//! frame, a failed write or the end of the connection. The reader ([`read_loop`]) owns the
//! stream and routes every frame (see `incoming.rs`); at the end of the stream, or when
//! nothing has arrived for the read timeout (a peer gone without a FIN or RST), it closes the
//! waiters, tells the writer and sends [`Event::Closed`].

use std::time::Duration;

use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

use super::incoming::{parse_incoming, route};
use super::waiters::Waiters;
use super::{Event, Ws, BAD_SERVER_FRAME};

/// The shortest ping interval (a zero one would ping without pause).
const MIN_PING_INTERVAL: Duration = Duration::from_millis(10);

/// `now + d`, or a time far enough away to never come when that overflows
/// ([`Duration::MAX`]: no deadline).
fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Writes queued frames until a close frame is written, a write fails, the reader reports
/// the end of the connection (`reader_done`), or every sender is gone; queues a ping every
/// `ping_every`.
pub(super) async fn write_loop(
    mut sink: SplitSink<Ws, Message>,
    mut rx: mpsc::Receiver<Message>,
    mut reader_done: oneshot::Receiver<()>,
    ping_every: Duration,
) {
    /// Most frames written before a flush.
    const BATCH: usize = 256;
    let ping_every = ping_every.max(MIN_PING_INTERVAL);
    let ping = tokio::time::sleep_until(after(Instant::now(), ping_every));
    tokio::pin!(ping);
    loop {
        let first = tokio::select! {
            first = rx.recv() => first,
            // The connection is gone: stop, so senders see Error::Closed.
            _ = &mut reader_done => return,
            // Whatever else is written: a server with nothing to send answers with a pong,
            // which keeps the reader's deadline (the gateway pings only a silent client).
            _ = &mut ping => {
                ping.as_mut().reset(after(Instant::now(), ping_every));
                Some(Message::Ping(Default::default()))
            }
        };
        let Some(first) = first else { break };
        let mut closing = matches!(first, Message::Close(_));
        if sink.feed(first).await.is_err() {
            return;
        }
        let mut n = 1;
        while !closing && n < BATCH {
            let Ok(msg) = rx.try_recv() else { break };
            closing = matches!(msg, Message::Close(_));
            if sink.feed(msg).await.is_err() {
                return;
            }
            n += 1;
        }
        if sink.flush().await.is_err() || closing {
            return;
        }
    }
    // Every sender is gone: close politely.
    let _ = sink.close().await;
}

/// Routes every frame until the connection ends or nothing has arrived for `read_timeout`,
/// then fails the waiters, stops the writer (`done`) and sends [`Event::Closed`].
pub(super) async fn read_loop(
    mut stream: SplitStream<Ws>,
    events: mpsc::UnboundedSender<Event>,
    waiters: Waiters,
    done: oneshot::Sender<()>,
    read_timeout: Duration,
) {
    // One timer, moved only when it fires: each frame just notes the time it arrived.
    let mut last_read = Instant::now();
    let deadline = tokio::time::sleep_until(after(last_read, read_timeout));
    tokio::pin!(deadline);
    loop {
        let msg = tokio::select! {
            biased;
            // Reading on after a Close frame lets tungstenite finish the close handshake; the
            // stream then ends.
            msg = stream.next() => msg,
            _ = &mut deadline => {
                let due = after(last_read, read_timeout);
                if Instant::now() >= due {
                    // Nothing for the whole timeout, not even a pong to our pings: the peer
                    // is gone without telling (power loss, a NAT that forgot the flow).
                    break;
                }
                deadline.as_mut().reset(due);
                continue;
            }
        };
        let Some(Ok(msg)) = msg else { break };
        last_read = Instant::now();
        match msg {
            Message::Text(text) => route(parse_incoming(text.as_str()), &events, &waiters),
            Message::Binary(_) => {
                let _ = events.send(Event::Error {
                    code: BAD_SERVER_FRAME.into(),
                    message: "binary frame from the server".into(),
                    id: None,
                });
            }
            _ => {}
        }
    }
    // Fail every pending waiter (their senders drop) and refuse new ones.
    waiters.close();
    let _ = done.send(());
    let _ = events.send(Event::Closed);
}
