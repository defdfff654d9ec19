//! The loss of a core primary that held a record no replica had (ADR-0064), on a real Redis
//! Cluster: three core primaries with two replicas each, a mailbox instance of its own, the
//! whole service (`run::serve`) and clients on real WebSockets.
//!
//! Before ADR-0064 the materializer read the log on the primary and applied a record the
//! replicas did not have yet (its send was refused: its `WAIT` counted no replica). W passed
//! its offset. After a failover to a replica without it, the head was below W again: the
//! next acknowledged send took that offset, and the materializer, reading after W, never
//! delivered it. The GC raises the head back to W, but only at its next pass (about once a
//! second); this test sets the GC an hour apart so that its window stays open, as it would
//! for every send in it.

mod gateway_support;

use std::time::{Duration, Instant};

use gateway_support::*;
use tidemark_redis_proc::{key_slot, ClusterOptions, RedisCluster, RedisProcess};
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run;
use tidemark_store::endpoint::cluster_endpoint;
use tidemark_store::redis::dlog::WaitPolicy;
use tokio_util::sync::CancellationToken;

/// Sends `id` until it is acknowledged (a failover refuses sends for a while); its offset
/// for `to`.
async fn send_until_acked(ws: &mut Ws, id: &str, to: &str, body: &str) -> u64 {
    let start = Instant::now();
    loop {
        let r = ws.send_msg(id, &[to], body).await;
        if r["type"] == "send_ack" {
            return offset_of(r["offsets"].as_object().unwrap(), to);
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{id} never acknowledged: {r}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_only_the_lost_core_primary_held_does_not_hide_the_next_acknowledged_send() {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return;
    }
    let mut c = RedisCluster::start(ClusterOptions {
        replicas_per_primary: 2,
        node_timeout_ms: 1000,
        ..ClusterOptions::default()
    })
    .expect("start a 3+6 Redis Cluster");
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
    let wait = WaitPolicy {
        replicas: Some(1),
        timeout: Duration::from_millis(500),
    };
    let gateway = GatewayOptions {
        dev_auth: true,
        recheck_interval: None,
        core_wait: wait,
        ..GatewayOptions::default()
    };
    let materializer = MaterializerOptions {
        core_wait: wait,
        gc_interval: Duration::from_secs(3600),
        gc_idle_interval: Duration::from_secs(3600),
        ..MaterializerOptions::default()
    };
    let cancel = CancellationToken::new();
    let running = run::serve(
        serve_options(
            cluster_endpoint(&c.seeds()),
            mailbox.url(),
            gateway,
            materializer,
        ),
        cancel.clone(),
    )
    .await
    .expect("serve");
    let mut alice = ready_at(running.addr, "alice").await;
    let mut bob = ready_at(running.addr, "bob").await;

    let zero = send_until_acked(&mut alice, "m-0", "bob", "zero").await;
    bob.expect_message(zero, "zero").await;

    // bob's shard's core primary loses both replicas' links; they stay stopped, so nothing
    // written from now on reaches them
    let slot = key_slot(format!("dlog:{{{}}}", shard_of("bob")).as_bytes());
    let primary = c.primary_of_slot(slot).expect("slot served");
    let replicas = c.replicas_of(primary);
    assert_eq!(replicas.len(), 2, "two replicas of node {primary}");
    for &r in &replicas {
        c.pause(r).unwrap();
    }
    c.call(primary, &["CLIENT", "KILL", "TYPE", "replica"])
        .unwrap();

    // a record only the primary holds: refused (no replica confirmed it), and not delivered
    alice.send_refused("m-1", &["bob"], "one", "internal").await;
    let early = bob.quiet_for(Duration::from_secs(2)).await;
    assert!(
        early.iter().all(|f| f["type"] != "deliver"),
        "a record no replica had was delivered: {early:?}"
    );

    // the primary is lost; one of the replicas (neither has m-1) takes over
    c.kill9(primary).unwrap();
    for &r in &replicas {
        c.resume(r).unwrap();
    }
    let start = Instant::now();
    loop {
        if matches!(c.primary_of_slot(slot), Some(p) if replicas.contains(&p)) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no replica of node {primary} was promoted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.wait_consistent().expect("the cluster settles");

    // the next acknowledged send is delivered, and so is m-1 once resent
    let two = send_until_acked(&mut alice, "m-2", "bob", "two").await;
    bob.expect_message(two, "two").await;
    let one = send_until_acked(&mut alice, "m-1", "bob", "one").await;
    assert!(one > two, "m-1 resent after m-2: {one} > {two}");
    bob.expect_message(one, "one").await;

    tokio::time::timeout(2 * WAIT, running.shutdown())
        .await
        .expect("service did not stop in time")
        .expect("service stopped with an error");
}
