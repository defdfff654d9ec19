//! The five watermark scripts against a real redis-server: Rust and Lua verdicts agree on one
//! table of vectors and on every blob length 0..=2500; each script's behaviour (uniform path,
//! divergence and convergence, CAS gaps, replays, fencing, v1 → v2, old code failing closed).

use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tidemark_store::keys;
use tidemark_store::redis::store::{
    Advance, AdvanceRecord, ChunkWritten, Gc, MailboxStore, Materialized, SingleItem,
    MAX_HOT_RECIPIENTS, MAX_RUN, MAX_RUN_ENTRIES,
};
use tidemark_store::redis::watermark::{
    decode_lane_watermarks, encode_packed_v1, encode_packed_v2, CorruptCode, LaneRecord,
    LaneWatermarks, Layout, FULL_BLOB_BYTES, LANES, LANE_BYTES,
};

mod support;

use support::{evalsha_calls, reset_stats, script_flush};

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// The packed-v2 store (new code) and the packed-v1 store (old code) on the test's
/// redis-server.
struct Stores {
    v2: MailboxStore,
    v1: MailboxStore,
}

type Env = support::Env<Stores>;

async fn env() -> Env {
    support::env(|url| async move {
        let v2 = MailboxStore::connect(&url, Layout::PackedV2).await.unwrap();
        let v1 = MailboxStore::connect(&url, Layout::PackedV1).await.unwrap();
        Stores { v2, v1 }
    })
    .await
}

/// [`env`] with shard 0's watermark initialised (by the packed-v2 store) in `layout`, at
/// `epoch`, every lane at `w`.
async fn env_with(layout: Layout, epoch: u64, w: u64) -> Env {
    let mut e = env().await;
    e.v2.init_watermark(0, layout, epoch, w, false)
        .await
        .unwrap();
    e
}

fn f(layout: &str, epoch: &str, blob: Vec<u8>) -> Fields {
    vec![
        (b"wm_layout".to_vec(), layout.as_bytes().to_vec()),
        (b"wm_epoch".to_vec(), epoch.as_bytes().to_vec()),
        (b"wm_blob".to_vec(), blob),
    ]
}

fn uni(w: u64, floor: u64) -> LaneWatermarks {
    LaneWatermarks::uniform(LaneRecord::at(w, floor))
}

async fn put(raw: &mut ConnectionManager, shard: u32, fields: &Fields) {
    let k = keys::wm(shard);
    let _: () = raw.del(&k).await.unwrap();
    if !fields.is_empty() {
        let _: () = raw.hset_multiple(&k, fields).await.unwrap();
    }
}

async fn snapshot(raw: &mut ConnectionManager, shard: u32) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut v: Vec<(Vec<u8>, Vec<u8>)> = raw.hgetall(keys::wm(shard)).await.unwrap();
    v.sort();
    v
}

async fn blob(raw: &mut ConnectionManager, shard: u32) -> Vec<u8> {
    raw.hget(keys::wm(shard), "wm_blob").await.unwrap()
}

type V = Option<(String, Option<usize>)>;

fn rust_verdict(fields: &Fields) -> V {
    decode_lane_watermarks(fields)
        .err()
        .map(|c| (c.code().to_string(), c.lane()))
}

/// What pre-ADR-0015 code says of these fields: v2 layout is unknown, only 1216 bytes legal.
fn old_code_verdict(fields: &Fields) -> V {
    let v = rust_verdict(fields);
    if let Some((code, _)) = &v {
        if code == "field_count" || code == "missing_field" || code == "unknown_layout" {
            return v;
        }
    }
    let layout = fields.iter().find(|(k, _)| k == b"wm_layout").unwrap();
    if layout.1 != b"packed-v1" {
        return Some(("unknown_layout".into(), None));
    }
    v
}

fn epoch_of(fields: &Fields) -> u64 {
    fields
        .iter()
        .find(|(k, _)| k == b"wm_epoch")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// Whether the hot path judges the lane records of these fields: it validates the header
/// always, but lanes only on the blob it would write from (19-byte packed-v2 for new code, a
/// uniform 1216-byte packed-v1 for old code); anything else it hands to the chunked path.
fn hot_path_sees_lanes(fields: &Fields, old: bool) -> bool {
    let get = |k: &[u8]| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    match (get(b"wm_layout"), get(b"wm_blob")) {
        (Some(l), Some(b)) if !old => l == b"packed-v2" && b.len() == LANE_BYTES,
        (Some(l), Some(b)) => {
            l == b"packed-v1" && b.len() == FULL_BLOB_BYTES && b[19..] == b[..b.len() - 19]
        }
        _ => false,
    }
}

/// The hot path's expected verdict: lane-level causes only where it looks at lanes.
fn hot_verdict(v: V, fields: &Fields, old: bool) -> V {
    match v {
        Some((_, Some(_))) if !hot_path_sees_lanes(fields, old) => None,
        other => other,
    }
}

/// Verdicts of every wm_blob-reading script of `store` on the watermark of shard 0.
async fn lua_verdicts(store: &mut MailboxStore, epoch: u64) -> Vec<(&'static str, V)> {
    let mut out = Vec::new();
    let g = store.gc_completed(0, 10).await.unwrap();
    out.push((
        "gc_completed_dispatch",
        match g {
            Gc::Corrupt(v) => Some((v.code.to_string(), v.lane)),
            Gc::Done { .. } => None,
        },
    ));
    let rec = AdvanceRecord {
        offset: 1,
        prev: 0,
        needed: [true; LANES], // nothing staged: held, never written
    };
    let adv = |a: Advance| match a {
        Advance::Corrupt(v) => Some((v.code.to_string(), v.lane)),
        _ => None,
    };
    out.push((
        "advance_log_watermark",
        adv(store.advance(0, epoch, &rec).await.unwrap()),
    ));
    out.push((
        "advance_log_watermarks",
        adv(store
            .advance_many(0, epoch, std::slice::from_ref(&rec))
            .await
            .unwrap()),
    ));
    // hot path with a wrong epoch: validates, then is fenced; never writes
    let m = store
        .materialize_single(
            0,
            epoch.wrapping_add(1),
            &SingleItem {
                offset: 1,
                prev: 0,
                recipients: vec!["x".into()],
                entry: b"e".to_vec(),
            },
        )
        .await
        .unwrap();
    out.push((
        "materialize_fresh_single_recipient",
        match m {
            Materialized::Corrupt(v) => Some((v.code.to_string(), v.lane)),
            _ => None,
        },
    ));
    out
}

fn lane_bytes(p: u8, w: u64, fl: u64, wr: u64) -> Vec<u8> {
    let mut v = vec![p];
    v.extend_from_slice(&w.to_be_bytes()[2..]);
    v.extend_from_slice(&fl.to_be_bytes()[2..]);
    v.extend_from_slice(&wr.to_be_bytes()[2..]);
    v
}

fn vectors() -> Vec<(&'static str, Fields)> {
    let good19 = encode_packed_v2(&uni(5, 1));
    let good1216 = encode_packed_v1(&uni(5, 1));
    let mut diverged = uni(5, 1);
    diverged.0[17] = LaneRecord::at(4, 1);
    diverged.0[40] = LaneRecord::EMPTY;
    let div = encode_packed_v2(&diverged);
    let mut v: Vec<(&'static str, Fields)> = vec![
        ("v2 uniform", f("packed-v2", "7", good19.clone())),
        ("v2 full uniform", f("packed-v2", "7", good1216.clone())),
        ("v2 diverged", f("packed-v2", "7", div.clone())),
        ("v1 full", f("packed-v1", "7", good1216.clone())),
        ("v1 diverged", f("packed-v1", "0", div.clone())),
        ("v2 empty uniform", f("packed-v2", "7", vec![0; LANE_BYTES])),
        (
            "epoch max",
            f("packed-v2", "18446744073709551615", good19.clone()),
        ),
        (
            "epoch overflow",
            f("packed-v2", "18446744073709551616", good19.clone()),
        ),
        ("epoch leading zero", f("packed-v2", "07", good19.clone())),
        ("epoch negative", f("packed-v2", "-7", good19.clone())),
        ("epoch empty", f("packed-v2", "", good19.clone())),
        ("epoch space", f("packed-v2", "7 ", good19.clone())),
        ("epoch hex", f("packed-v2", "0x7", good19.clone())),
        ("layout case", f("Packed-V2", "7", good19.clone())),
        ("layout v3", f("packed-v3", "7", good19.clone())),
        (
            "layout trailing space",
            f("packed-v2 ", "7", good19.clone()),
        ),
        ("v1 with 19 bytes", f("packed-v1", "7", good19.clone())),
        ("v2 with 20 bytes", f("packed-v2", "7", vec![0; 20])),
        ("v2 with 0 bytes", f("packed-v2", "7", vec![])),
        (
            "v2 with 1215 bytes",
            f("packed-v2", "7", good1216[..1215].to_vec()),
        ),
        (
            "v2 with 1217 bytes",
            f("packed-v2", "7", [good1216.clone(), vec![0]].concat()),
        ),
        (
            "v2 with 38 bytes",
            f("packed-v2", "7", [good19.clone(), good19.clone()].concat()),
        ),
        ("presence 2", f("packed-v2", "7", lane_bytes(2, 5, 1, 5))),
        ("presence ff", f("packed-v2", "7", lane_bytes(255, 0, 0, 0))),
        ("nonzero empty", f("packed-v2", "7", lane_bytes(0, 0, 0, 1))),
        ("w mismatch", f("packed-v2", "7", lane_bytes(1, 5, 1, 6))),
        ("w below floor", f("packed-v2", "7", lane_bytes(1, 5, 6, 5))),
        (
            "w max",
            f(
                "packed-v2",
                "7",
                lane_bytes(1, (1 << 48) - 1, 0, (1 << 48) - 1),
            ),
        ),
        (
            "mismatch and below floor",
            f("packed-v2", "7", lane_bytes(1, 5, 9, 6)),
        ),
        (
            "four fields",
            [
                f("packed-v2", "7", good19.clone()),
                vec![(b"x".to_vec(), b"y".to_vec())],
            ]
            .concat(),
        ),
        (
            "two fields",
            f("packed-v2", "7", good19.clone())[..2].to_vec(),
        ),
        (
            "blob renamed",
            vec![
                (b"wm_layout".to_vec(), b"packed-v2".to_vec()),
                (b"wm_epoch".to_vec(), b"7".to_vec()),
                (b"wm_blobs".to_vec(), good19.clone()),
            ],
        ),
        (
            "layout renamed",
            vec![
                (b"layout".to_vec(), b"packed-v2".to_vec()),
                (b"wm_epoch".to_vec(), b"7".to_vec()),
                (b"wm_blob".to_vec(), good19.clone()),
            ],
        ),
        ("bad length and bad epoch", f("packed-v2", "x", vec![1; 3])),
        ("unknown layout and bad length", f("nope", "7", vec![1; 3])),
    ];
    // a fault in every lane position of a full blob, of every kind
    for lane in [0usize, 1, 31, 62, 63] {
        for (kind, rec) in [
            ("presence", lane_bytes(3, 5, 1, 5)),
            ("empty", lane_bytes(0, 1, 0, 0)),
            ("mismatch", lane_bytes(1, 5, 1, 4)),
            ("floor", lane_bytes(1, 5, 7, 5)),
        ] {
            for layout in ["packed-v1", "packed-v2"] {
                let mut b = good1216.clone();
                b[lane * LANE_BYTES..(lane + 1) * LANE_BYTES].copy_from_slice(&rec);
                let name: &'static str =
                    Box::leak(format!("{layout} lane {lane} {kind}").into_boxed_str());
                v.push((name, f(layout, "7", b)));
            }
        }
    }
    v
}

/// Every wm_blob-reading script of `store` (new code, or `old`) gives `expect` on the vector
/// `fields` called `name`; the hot path only where it looks at lanes.
async fn assert_scripts(
    store: &mut MailboxStore,
    (fields, name): (&Fields, &str),
    expect: &V,
    old: bool,
) {
    let what = if old { "v1" } else { "v2" };
    for (script, got) in lua_verdicts(store, epoch_of(fields)).await {
        let want = if script == "materialize_fresh_single_recipient" {
            hot_verdict(expect.clone(), fields, old)
        } else {
            expect.clone()
        };
        assert_eq!(got, want, "{what} {script} on {name}");
    }
}

#[tokio::test]
async fn rust_and_lua_give_identical_verdicts() {
    let mut e = env().await;
    for (name, fields) in vectors() {
        let expect = rust_verdict(&fields);
        let expect_old = old_code_verdict(&fields);
        put(&mut e.raw, 0, &fields).await;
        let before = snapshot(&mut e.raw, 0).await;
        assert_scripts(&mut e.v2, (&fields, name), &expect, false).await;
        assert_scripts(&mut e.v1, (&fields, name), &expect_old, true).await;
        // store.rs reads through read_log_watermarks.lua + decode_lane_watermarks
        let read = e.v2.read_watermark(0).await;
        assert_eq!(
            read.err().and_then(|x| x.corrupt_verdict()),
            expect,
            "read_watermark on {name}"
        );
        assert_eq!(
            snapshot(&mut e.raw, 0).await,
            before,
            "{name}: nothing written"
        );
    }
}

#[tokio::test]
async fn every_blob_length_both_layouts() {
    let mut e = env().await;
    let pattern = encode_packed_v1(&uni(9, 3));
    for layout in ["packed-v1", "packed-v2"] {
        // pipelined: write the hash and run gc (full validation) for each length
        for chunk in (0..=2500usize).collect::<Vec<_>>().chunks(250) {
            let mut expected = Vec::new();
            for &len in chunk {
                let blob: Vec<u8> = pattern.iter().cycle().take(len).copied().collect();
                let fields = f(layout, "1", blob);
                expected.push((len, rust_verdict(&fields)));
                put(&mut e.raw, 0, &fields).await;
                let got = match e.v2.gc_completed(0, 1).await.unwrap() {
                    Gc::Corrupt(v) => Some((v.code.to_string(), v.lane)),
                    Gc::Done { .. } => None,
                };
                let legal = if layout == "packed-v1" {
                    len == FULL_BLOB_BYTES
                } else {
                    len == LANE_BYTES || len == FULL_BLOB_BYTES
                };
                assert_eq!(got, rust_verdict(&fields), "{layout} len {len}");
                assert_eq!(got.is_none(), legal, "{layout} len {len}");
                if !legal {
                    assert_eq!(got.unwrap().0, "bad_length");
                }
                let old = match e.v1.gc_completed(0, 1).await.unwrap() {
                    Gc::Corrupt(v) => Some((v.code.to_string(), v.lane)),
                    Gc::Done { .. } => None,
                };
                assert_eq!(
                    old,
                    old_code_verdict(&fields),
                    "old code {layout} len {len}"
                );
            }
        }
    }
}

/// Record `offset` (prev: the one before) with no recipient in any lane.
fn no_recipients(offset: u64) -> AdvanceRecord {
    AdvanceRecord {
        offset,
        prev: offset - 1,
        needed: [false; LANES],
    }
}

fn item(offset: u64, to: &str) -> SingleItem {
    SingleItem {
        offset,
        prev: offset - 1,
        recipients: vec![to.into()],
        entry: format!("{offset}:{to}").into_bytes(),
    }
}

/// The outcome of a run whose records `offsets` were all applied.
fn applied(offsets: std::ops::RangeInclusive<u64>) -> Vec<Materialized> {
    offsets
        .map(|offset| Materialized::Applied { offset })
        .collect()
}

#[tokio::test]
async fn hot_path_writes_19_bytes_and_replays_write_nothing() {
    let mut e = env_with(Layout::PackedV2, 4, 0).await;
    assert_eq!(blob(&mut e.raw, 0).await.len(), 19);
    let out =
        e.v2.materialize_batch(0, 4, &[item(1, "bob"), item(2, "ann"), item(3, "bob")])
            .await
            .unwrap();
    assert_eq!(
        out,
        vec![
            Materialized::Applied { offset: 1 },
            Materialized::Applied { offset: 2 },
            Materialized::Applied { offset: 3 }
        ]
    );
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(3, 0)));
    let mb: Vec<(Vec<u8>, f64)> = e
        .raw
        .zrange_withscores(keys::mailbox(0, "bob"), 0, -1)
        .await
        .unwrap();
    assert_eq!(mb, vec![(b"1:bob".to_vec(), 1.0), (b"3:bob".to_vec(), 3.0)]);
    // a replay, a gap (expected_previous above W), a stale epoch (fenced): nothing written
    let before = snapshot(&mut e.raw, 0).await;
    let fenced = Materialized::Fenced {
        current_epoch: Some(4),
    };
    for (what, epoch, offset, want) in [
        ("a replay", 4, 2, Materialized::Replay { w: 3 }),
        ("a gap", 4, 6, Materialized::Gap { w: 3 }),
        ("a fenced call", 3, 4, fenced),
    ] {
        let ann = item(offset, "ann");
        let r = e.v2.materialize_single(0, epoch, &ann).await.unwrap();
        assert_eq!(r, want, "{what}");
        assert_eq!(snapshot(&mut e.raw, 0).await, before, "{what}");
        let n: usize = e.raw.zcard(keys::mailbox(0, "ann")).await.unwrap();
        assert_eq!(n, 1, "{what} writes no entry");
    }
}

async fn entries(raw: &mut ConnectionManager, users: &[&str]) -> usize {
    let mut n = 0;
    for u in users {
        let c: usize = raw.zcard(keys::mailbox(0, u)).await.unwrap();
        n += c;
    }
    n
}

#[tokio::test]
async fn a_run_of_records_is_one_call_that_stops_at_its_gap() {
    // ADR-0039: the hot path takes a shard's consecutive records in runs of up to MAX_RUN
    let users = ["u0", "u1", "u2", "u3", "u4"];
    let to = |o: u64| users[(o % 5) as usize];
    let run = |r: std::ops::RangeInclusive<u64>| -> Vec<SingleItem> {
        r.map(|o| item(o, to(o))).collect()
    };
    let mut e = env_with(Layout::PackedV2, 4, 0).await;
    reset_stats(&mut e.raw).await;
    let out = e.v2.materialize_batch(0, 4, &run(1..=300)).await.unwrap();
    assert_eq!(out, applied(1..=300));
    assert_eq!(
        evalsha_calls(&mut e.raw).await,
        300u64.div_ceil(MAX_RUN as u64),
        "one call per run of at most {MAX_RUN}"
    );
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(300, 0)));
    assert_eq!(entries(&mut e.raw, &users).await, 300);

    // records at or below W are replays, the rest of the run applies
    let out = e.v2.materialize_batch(0, 4, &run(298..=305)).await.unwrap();
    let mut want = vec![Materialized::Replay { w: 305 }; 3];
    want.extend(applied(301..=305));
    assert_eq!(out, want);
    assert_eq!(entries(&mut e.raw, &users).await, 305);

    // a gap in the middle of a run: what comes before it is written, nothing after it
    let mut items = run(306..=307);
    items.extend(run(309..=310));
    let out = e.v2.materialize_batch(0, 4, &items).await.unwrap();
    assert_eq!(
        out,
        vec![
            Materialized::Applied { offset: 306 },
            Materialized::Applied { offset: 307 },
            Materialized::Gap { w: 307 },
            Materialized::Gap { w: 307 }
        ]
    );
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(307, 0)));
    assert_eq!(entries(&mut e.raw, &users).await, 307);

    // a fenced run, and offsets that do not increase: nothing written
    let before = snapshot(&mut e.raw, 0).await;
    let out = e.v2.materialize_batch(0, 3, &run(308..=309)).await.unwrap();
    let fenced = Materialized::Fenced {
        current_epoch: Some(4),
    };
    assert_eq!(out, vec![fenced.clone(), fenced]);
    let err =
        e.v2.materialize_batch(0, 4, &[item(309, "u0"), item(308, "u1")])
            .await;
    assert!(
        matches!(err, Err(tidemark_store::Error::InvalidArgument(_))),
        "{err:?}"
    );
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
    assert_eq!(entries(&mut e.raw, &users).await, 307);
}

/// Record `offset` to every one of `to`, one member for all of them.
fn item_to(offset: u64, to: &[&str]) -> SingleItem {
    SingleItem {
        offset,
        prev: offset - 1,
        recipients: to.iter().map(|t| t.to_string()).collect(),
        entry: format!("{offset}:m").into_bytes(),
    }
}

#[tokio::test]
async fn records_of_many_recipients_apply_whole_in_one_call() {
    // ADR-0048: a record of up to MAX_HOT_RECIPIENTS recipients is written to every mailbox
    // and W moves past it in one atomic step; no staging state is written
    let users: Vec<String> = (0..MAX_HOT_RECIPIENTS).map(|i| format!("u{i}")).collect();
    let all: Vec<&str> = users.iter().map(String::as_str).collect();
    let mut e = env_with(Layout::PackedV2, 4, 0).await;
    reset_stats(&mut e.raw).await;
    // one-recipient records and many-recipient ones mixed in one run
    let items = vec![
        item(1, "u0"),
        item_to(2, &["u1", "u2", "u3"]),
        item(3, "u1"),
        item_to(4, &all[..8]),
    ];
    let out = e.v2.materialize_batch(0, 4, &items).await.unwrap();
    assert_eq!(out, applied(1..=4));
    assert_eq!(evalsha_calls(&mut e.raw).await, 1, "one call for the run");
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(4, 0)));
    assert_eq!(entries(&mut e.raw, &all).await, 1 + 3 + 1 + 8);
    let mb: Vec<(Vec<u8>, f64)> = e
        .raw
        .zrange_withscores(keys::mailbox(0, "u1"), 0, -1)
        .await
        .unwrap();
    assert_eq!(
        mb,
        vec![
            (b"2:m".to_vec(), 2.0),
            (b"3:u1".to_vec(), 3.0),
            (b"4:m".to_vec(), 4.0)
        ]
    );
    let staged: Vec<String> = e.raw.keys("stg*").await.unwrap();
    assert!(staged.is_empty(), "no staging state: {staged:?}");

    // a replay, then records up to a gap: what comes before the gap is written whole
    let out =
        e.v2.materialize_batch(
            0,
            4,
            &[
                item_to(4, &all[..8]),
                item_to(5, &all[..2]),
                item_to(7, &all[..2]),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            Materialized::Replay { w: 5 },
            Materialized::Applied { offset: 5 },
            Materialized::Gap { w: 5 }
        ]
    );
    assert_eq!(entries(&mut e.raw, &all).await, 13 + 2);

    // runs end at MAX_RUN_ENTRIES entries: 5 records of MAX_HOT_RECIPIENTS recipients are
    // ceil(5 × 128 / 256) = 3 calls
    reset_stats(&mut e.raw).await;
    let big: Vec<SingleItem> = (6..=10).map(|o| item_to(o, &all)).collect();
    let out = e.v2.materialize_batch(0, 4, &big).await.unwrap();
    assert_eq!(out, applied(6..=10));
    let calls = (5 * MAX_HOT_RECIPIENTS).div_ceil(MAX_RUN_ENTRIES) as u64;
    assert_eq!(evalsha_calls(&mut e.raw).await, calls);
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(10, 0)));
    assert_eq!(entries(&mut e.raw, &all).await, 15 + 5 * MAX_HOT_RECIPIENTS);

    // too many recipients, and more than one on packed-v1 code: refused before any call
    let before = snapshot(&mut e.raw, 0).await;
    let mut many = all.clone();
    many.push("one-too-many");
    let err = e.v2.materialize_batch(0, 4, &[item_to(11, &many)]).await;
    assert!(
        matches!(err, Err(tidemark_store::Error::InvalidArgument(_))),
        "{err:?}"
    );
    let err =
        e.v1.materialize_batch(0, 4, &[item_to(11, &all[..2])])
            .await;
    assert!(
        matches!(err, Err(tidemark_store::Error::InvalidArgument(_))),
        "{err:?}"
    );
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
}

#[tokio::test]
async fn the_many_recipient_form_refuses_counts_that_do_not_add_up() {
    // the script's own guard, called by hand: nothing is written on bad counts
    let mut e = env_with(Layout::PackedV2, 4, 0).await;
    let before = snapshot(&mut e.raw, 0).await;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(include_str!(
            "../src/redis/lua/v2/materialize_fresh_single_recipient.lua"
        ))
        .query_async(&mut e.raw)
        .await
        .unwrap();
    let (wm, a, b) = (keys::wm(0), keys::mailbox(0, "a"), keys::mailbox(0, "b"));
    for (what, ks, counts) in [
        ("a count above the keys", vec![&a], "2"),
        ("a count below the keys", vec![&a, &b], "1"),
        ("a zero count", vec![&a], "0"),
        ("a negative count", vec![&a], "-1"),
        ("a count that is not a number", vec![&a], "x"),
    ] {
        let mut c = redis::cmd("EVALSHA");
        c.arg(&sha).arg(ks.len() + 1).arg(&wm);
        for k in &ks {
            c.arg(k.as_str());
        }
        c.arg("4").arg("m").arg("1").arg("0").arg(counts).arg("1:m");
        let r: redis::RedisResult<redis::Value> = c.query_async(&mut e.raw).await;
        let err = r.expect_err(what);
        assert!(err.to_string().contains("bad_arguments"), "{what}: {err}");
        assert_eq!(snapshot(&mut e.raw, 0).await, before, "{what}");
    }
    // a record split over two calls' worth of arguments (not a multiple of four)
    let r: redis::RedisResult<redis::Value> = redis::cmd("EVALSHA")
        .arg(&sha)
        .arg(2)
        .arg(&wm)
        .arg(&a)
        .arg("4")
        .arg("m")
        .arg("1")
        .arg("0")
        .arg("1")
        .query_async(&mut e.raw)
        .await;
    assert!(r.is_err());
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
    let n: usize = e.raw.zcard(&a).await.unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn held_lane_diverges_to_1216_and_converges_to_19() {
    let mut e = env_with(Layout::PackedV2, 1, 0).await;
    let mut needed = [false; LANES];
    needed[3] = true;
    needed[9] = true;
    let rec = AdvanceRecord {
        offset: 1,
        prev: 0,
        needed,
    };
    // only lane 3's chunk is durable: lane 9 holds back, the rest move
    let c =
        e.v2.write_lane_chunk(0, 1, 1, 3, &[("u3", b"1:u3".as_slice())])
            .await
            .unwrap();
    assert_eq!(c, ChunkWritten::Done { entries: 1 });
    match e.v2.advance(0, 1, &rec).await.unwrap() {
        Advance::Moved(c) => {
            assert_eq!(
                (c.advanced, c.held, c.min_w, c.max_w),
                (63, 1, Some(0), Some(1))
            )
        }
        other => panic!("{other:?}"),
    }
    let b = blob(&mut e.raw, 0).await;
    assert_eq!(b.len(), 1216);
    let wm = e.v2.read_watermark(0).await.unwrap();
    assert_eq!(wm.lanes.lane(9).w, 0);
    assert_eq!(wm.lanes.lane(3).w, 1);
    // the hot path refuses a diverged watermark
    assert_eq!(
        e.v2.materialize_single(0, 1, &item(2, "x")).await.unwrap(),
        Materialized::NotUniform
    );
    // record 2 (no recipients in lane 9) advances the other lanes; lane 9 is a gap for it
    let rec2 = no_recipients(2);
    match e.v2.advance(0, 1, &rec2).await.unwrap() {
        Advance::Moved(c) => assert_eq!((c.advanced, c.gaps), (63, 1)),
        other => panic!("{other:?}"),
    }
    // retry: lane 9's chunk lands, catch-up over both records converges to 19 bytes
    e.v2.write_lane_chunk(0, 1, 1, 9, &[("u9", b"1:u9".as_slice())])
        .await
        .unwrap();
    match e
        .v2
        .advance_many(0, 1, &[rec.clone(), rec2.clone()])
        .await
        .unwrap()
    {
        Advance::Moved(c) => assert_eq!((c.advanced, c.min_w, c.max_w), (2, Some(2), Some(2))),
        other => panic!("{other:?}"),
    }
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(2, 0)));
    // replaying the catch-up writes nothing
    let before = snapshot(&mut e.raw, 0).await;
    assert!(matches!(
        e.v2.advance_many(0, 1, &[rec, rec2]).await.unwrap(),
        Advance::Replay(_)
    ));
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
    // gc removes staging at or below the lowest W only
    e.v2.write_lane_chunk(0, 1, 3, 5, &[("u5", b"3:u5".as_slice())])
        .await
        .unwrap();
    assert_eq!(
        e.v2.gc_completed(0, 100).await.unwrap(),
        Gc::Done {
            min_w: Some(2),
            deleted: 1,
            epoch: Some(1)
        }
    );
    let left: Vec<u64> = e.raw.zrange(keys::staging_index(0), 0, -1).await.unwrap();
    assert_eq!(left, vec![3]);
    let gone: bool = e.raw.exists(keys::staging(0, 1)).await.unwrap();
    assert!(!gone);
    let kept: bool = e.raw.exists(keys::staging(0, 3)).await.unwrap();
    assert!(kept);
}

#[tokio::test]
async fn cas_gap_does_not_advance_and_stale_epoch_is_refused() {
    let mut e = env_with(Layout::PackedV2, 2, 10).await;
    let before = snapshot(&mut e.raw, 0).await;
    let rec = no_recipients(13);
    assert!(matches!(e.v2.advance(0, 2, &rec).await.unwrap(), Advance::Gap(c) if c.gaps == 64));
    assert!(matches!(
        e.v2.advance_many(0, 2, std::slice::from_ref(&rec))
            .await
            .unwrap(),
        Advance::Gap(_)
    ));
    assert_eq!(
        e.v2.advance(0, 1, &rec).await.unwrap(),
        Advance::Fenced {
            current_epoch: Some(2)
        }
    );
    assert_eq!(
        e.v2.write_lane_chunk(0, 1, 11, 0, &[("a", b"11:a".as_slice())])
            .await
            .unwrap(),
        ChunkWritten::Fenced {
            current_epoch: Some(2)
        }
    );
    let n: usize = e.raw.zcard(keys::mailbox(0, "a")).await.unwrap();
    assert_eq!(n, 0);
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
    // a new owner claims: the old epoch is fenced from then on
    let new = e.v2.claim(0).await.unwrap();
    assert_eq!(new, 3);
    assert!(matches!(
        e.v2.materialize_single(0, 2, &item(11, "a")).await.unwrap(),
        Materialized::Fenced {
            current_epoch: Some(3)
        }
    ));
    assert_eq!(
        e.v2.materialize_single(0, 3, &item(11, "a")).await.unwrap(),
        Materialized::Applied { offset: 11 }
    );
}

#[tokio::test]
async fn v1_data_is_read_and_rewritten_as_v2() {
    let mut e = env_with(Layout::PackedV1, 1, 0).await;
    assert_eq!(blob(&mut e.raw, 0).await.len(), 1216);
    // the hot path hands v1 data to the chunked path
    assert_eq!(
        e.v2.materialize_single(0, 1, &item(1, "x")).await.unwrap(),
        Materialized::NotUniform
    );
    let rec = no_recipients(1);
    assert!(matches!(
        e.v2.advance(0, 1, &rec).await.unwrap(),
        Advance::Moved(_)
    ));
    let layout: String = e.raw.hget(keys::wm(0), "wm_layout").await.unwrap();
    assert_eq!(layout, "packed-v2");
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v2(&uni(1, 0)));
    // and the hot path takes it from there
    assert_eq!(
        e.v2.materialize_single(0, 1, &item(2, "x")).await.unwrap(),
        Materialized::Applied { offset: 2 }
    );
}

/// Old code (the packed-v1 store) refuses shard 0's watermark as `code` (`name`) in its hot
/// path and in every script, and writes nothing.
async fn v1_refuses(e: &mut Env, code: CorruptCode, name: &str) {
    let before = snapshot(&mut e.raw, 0).await;
    let r = e.v1.materialize_single(0, 1, &item(1, "x")).await.unwrap();
    assert!(
        matches!(r, Materialized::Corrupt(ref v) if v.code == code),
        "{r:?}"
    );
    for (s, v) in lua_verdicts(&mut e.v1, 1).await {
        assert_eq!(v.unwrap().0, name, "{s}");
    }
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
}

#[tokio::test]
async fn old_code_refuses_v2_by_layout_and_by_length_without_writing() {
    // path 1: the layout check
    let mut e = env_with(Layout::PackedV2, 1, 0).await;
    v1_refuses(&mut e, CorruptCode::UnknownLayout, "unknown_layout").await;
    // path 2: the length check, even with the layout string of v1
    let _: () = e
        .raw
        .hset(keys::wm(0), "wm_layout", "packed-v1")
        .await
        .unwrap();
    v1_refuses(&mut e, CorruptCode::BadLength, "bad_length").await;
    let n: usize = e.raw.zcard(keys::mailbox(0, "x")).await.unwrap();
    assert_eq!(n, 0);
}

/// Old code must not fence a new owner before failing closed: a packed-v1 store refuses to
/// claim anything but packed-v1 with 1216 bytes, before raising the epoch (ADR-0022).
#[tokio::test]
async fn old_code_refuses_to_claim_newer_data_without_raising_the_epoch() {
    // packed-v2 with a 19-byte and with a 1216-byte blob: unknown_layout
    let mut e = env_with(Layout::PackedV2, 7, 0).await;
    put(
        &mut e.raw,
        1,
        &f("packed-v2", "7", encode_packed_v1(&uni(3, 0))),
    )
    .await;
    for shard in [0, 1] {
        let before = snapshot(&mut e.raw, shard).await;
        let err = e.v1.claim(shard).await.unwrap_err();
        assert!(err.is_corrupt(), "{err:?}");
        assert_eq!(
            err.corrupt_verdict(),
            Some(("unknown_layout".to_string(), None)),
            "shard {shard}: {err}"
        );
        assert_eq!(snapshot(&mut e.raw, shard).await, before, "nothing written");
        // new code claims it
        assert_eq!(e.v2.claim(shard).await.unwrap(), 8);
    }
    // packed-v1 with a 19-byte blob: bad_length (the decoder's own check), nothing written
    put(
        &mut e.raw,
        2,
        &f("packed-v1", "7", encode_packed_v2(&uni(3, 0))),
    )
    .await;
    let before = snapshot(&mut e.raw, 2).await;
    let err = e.v1.claim(2).await.unwrap_err();
    assert_eq!(
        err.corrupt_verdict(),
        Some(("bad_length".to_string(), None))
    );
    assert_eq!(snapshot(&mut e.raw, 2).await, before);
    // packed-v1, 1216 bytes: old code claims as before
    put(
        &mut e.raw,
        3,
        &f("packed-v1", "7", encode_packed_v1(&uni(3, 0))),
    )
    .await;
    assert_eq!(e.v1.claim(3).await.unwrap(), 8);
    assert_eq!(
        e.v1.read_watermark(3).await.unwrap().layout,
        Layout::PackedV1
    );
}

/// Records 1 (to `a`) and 2 (to `to`) through `store`'s hot path in one batch, epoch 1: the
/// second is applied.
async fn two_in_a_batch(store: &mut MailboxStore, to: &str) {
    let items = [item(1, "a"), item(2, to)];
    let r = store.materialize_batch(0, 1, &items).await.unwrap();
    assert_eq!(r[1], Materialized::Applied { offset: 2 });
}

#[tokio::test]
async fn v1_scripts_work_on_v1_data() {
    let mut e = env().await;
    e.v1.init_watermark(0, Layout::PackedV1, 1, 0, false)
        .await
        .unwrap();
    two_in_a_batch(&mut e.v1, "b").await;
    assert_eq!(blob(&mut e.raw, 0).await, encode_packed_v1(&uni(2, 0)));
}

#[tokio::test]
async fn hlen_not_3_refused_by_every_script() {
    let mut e = env_with(Layout::PackedV2, 1, 0).await;
    let _: () = e.raw.hset(keys::wm(0), "extra", "1").await.unwrap();
    let before = snapshot(&mut e.raw, 0).await;
    for (s, v) in lua_verdicts(&mut e.v2, 1).await {
        assert_eq!(v.unwrap().0, "field_count", "{s}");
    }
    assert_eq!(snapshot(&mut e.raw, 0).await, before);
}

#[tokio::test]
async fn noscript_recovery_after_script_flush() {
    let mut e = env_with(Layout::PackedV2, 1, 0).await;
    script_flush(&mut e.raw).await;
    two_in_a_batch(&mut e.v2, "a").await;
    script_flush(&mut e.raw).await;
    assert_eq!(e.v2.read_watermark(0).await.unwrap().lanes, uni(2, 0));
}

#[tokio::test]
async fn init_refuses_overwrite_and_downgrade_expands() {
    let mut e = env_with(Layout::PackedV2, 1, 0).await;
    let err =
        e.v2.init_watermark(0, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap_err();
    assert_eq!(err.code(), "already_exists");
    e.v2.materialize_single(0, 1, &item(1, "a")).await.unwrap();
    let wm = e.v2.downgrade_to_v1(0).await.unwrap();
    assert_eq!(wm.layout, Layout::PackedV2);
    let after = e.v2.read_watermark(0).await.unwrap();
    assert_eq!(
        (after.layout, after.blob_len, after.epoch),
        (Layout::PackedV1, 1216, 1)
    );
    assert_eq!(after.lanes, uni(1, 0));
    // old code runs again on the downgraded data
    assert_eq!(
        e.v1.materialize_single(0, 1, &item(2, "a")).await.unwrap(),
        Materialized::Applied { offset: 2 }
    );
    // corrupt input is refused
    let _: () = e.raw.hset(keys::wm(0), "wm_epoch", "x").await.unwrap();
    assert!(e.v2.downgrade_to_v1(0).await.unwrap_err().is_corrupt());
}

/// Issue 11, item 2: the epoch — not only the CAS on W — stops a stale owner. Every writing
/// script is called by a fenced owner (epoch 1, the shard claimed to 2) with arguments the W
/// check accepts (`expected_previous == W`, a record above W): each answers `Fenced` and writes
/// nothing (watermark, mailbox, staging). The very same call with the current epoch, on a
/// shard in the same state, is applied: so only the fence refused it.
#[tokio::test]
async fn a_stale_epoch_is_refused_where_the_w_check_alone_would_pass() {
    let mut e = env().await;
    // shards 0..4, one per script: W = 5 on every lane, epoch 1 claimed to 2
    for s in 0..4 {
        e.v2.init_watermark(s, Layout::PackedV2, 1, 5, false)
            .await
            .unwrap();
        assert_eq!(e.v2.claim(s).await.unwrap(), 2);
    }
    let fenced = Some(2);
    let lane = 7;
    let rec = no_recipients(6);
    // everything a call may write on shard `s`
    async fn state(raw: &mut ConnectionManager, s: u32) -> (Fields, Vec<Vec<u8>>, bool, usize) {
        let mb: Vec<Vec<u8>> = raw.zrange(keys::mailbox(s, "zed"), 0, -1).await.unwrap();
        let stg: bool = raw.exists(keys::staging(s, 6)).await.unwrap();
        let idx: usize = raw.zcard(keys::staging_index(s)).await.unwrap();
        (snapshot(raw, s).await, mb, stg, idx)
    }
    let before: Vec<_> = {
        let mut v = Vec::new();
        for s in 0..4 {
            v.push(state(&mut e.raw, s).await);
        }
        v
    };

    // 1. hot path
    assert_eq!(
        e.v2.materialize_single(0, 1, &item(6, "zed"))
            .await
            .unwrap(),
        Materialized::Fenced {
            current_epoch: fenced
        }
    );
    // 2. lane chunk (no CAS at all: the epoch is its only guard)
    assert_eq!(
        e.v2.write_lane_chunk(1, 1, 6, lane, &[("zed", b"6:zed".as_slice())])
            .await
            .unwrap(),
        ChunkWritten::Fenced {
            current_epoch: fenced
        }
    );
    // 3. and 4. advance one record, advance many
    assert_eq!(
        e.v2.advance(2, 1, &rec).await.unwrap(),
        Advance::Fenced {
            current_epoch: fenced
        }
    );
    assert_eq!(
        e.v2.advance_many(3, 1, std::slice::from_ref(&rec))
            .await
            .unwrap(),
        Advance::Fenced {
            current_epoch: fenced
        }
    );
    for s in 0..4 {
        assert_eq!(
            state(&mut e.raw, s).await,
            before[s as usize],
            "shard {s}: a fenced call wrote something"
        );
    }

    // the same calls with the current epoch go through: the W check alone would let them
    assert_eq!(
        e.v2.materialize_single(0, 2, &item(6, "zed"))
            .await
            .unwrap(),
        Materialized::Applied { offset: 6 }
    );
    assert_eq!(
        e.v2.write_lane_chunk(1, 2, 6, lane, &[("zed", b"6:zed".as_slice())])
            .await
            .unwrap(),
        ChunkWritten::Done { entries: 1 }
    );
    assert!(matches!(
        e.v2.advance(2, 2, &rec).await.unwrap(),
        Advance::Moved(c) if c.min_w == Some(6)
    ));
    assert!(matches!(
        e.v2.advance_many(3, 2, std::slice::from_ref(&rec)).await.unwrap(),
        Advance::Moved(c) if c.min_w == Some(6)
    ));
    let mb: Vec<Vec<u8>> = e.raw.zrange(keys::mailbox(0, "zed"), 0, -1).await.unwrap();
    assert_eq!(mb, vec![b"6:zed".to_vec()]);
    let mb: Vec<Vec<u8>> = e.raw.zrange(keys::mailbox(1, "zed"), 0, -1).await.unwrap();
    assert_eq!(mb, vec![b"6:zed".to_vec()]);
}

/// ADR-0123: a `wm:{s}` that is not a hash is that shard's corrupt watermark alone. Before,
/// the read script's `HGETALL` raised `WRONGTYPE`, which aborted the script and failed the
/// read of every shard asked (the gateway's wake sweep read none of its instance's shards
/// while one key was broken).
#[tokio::test]
async fn a_watermark_key_of_another_type_fails_only_its_own_shard() {
    let mut e = env().await;
    for s in [0, 1, 2] {
        e.v2.init_watermark(s, Layout::PackedV2, 1, 7, false)
            .await
            .unwrap();
    }
    let _: () = e.raw.del(keys::wm(1)).await.unwrap();
    let _: () = e.raw.set(keys::wm(1), "x").await.unwrap();
    let _: () = e.raw.del(keys::wm(2)).await.unwrap();
    let _: () = e.raw.rpush(keys::wm(2), "x").await.unwrap();
    let Stores { v2, v1 } = &mut *e;
    for store in [v2, v1] {
        let read = store
            .read_watermarks(&[0, 1, 2, 3])
            .await
            .expect("one key of another type fails its own shard only");
        assert_eq!(read.len(), 4);
        assert_eq!(read[0].as_ref().unwrap().lanes, uni(7, 7));
        for (i, found) in [(1, "string"), (2, "list")] {
            let err = read[i].as_ref().unwrap_err();
            assert!(err.is_corrupt(), "shard {i}: {err}");
            assert_eq!(
                err.corrupt_verdict(),
                Some(("wrong_type".to_string(), None)),
                "shard {i}: {err}"
            );
            assert!(err.to_string().contains(found), "shard {i}: {err}");
        }
        assert_eq!(read[3].as_ref().unwrap_err().code(), "no_watermark");
        // one shard alone: the same typed verdict, not a Redis error
        let one = store.read_watermark(1).await.unwrap_err();
        assert_eq!(one.corrupt_verdict(), Some(("wrong_type".into(), None)));
    }
}
