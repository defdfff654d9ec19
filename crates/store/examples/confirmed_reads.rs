//! What ADR-0064's confirmation costs a log reader: a backlog read in batches with and without
//! a replica wait, on one primary with one replica (real redis-servers), alternated.
//!
//! ```sh
//! cargo run --release -p tidemark-store --example confirmed_reads -- [RECORDS] [ROUNDS]
//! ```
//!
//! For each read of the whole backlog (4 shards, `XREAD COUNT 512` per shard, as a worker
//! reads): the wall time, and the CPU the primary and the replica spent (`used_cpu_sys` +
//! `used_cpu_user` from `INFO cpu` before and after), per record.

use std::time::{Duration, Instant};

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::{
    request_digest, CommitRequest, LogReader, LogStore, ReplicaWait, DEFAULT_DEDUPE_TTL_S,
};

const SHARDS: u32 = 4;
const BATCH: usize = 512;

async fn cpu_s(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k, "used_cpu_sys" | "used_cpu_user").then(|| v.trim().parse::<f64>().ok())?
        })
        .sum()
}

async fn connect(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let records: u64 = args.next().map_or(200_000, |a| a.parse().unwrap());
    let rounds: usize = args.next().map_or(3, |a| a.parse().unwrap());
    let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let replica = RedisProcess::start_replica_of(&primary).expect("replica");
    let mut p = connect(&primary.url()).await;
    let mut r = connect(&replica.url()).await;

    // the backlog: `records` one-recipient records over the shards, 64 per call
    let mut log = LogStore::connect(&primary.url()).await.unwrap();
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
        log.commit_group(c as u32 % SHARDS, &reqs, DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap();
    }
    // wait until the replica has it all
    loop {
        // (an error while the replica loads what the primary sent)
        let n: Result<u64, _> = redis::cmd("DBSIZE").query_async(&mut r).await;
        let m: u64 = redis::cmd("DBSIZE").query_async(&mut p).await.unwrap();
        if n.is_ok_and(|n| n == m) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("backlog: {records} records over {SHARDS} shards, batches of {BATCH} per shard");
    println!("variant    wall ms   µs/record wall   primary µs/record   replica µs/record");
    for round in 0..rounds {
        for wait in [None, Some(1)] {
            let mut reader = LogReader::connect(&primary.url()).await.unwrap();
            reader.set_replica_wait(wait.map(|n| ReplicaWait {
                replicas: n,
                timeout: Duration::from_secs(1),
            }));
            let (p0, r0) = (cpu_s(&mut p).await, cpu_s(&mut r).await);
            let start = Instant::now();
            let mut pos: Vec<(u32, u64)> = (0..SHARDS).map(|s| (s, 0)).collect();
            let mut got = 0u64;
            while got < records {
                for (s, recs) in reader.read(&pos, BATCH, Duration::ZERO).await.unwrap() {
                    got += recs.len() as u64;
                    let last = recs.last().unwrap().offset;
                    pos.iter_mut().find(|(x, _)| *x == s).unwrap().1 = last;
                }
            }
            let wall = start.elapsed();
            let (p1, r1) = (cpu_s(&mut p).await, cpu_s(&mut r).await);
            let per = |s: f64| s * 1e6 / records as f64;
            println!(
                "{:<10} {:>7.1}   {:>14.2}   {:>17.2}   {:>17.2}   (round {})",
                if wait.is_some() { "confirmed" } else { "plain" },
                wall.as_secs_f64() * 1e3,
                per(wall.as_secs_f64()),
                per(p1 - p0),
                per(r1 - r0),
                round + 1
            );
        }
    }
}
