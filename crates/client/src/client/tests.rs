//! Unit tests of the connection's pure parts: reading server frames, building the upgrade
//! request, and never printing a token.

use std::collections::BTreeMap;

use tidemark_protocol::Entry;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;

use super::connect::build_request;
use super::incoming::{fast, parse_in_full, parse_incoming, ErrorFrame, Incoming};
use super::Auth;

#[test]
fn parses_server_frames() {
    assert_eq!(
        parse_incoming(r#"{"type":"ready","user":"alice","after":3400}"#),
        Ok(Incoming::Ready {
            user: "alice".into(),
            after: 3400
        })
    );
    assert_eq!(
        parse_incoming(r#"{"type":"send_ack","id":"c-1","offsets":{"12":3471,"3":9}}"#),
        Ok(Incoming::SendAck {
            id: "c-1".into(),
            offsets: BTreeMap::from([(3, 9), (12, 3471)])
        })
    );
    assert_eq!(
        parse_incoming(
            r#"{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1,"new":true}"#
        ),
        Ok(Incoming::Deliver(Entry {
            seq: 3471,
            from: "alice".into(),
            body: "hi".into(),
            sent_at_us: 1
        }))
    );
    // Error codes newer than this client are kept, not refused.
    assert_eq!(
        parse_incoming(r#"{"type":"error","code":"brand_new","message":"m","id":"c-1"}"#),
        Ok(Incoming::Error(ErrorFrame {
            code: "brand_new".into(),
            message: "m".into(),
            id: Some("c-1".into())
        }))
    );
    assert_eq!(
        parse_incoming(r#"{"type":"error","code":"bad_json","message":"m"}"#),
        Ok(Incoming::Error(ErrorFrame {
            code: "bad_json".into(),
            message: "m".into(),
            id: None
        }))
    );
    assert_eq!(
        parse_incoming(r#"{"type":"from_the_future"}"#),
        Ok(Incoming::Unknown)
    );
    for bad in [
        "nope",
        "[]",
        r#"{"no":"type"}"#,
        r#"{"type":7}"#,
        r#"{"type":"ready","user":"a"}"#,
        r#"{"type":"send_ack","id":"c","offsets":{"x":1}}"#,
        r#"{"type":"deliver","seq":-1,"from":"a","body":"","sent_at_us":0}"#,
        r#"{"type":"error","message":"no code"}"#,
    ] {
        assert!(parse_incoming(bad).is_err(), "{bad}");
    }
}

/// The frames a client reads most take the one-pass read; what it returns is what the full
/// parse returns.
#[test]
fn everyday_frames_take_the_fast_path() {
    for text in [
        r#"{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1764489600000000}"#,
        r#"{"seq":1,"type":"deliver","sent_at_us":0,"body":"","from":"a"}"#,
        r#"{"type":"send_ack","id":"c-1","offsets":{"12":3471}}"#,
        r#"{"offsets":{"12":3471,"3":9},"type":"send_ack","id":"c-1"}"#,
        r#"{"type":"send_ack","id":"c-1","offsets":{}}"#,
    ] {
        let got = fast(text).unwrap_or_else(|| panic!("not on the fast path: {text}"));
        assert_eq!(Ok(got), parse_in_full(text), "{text}");
    }
}

/// Whatever the one-pass read is not sure of goes to the full parse: escapes it cannot
/// borrow, unknown and duplicate fields, missing or extra fields, other types, bad keys.
#[test]
fn doubtful_frames_go_to_the_full_parse() {
    for text in [
        r#"{"type":"deliver","seq":1,"from":"a","body":"","sent_at_us":0,"new":true}"#,
        r#"{"type":"deliver","seq":1,"seq":2,"from":"a","body":"","sent_at_us":0}"#,
        r#"{"type":"deliver","seq":1,"from":"a","body":"","sent_at_us":0,"id":"x"}"#,
        r#"{"type":"deliver","seq":1,"from":"a","body":""}"#,
        r#"{"type":"deli\u0076er","seq":1,"from":"a","body":"","sent_at_us":0}"#,
        r#"{"type":"deliver","seq":-1,"from":"a","body":"","sent_at_us":0}"#,
        r#"{"type":"deliver","seq":1.0,"from":"a","body":"","sent_at_us":0}"#,
        r#"{"type":"send_ack","id":"c","offsets":{"x":1}}"#,
        r#"{"type":"send_ack","id":"c","offsets":{"\u0031":1}}"#,
        r#"{"type":"send_ack","id":"c","offsets":{"99999999999":1}}"#,
        r#"{"type":"send_ack","id":"c"}"#,
        r#"{"type":"ready","user":"alice","after":3400}"#,
        r#"{"type":"error","code":"bad_json","message":"m"}"#,
        "nope",
    ] {
        assert_eq!(fast(text), None, "{text}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]

    /// Mostly well-formed `deliver` and `send_ack` frames, with fields missing, repeated,
    /// unknown, of other types, escaped or reordered: whatever the one-pass read returns, the
    /// full parse returns too.
    #[test]
    fn the_fast_path_agrees_with_the_full_parse(
        deliver in proptest::bool::ANY,
        own in proptest::collection::vec(0usize..16, 4),
        picks in proptest::collection::vec((0usize..16, 0usize..6), 1..9),
        drop_mask in proptest::num::u16::ANY,
    ) {
        let values = [
            "1", "0", "281474976710655", "18446744073709551615", "-1", "1.5", "\"7\"", "null",
            "\"alice\"", "\"\"", "\"a\\u00e9\\n\"", "{}", "{\"12\":3}", "{\"012\":3,\"12\":4}",
            "{\"x\":1}", "{\"+1\":2}",
        ];
        let keys = if deliver {
            ["seq", "from", "body", "sent_at_us", "id", "zz"]
        } else {
            ["id", "offsets", "offsets", "seq", "body", "zz"]
        };
        // the frame's own fields first, each kept three times in four; three times in four each
        // holds a value of the right type, else any of `values`
        let right: [&[&str]; 4] = if deliver {
            [
                &["3", "0", "281474976710655", "18446744073709551615"],
                &["\"alice\"", "\"\"", "\"a\\u00e9\"", "\"bob\""],
                &["\"hi\"", "\"\"", "\"line\\n\"", "\"\\\"q\\\"\""],
                &["5", "0", "1764489600000000", "18446744073709551615"],
            ]
        } else {
            [
                &["\"c-1\"", "\"\"", "\"c\\u0031\"", "\"x\""],
                &["{\"12\":3471,\"3\":9}", "{}", "{\"012\":3,\"12\":4}", "{\"4294967295\":1}"],
                &[],
                &[],
            ]
        };
        let names: &[&str] = if deliver {
            &["seq", "from", "body", "sent_at_us"]
        } else {
            &["id", "offsets"]
        };
        let mut fields: Vec<String> = Vec::new();
        for (i, k) in names.iter().enumerate() {
            // dropped a quarter of the time
            if drop_mask & (0x101 << i) != 0x101 << i {
                let v = if own[i] < 12 { right[i][own[i] % 4] } else { values[own[i]] };
                fields.push(format!("\"{k}\":{v}"));
            }
        }
        let ty = if deliver { "deliver" } else { "send_ack" };
        let at = usize::from((drop_mask >> 6) & 3).min(fields.len());
        fields.insert(at, format!("\"type\":\"{ty}\""));
        // other fields a quarter of the time: repeated, unknown, of other types
        for (v, k) in &picks {
            if drop_mask & 0x3000 == 0x3000 {
                fields.push(format!("\"{}\":{}", keys[*k], values[*v]));
            }
        }
        let text = format!("{{{}}}", fields.join(","));
        if let Some(got) = fast(&text) {
            proptest::prop_assert_eq!(Ok(got), parse_in_full(&text), "{}", text);
        }
    }
}

#[test]
fn builds_upgrade_requests() {
    let (req, shown) =
        build_request("ws://127.0.0.1:1/v1/ws", &Auth::Token("v1.abc.def".into())).unwrap();
    assert_eq!(req.headers()[AUTHORIZATION], "Bearer v1.abc.def");
    assert_eq!(req.uri().query(), None);
    assert_eq!(shown, "ws://127.0.0.1:1/v1/ws");

    let (req, shown) =
        build_request("ws://h:1/v1/ws?x=1", &Auth::DevUser("bob smith&co".into())).unwrap();
    assert!(req.headers().get(AUTHORIZATION).is_none());
    assert_eq!(req.uri().query(), Some("x=1&user=bob+smith%26co"));
    assert_eq!(shown, "ws://h:1/v1/ws");

    for (url, auth) in [
        ("http://h/v1/ws", Auth::DevUser("a".into())),
        ("not a url", Auth::DevUser("a".into())),
        ("ws://h/v1/ws", Auth::Token("bad\ntoken".into())),
    ] {
        assert_eq!(build_request(url, &auth).unwrap_err().code(), "invalid_url");
    }
}

/// This crate has no TLS: a `wss://` URL is refused when the request is built (not
/// retryable), not left to fail at every connect as a retryable `connect_failed`.
#[test]
fn wss_is_refused_when_the_request_is_built() {
    for url in ["wss://h/v1/ws", "WSS://h:443/v1/ws?x=1"] {
        let e = build_request(url, &Auth::DevUser("a".into())).unwrap_err();
        assert_eq!(e.code(), "invalid_url", "{url}");
        assert!(!e.retryable(), "{url}");
    }
}

#[test]
fn auth_debug_hides_tokens() {
    let s = format!("{:?}", Auth::Token("v1.secret.mac".into()));
    assert!(!s.contains("secret"), "{s}");
    assert_eq!(format!("{:?}", Auth::DevUser("a".into())), "DevUser(\"a\")");
}
