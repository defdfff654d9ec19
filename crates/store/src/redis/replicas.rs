//! Replica waits (ADR-0032): what must be on replicas before it counts.
//!
//! Redis replicates asynchronously; `WAIT n timeout` blocks the connection that sent writes
//! until `n` replicas acknowledged every write sent on it before, and answers how many did.
//! Two uses:
//!
//! - a commit is acknowledged (`send_ack`) only once on `--core-wait-replicas` replicas. The
//!   gateway's commits share one multiplexed connection per node, and a `WAIT` blocks that
//!   connection while it waits, so one `WAIT` per commit would serialise every commit behind a
//!   replica round trip. [`ReplicaConfirm`] groups them instead: per shard (one slot, one
//!   node) at most one `WAIT` is in flight, and it confirms every commit whose reply came
//!   before it was sent — a group commit of confirmations;
//! - the materializer trims a shard's core log only below a W confirmed on
//!   `--mailbox-wait-replicas` replicas ([`with_wait`] after a read of `wm:{s}`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Value;

use crate::endpoint::Conn;
use crate::error::{Error, Result};

/// How a write is confirmed on replicas: `WAIT replicas timeout` after it, on the connection
/// to the primary that took it (ADR-0032).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas that must have the write.
    pub replicas: u32,
    /// How long `WAIT` may block.
    pub timeout: Duration,
}

/// What an operator asks for (`--core-wait-replicas`, `--mailbox-wait-replicas`): a replica
/// count, or `None` for the default — 1 on a Redis Cluster that has replicas, 0 otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Replicas to wait for; `None`: the default.
    pub replicas: Option<u32>,
    /// How long one `WAIT` may block.
    pub timeout: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            replicas: None,
            timeout: Duration::from_secs(1),
        }
    }
}

impl WaitPolicy {
    /// The wait in force on `conn`'s deployment (`None`: no wait).
    pub async fn resolve(&self, conn: &mut Conn) -> Result<Option<ReplicaWait>> {
        let replicas = match self.replicas {
            Some(n) => n,
            None if conn.is_cluster() && has_replicas(conn).await? => 1,
            None => 0,
        };
        Ok((replicas > 0).then_some(ReplicaWait {
            replicas,
            timeout: self.timeout,
        }))
    }
}

/// Whether the deployment behind `conn` has replicas: on a cluster, any node of `CLUSTER
/// NODES` flagged `slave`; on one instance, `connected_slaves` above 0.
pub async fn has_replicas(conn: &mut Conn) -> Result<bool> {
    if conn.is_cluster() {
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
        return Ok(nodes.lines().any(|l| {
            l.split(' ')
                .nth(2)
                .is_some_and(|f| f.split(',').any(|x| x == "slave"))
        }));
    }
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("connected_slaves:"))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 0))
}

/// Runs `cmds` (keyed commands of one slot) followed by `WAIT` on the same connection — one
/// pipeline, so on a cluster all go to the primary of that slot — checks the replica count
/// and returns the replies of `cmds`. The `WAIT` covers only what this connection wrote: one
/// of `cmds` should be a write (ADR-0063).
pub(crate) async fn with_wait(
    conn: &mut impl redis::aio::ConnectionLike,
    cmds: &[redis::Cmd],
    wait: ReplicaWait,
) -> std::result::Result<Vec<Value>, WaitError> {
    let mut pipe = redis::pipe();
    for c in cmds {
        pipe.add_command(c.clone());
    }
    pipe.cmd("WAIT")
        .arg(wait.replicas)
        .arg(wait.timeout.as_millis() as u64);
    let mut v: Vec<Value> = pipe.query_async(conn).await.map_err(WaitError::Redis)?;
    let n = match v.pop() {
        Some(Value::Int(n)) if v.len() == cmds.len() => u32::try_from(n).unwrap_or(0),
        other => {
            return Err(WaitError::Redis(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "unexpected WAIT reply",
                format!("{other:?}"),
            ))))
        }
    };
    // (a command refused inside the pipeline fails the whole pipeline in redis-rs: a marker
    // write that failed never lets the `WAIT` that covers nothing of it confirm anything)
    if n < wait.replicas {
        return Err(WaitError::Short);
    }
    Ok(v)
}

/// Which connection a command ran on, from `CLIENT INFO`: its id on the server, its address
/// (our end) and the server's address (`laddr`). `WAIT` confirms only the writes made on the
/// connection it runs on, and redis-rs' cluster client may run a command again on a new
/// connection after the first one dropped (ADR-0063): a commit counts as confirmed only by
/// a `WAIT` that ran on the connection the commit ran on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConnId(String);

/// `CLIENT INFO`, pipelined after a command to learn which connection ran it.
pub(crate) fn client_info() -> redis::Cmd {
    let mut c = redis::cmd("CLIENT");
    c.arg("INFO");
    c
}

/// The [`ConnId`] in a `CLIENT INFO` reply; `None` when it does not name one.
pub(crate) fn conn_id(info: &Value) -> Option<ConnId> {
    let text = match info {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?,
        Value::SimpleString(s) => s.as_str(),
        Value::VerbatimString { text, .. } => text.as_str(),
        _ => return None,
    };
    let field = |name: &str| {
        text.split_ascii_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    let (id, addr, laddr) = (field("id")?, field("addr")?, field("laddr")?);
    Some(ConnId(format!("{id} {addr} {laddr}")))
}

/// A failed [`with_wait`]: the command or the pipeline failed, or the command ran but too
/// few replicas confirmed what came before.
pub(crate) enum WaitError {
    Redis(redis::RedisError),
    Short,
}

/// Group confirmation of commits on replicas: per shard, at most one `WAIT` in flight; a
/// commit whose reply has arrived waits for the first `WAIT` *sent after* that moment (it
/// covers every earlier write on the connection), leading one itself when none is pending.
/// Cheap to clone (shared).
#[derive(Clone, Default)]
pub(crate) struct ReplicaConfirm {
    shards: Arc<Mutex<HashMap<u32, Arc<Group>>>>,
}

#[derive(Default)]
struct Group {
    state: Mutex<GroupState>,
    done: tokio::sync::Notify,
}

#[derive(Default)]
struct GroupState {
    /// Generation the next `WAIT` sent will have.
    next: u64,
    /// A `WAIT` is in flight.
    in_flight: bool,
    /// The last finished generation and what it answered (replicas and the connection it
    /// ran on, or the error's text).
    last: Option<(u64, WaitAnswer)>,
}

impl ReplicaConfirm {
    /// Waits until everything written on `conn` for `shard` so far is on `wait.replicas`
    /// replicas: `Ok(())`, or [`Error::NotReplicated`] / the `WAIT`'s own failure. `ran_on`:
    /// the connections the writes to confirm ran on; a `WAIT` that ran on another one (or
    /// an unknown one) confirms nothing of them (ADR-0063).
    pub(crate) async fn confirm(
        &self,
        conn: &Conn,
        shard: u32,
        wait: ReplicaWait,
        ran_on: &[Option<ConnId>],
    ) -> Result<()> {
        let group = self
            .shards
            .lock()
            .expect("not poisoned")
            .entry(shard)
            .or_default()
            .clone();
        let need;
        {
            let st = group.state.lock().expect("not poisoned");
            need = st.next;
        }
        loop {
            let notified = group.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let lead = {
                let mut st = group.state.lock().expect("not poisoned");
                if let Some((g, r)) = &st.last {
                    if *g >= need {
                        return verdict(shard, wait, r.clone(), ran_on);
                    }
                }
                if st.in_flight {
                    None
                } else {
                    st.in_flight = true;
                    let g = st.next;
                    st.next += 1;
                    Some(g)
                }
            };
            match lead {
                Some(g) => {
                    // dropped before the WAIT answers (a commit cancelled, or a panic beside
                    // it in the same round): the lead passes to a waiter
                    let lead = Lead { group: &group };
                    let r = send_wait(conn, shard, wait).await;
                    lead.answer(g, r.clone());
                    // g >= need: the WAIT was sent after our write's reply
                    return verdict(shard, wait, r, ran_on);
                }
                None => notified.await,
            }
        }
    }
}

/// The `WAIT` in flight of a [`Group`], held by the confirm that sent it. Its drop frees the
/// group for the next `WAIT` and wakes the waiters, after its answer was recorded or without
/// one (then one of the waiters sends the next `WAIT`). Without that, a leader dropped while its `WAIT` blocked
/// left `in_flight` set for good, and every later commit of the shard waited for a `WAIT`
/// nobody would send: sends never answered, with `/healthz` green.
struct Lead<'a> {
    group: &'a Group,
}

impl Lead<'_> {
    /// Records the answer of `WAIT` generation `g`; the drop that follows frees the group and
    /// wakes the waiters.
    fn answer(self, g: u64, r: WaitAnswer) {
        self.group.state.lock().expect("not poisoned").last = Some((g, r));
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        // a poisoned lock (a panic while it was held) is still freed: nothing it guards is
        // left half written by the lines that take it
        self.group
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight = false;
        self.group.done.notify_waiters();
    }
}

/// What a `WAIT` answered: how many replicas, and the connection it ran on; or why it failed.
type WaitAnswer = std::result::Result<(u32, Option<ConnId>), String>;

fn verdict(shard: u32, wait: ReplicaWait, r: WaitAnswer, ran_on: &[Option<ConnId>]) -> Result<()> {
    match r {
        Ok((n, at)) if ran_on.iter().any(|c| c.is_none() || *c != at) => {
            // the WAIT ran on another connection than a write it should confirm (redis-rs
            // ran it again on a new connection, after a drop or a failover): there it
            // answers at once, knowing nothing of those writes
            tracing::warn!(
                shard,
                replicas = n,
                "replica WAIT ran on another connection than the commit; not confirmed"
            );
            Err(Error::NotReplicated {
                shard,
                replicas: 0,
                wanted: wait.replicas,
            })
        }
        Ok((n, _)) if n >= wait.replicas => Ok(()),
        Ok((n, _)) => Err(Error::NotReplicated {
            shard,
            replicas: n,
            wanted: wait.replicas,
        }),
        Err(e) => Err(Error::Redis(redis::RedisError::from((
            redis::ErrorKind::Io,
            "WAIT failed",
            e,
        )))),
    }
}

/// `WAIT replicas timeout` on the connection to `shard`'s primary (on a cluster, routed to
/// the node serving the shard's slot, through the connection the commits went by), with
/// `CLIENT INFO` behind it in one pipeline: the connection it ran on.
async fn send_wait(conn: &Conn, shard: u32, wait: ReplicaWait) -> WaitAnswer {
    let mut pipe = redis::pipe();
    pipe.cmd("WAIT")
        .arg(wait.replicas)
        .arg(wait.timeout.as_millis() as u64)
        .add_command(client_info());
    let r: redis::RedisResult<Vec<Value>> = match conn.clone() {
        Conn::Single(mut c) => pipe.query_async(&mut c).await,
        Conn::Cluster(mut c) => {
            use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
            let slot = crate::endpoint::key_slot(crate::keys::dlog(shard).as_bytes());
            c.route_pipeline(
                pipe,
                0,
                2,
                SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
            )
            .await
        }
    };
    match r.as_deref() {
        Ok([Value::Int(n), info]) => Ok((u32::try_from(*n).unwrap_or(0), conn_id(info))),
        Ok(v) => Err(format!("unexpected WAIT reply {v:?}")),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let w = ReplicaWait {
            replicas: 1,
            timeout: Duration::from_millis(10),
        };
        let here = conn_id(&Value::BulkString(
            b"id=7 addr=127.0.0.1:50000 laddr=127.0.0.1:7000 fd=9 name= age=1\n".to_vec(),
        ));
        assert_eq!(
            here,
            Some(ConnId("7 127.0.0.1:50000 127.0.0.1:7000".into()))
        );
        let ran = [here.clone()];
        assert!(verdict(3, w, Ok((1, here.clone())), &ran).is_ok());
        assert!(matches!(
            verdict(3, w, Ok((0, here.clone())), &ran),
            Err(Error::NotReplicated {
                shard: 3,
                replicas: 0,
                wanted: 1
            })
        ));
        assert!(verdict(3, w, Err("x".into()), &ran).is_err());
        // a WAIT on another connection (same id on another node, or a new connection)
        // confirms nothing, however many replicas it counts
        let elsewhere = conn_id(&Value::BulkString(
            b"id=7 addr=127.0.0.1:50000 laddr=127.0.0.1:7001".to_vec(),
        ));
        assert!(verdict(3, w, Ok((2, elsewhere)), &ran).is_err());
        assert!(verdict(3, w, Ok((2, None)), &ran).is_err());
        assert!(verdict(3, w, Ok((2, here.clone())), &[here, None]).is_err());
        // a reply that names no connection
        assert_eq!(conn_id(&Value::BulkString(b"id=7 addr=x".to_vec())), None);
    }
}
