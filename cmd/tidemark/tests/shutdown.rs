//! How `tidemark serve` ends a stop that does not finish (ADR-0122). The stop is made to hang
//! the way a host gone without a reset does: the mailbox instance is stopped (SIGSTOP) with a
//! record in flight, then the core instance too, so the materializer's step and the release of
//! the leases both wait on servers that never answer. A second SIGTERM, or
//! `--shutdown-timeout` after the first, ends the process with status 1. Before, the process
//! listened for one signal only: every later one was swallowed, and nothing bounded the stop.

mod support;

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};

/// A `tidemark serve` whose stop hangs, with its stderr as it comes.
struct Stuck {
    child: Child,
    stderr: Arc<Mutex<String>>,
    core: RedisProcess,
    mailbox: RedisProcess,
}

/// Sends `sig` to process `pid`.
fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: a signal to a process of this test (a child, or a redis-server it started)
    let r = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(r, 0, "kill {sig} {pid}");
}

impl Stuck {
    /// Starts `tidemark serve` (leases mode, with `extra` flags) over one shard, waits until
    /// its worker has materialised a record, then stops its mailbox instance, commits a record
    /// (the worker's step for it waits on the stopped instance) and stops its core instance
    /// (the release of the lease waits on it).
    async fn start(extra: &[&str]) -> Stuck {
        let (core, mailbox) = support::redis_pair();
        let port = support::free_port();
        let mut args =
            support::serve_args(&core.url(), &mailbox.url(), 1, &format!("127.0.0.1:{port}"));
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = support::spawn_killed_with_us(&mut cmd);
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr is piped");
        let out = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                out.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        support::wait_healthy(port).await;
        let mut log = LogStore::connect(&core.url()).await.unwrap();
        // the node holds the shard's lease and its worker runs: a first record materialised
        let lane = support::route("bob", 1).lane;
        let first = log
            .commit(0, "alice", "m1", &["bob"], "body", 1, DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap()
            .offset;
        let url = mailbox.url();
        support::until("the first record materialised", 15, || async {
            support::watermark(&url, 0).await.lanes.lane(lane).w >= first
        })
        .await;
        signal(mailbox.pid().unwrap(), libc::SIGSTOP);
        log.commit(0, "alice", "m2", &["bob"], "body", 1, DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        signal(core.pid().unwrap(), libc::SIGSTOP);
        Stuck {
            child,
            stderr,
            core,
            mailbox,
        }
    }

    /// The process's exit status once it exits within `within`, else `None`.
    fn exit_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if start.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Stuck {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in [&self.core, &self.mailbox] {
            if let Some(pid) = r.pid() {
                // SAFETY: a redis-server this test started
                unsafe { libc::kill(pid as i32, libc::SIGCONT) };
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_a_stop_that_hangs() {
    let mut s = Stuck::start(&[]).await;
    signal(s.child.id(), libc::SIGTERM);
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal(s.child.id(), libc::SIGTERM);
    let status = s.exit_within(Duration::from_secs(3));
    let err = s.stderr();
    let status = status.unwrap_or_else(|| {
        panic!("tidemark serve still running 3 s after a second SIGTERM; stderr:\n{err}")
    });
    assert_eq!(
        status.code(),
        Some(1),
        "the stop was cut short; stderr:\n{err}"
    );
    assert!(
        err.contains("stop not finished: a second signal (SIGTERM)"),
        "says why: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_that_hangs_is_given_up_after_the_shutdown_timeout() {
    let mut s = Stuck::start(&["--shutdown-timeout", "1s"]).await;
    signal(s.child.id(), libc::SIGTERM);
    let status = s.exit_within(Duration::from_secs(4));
    let err = s.stderr();
    let status = status.unwrap_or_else(|| {
        panic!(
            "tidemark serve still running 4 s after SIGTERM with --shutdown-timeout 1s; \
             stderr:\n{err}"
        )
    });
    assert_eq!(
        status.code(),
        Some(1),
        "the stop was cut short; stderr:\n{err}"
    );
    assert!(
        err.contains("stop not finished: --shutdown-timeout 1s passed"),
        "says why: {err}"
    );
}
