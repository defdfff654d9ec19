//! Replays the committed fuzz seed corpus (`fuzz/corpus/parse_frame/`) through the fuzz
//! target's own checks (`tidemark_protocol::fuzzing::check`: no panic, round trips of every
//! accepted input, consistent error codes and echoed ids), under the default limits and under
//! small ones, so the corpus is exercised by plain `cargo test`, without nightly or
//! cargo-fuzz. Seeds named `valid_*` must be accepted as frames and `hostile_*` refused with
//! the code (and echoed id) the protocol documents for them.

use std::fs;
use std::path::Path;

use tidemark_protocol::fuzzing::check_all_limits;
use tidemark_protocol::{parse_client_frame, Limits};

/// The documented refusal of each hostile seed: (code, echoed client id).
fn expected_refusal(name: &str) -> Option<(&'static str, Option<&'static str>)> {
    let c1 = Some("c-1");
    Some(match name.split('.').next()? {
        "hostile_array" => ("bad_json", None),
        "hostile_body_too_large" => ("body_too_large", c1),
        "hostile_deep_nesting" => ("bad_json", None),
        "hostile_dup_recipient" => ("bad_recipient", c1),
        "hostile_empty_id" => ("bad_id", None),
        "hostile_empty_recipient" => ("bad_recipient", c1),
        "hostile_lone_surrogate" => ("bad_json", None),
        "hostile_long_recipient" => ("bad_recipient", c1),
        "hostile_missing_type" => ("bad_request", None),
        "hostile_not_json" => ("bad_json", None),
        "hostile_seq_2pow48" => ("seq_out_of_range", None),
        "hostile_seq_exponent" => ("seq_out_of_range", None), // a number above 2^48-1
        "hostile_seq_float" => ("bad_request", None),
        "hostile_seq_negative" => ("seq_out_of_range", None),
        "hostile_seq_string" => ("bad_request", None),
        "hostile_to_numbers" => ("bad_request", c1),
        "hostile_to_string" => ("bad_request", c1),
        "hostile_too_many_recipients" => ("too_many_recipients", c1),
        "hostile_truncated" => ("bad_json", None),
        "hostile_unknown_type" => ("unknown_type", None),
        _ => return None,
    })
}

#[test]
fn replay_seed_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/parse_frame");
    let limits = Limits::default();
    let mut files = 0;
    let (mut valid, mut hostile) = (0, 0);
    let (mut accepted, mut refused) = (0, 0);
    for entry in fs::read_dir(&dir).expect("seed corpus directory exists") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let data = fs::read(&path).unwrap();
        files += 1;
        let seen = check_all_limits(&data).unwrap_or_else(|broken| panic!("{name}: {broken}"));
        if seen.frame_accepted {
            accepted += 1;
        } else {
            refused += 1;
        }
        if name.starts_with("valid_") {
            valid += 1;
            assert!(seen.frame_accepted, "{name}: rejected");
        } else if name.starts_with("hostile_") {
            hostile += 1;
            let text = String::from_utf8_lossy(&data);
            let e = parse_client_frame(&text, &limits).expect_err(&name);
            let (code, id) =
                expected_refusal(&name).unwrap_or_else(|| panic!("{name}: no expected code"));
            assert_eq!((e.code(), e.id()), (code, id), "{name}: {e}");
        }
    }
    assert!(files >= 10, "seed corpus has only {files} files");
    assert!(
        valid >= 5 && hostile >= 5,
        "{valid} valid, {hostile} hostile seeds"
    );
    // the generated part of the corpus reaches both outcomes, so both sets of checks ran
    assert!(
        accepted >= 50 && refused >= 50,
        "{accepted} accepted, {refused} refused"
    );
}
