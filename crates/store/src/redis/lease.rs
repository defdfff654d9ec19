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

/// A lease operation of [`LogStore::lease_many`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// [`LogStore::acquire_lease`].
    Acquire,
    /// [`LogStore::renew_lease`].
    Renew,
    /// [`LogStore::release_lease`] (the TTL is ignored).
    Release,
}

impl LeaseOp {
    /// `shard_lease.lua`'s `ARGV[1]`.
    fn as_str(self) -> &'static str {
        match self {
            LeaseOp::Acquire => "acquire",
            LeaseOp::Renew => "renew",
            LeaseOp::Release => "release",
        }
    }
}

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
    /// How it obtains its shards (ADR-0131): only leases nodes share the balanced assignment,
    /// and the shards a static node owns are left to it. `None` for a record whose last
    /// heartbeat did not say (a build before ADR-0131, or a tool's heartbeat). Not in the
    /// admin status's JSON (its schema lists the fields it has).
    #[serde(skip)]
    pub ownership: Option<Ownership>,
    /// Milliseconds since its last heartbeat (Redis time).
    pub age_ms: u64,
}

/// How a node obtains its shards, as its heartbeat says (ADR-0131). Before, a registry record
/// did not say, and a leases node counted a static node as one of its own kind: the balanced
/// assignment gave the static node a share of the shards, which it never took, and no leases
/// node took them either.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    /// Leases mode (ADR-0030): it takes the shards the balanced assignment over the live
    /// leases nodes gives it, by winning their leases.
    Leases,
    /// Static mode (ADR-0015): it owns these shards (its `--own-shards`, its row of the owner
    /// table, or every shard), without leases; none for a static node that materialises
    /// nothing (a gateway). Kept as inclusive ranges: a record never makes the reader
    /// allocate one entry per shard it names.
    Static {
        /// The shards it owns, as inclusive ranges in the order written.
        shards: Vec<std::ops::RangeInclusive<u32>>,
    },
}

impl Ownership {
    /// A static owner of `shards` (in any order, duplicates allowed).
    pub fn owning(shards: &[u32]) -> Ownership {
        let mut sorted = shards.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut ranges: Vec<std::ops::RangeInclusive<u32>> = Vec::new();
        for s in sorted {
            match ranges.last_mut() {
                Some(r) if r.end().checked_add(1) == Some(s) => *r = *r.start()..=s,
                _ => ranges.push(s..=s),
            }
        }
        Ownership::Static { shards: ranges }
    }

    /// True when this is a static owner of `shard`.
    pub fn owns_statically(&self, shard: u32) -> bool {
        match self {
            Ownership::Leases => false,
            Ownership::Static { shards } => shards.iter().any(|r| r.contains(&shard)),
        }
    }

    /// The heartbeat's `ownership` and `owns` arguments (`node_heartbeat.lua` `ARGV[9]`, `ARGV[10]`).
    fn to_args(&self) -> (&'static str, String) {
        match self {
            Ownership::Leases => ("leases", String::new()),
            Ownership::Static { shards } => {
                let owns: Vec<String> = shards
                    .iter()
                    .map(|r| {
                        if r.start() == r.end() {
                            r.start().to_string()
                        } else {
                            format!("{}-{}", r.start(), r.end())
                        }
                    })
                    .collect();
                ("static", owns.join(","))
            }
        }
    }

    /// Reads what `node_list.lua` returns for a record: `None` when the record does not say,
    /// or says a mode this code does not know. A range that does not parse is left out: the
    /// leases nodes then take that shard (possibly fencing the static owner) rather than leave
    /// it to an owner that may not be there.
    fn from_fields(ownership: &str, owns: &str) -> Option<Ownership> {
        match ownership {
            "leases" => Some(Ownership::Leases),
            "static" => Some(Ownership::Static {
                shards: owns
                    .split(',')
                    .filter_map(|r| {
                        let (a, b) = r.split_once('-').unwrap_or((r, r));
                        let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                        (a <= b).then_some(a..=b)
                    })
                    .collect(),
            }),
            _ => None,
        }
    }
}

/// What a node's heartbeat says about it ([`LogStore::beat`]).
#[derive(Debug, Clone, Copy)]
pub struct Beat<'a> {
    /// Node id.
    pub id: &'a str,
    /// How long the record lives without another heartbeat.
    pub ttl_ms: u64,
    /// Advertised client URL.
    pub url: &'a str,
    /// `all`, `gateway` or `materializer`.
    pub role: &'a str,
    /// The watermark layout it writes.
    pub layout: Layout,
    /// The core instances it has not reached for a lease TTL (ADR-0113).
    pub unreached: &'a [usize],
    /// A random string per process; "" is not checked (ADR-0114).
    pub incarnation: &'a str,
    /// How it obtains its shards (ADR-0131); `None` writes nothing said (as a build before).
    pub ownership: Option<&'a Ownership>,
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

    /// `op` of the lease of each of `shards` (all on this instance) for `node`, in one
    /// pipeline, one result per shard in the given order: a shard's failure is its own. On a
    /// Redis Cluster, one pipeline per shard ([`crate::endpoint::Conn::exec_each_within`]),
    /// each waited for at most `within` (and at most
    /// [`crate::endpoint::SHARD_CALL_TIMEOUT`]): a node that hangs costs only its own shards,
    /// which are answered an error; `within` is ignored on one instance. A call answered
    /// NOSCRIPT is sent again as `EVAL`. The outer error is the connection failing.
    ///
    /// Why (ADR-0132): the lease loop renewed one lease after another, a round trip each.
    /// At 512 shards with `appendfsync always` (an `fsync` per round trip) that took longer
    /// than the TTL, and the leases lapsed between two of their renewals. One pipeline costs
    /// about one round trip and one `fsync` however many shards it holds.
    pub async fn lease_many(
        &mut self,
        op: LeaseOp,
        shards: &[u32],
        node: &str,
        ttl_ms: u64,
        within: Option<std::time::Duration>,
    ) -> Result<Vec<Result<Lease>>> {
        if shards.is_empty() {
            // (an empty pipeline is an error of redis-rs, not an empty answer)
            return Ok(Vec::new());
        }
        let name = op.as_str();
        let cmds: Vec<(u32, redis::Cmd)> = shards
            .iter()
            .map(|&s| {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&SHARD_LEASE.sha)
                    .arg(1)
                    .arg(keys::lease(s))
                    .arg(name)
                    .arg(node)
                    .arg(ttl_ms);
                (s, c)
            })
            .collect();
        let bound = self
            .conn
            .shard_bound()
            .map(|b| within.map_or(b, |w| w.min(b)));
        let mut replies = self.conn.exec_each_within(&cmds, bound).await?;
        let again: Vec<usize> = replies
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r, Err(e) if e.code() == Some("NOSCRIPT")))
            .map(|(i, _)| i)
            .collect();
        if !again.is_empty() {
            // EVAL runs the source wherever the key is served, and leaves it in that cache
            let evals: Vec<(u32, redis::Cmd)> = again
                .iter()
                .map(|&i| {
                    let (s, c) = &cmds[i];
                    (*s, super::scripts::as_eval(c, &SHARD_LEASE.source))
                })
                .collect();
            let evaled = self.conn.exec_each_within(&evals, bound).await?;
            for (i, r) in again.into_iter().zip(evaled) {
                replies[i] = r;
            }
        }
        Ok(replies
            .into_iter()
            .map(|r| parse_lease(name, &r?))
            .collect())
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
    /// `layout`) is alive for `ttl_ms` (call on core instance 0). It does not say how the node
    /// owns shards (a tool's heartbeat; the service's say it: [`LogStore::beat`], ADR-0131).
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
    /// [`Error::NodeIdInUse`] and nothing written (ADR-0114). It does not say how the node
    /// obtains its shards ([`LogStore::beat`] does).
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
        self.beat(&Beat {
            id,
            ttl_ms,
            url,
            role,
            layout,
            unreached,
            incarnation,
            ownership: None,
        })
        .await
    }

    /// Records that node `b.id` is alive for `b.ttl_ms`, with everything `b` says about it;
    /// Redis time of the heartbeat (call on core instance 0). While a live record of the id
    /// has another incarnation: [`Error::NodeIdInUse`], nothing written (ADR-0114).
    pub async fn beat(&mut self, b: &Beat<'_>) -> Result<u64> {
        check_node_id(b.id)?;
        let unreached: Vec<String> = b.unreached.iter().map(usize::to_string).collect();
        let (ownership, owns) = b.ownership.map_or(("", String::new()), Ownership::to_args);
        let id = b.id;
        let now: u64 = NODE_HEARTBEAT
            .key(keys::NODES)
            .key(format!("{}{id}", keys::NODE_PREFIX))
            .arg(id)
            .arg(b.ttl_ms)
            .arg(b.url)
            .arg(b.role)
            .arg(b.layout.as_str())
            .arg(crate::deployment::VERSION_CURRENT)
            .arg(unreached.join(","))
            .arg(b.incarnation)
            .arg(ownership)
            .arg(owns)
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
        for rec in v[1..].chunks(9) {
            let [id, url, role, Value::Int(beat), layout, reads, unreached, ownership, owns] = rec
            else {
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
                ownership: Ownership::from_fields(&text(ownership)?, &text(owns)?),
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

    /// ADR-0131: a static owner's shards go to the registry as ranges and come back as the
    /// same set; what does not parse is left out; a mode not said (or unknown) is `None`.
    #[test]
    fn ownership_round_trips_as_ranges() {
        let o = Ownership::owning(&[7, 0, 1, 2, 3, 9, 8, 2, u32::MAX]);
        let (mode, owns) = o.to_args();
        assert_eq!((mode, owns.as_str()), ("static", "0-3,7-9,4294967295"));
        assert_eq!(Ownership::from_fields(mode, &owns), Some(o.clone()));
        for s in [0, 3, 8, u32::MAX] {
            assert!(o.owns_statically(s), "{s}");
        }
        for s in [4, 6, 10] {
            assert!(!o.owns_statically(s), "{s}");
        }
        assert_eq!(
            Ownership::from_fields("static", "x,5-3,2,4-"),
            Some(Ownership::Static {
                shards: vec![2..=2]
            })
        );
        assert_eq!(
            Ownership::from_fields("static", ""),
            Some(Ownership::owning(&[]))
        );
        assert_eq!(Ownership::Leases.to_args(), ("leases", String::new()));
        assert_eq!(
            Ownership::from_fields("leases", ""),
            Some(Ownership::Leases)
        );
        assert!(!Ownership::Leases.owns_statically(0));
        assert_eq!(Ownership::from_fields("", ""), None);
        assert_eq!(Ownership::from_fields("elected", "1"), None);
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
