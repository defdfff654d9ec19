//! Unit tests of the connection's pure parts: reading server frames, building the upgrade
//! request, and never printing a token.

use std::collections::BTreeMap;

use tidemark_protocol::Entry;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;

use super::connect::build_request;
use super::incoming::{parse_incoming, ErrorFrame, Incoming};
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

#[test]
fn auth_debug_hides_tokens() {
    let s = format!("{:?}", Auth::Token("v1.secret.mac".into()));
    assert!(!s.contains("secret"), "{s}");
    assert_eq!(format!("{:?}", Auth::DevUser("a".into())), "DevUser(\"a\")");
}
