//! Unit tests of the frames: valid frames, limits, the id echoed in errors, the wire
//! examples of `docs/protocol.md`, and the code every hostile frame gets.

use super::*;
use serde_json::json;

fn parse(text: &str) -> Result<ClientFrame, FrameError> {
    parse_client_frame(text, &Limits::default())
}

fn send(id: &str, to: &[&str], body: &str) -> ClientFrame {
    ClientFrame::Send(SendRequest {
        id: id.into(),
        to: to.iter().map(|s| s.to_string()).collect(),
        body: body.into(),
    })
}

#[test]
fn parses_valid_client_frames() {
    assert_eq!(
        parse(r#"{"type":"send","id":"c-1","to":["bob"],"body":"hi"}"#).unwrap(),
        send("c-1", &["bob"], "hi")
    );
    assert_eq!(
        parse(r#"{"type":"ack","seq":3471}"#).unwrap(),
        ClientFrame::Ack { seq: 3471 }
    );
    assert_eq!(
        parse(r#"{"type":"sync","after":3400}"#).unwrap(),
        ClientFrame::Sync { after: 3400 }
    );
    // Edges that are accepted.
    assert_eq!(
        parse(r#"{"type":"ack","seq":0}"#).unwrap(),
        ClientFrame::Ack { seq: 0 }
    );
    assert_eq!(
        parse(&format!(r#"{{"type":"sync","after":{MAX_SEQ}}}"#)).unwrap(),
        ClientFrame::Sync { after: MAX_SEQ }
    );
    assert_eq!(
        parse(r#"{"type":"send","id":"x","to":["a","b"],"body":""}"#).unwrap(),
        send("x", &["a", "b"], "")
    );
    // Non-ASCII and spaces are fine in ids; control characters only in the body.
    assert_eq!(
        parse(r#"{"type":"send","id":"ü 1","to":["bö b","\u0080"],"body":"a\u0000\n"}"#).unwrap(),
        send("ü 1", &["bö b", "\u{80}"], "a\0\n")
    );
    // Unknown fields are ignored; key order does not matter.
    assert_eq!(
        parse(r#"{"body":"hi","to":["bob"],"v":2,"id":"c-1","type":"send"}"#).unwrap(),
        send("c-1", &["bob"], "hi")
    );
}

#[test]
fn limits_are_inclusive() {
    let l = Limits::default();
    let id = "i".repeat(l.max_id_bytes);
    let r = "r".repeat(MAX_USER_ID_BYTES);
    let body = "é".repeat(l.max_body_bytes / 2);
    let to: Vec<String> = (0..l.max_recipients).map(|i| format!("u{i}")).collect();
    let frame = json!({"type":"send","id":id,"to":[r],"body":body}).to_string();
    assert!(parse(&frame).is_ok());
    let frame = json!({"type":"send","id":"c","to":to,"body":"b"}).to_string();
    assert!(parse(&frame).is_ok());
    // Exactly max_frame_bytes is accepted.
    let pad = l.max_frame_bytes - r#"{"type":"ack","seq":1,"p":""}"#.len();
    let frame = format!(r#"{{"type":"ack","seq":1,"p":"{}"}}"#, " ".repeat(pad));
    assert_eq!(frame.len(), l.max_frame_bytes);
    assert!(parse(&frame).is_ok());
    assert_eq!(
        parse(&format!("{frame} ")).unwrap_err().code(),
        "frame_too_large"
    );
}

#[test]
fn body_limit_counts_utf8_bytes() {
    let l = Limits::default();
    // 8193 two-byte characters = 16386 bytes.
    let body = "é".repeat(l.max_body_bytes / 2 + 1);
    let frame = json!({"type":"send","id":"c-9","to":["bob"],"body":body}).to_string();
    let e = parse(&frame).unwrap_err();
    assert_eq!(e.code(), "body_too_large");
    assert_eq!(e.id(), Some("c-9"));
}

#[test]
fn custom_limits_apply() {
    let l = Limits {
        max_recipients: 1,
        max_body_bytes: 2,
        max_id_bytes: 3,
        ..Limits::default()
    };
    let p = |t: &str| parse_client_frame(t, &l).unwrap_err().code();
    assert_eq!(
        p(r#"{"type":"send","id":"c","to":["a","b"],"body":""}"#),
        "too_many_recipients"
    );
    assert_eq!(
        p(r#"{"type":"send","id":"c","to":["a"],"body":"abc"}"#),
        "body_too_large"
    );
    assert_eq!(
        p(r#"{"type":"send","id":"abcd","to":["a"],"body":""}"#),
        "bad_id"
    );
}

#[test]
fn error_echoes_id_when_recoverable() {
    let e = parse(r#"{"type":"send","id":"c-7","to":["bob","bob"],"body":"hi"}"#).unwrap_err();
    assert_eq!(e.code(), "bad_recipient");
    assert_eq!(e.id(), Some("c-7"));
    assert_eq!(
        e.to_server_frame(),
        ServerFrame::Error {
            code: ErrorCode::BadRecipient,
            message: e.message().to_owned(),
            id: Some("c-7".into())
        }
    );
    // Unknown type from a newer client: id still echoed.
    let e = parse(r#"{"type":"edit","id":"c-8"}"#).unwrap_err();
    assert_eq!((e.code(), e.id()), ("unknown_type", Some("c-8")));
    // Invalid ids are not echoed.
    let e = parse(r#"{"type":"send","id":"","to":["b"],"body":""}"#).unwrap_err();
    assert_eq!((e.code(), e.id()), ("bad_id", None));
    let e = parse(r#"{"type":"send","id":7,"to":["b"],"body":""}"#).unwrap_err();
    assert_eq!((e.code(), e.id()), ("bad_request", None));
    // Nothing to recover from non-objects.
    assert_eq!(parse("[1]").unwrap_err().id(), None);
}

#[test]
fn server_frames_match_the_wire_examples() {
    let cases = [
        (
            ServerFrame::Ready {
                user: "alice".into(),
                after: 3400,
            },
            r#"{"type":"ready","user":"alice","after":3400}"#,
        ),
        (
            ServerFrame::SendAck {
                id: "c-1".into(),
                offsets: BTreeMap::from([(12, 3471)]),
            },
            r#"{"type":"send_ack","id":"c-1","offsets":{"12":3471}}"#,
        ),
        (
            ServerFrame::Deliver(Entry {
                seq: 3471,
                from: "alice".into(),
                body: "hi".into(),
                sent_at_us: 1_764_489_600_000_000,
            }),
            r#"{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1764489600000000}"#,
        ),
        (
            ServerFrame::Error {
                code: ErrorCode::BadRequest,
                message: "…".into(),
                id: Some("c-1".into()),
            },
            r#"{"type":"error","code":"bad_request","message":"…","id":"c-1"}"#,
        ),
        (
            ServerFrame::Error {
                code: ErrorCode::Overloaded,
                message: "m".into(),
                id: None,
            },
            r#"{"type":"error","code":"overloaded","message":"m"}"#,
        ),
    ];
    for (frame, json) in cases {
        assert_eq!(frame.to_json(), json);
        assert_eq!(serde_json::from_str::<ServerFrame>(json).unwrap(), frame);
    }
}

#[test]
fn client_frames_serialise_to_the_wire_examples() {
    let cases = [
        (
            send("c-1", &["bob"], "hi"),
            r#"{"type":"send","id":"c-1","to":["bob"],"body":"hi"}"#,
        ),
        (
            ClientFrame::Ack { seq: 3471 },
            r#"{"type":"ack","seq":3471}"#,
        ),
        (
            ClientFrame::Sync { after: 3400 },
            r#"{"type":"sync","after":3400}"#,
        ),
    ];
    for (frame, json) in cases {
        assert_eq!(frame.to_json(), json);
        assert_eq!(parse(json).unwrap(), frame);
    }
}

/// Hostile frames and the exact code each must get.
#[test]
fn hostile_frames_get_stable_codes() {
    let huge_body =
        json!({"type":"send","id":"c","to":["b"],"body":"x".repeat(16_385)}).to_string();
    // 10,000 recipients fit in one frame only when short; the count is checked before
    // the recipients themselves, so duplicates do not change the code.
    let many_recipients =
        json!({"type":"send","id":"c","to":vec!["b"; 10_000],"body":""}).to_string();
    let many: Vec<String> = (0..10_000).map(|i| format!("u{i}")).collect();
    let many_distinct = json!({"type":"send","id":"c","to":many,"body":""}).to_string();
    let oversize = format!(r#"{{"type":"ack","seq":1,"p":"{}"}}"#, "x".repeat(70_000));
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let deep_obj = format!(
        r#"{{"type":"ack","seq":1,"x":{}1{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let long_recipient =
        json!({"type":"send","id":"c","to":["r".repeat(129)],"body":""}).to_string();
    let long_id = json!({"type":"send","id":"i".repeat(129),"to":["b"],"body":""}).to_string();

    let table: &[(&str, &str, &str)] = &[
        // not JSON / not an object
        ("empty input", "", "bad_json"),
        ("garbage", "hello", "bad_json"),
        ("truncated", r#"{"type":"ack","seq":1"#, "bad_json"),
        ("trailing garbage", r#"{"type":"ack","seq":1}x"#, "bad_json"),
        ("two objects", r#"{"type":"ack","seq":1}{}"#, "bad_json"),
        ("array", r#"[{"type":"ack","seq":1}]"#, "bad_json"),
        ("string", r#""send""#, "bad_json"),
        ("number", "3471", "bad_json"),
        ("null", "null", "bad_json"),
        (
            "lone surrogate",
            r#"{"type":"send","id":"c","to":["b"],"body":"\ud800"}"#,
            "bad_json",
        ),
        ("deep nesting", &deep, "bad_json"),
        ("deep nesting inside object", &deep_obj, "bad_json"),
        ("single quotes", "{'type':'ack','seq':1}", "bad_json"),
        // type
        ("missing type", r#"{"seq":1}"#, "bad_request"),
        ("type not a string", r#"{"type":1,"seq":1}"#, "bad_request"),
        ("type null", r#"{"type":null}"#, "bad_request"),
        ("unknown type", r#"{"type":"edit"}"#, "unknown_type"),
        (
            "server frame type",
            r#"{"type":"deliver","seq":1}"#,
            "unknown_type",
        ),
        (
            "type wrong case",
            r#"{"type":"SEND","id":"c","to":["b"],"body":""}"#,
            "unknown_type",
        ),
        ("empty object", "{}", "bad_request"),
        // send fields
        (
            "send missing id",
            r#"{"type":"send","to":["b"],"body":""}"#,
            "bad_request",
        ),
        (
            "send missing to",
            r#"{"type":"send","id":"c","body":""}"#,
            "bad_request",
        ),
        (
            "send missing body",
            r#"{"type":"send","id":"c","to":["b"]}"#,
            "bad_request",
        ),
        (
            "id not a string",
            r#"{"type":"send","id":1,"to":["b"],"body":""}"#,
            "bad_request",
        ),
        (
            "empty id",
            r#"{"type":"send","id":"","to":["b"],"body":""}"#,
            "bad_id",
        ),
        ("id too long", &long_id, "bad_id"),
        (
            "id with NUL",
            r#"{"type":"send","id":"b\u0000c","to":["a"],"body":""}"#,
            "bad_id",
        ),
        (
            "id with a newline",
            r#"{"type":"send","id":"c\n1","to":["b"],"body":""}"#,
            "bad_id",
        ),
        (
            "id with DEL",
            r#"{"type":"send","id":"c\u007f","to":["b"],"body":""}"#,
            "bad_id",
        ),
        (
            "to a string",
            r#"{"type":"send","id":"c","to":"bob","body":""}"#,
            "bad_request",
        ),
        (
            "to of numbers",
            r#"{"type":"send","id":"c","to":[1],"body":""}"#,
            "bad_request",
        ),
        (
            "to with null",
            r#"{"type":"send","id":"c","to":["b",null],"body":""}"#,
            "bad_request",
        ),
        (
            "to empty",
            r#"{"type":"send","id":"c","to":[],"body":""}"#,
            "bad_request",
        ),
        ("10,000 recipients", &many_recipients, "too_many_recipients"),
        (
            "10,000 distinct recipients",
            &many_distinct,
            "frame_too_large",
        ),
        (
            "101 recipients",
            &json!({"type":"send","id":"c","to":vec!["b"; 101],"body":""}).to_string(),
            "too_many_recipients",
        ),
        (
            "empty recipient",
            r#"{"type":"send","id":"c","to":[""],"body":""}"#,
            "bad_recipient",
        ),
        ("recipient too long", &long_recipient, "bad_recipient"),
        (
            "recipient with NUL",
            r#"{"type":"send","id":"c","to":["a\u0000b"],"body":""}"#,
            "bad_recipient",
        ),
        (
            "recipient with U+001F",
            r#"{"type":"send","id":"c","to":["b","a\u001f"],"body":""}"#,
            "bad_recipient",
        ),
        (
            "recipient with DEL",
            r#"{"type":"send","id":"c","to":["\u007f"],"body":""}"#,
            "bad_recipient",
        ),
        (
            "duplicate recipient",
            r#"{"type":"send","id":"c","to":["b","a","b"],"body":""}"#,
            "bad_recipient",
        ),
        (
            "body a number",
            r#"{"type":"send","id":"c","to":["b"],"body":1}"#,
            "bad_request",
        ),
        (
            "body an object",
            r#"{"type":"send","id":"c","to":["b"],"body":{"t":"hi"}}"#,
            "bad_request",
        ),
        (
            "body null",
            r#"{"type":"send","id":"c","to":["b"],"body":null}"#,
            "bad_request",
        ),
        ("huge body", &huge_body, "body_too_large"),
        // seqs
        ("ack missing seq", r#"{"type":"ack"}"#, "bad_request"),
        (
            "sync missing after",
            r#"{"type":"sync","seq":1}"#,
            "bad_request",
        ),
        (
            "seq a string",
            r#"{"type":"ack","seq":"3471"}"#,
            "bad_request",
        ),
        ("seq null", r#"{"type":"ack","seq":null}"#, "bad_request"),
        ("seq bool", r#"{"type":"ack","seq":true}"#, "bad_request"),
        ("float seq", r#"{"type":"ack","seq":3471.5}"#, "bad_request"),
        (
            "integral float seq",
            r#"{"type":"ack","seq":3471.0}"#,
            "bad_request",
        ),
        (
            "exponent seq",
            r#"{"type":"sync","after":1e3}"#,
            "bad_request",
        ),
        (
            "seq 2^48",
            r#"{"type":"ack","seq":281474976710656}"#,
            "seq_out_of_range",
        ),
        (
            "seq u64 max",
            r#"{"type":"ack","seq":18446744073709551615}"#,
            "seq_out_of_range",
        ),
        (
            "seq beyond u64",
            r#"{"type":"sync","after":100000000000000000000000}"#,
            "seq_out_of_range",
        ),
        (
            "seq huge exponent",
            r#"{"type":"ack","seq":1e300}"#,
            "seq_out_of_range",
        ),
        (
            "negative seq",
            r#"{"type":"ack","seq":-1}"#,
            "seq_out_of_range",
        ),
        (
            "negative after",
            r#"{"type":"sync","after":-3400}"#,
            "seq_out_of_range",
        ),
        (
            "negative float seq",
            r#"{"type":"ack","seq":-0.5}"#,
            "seq_out_of_range",
        ),
        // size
        ("oversize frame", &oversize, "frame_too_large"),
    ];
    for (name, frame, code) in table {
        match parse(frame) {
            Ok(f) => panic!("{name}: accepted as {f:?}"),
            Err(e) => assert_eq!(e.code(), *code, "{name}: {e}"),
        }
    }
}
