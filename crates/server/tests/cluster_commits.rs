//! The gateway's group commit on a Redis Cluster with one primary hung (ADR-0128): the commits
//! of shards on the other primaries still answer. Real Redis Cluster, the gateway's own
//! commit path ([`CommitPath`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidemark_redis_proc::{key_slot, ClusterOptions, RedisCluster, RedisProcess};
use tidemark_server::gateway::CommitPath;
use tidemark_server::health::HealthBoard;
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::WaitPolicy;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology};

const SHARDS: u32 = 16;

/// A user whose shard's log is on primary `node` (or, with `not`, on any other primary), and
/// whose name starts with `prefix`.
fn user_on(c: &RedisCluster, map: &ShardMap, prefix: &str, node: usize, not: bool) -> String {
    (0..10_000)
        .map(|i| format!("{prefix}{i}"))
        .find(|u| {
            let s = map.route(u).shard;
            let on = c.primary_of_slot(key_slot(format!("dlog:{{{s}}}").as_bytes()));
            (on == Some(node)) != not
        })
        .expect("a user on that node")
}

/// Two sends whose shards are on a hung primary take both flush tasks of the cluster's queue,
/// one round each. A send whose shards are all on healthy primaries must still be answered
/// promptly. Before, each flush task waited for every call of its round, so both waited on
/// the hung node (the client's 30 s response timeout), and the healthy send, queued behind
/// them, timed out after the commit path's 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primary_holds_up_only_its_own_shards_commits() {
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
    let mailbox = RedisProcess::start().expect("mailbox redis");
    let map = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![cluster_endpoint(&c.seeds())],
        vec![mailbox.url()],
    )
    .validate()
    .expect("a valid topology");
    let path = CommitPath::connect(
        map.clone(),
        &WaitPolicy::default(),
        Arc::new(HealthBoard::default()),
    )
    .await
    .expect("connect");
    let hung_node = c.primaries()[0];
    let (hung_sender, hung_recipient) = (
        user_on(&c, &map, "hs", hung_node, false),
        user_on(&c, &map, "hr", hung_node, false),
    );
    let (sender, recipient) = (
        user_on(&c, &map, "s", hung_node, true),
        user_on(&c, &map, "r", hung_node, true),
    );
    // every node answers before the hang
    for (s, r, id) in [
        (&hung_sender, &hung_recipient, "warm-1"),
        (&sender, &recipient, "warm-2"),
    ] {
        path.commit(s, id, vec![r.clone()], "warm".into())
            .await
            .expect("committed before the hang");
    }

    c.pause(hung_node).unwrap();
    // one round each for the two flush tasks, both stuck on the hung node
    let mut stuck = Vec::new();
    for i in 0..2 {
        let (path, s, r) = (path.clone(), hung_sender.clone(), hung_recipient.clone());
        stuck.push(tokio::spawn(async move {
            path.commit(
                &s,
                &format!("stuck-{i}"),
                vec![r],
                "to the hung node".into(),
            )
            .await
        }));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let start = Instant::now();
    let r = path
        .commit(
            &sender,
            "healthy",
            vec![recipient.clone()],
            "elsewhere".into(),
        )
        .await;
    let took = start.elapsed();
    c.resume(hung_node).unwrap();
    for t in stuck {
        let _ = t.await;
    }
    assert!(r.is_ok(), "the healthy send failed after {took:?}: {r:?}");
    assert!(
        took < Duration::from_secs(3),
        "the healthy send took {took:?} while another node hung"
    );
}
