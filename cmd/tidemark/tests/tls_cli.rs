//! `--tls-cert`/`--tls-key` and `--admin-listen` of the `tidemark` binary (issue 9 items 10
//! and 11; ADR-0027), run as a real process: unusable certificate or key files are refused
//! with exit 2 before anything starts, `up` serves `wss://`/`https://` on its listener, and
//! with `--admin-listen` `/healthz`/`/metrics` on the admin address only.

mod support;
#[path = "../../../crates/server/tests/tls_support/mod.rs"]
mod tls_support;

use std::time::{Duration, Instant};

use support::{exchange, free_port, http_get, run, serve_cmd, UpProc};
use tls_support::{client_config, TlsFiles};

#[test]
fn unusable_tls_files_are_refused_before_anything_starts() {
    let files = TlsFiles::new(&["localhost"], "hello\n");
    let TlsFiles {
        cert,
        key,
        other_key,
        missing,
        garbage,
        ..
    } = &files;
    // no Redis behind this: a serve that got past the TLS files would fail with exit 1
    let core = format!("redis://127.0.0.1:{}/", free_port());
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let data = files.dir.path().join("data");
    for (c, k, named) in [
        (missing, key, missing),
        (cert, missing, missing),
        (garbage, key, garbage),
        (cert, garbage, garbage),
        (cert, other_key, other_key),
    ] {
        let tls = [
            "--tls-cert",
            c.to_str().unwrap(),
            "--tls-key",
            k.to_str().unwrap(),
        ];
        let serve = run(serve_cmd(&core, &core)
            .args(["--listen", &listen, "--dev-auth"])
            .args(tls));
        let up = run(support::cli()
            .args(["up", "--dev-auth", "--listen", &listen, "--data-dir"])
            .arg(&data)
            .args(tls));
        for (what, o) in [("serve", serve), ("up", up)] {
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{what} {c:?} {k:?}: {err}");
            assert!(err.starts_with("error: TLS "), "{what}: {err}");
            assert!(
                err.contains(&named.display().to_string()),
                "{what}: the message does not name {named:?}: {err}"
            );
        }
        assert!(!data.exists(), "up created its data dir");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    }
    // one without the other is a usage error
    let o = run(serve_cmd(&core, &core)
        .args(["--dev-auth", "--tls-cert"])
        .arg(cert));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--tls-key"));
}

/// One `GET path` over TLS to 127.0.0.1:`port` (verified as `localhost` against `ca`):
/// (status, body).
fn https_get(
    port: u16,
    ca: &rustls::pki_types::CertificateDer<'static>,
    path: &str,
) -> (u16, String) {
    https_request(
        port,
        ca,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    )
}

/// `POST path` with a JSON `body` over TLS to 127.0.0.1:`port`: (status, body).
fn https_post(
    port: u16,
    ca: &rustls::pki_types::CertificateDer<'static>,
    path: &str,
    body: &str,
) -> (u16, String) {
    https_request(
        port,
        ca,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// Writes `request` over TLS to 127.0.0.1:`port` (verified as `localhost` against `ca`) and
/// reads the answer: (status, body); status 0 when nothing answered.
fn https_request(
    port: u16,
    ca: &rustls::pki_types::CertificateDer<'static>,
    request: &str,
) -> (u16, String) {
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(client_config(ca), name).unwrap();
    let Ok(tcp) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let tls = rustls::StreamOwned::new(conn, tcp);
    exchange(tls, request)
}

/// `tidemark up` with dev auth, serving TLS with `files`; `extra` arguments after.
fn up_tls(files: &TlsFiles, extra: &[&str]) -> UpProc {
    let (cert, key) = (files.cert.to_str().unwrap(), files.key.to_str().unwrap());
    let mut args = vec!["--dev-auth", "--tls-cert", cert, "--tls-key", key];
    args.extend(extra);
    UpProc::start(&files.dir.path().join("data"), &args)
}

/// Waits (at most 30 s) until `get` answers 200.
fn wait_200(mut get: impl FnMut() -> u16) {
    let start = Instant::now();
    while get() != 200 {
        assert!(start.elapsed() < Duration::from_secs(30), "never healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn up_serves_tls() {
    let files = TlsFiles::new(&["localhost"], "");
    let up = up_tls(&files, &[]);
    let gateway = up.line("gateway");
    assert!(gateway.contains("wss://127.0.0.1:"), "{gateway}");
    let port = up.port("gateway");

    // https: /healthz and a client endpoint
    wait_200(|| https_get(port, &files.ca, "/healthz").0);
    let (status, body) = https_get(port, &files.ca, "/v1/mailbox?user=bob");
    assert_eq!(status, 200, "{body}");
    // plain HTTP to the TLS port gets no HTTP answer
    assert_eq!(http_get(port, "/healthz").0, 0);
    up.stop();
}

#[test]
fn up_serves_metrics_and_healthz_on_the_admin_listener_only() {
    let files = TlsFiles::new(&["localhost"], "");
    let up = up_tls(&files, &["--admin-listen", "127.0.0.1:0"]);
    let gateway = up.line("gateway");
    assert!(gateway.contains("wss://127.0.0.1:"), "{gateway}");
    let admin = up.line("admin");
    assert!(admin.contains("http://127.0.0.1:"), "{admin}");
    let (port, admin_port) = (up.port("gateway"), up.port("admin"));

    // /healthz and /metrics on the admin listener (plain HTTP, no auth)…
    wait_200(|| http_get(admin_port, "/healthz").0);
    assert_eq!(http_get(admin_port, "/metrics").0, 200);
    assert_eq!(http_get(admin_port, "/v1/mailbox?user=bob").0, 404);
    // …not on the TLS listener, which answers the client endpoints over https
    // (like any path it does not serve: 401 without credentials, 404 with them)
    for path in ["/healthz", "/metrics"] {
        let (status, body) = https_get(port, &files.ca, path);
        assert_eq!(status, 401, "{path}: {body}");
        let (status, body) = https_get(port, &files.ca, &format!("{path}?user=bob"));
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body.contains("not_found"), "{path}: {body}");
    }
    let (status, body) = https_get(port, &files.ca, "/v1/mailbox?user=bob");
    assert_eq!(status, 200, "{body}");
    up.stop();
}

/// `up --nodes 3 --tls-cert … --tls-key … --admin-listen …`: every node serves `wss://` and
/// `https://` with the same certificate on consecutive ports, and `/healthz`/`/metrics` on its
/// own admin listener (consecutive ports too, each printed); a message sent over https through
/// one node is read over https through another. Port 0 or overlapping ranges are refused
/// before anything starts.
#[test]
fn up_with_three_nodes_serves_tls_and_an_admin_listener_each() {
    let files = TlsFiles::new(&["localhost"], "");
    let (cert, key) = (files.cert.to_str().unwrap(), files.key.to_str().unwrap());
    let data = files.dir.path().join("data");
    // refused before anything starts: port 0 with several nodes, overlapping ranges
    let gateways = support::nodes::consecutive_node_ports(3);
    let admins = support::nodes::consecutive_node_ports(3);
    let listen = format!("127.0.0.1:{}", gateways[0]);
    let admin_listen = format!("127.0.0.1:{}", admins[0]);
    let overlapping = format!("127.0.0.1:{}", gateways[2]);
    for (listen, admin, says) in [
        ("127.0.0.1:0", admin_listen.as_str(), "not 0"),
        (listen.as_str(), "127.0.0.1:0", "not 0"),
        (listen.as_str(), overlapping.as_str(), "overlap"),
    ] {
        let o = run(support::cli()
            .args(["up", "--nodes", "3", "--dev-auth", "--listen", listen])
            .args([
                "--admin-listen",
                admin,
                "--tls-cert",
                cert,
                "--tls-key",
                key,
            ])
            .arg("--data-dir")
            .arg(&data));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{listen} {admin}: {err}");
        assert!(err.contains(says), "{listen} {admin}: {err}");
        assert!(!data.exists(), "up created its data dir");
    }

    let up = UpProc::start_in(
        std::path::Path::new("."),
        &listen,
        &data,
        &[
            "--nodes",
            "3",
            "--dev-auth",
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--admin-listen",
            &admin_listen,
        ],
    );
    // every node and its admin listener printed
    assert!(up.line("gateway").contains(&format!("wss://{listen}/")));
    for i in 1..3 {
        let node = up.containing(&format!("node     up-{i} "));
        assert!(
            node.contains(&format!("wss://127.0.0.1:{}/v1/ws", gateways[i])),
            "{node}"
        );
        let admin = up.containing(&format!("admin    up-{i} "));
        assert!(
            admin.contains(&format!("http://127.0.0.1:{}", admins[i])),
            "{admin}"
        );
    }
    assert_eq!(up.port("admin"), admins[0]);
    for i in 0..3 {
        // /healthz on the admin listener (plain HTTP), once the node owns its shards
        wait_200(|| http_get(admins[i], "/healthz").0);
        assert_eq!(http_get(admins[i], "/metrics").0, 200);
        // the gateway: TLS only, the client endpoints only
        assert_eq!(http_get(gateways[i], "/v1/mailbox?user=bob").0, 0);
        assert_eq!(
            https_get(gateways[i], &files.ca, "/healthz?user=bob").0,
            404
        );
        let (status, body) = https_get(gateways[i], &files.ca, "/v1/mailbox?user=bob");
        assert_eq!(status, 200, "node {i}: {body}");
    }
    // sent through up-1, read through up-2
    let (status, body) = https_post(
        gateways[1],
        &files.ca,
        "/v1/messages?user=alice",
        r#"{"id":"tls-nodes-1","to":["bob"],"body":"over tls"}"#,
    );
    assert_eq!(status, 200, "{body}");
    let start = Instant::now();
    loop {
        let (status, body) = https_get(gateways[2], &files.ca, "/v1/mailbox?user=bob");
        assert_eq!(status, 200, "{body}");
        if body.contains("over tls") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not delivered: {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Ctrl-C in a terminal: every node stops, and `up` does not report that as a node lost
    // (ADR-0065)
    let said = up.interrupt_group();
    assert!(!said.contains("node process exited"), "{said}");
}
