//! The `tidemark` command: the top-level arguments and the dispatch to one module per
//! command group ([`cmd`]), which parses its flags and calls the library crates. Nothing else.

mod cmd;

/// mimalloc instead of glibc's malloc: the gateway allocates per frame and per Redis command,
/// and glibc's allocator was ~17 % of the server's CPU under load (`scripts/perf/
/// profile_server.sh`, docs/performance.md "CPU per message").
#[cfg(not(feature = "alloc-count"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// With the `alloc-count` feature (a build for measurements): mimalloc, with every allocation
/// and reallocation counted and exported on `/metrics`.
#[cfg(feature = "alloc-count")]
#[global_allocator]
static GLOBAL: alloc_count::Counting = alloc_count::Counting;

#[cfg(feature = "alloc-count")]
mod alloc_count {
    //! Counts allocations per thread slot (no shared cache line between the runtime's
    //! threads, so counting barely changes what it counts) and sums the slots when read.

    use std::alloc::{GlobalAlloc, Layout};
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

    const SLOTS: usize = 64;

    #[repr(align(128))]
    struct Slot {
        allocs: AtomicU64,
        reallocs: AtomicU64,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = Slot {
        allocs: AtomicU64::new(0),
        reallocs: AtomicU64::new(0),
    };
    static COUNTS: [Slot; SLOTS] = [EMPTY; SLOTS];
    static NEXT: AtomicUsize = AtomicUsize::new(0);

    thread_local! {
        // const-initialised: reading it never allocates
        static MINE: Cell<usize> = const { Cell::new(usize::MAX) };
    }

    fn slot() -> &'static Slot {
        let i = MINE
            .try_with(|m| {
                if m.get() == usize::MAX {
                    m.set(NEXT.fetch_add(1, Relaxed) % SLOTS);
                }
                m.get()
            })
            .unwrap_or(0);
        &COUNTS[i]
    }

    /// mimalloc, counted.
    pub struct Counting;

    // SAFETY: every call is passed on to mimalloc unchanged; only counters are touched.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            slot().allocs.fetch_add(1, Relaxed);
            unsafe { mimalloc::MiMalloc.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            slot().allocs.fetch_add(1, Relaxed);
            unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            slot().reallocs.fetch_add(1, Relaxed);
            unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
        }
    }

    /// (allocations, reallocations) since the process started.
    pub fn counts() -> (u64, u64) {
        COUNTS.iter().fold((0, 0), |(a, r), s| {
            (a + s.allocs.load(Relaxed), r + s.reallocs.load(Relaxed))
        })
    }
}

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cmd::{bench, client, serve, status, trace, upgrade, wm};

#[derive(Parser)]
#[command(
    name = "tidemark",
    version,
    about = "Tidemark: gap-free mailbox delivery on Redis"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Watermark operations (wm:{s} on a mailbox Redis).
    #[command(subcommand)]
    Wm(wm::WmCmd),
    /// Shard ownership operations.
    #[command(subcommand)]
    Shard(wm::ShardCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Run Tidemark locally: starts its own redis-server processes, gateway and materializers.
    Up(serve::UpArgs),
    /// Run the gateway and materializers against Redis instances started elsewhere.
    Serve(Box<serve::ServeArgs>),
    /// Mint a bearer token (HMAC-SHA256, user + expiry; --admin for the operator endpoints).
    Token(client::TokenArgs),
    /// Send one message and print its offsets.
    Send(client::SendArgs),
    /// Print deliveries as they arrive.
    Tail(client::TailArgs),
    /// Follow one message from its commit in dlog:{s} to every mailbox entry.
    Trace(trace::TraceArgs),
    /// Token secret files.
    #[command(subcommand)]
    Secret(client::SecretCmd),
    /// Live nodes, and every shard's owner, epoch, W, head and lag.
    Status(status::StatusArgs),
    /// Raise the deployment's identity version from 2 to 3 (packed log records, ADR-0056);
    /// checks first that no process that cannot read them runs.
    Upgrade(upgrade::UpgradeArgs),
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Wm(c) => wm::run(c).await,
        Cmd::Shard(c) => wm::run_shard(c).await,
        Cmd::Bench(c) => bench::run(c).await,
        Cmd::Up(a) => serve::up(a).await,
        Cmd::Serve(a) => serve::serve(*a).await,
        Cmd::Token(a) => client::token(a),
        Cmd::Send(a) => client::send(a).await,
        Cmd::Tail(a) => client::tail(a).await,
        Cmd::Trace(a) => trace::run(a).await,
        Cmd::Secret(c) => client::secret(c),
        Cmd::Status(a) => status::run(a).await,
        Cmd::Upgrade(a) => upgrade::run(a).await,
    }
}

/// Turns transparent huge pages off for this process and the processes it starts (ADR-0087).
///
/// mimalloc asks for huge pages on its arenas (`madvise(MADV_HUGEPAGE)`), and it returns
/// memory to the system a second after it falls idle. Each time the gateway touched such
/// memory again, the kernel zeroed a whole 2 MiB page: 2–8 % of the server's CPU samples at
/// 5,000 msg/s went to that, and 0.1–0.5 % with this off. The flag is inherited by the
/// redis-servers `up` starts, which is what Redis recommends for itself (it warns about THP,
/// and turns it off for its own process by default). Does nothing off Linux; a kernel that
/// refuses it leaves THP as it was.
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integer arguments and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let cli = Cli::parse();
    cmd::logs::init();
    #[cfg(feature = "alloc-count")]
    tidemark_server::telemetry::set_allocation_counts(alloc_count::counts);
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            cmd::logs::fatal(&e);
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// After the call, the kernel reports THP off for the process (`THP_enabled: 0`).
    #[cfg(target_os = "linux")]
    #[test]
    fn transparent_huge_pages_are_turned_off() {
        disable_transparent_huge_pages();
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let line = status
            .lines()
            .find(|l| l.starts_with("THP_enabled:"))
            .expect("THP_enabled in /proc/self/status");
        assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    }

    /// Every flag and argument of every command says what it is for (`--help`).
    #[test]
    fn every_flag_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {} (no about)", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "tidemark", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
