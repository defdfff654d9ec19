//! What ADR-0064's confirmation costs a log reader: a backlog read in batches with and without
//! a replica wait, alternated, on one primary with one replica or (`cluster`) on a 3+3 Redis
//! Cluster (real redis-servers either way).
//!
//! ```sh
//! cargo run --release -p tidemark-store --example confirmed_reads -- [RECORDS] [ROUNDS] [cluster]
//! ```
//!
//! For each read of the whole backlog (`XREAD COUNT 512` per shard, as a worker reads; 4
//! shards on one instance, 16 on the cluster): the wall time, and the CPU the primaries and
//! the replicas spent (`used_cpu_sys` + `used_cpu_user` from `INFO cpu` before and after),
//! per record.

use std::time::{Duration, Instant};

use tidemark_redis_proc::{ClusterOptions, RedisCluster, RedisProcess};
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::{
    request_digest, CommitRequest, LogReader, LogStore, ReplicaWait, DEFAULT_DEDUPE_TTL_S,
};

const BATCH: usize = 512;

/// The servers under test: their primaries' and replicas' CPU seconds so far.
enum Servers {
    One {
        primary: RedisProcess,
        replica: RedisProcess,
    },
    Cluster(RedisCluster),
}

fn cpu_s(addr: std::net::SocketAddr) -> f64 {
    let mut c =
        tidemark_redis_proc::resp::Conn::connect(addr, None, Duration::from_secs(5)).unwrap();
    let info = c.call(&["INFO", "cpu"]).unwrap().text().unwrap();
    info.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k, "used_cpu_sys" | "used_cpu_user").then(|| v.trim().parse::<f64>().ok())?
        })
        .sum()
}

impl Servers {
    fn url(&self) -> String {
        match self {
            Servers::One { primary, .. } => primary.url(),
            Servers::Cluster(c) => cluster_endpoint(&c.seeds()),
        }
    }

    /// (primaries, replicas) CPU seconds.
    fn cpu(&self) -> (f64, f64) {
        match self {
            Servers::One { primary, replica } => (cpu_s(primary.addr()), cpu_s(replica.addr())),
            Servers::Cluster(c) => {
                let sum = |nodes: Vec<usize>| nodes.into_iter().map(|i| cpu_s(c.addr(i))).sum();
                (sum(c.primaries()), sum(c.replicas()))
            }
        }
    }

    /// Whether every replica holds as many keys as its primary.
    fn replicated(&self) -> bool {
        let dbsize = |addr| {
            let mut c =
                tidemark_redis_proc::resp::Conn::connect(addr, None, Duration::from_secs(5))
                    .unwrap();
            c.call(&["DBSIZE"]).ok().and_then(|v| v.int())
        };
        match self {
            Servers::One { primary, replica } => {
                dbsize(replica.addr()).is_some() && dbsize(replica.addr()) == dbsize(primary.addr())
            }
            Servers::Cluster(c) => c.primaries().into_iter().all(|p| {
                c.replicas_of(p)
                    .into_iter()
                    .all(|r| dbsize(c.addr(r)).is_some() && dbsize(c.addr(r)) == dbsize(c.addr(p)))
            }),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let records: u64 = args.next().map_or(200_000, |a| a.parse().unwrap());
    let rounds: usize = args.next().map_or(3, |a| a.parse().unwrap());
    let cluster = args.next().as_deref() == Some("cluster");
    let (servers, shards) = if cluster {
        let c = RedisCluster::start(ClusterOptions::default()).expect("a 3+3 cluster");
        (Servers::Cluster(c), 16u32)
    } else {
        let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
        let replica = RedisProcess::start_replica_of(&primary).expect("replica");
        (Servers::One { primary, replica }, 4u32)
    };
    let url = servers.url();

    // the backlog: `records` one-recipient records over the shards, 64 per call
    let mut log = LogStore::connect(&url).await.unwrap();
    let body = "x".repeat(64);
    let digest = request_digest(&["bob"], &body);
    let ids: Vec<String> = (0..records).map(|i| format!("m-{i}")).collect();
    for (c, chunk) in ids.chunks(64).enumerate() {
        let reqs: Vec<CommitRequest<'_>> = chunk
            .iter()
            .map(|id| CommitRequest {
                sender: "alice",
                client_id: id,
                recipients: &["bob"],
                body: &body,
                sent_at_us: 1,
                digest: &digest,
                claim_home: None,
            })
            .collect();
        log.commit_group(c as u32 % shards, &reqs, DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap();
    }
    // wait until the replicas have it all
    while !servers.replicated() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "backlog: {records} records over {shards} shards ({}), batches of {BATCH} per shard",
        if cluster {
            "a 3+3 cluster"
        } else {
            "one primary, one replica"
        }
    );
    println!("variant    wall ms   µs/record wall   primaries µs/record   replicas µs/record");
    for round in 0..rounds {
        for wait in [None, Some(1)] {
            let mut reader = LogReader::connect(&url).await.unwrap();
            reader.set_replica_wait(wait.map(|n| ReplicaWait {
                replicas: n,
                timeout: Duration::from_secs(1),
            }));
            let (p0, r0) = servers.cpu();
            let start = Instant::now();
            let mut pos: Vec<(u32, u64)> = (0..shards).map(|s| (s, 0)).collect();
            let mut got = 0u64;
            while got < records {
                for (s, recs) in reader.read(&pos, BATCH, Duration::ZERO).await.unwrap() {
                    got += recs.len() as u64;
                    let last = recs.last().unwrap().offset;
                    pos.iter_mut().find(|(x, _)| *x == s).unwrap().1 = last;
                }
            }
            let wall = start.elapsed();
            let (p1, r1) = servers.cpu();
            let per = |s: f64| s * 1e6 / records as f64;
            println!(
                "{:<10} {:>7.1}   {:>14.2}   {:>19.2}   {:>18.2}   (round {})",
                if wait.is_some() { "confirmed" } else { "plain" },
                wall.as_secs_f64() * 1e3,
                per(wall.as_secs_f64()),
                per(p1 - p0),
                per(r1 - r0),
                round + 1
            );
        }
    }
    if let Servers::Cluster(mut c) = servers {
        degraded(&mut c, &mut log, shards).await;
    }
}

/// One node's replica stopped: one record more per shard, then reads with a 300 ms wait
/// until every other node's shards are handed on; then one record more on one of those, and
/// the time until it is handed on. Each read hands on what was confirmed
/// within `CONFIRM_GRACE` of the first confirmation; that node's shards time out in tasks of
/// their own and do not hold up the others.
async fn degraded(c: &mut RedisCluster, log: &mut LogStore, shards: u32) {
    let slot = tidemark_redis_proc::key_slot(b"dlog:{0}");
    let primary = c.primary_of_slot(slot).expect("served");
    let on_node = (0..shards)
        .filter(|s| {
            c.primary_of_slot(tidemark_redis_proc::key_slot(
                format!("dlog:{{{s}}}").as_bytes(),
            )) == Some(primary)
        })
        .count();
    // connected (and where every shard's log ends read) while every node answers
    let mut reader = LogReader::connect(&cluster_endpoint(&c.seeds()))
        .await
        .unwrap();
    let timeout = Duration::from_millis(300);
    reader.set_replica_wait(Some(ReplicaWait {
        replicas: 1,
        timeout,
    }));
    let mut pos: Vec<(u32, u64)> = Vec::new();
    for s in 0..shards {
        let head: Option<String> = redis::cmd("GET")
            .arg(format!("head:{{{s}}}"))
            .query_async(&mut log.connection())
            .await
            .unwrap();
        pos.push((s, head.map_or(0, |h| h.parse().unwrap())));
    }
    // (the first read also subscribes to the commit hints)
    assert!(reader
        .read(&pos, BATCH, Duration::ZERO)
        .await
        .unwrap()
        .is_empty());
    let replica = c.replicas_of(primary)[0];
    c.pause(replica).unwrap();
    let body = "x".repeat(64);
    let digest = request_digest(&["bob"], &body);
    let ids: Vec<String> = (0..shards).map(|s| format!("late-{s}")).collect();
    let request = |client_id| CommitRequest {
        sender: "alice",
        client_id,
        recipients: &["bob"],
        body: &body,
        sent_at_us: 1,
        digest: &digest,
        claim_home: None,
    };
    for (s, id) in (0..shards).zip(&ids) {
        log.commit_group(s, &[request(id)], DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap();
    }
    // (the commits' hints reach the reader's subscription)
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    let mut handed = std::collections::BTreeSet::new();
    let mut reads = Vec::new();
    while handed.len() < shards as usize - on_node && start.elapsed() < timeout * 10 {
        let t = Instant::now();
        let got = reader.read(&pos, BATCH, Duration::ZERO).await.unwrap();
        reads.push(format!(
            "{:.1} ms ({} shards)",
            t.elapsed().as_secs_f64() * 1e3,
            got.len()
        ));
        handed.extend(got.into_iter().map(|(s, _)| s));
    }
    println!(
        "degraded: the replica of the node serving {on_node} of {shards} shards stopped, \
         WAIT {timeout:?}: the other {} shards' records handed on after {:.1} ms, in {} \
         reads: {}",
        handed.len(),
        start.elapsed().as_secs_f64() * 1e3,
        reads.len(),
        reads.join(", ")
    );
    // then one record more on one of those shards, that node's shards still unconfirmed
    let mut later = pos.clone();
    for (s, recs) in reader.read(&pos, BATCH, Duration::ZERO).await.unwrap() {
        if let (Some(p), Some(last)) = (later.iter_mut().find(|(t, _)| *t == s), recs.last()) {
            p.1 = last.offset;
        }
    }
    let shard = *handed.iter().next().expect("a shard handed on");
    log.commit_group(shard, &[request("later")], DEFAULT_DEDUPE_TTL_S)
        .await
        .unwrap();
    let start = Instant::now();
    let mut took = None;
    while took.is_none() && start.elapsed() < timeout * 10 {
        let got = reader
            .read(&later, BATCH, Duration::from_millis(500))
            .await
            .unwrap();
        if got.iter().any(|(s, _)| *s == shard) {
            took = Some(start.elapsed());
        }
    }
    println!(
        "degraded, light traffic: one record more on shard {shard} handed on after {}",
        took.map_or("(not within 3 s)".to_string(), |t| format!(
            "{:.1} ms",
            t.as_secs_f64() * 1e3
        ))
    );
    c.resume(replica).unwrap();
}
