//! Unit tests of the Lua benchmark's pure parts: `INFO` parsing, the median, the workload's
//! entries, labels and reply checks, and the error codes.

use redis::Value;

use super::items::{entry, items, BASE, ENTRY_BYTES};
use super::measure::{info_field, median, parse_evalsha_stats};
use super::Error;

#[test]
fn parses_commandstats() {
    let info = "# Commandstats\r\n\
        cmdstat_config:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_evalsha:calls=500,usec=2750,usec_per_call=5.50,rejected_calls=0,failed_calls=2\r\n";
    assert_eq!(parse_evalsha_stats(info), Some((500, 2750, 2)));
    assert_eq!(parse_evalsha_stats("# Commandstats\r\n"), None);
}

#[test]
fn reads_info_field() {
    let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:0\r\n";
    assert_eq!(info_field(info, "redis_version").as_deref(), Some("7.0.15"));
    assert_eq!(info_field(info, "redis_mode"), None);
}

#[test]
fn median_odd_even() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    assert!(median(&[]).is_nan());
}

#[test]
fn entries_are_64_bytes_and_unique() {
    assert_eq!(entry(BASE + 1).len(), ENTRY_BYTES);
    assert_ne!(entry(BASE + 1), entry(BASE + 2));
}

#[test]
fn error_codes_are_stable() {
    let e = Error::InvalidOptions("x".into());
    assert_eq!(e.code(), "invalid_options");
    let e = Error::NotApplied {
        item: "a".into(),
        call: 1,
        expected: "b".into(),
        reply: "c".into(),
    };
    assert_eq!(e.code(), "not_applied");
    assert_eq!(Error::KeysExist { keys: vec![] }.code(), "keys_exist");
}

#[test]
fn replies_not_on_the_common_path_are_refused() {
    let items = items();
    let hot = items
        .iter()
        .find(|i| i.label == "materialize_fresh_single_recipient/packed-v2")
        .unwrap();
    let applied = Value::Int((BASE + 1) as i64);
    assert!(hot.check(0, &applied).is_ok());
    let not_uniform = Value::Array(vec![Value::Int(4)]);
    let e = hot.check(0, &not_uniform).unwrap_err();
    assert_eq!(e.code(), "not_applied");
    let gap = Value::Array(vec![Value::Int(2), Value::Int(BASE as i64)]);
    assert!(hot.check(0, &gap).is_err());
}

#[test]
fn every_item_has_a_distinct_label_and_the_ten_scripts() {
    let items = items();
    let mut labels: Vec<_> = items.iter().map(|i| i.label.clone()).collect();
    labels.sort();
    labels.dedup();
    assert_eq!(labels.len(), items.len());
    let scripts = labels.iter().filter(|l| l.contains('/')).count();
    assert_eq!(scripts, 10);
}
