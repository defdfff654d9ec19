//! Shard leases and the node registry on core Redis (issue 13, ADR-0030): typed wrappers of
//! `lua/core/shard_lease.lua`, `node_heartbeat.lua` and `node_list.lua`, each called by
//! EVALSHA with a NOSCRIPT reload where the call runs ([`Script::key`]).
//!
//! A lease says which node may own a shard; it never replaces the epoch fence. Lease time is
//! Redis time (PX on the server); a node also keeps its own deadline (the time it *sent* its
//! last successful renewal plus the TTL, minus a margin) and stops writing a shard at that
//! deadline, before the lease can expire and another node take it.

use std::sync::LazyLock;

use redis::Value;

use super::dlog::LogStore;
use super::scripts::Script;
use super::watermark::Layout;
use crate::error::{Error, Result};
use crate::keys;

static SHARD_LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "shard_lease",
        include_str!("lua/core/shard_lease.lua").to_string(),
    )
});
static NODE_HEARTBEAT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "node_heartbeat",
        include_str!("lua/core/node_heartbeat.lua").to_string(),
    )
});
static NODE_LIST: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "node_list",
        include_str!("lua/core/node_list.lua").to_string(),
    )
});

/// Longest node id (bytes).
pub const MAX_NODE_ID: usize = 128;

/// What a lease call found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lease {
    /// The calling node holds the lease now (`fresh`: it was free before this acquire).
    Held { fresh: bool },
    /// Another node holds it for `pttl_ms` more (nothing written).
    Other { owner: String, pttl_ms: i64 },
    /// Renew or release of a lease that had expired (nothing written).
    Absent,
    /// Released.
    Released,
}

/// A live node, as the registry on core instance 0 knows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeInfo {
    /// Node id (`serve --node-id`).
    pub id: String,
    /// Advertised client URL (`serve --advertise`).
    pub url: String,
    /// `all`, `gateway` or `materializer`.
    pub role: String,
    /// The watermark layout it writes (`packed-v1`, `packed-v2`); `None` for a record written
    /// without one (a build before ADR-0033). Shards go to the nodes of the newest layout
    /// ([`crate::assign::eligible`]).
    pub layout: Option<String>,
    /// The newest deployment identity version its code reads
    /// ([`crate::deployment::VERSION_CURRENT`] of its build); `None` for a record written
    /// without one (a build before ADR-0056). `tidemark upgrade` raises a deployment's version
    /// only when every live node reads the new one.
    pub reads: Option<u32>,
    /// The core instances (by index) it has not reached for a lease TTL (ADR-0113): the
    /// shards of those instances are assigned to the nodes that reach them
    /// ([`crate::assign::around_unreached`]). Empty for a build before ADR-0113.
    pub unreached: Vec<usize>,
    /// Milliseconds since its last heartbeat (Redis time).
    pub age_ms: u64,
}

/// Checks a node id: 1..=[`MAX_NODE_ID`] bytes of `A-Z a-z 0-9 - _ .` (it appears in keys,
/// logs and URLs).
pub fn check_node_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= MAX_NODE_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "node id {id:?}: 1..={MAX_NODE_ID} characters of A-Z a-z 0-9 - _ ."
        )))
    }
}

fn bad(detail: String) -> Error {
    Error::UnexpectedReply {
        script: "shard_lease",
        detail,
    }
}

fn parse_lease(op: &str, v: &Value) -> Result<Lease> {
    let items = match v {
        Value::Array(items) => items,
        other => return Err(bad(format!("{op}: {other:?}"))),
    };
    let int = |i: usize| match items.get(i) {
        Some(Value::Int(n)) => Ok(*n),
        other => Err(bad(format!("{op}: item {i} {other:?}"))),
    };
    match int(0)? {
        0 if op == "release" => Ok(Lease::Released),
        0 => Ok(Lease::Held {
            fresh: int(1)? == 1,
        }),
        1 => {
            let owner = match items.get(1) {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                other => return Err(bad(format!("{op}: owner {other:?}"))),
            };
            Ok(Lease::Other {
                owner,
                pttl_ms: int(2)?,
            })
        }
        2 => Ok(Lease::Absent),
        n => Err(bad(format!("{op}: status {n}"))),
    }
}

impl LogStore {
    async fn lease_op(&mut self, op: &str, shard: u32, node: &str, ttl_ms: u64) -> Result<Lease> {
        let v: Value = SHARD_LEASE
            .key(keys::lease(shard))
            .arg(op)
            .arg(node)
            .arg(ttl_ms)
            .invoke(&mut self.conn)
            .await?;
        parse_lease(op, &v)
    }

    /// Takes shard `shard`'s lease for `node` when it is free or already `node`'s, for
    /// `ttl_ms` from now (Redis time).
    pub async fn acquire_lease(&mut self, shard: u32, node: &str, ttl_ms: u64) -> Result<Lease> {
        self.lease_op("acquire", shard, node, ttl_ms).await
    }

    /// Extends `node`'s lease of `shard` to `ttl_ms` from now, only while `node` holds it.
    pub async fn renew_lease(&mut self, shard: u32, node: &str, ttl_ms: u64) -> Result<Lease> {
        self.lease_op("renew", shard, node, ttl_ms).await
    }

    /// Gives up `node`'s lease of `shard` (only while `node` holds it).
    pub async fn release_lease(&mut self, shard: u32, node: &str) -> Result<Lease> {
        self.lease_op("release", shard, node, 0).await
    }

    /// The holder of `shard`'s lease and its remaining ms, if any (for `tidemark status`).
    pub async fn lease_holder(&mut self, shard: u32) -> Result<Option<(String, i64)>> {
        let (owner, pttl): (Option<String>, i64) = redis::pipe()
            .cmd("GET")
            .arg(keys::lease(shard))
            .cmd("PTTL")
            .arg(keys::lease(shard))
            .query_async(&mut self.conn)
            .await?;
        Ok(owner.map(|o| (o, pttl)))
    }

    /// For each of `shards` (all on this instance): its head (`head:{s}`, 0 when none) and
    /// the holder of its lease, if any — in one pipeline, split per shard on a cluster
    /// ([`crate::endpoint::Conn::exec_each`]) (for `tidemark status` and the gateway's
    /// `GET /v1/admin/status`).
    pub async fn heads_and_holders(
        &mut self,
        shards: &[u32],
    ) -> Result<Vec<(u64, Option<String>)>> {
        let mut cmds = Vec::with_capacity(2 * shards.len());
        for &s in shards {
            cmds.push((s, redis::cmd("GET").arg(keys::head(s)).clone()));
            cmds.push((s, redis::cmd("GET").arg(keys::lease(s)).clone()));
        }
        let v = self.conn.exec_each(&cmds).await?;
        if v.len() != cmds.len() {
            return Err(Error::UnexpectedReply {
                script: "status",
                detail: format!("{} replies to {} commands", v.len(), cmds.len()),
            });
        }
        let mut out = Vec::with_capacity(shards.len());
        for pair in v.chunks(2) {
            let (head, holder) = (pair[0].clone()?, pair[1].clone()?);
            let head: Option<u64> =
                redis::from_redis_value_ref(&head).map_err(redis::RedisError::from)?;
            let holder: Option<String> =
                redis::from_redis_value_ref(&holder).map_err(redis::RedisError::from)?;
            out.push((head.unwrap_or(0), holder));
        }
        Ok(out)
    }

    /// Records that node `id` (advertising `url`, running `role`, writing watermarks in
    /// `layout`) is alive for `ttl_ms` (call on core instance 0).
    pub async fn heartbeat(
        &mut self,
        id: &str,
        ttl_ms: u64,
        url: &str,
        role: &str,
        layout: Layout,
    ) -> Result<u64> {
        self.heartbeat_reaching(id, ttl_ms, url, role, layout, &[], "")
            .await
    }

    /// [`LogStore::heartbeat`] of a node that has not reached the core instances `unreached`
    /// (indices) for a lease TTL (ADR-0113), from the process `incarnation` (a random string
    /// per process; "" is not checked): while a live record of `id` has another incarnation,
    /// [`Error::NodeIdInUse`] and nothing written (ADR-0114).
    #[allow(clippy::too_many_arguments)]
    pub async fn heartbeat_reaching(
        &mut self,
        id: &str,
        ttl_ms: u64,
        url: &str,
        role: &str,
        layout: Layout,
        unreached: &[usize],
        incarnation: &str,
    ) -> Result<u64> {
        check_node_id(id)?;
        let unreached: Vec<String> = unreached.iter().map(usize::to_string).collect();
        let now: u64 = NODE_HEARTBEAT
            .key(keys::NODES)
            .key(format!("{}{id}", keys::NODE_PREFIX))
            .arg(id)
            .arg(ttl_ms)
            .arg(url)
            .arg(role)
            .arg(layout.as_str())
            .arg(crate::deployment::VERSION_CURRENT)
            .arg(unreached.join(","))
            .arg(incarnation)
            .invoke(&mut self.conn)
            .await
            .map_err(|e| {
                if e.detail().is_some_and(|d| d.starts_with("node_id_in_use")) {
                    Error::NodeIdInUse { id: id.to_string() }
                } else {
                    e.into()
                }
            })?;
        Ok(now)
    }

    /// One `PING`: whether the instance answers (the lease loop's probe of an instance it has
    /// nothing else to call on, ADR-0113).
    pub async fn ping(&mut self) -> Result<()> {
        let _: String = redis::cmd("PING").query_async(&mut self.conn).await?;
        Ok(())
    }

    /// Removes node `id`'s record at once (a clean stop; call on core instance 0).
    pub async fn deregister(&mut self, id: &str) -> Result<()> {
        let () = redis::pipe()
            .cmd("ZREM")
            .arg(keys::NODES)
            .arg(id)
            .ignore()
            .cmd("DEL")
            .arg(format!("{}{id}", keys::NODE_PREFIX))
            .ignore()
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// The live nodes by id (call on core instance 0).
    pub async fn live_nodes(&mut self) -> Result<Vec<NodeInfo>> {
        let v: Vec<Value> = NODE_LIST
            .key(keys::NODES)
            .arg(keys::NODE_PREFIX)
            .invoke(&mut self.conn)
            .await?;
        let nbad = |d: &str| Error::UnexpectedReply {
            script: "node_list",
            detail: d.to_string(),
        };
        let now = match v.first() {
            Some(Value::Int(n)) => *n,
            _ => return Err(nbad("no time")),
        };
        let text = |x: &Value| match x {
            Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
            _ => Err(nbad("not a string")),
        };
        let mut out = Vec::new();
        for rec in v[1..].chunks(7) {
            let [id, url, role, Value::Int(beat), layout, reads, unreached] = rec else {
                return Err(nbad("bad record"));
            };
            out.push(NodeInfo {
                id: text(id)?,
                url: text(url)?,
                role: text(role)?,
                layout: Some(text(layout)?).filter(|l| !l.is_empty()),
                // a value that is not a version reads as none: the node is not counted on
                reads: text(reads)?.parse().ok(),
                // what does not parse is left out: at worst a node keeps shards it cannot
                // reach, as before ADR-0113
                unreached: text(unreached)?
                    .split(',')
                    .filter_map(|i| i.parse().ok())
                    .collect(),
                age_ms: u64::try_from(now - beat).unwrap_or(0),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids() {
        for ok in ["a", "node-1", "n_2.example", &"x".repeat(MAX_NODE_ID)] {
            assert!(check_node_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a:b", "é", &"x".repeat(MAX_NODE_ID + 1), "a\n"] {
            assert!(check_node_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lease_replies_decode() {
        let arr = Value::Array;
        assert_eq!(
            parse_lease("acquire", &arr(vec![Value::Int(0), Value::Int(1)])).unwrap(),
            Lease::Held { fresh: true }
        );
        assert_eq!(
            parse_lease("release", &arr(vec![Value::Int(0), Value::Int(0)])).unwrap(),
            Lease::Released
        );
        assert_eq!(
            parse_lease(
                "renew",
                &arr(vec![
                    Value::Int(1),
                    Value::BulkString(b"other".to_vec()),
                    Value::Int(1200)
                ])
            )
            .unwrap(),
            Lease::Other {
                owner: "other".into(),
                pttl_ms: 1200
            }
        );
        assert_eq!(
            parse_lease("renew", &arr(vec![Value::Int(2)])).unwrap(),
            Lease::Absent
        );
        assert!(parse_lease("renew", &arr(vec![Value::Int(9)])).is_err());
        assert!(parse_lease("renew", &Value::Int(0)).is_err());
    }
}
