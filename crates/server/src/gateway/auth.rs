//! Who is calling: a bearer token (`Authorization: Bearer …`, or `?token=` on the WebSocket
//! URL only), or — with `dev_auth` — `?user=NAME`. Checked once, before anything else.
//!
//! A token, when given, must verify (a bad token is never overridden by `?user=`). Without a
//! token, `?user=` counts only with `dev_auth`; otherwise it is ignored and the request is
//! `unauthorized`. The user found here is the only mailbox the caller can read or ack.
//!
//! The operator's endpoint (`GET /v1/admin/status`, [`authorize_admin`]) needs an admin token
//! (`"admin":true`, `tidemark token --admin`): a valid user token gets 403 `forbidden`. With
//! `dev_auth` it is open to a request without a token (`?user=` or nothing at all), like
//! everything else in development mode.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderMap};
use tidemark_protocol::{is_valid_user_id, token, ErrorCode};

use super::GatewayOptions;

/// Where the credentials may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/ws`: also `?token=`.
    WebSocket,
    /// The HTTP endpoints: the header only.
    Http,
}

/// A refusal: the code (`unauthorized` or `token_expired`) and a message.
pub(crate) type Refusal = (ErrorCode, String);

/// Who is calling, and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    pub user: String,
    /// The token's `exp` (unix seconds); `None` for a `?user=` (dev auth) caller.
    pub expires_at_unix: Option<u64>,
    /// An admin token (`"admin":true`); false for a `?user=` caller.
    pub admin: bool,
}

fn unauthorized(msg: impl Into<String>) -> Refusal {
    (ErrorCode::Unauthorized, msg.into())
}

/// Under dev auth, a web page of another site must not act as a user (ADR-0104): a browser
/// sends `Origin` with every WebSocket handshake and every cross-origin request (and a
/// WebSocket is not held back by CORS), so a request whose `Origin` is not this gateway's
/// (its host and port, compared with the request's `Host`) is refused. Requests without an
/// `Origin` (command-line clients, the load generator, same-origin `GET`s) pass, and so do
/// this gateway's own pages (the console).
///
/// And unless `public` (`--dev-auth-public`), the `Host` must be a loopback one (ADR-0115):
/// a page of `evil.example` whose name is re-pointed at 127.0.0.1 after it loaded (DNS
/// rebinding) is same-origin with the `Host` it sends, `evil.example`, which no one uses to
/// reach a gateway listening on loopback.
///
/// A `Host` or an `Origin` that is there but cannot be read (not visible ASCII), or given more
/// than once, is refused too (ADR-0125): before, an unreadable one counted as absent, and
/// both checks were skipped. Whoever sends such a header is no browser we serve.
fn dev_auth_allowed(headers: &HeaderMap, public: bool) -> Result<(), Refusal> {
    let host = readable(headers, header::HOST)?;
    if let Some(host) = host.filter(|h| !public && !is_loopback_host(h)) {
        tracing::info!(
            host,
            "dev auth: request for a host that is not loopback refused"
        );
        return Err((
            ErrorCode::Forbidden,
            "with dev auth (?user=) this gateway answers only for localhost, 127.0.0.1 or \
             [::1] (--dev-auth-public serves other names)"
                .into(),
        ));
    }
    let Some(origin) = readable(headers, header::ORIGIN)? else {
        return Ok(());
    };
    let Some(host) = host else {
        // no `Host` to compare with (HTTP/2 names it in the URI): nothing to refuse on
        return Ok(());
    };
    let authority = origin
        .split_once("://")
        .map(|(_, a)| a.trim_end_matches('/'));
    if authority.is_some_and(|a| a.eq_ignore_ascii_case(host)) {
        return Ok(());
    }
    tracing::info!(origin, host, "dev auth: cross-origin request refused");
    Err((
        ErrorCode::Forbidden,
        "cross-origin request refused: with dev auth (?user=) only this gateway's own pages \
         may act as a user"
            .into(),
    ))
}

/// The value of header `name` for the dev-auth checks: `None` when absent; refused (403
/// `forbidden`) when given more than once or not visible ASCII, which the checks could not
/// compare (fail closed, ADR-0125).
fn readable(headers: &HeaderMap, name: header::HeaderName) -> Result<Option<&str>, Refusal> {
    let mut values = headers.get_all(&name).iter();
    let value = match (values.next(), values.next()) {
        (None, _) => return Ok(None),
        (Some(v), None) => v,
        (Some(_), Some(_)) => {
            tracing::info!(header = %name, "dev auth: header given more than once refused");
            return Err((
                ErrorCode::Forbidden,
                format!("with dev auth (?user=) the {name} header may be given only once"),
            ));
        }
    };
    match value.to_str() {
        Ok(v) => Ok(Some(v)),
        Err(_) => {
            tracing::info!(header = %name, value = ?value, "dev auth: unreadable header refused");
            Err((
                ErrorCode::Forbidden,
                format!("with dev auth (?user=) the {name} header must be visible ASCII"),
            ))
        }
    }
}

/// The authenticated caller of a request.
pub(crate) fn authenticate(
    opts: &GatewayOptions,
    headers: &HeaderMap,
    query: Option<&str>,
    endpoint: Endpoint,
) -> Result<Caller, Refusal> {
    let query = query.unwrap_or("");
    let mut tokens = headers.get_all(header::AUTHORIZATION).iter();
    let header_token = match (tokens.next(), tokens.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => return Err(unauthorized("more than one Authorization header")),
        (Some(v), None) => {
            let v = v
                .to_str()
                .map_err(|_| unauthorized("Authorization header is not ASCII"))?;
            let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
            if !scheme.eq_ignore_ascii_case("bearer") {
                return Err(unauthorized("Authorization must be `Bearer <token>`"));
            }
            Some(rest.trim().to_string())
        }
    };
    let query_token = match endpoint {
        Endpoint::WebSocket => query_param(query, "token")?,
        Endpoint::Http => None,
    };
    let token = match (header_token, query_token) {
        (Some(_), Some(_)) => return Err(unauthorized("token given twice (header and query)")),
        (Some(t), None) | (None, Some(t)) => Some(t),
        (None, None) => None,
    };
    if let Some(t) = token {
        let Some(secret) = &opts.token_secret else {
            tracing::info!("token refused: this gateway has no token secret");
            return Err(unauthorized(token::INVALID_TOKEN_MESSAGE));
        };
        return match token::verify(secret, &t, now_unix()) {
            Ok(claims) => Ok(Caller {
                user: claims.user,
                expires_at_unix: Some(claims.expires_at_unix),
                admin: claims.admin,
            }),
            Err(e) => {
                // the detail (malformed or mis-signed) is for the log only
                tracing::info!(code = e.code(), error = %e, "token refused");
                Err((e.error_code(), e.client_message().to_string()))
            }
        };
    }
    if opts.dev_auth {
        if let Some(user) = query_param(query, "user")? {
            dev_auth_allowed(headers, opts.dev_auth_public)?;
            if !is_valid_user_id(&user) {
                return Err(unauthorized(
                    "`user` must be 1..=128 bytes without control characters",
                ));
            }
            return Ok(Caller {
                user,
                expires_at_unix: None,
                admin: false,
            });
        }
    }
    Err(unauthorized("missing credentials"))
}

/// Who may read the operator's endpoints: `Ok(Some(user))` for an admin token, `Ok(None)`
/// for a request without a token when `dev_auth` is on (a `?user=` or nothing), else the
/// refusal: 401 as for any endpoint (no credentials, a bad token), 403 `forbidden` for a
/// valid token without the admin claim.
pub(crate) fn authorize_admin(
    opts: &GatewayOptions,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Option<Caller>, Refusal> {
    if opts.dev_auth && !headers.contains_key(header::AUTHORIZATION) {
        dev_auth_allowed(headers, opts.dev_auth_public)?;
        return Ok(None);
    }
    let caller = authenticate(opts, headers, query, Endpoint::Http)?;
    if caller.admin {
        // the whole caller: a stream answered to it ends at its token's `exp` (ADR-0103)
        Ok(Some(caller))
    } else if caller.expires_at_unix.is_none() {
        // a `?user=` caller: only reachable with dev auth, which opens this endpoint
        Ok(None)
    } else {
        tracing::info!(user = %caller.user, "admin endpoint refused: not an admin token");
        Err((
            ErrorCode::Forbidden,
            "this endpoint needs an admin token (tidemark token --admin)".into(),
        ))
    }
}

/// Whether a `Host` header names this machine's loopback: `localhost` (and its subdomains,
/// which browsers resolve to loopback themselves), an address of `127.0.0.0/8`, or `[::1]`;
/// with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6] or [v6]:port
        match rest.split_once(']') {
            Some((v6, _)) => {
                return v6
                    .parse::<std::net::Ipv6Addr>()
                    .is_ok_and(|a| a.is_loopback())
            }
            None => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|a| a.is_loopback())
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The percent-decoded value of `key` in a query string (other parameters are ignored); a
/// repeated or undecodable one is refused.
fn query_param(query: &str, key: &str) -> Result<Option<String>, Refusal> {
    let mut found = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, value) = pair.split_once('=').unwrap_or((pair, ""));
        if k != key {
            continue;
        }
        if found.is_some() {
            return Err(unauthorized(format!("`{key}` given twice")));
        }
        let value = percent_decode(value)
            .ok_or_else(|| unauthorized(format!("`{key}` is not valid percent-encoded UTF-8")))?;
        found = Some(value);
    }
    Ok(found)
}

/// Decodes `%XX` escapes and `+` (space), as in `application/x-www-form-urlencoded`.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const SECRET: &[u8] = b"unit secret";

    fn opts(dev: bool) -> GatewayOptions {
        GatewayOptions {
            token_secret: Some(SECRET.to_vec()),
            dev_auth: dev,
            ..GatewayOptions::default()
        }
    }

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
        );
        h
    }

    /// ADR-0115: the `Host`s dev auth answers for without `--dev-auth-public`.
    #[test]
    fn loopback_hosts() {
        for ok in [
            "localhost",
            "localhost:7400",
            "LOCALHOST.:7400",
            "app.localhost:80",
            "127.0.0.1",
            "127.0.0.1:7400",
            "127.5.6.7:1",
            "[::1]",
            "[::1]:7400",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example:7400",
            "localhost.evil.example",
            "127.0.0.1.evil.example:7400",
            "10.0.0.1:7400",
            "0.0.0.0:7400",
            "[::2]:7400",
            "[::1",
            "",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }

    /// ADR-0125: an unreadable or repeated `Host` or `Origin` is refused under dev auth, with
    /// or without `--dev-auth-public`; a request with a token is not concerned.
    #[test]
    fn dev_auth_refuses_unreadable_or_repeated_host_and_origin() {
        let header = |h: &mut HeaderMap, name, v: &[u8]| {
            h.append(name, HeaderValue::from_bytes(v).unwrap());
        };
        let mut bad_host = HeaderMap::new();
        header(&mut bad_host, header::HOST, b"127.0.0.1\xff:7400");
        let mut two_hosts = HeaderMap::new();
        header(&mut two_hosts, header::HOST, b"127.0.0.1:7400");
        header(&mut two_hosts, header::HOST, b"evil.example:7400");
        let mut bad_origin = HeaderMap::new();
        header(&mut bad_origin, header::HOST, b"127.0.0.1:7400");
        header(
            &mut bad_origin,
            header::ORIGIN,
            b"http://127.0.0.1:7400\x80",
        );
        let mut two_origins = HeaderMap::new();
        header(&mut two_origins, header::HOST, b"127.0.0.1:7400");
        header(&mut two_origins, header::ORIGIN, b"http://127.0.0.1:7400");
        header(&mut two_origins, header::ORIGIN, b"http://evil.example");
        for public in [false, true] {
            let mut o = opts(true);
            o.dev_auth_public = public;
            for (what, h) in [
                ("unreadable Host", &bad_host),
                ("two Hosts", &two_hosts),
                ("unreadable Origin", &bad_origin),
                ("two Origins", &two_origins),
            ] {
                let refused = authenticate(&o, h, Some("user=alice"), Endpoint::Http);
                assert_eq!(
                    refused.unwrap_err().0,
                    ErrorCode::Forbidden,
                    "{what}, public {public}"
                );
                assert_eq!(
                    authorize_admin(&o, h, None).unwrap_err().0,
                    ErrorCode::Forbidden,
                    "{what}, public {public}"
                );
            }
        }
        // a token does not go through the dev-auth checks
        let mut h = bearer(&token::sign(SECRET, "alice", now_unix() + 60));
        header(&mut h, header::HOST, b"127.0.0.1\xff:7400");
        assert!(authenticate(&opts(true), &h, None, Endpoint::Http).is_ok());
        // one readable loopback Host and its own Origin pass
        let mut ok = HeaderMap::new();
        header(&mut ok, header::HOST, b"127.0.0.1:7400");
        header(&mut ok, header::ORIGIN, b"http://127.0.0.1:7400");
        assert!(authenticate(&opts(true), &ok, Some("user=alice"), Endpoint::Http).is_ok());
    }

    #[test]
    fn tokens_and_dev_users() {
        let good = token::sign(SECRET, "alice", now_unix() + 60);
        let none = HeaderMap::new();
        let ws = Endpoint::WebSocket;
        let http = Endpoint::Http;
        // header token, any endpoint; `?user=` never overrides it
        assert_eq!(
            authenticate(&opts(true), &bearer(&good), Some("user=bob"), http)
                .unwrap()
                .user,
            "alice"
        );
        // the token's expiry comes along (a WebSocket is closed when it passes)
        let exp = token::verify(SECRET, &good, 0).unwrap().expires_at_unix;
        assert_eq!(
            authenticate(&opts(false), &bearer(&good), None, ws)
                .unwrap()
                .expires_at_unix,
            Some(exp)
        );
        // query token: WebSocket only
        let q = format!("token={good}");
        assert_eq!(
            authenticate(&opts(false), &none, Some(&q), ws)
                .unwrap()
                .user,
            "alice"
        );
        assert_eq!(
            authenticate(&opts(false), &none, Some(&q), http)
                .unwrap_err()
                .0,
            ErrorCode::Unauthorized
        );
        // expired, forged
        let old = token::sign(SECRET, "alice", 1);
        assert_eq!(
            authenticate(&opts(true), &bearer(&old), Some("user=alice"), http)
                .unwrap_err()
                .0,
            ErrorCode::TokenExpired
        );
        let forged = token::sign(b"other", "alice", now_unix() + 60);
        assert_eq!(
            authenticate(&opts(true), &bearer(&forged), None, http)
                .unwrap_err()
                .0,
            ErrorCode::Unauthorized
        );
        // dev users
        assert_eq!(
            authenticate(&opts(true), &none, Some("user=b%C3%B6b+x"), http).unwrap(),
            Caller {
                user: "böb x".into(),
                expires_at_unix: None,
                admin: false,
            }
        );
        assert!(authenticate(&opts(false), &none, Some("user=bob"), http).is_err());
        assert!(authenticate(&opts(true), &none, Some("user="), http).is_err());
        assert!(authenticate(&opts(true), &none, Some("user=a&user=b"), http).is_err());
        assert!(authenticate(&opts(true), &none, Some("user=%FF"), http).is_err());
        // control characters (ADR-0022)
        for q in ["user=a%00b", "user=a%0A", "user=%1F", "user=%7F"] {
            assert_eq!(
                authenticate(&opts(true), &none, Some(q), http)
                    .unwrap_err()
                    .0,
                ErrorCode::Unauthorized,
                "{q}"
            );
        }
        assert!(authenticate(&opts(true), &none, None, http).is_err());
        // `user` is not looked at when a token is given or dev auth is off
        assert_eq!(
            authenticate(&opts(false), &bearer(&good), Some("user=a&user=%FF"), http)
                .unwrap()
                .user,
            "alice"
        );
        // no secret: tokens refused
        let no_secret = GatewayOptions::default();
        assert!(authenticate(&no_secret, &bearer(&good), None, http).is_err());
    }

    #[test]
    fn admin_endpoint() {
        let none = HeaderMap::new();
        let exp = now_unix() + 60;
        let admin = bearer(&token::sign_admin(SECRET, "ops", exp));
        let user = bearer(&token::sign(SECRET, "alice", exp));
        for dev in [false, true] {
            let c = authorize_admin(&opts(dev), &admin, None).unwrap().unwrap();
            assert_eq!((c.user.as_str(), c.expires_at_unix), ("ops", Some(exp)));
            // a valid user token: 403, whatever the mode
            let refused = authorize_admin(&opts(dev), &user, None).unwrap_err();
            assert_eq!(refused.0, ErrorCode::Forbidden);
            // a bad or expired token: 401 as everywhere
            let forged = bearer(&token::sign_admin(b"other", "ops", exp));
            assert_eq!(
                authorize_admin(&opts(dev), &forged, None).unwrap_err().0,
                ErrorCode::Unauthorized
            );
            let old = bearer(&token::sign_admin(SECRET, "ops", 1));
            assert_eq!(
                authorize_admin(&opts(dev), &old, None).unwrap_err().0,
                ErrorCode::TokenExpired
            );
        }
        // no credentials: open with dev auth only
        assert!(matches!(
            authorize_admin(&opts(true), &none, None),
            Ok(None)
        ));
        assert!(matches!(
            authorize_admin(&opts(true), &none, Some("user=bob")),
            Ok(None)
        ));
        assert_eq!(
            authorize_admin(&opts(false), &none, None).unwrap_err().0,
            ErrorCode::Unauthorized
        );
        assert_eq!(
            authorize_admin(&opts(false), &none, Some("user=bob"))
                .unwrap_err()
                .0,
            ErrorCode::Unauthorized
        );
        // an admin token is its user's token on the client endpoints
        let c = authenticate(&opts(false), &admin, None, Endpoint::Http).unwrap();
        assert_eq!((c.user.as_str(), c.admin), ("ops", true));
    }

    #[test]
    fn one_refusal_for_every_invalid_token() {
        let good = token::sign(SECRET, "alice", now_unix() + 60);
        let (head, _) = good.rsplit_once('.').unwrap();
        let want = (ErrorCode::Unauthorized, "invalid token".to_string());
        for bad in [
            token::sign(b"other", "alice", now_unix() + 60),
            format!("{head}.AAAA"),
            "v1.x".to_string(),
            "garbage".to_string(),
            "v1.".to_string() + &"A".repeat(2000) + ".AAAA",
        ] {
            for ep in [Endpoint::Http, Endpoint::WebSocket] {
                assert_eq!(
                    authenticate(&opts(false), &bearer(&bad), None, ep).unwrap_err(),
                    want,
                    "{bad}"
                );
            }
            let q = format!("token={bad}");
            assert_eq!(
                authenticate(
                    &opts(false),
                    &HeaderMap::new(),
                    Some(&q),
                    Endpoint::WebSocket
                )
                .unwrap_err(),
                want
            );
            assert_eq!(
                authenticate(
                    &GatewayOptions::default(),
                    &bearer(&bad),
                    None,
                    Endpoint::Http
                )
                .unwrap_err(),
                want
            );
        }
    }
}
