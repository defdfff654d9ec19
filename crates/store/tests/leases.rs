//! Shard leases and the node registry against a real redis-server (`shard_lease.lua`,
//! `node_heartbeat.lua`, `node_list.lua`): compare-and-set semantics, expiry in Redis time,
//! and a script flushed from the cache (NOSCRIPT) reloaded on the next call.

use std::time::Duration;

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::Lease;

async fn core() -> (RedisProcess, LogStore) {
    let redis = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let store = LogStore::connect(&redis.url()).await.unwrap();
    (redis, store)
}

#[tokio::test]
async fn a_lease_has_one_holder_and_expires_in_redis_time() {
    let (redis, mut c) = core().await;
    assert_eq!(
        c.acquire_lease(3, "a", 400).await.unwrap(),
        Lease::Held { fresh: true }
    );
    // the holder may take it again (not fresh); another node may not
    assert_eq!(
        c.acquire_lease(3, "a", 400).await.unwrap(),
        Lease::Held { fresh: false }
    );
    match c.acquire_lease(3, "b", 400).await.unwrap() {
        Lease::Other { owner, pttl_ms } => {
            assert_eq!(owner, "a");
            assert!(pttl_ms > 0 && pttl_ms <= 400, "{pttl_ms}");
        }
        other => panic!("b took a's lease: {other:?}"),
    }
    // renew and release only by the holder
    assert!(matches!(
        c.renew_lease(3, "b", 400).await.unwrap(),
        Lease::Other { .. }
    ));
    assert!(matches!(
        c.release_lease(3, "b").await.unwrap(),
        Lease::Other { .. }
    ));
    assert_eq!(
        c.renew_lease(3, "a", 400).await.unwrap(),
        Lease::Held { fresh: false }
    );
    // another shard is another lease
    assert_eq!(
        c.acquire_lease(4, "b", 400).await.unwrap(),
        Lease::Held { fresh: true }
    );
    // not renewed: gone after its ttl, then free for another node
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(c.renew_lease(3, "a", 400).await.unwrap(), Lease::Absent);
    assert_eq!(c.lease_holder(3).await.unwrap(), None);
    assert_eq!(
        c.acquire_lease(3, "b", 400).await.unwrap(),
        Lease::Held { fresh: true }
    );
    assert_eq!(c.release_lease(3, "b").await.unwrap(), Lease::Released);
    assert_eq!(c.release_lease(3, "b").await.unwrap(), Lease::Absent);

    // a flushed script cache is reloaded on the next call
    let client = redis::Client::open(redis.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        c.acquire_lease(5, "a", 400).await.unwrap(),
        Lease::Held { fresh: true }
    );
}

#[tokio::test]
async fn nodes_are_live_while_they_beat() {
    let (_redis, mut c) = core().await;
    c.heartbeat("n1", 500, "ws://127.0.0.1:7401/v1/ws", "all")
        .await
        .unwrap();
    c.heartbeat("n0", 5_000, "ws://127.0.0.1:7400/v1/ws", "gateway")
        .await
        .unwrap();
    let nodes = c.live_nodes().await.unwrap();
    let ids: Vec<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, ["n0", "n1"], "by id");
    assert_eq!(nodes[0].url, "ws://127.0.0.1:7400/v1/ws");
    assert_eq!(nodes[0].role, "gateway");
    assert!(nodes[0].age_ms < 1_000);
    // n1 stops beating: gone after its ttl; n0 deregisters: gone at once
    tokio::time::sleep(Duration::from_millis(700)).await;
    let ids: Vec<String> = c
        .live_nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(ids, ["n0"]);
    c.deregister("n0").await.unwrap();
    assert!(c.live_nodes().await.unwrap().is_empty());
    // ids that would corrupt keys or logs are refused
    assert!(c.heartbeat("a b", 500, "", "all").await.is_err());
}
