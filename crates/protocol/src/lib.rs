//! Tidemark's client protocol, version 1: everything a client and the gateway must agree on,
//! with no network I/O and no Redis in it.
//!
//! - [`frames`]: the WebSocket frames (`/v1/ws`, one JSON object per text frame), their
//!   [`Limits`], and [`parse_client_frame`], the one entry point for untrusted client input.
//! - [`http`]: the same operations over HTTP (`POST /v1/messages`, `GET /v1/mailbox`,
//!   `POST /v1/mailbox/ack`): request/response bodies and their parsers.
//! - [`token`]: HMAC-SHA256 bearer tokens (`v1.<payload>.<mac>`) naming a user and an expiry.
//! - [`secret`]: the one loader of the token secret (file or environment, at least 32 bytes
//!   after trimming) used by the server, the CLI and the client helpers.
//! - [`entry`]: the binary mailbox entry stored as a sorted-set member in the mailbox Redis
//!   (the one decoder, whole or head only).
//! - [`time`]: unix microseconds as an RFC 3339 UTC timestamp (the one formatter).
//! - [`close`]: the WebSocket close codes the gateway sends ([`CloseCode`]).
//! - [`error`]: the crate's [`Error`] and the wire-level [`ErrorCode`]s (stable strings,
//!   HTTP status, retryable or not).
//!
//! The normative description of the protocol is `docs/protocol.md`; this crate implements it
//! and its tests check the two agree on the error-code and close-code tables.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod close;
pub mod entry;
pub mod error;
pub mod frames;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod secret;
pub mod time;
pub mod token;

pub use close::CloseCode;
pub use entry::{decode_entry, decode_entry_head, encode_entry, Entry, EntryHead};
pub use error::{Error, ErrorCode};
pub use frames::{deliver_json, parse_client_frame, ClientFrame, FrameError, Limits, ServerFrame};
pub use http::{
    parse_ack_request, parse_mailbox_query, parse_send_request, AckRequest, AckResponse, ErrorBody,
    ErrorDetail, MailboxPage, MailboxQuery, SendRequest, SendResponse,
};
pub use secret::{SecretError, TokenSecret};
pub use token::{sign, verify, Claims, TokenError, INVALID_TOKEN_MESSAGE};

/// Largest mailbox seq / dispatch-log offset: seqs are u48 (ADR-0015 keeps the low 48 bits;
/// the high 16 are reserved). Every u48 fits a JSON number (an IEEE double) exactly.
pub const MAX_SEQ: u64 = (1 << 48) - 1;

/// Longest user (recipient, sender) id in bytes. Ids are UTF-8, 1..=128 bytes; the limit is
/// what lets an [`entry`] store the sender's length in one byte.
pub const MAX_USER_ID_BYTES: usize = 128;

/// Whether `id` is a valid user id: 1..=[`MAX_USER_ID_BYTES`] bytes (a `&str` is always UTF-8)
/// and no control character ([`has_control_chars`]).
///
/// The same rule applies to recipients in `send`, to the user in a token and to the dev-auth
/// `?user=`, so any id accepted anywhere is accepted everywhere. (A mailbox entry's sender is
/// only length-checked: records committed before control characters were refused must still
/// be stored.)
pub fn is_valid_user_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_USER_ID_BYTES && !has_control_chars(id)
}

/// Whether `s` contains a C0 control character (U+0000–U+001F) or DEL (U+007F), which user
/// ids and client message ids may not: they end up in logs, Redis keys and terminals, and NUL
/// separated sender and id in the earlier dedupe key (ADR-0022). In UTF-8 these are single
/// bytes that never occur inside a multi-byte character, so a byte scan is exact.
pub fn has_control_chars(s: &str) -> bool {
    s.bytes().any(|b| b < 0x20 || b == 0x7f)
}
