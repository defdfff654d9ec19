//! `ack_mailbox.lua` against a real redis-server: many acks in one call (ADR-0053), each
//! standing alone (monotonic, trimming its mailbox, failing only itself), and the calls they
//! take.

use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tidemark_store::keys;
use tidemark_store::redis::store::{MailboxStore, ACKS_PER_CALL};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::Error;

mod support;

use support::{evalsha_calls, reset_stats, script_flush};

type Env = support::Env<MailboxStore>;

async fn env() -> Env {
    support::env(|url| async move { MailboxStore::connect(&url, Layout::PackedV2).await.unwrap() })
        .await
}

/// Puts entries with seqs `1..=n` in `user`'s mailbox of shard `shard`.
async fn fill(raw: &mut ConnectionManager, shard: u32, user: &str, n: u64) {
    for seq in 1..=n {
        let _: () = raw
            .zadd(keys::mailbox(shard, user), format!("e{seq}"), seq)
            .await
            .unwrap();
    }
}

/// The seqs left in a mailbox.
async fn seqs(raw: &mut ConnectionManager, shard: u32, user: &str) -> Vec<u64> {
    let v: Vec<(String, u64)> = raw
        .zrange_withscores(keys::mailbox(shard, user), 0, -1)
        .await
        .unwrap();
    v.into_iter().map(|(_, s)| s).collect()
}

#[tokio::test]
async fn acks_of_many_mailboxes_go_in_one_call_and_each_stands_alone() {
    let mut e = env().await;
    fill(&mut e.raw, 1, "alice", 5).await;
    fill(&mut e.raw, 1, "bob", 5).await;
    fill(&mut e.raw, 2, "carol", 5).await;
    // shard 3's ack hash is a string: dave's ack fails, and only his
    let _: () = e.raw.set(keys::acks(3), "not a hash").await.unwrap();
    reset_stats(&mut e.raw).await;
    let acks = [
        (1, "alice", 3),
        (1, "bob", 2),
        (3, "dave", 1),
        (2, "carol", 5),
        (1, "alice", 2),      // below alice's ack: changes nothing
        (1, "alice", 4),      // a later ack of the same mailbox sees the first
        (1, "erin", 1 << 48), // above u48: refused before any call
    ];
    let out = e.ack_mailboxes(&acks).await.unwrap();
    assert_eq!(out.len(), acks.len());
    assert_eq!(out[0].as_ref().unwrap(), &3);
    assert_eq!(out[1].as_ref().unwrap(), &2);
    match &out[2] {
        Err(Error::AckFailed {
            shard,
            user,
            detail,
        }) => {
            assert_eq!((*shard, user.as_str()), (3, "dave"));
            assert!(detail.contains("WRONGTYPE"), "{detail}");
        }
        other => panic!("dave's ack: {other:?}"),
    }
    assert_eq!(out[2].as_ref().unwrap_err().code(), "ack_failed");
    assert_eq!(out[3].as_ref().unwrap(), &5);
    assert_eq!(out[4].as_ref().unwrap(), &3, "an ack never moves back");
    assert_eq!(out[5].as_ref().unwrap(), &4);
    assert!(
        matches!(out[6], Err(Error::InvalidArgument(_))),
        "{:?}",
        out[6]
    );
    assert_eq!(
        evalsha_calls(&mut e.raw).await,
        1,
        "the six acks that reached Redis took one call"
    );
    // each mailbox trimmed to its own ack
    assert_eq!(seqs(&mut e.raw, 1, "alice").await, vec![5]);
    assert_eq!(seqs(&mut e.raw, 1, "bob").await, vec![3, 4, 5]);
    assert_eq!(seqs(&mut e.raw, 2, "carol").await, Vec::<u64>::new());
    assert_eq!(e.acked(1, "alice").await.unwrap(), 4);
    assert_eq!(e.acked(1, "bob").await.unwrap(), 2);
    assert_eq!(e.acked(2, "carol").await.unwrap(), 5);
    // one ack alone: the same script
    assert_eq!(e.ack_mailbox(1, "bob", 4).await.unwrap(), 4);
    assert_eq!(seqs(&mut e.raw, 1, "bob").await, vec![5]);
    let alone = e.ack_mailbox(3, "dave", 2).await.unwrap_err();
    assert_eq!(alone.code(), "ack_failed", "{alone}");
}

#[tokio::test]
async fn a_large_batch_is_split_into_bounded_calls() {
    let mut e = env().await;
    let users: Vec<String> = (0..=ACKS_PER_CALL).map(|i| format!("u{i}")).collect();
    for u in &users {
        fill(&mut e.raw, 7, u, 2).await;
    }
    reset_stats(&mut e.raw).await;
    let acks: Vec<(u32, &str, u64)> = users.iter().map(|u| (7, u.as_str(), 1)).collect();
    let out = e.ack_mailboxes(&acks).await.unwrap();
    assert!(out.iter().all(|a| matches!(a, Ok(1))), "{out:?}");
    assert_eq!(evalsha_calls(&mut e.raw).await, 2, "{} acks", acks.len());
    for u in &users {
        assert_eq!(seqs(&mut e.raw, 7, u).await, vec![2]);
    }
}

#[tokio::test]
async fn acks_after_a_script_flush_are_written() {
    let mut e = env().await;
    fill(&mut e.raw, 1, "alice", 3).await;
    script_flush(&mut e.raw).await;
    let out = e
        .ack_mailboxes(&[(1, "alice", 2), (1, "bob", 1)])
        .await
        .unwrap();
    assert!(matches!(out[..], [Ok(2), Ok(1)]), "{out:?}");
    assert_eq!(seqs(&mut e.raw, 1, "alice").await, vec![3]);
}
