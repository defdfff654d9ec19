//! Tidemark's client library: client protocol v1 (`docs/protocol.md`) over the WebSocket
//! endpoint `/v1/ws`, and the functions behind the `tidemark` CLI's client commands.
//!
//! - [`Client`]: one authenticated connection. [`Client::connect`] waits for the server's
//!   `ready` frame; then a reader task routes `send_ack`/`error` frames to whoever waits for
//!   that send id ([`ClientHandle::send_and_wait`], [`ClientHandle::start_send`]) and everything
//!   else to [`Client::next_event`], while one writer task owns the socket's sink behind a
//!   bounded queue. [`ClientHandle`] (from [`Client::handle`]; a `Client` derefs to its own)
//!   sends from other tasks, so many sends can be in flight at once. See the [`client`]
//!   module for the routing rules.
//! - [`Auth`]: a bearer token (`Authorization` header) or a `--dev-auth` user name
//!   (`?user=`).
//! - CLI helpers: [`make_token`], [`parse_ttl`], [`read_secret`], [`send_once`], [`tail`],
//!   [`format_entry`], [`new_message_id`].
//! - [`SeqDedup`]: drops repeated deliveries (the wire is at least once).
//! - [`Error`]: the one error type, with a stable [`code`](Error::code).
//!
//! ```no_run
//! # async fn demo() -> Result<(), tidemark_client::Error> {
//! use std::time::Duration;
//! use tidemark_client::{Auth, Client, Event};
//!
//! let mut client = Client::connect("ws://127.0.0.1:8080/v1/ws", &Auth::DevUser("alice".into())).await?;
//! let offsets = client
//!     .send_and_wait("c-1", &["bob".to_string()], "hi", Duration::from_secs(10))
//!     .await?;
//! println!("committed at {offsets:?}");
//! while let Some(Event::Deliver(entry)) = client.next_event().await {
//!     println!("{}", tidemark_client::format_entry(&entry));
//!     client.ack(entry.seq).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! Only `ws://` URLs work: the crate is built without TLS support, and a `wss://` URL is
//! refused at once with [`Error::InvalidUrl`] (not retryable).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cli;
pub mod client;
mod dedup;
mod error;

pub use cli::{
    format_entry, format_unix_us, make_token, make_token_with, new_message_id, parse_ttl,
    read_secret, send_once, tail, tail_with, Reconnect, SECRET_ENV_VAR, SEND_ONCE_TIMEOUT,
};
pub use client::{
    Auth, Client, ClientHandle, ClientOptions, Event, Offsets, PendingAck, BAD_SERVER_FRAME,
    CLOSE_TIMEOUT, CONNECT_TIMEOUT, PING_INTERVAL, READ_TIMEOUT, WRITE_QUEUE,
};
pub use dedup::SeqDedup;
pub use error::Error;
pub use tidemark_protocol::Entry;
