//! Unit tests of the mailbox store that need no Redis: the Lua sources' status numbers and
//! cause strings checked against [`ScriptStatus`] and [`CorruptCode`], and every `parse_*` of
//! [`super::reply`] fed synthetic replies. (Against a real redis-server:
//! `crates/store/tests/watermark_scripts.rs`.)

use std::collections::BTreeSet;

use redis::Value;

use super::reply::{parse_advance, parse_chunk_written, parse_fence, parse_gc, parse_materialized};
use super::{Advance, AdvanceCounts, ChunkWritten, Fence, Gc, Materialized, ScriptStatus, Verdict};
use crate::error::{Error, Result};
use crate::redis::watermark::{CorruptCause, CorruptCode};

const LANES_LUA: &str = include_str!("../lua/common/_lanes.lua");
const LAYOUT_V1_LUA: &str = include_str!("../lua/v1/_layout.lua");
const LAYOUT_V2_LUA: &str = include_str!("../lua/v2/_layout.lua");
const HOT_V1_LUA: &str = include_str!("../lua/v1/materialize_fresh_single_recipient.lua");
const HOT_V2_LUA: &str = include_str!("../lua/v2/materialize_fresh_single_recipient.lua");
const READ_LUA: &str = include_str!("../lua/common/read_log_watermarks.lua");
const SOURCES: [(&str, &str); 6] = [
    ("common/_lanes.lua", LANES_LUA),
    ("v1/_layout.lua", LAYOUT_V1_LUA),
    ("v2/_layout.lua", LAYOUT_V2_LUA),
    ("v1/materialize_fresh_single_recipient.lua", HOT_V1_LUA),
    ("v2/materialize_fresh_single_recipient.lua", HOT_V2_LUA),
    ("common/read_log_watermarks.lua", READ_LUA),
];

/// The quoted strings that follow each occurrence of `prefix` in `src`.
fn quoted_after<'a>(src: &'a str, prefix: &str) -> Vec<&'a str> {
    src.match_indices(prefix)
        .filter_map(|(i, _)| {
            let rest = &src[i + prefix.len()..];
            rest.find('\'').map(|end| &rest[..end])
        })
        .collect()
}

/// Every cause string a corrupt reply of these sources can carry: `corrupt('x'…)`,
/// `{-1, 'x', …}`, and the lane checks' `return nil, 'x'` (passed on to `corrupt`).
fn lua_cause_strings() -> BTreeSet<(&'static str, &'static str)> {
    let mut out = BTreeSet::new();
    for (name, src) in SOURCES {
        for prefix in ["corrupt('", "{-1, '", "return nil, '"] {
            for s in quoted_after(src, prefix) {
                out.insert((name, s));
            }
        }
    }
    out
}

#[test]
fn corrupt_codes_match_the_lua_sources() {
    let found = lua_cause_strings();
    for (name, s) in &found {
        assert!(
            s.parse::<CorruptCode>().is_ok(),
            "{name} returns cause {s:?}, which is not a CorruptCode"
        );
    }
    let strings: BTreeSet<&str> = found.iter().map(|(_, s)| *s).collect();
    for code in CorruptCode::ALL {
        assert!(
            strings.contains(code.as_str()),
            "CorruptCode {code} is returned by no Lua source"
        );
        assert_eq!(code.as_str().parse::<CorruptCode>(), Ok(code));
    }
    // each hot path repeats the checks on its own: it can return every code of the fields
    // (a key that is not a hash fails its call with WRONGTYPE: `wrong_type` is the read
    // script's, ADR-0123)
    for (name, src) in [("v1", HOT_V1_LUA), ("v2", HOT_V2_LUA)] {
        let hot: BTreeSet<&str> = quoted_after(src, "{-1, '").into_iter().collect();
        let all: BTreeSet<&str> = CorruptCode::ALL
            .iter()
            .filter(|c| **c != CorruptCode::WrongType)
            .map(|c| c.as_str())
            .collect();
        assert_eq!(hot, all, "{name} hot path");
    }
    assert!("bogus".parse::<CorruptCode>().is_err());
}

/// The status numbers of the reply-convention header of `_lanes.lua`.
fn documented_statuses() -> BTreeSet<i64> {
    let mut lines = LANES_LUA
        .lines()
        .skip_while(|l| !l.starts_with("-- Reply conventions"))
        .skip(1)
        .take_while(|l| l.starts_with("--"));
    let mut out = BTreeSet::new();
    for l in lines.by_ref() {
        let body = l.trim_start_matches('-').trim_start();
        if let Some(rest) = body.strip_prefix('{') {
            let n: String = rest
                .chars()
                .take_while(|c| *c == '-' || c.is_ascii_digit())
                .collect();
            out.insert(n.parse().expect("a status number"));
        }
    }
    out
}

#[test]
fn script_statuses_match_the_lanes_header() {
    let documented = documented_statuses();
    let ours: BTreeSet<i64> = ScriptStatus::ALL.iter().map(|s| s.code()).collect();
    assert_eq!(documented, ours);
    assert_eq!(ours.len(), ScriptStatus::ALL.len(), "codes are distinct");
    for s in ScriptStatus::ALL {
        assert_eq!(ScriptStatus::from_code(s.code()), Some(s));
    }
    // every literal status these sources return is in the table
    for (name, src) in SOURCES {
        for (i, _) in src.match_indices("return {") {
            let n: String = src[i + "return {".len()..]
                .chars()
                .take_while(|c| *c == '-' || c.is_ascii_digit())
                .collect();
            if n.is_empty() {
                continue; // {status, ...} computed, or a table that is not a reply
            }
            let n: i64 = n.parse().unwrap();
            assert!(
                ScriptStatus::from_code(n).is_some(),
                "{name} returns status {n}"
            );
        }
    }
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}
fn bulk(s: &str) -> Value {
    Value::BulkString(s.as_bytes().to_vec())
}
fn int(i: i64) -> Value {
    Value::Int(i)
}
fn unexpected<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(Error::UnexpectedReply { .. }))
}

#[test]
fn hot_path_replies_decode() {
    // one record: the replies ADR-0015's one-record call gives
    let p = |v: &Value| parse_materialized(v, &[9]).map(|o| o.map(|mut v| v.pop().unwrap()));
    assert_eq!(
        p(&int(9)).unwrap(),
        Some(Materialized::Applied { offset: 9 })
    );
    assert_eq!(
        p(&arr(vec![int(1), int(5), int(1), int(0)])).unwrap(),
        Some(Materialized::Replay { w: 5 })
    );
    assert_eq!(
        p(&arr(vec![int(2), bulk("4"), int(0), int(0)])).unwrap(),
        Some(Materialized::Gap { w: 4 })
    );
    assert_eq!(
        p(&arr(vec![int(3), bulk("12")])).unwrap(),
        Some(Materialized::Fenced {
            current_epoch: Some(12)
        })
    );
    assert_eq!(
        p(&arr(vec![int(4)])).unwrap(),
        Some(Materialized::NotUniform)
    );
    assert_eq!(p(&arr(vec![int(5)])).unwrap(), None);
    assert_eq!(
        p(&arr(vec![int(-1), bulk("bad_epoch"), int(-1)])).unwrap(),
        Some(Materialized::Corrupt(Verdict {
            code: CorruptCode::BadEpoch,
            lane: None
        }))
    );
    assert_eq!(
        p(&arr(vec![int(-1), bulk("w_mismatch"), int(0)])).unwrap(),
        Some(Materialized::Corrupt(Verdict {
            code: CorruptCode::WMismatch,
            lane: Some(0)
        }))
    );
    // unknown status, status the hot path does not return, unknown or missing cause
    assert!(unexpected(p(&arr(vec![int(8)]))));
    assert!(unexpected(p(&arr(vec![int(-2), int(1)]))));
    assert!(unexpected(p(&arr(vec![int(6), int(0)]))));
    assert!(unexpected(p(&arr(vec![int(-1), bulk("bogus"), int(-1)]))));
    assert!(unexpected(p(&arr(vec![int(-1)]))));
    assert!(unexpected(p(&arr(vec![]))));
    assert!(unexpected(p(&bulk("OK"))));
    // applied up to another offset than the record's; a replay or gap without its counts
    assert!(unexpected(p(&int(8))));
    assert!(unexpected(p(&arr(vec![int(1), int(5)]))));
    assert!(unexpected(p(&arr(vec![int(2), int(5)]))));
}

#[test]
fn hot_path_run_replies_decode() {
    // a run of four records, offsets 7..=10: one outcome per record, in order
    let offs = [7, 8, 9, 10];
    let p = |v: Value| parse_materialized(&v, &offs);
    let applied = |o: u64| Materialized::Applied { offset: o };
    assert_eq!(
        p(int(10)).unwrap().unwrap(),
        vec![applied(7), applied(8), applied(9), applied(10)]
    );
    // two replays (W was 8), then two applied
    assert_eq!(
        p(arr(vec![int(1), int(10), int(2), int(2)]))
            .unwrap()
            .unwrap(),
        vec![
            Materialized::Replay { w: 10 },
            Materialized::Replay { w: 10 },
            applied(9),
            applied(10)
        ]
    );
    // one applied, then a gap: the gap and every record after it report it
    assert_eq!(
        p(arr(vec![int(2), int(7), int(0), int(1)]))
            .unwrap()
            .unwrap(),
        vec![
            applied(7),
            Materialized::Gap { w: 7 },
            Materialized::Gap { w: 7 },
            Materialized::Gap { w: 7 }
        ]
    );
    assert_eq!(
        p(arr(vec![int(4)])).unwrap().unwrap(),
        vec![Materialized::NotUniform; 4]
    );
    // counts that do not fit the run: never accepted as some outcome
    assert!(unexpected(p(arr(vec![int(1), int(10), int(1), int(2)]))));
    assert!(unexpected(p(arr(vec![int(1), int(10), int(3), int(2)]))));
    assert!(unexpected(p(arr(vec![int(2), int(10), int(2), int(2)]))));
    assert!(unexpected(p(arr(vec![int(2), int(10), int(4), int(1)]))));
    assert!(unexpected(p(int(9))));
}

#[test]
fn advance_replies_decode() {
    let p = |v: Value| parse_advance(7, "advance_log_watermark", &v);
    let counts = AdvanceCounts {
        advanced: 1,
        held: 2,
        gaps: 3,
        min_w: Some(4),
        max_w: None,
    };
    let c = |s: i64| arr(vec![int(s), int(1), int(2), int(3), int(4), int(-1)]);
    assert_eq!(p(c(0)).unwrap(), Advance::Moved(counts));
    assert_eq!(p(c(1)).unwrap(), Advance::Replay(counts));
    assert_eq!(p(c(2)).unwrap(), Advance::Gap(counts));
    assert_eq!(p(c(6)).unwrap(), Advance::Held(counts));
    assert_eq!(
        p(arr(vec![
            int(7),
            int(1),
            int(2),
            int(3),
            int(4),
            int(-1),
            int(63),
            int(99)
        ]))
        .unwrap(),
        Advance::EmptyLane {
            counts,
            lane: 63,
            offset: 99
        }
    );
    assert_eq!(
        p(arr(vec![int(3), bulk("not-an-epoch")])).unwrap(),
        Advance::Fenced {
            current_epoch: None
        }
    );
    assert!(matches!(
        p(arr(vec![int(5)])),
        Err(Error::NoWatermark { shard: 7 })
    ));
    assert_eq!(
        p(arr(vec![int(-1), bulk("bad_presence"), int(3)])).unwrap(),
        Advance::Corrupt(Verdict {
            code: CorruptCode::BadPresence,
            lane: Some(3)
        })
    );
    assert!(unexpected(p(arr(vec![int(4)]))));
    assert!(unexpected(p(arr(vec![int(9), int(0)]))));
    assert!(unexpected(p(arr(vec![
        int(-1),
        bulk("w_too_high"),
        int(3)
    ]))));
}

#[test]
fn chunk_gc_and_fence_replies_decode() {
    assert_eq!(
        parse_chunk_written(1, &arr(vec![int(0), int(3)])).unwrap(),
        ChunkWritten::Done { entries: 3 }
    );
    assert_eq!(
        parse_chunk_written(1, &arr(vec![int(3), bulk("2")])).unwrap(),
        ChunkWritten::Fenced {
            current_epoch: Some(2)
        }
    );
    assert!(matches!(
        parse_chunk_written(1, &arr(vec![int(5)])),
        Err(Error::NoWatermark { shard: 1 })
    ));
    assert!(unexpected(parse_chunk_written(
        1,
        &arr(vec![int(-1), bulk("bad_length"), int(-1)])
    )));
    assert!(unexpected(parse_chunk_written(1, &arr(vec![int(42)]))));

    assert_eq!(
        parse_gc(2, &arr(vec![int(0), int(-1), int(0)])).unwrap(),
        Gc::Done {
            min_w: None,
            deleted: 0,
            epoch: None
        }
    );
    assert_eq!(
        parse_gc(2, &arr(vec![int(0), int(10), int(4)])).unwrap(),
        Gc::Done {
            min_w: Some(10),
            deleted: 4,
            epoch: None
        }
    );
    assert_eq!(
        parse_gc(2, &arr(vec![int(0), int(10), int(4), bulk("7")])).unwrap(),
        Gc::Done {
            min_w: Some(10),
            deleted: 4,
            epoch: Some(7)
        }
    );
    assert_eq!(
        parse_gc(2, &arr(vec![int(-1), bulk("field_count"), int(-1)])).unwrap(),
        Gc::Corrupt(Verdict {
            code: CorruptCode::FieldCount,
            lane: None
        })
    );
    assert!(unexpected(parse_gc(
        2,
        &arr(vec![int(-1), bulk("unknown"), int(-1)])
    )));
    assert!(unexpected(parse_gc(2, &arr(vec![int(1), int(0)]))));

    assert_eq!(
        parse_fence(3, 8, &arr(vec![int(0), bulk("8")])).unwrap(),
        Fence::Raised { epoch: 8 }
    );
    assert_eq!(
        parse_fence(3, 8, &arr(vec![int(3), bulk("9")])).unwrap(),
        Fence::Lost {
            current_epoch: Some(9)
        }
    );
    assert!(matches!(
        parse_fence(3, 8, &arr(vec![int(5)])),
        Err(Error::NoWatermark { shard: 3 })
    ));
    assert!(unexpected(parse_fence(3, 8, &arr(vec![int(-7)]))));
}

#[test]
fn rust_causes_carry_their_codes() {
    let c = CorruptCause::WBelowFloor {
        lane: 2,
        w: 1,
        w_floor: 5,
    };
    assert_eq!(c.code(), CorruptCode::WBelowFloor);
    assert_eq!(c.verdict(), ("w_below_floor", Some(2)));
}
