//! Replays the committed fuzz seed corpus (`fuzz/corpus/parse_frame/`) through the parsers, so
//! the seeds are exercised by plain `cargo test`, without nightly or cargo-fuzz.
//!
//! Every file must parse without panicking. Seeds named `valid_*` must be accepted and
//! `hostile_*` rejected; other files (e.g. inputs a fuzzing run added) only must not panic.

use std::fs;
use std::path::Path;

use tidemark_protocol::{parse_ack_request, parse_client_frame, parse_send_request, Limits};

#[test]
fn replay_seed_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/parse_frame");
    let limits = Limits::default();
    let mut files = 0;
    let (mut valid, mut hostile) = (0, 0);
    for entry in fs::read_dir(&dir).expect("seed corpus directory exists") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let data = fs::read(&path).unwrap();
        files += 1;

        let _ = parse_send_request(&data, &limits);
        let _ = parse_ack_request(&data, &limits);
        let Ok(text) = std::str::from_utf8(&data) else {
            continue;
        };
        let result = parse_client_frame(text, &limits);
        if name.starts_with("valid_") {
            valid += 1;
            let frame = result.unwrap_or_else(|e| panic!("{name}: rejected: {e}"));
            assert_eq!(
                parse_client_frame(&frame.to_json(), &limits).as_ref(),
                Ok(&frame),
                "{name}: round trip"
            );
        } else if name.starts_with("hostile_") {
            hostile += 1;
            assert!(result.is_err(), "{name}: accepted: {result:?}");
        }
    }
    assert!(files >= 10, "seed corpus has only {files} files");
    assert!(
        valid >= 5 && hostile >= 5,
        "{valid} valid, {hostile} hostile seeds"
    );
}
