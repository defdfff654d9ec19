//! cargo fuzz target: `decode_lane_watermarks` on arbitrary hash fields must never panic, and
//! whatever it accepts must re-encode canonically (see `watermark::fuzzing::check`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tidemark_store::redis::watermark::fuzzing::check(data);
});
