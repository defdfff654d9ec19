//! A stand-alone driver of the load generator (the `tidemark bench load` / `bench ladder`
//! commands call the same library functions):
//!
//! ```sh
//! cargo run --release -p tidemark-bench --example load -- \
//!     --clients 200 --rate 2000 --duration 20 --layouts packed-v1,packed-v2 \
//!     --mailbox 1 --core 1 --shards 64 --json out.json --plot docs/perf
//! cargo run --release -p tidemark-bench --example load -- \
//!     --ladder 1+1@1000,1+1@2000 --clients 200 --duration 20 --plot docs/perf
//! ```
//!
//! Prints the markdown table (and the ladder table with `--ladder`) on stdout.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tidemark_bench::load::{self, LoadOptions, Target};
use tidemark_store::redis::watermark::Layout;

fn usage() -> ExitCode {
    eprintln!(
        "usage: load [--clients N] [--rate R] [--duration S] [--fanout K] [--seed N] \
         [--drain-grace S] [--mailbox M] [--core C] [--shards S] [--appendfsync P] \
         [--layouts packed-v1,packed-v2] [--ladder M+C@R,…] [--json FILE] [--plot DIR] \
         [--no-progress]"
    );
    ExitCode::from(2)
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut opts = LoadOptions {
        progress: true,
        ..LoadOptions::default()
    };
    let (mut mailbox, mut core, mut shards, mut appendfsync) =
        (4usize, 4usize, 64u32, "everysec".to_string());
    let (mut json, mut plot, mut ladder) = (None::<PathBuf>, None::<PathBuf>, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--no-progress" {
            opts.progress = false;
            continue;
        }
        let Some(v) = args.next() else {
            return usage();
        };
        let ok = match flag.as_str() {
            "--clients" => v.parse().map(|x| opts.clients = x).is_ok(),
            "--rate" => v.parse().map(|x| opts.rate = x).is_ok(),
            "--duration" => v
                .parse()
                .map(|x| opts.duration = Duration::from_secs_f64(x))
                .is_ok(),
            "--drain-grace" => v
                .parse()
                .map(|x| opts.drain_grace = Duration::from_secs_f64(x))
                .is_ok(),
            "--fanout" => v.parse().map(|x| opts.fanout = x).is_ok(),
            "--seed" => v.parse().map(|x| opts.seed = x).is_ok(),
            "--mailbox" => v.parse().map(|x| mailbox = x).is_ok(),
            "--core" => v.parse().map(|x| core = x).is_ok(),
            "--shards" => v.parse().map(|x| shards = x).is_ok(),
            "--appendfsync" => {
                appendfsync = v;
                true
            }
            "--layouts" => {
                let parsed: Option<Vec<Layout>> = v
                    .split(',')
                    .map(|l| Layout::from_bytes(l.trim().as_bytes()))
                    .collect();
                parsed.map(|l| opts.layouts = l).is_some()
            }
            "--ladder" => {
                ladder = Some(v);
                true
            }
            "--json" => {
                json = Some(v.into());
                true
            }
            "--plot" => {
                plot = Some(v.into());
                true
            }
            _ => false,
        };
        if !ok {
            eprintln!("bad {flag}");
            return usage();
        }
    }
    opts.target = Target::Local {
        mailbox,
        core,
        shards,
        appendfsync,
    };
    let result = match &ladder {
        Some(steps) => match load::parse_steps(steps) {
            Ok(steps) => load::run_ladder(&opts, &steps).await,
            Err(e) => Err(e),
        },
        None => load::run_load(&opts).await,
    };
    let runs = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error ({}): {e}", e.code());
            return ExitCode::FAILURE;
        }
    };
    println!("{}", load::markdown_table(&runs));
    if ladder.is_some() {
        println!("{}", load::ladder_table(&runs));
    }
    for r in &runs {
        if !r.errors.is_empty() {
            println!("{} errors: {:?}", r.layout, r.errors);
        }
        println!(
            "{}: sent {} acked {} delivered {}/{} e2e max {:.1}ms, generator lag max {:.1}ms",
            r.layout,
            r.sent,
            r.send_acked,
            r.delivered,
            r.expected,
            r.e2e_ms.max,
            r.max_send_lag_ms
        );
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&load::to_json(&runs)).expect("JSON");
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(parent);
        }
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(dir) = plot {
        match tidemark_bench::plot::write_plots(&dir, &runs, ladder.is_some()) {
            Ok(files) => {
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            Err(e) => {
                eprintln!("plots: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
