//! Wake-up hints on `wake:{s}` (Pub/Sub), end to end: the payload codec, the publisher
//! ([`publish_wake`], used by the materializer after W moves) and the subscriber
//! ([`WakeSubscriber`], used by the gateway: one per mailbox instance). A hint is never the data
//! path: it only tells gateways which mailboxes may have new entries; a reader always re-reads
//! W and the mailbox. Which connections a hint wakes is the gateway's business.
//!
//! ```text
//! payload = <min present W, decimal> '\n' [ tag ] { <len u8 (1..=128)> <recipient id bytes> }*
//! tag     = <len u8> 0x00 <epoch, decimal> ':' <seq, decimal>      (sequenced hints, ADR-0035)
//! ```
//! Length-prefixed ids, so any valid id (even one holding '\n') can be named. The tag is
//! written like a recipient whose id starts with NUL, which no user id may hold
//! (`tidemark_protocol::is_valid_user_id` refuses control characters): a gateway that predates
//! the tag reads it as a recipient nobody is, and wakes the others as before.
//!
//! **Sequenced hints** (ADR-0035). A materializer numbers the hints of each shard it runs:
//! `epoch` is its claim's fencing epoch, `seq` counts from 0 (the hint it publishes when it
//! claims the shard) by one per hint. A hint it could not publish is merged into the next one
//! (its recipients are kept), so every recipient is named in some published hint; a gateway
//! that sees a hint out of sequence (another epoch, `seq` 0, or a `seq` that skips) re-checks
//! every connection of the shard once. This is what lets gateways drop the periodic
//! per-connection re-check: a hint can only be missed by a subscriber whose connection
//! dropped, and a subscriber that reconnects re-checks every connection.
//!
//! The subscriber connects with a timeout ([`CONNECT_TIMEOUT`]), subscribes to the pattern
//! [`PATTERN`], and pings its connection every [`PING_EVERY`] while it waits for hints, so a
//! silent dead connection ends the subscription ([`PING_TIMEOUT`]) instead of hanging it. A
//! redis-rs Pub/Sub connection (`Client::get_async_pubsub`) has no response timeout (the 500 ms
//! default of multiplexed connections does not apply to it), hence the ping's own.

use std::time::Duration;

use futures::StreamExt;

use crate::error::Result;
use crate::keys;
use crate::redis::dlog::{decode_recipients, encode_recipients};
use crate::redis::store::MailboxStore;

/// How long connecting to the mailbox instance for Pub/Sub may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the subscriber pings its connection (a silent dead connection is replaced).
pub const PING_EVERY: Duration = Duration::from_secs(5);
/// How long a ping may take before the connection is given up.
pub const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// The pattern the subscriber listens on: every shard's `wake:{s}` ([`keys::wake`]).
pub const PATTERN: &str = "wake:*";

/// Builds an unsequenced hint payload (what materializers before ADR-0035 published).
pub fn encode(min_w: u64, recipients: &[&str]) -> Vec<u8> {
    encode_with(min_w, None, recipients)
}

fn encode_with(min_w: u64, seq: Option<HintSeq>, recipients: &[&str]) -> Vec<u8> {
    // integers with itoa, not `format!` (a hint per shard step; ADR-0071)
    let mut out = itoa::Buffer::new().format(min_w).as_bytes().to_vec();
    out.push(b'\n');
    if let Some(q) = seq {
        // the tag "\0<epoch>:<seq>", after its length (at most 1 + 20 + 1 + 20 bytes)
        let (mut e, mut n) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (e, n) = (e.format(q.epoch).as_bytes(), n.format(q.seq).as_bytes());
        out.push((2 + e.len() + n.len()) as u8);
        out.push(0);
        out.extend_from_slice(e);
        out.push(b':');
        out.extend_from_slice(n);
    }
    out.extend_from_slice(&encode_recipients(recipients));
    out
}

/// Parses a hint payload's W and recipients (the tag of a sequenced hint is not a
/// recipient); `None` when malformed.
pub fn decode(payload: &[u8]) -> Option<(u64, Vec<String>)> {
    WakeHint::decode(payload).map(|h| (h.min_w, h.recipients))
}

/// A hint's place in its shard's sequence (ADR-0035).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HintSeq {
    /// The fencing epoch of the claim whose worker published it.
    pub epoch: u64,
    /// 0 for the hint published at the claim, then one more per hint.
    pub seq: u64,
}

impl HintSeq {
    /// Whether `next` is the hint that follows `self` with nothing missed in between.
    pub fn follows(self, next: HintSeq) -> bool {
        next.epoch == self.epoch && next.seq == self.seq.wrapping_add(1) && next.seq != 0
    }
}

/// The shard a channel `wake:{s}` names; `None` for any other channel.
pub fn shard_of_channel(channel: &str) -> Option<u32> {
    channel
        .strip_prefix("wake:{")
        .and_then(|r| r.strip_suffix('}'))
        .and_then(|n| n.parse().ok())
}

/// One hint: the shard's lowest present W and the recipients that got entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeHint {
    /// Lowest present W of the shard after the move.
    pub min_w: u64,
    /// Its place in the shard's sequence; `None` from a publisher before ADR-0035.
    pub seq: Option<HintSeq>,
    /// Recipients that may have new entries.
    pub recipients: Vec<String>,
}

impl WakeHint {
    /// The hint's payload (see the module's layout).
    pub fn encode(&self) -> Vec<u8> {
        let names: Vec<&str> = self.recipients.iter().map(String::as_str).collect();
        encode_with(self.min_w, self.seq, &names)
    }

    /// A payload's hint; `None` when malformed (a tag that does not parse included).
    pub fn decode(payload: &[u8]) -> Option<WakeHint> {
        let nl = payload.iter().position(|&b| b == b'\n')?;
        let min_w = std::str::from_utf8(&payload[..nl]).ok()?.parse().ok()?;
        let mut recipients = decode_recipients(&payload[nl + 1..])?;
        let mut seq = None;
        if let Some(tag) = recipients.first().and_then(|r| r.strip_prefix('\0')) {
            let (e, q) = tag.split_once(':')?;
            seq = Some(HintSeq {
                epoch: e.parse().ok()?,
                seq: q.parse().ok()?,
            });
            recipients.remove(0);
        }
        Some(WakeHint {
            min_w,
            seq,
            recipients,
        })
    }
}

/// Publishes `hints` (`(shard, hint)`, each on `wake:{shard}`) on the mailbox instance of
/// `store`, as one pipeline of PUBLISH (not one round trip per shard). On a Redis Cluster,
/// sharded `SPUBLISH` (Redis 7): the hint stays on the nodes serving the shard's slot instead
/// of being broadcast over the cluster bus.
///
/// Returns the most subscribers any one hint reached (PUBLISH's reply): a materializer that
/// sees no more than its own process's gateway may let hints that process's connections were
/// handed as local runs wait for a flush (ADR-0047).
pub async fn publish_wake(store: &MailboxStore, hints: &[(u32, WakeHint)]) -> Result<u64> {
    let mut conn = store.connection();
    let verb = if conn.is_cluster() {
        "SPUBLISH"
    } else {
        "PUBLISH"
    };
    let cmds: Vec<(u32, redis::Cmd)> = hints
        .iter()
        .map(|(shard, hint)| {
            let mut c = redis::cmd(verb);
            c.arg(keys::Key::wake(*shard)).arg(hint.encode());
            (*shard, c)
        })
        .collect();
    let mut most = 0;
    // on a cluster, a node that hangs holds the publisher up a bounded time (ADR-0124)
    let bound = conn.shard_bound();
    for r in conn.exec_each_within(&cmds, bound).await? {
        if let redis::Value::Int(n) = r? {
            most = most.max(u64::try_from(n).unwrap_or(0));
        }
    }
    Ok(most)
}

/// One message received on [`PATTERN`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeMessage {
    /// The shard its channel names ([`shard_of_channel`]).
    pub shard: Option<u32>,
    /// The hint it carries; `None` when the payload is malformed.
    pub hint: Option<WakeHint>,
}

/// A live subscription to every shard's hints on one mailbox instance. Ends (an error from
/// [`WakeSubscriber::next`], or `None`) when the connection does; the caller reconnects.
pub struct WakeSubscriber {
    inner: Inner,
    ping: tokio::time::Interval,
}

enum Inner {
    /// One instance: `PSUBSCRIBE wake:*`.
    Single {
        sink: redis::aio::PubSubSink,
        stream: redis::aio::PubSubStream,
    },
    /// A cluster: `SSUBSCRIBE wake:{s}` for every shard (sharded channels cannot be matched
    /// by a pattern).
    Cluster(crate::endpoint::ShardedSub),
}

impl WakeSubscriber {
    /// Connects to `url` (within [`CONNECT_TIMEOUT`]) and subscribes to [`PATTERN`] — on a
    /// cluster endpoint, to `wake:{s}` of every shard of `shards`. Anything published before
    /// this returns is not seen.
    pub async fn connect(url: &str, shards: std::ops::Range<u32>) -> Result<WakeSubscriber> {
        let timed_out =
            || redis::RedisError::from((redis::ErrorKind::Io, "pub/sub connect timed out"));
        let inner = if crate::endpoint::is_cluster(url) {
            let channels: Vec<String> = shards.map(keys::wake).collect();
            let sub = tokio::time::timeout(
                CONNECT_TIMEOUT * 4,
                crate::endpoint::ShardedSub::connect(url, &channels),
            )
            .await
            .map_err(|_| timed_out())??;
            Inner::Cluster(sub)
        } else {
            let client = redis::Client::open(url)?;
            let pubsub = tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub())
                .await
                .map_err(|_| timed_out())??;
            let (mut sink, stream) = pubsub.split();
            sink.psubscribe(PATTERN).await?;
            Inner::Single { sink, stream }
        };
        let mut ping = tokio::time::interval(PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping.tick().await;
        Ok(WakeSubscriber { inner, ping })
    }

    /// The next message, pinging the connection every [`PING_EVERY`] while none comes.
    /// `Ok(None)`: the subscription ended; an error: the connection failed (on a cluster: any
    /// node's connection dropped, so hints may have been lost) or a ping went unanswered for
    /// [`PING_TIMEOUT`]. Dropping the future loses no received message, but may cut a ping
    /// short: race it only against the end of the subscription.
    pub async fn next(&mut self) -> Result<Option<WakeMessage>> {
        let ping_failed = |e: Option<redis::RedisError>| -> crate::Error {
            e.unwrap_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Io, "pub/sub ping timed out"))
            })
            .into()
        };
        loop {
            match &mut self.inner {
                Inner::Single { sink, stream } => {
                    tokio::select! {
                        msg = stream.next() => {
                            let Some(msg) = msg else { return Ok(None) };
                            return Ok(Some(WakeMessage {
                                shard: shard_of_channel(msg.get_channel_name()),
                                hint: WakeHint::decode(msg.get_payload_bytes()),
                            }));
                        }
                        _ = self.ping.tick() => {
                            match tokio::time::timeout(PING_TIMEOUT, sink.ping::<redis::Value>()).await {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => return Err(ping_failed(Some(e))),
                                Err(_) => return Err(ping_failed(None)),
                            }
                        }
                    }
                }
                Inner::Cluster(sub) => {
                    tokio::select! {
                        push = sub.rx.recv() => {
                            let Some(push) = push else { return Ok(None) };
                            if let Some((ch, payload)) = crate::endpoint::smessage(&push) {
                                return Ok(Some(WakeMessage {
                                    shard: shard_of_channel(&ch),
                                    hint: WakeHint::decode(payload),
                                }));
                            }
                            if push.kind == redis::PushKind::Disconnection {
                                return Err(redis::RedisError::from((
                                    redis::ErrorKind::Io,
                                    "a cluster node's pub/sub connection dropped",
                                ))
                                .into());
                            }
                        }
                        _ = self.ping.tick() => {
                            let cmd = redis::cmd("PING");
                            let ping = cmd.query_async::<redis::Value>(&mut sub.conn);
                            match tokio::time::timeout(PING_TIMEOUT, ping).await {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => return Err(ping_failed(Some(e))),
                                Err(_) => return Err(ping_failed(None)),
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip_with_newline_in_an_id() {
        let p = super::encode(17, &["alice", "line\nbreak"]);
        assert_eq!(
            super::decode(&p),
            Some((17, vec!["alice".to_string(), "line\nbreak".to_string()]))
        );
        assert_eq!(super::decode(b"x"), None);
        assert_eq!(super::decode(b"1\n"), Some((1, vec![])));
    }

    #[test]
    fn a_sequenced_hint_round_trips_and_old_decoders_see_no_user_in_its_tag() {
        use super::{HintSeq, WakeHint};
        let h = WakeHint {
            min_w: 42,
            seq: Some(HintSeq {
                epoch: u64::MAX,
                seq: u64::MAX,
            }),
            recipients: vec!["alice".into(), "bob".into()],
        };
        let p = h.encode();
        assert_eq!(WakeHint::decode(&p), Some(h));
        // the bytes the `format!` encoder wrote (ADR-0071 only changed how they are made)
        let tag = format!("\0{}:{}", u64::MAX, u64::MAX);
        let mut was = format!("{}\n", 42).into_bytes();
        was.push(tag.len() as u8);
        was.extend_from_slice(tag.as_bytes());
        was.extend_from_slice(&crate::redis::dlog::encode_recipients(&["alice", "bob"]));
        assert_eq!(p, was);
        // what a gateway before ADR-0035 decodes: the tag is one more "recipient", which no
        // valid user id can be
        let old = crate::redis::dlog::decode_recipients(&p[3..]).unwrap();
        assert_eq!(old.len(), 3);
        assert_eq!(
            old[0].as_bytes()[0],
            0,
            "a control character: never a valid user id"
        );
        // a tag that does not parse is a malformed hint, not a user
        let mut bad = b"1\n".to_vec();
        bad.extend_from_slice(&crate::redis::dlog::encode_recipients(&["\0x:1", "alice"]));
        assert_eq!(WakeHint::decode(&bad), None);
        // unsequenced (an older publisher)
        assert_eq!(
            WakeHint::decode(&super::encode(5, &["a"])).unwrap().seq,
            None
        );
    }

    #[test]
    fn follows_only_the_next_seq_of_the_same_epoch() {
        use super::HintSeq;
        let q = |epoch, seq| HintSeq { epoch, seq };
        assert!(q(3, 7).follows(q(3, 8)));
        assert!(!q(3, 7).follows(q(3, 9)));
        assert!(!q(3, 7).follows(q(3, 7)));
        assert!(!q(3, 7).follows(q(4, 8)));
        assert!(!q(3, 7).follows(q(4, 0)));
        assert!(!q(3, u64::MAX).follows(q(3, 0)));
    }
}
