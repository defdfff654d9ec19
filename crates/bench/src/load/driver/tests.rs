//! Unit tests of the driver's pure parts: recipient choice and the ack-rate window.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::time::Instant;

use super::schedule::{pick, Frames};
use super::shared::Acks;

#[test]
fn picks_distinct_recipients_never_the_sender() {
    let mut rng = StdRng::seed_from_u64(7);
    for from in 0..5 {
        for k in 1..5 {
            let mut v = pick(&mut rng, 5, from, k);
            assert_eq!(v.len(), k);
            assert!(v.iter().all(|&r| r != from && r < 5));
            v.sort_unstable();
            v.dedup();
            assert_eq!(v.len(), k);
        }
    }
}

/// Acks that arrive during the drain grace are not throughput: a run whose service fell
/// behind and caught up after sending stopped must not report the offered rate.
#[test]
fn acks_after_sending_do_not_count_towards_the_rate() {
    let t0 = Instant::now();
    let duration = Duration::from_secs(10);
    let acks = Acks::new(t0 + duration);
    acks.arrived(t0 + Duration::from_secs(1));
    acks.arrived(t0 + duration); // the last instant of sending still counts
    acks.arrived(t0 + duration + Duration::from_millis(1));
    acks.arrived(t0 + duration + Duration::from_secs(4));
    let (total, while_sending, per_s) = acks.report(duration.as_secs_f64());
    assert_eq!(total, 4, "every ack of the window is in send_acked");
    assert_eq!(
        while_sending, 2,
        "only the acks that arrived by t0 + duration"
    );
    assert_eq!(
        per_s, 0.2,
        "2 acks over 10 s, not 4 (acks of the drain grace)"
    );

    // Everything acked, but only after sending stopped: nothing was acked while sending.
    let late = Acks::new(t0 + duration);
    for k in 1..=100 {
        late.arrived(t0 + duration + Duration::from_millis(k));
    }
    assert_eq!(late.report(duration.as_secs_f64()), (100, 0, 0.0));
}

#[test]
fn same_seed_same_traffic() {
    let draw = |seed| {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..100)
            .map(|i| pick(&mut rng, 50, i % 50, 2))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(3), draw(3));
    assert_ne!(draw(3), draw(4));
}

/// A send frame written by hand is the protocol's `send` frame, names quoted as JSON.
#[test]
fn send_frames_are_the_protocols() {
    let users: Vec<String> = ["lg1-0", "lg1-1", "we\"ird\\name"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let frames = Frames::new(&users);
    let text = frames.send(42, &[2, 1]);
    let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
    assert_eq!(
        v,
        serde_json::json!({"type": "send", "id": "m42", "to": ["we\"ird\\name", "lg1-1"], "body": "i:42"})
    );
    assert_eq!(
        frames.send(0, &[0]),
        r#"{"type":"send","id":"m0","to":["lg1-0"],"body":"i:0"}"#
    );
}
