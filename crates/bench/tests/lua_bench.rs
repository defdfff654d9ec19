//! The Lua micro-benchmark against a real redis-server, with small counts: the report is
//! well-formed (every script in both layouts, positive figures, the JSON shape). Speed is
//! never asserted. The full default run is the ignored test `full_run`:
//! `cargo test -p tidemark-bench --release --test lua_bench -- --ignored --nocapture full_run`.

use std::collections::BTreeMap;

use tidemark_bench::lua::{self, LuaBenchOptions};
use tidemark_redis_proc::RedisProcess;

const SCRIPTS: [&str; 5] = [
    "materialize_fresh_single_recipient",
    "advance_log_watermark",
    "advance_log_watermarks",
    "read_log_watermarks",
    "gc_completed_dispatch",
];
const CHECKS: [&str; 4] = ["two_sub", "rep", "byte_loop", "length"];

/// The keys of a report map, in order.
fn keys<V>(m: &BTreeMap<String, V>) -> Vec<&str> {
    m.keys().map(String::as_str).collect()
}

/// `names` sorted (the order of a map's keys).
fn sorted<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let mut v = names.to_vec();
    v.sort();
    v
}

fn small(redis_url: Option<String>) -> LuaBenchOptions {
    LuaBenchOptions {
        redis_url,
        calls_per_round: 500,
        rounds: 2,
    }
}

#[test]
fn defaults() {
    let o = LuaBenchOptions::default();
    assert_eq!(o.redis_url, None);
    assert_eq!(o.calls_per_round, 20_000);
    assert_eq!(o.rounds, 7);
}

#[tokio::test]
async fn report_is_well_formed() {
    let report = lua::run(&small(None)).await.expect("benchmark run");
    assert!(report
        .redis_version
        .chars()
        .next()
        .unwrap()
        .is_ascii_digit());
    assert_eq!((report.rounds, report.calls_per_round), (2, 500));
    assert!(report.noop_evalsha_us > 0.0);

    assert_eq!(keys(&report.scripts), sorted(&SCRIPTS));
    for (name, by_layout) in &report.scripts {
        assert_eq!(keys(by_layout), ["packed-v1", "packed-v2"], "{name}");
        for (layout, us) in by_layout {
            assert!(us.is_finite() && *us > 0.0, "{name} {layout}: {us}");
        }
    }
    assert_eq!(keys(&report.uniform_checks_us), sorted(&CHECKS));
    // The net figure of a check is a difference (the length check may be ~0 either side);
    // the raw figures are all real timings.
    for us in report.uniform_checks_us.values() {
        assert!(us.is_finite());
    }
    for name in CHECKS.iter().chain(&["hget_1216", "hget_19"]) {
        let raw = report.uniform_raw_us()[*name];
        assert!(raw.is_finite() && raw > 0.0, "{name}: {raw}");
    }

    let j = report.to_json();
    let top: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        sorted(&top),
        [
            "calls_per_round",
            "noop_evalsha_us",
            "redis_version",
            "rounds",
            "scripts",
            "uniform_checks_us"
        ]
    );
    assert_eq!(
        (j["calls_per_round"].as_u64(), j["rounds"].as_u64()),
        (Some(500), Some(2))
    );
    assert!(j["redis_version"].is_string());
    assert!(j["noop_evalsha_us"].as_f64().unwrap() > 0.0);
    let scripts = j["scripts"].as_object().unwrap();
    assert_eq!(scripts.len(), 5);
    for name in SCRIPTS {
        let s = scripts[name].as_object().unwrap();
        assert_eq!(s.len(), 2);
        assert!(s["packed-v1"].as_f64().unwrap() > 0.0);
        assert!(s["packed-v2"].as_f64().unwrap() > 0.0);
    }
    let checks = j["uniform_checks_us"].as_object().unwrap();
    assert_eq!(checks.len(), 4);
    for c in CHECKS {
        assert!(checks[c].is_f64(), "{c}");
    }

    let table = report.to_table();
    for name in SCRIPTS.iter().chain(&CHECKS) {
        assert!(table.contains(name), "table lacks {name}:\n{table}");
    }
    assert!(table.contains("no-op"));
    println!("{table}");
}

#[tokio::test]
async fn external_server_is_left_clean_and_its_keys_are_never_overwritten() {
    let redis = RedisProcess::start().expect("redis-server");
    let url = redis.url();
    lua::run(&small(Some(url.clone()))).await.expect("run");
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let n: i64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(n, 0, "the benchmark left keys behind");

    // A real shard's watermark on the server: refused, untouched.
    let _: () = redis::cmd("HSET")
        .arg("wm:{2}")
        .arg("wm_layout")
        .arg("packed-v2")
        .query_async(&mut conn)
        .await
        .unwrap();
    let e = lua::run(&small(Some(url))).await.unwrap_err();
    assert_eq!(e.code(), "keys_exist", "{e}");
    let layout: String = redis::cmd("HGET")
        .arg("wm:{2}")
        .arg("wm_layout")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(layout, "packed-v2");
}

#[tokio::test]
async fn invalid_options_are_refused() {
    let e = lua::run(&LuaBenchOptions {
        redis_url: None,
        calls_per_round: 0,
        rounds: 1,
    })
    .await
    .unwrap_err();
    assert_eq!(e.code(), "invalid_options");
}

/// The full default run (a few minutes), printed.
#[tokio::test]
#[ignore = "the full default run takes minutes; run it with --ignored --nocapture"]
async fn full_run() {
    let report = lua::run(&LuaBenchOptions::default()).await.expect("run");
    println!("{}", report.to_table());
    println!(
        "{}",
        serde_json::to_string_pretty(&report.to_json()).unwrap()
    );
}
