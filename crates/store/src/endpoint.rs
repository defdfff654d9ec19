//! Where a pool's Redis lives — one instance, or a Redis Cluster — and [`Conn`], the one
//! connection type every store uses for both (ADR-0032).
//!
//! An *endpoint* is the string a topology holds for one instance of a pool:
//!
//! ```text
//! redis://[:password@]host:port/                      one Redis instance
//! cluster:redis://[:pw@]h1:p1/,redis://[:pw@]h2:p2/   a Redis Cluster, by its seed nodes
//! ```
//!
//! A cluster is *one* instance of its pool: every key of a shard carries the hash tag `{s}`,
//! so each script and each per-shard pipeline touches one slot, and the cluster client routes
//! it to the primary that serves the slot (following MOVED and ASK, retrying TRYAGAIN and
//! CLUSTERDOWN with backoff). What must differ is kept here or next to its one caller:
//!
//! - pipelines that span shards are split per shard ([`Conn::exec_each`]), since a cluster
//!   refuses a pipeline whose keys fall in several slots;
//! - `SCRIPT LOAD` reaches every node of a cluster (redis-rs routes it to all nodes), so a
//!   promoted replica already has the scripts; NOSCRIPT is still handled by every caller;
//! - a blocking `XREAD` cannot name the logs of several shards (several slots): the log reader
//!   in cluster mode reads per shard and waits on sharded Pub/Sub hints instead
//!   ([`crate::redis::dlog::LogReader`]);
//! - wake hints use `SPUBLISH`/`SSUBSCRIBE` ([`crate::wake`]).

use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Arg, Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::error::Result;

/// Most commands in one pipeline of [`Conn::exec_each`] on one instance: a longer list goes
/// as several pipelines handed to the connection one after another, so that Redis starts
/// on the first while the rest are encoded.
pub const PIPELINE_CHUNK: usize = 512;

/// Longest wait for one shard's commands on a Redis Cluster where a caller bounds it
/// ([`Conn::exec_each_within`], [`Conn::shard_bound`]; the mailbox store does, ADR-0124).
/// They answer in milliseconds; a group that takes this long is on a node that hangs or is
/// gone (the client retries a refused connection for about 10 s, and a hung node's answer
/// never comes before the 30 s response timeout), and it must not hold up the shards of the
/// other nodes. Its commands are then answered an error ([`unanswered`]): their outcome is
/// unknown (a write may have been applied), never a success.
pub const SHARD_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The error of a command whose shard's node did not answer within `bound`: a timeout
/// ([`::redis::RedisError::is_timeout`]), whose outcome is unknown.
pub fn unanswered(bound: Duration) -> ::redis::RedisError {
    ::redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the shard's node did not answer within {bound:?}: the outcome of the command is \
             unknown"
        ),
    ))
}

/// `fut` given at most `bound` (none: as long as it takes); past it, [`unanswered`].
pub async fn within<T>(
    bound: Option<Duration>,
    fut: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    match bound {
        None => fut.await,
        Some(t) => tokio::time::timeout(t, fut)
            .await
            .unwrap_or_else(|_| Err(unanswered(t))),
    }
}

/// The prefix that marks a cluster endpoint.
pub const CLUSTER_PREFIX: &str = "cluster:";

/// The endpoint string of a cluster given its seed node URLs.
pub fn cluster_endpoint<S: AsRef<str>>(seeds: &[S]) -> String {
    let seeds: Vec<&str> = seeds.iter().map(|s| s.as_ref()).collect();
    format!("{CLUSTER_PREFIX}{}", seeds.join(","))
}

/// The seed URLs of a cluster endpoint; `None` for a single instance.
pub fn cluster_seeds(endpoint: &str) -> Option<Vec<&str>> {
    endpoint.strip_prefix(CLUSTER_PREFIX).map(|rest| {
        rest.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    })
}

/// Whether `endpoint` names a Redis Cluster.
pub fn is_cluster(endpoint: &str) -> bool {
    endpoint.starts_with(CLUSTER_PREFIX)
}

/// `HOST:PORT` or a URL → a `redis://` URL carrying `password` when the item has none.
/// For `--core-cluster 127.0.0.1:7001,…` style lists.
pub fn seed_url(item: &str, password: Option<&str>) -> String {
    if item.contains("://") {
        return item.to_string();
    }
    match password {
        Some(p) => format!("redis://:{p}@{item}/"),
        None => format!("redis://{item}/"),
    }
}

/// The Redis hash slot of `key` (CRC16/XMODEM mod 16384, honouring a `{hash tag}`), as Redis
/// Cluster computes it. Used to group commands per slot and in tests.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16_xmodem(tagged) % 16384
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Timeouts of a store connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    /// Longest wait for one reply (`None`: no limit, for blocking reads).
    pub response_timeout: Option<Duration>,
    /// Longest wait for a TCP connection.
    pub connection_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            response_timeout: Some(Duration::from_secs(30)),
            connection_timeout: Duration::from_secs(5),
        }
    }
}

/// A multiplexed, self-reconnecting connection to one Redis instance or to a Redis Cluster.
/// Cloning shares the underlying connection(s).
#[derive(Clone)]
pub enum Conn {
    /// One instance (reconnects by itself).
    Single(ConnectionManager),
    /// A cluster: one connection per node, commands routed by slot.
    Cluster(ClusterConnection),
}

/// Connects to `endpoint` (a URL, or a cluster endpoint).
pub async fn connect(endpoint: &str, opts: ConnectOptions) -> Result<Conn> {
    match cluster_seeds(endpoint) {
        None => {
            let client = ::redis::Client::open(endpoint)?;
            let cfg = ::redis::aio::ConnectionManagerConfig::new()
                .set_response_timeout(opts.response_timeout)
                .set_connection_timeout(Some(opts.connection_timeout))
                .set_number_of_retries(3);
            Ok(Conn::Single(
                ConnectionManager::new_with_config(client, cfg).await?,
            ))
        }
        Some(seeds) => {
            let mut b = cluster_builder(&seeds).connection_timeout(opts.connection_timeout);
            if let Some(t) = opts.response_timeout {
                b = b.response_timeout(t);
            }
            Ok(Conn::Cluster(b.build()?.get_async_connection().await?))
        }
    }
}

/// A cluster client builder with the retry policy every cluster connection uses: MOVED/ASK
/// are followed, TRYAGAIN/CLUSTERDOWN/LOADING retried with backoff (up to about 10 s, long
/// enough to ride out a failover with a small `cluster-node-timeout`).
pub(crate) fn cluster_builder(seeds: &[&str]) -> ::redis::cluster::ClusterClientBuilder {
    ::redis::cluster::ClusterClientBuilder::new(seeds.iter().map(|s| s.to_string()))
        .retries(12)
        .min_retry_wait(20)
        .max_retry_wait(1_000)
}

/// The slot of the first key of an `EVALSHA` or `EVAL` command; `None` for another command
/// or one without keys.
fn first_key_slot(cmd: &Cmd) -> Option<u16> {
    let mut args = cmd.args_iter();
    let Arg::Simple(name) = args.next()? else {
        return None;
    };
    if !name.eq_ignore_ascii_case(b"EVALSHA") && !name.eq_ignore_ascii_case(b"EVAL") {
        return None;
    }
    args.next()?; // the SHA-1 or the body
    let Arg::Simple(n) = args.next()? else {
        return None;
    };
    let n: usize = std::str::from_utf8(n).ok()?.parse().ok()?;
    if n == 0 {
        return None;
    }
    match args.next()? {
        Arg::Simple(key) => Some(key_slot(key)),
        _ => None,
    }
}

impl Conn {
    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }

    /// The bound of one shard's call for a caller that keeps a node's failure to that node's
    /// shards (ADR-0124): [`SHARD_CALL_TIMEOUT`] on a cluster; `None` on one instance, where
    /// every shard is on the one server and the connection's response timeout applies.
    pub fn shard_bound(&self) -> Option<Duration> {
        self.is_cluster().then_some(SHARD_CALL_TIMEOUT)
    }

    /// `SCRIPT LOAD` of each of `sources` where `cmd` (a script call) runs; their SHA-1s, in
    /// order. One instance: there. A cluster: on the primary that serves the slot of `cmd`'s
    /// first key only (on every node when it has none, or for `None`), not on every node as redis-rs routes
    /// a plain `SCRIPT LOAD`: a node that hangs or is gone elsewhere in the cluster must not
    /// hold up a primary that lost its script cache (a promoted replica, a restarted node).
    /// A slot that moved meanwhile is followed like any command (MOVED).
    pub async fn load_scripts_for(
        &mut self,
        cmd: Option<&Cmd>,
        sources: &[&str],
    ) -> RedisResult<Vec<String>> {
        let loads = sources.iter().map(|src| {
            let mut c = ::redis::cmd("SCRIPT");
            c.arg("LOAD").arg(*src);
            c
        });
        match self {
            Conn::Single(c) => {
                let mut pipe = ::redis::pipe();
                for l in loads {
                    pipe.add_command(l);
                }
                pipe.query_async(c).await
            }
            Conn::Cluster(c) => {
                let routing = cmd.and_then(first_key_slot).map(|slot| {
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                        slot,
                        SlotAddr::Master,
                    )))
                });
                let mut out = Vec::with_capacity(sources.len());
                for l in loads {
                    let v = match &routing {
                        Some(r) => c.route_command(l, r.clone()).await?,
                        None => l.query_async::<Value>(c).await?,
                    };
                    out.push(::redis::from_redis_value(v)?);
                }
                Ok(out)
            }
        }
    }

    /// Runs `cmds`, each tagged with the shard whose keys it touches, and returns one result
    /// per command in the given order. One instance: one pipeline, or for more than
    /// [`PIPELINE_CHUNK`] commands several, handed to the connection in order; the outer
    /// error is the connection failing. A cluster: one pipeline per shard (one slot each),
    /// run concurrently; the commands of one shard keep their order, which is the only order
    /// the callers rely on. A shard's pipeline that fails as a whole (its node refuses the
    /// connection, the response timeout) is an error for each of its commands alone
    /// (ADR-0124): the other shards' results are returned as they came, and there is no
    /// outer error. (Before, the first such failure failed the whole call, though the other
    /// nodes had run their commands.) [`Self::exec_each_within`] also bounds the wait.
    pub async fn exec_each(&mut self, cmds: &[(u32, Cmd)]) -> RedisResult<Vec<RedisResult<Value>>> {
        self.exec_each_within(cmds, None).await
    }

    /// [`Self::exec_each`], each shard's pipeline on a cluster given at most `bound`: past
    /// it, each of that shard's commands is answered [`unanswered`] (outcome unknown: a
    /// write may have been applied; never a success), while the other shards' results are
    /// returned. A node that hangs (SIGSTOP, a host gone without a reset) or is gone then
    /// holds the call up `bound` at most, where it held it up for the client's response
    /// timeout (30 s) or its reconnection retries (about 10 s), and failed it as a whole
    /// (ADR-0124). `bound` is ignored on one instance (all shards are on that server).
    pub async fn exec_each_within(
        &mut self,
        cmds: &[(u32, Cmd)],
        bound: Option<Duration>,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        match self {
            Conn::Single(c) => {
                if cmds.len() <= PIPELINE_CHUNK {
                    let mut pipe = ::redis::pipe();
                    pipe.ignore_errors();
                    for (_, cmd) in cmds {
                        pipe.add_command(cmd.clone());
                    }
                    return pipe.query_async(c).await;
                }
                // Several pipelines on the one connection, each handed to it in order before
                // any is awaited: Redis starts on the first while the next are encoded, and
                // the replies are read while it works on the rest (one connection keeps the
                // order of what it was handed).
                let mut runs: Vec<_> = cmds
                    .chunks(PIPELINE_CHUNK)
                    .map(|chunk| {
                        let mut conn = c.clone();
                        let mut pipe = ::redis::pipe();
                        pipe.ignore_errors();
                        for (_, cmd) in chunk {
                            pipe.add_command(cmd.clone());
                        }
                        Box::pin(futures::future::maybe_done(async move {
                            pipe.query_async::<Vec<RedisResult<Value>>>(&mut conn).await
                        }))
                    })
                    .collect();
                for run in runs.iter_mut() {
                    // the first poll hands the pipeline to the connection
                    let _ = futures::poll!(run.as_mut());
                }
                futures::future::join_all(runs.iter_mut().map(|r| r.as_mut())).await;
                let mut out = Vec::with_capacity(cmds.len());
                for run in runs.iter_mut() {
                    out.extend(run.as_mut().take_output().expect("joined")?);
                }
                Ok(out)
            }
            Conn::Cluster(c) => {
                let mut groups: Vec<(u32, Vec<usize>)> = Vec::new();
                for (i, (shard, _)) in cmds.iter().enumerate() {
                    match groups.iter_mut().find(|(s, _)| s == shard) {
                        Some((_, idx)) => idx.push(i),
                        None => groups.push((*shard, vec![i])),
                    }
                }
                let runs = groups.iter().map(|(_, idx)| {
                    let mut conn = c.clone();
                    within(bound, async move {
                        let mut pipe = ::redis::pipe();
                        pipe.ignore_errors();
                        for &i in idx {
                            pipe.add_command(cmds[i].1.clone());
                        }
                        let replies = pipe
                            .query_async::<Vec<RedisResult<Value>>>(&mut conn)
                            .await?;
                        if !replies
                            .iter()
                            .any(|r| matches!(r, Err(e) if is_redirect(e)))
                        {
                            return Ok(replies);
                        }
                        // The slot moved (or is moving) under the pipeline: send the group
                        // again one command at a time, in order, so each gets the client's
                        // MOVED/ASK/TRYAGAIN handling. Every command the stores pipeline
                        // is a CAS, idempotent or a read, so repeating one that applied is
                        // a replay.
                        let mut out = Vec::with_capacity(idx.len());
                        for &i in idx {
                            out.push(cmds[i].1.query_async::<Value>(&mut conn).await);
                        }
                        Ok::<_, ::redis::RedisError>(out)
                    })
                });
                let replies = futures::future::join_all(runs).await;
                let mut out: Vec<Option<RedisResult<Value>>> =
                    (0..cmds.len()).map(|_| None).collect();
                for ((_, idx), reply) in groups.iter().zip(replies) {
                    match reply {
                        Ok(reply) => {
                            for (&i, r) in idx.iter().zip(reply) {
                                out[i] = Some(r);
                            }
                        }
                        // this shard's node failed or did not answer: its commands alone
                        Err(e) => {
                            for &i in idx {
                                out[i] = Some(Err(e.clone()));
                            }
                        }
                    }
                }
                // a command left without a reply is an error, never taken for a success
                Ok(out
                    .into_iter()
                    .map(|r| {
                        r.unwrap_or_else(|| {
                            Err(::redis::RedisError::from((
                                ::redis::ErrorKind::Client,
                                "no reply for the command in its shard's pipeline",
                            )))
                        })
                    })
                    .collect())
            }
        }
    }
}

/// A sharded Pub/Sub subscription on a cluster (`SSUBSCRIBE`, one channel per call: each
/// channel hashes to its own slot). Pushes arrive on `rx`; a [`PushKind::Disconnection`]
/// there means a node connection dropped and hints may have been lost (the client
/// resubscribes by itself, but the caller must re-check what it waits for).
///
/// [`PushKind::Disconnection`]: ::redis::PushKind::Disconnection
pub(crate) struct ShardedSub {
    /// The connection (kept for pings and to keep the subscription alive).
    pub conn: ClusterConnection,
    /// Pushes: `smessage` (channel, payload), subscription confirmations, disconnections.
    pub rx: tokio::sync::mpsc::UnboundedReceiver<::redis::PushInfo>,
}

impl ShardedSub {
    /// Connects to the cluster at `endpoint` with RESP3 and subscribes to `channels`.
    pub async fn connect(endpoint: &str, channels: &[String]) -> Result<ShardedSub> {
        let seeds = cluster_seeds(endpoint).ok_or_else(|| {
            crate::Error::InvalidArgument(format!(
                "{} is not a cluster endpoint",
                crate::redact_url(endpoint)
            ))
        })?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let client = cluster_builder(&seeds)
            .connection_timeout(Duration::from_secs(5))
            .response_timeout(Duration::from_secs(5))
            .use_protocol(::redis::ProtocolVersion::RESP3)
            .push_sender(tx)
            .build()?;
        let mut conn = client.get_async_connection().await?;
        for ch in channels {
            conn.ssubscribe(ch).await?;
        }
        Ok(ShardedSub { conn, rx })
    }
}

/// The channel and payload of a sharded Pub/Sub message (`smessage`); `None` for any other
/// push.
pub(crate) fn smessage(push: &::redis::PushInfo) -> Option<(String, &[u8])> {
    if push.kind != ::redis::PushKind::SMessage {
        return None;
    }
    match (push.data.first(), push.data.get(1)) {
        (Some(Value::BulkString(ch)), Some(Value::BulkString(payload))) => {
            Some((String::from_utf8_lossy(ch).into_owned(), payload.as_slice()))
        }
        _ => None,
    }
}

/// A reply that says the command went to the wrong node or met a slot on the move.
fn is_redirect(e: &::redis::RedisError) -> bool {
    matches!(
        e.code(),
        Some("MOVED") | Some("ASK") | Some("TRYAGAIN") | Some("CLUSTERDOWN")
    )
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis_cluster() {
        // values from the Redis Cluster specification and CLUSTER KEYSLOT
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"wm:{7}"), key_slot(b"dlog:{7}"));
        // an empty tag hashes the whole key
        assert_eq!(key_slot(b"foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % 16384);
    }

    #[test]
    fn endpoints() {
        let e = cluster_endpoint(&["redis://a:1/", "redis://b:2/"]);
        assert!(is_cluster(&e));
        assert_eq!(
            cluster_seeds(&e).unwrap(),
            vec!["redis://a:1/", "redis://b:2/"]
        );
        assert_eq!(cluster_seeds("redis://a:1/"), None);
        assert_eq!(
            seed_url("127.0.0.1:7001", Some("pw")),
            "redis://:pw@127.0.0.1:7001/"
        );
        assert_eq!(seed_url("redis://x:1/", Some("pw")), "redis://x:1/");
    }
}
