//! `tidemark trace` as an operator runs it, against real redis-servers. The shard's state is
//! built step by step with the store's own calls (commit, hot path, lane chunks, advance,
//! ack, log trim), so every state the trace reports is reached deterministically: a delivered
//! message (materialised, entry present), a many-recipient record with one lane held back
//! (pending, staging), an acked and trimmed entry, a record trimmed from the log, an offset
//! above the head, a corrupt watermark, a lost entry, and `--config` table selection.

use std::process::Output;

use tidemark_protocol::entry::encode_entry;
use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::store::{
    Advance, AdvanceRecord, MailboxStore, Materialized, SingleItem,
};
use tidemark_store::redis::watermark::LANES;
mod support;
use support::{redis_cmd, route, tidemark};

const SHARDS: u32 = 4;
const SHARD: u32 = 2;
const SENT_AT: u64 = 1_764_489_600_000_000;

/// `tidemark trace` of `offset` in `SHARD`.
fn trace(core: &str, mb: &str, offset: u64, json: bool) -> Output {
    support::trace(core, mb, SHARDS, SHARD, offset, json)
}

/// Two redis-servers (core, mailbox), a store of each, every watermark initialised.
async fn instances() -> ((RedisProcess, RedisProcess), LogStore, MailboxStore) {
    let (core_p, mb_p) = support::redis_pair();
    let core = LogStore::connect(&core_p.url()).await.unwrap();
    let store = support::init_watermarks(&mb_p.url(), SHARDS).await;
    ((core_p, mb_p), core, store)
}

fn trace_json(core: &str, mb: &str, offset: u64) -> serde_json::Value {
    let out = trace(core, mb, offset, true);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// `tidemark trace` (text) of `offset`, which must exit with `code`: (stdout, stderr).
fn trace_exit(core: &str, mb: &str, offset: u64, code: i32) -> (String, String) {
    let out = trace(core, mb, offset, false);
    assert_eq!(out.status.code(), Some(code), "{out:?}");
    (text(&out.stdout), text(&out.stderr))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Two users of `SHARD` in different lanes.
fn two_users() -> (String, String) {
    let mut found: Vec<(String, usize)> = Vec::new();
    for i in 0.. {
        let u = format!("user{i}");
        let r = route(&u, SHARDS);
        if r.shard != SHARD {
            continue;
        }
        if let Some((a, _)) = found.iter().find(|(_, l)| *l != r.lane) {
            return (a.clone(), u);
        }
        found.push((u, r.lane));
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_delivered_pending_trimmed_above_head() {
    let ((core_p, mb_p), mut core, mut store) = instances().await;
    let (core_url, mb_url) = (core_p.url(), mb_p.url());
    let epoch = store.claim(SHARD).await.unwrap();
    let (bob, carol) = two_users();
    let (lb, lc) = (route(&bob, SHARDS).lane, route(&carol, SHARDS).lane);

    // 1: alice -> bob, through the hot path: delivered
    let c1 = core
        .commit(SHARD, "alice", "m-1", &[&bob], "hello", SENT_AT, 60)
        .await
        .unwrap();
    assert_eq!(c1.offset, 1);
    let out = store
        .materialize_single(
            SHARD,
            epoch,
            &SingleItem {
                offset: 1,
                prev: 0,
                recipients: vec![bob.clone()],
                entry: encode_entry(1, SENT_AT, "alice", "hello"),
            },
        )
        .await
        .unwrap();
    assert_eq!(out, Materialized::Applied { offset: 1 });

    let v = trace_json(&core_url, &mb_url, 1);
    assert_eq!(v["shard"], SHARD);
    assert_eq!(v["offset"], 1);
    assert_eq!(v["trimmed"], false);
    assert_eq!(v["status"], "materialised");
    assert_eq!(v["record"]["sender"], "alice");
    assert_eq!(v["record"]["client_id"], "m-1");
    assert_eq!(v["record"]["prev"], 0);
    assert_eq!(v["record"]["sent_at_us"], SENT_AT);
    assert_eq!(v["record"]["recipients"], serde_json::json!([bob]));
    assert_eq!(v["log"]["head"], 1);
    assert_eq!(v["watermark"]["layout"], "packed-v2");
    assert_eq!(v["watermark"]["blob_bytes"], 19);
    assert_eq!(v["watermark"]["uniform"], true);
    assert_eq!(v["watermark"]["epoch"], epoch);
    assert_eq!(v["watermark"]["min_w"], 1);
    assert!(v["staging_lanes"].is_null());
    let r = &v["recipients"][0];
    assert_eq!(r["user"], bob.as_str());
    assert_eq!(r["lane"], lb);
    assert_eq!(r["lane_w"], 1);
    assert_eq!(r["state"], "materialised");
    assert_eq!(r["materialised"], true);
    assert_eq!(r["entry"]["from"], "alice");
    assert_eq!(v["problems"], serde_json::json!([]));

    let (t, _) = trace_exit(&core_url, &mb_url, 1, 0);
    assert!(
        t.contains("offset 1 prev 0, from alice, client id m-1"),
        "{t}"
    );
    assert!(t.contains("2025-11-30T08:00:00.000000Z"), "{t}");
    assert!(
        t.contains("packed-v2, epoch 2, blob 19 bytes, uniform"),
        "{t}"
    );
    assert!(t.contains("materialised, entry present"), "{t}");
    assert!(
        t.contains("status     materialised for every recipient"),
        "{t}"
    );

    // 2: alice -> bob, carol (two lanes): bob's chunk lands, carol's lane is held back
    let c2 = core
        .commit(
            SHARD,
            "alice",
            "m-2",
            &[&bob, &carol],
            "both",
            SENT_AT + 1,
            60,
        )
        .await
        .unwrap();
    assert_eq!(c2.offset, 2);
    let e2 = encode_entry(2, SENT_AT + 1, "alice", "both");
    store
        .write_lane_chunk(SHARD, epoch, 2, lb, &[(&bob, &e2)])
        .await
        .unwrap();
    let mut needed = [false; LANES];
    needed[lb] = true;
    needed[lc] = true;
    let rec2 = AdvanceRecord {
        offset: 2,
        prev: 1,
        needed,
    };
    let adv = store.advance(SHARD, epoch, &rec2).await.unwrap();
    assert!(matches!(adv, Advance::Moved(_)), "{adv:?}");

    let v = trace_json(&core_url, &mb_url, 2);
    assert_eq!(v["status"], "pending");
    assert_eq!(v["watermark"]["uniform"], false);
    assert_eq!(v["watermark"]["blob_bytes"], 1216);
    assert_eq!(v["staging_lanes"], serde_json::json!([lb]));
    let rs = v["recipients"].as_array().unwrap();
    let rb = rs.iter().find(|r| r["user"] == bob.as_str()).unwrap();
    let rc = rs.iter().find(|r| r["user"] == carol.as_str()).unwrap();
    assert_eq!(rb["state"], "materialised");
    assert_eq!(rc["state"], "pending");
    assert_eq!(rc["lane_w"], 1);
    assert!(rc["entry"].is_null());
    let t = text(&trace(&core_url, &mb_url, 2, false).stdout);
    assert!(t.contains("pending (lane W = 1)"), "{t}");
    assert!(t.contains(&format!("lanes durable: {lb}")), "{t}");

    // carol's chunk lands: both materialised, the blob is 19 bytes again
    store
        .write_lane_chunk(SHARD, epoch, 2, lc, &[(&carol, &e2)])
        .await
        .unwrap();
    store.advance(SHARD, epoch, &rec2).await.unwrap();
    let v = trace_json(&core_url, &mb_url, 2);
    assert_eq!(v["status"], "materialised");
    assert_eq!(v["watermark"]["blob_bytes"], 19);

    // bob acks 1 (his entry 1 is trimmed): "acked, possibly trimmed"
    assert_eq!(store.ack_mailbox(SHARD, &bob, 1).await.unwrap(), 1);
    let v = trace_json(&core_url, &mb_url, 1);
    assert_eq!(v["recipients"][0]["state"], "acked_possibly_trimmed");
    assert_eq!(v["recipients"][0]["acked"], 1);
    assert_eq!(v["problems"], serde_json::json!([]));
    let t = text(&trace(&core_url, &mb_url, 1, false).stdout);
    assert!(t.contains("acked, possibly trimmed (acked 1)"), "{t}");

    // GC trims the log at or below the lowest W: the trace continues from the mailboxes
    core.trim(SHARD, 2).await.unwrap();
    let (t, _) = trace_exit(&core_url, &mb_url, 2, 0);
    assert!(
        t.contains("record trimmed from the log (fully materialised)"),
        "{t}"
    );
    assert!(t.contains(&bob) && t.contains(&carol), "{t}");
    let v = trace_json(&core_url, &mb_url, 2);
    assert_eq!(v["trimmed"], true);
    assert!(v["record"].is_null());
    assert_eq!(v["recipients_from"], "mailboxes");
    assert_eq!(v["status"], "materialised");
    let mut users: Vec<&str> = v["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["user"].as_str().unwrap())
        .collect();
    users.sort();
    let mut want = vec![bob.as_str(), carol.as_str()];
    want.sort();
    assert_eq!(users, want);
    assert!(v["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["state"] == "materialised"));

    // above the head: non-zero exit, a clear message, nothing on stdout
    let (t, err) = trace_exit(&core_url, &mb_url, 3, 1);
    assert!(err.contains("offset 3 is above the log head 2"), "{err}");
    assert!(t.is_empty());

    // --config: the shard's instances come from the static tables
    let dir = support::temp_dir("trace-cli");
    let cfg = dir.join("deploy.toml");
    std::fs::write(
        &cfg,
        format!(
            "shards = {SHARDS}\ncore = [\"{core_url}\"]\n\
             mailbox = [\"redis://127.0.0.1:1/\", \"{mb_url}\"]\n\
             mailbox_of_shard = [0, 0, 1, 0]\n"
        ),
    )
    .unwrap();
    let out = tidemark(&[
        "trace",
        "--config",
        cfg.to_str().unwrap(),
        "--shard",
        &SHARD.to_string(),
        "--offset",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mailbox_url"], mb_url.as_str());
    assert_eq!(v["shards"], SHARDS);

    // an entry lost at or below W (not acked): reported as a problem, exit 5
    let c3 = core
        .commit(SHARD, "alice", "m-3", &[&carol], "three", SENT_AT + 2, 60)
        .await
        .unwrap();
    store
        .materialize_single(
            SHARD,
            epoch,
            &SingleItem {
                offset: c3.offset,
                prev: c3.offset - 1,
                recipients: vec![carol.clone()],
                entry: encode_entry(c3.offset, SENT_AT + 2, "alice", "three"),
            },
        )
        .await
        .unwrap();
    redis_cmd(
        &mb_url,
        &[
            "ZREMRANGEBYSCORE",
            &format!("mb:{{{SHARD}}}:{carol}"),
            "3",
            "3",
        ],
    );
    let (t, _) = trace_exit(&core_url, &mb_url, 3, 5);
    assert!(t.contains("MISSING") && t.contains("problem"), "{t}");

    // a corrupt watermark: exit 3, one `corrupt:` line (the wm inspect convention)
    redis_cmd(
        &mb_url,
        &["HSET", &format!("wm:{{{SHARD}}}"), "wm_blob", "xx"],
    );
    let (_, err) = trace_exit(&core_url, &mb_url, 1, 3);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("corrupt:") && err.contains("bad_length"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Issue 10, item 9: a record gone from the log while W is below it is `lost`, never
/// `materialised`; a shard count that contradicts the deployment's identity is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_lost_record_and_wrong_shard_count() {
    let ((core_p, mb_p), mut core, _store) = instances().await;
    let (core_url, mb_url) = (core_p.url(), mb_p.url());
    let (bob, _) = two_users();
    for i in 0..2 {
        core.commit(SHARD, "alice", &format!("l-{i}"), &[&bob], "x", SENT_AT, 60)
            .await
            .unwrap();
    }
    // the log loses both records while W is still 0 (a restore, a bad trim)
    redis_cmd(
        &core_url,
        &["XTRIM", &format!("dlog:{{{SHARD}}}"), "MINID", "3-0"],
    );
    let (t, _) = trace_exit(&core_url, &mb_url, 1, 5);
    assert!(t.contains("status     lost"), "{t}");
    assert!(!t.contains("materialised for every recipient"), "{t}");
    let out = trace(&core_url, &mb_url, 2, true);
    assert_eq!(out.status.code(), Some(5));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "lost");

    // the mailbox instance records a 4-shard deployment: --shards 8 is refused
    let id = tidemark_store::deployment::Identity {
        version: tidemark_store::deployment::VERSION_CURRENT,
        shards: SHARDS,
        role: tidemark_store::deployment::Role::Mailbox,
        index: 0,
        holds: (0..SHARDS).collect(),
        tables: "0".repeat(16),
    };
    let client = redis::Client::open(mb_url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    tidemark_store::deployment::record_if_absent(&mut conn, &id)
        .await
        .unwrap();
    let out = support::trace(&core_url, &mb_url, 8, 2, 1, false);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("4-shard deployment") && err.contains("--shards 4"),
        "{err}"
    );
}
