//! Every token that does not verify is refused with the same answer on the wire (HTTP and
//! WebSocket upgrade, header and `?token=`): a client cannot tell a malformed token from a
//! mis-signed one (issue 9, item 5). Real gateway, real sockets.

mod gateway_support;

use std::collections::BTreeSet;

use gateway_support::{assert_error, encode, now_unix, start_with, token_for, SECRET};
use tidemark_protocol::token;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_mis_signed_tokens_get_one_answer() {
    let d = start_with(|o| o.dev_auth = false).await;
    let good = token_for("alice");
    let (head, _) = good.rsplit_once('.').unwrap();
    let invalid = [
        (
            "wrong secret",
            token::sign(b"another secret", "alice", now_unix() + 60),
        ),
        ("zero MAC", format!("{head}.{}", "A".repeat(43))),
        ("truncated MAC", format!("{head}.AAAA")),
        ("not v1", good.replacen("v1.", "v2.", 1)),
        ("garbage", "garbage".to_string()),
        ("bad base64", "v1.!!!.AAAA".to_string()),
        ("too long", format!("v1.{}.AAAA", "A".repeat(2000))),
        (
            "expired, wrong secret",
            token::sign(b"another secret", "alice", 1),
        ),
    ];
    let mut answers = BTreeSet::new();
    for (what, t) in &invalid {
        let bearer = format!("Bearer {t}");
        let http = d
            .http("GET", "/v1/mailbox", &[("Authorization", &bearer)], None)
            .await;
        answers.insert(format!("{} {}", http.0, http.1));
        for (query, headers) in [
            (format!("token={}", encode(t)), vec![]),
            (String::new(), vec![("Authorization", bearer.as_str())]),
        ] {
            let Err((status, body)) = d.try_ws(&query, &headers).await else {
                panic!("{what}: upgrade accepted");
            };
            answers.insert(format!("{status} {body}"));
        }
    }
    assert_eq!(answers.len(), 1, "{answers:#?}");
    let one = answers.into_iter().next().unwrap();
    assert!(one.starts_with("401 "), "{one}");
    let body: serde_json::Value = serde_json::from_str(&one[4..]).unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");
    assert_eq!(body["error"]["message"], token::INVALID_TOKEN_MESSAGE);

    // a correctly signed, expired token is told apart (the client needs a new one)
    let expired = token::sign(SECRET, "alice", now_unix() - 1);
    let r = d.with_token("GET", "/v1/mailbox", &expired, None).await;
    assert_error(&r, 401, "token_expired");
    d.shutdown().await;
}
