//! Unit tests of the frames: valid frames, limits, the id echoed in errors, the wire
//! examples of `docs/protocol.md`, and the code every hostile frame gets. Most are tables:
//! (input, what it must parse to) or (code, the inputs refused with it).

use super::*;
use serde_json::json;

fn parse(text: &str) -> Result<ClientFrame, FrameError> {
    parse_client_frame(text, &Limits::default())
}

/// The code and the echoed client id of a frame that `limits` must refuse.
fn refusal(text: &str, limits: &Limits) -> (&'static str, Option<String>) {
    match parse_client_frame(text, limits) {
        Ok(f) => panic!("{text:.100}: accepted as {f:?}"),
        Err(e) => (e.code(), e.id().map(str::to_owned)),
    }
}

fn send(id: &str, to: &[&str], body: &str) -> ClientFrame {
    ClientFrame::Send(SendRequest {
        id: id.into(),
        to: to.iter().map(|s| s.to_string()).collect(),
        body: body.into(),
    })
}

fn ack(seq: u64) -> ClientFrame {
    ClientFrame::Ack { seq }
}

fn sync(after: u64) -> ClientFrame {
    ClientFrame::Sync { after }
}

fn error(code: ErrorCode, message: &str, id: Option<&str>) -> ServerFrame {
    ServerFrame::Error {
        code,
        message: message.into(),
        id: id.map(str::to_owned),
    }
}

#[test]
fn parses_valid_client_frames() {
    let max_seq = format!(r#"{{"type":"sync","after":{MAX_SEQ}}}"#);
    let cases = [
        (
            r#"{"type":"send","id":"c-1","to":["bob"],"body":"hi"}"#,
            send("c-1", &["bob"], "hi"),
        ),
        (r#"{"type":"ack","seq":3471}"#, ack(3471)),
        (r#"{"type":"sync","after":3400}"#, sync(3400)),
        // Edges that are accepted.
        (r#"{"type":"ack","seq":0}"#, ack(0)),
        (&max_seq, sync(MAX_SEQ)),
        (
            r#"{"type":"send","id":"x","to":["a","b"],"body":""}"#,
            send("x", &["a", "b"], ""),
        ),
        // Non-ASCII and spaces are fine in ids; control characters only in the body.
        (
            r#"{"type":"send","id":"ü 1","to":["bö b","\u0080"],"body":"a\u0000\n"}"#,
            send("ü 1", &["bö b", "\u{80}"], "a\0\n"),
        ),
        // Unknown fields are ignored; key order does not matter.
        (
            r#"{"body":"hi","to":["bob"],"v":2,"id":"c-1","type":"send"}"#,
            send("c-1", &["bob"], "hi"),
        ),
    ];
    for (text, frame) in cases {
        assert_eq!(parse(text).unwrap(), frame, "{text}");
    }
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
    assert_eq!(refusal(&format!("{frame} "), &l).0, "frame_too_large");
}

#[test]
fn body_limit_counts_utf8_bytes() {
    let l = Limits::default();
    // 8193 two-byte characters = 16386 bytes.
    let body = "é".repeat(l.max_body_bytes / 2 + 1);
    let frame = json!({"type":"send","id":"c-9","to":["bob"],"body":body}).to_string();
    assert_eq!(refusal(&frame, &l), ("body_too_large", Some("c-9".into())));
}

#[test]
fn custom_limits_apply() {
    let l = Limits {
        max_recipients: 1,
        max_body_bytes: 2,
        max_id_bytes: 3,
        ..Limits::default()
    };
    for (text, code) in [
        (
            r#"{"type":"send","id":"c","to":["a","b"],"body":""}"#,
            "too_many_recipients",
        ),
        (
            r#"{"type":"send","id":"c","to":["a"],"body":"abc"}"#,
            "body_too_large",
        ),
        (
            r#"{"type":"send","id":"abcd","to":["a"],"body":""}"#,
            "bad_id",
        ),
    ] {
        assert_eq!(refusal(text, &l).0, code, "{text}");
    }
}

#[test]
fn error_echoes_id_when_recoverable() {
    let e = parse(r#"{"type":"send","id":"c-7","to":["bob","bob"],"body":"hi"}"#).unwrap_err();
    assert_eq!((e.code(), e.id()), ("bad_recipient", Some("c-7")));
    assert_eq!(
        e.to_server_frame(),
        error(ErrorCode::BadRecipient, e.message(), Some("c-7"))
    );
    for (text, code, id) in [
        // Unknown type from a newer client: id still echoed.
        (r#"{"type":"edit","id":"c-8"}"#, "unknown_type", Some("c-8")),
        // Invalid ids are not echoed.
        (
            r#"{"type":"send","id":"","to":["b"],"body":""}"#,
            "bad_id",
            None,
        ),
        (
            r#"{"type":"send","id":7,"to":["b"],"body":""}"#,
            "bad_request",
            None,
        ),
        // Nothing to recover from non-objects.
        ("[1]", "bad_json", None),
    ] {
        let want = (code, id.map(str::to_owned));
        assert_eq!(refusal(text, &Limits::default()), want, "{text}");
    }
}

#[test]
fn server_frames_match_the_wire_examples() {
    let deliver = ServerFrame::Deliver(Entry {
        seq: 3471,
        from: "alice".into(),
        body: "hi".into(),
        sent_at_us: 1_764_489_600_000_000,
    });
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
            deliver,
            r#"{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1764489600000000}"#,
        ),
        (
            error(ErrorCode::BadRequest, "…", Some("c-1")),
            r#"{"type":"error","code":"bad_request","message":"…","id":"c-1"}"#,
        ),
        (
            error(ErrorCode::Overloaded, "m", None),
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
    for (frame, json) in [
        (
            send("c-1", &["bob"], "hi"),
            r#"{"type":"send","id":"c-1","to":["bob"],"body":"hi"}"#,
        ),
        (ack(3471), r#"{"type":"ack","seq":3471}"#),
        (sync(3400), r#"{"type":"sync","after":3400}"#),
    ] {
        assert_eq!(frame.to_json(), json);
        assert_eq!(parse(json).unwrap(), frame);
    }
}

/// Hostile frames and the exact code each must get: (code, [(case, frame)]).
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
    let recipients_101 = json!({"type":"send","id":"c","to":vec!["b"; 101],"body":""}).to_string();
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

    let table: &[(&str, &[(&str, &str)])] = &[
        // not JSON / not an object
        (
            "bad_json",
            &[
                ("empty input", ""),
                ("garbage", "hello"),
                ("truncated", r#"{"type":"ack","seq":1"#),
                ("trailing garbage", r#"{"type":"ack","seq":1}x"#),
                ("two objects", r#"{"type":"ack","seq":1}{}"#),
                ("array", r#"[{"type":"ack","seq":1}]"#),
                // a frame's fields by position (serde reads a struct from an array)
                (
                    "array of fields",
                    r#"["send","c-1",["bob"],"hi",null,null]"#,
                ),
                ("array of ack fields", r#"["ack",null,null,null,3471,null]"#),
                ("string", r#""send""#),
                ("number", "3471"),
                ("null", "null"),
                (
                    "lone surrogate",
                    r#"{"type":"send","id":"c","to":["b"],"body":"\ud800"}"#,
                ),
                ("deep nesting", &deep),
                ("deep nesting inside object", &deep_obj),
                ("single quotes", "{'type':'ack','seq':1}"),
            ],
        ),
        // type, missing fields and fields of the wrong JSON type
        (
            "bad_request",
            &[
                ("missing type", r#"{"seq":1}"#),
                ("type not a string", r#"{"type":1,"seq":1}"#),
                ("type null", r#"{"type":null}"#),
                ("empty object", "{}"),
                ("send missing id", r#"{"type":"send","to":["b"],"body":""}"#),
                ("send missing to", r#"{"type":"send","id":"c","body":""}"#),
                (
                    "send missing body",
                    r#"{"type":"send","id":"c","to":["b"]}"#,
                ),
                (
                    "id not a string",
                    r#"{"type":"send","id":1,"to":["b"],"body":""}"#,
                ),
                (
                    "to a string",
                    r#"{"type":"send","id":"c","to":"bob","body":""}"#,
                ),
                (
                    "to of numbers",
                    r#"{"type":"send","id":"c","to":[1],"body":""}"#,
                ),
                (
                    "to with null",
                    r#"{"type":"send","id":"c","to":["b",null],"body":""}"#,
                ),
                ("to empty", r#"{"type":"send","id":"c","to":[],"body":""}"#),
                (
                    "body a number",
                    r#"{"type":"send","id":"c","to":["b"],"body":1}"#,
                ),
                (
                    "body an object",
                    r#"{"type":"send","id":"c","to":["b"],"body":{"t":"hi"}}"#,
                ),
                (
                    "body null",
                    r#"{"type":"send","id":"c","to":["b"],"body":null}"#,
                ),
                ("ack missing seq", r#"{"type":"ack"}"#),
                ("sync missing after", r#"{"type":"sync","seq":1}"#),
                ("seq a string", r#"{"type":"ack","seq":"3471"}"#),
                ("seq null", r#"{"type":"ack","seq":null}"#),
                ("seq bool", r#"{"type":"ack","seq":true}"#),
                ("float seq", r#"{"type":"ack","seq":3471.5}"#),
                ("integral float seq", r#"{"type":"ack","seq":3471.0}"#),
                ("exponent seq", r#"{"type":"sync","after":1e3}"#),
            ],
        ),
        (
            "unknown_type",
            &[
                ("unknown type", r#"{"type":"edit"}"#),
                ("server frame type", r#"{"type":"deliver","seq":1}"#),
                (
                    "type wrong case",
                    r#"{"type":"SEND","id":"c","to":["b"],"body":""}"#,
                ),
            ],
        ),
        (
            "bad_id",
            &[
                (
                    "empty id",
                    r#"{"type":"send","id":"","to":["b"],"body":""}"#,
                ),
                ("id too long", &long_id),
                (
                    "id with NUL",
                    r#"{"type":"send","id":"b\u0000c","to":["a"],"body":""}"#,
                ),
                (
                    "id with a newline",
                    r#"{"type":"send","id":"c\n1","to":["b"],"body":""}"#,
                ),
                (
                    "id with DEL",
                    r#"{"type":"send","id":"c\u007f","to":["b"],"body":""}"#,
                ),
            ],
        ),
        (
            "too_many_recipients",
            &[
                ("10,000 recipients", &many_recipients),
                ("101 recipients", &recipients_101),
            ],
        ),
        (
            "bad_recipient",
            &[
                (
                    "empty recipient",
                    r#"{"type":"send","id":"c","to":[""],"body":""}"#,
                ),
                ("recipient too long", &long_recipient),
                (
                    "recipient with NUL",
                    r#"{"type":"send","id":"c","to":["a\u0000b"],"body":""}"#,
                ),
                (
                    "recipient with U+001F",
                    r#"{"type":"send","id":"c","to":["b","a\u001f"],"body":""}"#,
                ),
                (
                    "recipient with DEL",
                    r#"{"type":"send","id":"c","to":["\u007f"],"body":""}"#,
                ),
                (
                    "duplicate recipient",
                    r#"{"type":"send","id":"c","to":["b","a","b"],"body":""}"#,
                ),
            ],
        ),
        ("body_too_large", &[("huge body", &huge_body)]),
        (
            "seq_out_of_range",
            &[
                ("seq 2^48", r#"{"type":"ack","seq":281474976710656}"#),
                (
                    "seq u64 max",
                    r#"{"type":"ack","seq":18446744073709551615}"#,
                ),
                (
                    "seq beyond u64",
                    r#"{"type":"sync","after":100000000000000000000000}"#,
                ),
                ("seq huge exponent", r#"{"type":"ack","seq":1e300}"#),
                ("negative seq", r#"{"type":"ack","seq":-1}"#),
                ("negative after", r#"{"type":"sync","after":-3400}"#),
                ("negative float seq", r#"{"type":"ack","seq":-0.5}"#),
            ],
        ),
        // size
        (
            "frame_too_large",
            &[
                ("10,000 distinct recipients", &many_distinct),
                ("oversize frame", &oversize),
            ],
        ),
    ];
    for (code, frames) in table {
        for (name, frame) in *frames {
            match parse(frame) {
                Ok(f) => panic!("{name}: accepted as {f:?}"),
                Err(e) => assert_eq!(e.code(), *code, "{name}: {e}"),
            }
        }
    }
}
