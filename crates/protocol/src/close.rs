//! WebSocket close codes the gateway sends, and what a client should do after each.
//!
//! The standard codes (RFC 6455, 1000–1011) keep their meaning; the 4000 range (reserved for
//! applications) carries Tidemark's own reasons. Like [`ErrorCode`](crate::ErrorCode)s they
//! are part of the protocol: a code never changes meaning once published, and
//! `docs/protocol.md` lists exactly these (a test checks it). Nothing already committed or
//! materialised is lost by any close: the mailbox still holds every entry, and the next
//! connection resumes after the acked cursor.

use std::fmt;

/// Why the server closed a WebSocket connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    /// 1000: the client closed, or the server ends a connection that is done.
    Normal,
    /// 1001: the server is shutting down; reconnect (to another gateway) after a backoff.
    GoingAway,
    /// 1002: the client broke the WebSocket protocol (an unmasked frame, reserved bits, a bad
    /// opcode): after a `bad_request` error frame. A client bug: fix it before reconnecting.
    ProtocolError,
    /// 1007: a text frame that is not valid UTF-8 (after a `bad_request` error frame). A
    /// client bug: fix it before reconnecting.
    InvalidPayload,
    /// 1009: a frame far above the frame limit; the connection is cut.
    MessageTooBig,
    /// 1011: an unexpected server failure; reconnect after a backoff.
    InternalError,
    /// 4001: the connection's token passed its `exp`; reconnect with a new token.
    TokenExpired,
    /// 4002: nothing (not even a pong) arrived from the client within the idle timeout.
    IdleTimeout,
    /// 4003: the client did not read: frames waited for room in its outbound budget longer
    /// than the grace period. Reconnect and read faster.
    SlowConsumer,
}

impl CloseCode {
    /// Every code, in documentation order.
    pub const ALL: [CloseCode; 9] = [
        CloseCode::Normal,
        CloseCode::GoingAway,
        CloseCode::ProtocolError,
        CloseCode::InvalidPayload,
        CloseCode::MessageTooBig,
        CloseCode::InternalError,
        CloseCode::TokenExpired,
        CloseCode::IdleTimeout,
        CloseCode::SlowConsumer,
    ];

    /// The numeric code of the close frame.
    pub fn as_u16(self) -> u16 {
        match self {
            CloseCode::Normal => 1000,
            CloseCode::GoingAway => 1001,
            CloseCode::ProtocolError => 1002,
            CloseCode::InvalidPayload => 1007,
            CloseCode::MessageTooBig => 1009,
            CloseCode::InternalError => 1011,
            CloseCode::TokenExpired => 4001,
            CloseCode::IdleTimeout => 4002,
            CloseCode::SlowConsumer => 4003,
        }
    }

    /// A stable snake_case name (metrics labels, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            CloseCode::Normal => "normal",
            CloseCode::GoingAway => "going_away",
            CloseCode::ProtocolError => "protocol_error",
            CloseCode::InvalidPayload => "invalid_payload",
            CloseCode::MessageTooBig => "message_too_big",
            CloseCode::InternalError => "internal_error",
            CloseCode::TokenExpired => "token_expired",
            CloseCode::IdleTimeout => "idle_timeout",
            CloseCode::SlowConsumer => "slow_consumer",
        }
    }

    /// The close frame's reason text (for humans; clients act on the number).
    pub fn reason(self) -> &'static str {
        match self {
            CloseCode::Normal => "",
            CloseCode::GoingAway => "server shutting down",
            CloseCode::ProtocolError => "websocket protocol violation",
            CloseCode::InvalidPayload => "text frame is not valid UTF-8",
            CloseCode::MessageTooBig => "frame too large",
            CloseCode::InternalError => "internal error; reconnect",
            CloseCode::TokenExpired => "token expired",
            CloseCode::IdleTimeout => "no pong within the idle timeout",
            CloseCode::SlowConsumer => "client too slow to read",
        }
    }

    /// The code with this number, if it is one of ours.
    pub fn from_u16(n: u16) -> Option<CloseCode> {
        CloseCode::ALL.into_iter().find(|c| c.as_u16() == n)
    }
}

impl fmt::Display for CloseCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.as_u16(), self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        let mut nums = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for c in CloseCode::ALL {
            assert!(nums.insert(c.as_u16()), "duplicate {c}");
            assert!(names.insert(c.as_str()), "duplicate {c}");
            assert_eq!(CloseCode::from_u16(c.as_u16()), Some(c));
            // RFC 6455: a reason is at most 123 bytes.
            assert!(c.reason().len() <= 123);
        }
        assert_eq!(CloseCode::from_u16(4999), None);
    }
}
