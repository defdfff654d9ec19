//! `docs/openapi.yaml` and `docs/ws-frames.schema.json` against a running gateway (real
//! redis-servers, the materializer, real HTTP and WebSocket): every documented path is
//! called, every answer's status must be documented for its operation, its content type
//! listed and its JSON body valid against the documented schema; every WebSocket frame the
//! server sends must be a valid `ServerFrame`, every frame the server accepts a valid
//! `ClientFrame`, and frames it refuses invalid where the schema can say so. Each
//! documented (method, path, status) is either seen here or listed in `NOT_TRIGGERED` with
//! the reason. The admin endpoints' auth (admin token, user token 403, dev auth) is checked
//! here too.
//!
//! The validator (`schema_support`) handles the JSON Schema subset the documents use and
//! panics on any other keyword; `validator_really_checks` shows it refuses what it must.

mod gateway_support;
mod schema_support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use futures::SinkExt;
use gateway_support::{
    encode, header_value, http_full, now_unix, poll, start_with, Deployment, SECRET, WAIT,
};
use schema_support::{assert_invalid, assert_valid, errors, resolve, OpenApi};
use serde_json::{json, Value};
use tidemark_protocol::{token, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// Documented answers this test does not provoke, and why.
const NOT_TRIGGERED: &[(&str, &str, &str, &str)] = &[
    (
        "POST",
        "/v1/messages",
        "429",
        "rate_limited: the per-user send rate is off by default (tests/gateway_limits.rs)",
    ),
    ("POST", "/v1/messages", "500", "internal: a Redis failure"),
    (
        "POST",
        "/v1/messages",
        "503",
        "overloaded / shard_unavailable: commit back-pressure, a corrupt watermark",
    ),
    (
        "POST",
        "/v1/messages",
        "507",
        "log_exhausted: a shard at offset 2^48-1",
    ),
    ("GET", "/v1/mailbox", "500", "internal: a Redis failure"),
    (
        "POST",
        "/v1/mailbox/ack",
        "500",
        "internal: a Redis failure",
    ),
    (
        "GET",
        "/v1/ws",
        "503",
        "overloaded: the gateway's connection limit (tests/gateway_limits.rs)",
    ),
    (
        "GET",
        "/v1/admin/status",
        "500",
        "internal: a Redis failure",
    ),
    (
        "GET",
        "/healthz",
        "503",
        "a stopped or stuck shard (tests/gateway.rs)",
    ),
];

fn repo_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn openapi() -> OpenApi {
    OpenApi::parse(&repo_file("docs/openapi.yaml"))
}

fn frames_doc() -> Value {
    serde_json::from_str(&repo_file("docs/ws-frames.schema.json")).unwrap()
}

fn frame_def(doc: &Value, name: &str) -> Value {
    resolve(doc, &format!("#/$defs/{name}")).clone()
}

#[test]
fn validator_really_checks() {
    let doc = json!({"$defs": {"Seq": {"type": "integer", "minimum": 0, "maximum": 10}}});
    let obj = json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["a"],
        "properties": {
            "a": {"$ref": "#/$defs/Seq"},
            "b": {"type": ["string", "null"], "minLength": 2, "maxLength": 3},
            "c": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "uniqueItems": true},
            "d": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 5}]},
            "e": {"allOf": [{"type": "object"}, {"properties": {"x": {"const": "y"}}}]},
            "f": {"type": "object", "propertyNames": {"maxLength": 2}, "minProperties": 1,
                  "additionalProperties": {"type": "integer"}},
        }
    });
    assert_valid(&doc, &obj, &json!({"a": 3}), "minimal");
    assert_valid(
        &doc,
        &obj,
        &json!({"a": 0, "b": null, "c": [1, 2], "d": 7.5, "e": {"x": "y"}, "f": {"k": 1}}),
        "full",
    );
    for bad in [
        json!({}),
        json!({"a": -1}),
        json!({"a": 11}),
        json!({"a": 1.5}),
        json!({"a": "1"}),
        json!({"a": 1, "z": 0}),
        json!({"a": 1, "b": "x"}),
        json!({"a": 1, "b": "long"}),
        json!({"a": 1, "b": 5}),
        json!({"a": 1, "c": []}),
        json!({"a": 1, "c": [3]}),
        json!({"a": 1, "c": [1, 1]}),
        json!({"a": 1, "d": 6}), // matches both: not oneOf
        json!({"a": 1, "d": "x"}),
        json!({"a": 1, "e": {"x": "z"}}),
        json!({"a": 1, "f": {}}),
        json!({"a": 1, "f": {"long": 1}}),
        json!({"a": 1, "f": {"k": "v"}}),
        json!([1]),
    ] {
        assert_invalid(&doc, &obj, &bad, "bad instance");
    }
    // an unsupported keyword is an error, never a silent pass
    let r = std::panic::catch_unwind(|| errors(&doc, &json!({"pattern": "^a$"}), &json!("b")));
    assert!(r.is_err(), "`pattern` must not be ignored");
    // a $ref that does not resolve is an error
    let r = std::panic::catch_unwind(|| errors(&doc, &json!({"$ref": "#/$defs/Nope"}), &json!(1)));
    assert!(r.is_err());

    // the real documents: invalid answers are refused
    let api = openapi();
    let page = api.json_schema("GET", "/v1/mailbox", 200);
    assert_valid(
        &api.doc,
        &page,
        &json!({"entries": [], "next_after": 0}),
        "empty page",
    );
    for bad in [
        json!({"entries": []}),
        json!({"entries": [], "next_after": -1}),
        json!({"entries": [{"seq": 1, "from": "a", "body": "b"}], "next_after": 1}),
        json!({"entries": [], "next_after": 1, "more": true}),
    ] {
        assert_invalid(&api.doc, &page, &bad, "mailbox page");
    }
    let unauthorized = api.json_schema("GET", "/v1/mailbox", 401);
    assert_invalid(
        &api.doc,
        &unauthorized,
        &json!({"error": {"code": "not_found", "message": "m"}}),
        "401 carries unauthorized or token_expired only",
    );
    let frames = frames_doc();
    let server = frame_def(&frames, "ServerFrame");
    for bad in [
        json!({"type": "ready", "user": "a"}),
        json!({"type": "deliver", "seq": 1, "from": "a", "body": "b"}),
        json!({"type": "error", "code": "nope", "message": "m"}),
        json!({"type": "send_ack", "id": "c", "offsets": {}}),
        json!({"type": "hello"}),
    ] {
        assert_invalid(&frames, &server, &bad, "server frame");
    }
}

#[test]
fn documents_agree_with_the_error_codes() {
    let all: BTreeSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let api = openapi();
    let frames = frames_doc();
    for (doc, enumeration) in [
        (
            &api.doc,
            &api.doc["components"]["schemas"]["ErrorCode"]["enum"],
        ),
        (&frames, &frames["$defs"]["ErrorCode"]["enum"]),
    ] {
        let listed: BTreeSet<&str> = enumeration
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert_eq!(listed, all, "ErrorCode enum of {}", doc["title"]);
    }
    // every code is accepted by the error schema of its HTTP status wherever that status is
    // documented, and by no error schema of another status
    for (method, path, status) in api.documented() {
        let r = api.response(&method, &path, status.parse().unwrap());
        let Some(schema) = r.get("content").and_then(|c| c.get("application/json")) else {
            continue;
        };
        let schema = &schema["schema"];
        if status == "200" {
            continue;
        }
        for code in ErrorCode::ALL {
            let body = json!({"error": {"code": code.as_str(), "message": "m"}});
            let ok = errors(&api.doc, schema, &body).is_empty();
            assert_eq!(
                ok,
                code.http_status().to_string() == status,
                "{method} {path} {status}: {code} (HTTP {})",
                code.http_status()
            );
        }
    }
}

/// Calls the gateway and checks the answer against the document; (status, head, body).
async fn call(
    api: &mut OpenApi,
    d: &Deployment,
    method: &str,
    path: &str,
    template: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String, String) {
    let (status, head, text) = http_full(d.addr, method, path, headers, body).await;
    assert_ne!(status, 0, "{method} {path}: no answer");
    api.check(
        method,
        template,
        status,
        header_value(&head, "content-type"),
        &text,
    );
    (status, head, text)
}

/// `call` expecting `status` and, for an error, `code`.
#[allow(clippy::too_many_arguments)]
async fn expect(
    api: &mut OpenApi,
    d: &Deployment,
    method: &str,
    path: &str,
    template: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    status: u16,
    code: Option<&str>,
) -> String {
    let (got, _, text) = call(api, d, method, path, template, headers, body).await;
    assert_eq!(got, status, "{method} {path}: {text}");
    if let Some(code) = code {
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], code, "{method} {path}: {text}");
    }
    text
}

/// A WebSocket upgrade with `query`: Ok(socket) on 101, else (status, content type, body).
async fn upgrade(
    d: &Deployment,
    query: &str,
) -> Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    (u16, Option<String>, String),
> {
    let req = d.ws_url(query).into_client_request().unwrap();
    let r = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(req))
        .await
        .expect("ws connect timed out");
    match r {
        Ok((ws, resp)) => {
            assert_eq!(resp.status().as_u16(), 101);
            Ok(ws)
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err((
            resp.status().as_u16(),
            resp.headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_string()),
            resp.body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default(),
        )),
        Err(e) => panic!("ws connect failed: {e}"),
    }
}

/// The first `n` events of `GET path` (server-sent events) as (event, data); the head too.
async fn sse_events(
    d: &Deployment,
    path: &str,
    headers: &[(&str, &str)],
    n: usize,
) -> (String, Vec<(String, String)>) {
    let mut io = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n", d.addr);
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    io.write_all(req.as_bytes()).await.unwrap();
    let mut text = String::new();
    let mut buf = [0u8; 16 * 1024];
    let read = async {
        loop {
            let k = io.read(&mut buf).await.unwrap();
            assert!(k > 0, "the stream ended: {text}");
            text.push_str(&String::from_utf8_lossy(&buf[..k]));
            let Some((_, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            // chunked framing: an event's lines never contain "\r\n", chunk sizes do; the
            // last block may be incomplete
            let blocks: Vec<&str> = body.split("\n\n").collect();
            let events: Vec<(String, String)> = blocks[..blocks.len() - 1]
                .iter()
                .filter_map(|block| {
                    let mut event = None;
                    let mut data = None;
                    for line in block.split('\n') {
                        let line = line.rsplit("\r\n").next().unwrap();
                        if let Some(e) = line.strip_prefix("event: ") {
                            event = Some(e.to_string());
                        } else if let Some(x) = line.strip_prefix("data: ") {
                            data = Some(x.to_string());
                        }
                    }
                    Some((event?, data?))
                })
                .collect();
            if events.len() >= n {
                let head = text.split_once("\r\n\r\n").unwrap().0.to_string();
                return (head, events.into_iter().take(n).collect());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("server-sent events within 20 s")
}

/// Reads text frames until one matches `pred` (bounded); every frame is a valid
/// `ServerFrame`, counted by type in `seen`.
async fn next_frame<S>(
    ws: &mut tokio_tungstenite::WebSocketStream<S>,
    frames: &Value,
    seen: &mut BTreeSet<String>,
    pred: impl Fn(&Value) -> bool,
) -> Value
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures::StreamExt;
    let server = frame_def(frames, "ServerFrame");
    loop {
        let msg = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("a frame within the wait")
            .expect("socket open")
            .expect("socket ok");
        let Message::Text(t) = msg else { continue };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        assert_valid(frames, &server, &v, "server frame");
        seen.insert(v["type"].as_str().unwrap().to_string());
        if pred(&v) {
            return v;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_answers_match_the_documents() {
    let d = start_with(|o| o.max_connections_per_user = 3).await;
    let mut api = openapi();
    let frames = frames_doc();
    let client_frame = frame_def(&frames, "ClientFrame");
    let user_token = token::sign(SECRET, "alice", now_unix() + 3600);
    let admin_token = token::sign_admin(SECRET, "ops", now_unix() + 3600);
    let forged = token::sign(b"another secret", "alice", now_unix() + 3600);
    let expired = token::sign(SECRET, "alice", now_unix() - 1);
    let bearer = |t: &str| format!("Bearer {t}");
    let (user_auth, admin_auth) = (bearer(&user_token), bearer(&admin_token));
    let (forged_auth, expired_auth) = (bearer(&forged), bearer(&expired));
    let user_h = [("Authorization", user_auth.as_str())];
    let admin_h = [("Authorization", admin_auth.as_str())];
    let forged_h = [("Authorization", forged_auth.as_str())];
    let expired_h = [("Authorization", expired_auth.as_str())];

    // ---- POST /v1/messages ----
    let m = "/v1/messages";
    let send = json!({"id": "o-1", "to": ["bob", "carol"], "body": "hello"});
    let sent = send.to_string();
    let ok = expect(
        &mut api,
        &d,
        "POST",
        &format!("{m}?user=alice"),
        m,
        &[],
        Some(sent.as_bytes()),
        200,
        None,
    )
    .await;
    let offsets: Value = serde_json::from_str(&ok).unwrap();
    // with a token too
    let by_token = json!({"id": "o-2", "to": ["bob"], "body": "by token"}).to_string();
    let ok2 = expect(
        &mut api,
        &d,
        "POST",
        m,
        m,
        &user_h,
        Some(by_token.as_bytes()),
        200,
        None,
    )
    .await;
    let offsets2: Value = serde_json::from_str(&ok2).unwrap();
    let too_many: Vec<String> = (0..101).map(|i| format!("u{i}")).collect();
    for (body, status, code) in [
        ("not json".to_string(), 400, "bad_json"),
        (r#"[1]"#.to_string(), 400, "bad_json"),
        (
            json!({"id": "x", "to": "bob", "body": "b"}).to_string(),
            400,
            "bad_request",
        ),
        (
            json!({"id": "x", "to": ["bob"]}).to_string(),
            400,
            "bad_request",
        ),
        (
            json!({"id": "x", "to": too_many, "body": "b"}).to_string(),
            400,
            "too_many_recipients",
        ),
        (
            json!({"id": "x", "to": ["bob", "bob"], "body": "b"}).to_string(),
            400,
            "bad_recipient",
        ),
        (
            json!({"id": "", "to": ["bob"], "body": "b"}).to_string(),
            400,
            "bad_id",
        ),
        (
            json!({"id": "x", "to": ["bob"], "body": "x".repeat(16385)}).to_string(),
            413,
            "body_too_large",
        ),
        ("x".repeat(70_000), 413, "frame_too_large"),
        (
            json!({"id": "o-1", "to": ["bob"], "body": "another"}).to_string(),
            422,
            "id_reused",
        ),
    ] {
        expect(
            &mut api,
            &d,
            "POST",
            &format!("{m}?user=alice"),
            m,
            &[],
            Some(body.as_bytes()),
            status,
            Some(code),
        )
        .await;
    }
    expect(
        &mut api,
        &d,
        "POST",
        m,
        m,
        &[],
        Some(sent.as_bytes()),
        401,
        Some("unauthorized"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "POST",
        m,
        m,
        &forged_h,
        Some(sent.as_bytes()),
        401,
        Some("unauthorized"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "POST",
        m,
        m,
        &expired_h,
        Some(sent.as_bytes()),
        401,
        Some("token_expired"),
    )
    .await;

    // ---- GET /v1/mailbox ----
    let mb = "/v1/mailbox";
    let seq = offsets["offsets"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .max()
        .unwrap();
    let seq2 = offsets2["offsets"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .as_u64()
        .unwrap();
    d.wait_visible("bob", seq2).await;
    let page = expect(
        &mut api,
        &d,
        "GET",
        &format!("{mb}?user=bob&after=0&limit=10"),
        mb,
        &[],
        None,
        200,
        None,
    )
    .await;
    let page: Value = serde_json::from_str(&page).unwrap();
    assert_eq!(page["entries"].as_array().unwrap().len(), 2, "{page}");
    expect(
        &mut api,
        &d,
        "GET",
        &format!("{mb}?user=carol"),
        mb,
        &[],
        None,
        200,
        None,
    )
    .await;
    for (q, code) in [
        ("limit=0", "bad_request"),
        ("limit=1001", "bad_request"),
        ("after=x", "bad_request"),
        ("after=1&after=2", "bad_request"),
        ("after=281474976710656", "seq_out_of_range"),
    ] {
        expect(
            &mut api,
            &d,
            "GET",
            &format!("{mb}?user=bob&{q}"),
            mb,
            &[],
            None,
            400,
            Some(code),
        )
        .await;
    }
    expect(
        &mut api,
        &d,
        "GET",
        mb,
        mb,
        &[],
        None,
        401,
        Some("unauthorized"),
    )
    .await;

    // ---- POST /v1/mailbox/ack ----
    let ack = "/v1/mailbox/ack";
    let acked = expect(
        &mut api,
        &d,
        "POST",
        &format!("{ack}?user=carol"),
        ack,
        &[],
        Some(json!({"seq": seq}).to_string().as_bytes()),
        200,
        None,
    )
    .await;
    assert!(acked.contains("acked"), "{acked}");
    for (body, status, code) in [
        (json!({"seq": "1"}).to_string(), 400, "bad_request"),
        (json!({"seq": 1.5}).to_string(), 400, "bad_request"),
        (json!({"seq": -1}).to_string(), 400, "seq_out_of_range"),
        (
            json!({"seq": 281_474_976_710_656u64}).to_string(),
            400,
            "seq_out_of_range",
        ),
        ("x".repeat(70_000), 413, "frame_too_large"),
    ] {
        expect(
            &mut api,
            &d,
            "POST",
            &format!("{ack}?user=carol"),
            ack,
            &[],
            Some(body.as_bytes()),
            status,
            Some(code),
        )
        .await;
    }
    expect(
        &mut api,
        &d,
        "POST",
        ack,
        ack,
        &[],
        Some(b"{\"seq\":1}"),
        401,
        Some("unauthorized"),
    )
    .await;

    // ---- GET /v1/ws: refusals, then frames both ways ----
    let ws = "/v1/ws";
    expect(
        &mut api,
        &d,
        "GET",
        &format!("{ws}?user=bob"),
        ws,
        &[],
        None,
        400,
        Some("bad_request"),
    )
    .await;
    for (q, code) in [
        ("", "unauthorized"),
        (&*format!("token={}", encode(&forged)), "unauthorized"),
    ] {
        let (status, ct, body) = upgrade(&d, q).await.expect_err("refused");
        api.check("GET", ws, status, ct.as_deref(), &body);
        assert_eq!(
            (
                status,
                serde_json::from_str::<Value>(&body).unwrap()["error"]["code"].clone()
            ),
            (401, json!(code))
        );
    }
    let mut crowd = Vec::new();
    for _ in 0..3 {
        crowd.push(
            upgrade(&d, "user=crowd")
                .await
                .expect("within the per-user limit"),
        );
    }
    let (status, ct, body) = upgrade(&d, "user=crowd")
        .await
        .expect_err("over the per-user limit");
    api.check("GET", ws, status, ct.as_deref(), &body);
    assert_eq!(status, 429, "{body}");
    drop(crowd);

    let mut seen = BTreeSet::new();
    let mut a = upgrade(&d, "user=alice").await.expect("alice");
    api.check("GET", ws, 101, None, "");
    let mut b = upgrade(
        &d,
        &format!(
            "token={}",
            encode(&token::sign(SECRET, "dave", now_unix() + 60))
        ),
    )
    .await
    .expect("dave");
    let ready = next_frame(&mut a, &frames, &mut seen, |v| v["type"] == "ready").await;
    assert_eq!(ready["user"], "alice");
    next_frame(&mut b, &frames, &mut seen, |v| v["type"] == "ready").await;
    let good = [
        json!({"type": "send", "id": "w-1", "to": ["dave"], "body": "over the socket"}),
        json!({"type": "send", "id": "w-2", "to": ["dave", "bob"], "body": "", "extra": "ignored"}),
    ];
    for f in &good {
        assert_valid(&frames, &client_frame, f, "client frame");
        a.send(Message::Text(f.to_string().into())).await.unwrap();
        let id = f["id"].clone();
        let r = next_frame(&mut a, &frames, &mut seen, |v| v["id"] == id).await;
        assert_eq!(r["type"], "send_ack", "{r}");
    }
    let first = next_frame(&mut b, &frames, &mut seen, |v| v["type"] == "deliver").await;
    let last = next_frame(&mut b, &frames, &mut seen, |v| {
        v["type"] == "deliver" && v["body"] == ""
    })
    .await;
    for f in [
        json!({"type": "ack", "seq": first["seq"]}),
        json!({"type": "sync", "after": 0}),
    ] {
        assert_valid(&frames, &client_frame, &f, "client frame");
        b.send(Message::Text(f.to_string().into())).await.unwrap();
    }
    // after the sync the stream restarts above 0: both entries again
    next_frame(&mut b, &frames, &mut seen, |v| {
        v["type"] == "deliver" && v["seq"] == last["seq"]
    })
    .await;
    // refused frames: the server says so, and the schema refuses them too
    let huge_body = "x".repeat(16385);
    for (text, code) in [
        (json!({"type": "hello"}).to_string(), "unknown_type"),
        (
            json!({"type": "send", "id": "e-1", "to": [], "body": ""}).to_string(),
            "bad_request",
        ),
        (
            json!({"type": "send", "id": "e-2", "to": ["dave", "dave"], "body": ""}).to_string(),
            "bad_recipient",
        ),
        (
            json!({"type": "send", "id": "", "to": ["dave"], "body": ""}).to_string(),
            "bad_id",
        ),
        (
            json!({"type": "send", "id": "e-3", "to": ["dave"]}).to_string(),
            "bad_request",
        ),
        (
            json!({"type": "send", "id": "e-4", "to": ["dave"], "body": huge_body}).to_string(),
            "body_too_large",
        ),
        (
            json!({"type": "ack", "seq": -1}).to_string(),
            "seq_out_of_range",
        ),
        (
            json!({"type": "sync", "after": "1"}).to_string(),
            "bad_request",
        ),
        (
            json!({"type": "send", "id": "w-1", "to": ["dave"], "body": "changed"}).to_string(),
            "id_reused",
        ),
    ] {
        let v: Value = serde_json::from_str(&text).unwrap();
        if code != "id_reused" {
            assert_invalid(&frames, &client_frame, &v, "refused frame");
        }
        a.send(Message::Text(text.clone().into())).await.unwrap();
        let e = next_frame(&mut a, &frames, &mut seen, |v| v["type"] == "error").await;
        assert_eq!(e["code"], code, "{text}: {e}");
    }
    a.send(Message::Text("not json".into())).await.unwrap();
    let e = next_frame(&mut a, &frames, &mut seen, |v| v["type"] == "error").await;
    assert_eq!(e["code"], "bad_json");
    assert!(e.get("id").is_none(), "{e}");
    a.send(Message::Binary(vec![1, 2, 3].into())).await.unwrap();
    let e = next_frame(&mut a, &frames, &mut seen, |v| v["type"] == "error").await;
    assert_eq!(e["code"], "bad_request");
    assert_eq!(
        seen,
        ["deliver", "error", "ready", "send_ack"]
            .map(String::from)
            .into_iter()
            .collect()
    );

    // ---- the admin endpoints ----
    // two live nodes in the registry, so that the status lists nodes for the schema to check:
    // one of this build (it says what it reads, ADR-0056) and one whose record does not say
    let mut registry = tidemark_store::redis::dlog::LogStore::connect(&d.core_url)
        .await
        .unwrap();
    for id in ["n-new", "n-old"] {
        registry
            .heartbeat(
                id,
                60_000,
                "ws://127.0.0.1:1/v1/ws",
                "gateway",
                tidemark_store::redis::watermark::Layout::PackedV2,
            )
            .await
            .unwrap();
    }
    let _: i64 = redis::cmd("HDEL")
        .arg("{tidemark}:node:n-old")
        .arg("reads")
        .query_async(
            &mut redis::Client::open(d.core_url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    let st = "/v1/admin/status";
    for h in [&[][..], &admin_h[..]] {
        let body = expect(&mut api, &d, "GET", st, st, h, None, 200, None).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        let reads: Vec<&Value> = v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| &n["reads"])
            .collect();
        assert_eq!(reads, [&json!(3), &Value::Null], "{v}");
        assert_eq!(v["shard_count"], gateway_support::SHARDS);
        assert_eq!(
            v["shards"].as_array().unwrap().len(),
            gateway_support::SHARDS as usize
        );
        for s in v["shards"].as_array().unwrap() {
            assert_eq!(s["lanes"].as_array().unwrap().len(), 64, "{s}");
            assert_eq!(s["blob_bytes"], 19, "{s}");
        }
    }
    expect(
        &mut api,
        &d,
        "GET",
        st,
        st,
        &user_h,
        None,
        403,
        Some("forbidden"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "GET",
        &format!("{st}?user=alice"),
        st,
        &user_h,
        None,
        403,
        Some("forbidden"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "GET",
        st,
        st,
        &forged_h,
        None,
        401,
        Some("unauthorized"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "GET",
        st,
        st,
        &expired_h,
        None,
        401,
        Some("token_expired"),
    )
    .await;
    let stream = "/v1/admin/status/stream";
    expect(
        &mut api,
        &d,
        "GET",
        stream,
        stream,
        &user_h,
        None,
        403,
        Some("forbidden"),
    )
    .await;
    expect(
        &mut api,
        &d,
        "GET",
        stream,
        stream,
        &forged_h,
        None,
        401,
        Some("unauthorized"),
    )
    .await;
    let (head, events) = sse_events(&d, stream, &admin_h, 2).await;
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    api.check(
        "GET",
        stream,
        status,
        header_value(&head, "content-type"),
        "",
    );
    let schema = resolve(&api.doc, "#/components/schemas/AdminStatus").clone();
    for (event, data) in &events {
        assert_eq!(event, "status");
        assert_valid(
            &api.doc,
            &schema,
            &serde_json::from_str(data).unwrap(),
            "status event",
        );
    }
    let second: Value = serde_json::from_str(&events[1].1).unwrap();
    assert!(
        second["window_ms"].as_u64().unwrap() >= 500,
        "rates over a window: {second}"
    );
    assert!(second["shards"][0]["commits_per_s"].is_number(), "{second}");

    // ---- static files and operator endpoints ----
    for (path, template) in [
        ("/", "/"),
        ("/ops", "/ops"),
        ("/console/console.js", "/console/{file}"),
        ("/console/ops.js", "/console/{file}"),
        ("/console/ops-view.js", "/console/{file}"),
        ("/console/style.css", "/console/{file}"),
        ("/v1/client.js", "/v1/client.js"),
        ("/metrics", "/metrics"),
    ] {
        let (status, head, _) = call(&mut api, &d, "GET", path, template, &[], None).await;
        assert_eq!(status, 200, "{path}");
        if path == "/" || path == "/ops" {
            let csp = header_value(&head, "content-security-policy").expect("a CSP");
            assert!(
                csp.contains("script-src 'self'") && !csp.contains("unsafe"),
                "{csp}"
            );
        }
    }
    expect(
        &mut api,
        &d,
        "GET",
        "/console/nope.js",
        "/console/{file}",
        &[],
        None,
        404,
        Some("not_found"),
    )
    .await;
    for (path, file) in [
        ("/v1/openapi.yaml", "docs/openapi.yaml"),
        ("/v1/ws-frames.schema.json", "docs/ws-frames.schema.json"),
    ] {
        let body = expect(&mut api, &d, "GET", path, path, &[], None, 200, None).await;
        assert_eq!(body, repo_file(file), "{path} serves the repository's file");
    }
    poll("a healthy gateway", || async {
        let (status, _, _) = http_full(d.addr, "GET", "/healthz", &[], None).await;
        (status == 200).then_some(())
    })
    .await;
    call(&mut api, &d, "GET", "/healthz", "/healthz", &[], None).await;

    // ---- every documented answer seen, or listed as not triggered ----
    let not_triggered: BTreeSet<(String, String, String)> = NOT_TRIGGERED
        .iter()
        .map(|(m, p, s, _)| (m.to_string(), p.to_string(), s.to_string()))
        .collect();
    let documented = api.documented();
    assert!(
        not_triggered.is_subset(&documented),
        "NOT_TRIGGERED lists undocumented answers: {:?}",
        not_triggered.difference(&documented).collect::<Vec<_>>()
    );
    assert!(
        api.seen.is_disjoint(&not_triggered),
        "seen after all, remove from NOT_TRIGGERED: {:?}",
        api.seen.intersection(&not_triggered).collect::<Vec<_>>()
    );
    let missing: Vec<_> = documented
        .difference(&api.seen)
        .filter(|t| !not_triggered.contains(*t))
        .collect();
    assert!(missing.is_empty(), "documented, never seen: {missing:?}");
}

/// Fails the chunk writes of one lane while `on`.
struct HoldLane {
    shard: u32,
    lane: usize,
    on: std::sync::atomic::AtomicBool,
}

impl tidemark_server::materializer::ChunkFault for HoldLane {
    fn fail(&self, shard: u32, _offset: u64, lane: usize, _attempt: u32) -> bool {
        shard == self.shard
            && lane == self.lane
            && self.on.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// `GET /v1/admin/status` of a shard one of whose lanes is held behind: `diverged`, the
/// 1216-byte blob, the lanes' W apart, the lag; then, the lane released, back to 19 bytes.
/// Every answer valid against the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_status_shows_diverged_lanes() {
    use std::sync::atomic::Ordering;
    let bob = gateway_support::route("bob");
    let n = (0..)
        .map(|i| format!("n{i}"))
        .find(|u| {
            let r = gateway_support::route(u);
            r.shard == bob.shard && r.lane != bob.lane
        })
        .unwrap();
    let nl = gateway_support::route(&n).lane;
    let fault = std::sync::Arc::new(HoldLane {
        shard: bob.shard,
        lane: bob.lane,
        on: true.into(),
    });
    let opts = tidemark_server::materializer::MaterializerOptions {
        fault: Some(fault.clone()),
        // lanes diverge on the chunked path only (ADR-0048)
        hot_recipients: 1,
        ..Default::default()
    };
    let d = gateway_support::start_full(|_| {}, opts).await;
    let api = openapi();
    let schema = resolve(&api.doc, "#/components/schemas/AdminStatus").clone();
    let body = json!({"id": "d-1", "to": ["bob", n], "body": "two lanes"}).to_string();
    let (status, reply) = d.post_message("alice", body.as_bytes()).await;
    assert_eq!(status, 200, "{reply}");
    let shard = |v: &Value| v["shards"][bob.shard as usize].clone();
    let status_now = || async {
        let (status, v) = d.get("/v1/admin/status").await;
        assert_eq!(status, 200, "{v}");
        assert_valid(&api.doc, &schema, &v, "admin status");
        v
    };
    let held = poll("the neighbour's lane ahead of bob's", || async {
        let s = shard(&status_now().await);
        (s["lanes"][nl] == 1).then_some(s)
    })
    .await;
    assert_eq!(held["lanes"][bob.lane], 0, "{held}");
    assert_eq!(
        (
            &held["diverged"],
            &held["blob_bytes"],
            &held["w_min"],
            &held["w_max"],
            &held["lag"]
        ),
        (&json!(true), &json!(1216), &json!(0), &json!(1), &json!(1)),
        "{held}"
    );
    fault.on.store(false, Ordering::SeqCst);
    let met = poll("the lanes meeting again", || async {
        let s = shard(&status_now().await);
        (s["diverged"] == false && s["w_min"] == 1).then_some(s)
    })
    .await;
    assert_eq!(
        (&met["blob_bytes"], &met["lag"]),
        (&json!(19), &json!(0)),
        "{met}"
    );
}
