//! The GC's check before it trims the core log (ADR-0063): W counts as on the mailbox
//! replicas only if a `WAIT` covered it, whatever connection the check runs on.
//!
//! Why: the log below W is trimmed once the check passes. If a replica that lacks W is then
//! promoted, W goes back, and the records between must be materialised again from the log:
//! trimmed, they are gone, and the shard is held at a discontinuity. The old check (`EXISTS`
//! then `WAIT` on the store's connection) relied on that connection having written W; after
//! a reconnect, its `WAIT` answered at once with the replicas attached and confirmed a W no
//! replica held.

use std::time::Duration;

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::dlog::WaitPolicy;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

mod support;
use support::signal;

const SHARD: u32 = 5;

/// Cuts every normal client connection of the instance at `url` but the caller's.
async fn cut_clients(url: &str) {
    let mut raw = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let cut: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(cut >= 1, "the store's connection was cut");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_w_only_the_primary_holds_is_not_confirmed_after_a_reconnect() {
    let primary = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let replica = RedisProcess::start_replica_of(&primary).expect("a replica");
    let pid = replica.pid().expect("running");
    let url = primary.url();
    let mut store = MailboxStore::connect(&url, Layout::PackedV2).await.unwrap();
    let wait = store
        .set_replica_wait(&WaitPolicy {
            replicas: Some(1),
            timeout: Duration::from_secs(1),
        })
        .await
        .unwrap();
    assert!(wait.is_some(), "one replica asked for");

    // W = 5 on both: confirmed (replication is quick, not instant: a few tries)
    store
        .init_watermark(SHARD, Layout::PackedV2, 1, 5, false)
        .await
        .unwrap();
    assert_eq!(
        confirmed_soon(&mut store, 5).await,
        Some(5),
        "a W on the replica is confirmed"
    );

    // the replica stops (still attached: the primary counts it until its repl-timeout);
    // W = 9 reaches the primary alone, written on the store's connection
    signal(pid, "STOP");
    store
        .init_watermark(SHARD, Layout::PackedV2, 1, 9, true)
        .await
        .unwrap();
    assert_eq!(
        store.confirm_replicated(SHARD, 9).await.unwrap(),
        None,
        "a W no replica holds is not confirmed"
    );

    // the store's connection drops and is made again: a connection that wrote nothing
    cut_clients(&url).await;
    let mut reconnected = false;
    for _ in 0..50 {
        if store.read_watermark(SHARD).await.is_ok() {
            reconnected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reconnected, "the store reconnects");
    for _ in 0..3 {
        let got = store.confirm_replicated(SHARD, 9).await.unwrap();
        assert!(
            got.is_none_or(|w| w <= 5),
            "after a reconnect, a W only the primary holds was confirmed as {got:?}: the log \
             would be trimmed below what a promoted replica holds"
        );
    }

    // once the replica runs again, W = 9 is confirmed
    signal(pid, "CONT");
    assert_eq!(
        confirmed_soon(&mut store, 9).await,
        Some(9),
        "confirmed once the replica has it"
    );
}

/// The check's answer for `w` once it confirms something, within 40 tries (replication is
/// quick, not instant); `None` if it never does.
async fn confirmed_soon(store: &mut MailboxStore, w: u64) -> Option<u64> {
    for _ in 0..40 {
        if let Some(got) = store.confirm_replicated(SHARD, w).await.unwrap() {
            return Some(got);
        }
    }
    None
}
