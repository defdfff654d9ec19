//! Shared by the tests that run the `tidemark` binary: its commands run to completion, and
//! `tidemark serve` / `tidemark up` as child processes.

#![allow(dead_code)]

pub mod nodes;

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_redis_proc::{RedisOptions, RedisProcess};

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

/// `tidemark ARGS…` run to completion, its output captured.
pub fn tidemark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(args)
        .output()
        .expect("run tidemark")
}

/// A `tidemark` command that finds no token secret and no token in its environment, logs at
/// `warn` and reads nothing.
pub fn cli() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.env_remove("TIDEMARK_TOKEN_SECRET")
        .env_remove("TIDEMARK_TOKEN")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to completion, its output captured (at most 60 s, then it is killed and the
/// test fails).
pub fn run(cmd: &mut Command) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = spawn_killed_with_us(cmd);
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after 60 s; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`cli`] for `tidemark serve --core CORE --mailbox MAILBOX --shards 1`; the caller adds the
/// rest.
pub fn serve_cmd(core: &str, mailbox: &str) -> Command {
    let mut cmd = cli();
    cmd.args(["serve", "--core", core, "--mailbox", mailbox])
        .args(["--shards", "1"]);
    cmd
}

/// A loopback port nothing listens on (yet).
pub fn free_port() -> u16 {
    tidemark_redis_proc::free_port().unwrap()
}

/// Whether something accepts connections on 127.0.0.1:`port`.
pub fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// A fresh directory `tidemark-NAME-PID` in the system's temporary directory.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tidemark-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `GET path` on 127.0.0.1:`port` (HTTP/1.1, connection close): (status, body); status 0 when
/// nothing answered.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    http_request(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
}

/// `POST path` with a JSON `body` on 127.0.0.1:`port`: (status, body).
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

/// Writes a raw request to 127.0.0.1:`port` and reads the answer to the end: (status, body).
fn http_request(port: u16, request: &str) -> (u16, String) {
    let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    exchange(s, request)
}

/// Writes `request` on `io` and reads the answer to the end: (status, body); status 0 when
/// no HTTP response came back.
pub fn exchange(mut io: impl Read + Write, request: &str) -> (u16, String) {
    if io.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut resp = Vec::new();
    let _ = io.read_to_end(&mut resp);
    let resp = String::from_utf8_lossy(&resp);
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
pub fn spawn_quiet(args: &[String]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    spawn_killed_with_us(&mut cmd)
}

/// Waits (at most 30 s) until `GET /healthz` on `port` answers 200.
pub async fn wait_healthy(port: u16) {
    until(
        &format!("serve on {port} to become healthy"),
        30,
        || async { http_get(port, "/healthz").0 == 200 },
    )
    .await
}

/// A quiet `tidemark serve` (dev auth) on 127.0.0.1:`port`, once `/healthz` answers 200.
pub async fn serve_healthy(core: &str, mailbox: &str, shards: u32, port: u16) -> Child {
    let listen = format!("127.0.0.1:{port}");
    spawn_healthy(&serve_args(core, mailbox, shards, &listen), port).await
}

/// [`spawn_quiet`] for a `tidemark serve` on `port`, once `/healthz` answers 200.
pub async fn spawn_healthy(args: &[String], port: u16) -> Child {
    let child = spawn_quiet(args);
    wait_healthy(port).await;
    child
}

/// Polls `f` (every 50 ms, at most `secs` seconds) until it holds.
pub async fn until<F, Fut>(what: &str, secs: u64, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lines `child` writes to its (piped) stdout, as they come, read by a thread of their own.
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
pub fn route(user: &str, shards: u32) -> tidemark_store::topology::Route {
    use tidemark_store::{redis::watermark::Layout, topology::Topology};
    let t = Topology::single(shards, Layout::PackedV2, "", "");
    t.validate().expect("topology").route(user)
}

/// One command on the Redis at `url` (a connection of its own).
pub fn redis_cmd(url: &str, args: &[&str]) -> redis::Value {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_connection().unwrap();
    redis::cmd(args[0]).arg(&args[1..]).query(&mut c).unwrap()
}

/// The field names of the dispatch log record at `offset` of shard `shard` on the core
/// instance at `url` (`p`, `m` for a packed record; `p`, `f`, `c`, `r`, `b`, `t` for six).
pub fn record_fields(url: &str, shard: u32, offset: u64) -> Vec<String> {
    let id = format!("{offset}-0");
    let v = redis_cmd(
        url,
        &["XRANGE", &tidemark_store::keys::dlog(shard), &id, &id],
    );
    let redis::Value::Array(entries) = &v else {
        panic!("{v:?}")
    };
    let redis::Value::Array(entry) = &entries[0] else {
        panic!("{v:?}")
    };
    let redis::Value::Array(kv) = &entry[1] else {
        panic!("{v:?}")
    };
    kv.iter()
        .step_by(2)
        .map(|k| redis::from_redis_value(k.clone()).unwrap())
        .collect()
}

/// A core and a mailbox `redis-server`, started in that order.
pub fn redis_pair() -> (RedisProcess, RedisProcess) {
    let core = RedisProcess::start().expect("core redis-server");
    (core, RedisProcess::start().expect("mailbox redis-server"))
}

/// redis-server options: the append-only file, fsynced on every write.
pub fn aof_always() -> RedisOptions {
    RedisOptions {
        appendonly: true,
        appendfsync: "always".into(),
        ..Default::default()
    }
}

/// Shard `shard`'s watermark on the mailbox Redis at `url`.
pub async fn watermark(url: &str, shard: u32) -> tidemark_store::redis::watermark::ShardWatermark {
    use tidemark_store::redis::{store::MailboxStore, watermark::Layout};
    let mut st = MailboxStore::connect(url, Layout::PackedV2).await.unwrap();
    st.read_watermark(shard).await.unwrap()
}

/// The mailbox store at `url`, every watermark of shards `0..shards` initialised (packed-v2).
pub async fn init_watermarks(url: &str, shards: u32) -> tidemark_store::redis::store::MailboxStore {
    use tidemark_store::redis::{store::MailboxStore, watermark::Layout};
    let mut st = MailboxStore::connect(url, Layout::PackedV2).await.unwrap();
    for s in 0..shards {
        st.init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap();
    }
    st
}

/// `tidemark trace` of `offset` in `shard` of a `shards`-shard deployment on these instances;
/// `--json` when `json`.
pub fn trace(
    core: &str,
    mailbox: &str,
    shards: u32,
    shard: u32,
    offset: u64,
    json: bool,
) -> Output {
    let (shards, shard, offset) = (shards.to_string(), shard.to_string(), offset.to_string());
    let mut args = vec!["trace", "--core", core, "--mailbox", mailbox];
    args.extend(["--shards", &shards, "--shard", &shard, "--offset", &offset]);
    if json {
        args.push("--json");
    }
    tidemark(&args)
}

/// A `tidemark serve` child process (dev auth), SIGKILLed on drop and on our death, its
/// stderr in a log file.
pub struct Serve {
    pub child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Serve {
    /// `tidemark serve` on 127.0.0.1:`port` for `shards` shards with `extra` arguments,
    /// logging at `rust_log` into `log`.
    pub fn start(
        (core, mailbox, shards): (&str, &str, u32),
        port: u16,
        extra: &[&str],
        rust_log: &str,
        log: PathBuf,
    ) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args(serve_args(
            core,
            mailbox,
            shards,
            &format!("127.0.0.1:{port}"),
        ))
        .args(extra)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        Serve {
            child: spawn_killed_with_us(&mut cmd),
            port,
            log,
        }
    }

    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/v1/ws", self.port)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (at most 30 s) until it accepts connections; panics if it exits first.
    pub async fn wait_listening(&mut self) {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("serve exited with {st}: {}", self.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "serve did not start"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits (at most `secs`) for the process to exit on its own; its exit status.
    pub async fn wait_exit(&mut self, secs: u64) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st;
            }
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "serve did not exit: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// SIGKILL, and the exit collected.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What an operator does: SIGTERM, then wait for the process to exit (SIGKILL after 10 s).
    pub fn stop(&mut self) {
        // SAFETY: signals our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A running `tidemark up` child: its stdout lines up to "Ctrl-C stops …", its stderr so far.
pub struct UpProc {
    child: Child,
    pub lines: Vec<String>,
    stderr: Arc<Mutex<String>>,
}

impl UpProc {
    /// Starts `tidemark up --shards 2 --listen 127.0.0.1:0 --data-dir DATA ARGS…` and waits
    /// until it has printed its endpoints.
    pub fn start(data: &Path, args: &[&str]) -> UpProc {
        Self::start_in(Path::new("."), "127.0.0.1:0", data, args)
    }

    /// [`UpProc::start`] in the working directory `cwd` (`data` may be relative to it) with
    /// another `--listen`.
    pub fn start_in(cwd: &Path, listen: &str, data: &Path, args: &[&str]) -> UpProc {
        Self::start_logged(cwd, listen, data, args, "warn")
    }

    /// [`UpProc::start_in`] logging at `rust_log` (its stderr is [`UpProc::stderr`]).
    pub fn start_logged(
        cwd: &Path,
        listen: &str,
        data: &Path,
        args: &[&str],
        rust_log: &str,
    ) -> UpProc {
        let mut cmd = cli();
        cmd.current_dir(cwd).env("RUST_LOG", rust_log);
        cmd.args(["up", "--shards", "2", "--listen", listen, "--data-dir"])
            .arg(data)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // a process group of its own, as a shell gives a command it runs: Ctrl-C in a terminal
        // reaches `up` and every node it started ([`UpProc::interrupt_group`])
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = spawn_killed_with_us(&mut cmd);
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let rx = stdout_lines(&mut child);
        let mut lines = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let done = line.starts_with("Ctrl-C");
                    lines.push(line);
                    if done {
                        break;
                    }
                }
                Err(_) => {
                    if let Some(status) = child.try_wait().unwrap() {
                        panic!(
                            "up exited with {status}: {}",
                            stderr.lock().unwrap().as_str()
                        );
                    }
                    assert!(
                        Instant::now() < deadline,
                        "up did not print its endpoints: {lines:?}"
                    );
                }
            }
        }
        UpProc {
            child,
            lines,
            stderr,
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The line starting with `prefix` (e.g. "gateway", "core     0").
    pub fn line(&self, prefix: &str) -> &str {
        self.lines
            .iter()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {:#?}", self.lines))
    }

    /// The printed line containing `needle`, trimmed.
    pub fn containing(&self, needle: &str) -> &str {
        let line = self.lines.iter().find(|l| l.contains(needle));
        line.unwrap_or_else(|| panic!("no line with {needle:?}: {:#?}", self.lines))
            .trim()
    }

    /// The port of the URL on the line starting with `prefix` (e.g.
    /// `core     0 redis://127.0.0.1:41733/`, `gateway  wss://127.0.0.1:PORT/v1/ws`).
    pub fn port(&self, prefix: &str) -> u16 {
        let line = self.line(prefix);
        let url = line.split_whitespace().find(|w| w.contains("://")).unwrap();
        let hostport = url.split("://").nth(1).unwrap().split('/').next().unwrap();
        hostport.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// SIGTERM, then waits (at most 30 s) for a clean exit; its stderr.
    pub fn stop(self) -> String {
        // SAFETY: a signal to our own child process
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        self.wait_clean_exit()
    }

    /// SIGINT to its whole process group, as Ctrl-C in a terminal sends it (to `up` and to
    /// the nodes it started), then waits (at most 30 s) for a clean exit; its stderr.
    pub fn interrupt_group(self) -> String {
        // SAFETY: a signal to the process group our own child leads
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGINT);
        }
        self.wait_clean_exit()
    }

    fn wait_clean_exit(mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "up exited with {status}: {}",
                    self.stderr()
                );
                break;
            }
            assert!(Instant::now() < deadline, "up did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        self.stderr()
    }
}
