//! Process-wide telemetry: one Prometheus recorder for the `metrics` facade (installed once,
//! rendered by the gateway's `/metrics`), and `tracing` structured logs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Handles of the metrics recorded once or more per message (or per materializer step),
/// registered once (ADR-0070). A `metrics::counter!(…)` call looks its key up in the
/// recorder's registry each time (a hash, a lock, a key compare); these paths made about ten
/// such lookups per message. The metrics recorded now and then keep the macros.
pub(crate) struct Hot {
    pub(crate) send_ack_seconds: Histogram,
    pub(crate) acks: Counter,
    pub(crate) delivery_latency_seconds: Histogram,
    pub(crate) deliveries: Counter,
    pub(crate) commits: Counter,
    pub(crate) commit_duplicates: Counter,
    pub(crate) commit_round_size: Histogram,
    pub(crate) commit_group_size: Histogram,
    pub(crate) ack_batch_size: Histogram,
    pub(crate) materialized_hot: Counter,
    pub(crate) commit_feed_records: Counter,
    pub(crate) wake_hints: Counter,
    pub(crate) wake_hints_deferred: Counter,
}

static HOT: OnceLock<Hot> = OnceLock::new();

/// The per-message metrics' handles, registered on first use, after the recorder is installed
/// (a handle taken before it would record nowhere, for good).
pub(crate) fn hot() -> &'static Hot {
    HOT.get_or_init(|| {
        let _ = metrics_handle();
        Hot {
            send_ack_seconds: metrics::histogram!("tidemark_send_ack_seconds"),
            acks: metrics::counter!("tidemark_acks_total"),
            delivery_latency_seconds: metrics::histogram!("tidemark_delivery_latency_seconds"),
            deliveries: metrics::counter!("tidemark_deliveries_total"),
            commits: metrics::counter!("tidemark_commits_total"),
            commit_duplicates: metrics::counter!("tidemark_commit_duplicates_total"),
            commit_round_size: metrics::histogram!("tidemark_commit_round_size"),
            commit_group_size: metrics::histogram!("tidemark_commit_group_size"),
            ack_batch_size: metrics::histogram!("tidemark_ack_batch_size"),
            materialized_hot: metrics::counter!("tidemark_materialized_total", "path" => "hot"),
            commit_feed_records: metrics::counter!("tidemark_commit_feed_records_total"),
            wake_hints: metrics::counter!("tidemark_wake_hints_total"),
            wake_hints_deferred: metrics::counter!("tidemark_wake_hints_deferred_total"),
        }
    })
}

/// The Prometheus handle, installing the global recorder on first use. Several services in
/// one process (tests) share it.
pub fn metrics_handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                ])
                .expect("static buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (embedding); then ours only renders.
            let _ = metrics::set_global_recorder(recorder);
            describe_and_zero();
            let _ = UPKEEP_RUNS.set(spawn_upkeep(handle.clone(), UPKEEP_EVERY));
            handle
        })
        .clone()
}

/// How often the recorder's histogram samples are folded into their buckets (the exporter's
/// own default when it runs its upkeep itself).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// How many upkeeps the process's recorder has had ([`metrics_handle`] starts them).
static UPKEEP_RUNS: OnceLock<Arc<AtomicU64>> = OnceLock::new();

/// Runs the recorder's upkeep every `every` on a thread of its own, for the life of the
/// process (the recorder is process-wide too); returns the count of upkeeps run.
///
/// `metrics-exporter-prometheus` keeps every histogram sample in a queue until the histogram
/// is folded into its buckets: at a render of `/metrics`, or at an upkeep. A recorder built
/// with `build_recorder` (ours: the gateway renders it itself) gets no upkeep of its own, so
/// a process nobody scraped kept every sample of `send_ack` latency, delivery latency and
/// batch sizes: about 45 bytes more heap per message, for ever (ADR-0086). A panic inside one
/// upkeep is caught, logged and counted (`tidemark_errors_total{code="metrics_upkeep"}`);
/// the next runs as planned.
fn spawn_upkeep(handle: PrometheusHandle, every: Duration) -> Arc<AtomicU64> {
    let runs = Arc::new(AtomicU64::new(0));
    let counted = runs.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            let upkeep = std::panic::AssertUnwindSafe(|| handle.run_upkeep());
            if std::panic::catch_unwind(upkeep).is_err() {
                tracing::error!("the metrics upkeep panicked; it runs again at the next interval");
                metrics::counter!("tidemark_errors_total", "code" => "metrics_upkeep").increment(1);
            }
            counted.fetch_add(1, Ordering::Relaxed);
        })
        .expect("spawn the metrics upkeep thread");
    runs
}

/// Counts an error answered to a client: `tidemark_client_errors_total{code}` when the client
/// caused it (a 4xx code: bad frames, auth, `id_reused`, `rate_limited`), else
/// `tidemark_errors_total{code}` (5xx: `internal`, `overloaded`, `log_exhausted` — the server
/// or Redis could not do it).
pub fn count_error(code: tidemark_protocol::ErrorCode) {
    let status = code.http_status();
    if status < 500 {
        metrics::counter!("tidemark_client_errors_total", "code" => code.as_str()).increment(1);
    } else {
        metrics::counter!("tidemark_errors_total", "code" => code.as_str()).increment(1);
    }
}

/// The process's allocation counts (allocations, reallocations), when its binary counts them:
/// the `tidemark` binary's `alloc-count` feature, a build for measurements only
/// (docs/performance.md). Unset in a normal build, and then no gauge is exported.
static ALLOCATION_COUNTS: OnceLock<fn() -> (u64, u64)> = OnceLock::new();

/// Makes `/metrics` export `f`'s counts as `tidemark_allocations_total` and
/// `tidemark_reallocations_total` (the first call wins).
pub fn set_allocation_counts(f: fn() -> (u64, u64)) {
    let _ = ALLOCATION_COUNTS.set(f);
}

/// Sets the standard `process_cpu_seconds_total` (user + system CPU of this process) and
/// `process_resident_memory_bytes` gauges from `/proc/self` (Linux), so CPU per message can be
/// computed from `/metrics` alone (issue 15). Does nothing where `/proc` is unreadable.
pub fn record_process_metrics() {
    // SAFETY: sysconf only reads configuration values.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // the command name (field 2) may hold spaces: count fields after its closing ')'
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            // after ')': state is field 3, so utime (14) and stime (15) are at 11 and 12
            if let (Some(u), Some(s)) = (f.get(11), f.get(12)) {
                if let (Ok(u), Ok(s)) = (u.parse::<f64>(), s.parse::<f64>()) {
                    if ticks > 0 {
                        metrics::gauge!("process_cpu_seconds_total").set((u + s) / ticks as f64);
                    }
                }
            }
        }
    }
    if let Some(counts) = ALLOCATION_COUNTS.get() {
        let (allocs, reallocs) = counts();
        metrics::gauge!("tidemark_allocations_total").set(allocs as f64);
        metrics::gauge!("tidemark_reallocations_total").set(reallocs as f64);
    }
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        if let Some(Ok(pages)) = statm.split_whitespace().nth(1).map(str::parse::<f64>) {
            if page > 0 {
                metrics::gauge!("process_resident_memory_bytes").set(pages * page as f64);
            }
        }
    }
}

/// Kind of a metric, for [`METRICS`].
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric Tidemark exports: name, kind, `# HELP` text. Counters without labels (and
/// the label sets listed in [`ZERO_LABELS`]) exist at 0 from start, so an `increase()` alert
/// sees the first event.
const METRICS: &[(&str, Kind, &str)] = &[
    ("process_cpu_seconds_total", Kind::Gauge, "User and system CPU time of this process, seconds."),
    ("process_resident_memory_bytes", Kind::Gauge, "Resident memory of this process, bytes."),
    ("tidemark_allocations_total", Kind::Gauge, "Heap allocations of this process since it started; only in a build with the alloc-count feature (measurements)."),
    ("tidemark_reallocations_total", Kind::Gauge, "Heap reallocations of this process since it started; only in a build with the alloc-count feature (measurements)."),
    ("tidemark_build_info", Kind::Gauge, "Always 1; the label `version` is the build's version."),
    ("tidemark_commits_total", Kind::Counter, "Shard commits (a message to N shards counts N)."),
    ("tidemark_commit_duplicates_total", Kind::Counter, "Shard commits answered from dedupe (resends)."),
    ("tidemark_commit_group_size", Kind::Histogram, "Messages per commit_dispatch call (on one core instance the parts of several shards of a commit round, on a Redis Cluster one shard's; at most 128)."),
    ("tidemark_commit_round_size", Kind::Histogram, "Messages per commit round of a core instance (group commit, ADR-0045: what queued for the instance since its previous round, rounds at least the commit linger apart; one write, one pass of core Redis)."),
    ("tidemark_ack_batch_size", Kind::Histogram, "WebSocket acks written per pipeline to one mailbox instance (grouped acks, ADR-0038)."),
    ("tidemark_send_ack_seconds", Kind::Histogram, "Time from receiving a send to its send_ack."),
    ("tidemark_deliveries_total", Kind::Counter, "deliver frames written (replays after reconnects included)."),
    ("tidemark_delivery_latency_seconds", Kind::Histogram, "Commit to first live deliver frame on a connection (replays excluded)."),
    ("tidemark_acks_total", Kind::Counter, "Client acks written to Redis."),
    ("tidemark_connected_clients", Kind::Gauge, "Open WebSocket connections."),
    ("tidemark_errors_total", Kind::Counter, "Errors by stable code (server side and Redis; client mistakes are in tidemark_client_errors_total)."),
    ("tidemark_client_errors_total", Kind::Counter, "Frames and requests refused because of the client, by stable code."),
    ("tidemark_materialized_total", Kind::Counter, "Records materialised, by path (hot, chunk)."),
    ("tidemark_gaps_total", Kind::Counter, "CAS gaps: the owner re-read from W."),
    ("tidemark_chunk_failures_total", Kind::Counter, "Injected lane chunk failures (fault runs only)."),
    ("tidemark_chunks_rewritten_total", Kind::Counter, "Lane chunks written again because their lane stayed held for a second with nothing moving although they were marked written (ADR-0112: the mailbox instance may have lost them in a failover)."),
    ("tidemark_shard_fenced_total", Kind::Counter, "Shards stopped because another owner raised the epoch."),
    ("tidemark_shard_corrupt_total", Kind::Counter, "Shards stopped because their watermark is corrupt."),
    ("tidemark_shard_recoveries_total", Kind::Counter, "Shards that resumed after a Redis failure."),
    ("tidemark_lane_empty_holds_total", Kind::Counter, "Records held because they need an empty lane."),
    ("tidemark_log_discontinuities_total", Kind::Counter, "Shards held because the log does not continue from W."),
    ("tidemark_head_raised_total", Kind::Counter, "Log heads raised to W: a core instance was behind the mailbox side (restored?)."),
    ("tidemark_watermark_regressions_total", Kind::Counter, "Shards whose stored W went backwards (a promoted mailbox replica lacked writes): re-materialised from the log."),
    ("tidemark_trim_deferred_total", Kind::Counter, "Log trims deferred: W not yet confirmed on --mailbox-wait-replicas replicas."),
    ("tidemark_task_restarts_total", Kind::Counter, "Supervised tasks restarted, by task and reason (panic, exit)."),
    ("tidemark_wake_hints_total", Kind::Counter, "Wake-up hints received over Pub/Sub."),
    ("tidemark_open_connections", Kind::Gauge, "Open TCP connections of the gateway (HTTP, WebSocket, TLS handshakes; admin listener included)."),
    ("tidemark_connections_refused_total", Kind::Counter, "Connections refused beyond --max-connections (503)."),
    ("tidemark_accept_errors_total", Kind::Counter, "accept() failures of the listener."),
    ("tidemark_tls_handshake_failures_total", Kind::Counter, "TLS handshakes that failed or did not finish within the header-read timeout."),
    ("tidemark_write_stalls_total", Kind::Counter, "Connections dropped because their writes made no progress for the grace period."),
    ("tidemark_slow_clients_total", Kind::Counter, "WebSockets closed with 4003: over their queued-bytes budget for the grace period."),
    ("tidemark_ws_closes_total", Kind::Counter, "WebSocket closes by close code."),
    ("tidemark_wake_reconnects_total", Kind::Counter, "Wake-up subscriptions re-established."),
    ("tidemark_wake_sequence_gaps_total", Kind::Counter, "Wake-up hints out of their shard's sequence (a new owner, a claim, a number skipped): every connection of the shard re-read its mailbox."),
    ("tidemark_local_runs_dropped_total", Kind::Counter, "Runs of fresh entries the materializer could not hand to a connection of this process (its queue was full, ADR-0041, or held its byte budget, ADR-0111): that connection read its mailbox instead."),
    ("tidemark_wake_hints_deferred_total", Kind::Counter, "Wake-up hints held back for the flush (ADR-0047): their moves were handed to this process's connections as local runs and no other gateway listened; counted once per shard and step."),
    ("tidemark_wake_sweep_wakes_total", Kind::Counter, "Shards whose connections the watermark sweep woke (a move no hint announced)."),
    ("tidemark_wake_sweep_rechecks_total", Kind::Counter, "Connections the watermark sweep made read in full because they were still below what a wake told them a whole sweep before (ADR-0067): a busy connection with a backlog, or a wake not acted on."),
    ("tidemark_wake_sweep_recovered_total", Kind::Counter, "Reads the sweep forced (ADR-0067) that found entries a wake had not delivered to an idle connection: each one is a lost wake the sweep mended (a delivery bug worth reporting)."),
    ("tidemark_wake_sweep_errors_total", Kind::Counter, "Shards the watermark sweep skipped because their watermark could not be read (corrupt, missing); the other shards are still swept (ADR-0062)."),
    ("tidemark_commit_feed_records_total", Kind::Counter, "Records the materializer took as this process's gateway handed them over instead of reading them from the log (ADR-0049)."),
    ("tidemark_commit_feed_dropped_total", Kind::Counter, "Committed records the gateway could not hand to a materializer of this process (its queue was full, ADR-0049): they were read from the log."),
    ("tidemark_commit_feed_quiet_waits_total", Kind::Counter, "Blocking log reads of a materializer in feed mode that had found nothing for ten polls in a row: a quiet process waits on the log instead of polling it every 100 ms (ADR-0068)."),
    ("tidemark_commit_feed_switches_total", Kind::Counter, "Switches of a materializer between feed mode (records handed over, the log polled) and log mode (XREAD BLOCK), by `to` (ADR-0049); to log when the log held records the feed did not carry."),
    ("tidemark_shard_min_w", Kind::Gauge, "Lowest present W of each owned shard."),
    ("tidemark_shard_head", Kind::Gauge, "Log head of each owned shard (kept live for stopped shards)."),
    ("tidemark_shard_lag", Kind::Gauge, "Head minus lowest W of each owned shard (kept live for stopped shards)."),
    ("tidemark_shard_epoch", Kind::Gauge, "Epoch this process holds for each owned shard."),
    ("tidemark_shard_running", Kind::Gauge, "1 while the shard is materialised by this process, else 0."),
    ("tidemark_node_shards_owned", Kind::Gauge, "Shards this node holds a lease of (leases mode)."),
    ("tidemark_lease_renewals_total", Kind::Counter, "Shard leases renewed by this node (leases mode)."),
    ("tidemark_lease_losses_total", Kind::Counter, "Shard leases this node lost: taken by another node or not renewed in time."),
    ("tidemark_lease_reclaims_total", Kind::Counter, "Shards this node claimed again because its worker was fenced although the lease was its own (a former owner's late claim)."),
];

/// Label sets of labelled counters created at 0.
const ZERO_LABELS: &[(&str, &[(&str, &str)])] = &[
    ("tidemark_materialized_total", &[("path", "hot")]),
    ("tidemark_materialized_total", &[("path", "chunk")]),
    (
        "tidemark_task_restarts_total",
        &[("task", "materializer"), ("reason", "panic")],
    ),
    (
        "tidemark_task_restarts_total",
        &[("task", "materializer"), ("reason", "exit")],
    ),
    (
        "tidemark_task_restarts_total",
        &[("task", "wake_subscriber"), ("reason", "panic")],
    ),
    ("tidemark_errors_total", &[("code", "redis")]),
    ("tidemark_errors_total", &[("code", "log_read")]),
    ("tidemark_errors_total", &[("code", "log_confirm")]),
    ("tidemark_errors_total", &[("code", "internal")]),
    ("tidemark_client_errors_total", &[("code", "bad_request")]),
    ("tidemark_client_errors_total", &[("code", "unauthorized")]),
];

fn describe_and_zero() {
    for &(name, kind, help) in METRICS {
        match kind {
            Kind::Counter => {
                metrics::describe_counter!(name, help);
                if !ZERO_LABELS.iter().any(|(n, _)| *n == name) {
                    metrics::counter!(name).increment(0);
                }
            }
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
    for (name, labels) in ZERO_LABELS {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|(k, v)| metrics::Label::new(*k, *v))
            .collect();
        metrics::counter!(*name, labels).increment(0);
    }
    metrics::gauge!("tidemark_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `name` (a metric without labels) in the rendered `/metrics`.
    fn rendered(name: &str) -> f64 {
        let text = metrics_handle().render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not rendered:\n{text}"))
    }

    /// The handles of [`hot`] record into the recorder `/metrics` renders: taken before it was
    /// installed, they would record nowhere, and these counters would stay where they were.
    #[test]
    fn the_per_message_handles_record_into_metrics() {
        let name = "tidemark_wake_hints_deferred_total";
        let h = hot();
        let before = rendered(name);
        h.wake_hints_deferred.increment(5);
        assert!(rendered(name) >= before + 5.0, "{name} did not move");
        let count = "tidemark_ack_batch_size_count";
        let before = rendered(count);
        h.ack_batch_size.record(3.0);
        assert!(rendered(count) > before, "{count} did not move");
    }

    /// The process's recorder has its upkeep running from the start, whether or not anybody
    /// renders `/metrics`; and an upkeep thread runs at its interval.
    #[test]
    fn histogram_samples_are_folded_without_a_scrape() {
        let _ = metrics_handle();
        assert!(UPKEEP_RUNS.get().is_some(), "no upkeep for the recorder");
        let recorder = PrometheusBuilder::new()
            .set_buckets(&[1.0])
            .expect("buckets")
            .build_recorder();
        let runs = spawn_upkeep(recorder.handle(), Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(500));
        assert!(runs.load(Ordering::Relaxed) >= 3, "the upkeep does not run");
    }

    /// Every metric the code records is described here (read from the sources).
    #[test]
    fn every_metric_in_the_code_is_described() {
        // every source file of the crate, wherever modules move (but this one, which describes)
        fn read_dir(dir: &std::path::Path, out: &mut String) {
            for e in std::fs::read_dir(dir).expect("src dir") {
                let path = e.expect("dir entry").path();
                if path.is_dir() {
                    read_dir(&path, out);
                } else if path.extension().is_some_and(|x| x == "rs")
                    && !path.ends_with("telemetry.rs")
                {
                    out.push_str(&std::fs::read_to_string(&path).expect("source"));
                }
            }
        }
        let mut src = String::new();
        read_dir(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut src,
        );
        assert!(src.contains("tidemark_shard_lag"), "sources read");
        let mut missing = Vec::new();
        for (i, _) in src.match_indices("\"tidemark_") {
            let rest = &src[i + 1..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !METRICS.iter().any(|(n, _, _)| *n == name) && !missing.contains(&name) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "undescribed metrics: {missing:?}");
    }
}
