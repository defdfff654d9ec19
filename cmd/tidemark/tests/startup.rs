//! Start-up never hurts a running deployment: a second `tidemark serve` that cannot start
//! (its listen address is taken, a Redis does not answer, an owned shard does not exist)
//! exits with an error naming what failed, and raises no shard's epoch, so the running owner
//! keeps delivering.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::store::Store;
use tidemark_store::redis::watermark::Layout;

const SHARDS: u32 = 4;

fn serve_args(core: &str, mailbox: &str, listen: &str) -> Vec<String> {
    [
        "serve",
        "--core",
        core,
        "--mailbox",
        mailbox,
        "--shards",
        &SHARDS.to_string(),
        "--listen",
        listen,
        "--dev-auth",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn epochs(mb: &str) -> Vec<u64> {
    let mut st = Store::connect(mb, Layout::PackedV2).await.unwrap();
    let mut out = Vec::new();
    for s in 0..SHARDS {
        out.push(st.read_watermark(s).await.unwrap().epoch);
    }
    out
}

/// Runs `tidemark` with `args` to completion (it must exit within 30 s).
fn run_to_exit(args: &[String]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = support::spawn_killed_with_us(&mut cmd);
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_that_cannot_start_fences_nobody() {
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let port = tidemark_redis_proc::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(serve_args(&core.url(), &mailbox.url(), &listen))
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut running = support::spawn_killed_with_us(&mut cmd);
    let start = Instant::now();
    while support::http_get(port, "/healthz").0 != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "serve did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = epochs(&mailbox.url()).await;

    // 1. the listen address is taken
    let out = run_to_exit(&serve_args(&core.url(), &mailbox.url(), &listen));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&listen), "names the address: {err}");
    assert_eq!(epochs(&mailbox.url()).await, before, "no epoch raised");

    // 2. a mailbox Redis that does not answer
    let nobody = format!(
        "redis://127.0.0.1:{}/",
        tidemark_redis_proc::free_port().unwrap()
    );
    let free = format!("127.0.0.1:{}", tidemark_redis_proc::free_port().unwrap());
    let mut args = serve_args(&core.url(), &format!("{},{nobody}", mailbox.url()), &free);
    // same shard count, two mailbox instances: shards of the dead one cannot be checked
    args.extend(["--layout".into(), "packed-v2".into()]);
    let out = run_to_exit(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(nobody.trim_end_matches('/')),
        "names the Redis: {err}"
    );
    assert_eq!(epochs(&mailbox.url()).await, before, "no epoch raised");

    // 3. an owned shard that does not exist: an error, not a panic
    let mut args = serve_args(&core.url(), &mailbox.url(), &free);
    args.extend(["--own-shards".into(), "9".into()]);
    let out = run_to_exit(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("shard 9"), "{err}");
    assert_eq!(epochs(&mailbox.url()).await, before, "no epoch raised");

    // the running owner still owns every shard
    assert_eq!(support::http_get(port, "/healthz").0, 200);
    let _ = running.kill();
    let _ = running.wait();
}
