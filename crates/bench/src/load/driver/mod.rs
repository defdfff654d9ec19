//! One run: deployment (local or remote), clients, the open-loop scheduler, receivers,
//! server-side samples, and the [`RunReport`]. The method is described in the module
//! documentation of [`crate::load`].
//!
//! This file holds the deployment ([`run_local`], [`run_remote`]) and the phases of a run in
//! order (`drive`: watch, connect, sample A, send, sample B, drain, sample C, stop, report).
//! The phases live apart: `clients.rs` (users, connecting, the receiving task),
//! `schedule.rs` (the open-loop sender and recipient choice), `shared.rs` (the clock,
//! histograms and counters the tasks share), `progress.rs` (progress bars) and `collect.rs`
//! (server-side samples and the report).

mod clients;
mod collect;
mod progress;
mod schedule;
mod shared;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tidemark_client::{Client, ClientHandle};
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run::{up, Up, UpOptions};
use tidemark_store::redis::watermark::Layout;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;

use super::procs::metrics_url_of;
use super::report::RunReport;
use super::{bump, Error, LoadOptions, Target};
use clients::{connect_all, receive, run_users};
use collect::{run_report, sample_point, servers, watch_all, Samples};
use progress::{bar, tick};
use schedule::send_all;
use shared::Shared;

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
    /// Gateways; client i connects to `ws_urls[i % len]`.
    ws_urls: Vec<String>,
    token_secret: Option<Vec<u8>>,
    mailbox_urls: Vec<String>,
    core_urls: Vec<String>,
    layout: Layout,
    target: &'static str,
    shards: u32,
    /// Each gateway process's `/metrics` (a remote target).
    metrics_urls: Vec<String>,
    /// The deployment runs in this process (a local target): its CPU and the generator's
    /// are one figure.
    in_process: bool,
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
            commit_linger: opts
                .commit_linger
                .unwrap_or(tidemark_server::gateway::DEFAULT_COMMIT_LINGER),
            ack_interval: opts
                .ack_interval
                .unwrap_or(tidemark_server::gateway::DEFAULT_ACK_INTERVAL),
            ..GatewayOptions::default()
        },
        materializer: MaterializerOptions {
            read_linger: opts
                .read_linger
                .unwrap_or(tidemark_server::materializer::DEFAULT_READ_LINGER),
            ..MaterializerOptions::default()
        },
        appendfsync: local.appendfsync.clone(),
        cluster: false,
        node: None,
        upgrade: false,
    };
    let Up {
        core,
        mailbox,
        running,
        ..
    } = up(up_opts, cancel.clone()).await?;
    let setup = Setup {
        ws_urls: vec![running.ws_url()],
        token_secret: None,
        mailbox_urls: mailbox.iter().map(|p| p.url()).collect(),
        core_urls: core.iter().map(|p| p.url()).collect(),
        layout: local.layout,
        target: "local",
        shards: local.shards,
        metrics_urls: Vec::new(),
        in_process: true,
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
        ws_urls,
        token_secret,
        mailbox_urls,
        core_urls,
        metrics_urls,
    } = &opts.target
    else {
        unreachable!("run_remote with a local target");
    };
    let metrics_urls = if metrics_urls.is_empty() {
        ws_urls.iter().map(|u| metrics_url_of(u)).collect()
    } else {
        metrics_urls.clone()
    };
    raise_fd_limit();
    let setup = Setup {
        ws_urls: ws_urls.clone(),
        token_secret: token_secret.clone(),
        mailbox_urls: mailbox_urls.clone(),
        core_urls: core_urls.clone(),
        layout,
        target: "remote",
        shards: 0,
        metrics_urls,
        in_process: false,
    };
    drive(opts, &setup).await
}

async fn drive(opts: &LoadOptions, setup: &Setup) -> Result<RunReport, Error> {
    // Server-side watchers first: a bad URL fails before any client connects.
    let mut watched = watch_all(setup, opts.read_policy).await?;
    let servers = servers(setup, opts.read_policy)?;

    let users = run_users(opts.clients);
    let clients = connect_all(opts, setup, &users).await?;
    let handles: Vec<ClientHandle> = clients.iter().map(Client::handle).collect();

    let total = (opts.rate * opts.duration.as_secs_f64()).round() as u64;
    let a = sample_point(&mut watched, &servers).await;
    let t0 = Instant::now() + Duration::from_millis(20);
    let shared = Arc::new(Shared::new(t0, opts, total));
    let stop = CancellationToken::new();
    // Whatever way this function returns, the receivers and the ticker stop with it.
    let _stop_on_exit = stop.clone().drop_guard();
    let receivers: Vec<JoinHandle<()>> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| tokio::spawn(receive(c, i, shared.clone(), stop.clone())))
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
    let max_lag = send_all(opts, &shared, &users, &handles, &sent).await;
    let b = sample_point(&mut watched, &servers).await;

    // Drain: until every pair is delivered and every ack is in, or the window ends.
    let expected = total * opts.fanout as u64;
    pb.set_prefix(format!("{} draining", setup.layout));
    while Instant::now() < shared.deadline
        && (shared.delivered.load(Ordering::Relaxed) < expected
            || shared.outstanding.load(Ordering::Relaxed) > 0)
    {
        sleep(Duration::from_millis(10)).await;
    }
    let c = sample_point(&mut watched, &servers).await;

    // Stop: the receivers end on `stop`; a send still unanswered now timed out.
    shared.stopping.store(true, Ordering::SeqCst);
    stop.cancel();
    for r in receivers {
        let _ = r.await;
    }
    let _ = ticker.await;
    pb.finish_and_clear();
    drop(handles);

    let samples = Samples { a, b, c };
    Ok(run_report(
        opts, setup, &shared, &watched, &servers, &samples, max_lag,
    ))
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
