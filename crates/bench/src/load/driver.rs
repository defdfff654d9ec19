//! One run: deployment (local or remote), clients, the open-loop scheduler, receivers,
//! server-side samples, and the [`RunReport`]. The method is described in the module
//! documentation of [`crate::load`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::join_all;
use futures::StreamExt;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidemark_client::{Auth, Client, ClientHandle, Event};
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run::{up, Up, UpOptions};
use tidemark_store::redis::watermark::Layout;
use tokio::task::JoinHandle;
use tokio::time::{sleep, sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use super::info::{Delta, Sample, Watched};
use super::report::{InstanceStats, Percentiles, PoolPair, RunReport, CURVE_PERCENTILES};
use super::{bump, Error, LoadOptions, Target};

/// Clients connecting at once.
const CONNECT_CONCURRENCY: usize = 32;
/// Attempts per client connection (retryable failures only).
const CONNECT_ATTEMPTS: usize = 3;
/// How often a receiver acks the highest seq it processed (at most).
const ACK_EVERY: Duration = Duration::from_millis(100);
/// Progress-bar refresh.
const TICK: Duration = Duration::from_millis(250);
/// Highest latency a histogram holds (µs); larger values are clamped to it.
const HIST_MAX_US: u64 = 3_600_000_000;

/// A local deployment to start.
pub(crate) struct Local {
    pub mailbox: usize,
    pub core: usize,
    pub shards: u32,
    pub appendfsync: String,
    pub layout: Layout,
}

/// Where a run connects, once the deployment is up.
struct Setup {
    ws_url: String,
    token_secret: Option<Vec<u8>>,
    mailbox_urls: Vec<String>,
    core_urls: Vec<String>,
    layout: Layout,
    target: &'static str,
    shards: u32,
}

/// Starts a fresh local deployment (temporary data dir), runs, tears it down.
pub(crate) async fn run_local(opts: &LoadOptions, local: &Local) -> Result<RunReport, Error> {
    raise_fd_limit();
    let dir = tempfile::Builder::new()
        .prefix("tidemark-load-")
        .tempdir()?;
    let cancel = CancellationToken::new();
    let up_opts = UpOptions {
        mailbox: local.mailbox,
        core: local.core,
        shards: local.shards,
        layout: local.layout,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().join("data"),
        gateway: GatewayOptions {
            dev_auth: true,
            ..GatewayOptions::default()
        },
        materializer: MaterializerOptions::default(),
        appendfsync: local.appendfsync.clone(),
    };
    let Up {
        core,
        mailbox,
        running,
        ..
    } = up(up_opts, cancel.clone()).await?;
    let setup = Setup {
        ws_url: running.ws_url(),
        token_secret: None,
        mailbox_urls: mailbox.iter().map(|p| p.url()).collect(),
        core_urls: core.iter().map(|p| p.url()).collect(),
        layout: local.layout,
        target: "local",
        shards: local.shards,
    };
    let result = drive(opts, &setup).await;
    let stopped = running.shutdown().await;
    drop(mailbox);
    drop(core);
    drop(dir);
    let mut report = result?;
    if let Err(e) = stopped {
        bump(&mut report.errors, &format!("service_{}", e.code()), 1);
    }
    Ok(report)
}

/// Runs against the remote deployment of `opts.target`.
pub(crate) async fn run_remote(opts: &LoadOptions, layout: Layout) -> Result<RunReport, Error> {
    let Target::Remote {
        ws_url,
        token_secret,
        mailbox_urls,
        core_urls,
    } = &opts.target
    else {
        unreachable!("run_remote with a local target");
    };
    raise_fd_limit();
    let setup = Setup {
        ws_url: ws_url.clone(),
        token_secret: token_secret.clone(),
        mailbox_urls: mailbox_urls.clone(),
        core_urls: core_urls.clone(),
        layout,
        target: "remote",
        shards: 0,
    };
    drive(opts, &setup).await
}

/// The `send_ack`s of a run: all of them, and those that arrived while sending.
#[derive(Debug)]
struct Acks {
    /// End of sending: `t0 + duration`.
    end_of_sending: Instant,
    /// Every ack that arrived in the window (drain grace included).
    total: AtomicU64,
    /// Acks that arrived by `end_of_sending`.
    while_sending: AtomicU64,
}

impl Acks {
    fn new(end_of_sending: Instant) -> Self {
        Acks {
            end_of_sending,
            total: AtomicU64::new(0),
            while_sending: AtomicU64::new(0),
        }
    }

    /// An ack arrived at `at`.
    fn arrived(&self, at: Instant) {
        self.total.fetch_add(1, Ordering::Relaxed);
        if at <= self.end_of_sending {
            self.while_sending.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// `(send_acked, send_acked_while_sending, acked_per_s_while_sending)` of a run that sent
    /// for `duration_s`: the rate counts only the acks that arrived while sending.
    fn report(&self, duration_s: f64) -> (u64, u64, f64) {
        let while_sending = self.while_sending.load(Ordering::Relaxed);
        (
            self.total(),
            while_sending,
            while_sending as f64 / duration_s,
        )
    }
}

/// State shared by the scheduler, the ack waiters and the receivers.
struct Shared {
    t0: Instant,
    rate: f64,
    total: u64,
    /// End of the window: `t0 + duration + drain_grace`.
    deadline: Instant,
    acks: Acks,
    delivered: AtomicU64,
    /// Ack waiters still running.
    outstanding: AtomicU64,
    e2e: Mutex<Histogram<u64>>,
    send_ack: Mutex<Histogram<u64>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Set when the run is over: a connection closing now is not an error.
    stopping: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// The intended send time of message `i` (the one clock every latency is measured on).
    fn intended(&self, i: u64) -> Instant {
        self.t0 + Duration::from_secs_f64(i as f64 / self.rate)
    }

    fn error(&self, code: &str) {
        bump(&mut lock(&self.errors), code, 1);
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

fn record(h: &Mutex<Histogram<u64>>, d: Duration) {
    let us = (d.as_micros().min(u128::from(HIST_MAX_US)) as u64).max(1);
    lock(h).saturating_record(us);
}

fn bar(opts: &LoadOptions, len: u64, template: &str) -> ProgressBar {
    if !opts.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb
}

async fn connect_one(url: &str, auth: &Auth, user: &str) -> Result<Client, Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match Client::connect(url, auth).await {
            Ok(c) => return Ok(c),
            Err(e) if e.retryable() && attempt < CONNECT_ATTEMPTS => {
                sleep(Duration::from_millis(200 * attempt as u64)).await;
            }
            Err(source) => {
                return Err(Error::Client {
                    user: user.to_owned(),
                    source,
                })
            }
        }
    }
}

async fn drive(opts: &LoadOptions, setup: &Setup) -> Result<RunReport, Error> {
    // Server-side watchers first: a bad URL fails before any client connects.
    let mut watched = Vec::new();
    for (i, url) in setup.mailbox_urls.iter().enumerate() {
        watched.push(Watched::connect("mailbox", i, url).await?);
    }
    for (i, url) in setup.core_urls.iter().enumerate() {
        watched.push(Watched::connect("core", i, url).await?);
    }

    // Users unique to this run, so a remote deployment's older mailboxes never interfere.
    let tag = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64 & 0xff_ffff)
        .unwrap_or(0);
    let users: Vec<String> = (0..opts.clients)
        .map(|i| format!("lg{tag:06x}-{i}"))
        .collect();
    let ttl = opts.duration + opts.drain_grace + Duration::from_secs(3600);
    let auth_of = |user: &str| match &setup.token_secret {
        Some(secret) => Auth::Token(
            tidemark_client::make_token(secret, user, ttl)
                .expect("a run's token lifetime is non-zero and far from overflowing"),
        ),
        None => Auth::DevUser(user.to_owned()),
    };

    // Connect every client.
    let pb = bar(
        opts,
        opts.clients as u64,
        "{prefix} [{bar:30}] {pos}/{len} clients",
    );
    pb.set_prefix(format!("{} connecting", setup.layout));
    let mut connected: Vec<Option<Client>> = (0..opts.clients).map(|_| None).collect();
    {
        let mut stream = futures::stream::iter(users.iter().enumerate())
            .map(|(i, user)| {
                let auth = auth_of(user);
                let url = setup.ws_url.clone();
                async move { (i, connect_one(&url, &auth, user).await) }
            })
            .buffer_unordered(CONNECT_CONCURRENCY);
        while let Some((i, result)) = stream.next().await {
            connected[i] = Some(result?);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    let clients: Vec<Client> = connected
        .into_iter()
        .map(|c| c.expect("connected"))
        .collect();
    let handles: Vec<ClientHandle> = clients.iter().map(Client::handle).collect();

    let total = (opts.rate * opts.duration.as_secs_f64()).round() as u64;
    let a = sample_all(&mut watched).await?;
    let t0 = Instant::now() + Duration::from_millis(20);
    let shared = Arc::new(Shared {
        t0,
        rate: opts.rate,
        total,
        deadline: t0 + opts.duration + opts.drain_grace,
        acks: Acks::new(t0 + opts.duration),
        delivered: AtomicU64::new(0),
        outstanding: AtomicU64::new(0),
        e2e: Mutex::new(new_histogram()),
        send_ack: Mutex::new(new_histogram()),
        errors: Mutex::new(BTreeMap::new()),
        stopping: AtomicBool::new(false),
    });
    let stop = CancellationToken::new();
    // Whatever way this function returns, the receivers and the ticker stop with it.
    let _stop_on_exit = stop.clone().drop_guard();
    let receivers: Vec<JoinHandle<()>> = clients
        .into_iter()
        .map(|c| tokio::spawn(receive(c, shared.clone(), stop.clone())))
        .collect();

    // Progress while sending and draining.
    let sent = Arc::new(AtomicU64::new(0));
    let pb = bar(
        opts,
        total,
        "{prefix} {elapsed_precise} [{bar:30}] {pos}/{len} sent {msg}",
    );
    pb.set_prefix(setup.layout.to_string());
    let ticker = tokio::spawn(tick(
        pb.clone(),
        shared.clone(),
        sent.clone(),
        stop.clone(),
        opts.fanout as u64,
    ));

    // The open-loop scheduler.
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut max_lag = Duration::ZERO;
    let n = opts.clients;
    for i in 0..total {
        let intended = shared.intended(i);
        if intended > Instant::now() {
            sleep_until(intended).await;
        }
        let from = (i % n as u64) as usize;
        let to: Vec<String> = pick(&mut rng, n, from, opts.fanout)
            .into_iter()
            .map(|r| users[r].clone())
            .collect();
        let id = format!("m{i}");
        let body = format!("i:{i}");
        let result = handles[from].start_send(&id, &to, &body).await;
        max_lag = max_lag.max(Instant::now().saturating_duration_since(intended));
        sent.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(pending) => {
                shared.outstanding.fetch_add(1, Ordering::Relaxed);
                let shared = shared.clone();
                tokio::spawn(async move {
                    let left = shared.deadline.saturating_duration_since(Instant::now());
                    match pending.wait(left).await {
                        Ok(_) => {
                            let now = Instant::now();
                            record(&shared.send_ack, now.saturating_duration_since(intended));
                            shared.acks.arrived(now);
                        }
                        Err(e) => shared.error(e.code()),
                    }
                    shared.outstanding.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Err(e) => shared.error(e.code()),
        }
    }
    let b = sample_all(&mut watched).await?;

    // Drain: until every pair is delivered and every ack is in, or the window ends.
    let expected = total * opts.fanout as u64;
    pb.set_prefix(format!("{} draining", setup.layout));
    while Instant::now() < shared.deadline
        && (shared.delivered.load(Ordering::Relaxed) < expected
            || shared.outstanding.load(Ordering::Relaxed) > 0)
    {
        sleep(Duration::from_millis(10)).await;
    }
    let c = sample_all(&mut watched).await?;

    // Stop: ack waiters end at the deadline on their own; receivers on `stop`.
    shared.stopping.store(true, Ordering::SeqCst);
    stop.cancel();
    let cap = Instant::now() + Duration::from_secs(2);
    while shared.outstanding.load(Ordering::Relaxed) > 0 && Instant::now() < cap {
        sleep(Duration::from_millis(10)).await;
    }
    for r in receivers {
        let _ = r.await;
    }
    let _ = ticker.await;
    pb.finish_and_clear();
    drop(handles);

    let mut errors = lock(&shared.errors).clone();
    bump(
        &mut errors,
        "ack_pending_at_end",
        shared.outstanding.load(Ordering::Relaxed),
    );
    let delivered = shared.delivered.load(Ordering::Relaxed);
    let e2e = lock(&shared.e2e).clone();
    let send_ack = lock(&shared.send_ack).clone();
    let duration_s = opts.duration.as_secs_f64();
    let (acked, acked_while_sending, acked_per_s_while_sending) = shared.acks.report(duration_s);

    // Server side.
    let mut per_instance = Vec::new();
    let mut pools: BTreeMap<&str, PoolAcc> = BTreeMap::new();
    for (i, w) in watched.iter().enumerate() {
        let loaded = Delta::between(&a[i], &b[i]);
        let whole = Delta::between(&a[i], &c[i]);
        let acc = pools.entry(w.pool).or_default();
        acc.instances += 1;
        acc.cpu_pct_sum += loaded.cpu_pct();
        acc.ops += loaded.ops_per_s();
        acc.calls += whole.evalsha_calls;
        acc.usec += whole.evalsha_usec;
        acc.cpu_s += whole.cpu_s;
        per_instance.push(InstanceStats {
            pool: w.pool.to_owned(),
            index: w.index,
            url: tidemark_store::redact_url(&w.url),
            evalsha_calls: whole.evalsha_calls,
            evalsha_us: whole.evalsha_us(),
            cpu_pct: loaded.cpu_pct(),
            ops_per_s: loaded.ops_per_s(),
            cpu_s: whole.cpu_s,
        });
    }
    let pool = |name: &str| pools.get(name).copied().unwrap_or_default();
    let (mb, core) = (pool("mailbox"), pool("core"));

    Ok(RunReport {
        layout: setup.layout,
        target: setup.target.to_owned(),
        mailbox_instances: setup.mailbox_urls.len(),
        core_instances: setup.core_urls.len(),
        shards: setup.shards,
        clients: opts.clients,
        rate: opts.rate,
        duration_s,
        fanout: opts.fanout,
        seed: opts.seed,
        sent: total,
        send_acked: acked,
        send_acked_while_sending: Some(acked_while_sending),
        acked_per_s_while_sending: Some(acked_per_s_while_sending),
        delivered,
        expected,
        delivered_in_window_pct: if expected > 0 {
            delivered as f64 / expected as f64 * 100.0
        } else {
            0.0
        },
        e2e_ms: percentiles(&e2e),
        send_ack_ms: percentiles(&send_ack),
        e2e_curve: curve(&e2e),
        send_ack_curve: curve(&send_ack),
        evalsha_us: PoolPair {
            mailbox: mb.evalsha_us(),
            core: core.evalsha_us(),
        },
        redis_cpu_pct: PoolPair {
            mailbox: mb.cpu_pct(),
            core: core.cpu_pct(),
        },
        ops_per_s: PoolPair {
            mailbox: mb.ops,
            core: core.ops,
        },
        mailbox_cpu_us_per_msg: if delivered > 0 {
            mb.cpu_s * 1e6 / delivered as f64
        } else {
            0.0
        },
        max_send_lag_ms: max_lag.as_secs_f64() * 1e3,
        errors,
        per_instance,
    })
}

/// Sums of one pool.
#[derive(Debug, Clone, Copy, Default)]
struct PoolAcc {
    instances: usize,
    cpu_pct_sum: f64,
    ops: f64,
    calls: u64,
    usec: u64,
    cpu_s: f64,
}

impl PoolAcc {
    fn evalsha_us(&self) -> f64 {
        if self.calls > 0 {
            self.usec as f64 / self.calls as f64
        } else {
            0.0
        }
    }

    fn cpu_pct(&self) -> f64 {
        if self.instances > 0 {
            self.cpu_pct_sum / self.instances as f64
        } else {
            0.0
        }
    }
}

async fn sample_all(watched: &mut [Watched]) -> Result<Vec<Sample>, Error> {
    join_all(watched.iter_mut().map(Watched::sample))
        .await
        .into_iter()
        .collect()
}

/// `k` distinct clients out of `n`, none of them `from`.
fn pick(rng: &mut StdRng, n: usize, from: usize, k: usize) -> Vec<usize> {
    let skip = |j: usize| if j >= from { j + 1 } else { j };
    if k == 1 {
        return vec![skip(rng.random_range(0..n - 1))];
    }
    rand::seq::index::sample(rng, n - 1, k)
        .into_iter()
        .map(skip)
        .collect()
}

/// One client's receiving side: deliveries (e2e latency, window count), periodic acks,
/// error frames.
async fn receive(mut client: Client, shared: Arc<Shared>, stop: CancellationToken) {
    let handle = client.handle();
    let mut highest = client.ready_after();
    let mut unacked: Option<u64> = None;
    let mut last_ack = Instant::now();
    loop {
        let event = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            e = client.next_event() => e,
            _ = sleep_until(last_ack + ACK_EVERY), if unacked.is_some() => {
                if let Some(seq) = unacked.take() {
                    let _ = handle.ack(seq).await;
                }
                last_ack = Instant::now();
                continue;
            }
        };
        match event {
            Some(Event::Deliver(entry)) => {
                let now = Instant::now();
                if entry.seq <= highest {
                    continue; // a repeat (at least once on the wire)
                }
                highest = entry.seq;
                unacked = Some(entry.seq);
                match entry
                    .body
                    .strip_prefix("i:")
                    .and_then(|n| n.parse::<u64>().ok())
                    .filter(|&n| n < shared.total)
                {
                    Some(i) if now <= shared.deadline => {
                        record(
                            &shared.e2e,
                            now.saturating_duration_since(shared.intended(i)),
                        );
                        shared.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(_) => {} // after the window
                    None => shared.error("foreign_body"),
                }
            }
            Some(Event::Error { code, .. }) => shared.error(&code),
            // An ack whose waiter gave up at the deadline: already counted as a timeout.
            Some(Event::SendAck { .. }) => {}
            Some(Event::Closed) | None => {
                if !shared.stopping.load(Ordering::SeqCst) {
                    shared.error("closed");
                }
                break;
            }
        }
    }
    // Dropping the client aborts its tasks: no close handshake needed at the end of a run.
    drop(client);
}

async fn tick(
    pb: ProgressBar,
    shared: Arc<Shared>,
    sent: Arc<AtomicU64>,
    stop: CancellationToken,
    fanout: u64,
) {
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep(TICK) => {}
        }
        let now = Instant::now();
        let s = sent.load(Ordering::Relaxed);
        let rate = (s - last.1) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-3);
        last = (now, s);
        pb.set_position(s);
        pb.set_message(format!(
            "acked {} delivered {}/{} rate {:.0}/s",
            shared.acks.total(),
            shared.delivered.load(Ordering::Relaxed),
            s * fanout,
            rate
        ));
    }
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let ms = |us: u64| us as f64 / 1e3;
    Percentiles {
        p50: ms(h.value_at_quantile(0.50)),
        p99: ms(h.value_at_quantile(0.99)),
        p999: ms(h.value_at_quantile(0.999)),
        max: ms(h.max()),
    }
}

fn curve(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    CURVE_PERCENTILES
        .iter()
        .map(|&p| {
            let us = if p >= 100.0 {
                h.max()
            } else {
                h.value_at_quantile(p / 100.0)
            };
            (p, us as f64 / 1e3)
        })
        .collect()
}

/// Raises the soft limit of open files to the hard limit: a local run holds two sockets
/// per client (both ends live in this process).
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_distinct_recipients_never_the_sender() {
        let mut rng = StdRng::seed_from_u64(7);
        for from in 0..5 {
            for k in 1..5 {
                let mut v = pick(&mut rng, 5, from, k);
                assert_eq!(v.len(), k);
                assert!(v.iter().all(|&r| r != from && r < 5));
                v.sort_unstable();
                v.dedup();
                assert_eq!(v.len(), k);
            }
        }
    }

    /// Acks that arrive during the drain grace are not throughput: a run whose service fell
    /// behind and caught up after sending stopped must not report the offered rate.
    #[test]
    fn acks_after_sending_do_not_count_towards_the_rate() {
        let t0 = Instant::now();
        let duration = Duration::from_secs(10);
        let acks = Acks::new(t0 + duration);
        acks.arrived(t0 + Duration::from_secs(1));
        acks.arrived(t0 + duration); // the last instant of sending still counts
        acks.arrived(t0 + duration + Duration::from_millis(1));
        acks.arrived(t0 + duration + Duration::from_secs(4));
        let (total, while_sending, per_s) = acks.report(duration.as_secs_f64());
        assert_eq!(total, 4, "every ack of the window is in send_acked");
        assert_eq!(
            while_sending, 2,
            "only the acks that arrived by t0 + duration"
        );
        assert_eq!(
            per_s, 0.2,
            "2 acks over 10 s, not 4 (acks of the drain grace)"
        );

        // Everything acked, but only after sending stopped: nothing was acked while sending.
        let late = Acks::new(t0 + duration);
        for k in 1..=100 {
            late.arrived(t0 + duration + Duration::from_millis(k));
        }
        assert_eq!(late.report(duration.as_secs_f64()), (100, 0, 0.0));
    }

    #[test]
    fn same_seed_same_traffic() {
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..100)
                .map(|i| pick(&mut rng, 50, i % 50, 2))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }
}
