//! `--tls-cert`/`--tls-key` and `--admin-listen` of the `tidemark` binary (issue 9 items 10
//! and 11; ADR-0027), run as a real process: unusable certificate or key files are refused
//! with exit 2 before anything starts, `up` serves `wss://`/`https://` on its listener, and
//! with `--admin-listen` `/healthz`/`/metrics` on the admin address only.

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{http_get, spawn_killed_with_us};

fn tidemark() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.env_remove("TIDEMARK_TOKEN_SECRET")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to completion (at most 60 s).
fn run(cmd: &mut Command) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = spawn_killed_with_us(cmd);
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn free_port() -> u16 {
    tidemark_redis_proc::free_port().unwrap()
}

/// A self-signed certificate for `localhost` as PEM files in `dir`: (cert, key, its DER).
fn self_signed(dir: &Path) -> (PathBuf, PathBuf, rustls::pki_types::CertificateDer<'static>) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key, ck.cert.der().clone())
}

#[test]
fn unusable_tls_files_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, _) = self_signed(dir.path());
    let other = tempfile::tempdir().unwrap();
    let (_, other_key, _) = self_signed(other.path());
    let missing = dir.path().join("missing.pem");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "hello\n").unwrap();
    // no Redis behind this: a serve that got past the TLS files would fail with exit 1
    let core = format!("redis://127.0.0.1:{}/", free_port());
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    for (c, k, named) in [
        (&missing, &key, &missing),
        (&cert, &missing, &missing),
        (&garbage, &key, &garbage),
        (&cert, &garbage, &garbage),
        (&cert, &other_key, &other_key),
    ] {
        let tls = [
            "--tls-cert",
            c.to_str().unwrap(),
            "--tls-key",
            k.to_str().unwrap(),
        ];
        let serve = run(tidemark()
            .args([
                "serve",
                "--core",
                &core,
                "--mailbox",
                &core,
                "--shards",
                "1",
            ])
            .args(["--listen", &listen, "--dev-auth"])
            .args(tls));
        let up = run(tidemark()
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
    let o = run(tidemark()
        .args([
            "serve",
            "--core",
            &core,
            "--mailbox",
            &core,
            "--shards",
            "1",
        ])
        .args(["--dev-auth", "--tls-cert"])
        .arg(&cert));
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
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = Vec::new();
    let _ = tls.read_to_end(&mut resp);
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The port of the first URL on `line` ("gateway  wss://127.0.0.1:PORT/v1/ws").
fn port_of(line: &str) -> u16 {
    let url = line.split_whitespace().nth(1).unwrap();
    let hostport = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    hostport.rsplit(':').next().unwrap().parse().unwrap()
}

/// A running `tidemark up --shards 2 --listen 127.0.0.1:0 --dev-auth` child, once it has
/// printed its endpoints.
struct Up {
    child: std::process::Child,
    lines: Vec<String>,
}

impl Up {
    fn start(data: &Path, args: &[&std::ffi::OsStr]) -> Up {
        let mut cmd = tidemark();
        cmd.args([
            "up",
            "--shards",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--dev-auth",
        ])
        .arg("--data-dir")
        .arg(data)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        let mut child = spawn_killed_with_us(&mut cmd);
        let rx = support::stdout_lines(&mut child);
        let mut lines = Vec::new();
        while !lines.iter().any(|l: &String| l.starts_with("Ctrl-C")) {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(l) => lines.push(l),
                Err(_) => panic!("up printed no endpoints: {lines:?}"),
            }
        }
        Up { child, lines }
    }

    /// The printed line starting with `prefix`.
    fn line(&self, prefix: &str) -> &str {
        self.lines
            .iter()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line: {:?}", self.lines))
    }

    /// SIGTERM, then a clean exit within 30 s.
    fn stop(mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "up exited with {status}");
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "up did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
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
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = self_signed(dir.path());
    let tls = [
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        key.as_os_str(),
    ];
    let up = Up::start(&dir.path().join("data"), &tls);
    let gateway = up.line("gateway");
    assert!(gateway.contains("wss://127.0.0.1:"), "{gateway}");
    let port = port_of(gateway);

    // https: /healthz and a client endpoint
    wait_200(|| https_get(port, &ca, "/healthz").0);
    let (status, body) = https_get(port, &ca, "/v1/mailbox?user=bob");
    assert_eq!(status, 200, "{body}");
    // plain HTTP to the TLS port gets no HTTP answer
    assert_eq!(http_get(port, "/healthz").0, 0);
    up.stop();
}

#[test]
fn up_serves_metrics_and_healthz_on_the_admin_listener_only() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = self_signed(dir.path());
    let args = [
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        key.as_os_str(),
        "--admin-listen".as_ref(),
        "127.0.0.1:0".as_ref(),
    ];
    let up = Up::start(&dir.path().join("data"), &args);
    let gateway = up.line("gateway");
    assert!(gateway.contains("wss://127.0.0.1:"), "{gateway}");
    let admin = up.line("admin");
    assert!(admin.contains("http://127.0.0.1:"), "{admin}");
    let (port, admin_port) = (port_of(gateway), port_of(admin));

    // /healthz and /metrics on the admin listener (plain HTTP, no auth)…
    wait_200(|| http_get(admin_port, "/healthz").0);
    assert_eq!(http_get(admin_port, "/metrics").0, 200);
    assert_eq!(http_get(admin_port, "/v1/mailbox?user=bob").0, 404);
    // …not on the TLS listener, which answers the client endpoints over https
    // (like any path it does not serve: 401 without credentials, 404 with them)
    for path in ["/healthz", "/metrics"] {
        let (status, body) = https_get(port, &ca, path);
        assert_eq!(status, 401, "{path}: {body}");
        let (status, body) = https_get(port, &ca, &format!("{path}?user=bob"));
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body.contains("not_found"), "{path}: {body}");
    }
    let (status, body) = https_get(port, &ca, "/v1/mailbox?user=bob");
    assert_eq!(status, 200, "{body}");
    up.stop();
}
