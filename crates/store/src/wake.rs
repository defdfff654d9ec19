//! Wake-up hints on `wake:{s}` (Pub/Sub). A hint is never the data path: it only tells
//! gateways which mailboxes may have new entries; a reader always re-reads W and the mailbox.
//!
//! ```text
//! payload = <min present W, decimal> '\n' { <len u8 (1..=128)> <recipient id bytes> }*
//! ```
//! Length-prefixed ids, so any valid id (even one holding '\n') can be named.

use crate::redis::dlog::{decode_recipients, encode_recipients};

/// Builds a hint payload.
pub fn encode(min_w: u64, recipients: &[&str]) -> Vec<u8> {
    let mut out = min_w.to_string().into_bytes();
    out.push(b'\n');
    out.extend_from_slice(&encode_recipients(recipients));
    out
}

/// Parses a hint payload; `None` when malformed.
pub fn decode(payload: &[u8]) -> Option<(u64, Vec<String>)> {
    let nl = payload.iter().position(|&b| b == b'\n')?;
    let w = std::str::from_utf8(&payload[..nl]).ok()?.parse().ok()?;
    Some((w, decode_recipients(&payload[nl + 1..])?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip_with_newline_in_an_id() {
        let p = super::encode(17, &["alice", "line\nbreak"]);
        assert_eq!(
            super::decode(&p),
            Some((17, vec!["alice".to_string(), "line\nbreak".to_string()]))
        );
        assert_eq!(super::decode(b"x"), None);
        assert_eq!(super::decode(b"1\n"), Some((1, vec![])));
    }
}
