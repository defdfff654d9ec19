//! `tidemark tail` when the server goes away (issue 10, polish): it says it is connected, says
//! when the connection is lost, reconnects with a backoff and syncs after the last seq it
//! printed (nothing skipped, nothing printed twice), and exits non-zero when it gives up.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{route, serve_healthy};
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};

const SHARDS: u32 = 4;

async fn wait_for(path: &std::path::Path, what: &str, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(what) {
            return text;
        }
        assert!(
            start.elapsed() < limit,
            "{what:?} not in {}:\n{text}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_reconnects_resumes_and_gives_up() {
    let (core, mailbox) = support::redis_pair();
    let port = tidemark_redis_proc::free_port().unwrap();
    let mut server = serve_healthy(&core.url(), &mailbox.url(), SHARDS, port).await;
    let dir = support::temp_dir("tail");
    let (out_path, err_path) = (dir.join("out"), dir.join("err"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args([
        "tail",
        "--url",
        &format!("ws://127.0.0.1:{port}/v1/ws"),
        "--dev-user",
        "bob",
        "--give-up-after",
        "5s",
    ])
    .stdout(std::fs::File::create(&out_path).unwrap())
    .stderr(std::fs::File::create(&err_path).unwrap());
    let mut tail = support::spawn_killed_with_us(&mut cmd);
    wait_for(&err_path, "tail: connected to", Duration::from_secs(10)).await;

    let shard = route("bob", SHARDS).shard;
    let mut commits = LogStore::connect(&core.url()).await.unwrap();
    commits
        .commit(
            shard,
            "alice",
            "t-1",
            &["bob"],
            "one",
            1,
            DEFAULT_DEDUPE_TTL_S,
        )
        .await
        .unwrap();
    wait_for(&out_path, "alice: one", Duration::from_secs(10)).await;

    // the server goes away; a message is committed meanwhile; the server comes back
    let _ = server.kill();
    let _ = server.wait();
    wait_for(&err_path, "connection lost", Duration::from_secs(10)).await;
    commits
        .commit(
            shard,
            "alice",
            "t-2",
            &["bob"],
            "two",
            2,
            DEFAULT_DEDUPE_TTL_S,
        )
        .await
        .unwrap();
    server = serve_healthy(&core.url(), &mailbox.url(), SHARDS, port).await;
    wait_for(
        &err_path,
        "reconnected; resuming after 1",
        Duration::from_secs(10),
    )
    .await;
    let out = wait_for(&out_path, "alice: two", Duration::from_secs(10)).await;
    assert_eq!(out.lines().count(), 2, "each message once:\n{out}");

    // gone for good: it gives up and says so, exit non-zero
    let _ = server.kill();
    let _ = server.wait();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = tail.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "tail did not give up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success());
    let err = std::fs::read_to_string(&err_path).unwrap();
    assert!(err.contains("giving up"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
