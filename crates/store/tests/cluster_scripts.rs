//! Scripts lost by one primary of a real Redis Cluster (a replica promoted by a failover
//! starts with an empty script cache) are loaded again on that primary alone: a node that
//! hangs elsewhere in the cluster must not hold up the shards it does not serve. Before, the
//! NOSCRIPT recovery sent `SCRIPT LOAD` to every node (redis-rs routes it to all of them)
//! and waited for the slowest: with one node stopped, every shard's recovery waited for the
//! response timeout (30 s) and then failed. Checked for the mailbox read, the ack, the commit
//! and the shard lease.

use std::time::Duration;

use tidemark_redis_proc::{key_slot, RedisCluster, Role};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::lease::Lease;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

mod support;
use support::cluster;

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

/// Promotes `replica` by a manual failover (`CLUSTER FAILOVER`) and waits until it says it
/// is a primary. Both nodes forget their scripts first, so the new primary has none (as
/// after a real failover: a replica never had them).
fn fail_over_to(c: &RedisCluster, replica: usize, old: usize) {
    for n in [replica, old] {
        c.call(n, &["SCRIPT", "FLUSH"]).unwrap();
    }
    c.call(replica, &["CLUSTER", "FAILOVER"]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.role(replica) != Role::Primary {
        assert!(std::time::Instant::now() < deadline, "failover did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Right after a failover a client's slot map still names the old primary, now a replica:
/// a key's command is redirected (MOVED) to the new primary, which has no scripts, but a
/// `SCRIPT LOAD` routed by the map can go to the old one. The recovery then ran `EVALSHA`
/// again on the new primary and failed with NOSCRIPT; a node's claim of a shard that failed
/// so left the shard unowned for 30 s (found by `cluster.rs`'s `primary_loss_under_load`,
/// 1 run in 35). The script's source now goes with the retry (`EVAL`), to wherever the key
/// is served (ADR-0059). Each kind of call has its own client, connected before the
/// failover, so each meets it with a stale map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_runs_on_a_new_primary_the_slot_map_does_not_know_yet() {
    let Some(c) = cluster() else { return };
    let endpoint = cluster_endpoint(&c.seeds());
    let shard = 5u32;
    let first = c
        .primary_of_slot(key_slot(format!("wm:{{{shard}}}").as_bytes()))
        .expect("slot served");
    let second = c.replicas_of(first)[0];
    let mut mbs = Vec::new();
    let mut logs = Vec::new();
    for _ in 0..3 {
        let mut mb = MailboxStore::connect(&endpoint, Layout::PackedV2)
            .await
            .unwrap();
        // creates it once; the others' `AlreadyExists` warms their slot maps all the same
        let _ = mb
            .init_watermark(shard, Layout::PackedV2, 1, 0, false)
            .await;
        mbs.push(mb);
        let mut log = LogStore::connect(&endpoint).await.unwrap();
        log.raise_head(shard, 0).await.unwrap();
        logs.push(log);
    }
    logs[0]
        .commit(shard, "alice", "m-1", &["bob"], "one", 1, 60)
        .await
        .unwrap();
    // the replica has every write (a manual failover waits for that) and no script
    fail_over_to(&c, second, first);

    let raised = soon("a head raise", logs[1].raise_head(shard, 1)).await;
    assert_eq!(raised.expect("the head raise after a failover"), None);
    let read = soon(
        "a mailbox read",
        mbs[0].read_watermark_and_mailbox(shard, "bob", 0, 10),
    )
    .await;
    read.expect("the mailbox read after a failover");
    let acked = soon("an ack", mbs[1].ack_mailboxes(&[(shard, "bob", 1)]))
        .await
        .unwrap();
    acked
        .into_iter()
        .next()
        .unwrap()
        .expect("the ack after a failover");
    let lease = soon("a lease", logs[2].acquire_lease(shard, "n1", 3_000))
        .await
        .expect("the lease after a failover");
    assert_eq!(lease, Lease::Held { fresh: true });
    let committed = soon(
        "a commit",
        logs[0].commit(shard, "alice", "m-2", &["bob"], "two", 2, 60),
    )
    .await
    .expect("the commit after a failover");
    assert_eq!(committed.offset, 2);
}
