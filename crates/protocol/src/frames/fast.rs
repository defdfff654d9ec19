//! The fast path of [`parse_client_frame`](super::parse_client_frame) (issue 15): a valid
//! `send`, `ack` or `sync` frame read straight into a struct whose strings borrow from the
//! frame, instead of a `serde_json::Value` tree whose every key and string is its own
//! allocation. Measured at 5,000 msg/s, the tree was over half of the gateway's allocations.
//!
//! The rule that keeps one source of truth for errors: this path either returns the frame
//! the full parse would return, or `None`, and then the full parse runs and gives the error
//! (or the frame) it always gave. So it returns `None` for anything it is not sure of: a
//! string with an escape (it cannot borrow it), a duplicate key, a field it does not know,
//! a field of another type (even one the frame's type ignores), a number that is not a
//! `u64`, and every frame that breaks a limit. `tests::the_fast_path_agrees_with_the_full_parse` checks that on
//! generated frames, valid and not.

use std::collections::HashSet;

use serde::Deserialize;

use super::{valid_client_id, ClientFrame, Limits};
use crate::http::SendRequest;
use crate::{is_valid_user_id, MAX_SEQ};

/// The fields of every client frame type. `&str` fields borrow from the frame (a string
/// with an escape fails to deserialize: the full parse takes it). An unknown field fails
/// too: the full parse ignores it, but only after building it as a value, which refuses
/// nesting deeper than 128 where skipping it would not. A duplicate field fails, and the
/// full parse (which keeps the last) decides.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields<'a> {
    #[serde(rename = "type")]
    ty: Option<&'a str>,
    id: Option<&'a str>,
    to: Option<Vec<&'a str>>,
    body: Option<&'a str>,
    seq: Option<u64>,
    after: Option<u64>,
}

/// Recipients up to this many are checked for duplicates pairwise (no set to allocate).
const PAIRWISE: usize = 16;

/// The frame, if `text` is a valid frame this path can read; `None`: ask the full parse.
pub(super) fn parse(text: &str, limits: &Limits) -> Option<ClientFrame> {
    if text.len() > limits.max_frame_bytes {
        return None;
    }
    // serde's derived struct also reads a JSON array, field by field in order
    // (`["ack",null,null,null,1,null]`); a frame is an object, and the full parse refuses
    // anything else with `bad_json` (ADR-0107)
    if !text.trim_start().starts_with('{') {
        return None;
    }
    let f: Fields<'_> = serde_json::from_str(text).ok()?;
    match f.ty? {
        "send" => {
            let id = f.id?;
            let to = f.to?;
            let body = f.body?;
            let valid = valid_client_id(id, limits)
                && !to.is_empty()
                && to.len() <= limits.max_recipients
                && to.iter().all(|r| is_valid_user_id(r))
                && distinct(&to)
                && body.len() <= limits.max_body_bytes;
            valid.then(|| {
                ClientFrame::Send(SendRequest {
                    id: id.to_owned(),
                    to: to.iter().map(|r| (*r).to_owned()).collect(),
                    body: body.to_owned(),
                })
            })
        }
        "ack" => f
            .seq
            .filter(|&s| s <= MAX_SEQ)
            .map(|seq| ClientFrame::Ack { seq }),
        "sync" => f
            .after
            .filter(|&a| a <= MAX_SEQ)
            .map(|after| ClientFrame::Sync { after }),
        _ => None,
    }
}

/// Whether no recipient is named twice.
fn distinct(to: &[&str]) -> bool {
    if to.len() <= PAIRWISE {
        return to.iter().enumerate().all(|(i, r)| !to[..i].contains(r));
    }
    let mut seen = HashSet::with_capacity(to.len());
    to.iter().all(|r| seen.insert(*r))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::parse_client_frame_in_full;
    use super::*;

    /// The frames the load generator and the client send take this path.
    #[test]
    fn everyday_frames_take_the_fast_path() {
        let limits = Limits::default();
        for text in [
            r#"{"type":"send","id":"m123456","to":["u000123"],"body":"i:123456"}"#,
            r#"{"type":"send","id":"c-1","to":["bob","carol","dave"],"body":"hi ü"}"#,
            r#"{"type":"ack","seq":3471}"#,
            r#"{"type":"sync","after":0}"#,
            r#" { "body" : "", "to" : [ "x" ] , "type" : "send", "id" : "1" } "#,
        ] {
            let fast = parse(text, &limits);
            assert!(fast.is_some(), "{text}: not taken");
            assert_eq!(
                fast.map(Ok),
                Some(parse_client_frame_in_full(text, &limits))
            );
        }
    }

    /// Frames the fast path leaves to the full parse (which then accepts or refuses them).
    #[test]
    fn doubtful_frames_go_to_the_full_parse() {
        let limits = Limits::default();
        for text in [
            r#"{"type":"send","id":"m\u0031","to":["u1"],"body":"x"}"#, // escape: accepted
            r#"{"type":"ack","seq":1,"seq":2}"#,                        // duplicate: last wins
            r#"{"type":"send","id":"m1","to":["u1"],"body":"x","seq":"no"}"#, // ignored field
            r#"{"type":"ack","seq":3471.0}"#,
            r#"{"type":"ack","seq":281474976710656}"#,
            r#"{"type":"send","id":"m1","to":["u1","u1"],"body":"x"}"#,
            r#"{"type":"send","id":"","to":["u1"],"body":"x"}"#,
            r#"{"type":"send","id":"m1","to":[],"body":"x"}"#,
            r#"{"type":"send","id":"m1","to":["u1"],"body":null}"#,
            r#"{"type":"nope"}"#,
            r#"{"type":"ack","seq":1,"extra":[]}"#, // unknown field: accepted
            r#"[1]"#,
            // the fields of `Fields` by position: an array, not a frame
            r#"["send","c-1",["bob"],"hi",null,null]"#,
            r#"["ack",null,null,null,3471,null]"#,
            r#" ["sync",null,null,null,null,0]"#,
        ] {
            assert_eq!(parse(text, &limits), None, "{text}");
        }
    }

    fn string() -> impl Strategy<Value = String> {
        prop_oneof![
            1 => Just(String::new()),
            8 => "[a-c]{1,2}",
            1 => Just("x".repeat(129)),
            1 => Just("a\\u0001b".into()),
            1 => Just("a\\\"b".into()),
            1 => Just("\u{7f}".into()),
            1 => Just("é".into()),
        ]
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            string().prop_map(|s| format!("\"{s}\"")),
            prop::collection::vec(string(), 0..5).prop_map(|v| format!(
                "[{}]",
                v.iter()
                    .map(|s| format!("\"{s}\""))
                    .collect::<Vec<_>>()
                    .join(",")
            )),
            Just("[\"a\",1]".to_string()),
            Just("null".to_string()),
            Just("-1".to_string()),
            Just("3.0".to_string()),
            Just("1e3".to_string()),
            Just("281474976710655".to_string()),
            Just("281474976710656".to_string()),
            Just("18446744073709551616".to_string()),
            (0u64..100).prop_map(|n| n.to_string()),
            Just("{}".to_string()),
            Just(format!("{}1{}", "[".repeat(200), "]".repeat(200))),
        ]
    }

    fn field() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("type"),
            Just("id"),
            Just("to"),
            Just("body"),
            Just("seq"),
            Just("after"),
            Just("other"),
        ];
        let ty = prop_oneof![
            Just("send"),
            Just("ack"),
            Just("sync"),
            Just("Send"),
            Just("x")
        ];
        prop_oneof![
            ty.prop_map(|t| format!("\"type\":\"{t}\"")),
            (key, value()).prop_map(|(k, v)| format!("\"{k}\":{v}")),
        ]
    }

    /// Mostly well-formed frames of each type, so that many reach the fast path's checks.
    fn near_valid() -> impl Strategy<Value = Vec<String>> {
        let list = prop::collection::vec(string(), 0..5).prop_map(|v| {
            let items: Vec<String> = v.iter().map(|s| format!("\"{s}\"")).collect();
            format!("[{}]", items.join(","))
        });
        let send = (string(), list, string(), prop::option::of(field())).prop_map(
            |(id, to, body, extra)| {
                let mut f = vec![
                    "\"type\":\"send\"".to_string(),
                    format!("\"id\":\"{id}\""),
                    format!("\"to\":{to}"),
                    format!("\"body\":\"{body}\""),
                ];
                f.extend(extra);
                f
            },
        );
        let seq = (
            prop_oneof![Just("ack"), Just("sync")],
            value(),
            prop::option::of(field()),
        )
            .prop_map(|(ty, v, extra)| {
                let key = if ty == "ack" { "seq" } else { "after" };
                let mut f = vec![format!("\"type\":\"{ty}\""), format!("\"{key}\":{v}")];
                f.extend(extra);
                f
            });
        prop_oneof![send, seq, prop::collection::vec(field(), 0..7)].prop_shuffle()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// Whatever the fast path returns, the full parse returns too.
        #[test]
        fn the_fast_path_agrees_with_the_full_parse(
            fields in near_valid(),
            max_recipients in 1usize..4,
            max_body_bytes in 0usize..8,
        ) {
            let text = format!("{{{}}}", fields.join(","));
            let limits = Limits { max_recipients, max_body_bytes, ..Limits::default() };
            if let Some(frame) = parse(&text, &limits) {
                prop_assert_eq!(Ok(frame), parse_client_frame_in_full(&text, &limits), "{}", text);
            }
        }
    }
}
