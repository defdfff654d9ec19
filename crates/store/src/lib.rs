//! Tidemark's storage layer on Redis.
//!
//! - [`redis::watermark`]: the packed per-shard watermark of ADR-0015 (codec, validation).
//! - [`redis::scripts`]: the Lua scripts, embedded with `include_str!`, in their packed-v1 and
//!   packed-v2 sets.
//! - [`redis::store`]: [`MailboxStore`](redis::store::MailboxStore), the mailbox Redis
//!   (watermarks, materialisation, mailboxes, owner marks): one typed wrapper per script,
//!   EVALSHA with NOSCRIPT recovery, and the only call site of `decode_lane_watermarks`. One
//!   file per concern under `redis/store/`; every script reply is decoded in
//!   `redis/store/reply.rs`.
//! - [`redis::dlog`]: [`LogStore`](redis::dlog::LogStore), the core Redis (dispatch logs,
//!   commits, dedupe) and the log reader.
//! - [`keys`]: key names.
//! - [`topology`]: the deployment's topology, validated once into a [`topology::ShardMap`]
//!   whose `route(user)` is the only place a recipient's shard, lane and instances are computed.
//! - [`deployment`]: the deployment's identity recorded in every instance (shard count,
//!   instance positions, tables), checked before a process writes anything.
//! - [`wake`]: wake-up hints on `wake:{s}`, end to end: the payload codec,
//!   [`wake::publish_wake`] and [`wake::WakeSubscriber`].
//! - [`endpoint`]: one instance or a Redis Cluster behind one connection type,
//!   [`endpoint::Conn`] (ADR-0032).
//! - [`error`]: the crate's one error type.
//! - [`inspect`]: read-only reads of one offset (log, mailboxes, acks, staging) for the
//!   operator tools, which live in the `tidemark-ops` crate.
//! - [`status`]: a deployment's status (live nodes; per shard owner, epoch, lanes' W, head,
//!   lag, layout, blob size) for `tidemark status` and the gateway's admin endpoint.
//! - [`redact_url`]: a Redis URL without its password, for output and logs.

pub mod assign;
pub mod deployment;
pub mod endpoint;
pub mod error;
pub mod inspect;
pub mod keys;
pub mod redis;
mod scan;
pub mod status;
pub mod topology;
pub mod wake;

pub use error::Error;

/// `url` with its password (if any) replaced by `***`: `redis://:s3cret@host:7001/` becomes
/// `redis://:***@host:7001/`. For anything printed or logged; connect with the original.
pub fn redact_url(url: &str) -> String {
    if let Some(seeds) = endpoint::cluster_seeds(url) {
        let seeds: Vec<String> = seeds.iter().map(|s| redact_url(s)).collect();
        return endpoint::cluster_endpoint(&seeds);
    }
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
