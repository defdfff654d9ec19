//! Secure defaults of the `tidemark` binary (issue 9, ADR-0024), run as a real process: the
//! token secret rule (exit 2, nothing started), file modes of `up`'s data dir, `up`'s
//! password-protected redis-servers, `token --ttl` bounds, and `--dev-auth` on a public
//! address.

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::{cli as tidemark, free_port, http_get, listening, run, serve_cmd, UpProc};

const GOOD_SECRET: &str = "0123456789abcdef0123456789abcdef";

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Pids of the redis-server processes whose working directory is inside `dir` (redis-server
/// rewrites its command line, so the working directory is what ties it to a data dir).
fn redis_servers_in(dir: &Path) -> Vec<u32> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != "redis-server" {
            continue;
        }
        if let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) {
            if cwd.starts_with(&dir) {
                found.push(pid);
            }
        }
    }
    found
}

fn assert_refused(o: &Output, what: &str, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{what}: {err}");
    assert!(err.contains(needle), "{what}: {err}");
}

#[test]
fn serve_refuses_an_empty_or_short_secret() {
    let dir = tempfile::tempdir().unwrap();
    // no Redis behind these: a serve that got past the secret would fail with exit 1
    let core = format!("redis://127.0.0.1:{}/", free_port());
    let mailbox = format!("redis://127.0.0.1:{}/", free_port());
    let listen = free_port();
    let serve = || {
        let mut cmd = serve_cmd(&core, &mailbox);
        cmd.args(["--listen", &format!("127.0.0.1:{listen}")]);
        cmd
    };
    let blank = dir.path().join("blank.secret");
    std::fs::write(&blank, " \n\t \n").unwrap();
    let short = dir.path().join("short.secret");
    std::fs::write(&short, format!("{}\n", &GOOD_SECRET[1..])).unwrap();
    // (what, TIDEMARK_TOKEN_SECRET, --secret-file, --dev-auth)
    let cases: [(&str, Option<&str>, Option<&Path>, bool); 5] = [
        ("empty TIDEMARK_TOKEN_SECRET", Some(""), None, false),
        (
            "empty TIDEMARK_TOKEN_SECRET, --dev-auth",
            Some(""),
            None,
            true,
        ),
        (
            "whitespace TIDEMARK_TOKEN_SECRET",
            Some("   \n"),
            None,
            false,
        ),
        ("whitespace-only --secret-file", None, Some(&blank), false),
        ("31-byte --secret-file", None, Some(&short), false),
    ];
    for (what, env, file, dev_auth) in cases {
        let mut cmd = serve();
        if let Some(v) = env {
            cmd.env("TIDEMARK_TOKEN_SECRET", v);
        }
        if let Some(f) = file {
            cmd.arg("--secret-file").arg(f);
        }
        if dev_auth {
            cmd.arg("--dev-auth");
        }
        let o = run(&mut cmd);
        assert_refused(&o, what, "token secret");
        assert!(stderr(&o).contains("at least 32"), "{what}: {}", stderr(&o));
        assert!(!listening(listen), "{what}: something listens on {listen}");
    }
    // no secret at all and no --dev-auth: refused too
    assert_refused(&run(&mut serve()), "no secret", "no token secret");
    // a 32-byte secret passes the check (and then fails on the missing Redis: exit 1)
    let ok = dir.path().join("ok.secret");
    std::fs::write(&ok, format!("  {GOOD_SECRET}\n")).unwrap();
    let o = run(serve().arg("--secret-file").arg(&ok));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn token_refuses_an_empty_or_short_secret() {
    let o = run(tidemark()
        .args(["token", "--user", "alice"])
        .env("TIDEMARK_TOKEN_SECRET", ""));
    assert_refused(&o, "empty env", "at least 32");
    assert!(o.stdout.is_empty());
    let o = run(tidemark().args(["token", "--user", "alice"]));
    assert_refused(&o, "no secret", "TIDEMARK_TOKEN_SECRET");
    // the same secret, however it is padded, mints the same token
    let a = run(tidemark()
        .args(["token", "--user", "alice", "--ttl", "1h"])
        .env("TIDEMARK_TOKEN_SECRET", format!("{GOOD_SECRET}\n")));
    assert!(a.status.success(), "{}", stderr(&a));
    let token = String::from_utf8(a.stdout).unwrap();
    let claims = tidemark_protocol::token::verify(GOOD_SECRET.as_bytes(), token.trim(), 0).unwrap();
    assert_eq!(claims.user, "alice");
    assert!(!claims.admin);
    // --admin: an admin token, for `admin` unless --user names another
    for (args, user) in [
        (&["--admin"][..], "admin"),
        (&["--admin", "--user", "ops"][..], "ops"),
    ] {
        let o = run(tidemark()
            .arg("token")
            .args(args)
            .env("TIDEMARK_TOKEN_SECRET", GOOD_SECRET));
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let token = String::from_utf8(o.stdout).unwrap();
        let claims =
            tidemark_protocol::token::verify(GOOD_SECRET.as_bytes(), token.trim(), 0).unwrap();
        assert_eq!(
            (claims.user.as_str(), claims.admin),
            (user, true),
            "{args:?}"
        );
    }
    // a user token needs --user
    let o = run(tidemark()
        .arg("token")
        .env("TIDEMARK_TOKEN_SECRET", GOOD_SECRET));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--user"), "{}", stderr(&o));
}

#[test]
fn up_refuses_an_existing_empty_token_secret() {
    for content in ["", " \n\t\n", &GOOD_SECRET[..31]] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("token.secret"), content).unwrap();
        let listen = free_port();
        let o = run(tidemark()
            .args(["up", "--shards", "2", "--listen"])
            .arg(format!("127.0.0.1:{listen}"))
            .arg("--data-dir")
            .arg(&data));
        assert_refused(&o, &format!("token.secret {content:?}"), "at least 32");
        assert!(!listening(listen));
        assert!(redis_servers_in(&data).is_empty());
        assert!(!data.join("core-0").exists(), "a redis-server was started");
        // the file is left as it was (never rewritten)
        assert_eq!(
            std::fs::read_to_string(data.join("token.secret")).unwrap(),
            content
        );
    }
}

#[test]
fn token_ttl_overflow_and_zero_are_refused() {
    let mint = |ttl: &str| {
        run(tidemark()
            .args(["token", "--user", "alice", "--ttl", ttl])
            .env("TIDEMARK_TOKEN_SECRET", GOOD_SECRET))
    };
    for (ttl, needle) in [
        ("213503982334602d", "too large"),
        ("18446744073709551616", "too large"),
        ("0", "0"),
        ("0d", "0"),
        ("1.5h", "not a duration"),
        // fits u64 seconds, but now + ttl does not
        ("18446744073709551615", "largest expiry"),
    ] {
        let o = mint(ttl);
        assert_refused(&o, ttl, needle);
        assert!(o.stdout.is_empty(), "{ttl}: a token was printed");
    }
    // the largest number of days that does not overflow u64 seconds still overflows the expiry
    assert_refused(&mint("213503982334601d"), "max days", "largest expiry");
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    // the token's clock runs between these two readings (a second may turn while it mints)
    let before = unix_now();
    let o = mint("7d");
    let now = unix_now();
    assert!(o.status.success(), "{}", stderr(&o));
    let token = String::from_utf8(o.stdout).unwrap();
    let claims =
        tidemark_protocol::token::verify(GOOD_SECRET.as_bytes(), token.trim(), now).unwrap();
    let exp = claims.expires_at_unix;
    assert!(
        (before + 7 * 86400..=now + 7 * 86400).contains(&exp),
        "expiry {exp} not 7 days after minting ({before}..={now})"
    );
}

#[test]
fn dev_auth_on_a_public_address_needs_dev_auth_public() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let core = format!("redis://127.0.0.1:{}/", free_port());
    let serve = |listen: &str, extra: &[&str]| {
        run(serve_cmd(&core, &core)
            .args(["--listen", listen, "--dev-auth"])
            .args(extra))
    };
    let port = free_port();
    for listen in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
        let o = serve(&listen, &[]);
        assert_refused(&o, &listen, "--dev-auth-public");
        assert!(!listening(port));
        let o = run(tidemark()
            .args(["up", "--dev-auth", "--listen", &listen, "--data-dir"])
            .arg(&data));
        assert_refused(&o, &listen, "--dev-auth-public");
        assert!(!data.exists(), "up created its data dir");
        assert!(redis_servers_in(dir.path()).is_empty());
    }
    // with --dev-auth-public: a warning, then it goes on (and fails on the missing Redis)
    let o = serve(&format!("0.0.0.0:{port}"), &["--dev-auth-public"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("warning: --dev-auth-public"),
        "{}",
        stderr(&o)
    );
    // loopback addresses need nothing more, and print no warning
    for listen in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
        let o = serve(&listen, &[]);
        assert_eq!(o.status.code(), Some(1), "{listen}: {}", stderr(&o));
        assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    }
    // --dev-auth-public alone is a usage error
    let o = run(serve_cmd(&core, &core).arg("--dev-auth-public"));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

/// Every path under `dir` (itself included) with its mode.
fn modes_under(dir: &Path) -> Vec<(std::path::PathBuf, u32)> {
    let mut out = vec![(dir.to_path_buf(), mode(dir))];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(modes_under(&e.path()));
        } else {
            out.push((e.path(), mode(&e.path())));
        }
    }
    out
}

fn set_mode(p: &Path, m: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

#[test]
fn up_keeps_its_data_dir_private() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // a fresh data dir: 0700, every file 0600, every directory 0700 (redis-server's too)
    let up = UpProc::start(&data, &[]);
    assert!(up.line("gateway").contains("ws://127.0.0.1:"));
    let all = modes_under(&data);
    let stderr = up.stop();
    assert!(!stderr.contains("note:"), "{stderr}");
    for name in [
        "token.secret",
        "up.toml",
        "tidemark.toml",
        "core-0",
        "mailbox-0",
    ] {
        assert!(
            all.iter().any(|(p, _)| p.ends_with(name)),
            "no {name}: {all:?}"
        );
    }
    assert!(
        all.iter().any(|(p, _)| p.ends_with("appendonlydir")),
        "{all:?}"
    );
    for (p, m) in &all {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(*m, want, "{} is {m:04o}", p.display());
    }

    // loosened by hand (or made by an older version): the next `up` tightens and says so
    let aof = data.join("core-0/appendonlydir");
    let loose = [
        (data.clone(), 0o755),
        (data.join("token.secret"), 0o644),
        (aof.clone(), 0o755),
        (data.join("mailbox-0"), 0o750),
    ];
    for (p, m) in &loose {
        set_mode(p, *m);
    }
    let aof_file = std::fs::read_dir(&aof)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    set_mode(&aof_file, 0o664);
    let up = UpProc::start(&data, &[]);
    let stderr = up.stop();
    assert!(
        stderr.contains("removed group/other access from 5 path(s)"),
        "{stderr}"
    );
    assert!(stderr.contains("token.secret 0644 -> 0600"), "{stderr}");
    for (p, m) in modes_under(&data) {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(m, want, "{} is {m:04o}", p.display());
    }
    // and a third start has nothing to say
    let up = UpProc::start(&data, &[]);
    let stderr = up.stop();
    assert!(!stderr.contains("note:"), "{stderr}");
}

/// One inline command on a fresh connection; every reply byte until `n` lines came back.
fn redis_raw(port: u16, commands: &str, n: usize) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(commands.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while got.iter().filter(|&&b| b == b'\n').count() < n {
        let k = s.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        got.extend_from_slice(&buf[..k]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn up_redis_servers_require_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // a relative --data-dir, as scripts/run.sh runs it (./data)
    // logging at info: the lines that name instances (claimed shards, …) must redact too
    let up = UpProc::start_logged(
        dir.path(),
        "127.0.0.1:0",
        Path::new("data"),
        &["--dev-auth"],
        "info",
    );
    let pass = std::fs::read_to_string(data.join("redis.pass")).unwrap();
    assert_eq!(pass.len(), 64, "{pass:?}");
    assert_eq!(mode(&data.join("redis.pass")), 0o600);
    let printed = up.lines.join("\n");
    assert!(
        !printed.contains(&pass),
        "up printed the password:\n{printed}"
    );
    // the workers have claimed (their log line names the core instance) by the time up has
    // printed its endpoints; stderr is read by another thread: wait for the line to arrive
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !up.stderr().contains("claimed shards") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let logged = up.stderr();
    assert!(logged.contains("claimed shards"), "{logged}");
    assert!(!logged.contains(&pass), "up logged the password:\n{logged}");
    let (core, mailbox) = (up.port("core     0"), up.port("mailbox  0"));
    let gw = up.port("gateway");

    // any local process without the password: NOAUTH, on every instance
    for port in [core, mailbox] {
        let r = redis_raw(port, "PING\r\nKEYS *\r\nCONFIG GET dir\r\n", 3);
        assert_eq!(r.matches("-NOAUTH").count(), 3, "{port}: {r}");
        let r = redis_raw(port, &format!("AUTH {pass}\r\nPING\r\n"), 2);
        assert_eq!(r, "+OK\r\n+PONG\r\n");
    }
    // the password is on no command line
    let pids = redis_servers_in(&data);
    assert_eq!(pids.len(), 2, "{pids:?}");
    for pid in &pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains(&pass));
    }
    // the commands up prints work as printed
    let sh = |line: &str| {
        run(Command::new("sh")
            .arg("-c")
            .arg(line)
            .current_dir(dir.path()))
    };
    let cli = up.containing("redis-cli");
    let o = sh(&format!("{cli} PING"));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "PONG",
        "{cli}: {}",
        stderr(&o)
    );
    let verify = up.containing("tidemark wm verify");
    let verify = verify.replacen("tidemark", env!("CARGO_BIN_EXE_tidemark"), 1);
    let o = sh(&verify);
    assert!(o.status.success(), "{verify}: {}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("2 watermark(s) checked, 0 problem(s)"));

    // Tidemark end to end: a token minted from up's secret, a send, the mailbox, a trace
    let ws = format!("ws://127.0.0.1:{gw}/v1/ws");
    let o = run(tidemark()
        .args(["token", "--user", "alice", "--secret-file"])
        .arg(data.join("token.secret")));
    assert!(o.status.success(), "{}", stderr(&o));
    let token = String::from_utf8(o.stdout).unwrap().trim().to_string();
    let o = run(tidemark().args([
        "send",
        "--url",
        &ws,
        "--token",
        &token,
        "--to",
        "bob",
        "hello bob",
    ]));
    assert!(o.status.success(), "{}", stderr(&o));
    // "sent <id>: shard S offset O"
    let sent = String::from_utf8(o.stdout).unwrap();
    let words: Vec<&str> = sent.split_whitespace().collect();
    let (shard, offset) = (words[3].trim_end_matches(','), words[5]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = http_get(gw, "/v1/mailbox?user=bob");
        if status == 200 && body.contains("hello bob") {
            break;
        }
        assert!(Instant::now() < deadline, "not delivered: {status} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(http_get(gw, "/healthz").0, 200);
    let url = |port: u16| format!("redis://:{pass}@127.0.0.1:{port}/");
    // `tidemark trace` of the message, its instances given by `with`: materialised
    let traced = |with: &[&str]| {
        let at = ["--shard", shard, "--offset", offset];
        let o = run(tidemark().arg("trace").args(with).args(at));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{out}{}", stderr(&o));
        assert!(out.contains("materialised, entry present"), "{out}");
        out
    };
    let (core_url, mailbox_url) = (url(core), url(mailbox));
    let out = traced(&[
        "--core",
        &core_url,
        "--mailbox",
        &mailbox_url,
        "--shards",
        "2",
    ]);
    assert!(!out.contains(&pass), "trace printed the password:\n{out}");
    assert!(out.contains(":***@127.0.0.1"), "{out}");
    let o = run(tidemark().args(["wm", "inspect", "--redis", &url(mailbox), "--shard", shard]));
    assert!(o.status.success(), "{}", stderr(&o));
    // the topology up runs, for read-only tools (issue 10: trace --config on the data dir)
    let topo = data.join("tidemark.toml");
    assert_eq!(mode(&topo), 0o600);
    traced(&["--config", topo.to_str().unwrap()]);
    // without the password the tools are refused
    let o = run(tidemark().args([
        "wm",
        "verify",
        "--redis",
        &format!("redis://127.0.0.1:{mailbox}/"),
    ]));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("NOAUTH") || stderr(&o).contains("uthentication"),
        "{}",
        stderr(&o)
    );
    up.stop();
    assert!(
        redis_servers_in(&data).is_empty(),
        "redis-servers left behind"
    );

    // the next `up` of the dir reuses the password (and the data), here on a public address
    let up = UpProc::start_in(
        dir.path(),
        "0.0.0.0:0",
        &data,
        &["--dev-auth", "--dev-auth-public"],
    );
    assert!(
        up.stderr().contains("warning: --dev-auth-public"),
        "{}",
        up.stderr()
    );
    assert_eq!(
        std::fs::read_to_string(data.join("redis.pass")).unwrap(),
        pass
    );
    let mailbox = up.port("mailbox  0");
    let r = redis_raw(mailbox, &format!("AUTH {pass}\r\nPING\r\n"), 2);
    assert_eq!(r, "+OK\r\n+PONG\r\n");
    let gw = up.port("gateway");
    let (status, body) = http_get(gw, "/v1/mailbox?user=bob");
    assert!(
        status == 200 && body.contains("hello bob"),
        "{status} {body}"
    );
    up.stop();
}
