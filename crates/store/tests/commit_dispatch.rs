//! The commit side against a real redis-server: `LogStore::commit` (`commit_dispatch.lua`)
//! at the end of the u48 offset space, a log record above u48, and the dedupe key (length-
//! prefixed, unambiguous for any strings; the legacy form still read). The store takes raw
//! strings: it must not depend on the protocol's validation of ids.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tidemark_redis_proc::RedisProcess;
use tidemark_store::keys;
use tidemark_store::redis::dlog::{LogReader, LogStore};
use tidemark_store::redis::watermark::U48_MAX;
use tidemark_store::Error;

const TTL: u64 = 60;

struct Env {
    _redis: RedisProcess,
    url: String,
    raw: ConnectionManager,
    core: LogStore,
}

async fn env() -> Env {
    let redis = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let url = redis.url();
    let raw = ConnectionManager::new(redis::Client::open(url.as_str()).unwrap())
        .await
        .unwrap();
    let core = LogStore::connect(&url).await.unwrap();
    Env {
        _redis: redis,
        url,
        raw,
        core,
    }
}

/// Every key of the core Redis, sorted (binary-safe).
async fn all_keys(raw: &mut ConnectionManager) -> Vec<Vec<u8>> {
    let mut k: Vec<Vec<u8>> = raw.keys("*").await.unwrap();
    k.sort();
    k
}

#[tokio::test]
async fn a_commit_at_the_last_u48_offset_is_refused_without_writing() {
    let mut e = env().await;
    let s = 3;
    // the last offset is still assigned
    let _: () = e.raw.set(keys::head(s), U48_MAX - 1).await.unwrap();
    let c = e
        .core
        .commit(s, "alice", "m-1", &["bob"], "last", 1, TTL)
        .await
        .unwrap();
    assert_eq!((c.offset, c.duplicate), (U48_MAX, false));
    let recs = e.core.read_after(s, U48_MAX - 1, 10).await.unwrap();
    assert_eq!(recs.len(), 1);
    assert_eq!((recs[0].offset, recs[0].prev), (U48_MAX, U48_MAX - 1));

    // the next one is refused before INCR: head unchanged, no XADD, no dedupe record
    let keys_before = all_keys(&mut e.raw).await;
    let err = e
        .core
        .commit(s, "alice", "m-2", &["bob"], "one too many", 2, TTL)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::LogExhausted { shard } if shard == s),
        "{err:?}"
    );
    assert_eq!(err.code(), "log_exhausted");
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX);
    assert_eq!(e.core.log_len(s).await.unwrap(), 1);
    assert_eq!(all_keys(&mut e.raw).await, keys_before);
    // and again: nothing ever goes past u48
    assert!(matches!(
        e.core
            .commit(s, "carol", "m-3", &["bob"], "x", 3, TTL)
            .await
            .unwrap_err(),
        Error::LogExhausted { .. }
    ));
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX);

    // a retry of a send that did commit is still answered with its offset
    let c = e
        .core
        .commit(s, "alice", "m-1", &["bob"], "last", 1, TTL)
        .await
        .unwrap();
    assert_eq!((c.offset, c.duplicate), (U48_MAX, true));

    // a head set above u48 by hand is refused too, and left as it is
    let _: () = e.raw.set(keys::head(s), U48_MAX + 5).await.unwrap();
    assert!(matches!(
        e.core
            .commit(s, "dave", "m-4", &["bob"], "x", 4, TTL)
            .await
            .unwrap_err(),
        Error::LogExhausted { .. }
    ));
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX + 5);
    assert_eq!(e.core.log_len(s).await.unwrap(), 1);
    // other shards are not affected
    let c = e
        .core
        .commit(s + 1, "alice", "m-2", &["bob"], "x", 5, TTL)
        .await
        .unwrap();
    assert_eq!(c.offset, 1);
}

#[tokio::test]
async fn a_log_record_above_u48_is_a_bad_record() {
    let mut e = env().await;
    let s = 0;
    let off = U48_MAX + 1;
    let _: String = redis::cmd("XADD")
        .arg(keys::dlog(s))
        .arg(format!("{off}-0"))
        .arg(&[
            ("p", U48_MAX.to_string()),
            ("f", "alice".into()),
            ("c", "m-1".into()),
            ("r", "\u{3}bob".into()),
            ("b", "hi".into()),
            ("t", "1".into()),
        ])
        .query_async(&mut e.raw)
        .await
        .unwrap();
    let err = e.core.read_after(s, 0, 10).await.unwrap_err();
    assert!(
        matches!(err, Error::BadRecord { shard: 0, offset, .. } if offset == off),
        "{err:?}"
    );
    // the materializer's blocking reader refuses it the same way
    let mut reader = LogReader::connect(&e.url).await.unwrap();
    let err = reader
        .read(&[(s, 0)], 10, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::BadRecord { offset, .. } if offset == off),
        "{err:?}"
    );
}

#[tokio::test]
async fn senders_and_ids_with_nul_no_longer_share_a_dedupe_key() {
    let mut e = env().await;
    let s = 1;
    // with `dd:{s}:<sender>\0<client id>` both were `dd:{1}:a\0b\0c`
    let first = e
        .core
        .commit(s, "a\0b", "c", &["bob"], "one", 1, TTL)
        .await
        .unwrap();
    let second = e
        .core
        .commit(s, "a", "b\0c", &["bob"], "two", 2, TTL)
        .await
        .unwrap();
    assert_eq!((first.offset, first.duplicate), (1, false));
    assert_eq!((second.offset, second.duplicate), (2, false));
    let recs = e.core.read_after(s, 0, 10).await.unwrap();
    let got: Vec<(&str, &str, &str)> = recs
        .iter()
        .map(|r| (r.sender.as_str(), r.client_id.as_str(), r.body.as_str()))
        .collect();
    assert_eq!(got, [("a\0b", "c", "one"), ("a", "b\0c", "two")]);
    // and each is still deduplicated against itself
    for (sender, id, off, body) in [("a\0b", "c", 1, "one"), ("a", "b\0c", 2, "two")] {
        let c = e
            .core
            .commit(s, sender, id, &["bob"], body, 3, TTL)
            .await
            .unwrap();
        assert_eq!((c.offset, c.duplicate), (off, true), "{sender:?} {id:?}");
    }
    assert_eq!(e.core.head(s).await.unwrap(), 2);
}

#[tokio::test]
async fn a_dedupe_record_in_the_legacy_key_format_is_still_a_duplicate() {
    let mut e = env().await;
    let s = 2;
    // written by the previous code: dd:{s}:<sender>\0<client id>, within its 24 h
    let legacy = format!("dd:{{{s}}}:alice\0m-1");
    let _: () = e.raw.set_ex(&legacy, 41u64, 3600).await.unwrap();
    let c = e
        .core
        .commit(s, "alice", "m-1", &["bob"], "retry", 1, TTL)
        .await
        .unwrap();
    assert_eq!((c.offset, c.duplicate), (41, true));
    assert_eq!(e.core.head(s).await.unwrap(), 0, "nothing committed");
    assert_eq!(e.core.log_len(s).await.unwrap(), 0);
    assert_eq!(all_keys(&mut e.raw).await, [legacy.into_bytes()]);

    // a new send writes the length-prefixed key only
    let c = e
        .core
        .commit(s, "alice", "m-2", &["bob"], "new", 2, TTL)
        .await
        .unwrap();
    assert_eq!((c.offset, c.duplicate), (1, false));
    let new_key = keys::dedupe(s, "alice", "m-2");
    assert_eq!(new_key, format!("dd:{{{s}}}:5:alicem-2"));
    let v: Option<String> = e.raw.get(&new_key).await.unwrap();
    let digest = tidemark_store::redis::dlog::request_digest(&["bob"], "new");
    assert_eq!(v, Some(format!("1:{digest}")), "offset and request digest");
    let ttl: i64 = e.raw.ttl(&new_key).await.unwrap();
    assert!((1..=TTL as i64).contains(&ttl), "{ttl}");
    let old: Option<String> = e
        .raw
        .get(keys::dedupe_legacy(s, "alice", "m-2"))
        .await
        .unwrap();
    assert_eq!(old, None, "the legacy form is never written");
}

/// Issue 10, item 5: the dedupe record keeps a digest of the whole request; the same id with
/// another digest is refused with `IdReused` and writes nothing.
#[tokio::test]
async fn the_same_id_with_another_request_is_refused_and_writes_nothing() {
    use tidemark_store::redis::dlog::request_digest;
    let mut e = env().await;
    let s = 3;
    let d1 = request_digest(&["bob", "carol"], "hi");
    let c = e
        .core
        .commit_request(s, "alice", "w-1", &["bob"], "hi", 1, TTL, &d1)
        .await
        .unwrap();
    assert_eq!((c.offset, c.duplicate), (1, false));
    let again = e
        .core
        .commit_request(s, "alice", "w-1", &["bob"], "hi", 2, TTL, &d1)
        .await
        .unwrap();
    assert_eq!((again.offset, again.duplicate), (1, true));
    let d2 = request_digest(&["bob"], "hi");
    match e
        .core
        .commit_request(s, "alice", "w-1", &["bob"], "hi", 3, TTL, &d2)
        .await
    {
        Err(tidemark_store::Error::IdReused { shard, offset }) => {
            assert_eq!((shard, offset), (s, 1))
        }
        other => panic!("expected IdReused, got {other:?}"),
    }
    assert_eq!(e.core.head(s).await.unwrap(), 1, "nothing committed");
    assert_eq!(e.core.read_after(s, 0, 10).await.unwrap().len(), 1);
}
