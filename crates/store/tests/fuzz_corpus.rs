//! Replays the committed `cargo fuzz` corpus of `decode_lane_watermarks` (and a generated seed
//! set) through the same check the fuzz target runs.

use tidemark_store::redis::watermark::fuzzing::check;

#[test]
fn corpus_replays_without_panic() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/decode_lane_watermarks"
    );
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        check(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 10, "corpus has only {n} files");
}

#[test]
fn seed_format_reaches_the_decoder() {
    use tidemark_store::redis::watermark::{decode_lane_watermarks, fuzzing::fields_from_input};
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/decode_lane_watermarks/"
    );
    let read = |name: &str| std::fs::read(format!("{dir}{name}")).unwrap();
    assert!(decode_lane_watermarks(&fields_from_input(&read("v2_uniform"))).is_ok());
    assert!(decode_lane_watermarks(&fields_from_input(&read("v1_full"))).is_ok());
    let verdict = |name: &str| {
        decode_lane_watermarks(&fields_from_input(&read(name)))
            .unwrap_err()
            .verdict()
    };
    assert_eq!(verdict("mismatch"), ("w_mismatch", Some(0)));
    assert_eq!(verdict("lane63_bad"), ("w_below_floor", Some(63)));
    assert_eq!(verdict("four_fields"), ("field_count", None));
}
