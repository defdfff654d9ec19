//! Backup and restore, as `docs/operations.md` ("Backup and restore") tells an operator to do
//! it, with real redis-servers (AOF, `BGREWRITEAOF`, a copy of `appendonlydir`), and what
//! Tidemark does after a restore moved one side back:
//!
//! - **Mailbox instance restored** to a point behind the trimmed core log: the owner holds the
//!   shard (log discontinuity, `/healthz` 503), `tidemark shard rebase` says which offsets are
//!   gone and, with `--accept-loss`, moves the lanes up; the owner resumes by itself and new
//!   messages are delivered.
//! - **Core instance restored** behind the mailbox side: its head is below W, so a new commit
//!   would reuse a delivered offset and be taken for a replay (never delivered). The owner
//!   raises the head to W — while running, and at start — and new messages are delivered.
//! - **Mailbox instance emptied** while the service runs (restarted without its data): the
//!   owner creates the watermark again at W = 0 and re-materialises the log by itself, with
//!   no new message; if the log was trimmed meanwhile, the shard is held at the
//!   discontinuity instead.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::{aof_always, redis_cmd, route, serve_healthy, until};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};

const SHARDS: u32 = 2;

/// The runbook's backup: rewrite the AOF, wait for the rewrite, copy `appendonlydir`.
async fn backup(p: &RedisProcess, to: &Path) {
    redis_cmd(&p.url(), &["BGREWRITEAOF"]);
    until("AOF rewrite done", 30, || async {
        let info = match redis_cmd(&p.url(), &["INFO", "persistence"]) {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            other => format!("{other:?}"),
        };
        info.contains("aof_rewrite_in_progress:0") && info.contains("aof_rewrite_scheduled:0")
    })
    .await;
    let _ = std::fs::remove_dir_all(to);
    copy_dir(&p.dir().join("appendonlydir"), to);
}

/// `cp -a from to`.
fn copy_dir(from: &Path, to: &Path) {
    let st = Command::new("cp").arg("-a").arg(from).arg(to).status();
    assert!(st.unwrap().success());
}

/// The runbook's restore: stop the instance, put the copy back, start it (it loads the AOF).
fn restore(p: &mut RedisProcess, from: &Path) {
    p.kill();
    let aof = p.dir().join("appendonlydir");
    std::fs::remove_dir_all(&aof).unwrap();
    copy_dir(from, &aof);
    p.restart().unwrap();
}

fn opts(dir: PathBuf) -> RedisOptions {
    RedisOptions {
        data_dir: Some(dir),
        ..aof_always()
    }
}

/// Bob's mailbox on shard `s` of the mailbox instance at `url`: (seq, body) of each entry.
async fn bobs_entries(url: &str, s: u32) -> Vec<(u64, String)> {
    let c = redis::Client::open(url).unwrap();
    let mut conn = c.get_multiplexed_async_connection().await.unwrap();
    let members: Vec<Vec<u8>> =
        redis::AsyncCommands::zrange(&mut conn, tidemark_store::keys::mailbox(s, "bob"), 0, -1)
            .await
            .unwrap();
    members
        .iter()
        .map(|m| {
            let e = tidemark_protocol::entry::decode_entry(m).unwrap();
            (e.seq, e.body)
        })
        .collect()
}

/// `/healthz`'s body once it answers 503 with a log discontinuity (at most 40 s: a lost
/// watermark is created again only after `WATERMARK_LOST_AFTER`, 10 s).
async fn held_at_discontinuity(port: u16) -> String {
    let start = Instant::now();
    loop {
        let (status, body) = support::http_get(port, "/healthz");
        if status == 503 && body.contains("log discontinuity") {
            return body;
        }
        assert!(start.elapsed() < Duration::from_secs(40), "{status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_that_move_one_side_back() {
    let root = std::env::temp_dir().join(format!("tidemark-restore-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let mut core = RedisProcess::start_with(opts(root.join("core"))).unwrap();
    let mut mailbox = RedisProcess::start_with(opts(root.join("mailbox"))).unwrap();
    let (core_url, mb_url) = (core.url(), mailbox.url());
    let port = tidemark_redis_proc::free_port().unwrap();
    let mut server = serve_healthy(&core_url, &mb_url, SHARDS, port).await;
    let bob = route("bob", SHARDS);
    let s = bob.shard;
    let commits = LogStore::connect(&core_url).await.unwrap();
    let mut n = 0u64;
    let mut send = |body: &'static str| {
        n += 1;
        let id = format!("r-{n}");
        let mut c = commits.clone();
        async move {
            // the first command after a restart of core Redis may meet the old connection
            for _ in 0..50 {
                match c
                    .commit(s, "alice", &id, &["bob"], body, 1, DEFAULT_DEDUPE_TTL_S)
                    .await
                {
                    Ok(c) => return c.offset,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            panic!("commit {id} failed");
        }
    };
    let lane_w =
        |url: String| async move { support::watermark(&url, s).await.lanes.lane(bob.lane).w };
    let mailbox_bodies = |url: String| async move {
        bobs_entries(&url, s)
            .await
            .into_iter()
            .map(|(_, body)| body)
            .collect::<Vec<String>>()
    };

    // ---- a mailbox instance restored behind the trimmed log ----
    for b in ["m1", "m2", "m3"] {
        send(b).await;
    }
    until("W = 3", 10, || async { lane_w(mb_url.clone()).await == 3 }).await;
    let mb_backup = root.join("mailbox-backup");
    backup(&mailbox, &mb_backup).await;
    for b in ["m4", "m5", "m6"] {
        send(b).await;
    }
    until("W = 6 and the log trimmed", 10, || async {
        let len = match redis_cmd(&core_url, &["XLEN", &format!("dlog:{{{s}}}")]) {
            redis::Value::Int(n) => n,
            _ => -1,
        };
        lane_w(mb_url.clone()).await == 6 && len == 0
    })
    .await;
    restore(&mut mailbox, &mb_backup);
    assert_eq!(
        lane_w(mb_url.clone()).await,
        3,
        "W moved back with the restore"
    );
    let body = held_at_discontinuity(port).await;
    assert!(
        body.contains(&format!("shard {s}: log discontinuity: W=3, head 6")),
        "{body}"
    );
    let rebase = |accept: bool| {
        let shard = s.to_string();
        let mut args = vec!["shard", "rebase", "--redis", &mb_url, "--core", &core_url];
        args.extend(["--shard", &shard]);
        if accept {
            args.push("--accept-loss");
        }
        support::tidemark(&args)
    };
    let out = rebase(false);
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("offsets 4..=6 are gone"), "{text}");
    assert_eq!(
        lane_w(mb_url.clone()).await,
        3,
        "nothing written without --accept-loss"
    );
    let out = rebase(true);
    assert!(out.status.success(), "{out:?}");
    until("healthy again after the rebase", 20, || async {
        support::http_get(port, "/healthz").0 == 200
    })
    .await;
    let o = send("m7").await;
    assert_eq!(o, 7);
    until("m7 delivered", 10, || async {
        lane_w(mb_url.clone()).await == 7
    })
    .await;
    assert_eq!(
        mailbox_bodies(mb_url.clone()).await,
        ["m1", "m2", "m3", "m7"]
    );

    // ---- a core instance restored behind the mailbox side, while serve runs ----
    let core_backup = root.join("core-backup");
    backup(&core, &core_backup).await; // head 7
    for b in ["m8", "m9"] {
        send(b).await;
    }
    until("W = 9", 10, || async { lane_w(mb_url.clone()).await == 9 }).await;
    restore(&mut core, &core_backup);
    let head = || {
        let core_url = core_url.clone();
        async move {
            let mut c = LogStore::connect(&core_url).await.unwrap();
            c.head(s).await.unwrap()
        }
    };
    until("head raised back to W", 20, || async { head().await == 9 }).await;
    let o = send("m10").await;
    assert_eq!(o, 10, "the next commit follows W, not the restored head");
    until("m10 delivered", 10, || async {
        lane_w(mb_url.clone()).await == 10
    })
    .await;

    // ---- and at start: restore the core again with serve stopped ----
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let _ = server.wait();
    restore(&mut core, &core_backup);
    assert_eq!(head().await, 7);
    server = serve_healthy(&core_url, &mb_url, SHARDS, port).await;
    assert_eq!(head().await, 10, "raised before anything was served");
    assert_eq!(send("m11").await, 11);
    until("m11 delivered", 10, || async {
        lane_w(mb_url.clone()).await == 11
    })
    .await;
    let bodies = mailbox_bodies(mb_url.clone()).await;
    assert_eq!(bodies, ["m1", "m2", "m3", "m7", "m8", "m9", "m10", "m11"]);
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&root);
}

/// A mailbox instance that lost everything while the service runs (restarted without its
/// data; a promoted replica that never had the shard's keys), and no message comes after:
/// the owner finds the watermark gone and creates it again at W = 0, as a start would. With
/// the log never trimmed (`--mailbox-wait-replicas 1` and no replica: no W is confirmed) it
/// re-materialises it: the entries come back with the same seqs, by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mailbox_instance_that_lost_everything_is_rebuilt_from_the_log() {
    lost_everything(false).await;
}

/// The same loss after the log was trimmed below W: the records are gone, so the shard is
/// held at the discontinuity (`/healthz` 503, as after a restore behind the trimmed log),
/// never skipped silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mailbox_instance_that_lost_everything_behind_the_trimmed_log_is_held() {
    lost_everything(true).await;
}

async fn lost_everything(trimmed: bool) {
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let (core_url, mb_url) = (core.url(), mailbox.url());
    let port = tidemark_redis_proc::free_port().unwrap();
    let mut args = support::serve_args(&core_url, &mb_url, SHARDS, &format!("127.0.0.1:{port}"));
    if !trimmed {
        args.extend(
            ["--mailbox-wait-replicas", "1", "--wait-timeout", "1s"]
                .iter()
                .map(|s| s.to_string()),
        );
    }
    let mut server = support::spawn_healthy(&args, port).await;
    let bob = route("bob", SHARDS);
    let s = bob.shard;
    let mut log = LogStore::connect(&core_url).await.unwrap();
    let mut seqs = Vec::new();
    for (i, body) in ["l1", "l2", "l3"].iter().enumerate() {
        let c = log
            .commit(
                s,
                "alice",
                &format!("l-{i}"),
                &["bob"],
                body,
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap();
        seqs.push(c.offset);
    }
    let bobs = |url: String| async move { bobs_entries(&url, s).await };
    let want: Vec<(u64, String)> = seqs
        .iter()
        .zip(["l1", "l2", "l3"])
        .map(|(&q, b)| (q, b.to_string()))
        .collect();
    until("the three entries", 10, || async {
        bobs(mb_url.clone()).await == want
    })
    .await;
    let xlen = || match redis_cmd(&core_url, &["XLEN", &format!("dlog:{{{s}}}")]) {
        redis::Value::Int(n) => n,
        v => panic!("{v:?}"),
    };
    if trimmed {
        until("the log trimmed", 10, || async { xlen() == 0 }).await;
    } else {
        // two GC intervals: no trim may happen (no W is confirmed on a replica)
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(xlen(), 3, "the log is not trimmed");
    }

    redis_cmd(&mb_url, &["FLUSHALL"]);
    // not on the first reads that find it missing (they may have met a node with a stale
    // role): only once it has been missing for WATERMARK_LOST_AFTER (10 s)
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        redis_cmd(&mb_url, &["EXISTS", &tidemark_store::keys::wm(s)]),
        redis::Value::Int(0),
        "created again too soon"
    );
    if trimmed {
        let body = held_at_discontinuity(port).await;
        assert!(
            body.contains(&format!("shard {s}: log discontinuity: W=0, head 3")),
            "{body}"
        );
        assert!(bobs(mb_url.clone()).await.is_empty(), "nothing made up");
    } else {
        // the watermark is created again once it has been missing for 10 s
        until(
            "the entries rebuilt from the log, with no new message",
            40,
            || async { bobs(mb_url.clone()).await == want },
        )
        .await;
        until("healthy again", 10, || async {
            support::http_get(port, "/healthz").0 == 200
        })
        .await;
    }
    let (_, metrics) = support::http_get(port, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tidemark_watermark_regressions_total ") && !l.ends_with(" 0")),
        "counted as a watermark that went back: {metrics}"
    );
    let _ = server.kill();
    let _ = server.wait();
}
