//! `tidemark wm …` and `tidemark shard fence` as a user runs them, against a real redis-server.

mod support;

use support::{redis_cmd, tidemark};
use tidemark_redis_proc::RedisProcess;

#[test]
fn init_inspect_downgrade_verify_fence() {
    let r = RedisProcess::start().unwrap();
    let url = r.url();
    let out = tidemark(&["wm", "init", "--redis", &url, "--shards", "4"]);
    assert!(out.status.success(), "{out:?}");
    // never overwrites, and never suggests --force: a partly initialised deployment gets
    // only what is missing
    let out = tidemark(&["wm", "init", "--redis", &url, "--shards", "6"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("initialised 2 shard(s)") && text.contains("4 already had a watermark"),
        "{text}"
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("--force"));
    let out = tidemark(&[
        "wm", "init", "--redis", &url, "--shards", "4", "--force", "--epoch", "5",
    ]);
    assert!(out.status.success());

    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "2", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shard"], 2);
    assert_eq!(v["layout"], "packed-v2");
    assert_eq!(v["epoch"], 5);
    assert_eq!(v["uniform"], true);
    let lanes = v["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 64);
    assert_eq!(lanes[63]["lane"], 63);
    assert_eq!(lanes[0]["presence"], 1);
    assert_eq!(lanes[0]["w"], 0);

    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("packed-v2") && text.contains("uniform"),
        "{text}"
    );

    // downgrade one shard: 1216 bytes, packed-v1
    let out = tidemark(&["wm", "downgrade", "--redis", &url, "--shard", "1"]);
    assert!(out.status.success(), "{out:?}");
    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["layout"], "packed-v1");
    assert_eq!(
        redis_cmd(&url, &["HSTRLEN", "wm:{1}", "wm_blob"]),
        redis::Value::Int(1216)
    );

    // fence raises the epoch
    let out = tidemark(&["shard", "fence", "--redis", &url, "--shard", "0"]);
    assert!(out.status.success(), "{out:?}");
    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "0", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["epoch"], 6);

    let out = tidemark(&["wm", "verify", "--redis", &url]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("6 watermark(s) checked, 0 problem(s)"));

    // corrupt: exit 3, one stderr line starting with corrupt: naming the cause
    redis_cmd(&url, &["HSET", "wm:{3}", "wm_blob", "short"]);
    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "3"]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("corrupt:") && err.contains("bad_length"),
        "{err}"
    );
    let out = tidemark(&["wm", "verify", "--redis", &url]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("shard 3"));
    let out = tidemark(&["wm", "downgrade", "--redis", &url, "--shard", "3"]);
    assert_eq!(out.status.code(), Some(3));

    // missing: another non-zero status, clear message
    let out = tidemark(&["wm", "inspect", "--redis", &url, "--shard", "9"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no watermark"));
}
