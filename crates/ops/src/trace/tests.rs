//! Unit tests of the trace's pure parts: recipient states and both renderings, on a synthetic
//! trace (`cmd/tidemark/tests/trace_cli.rs` traces real deployments).

use tidemark_store::redis::watermark::{LaneRecord, Layout};

use super::render::one_line;
use super::*;

#[test]
fn recipient_states() {
    let lane = LaneRecord::at(10, 0);
    let s = |lane: &LaneRecord, entry, acked| RecipientState::classify(lane, 10, entry, acked);
    assert_eq!(s(&lane, true, 0), RecipientState::Materialised);
    assert_eq!(s(&lane, false, 10), RecipientState::AckedPossiblyTrimmed);
    assert_eq!(s(&lane, false, 9), RecipientState::Missing);
    let behind = LaneRecord::at(9, 0);
    assert_eq!(s(&behind, true, 0), RecipientState::PendingEntryWritten);
    assert_eq!(s(&behind, false, 20), RecipientState::Pending);
    assert_eq!(
        s(&LaneRecord::EMPTY, true, 20),
        RecipientState::LaneNotPresent
    );
    for (state, materialised) in [
        (RecipientState::Materialised, true),
        (RecipientState::AckedPossiblyTrimmed, true),
        (RecipientState::Missing, true),
        (RecipientState::PendingEntryWritten, false),
        (RecipientState::Pending, false),
        (RecipientState::LaneNotPresent, false),
    ] {
        assert_eq!(state.is_materialised(), materialised, "{state:?}");
    }
}

#[test]
fn user_ids_stay_on_one_line() {
    assert_eq!(one_line("alice"), "alice");
    assert_eq!(one_line("a\nb\u{1b}"), "a\\nb\\u{1b}");
}

fn sample() -> Trace {
    Trace {
        shard: 3,
        offset: 7,
        shards: 4,
        core_url: "redis://:***@h:1/".into(),
        mailbox_url: "redis://h:2/".into(),
        log: LogState {
            head: 9,
            first: Some(5),
            len: 5,
        },
        record: Some(LogRecord {
            offset: 7,
            prev: 6,
            sender: "alice".into(),
            client_id: "m-1".into(),
            recipients: vec!["bob".into(), "carol\n".into()],
            sent_at_us: 1_764_489_600_000_000,
            body_bytes: 2,
        }),
        trimmed: false,
        watermark: WatermarkSummary {
            layout: Layout::PackedV2,
            epoch: 2,
            blob_bytes: 19,
            uniform: false,
            min_w: Some(6),
            max_w: Some(8),
        },
        staging_lanes: None,
        recipients_from: RecipientSource::Log,
        recipients: vec![
            RecipientTrace {
                user: "bob".into(),
                lane: 12,
                lane_present: true,
                lane_w: 8,
                entry: Some(EntryInfo {
                    from: Some("alice".into()),
                    sent_at_us: Some(1_764_489_600_000_000),
                    bytes: 22,
                }),
                acked: 0,
                state: RecipientState::Materialised,
            },
            RecipientTrace {
                user: "carol\n".into(),
                lane: 40,
                lane_present: true,
                lane_w: 6,
                entry: None,
                acked: 0,
                state: RecipientState::Pending,
            },
        ],
        status: TraceStatus::Pending,
        problems: vec!["something odd".into()],
    }
}

#[test]
fn human_form() {
    let text = sample().to_human();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "trace shard 3 offset 7 (4 shards; core redis://:***@h:1/, mailbox redis://h:2/)"
    );
    assert_eq!(
        lines[1],
        "log        dlog:{3} head 9, holds offsets 5..=9 (5 records)"
    );
    assert_eq!(
        lines[2],
        "record     offset 7 prev 6, from alice, client id m-1, sent_at \
         2025-11-30T08:00:00.000000Z (1764489600000000 µs), body 2 bytes"
    );
    assert_eq!(
        lines[3],
        "           recipients in this shard (2): bob, carol\\n"
    );
    assert!(lines[4].starts_with("watermark  wm:{3} packed-v2, epoch 2, blob 19 bytes, diverged"));
    assert_eq!(
        lines[5],
        "staging    stg:{3}:7: none (hot path, or collected by GC)"
    );
    assert!(
        lines[7].contains("materialised, entry present"),
        "{}",
        lines[7]
    );
    assert!(lines[8].starts_with("  carol\\n"), "{}", lines[8]);
    assert!(lines[8].ends_with("pending (lane W = 6)"), "{}", lines[8]);
    assert_eq!(
        lines[9],
        "status     pending: some lane W is still below the record"
    );
    assert_eq!(lines[10], "problem    something odd");
    assert_eq!(lines.len(), 11);
}

#[test]
fn json_form_adds_materialised_and_detail() {
    let t = sample();
    let v = t.to_json();
    assert_eq!(v["status"], "pending");
    assert_eq!(v["recipients_from"], "log");
    assert_eq!(v["watermark"]["layout"], "packed-v2");
    assert_eq!(v["recipients"][0]["state"], "materialised");
    assert_eq!(v["recipients"][0]["materialised"], true);
    assert_eq!(v["recipients"][0]["detail"], "materialised, entry present");
    assert_eq!(v["recipients"][1]["materialised"], false);
    assert_eq!(v["recipients"][1]["detail"], "pending (lane W = 6)");
    assert_eq!(v["problems"][0], "something odd");
}
