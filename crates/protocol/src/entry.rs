//! The mailbox entry: one message as stored in a recipient's mailbox in the mailbox Redis, a
//! member of the mailbox's sorted set whose score is the entry's seq.
//!
//! ```text
//!  0               6                       14      15          15+n
//!  +---------------+-----------------------+-------+-----------+----------------+
//!  | seq           | sent_at_us            | n     | from      | body           |
//!  | u48 BE (6 B)  | u64 BE (8 B)          | u8    | n bytes   | rest (0+ B)    |
//!  +---------------+-----------------------+-------+-----------+----------------+
//!  n = from_len, 1..=128; from and body are UTF-8.
//! ```
//!
//! The seq prefix makes every member unique within a mailbox (a sorted set would otherwise
//! merge two identical messages from the same sender at the same microsecond) and makes
//! re-writing the same entry idempotent: the member is a pure function of the entry. The
//! binary form is compact, needs no escaping, and is decoded only by Rust.

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::{MAX_SEQ, MAX_USER_ID_BYTES};

/// Bytes before the sender: seq (6) + sent_at_us (8) + from_len (1).
pub const ENTRY_HEADER_BYTES: usize = 15;

/// One mailbox entry.
///
/// The same type is what a client sees: the `deliver` frame and the entries of
/// `GET /v1/mailbox` serialise it as `{"seq":…,"from":…,"body":…,"sent_at_us":…}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// MailboxSeq: the dispatch-log offset of the message in the recipient's shard (u48).
    pub seq: u64,
    /// The sender's user id.
    pub from: String,
    /// The message body.
    pub body: String,
    /// When the gateway accepted the send, unix microseconds.
    pub sent_at_us: u64,
}

impl Entry {
    /// The stored form of this entry; see [`encode_entry`] (same panics).
    pub fn encode(&self) -> Vec<u8> {
        encode_entry(self.seq, self.sent_at_us, &self.from, &self.body)
    }
}

/// Encodes an entry into its stored form.
///
/// # Panics
///
/// If `seq > MAX_SEQ` or `from` is not 1..=128 bytes. Both come from a committed log record,
/// where they were already validated; anything else is a caller bug. Only the length is
/// checked, not the rest of [`is_valid_user_id`](crate::is_valid_user_id): a sender committed
/// before control characters were refused is still stored.
pub fn encode_entry(seq: u64, sent_at_us: u64, from: &str, body: &str) -> Vec<u8> {
    assert!(seq <= MAX_SEQ, "entry seq {seq} exceeds u48");
    assert!(
        !from.is_empty() && from.len() <= MAX_USER_ID_BYTES,
        "entry sender must be 1..={MAX_USER_ID_BYTES} bytes, got {}",
        from.len()
    );
    let mut out = Vec::with_capacity(ENTRY_HEADER_BYTES + from.len() + body.len());
    out.extend_from_slice(&seq.to_be_bytes()[2..]);
    out.extend_from_slice(&sent_at_us.to_be_bytes());
    // from.len() <= 128 was asserted above.
    out.push(from.len() as u8);
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(body.as_bytes());
    out
}

/// The fixed fields and the sender of a stored entry, borrowed from its bytes, with the body
/// left as bytes: for readers that only need to know whose entry it is (`tidemark trace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryHead<'a> {
    /// MailboxSeq (u48).
    pub seq: u64,
    /// When the gateway accepted the send, unix microseconds.
    pub sent_at_us: u64,
    /// The sender's user id.
    pub from: &'a str,
    /// The body, not checked for UTF-8.
    pub body: &'a [u8],
}

/// Decodes the head of a stored entry: everything [`decode_entry`] checks except that the body
/// is UTF-8. Any truncation, a sender length outside 1..=128, or a non-UTF-8 sender is
/// [`Error::BadEntry`]. Never panics.
pub fn decode_entry_head(bytes: &[u8]) -> Result<EntryHead<'_>, Error> {
    let bad = |reason| Err(Error::BadEntry { reason });
    let Some((header, rest)) = bytes.split_first_chunk::<ENTRY_HEADER_BYTES>() else {
        return bad("shorter than the 15-byte header");
    };
    let mut seq = [0u8; 8];
    seq[2..].copy_from_slice(&header[..6]);
    let mut sent_at_us = [0u8; 8];
    sent_at_us.copy_from_slice(&header[6..14]);
    let from_len = usize::from(header[14]);
    if from_len == 0 || from_len > MAX_USER_ID_BYTES {
        return bad("sender length outside 1..=128");
    }
    let Some((from, body)) = rest.split_at_checked(from_len) else {
        return bad("truncated sender");
    };
    let Ok(from) = std::str::from_utf8(from) else {
        return bad("sender is not UTF-8");
    };
    Ok(EntryHead {
        seq: u64::from_be_bytes(seq),
        sent_at_us: u64::from_be_bytes(sent_at_us),
        from,
        body,
    })
}

/// Decodes a stored entry. Any truncation, a sender length outside 1..=128, or non-UTF-8
/// sender or body is [`Error::BadEntry`] (code `bad_entry`). Never panics.
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, Error> {
    let head = decode_entry_head(bytes)?;
    let Ok(body) = std::str::from_utf8(head.body) else {
        return Err(Error::BadEntry {
            reason: "body is not UTF-8",
        });
    };
    Ok(Entry {
        seq: head.seq,
        from: head.from.to_owned(),
        body: body.to_owned(),
        sent_at_us: head.sent_at_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_is_exact() {
        let bytes = encode_entry(0x0102_0304_0506, 0x1112_1314_1516_1718, "al", "hi!");
        assert_eq!(
            bytes,
            [
                1, 2, 3, 4, 5, 6, // seq
                0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, // sent_at_us
                2, b'a', b'l', // from
                b'h', b'i', b'!', // body
            ]
        );
        let e = decode_entry(&bytes).unwrap();
        assert_eq!(
            e,
            Entry {
                seq: 0x0102_0304_0506,
                from: "al".into(),
                body: "hi!".into(),
                sent_at_us: 0x1112_1314_1516_1718
            }
        );
        assert_eq!(e.encode(), bytes);
    }

    #[test]
    fn edges_round_trip() {
        for (seq, from, body) in [
            (0, "a", ""),
            (MAX_SEQ, &*"f".repeat(128), "body"),
            (1, "Ünïcødé", "用户 \u{0} \n"),
        ] {
            let e = decode_entry(&encode_entry(seq, u64::MAX, from, body)).unwrap();
            assert_eq!((e.seq, e.from.as_str(), e.body.as_str()), (seq, from, body));
            assert_eq!(e.sent_at_us, u64::MAX);
        }
    }

    #[test]
    fn bad_entries() {
        let good = encode_entry(7, 8, "alice", "hi");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("header only partly", good[..14].to_vec()),
            ("no sender bytes", good[..15].to_vec()),
            ("truncated sender", good[..17].to_vec()),
            ("zero sender length", {
                let mut b = good.clone();
                b[14] = 0;
                b
            }),
            ("sender length 129", {
                let mut b = vec![0u8; 15 + 200];
                b[14] = 129;
                b
            }),
            ("sender not UTF-8", {
                let mut b = good.clone();
                b[15] = 0xff;
                b
            }),
            ("body not UTF-8", {
                let mut b = good.clone();
                b.push(0xc3);
                b
            }),
        ];
        for (name, bytes) in cases {
            let e = decode_entry(&bytes).unwrap_err();
            assert_eq!(e.code(), "bad_entry", "{name}");
        }
        // Exactly the header plus the sender, empty body: fine.
        assert_eq!(decode_entry(&good[..20]).unwrap().body, "");
    }

    #[test]
    fn head_decodes_without_the_body() {
        let mut bytes = encode_entry(258, 1_764_489_600_000_000, "alice", "hi");
        assert_eq!(
            decode_entry_head(&bytes).unwrap(),
            EntryHead {
                seq: 258,
                sent_at_us: 1_764_489_600_000_000,
                from: "alice",
                body: b"hi",
            }
        );
        // A body that is not UTF-8 spoils the entry, not its head.
        bytes.push(0xc3);
        assert_eq!(decode_entry(&bytes).unwrap_err().code(), "bad_entry");
        assert_eq!(decode_entry_head(&bytes).unwrap().from, "alice");
        // Truncated in the sender (5 bytes announced, 1 there): no head either.
        let e = decode_entry_head(&bytes[..16]).unwrap_err();
        assert_eq!(e.code(), "bad_entry");
    }

    #[test]
    #[should_panic(expected = "exceeds u48")]
    fn encode_refuses_seq_above_u48() {
        encode_entry(MAX_SEQ + 1, 0, "a", "");
    }

    #[test]
    #[should_panic(expected = "entry sender")]
    fn encode_refuses_empty_sender() {
        encode_entry(1, 0, "", "");
    }

    #[test]
    fn a_sender_committed_before_control_chars_were_refused_is_still_stored() {
        let bytes = encode_entry(7, 1, "old\u{1}user", "hi");
        assert_eq!(decode_entry(&bytes).unwrap().from, "old\u{1}user");
    }

    proptest! {
        #[test]
        fn round_trip(
            seq in 0..=MAX_SEQ,
            sent_at_us in any::<u64>(),
            from in "\\PC{1,40}",
            body in "\\PC{0,200}",
        ) {
            prop_assume!(from.len() <= MAX_USER_ID_BYTES);
            let bytes = encode_entry(seq, sent_at_us, &from, &body);
            prop_assert_eq!(bytes.len(), ENTRY_HEADER_BYTES + from.len() + body.len());
            let e = decode_entry(&bytes).unwrap();
            prop_assert_eq!(&e, &Entry { seq, from, body, sent_at_us });
            prop_assert_eq!(e.encode(), bytes);
        }

        /// The borrowed `deliver` frame is the owned one's text, for any entry (quotes,
        /// backslashes, control and non-ASCII characters included).
        #[test]
        fn deliver_json_is_the_frames_text(
            seq in 0..=MAX_SEQ,
            sent_at_us in any::<u64>(),
            from in "\\PC{1,40}|[\"\\\\\u{0}-\u{1f}a]{1,10}",
            body in "\\PC{0,200}|[\"\\\\\u{0}-\u{1f}\u{7f}é😀]{0,30}",
        ) {
            let e = Entry { seq, from, body, sent_at_us };
            prop_assert_eq!(
                crate::frames::deliver_json(e.seq, &e.from, &e.body, e.sent_at_us),
                crate::ServerFrame::Deliver(e.clone()).to_json()
            );
        }

        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(e) = decode_entry(&bytes) {
                // Whatever decodes re-encodes to the same bytes, and has the same head.
                let h = decode_entry_head(&bytes).unwrap();
                prop_assert_eq!((h.seq, h.sent_at_us, h.from), (e.seq, e.sent_at_us, &*e.from));
                prop_assert_eq!(e.encode(), bytes);
            }
        }

        #[test]
        fn decode_never_panics_near_valid(
            from_len in any::<u8>(),
            tail in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut bytes = vec![0u8; 14];
            bytes.push(from_len);
            bytes.extend_from_slice(&tail);
            let _ = decode_entry(&bytes);
        }
    }
}
