//! The crate's error type and the protocol's wire error codes.
//!
//! [`ErrorCode`] is what a client sees (in an `error` frame or an HTTP error body); [`Error`]
//! is what this crate's functions return. Both expose stable code strings: codes are part of
//! the protocol and never change meaning once published.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::frames::FrameError;
use crate::secret::SecretError;
use crate::token::TokenError;

/// A stable, machine-readable error code sent to clients.
///
/// Exists so the gateway, the client and `docs/protocol.md` share one closed list: every
/// rejected frame or request carries exactly one of these, with a fixed HTTP status and a
/// fixed retry policy. Serialised as its snake_case string (`"bad_request"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame/body is not JSON, or not a JSON object.
    BadJson,
    /// A field is missing or has the wrong type (e.g. `to` not an array of strings, a seq
    /// that is not an integer, an empty `to`, a bad query parameter).
    BadRequest,
    /// `type` names no client frame of protocol version 1.
    UnknownType,
    /// The frame/body is longer than `max_frame_bytes`.
    FrameTooLarge,
    /// `body` is longer than `max_body_bytes` (UTF-8 bytes).
    BodyTooLarge,
    /// `to` has more than `max_recipients` entries.
    TooManyRecipients,
    /// A recipient is empty, longer than 128 bytes, contains a control character
    /// (U+0000–U+001F, U+007F), or appears twice in `to`.
    BadRecipient,
    /// The client message `id` is empty, longer than `max_id_bytes`, or contains a control
    /// character (U+0000–U+001F, U+007F).
    BadId,
    /// A seq/offset is outside `0..=2^48-1` (negative or too large).
    SeqOutOfRange,
    /// No credentials, a token that is malformed or fails its signature check, or a caller's
    /// user id that is not valid (e.g. a control character in the dev-auth `user`).
    Unauthorized,
    /// A token whose signature is valid but whose expiry has passed.
    TokenExpired,
    /// The commit side is pushing back; nothing was lost, retry later (same `id` for a send).
    Overloaded,
    /// An unexpected server failure; retry later (same `id` for a send).
    Internal,
    /// No such endpoint or resource.
    NotFound,
    /// The client exceeded its request rate; retry later.
    RateLimited,
    /// A shard the recipients fall in has used up its offsets (the dispatch log's head is at
    /// 2^48-1): the send was refused there and will keep being refused until an operator
    /// acts on the shard. Not retryable.
    LogExhausted,
    /// The send's `id` was already used by this sender, within the 24 h dedupe lifetime, for
    /// another message (other recipients or another body). Nothing was committed. Not
    /// retryable: a new message needs a new id.
    IdReused,
    /// The user already has as many open connections as a gateway allows; retry once one
    /// has closed.
    TooManyConnections,
    /// A shard the recipients fall in is stopped on this gateway's node because its watermark
    /// is corrupt (fail closed): nothing was committed, so nothing waits there undelivered.
    /// Retryable once an operator has repaired the shard.
    ShardUnavailable,
    /// The endpoint exists but not with this HTTP method (e.g. `GET /v1/messages`).
    MethodNotAllowed,
    /// Valid credentials that do not allow this endpoint: a user token on an operator's
    /// endpoint (`GET /v1/admin/status` needs an admin token). Not retryable with the same
    /// token.
    Forbidden,
}

impl ErrorCode {
    /// Every code, in documentation order.
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::BadJson,
        ErrorCode::BadRequest,
        ErrorCode::UnknownType,
        ErrorCode::FrameTooLarge,
        ErrorCode::BodyTooLarge,
        ErrorCode::TooManyRecipients,
        ErrorCode::BadRecipient,
        ErrorCode::BadId,
        ErrorCode::SeqOutOfRange,
        ErrorCode::Unauthorized,
        ErrorCode::TokenExpired,
        ErrorCode::Overloaded,
        ErrorCode::Internal,
        ErrorCode::NotFound,
        ErrorCode::RateLimited,
        ErrorCode::LogExhausted,
        ErrorCode::IdReused,
        ErrorCode::TooManyConnections,
        ErrorCode::ShardUnavailable,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Forbidden,
    ];

    /// The stable wire string, e.g. `"bad_request"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadJson => "bad_json",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownType => "unknown_type",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::TooManyRecipients => "too_many_recipients",
            ErrorCode::BadRecipient => "bad_recipient",
            ErrorCode::BadId => "bad_id",
            ErrorCode::SeqOutOfRange => "seq_out_of_range",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::TokenExpired => "token_expired",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Internal => "internal",
            ErrorCode::NotFound => "not_found",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::LogExhausted => "log_exhausted",
            ErrorCode::IdReused => "id_reused",
            ErrorCode::TooManyConnections => "too_many_connections",
            ErrorCode::ShardUnavailable => "shard_unavailable",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Forbidden => "forbidden",
        }
    }

    /// Whether the same request may be sent again unchanged, after a backoff.
    ///
    /// True for `overloaded`, `rate_limited`, `too_many_connections` and `internal`: the
    /// request itself was fine. A
    /// retried `send` must reuse its `id`; the server dedupes on (sender, id), so a send that
    /// was in fact committed is not committed twice. Every other code needs a changed request
    /// (or, for `token_expired`, a new token) first.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Overloaded
                | ErrorCode::RateLimited
                | ErrorCode::TooManyConnections
                | ErrorCode::ShardUnavailable
                | ErrorCode::Internal
        )
    }

    /// The HTTP status that carries this code on the HTTP endpoints (and on a refused
    /// WebSocket upgrade).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadJson
            | ErrorCode::BadRequest
            | ErrorCode::UnknownType
            | ErrorCode::TooManyRecipients
            | ErrorCode::BadRecipient
            | ErrorCode::BadId
            | ErrorCode::SeqOutOfRange => 400,
            ErrorCode::Unauthorized | ErrorCode::TokenExpired => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::FrameTooLarge | ErrorCode::BodyTooLarge => 413,
            ErrorCode::RateLimited | ErrorCode::TooManyConnections => 429,
            ErrorCode::Internal => 500,
            ErrorCode::Overloaded | ErrorCode::ShardUnavailable => 503,
            ErrorCode::LogExhausted => 507,
            ErrorCode::IdReused => 422,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Returned by [`ErrorCode::from_str`] for a string that is no known code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code")]
pub struct UnknownErrorCode;

impl FromStr for ErrorCode {
    type Err = UnknownErrorCode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ErrorCode::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or(UnknownErrorCode)
    }
}

/// Every error this crate returns.
///
/// One enum so callers can `?` across modules; each variant keeps its own typed detail and a
/// stable [`code`](Error::code) for logs and metrics, and maps to the [`ErrorCode`] a client
/// should see via [`error_code`](Error::error_code).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A client frame or HTTP request was rejected. Code: the frame's own code
    /// (`bad_json`, `bad_request`, …).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A bearer token was rejected. Code: `token_malformed`, `token_bad_signature` or
    /// `token_expired`.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The token secret could not be loaded or is too short. Code: `secret_unreadable`,
    /// `secret_missing`, `secret_too_short` or `secret_create`.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// A stored mailbox entry is truncated or invalid. Code: `bad_entry`.
    #[error("bad mailbox entry: {reason}")]
    BadEntry {
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl Error {
    /// The stable code string of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Frame(e) => e.code(),
            Error::Token(e) => e.code(),
            Error::Secret(e) => e.code(),
            Error::BadEntry { .. } => "bad_entry",
        }
    }

    /// The code a client should be shown. A bad stored entry or secret is the server's
    /// fault: `internal`.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            Error::Frame(e) => e.error_code(),
            Error::Token(e) => e.error_code(),
            Error::Secret(_) | Error::BadEntry { .. } => ErrorCode::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(seen.insert(code.as_str()), "duplicate {code}");
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(code));
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        assert_eq!("nope".parse::<ErrorCode>(), Err(UnknownErrorCode));
    }

    #[test]
    fn http_status_and_retryable() {
        use ErrorCode::*;
        let table = [
            (BadJson, 400, false),
            (BadRequest, 400, false),
            (UnknownType, 400, false),
            (FrameTooLarge, 413, false),
            (BodyTooLarge, 413, false),
            (TooManyRecipients, 400, false),
            (BadRecipient, 400, false),
            (BadId, 400, false),
            (SeqOutOfRange, 400, false),
            (Unauthorized, 401, false),
            (TokenExpired, 401, false),
            (Overloaded, 503, true),
            (Internal, 500, true),
            (NotFound, 404, false),
            (RateLimited, 429, true),
            (LogExhausted, 507, false),
            (IdReused, 422, false),
            (TooManyConnections, 429, true),
            (ShardUnavailable, 503, true),
            (MethodNotAllowed, 405, false),
            (Forbidden, 403, false),
        ];
        assert_eq!(table.len(), ErrorCode::ALL.len());
        for (code, status, retry) in table {
            assert_eq!(code.http_status(), status, "{code}");
            assert_eq!(code.retryable(), retry, "{code}");
        }
    }

    #[test]
    fn error_codes() {
        let e = Error::BadEntry { reason: "x" };
        assert_eq!(e.code(), "bad_entry");
        assert_eq!(e.error_code(), ErrorCode::Internal);
        let e = Error::from(TokenError::BadSignature);
        assert_eq!(e.code(), "token_bad_signature");
        assert_eq!(e.error_code(), ErrorCode::Unauthorized);
    }
}
