//! Start-up never hurts a running deployment: a second `tidemark serve` that cannot start
//! (its listen address is taken, a Redis does not answer, an owned shard does not exist)
//! exits with an error naming what failed, and raises no shard's epoch, so the running owner
//! keeps delivering.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::tidemark;
use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

const SHARDS: u32 = 4;

fn serve_args(core: &str, mailbox: &str, listen: &str) -> Vec<String> {
    support::serve_args(core, mailbox, SHARDS, listen)
}

async fn epochs(mb: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for s in 0..SHARDS {
        out.push(support::watermark(mb, s).await.epoch);
    }
    out
}

/// Runs `tidemark` with `args` to completion (it must exit within 30 s).
/// The shards' epochs once they stop moving. In leases mode (the default) a started node
/// claims its shards, then claims each again when its worker restarts on winning the lease,
/// within a lease tick (1 s by default): healthy does not mean that has happened. Read
/// twice, 1.5 s apart, until both agree (at most 30 s).
async fn settled_epochs(mb: &str) -> Vec<u64> {
    let start = Instant::now();
    let mut last = epochs(mb).await;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = epochs(mb).await;
        if now == last {
            return now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "epochs keep moving: {now:?}"
        );
        last = now;
    }
}

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
    let (core, mailbox) = support::redis_pair();
    let port = tidemark_redis_proc::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let mut running = support::serve_healthy(&core.url(), &mailbox.url(), SHARDS, port).await;
    let before = settled_epochs(&mailbox.url()).await;

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

async fn wm_keys(url: &str) -> Vec<u32> {
    let c = redis::Client::open(url).unwrap();
    let mut conn = c.get_multiplexed_async_connection().await.unwrap();
    tidemark_store::deployment::watermark_shards(&mut conn)
        .await
        .unwrap()
}

/// Issue 10, item 2: the shard count and the tables are recorded in every instance at first
/// start; a process with another shard count is refused before it writes anything, and so is
/// one that meets watermarks its topology does not place on an instance (deployments created
/// before identities existed). `wm verify` reports what does not belong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_shard_count_is_refused_and_writes_nothing() {
    let core = RedisProcess::start().unwrap();
    let mb0 = RedisProcess::start().unwrap();
    let mb1 = RedisProcess::start().unwrap();
    let mailboxes = format!("{},{}", mb0.url(), mb1.url());
    let port = tidemark_redis_proc::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    // an 8-shard deployment over two mailbox instances
    let mut args = serve_args(&core.url(), &mailboxes, &listen);
    let i = args.iter().position(|a| a == "--shards").unwrap();
    args[i + 1] = "8".into();
    let mut first = support::spawn_healthy(&args, port).await;
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(wm_keys(&mb0.url()).await, vec![0, 1, 2, 3]);
    assert_eq!(wm_keys(&mb1.url()).await, vec![4, 5, 6, 7]);

    // the same instances with 16 shards: refused, nothing created
    args[i + 1] = "16".into();
    let out = run_to_exit(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("deployment mismatch") && err.contains("created with 8 shards"),
        "{err}"
    );
    assert_eq!(wm_keys(&mb0.url()).await, vec![0, 1, 2, 3]);
    assert_eq!(wm_keys(&mb1.url()).await, vec![4, 5, 6, 7]);
    // the instances swapped: refused too
    let mut swapped = args.clone();
    swapped[i + 1] = "8".into();
    let j = swapped.iter().position(|a| a == "--mailbox").unwrap();
    swapped[j + 1] = format!("{},{}", mb1.url(), mb0.url());
    let out = run_to_exit(&swapped);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("mailbox instance 0"));

    // advice for a missing watermark says what the instance is
    let inspect = |url: &str, shard: &str| {
        let out = tidemark(&["wm", "inspect", "--redis", url, "--shard", shard]);
        assert_eq!(out.status.code(), Some(4));
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = inspect(&core.url(), "2");
    assert!(err.contains("is core instance 0"), "{err}");
    assert!(!err.contains("wm init"), "{err}");
    let err = inspect(&mb0.url(), "5");
    assert!(
        err.contains("holds shards 0-3; shard 5 lives on another mailbox instance"),
        "{err}"
    );
    let err = inspect(&mb0.url(), "12");
    assert!(err.contains("there is no shard 12"), "{err}");

    // a deployment from before identities: its watermarks decide
    let legacy = RedisProcess::start().unwrap();
    let legacy_core = RedisProcess::start().unwrap();
    support::init_watermarks(&legacy.url(), 8).await;
    let out = run_to_exit(&serve_args(&legacy_core.url(), &legacy.url(), &listen));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("shards 4-7"), "{err}");

    // wm verify: a core instance is named as such; a stray watermark is reported
    let out = tidemark(&["wm", "verify", "--redis", &core.url()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("core instance 0"));
    let mut st = MailboxStore::connect(&mb0.url(), Layout::PackedV2)
        .await
        .unwrap();
    st.init_watermark(6, Layout::PackedV2, 1, 0, false)
        .await
        .unwrap();
    let out = tidemark(&["wm", "verify", "--redis", &mailboxes]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(text.contains("wm:{6} does not belong here"), "{text}");
}

/// ADR-0055: the identity version belongs to the deployment. A core instance that lost its
/// identity (wiped, restarted empty) in a deployment of version 2 gets version 2 again, not
/// this code's 3: with 3 there, this code would write packed log records to it while code
/// that cannot read them may still run on the rest. Its records stay in the six-field form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_lost_its_identity_gets_the_deployments_version() {
    use redis::AsyncCommands;
    use tidemark_store::deployment::KEY;
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let port = tidemark_redis_proc::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let args = serve_args(&core.url(), &mailbox.url(), &listen);
    let mut first = support::spawn_healthy(&args, port).await;
    let _ = first.kill();
    let _ = first.wait();
    let conn = |url: String| async move {
        let c = redis::Client::open(url).unwrap();
        c.get_multiplexed_async_connection().await.unwrap()
    };
    let (mut c, mut m) = (conn(core.url()).await, conn(mailbox.url()).await);
    let version = |v: Option<String>| v.unwrap_or_default();
    let v: Option<String> = c.hget(KEY, "version").await.unwrap();
    assert_eq!(
        version(v),
        "3",
        "a new deployment is of this code's version"
    );
    // a deployment of version 2 (created by older code) whose core instance lost everything
    let () = m.hset(KEY, "version", "2").await.unwrap();
    let () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    let mut again = support::spawn_healthy(&args, port).await;
    let _ = again.kill();
    let _ = again.wait();
    let v: Option<String> = c.hget(KEY, "version").await.unwrap();
    assert_eq!(version(v), "2", "the deployment's version, not this code's");
    let mut log = tidemark_store::redis::dlog::LogStore::connect(&core.url())
        .await
        .unwrap();
    assert!(!log.packed_records(), "six-field records on that instance");
    let c1 = log
        .commit(0, "alice", "m-1", &["bob"], "hi", 1, 60)
        .await
        .unwrap();
    let names = support::record_fields(&core.url(), 0, c1.offset);
    assert_eq!(names, ["p", "f", "c", "r", "b", "t"]);
}

/// Issue 10, item 2: unknown keys in the config file are errors; `--layout` with `--config`
/// is an error; `up --layout packed-v1` on a packed-v2 data dir is refused.
#[test]
fn configuration_mistakes_are_refused() {
    let dir = support::temp_dir("startup");
    let cfg = dir.join("deploy.toml");
    std::fs::write(
        &cfg,
        "shards = 4\ncore = [\"redis://127.0.0.1:1/\"]\nmailbox = [\"redis://127.0.0.1:1/\"]\n\
         mailbox_of_shards = [0, 0, 0, 0]\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let out = tidemark(&["serve", "--config", cfg, "--dev-auth"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown field `mailbox_of_shards`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tidemark(&[
        "serve",
        "--config",
        cfg,
        "--layout",
        "packed-v1",
        "--dev-auth",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--layout"));
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(
        // the earlier name of up's state file: still read (and renamed to up.toml)
        data.join("deployment.toml"),
        "shards = 4\ncore = 1\nmailbox = 1\nlayout = \"packed-v2\"\n",
    )
    .unwrap();
    let mut up = vec!["up", "--data-dir", data.to_str().unwrap(), "--shards", "4"];
    up.extend([
        "--layout",
        "packed-v1",
        "--dev-auth",
        "--listen",
        "127.0.0.1:0",
    ]);
    let out = tidemark(&up);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("wm downgrade"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 10, item 4: a corrupt watermark stops only its shard: `serve` starts, materialises
/// every other shard, and reports the corrupt one in `/healthz` (503) and `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_shard_stops_only_itself() {
    use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};
    let (core, mailbox) = support::redis_pair();
    let mut st = support::init_watermarks(&mailbox.url(), SHARDS).await;
    let mut conn = st.connection();
    let _: () = redis::AsyncCommands::hset(&mut conn, "wm:{1}", "wm_blob", "short")
        .await
        .unwrap();
    let port = tidemark_redis_proc::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let mut child = support::spawn_quiet(&serve_args(&core.url(), &mailbox.url(), &listen));
    let start = Instant::now();
    let body = loop {
        let (status, body) = support::http_get(port, "/healthz");
        // the other shards may be briefly `starting` again: in leases mode a worker restarts
        // when its lease is won, after the first claim (a slow box shows it)
        if status == 503 && body.contains("shard 1: Corrupt") && body.lines().count() == 1 {
            break body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no 503 naming shard 1 alone: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(body.lines().count(), 1, "only shard 1: {body}");
    // sends to the corrupt shard are refused before anything commits (issue 10, item 4); a
    // send to it and another shard is refused whole, and the other shard commits nothing
    // either (a send to several shards takes the grouped path, ADR-0081)
    let user_on = |shard| {
        (0..)
            .map(|i| format!("u{i}"))
            .find(|u| support::route(u, SHARDS).shard == shard)
            .unwrap()
    };
    let (on_shard_1, on_shard_2) = (user_on(1), user_on(2));
    for (id, to) in [
        ("c-1", format!(r#""{on_shard_1}""#)),
        ("c-2", format!(r#""{on_shard_2}","{on_shard_1}""#)),
    ] {
        let (status, body) = support::http_post(
            port,
            "/v1/messages?user=alice",
            &format!(r#"{{"id":"{id}","to":[{to}],"body":"x"}}"#),
        );
        assert_eq!(status, 503, "{id}: {body}");
        assert!(body.contains("shard_unavailable"), "{id}: {body}");
        assert!(body.contains("shard 1 is stopped"), "{id}: {body}");
    }
    let mut commits = LogStore::connect(&core.url()).await.unwrap();
    assert_eq!(
        commits.head(1).await.unwrap(),
        0,
        "nothing committed to shard 1"
    );
    assert_eq!(
        commits.head(2).await.unwrap(),
        0,
        "nothing committed to shard 2"
    );
    commits
        .commit(0, "a", "m1", &["bob"], "hi", 1, DEFAULT_DEDUPE_TTL_S)
        .await
        .unwrap();
    let start = Instant::now();
    while st.read_watermark(0).await.unwrap().lanes.min_present_w() != Some(1) {
        assert!(start.elapsed() < Duration::from_secs(10), "shard 0 runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, metrics) = support::http_get(port, "/metrics");
    assert!(
        metrics.contains("tidemark_shard_running{shard=\"1\"} 0"),
        "{metrics}"
    );
    assert!(metrics.contains("tidemark_shard_running{shard=\"0\"} 1"));
    // issue 10, item 7: a stopped shard's head and lag stay live; counters exist at zero from
    // the start; every metric has a HELP line; build info
    commits
        .commit(1, "a", "m2", &["x"], "waits", 1, DEFAULT_DEDUPE_TTL_S)
        .await
        .unwrap();
    let start = Instant::now();
    let metrics = loop {
        let (_, m) = support::http_get(port, "/metrics");
        if m.contains("tidemark_shard_lag{shard=\"1\"} 1") {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "lag of the stopped shard: {m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        metrics.contains("tidemark_shard_head{shard=\"1\"} 1"),
        "{metrics}"
    );
    for line in [
        "tidemark_gaps_total 0",
        "tidemark_shard_fenced_total 0",
        "tidemark_task_restarts_total{task=\"materializer\",reason=\"panic\"} 0",
        "# HELP tidemark_shard_lag ",
        "tidemark_build_info{version=",
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    for l in metrics.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = l.split_whitespace().nth(2).unwrap();
        assert!(
            metrics.contains(&format!("# HELP {name} ")),
            "no HELP for {name}"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Issue 10, item 6: `wm downgrade` refuses shards whose owner is live and holds the epoch
/// (it would write packed-v2 again right after); a fenced shard, `--force-offline`, or a
/// stopped owner (its marks removed on a clean stop) let it through. `--all` lists what it
/// converted and what it skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downgrade_refuses_a_live_owner() {
    let (core, mailbox) = support::redis_pair();
    let port = tidemark_redis_proc::free_port().unwrap();
    let mut owner = support::serve_healthy(&core.url(), &mailbox.url(), SHARDS, port).await;
    // the owner refreshes its marks once a second
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mb = mailbox.url();
    let layout = |s: u32| {
        let mb = mb.clone();
        async move { support::watermark(&mb, s).await.layout }
    };
    let out = tidemark(&["wm", "downgrade", "--redis", &mb, "--all"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("0 converted, 4 skipped"), "{text}");
    assert!(
        text.contains("shard 0: skipped: a live owner holds epoch"),
        "{text}"
    );
    assert_eq!(layout(0).await, Layout::PackedV2);
    // fenced: the owner can no longer write, the downgrade goes through
    assert!(
        tidemark(&["shard", "fence", "--redis", &mb, "--shard", "0"])
            .status
            .success()
    );
    let out = tidemark(&["wm", "downgrade", "--redis", &mb, "--shard", "0"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(layout(0).await, Layout::PackedV1);
    // --force-offline: converted, with a warning
    let out = tidemark(&[
        "wm",
        "downgrade",
        "--redis",
        &mb,
        "--shard",
        "1",
        "--force-offline",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: --force-offline"));
    // a clean stop removes the marks: the rest converts at once
    unsafe { libc::kill(owner.id() as i32, libc::SIGTERM) };
    let _ = owner.wait();
    let out = tidemark(&["wm", "downgrade", "--redis", &mb, "--all"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("4 converted, 0 skipped"), "{text}");
}

/// Issue 10, polish: logs carry no ANSI colours when stderr is not a terminal, and in JSON
/// mode every line on stderr is a JSON object (the exit error too).
#[test]
fn logs_are_plain_or_json_only() {
    let nobody = format!(
        "redis://127.0.0.1:{}/",
        tidemark_redis_proc::free_port().unwrap()
    );
    let listen = format!("127.0.0.1:{}", tidemark_redis_proc::free_port().unwrap());
    for json in [false, true] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args(serve_args(&nobody, &nobody, &listen))
            .env("RUST_LOG", "info");
        if json {
            cmd.env("TIDEMARK_LOG_FORMAT", "json");
        }
        let out = cmd.output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains('\u{1b}'), "ANSI escape in {err}");
        assert!(!err.trim().is_empty());
        if json {
            for line in err.lines() {
                let v: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                assert!(v.get("level").is_some(), "{line}");
            }
            assert!(err.contains("exiting"), "{err}");
        } else {
            assert!(err.contains("error: "), "{err}");
        }
    }
}

/// Issue 10, starter kit: `tidemark secret gen` writes a fresh secret (0600, 64 hex digits)
/// that `token` accepts, and never overwrites an existing file.
#[test]
fn secret_gen_writes_a_private_secret_once() {
    use std::os::unix::fs::PermissionsExt;
    let dir = support::temp_dir("secret-gen");
    let path = dir.join("token.secret");
    let _ = std::fs::remove_file(&path);
    let gen = || tidemark(&["secret", "gen", "--out", path.to_str().unwrap()]);
    let out = gen();
    assert!(out.status.success(), "{out:?}");
    let secret = std::fs::read_to_string(&path).unwrap();
    assert_eq!(secret.len(), 64);
    assert!(secret.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let out = gen();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("never overwritten"));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), secret);
    let out = tidemark(&[
        "token",
        "--user",
        "bob",
        "--secret-file",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
