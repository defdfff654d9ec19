//! Scripts lost by one primary of a real Redis Cluster (a replica promoted by a failover
//! starts with an empty script cache) are loaded again on that primary alone: a node that
//! hangs elsewhere in the cluster must not hold up the shards it does not serve. Before, the
//! NOSCRIPT recovery sent `SCRIPT LOAD` to every node (redis-rs routes it to all of them)
//! and waited for the slowest: with one node stopped, every shard's recovery waited for the
//! response timeout (30 s) and then failed. Checked for the mailbox read, the ack, the commit
//! and the shard lease.

use std::time::Duration;

use tidemark_redis_proc::{key_slot, ClusterOptions, RedisCluster};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::Lease;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

fn cluster() -> Option<RedisCluster> {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return None;
    }
    Some(
        RedisCluster::start(ClusterOptions {
            node_timeout_ms: 1000,
            ..ClusterOptions::default()
        })
        .expect("start a 3+3 Redis Cluster"),
    )
}

/// Within 10 s, or the test fails (the old recovery waited 30 s for the stopped node).
async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: still waiting after 10 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_lost_its_scripts_gets_them_back_while_another_node_hangs() {
    let Some(mut c) = cluster() else { return };
    let endpoint = cluster_endpoint(&c.seeds());
    let shard = 3u32;
    let primary = c
        .primary_of_slot(key_slot(format!("wm:{{{shard}}}").as_bytes()))
        .expect("slot served");
    let mut mb = MailboxStore::connect(&endpoint, Layout::PackedV2)
        .await
        .unwrap();
    mb.init_watermark(shard, Layout::PackedV2, 1, 0, false)
        .await
        .unwrap();
    let mut log = LogStore::connect(&endpoint).await.unwrap();
    log.commit(shard, "alice", "m-1", &["bob"], "one", 1, 60)
        .await
        .unwrap();
    mb.read_watermark_and_mailbox(shard, "bob", 0, 10)
        .await
        .unwrap();

    // a node that serves none of the shard's keys hangs: another primary
    let hung = c
        .primaries()
        .into_iter()
        .find(|&p| p != primary)
        .expect("three primaries");
    c.pause(hung).unwrap();
    // the shard's primary forgets every script, as a promoted replica starts
    c.call(primary, &["SCRIPT", "FLUSH"]).unwrap();

    let read = soon(
        "a mailbox read",
        mb.read_watermark_and_mailbox(shard, "bob", 0, 10),
    )
    .await;
    let (wm, entries) = read.expect("the read after the script cache was lost");
    assert_eq!(wm.epoch, 1);
    assert!(entries.is_empty(), "nothing materialised: {entries:?}");
    c.call(primary, &["SCRIPT", "FLUSH"]).unwrap();
    let acked = soon("an ack", mb.ack_mailboxes(&[(shard, "bob", 1)]))
        .await
        .unwrap();
    assert_eq!(acked.len(), 1);
    acked.into_iter().next().unwrap().expect("the ack");
    c.call(primary, &["SCRIPT", "FLUSH"]).unwrap();
    let committed = soon(
        "a commit",
        log.commit(shard, "alice", "m-2", &["bob"], "two", 2, 60),
    )
    .await
    .expect("the commit after the script cache was lost");
    assert_eq!(committed.offset, 2);
    // the shard's lease (its key is in the shard's slot): a node renews it every tick
    c.call(primary, &["SCRIPT", "FLUSH"]).unwrap();
    let lease = soon("a lease", log.acquire_lease(shard, "n1", 3_000))
        .await
        .expect("the lease after the script cache was lost");
    assert_eq!(lease, Lease::Held { fresh: true });
    c.resume(hung).unwrap();
}
