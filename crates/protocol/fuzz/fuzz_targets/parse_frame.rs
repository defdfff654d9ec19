//! Fuzz target: `parse_client_frame` (and the HTTP body parsers) on arbitrary input must never
//! panic, and every accepted frame must survive a serialise/parse round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidemark_protocol::{parse_ack_request, parse_client_frame, parse_send_request, Limits};

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let _ = parse_send_request(data, &limits);
    let _ = parse_ack_request(data, &limits);
    // WebSocket text frames are UTF-8 by definition; the transport rejects anything else.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_client_frame(text, &limits) {
        Ok(frame) => {
            let again = parse_client_frame(&frame.to_json(), &limits)
                .expect("a frame the parser accepted must re-parse");
            assert_eq!(again, frame);
        }
        Err(e) => {
            assert_eq!(e.code(), e.error_code().as_str());
            if let Some(id) = e.id() {
                assert!(!id.is_empty() && id.len() <= limits.max_id_bytes);
            }
        }
    }
});
