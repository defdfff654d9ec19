//! Shared by the tests that run `tidemark serve` as a child process.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// Spawns `cmd` so that it is SIGKILLed when the test process dies (PR_SET_PDEATHSIG), even if
/// the test panics before its drop handlers run.
pub fn spawn_killed_with_us(cmd: &mut Command) -> Child {
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().expect("spawn tidemark")
}

/// `GET path` on 127.0.0.1:`port` (HTTP/1.1, connection close): (status, body); status 0 when
/// nothing answered.
#[allow(dead_code)]
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    http_request(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
}

/// Writes a raw request to 127.0.0.1:`port` and reads the answer to the end: (status, body).
#[allow(dead_code)]
fn http_request(port: u16, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    if s.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Arguments of `tidemark serve` with dev auth: `mailbox` may list several URLs
/// (comma-separated).
#[allow(dead_code)]
pub fn serve_args(core: &str, mailbox: &str, shards: u32, listen: &str) -> Vec<String> {
    [
        "serve",
        "--core",
        core,
        "--mailbox",
        mailbox,
        "--shards",
        &shards.to_string(),
        "--listen",
        listen,
        "--dev-auth",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Spawns `tidemark` with `args`, quiet (`RUST_LOG=error`, output discarded), killed with us.
#[allow(dead_code)]
pub fn spawn_quiet(args: &[String]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(args)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    spawn_killed_with_us(&mut cmd)
}

/// Waits (at most 30 s) until `GET /healthz` on `port` answers 200.
#[allow(dead_code)]
pub async fn wait_healthy(port: u16) {
    let start = std::time::Instant::now();
    while http_get(port, "/healthz").0 != 200 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "serve on {port} did not become healthy"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `POST path` with a JSON `body` on 127.0.0.1:`port`: (status, body).
#[allow(dead_code)]
pub fn http_post(port: u16, path: &str, body: &str) -> (u16, String) {
    http_request(
        port,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// The lines `child` writes to its (piped) stdout, as they come, read by a thread of their own.
#[allow(dead_code)]
pub fn stdout_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().expect("stdout is piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Where `user` lives in a deployment of `shards` shards (one instance of each kind; the
/// instances do not change a shard or lane).
#[allow(dead_code)]
pub fn route(user: &str, shards: u32) -> tidemark_store::topology::Route {
    use tidemark_store::{redis::watermark::Layout, topology::Topology};
    let t = Topology::single(shards, Layout::PackedV2, "", "");
    t.validate().expect("topology").route(user)
}
