//! Redis key names. Every key of a shard carries the hash tag `{s}`, so each script touches
//! one slot and the same layout runs on standalone Redis and on Redis Cluster.
//!
//! ```text
//! mailbox Redis (materialize side)          core Redis (commit side)
//!   wm:{s}           hash  watermark [ADR]    dlog:{s}           stream  dispatch log, ids "<offset>-0"
//!   mb:{s}:<user>    zset  mailbox entries    head:{s}           string  last assigned offset
//!   ack:{s}          hash  user -> acked seq  dd:{s}:<n>:<sender><client id>  string  "<offset>:<digest>" (dedupe, TTL)
//!                                             msgid:{h}:<n>:<sender><client id>  string  digest, or "<offset>:<digest>"
//!                                                                 (h: sender's shard, TTL; ADR-0040)
//!   stg:{s}:<o>      hash  lanes durable of o             dlogwake:{s}  sharded channel: commit hint (cluster only)
//!                                             dlogsync:{s}  string  last offset a log read had confirmed
//!                                                                 (with a core replica wait only; ADR-0064)
//!   stgidx:{s}       zset  offsets with staging
//!   owner:{s}        string epoch of the live owner (PX, refreshed every second)
//!   wmsync:{s}       string W last confirmed for a log trim (with a replica wait only)
//!   wake:{s}         pub/sub channel (hint)
//!
//! core Redis, coordination (ADR-0030)
//!   lease:{s}              string  node id owning shard s (PX; on the shard's core instance)
//!   {tidemark}:nodes       zset    node id -> Redis ms its record expires (instance 0)
//!   {tidemark}:node:<id>   hash    url, role, beat (PX; instance 0)
//! ```
//!
//! In the dedupe key, `<n>` is the sender's length in bytes, in decimal: the prefix makes the
//! key unambiguous, no two (sender, client id) pairs share one. The earlier form
//! `dd:{s}:<sender>\0<client id>` was ambiguous (`a\0b`+`c` and `a`+`b\0c` met); it is still
//! read, never written, for the 24 h its records live (ADR-0022).
//!
//! In a deployment of identity version 2 (ADR-0040), a one-shard send whose commit claims its
//! id writes no `dd:` record: its claim `msgid:` holds `"<offset>:<digest>"` and is the
//! dedupe record. A send to several shards still claims the bare digest first and writes a
//! `dd:` record per shard.

/// A shard-tagged key not yet written out: `<prefix>{<shard>}` and then its tail. The layout
/// of every such key is here once, and a key is either made a `String` ([`Key::into_string`])
/// or written straight into a redis-rs command's buffer as an argument (its [`ToRedisArgs`]):
/// the keys a commit call and a hot-path call name per message then need no `String` of
/// their own (ADR-0082). Both give the same bytes (tested).
///
/// [`ToRedisArgs`]: redis::ToRedisArgs
#[derive(Clone, Copy, Debug)]
pub struct Key<'a> {
    prefix: &'static str,
    shard: u32,
    tail: Tail<'a>,
}

/// What follows `<prefix>{<shard>}`.
#[derive(Clone, Copy, Debug)]
enum Tail<'a> {
    None,
    /// `:<s>`
    Colon(&'a str),
    /// `:<n>:<sender><client id>`, n the sender's length in bytes (decimal)
    Sender {
        sender: &'a str,
        client_id: &'a str,
    },
    /// `:<sender>\0<client id>` (the legacy dedupe form)
    Legacy {
        sender: &'a str,
        client_id: &'a str,
    },
}

impl<'a> Key<'a> {
    const fn new(prefix: &'static str, shard: u32, tail: Tail<'a>) -> Self {
        Key {
            prefix,
            shard,
            tail,
        }
    }

    /// Hands the key's bytes to `f`, piece by piece, in order.
    fn pieces(&self, mut f: impl FnMut(&[u8])) {
        let mut n = itoa::Buffer::new();
        f(self.prefix.as_bytes());
        f(b"{");
        f(n.format(self.shard).as_bytes());
        f(b"}");
        match self.tail {
            Tail::None => {}
            Tail::Colon(t) => {
                f(b":");
                f(t.as_bytes());
            }
            Tail::Sender { sender, client_id } => {
                f(b":");
                f(n.format(sender.len()).as_bytes());
                f(b":");
                f(sender.as_bytes());
                f(client_id.as_bytes());
            }
            Tail::Legacy { sender, client_id } => {
                f(b":");
                f(sender.as_bytes());
                f(b"\0");
                f(client_id.as_bytes());
            }
        }
    }

    /// The key's length in bytes.
    fn len(&self) -> usize {
        let mut len = 0;
        self.pieces(|p| len += p.len());
        len
    }

    /// The key as a `String`, in one allocation of its length.
    pub fn into_string(self) -> String {
        let mut k = Vec::with_capacity(self.len());
        self.pieces(|p| k.extend_from_slice(p));
        // the pieces are the prefix, ASCII, decimal digits and whole `&str`s
        String::from_utf8(k).expect("a key is UTF-8")
    }

    /// `wm:{s}` ([`wm`]).
    pub const fn wm(shard: u32) -> Self {
        Key::new("wm:", shard, Tail::None)
    }

    /// `mb:{s}:<user>` ([`mailbox`]).
    pub const fn mailbox(shard: u32, user: &'a str) -> Self {
        Key::new("mb:", shard, Tail::Colon(user))
    }

    /// `ack:{s}` ([`acks`]).
    pub const fn acks(shard: u32) -> Self {
        Key::new("ack:", shard, Tail::None)
    }

    /// `wake:{s}` ([`wake`]).
    pub const fn wake(shard: u32) -> Self {
        Key::new("wake:", shard, Tail::None)
    }

    /// `dlog:{s}` ([`dlog`]).
    pub const fn dlog(shard: u32) -> Self {
        Key::new("dlog:", shard, Tail::None)
    }

    /// `head:{s}` ([`head`]).
    pub const fn head(shard: u32) -> Self {
        Key::new("head:", shard, Tail::None)
    }

    /// `msgid:{h}:<n>:<sender><client id>` ([`message_id`]).
    pub const fn message_id(shard: u32, sender: &'a str, client_id: &'a str) -> Self {
        Key::new("msgid:", shard, Tail::Sender { sender, client_id })
    }

    /// `dd:{s}:<n>:<sender><client id>` ([`dedupe`]).
    pub const fn dedupe(shard: u32, sender: &'a str, client_id: &'a str) -> Self {
        Key::new("dd:", shard, Tail::Sender { sender, client_id })
    }

    /// `dd:{s}:<sender>\0<client id>` ([`dedupe_legacy`]).
    pub const fn dedupe_legacy(shard: u32, sender: &'a str, client_id: &'a str) -> Self {
        Key::new("dd:", shard, Tail::Legacy { sender, client_id })
    }
}

impl redis::ToRedisArgs for Key<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        // assembled on the stack and handed over in one piece: writing each piece through
        // redis-rs' `io::Write` for the next argument cost twice the instructions of the
        // `String` it replaces (callgrind); a key longer than the buffer (a long sender and
        // id) is made a `String` as before
        let mut buf = [0u8; 256];
        let mut len = 0;
        let mut fits = true;
        self.pieces(|p| {
            if fits && len + p.len() <= buf.len() {
                buf[len..len + p.len()].copy_from_slice(p);
                len += p.len();
            } else {
                fits = false;
            }
        });
        if fits {
            out.write_arg(&buf[..len]);
        } else {
            out.write_arg(self.into_string().as_bytes());
        }
    }
}

/// `<prefix>{<shard>}` with no tail, in one allocation of the right size. The server makes
/// several of these keys per message, and `format!`'s machinery cost several times the copy
/// (callgrind, ADR-0071); the names are exactly the `format!` forms (tested).
fn tagged(prefix: &'static str, shard: u32) -> String {
    Key::new(prefix, shard, Tail::None).into_string()
}

/// `wm:{s}`.
pub fn wm(shard: u32) -> String {
    tagged("wm:", shard)
}

/// `mb:{s}:<user>`: the user's mailbox, a sorted set scored by MailboxSeq.
pub fn mailbox(shard: u32, user: &str) -> String {
    Key::mailbox(shard, user).into_string()
}

/// `ack:{s}`: per-user acked seq of the shard's mailboxes.
pub fn acks(shard: u32) -> String {
    tagged("ack:", shard)
}

/// `wmsync:{s}`: the W the GC last asked the replicas to confirm before trimming the core
/// log. Written for its replication: the `WAIT` after it covers everything the primary held
/// when W was read (ADR-0063); only with a mailbox replica wait.
pub fn wm_sync(shard: u32) -> String {
    tagged("wmsync:", shard)
}

/// `dlogsync:{s}`: the offset of the last record a log reader asked the core replicas to
/// confirm before handing it on. Written for its replication: the `WAIT` after it covers every
/// record the primary held when the log was read (ADR-0064); only with a core replica wait.
pub fn dlog_sync(shard: u32) -> String {
    tagged("dlogsync:", shard)
}

/// `owner:{s}`: the epoch of the process materialising the shard, set with a short expiry and
/// refreshed while it runs (deleted on a clean stop): how offline tools tell a live owner.
pub fn owner(shard: u32) -> String {
    tagged("owner:", shard)
}

/// `stg:{s}:<o>`: staging state (durable lanes) of record `o`.
pub fn staging(shard: u32, offset: u64) -> String {
    format!("stg:{{{shard}}}:{offset}")
}

/// Prefix of staging keys, for `gc_completed_dispatch`.
pub fn staging_prefix(shard: u32) -> String {
    Key::new("stg:", shard, Tail::Colon("")).into_string()
}

/// `stgidx:{s}`: index of offsets that have staging state.
pub fn staging_index(shard: u32) -> String {
    tagged("stgidx:", shard)
}

/// `dlog:{s}`: the shard's dispatch log (a stream).
pub fn dlog(shard: u32) -> String {
    tagged("dlog:", shard)
}

/// `dlogwake:{s}`: sharded Pub/Sub channel of commit hints on a Redis Cluster (ADR-0032).
pub fn dlog_wake(shard: u32) -> String {
    tagged("dlogwake:", shard)
}

/// `head:{s}`: last offset assigned in `dlog:{s}`.
pub fn head(shard: u32) -> String {
    tagged("head:", shard)
}

/// `msgid:{h}:<n>:<sender><client id>`: which message (request digest) a sender's client id
/// names, kept on the sender's own shard `h` so that every send with that id meets it,
/// whatever shards its recipients fall in. A one-shard send's claim made inside its commit
/// holds `"<offset>:<digest>"` in a deployment of identity version 2 (ADR-0040).
pub fn message_id(shard: u32, sender: &str, client_id: &str) -> String {
    Key::message_id(shard, sender, client_id).into_string()
}

/// `dd:{s}:<n>:<sender><client id>`, n the sender's length in bytes (decimal): the dedupe
/// record of (sender, client id). Unambiguous for any two strings.
pub fn dedupe(shard: u32, sender: &str, client_id: &str) -> String {
    Key::dedupe(shard, sender, client_id).into_string()
}

/// `dd:{s}:<sender>\0<client id>`: the earlier, ambiguous form of [`dedupe`]. Read by
/// `commit_dispatch.lua` (never written) so that records written before the change still
/// dedupe for the rest of their 24 h.
pub fn dedupe_legacy(shard: u32, sender: &str, client_id: &str) -> String {
    Key::dedupe_legacy(shard, sender, client_id).into_string()
}

/// `wake:{s}`: Pub/Sub channel of materialisation hints.
pub fn wake(shard: u32) -> String {
    tagged("wake:", shard)
}

/// `lease:{s}`: the node that owns shard `s` (a PX lease on the shard's core instance).
pub fn lease(shard: u32) -> String {
    tagged("lease:", shard)
}

/// `{tidemark}:nodes`: the live nodes, scored by when their record expires (core instance 0).
pub const NODES: &str = "{tidemark}:nodes";

/// Prefix of a node's record: `{tidemark}:node:<id>`.
pub const NODE_PREFIX: &str = "{tidemark}:node:";

#[cfg(test)]
mod tests {
    use super::*;

    /// A [`Key`] written into a command is one argument holding exactly its `String` form.
    fn written(k: Key<'_>) -> String {
        let args = redis::ToRedisArgs::to_redis_args(&k);
        assert_eq!(args.len(), 1, "one argument");
        let mut cmd = redis::Cmd::new();
        cmd.arg("X").arg(k).arg("Y");
        assert_eq!(cmd.args_iter().count(), 3, "one argument in a command");
        String::from_utf8(args.into_iter().next().unwrap()).unwrap()
    }

    /// Every key built with [`Key`] is the name its `format!` form gave, byte for byte, as a
    /// `String` and written into a command: the keys name data already stored, so not one
    /// may change.
    #[test]
    fn keys_are_the_format_forms() {
        let users = ["", "bob", "alice-1", "ünïcödé", "a:b{c}", "a\0b"];
        for shard in [0, 1, 9, 10, 63, 64, 999, 1000, 65_535, u32::MAX] {
            assert_eq!(wm(shard), format!("wm:{{{shard}}}"));
            assert_eq!(acks(shard), format!("ack:{{{shard}}}"));
            assert_eq!(wm_sync(shard), format!("wmsync:{{{shard}}}"));
            assert_eq!(dlog_sync(shard), format!("dlogsync:{{{shard}}}"));
            assert_eq!(owner(shard), format!("owner:{{{shard}}}"));
            assert_eq!(staging_prefix(shard), format!("stg:{{{shard}}}:"));
            assert_eq!(staging_index(shard), format!("stgidx:{{{shard}}}"));
            assert_eq!(dlog(shard), format!("dlog:{{{shard}}}"));
            assert_eq!(dlog_wake(shard), format!("dlogwake:{{{shard}}}"));
            assert_eq!(head(shard), format!("head:{{{shard}}}"));
            assert_eq!(wake(shard), format!("wake:{{{shard}}}"));
            assert_eq!(lease(shard), format!("lease:{{{shard}}}"));
            assert_eq!(written(Key::wm(shard)), wm(shard));
            assert_eq!(written(Key::acks(shard)), acks(shard));
            assert_eq!(written(Key::wake(shard)), wake(shard));
            assert_eq!(written(Key::dlog(shard)), dlog(shard));
            assert_eq!(written(Key::head(shard)), head(shard));
            for u in users {
                assert_eq!(mailbox(shard, u), format!("mb:{{{shard}}}:{u}"));
                assert_eq!(written(Key::mailbox(shard, u)), mailbox(shard, u));
                for c in users {
                    let n = u.len();
                    assert_eq!(
                        message_id(shard, u, c),
                        format!("msgid:{{{shard}}}:{n}:{u}{c}")
                    );
                    assert_eq!(dedupe(shard, u, c), format!("dd:{{{shard}}}:{n}:{u}{c}"));
                    assert_eq!(
                        dedupe_legacy(shard, u, c),
                        format!("dd:{{{shard}}}:{u}\0{c}")
                    );
                    assert_eq!(
                        written(Key::message_id(shard, u, c)),
                        message_id(shard, u, c)
                    );
                    assert_eq!(written(Key::dedupe(shard, u, c)), dedupe(shard, u, c));
                    assert_eq!(
                        written(Key::dedupe_legacy(shard, u, c)),
                        dedupe_legacy(shard, u, c)
                    );
                }
            }
        }
        // a key longer than the stack buffer is written whole too
        let long = "s".repeat(128);
        let id = "i".repeat(200);
        assert_eq!(
            written(Key::message_id(7, &long, &id)),
            format!("msgid:{{7}}:128:{long}{id}")
        );
        // the capacity is the length: one allocation, none grown
        let k = message_id(12, "alice", "m-1");
        assert_eq!(k.capacity(), k.len());
    }
}
