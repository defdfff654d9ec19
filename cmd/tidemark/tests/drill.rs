//! The ADR-0015 upgrade and downgrade drill of `docs/operations.md`, run for real: the
//! `tidemark` binary as child processes, real redis-servers with AOF (`appendfsync always`),
//! clients over WebSocket with dev auth.
//!
//! 1. **Old deployment.** `tidemark serve --layout packed-v1` (the kept packed-v1 "old code"
//!    scripts) delivers messages; every watermark is packed-v1, 1216 bytes.
//! 2. **Upgrade.** A packed-v2 owner starts while the old one still runs (the worst case the
//!    drill guards against). It claims every shard (epoch + 1) — claiming converts nothing —
//!    and converts each watermark on its next write (19 bytes when uniform). The old owner
//!    fails closed on every shard (fenced by the epoch, or refusing packed-v2 as corrupt by the
//!    layout and length checks): its `/healthz` answers 503 and it logs `shard stopped`. It
//!    wrote nothing: `wm verify` passes and every mailbox holds exactly the messages sent.
//!    Then old code is *started* beside the running packed-v2 owner: it refuses to claim any
//!    shard (`unknown_layout`, before raising the epoch), exits non-zero, fences nobody (every
//!    `wm_epoch` unchanged), and the packed-v2 owner keeps delivering.
//! 3. **Offline downgrade.** Every owner stopped. First the mistake: the old code started on
//!    packed-v2 data refuses every shard as corrupt (`unknown_layout`) without claiming,
//!    writes nothing and exits, and a message committed meanwhile waits in the log. Then
//!    `tidemark wm downgrade --all` writes every watermark back as packed-v1 (1216 bytes); the
//!    old code starts again and delivers everything, the waiting message included.
//!
//! Every message of the whole drill is in its recipients' mailboxes exactly once, in order,
//! and a fresh client receives all of them, in order.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use support::route;
use tidemark_client::{Auth, Client, Event};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::keys;
use tidemark_store::redis::dlog::LogStore;

const SHARDS: u32 = 4;
const SENDER: &str = "drill-sender";

/// A `tidemark serve` child process (SIGKILLed on drop and on our death), stderr to a file.
struct Serve {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Serve {
    fn start(core: &str, mailbox: &str, layout: &str, log: PathBuf) -> Serve {
        let port = tidemark_redis_proc::free_port().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args([
            "serve",
            "--core",
            core,
            "--mailbox",
            mailbox,
            "--shards",
            &SHARDS.to_string(),
            "--layout",
            layout,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--dev-auth",
        ])
        .env("RUST_LOG", "warn,tidemark_server=info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
        Serve {
            child: support::spawn_killed_with_us(&mut cmd),
            port,
            log,
        }
    }

    fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/v1/ws", self.port)
    }

    async fn wait_listening(&mut self) {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("serve exited with {st}: {}", self.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "serve did not start"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits (at most `secs`) for the process to exit on its own; its exit status.
    async fn wait_exit(&mut self, secs: u64) -> std::process::ExitStatus {
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

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What an operator does: SIGTERM, then wait for the process to exit (SIGKILL after 10 s).
    fn stop(&mut self) {
        // SAFETY: signals our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tidemark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(args)
        .output()
        .expect("run tidemark")
}

use support::http_get;

/// Two users per shard, in different lanes.
fn pick_users() -> Vec<String> {
    let mut per_shard: BTreeMap<u32, Vec<(String, usize)>> = BTreeMap::new();
    for i in 0.. {
        let u = format!("drill-{i}");
        let r = route(&u, SHARDS);
        let v = per_shard.entry(r.shard).or_default();
        if v.len() < 2 && v.iter().all(|(_, l)| *l != r.lane) {
            v.push((u, r.lane));
        }
        if per_shard.len() == SHARDS as usize && per_shard.values().all(|v| v.len() == 2) {
            break;
        }
    }
    per_shard
        .into_values()
        .flat_map(|v| v.into_iter().map(|(u, _)| u))
        .collect()
}

/// What every user must hold: (seq, body) in seq order.
type Expected = BTreeMap<String, Vec<(u64, String)>>;

/// Sends one phase's messages through `ws_url`: one to each user alone (hot path), then three
/// to many (lane chunks: two lanes of one shard, two shards, everybody).
async fn send_phase(ws_url: &str, phase: &str, users: &[String], expected: &mut Expected) {
    let c = Client::connect(ws_url, &Auth::DevUser(SENDER.into()))
        .await
        .expect("sender connects");
    let mut batches: Vec<Vec<String>> = users.iter().map(|u| vec![u.clone()]).collect();
    batches.push(users[0..2].to_vec());
    batches.push(users[2..6].to_vec());
    batches.push(users.to_vec());
    for (i, to) in batches.into_iter().enumerate() {
        send(&c, &format!("{phase}-{i}"), &to, expected).await;
    }
    c.close().await;
}

/// Sends one message (body = its id) and records what each recipient must hold.
async fn send(c: &Client, id: &str, to: &[String], expected: &mut Expected) {
    let body = format!("message {id}");
    let offsets = c
        .send_and_wait(id, to, &body, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("send {id}: {e}"));
    for u in to {
        let seq = offsets[&route(u, SHARDS).shard];
        expected
            .entry(u.clone())
            .or_default()
            .push((seq, body.clone()));
    }
}

/// Commits one message (body = its id) straight to the core Redis, as a gateway does before
/// its `send_ack`, and records what each recipient must hold.
async fn commit_direct(core_url: &str, id: &str, to: &[String], expected: &mut Expected) {
    let body = format!("message {id}");
    let mut core = LogStore::connect(core_url).await.unwrap();
    let mut by_shard: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for u in to {
        by_shard
            .entry(route(u, SHARDS).shard)
            .or_default()
            .push(u.as_str());
    }
    for (shard, rcpts) in by_shard {
        let c = core
            .commit(shard, SENDER, id, &rcpts, &body, 1, 3600)
            .await
            .unwrap();
        assert!(!c.duplicate);
        for u in rcpts {
            expected
                .entry(u.to_string())
                .or_default()
                .push((c.offset, body.clone()));
        }
    }
}

/// A fresh connection per user receives everything expected, in order, once, from `SENDER`.
async fn check_delivered(ws_url: &str, expected: &Expected) {
    let mut tasks = Vec::new();
    for (user, want) in expected.clone() {
        let url = ws_url.to_string();
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(&url, &Auth::DevUser(user.clone()))
                .await
                .expect("receiver connects");
            let mut got: Vec<(u64, String)> = Vec::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while got.len() < want.len() {
                match tokio::time::timeout_at(deadline, c.next_event()).await {
                    Ok(Some(Event::Deliver(e))) => {
                        assert_eq!(e.from, SENDER);
                        got.push((e.seq, e.body));
                    }
                    Ok(Some(Event::Closed)) | Ok(None) => panic!("{user}: connection closed"),
                    Ok(Some(_)) => {}
                    Err(_) => panic!("{user}: got {got:?}, want {want:?}"),
                }
            }
            c.close().await;
            assert_eq!(got, want, "{user}: delivered exactly once, in order");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// From Redis directly: every mailbox holds exactly the expected entries, in seq order.
async fn check_mailboxes(conn: &mut redis::aio::MultiplexedConnection, expected: &Expected) {
    for (user, want) in expected {
        let key = keys::mailbox(route(user, SHARDS).shard, user);
        let members: Vec<(Vec<u8>, f64)> = conn.zrange_withscores(&key, 0, -1).await.unwrap();
        let have: Vec<(u64, String)> = members
            .iter()
            .map(|(m, score)| {
                let e = tidemark_protocol::entry::decode_entry(m).unwrap();
                assert_eq!(e.seq, *score as u64);
                (e.seq, e.body)
            })
            .collect();
        assert_eq!(&have, want, "{key}: exactly the messages sent, in order");
    }
}

/// While the old code refuses packed-v2: nothing became visible. Each mailbox holds what it
/// held `before`, at or below its lane's W, and W did not move; the only thing allowed above
/// W is the waiting message's own entry (a lane chunk written before the advance refused:
/// invisible to readers, and the very member the rightful owner writes later, idempotently).
async fn check_nothing_visible(
    conn: &mut redis::aio::MultiplexedConnection,
    mb_url: &str,
    before: &Expected,
    after: &Expected,
) {
    let mut store = tidemark_store::redis::store::MailboxStore::connect(
        mb_url,
        tidemark_store::redis::watermark::Layout::PackedV2,
    )
    .await
    .unwrap();
    for (user, want) in before {
        let r = route(user, SHARDS);
        let wm = store.read_watermark(r.shard).await.unwrap();
        let w = wm.lanes.lane(r.lane).w;
        assert_eq!(w, want.last().unwrap().0, "{user}: lane W did not move");
        let members: Vec<Vec<u8>> = conn
            .zrange(keys::mailbox(r.shard, user), 0, -1)
            .await
            .unwrap();
        let have: Vec<(u64, String)> = members
            .iter()
            .map(|m| {
                let e = tidemark_protocol::entry::decode_entry(m).unwrap();
                (e.seq, e.body)
            })
            .collect();
        let (visible, above): (Vec<_>, Vec<_>) = have.into_iter().partition(|(seq, _)| *seq <= w);
        assert_eq!(&visible, want, "{user}: nothing new at or below W");
        let waiting = &after[user][want.len()..];
        assert!(
            above.iter().all(|e| waiting.contains(e)),
            "{user}: {above:?}"
        );
    }
}

/// (layout, epoch) from `tidemark wm inspect --json`, and the blob's length from HSTRLEN.
async fn wm_state(
    mb_url: &str,
    conn: &mut redis::aio::MultiplexedConnection,
    shard: u32,
) -> (String, u64, u64) {
    let out = tidemark(&[
        "wm",
        "inspect",
        "--redis",
        mb_url,
        "--shard",
        &shard.to_string(),
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let len: u64 = redis::cmd("HSTRLEN")
        .arg(keys::wm(shard))
        .arg("wm_blob")
        .query_async(conn)
        .await
        .unwrap();
    (
        v["layout"].as_str().unwrap().to_string(),
        v["epoch"].as_u64().unwrap(),
        len,
    )
}

fn wm_verify(mb_url: &str) {
    let out = tidemark(&["wm", "verify", "--redis", mb_url]);
    assert!(out.status.success(), "wm verify: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{SHARDS} watermark(s) checked, 0 problem(s)")),
        "{text}"
    );
}

async fn wait_for<F, Fut>(what: &str, secs: u64, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match f().await {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn log_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("tidemark-drill-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn log_file(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrade_v1_to_v2_then_offline_downgrade() {
    let t0 = Instant::now();
    let opts = || RedisOptions {
        appendonly: true,
        appendfsync: "always".into(),
        ..Default::default()
    };
    let core = RedisProcess::start_with(opts()).unwrap();
    let mailbox = RedisProcess::start_with(opts()).unwrap();
    let (core_url, mb_url) = (core.url(), mailbox.url());
    let mut conn = redis::Client::open(mb_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let logs = log_dir();
    let users = pick_users();
    let mut expected = Expected::new();

    // ---- (a) the old deployment: packed-v1 ----
    let mut old = Serve::start(
        &core_url,
        &mb_url,
        "packed-v1",
        log_file(&logs, "old-1.log"),
    );
    old.wait_listening().await;
    send_phase(&old.ws_url(), "a", &users, &mut expected).await;
    check_delivered(&old.ws_url(), &expected).await;
    check_mailboxes(&mut conn, &expected).await;
    for s in 0..SHARDS {
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v1", 2, 1216),
            "shard {s}"
        );
    }
    wm_verify(&mb_url);
    assert_eq!(http_get(old.port, "/healthz").0, 200);
    println!("drill (a) packed-v1 deployment: ok at {:?}", t0.elapsed());

    // ---- (b) upgrade: a packed-v2 owner starts while the old one still runs ----
    let mut new = Serve::start(&core_url, &mb_url, "packed-v2", log_file(&logs, "new.log"));
    new.wait_listening().await;
    // claimed (epoch + 1), nothing converted yet: conversion is lazy, on the next write
    for s in 0..SHARDS {
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v1", 3, 1216),
            "shard {s}"
        );
    }
    send_phase(&new.ws_url(), "b", &users, &mut expected).await;
    check_delivered(&new.ws_url(), &expected).await;
    // every shard was written: packed-v2, 19 bytes once its lanes meet again
    for s in 0..SHARDS {
        let (mb, c) = (mb_url.clone(), conn.clone());
        wait_for(&format!("shard {s} packed-v2 19 bytes"), 10, move || {
            let (mb, mut c) = (mb.clone(), c.clone());
            async move {
                match wm_state(&mb, &mut c, s).await {
                    (l, 3, 19) if l == "packed-v2" => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await;
    }
    // the old owner failed closed on every shard: /healthz 503, one line per shard
    let old_port = old.port;
    wait_for(
        "old owner fenced or corrupt on every shard",
        10,
        || async move {
            let (status, body) = http_get(old_port, "/healthz");
            let stopped = (0..SHARDS)
                .filter(|s| {
                    body.lines().any(|l| {
                        l.starts_with(&format!("shard {s}: "))
                            && (l.contains("Fenced") || l.contains("Corrupt"))
                    })
                })
                .count();
            if status == 503 && stopped == SHARDS as usize {
                Ok(())
            } else {
                Err(format!("{status} {body}"))
            }
        },
    )
    .await;
    let (_, body) = http_get(old.port, "/healthz");
    println!("old owner /healthz 503:\n{body}");
    let log = old.log_text();
    let stopped_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("shard stopped"))
        .collect();
    assert!(stopped_lines.len() >= SHARDS as usize, "{log}");
    println!("old owner log:\n{}", stopped_lines.join("\n"));
    assert_eq!(http_get(new.port, "/healthz"), (200, "ok".to_string()));
    // and it wrote nothing bad
    wm_verify(&mb_url);
    check_mailboxes(&mut conn, &expected).await;
    println!("drill (b) upgrade to packed-v2: ok at {:?}", t0.elapsed());

    // ---- (b') old code started while the packed-v2 owner runs ----
    // It must not claim: raising wm_epoch would fence the live owner before the old code
    // fails closed on the layout. It refuses every shard without writing and exits non-zero;
    // the packed-v2 owner keeps its epoch and keeps delivering.
    old.stop();
    let mut late = Serve::start(
        &core_url,
        &mb_url,
        "packed-v1",
        log_file(&logs, "old-late.log"),
    );
    let status = late.wait_exit(20).await;
    let log = late.log_text();
    assert!(!status.success(), "old code must exit non-zero: {log}");
    assert!(log.contains("unknown_layout"), "{log}");
    println!(
        "old code beside a packed-v2 owner: {status}; {}",
        log.trim()
    );
    for s in 0..SHARDS {
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v2", 3, 19),
            "shard {s}: epoch untouched"
        );
    }
    let c = Client::connect(&new.ws_url(), &Auth::DevUser(SENDER.into()))
        .await
        .expect("sender connects");
    send(&c, "b-after-late-old", &users, &mut expected).await;
    c.close().await;
    check_delivered(&new.ws_url(), &expected).await;
    assert_eq!(http_get(new.port, "/healthz"), (200, "ok".to_string()));
    wm_verify(&mb_url);
    check_mailboxes(&mut conn, &expected).await;
    println!(
        "drill (b') old code refused to claim, the owner kept delivering: ok at {:?}",
        t0.elapsed()
    );

    // ---- (c) offline downgrade: stop every owner, downgrade, start the old code again ----
    new.stop();

    // first the mistake the downgrade exists for: the old code started on packed-v2 data.
    // It refuses to claim any shard (layout check, before the epoch is raised), writes
    // nothing and exits non-zero. A message committed meanwhile (what a gateway does before
    // its send_ack) waits in the log.
    let mut wrong = Serve::start(
        &core_url,
        &mb_url,
        "packed-v1",
        log_file(&logs, "old-without-downgrade.log"),
    );
    let status = wrong.wait_exit(20).await;
    let log = wrong.log_text();
    assert!(!status.success(), "{log}");
    assert!(log.contains("unknown_layout"), "{log}");
    let before = expected.clone();
    commit_direct(&core_url, "c-while-refused", &users, &mut expected).await;
    check_nothing_visible(&mut conn, &mb_url, &before, &expected).await;
    wm_verify(&mb_url);
    for s in 0..SHARDS {
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v2", 3, 19),
            "shard {s}"
        );
    }

    let out = tidemark(&["wm", "downgrade", "--redis", &mb_url, "--all"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for s in 0..SHARDS {
        assert!(
            text.contains(&format!(
                "shard {s}: packed-v2 (19 bytes) -> packed-v1 (1216 bytes), epoch 3"
            )),
            "{text}"
        );
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v1", 3, 1216),
            "shard {s}"
        );
    }
    wm_verify(&mb_url);
    let mut old2 = Serve::start(
        &core_url,
        &mb_url,
        "packed-v1",
        log_file(&logs, "old-2.log"),
    );
    old2.wait_listening().await;
    send_phase(&old2.ws_url(), "c", &users, &mut expected).await;
    // nothing lost across the whole drill: (a), (b) and (c), each once, in order
    check_delivered(&old2.ws_url(), &expected).await;
    check_mailboxes(&mut conn, &expected).await;
    for s in 0..SHARDS {
        let (layout, epoch, len) = wm_state(&mb_url, &mut conn, s).await;
        assert_eq!(
            (layout.as_str(), epoch, len),
            ("packed-v1", 4, 1216),
            "shard {s}"
        );
    }
    wm_verify(&mb_url);
    assert_eq!(http_get(old2.port, "/healthz"), (200, "ok".to_string()));

    // trace the last message to the first user: materialised, entry present
    let (u, (seq, _)) = expected
        .iter()
        .map(|(u, v)| (u, v.last().unwrap()))
        .next()
        .unwrap();
    let out = tidemark(&[
        "trace",
        "--core",
        &core_url,
        "--mailbox",
        &mb_url,
        "--shards",
        &SHARDS.to_string(),
        "--shard",
        &route(u, SHARDS).shard.to_string(),
        "--offset",
        &seq.to_string(),
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "materialised");
    let r = v["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["user"] == u.as_str())
        .unwrap();
    assert_eq!(r["state"], "materialised");
    let total: usize = expected.values().map(Vec::len).sum();
    println!(
        "drill (c) offline downgrade: ok at {:?}; {total} deliveries, none lost or duplicated",
        t0.elapsed()
    );
    old2.stop();
    std::fs::remove_dir_all(&logs).ok();
}
