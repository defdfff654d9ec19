//! The handshake: the upgrade request with its credential ([`build_request`]), the
//! upgrade's failures as [`Error`]s ([`connect_error`]: an HTTP refusal keeps the server's
//! code), and the wait for the server's `ready` frame ([`wait_ready`]); [`handshake_on`]
//! runs all three over a TCP connection the caller made.

use std::time::Duration;

use futures::{Stream, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::Request;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::WebSocketStream;
use url::Url;

use super::incoming::{parse_incoming, Incoming};
use super::Auth;
use crate::error::Error;

/// A WebSocket over a caller's TCP connection, after the server's `ready`: what
/// [`handshake_on`] returns.
#[derive(Debug)]
pub struct Handshaken {
    /// The socket, with no task reading or writing it: the caller must keep reading it (a
    /// ping is answered while reading) or the server closes it as idle.
    pub ws: WebSocketStream<TcpStream>,
    /// The authenticated user, from `ready.user`.
    pub user: String,
    /// `ready.after`.
    pub after: u64,
}

/// The upgrade of `ws_url` with `auth` over `tcp` (a connection the caller made, e.g. from a
/// chosen source address), then the wait for `ready`, all within `timeout`. For callers that
/// hold many connections and need no [`Client`](super::Client) tasks (`bench idle`).
///
/// Errors: as [`Client::connect`](super::Client::connect).
pub async fn handshake_on(
    tcp: TcpStream,
    ws_url: &str,
    auth: &Auth,
    config: WebSocketConfig,
    timeout: Duration,
) -> Result<Handshaken, Error> {
    let (request, shown_url) = build_request(ws_url, auth)?;
    let handshake = async {
        let (mut ws, _response) =
            tokio_tungstenite::client_async_with_config(request, tcp, Some(config))
                .await
                .map_err(|e| connect_error(&shown_url, e))?;
        let (user, after) = wait_ready(&mut ws).await?;
        Ok::<_, Error>(Handshaken { ws, user, after })
    };
    tokio::time::timeout(timeout, handshake)
        .await
        .map_err(|_| Error::Timeout(timeout, "the ready frame"))?
}

/// The upgrade request, and the URL to show in errors (without its query, which may carry a
/// credential).
pub(super) fn build_request(ws_url: &str, auth: &Auth) -> Result<(Request, String), Error> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: ws_url.to_owned(),
        reason,
    };
    let mut url = Url::parse(ws_url).map_err(|e| invalid(e.to_string()))?;
    match url.scheme() {
        "ws" => {}
        // Refused here, where no retry can help: the connect would fail the same way every
        // time, as a (retryable) connect error.
        "wss" => {
            return Err(invalid(
                "wss:// needs TLS, which this client is built without; use ws:// (behind a \
                 TLS-terminating proxy if the network needs TLS)"
                    .into(),
            ))
        }
        other => return Err(invalid(format!("scheme must be ws, not {other}"))),
    }
    let mut shown = url.clone();
    shown.set_query(None);
    if let Auth::DevUser(name) = auth {
        url.query_pairs_mut().append_pair("user", name);
    }
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| invalid(e.to_string()))?;
    if let Auth::Token(token) = auth {
        let value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| invalid("the token contains characters not allowed in a header".into()))?;
        request.headers_mut().insert(AUTHORIZATION, value);
    }
    Ok((request, shown.to_string()))
}

/// The [`Error`] of a failed upgrade of `url`.
pub(super) fn connect_error(url: &str, e: tungstenite::Error) -> Error {
    match e {
        tungstenite::Error::Http(response) => {
            let status = response.status().as_u16();
            let body = response.body().as_deref().unwrap_or_default();
            let detail = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
                let err = v.get("error")?;
                Some((
                    err.get("code")?.as_str()?.to_owned(),
                    err.get("message")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                ))
            });
            let (code, message) = detail.unwrap_or_else(|| {
                (
                    "upgrade_rejected".to_owned(),
                    String::from_utf8_lossy(body).into_owned(),
                )
            });
            Error::Rejected {
                status,
                code,
                message,
            }
        }
        source => Error::Connect {
            url: url.to_owned(),
            source,
        },
    }
}

/// Reads frames until the server's `ready`: its `(user, after)`.
pub(super) async fn wait_ready<S>(stream: &mut S) -> Result<(String, u64), Error>
where
    S: Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
{
    loop {
        let text = match stream.next().await {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return Err(Error::Closed),
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Binary(_))) => {
                return Err(Error::Protocol("binary frame before ready".into()))
            }
            Some(Ok(_)) => continue, // ping / pong
        };
        match parse_incoming(text.as_str()) {
            Ok(Incoming::Ready { user, after }) => return Ok((user, after)),
            Ok(Incoming::Error(e)) => {
                return Err(Error::Server {
                    code: e.code,
                    message: e.message,
                })
            }
            Ok(Incoming::Unknown) => continue,
            Ok(other) => {
                return Err(Error::Protocol(format!(
                    "first frame was not ready: {other:?}"
                )))
            }
            Err(e) => return Err(Error::Protocol(e)),
        }
    }
}
