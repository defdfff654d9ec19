//! A small W3C WebDriver client for the browser tests: `chromedriver` (Debian's
//! `chromium-driver`) as a child process on a free loopback port, headless Chromium sessions
//! driven over its HTTP API — plain HTTP/1.1 on a `TcpStream` (one connection per command)
//! and serde_json, blocking. Only what the tests use: navigate, find, click, type, read text,
//! run scripts (sync and async), resize, screenshot, reload.
//!
//! [`Browser::find_installed`] tells whether Chromium and chromedriver are installed
//! (`scripts/install-chromium.sh`); the tests skip with a visible notice when they are not.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use crate::support::{free_port, spawn_killed_with_us};

/// The key WebDriver uses for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The Enter key, for `send_keys`.
pub const ENTER: &str = "\u{E007}";

/// Chromium and chromedriver, found on the PATH (or in /usr/bin).
pub struct Installed {
    pub chromium: PathBuf,
    pub chromedriver: PathBuf,
}

/// One HTTP/1.1 request to chromedriver on 127.0.0.1:`port`: (status, JSON body). Status 0
/// when nothing answered.
fn request(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, Value::Null);
    };
    // an async script may run for a while (the client tests)
    let _ = s.set_read_timeout(Some(Duration::from_secs(300)));
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_err() {
        return (0, Value::Null);
    }
    // chromedriver may keep the connection open: read the head, then the body it announces
    let mut resp = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    let split = loop {
        if let Some(i) = resp.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return (0, Value::Null),
            Ok(n) => resp.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&resp[..split]).to_ascii_lowercase();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let chunked = head.contains("transfer-encoding: chunked");
    let mut payload = resp[split + 4..].to_vec();
    loop {
        let complete = match length {
            Some(n) => payload.len() >= n,
            None if chunked => payload.windows(5).any(|w| w == b"0\r\n\r\n"),
            None => false,
        };
        if complete {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => payload.extend_from_slice(&buf[..n]),
        }
    }
    if let Some(n) = length {
        payload.truncate(n);
    } else if chunked {
        payload = dechunk(&payload);
    }
    (
        status,
        serde_json::from_slice(&payload).unwrap_or(Value::Null),
    )
}

/// The body of a chunked transfer encoding.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || b.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[(eol + 4 + size).min(b.len())..];
    }
    out
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A running chromedriver, killed on drop (its sessions deleted first).
pub struct Browser {
    child: Child,
    port: u16,
    chromium: PathBuf,
    profiles: PathBuf,
    sessions: std::sync::Mutex<Vec<String>>,
}

impl Browser {
    /// Chromium and chromedriver, when both are installed (`TIDEMARK_CHROMIUM` and
    /// `TIDEMARK_CHROMEDRIVER` name other binaries; a path that is no file counts as not
    /// installed).
    pub fn find_installed() -> Option<Installed> {
        let given = |var: &str| std::env::var_os(var).map(PathBuf::from);
        let chromium = match given("TIDEMARK_CHROMIUM") {
            Some(p) => p,
            None => which("chromium").or_else(|| which("chromium-browser"))?,
        };
        let chromedriver = given("TIDEMARK_CHROMEDRIVER").or_else(|| which("chromedriver"))?;
        (chromium.is_file() && chromedriver.is_file()).then_some(Installed {
            chromium,
            chromedriver,
        })
    }

    /// Starts chromedriver on a free port; waits (at most 60 s) until it is ready. Browser
    /// profiles go under `profiles`.
    pub fn start(installed: &Installed, profiles: &Path) -> Browser {
        let port = free_port();
        let mut cmd = Command::new(&installed.chromedriver);
        cmd.arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn_killed_with_us(&mut cmd);
        let b = Browser {
            child,
            port,
            chromium: installed.chromium.clone(),
            profiles: profiles.to_path_buf(),
            sessions: Default::default(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while request(port, "GET", "/status", None).1["value"]["ready"] != true {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        b
    }

    /// A new headless Chromium session with a fresh profile and a `width`×`height` window.
    pub fn session(&self, name: &str, width: u32, height: u32) -> Session {
        let profile = self.profiles.join(name);
        let _ = std::fs::remove_dir_all(&profile);
        std::fs::create_dir_all(&profile).unwrap();
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-quic".into(),
            "--disable-extensions".into(),
            "--hide-scrollbars".into(),
            "--force-device-scale-factor=1".into(),
            "--lang=en-US".into(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", profile.display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": self.chromium, "args": args},
        }}});
        let (_, v) = request(self.port, "POST", "/session", Some(&caps));
        let id = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_string();
        self.sessions.lock().unwrap().push(id.clone());
        let s = Session {
            port: self.port,
            base: format!("/session/{id}"),
            id,
        };
        s.cmd(
            "POST",
            "/timeouts",
            json!({"script": 240_000, "pageLoad": 60_000, "implicit": 0}),
        );
        s
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // delete the sessions (chromedriver quits their browsers), then stop chromedriver
        for id in self.sessions.lock().unwrap().drain(..) {
            let _ = request(self.port, "DELETE", &format!("/session/{id}"), None);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One browser session (one window).
pub struct Session {
    port: u16,
    base: String,
    pub id: String,
}

impl Session {
    /// One WebDriver command; its `value`. Panics on a WebDriver error.
    pub fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        let body = (method == "POST").then_some(&body);
        let (status, v) = request(self.port, method, &format!("{}{path}", self.base), body);
        assert!(
            (200..300).contains(&status),
            "{method} {path}: HTTP {status}: {v}"
        );
        v["value"].clone()
    }

    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", json!({ "url": url }));
    }

    pub fn refresh(&self) {
        self.cmd("POST", "/refresh", json!({}));
    }

    /// The first element matching `css`, if any.
    pub fn try_find(&self, css: &str) -> Option<String> {
        let v = self.cmd(
            "POST",
            "/elements",
            json!({"using": "css selector", "value": css}),
        );
        v.as_array()?.first()?[ELEMENT].as_str().map(str::to_string)
    }

    /// The element `[data-testid="id"]`, waiting for it (at most 30 s).
    pub fn testid(&self, id: &str) -> String {
        let css = format!("[data-testid=\"{id}\"]");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(e) = self.try_find(&css) {
                return e;
            }
            assert!(Instant::now() < deadline, "no element {css}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn click(&self, el: &str) {
        self.cmd("POST", &format!("/element/{el}/click"), json!({}));
    }

    pub fn clear(&self, el: &str) {
        self.cmd("POST", &format!("/element/{el}/clear"), json!({}));
    }

    /// Types `text` into `el` (keys, as a user would; [`ENTER`] presses Enter).
    pub fn send_keys(&self, el: &str, text: &str) {
        self.cmd(
            "POST",
            &format!("/element/{el}/value"),
            json!({ "text": text }),
        );
    }

    pub fn text(&self, el: &str) -> String {
        self.cmd("GET", &format!("/element/{el}/text"), Value::Null)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs `script` (a function body; `arguments` are `args`) and returns its result.
    pub fn exec(&self, script: &str, args: Value) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            json!({"script": script, "args": args}),
        )
    }

    /// Runs `script`, which calls `arguments[arguments.length - 1]` with its result.
    pub fn exec_async(&self, script: &str, args: Value) -> Value {
        self.cmd(
            "POST",
            "/execute/async",
            json!({"script": script, "args": args}),
        )
    }

    pub fn set_window(&self, width: u32, height: u32) {
        self.cmd(
            "POST",
            "/window/rect",
            json!({"width": width, "height": height}),
        );
    }

    /// A PNG of the viewport.
    pub fn screenshot(&self) -> Vec<u8> {
        let b64 = self.cmd("GET", "/screenshot", Value::Null);
        base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().expect("base64 PNG"))
            .expect("screenshot decodes")
    }

    /// Polls `script` (a function body returning a value) every 50 ms until `ok` holds for its
    /// result, at most `secs`; returns that result.
    pub fn until(&self, what: &str, secs: u64, script: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.exec(script, json!([]));
            if ok(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {secs} s: {what} (last: {v})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
