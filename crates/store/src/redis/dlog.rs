//! The commit side: per-shard dispatch logs `dlog:{s}` on core Redis.
//!
//! A message is committed to every shard it touches by `commit_dispatch.lua` (several
//! messages of one shard per call: group commit, ADR-0036, [`LogStore::commit_group`]): dedupe on
//! (sender, client id) (key `dd:{s}:<len(sender)>:<sender><client id>`, see [`keys::dedupe`];
//! in a deployment of identity version 2, a one-shard send's id claim instead, ADR-0040),
//! next contiguous u48 offset, one stream entry with id `<offset>-0`, in one of two forms.
//! A deployment of identity version 3 writes the packed form (ADR-0055: two fields, so the
//! commit script passes 3 arguments per message instead of 7 and `XADD` stores 4 values
//! instead of 12); older deployments write the six-field form. Readers take both, so a log
//! written before an upgrade is read after it:
//!
//! ```text
//! dlog:{s}  stream entry "<offset>-0", six-field form
//!   p  decimal   prev offset (offset - 1; offsets are contiguous from 1)
//!   f  utf-8     sender
//!   c  utf-8     client message id
//!   r  bytes     recipients of this shard: repeated [len u8 (1..=128)][id bytes]
//!   b  utf-8     body
//!   t  decimal   sent_at, µs since the Unix epoch (gateway clock at commit)
//!
//! dlog:{s}  stream entry "<offset>-0", packed form (ADR-0055)
//!   p  decimal   prev offset, as above
//!   m  bytes     the message, packed (all integers big-endian):
//!
//!      offset      width  field
//!      0           1      form: 1
//!      1           1      S, the sender's length (1..=128)
//!      2           S      sender, utf-8
//!      2+S         4      C, the client id's length (u32)
//!      6+S         C      client message id, utf-8
//!      6+S+C       4      R, the recipients' length in bytes (u32)
//!      10+S+C      R      recipients of this shard: repeated [len u8 (1..=128)][id bytes]
//!      10+S+C+R    8      sent_at, µs since the Unix epoch (u64)
//!      18+S+C+R    rest   body, utf-8, to the end of the value
//! ```
//!
//! Invariants of `m`: every length fits in what follows it, the body takes exactly the rest,
//! every text is UTF-8; anything else (another form byte, a short value) is a
//! [`Error::BadRecord`]: a record is never read half-understood. An entry holding `m` is read
//! from `p` and `m` alone (other fields are ignored).
//!
//! Materializers read the log in order with [`LogReader`] (XREAD BLOCK on a connection of its
//! own, without response timeout) and trim it with [`LogStore::trim`] once every lane's W has
//! passed a record.

use std::collections::HashMap;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::Value;

use super::scripts::COMMIT_DISPATCH;
use super::watermark::U48_MAX;
use crate::endpoint::{self, Conn};
use crate::error::{Error, Result};
use crate::keys::{self, Key};
use crate::redis::replicas::{client_info, conn_id, with_wait, ConnId, ReplicaConfirm, WaitError};
pub use crate::redis::replicas::{has_replicas, ReplicaWait, WaitPolicy};

/// How long a dedupe record (sender, client id) → offset lives.
pub const DEFAULT_DEDUPE_TTL_S: u64 = 24 * 3600;

/// One record of a dispatch log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchRecord {
    /// Offset in `dlog:{s}` (u48, contiguous from 1) = the entries' MailboxSeq.
    pub offset: u64,
    /// Previous record's offset: the `expected_previous` of the watermark CAS.
    pub prev: u64,
    /// Sender user id.
    pub sender: String,
    /// Client-chosen message id (dedupe key with the sender).
    pub client_id: String,
    /// Recipients of this shard, in the order given by the sender.
    pub recipients: Vec<String>,
    /// Message body.
    pub body: String,
    /// Commit time, µs since the Unix epoch.
    pub sent_at_us: u64,
}

/// Result of a commit on one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// The offset assigned (the first one, for a duplicate).
    pub offset: u64,
    /// True when (sender, client id) had already been committed: nothing was added.
    pub duplicate: bool,
}

/// One message of a group commit ([`LogStore::commit_group`]). `R` is how the recipients are
/// held: `&str` by default, or the `String`s a caller already has (the gateway's queued
/// sends), so that no list of `&str` is built per message (ADR-0083).
#[derive(Debug, Clone, Copy)]
pub struct CommitRequest<'a, R = &'a str> {
    /// Sender user id.
    pub sender: &'a str,
    /// Client-chosen message id (dedupe key with the sender).
    pub client_id: &'a str,
    /// Recipients of this shard, in the order given by the sender.
    pub recipients: &'a [R],
    /// Message body.
    pub body: &'a str,
    /// Commit time, µs since the Unix epoch.
    pub sent_at_us: u64,
    /// [`request_digest`] of the whole message (every shard's recipients, the body).
    pub digest: &'a str,
    /// The sender's home shard when this call also claims the id (ADR-0037): the claim
    /// [`LogStore::claim_message_id`] would make, made by the script before the commit, so
    /// a one-shard send takes one round trip instead of two. Only where the claim key is on
    /// this instance (on a Redis Cluster: `Some(shard)` only, the same slot); `None`: the
    /// caller claimed before (or needs no claim).
    pub claim_home: Option<u32>,
}

/// Encodes recipients as `[len u8][bytes]…`.
pub fn encode_recipients<R: AsRef<str>>(rs: &[R]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rs.iter().map(|r| r.as_ref().len() + 1).sum());
    push_recipients(&mut out, rs);
    out
}

/// Appends `[len u8][bytes]…` of `rs` to `out` (both record forms store recipients so).
fn push_recipients<R: AsRef<str>>(out: &mut Vec<u8>, rs: &[R]) {
    for r in rs {
        let r = r.as_ref();
        debug_assert!(!r.is_empty() && r.len() <= 128);
        out.push(r.len() as u8);
        out.extend_from_slice(r.as_bytes());
    }
}

/// The form byte of a packed record (the first byte of field `m`, ADR-0055).
const PACKED_FORM: u8 = 1;

/// The text of Redis's refusal of an `XADD` whose id is not above the stream's last
/// (`t_stream.c`, Redis 5 to 7): the one `{5}` answer of the commit script that means a log
/// ahead of its head ([`Error::LogAheadOfHead`]).
const XADD_ID_TOO_SMALL: &str = "equal or smaller than the target stream top item";

/// Packs a message for field `m` of a log entry (ADR-0055; the layout at the top of this
/// module). `sender` is 1..=128 bytes (checked by the gateway before any commit).
pub fn encode_record<R: AsRef<str>>(
    sender: &str,
    client_id: &str,
    recipients: &[R],
    sent_at_us: u64,
    body: &str,
) -> Vec<u8> {
    let mut out = Vec::new();
    push_record(&mut out, sender, client_id, recipients, sent_at_us, body);
    out
}

/// [`encode_record`] appended to `out` (a commit call packs its messages one after another
/// in one buffer: ADR-0083).
fn push_record<R: AsRef<str>>(
    out: &mut Vec<u8>,
    sender: &str,
    client_id: &str,
    recipients: &[R],
    sent_at_us: u64,
    body: &str,
) {
    debug_assert!(!sender.is_empty() && sender.len() <= 128);
    let r_len: usize = recipients.iter().map(|r| r.as_ref().len() + 1).sum();
    out.reserve(18 + sender.len() + client_id.len() + r_len + body.len());
    out.push(PACKED_FORM);
    out.push(sender.len() as u8);
    out.extend_from_slice(sender.as_bytes());
    out.extend_from_slice(&(client_id.len() as u32).to_be_bytes());
    out.extend_from_slice(client_id.as_bytes());
    out.extend_from_slice(&(r_len as u32).to_be_bytes());
    push_recipients(out, recipients);
    out.extend_from_slice(&sent_at_us.to_be_bytes());
    out.extend_from_slice(body.as_bytes());
}

/// A packed record's message, taken apart: (sender, client id, recipients, sent_at_us,
/// body).
type Unpacked = (String, String, Vec<String>, u64, String);

/// Takes field `m` apart ([`encode_record`]'s layout); `Err(detail)` for anything that is not
/// exactly that layout.
fn decode_record(m: &[u8]) -> std::result::Result<Unpacked, &'static str> {
    fn take<'a>(m: &mut &'a [u8], n: usize) -> std::result::Result<&'a [u8], &'static str> {
        if m.len() < n {
            return Err("packed record is truncated");
        }
        let (head, rest) = m.split_at(n);
        *m = rest;
        Ok(head)
    }
    fn text(b: &[u8]) -> std::result::Result<String, &'static str> {
        String::from_utf8(b.to_vec()).map_err(|_| "packed record field is not UTF-8")
    }
    fn len32(m: &mut &[u8]) -> std::result::Result<usize, &'static str> {
        let b = take(m, 4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    let mut m = m;
    if take(&mut m, 1)? != [PACKED_FORM] {
        return Err("packed record of an unknown form");
    }
    let s = take(&mut m, 1)?[0] as usize;
    let sender = text(take(&mut m, s)?)?;
    let c = len32(&mut m)?;
    let client_id = text(take(&mut m, c)?)?;
    let r = len32(&mut m)?;
    let recipients = decode_recipients(take(&mut m, r)?).ok_or("bad recipients")?;
    let t = take(&mut m, 8)?;
    let sent_at_us = u64::from_be_bytes(t.try_into().expect("8 bytes"));
    Ok((sender, client_id, recipients, sent_at_us, text(m)?))
}

/// Decodes `[len u8][bytes]…`; `None` when truncated, empty-named or not UTF-8.
pub fn decode_recipients(b: &[u8]) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let n = b[i] as usize;
        if n == 0 || i + 1 + n > b.len() {
            return None;
        }
        out.push(String::from_utf8(b[i + 1..i + 1 + n].to_vec()).ok()?);
        i += 1 + n;
    }
    Some(out)
}

/// Digest of a message request for idempotency: its recipients as a set (order and repeats
/// do not matter) and its body; 32 hex digits (xxh3-128). Two sends with the same id are the
/// same message exactly when their digests are equal.
pub fn request_digest<S: AsRef<str>>(recipients: &[S], body: &str) -> String {
    // the recipients as a set: sorted, without repeats (one recipient needs neither, and no
    // list is built for it: this runs once per send)
    let one: [&str; 1];
    let mut sorted: Vec<&str> = Vec::new();
    let rs: &[&str] = if let [only] = recipients {
        one = [only.as_ref()];
        &one
    } else {
        sorted.extend(recipients.iter().map(AsRef::as_ref));
        sorted.sort_unstable();
        sorted.dedup();
        &sorted
    };
    // each recipient as its length (u32, big-endian) and bytes, then u32::MAX, then the body;
    // hashed in one piece, on the stack when it fits
    let len = 4 + body.len() + rs.iter().map(|r| r.len() + 4).sum::<usize>();
    let mut stack = [0u8; 256];
    let mut heap: Vec<u8>;
    let bytes: &mut [u8] = if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap = vec![0u8; len];
        &mut heap
    };
    let mut at = 0;
    let mut put = |b: &[u8]| {
        bytes[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    };
    for r in rs {
        put(&(r.len() as u32).to_be_bytes());
        put(r.as_bytes());
    }
    put(&u32::MAX.to_be_bytes());
    put(body.as_bytes());
    hex32(xxhash_rust::xxh3::xxh3_128(bytes))
}

/// `v` as 32 lowercase hex digits, the `{:032x}` form without `format!`'s machinery (made
/// once per send; ADR-0071).
fn hex32(v: u128) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, d) in out.iter_mut().enumerate() {
        *d = DIGITS[((v >> (124 - 4 * i)) & 0xf) as usize];
    }
    String::from_utf8(out.to_vec()).expect("hex digits are ASCII")
}

/// What a client id names, as [`LogStore::claim_message_id`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdClaim {
    /// First use of the id: it now names this message.
    New,
    /// The id already names this very message (a resend): commit it again, each shard answers
    /// its first offset (or commits it now, completing a send that failed part-way).
    SameMessage,
    /// The id names another message: refuse (`id_reused`), commit nothing.
    OtherMessage,
}

/// Connection to one core Redis (commit side).
#[derive(Clone)]
pub struct LogStore {
    pub(crate) conn: Conn,
    url: String,
    /// Replicas every commit must reach before it is acknowledged (`WAIT`); 0: none.
    wait: Option<ReplicaWait>,
    /// The grouped `WAIT`s of the commits (shared by the clones).
    confirm: ReplicaConfirm,
    /// A claim made inside the commit is the message's only dedupe record (ADR-0040): set
    /// for a deployment whose identity allows it ([`crate::deployment::Identity::one_key_claims`]).
    one_key_claims: bool,
    /// Records are written in the packed form (ADR-0055): set for a deployment whose
    /// identity says that every process reads it ([`crate::deployment::Identity::packed_records`]).
    packed_records: bool,
}

/// `XTRIM dlog:{s} MINID <upto + 1>-0`: the records at or below `upto` go.
fn trim_cmd(shard: u32, upto: u64) -> redis::Cmd {
    let mut c = redis::cmd("XTRIM");
    c.arg(keys::dlog(shard))
        .arg("MINID")
        .arg(format!("{}-0", upto + 1));
    c
}

fn offset_of_id(id: &str) -> Option<u64> {
    id.strip_suffix("-0")?.parse().ok()
}

/// The fields of a log entry of either form (the tables at the top of this module), in the
/// order `parse_entries` takes them apart.
const FIELDS: [&[u8]; 7] = [b"p", b"f", b"c", b"r", b"b", b"t", b"m"];

fn parse_entries(shard: u32, v: &Value) -> Result<Vec<DispatchRecord>> {
    let bad = |detail: String| Error::BadRecord {
        shard,
        offset: 0,
        detail,
    };
    let Value::Array(entries) = v else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let Value::Array(pair) = e else {
            return Err(bad(format!("{e:?}")));
        };
        let [Value::BulkString(id), Value::Array(kv)] = pair.as_slice() else {
            return Err(bad(format!("{pair:?}")));
        };
        let id = String::from_utf8_lossy(id);
        let offset = offset_of_id(&id).ok_or_else(|| bad(format!("stream id {id}")))?;
        if offset > U48_MAX {
            // commit_dispatch.lua never assigns one; a mailbox seq keeps only 48 bits.
            return Err(Error::BadRecord {
                shard,
                offset,
                detail: "offset above 2^48-1".to_string(),
            });
        }
        // the fields by name (others are ignored; a repeated one counts last), without a map
        // per record: this runs for every record a materializer reads
        let mut fields: [Option<&[u8]>; FIELDS.len()] = [None; FIELDS.len()];
        for f in kv.chunks(2) {
            if let [Value::BulkString(k), Value::BulkString(v)] = f {
                if let Some(i) = FIELDS.iter().position(|n| *n == k.as_slice()) {
                    fields[i] = Some(v);
                }
            }
        }
        let [p, f, c, r, b, t, m] = fields;
        let rb = |detail: &str| Error::BadRecord {
            shard,
            offset,
            detail: detail.to_string(),
        };
        let text = |v: Option<&[u8]>| -> Result<String> {
            let v = v.ok_or_else(|| rb("missing field"))?;
            String::from_utf8(v.to_vec()).map_err(|_| rb("field is not UTF-8"))
        };
        let num = |v: Option<&[u8]>| -> Result<u64> {
            let v = v.ok_or_else(|| rb("missing field"))?;
            std::str::from_utf8(v)
                .map_err(|_| rb("field is not UTF-8"))?
                .parse::<u64>()
                .map_err(|_| rb("field is not a number"))
        };
        let prev = num(p)?;
        let (sender, client_id, recipients, sent_at_us, body) = match m {
            // the packed form (ADR-0055)
            Some(m) => decode_record(m).map_err(rb)?,
            None => (
                text(f)?,
                text(c)?,
                decode_recipients(r.ok_or_else(|| rb("no r"))?)
                    .ok_or_else(|| rb("bad recipients"))?,
                num(t)?,
                text(b)?,
            ),
        };
        if sender.is_empty() || sender.len() > 128 {
            // a mailbox entry stores the sender's length in one byte (1..=128)
            return Err(rb("sender is not 1..=128 bytes"));
        }
        out.push(DispatchRecord {
            offset,
            prev,
            sender,
            client_id,
            recipients,
            body,
            sent_at_us,
        });
    }
    Ok(out)
}

impl LogStore {
    /// Connects to a core Redis and loads the commit script. Reads the deployment identity
    /// recorded there: in a deployment of version 2 a claim made inside the commit is the
    /// message's only dedupe record (ADR-0040); one of another or no identity keeps both
    /// records. An identity this code cannot read (a newer version) is refused.
    pub async fn connect(url: &str) -> Result<LogStore> {
        let mut conn = endpoint::connect(url, endpoint::ConnectOptions::default()).await?;
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&COMMIT_DISPATCH.source)
            .query_async(&mut conn)
            .await?;
        let key = crate::deployment::key(url, crate::deployment::Role::Core);
        let identity = crate::deployment::read_at(&mut conn, &key).await?;
        Ok(LogStore {
            conn,
            url: url.to_string(),
            wait: None,
            confirm: ReplicaConfirm::default(),
            one_key_claims: identity.as_ref().is_some_and(|id| id.one_key_claims()),
            packed_records: identity.as_ref().is_some_and(|id| id.packed_records()),
        })
    }

    /// Whether records are written in the packed form (ADR-0055).
    pub fn packed_records(&self) -> bool {
        self.packed_records
    }

    /// Overrides what [`LogStore::connect`] read from the identity (tests of both forms on one
    /// instance).
    pub fn set_packed_records(&mut self, on: bool) {
        self.packed_records = on;
    }

    /// Whether a claim made inside the commit is the message's only dedupe record (ADR-0040).
    pub fn one_key_claims(&self) -> bool {
        self.one_key_claims
    }

    /// Overrides what [`LogStore::connect`] read from the identity (tests of both forms on one
    /// instance).
    pub fn set_one_key_claims(&mut self, on: bool) {
        self.one_key_claims = on;
    }

    /// From now on every commit waits for `wait` (`None` or 0 replicas: no wait).
    pub fn set_replica_wait(&mut self, wait: Option<ReplicaWait>) {
        self.wait = wait.filter(|w| w.replicas > 0);
    }

    /// The replica wait in force.
    pub fn replica_wait(&self) -> Option<ReplicaWait> {
        self.wait
    }

    /// Whether this is a connection to a Redis Cluster (keys of one script call must share a
    /// slot there).
    pub fn is_cluster(&self) -> bool {
        self.conn.is_cluster()
    }

    /// Whether this core instance (or cluster) has replicas ([`has_replicas`]).
    pub async fn has_replicas(&mut self) -> Result<bool> {
        has_replicas(&mut self.conn).await
    }

    /// The instance URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A clone of the connection, for plain commands.
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// Commits one message to one shard (`commit_dispatch.lua`).
    ///
    /// Dedupes on (sender, client id) with [`keys::dedupe`], unambiguous for any strings; a
    /// record under the earlier form [`keys::dedupe_legacy`] (read, never written) counts as
    /// a duplicate too. That lookup could only confuse ids containing NUL, which the protocol
    /// refuses; this function itself takes any strings (validation is the protocol's job).
    ///
    /// [`Error::LogExhausted`] when the shard's head is already 2^48-1: the script refuses
    /// before taking an offset, so nothing is written (a duplicate is still answered).
    ///
    /// The request digest is [`request_digest`] of this shard's recipients and the body; a
    /// gateway committing one message to several shards uses [`LogStore::commit_request`]
    /// with the digest of the whole message instead.
    #[allow(clippy::too_many_arguments)]
    pub async fn commit(
        &mut self,
        shard: u32,
        sender: &str,
        client_id: &str,
        recipients: &[&str],
        body: &str,
        sent_at_us: u64,
        dedupe_ttl_s: u64,
    ) -> Result<Committed> {
        let digest = request_digest(recipients, body);
        self.commit_request(
            shard,
            sender,
            client_id,
            recipients,
            body,
            sent_at_us,
            dedupe_ttl_s,
            &digest,
        )
        .await
    }

    /// [`LogStore::commit`] with the caller's request digest: a resend of the same id whose
    /// digest differs is refused with [`Error::IdReused`] (nothing written). A group of one
    /// ([`LogStore::commit_group`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn commit_request(
        &mut self,
        shard: u32,
        sender: &str,
        client_id: &str,
        recipients: &[&str],
        body: &str,
        sent_at_us: u64,
        dedupe_ttl_s: u64,
        digest: &str,
    ) -> Result<Committed> {
        let req = CommitRequest {
            sender,
            client_id,
            recipients,
            body,
            sent_at_us,
            digest,
            claim_home: None,
        };
        self.commit_group(shard, &[req], dedupe_ttl_s)
            .await?
            .pop()
            .expect("one answer per message")
    }

    /// Group commit (ADR-0036): commits `reqs` to shard `shard` in one `commit_dispatch.lua`
    /// call, in the order given. Each message gets its own answer, the one it would get
    /// committed alone at that point: its offset, [`Committed::duplicate`] for a (sender,
    /// client id) committed before (also earlier in the same group), [`Error::IdReused`] for
    /// an id committed with another request digest, [`Error::LogExhausted`] once the head is
    /// at 2^48-1, [`Error::LogAheadOfHead`] from a damaged log on (nothing written for those),
    /// [`Error::CommitFailed`] for each message when the script failed in the group (what it
    /// wrote is not known).
    /// Offsets of the committed messages are consecutive, in the group's order.
    ///
    /// A message with [`CommitRequest::claim_home`] claims its id first in the same call
    /// (ADR-0037): an id bound to another digest is [`Error::IdReused`] with offset 0. On a
    /// Redis Cluster a claim on another shard than `shard` is [`Error::InvalidArgument`]
    /// (another slot), before anything is sent.
    ///
    /// With a replica wait, one grouped `WAIT` covers the whole call; a failed wait fails
    /// every message that was committed or a duplicate (the refused ones wrote nothing).
    /// The outer `Err` is a failure of the call itself (connection, script error): nothing
    /// is known of the messages, and a resend of each is deduplicated.
    pub async fn commit_group<R: AsRef<str> + Sync>(
        &mut self,
        shard: u32,
        reqs: &[CommitRequest<'_, R>],
        dedupe_ttl_s: u64,
    ) -> Result<Vec<Result<Committed>>> {
        // one part: the flat answers are the part's
        self.commit_flat(&[(shard, reqs)], dedupe_ttl_s).await
    }

    /// [`LogStore::commit_group`] of several shards' groups in one call (ADR-0051): each part
    /// `(shard, group)` is committed as `commit_group` would commit it alone, the parts in
    /// the order given, and answered in that order. A part whose log is damaged
    /// ([`Error::LogAheadOfHead`]) or that fails in the script ([`Error::CommitFailed`]) does
    /// not stop the others. One instance only: on a Redis
    /// Cluster (one slot per call) more than one part is [`Error::InvalidArgument`], before
    /// anything is sent. Parts may name the same shard twice (its messages in order).
    pub async fn commit_parts<R: AsRef<str> + Sync>(
        &mut self,
        parts: &[(u32, &[CommitRequest<'_, R>])],
        dedupe_ttl_s: u64,
    ) -> Result<Vec<Vec<Result<Committed>>>> {
        let mut flat = self.commit_flat(parts, dedupe_ttl_s).await?.into_iter();
        Ok(parts
            .iter()
            .map(|(_, reqs)| flat.by_ref().take(reqs.len()).collect())
            .collect())
    }

    /// [`LogStore::commit_parts`] answered in one list: the answers of every part one after
    /// another, in the parts' order (as many as there are messages). What the gateway's group
    /// commit calls: one list per call, not one per part (ADR-0083). An empty part is
    /// answered with nothing and not sent.
    pub async fn commit_flat<R: AsRef<str> + Sync>(
        &mut self,
        parts: &[(u32, &[CommitRequest<'_, R>])],
        dedupe_ttl_s: u64,
    ) -> Result<Vec<Result<Committed>>> {
        let mut sent = parts.iter().filter(|(_, reqs)| !reqs.is_empty());
        let Some(&(first, first_reqs)) = sent.next() else {
            return Ok(Vec::new());
        };
        if self.conn.is_cluster() {
            if sent.next().is_some() {
                return Err(Error::InvalidArgument(format!(
                    "one commit call on a Redis Cluster holds one shard, not {}",
                    parts.iter().filter(|(_, reqs)| !reqs.is_empty()).count()
                )));
            }
            if let Some(home) = first_reqs
                .iter()
                .filter_map(|r| r.claim_home)
                .find(|&h| h != first)
            {
                return Err(Error::InvalidArgument(format!(
                    "a commit to shard {first} cannot claim an id on shard {home} of a Redis \
                     Cluster (another slot)"
                )));
            }
        }
        // the connections the calls ran on: a replica WAIT confirms only their writes if it
        // runs on the same one (ADR-0063)
        let mut ran_on = Vec::new();
        let mut out = self
            .commit_call(parts, dedupe_ttl_s, true, &mut ran_on)
            .await?;
        // one-key messages whose claim is a bare digest of theirs: again, with their dedupe
        // keys (ADR-0043; rare: a claim written before ADR-0040, or by a two-step claim),
        // each with the later messages of its log deferred behind it, in their order
        // (ADR-0091)
        if out.iter().any(Option::is_none) {
            // the flat index of each message sent again, and those messages by part
            let mut at = Vec::new();
            let mut reqs: Vec<(u32, Vec<&CommitRequest<'_, R>>)> = Vec::new();
            let mut i = 0;
            for (shard, part) in parts {
                let mut again = Vec::new();
                for r in part.iter() {
                    if out[i].is_none() {
                        at.push(i);
                        again.push(r);
                    }
                    i += 1;
                }
                if !again.is_empty() {
                    reqs.push((*shard, again));
                }
            }
            let retry: Vec<(u32, &[&CommitRequest<'_, R>])> = reqs
                .iter()
                .map(|(shard, reqs)| (*shard, reqs.as_slice()))
                .collect();
            let answers = self
                .commit_call(&retry, dedupe_ttl_s, false, &mut ran_on)
                .await?;
            for (i, a) in at.into_iter().zip(answers) {
                out[i] = a;
            }
        }
        // (the call with every key answers every message)
        let mut out: Vec<Result<Committed>> = out
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    Err(Error::UnexpectedReply {
                        script: "commit_dispatch",
                        detail: "a message left unanswered".into(),
                    })
                })
            })
            .collect();
        // a duplicate waits too: the first commit may not have reached the replicas yet; a
        // refusal (exhausted log, id reused) wrote nothing: no replica needed. One WAIT covers
        // every write made on the connection before it, so every part of the call.
        let acked = out.iter().any(|r| r.is_ok());
        if let (Some(w), true) = (self.wait, acked) {
            if let Err(e) = self.confirm.confirm(&self.conn, first, w, &ran_on).await {
                let shards = parts
                    .iter()
                    .flat_map(|(shard, reqs)| std::iter::repeat_n(*shard, reqs.len()));
                for (r, shard) in out.iter_mut().zip(shards) {
                    if r.is_ok() {
                        *r = Err(match &e {
                            Error::NotReplicated {
                                replicas, wanted, ..
                            } => Error::NotReplicated {
                                shard,
                                replicas: *replicas,
                                wanted: *wanted,
                            },
                            e => e.clone(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// One `commit_dispatch.lua` call of `parts` (empty parts are left out of it): each
    /// message's answer, in one list in the parts' order, `None` for a one-key message (flag
    /// '3', sent only when `one_key` and the deployment claims with one key) that needs its
    /// dedupe keys (the script's `{4, 0}`: nothing was written for it), and for every later
    /// message of the same log, deferred behind it (`{7, 0}`, ADR-0091). With `one_key` false
    /// every claiming message is sent with its three keys. `T` is a request or a reference
    /// to one (the retry of [`LogStore::commit_flat`]).
    async fn commit_call<'r, R, T>(
        &mut self,
        parts: &[(u32, &[T])],
        dedupe_ttl_s: u64,
        one_key: bool,
        ran_on: &mut Vec<Option<ConnId>>,
    ) -> Result<Vec<Option<Result<Committed>>>>
    where
        R: AsRef<str> + Sync + 'r,
        T: std::borrow::Borrow<CommitRequest<'r, R>> + Sync,
    {
        // ADR-0043: a one-key claim passes only its claim's key
        let one_key = one_key && self.one_key_claims;
        let compact = |r: &CommitRequest<'_, R>| one_key && r.claim_home.is_some();
        let sent = || parts.iter().filter(|(_, reqs)| !reqs.is_empty());
        let n_keys: usize = sent()
            .map(|(_, reqs)| {
                2 + reqs
                    .iter()
                    .map(|r| if compact(r.borrow()) { 1 } else { 3 })
                    .sum::<usize>()
            })
            .sum();
        // the command's buffers sized once, from above: grown argument by argument they were
        // reallocated several times per call (ADR-0071)
        let msgs: usize = sent().map(|(_, reqs)| reqs.len()).sum();
        let n_parts = sent().count();
        let mut record_max = 0;
        let bytes: usize = sent()
            .flat_map(|(_, reqs)| reqs.iter())
            .map(|r| {
                let r = r.borrow();
                // three keys and the record or its fields (each holding sender and client
                // id), the recipients, the body, the digest and the small numbers
                let rcpts = r
                    .recipients
                    .iter()
                    .map(|x| x.as_ref().len() + 1)
                    .sum::<usize>();
                record_max =
                    record_max.max(18 + r.sender.len() + r.client_id.len() + rcpts + r.body.len());
                4 * (r.sender.len() + r.client_id.len()) + rcpts + r.body.len() + 160
            })
            .sum::<usize>()
            + 64 * n_parts
            + 96;
        let mut cmd = redis::Cmd::with_capacity(6 + n_keys + 2 * n_parts + 7 * msgs, bytes);
        cmd.arg("EVALSHA").arg(&COMMIT_DISPATCH.sha).arg(n_keys);
        for (shard, reqs) in sent() {
            let shard = *shard;
            // the keys are written into the command's buffer, with no `String` each (ADR-0082)
            cmd.arg(Key::dlog(shard)).arg(Key::head(shard));
            for r in reqs.iter() {
                let r = r.borrow();
                if let (true, Some(home)) = (compact(r), r.claim_home) {
                    cmd.arg(Key::message_id(home, r.sender, r.client_id));
                    continue;
                }
                let dedupe = Key::dedupe(shard, r.sender, r.client_id);
                let claim = match r.claim_home {
                    Some(home) => Key::message_id(home, r.sender, r.client_id),
                    None => dedupe, // not touched (flag '0'); same slot
                };
                cmd.arg(dedupe)
                    .arg(Key::dedupe_legacy(shard, r.sender, r.client_id))
                    .arg(claim);
            }
        }
        let packed = self.packed_records;
        cmd.arg(dedupe_ttl_s.max(1))
            .arg(n_parts)
            // 'w': this call is confirmed with WAIT, and a part answering only duplicates
            // writes (ADR-0116)
            .arg(match (packed, self.wait.is_some()) {
                (true, false) => "m",
                (true, true) => "mw",
                (false, false) => "f",
                (false, true) => "fw",
            });
        // each packed record is made in one buffer for the call, not a `Vec` each (ADR-0083)
        let mut record = Vec::with_capacity(if packed { record_max } else { 0 });
        for (shard, reqs) in sent() {
            cmd.arg(reqs.len());
            if self.conn.is_cluster() {
                cmd.arg(keys::dlog_wake(*shard));
            } else {
                cmd.arg("");
            }
            for r in reqs.iter() {
                let r = r.borrow();
                if packed {
                    record.clear();
                    push_record(
                        &mut record,
                        r.sender,
                        r.client_id,
                        r.recipients,
                        r.sent_at_us,
                        r.body,
                    );
                    cmd.arg(&record[..]);
                } else {
                    cmd.arg(r.sender)
                        .arg(r.client_id)
                        .arg(encode_recipients(r.recipients))
                        .arg(r.body)
                        .arg(r.sent_at_us);
                }
                cmd.arg(r.digest).arg(match r.claim_home {
                    Some(_) if compact(r) => "3",
                    Some(_) if self.one_key_claims => "2",
                    Some(_) => "1",
                    None => "0",
                });
            }
        }
        drop(record);
        let first = sent().next().map_or(0, |(shard, _)| *shard);
        let (v, conn) = self.eval_commit(&cmd, first).await?;
        ran_on.push(conn);
        let bad = || Error::UnexpectedReply {
            script: "commit_dispatch",
            detail: format!("{v:?}"),
        };
        let Value::Array(a) = &v else {
            return Err(bad());
        };
        if a.len() != 2 * msgs {
            return Err(bad());
        }
        let mut pairs = a.chunks(2);
        let mut out = Vec::with_capacity(msgs);
        for (shard, reqs) in sent() {
            let shard = *shard;
            for r in reqs.iter() {
                // (zip would take one pair too many from the shared iterator)
                let pair = pairs.next().expect("length checked");
                out.push(match (&pair[0], &pair[1]) {
                    (Value::Int(s), Value::Int(o)) if *s == 0 || *s == 1 => Some(Ok(Committed {
                        offset: *o as u64,
                        duplicate: *s == 1,
                    })),
                    (Value::Int(2), Value::Int(_)) => Some(Err(Error::LogExhausted { shard })),
                    (Value::Int(3), Value::Int(o)) => Some(Err(Error::IdReused {
                        shard,
                        offset: *o as u64,
                    })),
                    (Value::Int(4), Value::Int(0)) if compact(r.borrow()) => None,
                    // deferred behind a message answered {4, 0} of the same log (ADR-0091):
                    // only in a call that holds one-key messages
                    (Value::Int(7), Value::Int(0)) if one_key => None,
                    (Value::Int(5), Value::BulkString(e)) => {
                        let detail = String::from_utf8_lossy(e).into_owned();
                        // {5} is any XADD that failed: a log ahead of its head (Redis: "equal
                        // or smaller than the target stream top item"), or the instance
                        // refusing a write (OOM, READONLY after a failover, NOREPLICAS,
                        // MISCONF), which is no damage: nothing was written either way
                        Some(Err(if detail.contains(XADD_ID_TOO_SMALL) {
                            Error::LogAheadOfHead { shard, detail }
                        } else {
                            Error::CommitFailed { shard, detail }
                        }))
                    }
                    (Value::Int(6), Value::BulkString(e)) => Some(Err(Error::CommitFailed {
                        shard,
                        detail: String::from_utf8_lossy(e).into_owned(),
                    })),
                    _ => return Err(bad()),
                });
            }
        }
        Ok(out)
    }

    /// Runs the commit command, reloading the script once on NOSCRIPT where the call runs (on
    /// a cluster, on the primary of its shard alone: [`Conn::load_scripts_for`]) and running
    /// it again as `EVAL` (ADR-0059: a `SCRIPT LOAD` routed by a stale slot map may have
    /// reached the old primary).
    ///
    /// With a replica wait, the call is pipelined with `CLIENT INFO`, which names the
    /// connection it ran on (ADR-0063); `None` without one.
    async fn eval_commit(
        &mut self,
        cmd: &redis::Cmd,
        shard: u32,
    ) -> Result<(Value, Option<ConnId>)> {
        if self.wait.is_none() {
            let v = match cmd.query_async(&mut self.conn).await {
                Err(e) if e.code() == Some("NOSCRIPT") => {
                    self.conn
                        .load_scripts_for(Some(cmd), &[&COMMIT_DISPATCH.source])
                        .await?;
                    super::scripts::as_eval(cmd, &COMMIT_DISPATCH.source)
                        .query_async(&mut self.conn)
                        .await?
                }
                other => other?,
            };
            return Ok((v, None));
        }
        let mut replies = self
            .conn
            .exec_each(&[(shard, cmd.clone()), (shard, client_info())])
            .await?;
        if matches!(&replies[0], Err(e) if e.code() == Some("NOSCRIPT")) {
            self.conn
                .load_scripts_for(Some(cmd), &[&COMMIT_DISPATCH.source])
                .await?;
            let again = super::scripts::as_eval(cmd, &COMMIT_DISPATCH.source);
            replies = self
                .conn
                .exec_each(&[(shard, again), (shard, client_info())])
                .await?;
        }
        let mut replies = replies.into_iter();
        let v = replies.next().expect("two replies")?;
        let conn = replies
            .next()
            .and_then(|r| r.ok())
            .and_then(|i| conn_id(&i));
        Ok((v, conn))
    }

    /// Binds (sender, client id) to the message digest on the sender's shard `home` (one
    /// `SET NX GET EX`), before any shard commits: a send that reuses an id for another
    /// message is then refused as a whole, even where its recipients fall in shards the
    /// first message did not touch. The binding lives as long as the dedupe records.
    pub async fn claim_message_id(
        &mut self,
        home: u32,
        sender: &str,
        client_id: &str,
        digest: &str,
        ttl_s: u64,
    ) -> Result<IdClaim> {
        let old: Option<String> = redis::cmd("SET")
            .arg(keys::message_id(home, sender, client_id))
            .arg(digest)
            .arg("NX")
            .arg("GET")
            .arg("EX")
            .arg(ttl_s.max(1))
            .query_async(&mut self.conn)
            .await?;
        // a claim made inside a commit may hold "<offset>:<digest>" (ADR-0040)
        Ok(match old {
            None => IdClaim::New,
            Some(d) if d.rsplit(':').next() == Some(digest) => IdClaim::SameMessage,
            Some(_) => IdClaim::OtherMessage,
        })
    }

    /// Records of `dlog:{s}` with offset > `after`, at most `count`, in order.
    pub async fn read_after(
        &mut self,
        shard: u32,
        after: u64,
        count: usize,
    ) -> Result<Vec<DispatchRecord>> {
        let v: Value = redis::cmd("XRANGE")
            .arg(keys::dlog(shard))
            .arg(format!("({after}-0"))
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.conn)
            .await?;
        parse_entries(shard, &v)
    }

    /// Last offset assigned in the shard (0 when none).
    pub async fn head(&mut self, shard: u32) -> Result<u64> {
        let v: Option<u64> = redis::cmd("GET")
            .arg(keys::head(shard))
            .query_async(&mut self.conn)
            .await?;
        Ok(v.unwrap_or(0))
    }

    /// Raises `head:{s}` to `to` when it is below (one atomic step); returns the head it had
    /// when it was raised, `None` when it was already at or above `to`.
    ///
    /// For a core instance restored to an earlier point than the mailbox side: its head is
    /// below offsets the mailboxes already hold (W), and a new commit there would be given an
    /// offset at or below W — a replay to the materializer, never delivered. Raising the head
    /// to W first makes the next commit W + 1.
    pub async fn raise_head(&mut self, shard: u32, to: u64) -> Result<Option<u64>> {
        static RAISE_HEAD: std::sync::LazyLock<super::scripts::Script> = std::sync::LazyLock::new(
            || {
                super::scripts::Script::new(
                    "raise_head",
                    "local h = tonumber(redis.call('GET', KEYS[1]) or '0') \
                     if h < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) return h end \
                     return -1"
                        .to_string(),
                )
            },
        );
        let old: i64 = RAISE_HEAD
            .key(keys::head(shard))
            .arg(to)
            .invoke(&mut self.conn)
            .await?;
        Ok(u64::try_from(old).ok())
    }

    /// Trims `dlog:{s}` to records above `upto` (they are fully materialised).
    pub async fn trim(&mut self, shard: u32, upto: u64) -> Result<u64> {
        let n: u64 = trim_cmd(shard, upto).query_async(&mut self.conn).await?;
        Ok(n)
    }

    /// [`Self::trim`] of several shards, `(shard, upto)` each, in one pipeline (on a Redis
    /// Cluster, one per shard, run concurrently): one result per trim, in the given order.
    ///
    /// Why (ADR-0088): with `appendfsync always` every write that reaches Redis in an event
    /// loop iteration of its own costs an `fdatasync`, about a third of core Redis's CPU per
    /// message. One `XTRIM` per shard and second, each its own round trip, was 12 % of core
    /// Redis's `fdatasync`s at 5,000 msg/s; trims that arrive together share one.
    pub async fn trim_many(&mut self, trims: &[(u32, u64)]) -> Result<Vec<Result<u64>>> {
        if trims.is_empty() {
            // (an empty pipeline is an error of redis-rs, not an empty answer)
            return Ok(Vec::new());
        }
        let cmds: Vec<(u32, redis::Cmd)> = trims
            .iter()
            .map(|&(s, upto)| (s, trim_cmd(s, upto)))
            .collect();
        let replies = self.conn.exec_each(&cmds).await?;
        Ok(replies
            .into_iter()
            .map(|r| -> Result<u64> {
                Ok(redis::from_redis_value::<u64>(r?).map_err(redis::RedisError::from)?)
            })
            .collect())
    }

    /// Number of records currently kept in `dlog:{s}`.
    pub async fn log_len(&mut self, shard: u32) -> Result<u64> {
        Ok(redis::cmd("XLEN")
            .arg(keys::dlog(shard))
            .query_async(&mut self.conn)
            .await?)
    }
}

/// Reader of several shards' logs on one core Redis (or cluster), in log order.
///
/// One instance: `XREAD BLOCK` over every shard's log on a connection of its own, without
/// response timeout (XREAD BLOCK would otherwise be cut off).
///
/// A Redis Cluster refuses one XREAD over keys of several slots, so there the reader keeps
/// a sharded subscription to the commit hints (`dlogwake:{s}`, published by
/// `commit_dispatch.lua` in the commit itself) and reads, per shard, only the logs that may
/// have more: a shard is read again when a hint names it, when the caller asks for another
/// position than the one the last read ended at (a resync, a new shard), when its last read
/// was full, after any dropped node connection (hints may be lost), and every
/// [`CLUSTER_SWEEP`] in any case. Between those it waits on the hints up to `block`.
///
/// With a replica wait ([`LogReader::set_replica_wait`]; `--core-wait-replicas`), a read
/// hands on only records the core replicas have confirmed (ADR-0064): when a read finds
/// records, the shards that had some are read again in one pipeline with a write of
/// `dlogsync:{s}` and `WAIT` (the first read then asks for one record per shard: it only
/// finds the shards; the write is `mark_log_read.lua`, allowed on an instance out of memory),
/// and the records of that second read are returned only if the
/// `WAIT` counted enough replicas (replication is in order, so the `WAIT` covers every record
/// the primary held when it ran the read, whichever connection ran the pipeline). Otherwise
/// that shard's records are held back and read again at the next call. A record a promoted
/// replica may lack is thus never materialised, so W never passes an offset the new primary
/// will hand out again.
pub struct LogReader {
    inner: ReaderInner,
    /// Replicas a record must be on before it is handed on (`None`: none asked).
    wait: Option<ReplicaWait>,
}

enum ReaderInner {
    Single(MultiplexedConnection),
    Cluster(Box<ClusterReader>),
}

/// How often a cluster log reader reads every shard even without a hint (a safety net: hints
/// are published by the commit itself and their loss is detected, so this finds nothing in
/// normal operation).
pub const CLUSTER_SWEEP: Duration = Duration::from_secs(5);

/// Longest wait for one shard's read on a cluster (ADR-0117): a read of the records there is
/// answers in milliseconds; one that takes this long is on a node that is gone or hung (the
/// cluster client retries a refused connection for about 10 s, and a hung node's answer never
/// comes), and it must not hold up the shards of the other nodes.
const SHARD_READ_TIMEOUT: Duration = Duration::from_secs(2);

struct ClusterReader {
    endpoint: String,
    conn: Conn,
    sub: Option<crate::endpoint::ShardedSub>,
    subscribed: std::collections::HashSet<u32>,
    /// Shards to read at the next call.
    dirty: std::collections::HashSet<u32>,
    /// Where the last read of each shard ended (the position a caller in step asks next).
    expect: HashMap<u32, u64>,
    last_sweep: tokio::time::Instant,
    /// Confirming pipelines in flight (ADR-0064), at most one per shard, each with the
    /// position it read from. The pipelines of one node share a connection, and a `WAIT`
    /// holds it: with that node's replicas down they time out one after another. A read
    /// waits only briefly for the ones it started (ADR-0066) and does not read a shard whose
    /// pipeline is still running, so shards on other nodes are not held up by those
    /// timeouts; a pipeline that ends wakes a waiting read ([`ClusterReader::done`]).
    confirming: HashMap<u32, tokio::task::JoinHandle<Confirmation>>,
    /// The connections the confirming pipelines run on: not [`ClusterReader::conn`], since a
    /// `WAIT` holds its node's connection until it answers, and a node whose replicas are
    /// away would hold every read of its shards behind its `WAIT`s, and with them (one read
    /// joins them all) the other nodes' records (ADR-0066).
    confirm_conn: Conn,
    /// Told by each confirming pipeline as it ends (a permit is kept if no read waits), so
    /// a read blocked on hints takes the outcome at once.
    done: std::sync::Arc<tokio::sync::Notify>,
    /// Shards whose last confirmation ended in an error of Redis (ADR-0069): their node
    /// refused the marker write (`NOREPLICAS` under `min-replicas-to-write` with its replicas
    /// away, say) or the pipeline failed. Such a shard is neither read nor confirmed again
    /// before the instant given, and the wait doubles with each error in a row
    /// ([`CONFIRM_RETRY_MIN`] to [`CONFIRM_RETRY_MAX`]): one node's refusals hold back only
    /// its own shards' records, where before they failed every read, and with it every other
    /// node's records, for as long as they lasted.
    confirm_backoff: HashMap<u32, (tokio::time::Instant, Duration)>,
    /// Shards whose last read failed or took [`SHARD_READ_TIMEOUT`] (ADR-0117), with when
    /// they may be read again and the wait that led there (doubling from
    /// [`CONFIRM_RETRY_MIN`] to [`CONFIRM_RETRY_MAX`]). Before, the reads of every shard were
    /// joined and one failure failed them all: a primary's death stopped the delivery of every
    /// shard of the cluster until its failover ended, and the reader made again to recover
    /// subscribed to the dead node's channels too, and failed the same way.
    read_backoff: HashMap<u32, (tokio::time::Instant, Duration)>,
    /// Confirmations that ended in an error reply since [`LogReader::take_confirm_errors`]
    /// last took them: the worker counts them in its metrics (the warning alone is easy to
    /// miss).
    confirm_errors: u64,
}

impl LogReader {
    /// Opens a dedicated connection for blocking reads (on a cluster: a connection and a
    /// sharded subscription, see [`LogReader`]).
    pub async fn connect(url: &str) -> Result<LogReader> {
        if crate::endpoint::is_cluster(url) {
            let conn = endpoint::connect(url, endpoint::ConnectOptions::default()).await?;
            let confirm_conn = endpoint::connect(url, endpoint::ConnectOptions::default()).await?;
            return Ok(LogReader {
                wait: None,
                inner: ReaderInner::Cluster(Box::new(ClusterReader {
                    endpoint: url.to_string(),
                    conn,
                    sub: None,
                    subscribed: Default::default(),
                    dirty: Default::default(),
                    expect: HashMap::new(),
                    last_sweep: tokio::time::Instant::now(),
                    confirming: HashMap::new(),
                    confirm_conn,
                    done: Default::default(),
                    confirm_backoff: HashMap::new(),
                    read_backoff: HashMap::new(),
                    confirm_errors: 0,
                })),
            });
        }
        let client = redis::Client::open(url)?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(Duration::from_secs(5)));
        let conn = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await?;
        Ok(LogReader {
            inner: ReaderInner::Single(conn),
            wait: None,
        })
    }

    /// Confirmations that ended in an error reply of a node and held back only their shard
    /// (ADR-0069), since the last call; zero on one instance (there an error fails the read).
    pub fn take_confirm_errors(&mut self) -> u64 {
        match &mut self.inner {
            ReaderInner::Cluster(r) => std::mem::take(&mut r.confirm_errors),
            ReaderInner::Single(_) => 0,
        }
    }

    /// Hand on only records confirmed on `wait.replicas` core replicas (ADR-0064); `None`:
    /// every record the primary holds.
    pub fn set_replica_wait(&mut self, wait: Option<ReplicaWait>) {
        self.wait = wait;
    }

    /// Records after each shard's position, per shard in log order, at most `count` per
    /// shard. Empty when nothing arrived within `block`; a zero `block` does not wait (what
    /// is there now, or nothing).
    pub async fn read(
        &mut self,
        positions: &[(u32, u64)],
        count: usize,
        block: Duration,
    ) -> Result<Vec<(u32, Vec<DispatchRecord>)>> {
        // with a wait, the first read only finds the shards that have records (one each): the
        // confirming read takes them all, so no record is read and parsed twice
        let first = if self.wait.is_some() { 1 } else { count };
        let deadline = tokio::time::Instant::now() + block;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let got = match &mut self.inner {
                ReaderInner::Single(conn) => read_blocking(conn, positions, first, left).await?,
                ReaderInner::Cluster(r) => r.read(positions, first, left).await?,
            };
            let Some(wait) = self.wait.filter(|_| !got.is_empty()) else {
                return Ok(got);
            };
            let out = self.confirmed(positions, count, &got, wait).await?;
            // on a cluster, confirmations not in yet end in tasks of their own and wake the
            // next read (the shards they cover are not read meanwhile): wait for them, or for
            // other shards' records, until the block time is over (ADR-0066)
            let single = matches!(self.inner, ReaderInner::Single(_));
            if !out.is_empty() || single || tokio::time::Instant::now() >= deadline {
                return Ok(out);
            }
        }
    }

    /// The records of the shards in `got` (the first read: at most one record per shard) that
    /// the replicas have confirmed: those shards read again from `positions`, up to `count`
    /// records each, each read pipelined with a write of `dlogsync:{s}` and `WAIT`
    /// (one pipeline for all on one instance; one per shard, on its slot's primary, on a
    /// cluster). A shard whose `WAIT` counted too few replicas gives nothing now (a warning;
    /// on a cluster it is read again at the next call).
    async fn confirmed(
        &mut self,
        positions: &[(u32, u64)],
        count: usize,
        got: &[(u32, Vec<DispatchRecord>)],
        wait: ReplicaWait,
    ) -> Result<Vec<(u32, Vec<DispatchRecord>)>> {
        let again: Vec<(u32, u64)> = positions
            .iter()
            .copied()
            .filter(|(s, _)| got.iter().any(|(g, recs)| g == s && !recs.is_empty()))
            .collect();
        if again.is_empty() {
            return Ok(Vec::new());
        }
        let marker = |s: u32| {
            let last = got
                .iter()
                .find(|(g, _)| *g == s)
                .and_then(|(_, recs)| recs.last())
                .map_or(0, |r| r.offset);
            let mut c = redis::cmd("EVAL");
            c.arg(MARK_LOG_READ)
                .arg(1)
                .arg(keys::dlog_sync(s))
                .arg(last);
            c
        };
        match &mut self.inner {
            ReaderInner::Single(conn) => {
                let read = xread(&again, count, Duration::ZERO);
                match with_wait(conn, &[read, marker(again[0].0)], wait).await {
                    Ok(v) => parse_xread(&v[0]),
                    Err(WaitError::Redis(e)) => Err(e.into()),
                    Err(WaitError::Short) => {
                        not_confirmed(&again, wait);
                        Ok(Vec::new())
                    }
                }
            }
            ReaderInner::Cluster(r) => {
                let mut mine = Vec::new();
                // (no shard in a failed confirmation's wait is here: the read left it out)
                for &(s, after) in &again {
                    if r.confirming.contains_key(&s) {
                        continue;
                    }
                    let mut conn = r.confirm_conn.clone();
                    let cmds = [xread(&[(s, after)], count, Duration::ZERO), marker(s)];
                    let done = r.done.clone();
                    let task = tokio::spawn(async move {
                        let res = with_wait(&mut conn, &cmds, wait).await;
                        done.notify_one();
                        (after, res)
                    });
                    r.confirming.insert(s, task);
                    mine.push(s);
                }
                // the confirmations this call started: until all have answered, or
                // [`CONFIRM_GRACE`] after the first answer, and at most [`CONFIRM_PATIENCE`]
                // (within the WAIT timeout and a margin for the reply). The shards of a node
                // whose replicas lag or are down do not hold up the others' records, which
                // before waited one WAIT timeout per read; what is still running ends in its
                // task and wakes a later read. Others' confirmations that ended meanwhile are
                // taken too.
                let until = tokio::time::Instant::now()
                    + CONFIRM_PATIENCE.min(wait.timeout + CONFIRM_MARGIN);
                let mut deadline = until;
                let mut ended = Vec::new();
                loop {
                    let pending: Vec<u32> = mine
                        .iter()
                        .copied()
                        .filter(|s| r.confirming.contains_key(s))
                        .collect();
                    if pending.is_empty() {
                        break;
                    }
                    let confirming = &mut r.confirming;
                    let ready = std::future::poll_fn(|cx| {
                        let mut ready = Vec::new();
                        for s in &pending {
                            let task = confirming.get_mut(s).expect("pending");
                            if let std::task::Poll::Ready(joined) =
                                std::future::Future::poll(std::pin::Pin::new(task), cx)
                            {
                                ready.push((*s, joined));
                            }
                        }
                        if ready.is_empty() {
                            std::task::Poll::Pending
                        } else {
                            std::task::Poll::Ready(ready)
                        }
                    });
                    let Ok(ready) = tokio::time::timeout_at(deadline, ready).await else {
                        break;
                    };
                    for (s, joined) in ready {
                        r.confirming.remove(&s);
                        ended.push((s, joined));
                    }
                    if deadline == until {
                        deadline = until.min(tokio::time::Instant::now() + CONFIRM_GRACE);
                    }
                }
                let finished: Vec<u32> = r
                    .confirming
                    .iter()
                    .filter(|(_, t)| t.is_finished())
                    .map(|(s, _)| *s)
                    .collect();
                for s in finished {
                    let task = r.confirming.remove(&s).expect("listed");
                    ended.push((s, task.await));
                }
                let mut out = Vec::new();
                for (s, joined) in ended {
                    let (from, res) = match joined {
                        Ok(r) => r,
                        Err(e) => {
                            return Err(redis::RedisError::from(std::io::Error::other(
                                e.to_string(),
                            ))
                            .into())
                        }
                    };
                    // read from where this call asks? (else: read again, from there)
                    let asked = positions.iter().any(|&(p, after)| p == s && after == from);
                    if !matches!(res, Err(WaitError::Redis(_))) {
                        r.confirm_backoff.remove(&s);
                    }
                    match res {
                        Ok(v) if asked => {
                            for (s, recs) in parse_xread(&v[0])? {
                                if let Some(last) = recs.last() {
                                    // where a caller in step asks next
                                    r.expect.insert(s, last.offset);
                                }
                                // the first read (of one) marked it as having more
                                if recs.len() < count {
                                    r.dirty.remove(&s);
                                }
                                out.push((s, recs));
                            }
                        }
                        Ok(_) => {
                            r.expect.remove(&s);
                        }
                        // the connection's own trouble: a new reader is the remedy
                        Err(WaitError::Redis(e)) if connection_trouble(&e) => return Err(e.into()),
                        Err(WaitError::Redis(e)) => {
                            // the node refused (an error reply): this shard's records wait,
                            // the others' go on (ADR-0069); the wait doubles while the
                            // errors follow one another, and starts over after a pause
                            let now = tokio::time::Instant::now();
                            let next = back_off(&mut r.confirm_backoff, s, now);
                            r.confirm_errors += 1;
                            r.expect.remove(&s);
                            tracing::warn!(
                                shard = s,
                                error = %e,
                                retry_in = ?next,
                                "confirming log records on the core replicas failed; the \
                                 shard's records are held back and confirmed again later"
                            );
                        }
                        Err(WaitError::Short) => {
                            not_confirmed(&[(s, 0)], wait);
                            // not where a caller in step asks next: read it again then
                            r.expect.remove(&s);
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// A confirming pipeline's outcome: the position it read from, and its replies (the read's
/// first) or why it confirmed nothing.
type Confirmation = (u64, std::result::Result<Vec<Value>, WaitError>);

/// How long past its `WAIT`'s timeout a confirming pipeline's reply may take before a read
/// stops waiting for it (it is picked up by a later read).
const CONFIRM_MARGIN: Duration = Duration::from_millis(100);

/// How long a read that has some shards' confirmations waits for the rest before it hands on
/// what it has: the confirmations of healthy replicas answer within a few milliseconds of
/// each other, while a node whose replicas lag or are down answers only at its `WAIT`'s
/// timeout (its shards are handed on by a later read).
const CONFIRM_GRACE: Duration = Duration::from_millis(10);

/// The longest a read waits for the confirmations it started before it goes back to waiting
/// for hints and for the confirmations to end (a confirmation that ends later wakes it):
/// healthy replicas answer well within it.
const CONFIRM_PATIENCE: Duration = Duration::from_millis(100);

/// `mark_log_read.lua`: the write a log reader's `WAIT` covers (ADR-0064), allowed when the
/// instance is out of memory. Sent as `EVAL`: a few bytes, only by reads that found records.
const MARK_LOG_READ: &str = include_str!("lua/core/mark_log_read.lua");

/// The first wait before a shard whose confirmation failed with an error is read and
/// confirmed again (ADR-0069); it doubles with each error in a row up to
/// [`CONFIRM_RETRY_MAX`].
const CONFIRM_RETRY_MIN: Duration = Duration::from_millis(100);
const CONFIRM_RETRY_MAX: Duration = Duration::from_secs(5);

/// Whether an error of a confirming pipeline is its connection's (I/O, a timeout, a dropped
/// or refused connection, one redis-rs says needs a new connection), not a reply of the
/// node: such an error still fails the read, so that the worker replaces the reader and its
/// connections (ADR-0069).
fn connection_trouble(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

/// Logs records held back by [`LogReader::confirmed`].
fn not_confirmed(shards: &[(u32, u64)], wait: ReplicaWait) {
    let shards: Vec<u32> = shards.iter().map(|(s, _)| *s).collect();
    tracing::warn!(
        ?shards,
        replicas = wait.replicas,
        timeout = ?wait.timeout,
        "log records not yet confirmed on the core replicas; held back"
    );
}

/// `XREAD COUNT count [BLOCK block] STREAMS dlog:{s}… after…` (no `BLOCK` for a zero
/// `block`: `BLOCK 0` would wait for ever).
fn xread(positions: &[(u32, u64)], count: usize, block: Duration) -> redis::Cmd {
    // sized once (a key and an id per shard): grown argument by argument it was reallocated
    // several times per read (ADR-0071)
    let mut cmd = redis::Cmd::with_capacity(6 + 2 * positions.len(), 48 + 40 * positions.len());
    cmd.arg("XREAD").arg("COUNT").arg(count);
    if !block.is_zero() {
        cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
    }
    cmd.arg("STREAMS");
    for (s, _) in positions {
        cmd.arg(Key::dlog(*s));
    }
    let mut id = [0u8; STREAM_ID_MAX];
    for (_, after) in positions {
        cmd.arg(stream_id(*after, &mut id));
    }
    cmd
}

/// The longest stream id [`stream_id`] writes: 20 digits (u64) and `-0`.
const STREAM_ID_MAX: usize = 22;

/// The log's stream id of offset `o`, `"<o>-0"`, written into `buf` without an allocation (an
/// `XREAD` names one per shard it reads; ADR-0071).
fn stream_id(o: u64, buf: &mut [u8; STREAM_ID_MAX]) -> &[u8] {
    let mut n = itoa::Buffer::new();
    let digits = n.format(o).as_bytes();
    let len = digits.len();
    buf[..len].copy_from_slice(digits);
    buf[len..len + 2].copy_from_slice(b"-0");
    &buf[..len + 2]
}

/// [`xread`] on one instance.
async fn read_blocking(
    conn: &mut MultiplexedConnection,
    positions: &[(u32, u64)],
    count: usize,
    block: Duration,
) -> Result<Vec<(u32, Vec<DispatchRecord>)>> {
    let v: Value = xread(positions, count, block).query_async(conn).await?;
    parse_xread(&v)
}

fn parse_xread(v: &Value) -> Result<Vec<(u32, Vec<DispatchRecord>)>> {
    let mut out = Vec::new();
    let streams: Vec<&Value> = match v {
        Value::Nil => return Ok(out),
        Value::Array(a) => a.iter().collect(),
        Value::Map(m) => {
            // RESP3 shape: key => entries
            for (k, entries) in m {
                let name = match k {
                    Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    _ => continue,
                };
                if let Some(s) = shard_of_dlog_key(&name) {
                    out.push((s, parse_entries(s, entries)?));
                }
            }
            return Ok(out);
        }
        _ => return Ok(out),
    };
    for st in streams {
        if let Value::Array(pair) = st {
            if let [Value::BulkString(k), entries] = pair.as_slice() {
                if let Some(s) = shard_of_dlog_key(&String::from_utf8_lossy(k)) {
                    out.push((s, parse_entries(s, entries)?));
                }
            }
        }
    }
    Ok(out)
}

impl Drop for ClusterReader {
    /// A reader dropped (replaced after an error, or its worker stopped) stops its confirming
    /// pipelines too: nobody would take their outcomes.
    fn drop(&mut self) {
        for task in self.confirming.values() {
            task.abort();
        }
    }
}

impl ClusterReader {
    /// Subscribes to the hints of every shard of `positions` not yet subscribed (after a
    /// (re)connect: all of them, and every shard is read once).
    async fn subscribe(&mut self, positions: &[(u32, u64)]) -> Result<()> {
        if self.sub.is_none() {
            let channels: Vec<String> =
                positions.iter().map(|(s, _)| keys::dlog_wake(*s)).collect();
            let sub = crate::endpoint::ShardedSub::connect(&self.endpoint, &channels).await?;
            self.sub = Some(sub);
            self.subscribed = positions.iter().map(|(s, _)| *s).collect();
            self.dirty.extend(positions.iter().map(|(s, _)| *s));
            return Ok(());
        }
        let sub = self.sub.as_mut().expect("checked");
        for (s, _) in positions {
            if self.subscribed.insert(*s) {
                sub.conn.ssubscribe(keys::dlog_wake(*s)).await?;
                self.dirty.insert(*s);
            }
        }
        Ok(())
    }

    /// Takes every push waiting; `true` when a node connection dropped (hints may be lost).
    fn drain(&mut self) -> bool {
        let Some(sub) = self.sub.as_mut() else {
            return true;
        };
        let mut lost = false;
        while let Ok(push) = sub.rx.try_recv() {
            lost |= note_push(&mut self.dirty, &push);
        }
        lost
    }

    async fn read(
        &mut self,
        positions: &[(u32, u64)],
        count: usize,
        block: Duration,
    ) -> Result<Vec<(u32, Vec<DispatchRecord>)>> {
        if let Err(e) = self.subscribe(positions).await {
            self.sub = None;
            return Err(e);
        }
        let deadline = tokio::time::Instant::now() + block;
        loop {
            let mut all = self.drain();
            if self.last_sweep.elapsed() >= CLUSTER_SWEEP {
                all = true;
            }
            if all {
                self.last_sweep = tokio::time::Instant::now();
            }
            // (a shard whose confirmation is still running is not read: its records are
            // handed on once that ends, ADR-0066; one that has ended is read, so that its
            // outcome is taken)
            // (nor is one whose confirmation failed, until its wait is over: ADR-0069)
            let confirming = &self.confirming;
            let now = tokio::time::Instant::now();
            let backoff = &self.confirm_backoff;
            let read_backoff = &self.read_backoff;
            let running = |s: &u32| {
                confirming.get(s).is_some_and(|t| !t.is_finished())
                    || backoff.get(s).is_some_and(|(until, _)| *until > now)
                    || read_backoff.get(s).is_some_and(|(until, _)| *until > now)
            };
            let targets: Vec<(u32, u64)> = positions
                .iter()
                .copied()
                .filter(|(s, after)| {
                    (all || self.dirty.contains(s)
                        || self.expect.get(s) != Some(after)
                        || confirming.contains_key(s))
                        && !running(s)
                })
                .collect();
            // a hint for a shard not read now stays noted
            let kept: Vec<u32> = self.dirty.iter().copied().filter(|s| running(s)).collect();
            self.dirty.clear();
            self.dirty.extend(kept);
            if !targets.is_empty() {
                let reads = targets.iter().map(|&(s, after)| {
                    let mut conn = self.conn.clone();
                    async move {
                        let read = async {
                            let v: Value = xread(&[(s, after)], count, Duration::ZERO)
                                .query_async(&mut conn)
                                .await?;
                            parse_xread(&v)
                        };
                        let got = match tokio::time::timeout(SHARD_READ_TIMEOUT, read).await {
                            Ok(r) => r,
                            Err(_) => {
                                Err(Error::Redis(redis::RedisError::from(std::io::Error::new(
                                    std::io::ErrorKind::TimedOut,
                                    "the shard's node did not answer the read in time",
                                ))))
                            }
                        };
                        (s, after, got)
                    }
                });
                let mut out = Vec::new();
                let (mut failed, mut first_error) = (0, None);
                let n_targets = targets.len();
                for (s, after, got) in futures::future::join_all(reads).await {
                    let got = match got {
                        Ok(got) => {
                            self.read_backoff.remove(&s);
                            got
                        }
                        Err(e) => {
                            // this shard waits; the others are handed on (ADR-0117)
                            let next = back_off(&mut self.read_backoff, s, now);
                            self.expect.remove(&s);
                            tracing::warn!(shard = s, error = %e, retry_in = ?next, "log read of a shard failed; the other shards go on");
                            failed += 1;
                            first_error.get_or_insert(e);
                            continue;
                        }
                    };
                    let recs: Vec<DispatchRecord> =
                        got.into_iter().flat_map(|(_, recs)| recs).collect();
                    let end = recs.last().map(|r| r.offset).unwrap_or(after);
                    self.expect.insert(s, end);
                    if recs.len() >= count {
                        self.dirty.insert(s);
                    }
                    if recs.is_empty() {
                        // nothing after the position now: an ended confirmation of the shard
                        // has nothing left to hand on (nor a failed one's wait to keep)
                        self.confirming.remove(&s);
                        self.confirm_backoff.remove(&s);
                    } else {
                        out.push((s, recs));
                    }
                }
                if failed == n_targets {
                    // every read failed: the cluster (or this process's way to it) is down,
                    // and the reader is made again, as before
                    return Err(first_error.expect("a failure"));
                }
                if !out.is_empty() {
                    return Ok(out);
                }
            }
            // nothing to read: wait for a hint, a confirmation's end, the block time, the
            // next sweep, or the end of a failed confirmation's or read's wait
            let sweep_at = self
                .confirm_backoff
                .values()
                .chain(self.read_backoff.values())
                .map(|(until, _)| *until)
                .filter(|until| *until > now)
                .fold(self.last_sweep + CLUSTER_SWEEP, |a, b| a.min(b));
            let done = self.done.clone();
            let Some(sub) = self.sub.as_mut() else {
                return Ok(Vec::new());
            };
            tokio::select! {
                _ = done.notified() => {}
                push = sub.rx.recv() => match push {
                    Some(push) => {
                        if note_push(&mut self.dirty, &push) {
                            self.last_sweep = tokio::time::Instant::now() - CLUSTER_SWEEP;
                        }
                    }
                    None => {
                        self.sub = None;
                        return Ok(Vec::new());
                    }
                },
                _ = tokio::time::sleep_until(deadline.min(sweep_at)) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Ok(Vec::new());
                    }
                }
            }
        }
    }
}

/// Records another failure of `shard` in `backoff` (a cluster reader's confirmations,
/// ADR-0069, or reads, ADR-0117): the shard waits a delay that doubles while failures follow
/// one another ([`CONFIRM_RETRY_MIN`] to [`CONFIRM_RETRY_MAX`]) and starts over after a pause.
/// Returns the delay.
fn back_off(
    backoff: &mut HashMap<u32, (tokio::time::Instant, Duration)>,
    shard: u32,
    now: tokio::time::Instant,
) -> Duration {
    let next = match backoff.get(&shard) {
        Some((until, d)) if now <= *until + CONFIRM_RETRY_MAX => (*d * 2).min(CONFIRM_RETRY_MAX),
        _ => CONFIRM_RETRY_MIN,
    };
    backoff.insert(shard, (now + next, next));
    next
}

/// Notes a push in `dirty`; `true` when it reports a dropped connection.
fn note_push(dirty: &mut std::collections::HashSet<u32>, push: &redis::PushInfo) -> bool {
    if let Some((ch, _)) = crate::endpoint::smessage(push) {
        if let Some(s) = ch
            .strip_prefix("dlogwake:{")
            .and_then(|r| r.strip_suffix('}'))
            .and_then(|n| n.parse().ok())
        {
            dirty.insert(s);
        }
        return false;
    }
    push.kind == redis::PushKind::Disconnection
}

fn shard_of_dlog_key(k: &str) -> Option<u32> {
    k.strip_prefix("dlog:{")?.strip_suffix('}')?.parse().ok()
}

#[cfg(test)]
mod tests {

    /// [`stream_id`] writes what `format!("{o}-0")` does, to the longest offset.
    #[test]
    fn stream_id_is_the_format_form() {
        let mut buf = [0u8; STREAM_ID_MAX];
        for o in [0, 1, 9, 10, 99, 281_474_976_710_655, u64::MAX] {
            assert_eq!(stream_id(o, &mut buf), format!("{o}-0").as_bytes());
        }
    }

    /// The digest's hex is `format!("{:032x}")`'s, digit for digit: stored claims and dedupe
    /// records hold it, and a resend must match them.
    #[test]
    fn hex32_is_the_format_form() {
        let mut v: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
        for x in [0, 1, 0xf, 0x10, u128::MAX, u128::MAX / 3, 1 << 127] {
            assert_eq!(hex32(x), format!("{x:032x}"));
        }
        for _ in 0..1000 {
            v = v
                .wrapping_mul(0x2545_f491_4f6c_dd1d)
                .wrapping_add(0x9e37_79b9);
            assert_eq!(hex32(v), format!("{v:032x}"));
        }
    }
    use super::*;

    #[test]
    fn digest_is_of_the_recipient_set_and_the_body() {
        let d = request_digest(&["b", "a"], "hi");
        assert_eq!(d.len(), 32);
        assert_eq!(d, request_digest(&["a", "b", "a"], "hi"));
        assert_ne!(d, request_digest(&["a"], "hi"));
        assert_ne!(d, request_digest(&["a", "b"], "hi!"));
        // the length prefix keeps boundaries: ["ab"] is not ["a", "b"]
        assert_ne!(request_digest(&["ab"], ""), request_digest(&["a", "b"], ""));
        // a known value: stored claims and dedupe records hold digests, so a later build must
        // compute the same one for the same message
        assert_eq!(
            request_digest(&["bob"], "hello"),
            "ef6e9f46d83049e1176b35971d89cadf"
        );
    }

    /// The digest as it was computed before it avoided building lists (ADR-0079): the
    /// recipients collected, sorted and deduplicated, the bytes in a `Vec`.
    fn reference_digest(recipients: &[&str], body: &str) -> String {
        let mut rs: Vec<&str> = recipients.to_vec();
        rs.sort_unstable();
        rs.dedup();
        let mut bytes = Vec::new();
        for r in rs {
            bytes.extend_from_slice(&(r.len() as u32).to_be_bytes());
            bytes.extend_from_slice(r.as_bytes());
        }
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        bytes.extend_from_slice(body.as_bytes());
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes))
    }

    proptest::proptest! {
        /// The digest is the reference's for any recipients and body, on the stack (short) or
        /// not (long), from `&str`s or `String`s.
        #[test]
        fn digest_is_the_reference_digest(
            rs in proptest::collection::vec("[a-c]{0,3}|[a-zé]{1,40}", 0..6),
            body in "(.{0,20}|.{200,400})",
        ) {
            let refs: Vec<&str> = rs.iter().map(String::as_str).collect();
            let want = reference_digest(&refs, &body);
            proptest::prop_assert_eq!(&request_digest(&refs, &body), &want);
            proptest::prop_assert_eq!(&request_digest(&rs, &body), &want);
        }
    }

    #[test]
    fn recipients_round_trip() {
        let rs = ["a", "bob", "ü"];
        assert_eq!(
            decode_recipients(&encode_recipients(&rs)).unwrap(),
            rs.iter().map(|s| s.to_string()).collect::<Vec<_>>()
        );
        assert!(decode_recipients(&[3, b'a']).is_none());
        assert!(decode_recipients(&[0]).is_none());
    }

    #[test]
    fn a_packed_record_is_its_layout_byte_by_byte() {
        let m = encode_record("al", "m-1", &["bob", "c"], 0x0102, "hi");
        let want: Vec<u8> = [
            &[1u8, 2][..],
            b"al",
            &[0, 0, 0, 3],
            b"m-1",
            &[0, 0, 0, 6],
            &[3],
            b"bob",
            &[1],
            b"c",
            &[0, 0, 0, 0, 0, 0, 1, 2],
            b"hi",
        ]
        .concat();
        assert_eq!(m, want);
        let (sender, id, rs, t, body) = decode_record(&m).unwrap();
        assert_eq!(
            (sender.as_str(), id.as_str(), t, body.as_str()),
            ("al", "m-1", 0x0102, "hi")
        );
        assert_eq!(rs, ["bob", "c"]);
    }

    #[test]
    fn a_packed_record_that_is_not_its_layout_is_refused() {
        let m = encode_record("al", "m-1", &["bob"], 7, "hi");
        // every cut inside the fixed part (the body may be cut: it is the rest)
        for n in 0..m.len() - 2 {
            assert!(decode_record(&m[..n]).is_err(), "cut at {n}");
        }
        let mut other = m.clone();
        other[0] = 2;
        assert_eq!(
            decode_record(&other).unwrap_err(),
            "packed record of an unknown form"
        );
        // a client id length past the end
        let mut long = m.clone();
        long[7] = 200;
        assert!(decode_record(&long).is_err());
        // a body that is not UTF-8
        let mut bad = m.clone();
        *bad.last_mut().unwrap() = 0xff;
        assert!(decode_record(&bad).is_err());
        // an empty recipient name inside the recipients
        let mut empty = m.clone();
        let r = 2 + 2 + 4 + 3 + 4;
        empty[r] = 0;
        assert!(decode_record(&empty).is_err());
    }

    proptest::proptest! {
        #[test]
        fn packed_records_round_trip(
            sender in "[a-z0-9ü]{1,42}",
            id in "\\PC{0,40}",
            rs in proptest::collection::vec("[a-z0-9é]{1,40}", 0..5),
            t in proptest::prelude::any::<u64>(),
            body in "\\PC{0,60}",
        ) {
            let refs: Vec<&str> = rs.iter().map(String::as_str).collect();
            let m = encode_record(&sender, &id, &refs, t, &body);
            proptest::prop_assert_eq!(decode_record(&m), Ok((sender, id, rs, t, body)));
        }

        #[test]
        fn any_bytes_decode_without_panicking(m in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = decode_record(&m);
        }
    }
}
