//! A cluster log reader with one node hung (ADR-0117): the shards of the other nodes are
//! still read. Real Redis Cluster.

use std::time::{Duration, Instant};

use tidemark_redis_proc::{key_slot, ClusterOptions, RedisCluster};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::{LogReader, LogStore};

/// Two shards whose logs are on two different primaries: (shard, its primary's index).
fn two_shards_on_two_nodes(c: &RedisCluster) -> [(u32, usize); 2] {
    let node = |s: u32| {
        c.primary_of_slot(key_slot(format!("dlog:{{{s}}}").as_bytes()))
            .expect("slot served")
    };
    let a = 0;
    let b = (1..64).find(|&s| node(s) != node(a)).expect("another node");
    [(a, node(a)), (b, node(b))]
}

/// A primary hangs (SIGSTOP: its connections stay open, nothing answers) and, with a long
/// node timeout, no failover comes. A read of both shards must still hand on the records of
/// the shard on the healthy node, and promptly. Before, the per-shard reads were joined: the
/// read waited for the hung node's answer (the client's 30 s response timeout), then failed
/// as a whole, and the reader made again failed while subscribing to the hung node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_does_not_hold_up_the_shards_of_the_others() {
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
    let mut log = LogStore::connect(&url).await.unwrap();
    for s in [healthy, hung] {
        log.commit(s, "alice", &format!("a-{s}"), &["bob"], "before", 1, 60)
            .await
            .unwrap();
    }
    let mut reader = LogReader::connect(&url).await.unwrap();
    let got = reader
        .read(&[(healthy, 0), (hung, 0)], 16, Duration::from_millis(200))
        .await
        .expect("both read");
    assert_eq!(got.len(), 2, "{got:?}");

    c.pause(hung_node).unwrap();
    // past the reader's sweep interval: its next read reads every shard, the hung one too
    // (a shard is read on a hint of its own, or at the sweep)
    tokio::time::sleep(tidemark_store::redis::dlog::CLUSTER_SWEEP + Duration::from_millis(500))
        .await;
    log.commit(healthy, "alice", "b", &["bob"], "while a node hangs", 2, 60)
        .await
        .unwrap();
    let start = Instant::now();
    let mut found = Vec::new();
    while found.is_empty() && start.elapsed() < Duration::from_secs(20) {
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            reader.read(&[(healthy, 1), (hung, 1)], 16, Duration::from_millis(200)),
        )
        .await;
        match read {
            Ok(Ok(got)) => {
                found = got
                    .into_iter()
                    .filter(|(s, _)| *s == healthy)
                    .flat_map(|(_, recs)| recs)
                    .map(|r| r.body)
                    .collect();
            }
            Ok(Err(e)) => panic!(
                "the read failed as a whole {:?} into the hang: {e}",
                start.elapsed()
            ),
            Err(_) => panic!("the read did not answer within 10 s of a node's hang"),
        }
    }
    let took = start.elapsed();
    c.resume(hung_node).unwrap();
    assert_eq!(found, ["while a node hangs"]);
    assert!(
        took < Duration::from_secs(8),
        "the healthy shard's record took {took:?}"
    );
}
