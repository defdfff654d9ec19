//! Fuzzing support shared by the `cargo fuzz` target (`crates/store/fuzz`) and the corpus
//! replay test: arbitrary bytes turned into `wm:{s}` fields, and the codec's invariants
//! checked on whatever [`decode_lane_watermarks`] makes of them. Not part of the API.

use super::*;

/// Turns arbitrary bytes into hash fields: byte 0 picks how many fields (0..=4), then each
/// field is `[name len u8][name][value len u16 BE][value]` (truncated input ends early).
/// A name byte of `0xF0 | i` stands for the real field name number `i`, so the fuzzer
/// reaches deep checks quickly.
pub fn fields_from_input(data: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    let Some((&n, mut rest)) = data.split_first() else {
        return out;
    };
    for _ in 0..(n % 5) {
        let Some((&nl, r)) = rest.split_first() else {
            break;
        };
        let nl = (nl as usize).min(r.len());
        let (name, r) = r.split_at(nl);
        let name = match name {
            [b] if b & 0xF0 == 0xF0 => match b & 0x0F {
                0 => FIELD_LAYOUT.as_bytes().to_vec(),
                1 => FIELD_EPOCH.as_bytes().to_vec(),
                _ => FIELD_BLOB.as_bytes().to_vec(),
            },
            other => other.to_vec(),
        };
        if r.len() < 2 {
            out.push((name, Vec::new()));
            break;
        }
        let vl = (u16::from_be_bytes([r[0], r[1]]) as usize).min(r.len() - 2);
        out.push((name, r[2..2 + vl].to_vec()));
        rest = &r[2 + vl..];
    }
    out
}

/// Decodes and checks the codec's invariants; panics when one breaks. Returns the verdict
/// (`None`: accepted), so a corpus replay can count both outcomes.
///
/// Accepted: the fields read back as given (layout, canonical epoch, blob length), every
/// present lane keeps `W == W_recomputed >= W_floor` and every empty lane is zero, and the
/// lanes survive re-encoding in both layouts (packed-v2 canonical: 19 bytes exactly when
/// uniform; packed-v1: 1216 bytes). Refused: a known cause code, a lane (< 64) exactly for
/// the lane-level causes, and the same verdict when decoded again.
pub fn check(data: &[u8]) -> Option<(&'static str, Option<usize>)> {
    let fields = fields_from_input(data);
    let wm = match decode_lane_watermarks(&fields) {
        Ok(wm) => wm,
        Err(c) => {
            let (code, lane) = c.verdict();
            assert_eq!(code.parse::<CorruptCode>(), Ok(c.code()), "{c}");
            let lane_level = c.code().is_lane_level();
            assert_eq!(lane.is_some(), lane_level, "{c}");
            assert!(lane.is_none_or(|l| l < LANES), "{c}");
            assert_eq!(
                decode_lane_watermarks(&fields).map(|_| ()),
                Err(c.clone()),
                "the verdict is stable"
            );
            return Some((code, lane));
        }
    };
    let field = |name: &str| -> &[u8] {
        &fields
            .iter()
            .find(|(k, _)| k == name.as_bytes())
            .expect("an accepted watermark has every field")
            .1
    };
    assert_eq!(field(FIELD_LAYOUT), wm.layout.as_str().as_bytes());
    assert_eq!(field(FIELD_EPOCH), wm.epoch.to_string().as_bytes());
    assert_eq!(field(FIELD_BLOB).len(), wm.blob_len);
    for (l, r) in wm.lanes.0.iter().enumerate() {
        if r.present {
            assert!(r.w == r.w_recomputed && r.w >= r.w_floor, "lane {l}: {r:?}");
        } else {
            assert_eq!(*r, LaneRecord::EMPTY, "lane {l}");
        }
    }
    let v2 = encode_packed_v2(&wm.lanes);
    assert_eq!(v2.len() == LANE_BYTES, wm.lanes.is_uniform());
    let v1 = encode_packed_v1(&wm.lanes);
    assert_eq!(v1.len(), FULL_BLOB_BYTES);
    for (layout, blob) in [(Layout::PackedV2, v2), (Layout::PackedV1, v1)] {
        let again = decode_lane_watermarks(&[
            (FIELD_LAYOUT.as_bytes(), layout.as_str().as_bytes()),
            (FIELD_EPOCH.as_bytes(), wm.epoch.to_string().as_bytes()),
            (FIELD_BLOB.as_bytes(), blob.as_slice()),
        ])
        .expect("a re-encoding decodes");
        assert_eq!(again.lanes, wm.lanes, "{layout:?} re-encoding");
    }
    None
}
