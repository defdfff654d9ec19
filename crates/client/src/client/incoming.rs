//! Server frames as the client reads them ([`parse_incoming`]) and where each one goes
//! ([`route`]): a `send_ack` or an `error` answering the frame of a waiting send (by id and
//! by count, see `waiters.rs`) completes that waiter; everything else becomes an [`Event`]
//! (a `deliver`, answers nobody waits for, errors without an id, and [`BAD_SERVER_FRAME`]
//! errors for frames that cannot be read).
//! Frames of an unknown `type` are ignored. The two frames a client reads most (`deliver`,
//! `send_ack`) take a one-pass read ([`fast`]) that falls back to the full parse whenever it
//! is not sure, so the full parse alone decides what is an error.

use std::collections::BTreeMap;

use serde_json::Value;
use tidemark_protocol::{Entry, ServerFrame};
use tokio::sync::mpsc;

use super::waiters::Waiters;
use super::{Event, Offsets, BAD_SERVER_FRAME};

/// A server frame as the client reads it. `error.code` stays a string so codes newer than
/// this client are passed on rather than failing the frame.
#[derive(Debug, PartialEq)]
pub(super) enum Incoming {
    Ready { user: String, after: u64 },
    SendAck { id: String, offsets: Offsets },
    Deliver(Entry),
    Error(ErrorFrame),
    Unknown,
}

#[derive(Debug, PartialEq, serde::Deserialize)]
pub(super) struct ErrorFrame {
    pub(super) code: String,
    #[serde(default)]
    pub(super) message: String,
    #[serde(default)]
    pub(super) id: Option<String>,
}

/// Reads one text frame from the server: a `deliver` or `send_ack` first by [`fast`], in one
/// pass; anything it is not sure of by [`parse_in_full`], which alone gives errors.
pub(super) fn parse_incoming(text: &str) -> Result<Incoming, String> {
    match fast(text) {
        Some(frame) => Ok(frame),
        None => parse_in_full(text),
    }
}

/// The fields of the two frames a client reads most (`deliver`, `send_ack`), read straight
/// from the text: no `serde_json::Value` tree built first and then read again. Unknown
/// fields, duplicate keys, escaped keys and wrong types are errors here, so those frames go
/// to the full parse.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Everyday<'a> {
    #[serde(rename = "type", borrow)]
    ty: &'a str,
    seq: Option<u64>,
    from: Option<String>,
    body: Option<String>,
    sent_at_us: Option<u64>,
    id: Option<String>,
    #[serde(borrow)]
    offsets: Option<BTreeMap<&'a str, u64>>,
}

/// A `deliver` or `send_ack` frame read in one pass: the frame [`parse_in_full`] would
/// return, or `None` when this is not such a frame or the fast read is not sure of it.
pub(super) fn fast(text: &str) -> Option<Incoming> {
    let f: Everyday<'_> = serde_json::from_str(text).ok()?;
    match f {
        Everyday {
            ty: "deliver",
            seq: Some(seq),
            from: Some(from),
            body: Some(body),
            sent_at_us: Some(sent_at_us),
            id: None,
            offsets: None,
        } => Some(Incoming::Deliver(Entry {
            seq,
            from,
            body,
            sent_at_us,
        })),
        Everyday {
            ty: "send_ack",
            seq: None,
            from: None,
            body: None,
            sent_at_us: None,
            id: Some(id),
            offsets: Some(offsets),
        } => {
            // the full parse's rule for a shard key: decimal digits only, a u32
            let offsets = offsets
                .into_iter()
                .map(|(k, v)| {
                    k.bytes()
                        .all(|b| b.is_ascii_digit())
                        .then(|| k.parse::<u32>().ok())
                        .flatten()
                        .map(|shard| (shard, v))
                })
                .collect::<Option<Offsets>>()?;
            Some(Incoming::SendAck { id, offsets })
        }
        _ => None,
    }
}

/// Reads one text frame from the server through a `serde_json::Value`: every frame type,
/// and the error of a frame that cannot be read.
pub(super) fn parse_in_full(text: &str) -> Result<Incoming, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let Some(ty) = value.get("type") else {
        return Err("not a JSON object with a `type`".into());
    };
    let Some(ty) = ty.as_str() else {
        return Err("`type` is not a string".into());
    };
    match ty {
        "error" => serde_json::from_value::<ErrorFrame>(value)
            .map(Incoming::Error)
            .map_err(|e| format!("bad error frame: {e}")),
        "ready" | "send_ack" | "deliver" => {
            let ty = ty.to_owned();
            match serde_json::from_value::<ServerFrame>(value) {
                Ok(ServerFrame::Ready { user, after }) => Ok(Incoming::Ready { user, after }),
                Ok(ServerFrame::SendAck { id, offsets }) => Ok(Incoming::SendAck { id, offsets }),
                Ok(ServerFrame::Deliver(e)) => Ok(Incoming::Deliver(e)),
                Ok(ServerFrame::Error { .. }) => unreachable!("type is {ty}"),
                Err(e) => Err(format!("bad {ty} frame: {e}")),
            }
        }
        _ => Ok(Incoming::Unknown),
    }
}

/// Hands one read frame to its waiter, or to the event stream.
pub(super) fn route(
    frame: Result<Incoming, String>,
    events: &mpsc::UnboundedSender<Event>,
    w: &Waiters,
) {
    let event = match frame {
        Ok(Incoming::SendAck { id, offsets }) => match w.answer(&id) {
            None => Event::SendAck { id, offsets },
            Some(tx) => match tx.send(Ok(offsets)) {
                Ok(()) => return,
                // The waiter gave up between the lookup and now: keep the ack as an event.
                Err(Ok(offsets)) => Event::SendAck { id, offsets },
                Err(Err(_)) => return, // not what was sent
            },
        },
        Ok(Incoming::Error(ErrorFrame {
            code,
            message,
            id: Some(id),
        })) => match w.answer(&id) {
            None => Event::Error {
                code,
                message,
                id: Some(id),
            },
            Some(tx) => match tx.send(Err((code, message))) {
                Ok(()) => return,
                Err(Err((code, message))) => Event::Error {
                    code,
                    message,
                    id: Some(id),
                },
                Err(Ok(_)) => return, // not what was sent
            },
        },
        Ok(Incoming::Error(ErrorFrame { code, message, id })) => Event::Error { code, message, id },
        Ok(Incoming::Deliver(entry)) => Event::Deliver(entry),
        Ok(Incoming::Ready { .. }) => Event::Error {
            code: BAD_SERVER_FRAME.into(),
            message: "a second ready frame".into(),
            id: None,
        },
        Ok(Incoming::Unknown) => return,
        Err(message) => Event::Error {
            code: BAD_SERVER_FRAME.into(),
            message,
            id: None,
        },
    };
    let _ = events.send(event);
}
