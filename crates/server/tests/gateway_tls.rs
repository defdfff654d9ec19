//! TLS on the gateway's listener and the admin listener (issue 9 items 10 and 11; ADR-0027),
//! against the real service (`run::serve`, real redis-servers, real sockets): a self-signed
//! certificate made here (rcgen), a WebSocket client over rustls sending and receiving over
//! `wss://`, `https://` requests, a plain-HTTP request to the TLS port, handshakes that stall,
//! the connection cap, and `/metrics` + `/healthz` moved to `--admin-listen`.

mod gateway_support;
mod tls_support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use gateway_support::{http_at, request_on, serve_options, Service};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tidemark_server::gateway::{GatewayOptions, TlsConfig};
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run;
use tls_support::{client_config, self_signed, TlsFiles};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

/// Bound of every single wait.
const WAIT: Duration = Duration::from_secs(10);

/// The names of the test certificate.
const NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

/// A TLS client that trusts only `ca`.
fn connector(ca: &CertificateDer<'static>) -> TlsConnector {
    TlsConnector::from(client_config(ca))
}

/// A TLS connection to the gateway at `addr`, verified as `localhost`.
async fn tls_connect(
    addr: SocketAddr,
    tls: &TlsConnector,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(WAIT, tls.connect(name, tcp))
        .await
        .expect("TLS handshake timed out")
        .expect("TLS handshake")
}

/// One HTTPS request (`Connection: close`): (status, body); status 0: no HTTP response.
async fn https(
    addr: SocketAddr,
    tls: &TlsConnector,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    let io = tls_connect(addr, tls).await;
    request_on(io, "localhost", method, path, &[], body.map(str::as_bytes)).await
}

/// One plain HTTP request (`Connection: close`): (status, body); status 0: no HTTP response.
async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    http_at(addr, method, path, &[], None).await
}

/// The service with `tweak`ed gateway options (dev auth on, a 200 ms re-check).
async fn start(tweak: impl FnOnce(&mut GatewayOptions)) -> Service {
    let materializer = MaterializerOptions {
        block: Duration::from_millis(50),
        ..Default::default()
    };
    let mut gateway = GatewayOptions {
        dev_auth: true,
        recheck_interval: None,
        ..Default::default()
    };
    tweak(&mut gateway);
    Service::start(gateway, materializer).await
}

/// Reads text frames from `ws` until one of `kind` arrives.
async fn recv_type<S>(ws: &mut tokio_tungstenite::WebSocketStream<S>, kind: &str) -> Value
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {kind} frame"))
            .expect("socket ended")
            .expect("socket error");
        if let Message::Text(t) = msg {
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["type"] == kind {
                return v;
            }
        }
    }
}

/// A `wss://` WebSocket for dev user `user`.
async fn wss(
    addr: SocketAddr,
    tls: &TlsConnector,
    user: &str,
) -> tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>> {
    let stream = tls_connect(addr, tls).await;
    let req = format!("wss://localhost:{}/v1/ws?user={user}", addr.port())
        .into_client_request()
        .unwrap();
    let (ws, resp) = tokio::time::timeout(WAIT, tokio_tungstenite::client_async(req, stream))
        .await
        .expect("upgrade timed out")
        .expect("upgrade");
    assert_eq!(resp.status().as_u16(), 101);
    ws
}

/// Waits until `GET /healthz` answers 200 through `get`.
async fn wait_healthy<F, Fut>(mut get: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (u16, String)>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body) = get().await;
        if status == 200 {
            assert_eq!(body, "ok");
            return;
        }
        assert!(Instant::now() < deadline, "never healthy: {status} {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wss_and_https_are_served_on_one_tls_listener() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = self_signed(dir.path(), &NAMES);
    let tls_config = TlsConfig::from_pem_files(&cert, &key).expect("load cert and key");
    let svc = start(|o| o.tls = Some(tls_config)).await;
    let addr = svc.running().addr;
    assert_eq!(
        svc.running().ws_url(),
        format!("wss://{addr}/v1/ws"),
        "the printed URL says wss"
    );
    let tls = connector(&ca);

    // https: /healthz, then every client endpoint
    wait_healthy(|| https(addr, &tls, "GET", "/healthz", None)).await;
    let (status, metrics) = https(addr, &tls, "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("tidemark_"), "{metrics}");

    // wss: bob listens, alice sends; bob receives it
    let mut bob = wss(addr, &tls, "bob").await;
    assert_eq!(recv_type(&mut bob, "ready").await["user"], "bob");
    let mut alice = wss(addr, &tls, "alice").await;
    recv_type(&mut alice, "ready").await;
    let send = json!({"type": "send", "id": "c-1", "to": ["bob"], "body": "over tls"});
    alice
        .send(Message::Text(send.to_string().into()))
        .await
        .unwrap();
    let ack = recv_type(&mut alice, "send_ack").await;
    assert_eq!(ack["id"], "c-1");
    let d = recv_type(&mut bob, "deliver").await;
    assert_eq!(d["from"], "alice");
    assert_eq!(d["body"], "over tls");
    let seq = d["seq"].as_u64().unwrap();
    bob.send(Message::Text(
        json!({"type": "ack", "seq": seq}).to_string().into(),
    ))
    .await
    .unwrap();

    let body = json!({"id": "h-1", "to": ["carol"], "body": "by https"}).to_string();
    let (status, sent) = https(addr, &tls, "POST", "/v1/messages?user=alice", Some(&body)).await;
    assert_eq!(status, 200, "{sent}");
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, page) = https(addr, &tls, "GET", "/v1/mailbox?user=carol", None).await;
        assert_eq!(status, 200, "{page}");
        let page: Value = serde_json::from_str(&page).unwrap();
        if let Some(e) = page["entries"].as_array().and_then(|a| a.first()) {
            assert_eq!(e["body"], "by https");
            let ack = json!({"seq": e["seq"]}).to_string();
            let (status, acked) =
                https(addr, &tls, "POST", "/v1/mailbox/ack?user=carol", Some(&ack)).await;
            assert_eq!(status, 200, "{acked}");
            break;
        }
        assert!(Instant::now() < deadline, "carol's entry never appeared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // plain HTTP on the TLS port: no HTTP answer, the connection is closed at once
    let started = Instant::now();
    let (status, got) = http(addr, "GET", "/healthz").await;
    assert_eq!(status, 0, "plain HTTP was answered: {got:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    // a client that does not trust the certificate fails its handshake; the gateway goes on
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let untrusting = connector(other.cert.der());
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    assert!(untrusting.connect(name, tcp).await.is_err());
    let (status, _) = https(addr, &tls, "GET", "/healthz", None).await;
    assert_eq!(status, 200);

    drop((alice, bob));
    svc.stop().await;
}

/// The header-read (and handshake) timeout of the handshake test: the sockets that never
/// send a ClientHello are closed after it.
const SILENT_TIMEOUT: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_handshakes_run_per_connection_with_a_timeout_and_count_against_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = self_signed(dir.path(), &NAMES);
    let tls_config = TlsConfig::from_pem_files(&cert, &key).unwrap();
    let svc = start(|o| {
        o.tls = Some(tls_config);
        o.header_read_timeout = SILENT_TIMEOUT;
        o.max_connections = 3;
        o.health_reserve = 0;
    })
    .await;
    let addr = svc.running().addr;
    let tls = connector(&ca);
    wait_healthy(|| https(addr, &tls, "GET", "/healthz", None)).await;

    // two sockets that never send a ClientHello: accept goes on, a TLS request is answered
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let (status, _) = https(addr, &tls, "GET", "/healthz", None).await;
    assert_eq!(status, 200);
    // answered while the silent sockets still wait out their timeout, not after it (the
    // margin is wide: on a loaded box a handshake alone has taken a few hundred ms)
    assert!(
        started.elapsed() < SILENT_TIMEOUT - Duration::from_millis(500),
        "took {:?}",
        started.elapsed()
    );

    // with them and one open TLS connection the cap (3) is full: the next TLS client gets
    // a 503 `overloaded` inside TLS
    let held = tls_connect(addr, &tls).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = https(addr, &tls, "GET", "/healthz", None).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("overloaded"), "{body}");

    // the silent sockets are closed once the header-read timeout passes…
    for mut s in silent {
        let mut b = [0u8; 16];
        let r = tokio::time::timeout(SILENT_TIMEOUT + Duration::from_secs(3), s.read(&mut b)).await;
        assert!(
            matches!(r, Ok(Ok(0)) | Ok(Err(_))),
            "a silent socket was not closed"
        );
    }
    drop(held);
    // …which frees their slots
    wait_healthy(|| https(addr, &tls, "GET", "/healthz", None)).await;
    let (_, metrics) = https(addr, &tls, "GET", "/metrics", None).await;
    let failures = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tidemark_tls_handshake_failures_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(failures >= 2.0, "{failures}");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_takes_metrics_and_healthz_off_the_public_one() {
    let svc = start(|o| o.admin_listen = Some("127.0.0.1:0".parse().unwrap())).await;
    let (addr, admin) = (svc.running().addr, svc.running().admin_addr.expect("admin"));
    assert_ne!(addr, admin);
    assert_eq!(svc.running().admin_url(), format!("http://{admin}"));

    // the admin listener: /healthz and /metrics, no auth; nothing else
    wait_healthy(|| http(admin, "GET", "/healthz")).await;
    let (status, metrics) = http(admin, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("tidemark_"), "{metrics}");
    for path in ["/v1/mailbox?user=bob", "/v1/ws?user=bob", "/"] {
        let (status, body) = http(admin, "GET", path).await;
        assert_eq!(status, 404, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "not_found", "{path}: {body}");
    }

    // the public listener: like any unknown path (the JSON error body): 401 without
    // credentials, 404 with them; the client endpoints as before
    for path in ["/healthz", "/metrics"] {
        let (status, body) = http(addr, "GET", path).await;
        assert_eq!(status, 401, "{path}: {body}");
        let (status, body) = http(addr, "GET", &format!("{path}?user=bob")).await;
        assert_eq!(status, 404, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "not_found", "{path}: {body}");
    }
    let (status, page) = http(addr, "GET", "/v1/mailbox?user=bob").await;
    assert_eq!(status, 200, "{page}");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_listener_metrics_and_healthz_stay_on_the_gateway() {
    let svc = start(|_| {}).await;
    let addr = svc.running().addr;
    assert_eq!(svc.running().admin_addr, None);
    assert_eq!(svc.running().admin_url(), format!("http://{addr}"));
    assert_eq!(svc.running().ws_url(), format!("ws://{addr}/v1/ws"));
    wait_healthy(|| http(addr, "GET", "/healthz")).await;
    let (status, metrics) = http(addr, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("tidemark_"), "{metrics}");
    svc.stop().await;
}

#[test]
fn unusable_certificate_or_key_files_are_refused_naming_the_file() {
    let files = TlsFiles::new(&NAMES, "not a pem file\n");
    let (cert, key, other_key) = (&files.cert, &files.key, &files.other_key);
    let (missing, garbage) = (&files.missing, &files.garbage);
    let broken = files.dir.path().join("broken.pem");
    std::fs::write(
        &broken,
        "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();

    let refused = |c: &Path, k: &Path| TlsConfig::from_pem_files(c, k).unwrap_err();
    let cases = [
        (refused(missing, key), "tls_unreadable", missing),
        (refused(cert, missing), "tls_unreadable", missing),
        (refused(garbage, key), "tls_bad_pem", garbage),
        (refused(&broken, key), "tls_bad_pem", &broken),
        (refused(cert, garbage), "tls_bad_pem", garbage),
        // a key is not a certificate, and a certificate is not a key
        (refused(key, key), "tls_bad_pem", key),
        (refused(cert, cert), "tls_bad_pem", cert),
        (refused(cert, other_key), "tls_key_mismatch", other_key),
    ];
    for (e, code, file) in cases {
        let text = e.to_string();
        assert_eq!(e.code(), code, "{text}");
        assert!(text.contains(&file.display().to_string()), "{text}");
    }
    assert!(TlsConfig::from_pem_files(cert, key).is_ok());
}

#[tokio::test]
async fn an_admin_address_that_cannot_be_bound_stops_the_start() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap();
    // no Redis behind these URLs: the listeners are bound before any Redis is asked
    let nowhere = "redis://127.0.0.1:1/".to_string();
    let gateway = GatewayOptions {
        dev_auth: true,
        admin_listen: Some(addr),
        ..Default::default()
    };
    let opts = serve_options(
        nowhere.clone(),
        nowhere,
        gateway,
        MaterializerOptions::default(),
    );
    let r = run::serve(opts, CancellationToken::new()).await;
    match r {
        Err(e @ run::Error::Listen { .. }) => {
            assert_eq!(e.code(), "listen");
            assert!(e.to_string().contains(&addr.to_string()), "{e}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("started on a taken admin address"),
    }
}
