//! cargo fuzz target: `decode_lane_watermarks` on arbitrary hash fields must never panic,
//! whatever it accepts must read back as given and re-encode canonically, and whatever it
//! refuses must carry a known cause code (see `watermark::fuzzing::check`, which the corpus
//! replay `tests/fuzz_corpus.rs` runs too).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = tidemark_store::redis::watermark::fuzzing::check(data);
});
