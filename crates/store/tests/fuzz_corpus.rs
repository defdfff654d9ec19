//! Replays the committed `cargo fuzz` corpus of `decode_lane_watermarks` through the fuzz
//! target's own checks (`watermark::fuzzing::check`: accepted watermarks read back as given and
//! re-encode canonically, refused ones carry a known cause code and lane), and checks that the
//! corpus reaches both outcomes and the named seeds get their documented verdicts.

use std::collections::BTreeSet;

use tidemark_store::redis::watermark::fuzzing::check;

#[test]
fn corpus_replays_through_the_targets_checks() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/decode_lane_watermarks"
    );
    let (mut n, mut accepted) = (0, 0);
    let mut codes = BTreeSet::new();
    for entry in std::fs::read_dir(dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        match check(&std::fs::read(&path).unwrap()) {
            None => accepted += 1,
            Some((code, _)) => {
                codes.insert(code);
            }
        }
        n += 1;
    }
    assert!(n >= 10, "corpus has only {n} files");
    // both outcomes are reached, so both sets of checks ran; and most causes
    assert!(accepted >= 3, "{accepted} of {n} accepted");
    assert!(codes.len() >= 5, "causes reached: {codes:?}");
}

#[test]
fn seed_format_reaches_the_decoder() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/decode_lane_watermarks/"
    );
    let verdict = |name: &str| check(&std::fs::read(format!("{dir}{name}")).unwrap());
    assert_eq!(verdict("v2_uniform"), None);
    assert_eq!(verdict("v1_full"), None);
    assert_eq!(verdict("mismatch"), Some(("w_mismatch", Some(0))));
    assert_eq!(verdict("lane63_bad"), Some(("w_below_floor", Some(63))));
    assert_eq!(verdict("four_fields"), Some(("field_count", None)));
}
