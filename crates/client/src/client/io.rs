//! The connection's two tasks. The writer ([`write_loop`]) owns the sink: it writes whatever
//! is queued, flushing once per batch, and stops at a close frame, a failed write or the end
//! of the connection. The reader ([`read_loop`]) owns the stream and routes every frame
//! (see `incoming.rs`); at the end of the stream it closes the waiters, tells the writer and
//! sends [`Event::Closed`].

use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

use super::incoming::{parse_incoming, route};
use super::waiters::Waiters;
use super::{Event, Ws, BAD_SERVER_FRAME};

/// Writes queued frames until a close frame is written, a write fails, the reader reports
/// the end of the connection (`reader_done`), or every sender is gone.
pub(super) async fn write_loop(
    mut sink: SplitSink<Ws, Message>,
    mut rx: mpsc::Receiver<Message>,
    mut reader_done: oneshot::Receiver<()>,
) {
    /// Most frames written before a flush.
    const BATCH: usize = 256;
    loop {
        let first = tokio::select! {
            first = rx.recv() => first,
            // The connection is gone: stop, so senders see Error::Closed.
            _ = &mut reader_done => return,
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

/// Routes every frame until the connection ends, then fails the waiters, stops the writer
/// (`done`) and sends [`Event::Closed`].
pub(super) async fn read_loop(
    mut stream: SplitStream<Ws>,
    events: mpsc::UnboundedSender<Event>,
    waiters: Waiters,
    done: oneshot::Sender<()>,
) {
    // Reading on after a Close frame lets tungstenite finish the close handshake; the stream
    // then ends.
    while let Some(Ok(msg)) = stream.next().await {
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
