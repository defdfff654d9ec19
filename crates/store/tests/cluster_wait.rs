//! Replica confirmations on a real Redis Cluster (ADR-0063). `WAIT` confirms only the writes
//! made on the connection it runs on. redis-rs' cluster client retries a command whose
//! connection dropped on a new connection, and there a `WAIT` answers at once with every
//! replica still attached: it confirmed a commit it knew nothing of, and the sender got
//! `send_ack` for a message that might exist on the primary alone.

use std::time::Duration;

use tidemark_redis_proc::key_slot;
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::LogStore;
use tidemark_store::redis::replicas::ReplicaWait;
use tidemark_store::Error;

mod support;
use support::cluster;

/// The commit's `WAIT` blocks on the primary (its one replica is stopped, so nothing is
/// replicated) when the connection it runs on is cut. The commit must not be confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_wait_retried_on_a_new_connection_confirms_nothing() {
    let Some(mut c) = cluster() else { return };
    let endpoint = cluster_endpoint(&c.seeds());
    let shard = 3u32;
    let primary = c
        .primary_of_slot(key_slot(format!("dlog:{{{shard}}}").as_bytes()))
        .expect("slot served");
    let replica = *c.replicas_of(primary).first().expect("a replica");
    let mut log = LogStore::connect(&endpoint).await.unwrap();
    log.set_replica_wait(Some(ReplicaWait {
        replicas: 1,
        timeout: Duration::from_secs(3),
    }));
    // replicated while the replica runs: the connections are up, the replica is attached
    log.commit(shard, "alice", "w-0", &["bob"], "zero", 1, 60)
        .await
        .expect("a commit confirmed by its replica");

    c.pause(replica).unwrap();
    let commit = tokio::spawn(async move {
        log.commit(shard, "alice", "w-1", &["bob"], "one", 2, 60)
            .await
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    // the commit's WAIT is blocked on the primary: cut the connection it runs on
    c.call(
        primary,
        &["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"],
    )
    .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), commit)
        .await
        .expect("the commit answers")
        .unwrap();
    c.resume(replica).unwrap();
    assert!(
        matches!(r, Err(Error::NotReplicated { .. })),
        "a commit nothing replicated was confirmed: {r:?}"
    );
}
