//! WebSocket frames of client protocol version 1: one JSON object per text frame, tagged by
//! `"type"`.
//!
//! Client → server: `send`, `ack`, `sync`. Server → client: `ready`, `send_ack`, `deliver`,
//! `error`. Untrusted client text goes through [`parse_client_frame`], which enforces
//! [`Limits`] and maps every rejection to a stable [`ErrorCode`]; it never panics.
//!
//! Unknown fields in a client frame are ignored (so a newer client can add optional fields);
//! if a key appears twice in one object, the last occurrence wins.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::entry::Entry;
use crate::error::ErrorCode;
use crate::http::SendRequest;
use crate::{has_control_chars, is_valid_user_id, MAX_SEQ, MAX_USER_ID_BYTES};

/// Size limits applied to untrusted client input.
///
/// Exists so every entry point (WebSocket and HTTP) rejects oversized input the same way and
/// before doing any work for it; a deployment may tighten or loosen them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Longest accepted frame (or HTTP body) in bytes, as received. Default 65536.
    pub max_frame_bytes: usize,
    /// Longest accepted message `body` in UTF-8 bytes, after JSON unescaping. Default 16384.
    pub max_body_bytes: usize,
    /// Most recipients in one `send`. Default 100.
    pub max_recipients: usize,
    /// Longest client message `id` in bytes. Default 128.
    pub max_id_bytes: usize,
    /// Largest `limit` of `GET /v1/mailbox`. Default 1000.
    pub max_page_entries: u32,
    /// `limit` of `GET /v1/mailbox` when the query names none. Default 100.
    pub default_page_entries: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 65_536,
            max_body_bytes: 16_384,
            max_recipients: 100,
            max_id_bytes: 128,
            max_page_entries: 1000,
            default_page_entries: 100,
        }
    }
}

/// A frame a client sends.
///
/// The serde derives give the exact wire shape (for clients that build frames); a server must
/// read untrusted input with [`parse_client_frame`], which also enforces [`Limits`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientFrame {
    /// `{"type":"send","id":"c-1","to":["bob"],"body":"hi"}`: commit a message to every
    /// recipient; answered by `send_ack` (or `error` with the same `id`).
    Send(SendRequest),
    /// `{"type":"ack","seq":3471}`: every entry at or below `seq` is processed; the server may
    /// trim them. Not answered (except by `error`).
    Ack {
        /// Highest processed mailbox seq (u48).
        seq: u64,
    },
    /// `{"type":"sync","after":3400}`: restart the delivery stream after `after`, then keep
    /// streaming live entries.
    Sync {
        /// The seq the stream restarts after (u48).
        after: u64,
    },
}

/// A frame the server sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    /// `{"type":"ready","user":"alice","after":3400}`: sent once, first, after the connection
    /// is authenticated. Delivery resumes after `after` (the mailbox's acked cursor).
    Ready {
        /// The authenticated user, whose mailbox this connection streams.
        user: String,
        /// The seq delivery resumes after.
        after: u64,
    },
    /// `{"type":"send_ack","id":"c-1","offsets":{"12":3471}}`: the `send` with this `id` is
    /// durably committed. `offsets` maps each shard the recipients fall in to the dispatch-log
    /// offset assigned there, which is also the seq of the entry in each of those mailboxes.
    SendAck {
        /// The client message id of the `send`.
        id: String,
        /// Shard number → log offset (JSON object with decimal-string keys).
        #[serde(with = "crate::http::shard_offsets")]
        offsets: BTreeMap<u32, u64>,
    },
    /// `{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1764489600000000}`:
    /// one mailbox entry, in seq order.
    Deliver(Entry),
    /// `{"type":"error","code":"bad_request","message":"…","id":"c-1"}`: a frame was rejected
    /// or a send failed. `id` is present when the client id is known.
    Error {
        /// Stable code.
        code: ErrorCode,
        /// Human-readable detail; not stable, do not parse.
        message: String,
        /// The client message id the error refers to, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
    },
}

impl ServerFrame {
    /// The frame as the JSON text of one WebSocket text frame.
    pub fn to_json(&self) -> String {
        // Serialising these types cannot fail: all map keys are integers, no custom impls.
        serde_json::to_string(self).expect("ServerFrame always serialises")
    }
}

/// The `deliver` frame of a stored entry whose sender and body are borrowed (a decoded
/// [`crate::entry::EntryHead`]): the same text as `ServerFrame::Deliver(entry).to_json()`,
/// without making the entry's `String`s first (tested against it).
pub fn deliver_json(seq: u64, from: &str, body: &str, sent_at_us: u64) -> String {
    /// `ServerFrame::Deliver(Entry)`'s fields, in its order, borrowed.
    #[derive(Serialize)]
    #[serde(tag = "type", rename = "deliver")]
    struct Deliver<'a> {
        seq: u64,
        from: &'a str,
        body: &'a str,
        sent_at_us: u64,
    }
    serde_json::to_string(&Deliver {
        seq,
        from,
        body,
        sent_at_us,
    })
    .expect("a deliver frame always serialises")
}

impl ClientFrame {
    /// The frame as the JSON text of one WebSocket text frame.
    pub fn to_json(&self) -> String {
        // Serialising these types cannot fail: no maps, no custom impls.
        serde_json::to_string(self).expect("ClientFrame always serialises")
    }
}

/// Why a client frame (or HTTP request) was rejected.
///
/// Carries the stable [`ErrorCode`], a human-readable message and — when it could be read
/// from the input — the client message `id`, so the `error` frame can echo it and the client
/// can match the failure to its `send`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct FrameError {
    code: ErrorCode,
    message: String,
    id: Option<String>,
}

impl FrameError {
    /// A rejection with no known client id.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        FrameError {
            code,
            message: message.into(),
            id: None,
        }
    }

    /// The stable code string, e.g. `"bad_recipient"`.
    pub fn code(&self) -> &'static str {
        self.code.as_str()
    }

    /// The code as an [`ErrorCode`].
    pub fn error_code(&self) -> ErrorCode {
        self.code
    }

    /// Human-readable detail (never echoes message bodies).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The client message id, when it could be recovered from the input.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The `error` frame that answers this rejection.
    pub fn to_server_frame(&self) -> ServerFrame {
        ServerFrame::Error {
            code: self.code,
            message: self.message.clone(),
            id: self.id.clone(),
        }
    }
}

/// A rejection before the client id is attached.
pub(crate) type Reject = (ErrorCode, String);

pub(crate) fn reject<T>(code: ErrorCode, message: impl Into<String>) -> Result<T, Reject> {
    Err((code, message.into()))
}

/// Refuses a size over its limit with `code`: `n` (in `unit`) above `limit` is
/// "`<what> <n> <unit>, limit is <limit>`", e.g. "`body` is 16386 bytes, limit is 16384".
fn at_most(code: ErrorCode, what: &str, n: usize, unit: &str, limit: usize) -> Result<(), Reject> {
    if n > limit {
        reject(code, format!("{what} {n} {unit}, limit is {limit}"))
    } else {
        Ok(())
    }
}

/// Parses and validates one WebSocket text frame from a client.
///
/// Checks, in order: size (`frame_too_large`), JSON object (`bad_json`), `type`
/// (`bad_request` if missing or not a string, `unknown_type`), then the fields of that type.
/// For `send`: `id` (`bad_request`, `bad_id` for an empty, too long or control-character
/// id), `to` (`bad_request` when not a non-empty array of strings, `too_many_recipients`,
/// `bad_recipient` for an empty, over-128-byte, control-character or duplicate recipient),
/// `body` (`bad_request`, `body_too_large`). Control characters are U+0000–U+001F and U+007F. For `ack`/`sync`: the seq must be a
/// JSON integer (`bad_request`) in `0..=2^48-1` (`seq_out_of_range`; any number outside that
/// range, including negative ones, gets this code).
///
/// The returned error carries the client `id` whenever the object has a valid string `id`
/// (1..=`max_id_bytes` bytes, no control character). Never panics.
pub fn parse_client_frame(text: &str, limits: &Limits) -> Result<ClientFrame, FrameError> {
    match fast::parse(text, limits) {
        Some(frame) => Ok(frame),
        None => parse_client_frame_in_full(text, limits),
    }
}

/// The parse every frame the fast path does not take goes through (and the one that says
/// what is wrong with a frame): the whole frame as a JSON value, then each field checked in
/// the documented order.
fn parse_client_frame_in_full(text: &str, limits: &Limits) -> Result<ClientFrame, FrameError> {
    let map = parse_object(text.as_bytes(), limits)?;
    let result = client_frame_from_map(&map, limits);
    result.map_err(|(code, message)| FrameError {
        code,
        message,
        id: recover_id(&map, limits),
    })
}

/// Size check and JSON parse shared by the WebSocket and HTTP parsers.
pub(crate) fn parse_object(
    bytes: &[u8],
    limits: &Limits,
) -> Result<Map<String, Value>, FrameError> {
    at_most(
        ErrorCode::FrameTooLarge,
        "frame is",
        bytes.len(),
        "bytes",
        limits.max_frame_bytes,
    )
    .map_err(|(code, message)| FrameError::new(code, message))?;
    // serde_json bounds nesting depth (128), so hostile nesting cannot overflow the stack.
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(FrameError::new(
            ErrorCode::BadJson,
            "frame is not a JSON object",
        )),
        Err(e) => Err(FrameError::new(
            ErrorCode::BadJson,
            format!("invalid JSON: {e}"),
        )),
    }
}

/// Attaches the recoverable client id (if any) to a rejection.
pub(crate) fn with_id(map: &Map<String, Value>, limits: &Limits, r: Reject) -> FrameError {
    FrameError {
        code: r.0,
        message: r.1,
        id: recover_id(map, limits),
    }
}

fn recover_id(map: &Map<String, Value>, limits: &Limits) -> Option<String> {
    match map.get("id") {
        Some(Value::String(id)) if valid_client_id(id, limits) => Some(id.clone()),
        _ => None,
    }
}

pub(crate) fn valid_client_id(id: &str, limits: &Limits) -> bool {
    !id.is_empty() && id.len() <= limits.max_id_bytes && !has_control_chars(id)
}

fn client_frame_from_map(map: &Map<String, Value>, limits: &Limits) -> Result<ClientFrame, Reject> {
    let ty = match map.get("type") {
        None => return reject(ErrorCode::BadRequest, "missing field `type`"),
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return reject(ErrorCode::BadRequest, "`type` must be a string"),
    };
    match ty {
        "send" => send_from_map(map, limits).map(ClientFrame::Send),
        "ack" => Ok(ClientFrame::Ack {
            seq: seq_field(map, "seq")?,
        }),
        "sync" => Ok(ClientFrame::Sync {
            after: seq_field(map, "after")?,
        }),
        _ => reject(ErrorCode::UnknownType, "unknown frame type"),
    }
}

/// Validates the fields of a send (`id`, `to`, `body`), shared with `POST /v1/messages`.
pub(crate) fn send_from_map(
    map: &Map<String, Value>,
    limits: &Limits,
) -> Result<SendRequest, Reject> {
    let id = string_field(map, "id")?;
    if !valid_client_id(id, limits) {
        return reject(
            ErrorCode::BadId,
            format!(
                "`id` must be 1..={} bytes without control characters",
                limits.max_id_bytes
            ),
        );
    }

    let to = match map.get("to") {
        None => return reject(ErrorCode::BadRequest, "missing field `to`"),
        Some(Value::Array(to)) => to,
        Some(_) => return reject(ErrorCode::BadRequest, "`to` must be an array of strings"),
    };
    if to.is_empty() {
        return reject(
            ErrorCode::BadRequest,
            "`to` must name at least one recipient",
        );
    }
    at_most(
        ErrorCode::TooManyRecipients,
        "`to` has",
        to.len(),
        "recipients",
        limits.max_recipients,
    )?;
    let mut seen = HashSet::with_capacity(to.len());
    let mut recipients = Vec::with_capacity(to.len());
    for (i, r) in to.iter().enumerate() {
        let Value::String(r) = r else {
            return reject(ErrorCode::BadRequest, "`to` must be an array of strings");
        };
        if !is_valid_user_id(r) {
            return reject(
                ErrorCode::BadRecipient,
                format!(
                    "recipient #{i} must be 1..={MAX_USER_ID_BYTES} bytes without control characters"
                ),
            );
        }
        if !seen.insert(r.as_str()) {
            return reject(
                ErrorCode::BadRecipient,
                format!("recipient #{i} is a duplicate"),
            );
        }
        recipients.push(r.clone());
    }

    let body = string_field(map, "body")?;
    at_most(
        ErrorCode::BodyTooLarge,
        "`body` is",
        body.len(),
        "bytes",
        limits.max_body_bytes,
    )?;

    Ok(SendRequest {
        id: id.to_owned(),
        to: recipients,
        body: body.to_owned(),
    })
}

fn string_field<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a str, Reject> {
    match map.get(key) {
        None => reject(ErrorCode::BadRequest, format!("missing field `{key}`")),
        Some(Value::String(s)) => Ok(s),
        Some(_) => reject(ErrorCode::BadRequest, format!("`{key}` must be a string")),
    }
}

/// Reads a u48 seq field: a JSON integer in `0..=MAX_SEQ`.
pub(crate) fn seq_field(map: &Map<String, Value>, key: &str) -> Result<u64, Reject> {
    match map.get(key) {
        None => reject(ErrorCode::BadRequest, format!("missing field `{key}`")),
        Some(Value::Number(n)) => {
            if let Some(v) = n.as_u64() {
                check_seq(key, v)
            } else if n.as_i64().is_some() {
                // Only negative integers are i64 but not u64.
                reject(ErrorCode::SeqOutOfRange, format!("`{key}` is negative"))
            } else {
                // A float, or an integer too large for u64. Out of range by value first, then
                // "not an integer" for in-range non-integers such as 3471.0 or 1e3.
                let f = n.as_f64().unwrap_or(f64::NAN);
                if !(0.0..=MAX_SEQ as f64).contains(&f) {
                    reject(
                        ErrorCode::SeqOutOfRange,
                        format!("`{key}` must be in 0..={MAX_SEQ}"),
                    )
                } else {
                    reject(ErrorCode::BadRequest, format!("`{key}` must be an integer"))
                }
            }
        }
        Some(_) => reject(ErrorCode::BadRequest, format!("`{key}` must be an integer")),
    }
}

pub(crate) fn check_seq(key: &str, v: u64) -> Result<u64, Reject> {
    if v > MAX_SEQ {
        reject(
            ErrorCode::SeqOutOfRange,
            format!("`{key}` must be in 0..={MAX_SEQ}"),
        )
    } else {
        Ok(v)
    }
}

mod fast;

#[cfg(test)]
mod tests;
