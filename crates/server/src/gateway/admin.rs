//! The operator's read-only endpoint: `GET /v1/admin/status` (one JSON snapshot) and
//! `GET /v1/admin/status/stream` (the same snapshot as a server-sent event every second),
//! behind an admin token ([`authorize_admin`]; open in `--dev-auth` mode). The `/ops` page
//! reads the stream.
//!
//! A snapshot is [`tidemark_store::status::gather`] over the gateway's own connections (the
//! same reading as `tidemark status`), plus every lane's W, whether the lanes diverge, and two
//! rates per shard from the difference of two snapshots: commits per second (the log head's
//! rise) and materializations per second (the rise of the lowest W: records now in every
//! mailbox of the shard). The [`Sampler`] keeps the previous snapshot for every viewer
//! together: a rate spans at least [`MIN_WINDOW`], so viewers polling at once do not turn it
//! into noise.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde::Serialize;
use tidemark_protocol::{ErrorBody, ErrorCode};
use tidemark_store::redis::lease::NodeInfo;
use tidemark_store::status::ShardStatus;

use super::auth::authorize_admin;
use super::http::error_response;
use super::state::Shared;

/// Shortest span a rate is computed over.
pub(crate) const MIN_WINDOW: Duration = Duration::from_millis(500);
/// How often the stream sends a snapshot.
pub(crate) const STREAM_EVERY: Duration = Duration::from_secs(1);

/// `GET /v1/admin/status`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct AdminStatus {
    /// When the snapshot was read, unix milliseconds.
    pub sampled_at_ms: u64,
    /// The span the rates were computed over, ms; null until two snapshots exist.
    pub window_ms: Option<u64>,
    /// Shards of the deployment.
    pub shard_count: u32,
    /// The layout this gateway's topology writes (each shard names its own in `layout`).
    pub layout: String,
    /// Live nodes (empty without a node registry: one static process).
    pub nodes: Vec<NodeInfo>,
    /// Every shard, ascending.
    pub shards: Vec<AdminShard>,
}

/// One shard of [`AdminStatus`].
#[derive(Debug, Clone, Serialize)]
pub(crate) struct AdminShard {
    pub shard: u32,
    pub owner: Option<String>,
    pub epoch: Option<u64>,
    pub w_min: Option<u64>,
    pub w_max: Option<u64>,
    pub head: u64,
    pub lag: Option<u64>,
    pub layout: Option<String>,
    pub blob_bytes: Option<usize>,
    /// Present lanes do not all hold the same W.
    pub diverged: bool,
    /// W of each of the 64 lanes (null: empty lane); empty when the watermark is unreadable.
    pub lanes: Vec<Option<u64>>,
    /// Rise of `head` per second over `window_ms`.
    pub commits_per_s: Option<f64>,
    /// Rise of `w_min` per second over `window_ms`.
    pub materialized_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One snapshot's counters, kept to compute the next rates.
struct Sample {
    at: Instant,
    heads: Vec<u64>,
    w_mins: Vec<Option<u64>>,
}

/// Rates of the last window: per shard (commits/s, materializations/s), and the window.
#[derive(Clone)]
struct Rates {
    per_shard: Vec<(f64, Option<f64>)>,
    window: Duration,
}

/// The previous snapshot and the last rates, shared by every viewer of this gateway.
#[derive(Default)]
pub(crate) struct Sampler {
    inner: Mutex<(Option<Sample>, Option<Rates>)>,
}

impl Sampler {
    /// The rates for a snapshot read `at`: over the span since the previous snapshot, or —
    /// when that is shorter than [`MIN_WINDOW`] — those of the last window.
    fn rates(&self, at: Instant, shards: &[ShardStatus]) -> Option<Rates> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (prev, last) = &mut *g;
        let sample = Sample {
            at,
            heads: shards.iter().map(|s| s.head).collect(),
            w_mins: shards.iter().map(|s| s.w_min).collect(),
        };
        match prev {
            Some(p) if p.heads.len() == sample.heads.len() => {
                let window = at.saturating_duration_since(p.at);
                if window < MIN_WINDOW {
                    return last.clone();
                }
                let secs = window.as_secs_f64();
                let per_shard = (0..sample.heads.len())
                    .map(|i| {
                        let commits = sample.heads[i].saturating_sub(p.heads[i]) as f64 / secs;
                        let materialized = match (p.w_mins[i], sample.w_mins[i]) {
                            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / secs),
                            _ => None,
                        };
                        (commits, materialized)
                    })
                    .collect();
                *last = Some(Rates { per_shard, window });
                *prev = Some(sample);
                last.clone()
            }
            _ => {
                *prev = Some(sample);
                None
            }
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reads one snapshot.
async fn snapshot(shared: &Shared) -> Result<AdminStatus, tidemark_store::Error> {
    let status = shared.status().await?;
    let rates = shared.sampler.rates(Instant::now(), &status.shards);
    let shards = status
        .shards
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let present: Vec<u64> = s.lanes.iter().flatten().copied().collect();
            let diverged = present.windows(2).any(|w| w[0] != w[1]);
            let (commits_per_s, materialized_per_s) = match &rates {
                Some(r) => (Some(r.per_shard[i].0), r.per_shard[i].1),
                None => (None, None),
            };
            AdminShard {
                shard: s.shard,
                owner: s.owner,
                epoch: s.epoch,
                w_min: s.w_min,
                w_max: s.w_max,
                head: s.head,
                lag: s.lag,
                layout: s.layout,
                blob_bytes: s.blob_bytes,
                diverged,
                lanes: s.lanes,
                commits_per_s,
                materialized_per_s,
                error: s.error,
            }
        })
        .collect();
    Ok(AdminStatus {
        sampled_at_ms: unix_ms(),
        window_ms: rates.map(|r| r.window.as_millis() as u64),
        shard_count: shared.map.shards(),
        layout: shared.map.layout().to_string(),
        nodes: status.nodes,
        shards,
    })
}

fn unavailable(e: &tidemark_store::Error) -> (ErrorCode, String) {
    tracing::warn!(error = %e, "reading the admin status failed");
    (
        ErrorCode::Internal,
        "reading the status from Redis failed; retry".to_string(),
    )
}

/// `GET /v1/admin/status`.
pub(crate) async fn status(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    if let Err((code, message)) = authorize_admin(&shared.opts, &headers, uri.query()) {
        return error_response(code, message);
    }
    match snapshot(&shared).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => {
            let (code, message) = unavailable(&e);
            error_response(code, message)
        }
    }
}

/// `GET /v1/admin/status/stream`: `text/event-stream`, one `status` event (the JSON of
/// [`AdminStatus`]) at once and every [`STREAM_EVERY`]; a snapshot that cannot be read is an
/// `error` event (an [`ErrorBody`]) and the stream goes on. Ends when the gateway stops, or
/// with an `error` event `token_expired` when the caller's token passes its `exp` (ADR-0103:
/// before, a stream opened with an admin token went on for ever).
pub(crate) async fn stream(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let caller = match authorize_admin(&shared.opts, &headers, uri.query()) {
        Ok(caller) => caller,
        Err((code, message)) => return error_response(code, message),
    };
    // an `exp` past what the clocks can hold never comes (both additions panicked, ADR-0107)
    let expires = caller.and_then(|c| c.expires_at_unix).and_then(|exp| {
        let left = UNIX_EPOCH
            .checked_add(Duration::from_secs(exp))?
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        tokio::time::Instant::now().checked_add(left)
    });
    Sse::new(events(shared, expires))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The status events until the gateway stops, or until `expires` (the caller's token's
/// `exp`), when one `error` event `token_expired` ends the stream.
fn events(
    shared: Arc<Shared>,
    expires: Option<tokio::time::Instant>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut tick = tokio::time::interval(STREAM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = (shared, tick, expires, false);
    futures::stream::unfold(state, |(shared, mut tick, expires, ended)| async move {
        if ended {
            return None;
        }
        let expiry = async {
            match expires {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shared.stop.cancelled() => return None,
            _ = expiry => {
                crate::telemetry::count_error(ErrorCode::TokenExpired);
                let event = Event::default()
                    .event("error")
                    .json_data(ErrorBody::new(
                        ErrorCode::TokenExpired,
                        "the token expired; reconnect with a new token".to_string(),
                    ))
                    .unwrap_or_else(|_| Event::default().event("error"));
                return Some((Ok(event), (shared, tick, expires, true)));
            }
            _ = tick.tick() => {}
        }
        let event = match snapshot(&shared).await {
            Ok(s) => Event::default()
                .event("status")
                .json_data(&s)
                .unwrap_or_else(|_| Event::default().event("error")),
            Err(e) => {
                let (code, message) = unavailable(&e);
                crate::telemetry::count_error(code);
                Event::default()
                    .event("error")
                    .json_data(ErrorBody::new(code, message))
                    .unwrap_or_else(|_| Event::default().event("error"))
            }
        };
        Some((Ok(event), (shared, tick, expires, false)))
    })
}
