//! Materializers: the single owner of each shard copies its dispatch log, in log order and
//! exactly once, into the recipients' mailboxes and moves the shard's contiguous watermark.
//!
//! One [`Worker`] runs per core Redis instance and owns the shards of that instance that this
//! process owns (static assignment). On start it claims each shard (raises `wm_epoch`, which
//! fences any older owner) and resumes from the lowest present W. Then it loops:
//!
//! 1. `XREAD BLOCK` over all its shards' logs (a connection of its own, no response timeout);
//!    in one process that also serves clients, once no other process commits to its shards,
//!    it takes the records the gateway hands over and only polls the logs (ADR-0049);
//! 2. the steady state — a record of up to 128 recipients (one before ADR-0048) on a uniform
//!    watermark — goes through `materialize_fresh_single_recipient` (hot path), one call per
//!    run of up to 128 of a shard's records and 256 entries (ADR-0039), pipelined across all
//!    shards of a mailbox instance, each shard's records in log order (each run CASes on W,
//!    so a failure cannot be overtaken);
//! 3. every other record (more recipients, or a diverged watermark) is *pending*: its lane
//!    chunks are written with `write_lane_chunk` (idempotent) and `advance_log_watermarks`
//!    moves each lane whose chunk is durable and whose CAS holds. A failed chunk holds its lane
//!    back (the blob diverges to 1216 bytes) and is retried until it lands; then the lanes meet
//!    and the blob is written back as 19 bytes, and the hot path resumes;
//! 4. a wake-up hint is published per shard that moved (`wake:{s}`, a hint only); in one
//!    process, while no other gateway listens, the hint of moves all handed to this process's
//!    connections as local runs waits for a flush, at most `hint_linger` (ADR-0047);
//! 5. once a second per shard: `gc_completed_dispatch` and the core log trimmed to the lowest W.
//!
//! Replays are no-ops, a gap makes the owner re-read from W, a fenced or corrupt shard is
//! stopped (fail closed) and reported unhealthy. A watermark that went backwards (a promoted
//! mailbox replica, a restore) re-materialises from the stored W; one that is gone (the
//! mailbox instance lost the shard's keys) is created again at W = 0, as a start does, and
//! re-materialises from there (found by the GC too: no new record is needed).
//!
//! **Failures retry by themselves.** Any Redis failure while materialising (connection refused,
//! timeout, `NOAUTH`, `LOADING`, `BUSY`, `READONLY`, …) puts the shards of the step in
//! *retry*: their in-memory records are dropped and, after a capped backoff ([`RETRY_MIN`]
//! doubling to [`RETRY_MAX`]), each re-reads its watermark and resumes reading the log from
//! its lowest W. This repeats until it succeeds, with or without new traffic (a shard never
//! waits for an unrelated send to notice a gap). A lost log connection (XREAD) is replaced
//! with the same backoff. `/healthz` names every shard in retry.
//!
//! **A mailbox instance that does not answer holds up only its own shards** (ADR-0129): every
//! call of the loop to a mailbox instance is bounded, one that timed out leaves the instance
//! alone for a while (its shards in retry, its hints kept, its marks and GC skipped), and the
//! step's pipelines to the instances run at once ([`stall`]).
//!
//! A panic is not handled here: [`crate::run`] supervises each worker, logs and counts the
//! panic and starts the worker again (it re-claims its shards: replays are no-ops).
//!
//! Files: [`worker`] (the loop, log reads, claims, owner marks), [`hot`] (routing a read
//! batch; the pipelined hot path), [`chunked`] (pending records: lane chunks, then advance),
//! [`shard`] (per-shard state: retry, holds, stop), [`gc`] (wake hints, GC, trimming),
//! [`stall`] (which mailbox instances answer), [`fault`] (fault injection).

use std::sync::Arc;
use std::time::Duration;

mod chunked;
mod fault;
mod feed;
mod gc;
mod hot;
mod owned;
mod shard;
mod stall;
mod worker;

pub use fault::{ChunkFault, RandomChunkFault};
pub use feed::{CommitFeed, ShardFeed, FEED_POLL, FEED_QUEUE, QUIET_POLLS};
pub use worker::Worker;

/// Most shards garbage-collected in one loop iteration.
const GC_SHARDS_PER_LOOP: usize = 4;

/// Log trims queued by GC are sent once this many are waiting, or once the first has waited
/// `gc_interval` (ADR-0088): 64 shards collected once a second make 4 trim calls a second
/// instead of 64, each of which costs core Redis an `fdatasync`.
const TRIMS_PER_CALL: usize = 16;

/// [`MaterializerOptions::hint_linger`]'s default: how late a gateway that has just subscribed
/// may hear of moves this process's connections were handed, and about how often each
/// moving shard is hinted meanwhile (ADR-0047).
pub const DEFAULT_HINT_LINGER: Duration = Duration::from_millis(100);

/// [`MaterializerOptions::read_linger`]'s default (ADR-0042; 4 ms since ADR-0085, 2 ms
/// before): at 5,000 msg/s it took 12–24 % off mailbox Redis's CPU per message against 2 ms,
/// for about 1.5 ms of median delivery latency. It adds nothing to a record that follows a
/// quiet spell.
pub const DEFAULT_READ_LINGER: Duration = Duration::from_millis(4);

/// How long every read of a shard's watermark must have found it missing before the owner
/// creates it again at W = 0 (ADR-0058). A read routed to a node with a stale role (a
/// restarted primary, empty, that has not yet learnt it was replaced) finds nothing for a
/// moment; a watermark that is really gone stays gone.
pub const WATERMARK_LOST_AFTER: Duration = Duration::from_secs(10);

/// First retry delay of a shard whose writes or reads failed.
pub const RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest retry delay (the backoff doubles up to this).
pub const RETRY_MAX: Duration = Duration::from_secs(1);
/// Longest wait for an XREAD beyond its BLOCK time before the connection is presumed dead.
const READ_GRACE: Duration = Duration::from_secs(10);
/// How often a shard held by a log discontinuity re-checks the log.
const DISCONTINUITY_RECHECK: Duration = Duration::from_secs(5);
/// How often a worker looks again at shards whose lease gate is closed (leases mode: the gate
/// opens again at the node's next successful renewal, or the shard is handed over).
const GATE_RECHECK: Duration = Duration::from_millis(100);
/// How often the owner marks (`owner:{s}`, read by offline tools only) are refreshed; they
/// live `tidemark_store::redis::store::OWNER_MARK_TTL_MS`.
const OWNER_MARK_REFRESH: Duration = Duration::from_secs(10);
/// A hold or retry that lasts is logged again this often (else once per state change).
const LOG_REMINDER: Duration = Duration::from_secs(60);

/// Tuning of a materializer.
#[derive(Clone)]
pub struct MaterializerOptions {
    /// Replicas a mailbox write must reach before the core log below it may be trimmed
    /// (`WAIT` on the shard's mailbox primary before `XTRIM`; ADR-0032): a promoted replica
    /// then never lacks what the trimmed log held.
    pub mailbox_wait: tidemark_store::redis::dlog::WaitPolicy,
    /// Replicas a log record must be on before it is materialised (`--core-wait-replicas`,
    /// ADR-0064): a record only the core primary holds could be lost with it, and its offset
    /// handed out again by the promoted replica; W must never pass it.
    pub core_wait: tidemark_store::redis::dlog::WaitPolicy,
    /// Most records read per XREAD.
    pub batch: usize,
    /// XREAD BLOCK time when idle.
    pub block: Duration,
    /// Shortest time between the starts of two log reads when the last one found no backlog
    /// (ADR-0042): live traffic is read in fewer, larger batches (fewer `XREAD`s, hot-path
    /// pipelines and hints per message) for at most this much added latency. Zero: read
    /// again at once.
    pub read_linger: Duration,
    /// Longest a wake hint may wait when it only announces moves this process's gateway was
    /// handed as local runs and no other gateway listens on the instance (ADR-0047): such
    /// hints are merged, one per shard per flush. Zero: every hint goes out with its step.
    pub hint_linger: Duration,
    /// How often each shard is garbage-collected (staging state, core log).
    pub gc_interval: Duration,
    /// How often a quiet shard (caught up, nothing pending, held or retrying) is: the GC is
    /// also where a quiet shard notices that its W went backwards (a promoted mailbox
    /// replica), so this bounds that detection when no traffic comes.
    pub gc_idle_interval: Duration,
    /// Most recipients of a record the hot path takes on packed-v2 (ADR-0048): its entries
    /// and W's move in one atomic script call, no staging. Capped at
    /// [`MAX_HOT_RECIPIENTS`](tidemark_store::redis::store::MAX_HOT_RECIPIENTS); 1 is
    /// ADR-0015's hot path alone (every record of more recipients takes the chunked path,
    /// which is where chunk faults are injected).
    pub hot_recipients: usize,
    /// Fault injection for chunk writes.
    pub fault: Option<Arc<dyn ChunkFault>>,
    /// In leases mode, the node's per-shard write permission ([`crate::ownership`]): a shard
    /// whose gate is closed is not read, written or garbage-collected. `None`: static
    /// ownership, always open.
    pub lease_gate: Option<Arc<crate::ownership::LeaseGate>>,
    /// This process's gateway, when it serves clients: applied hot-path runs are handed to
    /// its connections (ADR-0041) besides the wake hint published on Redis.
    pub local: Option<crate::gateway::LocalDelivery>,
    /// The records this process's gateway commits, handed over so the logs need not be read
    /// back (ADR-0049); `None`: every record is read from the log.
    pub feed: Option<CommitFeed>,
}

impl Default for MaterializerOptions {
    fn default() -> Self {
        MaterializerOptions {
            mailbox_wait: Default::default(),
            core_wait: Default::default(),
            batch: 512,
            block: Duration::from_millis(500),
            read_linger: DEFAULT_READ_LINGER,
            hint_linger: DEFAULT_HINT_LINGER,
            gc_interval: Duration::from_secs(1),
            gc_idle_interval: Duration::from_secs(10),
            hot_recipients: tidemark_store::redis::store::MAX_HOT_RECIPIENTS,
            fault: None,
            lease_gate: None,
            local: None,
            feed: None,
        }
    }
}

/// Errors that stop a whole worker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
    /// A claim or a fence this worker was about to make while the shard's lease gate is
    /// closed: a shard owned unclaimed (ADR-0097, ADR-0130) or a watermark to create again,
    /// or a re-fence whose answer was lost (ADR-0120). Not made: that would fence the node
    /// that may hold the lease now. The shard retries; the lease loop restarts or stops the
    /// worker as the lease goes.
    #[error("shard {shard}: its lease gate is closed, so it is not claimed or fenced now")]
    LeaseLapsed { shard: u32 },
    /// A call to a mailbox instance was skipped or given up (ADR-0129): the instance did not
    /// answer within the worker's bound, and is left alone for a while so that the shards of
    /// the other instances go on. A write given up has an unknown outcome: its shards retry
    /// from W.
    #[error("mailbox instance {mailbox} does not answer; its shards retry once it does")]
    MailboxStalled { mailbox: String },
}

impl Error {
    /// Stable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Store(e) => e.code(),
            Error::LeaseLapsed { .. } => "lease_lapsed",
            Error::MailboxStalled { .. } => "mailbox_stalled",
        }
    }
}

/// `v[i]`, growing `v` with defaults up to `i` first: the per-step lists indexed by mailbox
/// instance (ADR-0078), which allocate nothing on a step that has nothing for any instance.
fn grown_to<T: Default>(v: &mut Vec<T>, i: usize) -> &mut T {
    if v.len() <= i {
        v.resize_with(i + 1, T::default);
    }
    &mut v[i]
}
