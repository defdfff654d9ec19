//! The checks of the `parse_frame` fuzz target (`fuzz/fuzz_targets/parse_frame.rs`), shared
//! with the corpus replay (`tests/fuzz_corpus.rs`) and the property tests
//! (`tests/parse_never_panics.rs`), so all three hold every input to the same rules:
//!
//! - nothing panics (`parse_client_frame`, `parse_send_request`, `parse_ack_request`,
//!   `parse_mailbox_query`);
//! - an accepted input survives a serialise/parse round trip unchanged (a frame as a frame, a
//!   send request as an HTTP body and as a `send` frame, an ack as `{"seq":N}`, a mailbox
//!   query as a query string), and a `send` frame's fields read as an HTTP body give the same
//!   request (the two paths validate identically);
//! - a rejection names its code consistently (`code()` is the string of its
//!   [`ErrorCode`](crate::ErrorCode), a client error: HTTP 4xx) and echoes only a valid
//!   client id (non-empty, at most `max_id_bytes`, no control character); its `error` frame
//!   round-trips.
//!
//! Not part of the API: for tests and fuzzing only.

use crate::frames::{parse_client_frame, ClientFrame, FrameError, Limits, ServerFrame};
use crate::http::{parse_ack_request, parse_mailbox_query, parse_send_request, ErrorBody};
use crate::MAX_SEQ;

/// What [`check`] saw, for callers that count (a corpus must reach both outcomes).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// `parse_client_frame` accepted the input.
    pub frame_accepted: bool,
    /// `parse_send_request` accepted the input.
    pub send_accepted: bool,
    /// `parse_ack_request` accepted the input.
    pub ack_accepted: bool,
}

/// The two sets of limits the corpus replay and the property tests hold every input to: the
/// defaults, and small ones that every size rule trips over.
pub fn limit_sets() -> [Limits; 2] {
    [
        Limits::default(),
        Limits {
            max_frame_bytes: 512,
            max_body_bytes: 8,
            max_recipients: 3,
            max_id_bytes: 4,
            max_page_entries: 5,
            default_page_entries: 2,
        },
    ]
}

/// [`check`] under each of [`limit_sets`]; what it saw under the default limits, or the
/// first rule broken, naming the limits it was broken under.
pub fn check_all_limits(data: &[u8]) -> Result<Seen, String> {
    let [default, small] = limit_sets();
    let seen = check(data, &default).map_err(|broken| format!("limits {default:?}: {broken}"))?;
    check(data, &small).map_err(|broken| format!("limits {small:?}: {broken}"))?;
    Ok(seen)
}

/// Runs every parser on `data` under `limits` and checks the rules of this module. Returns
/// the first rule broken, as a message naming it.
pub fn check(data: &[u8], limits: &Limits) -> Result<Seen, String> {
    let mut seen = Seen::default();
    match parse_send_request(data, limits) {
        Ok(req) => {
            seen.send_accepted = true;
            let body = serde_json::to_vec(&req).map_err(|e| format!("send request: {e}"))?;
            let again = parse_send_request(&body, limits);
            if again.as_ref() != Ok(&req) {
                return Err(format!(
                    "send request round trip: {req:?} became {again:?} via {}",
                    String::from_utf8_lossy(&body)
                ));
            }
            let frame = ClientFrame::Send(req);
            let again = parse_client_frame(&frame.to_json(), limits);
            if again.as_ref() != Ok(&frame) {
                return Err(format!(
                    "an accepted HTTP send request is not accepted as a frame: {frame:?} became \
                     {again:?}"
                ));
            }
        }
        Err(e) => check_error(&e, limits, "parse_send_request")?,
    }
    match parse_ack_request(data, limits) {
        Ok(ack) => {
            seen.ack_accepted = true;
            if ack.seq > MAX_SEQ {
                return Err(format!("ack request above u48 accepted: {ack:?}"));
            }
            let again = parse_ack_request(format!(r#"{{"seq":{}}}"#, ack.seq).as_bytes(), limits);
            if again.as_ref() != Ok(&ack) {
                return Err(format!("ack request round trip: {ack:?} became {again:?}"));
            }
        }
        Err(e) => check_error(&e, limits, "parse_ack_request")?,
    }
    // WebSocket text frames and query strings are UTF-8 by definition; the transport rejects
    // anything else.
    let Ok(text) = std::str::from_utf8(data) else {
        return Ok(seen);
    };
    match parse_client_frame(text, limits) {
        Ok(frame) => {
            seen.frame_accepted = true;
            let again = parse_client_frame(&frame.to_json(), limits);
            if again.as_ref() != Ok(&frame) {
                return Err(format!(
                    "frame round trip: {frame:?} became {again:?} via {}",
                    frame.to_json()
                ));
            }
            match &frame {
                ClientFrame::Send(req) => {
                    // the same object as an HTTP body (its `type` is ignored there)
                    let http = parse_send_request(data, limits);
                    if http.as_ref() != Ok(req) {
                        return Err(format!(
                            "a send frame and the same HTTP body disagree: {req:?} vs {http:?}"
                        ));
                    }
                }
                ClientFrame::Ack { seq } | ClientFrame::Sync { after: seq } => {
                    if *seq > MAX_SEQ {
                        return Err(format!("seq above u48 accepted: {frame:?}"));
                    }
                }
            }
        }
        Err(e) => check_error(&e, limits, "parse_client_frame")?,
    }
    match parse_mailbox_query(text, limits) {
        Ok(q) => {
            let mut again = format!("limit={}", q.limit);
            if let Some(after) = q.after {
                again.push_str(&format!("&after={after}"));
            }
            let back = parse_mailbox_query(&again, limits);
            if back.as_ref() != Ok(&q) {
                return Err(format!("mailbox query round trip: {q:?} became {back:?}"));
            }
            if q.after.is_some_and(|a| a > MAX_SEQ)
                || q.limit == 0
                || q.limit > limits.max_page_entries
            {
                return Err(format!("mailbox query out of range accepted: {q:?}"));
            }
        }
        Err(e) => check_error(&e, limits, "parse_mailbox_query")?,
    }
    Ok(seen)
}

/// The rules every rejection follows.
fn check_error(e: &FrameError, limits: &Limits, what: &str) -> Result<(), String> {
    if e.code() != e.error_code().as_str() {
        return Err(format!("{what}: code {} vs {:?}", e.code(), e.error_code()));
    }
    let status = ErrorBody::from(e).http_status();
    if !(400..500).contains(&status) {
        return Err(format!(
            "{what}: {e} is answered {status}, not a client error"
        ));
    }
    if let Some(id) = e.id() {
        if id.is_empty() || id.len() > limits.max_id_bytes || crate::has_control_chars(id) {
            return Err(format!("{what}: {e} echoes an invalid client id {id:?}"));
        }
    }
    let frame = e.to_server_frame();
    let back: Result<ServerFrame, _> = serde_json::from_str(&frame.to_json());
    match back {
        Ok(b) if b == frame => Ok(()),
        other => Err(format!(
            "{what}: error frame round trip: {frame:?} became {other:?}"
        )),
    }
}
