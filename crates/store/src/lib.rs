//! Tidemark's storage layer on Redis.
//!
//! - [`redis::watermark`]: the packed per-shard watermark of ADR-0015 (codec, validation).
//! - [`redis::scripts`]: the Lua scripts, embedded with `include_str!`, in their packed-v1 and
//!   packed-v2 sets.
//! - [`redis::store`]: one typed wrapper per script, EVALSHA with NOSCRIPT recovery, and the
//!   only call site of `decode_lane_watermarks`.
//! - [`keys`]: key names.
//! - [`topology`]: the deployment's topology, validated once into a [`topology::ShardMap`]
//!   whose `route(user)` is the only place a recipient's shard, lane and instances are computed.
//! - [`deployment`]: the deployment's identity recorded in every instance (shard count,
//!   instance positions, tables), checked before a process writes anything.
//! - [`inspect`]: read-only reads of one offset (log, mailboxes, acks, staging) for the
//!   operator tools, which live in the `tidemark-ops` crate.
//! - [`ops`]: owner marks (`owner:{s}`): their lifetime and the read the offline tools make.
//! - [`redact_url`]: a Redis URL without its password, for output and logs.

pub mod deployment;
pub mod error;
pub mod inspect;
pub mod keys;
pub mod ops;
pub mod redis;
mod scan;
pub mod topology;
pub mod wake;

pub use error::Error;

/// `url` with its password (if any) replaced by `***`: `redis://:s3cret@host:7001/` becomes
/// `redis://:***@host:7001/`. For anything printed or logged; connect with the original.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted() {
        for (url, want) in [
            (
                "redis://:s3cret@127.0.0.1:7001/",
                "redis://:***@127.0.0.1:7001/",
            ),
            ("redis://user:p%40ss@h:1/0", "redis://user:***@h:1/0"),
            ("rediss://:a:b@h:1", "rediss://:***@h:1"),
            ("redis://127.0.0.1:7001/", "redis://127.0.0.1:7001/"),
            ("redis://user@h:1/", "redis://user@h:1/"),
            ("redis://h:1/?x=a@b:c", "redis://h:1/?x=a@b:c"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }
}
