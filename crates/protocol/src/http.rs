//! HTTP shapes of client protocol version 1: the same operations as the WebSocket frames, one
//! request each.
//!
//! | request | body / query | response (200) |
//! |---|---|---|
//! | `POST /v1/messages` | [`SendRequest`] | [`SendResponse`] |
//! | `GET /v1/mailbox?after=SEQ&limit=N` | [`MailboxQuery`] | [`MailboxPage`] |
//! | `POST /v1/mailbox/ack` | [`AckRequest`] | [`AckResponse`] |
//!
//! Any failure is answered with [`ErrorBody`] and [`ErrorCode::http_status`]. Request bodies
//! go through the same validation and [`Limits`] as the WebSocket frames.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::entry::Entry;
use crate::error::ErrorCode;
use crate::frames::{check_seq, parse_object, reject, send_from_map, seq_field, with_id};
use crate::frames::{FrameError, Limits, Reject};

/// A message to commit: the body of `POST /v1/messages`, and the fields of a `send` frame.
///
/// One type for both so the WebSocket and HTTP paths validate and commit identically.
/// Build it from untrusted input only through [`parse_send_request`] or
/// [`parse_client_frame`](crate::parse_client_frame).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendRequest {
    /// Client-chosen message id, 1..=`max_id_bytes` bytes. The server dedupes on
    /// (sender, id): a retry with the same id returns the offsets first assigned.
    pub id: String,
    /// Recipients: 1..=`max_recipients` distinct user ids.
    pub to: Vec<String>,
    /// Message body, at most `max_body_bytes` UTF-8 bytes.
    pub body: String,
}

/// Response to `POST /v1/messages`: `{"id":"c-1","offsets":{"12":3471}}`, the same content as
/// a `send_ack` frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendResponse {
    /// The client message id of the request.
    pub id: String,
    /// Shard number → dispatch-log offset assigned there (= the entry's seq in every
    /// recipient mailbox of that shard).
    #[serde(with = "shard_offsets")]
    pub offsets: BTreeMap<u32, u64>,
}

/// Serde for `offsets`: a JSON object whose keys are shard numbers in decimal.
///
/// Needed because serde's buffering of internally tagged enums (`ServerFrame`) hands map
/// keys over as strings, which the stock `u32` key deserializer refuses.
pub(crate) mod shard_offsets {
    use std::collections::BTreeMap;

    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(crate) fn serialize<S: Serializer>(
        offsets: &BTreeMap<u32, u64>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        offsets.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<u32, u64>, D::Error> {
        BTreeMap::<String, u64>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| {
                let shard = k
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                    .then(|| k.parse::<u32>().ok())
                    .flatten()
                    .ok_or_else(|| D::Error::custom("shard key must be a decimal u32"))?;
                Ok((shard, v))
            })
            .collect()
    }
}

/// Query of `GET /v1/mailbox?after=SEQ&limit=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MailboxQuery {
    /// Return entries with seq strictly above this. `None` (parameter absent): above the
    /// mailbox's acked cursor.
    pub after: Option<u64>,
    /// Most entries to return, 1..=`max_page_entries`; `default_page_entries` when absent.
    pub limit: u32,
}

/// Response to `GET /v1/mailbox`: entries in ascending seq order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MailboxPage {
    /// `{"seq":…,"from":…,"body":…,"sent_at_us":…}` each.
    pub entries: Vec<Entry>,
    /// Pass as `after` to get the next page: the last entry's seq, or the effective `after`
    /// of the request when `entries` is empty.
    pub next_after: u64,
}

impl MailboxPage {
    /// A page of `entries` (ascending seq) read after `after`, with `next_after` filled in.
    pub fn new(entries: Vec<Entry>, after: u64) -> Self {
        let next_after = entries.last().map_or(after, |e| e.seq);
        MailboxPage {
            entries,
            next_after,
        }
    }
}

/// Body of `POST /v1/mailbox/ack`: `{"seq":N}`, like an `ack` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckRequest {
    /// Highest processed mailbox seq (u48).
    pub seq: u64,
}

/// Response to `POST /v1/mailbox/ack`: `{"acked":N}`, the mailbox's acked cursor after the
/// request (acks never move it backwards, so it may be above the seq sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckResponse {
    /// The acked cursor.
    pub acked: u64,
}

/// Every HTTP error response: `{"error":{"code":"…","message":"…"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable code.
    pub code: ErrorCode,
    /// Human-readable detail; not stable, do not parse.
    pub message: String,
}

impl ErrorBody {
    /// An error body for `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message: message.into(),
            },
        }
    }

    /// The HTTP status for this body ([`ErrorCode::http_status`]).
    pub fn http_status(&self) -> u16 {
        self.error.code.http_status()
    }
}

impl From<&FrameError> for ErrorBody {
    fn from(e: &FrameError) -> Self {
        ErrorBody::new(e.error_code(), e.message())
    }
}

/// Parses and validates the body of `POST /v1/messages`. Same checks and codes as a `send`
/// frame (a `type` field, if present, is ignored); a body that is not UTF-8 is `bad_json`.
pub fn parse_send_request(body: &[u8], limits: &Limits) -> Result<SendRequest, FrameError> {
    let map = parse_object(body, limits)?;
    send_from_map(&map, limits).map_err(|r| with_id(&map, limits, r))
}

/// Parses and validates the body of `POST /v1/mailbox/ack`: `seq` as in an `ack` frame.
pub fn parse_ack_request(body: &[u8], limits: &Limits) -> Result<AckRequest, FrameError> {
    let map = parse_object(body, limits)?;
    seq_field(&map, "seq")
        .map(|seq| AckRequest { seq })
        .map_err(|r| with_id(&map, limits, r))
}

/// Parses the query string of `GET /v1/mailbox` (without the leading `?`).
///
/// `after`: decimal u48 (`seq_out_of_range` when negative or above 2^48-1, `bad_request` when
/// not a decimal integer). `limit`: decimal in 1..=`max_page_entries` (`bad_request`
/// otherwise). A parameter given twice is `bad_request`; other parameters are ignored.
pub fn parse_mailbox_query(query: &str, limits: &Limits) -> Result<MailboxQuery, FrameError> {
    parse_query(query, limits).map_err(|(code, message)| FrameError::new(code, message))
}

fn parse_query(query: &str, limits: &Limits) -> Result<MailboxQuery, Reject> {
    let mut after = None;
    let mut limit = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "after" => {
                if after.is_some() {
                    return reject(ErrorCode::BadRequest, "`after` given twice");
                }
                after = Some(query_seq(value)?);
            }
            "limit" => {
                if limit.is_some() {
                    return reject(ErrorCode::BadRequest, "`limit` given twice");
                }
                let n = decimal(value)
                    .and_then(|d| d.parse::<u32>().ok())
                    .filter(|n| (1..=limits.max_page_entries).contains(n));
                let Some(n) = n else {
                    return reject(
                        ErrorCode::BadRequest,
                        format!("`limit` must be in 1..={}", limits.max_page_entries),
                    );
                };
                limit = Some(n);
            }
            _ => {}
        }
    }
    Ok(MailboxQuery {
        after,
        limit: limit.unwrap_or(limits.default_page_entries),
    })
}

fn query_seq(value: &str) -> Result<u64, Reject> {
    if value.strip_prefix('-').and_then(decimal).is_some() {
        return reject(ErrorCode::SeqOutOfRange, "`after` is negative");
    }
    let Some(digits) = decimal(value) else {
        return reject(ErrorCode::BadRequest, "`after` must be a decimal integer");
    };
    // All digits: a parse failure can only be overflow.
    match digits.parse::<u64>() {
        Ok(v) => check_seq("after", v),
        Err(_) => check_seq("after", u64::MAX),
    }
}

/// `Some(s)` if `s` is a non-empty string of ASCII digits.
fn decimal(s: &str) -> Option<&str> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_SEQ;

    fn l() -> Limits {
        Limits::default()
    }

    #[test]
    fn send_request_round_trip() {
        let body = br#"{"id":"c-1","to":["bob","carol"],"body":"hi"}"#;
        let req = parse_send_request(body, &l()).unwrap();
        assert_eq!(
            req,
            SendRequest {
                id: "c-1".into(),
                to: vec!["bob".into(), "carol".into()],
                body: "hi".into()
            }
        );
        assert_eq!(serde_json::to_vec(&req).unwrap(), body);
    }

    #[test]
    fn send_request_errors() {
        let code = |b: &[u8]| parse_send_request(b, &l()).unwrap_err().code();
        assert_eq!(code(b"\xff\xfe"), "bad_json");
        assert_eq!(code(b"[]"), "bad_json");
        assert_eq!(
            code(br#"{"id":"c","to":["a","a"],"body":""}"#),
            "bad_recipient"
        );
        assert_eq!(code(br#"{"id":"c","to":["a"]}"#), "bad_request");
        // control characters (ADR-0022)
        assert_eq!(code(br#"{"id":"b\u0000c","to":["a"],"body":""}"#), "bad_id");
        assert_eq!(
            code(br#"{"id":"c","to":["a\u0000b"],"body":""}"#),
            "bad_recipient"
        );
        assert_eq!(
            code(br#"{"id":"c","to":["a\u007f"],"body":""}"#),
            "bad_recipient"
        );
        let e = parse_send_request(br#"{"id":"c-2","to":[""],"body":""}"#, &l()).unwrap_err();
        assert_eq!(e.id(), Some("c-2"));
        assert_eq!(code(&vec![b' '; 65_537]), "frame_too_large");
    }

    #[test]
    fn ack_request() {
        assert_eq!(
            parse_ack_request(br#"{"seq":7}"#, &l()).unwrap(),
            AckRequest { seq: 7 }
        );
        for (body, code) in [
            (&br#"{"seq":281474976710656}"#[..], "seq_out_of_range"),
            (br#"{"seq":-1}"#, "seq_out_of_range"),
            (br#"{"seq":"7"}"#, "bad_request"),
            (br#"{}"#, "bad_request"),
            (b"7", "bad_json"),
        ] {
            let e = parse_ack_request(body, &l()).unwrap_err();
            assert_eq!(e.code(), code, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn mailbox_query() {
        let q = |s: &str| parse_mailbox_query(s, &l());
        let max = format!("limit=1000&x=y&after={MAX_SEQ}");
        for (query, after, limit) in [
            ("", None, 100),
            ("after=3400&limit=50", Some(3400), 50),
            (&max, Some(MAX_SEQ), 1000),
        ] {
            assert_eq!(q(query).unwrap(), MailboxQuery { after, limit }, "{query}");
        }
        for (query, code) in [
            ("after=281474976710656", "seq_out_of_range"),
            ("after=99999999999999999999999", "seq_out_of_range"),
            ("after=-1", "seq_out_of_range"),
            ("after=1.5", "bad_request"),
            ("after=", "bad_request"),
            ("after", "bad_request"),
            ("after=+1", "bad_request"),
            ("after=1&after=2", "bad_request"),
            ("limit=0", "bad_request"),
            ("limit=1001", "bad_request"),
            ("limit=abc", "bad_request"),
            ("limit=99999999999", "bad_request"),
            ("limit=1&limit=1", "bad_request"),
        ] {
            assert_eq!(q(query).unwrap_err().code(), code, "{query}");
        }
    }

    #[test]
    fn responses_match_the_wire_shapes() {
        let r = SendResponse {
            id: "c-1".into(),
            offsets: BTreeMap::from([(3, 9), (12, 3471)]),
        };
        let json = r#"{"id":"c-1","offsets":{"3":9,"12":3471}}"#;
        assert_eq!(serde_json::to_string(&r).unwrap(), json);
        assert_eq!(serde_json::from_str::<SendResponse>(json).unwrap(), r);

        let page = MailboxPage::new(
            vec![Entry {
                seq: 3471,
                from: "alice".into(),
                body: "hi".into(),
                sent_at_us: 5,
            }],
            3400,
        );
        assert_eq!(
            serde_json::to_string(&page).unwrap(),
            r#"{"entries":[{"seq":3471,"from":"alice","body":"hi","sent_at_us":5}],"next_after":3471}"#
        );
        assert_eq!(MailboxPage::new(vec![], 3400).next_after, 3400);

        assert_eq!(
            serde_json::to_string(&AckResponse { acked: 3471 }).unwrap(),
            r#"{"acked":3471}"#
        );

        let e = ErrorBody::new(ErrorCode::Overloaded, "try later");
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"error":{"code":"overloaded","message":"try later"}}"#
        );
        assert_eq!(e.http_status(), 503);
        let fe = parse_send_request(b"{", &l()).unwrap_err();
        let body = ErrorBody::from(&fe);
        assert_eq!(
            (body.error.code, body.http_status()),
            (ErrorCode::BadJson, 400)
        );
    }
}
