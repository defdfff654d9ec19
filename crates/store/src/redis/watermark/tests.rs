//! Unit tests of the watermark codec: round trips, the epoch syntax, every corrupt cause and
//! its check order, and property tests over arbitrary blobs. (The same vectors through the Lua
//! scripts, against a real redis-server: `crates/store/tests/watermark_scripts.rs`.)

use super::*;
use proptest::prelude::*;

fn fields(layout: &str, epoch: &str, blob: Vec<u8>) -> Vec<(Vec<u8>, Vec<u8>)> {
    vec![
        (FIELD_LAYOUT.into(), layout.into()),
        (FIELD_EPOCH.into(), epoch.into()),
        (FIELD_BLOB.into(), blob),
    ]
}

#[test]
fn uniform_v2_round_trip() {
    let lanes = LaneWatermarks::uniform(LaneRecord::at(42, 7));
    let blob = encode_packed_v2(&lanes);
    assert_eq!(blob.len(), LANE_BYTES);
    let wm = decode_lane_watermarks(&fields("packed-v2", "3", blob)).unwrap();
    assert_eq!(wm.lanes, lanes);
    assert_eq!(wm.epoch, 3);
    assert_eq!(wm.blob_len, 19);
}

#[test]
fn epoch_syntax() {
    for ok in ["0", "1", "18446744073709551615", "42"] {
        assert!(parse_epoch(ok.as_bytes()).is_some(), "{ok}");
    }
    for bad in [
        "",
        "01",
        "+1",
        "-1",
        " 1",
        "1 ",
        "18446744073709551616",
        "1e3",
        "0x1",
        "99999999999999999999",
        "000",
    ] {
        assert!(parse_epoch(bad.as_bytes()).is_none(), "{bad}");
    }
}

#[test]
fn later_lane_checked() {
    let mut lanes = LaneWatermarks::uniform(LaneRecord::at(5, 0));
    lanes.0[63] = LaneRecord::at(4, 0);
    let mut blob = encode_packed_v2(&lanes);
    assert_eq!(blob.len(), FULL_BLOB_BYTES);
    blob[63 * 19 + 18] = 9; // W_recomputed of lane 63 low byte
    let err = decode_lane_watermarks(&fields("packed-v2", "1", blob)).unwrap_err();
    assert_eq!(err.verdict(), ("w_mismatch", Some(63)));
}

fn lane_strategy() -> impl Strategy<Value = LaneRecord> {
    prop_oneof![
        Just(LaneRecord::EMPTY),
        (0u64..=U48_MAX, 0u64..=U48_MAX).prop_map(|(a, b)| LaneRecord::at(a.max(b), a.min(b))),
    ]
}

fn lanes_strategy() -> impl Strategy<Value = LaneWatermarks> {
    prop_oneof![
        lane_strategy().prop_map(LaneWatermarks::uniform),
        proptest::collection::vec(lane_strategy(), LANES)
            .prop_map(|v| LaneWatermarks(v.try_into().unwrap())),
        // mostly-uniform: one lane differs
        (lane_strategy(), lane_strategy(), 0usize..LANES).prop_map(|(a, b, i)| {
            let mut l = LaneWatermarks::uniform(a);
            l.0[i] = b;
            l
        }),
    ]
}

proptest! {
    #[test]
    fn round_trip_and_canonical(lanes in lanes_strategy(), epoch in any::<u64>()) {
        let v2 = encode_packed_v2(&lanes);
        prop_assert_eq!(v2.len() == LANE_BYTES, lanes.is_uniform());
        prop_assert!(v2.len() == LANE_BYTES || v2.len() == FULL_BLOB_BYTES);
        let wm = decode_lane_watermarks(&fields("packed-v2", &epoch.to_string(), v2.clone())).unwrap();
        prop_assert_eq!(&wm.lanes, &lanes);
        prop_assert_eq!(wm.epoch, epoch);
        // re-encoding what we read is a fixed point
        prop_assert_eq!(encode_packed_v2(&wm.lanes), v2);
        let v1 = encode_packed_v1(&lanes);
        prop_assert_eq!(v1.len(), FULL_BLOB_BYTES);
        let wm1 = decode_lane_watermarks(&fields("packed-v1", &epoch.to_string(), v1.clone())).unwrap();
        prop_assert_eq!(&wm1.lanes, &lanes);
        // a non-canonical (1216-byte uniform) v2 blob still reads the same
        let wm2 = decode_lane_watermarks(&fields("packed-v2", "0", v1)).unwrap();
        prop_assert_eq!(&wm2.lanes, &lanes);
    }

    #[test]
    fn decode_never_panics(blob in proptest::collection::vec(any::<u8>(), 0..1300), layout in "packed-v[12]", epoch in "[0-9]{0,3}") {
        let _ = decode_lane_watermarks(&fields(&layout, &epoch, blob));
    }
}
