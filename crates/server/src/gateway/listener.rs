//! Accepting connections: one HTTP/1.1 connection per accepted socket (hyper, with a
//! header-read timeout), optionally inside TLS, a cap on open connections, and graceful
//! shutdown.
//!
//! ```text
//!   open connections:  1 ..= max            served normally
//!                      max+1 ..= max+reserve  served for GET /healthz and /metrics only;
//!                                             anything else: 503 `overloaded`, then close
//!                      above                  an HTTP 503 `overloaded` written raw (after
//!                                             the TLS handshake on a TLS listener), then close
//! ```
//!
//! A connection counts from `accept` until its socket is closed, TLS handshake and WebSocket
//! lifetime included (the [`ConnSlot`] travels with the upgraded request). The TLS handshake
//! runs in the connection's own task, never in the accept loop, and must finish within the
//! header-read timeout. A socket whose writes make no progress for `slow_client_grace` (a
//! response nobody reads) fails and is closed: a WebSocket sets a longer limit, as it closes
//! a client that does not read by itself. The reserve keeps `/healthz` answering while the
//! cap is reached. The header-read timeout covers a request's head and an idle keep-alive
//! connection alike: a socket that sends no complete request head within it is closed. A
//! connection buffers at most [`MAX_CONNECTION_BUFFER`] bytes: a request head above it (or
//! with more than [`MAX_HEADERS`] lines) is answered 431 and the connection closed.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;
use axum::Router;
use futures::future::Either;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tidemark_protocol::{ErrorBody, ErrorCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::http::error_response;
use super::tls::TlsConfig;

/// How long an open HTTP exchange may take to finish once the gateway stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Pause after an `accept` failure that is not the peer's fault (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Most refusals (above `max + reserve`) being written at once; beyond, sockets are dropped.
const MAX_REFUSING: usize = 256;
/// How long a refusal waits for the response to be written and the peer to finish.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Most bytes a connection buffers, for a request head above all (ADR-0125): hyper's default
/// (about 400 KiB) let every socket that had not logged in hold that much with one long
/// header line, 4 GiB at 10 000 connections. A head of ours is well under it: a bearer token
/// is about 1 KiB, a WebSocket upgrade a few hundred bytes. A head that does not fit is
/// answered 431 and the connection closed.
const MAX_CONNECTION_BUFFER: usize = 32 * 1024;
/// Most header lines in a request head (hyper's default, stated here: a browser sends about
/// 20, and each is bounded by [`MAX_CONNECTION_BUFFER`] anyway); more are answered 431.
const MAX_HEADERS: usize = 100;

/// One open connection; the count drops when the last clone is dropped (for a WebSocket: when
/// the socket closes).
#[derive(Clone)]
pub(crate) struct ConnSlot(Arc<SlotGuard>);

struct SlotGuard {
    open: Arc<AtomicUsize>,
    /// The socket's write-stall limit, in milliseconds (read by its [`StallIo`]).
    write_stall_ms: Arc<AtomicU64>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!("tidemark_open_connections").decrement(1.0);
    }
}

impl ConnSlot {
    /// Changes how long the socket's writes may make no progress before they fail.
    pub(crate) fn set_write_stall(&self, limit: Duration) {
        self.0
            .write_stall_ms
            .store(limit.as_millis() as u64, Ordering::Relaxed);
    }
}

/// A socket whose writes fail (`TimedOut`) after making no progress for the limit: a peer
/// that does not read cannot hold a response, or the memory behind it, for ever.
struct StallIo {
    tcp: TcpStream,
    limit_ms: Arc<AtomicU64>,
    timer: Pin<Box<tokio::time::Sleep>>,
    armed: bool,
}

impl StallIo {
    fn new(tcp: TcpStream, limit_ms: Arc<AtomicU64>) -> StallIo {
        StallIo {
            tcp,
            limit_ms,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            armed: false,
        }
    }

    /// Maps a write's result: progress disarms the timer; `Pending` arms it, and fails once
    /// it has run out.
    fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if r.is_ready() {
            self.armed = false;
            return r;
        }
        if !self.armed {
            let limit = Duration::from_millis(self.limit_ms.load(Ordering::Relaxed));
            self.timer
                .as_mut()
                .reset(tokio::time::Instant::now() + limit);
            self.armed = true;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                metrics::counter!("tidemark_write_stalls_total").increment(1);
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the peer read nothing for too long",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for StallIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.tcp).poll_write(cx, buf);
        self.check(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        self.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// How one listener serves its connections.
#[derive(Clone, Debug)]
pub(crate) struct ListenerConfig {
    /// Most open connections served normally.
    pub max: usize,
    /// Connections above `max` still read, for `/healthz` and `/metrics` only.
    pub reserve: usize,
    /// A request head (and a TLS handshake) must arrive within this time.
    pub header_timeout: Duration,
    /// A socket's writes may make no progress for this long.
    pub write_stall: Duration,
    /// Serve inside TLS.
    pub tls: Option<TlsConfig>,
}

/// Serves `app` on `listener` until `stop`, then lets open exchanges finish (each within
/// [`SHUTDOWN_GRACE`]). Every connection task runs on `tracker`.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: ListenerConfig,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let open = Arc::new(AtomicUsize::new(0));
    let refusing = Arc::new(AtomicUsize::new(0));
    let max = cfg.max.max(1);
    let reserve = cfg.reserve;
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                if !is_connection_error(&e) {
                    // EMFILE/ENFILE and the like: the connection stays in the backlog;
                    // retry shortly instead of spinning.
                    tracing::error!(error = %e, "accept failed");
                    metrics::counter!("tidemark_accept_errors_total").increment(1);
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                continue;
            }
        };
        // Small frames must not wait for Nagle's algorithm (it added ~40 ms to acks and
        // deliveries).
        let _ = tcp.set_nodelay(true);
        let n = open.fetch_add(1, Ordering::AcqRel) + 1;
        if n > max + reserve {
            open.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("tidemark_connections_refused_total").increment(1);
            refuse(tcp, cfg.tls.clone(), &refusing, &tracker);
            continue;
        }
        metrics::gauge!("tidemark_open_connections").increment(1.0);
        let write_stall_ms = Arc::new(AtomicU64::new(cfg.write_stall.as_millis() as u64));
        let io = StallIo::new(tcp, write_stall_ms.clone());
        let slot = ConnSlot(Arc::new(SlotGuard {
            open: open.clone(),
            write_stall_ms,
        }));
        let overflow = n > max;
        if overflow {
            metrics::counter!("tidemark_connections_refused_total").increment(1);
        }
        let (app, tls, header_timeout, stop) = (
            app.clone(),
            cfg.tls.clone(),
            cfg.header_timeout,
            stop.clone(),
        );
        tracker.spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(io, app, slot, overflow, header_timeout, stop).await;
            };
            // the handshake holds the connection's slot, and is bounded like a request head
            let handshake = tokio::select! {
                r = tokio::time::timeout(header_timeout, tls.acceptor().accept(io)) => r,
                _ = stop.cancelled() => return,
            };
            match handshake {
                Ok(Ok(io)) => serve_connection(io, app, slot, overflow, header_timeout, stop).await,
                Ok(Err(e)) => {
                    metrics::counter!("tidemark_tls_handshake_failures_total").increment(1);
                    tracing::debug!(error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    metrics::counter!("tidemark_tls_handshake_failures_total").increment(1);
                    tracing::debug!("TLS handshake timed out");
                }
            }
        });
    }
}

/// Serves one connection; `overflow`: above the cap, only health and metrics are answered.
async fn serve_connection<I>(
    io: I,
    app: Router,
    slot: ConnSlot,
    overflow: bool,
    header_timeout: Duration,
    stop: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let inner = TowerToHyperService::new(app);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let mut req = req.map(Body::new);
        if overflow && !matches!(req.uri().path(), "/healthz" | "/metrics") {
            return Either::Left(std::future::ready(Ok::<Response, Infallible>(full())));
        }
        req.extensions_mut().insert(slot.clone());
        Either::Right(hyper::service::Service::call(&inner, req))
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_CONNECTION_BUFFER)
        .max_headers(MAX_HEADERS)
        .keep_alive(!overflow);
    let conn = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        }
        _ = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, conn).await;
        }
    }
}

/// The answer above the connection cap.
fn full() -> Response {
    error_response(
        ErrorCode::Overloaded,
        "too many open connections; retry later",
    )
}

/// Writes a 503 `overloaded` on a socket above `max + reserve` and closes it, without
/// parsing anything (on a TLS listener, after the handshake): at most [`MAX_REFUSING`] at
/// once, each within [`REFUSAL_LINGER`].
fn refuse(
    tcp: TcpStream,
    tls: Option<TlsConfig>,
    refusing: &Arc<AtomicUsize>,
    tracker: &TaskTracker,
) {
    if refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
        refusing.fetch_sub(1, Ordering::AcqRel);
        return; // dropped: the peer sees the connection closed
    }
    let refusing = refusing.clone();
    tracker.spawn(async move {
        let _ = tokio::time::timeout(REFUSAL_LINGER, async move {
            match tls {
                None => write_refusal(tcp).await,
                Some(tls) => write_refusal(tls.acceptor().accept(tcp).await?).await,
            }
        })
        .await;
        refusing.fetch_sub(1, Ordering::AcqRel);
    });
}

async fn write_refusal<S: AsyncRead + AsyncWrite + Unpin>(mut io: S) -> std::io::Result<()> {
    let body = serde_json::to_string(&ErrorBody::new(
        ErrorCode::Overloaded,
        "too many open connections; retry later",
    ))
    .unwrap_or_default();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n",
        body.len()
    );
    io.write_all(head.as_bytes()).await?;
    io.write_all(body.as_bytes()).await?;
    io.shutdown().await?;
    // Read what the client sent until it closes: closing with unread data would reset the
    // connection, and the peer could lose the response.
    let mut sink = [0u8; 1024];
    while io.read(&mut sink).await? > 0 {}
    Ok(())
}

fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}
