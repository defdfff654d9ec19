//! A log reader with a core replica wait hands on only records the replicas confirmed
//! (ADR-0064), on one instance with a replica and on a real Redis Cluster.
//!
//! Why: a record the materializer applied but no replica had lets W pass an offset that a
//! promoted replica hands out again. The next acknowledged send takes that offset, and the
//! materializer, reading after W, never sees it: an acknowledged message lost.

use std::time::Duration;

use tidemark_redis_proc::{key_slot, RedisProcess};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::{LogReader, LogStore, ReplicaWait};

mod support;
use support::{cluster, signal};

const SHARD: u32 = 3;

/// The wait the reader is given: short, so the held-back read answers soon.
const WAIT: ReplicaWait = ReplicaWait {
    replicas: 1,
    timeout: Duration::from_millis(300),
};

/// Bodies of the records a read of `SHARD` after `after` hands on now.
async fn read_bodies(reader: &mut LogReader, after: u64) -> Vec<String> {
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        reader.read(&[(SHARD, after)], 16, Duration::from_millis(100)),
    )
    .await
    .expect("the read answers")
    .expect("the read succeeds");
    got.into_iter()
        .flat_map(|(s, recs)| {
            assert_eq!(s, SHARD);
            recs
        })
        .map(|r| r.body)
        .collect()
}

/// The scenario on `url`: a record replicated is handed on; with the replica stopped, a
/// record only the primary holds is not; once the replica runs again, it is.
async fn held_back_until_replicated(url: &str, pause: impl FnOnce(), resume: impl FnOnce()) {
    // commits without a wait of their own: what the primary holds is what the reader sees
    let mut log = LogStore::connect(url).await.unwrap();
    let mut reader = LogReader::connect(url).await.unwrap();
    reader.set_replica_wait(Some(WAIT));
    log.commit(SHARD, "alice", "r-0", &["bob"], "zero", 1, 60)
        .await
        .unwrap();
    // replication is quick, but not instant: the first read may find it unconfirmed
    let mut first = Vec::new();
    for _ in 0..20 {
        first = read_bodies(&mut reader, 0).await;
        if !first.is_empty() {
            break;
        }
    }
    assert_eq!(first, ["zero"], "a replicated record is handed on");

    pause();
    log.commit(SHARD, "alice", "r-1", &["bob"], "one", 2, 60)
        .await
        .unwrap();
    for _ in 0..3 {
        let got = read_bodies(&mut reader, 1).await;
        assert!(
            got.is_empty(),
            "a record no replica confirmed was handed on: {got:?}"
        );
    }
    resume();
    let mut later = Vec::new();
    for _ in 0..50 {
        later = read_bodies(&mut reader, 1).await;
        if !later.is_empty() {
            break;
        }
    }
    assert_eq!(later, ["one"], "handed on once the replica has it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_hands_on_only_what_its_replica_confirmed() {
    let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let replica = RedisProcess::start_replica_of(&primary).expect("a replica");
    let pid = replica.pid().expect("running");
    held_back_until_replicated(
        &primary.url(),
        || signal(pid, "STOP"),
        || signal(pid, "CONT"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_hands_on_only_what_the_shards_replica_confirmed() {
    let Some(c) = cluster() else { return };
    let primary = c
        .primary_of_slot(key_slot(format!("dlog:{{{SHARD}}}").as_bytes()))
        .expect("slot served");
    let replica = *c.replicas_of(primary).first().expect("a replica");
    let pid = c.process(replica).pid().expect("running");
    held_back_until_replicated(
        &cluster_endpoint(&c.seeds()),
        || signal(pid, "STOP"),
        || signal(pid, "CONT"),
    )
    .await;
}

/// A core instance at `maxmemory` (`noeviction`, as docs/operations.md advises) refuses
/// writes such as `SET`, but its acknowledged records must still be delivered (their
/// delivery is what lets the log be trimmed and memory come back): the reader's confirming
/// write is allowed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_core_out_of_memory_still_hands_on_confirmed_records() {
    let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let _replica = RedisProcess::start_replica_of(&primary).expect("a replica");
    let url = primary.url();
    let mut log = LogStore::connect(&url).await.unwrap();
    log.commit(SHARD, "alice", "o-0", &["bob"], "zero", 1, 60)
        .await
        .unwrap();
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(1)
        .query_async(&mut raw)
        .await
        .unwrap();
    let refused: redis::RedisResult<()> = redis::cmd("SET")
        .arg("x")
        .arg("y")
        .query_async(&mut raw)
        .await;
    assert!(refused.is_err(), "the instance is out of memory");
    let mut reader = LogReader::connect(&url).await.unwrap();
    reader.set_replica_wait(Some(WAIT));
    let mut got = Vec::new();
    for _ in 0..20 {
        got = tokio::time::timeout(
            Duration::from_secs(10),
            reader.read(&[(SHARD, 0)], 16, Duration::from_millis(100)),
        )
        .await
        .expect("the read answers")
        .expect("the read succeeds: the instance is out of memory, not broken")
        .into_iter()
        .flat_map(|(_, recs)| recs)
        .map(|r| r.body)
        .collect();
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got, ["zero"], "a confirmed record is handed on");
}

/// On a cluster, the confirming pipelines of one node's shards share the reader's connection
/// to it, and each `WAIT` holds it: with that node's replica stopped they time out one after
/// another. A read must not wait for all of them (k timeouts, past the worker's read grace
/// with many shards) before handing on the other nodes' shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_its_replica_does_not_hold_up_the_other_nodes_shards() {
    let Some(mut c) = cluster() else { return };
    const SHARDS: u32 = 16;
    let timeout = Duration::from_secs(2);
    let (primary, nodes) = busiest_primary(&c, SHARDS);
    let stuck = nodes.iter().filter(|n| **n == Some(primary)).count() as u32;
    assert!(stuck >= 6, "16 shards over 3 nodes: {stuck}");
    let url = cluster_endpoint(&c.seeds());
    let mut log = LogStore::connect(&url).await.unwrap();
    let mut reader = waiting_reader(&url, SHARDS, timeout).await;
    let pos: Vec<(u32, u64)> = (0..SHARDS).map(|s| (s, 0)).collect();
    let replica = c.replicas_of(primary)[0];
    c.pause(replica).unwrap();
    for s in 0..SHARDS {
        log.commit(s, "alice", &format!("n-{s}"), &["bob"], "b", 1, 60)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let others: Vec<u32> = (0..SHARDS)
        .filter(|&s| nodes[s as usize] != Some(primary))
        .collect();
    let start = std::time::Instant::now();
    let degraded = start;
    let mut handed: Vec<u32> = Vec::new();
    let mut reads = 0;
    // the other nodes' shards are handed on as soon as their replicas confirm (a read may
    // hand on some of them, the next the rest), not after the WAIT timeout the node without
    // its replica takes: before, each read waited for that node's confirmations (one WAIT
    // timeout per read; earlier still, one per shard of that node)
    while !others.iter().all(|s| handed.contains(s)) && start.elapsed() < timeout * 4 {
        let got = reader.read(&pos, 16, Duration::ZERO).await.unwrap();
        reads += 1;
        handed.extend(got.iter().map(|(s, _)| *s));
    }
    let took = start.elapsed();
    let healthy = others[0];
    let later: Vec<(u32, u64)> = pos
        .iter()
        .map(|&(s, after)| (s, if others.contains(&s) { 1 } else { after }))
        .collect();
    // a read that finds records only on that node's shards waits (for hints, and for their
    // confirmations to end) rather than reading them again and again
    let xreads = |c: &tidemark_redis_proc::RedisCluster| {
        c.primaries()
            .into_iter()
            .map(|p| xread_calls(&c.url(p)))
            .sum::<u64>()
    };
    let before = xreads(&c);
    let idle = reader
        .read(&later, 16, Duration::from_secs(1))
        .await
        .unwrap();
    let spent = xreads(&c) - before;
    // then light traffic: one record more on one of the other shards, while that node's
    // shards stay unconfirmed (their confirmations run, time out and start again); it is
    // handed on as soon as its own replica confirms it, not after their timeouts. It comes
    // just after the first of those confirmations timed out, while the next still waits:
    // a read of the first's shard then goes to that node while a `WAIT` holds a connection
    // there (which, were it the read's own, would hold the read and this record up)
    tokio::time::sleep_until((degraded + timeout + Duration::from_millis(300)).into()).await;
    log.commit(healthy, "alice", "n-late", &["bob"], "b", 1, 60)
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let mut late = None;
    while late.is_none() && start.elapsed() < timeout * 4 {
        let got = reader
            .read(&later, 16, Duration::from_millis(500))
            .await
            .unwrap();
        late = got
            .iter()
            .find(|(s, recs)| *s == healthy && recs.iter().any(|r| r.offset == 2))
            .map(|_| start.elapsed());
    }
    c.resume(replica).unwrap();
    assert!(
        idle.is_empty(),
        "nothing new on the other shards, nothing confirmed on that node's: {idle:?}"
    );
    assert!(
        spent < 100,
        "{spent} XREADs in a read of 1 s that had only unconfirmed shards to find"
    );
    let late = late.expect("the later record is handed on");
    assert!(
        late < timeout / 2,
        "a later record of shard {healthy} took {late:?} while another node's shards waited \
         for their replica (WAIT {timeout:?})"
    );
    assert!(
        others.iter().all(|s| handed.contains(s)),
        "the other nodes' shards are handed on: {handed:?}"
    );
    assert!(
        handed.iter().all(|&s| nodes[s as usize] != Some(primary)),
        "nothing of the node without its replica: {handed:?}"
    );
    assert!(
        took < timeout / 2,
        "the other nodes' shards took {took:?} over {reads} reads ({stuck} shards of one \
         node without its replica, WAIT {timeout:?})"
    );
}

/// A reader of the cluster at `url` that waits for one replica (`WAIT` `timeout`), after its
/// first read of shards `0..shards` (which subscribes to their commit hints: every node
/// answers) found nothing.
async fn waiting_reader(url: &str, shards: u32, timeout: Duration) -> LogReader {
    let mut reader = LogReader::connect(url).await.unwrap();
    reader.set_replica_wait(Some(ReplicaWait {
        replicas: 1,
        timeout,
    }));
    let pos: Vec<(u32, u64)> = (0..shards).map(|s| (s, 0)).collect();
    assert!(reader
        .read(&pos, 16, Duration::ZERO)
        .await
        .unwrap()
        .is_empty());
    reader
}

/// The primary that serves the most of shards `0..shards`, and each shard's primary.
fn busiest_primary(
    c: &tidemark_redis_proc::RedisCluster,
    shards: u32,
) -> (usize, Vec<Option<usize>>) {
    let nodes: Vec<Option<usize>> = (0..shards)
        .map(|s| c.primary_of_slot(key_slot(format!("dlog:{{{s}}}").as_bytes())))
        .collect();
    let primary = c
        .primaries()
        .into_iter()
        .max_by_key(|p| nodes.iter().filter(|n| **n == Some(*p)).count())
        .unwrap();
    (primary, nodes)
}

/// The value of `field` in `INFO section` of the instance at `url`, if it is there.
fn info_field(url: &str, section: &str, field: &str) -> Option<String> {
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let info: String = redis::cmd("INFO").arg(section).query(&mut conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// `XREAD` calls the instance at `url` has served (`INFO commandstats`).
fn xread_calls(url: &str) -> u64 {
    info_field(url, "commandstats", "cmdstat_xread").map_or(0, |v| {
        let calls = v.split(',').next().unwrap();
        calls.strip_prefix("calls=").unwrap().parse().unwrap()
    })
}

/// Runs `CONFIG SET name value` on the instance at `url`.
fn config_set(url: &str, name: &str, value: &str) {
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query(&mut conn)
        .unwrap();
}

/// `INFO replication`'s `min_slaves_good_slaves` of the instance at `url` (`None` when not
/// reported: no `min-replicas-to-write`).
fn good_replicas(url: &str) -> Option<u64> {
    info_field(url, "replication", "min_slaves_good_slaves").map(|n| n.parse().unwrap())
}

/// ADR-0069: a node that refuses the confirmations' marker write (`min-replicas-to-write 1`
/// with its replica away: `NOREPLICAS`) holds back only its own shards' records. Before, the
/// error failed every read that found records there, so the other nodes' records were never
/// handed on for as long as it lasted. When the node accepts writes again, its shards'
/// records are handed on with no more traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_refuses_confirmations_holds_back_only_its_own_shards() {
    let Some(mut c) = cluster() else { return };
    const SHARDS: u32 = 16;
    let (primary, nodes) = busiest_primary(&c, SHARDS);
    let (mine, others): (Vec<u32>, Vec<u32>) =
        (0..SHARDS).partition(|&s| nodes[s as usize] == Some(primary));
    let url = cluster_endpoint(&c.seeds());
    let mut log = LogStore::connect(&url).await.unwrap();
    let mut reader = waiting_reader(&url, SHARDS, Duration::from_millis(300)).await;
    // that node's shards get a record while it still takes writes; then it refuses them
    for &s in &mine {
        log.commit(s, "alice", &format!("m-{s}"), &["bob"], "b", 1, 60)
            .await
            .unwrap();
    }
    let node = c.url(primary);
    config_set(&node, "min-replicas-max-lag", "1");
    config_set(&node, "min-replicas-to-write", "1");
    let replica = c.replicas_of(primary)[0];
    c.pause(replica).unwrap();
    let since = std::time::Instant::now();
    while good_replicas(&node) != Some(0) {
        assert!(
            since.elapsed() < Duration::from_secs(15),
            "the node still counts its paused replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // for 3 s the other nodes' shards get records, one at a time: each is handed on (within
    // 1.5 s: a `WAIT` of 300 ms that a busy replica misses costs one more) although that node
    // refuses (before, a read that took one of its failed confirmations failed)
    let mut at: std::collections::BTreeMap<u32, u64> = (0..SHARDS).map(|s| (s, 0)).collect();
    let start = std::time::Instant::now();
    let mut handed: Vec<u32> = Vec::new();
    let mut failed = None;
    let mut slowest = Duration::ZERO;
    let mut i = 0;
    while failed.is_none() && start.elapsed() < Duration::from_secs(3) {
        let s = others[i % others.len()];
        i += 1;
        let off = log
            .commit(s, "alice", &format!("o-{i}"), &["bob"], "b", 1, 60)
            .await
            .unwrap()
            .offset;
        let sent = std::time::Instant::now();
        while at[&s] < off && sent.elapsed() < Duration::from_secs(2) {
            let pos: Vec<(u32, u64)> = at.iter().map(|(s, a)| (*s, *a)).collect();
            match reader.read(&pos, 16, Duration::from_millis(200)).await {
                Ok(got) => {
                    for (g, recs) in got {
                        handed.push(g);
                        at.insert(g, recs.last().unwrap().offset);
                    }
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        assert!(
            failed.is_some() || at[&s] >= off,
            "shard {s}'s record {off} not handed on in 2 s"
        );
        slowest = slowest.max(sent.elapsed());
    }
    // the refusals were seen as such (held per shard, counted), not as something else
    let refused = reader.take_confirm_errors();
    // the node takes writes again: its shards' records come with no more traffic
    c.resume(replica).unwrap();
    config_set(&node, "min-replicas-to-write", "0");
    let back = std::time::Instant::now();
    let mut recovered: Vec<u32> = Vec::new();
    while failed.is_none()
        && !mine.iter().all(|s| recovered.contains(s))
        && back.elapsed() < Duration::from_secs(20)
    {
        let pos: Vec<(u32, u64)> = at.iter().map(|(s, a)| (*s, *a)).collect();
        match reader.read(&pos, 16, Duration::from_millis(500)).await {
            Ok(got) => {
                for (g, recs) in got {
                    recovered.push(g);
                    at.insert(g, recs.last().unwrap().offset);
                }
            }
            Err(e) => failed = Some(format!("after the node took writes again: {e}")),
        }
    }
    assert_eq!(
        failed, None,
        "a read failed while one node refused its confirmations (the other nodes' records \
         were not handed on)"
    );
    assert!(
        refused > 0,
        "no confirmation of the refusing node's shards ended in an error"
    );
    assert!(
        slowest < Duration::from_millis(1500),
        "the other nodes' records took up to {slowest:?} to be handed on"
    );
    assert!(
        handed.iter().all(|s| !mine.contains(s)),
        "nothing of the refusing node's shards: {handed:?}"
    );
    assert!(
        mine.iter().all(|s| recovered.contains(s)),
        "the node's shards once it takes writes again, within {:?}: {recovered:?} of {mine:?}",
        back.elapsed()
    );
}

/// ADR-0116: a resend answered as a duplicate on another connection than its first commit's
/// (another gateway, a reconnect) is confirmed by a `WAIT` on that connection, which covers
/// only what that connection wrote. A duplicate wrote nothing, so the `WAIT` answered at once
/// with the stopped replica still counted, and the resend was acknowledged although no
/// replica had the record: a failover then lost an acknowledged message. The call now writes
/// the head again when it answers only duplicates, and the `WAIT` covers the first commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_answered_on_another_connection_waits_for_the_replica_too() {
    let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let replica = RedisProcess::start_replica_of(&primary).expect("a replica");
    let pid = replica.pid().expect("running");
    let url = primary.url();
    let mut first = LogStore::connect(&url).await.unwrap();
    first.set_replica_wait(Some(WAIT));
    first
        .commit(SHARD, "alice", "d-0", &["bob"], "zero", 1, 60)
        .await
        .expect("confirmed while the replica runs");
    signal(pid, "STOP");
    let refused = first
        .commit(SHARD, "alice", "d-1", &["bob"], "one", 2, 60)
        .await
        .expect_err("no replica takes it");
    assert_eq!(refused.code(), "not_replicated", "{refused}");
    // the sender sends it again, through another gateway: another connection, which has
    // written nothing
    let mut other = LogStore::connect(&url).await.unwrap();
    other.set_replica_wait(Some(WAIT));
    let again = other
        .commit(SHARD, "alice", "d-1", &["bob"], "one", 2, 60)
        .await;
    assert_eq!(
        again.as_ref().map_err(|e| e.code()).err(),
        Some("not_replicated"),
        "the resend was acknowledged with no replica holding the record: {again:?}"
    );
    signal(pid, "CONT");
    let mut ok = None;
    for _ in 0..20 {
        if let Ok(c) = other
            .commit(SHARD, "alice", "d-1", &["bob"], "one", 2, 60)
            .await
        {
            ok = Some(c);
            break;
        }
    }
    let c = ok.expect("acknowledged once the replica has it");
    assert!(c.duplicate, "the resend is the first commit: {c:?}");
}
