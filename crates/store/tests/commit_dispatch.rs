//! The commit side against a real redis-server: `LogStore::commit` (`commit_dispatch.lua`)
//! at the end of the u48 offset space, a log record above u48, and the dedupe key (length-
//! prefixed, unambiguous for any strings; the legacy form still read). The store takes raw
//! strings: it must not depend on the protocol's validation of ids.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tidemark_store::keys;
use tidemark_store::redis::dlog::{LogReader, LogStore};
use tidemark_store::redis::watermark::U48_MAX;
use tidemark_store::Error;

mod support;

const TTL: u64 = 60;

/// The core store on the test's redis-server.
struct Core {
    core: LogStore,
}

type Env = support::Env<Core>;

async fn env() -> Env {
    support::env(|url| async move {
        let core = LogStore::connect(&url).await.unwrap();
        Core { core }
    })
    .await
}

impl Env {
    /// Commits `body` from `sender` (client id `id`, sent at `t`) to bob in shard `s`:
    /// (offset, duplicate).
    async fn commit(
        &mut self,
        s: u32,
        (sender, id): (&str, &str),
        body: &str,
        t: u64,
    ) -> (u64, bool) {
        let c = self
            .core
            .commit(s, sender, id, &["bob"], body, t, TTL)
            .await;
        let c = c.unwrap_or_else(|e| panic!("commit {sender:?} {id:?}: {e:?}"));
        (c.offset, c.duplicate)
    }

    /// [`Env::commit`], which must be refused.
    async fn refused(&mut self, s: u32, (sender, id): (&str, &str), body: &str, t: u64) -> Error {
        let c = self
            .core
            .commit(s, sender, id, &["bob"], body, t, TTL)
            .await;
        c.expect_err("a refused commit")
    }

    /// alice's `w-1` to bob ("hi", sent at `t`) with the request digest `digest`.
    async fn request(&mut self, s: u32, t: u64, digest: &str) -> Result<(u64, bool), Error> {
        let c = self
            .core
            .commit_request(s, "alice", "w-1", &["bob"], "hi", t, TTL, digest);
        c.await.map(|c| (c.offset, c.duplicate))
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
    let c = e.commit(s, ("alice", "m-1"), "last", 1).await;
    assert_eq!(c, (U48_MAX, false));
    let recs = e.core.read_after(s, U48_MAX - 1, 10).await.unwrap();
    assert_eq!(recs.len(), 1);
    assert_eq!((recs[0].offset, recs[0].prev), (U48_MAX, U48_MAX - 1));

    // the next one is refused before INCR: head unchanged, no XADD, no dedupe record
    let keys_before = all_keys(&mut e.raw).await;
    let err = e.refused(s, ("alice", "m-2"), "one too many", 2).await;
    assert!(
        matches!(err, Error::LogExhausted { shard } if shard == s),
        "{err:?}"
    );
    assert_eq!(err.code(), "log_exhausted");
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX);
    assert_eq!(e.core.log_len(s).await.unwrap(), 1);
    assert_eq!(all_keys(&mut e.raw).await, keys_before);
    // and again: nothing ever goes past u48
    let err = e.refused(s, ("carol", "m-3"), "x", 3).await;
    assert!(matches!(err, Error::LogExhausted { .. }), "{err:?}");
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX);

    // a retry of a send that did commit is still answered with its offset
    let c = e.commit(s, ("alice", "m-1"), "last", 1).await;
    assert_eq!(c, (U48_MAX, true));

    // a head set above u48 by hand is refused too, and left as it is
    let _: () = e.raw.set(keys::head(s), U48_MAX + 5).await.unwrap();
    let err = e.refused(s, ("dave", "m-4"), "x", 4).await;
    assert!(matches!(err, Error::LogExhausted { .. }), "{err:?}");
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX + 5);
    assert_eq!(e.core.log_len(s).await.unwrap(), 1);
    // other shards are not affected
    assert_eq!(e.commit(s + 1, ("alice", "m-2"), "x", 5).await.0, 1);
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
    let mut reader = LogReader::connect(&e.redis.url()).await.unwrap();
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
    let first = e.commit(s, ("a\0b", "c"), "one", 1).await;
    let second = e.commit(s, ("a", "b\0c"), "two", 2).await;
    assert_eq!(first, (1, false));
    assert_eq!(second, (2, false));
    let recs = e.core.read_after(s, 0, 10).await.unwrap();
    let got: Vec<(&str, &str, &str)> = recs
        .iter()
        .map(|r| (r.sender.as_str(), r.client_id.as_str(), r.body.as_str()))
        .collect();
    assert_eq!(got, [("a\0b", "c", "one"), ("a", "b\0c", "two")]);
    // and each is still deduplicated against itself
    for (sender, id, off, body) in [("a\0b", "c", 1, "one"), ("a", "b\0c", 2, "two")] {
        let c = e.commit(s, (sender, id), body, 3).await;
        assert_eq!(c, (off, true), "{sender:?} {id:?}");
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
    assert_eq!(e.commit(s, ("alice", "m-1"), "retry", 1).await, (41, true));
    assert_eq!(e.core.head(s).await.unwrap(), 0, "nothing committed");
    assert_eq!(e.core.log_len(s).await.unwrap(), 0);
    assert_eq!(all_keys(&mut e.raw).await, [legacy.into_bytes()]);

    // a new send writes the length-prefixed key only
    assert_eq!(e.commit(s, ("alice", "m-2"), "new", 2).await, (1, false));
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
    assert_eq!(e.request(s, 1, &d1).await.unwrap(), (1, false));
    assert_eq!(e.request(s, 2, &d1).await.unwrap(), (1, true));
    let d2 = request_digest(&["bob"], "hi");
    match e.request(s, 3, &d2).await {
        Err(tidemark_store::Error::IdReused { shard, offset }) => {
            assert_eq!((shard, offset), (s, 1))
        }
        other => panic!("expected IdReused, got {other:?}"),
    }
    assert_eq!(e.core.head(s).await.unwrap(), 1, "nothing committed");
    assert_eq!(e.core.read_after(s, 0, 10).await.unwrap().len(), 1);
}
