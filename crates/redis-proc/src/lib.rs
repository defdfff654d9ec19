//! Real `redis-server` processes, owned by Rust values.
//!
//! Every test in the workspace and `tidemark up` start Redis through this crate: a
//! [`RedisProcess`] picks a free loopback port, starts `redis-server` with the options given,
//! waits until it answers `PING` (for as long as it answers `LOADING`: a large AOF takes its
//! time, ADR-0109), and kills the process when dropped. The child also gets a parent-death
//! signal (`PR_SET_PDEATHSIG`), so a `kill -9` of the owner never leaves an orphaned server
//! behind, and a process group of its own, so the terminal's Ctrl-C (SIGINT to the foreground
//! process group) reaches its owner only: the owner stops first, while its Redis still
//! answers, then kills the server (ADR-0109).
//!
//! With [`RedisOptions::requirepass`], the server requires that password (`AUTH`) from every
//! client; it is handed to redis-server on its standard input (`redis-server -`), never on the
//! command line, where any local user could read it with `ps`. [`RedisProcess::url`] then
//! carries it (`redis://:PASS@127.0.0.1:PORT/`); [`RedisProcess::display_url`] does not.
//!
//! Files are private: a data directory this crate creates is mode 0700, and the server runs
//! with umask 077, so its AOF directory, AOF files and log are readable by their owner only.
//!
//! [`cluster`] builds a local Redis Cluster out of such processes ([`RedisCluster`]); [`resp`]
//! is the tiny blocking client the harness talks to its nodes with.
//!
//! There is deliberately no mock of Redis anywhere in Tidemark: what the tests prove is what
//! runs in production.

pub mod cluster;
pub mod resp;

pub use cluster::{
    free_cluster_port, free_cluster_ports, key_slot, redis_cli_available, ClusterOptions, NodeInfo,
    RedisCluster, Role,
};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Errors of this crate; each has a stable code (see [`Error::code`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `redis-server` is not on `PATH`.
    #[error("redis-server not found on PATH; install it with: sudo apt-get update && sudo apt-get install -y redis-server (or run scripts/install-redis.sh)")]
    NotInstalled,
    /// The process started but never answered `PING`.
    #[error("redis-server on {addr} did not answer PING within {waited:?}: {log}")]
    NotReady {
        addr: SocketAddr,
        waited: Duration,
        log: String,
    },
    /// A `requirepass` that is empty or holds a character other than ASCII letters, digits,
    /// `-`, `.`, `_` and `~` (so that it needs no quoting in a config line or a URL).
    #[error("a redis password must be 1..=512 characters of A-Z a-z 0-9 - . _ ~")]
    BadPassword,
    /// `redis-cli` is not on `PATH` (the cluster harness needs it).
    #[error("redis-cli not found on PATH; install it with: sudo apt-get update && sudo apt-get install -y redis-tools (or run scripts/install-redis.sh)")]
    CliNotInstalled,
    /// [`ClusterOptions`] that cannot make a cluster, or that do not match the cluster found
    /// in the base directory.
    #[error("bad cluster options: {0}")]
    BadClusterOptions(String),
    /// A [`RedisCluster`] method called in a way that cannot work (no such node, not a
    /// primary, a failover of a node that had no replica …).
    #[error("cluster harness misuse: {0}")]
    ClusterUsage(String),
    /// `redis-cli --cluster <step>` failed (exit status and the end of its output).
    #[error("redis-cli --cluster {step} failed: {output}")]
    ClusterCli { step: &'static str, output: String },
    /// A cluster condition was not reached in time; `what` names the condition and the first
    /// node that did not meet it.
    #[error("redis cluster not ready after {waited:?}: {what}")]
    ClusterNotReady { what: String, waited: Duration },
    /// A node answered a harness command with an error.
    #[error("{addr} answered {command:?} with {reply}")]
    ClusterCommand {
        addr: SocketAddr,
        command: String,
        reply: String,
    },
    /// A replica ([`RedisProcess::start_replica_of`]) that did not finish its first sync
    /// with its primary in time.
    #[error("redis-server on {addr} did not attach as a replica of {primary} within {waited:?}")]
    ReplicaNotAttached {
        addr: SocketAddr,
        primary: SocketAddr,
        waited: Duration,
    },
    /// Any I/O failure while preparing or starting the process.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// A stable, machine-readable code for this error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotInstalled => "redis_not_installed",
            Error::NotReady { .. } => "redis_not_ready",
            Error::BadPassword => "bad_password",
            Error::CliNotInstalled => "redis_cli_not_installed",
            Error::BadClusterOptions(_) => "bad_cluster_options",
            Error::ClusterUsage(_) => "cluster_usage",
            Error::ClusterCli { .. } => "cluster_cli_failed",
            Error::ClusterNotReady { .. } => "cluster_not_ready",
            Error::ClusterCommand { .. } => "cluster_command_failed",
            Error::ReplicaNotAttached { .. } => "replica_not_attached",
            Error::Io(_) => "io",
        }
    }
}

/// The server's log file in its directory: one per instance, appended to across restarts
/// (ports change at each start of `tidemark up`; the log does not).
pub const LOG_FILE: &str = "redis.log";

/// `auto-aof-rewrite-min-size` of every instance started with `appendonly` (ADR-0044): the
/// append-only file is rewritten once it has grown past this (and doubled since the last
/// rewrite). Redis's default, 64 MB, is reached every 15–25 s at 10,000 msg/s, and each
/// rewrite forks the server, which stalls delivery on a small machine. At 1 GB that is every
/// few minutes at that rate, for at most about 1 GB more disk per instance.
pub const AOF_REWRITE_MIN_SIZE: &str = "1gb";

/// How to start a `redis-server`.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Port to listen on; `None` picks a free loopback port.
    pub port: Option<u16>,
    /// Working directory for AOF/RDB files; `None` uses a private temporary directory that
    /// is removed with the process.
    pub data_dir: Option<PathBuf>,
    /// Turn on the append-only file (durability of commits).
    pub appendonly: bool,
    /// `appendfsync` policy when `appendonly` is on (`always`, `everysec`, `no`).
    pub appendfsync: String,
    /// Extra `--name value` arguments, passed as given after the others (so they override
    /// them, e.g. `auto-aof-rewrite-min-size`).
    pub extra: Vec<(String, String)>,
    /// Require this password from every client (`requirepass`); see [`valid_password`]. It
    /// is also the server's `masterauth`: a replica authenticates to its primary with it
    /// (in a [`RedisCluster`], all nodes share one password).
    pub requirepass: Option<String>,
}

/// Whether `p` can be a [`RedisOptions::requirepass`]: 1..=512 characters, each an ASCII
/// letter or digit or one of `-._~` (URL-unreserved: no quoting anywhere).
pub fn valid_password(p: &str) -> bool {
    (1..=512).contains(&p.len())
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            port: None,
            data_dir: None,
            appendonly: false,
            appendfsync: "everysec".into(),
            extra: Vec::new(),
            requirepass: None,
        }
    }
}

/// A running `redis-server`, killed (SIGKILL, then reaped) when dropped.
pub struct RedisProcess {
    child: Option<Child>,
    addr: SocketAddr,
    opts: RedisOptions,
    dir: PathBuf,
    /// Keeps the temporary directory alive as long as the process.
    _tmp: Option<tempfile::TempDir>,
}

/// Creates `dir` (and missing parents) when it does not exist; `dir` itself gets mode 0700.
/// An existing directory is left as it is.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        other => other,
    }
}

/// Returns an unused TCP port on 127.0.0.1 (bound then released), never one it returned
/// before in this process: the tests of one binary run in parallel, and two of them given the
/// same port (free again between one's call and its server's bind) would each reach the
/// other's server.
pub fn free_port() -> std::io::Result<u16> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if GIVEN.lock().unwrap_or_else(|p| p.into_inner()).insert(port) {
            return Ok(port);
        }
    }
}

/// True when `redis-server` can be started from `PATH`.
pub fn redis_server_available() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

impl RedisProcess {
    /// Starts a throw-away server (no persistence) on a free port.
    pub fn start() -> Result<Self, Error> {
        Self::start_with(RedisOptions::default())
    }

    /// How long [`RedisProcess::start_with`] waits for a server that neither answers `PONG`
    /// nor `LOADING` (nor exits).
    pub const READY_WITHIN: Duration = Duration::from_secs(20);

    /// Starts a server with the given options and waits until it answers `PING`: see
    /// [`RedisProcess::start_with_ready_within`], with [`RedisProcess::READY_WITHIN`].
    pub fn start_with(opts: RedisOptions) -> Result<Self, Error> {
        Self::start_with_ready_within(opts, Self::READY_WITHIN)
    }

    /// Starts a server with the given options and waits until it answers `PING` with
    /// `PONG`. A server that answers `LOADING` (reading a large AOF) is alive and making
    /// progress: it is waited for as long as it loads, `ready_within` counting again from each
    /// such answer; a server silent for `ready_within` is killed and reported
    /// ([`Error::NotReady`]), never started again (a restart would load the same files from
    /// the start). Only a server that exited at once (its port taken between the probe and
    /// its bind) is started again, on another free port, at most 5 times.
    pub fn start_with_ready_within(
        opts: RedisOptions,
        ready_within: Duration,
    ) -> Result<Self, Error> {
        if !redis_server_available() {
            return Err(Error::NotInstalled);
        }
        if opts
            .requirepass
            .as_deref()
            .is_some_and(|p| !valid_password(p))
        {
            return Err(Error::BadPassword);
        }
        let (dir, tmp) = match &opts.data_dir {
            Some(d) => {
                create_private_dir(d)?;
                // absolute: redis-server changes into --dir before it opens --logfile
                (std::fs::canonicalize(d)?, None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("tidemark-redis-")
                    .tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        // A free port can be taken by someone else between our probe and the bind; retry.
        let mut last = None;
        for _ in 0..5 {
            let port = match opts.port {
                Some(p) => p,
                None => free_port()?,
            };
            match Self::spawn_once(&opts, &dir, port) {
                Ok(child) => {
                    let mut p = RedisProcess {
                        child: Some(child),
                        addr: SocketAddr::from(([127, 0, 0, 1], port)),
                        opts: opts.clone(),
                        dir: dir.clone(),
                        _tmp: None,
                    };
                    match p.wait_ready(ready_within) {
                        Ok(()) => {
                            p._tmp = tmp;
                            return Ok(p);
                        }
                        Err(e) => {
                            let exited = p.exited();
                            p.kill();
                            last = Some(e);
                            // a server that is still running did not lose a race for its
                            // port: another start would only load the same files again
                            if opts.port.is_some() || !exited {
                                break;
                            }
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(Error::NotInstalled))
    }

    fn spawn_once(opts: &RedisOptions, dir: &Path, port: u16) -> Result<Child, Error> {
        let mut cmd = Command::new("redis-server");
        if opts.requirepass.is_some() {
            // `-` first: read config lines from stdin (the password stays off the command line)
            cmd.arg("-");
        }
        cmd.arg("--port")
            .arg(port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(dir)
            .arg("--save")
            .arg("")
            .arg("--daemonize")
            .arg("no")
            .arg("--protected-mode")
            .arg("no")
            .arg("--logfile")
            .arg(dir.join(LOG_FILE));
        if opts.appendonly {
            cmd.arg("--appendonly")
                .arg("yes")
                .arg("--appendfsync")
                .arg(&opts.appendfsync)
                .arg("--appendfilename")
                .arg("appendonly.aof")
                // ADR-0044: a rewrite forks the server; at Redis's 64 MB a busy instance
                // forks every few seconds (`extra` may set another size)
                .arg("--auto-aof-rewrite-min-size")
                .arg(AOF_REWRITE_MIN_SIZE);
        } else {
            cmd.arg("--appendonly").arg("no");
        }
        for (k, v) in &opts.extra {
            cmd.arg(format!("--{k}")).arg(v);
        }
        cmd.stdin(if opts.requirepass.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // a process group of its own (ADR-0109): the terminal's Ctrl-C reaches the owner, which
        // stops while its Redis still answers, then kills it; the parent-death signal below
        // still ends it with its owner
        cmd.process_group(0);
        // SAFETY: prctl and umask are async-signal-safe; the closure touches nothing else.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // the server's files (AOF, log) readable by their owner only
                libc::umask(0o077);
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        if let (Some(pass), Some(mut stdin)) = (&opts.requirepass, child.stdin.take()) {
            // A server that died before reading this is reported by the readiness check.
            let _ = stdin.write_all(format!("requirepass {pass}\nmasterauth {pass}\n").as_bytes());
        }
        Ok(child)
    }

    /// Waits for `PONG`. `LOADING` answers restart the `limit` (the server is alive and
    /// loading its files: ADR-0109); an exit or `limit` without either answer is an error.
    fn wait_ready(&mut self, limit: Duration) -> Result<(), Error> {
        let start = Instant::now();
        let mut heard = start;
        loop {
            if self.exited() {
                return Err(self.not_ready(start.elapsed()));
            }
            match ping_state(self.addr, self.opts.requirepass.as_deref()) {
                Ok(PingState::Pong) => return Ok(()),
                Ok(PingState::Loading) => heard = Instant::now(),
                Ok(PingState::Other) | Err(_) => {}
            }
            if heard.elapsed() > limit {
                return Err(self.not_ready(start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process has exited (or was never started / already killed).
    fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    fn not_ready(&self, waited: Duration) -> Error {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        Error::NotReady {
            addr: self.addr,
            waited,
            log: tail,
        }
    }

    /// Path of the server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join(LOG_FILE)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The URL clients connect with: `redis://127.0.0.1:PORT/`, or
    /// `redis://:PASS@127.0.0.1:PORT/` with a password. Not for printing: see
    /// [`display_url`](Self::display_url).
    pub fn url(&self) -> String {
        match &self.opts.requirepass {
            Some(p) => format!("redis://:{p}@{}/", self.addr),
            None => self.display_url(),
        }
    }

    /// `redis://127.0.0.1:PORT/`, without the password (for output and logs).
    pub fn display_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// The password every client must give, if any.
    pub fn password(&self) -> Option<&str> {
        self.opts.requirepass.as_deref()
    }

    /// The server's working directory (AOF lives here).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// OS process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Starts a server (options as `primary`'s, its own port and directory) that replicates
    /// `primary` (`REPLICAOF`), and waits until its first sync is done: from then on it
    /// receives every write of the primary. Tests of replica waits stop it (SIGSTOP on
    /// [`RedisProcess::pid`]) to hold replication back.
    pub fn start_replica_of(primary: &RedisProcess) -> Result<RedisProcess, Error> {
        let mut opts = primary.opts.clone();
        opts.port = None;
        opts.data_dir = None;
        let replica = RedisProcess::start_with(opts)?;
        let password = replica.password().map(str::to_string);
        let timeout = Duration::from_secs(30);
        let mut c = resp::Conn::connect(replica.addr, password.as_deref(), timeout)?;
        let port = primary.port().to_string();
        let reply = c.call(&["REPLICAOF", "127.0.0.1", port.as_str()])?;
        if !reply.is_ok() {
            return Err(Error::ClusterCommand {
                addr: replica.addr,
                command: format!("REPLICAOF 127.0.0.1 {port}"),
                reply: format!("{reply:?}"),
            });
        }
        let start = Instant::now();
        loop {
            let info = c.call(&["INFO", "replication"])?.text().unwrap_or_default();
            if info.contains("master_link_status:up") && info.contains("master_sync_in_progress:0")
            {
                return Ok(replica);
            }
            if start.elapsed() > timeout {
                return Err(Error::ReplicaNotAttached {
                    addr: replica.addr,
                    primary: primary.addr,
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the server and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the server (SIGKILL: no shutdown save) and starts it again on the same port and
    /// directory, so it reloads its AOF. Used by fault tests.
    pub fn restart(&mut self) -> Result<(), Error> {
        self.kill();
        let mut last = None;
        for _ in 0..50 {
            match Self::spawn_once(&self.opts, &self.dir, self.addr.port()) {
                Ok(child) => {
                    self.child = Some(child);
                    match self.wait_ready(Self::READY_WITHIN) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            let exited = self.exited();
                            self.kill();
                            last = Some(e);
                            if !exited {
                                // running but silent: starting it again would not help
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(Error::NotInstalled))
    }
}

impl RedisProcess {
    /// Kills the server (SIGKILL) and starts it again on the same port and directory with
    /// `extra` `--name value` arguments added for this start only, without waiting for it to
    /// answer `PING`: for fault tests that restart a server into a state such as a slow
    /// `LOADING` (`key-load-delay`). A later [`RedisProcess::restart`] uses the original
    /// options again.
    pub fn restart_with_extra(&mut self, extra: &[(&str, &str)]) -> Result<(), Error> {
        self.kill();
        let mut opts = self.opts.clone();
        opts.extra
            .extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let started = Instant::now();
        self.child = Some(Self::spawn_once(&opts, &self.dir, self.addr.port())?);
        // a server that refuses its settings (or its port) exits at once: say so here, with
        // its log's tail
        std::thread::sleep(Duration::from_millis(200));
        if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
            let e = self.not_ready(started.elapsed());
            self.child = None;
            return Err(e);
        }
        Ok(())
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends an inline `PING` and checks for `+PONG`.
pub fn ping(addr: SocketAddr) -> std::io::Result<bool> {
    ping_auth(addr, None)
}

/// Like [`ping`], after `AUTH password` when one is given: true only when the server accepts
/// the password and answers `+PONG` (not while it is still loading its AOF).
pub fn ping_auth(addr: SocketAddr, password: Option<&str>) -> std::io::Result<bool> {
    Ok(ping_state(addr, password)? == PingState::Pong)
}

/// What a server answered [`ping_state`]'s `PING`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PingState {
    /// `+PONG` (after `+OK` to `AUTH`, with a password): ready.
    Pong,
    /// `-LOADING …`: alive, loading its AOF or RDB; it answers `PONG` once loaded.
    Loading,
    /// Anything else (a refused password, a closed connection, another error).
    Other,
}

/// `AUTH password` (when one is given), then `PING`, on a fresh connection: what the server
/// answered. An I/O error (nothing listening, no answer within 500 ms) is `Err`.
pub fn ping_state(addr: SocketAddr, password: Option<&str>) -> std::io::Result<PingState> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
    s.set_read_timeout(Some(Duration::from_millis(500)))?;
    let mut lines = 1;
    if let Some(p) = password {
        // a valid password has no spaces or quotes: safe as an inline command
        s.write_all(format!("AUTH {p}\r\n").as_bytes())?;
        lines += 1;
    }
    s.write_all(b"PING\r\n")?;
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while got.windows(2).filter(|w| w == b"\r\n").count() < lines {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    let auth_ok = password.is_none() || got.starts_with(b"+OK\r\n");
    let ping = got
        .split(|&b| b == b'\n')
        .nth(lines - 1)
        .unwrap_or_default();
    Ok(if !auth_ok {
        PingState::Other
    } else if ping.starts_with(b"+PONG\r") {
        PingState::Pong
    } else if ping.starts_with(b"-LOADING") {
        PingState::Loading
    } else {
        PingState::Other
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_answers_and_dies_on_drop() {
        let p = RedisProcess::start().expect("redis-server must be installed for tests");
        let addr = p.addr();
        assert!(ping(addr).unwrap());
        drop(p);
        assert!(ping(addr).is_err() || !ping(addr).unwrap());
    }

    /// One inline command on a fresh connection; the first reply line.
    fn command(addr: SocketAddr, line: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(format!("{line}\r\n").as_bytes()).unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).trim_end().to_string()
    }

    #[test]
    fn requirepass_is_required_and_kept_off_the_command_line() {
        let pass = "p4ss-word_0123456789abcdef";
        let mut p = RedisProcess::start_with(RedisOptions {
            requirepass: Some(pass.into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(p.url(), format!("redis://:{pass}@127.0.0.1:{}/", p.port()));
        assert_eq!(p.display_url(), format!("redis://127.0.0.1:{}/", p.port()));
        assert!(command(p.addr(), "PING").starts_with("-NOAUTH"));
        assert!(command(p.addr(), "AUTH wrong").starts_with("-WRONGPASS"));
        assert!(ping_auth(p.addr(), Some(pass)).unwrap());
        assert!(!ping(p.addr()).unwrap());
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", p.pid().unwrap())).unwrap();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(pass),
            "password on the command line"
        );
        // a restart keeps it
        p.restart().unwrap();
        assert!(command(p.addr(), "PING").starts_with("-NOAUTH"));
        assert!(ping_auth(p.addr(), Some(pass)).unwrap());
        for bad in ["", "has space", "quo\"te", "new\nline", &"x".repeat(513)] {
            let e = RedisProcess::start_with(RedisOptions {
                requirepass: Some(bad.into()),
                ..Default::default()
            })
            .err()
            .unwrap();
            assert_eq!(e.code(), "bad_password");
        }
    }

    #[test]
    fn aof_is_rewritten_at_a_gigabyte_unless_told_otherwise() {
        let min_size = |opts: RedisOptions| {
            let p = RedisProcess::start_with(opts).unwrap();
            command(p.addr(), "CONFIG GET auto-aof-rewrite-min-size")
        };
        let aof = || RedisOptions {
            appendonly: true,
            ..Default::default()
        };
        assert!(min_size(aof()).ends_with("\r\n1073741824"), "ADR-0044: 1gb");
        let told = RedisOptions {
            extra: vec![("auto-aof-rewrite-min-size".into(), "64mb".into())],
            ..aof()
        };
        assert!(
            min_size(told).ends_with("\r\n67108864"),
            "`extra` overrides"
        );
        // without an AOF there is nothing to rewrite: Redis's default is left alone
        assert!(min_size(RedisOptions::default()).ends_with("\r\n67108864"));
    }

    #[test]
    fn restart_keeps_aof_data() {
        let mut p = RedisProcess::start_with(RedisOptions {
            appendonly: true,
            appendfsync: "always".into(),
            ..Default::default()
        })
        .unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        s.write_all(b"SET k v\r\n").unwrap();
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"+OK\r\n");
        drop(s);
        p.restart().unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        s.write_all(b"GET k\r\n").unwrap();
        let n = s.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"$1\r\nv\r\n");
    }
}
