//! ADR-0109: one `tidemark up` per data dir. A second `up` on a data dir in use is refused
//! (`data_dir_locked`) before it starts a redis-server or writes a file; the first one's
//! redis-servers, AOF files and `tidemark.toml` are left as they were, and the data dir can be
//! used again once the first has stopped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run::{self, UpOptions};
use tidemark_store::redis::watermark::Layout;
use tokio_util::sync::CancellationToken;

fn options(dir: &Path) -> UpOptions {
    UpOptions {
        mailbox: 1,
        core: 1,
        shards: 2,
        layout: Layout::PackedV2,
        // another port for each: before ADR-0109 the second `up` then started in full
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.to_path_buf(),
        gateway: GatewayOptions {
            dev_auth: true,
            ..Default::default()
        },
        materializer: MaterializerOptions {
            block: Duration::from_millis(100),
            ..Default::default()
        },
        appendfsync: "always".into(),
        cluster: false,
        node: None,
        upgrade: false,
    }
}

/// Pids of the redis-server processes whose working directory is inside `dir`.
fn redis_servers_in(dir: &Path) -> Vec<u32> {
    let dir = dir.canonicalize().unwrap();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != "redis-server" {
            continue;
        }
        if let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) {
            if cwd.starts_with(&dir) {
                found.push(pid);
            }
        }
    }
    found.sort_unstable();
    found
}

/// Every file under `dir` with its contents (the AOF files, manifests, `tidemark.toml`…),
/// except the servers' logs, which a redis-server appends to at any time.
fn files_under(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if !p.ends_with(tidemark_redis_proc::LOG_FILE) {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_up_on_a_data_dir_in_use_is_refused_and_touches_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let cancel = CancellationToken::new();
    let first = run::up(options(&dir), cancel.clone())
        .await
        .expect("first up");
    // something acknowledged on the first's core instance (appendfsync always: in its AOF)
    let core_url = first.core[0].url();
    let client = redis::Client::open(core_url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("acknowledged")
        .arg("yes")
        .query_async(&mut c)
        .await
        .unwrap();
    let servers = redis_servers_in(&dir);
    assert_eq!(servers.len(), 2, "the first up's core and mailbox");
    let files = files_under(&dir);
    let topology_file = std::fs::read(dir.join(run::UP_TOPOLOGY_FILE)).unwrap();

    let second = run::up(options(&dir), CancellationToken::new()).await;
    let err = match second {
        Ok(up) => {
            let also = redis_servers_in(&dir);
            drop(up);
            panic!(
                "a second up on {} started (redis-servers in it: {also:?}, the first's: \
                 {servers:?})",
                dir.display()
            );
        }
        Err(e) => e,
    };
    assert_eq!(err.code(), "data_dir_locked", "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&dir.display().to_string()) && text.contains("up.lock"),
        "{text}"
    );
    // nothing started, nothing written
    assert_eq!(redis_servers_in(&dir), servers);
    assert_eq!(
        std::fs::read(dir.join(run::UP_TOPOLOGY_FILE)).unwrap(),
        topology_file
    );
    assert_eq!(files_under(&dir), files);
    // the first still serves what it acknowledged
    let got: String = redis::cmd("GET")
        .arg("acknowledged")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(got, "yes");

    // once the first has stopped (its redis-servers killed), the data dir is free again
    cancel.cancel();
    stop(first).await;
    assert!(redis_servers_in(&dir).is_empty());
    let cancel = CancellationToken::new();
    let again = run::up(options(&dir), cancel.clone())
        .await
        .expect("up after the first stopped");
    let client = redis::Client::open(again.core[0].url().as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let got: String = redis::cmd("GET")
        .arg("acknowledged")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(got, "yes", "the AOF kept what was acknowledged");
    cancel.cancel();
    stop(again).await;
}

/// Waits for a cancelled `up` to stop, then drops the rest of it (its redis-servers, its
/// lock).
async fn stop(up: run::Up) {
    let run::Up { running, .. } = up;
    running.wait().await.unwrap();
}
