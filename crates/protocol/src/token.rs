//! Bearer tokens: a user id and an expiry, signed with HMAC-SHA256 under a server secret.
//!
//! ```text
//! v1.<payload_b64>.<mac_b64>
//!   payload_b64 = base64url-nopad( {"u":"alice","exp":1764489600} )   exp: unix seconds
//!               | base64url-nopad( {"u":"ops","exp":1764489600,"admin":true} )   an admin token
//!   mac_b64     = base64url-nopad( HMAC-SHA256(secret, "v1." + payload_b64) )
//! ```
//!
//! [`verify`] checks the MAC first (constant time, via `hmac`'s `verify_slice`), and only then
//! reads the payload, so nothing unsigned is ever trusted. A token is valid while
//! `now < exp`. The user must be a valid user id (1..=128 bytes, no control character).
//!
//! An **admin** token ([`sign_admin`], `tidemark token --admin`) also carries `"admin":true`:
//! it may read the operator's endpoints (`GET /v1/admin/status`); everywhere else it is the
//! token of its user. `admin` is written only when true, and a signed payload with any other
//! value for it (`false`, a string) is malformed: there is one form of each token.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::ErrorCode;
use crate::is_valid_user_id;

type HmacSha256 = Hmac<Sha256>;

const PREFIX: &str = "v1.";

/// Longest token [`verify`] looks at; a valid token is far shorter (under 300 bytes).
pub const MAX_TOKEN_BYTES: usize = 1024;

/// The one message a client is shown for a token that does not verify, whatever the reason.
pub const INVALID_TOKEN_MESSAGE: &str = "invalid token";

/// The message a client is shown for a correctly signed token whose expiry has passed.
pub const EXPIRED_TOKEN_MESSAGE: &str = "token expired; get a new one";

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The authenticated user id.
    pub user: String,
    /// Unix seconds at which the token stops being valid.
    pub expires_at_unix: u64,
    /// The token may read the operator's endpoints (`"admin":true` in its payload).
    pub admin: bool,
}

/// Why a token was rejected.
///
/// Typed so the server can log the real reason (`code()`, `Display`) while showing the client
/// only `unauthorized` or `token_expired` (`error_code()`) with a fixed message
/// (`client_message()`): a client is never told whether a forged token was malformed or
/// merely mis-signed. `Display` carries that detail and is for logs only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not of the form `v1.<b64>.<b64>`, bad base64, too long, or a signed payload that is not
    /// `{"u":<valid user id>,"exp":<u64>}`. Code `token_malformed`.
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    /// The MAC does not match (forged, tampered, or signed with another secret). Code
    /// `token_bad_signature`.
    #[error("token signature does not verify")]
    BadSignature,
    /// Correctly signed but `now >= exp`. Code `token_expired`.
    #[error("token expired at {expires_at_unix} (now {now_unix})")]
    Expired {
        /// The token's `exp`.
        expires_at_unix: u64,
        /// The time it was checked at.
        now_unix: u64,
    },
}

impl TokenError {
    /// The stable code string (for logs and metrics).
    pub fn code(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) => "token_malformed",
            TokenError::BadSignature => "token_bad_signature",
            TokenError::Expired { .. } => "token_expired",
        }
    }

    /// The message the client sees: [`INVALID_TOKEN_MESSAGE`] for every token that does not
    /// verify (malformed, mis-signed, tampered, too long), [`EXPIRED_TOKEN_MESSAGE`] for a
    /// correctly signed, expired one. Never the detail of `Display`.
    pub fn client_message(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) | TokenError::BadSignature => INVALID_TOKEN_MESSAGE,
            TokenError::Expired { .. } => EXPIRED_TOKEN_MESSAGE,
        }
    }

    /// The code the client sees: `token_expired` for an expired token, else `unauthorized`.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            TokenError::Malformed(_) | TokenError::BadSignature => ErrorCode::Unauthorized,
            TokenError::Expired { .. } => ErrorCode::TokenExpired,
        }
    }
}

/// The signed payload, serialised as `{"u":…,"exp":…}` or `{"u":…,"exp":…,"admin":true}`
/// (field order fixed).
#[derive(Serialize)]
struct Payload<'a> {
    u: &'a str,
    exp: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    admin: bool,
}

/// The payload as read back: unknown and duplicate fields are refused by serde's derive.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PayloadIn {
    u: String,
    exp: u64,
    /// `Some` whenever the field is present, `null` included (a plain `Option` reads `null` as
    /// absent).
    #[serde(default, deserialize_with = "present")]
    admin: Option<serde_json::Value>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// Reads a payload: exactly one JSON object with a string `u`, an unsigned integer `exp` and,
/// for an admin token, `"admin":true` (serde would also accept the array form
/// `["alice",123]`, hence the object check). Returns (user, exp, admin).
fn parse_payload(json: &[u8]) -> Option<(String, u64, bool)> {
    let first = json
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))?;
    if *first != b'{' {
        return None;
    }
    let p = serde_json::from_slice::<PayloadIn>(json).ok()?;
    let admin = match p.admin {
        None => false,
        Some(serde_json::Value::Bool(true)) => true,
        // never signed by `sign`: one form per token
        Some(_) => return None,
    };
    Some((p.u, p.exp, admin))
}

fn mac(secret: &[u8]) -> HmacSha256 {
    // HMAC is defined for keys of any length; new_from_slice never fails for it.
    <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length")
}

/// Signs a token for `user`, valid until `expires_at_unix` (unix seconds, exclusive).
///
/// # Panics
///
/// If `user` is not a valid user id (1..=128 bytes, no control character; see
/// [`crate::is_valid_user_id`]): such a token could never verify, so issuing one is a bug in
/// the caller.
pub fn sign(secret: &[u8], user: &str, expires_at_unix: u64) -> String {
    sign_claims(secret, user, expires_at_unix, false)
}

/// Signs an **admin** token for `user` (`"admin":true`), valid until `expires_at_unix`: it may
/// also read the operator's endpoints (`GET /v1/admin/status`).
///
/// # Panics
///
/// As [`sign`], if `user` is not a valid user id.
pub fn sign_admin(secret: &[u8], user: &str, expires_at_unix: u64) -> String {
    sign_claims(secret, user, expires_at_unix, true)
}

fn sign_claims(secret: &[u8], user: &str, expires_at_unix: u64, admin: bool) -> String {
    assert!(
        is_valid_user_id(user),
        "token user must be 1..=128 bytes without control characters ({} bytes given)",
        user.len()
    );
    let payload = Payload {
        u: user,
        exp: expires_at_unix,
        admin,
    };
    // Serialising a str and a u64 cannot fail.
    let json = serde_json::to_vec(&payload).expect("token payload serialises");
    let mut token = String::with_capacity(64 + 2 * json.len());
    token.push_str(PREFIX);
    URL_SAFE_NO_PAD.encode_string(&json, &mut token);
    let mut m = mac(secret);
    m.update(token.as_bytes());
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(m.finalize().into_bytes(), &mut token);
    token
}

/// Verifies `token` under `secret` at time `now_unix` and returns its claims.
///
/// Order: shape and length (`Malformed`), MAC in constant time (`BadSignature`), payload
/// (`Malformed`), expiry (`Expired` when `now_unix >= exp`). Never panics.
pub fn verify(secret: &[u8], token: &str, now_unix: u64) -> Result<Claims, TokenError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Malformed("too long"));
    }
    let Some(rest) = token.strip_prefix(PREFIX) else {
        return Err(TokenError::Malformed("not a v1 token"));
    };
    let Some((payload_b64, mac_b64)) = rest.split_once('.') else {
        return Err(TokenError::Malformed("missing signature"));
    };
    if payload_b64.contains('.') || mac_b64.contains('.') {
        return Err(TokenError::Malformed("too many parts"));
    }
    let Ok(tag) = URL_SAFE_NO_PAD.decode(mac_b64) else {
        return Err(TokenError::Malformed("signature is not base64url"));
    };
    let signed = &token[..PREFIX.len() + payload_b64.len()];
    let mut m = mac(secret);
    m.update(signed.as_bytes());
    m.verify_slice(&tag).map_err(|_| TokenError::BadSignature)?;

    let Ok(json) = URL_SAFE_NO_PAD.decode(payload_b64) else {
        return Err(TokenError::Malformed("payload is not base64url"));
    };
    let Some((user, exp, admin)) = parse_payload(&json) else {
        return Err(TokenError::Malformed(
            "payload is not {\"u\":…,\"exp\":…} (or with \"admin\":true)",
        ));
    };
    if !is_valid_user_id(&user) {
        return Err(TokenError::Malformed(
            "user must be 1..=128 bytes without control characters",
        ));
    }
    if now_unix >= exp {
        return Err(TokenError::Expired {
            expires_at_unix: exp,
            now_unix,
        });
    }
    Ok(Claims {
        user,
        expires_at_unix: exp,
        admin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECRET: &[u8] = b"tidemark test secret";
    const NOW: u64 = 1_764_489_600;

    /// Signs an arbitrary payload text (for crafting tokens `sign` refuses to make).
    fn sign_raw(secret: &[u8], payload_json: &str) -> String {
        let head = format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(payload_json));
        let mut m = mac(secret);
        m.update(head.as_bytes());
        format!(
            "{head}.{}",
            URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
        )
    }

    #[test]
    fn round_trip() {
        let t = sign(SECRET, "alice", NOW + 60);
        assert!(t.starts_with("v1."));
        assert_eq!(
            verify(SECRET, &t, NOW).unwrap(),
            Claims {
                user: "alice".into(),
                expires_at_unix: NOW + 60,
                admin: false,
            }
        );
        // Non-ASCII and maximal user ids.
        for user in ["Ünïcødé 用户", &"u".repeat(128)] {
            let t = sign(SECRET, user, NOW + 1);
            assert_eq!(verify(SECRET, &t, NOW).unwrap().user, user);
        }
    }

    #[test]
    fn format_is_exact() {
        let t = sign(SECRET, "alice", 1_764_489_600);
        let parts: Vec<&str> = t.split('.').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], "v1");
        assert_eq!(
            URL_SAFE_NO_PAD.decode(parts[1]).unwrap(),
            br#"{"u":"alice","exp":1764489600}"#
        );
        assert_eq!(t, sign_raw(SECRET, r#"{"u":"alice","exp":1764489600}"#));
        assert!(!t.contains('='));
    }

    #[test]
    fn admin_tokens() {
        let t = sign_admin(SECRET, "ops", NOW + 60);
        let parts: Vec<&str> = t.split('.').collect();
        assert_eq!(
            URL_SAFE_NO_PAD.decode(parts[1]).unwrap(),
            br#"{"u":"ops","exp":1764489660,"admin":true}"#
        );
        assert_eq!(
            verify(SECRET, &t, NOW).unwrap(),
            Claims {
                user: "ops".into(),
                expires_at_unix: NOW + 60,
                admin: true,
            }
        );
        assert_eq!(
            t,
            sign_raw(SECRET, r#"{"u":"ops","exp":1764489660,"admin":true}"#)
        );
        // a user token is not an admin token
        assert!(
            !verify(SECRET, &sign(SECRET, "ops", NOW + 60), NOW)
                .unwrap()
                .admin
        );
        // the claim is signed: adding it to a user token breaks the MAC
        let user = sign(SECRET, "ops", NOW + 60);
        let (_, mac_b64) = user.rsplit_once('.').unwrap();
        let forged = format!("v1.{}.{mac_b64}", parts[1]);
        assert_eq!(verify(SECRET, &forged, NOW), Err(TokenError::BadSignature));
        // expiry applies as to any token
        let old = sign_admin(SECRET, "ops", NOW);
        assert_eq!(
            verify(SECRET, &old, NOW).unwrap_err().code(),
            "token_expired"
        );
    }

    #[test]
    fn expired() {
        let t = sign(SECRET, "alice", NOW);
        let e = verify(SECRET, &t, NOW).unwrap_err();
        assert_eq!(
            e,
            TokenError::Expired {
                expires_at_unix: NOW,
                now_unix: NOW
            }
        );
        assert_eq!(e.code(), "token_expired");
        assert_eq!(e.error_code(), ErrorCode::TokenExpired);
        assert!(verify(SECRET, &t, NOW - 1).is_ok());
    }

    #[test]
    fn wrong_secret() {
        let t = sign(b"other secret", "alice", NOW + 60);
        let e = verify(SECRET, &t, NOW).unwrap_err();
        assert_eq!(e, TokenError::BadSignature);
        assert_eq!(e.error_code(), ErrorCode::Unauthorized);
        // An expired token under the wrong secret is a bad signature, not "expired".
        let t = sign(b"other secret", "alice", 1);
        assert_eq!(verify(SECRET, &t, NOW), Err(TokenError::BadSignature));
    }

    #[test]
    fn forged_signature() {
        let t = sign(SECRET, "alice", NOW + 60);
        let (head, _) = t.rsplit_once('.').unwrap();
        let forged = format!("{head}.{}", URL_SAFE_NO_PAD.encode([0u8; 32]));
        assert_eq!(verify(SECRET, &forged, NOW), Err(TokenError::BadSignature));
        // Truncated and empty MACs.
        let short = format!("{head}.{}", URL_SAFE_NO_PAD.encode([0u8; 16]));
        assert_eq!(verify(SECRET, &short, NOW), Err(TokenError::BadSignature));
        assert_eq!(
            verify(SECRET, &format!("{head}."), NOW),
            Err(TokenError::BadSignature)
        );
        // One flipped character of the MAC.
        let mut bytes = t.clone().into_bytes();
        let last = bytes.len() - 2;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(bytes).unwrap();
        assert!(verify(SECRET, &flipped, NOW).is_err());
    }

    #[test]
    fn tampered_payload() {
        let t = sign(SECRET, "alice", NOW + 60);
        let (_, mac_b64) = t.rsplit_once('.').unwrap();
        let evil = URL_SAFE_NO_PAD.encode(br#"{"u":"mallory","exp":99999999999}"#);
        let tampered = format!("v1.{evil}.{mac_b64}");
        assert_eq!(
            verify(SECRET, &tampered, NOW),
            Err(TokenError::BadSignature)
        );
        // Changing the version prefix is also caught.
        let v2 = t.replacen("v1.", "v2.", 1);
        assert_eq!(
            verify(SECRET, &v2, NOW).unwrap_err().code(),
            "token_malformed"
        );
    }

    #[test]
    fn signed_but_invalid_payloads_are_malformed() {
        for payload in [
            r#"{"u":"","exp":99999999999}"#,
            &format!(r#"{{"u":"{}","exp":99999999999}}"#, "u".repeat(129)),
            r#"{"u":"alice"}"#,
            r#"{"exp":99999999999}"#,
            r#"{"u":"alice","exp":-1}"#,
            r#"{"u":"alice","exp":"99999999999"}"#,
            r#"{"u":"alice","exp":99999999999,"root":true}"#,
            r#"{"u":"alice","exp":99999999999,"admin":false}"#,
            r#"{"u":"alice","exp":99999999999,"admin":"true"}"#,
            r#"{"u":"alice","exp":99999999999,"admin":1}"#,
            r#"{"u":"alice","exp":99999999999,"admin":null}"#,
            r#"{"u":"alice","exp":99999999999,"admin":true,"admin":true}"#,
            r#"["alice",99999999999]"#,
            r#"{"u":"alice","exp":99999999999.5}"#,
            r#"{"u":"alice","u":"bob","exp":99999999999}"#,
            r#"{"u":7,"exp":99999999999}"#,
            r#"{"u":"a\u0000b","exp":99999999999}"#,
            r#"{"u":"alice\n","exp":99999999999}"#,
            r#"{"u":"\u007f","exp":99999999999}"#,
            "not json",
        ] {
            let t = sign_raw(SECRET, payload);
            assert!(
                matches!(verify(SECRET, &t, NOW), Err(TokenError::Malformed(_))),
                "{payload}"
            );
        }
    }

    #[test]
    fn garbage() {
        let long = "v1.".to_string() + &"A".repeat(2000) + ".AAAA";
        for t in [
            "",
            "v1",
            "v1.",
            "v1..",
            "v1.abc",
            "Bearer v1.a.b",
            "v1.a.b.c",
            "v1.!!!.AAAA",
            "v1.eyJ1IjoiYSJ9.***",
            "v1.eyJ1IjoiYSJ9.AAAA=",
            &long,
            "\u{0}\u{1}\u{2}",
            "ümlaut.ümlaut.ümlaut",
        ] {
            let e = verify(SECRET, t, NOW).unwrap_err();
            assert_ne!(e.error_code(), ErrorCode::TokenExpired, "{t:?}");
        }
    }

    #[test]
    fn clients_see_one_message_for_every_invalid_token() {
        let good = sign(SECRET, "alice", NOW + 60);
        let (head, _) = good.rsplit_once('.').unwrap();
        let invalid = [
            sign(b"other secret", "alice", NOW + 60),
            format!("{head}.{}", URL_SAFE_NO_PAD.encode([0u8; 32])),
            "garbage".to_string(),
            "v1.!!!.AAAA".to_string(),
            sign_raw(SECRET, r#"{"u":"","exp":99999999999}"#),
            "v1.".to_string() + &"A".repeat(2000) + ".AAAA",
        ];
        let mut codes = std::collections::BTreeSet::new();
        for t in &invalid {
            let e = verify(SECRET, t, NOW).unwrap_err();
            codes.insert(e.code());
            assert_eq!(e.client_message(), INVALID_TOKEN_MESSAGE, "{t}");
            assert_eq!(e.error_code(), ErrorCode::Unauthorized, "{t}");
        }
        // the log codes still tell them apart
        assert_eq!(
            codes.into_iter().collect::<Vec<_>>(),
            ["token_bad_signature", "token_malformed"]
        );
        let e = verify(SECRET, &sign(SECRET, "alice", NOW), NOW).unwrap_err();
        assert_eq!(e.client_message(), EXPIRED_TOKEN_MESSAGE);
    }

    #[test]
    #[should_panic(expected = "token user")]
    fn sign_refuses_an_invalid_user() {
        sign(SECRET, "", NOW);
    }

    #[test]
    #[should_panic(expected = "token user")]
    fn sign_refuses_a_user_with_a_control_character() {
        sign(SECRET, "a\0b", NOW);
    }

    proptest! {
        #[test]
        fn verify_never_panics(t in ".{0,400}", secret in prop::collection::vec(any::<u8>(), 0..80)) {
            let _ = verify(&secret, &t, NOW);
            let _ = verify(&secret, &format!("v1.{t}"), NOW);
        }

        #[test]
        fn sign_verify_round_trip(
            user in "\\PC{1,32}",
            exp in 1u64..=u64::MAX,
            secret in prop::collection::vec(any::<u8>(), 0..100),
        ) {
            prop_assume!(is_valid_user_id(&user));
            let t = sign(&secret, &user, exp);
            let c = verify(&secret, &t, exp - 1).unwrap();
            prop_assert_eq!(c.user, user);
            prop_assert_eq!(c.expires_at_unix, exp);
        }
    }
}
