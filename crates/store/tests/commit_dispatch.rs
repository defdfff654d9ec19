//! The commit side against a real redis-server: `LogStore::commit` and `commit_group`
//! (`commit_dispatch.lua`; group commit, ADR-0036) at the end of the u48 offset space, a log
//! record above u48, the dedupe key (length-prefixed, unambiguous for any strings; the legacy
//! form still read), and a group's per-message answers. The store takes raw
//! strings: it must not depend on the protocol's validation of ids.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tidemark_store::keys;
use tidemark_store::redis::dlog::{LogReader, LogStore};
use tidemark_store::redis::watermark::U48_MAX;
use tidemark_store::Error;

mod support;

/// Runs each test `name(packed: bool)` in both record forms (ADR-0055), as `name::six_fields`
/// and `name::packed`: the commit script's arguments differ (7 or 3 per message), so every
/// path through it that counts them is run in both.
macro_rules! both_forms {
    ($($name:ident),* $(,)?) => { $(
        mod $name {
            #[tokio::test]
            async fn six_fields() {
                super::$name(false).await
            }
            #[tokio::test]
            async fn packed() {
                super::$name(true).await
            }
        }
    )* };
}

both_forms!(
    a_group_answers_each_message_as_if_it_were_committed_alone_in_order,
    the_parts_of_one_call_commit_as_separate_calls_and_fail_alone,
    a_one_key_claim_is_the_only_dedupe_record_of_a_one_shard_send,
    a_one_key_claim_whose_xadd_fails_is_taken_back,
    a_failed_part_of_one_key_messages_leaves_the_next_part_whole,
    a_part_that_fails_after_committing_counts_what_it_committed_in_its_head,
);

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

/// A message of a test group: (sender, id, recipients, body).
type Msg<'a> = (&'a str, &'a str, &'a [&'a str], &'a str);

/// Commits `msgs` as one group on shard `s` (digest of each: its recipients and body).
async fn group(e: &mut Env, s: u32, msgs: &[Msg<'_>]) -> Vec<Result<(u64, bool), Error>> {
    use tidemark_store::redis::dlog::{request_digest, CommitRequest};
    let digests: Vec<String> = msgs
        .iter()
        .map(|(_, _, rs, b)| request_digest(rs, b))
        .collect();
    let reqs: Vec<CommitRequest> = msgs
        .iter()
        .zip(&digests)
        .enumerate()
        .map(|(i, ((f, c, rs, b), d))| CommitRequest {
            sender: f,
            client_id: c,
            recipients: rs,
            body: b,
            sent_at_us: 100 + i as u64,
            digest: d,
            claim_home: None,
        })
        .collect();
    e.core
        .commit_group(s, &reqs, TTL)
        .await
        .expect("the group call")
        .into_iter()
        .map(|r| r.map(|c| (c.offset, c.duplicate)))
        .collect()
}

/// Every record of shard `s` in log order, as `offset prev sender client-id recipients body`.
async fn log_of(e: &mut Env, s: u32) -> Vec<String> {
    e.core
        .read_after(s, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            format!(
                "{} {} {} {} {} {}",
                r.offset,
                r.prev,
                r.sender,
                r.client_id,
                r.recipients.join(","),
                r.body
            )
        })
        .collect()
}

/// The client ids of shard `s`'s records, in log order.
async fn client_ids_of(e: &mut Env, s: u32) -> Vec<String> {
    log_of(e, s)
        .await
        .into_iter()
        .map(|l| l.split(' ').nth(3).unwrap().to_string())
        .collect()
}

/// ADR-0036: one call, many messages, each with the answer it would get alone at its place in
/// the group — a new one its offset (consecutive, in the group's order), a resend of an
/// earlier commit or of a message earlier in the same group a duplicate with that offset, the
/// same id with another request `id_reused` — and the log holds exactly the committed ones,
/// each record the message it answered.
async fn a_group_answers_each_message_as_if_it_were_committed_alone_in_order(packed: bool) {
    let mut e = env().await;
    e.core.set_packed_records(packed);
    let s = 2;
    assert_eq!(e.commit(s, ("zoe", "z-1"), "before", 1).await, (1, false));
    let got = group(
        &mut e,
        s,
        &[
            ("alice", "a-1", &["bob"], "one"),
            ("carol", "c-1", &["bob", "dan"], "two"),
            ("alice", "a-1", &["bob"], "one"), // resend within the group
            ("zoe", "z-1", &["bob"], "before"), // resend of an earlier commit
            ("alice", "a-1", &["bob"], "other body"), // id reused within the group
            ("zoe", "z-1", &["eve"], "before"), // id reused against the earlier commit
            ("alice", "a-2", &["eve"], "three"),
        ],
    )
    .await;
    let ok = |o, d| -> Result<(u64, bool), Error> { Ok((o, d)) };
    assert_eq!(got.len(), 7);
    assert_eq!(got[0].as_ref().ok(), ok(2, false).as_ref().ok());
    assert_eq!(got[1].as_ref().ok(), ok(3, false).as_ref().ok());
    assert_eq!(got[2].as_ref().ok(), ok(2, true).as_ref().ok());
    assert_eq!(got[3].as_ref().ok(), ok(1, true).as_ref().ok());
    assert!(
        matches!(got[4], Err(Error::IdReused { shard, offset: 2 }) if shard == s),
        "{:?}",
        got[4]
    );
    assert!(
        matches!(got[5], Err(Error::IdReused { shard, offset: 1 }) if shard == s),
        "{:?}",
        got[5]
    );
    assert_eq!(got[6].as_ref().ok(), ok(4, false).as_ref().ok());
    assert_eq!(e.core.head(s).await.unwrap(), 4);
    assert_eq!(
        log_of(&mut e, s).await,
        [
            "1 0 zoe z-1 bob before",
            "2 1 alice a-1 bob one",
            "3 2 carol c-1 bob,dan two",
            "4 3 alice a-2 eve three",
        ]
    );
    // each sent_at is its own message's (group index 0, 1, 6)
    let recs = e.core.read_after(s, 1, 10).await.unwrap();
    let t: Vec<u64> = recs.iter().map(|r| r.sent_at_us).collect();
    assert_eq!(t, [100, 101, 106]);
    // and every committed message dedupes on its own afterwards
    let again = group(
        &mut e,
        s,
        &[
            ("carol", "c-1", &["dan", "bob"], "two"),
            ("alice", "a-2", &["eve"], "three"),
        ],
    )
    .await;
    assert_eq!(again[0].as_ref().ok(), Some(&(3, true)));
    assert_eq!(again[1].as_ref().ok(), Some(&(4, true)));
}

/// The end of the u48 offset space in the middle of a group: the message that takes the last
/// offset commits, the new ones after it are refused (`log_exhausted`, nothing written), a
/// resend among them is still answered with its offset.
#[tokio::test]
async fn a_group_that_reaches_the_last_u48_offset_refuses_the_rest() {
    let mut e = env().await;
    let s = 1;
    let _: () = e.raw.set(keys::head(s), U48_MAX - 2).await.unwrap();
    let got = group(
        &mut e,
        s,
        &[
            ("a", "1", &["bob"], "x"),
            ("b", "1", &["bob"], "x"),
            ("c", "1", &["bob"], "x"),
            ("a", "1", &["bob"], "x"),
            ("d", "1", &["bob"], "x"),
        ],
    )
    .await;
    assert_eq!(got[0].as_ref().ok(), Some(&(U48_MAX - 1, false)));
    assert_eq!(got[1].as_ref().ok(), Some(&(U48_MAX, false)));
    assert!(
        matches!(got[2], Err(Error::LogExhausted { .. })),
        "{:?}",
        got[2]
    );
    assert_eq!(got[3].as_ref().ok(), Some(&(U48_MAX - 1, true)));
    assert!(
        matches!(got[4], Err(Error::LogExhausted { .. })),
        "{:?}",
        got[4]
    );
    assert_eq!(e.core.head(s).await.unwrap(), U48_MAX);
    assert_eq!(e.core.log_len(s).await.unwrap(), 2);
    let d: Option<String> = e.raw.get(keys::dedupe(s, "c", "1")).await.unwrap();
    assert_eq!(d, None, "a refused message leaves no dedupe record");
}

/// Writes a record at `offset` to shard `s`'s log without its head knowing (a damaged core
/// instance): the commit's next `XADD` at that offset collides.
async fn stray_record(e: &mut Env, s: u32, offset: u64) {
    let _: String = redis::cmd("XADD")
        .arg(keys::dlog(s))
        .arg(format!("{offset}-0"))
        .arg(&[
            ("p", (offset - 1).to_string()),
            ("f", "zz".into()),
            ("c", "q".into()),
            ("r", "\u{3}bob".into()),
            ("b", "x".into()),
            ("t", "1".into()),
        ])
        .query_async(&mut e.raw)
        .await
        .unwrap();
}

/// An `XADD` the instance refuses (out of memory here; READONLY after a failover,
/// NOREPLICAS and MISCONF come the same way) is a failed commit (`commit_failed`), not a log
/// ahead of its head: before, every `XADD` failure was reported as a damaged log.
#[tokio::test]
async fn an_xadd_the_instance_refuses_is_a_failed_commit_not_a_damaged_log() {
    use tidemark_store::redis::dlog::{request_digest, CommitRequest};
    let mut e = env().await;
    let d = request_digest(&["bob"], "x");
    // no claim: the record's XADD is the message's first write
    let req = CommitRequest {
        sender: "alice",
        client_id: "oom-1",
        recipients: &["bob"],
        body: "x",
        sent_at_us: 1,
        digest: &d,
        claim_home: None,
    };
    let config = |e: &mut Env, v: &'static str| {
        let mut c = e.raw.clone();
        async move {
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(v)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    };
    config(&mut e, "1").await;
    let r = e
        .core
        .commit_group(0, std::slice::from_ref(&req), TTL)
        .await
        .expect("the call");
    config(&mut e, "0").await;
    assert!(
        matches!(&r[..], [Err(err @ Error::CommitFailed { shard: 0, detail })]
            if err.code() == "commit_failed" && detail.contains("OOM")),
        "{r:?}"
    );
    // nothing was written: the resend commits at offset 1
    let r = e
        .core
        .commit_group(0, std::slice::from_ref(&req), TTL)
        .await
        .expect("the call");
    assert_eq!(
        r[0].as_ref().map(|c| (c.offset, c.duplicate)).ok(),
        Some((1, false)),
        "{r:?}"
    );
}

/// A log whose last record is above its head (a damaged core instance): the group's XADD
/// fails, that message and the rest of the group are refused (`log_ahead_of_head`), and
/// nothing is written for them (no head moved, no dedupe record); a resend before the
/// failure is still answered.
#[tokio::test]
async fn a_failed_xadd_refuses_the_rest_of_the_group_and_writes_nothing() {
    let mut e = env().await;
    let s = 0;
    assert_eq!(e.commit(s, ("a", "1"), "x", 1).await, (1, false));
    // a record at offset 2 without the head knowing: the next XADD (2-0) collides
    stray_record(&mut e, s, 2).await;
    use tidemark_store::redis::dlog::{request_digest, CommitRequest};
    let d = request_digest(&["bob"], "x");
    let req = |f: &'static str| CommitRequest {
        sender: f,
        client_id: "1",
        recipients: &["bob"],
        body: "x",
        sent_at_us: 1,
        digest: "",
        claim_home: None,
    };
    let reqs = [
        CommitRequest {
            digest: &d,
            ..req("a")
        },
        CommitRequest {
            digest: &d,
            ..req("b")
        },
        CommitRequest {
            digest: &d,
            ..req("c")
        },
    ];
    let r = e.core.commit_group(s, &reqs, TTL).await.expect("the call");
    assert_eq!(
        r[0].as_ref().map(|c| (c.offset, c.duplicate)).ok(),
        Some((1, true)),
        "{r:?}"
    );
    for a in &r[1..] {
        assert!(
            matches!(a, Err(e @ Error::LogAheadOfHead { shard: 0, .. }) if e.code() == "log_ahead_of_head"),
            "{a:?}"
        );
    }
    assert_eq!(e.core.head(s).await.unwrap(), 1);
    for f in ["b", "c"] {
        let d: Option<String> = e.raw.get(keys::dedupe(s, f, "1")).await.unwrap();
        assert_eq!(d, None, "no dedupe record for {f}");
    }
    // the resend ahead of the failure was answered before it: still a duplicate
    assert_eq!(e.commit(s, ("a", "1"), "x", 1).await, (1, true));
}

/// ADR-0051: the parts of several shards in one call are each committed as their own call
/// would commit them, in the call's order: shard 4's second part continues after its first
/// (a resend of the first part's message is a duplicate there), and a damaged log (shard 6,
/// a record above its head) or a part that fails in the script (shard 8, a head that is not
/// a number; before ADR-0051 that failed the whole call) refuses only its own part; the
/// parts after it commit. The logs and answers are those of separate calls.
async fn the_parts_of_one_call_commit_as_separate_calls_and_fail_alone(packed: bool) {
    use tidemark_store::redis::dlog::{request_digest, CommitRequest};
    let mut e = env().await;
    e.core.set_packed_records(packed);
    assert_eq!(e.commit(5, ("zoe", "z-1"), "before", 1).await, (1, false));
    // shard 6: a record at offset 1 without the head knowing
    stray_record(&mut e, 6, 1).await;
    // shard 8: a head that is not a number (the script fails in that part)
    let _: () = e.raw.set(keys::head(8), "not a number").await.unwrap();
    let msgs: [(u32, &[Msg<'_>]); 6] = [
        (9, &[]), // an empty part: answered with nothing, not sent
        (
            4,
            &[
                ("alice", "a-1", &["bob"], "one"),
                ("carol", "c-1", &["bob", "dan"], "two"),
            ],
        ),
        (
            6,
            &[
                ("alice", "a-9", &["bob"], "lost"),
                ("dan", "d-9", &["bob"], "lost too"),
            ],
        ),
        (
            5,
            &[
                ("zoe", "z-1", &["bob"], "before"), // a resend of the earlier commit
                ("zoe", "z-2", &["bob"], "after"),
            ],
        ),
        (8, &[("eve", "e-1", &["bob"], "unread")]),
        (
            4,
            &[
                ("alice", "a-1", &["bob"], "one"), // a resend of the first part's message
                ("alice", "a-2", &["eve"], "three"),
            ],
        ),
    ];
    let digests: Vec<Vec<String>> = msgs
        .iter()
        .map(|(_, ms)| {
            ms.iter()
                .map(|(_, _, rs, b)| request_digest(rs, b))
                .collect()
        })
        .collect();
    let reqs: Vec<Vec<CommitRequest>> = msgs
        .iter()
        .zip(&digests)
        .map(|((_, ms), ds)| {
            ms.iter()
                .zip(ds)
                .map(|((f, c, rs, b), d)| CommitRequest {
                    sender: f,
                    client_id: c,
                    recipients: rs,
                    body: b,
                    sent_at_us: 7,
                    digest: d,
                    claim_home: None,
                })
                .collect()
        })
        .collect();
    let parts: Vec<(u32, &[CommitRequest])> = msgs
        .iter()
        .zip(&reqs)
        .map(|((s, _), r)| (*s, r.as_slice()))
        .collect();
    let got = e.core.commit_parts(&parts, TTL).await.expect("the call");
    let got: Vec<Vec<Result<(u64, bool), String>>> = got
        .into_iter()
        .map(|p| {
            p.into_iter()
                .map(|r| {
                    r.map(|c| (c.offset, c.duplicate))
                        .map_err(|e| e.code().to_string())
                })
                .collect()
        })
        .collect();
    let ahead = || Err("log_ahead_of_head".to_string());
    assert_eq!(
        got,
        [
            vec![],
            vec![Ok((1, false)), Ok((2, false))],
            vec![ahead(), ahead()],
            vec![Ok((1, true)), Ok((2, false))],
            vec![Err("commit_failed".to_string())],
            vec![Ok((1, true)), Ok((3, false))],
        ]
    );
    assert_eq!(
        log_of(&mut e, 4).await,
        [
            "1 0 alice a-1 bob one",
            "2 1 carol c-1 bob,dan two",
            "3 2 alice a-2 eve three",
        ]
    );
    assert_eq!(
        log_of(&mut e, 5).await,
        ["1 0 zoe z-1 bob before", "2 1 zoe z-2 bob after"]
    );
    assert_eq!(e.core.head(4).await.unwrap(), 3);
    assert_eq!(e.core.head(5).await.unwrap(), 2);
    assert_eq!(
        e.core.head(6).await.unwrap(),
        0,
        "the damaged log's head did not move"
    );
    assert_eq!(
        log_of(&mut e, 8).await.len(),
        0,
        "nothing committed to shard 8"
    );
    for (f, c) in [("alice", "a-9"), ("dan", "d-9")] {
        let d: Option<String> = e.raw.get(keys::dedupe(6, f, c)).await.unwrap();
        assert_eq!(d, None, "no dedupe record for {f} {c}");
    }
}

/// alice's message `id` to bob (`body`, request digest `d`), claiming its id on shard `home`
/// inside the commit (ADR-0037).
fn claiming(
    home: u32,
    id: &'static str,
    body: &'static str,
    d: &'static str,
) -> tidemark_store::redis::dlog::CommitRequest<'static> {
    tidemark_store::redis::dlog::CommitRequest {
        sender: "alice",
        client_id: id,
        recipients: &["bob"],
        body,
        sent_at_us: 1,
        digest: d,
        claim_home: Some(home),
    }
}

/// ADR-0037: a commit that carries its id claim binds the id like `claim_message_id` would,
/// in the same call: a first send claims and commits, a resend is a duplicate, the same id
/// with another message is refused with nothing written (also when the claim was made by a
/// separate `claim_message_id`, and on another shard's key: the sender's home).
#[tokio::test]
async fn a_commit_that_carries_its_claim_binds_the_id_and_refuses_another_message() {
    use tidemark_store::redis::dlog::{request_digest, CommitRequest, IdClaim};
    let mut e = env().await;
    let (s, home) = (3u32, 9u32);
    let d1 = request_digest(&["bob"], "one");
    let d2 = request_digest(&["bob"], "two");
    let req = |id, body, d| claiming(home, id, body, d);
    let (d1, d2): (&'static str, &'static str) = (d1.leak(), d2.leak());
    let store = e.core.clone();
    let one = |r: CommitRequest<'static>| {
        let core = store.clone();
        async move {
            let mut core = core;
            core.commit_group(s, &[r], TTL)
                .await
                .expect("the call")
                .pop()
                .unwrap()
        }
    };
    let first = one(req("m1", "one", d1)).await.unwrap();
    assert_eq!((first.offset, first.duplicate), (1, false));
    let claim: Option<String> = e
        .raw
        .get(keys::message_id(home, "alice", "m1"))
        .await
        .unwrap();
    assert_eq!(
        claim.as_deref(),
        Some(d1),
        "the call bound the id to the digest"
    );
    let again = one(req("m1", "one", d1)).await.unwrap();
    assert_eq!((again.offset, again.duplicate), (1, true), "a resend");
    match one(req("m1", "two", d2)).await {
        Err(Error::IdReused { shard, .. }) => assert_eq!(shard, s),
        other => panic!("another message under a claimed id: {other:?}"),
    }
    // an id claimed by the separate SET (a send to several shards) is refused here too,
    // before any dedupe record of this shard exists
    assert_eq!(
        e.core
            .claim_message_id(home, "alice", "m2", d1, TTL)
            .await
            .unwrap(),
        IdClaim::New
    );
    match one(req("m2", "two", d2)).await {
        Err(Error::IdReused { shard, offset }) => assert_eq!((shard, offset), (s, 0)),
        other => panic!("another message under a claimed id: {other:?}"),
    }
    assert_eq!(e.core.head(s).await.unwrap(), 1, "nothing more was written");
    assert_eq!(log_of(&mut e, s).await.len(), 1);
    let d: Option<String> = e.raw.get(keys::dedupe(s, "alice", "m2")).await.unwrap();
    assert_eq!(d, None, "the refused message left no dedupe record");
}

/// ADR-0040: in a deployment of identity version 2, a one-shard send's claim made inside the
/// commit is its only dedupe record ("<offset>:<digest>"): a first send writes the log entry
/// and that one key; a resend is answered from it, another message under the id is refused
/// with the first one's offset; a bare claim (a send to several shards) still goes through
/// the dedupe record; `claim_message_id` reads both forms.
async fn a_one_key_claim_is_the_only_dedupe_record_of_a_one_shard_send(packed: bool) {
    use tidemark_store::deployment::{self, Identity, Role};
    use tidemark_store::redis::dlog::{request_digest, CommitRequest, IdClaim};
    let mut e = env().await;
    e.core.set_packed_records(packed);
    assert!(
        !e.core.one_key_claims(),
        "no identity recorded: both records, as before ADR-0040"
    );
    e.core.set_one_key_claims(true);
    let (s, home) = (3u32, 9u32);
    let d1: &'static str = request_digest(&["bob"], "one").leak();
    let d2: &'static str = request_digest(&["bob"], "two").leak();
    let req = |id, body, d| claiming(home, id, body, d);
    let store = e.core.clone();
    let mut core = e.core.clone();
    let group = |reqs: Vec<CommitRequest<'static>>| {
        let mut core = store.clone();
        async move {
            core.commit_group(s, &reqs, TTL)
                .await
                .expect("the call")
                .into_iter()
                .map(|r| r.map(|c| (c.offset, c.duplicate)))
                .collect::<Vec<_>>()
        }
    };
    // a first send, and the same message again in the same call
    let out = group(vec![req("m1", "one", d1), req("m1", "one", d1)]).await;
    assert_eq!(out[0].as_ref().unwrap(), &(1, false));
    assert_eq!(out[1].as_ref().unwrap(), &(1, true));
    let claim: Option<String> = e
        .raw
        .get(keys::message_id(home, "alice", "m1"))
        .await
        .unwrap();
    assert_eq!(claim, Some(format!("1:{d1}")));
    let mut want = vec![
        keys::dlog(s).into_bytes(),
        keys::head(s).into_bytes(),
        keys::message_id(home, "alice", "m1").into_bytes(),
    ];
    want.sort();
    assert_eq!(
        all_keys(&mut e.raw).await,
        want,
        "one key per send besides the log"
    );
    let ttl: i64 = e
        .raw
        .ttl(keys::message_id(home, "alice", "m1"))
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= TTL as i64, "TTL {ttl}");
    // a resend; another message under the id: refused with the first one's offset
    let out = group(vec![req("m1", "one", d1), req("m1", "two", d2)]).await;
    assert_eq!(out[0].as_ref().unwrap(), &(1, true));
    assert!(
        matches!(
            out[1],
            Err(Error::IdReused {
                shard: 3,
                offset: 1
            })
        ),
        "{:?}",
        out[1]
    );
    // the claim of a send to several shards meets the one-key claim
    assert_eq!(
        core.claim_message_id(home, "alice", "m1", d1, TTL)
            .await
            .unwrap(),
        IdClaim::SameMessage
    );
    assert_eq!(
        core.claim_message_id(home, "alice", "m1", d2, TTL)
            .await
            .unwrap(),
        IdClaim::OtherMessage
    );
    // a bare claim (made by claim_message_id) of this message: the dedupe record decides
    assert_eq!(
        core.claim_message_id(home, "alice", "m2", d1, TTL)
            .await
            .unwrap(),
        IdClaim::New
    );
    let out = group(vec![req("m2", "one", d1)]).await;
    assert_eq!(out[0].as_ref().unwrap(), &(2, false));
    let dd: Option<String> = e.raw.get(keys::dedupe(s, "alice", "m2")).await.unwrap();
    assert_eq!(dd, Some(format!("2:{d1}")));
    let out = group(vec![req("m2", "one", d1), req("m2", "two", d2)]).await;
    assert_eq!(out[0].as_ref().unwrap(), &(2, true));
    assert!(
        matches!(out[1], Err(Error::IdReused { offset: 0, .. })),
        "{:?}",
        out[1]
    );
    assert_eq!(e.core.head(s).await.unwrap(), 2, "two messages committed");
    // ADR-0043: one-key messages pass only their claim's key; one that meets a bare claim
    // of its own is answered "needs its keys" by the script and committed by a second call
    // with them; ADR-0091: the later messages of its log are deferred to that second call,
    // so the log keeps the order given (before, m5 took offset 4 and m4 offset 5)
    assert_eq!(
        core.claim_message_id(home, "alice", "m4", d1, TTL)
            .await
            .unwrap(),
        IdClaim::New
    );
    let out = group(vec![
        req("m3", "one", d1),
        req("m4", "one", d1),
        req("m5", "one", d1),
    ])
    .await;
    let out: Vec<(u64, bool)> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(
        out,
        [(3, false), (4, false), (5, false)],
        "in the order given"
    );
    let dd: Option<String> = e.raw.get(keys::dedupe(s, "alice", "m4")).await.unwrap();
    assert_eq!(dd, Some(format!("4:{d1}")), "m4's dedupe record decides");
    let claim5: Option<String> = e
        .raw
        .get(keys::message_id(home, "alice", "m5"))
        .await
        .unwrap();
    assert_eq!(
        claim5,
        Some(format!("5:{d1}")),
        "m5's claim, from the second call"
    );
    let out = group(vec![req("m4", "one", d1), req("m5", "one", d1)]).await;
    let out: Vec<(u64, bool)> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(out, [(4, true), (5, true)], "resends: duplicates");
    assert_eq!(e.core.head(s).await.unwrap(), 5);
    let ids = client_ids_of(&mut e, s).await;
    assert_eq!(ids, ["m1", "m2", "m3", "m4", "m5"], "the log's client ids");
    // the same across parts of one call that name the same log: a later part of it waits
    // too; a part of another log does not (it is committed in the first call)
    assert_eq!(
        core.claim_message_id(home, "alice", "m6", d1, TTL)
            .await
            .unwrap(),
        IdClaim::New
    );
    let s2 = 5u32;
    let parts = [
        vec![req("m6", "one", d1), req("m7", "one", d1)],
        vec![req("x1", "one", d1)],
        vec![req("m8", "one", d1)],
    ];
    let out = core
        .commit_parts(&[(s, &parts[0]), (s2, &parts[1]), (s, &parts[2])], TTL)
        .await
        .expect("the call");
    let out: Vec<Vec<(u64, bool)>> = out
        .into_iter()
        .map(|p| {
            p.into_iter()
                .map(|r| r.map(|c| (c.offset, c.duplicate)).unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        out,
        [
            vec![(6, false), (7, false)],
            vec![(1, false)],
            vec![(8, false)]
        ]
    );
    let ids = client_ids_of(&mut e, s).await;
    assert_eq!(ids[5..], ["m6", "m7", "m8"], "the log's client ids");

    // the form follows the identity recorded on the instance: version 2 one key, version 1
    // both records, an unknown version refused
    let id = Identity {
        version: deployment::VERSION_CURRENT,
        shards: 16,
        role: Role::Core,
        index: 0,
        holds: (0..16).collect(),
        tables: "0".repeat(16),
    };
    deployment::record_if_absent(&mut e.raw, &id).await.unwrap();
    let now = LogStore::connect(&e.redis.url()).await.unwrap();
    assert!(now.one_key_claims() && now.packed_records());
    let () = e.raw.hset(deployment::KEY, "version", "2").await.unwrap();
    let two = LogStore::connect(&e.redis.url()).await.unwrap();
    assert!(two.one_key_claims() && !two.packed_records());
    let () = e.raw.hset(deployment::KEY, "version", "1").await.unwrap();
    let one = LogStore::connect(&e.redis.url()).await.unwrap();
    assert!(!one.one_key_claims() && !one.packed_records());
    let () = e.raw.hset(deployment::KEY, "version", "4").await.unwrap();
    assert!(LogStore::connect(&e.redis.url()).await.is_err());
}

/// ADR-0052: a one-key claim is written before its `XADD`, as it stands once committed
/// ("<offset>:<digest>"), so that one `SET NX GET` both reads and makes it. When the `XADD`
/// then fails (a log ahead of its head), the claim is removed again: a resend after the log
/// is repaired must be committed, not answered with an offset that was never written. At
/// the end of the offset space nothing is written either.
async fn a_one_key_claim_whose_xadd_fails_is_taken_back(packed: bool) {
    use tidemark_store::redis::dlog::request_digest;
    let mut e = env().await;
    e.core.set_packed_records(packed);
    e.core.set_one_key_claims(true);
    let (s, home) = (3u32, 9u32);
    let d1: &'static str = request_digest(&["bob"], "one").leak();
    let mut core = e.core.clone();
    let out = core
        .commit_group(s, &[claiming(home, "m1", "one", d1)], TTL)
        .await
        .expect("the call");
    assert_eq!(out[0].as_ref().map(|c| c.offset).ok(), Some(1));
    // a record at offset 2 without the head knowing: m2's XADD collides
    stray_record(&mut e, s, 2).await;
    let out = core
        .commit_group(
            s,
            &[
                claiming(home, "m2", "one", d1),
                claiming(home, "m3", "one", d1),
            ],
            TTL,
        )
        .await
        .expect("the call");
    for a in &out {
        assert!(matches!(a, Err(Error::LogAheadOfHead { .. })), "{a:?}");
    }
    for id in ["m2", "m3"] {
        let claim: Option<String> = e
            .raw
            .get(keys::message_id(home, "alice", id))
            .await
            .unwrap();
        assert_eq!(claim, None, "no claim is left for {id}");
    }
    assert_eq!(e.core.head(s).await.unwrap(), 1);
    // repaired (the stream made again with record 1 alone, so its last id is 1 again; a
    // stream's last id cannot go back below a deleted entry's on Valkey 8,
    // where `XDEL` + `XSETID 1-0` is refused): the resend commits at offset 2
    let first: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(keys::dlog(s))
        .arg("1-0")
        .arg("1-0")
        .query_async(&mut e.raw)
        .await
        .unwrap();
    let (id, fields) = first.into_iter().next().expect("record 1");
    let _: () = e.raw.del(keys::dlog(s)).await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(keys::dlog(s))
        .arg(id)
        .arg(fields)
        .query_async(&mut e.raw)
        .await
        .unwrap();
    let out = core
        .commit_group(s, &[claiming(home, "m2", "one", d1)], TTL)
        .await
        .expect("the call");
    let c = out[0].as_ref().expect("committed");
    assert_eq!((c.offset, c.duplicate), (2, false));
    let claim: Option<String> = e
        .raw
        .get(keys::message_id(home, "alice", "m2"))
        .await
        .unwrap();
    assert_eq!(claim, Some(format!("2:{d1}")));
    // at the end of the offset space: refused, and no claim written
    let _: () = e.raw.set(keys::head(s), U48_MAX).await.unwrap();
    let out = core
        .commit_group(s, &[claiming(home, "m4", "one", d1)], TTL)
        .await
        .expect("the call");
    assert!(
        matches!(out[0], Err(Error::LogExhausted { .. })),
        "{:?}",
        out[0]
    );
    let claim: Option<String> = e
        .raw
        .get(keys::message_id(home, "alice", "m4"))
        .await
        .unwrap();
    assert_eq!(claim, None);
}

/// ADR-0055: a deployment of identity version 3 writes each record as two fields, `p` and the
/// packed message `m`; it reads back as the same record as the six-field form, and a log
/// holding both forms (one written before an upgrade) is read in order. A packed record that
/// is not its layout is a bad record for both readers, never half-read.
#[tokio::test]
async fn packed_records_read_as_the_six_field_form_and_a_bad_one_is_refused() {
    let mut e = env().await;
    let s = 4;
    assert!(!e.core.packed_records(), "no identity recorded: six fields");
    assert_eq!(e.commit(s, ("alice", "a-1"), "one", 10).await, (1, false));
    e.core.set_packed_records(true);
    assert_eq!(
        e.commit(s, ("alice", "a-2"), "tw\u{f6}", 11).await,
        (2, false)
    );
    assert_eq!(
        e.commit(s, ("alice", "a-1"), "one", 10).await,
        (1, true),
        "a resend"
    );
    let fields = |v: redis::Value| -> Vec<String> {
        let redis::Value::Array(entries) = v else {
            panic!("{v:?}")
        };
        let redis::Value::Array(pair) = &entries[0] else {
            panic!()
        };
        let redis::Value::Array(kv) = &pair[1] else {
            panic!()
        };
        kv.iter()
            .step_by(2)
            .map(|k| redis::from_redis_value::<String>(k.clone()).unwrap())
            .collect()
    };
    let raw = |from: &str| {
        redis::cmd("XRANGE")
            .arg(keys::dlog(s))
            .arg(from)
            .arg(from)
            .clone()
    };
    let six: redis::Value = raw("1-0").query_async(&mut e.raw).await.unwrap();
    assert_eq!(fields(six), ["p", "f", "c", "r", "b", "t"]);
    let packed: redis::Value = raw("2-0").query_async(&mut e.raw).await.unwrap();
    assert_eq!(fields(packed), ["p", "m"]);
    let log = e.core.read_after(s, 0, 10).await.unwrap();
    let got: Vec<_> = log
        .iter()
        .map(|r| {
            (
                r.offset,
                r.prev,
                r.sender.as_str(),
                r.client_id.as_str(),
                r.recipients.clone(),
                r.body.as_str(),
                r.sent_at_us,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (1, 0, "alice", "a-1", vec!["bob".to_string()], "one", 10),
            (
                2,
                1,
                "alice",
                "a-2",
                vec!["bob".to_string()],
                "tw\u{f6}",
                11
            ),
        ]
    );

    // a packed record cut short (a damaged instance): refused by both readers
    let bad = tidemark_store::redis::dlog::encode_record("alice", "a-3", &["bob"], 12, "x");
    let _: String = redis::cmd("XADD")
        .arg(keys::dlog(s))
        .arg("3-0")
        .arg("p")
        .arg(2)
        .arg("m")
        .arg(&bad[..bad.len() - 3])
        .query_async(&mut e.raw)
        .await
        .unwrap();
    let err = e.core.read_after(s, 2, 10).await.unwrap_err();
    assert!(
        matches!(&err, Error::BadRecord { shard: 4, offset: 3, detail } if detail.contains("truncated")),
        "{err:?}"
    );
    let mut reader = LogReader::connect(&e.redis.url()).await.unwrap();
    let err = reader
        .read(&[(s, 2)], 10, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::BadRecord { offset: 3, .. }), "{err:?}");
}

/// A part that fails in the script is skipped by counting its keys (one per one-key
/// message, ADR-0043, three per other) from its messages' claim flags, which sit at another
/// argument in each record form (ADR-0055): a miscount would give the next part the wrong
/// keys. The next part commits as if alone, its claim made on its own key.
async fn a_failed_part_of_one_key_messages_leaves_the_next_part_whole(packed: bool) {
    use tidemark_store::redis::dlog::request_digest;
    let mut e = env().await;
    e.core.set_packed_records(packed);
    e.core.set_one_key_claims(true);
    let _: () = e.raw.set(keys::head(8), "not a number").await.unwrap();
    let d1: &'static str = request_digest(&["bob"], "one").leak();
    let d2: &'static str = request_digest(&["bob"], "two").leak();
    let failing = [claiming(8, "f-1", "one", d1)];
    let next = [claiming(4, "n-1", "two", d2), claiming(4, "n-2", "two", d2)];
    let got = e
        .core
        .commit_parts(&[(8, &failing[..]), (4, &next[..])], TTL)
        .await
        .expect("the call");
    assert!(
        matches!(&got[0][..], [Err(Error::CommitFailed { shard: 8, .. })]),
        "{got:?}"
    );
    let next_got: Vec<(u64, bool)> = got[1]
        .iter()
        .map(|r| r.clone().unwrap())
        .map(|c| (c.offset, c.duplicate))
        .collect();
    assert_eq!(next_got, [(1, false), (2, false)]);
    assert_eq!(
        log_of(&mut e, 4).await,
        ["1 0 alice n-1 bob two", "2 1 alice n-2 bob two"]
    );
    let claim: Option<String> = e
        .raw
        .get(keys::message_id(4, "alice", "n-2"))
        .await
        .unwrap();
    assert_eq!(claim, Some(format!("2:{d2}")));
    assert_eq!(
        e.core.head(8).await.ok(),
        None,
        "the failed part's head is as it was"
    );
}

/// ADR-0099: a part that fails in the script after it committed messages (here its second
/// message's claim key holds a hash: WRONGTYPE) keeps what it committed, answered and counted
/// in the head. Before, every message of the part was answered `CommitFailed` and the head was
/// left behind the log, so every later commit to the shard failed its `XADD`
/// (`LogAheadOfHead`) until the materializer's GC raised the head.
async fn a_part_that_fails_after_committing_counts_what_it_committed_in_its_head(packed: bool) {
    use tidemark_store::redis::dlog::request_digest;
    let mut e = env().await;
    e.core.set_packed_records(packed);
    e.core.set_one_key_claims(true);
    let _: () = e
        .raw
        .hset(keys::message_id(8, "alice", "p-2"), "not", "a string")
        .await
        .unwrap();
    let d: &'static str = request_digest(&["bob"], "one").leak();
    let part = [
        claiming(8, "p-1", "one", d),
        claiming(8, "p-2", "one", d),
        claiming(8, "p-3", "one", d),
    ];
    let got = e
        .core
        .commit_parts(&[(8, &part[..])], TTL)
        .await
        .expect("the call");
    assert!(
        matches!(
            &got[0][..],
            [
                Ok(tidemark_store::redis::dlog::Committed {
                    offset: 1,
                    duplicate: false
                }),
                Err(Error::CommitFailed { shard: 8, .. }),
                Err(Error::CommitFailed { shard: 8, .. }),
            ]
        ),
        "{got:?}"
    );
    assert_eq!(e.core.head(8).await.unwrap(), 1, "the head counts p-1");
    assert_eq!(log_of(&mut e, 8).await, ["1 0 alice p-1 bob one"]);
    // the shard takes the next commit, and p-1's resend is its duplicate
    let next = [claiming(8, "p-3", "one", d), claiming(8, "p-1", "one", d)];
    let got = e
        .core
        .commit_parts(&[(8, &next[..])], TTL)
        .await
        .expect("the call");
    let got: Vec<(u64, bool)> = got[0]
        .iter()
        .map(|r| r.clone().unwrap())
        .map(|c| (c.offset, c.duplicate))
        .collect();
    assert_eq!(got, [(2, false), (1, true)]);
}

/// Commits of one shard share their replica confirmations: one `WAIT` in flight, later
/// commits wait for its successor (ADR-0032). A commit dropped while its `WAIT` blocks (a
/// commit cancelled, or a round unwound by a panic beside it) must hand that lead on: before,
/// every later commit of the shard waited for a `WAIT` that nobody would send, for ever.
#[tokio::test]
async fn a_commit_dropped_while_its_replica_wait_blocks_does_not_hold_the_next_ones() {
    use tidemark_store::redis::replicas::ReplicaWait;
    let mut e = env().await;
    // no replica: each WAIT blocks for its whole timeout, then answers 0
    e.core.set_replica_wait(Some(ReplicaWait {
        replicas: 1,
        timeout: Duration::from_millis(500),
    }));
    let first = tokio::time::timeout(
        Duration::from_millis(100),
        e.core.commit(0, "alice", "r-1", &["bob"], "one", 1, TTL),
    )
    .await;
    assert!(
        first.is_err(),
        "a WAIT for a missing replica answered early"
    );
    let second = tokio::time::timeout(
        Duration::from_secs(5),
        e.core.commit(0, "alice", "r-2", &["bob"], "two", 2, TTL),
    )
    .await
    .expect("the next commit of the shard was held by the dropped commit's WAIT");
    assert!(
        matches!(
            second,
            Err(Error::NotReplicated {
                shard: 0,
                replicas: 0,
                wanted: 1
            })
        ),
        "{second:?}"
    );
}

/// `trim_many` (ADR-0088): the trims of several shards go in one call, each shard's log is
/// trimmed to its own point, and a log that cannot be trimmed fails alone.
#[tokio::test]
async fn several_logs_are_trimmed_in_one_call_each_to_its_own_point() {
    let mut e = env().await;
    for s in 0..3 {
        for i in 0..4 {
            e.commit(s, ("alice", &format!("t{s}-{i}")), "x", i).await;
        }
    }
    // shard 3's log key holds a string: its XTRIM is refused (WRONGTYPE)
    let _: () = e.raw.set(keys::dlog(3), "not a stream").await.unwrap();
    let results = e
        .core
        .trim_many(&[(0, 2), (3, 1), (1, 4), (2, 0)])
        .await
        .unwrap();
    let results: Vec<Result<u64, String>> = results
        .into_iter()
        .map(|r| r.map_err(|e| e.to_string()))
        .collect();
    assert_eq!(results[0], Ok(2), "shard 0: records 1 and 2 go");
    assert!(
        results[1].as_ref().is_err_and(|e| e.contains("WRONGTYPE")),
        "shard 3 fails alone: {:?}",
        results[1]
    );
    assert_eq!(results[2], Ok(4), "shard 1: every record goes");
    assert_eq!(results[3], Ok(0), "shard 2: nothing at or below 0");
    let kept = |recs: Vec<tidemark_store::redis::dlog::DispatchRecord>| {
        recs.iter().map(|r| r.offset).collect::<Vec<_>>()
    };
    assert_eq!(kept(e.core.read_after(0, 0, 10).await.unwrap()), vec![3, 4]);
    assert!(e.core.read_after(1, 0, 10).await.unwrap().is_empty());
    assert_eq!(
        kept(e.core.read_after(2, 0, 10).await.unwrap()),
        vec![1, 2, 3, 4]
    );
    // the heads are not trims' business
    for s in 0..3 {
        assert_eq!(e.core.head(s).await.unwrap(), 4);
    }
    // nothing to trim: no call, no result
    assert!(e.core.trim_many(&[]).await.unwrap().is_empty());
}
