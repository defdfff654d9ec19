//! Mailbox calls of several shards on a Redis Cluster with one primary hung (ADR-0124): the
//! shards of the other primaries are answered, promptly, and the hung node's shards alone
//! fail. Before, `Conn::exec_each` joined the shards' pipelines and the first failure failed
//! the whole call: the materializer's step (`materialize_batches`, every shard of the
//! instance), the gateway's ack round (`ack_mailboxes`) and the wake sweep's read
//! (`read_watermarks`) waited for the hung node's 30 s response timeout, then failed for every
//! shard, though the healthy nodes had run their commands. Real Redis Cluster.

use std::time::Duration;

use tidemark_redis_proc::{key_slot, ClusterOptions, RedisCluster};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::store::{MailboxStore, Materialized, SingleItem};
use tidemark_store::redis::watermark::Layout;

/// Two shards whose watermarks are on two different primaries: (shard, its primary's index).
fn two_shards_on_two_nodes(c: &RedisCluster) -> [(u32, usize); 2] {
    let node = |s: u32| {
        c.primary_of_slot(key_slot(format!("wm:{{{s}}}").as_bytes()))
            .expect("slot served")
    };
    let a = 0;
    let b = (1..64).find(|&s| node(s) != node(a)).expect("another node");
    [(a, node(a)), (b, node(b))]
}

/// Record 1 of a shard (W 0), for `to`.
fn first(to: &str) -> SingleItem {
    SingleItem {
        offset: 1,
        prev: 0,
        recipients: vec![to.into()],
        entry: format!("1:{to}").into_bytes(),
    }
}

/// `f`'s result, or `None` when it takes more than 10 s (the hung node's 30 s response
/// timeout, before the fix).
async fn within_10s<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::time::timeout(Duration::from_secs(10), f).await.ok()
}

/// A primary hangs (SIGSTOP: its connections stay open, nothing answers) and, with a long
/// node timeout, no failover comes. A hot-path step, an ack round and a watermark read of one
/// shard on a healthy primary and one on the hung primary must each answer within 10 s: the
/// healthy shard applied (acked, read), the hung one an error (its outcome unknown: never a
/// success).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primary_fails_only_its_own_shards_mailbox_calls() {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return;
    }
    let mut c = RedisCluster::start(ClusterOptions {
        replicas_per_primary: 0,
        node_timeout_ms: 60_000,
        ..ClusterOptions::default()
    })
    .expect("start a 3-primary Redis Cluster");
    let url = cluster_endpoint(&c.seeds());
    let [(healthy, _), (hung, hung_node)] = two_shards_on_two_nodes(&c);
    let mut mb = MailboxStore::connect(&url, Layout::PackedV2).await.unwrap();
    for s in [healthy, hung] {
        mb.init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap();
    }
    assert_eq!(mb.read_watermarks(&[healthy, hung]).await.unwrap().len(), 2);

    c.pause(hung_node).unwrap();
    let batches = [
        (healthy, 1, vec![first("bob")]),
        (hung, 1, vec![first("bob")]),
    ];
    let materialized = within_10s(mb.materialize_batches(&batches)).await;
    let acked = within_10s(mb.ack_mailboxes(&[(healthy, "bob", 1), (hung, "bob", 1)])).await;
    let read = within_10s(mb.read_watermarks(&[healthy, hung])).await;
    // SIGCONT before anything can panic: the cluster is torn down with every node running
    c.resume(hung_node).unwrap();

    let materialized = materialized
        .expect("materialize_batches did not answer within 10 s of a node's hang")
        .expect("materialize_batches failed as a whole");
    assert_eq!(
        materialized[0].as_ref().expect("the healthy shard's step"),
        &[Materialized::Applied { offset: 1 }]
    );
    let err = materialized[1]
        .as_ref()
        .expect_err("the hung shard's step is an error, not an outcome");
    assert_eq!(err.code(), "redis", "{err}");

    let acked = acked
        .expect("ack_mailboxes did not answer within 10 s of a node's hang")
        .expect("ack_mailboxes failed as a whole");
    assert_eq!(*acked[0].as_ref().expect("the healthy shard's ack"), 1);
    assert!(acked[1].is_err(), "the hung shard's ack: {:?}", acked[1]);

    let read = read
        .expect("read_watermarks did not answer within 10 s of a node's hang")
        .expect("read_watermarks failed as a whole");
    let wm = read[0].as_ref().expect("the healthy shard's watermark");
    assert_eq!(wm.lanes.min_present_w(), Some(1));
    assert!(read[1].is_err(), "the hung shard's read: {:?}", read[1]);
}
