//! Shard leases and the node registry against a real redis-server (`shard_lease.lua`,
//! `node_heartbeat.lua`, `node_list.lua`): compare-and-set semantics, expiry in Redis time,
//! and a script flushed from the cache (NOSCRIPT) reloaded on the next call.

use std::time::Duration;

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::Lease;
use tidemark_store::redis::watermark::Layout::{PackedV1, PackedV2};

/// What a node asks of a shard's lease.
#[derive(Clone, Copy, Debug)]
enum Op {
    Acquire,
    Renew,
    Release,
}

/// `node` asks `op` of shard `shard`'s lease (ttl 400 ms); the answer.
async fn lease(c: &mut LogStore, op: Op, shard: u32, node: &str) -> Lease {
    let r = match op {
        Op::Acquire => c.acquire_lease(shard, node, 400).await,
        Op::Renew => c.renew_lease(shard, node, 400).await,
        Op::Release => c.release_lease(shard, node).await,
    };
    r.unwrap_or_else(|e| panic!("{op:?} {shard} {node}: {e}"))
}

async fn core() -> (RedisProcess, LogStore) {
    let redis = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let store = LogStore::connect(&redis.url()).await.unwrap();
    (redis, store)
}

#[tokio::test]
async fn a_lease_has_one_holder_and_expires_in_redis_time() {
    use Op::*;
    let (redis, mut c) = core().await;
    let held = |fresh| Lease::Held { fresh };
    assert_eq!(lease(&mut c, Acquire, 3, "a").await, held(true));
    // the holder may take it again (not fresh); another node may not
    assert_eq!(lease(&mut c, Acquire, 3, "a").await, held(false));
    match lease(&mut c, Acquire, 3, "b").await {
        Lease::Other { owner, pttl_ms } => {
            assert_eq!(owner, "a");
            assert!(pttl_ms > 0 && pttl_ms <= 400, "{pttl_ms}");
        }
        other => panic!("b took a's lease: {other:?}"),
    }
    // renew and release only by the holder
    for op in [Renew, Release] {
        let r = lease(&mut c, op, 3, "b").await;
        assert!(matches!(r, Lease::Other { .. }), "{op:?}: {r:?}");
    }
    assert_eq!(lease(&mut c, Renew, 3, "a").await, held(false));
    // another shard is another lease
    assert_eq!(lease(&mut c, Acquire, 4, "b").await, held(true));
    // not renewed: gone after its ttl, then free for another node
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(lease(&mut c, Renew, 3, "a").await, Lease::Absent);
    assert_eq!(c.lease_holder(3).await.unwrap(), None);
    assert_eq!(lease(&mut c, Acquire, 3, "b").await, held(true));
    assert_eq!(lease(&mut c, Release, 3, "b").await, Lease::Released);
    assert_eq!(lease(&mut c, Release, 3, "b").await, Lease::Absent);

    // a flushed script cache is reloaded on the next call
    let client = redis::Client::open(redis.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(lease(&mut c, Acquire, 5, "a").await, held(true));
}

#[tokio::test]
async fn nodes_are_live_while_they_beat() {
    let (server, mut c) = core().await;
    c.heartbeat("n1", 500, "ws://127.0.0.1:7401/v1/ws", "all", PackedV1)
        .await
        .unwrap();
    c.heartbeat(
        "n0",
        5_000,
        "ws://127.0.0.1:7400/v1/ws",
        "gateway",
        PackedV2,
    )
    .await
    .unwrap();
    let nodes = c.live_nodes().await.unwrap();
    let ids: Vec<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, ["n0", "n1"], "by id");
    assert_eq!(nodes[0].url, "ws://127.0.0.1:7400/v1/ws");
    assert_eq!(nodes[0].role, "gateway");
    assert_eq!(nodes[0].layout.as_deref(), Some("packed-v2"));
    assert_eq!(nodes[1].layout.as_deref(), Some("packed-v1"));
    // a record written without a layout (a build before ADR-0033) lists as None
    let client = redis::Client::open(server.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("HDEL")
        .arg("{tidemark}:node:n0")
        .arg("layout")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(c.live_nodes().await.unwrap()[0].layout, None);
    // each says which identity versions its code reads (ADR-0056); a record without it (a
    // build before) lists as None
    let newest = tidemark_store::deployment::VERSION_CURRENT;
    assert_eq!(
        (nodes[0].reads, nodes[1].reads),
        (Some(newest), Some(newest))
    );
    let () = redis::cmd("HDEL")
        .arg("{tidemark}:node:n0")
        .arg("reads")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(c.live_nodes().await.unwrap()[0].reads, None);
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
    assert!(c.heartbeat("a b", 500, "", "all", PackedV2).await.is_err());
}

/// ADR-0113 and ADR-0114: a heartbeat carries the core instances the node has not reached,
/// which `node_list` returns; and a live record of the id written by another incarnation
/// refuses the heartbeat with `NodeIdInUse`, writing nothing, until it expires.
#[tokio::test]
async fn a_heartbeat_says_what_it_does_not_reach_and_whose_id_it_is() {
    let (_server, mut c) = core().await;
    let beat = |c: &mut LogStore, unreached: &'static [usize], inc: &'static str| {
        let mut c = c.clone();
        async move {
            c.heartbeat_reaching("n1", 400, "ws://x/v1/ws", "all", PackedV2, unreached, inc)
                .await
        }
    };
    beat(&mut c, &[1, 3], "inc-a").await.unwrap();
    let nodes = c.live_nodes().await.unwrap();
    assert_eq!(nodes[0].unreached, [1, 3]);
    beat(&mut c, &[], "inc-a").await.unwrap();
    assert!(c.live_nodes().await.unwrap()[0].unreached.is_empty());
    let e = beat(&mut c, &[2], "inc-b").await.unwrap_err();
    assert_eq!(e.code(), "node_id_in_use", "{e}");
    assert!(
        c.live_nodes().await.unwrap()[0].unreached.is_empty(),
        "the refused heartbeat wrote nothing"
    );
    // a heartbeat without an incarnation (static mode, tools) is not checked
    c.heartbeat("n1", 400, "ws://x/v1/ws", "all", PackedV2)
        .await
        .unwrap();
    // the other incarnation's record expires: the id is free again
    tokio::time::sleep(Duration::from_millis(600)).await;
    beat(&mut c, &[], "inc-b").await.unwrap();
    assert_eq!(
        beat(&mut c, &[], "inc-a").await.unwrap_err().code(),
        "node_id_in_use"
    );
}

/// ADR-0131: a heartbeat says how the node owns shards, and a static owner which ones;
/// `node_list` returns it. A record whose last heartbeat did not say (a build before, or a
/// tool) lists `None` — also when an earlier heartbeat of the id did say (a downgrade under
/// the same id must not leave the old claim to shards standing).
#[tokio::test]
async fn a_heartbeat_says_how_the_node_owns_shards() {
    use tidemark_store::redis::lease::{Beat, Ownership};
    let (_server, mut c) = core().await;
    let beat = |id: &'static str, ownership: Option<&'static Ownership>| Beat {
        id,
        ttl_ms: 5_000,
        url: "ws://x/v1/ws",
        role: "all",
        layout: PackedV2,
        unreached: &[],
        incarnation: "",
        ownership,
    };
    static LEASES: Ownership = Ownership::Leases;
    static STATIC: std::sync::LazyLock<Ownership> =
        std::sync::LazyLock::new(|| Ownership::owning(&[0, 1, 2, 5]));
    c.beat(&beat("l", Some(&LEASES))).await.unwrap();
    c.beat(&beat("s", Some(&STATIC))).await.unwrap();
    c.beat(&beat("t", None)).await.unwrap();
    let nodes = c.live_nodes().await.unwrap();
    let got: Vec<(&str, Option<&Ownership>)> = nodes
        .iter()
        .map(|n| (n.id.as_str(), n.ownership.as_ref()))
        .collect();
    assert_eq!(
        got,
        [("l", Some(&LEASES)), ("s", Some(&*STATIC)), ("t", None)]
    );
    let s = nodes[1].ownership.as_ref().unwrap();
    assert!([0, 1, 2, 5].iter().all(|&x| s.owns_statically(x)));
    assert!(!s.owns_statically(3));
    // the same id beats again without saying (a build before ADR-0131): not static any more
    c.heartbeat("s", 5_000, "ws://x/v1/ws", "all", PackedV2)
        .await
        .unwrap();
    let nodes = c.live_nodes().await.unwrap();
    assert_eq!(nodes[1].id, "s");
    assert_eq!(nodes[1].ownership, None);
}

/// ADR-0132: `lease_many` runs one operation over many shards in one pipeline, each shard's
/// answer its own (the same answers as one call each), and a flushed script cache is
/// reloaded for the calls that met it.
#[tokio::test]
async fn many_leases_in_one_pipeline() {
    use tidemark_store::redis::lease::LeaseOp;
    let (redis, mut c) = core().await;
    assert_eq!(
        lease(&mut c, Op::Acquire, 1, "b").await,
        Lease::Held { fresh: true }
    );
    let shards = [0, 1, 2];
    let got: Vec<Lease> = c
        .lease_many(LeaseOp::Acquire, &shards, "a", 400, None)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        matches!(&got[1], Lease::Other { owner, .. } if owner == "b"),
        "{got:?}"
    );
    assert_eq!(got[0], Lease::Held { fresh: true });
    assert_eq!(got[2], Lease::Held { fresh: true });
    let client = redis::Client::open(redis.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw)
        .await
        .unwrap();
    let renewed: Vec<Lease> = c
        .lease_many(LeaseOp::Renew, &[0, 2, 7], "a", 400, None)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        renewed,
        [
            Lease::Held { fresh: false },
            Lease::Held { fresh: false },
            Lease::Absent
        ]
    );
    let released: Vec<Lease> = c
        .lease_many(LeaseOp::Release, &[0, 1], "a", 0, None)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(released[0], Lease::Released);
    assert!(matches!(released[1], Lease::Other { .. }));
    assert_eq!(c.lease_holder(0).await.unwrap(), None);
    assert!(c
        .lease_many(LeaseOp::Renew, &[], "a", 400, None)
        .await
        .unwrap()
        .is_empty());
}
