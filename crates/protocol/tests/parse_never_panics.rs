//! Property tests: the client-input parsers never panic, whatever they are given, every input
//! they accept survives a serialise/parse round trip unchanged and every rejection names its
//! code and echoed id consistently: the fuzz target's own checks
//! (`tidemark_protocol::fuzzing::check`) on generated input, plus the frame checks below.

use proptest::prelude::*;
use serde_json::{Map, Number, Value};
use tidemark_protocol::fuzzing::{check_all_limits, limit_sets};
use tidemark_protocol::{
    parse_ack_request, parse_client_frame, parse_mailbox_query, parse_send_request, ClientFrame,
    ErrorCode, Limits, SendRequest, MAX_SEQ,
};

/// Keys and strings biased towards the protocol's own, so generated objects often get deep
/// into validation instead of failing at `type`.
fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "type", "send", "ack", "sync", "id", "to", "body", "seq", "after", "c-1", "bob", "",
        ])
        .prop_map(String::from),
        1 => ".{0,12}",
        1 => "\\PC{120,140}",
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0..=MAX_SEQ + 2).prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| Number::from_f64(f).map(Value::Number)),
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        word().prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 128, 12, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..12).prop_map(Value::Array),
            prop::collection::vec((word(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Objects shaped like frames: a known or random `type` plus any subset of the fields.
fn frame_like() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just(Value::from("send")),
            Just(Value::from("ack")),
            Just(Value::from("sync")),
            json()
        ],
        prop::collection::vec(
            (
                prop::sample::select(vec!["id", "to", "body", "seq", "after", "x"]),
                prop_oneof![
                    json(),
                    prop::collection::vec(word().prop_map(Value::String), 0..120)
                        .prop_map(Value::Array)
                ],
            ),
            0..5,
        ),
    )
        .prop_map(|(ty, fields)| {
            let mut m = Map::new();
            m.insert("type".into(), ty);
            for (k, v) in fields {
                m.insert(k.into(), v);
            }
            Value::Object(m)
        })
}

/// The fuzz target's checks on `bytes`, under both sets of limits.
fn target_checks(bytes: &[u8]) -> Result<(), TestCaseError> {
    check_all_limits(bytes).map_err(TestCaseError::fail)?;
    Ok(())
}

fn check(text: &str) -> Result<(), TestCaseError> {
    target_checks(text.as_bytes())?;
    for limits in limit_sets() {
        match parse_client_frame(text, &limits) {
            Ok(frame) => {
                let again = parse_client_frame(&frame.to_json(), &Limits::default());
                prop_assert_eq!(again.as_ref(), Ok(&frame));
            }
            Err(e) => {
                prop_assert_eq!(e.code(), e.error_code().as_str());
                prop_assert!(e.error_code().http_status() < 500);
                if let Some(id) = e.id() {
                    prop_assert!(!id.is_empty() && id.len() <= limits.max_id_bytes);
                }
            }
        }
        let _ = parse_send_request(text.as_bytes(), &limits);
        let _ = parse_ack_request(text.as_bytes(), &limits);
        let _ = parse_mailbox_query(text, &limits);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_strings(text in ".*") {
        check(&text)?;
    }

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        target_checks(&bytes)?;
        if let Ok(text) = std::str::from_utf8(&bytes) {
            check(text)?;
        }
    }

    #[test]
    fn arbitrary_json(v in json()) {
        check(&v.to_string())?;
    }

    #[test]
    fn frame_shaped_json(v in frame_like()) {
        check(&v.to_string())?;
    }

    #[test]
    fn truncated_valid_frames(cut in 0usize..60, which in 0usize..3) {
        let text = [
            r#"{"type":"send","id":"c-1","to":["bob"],"body":"hi"}"#,
            r#"{"type":"ack","seq":3471}"#,
            r#"{"type":"sync","after":3400}"#,
        ][which];
        let text = &text[..cut.min(text.len())];
        check(text)?;
    }

    #[test]
    fn mailbox_queries(after in ".{0,30}", limit in ".{0,10}", extra in ".{0,20}") {
        target_checks(format!("after={after}&limit={limit}&{extra}").as_bytes())?;
        target_checks(format!("{extra}={after}").as_bytes())?;
    }

    #[test]
    fn valid_frames_round_trip(
        id in "\\PC{1,20}",
        to in prop::collection::btree_set("\\PC{1,30}", 1..10),
        body in "\\PC{0,100}",
        seq in 0..=MAX_SEQ,
    ) {
        let frames = [
            ClientFrame::Send(SendRequest { id, to: to.into_iter().collect(), body }),
            ClientFrame::Ack { seq },
            ClientFrame::Sync { after: seq },
        ];
        for frame in frames {
            prop_assert_eq!(parse_client_frame(&frame.to_json(), &Limits::default()), Ok(frame));
        }
    }

    #[test]
    fn seqs_above_u48_are_out_of_range(seq in MAX_SEQ + 1..=u64::MAX) {
        let e = parse_client_frame(&format!(r#"{{"type":"ack","seq":{seq}}}"#), &Limits::default())
            .unwrap_err();
        prop_assert_eq!(e.error_code(), ErrorCode::SeqOutOfRange);
    }
}
