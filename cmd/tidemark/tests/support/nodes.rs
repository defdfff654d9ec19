//! Shared by the tests that run several `tidemark serve` nodes (`nodes.rs`, `chaos.rs`):
//! ports for nodes that restart, signals, who holds which lease, an HTTP sender spread over
//! every gateway and the check that every acknowledged message was delivered exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_store::topology::ShardMap;

use super::{http_get, http_post};

/// Where [`node_ports`] picks ports: below Linux's ephemeral range (32768 and up by default),
/// where `bind(…:0)` — every other test's `free_port`, every redis-server of a test — lands,
/// and below the Redis Cluster harness's client and bus ports (12000..32000).
const NODE_PORTS: (u16, u16) = (10_000, 12_000);

/// `n` distinct ports for nodes, each free when picked, from a range apart from the ephemeral
/// ports: a node killed and restarted on its port must find it still free, and an ephemeral
/// port released by a dead node could be taken meanwhile by any test's `bind(…:0)`. Each
/// process starts at its own offset (from its pid) and never hands a port out twice, so tests
/// of one binary, and binaries running side by side, do not pick the same ports.
pub fn node_ports(n: usize) -> Vec<u16> {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let (lo, hi) = NODE_PORTS;
    let span = u32::from(hi - lo);
    let start = (std::process::id().wrapping_mul(7919) % span) as u16;
    let _ = NEXT.compare_exchange(0, start.max(1), Ordering::SeqCst, Ordering::SeqCst);
    let mut out = Vec::with_capacity(n);
    for _ in 0..span {
        if out.len() == n {
            break;
        }
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = lo + (u32::from(k) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            out.push(port);
        }
    }
    assert_eq!(out.len(), n, "no {n} free ports in {lo}..{hi}");
    out
}

/// `n` consecutive ports from [`node_ports`] (`up --nodes N` puts its nodes on consecutive
/// ports).
pub fn consecutive_node_ports(n: usize) -> Vec<u16> {
    loop {
        let ports = node_ports(n);
        if ports.windows(2).all(|w| w[1] == w[0] + 1) {
            return ports;
        }
    }
}

/// Sends `sig` to our child `child`.
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// Shard → lease holder, for the shards that have one (empty while Redis does not answer).
pub async fn owners(map: &ShardMap) -> BTreeMap<u32, String> {
    match tidemark_ops::status::status(map).await {
        Ok(s) => s
            .shards
            .into_iter()
            .filter_map(|l| l.owner.map(|o| (l.shard, o)))
            .collect(),
        Err(_) => BTreeMap::new(),
    }
}

/// Waits (at most `secs`) until every shard of `map` is held by one of `live`, each of them
/// holding ⌊S/n⌋ or ⌈S/n⌉; returns how long it took.
pub async fn until_balanced_within(
    map: &ShardMap,
    live: &[&str],
    what: &str,
    secs: u64,
) -> Duration {
    let start = Instant::now();
    let shards = map.shards();
    let n = live.len() as u32;
    loop {
        let o = owners(map).await;
        let mut count: BTreeMap<&str, u32> = live.iter().map(|&id| (id, 0)).collect();
        let mut ok = o.len() == shards as usize;
        for id in o.values() {
            match count.get_mut(id.as_str()) {
                Some(c) => *c += 1,
                None => ok = false,
            }
        }
        if ok
            && count
                .values()
                .all(|&c| c == shards / n || c == shards.div_ceil(n))
        {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "{what}: not balanced over {live:?} after {secs} s: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`until_balanced_within`] 30 s.
pub async fn until_balanced(map: &ShardMap, live: &[&str], what: &str) -> Duration {
    until_balanced_within(map, live, what, 30).await
}

/// Users the [`sender`] writes to.
pub const USERS: usize = 12;

/// An acknowledged message: its recipients and its offset per shard.
pub struct Acked {
    pub to: Vec<String>,
    pub offsets: BTreeMap<u32, u64>,
}

/// Sends until `stop`, round-robin over the gateways of `ports` that answer; a message whose
/// gateway fails is resent with the same id through the next one (idempotent).
pub fn sender(
    ports: Arc<Mutex<Vec<u16>>>,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut i = 0usize;
        while !stop.load(Ordering::SeqCst) {
            let to: Vec<String> = (0..1 + i % 3)
                .map(|k| format!("u{}", (i * 7 + k * 5) % USERS))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let body =
                serde_json::json!({"id": format!("m{i}"), "to": to, "body": format!("b{i}")});
            let sender = format!("s{}", i % 4);
            let mut tries = 0;
            loop {
                let live = ports.lock().unwrap().clone();
                let port = live[(i + tries) % live.len()];
                let (status, resp) = http_post(
                    port,
                    &format!("/v1/messages?user={sender}"),
                    &body.to_string(),
                );
                if status == 200 {
                    let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
                    let offsets = v["offsets"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(s, o)| (s.parse().unwrap(), o.as_u64().unwrap()))
                        .collect();
                    acked.lock().unwrap().push(Acked { to, offsets });
                    break;
                }
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
                if tries > 500 {
                    panic!("message m{i} not acknowledged: {status} {resp}");
                }
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

/// `user`'s whole mailbox read through the gateway on `port` (page after page): its seqs, or
/// the status of a failed read.
fn read_mailbox(port: u16, user: &str) -> Result<Vec<u64>, (u16, String)> {
    let mut got = Vec::new();
    loop {
        let after = got.last().copied().unwrap_or(0);
        let (status, body) = http_get(
            port,
            &format!("/v1/mailbox?user={user}&after={after}&limit=1000"),
        );
        if status != 200 {
            return Err((status, body));
        }
        let page: serde_json::Value = serde_json::from_str(&body).unwrap();
        let entries = page["entries"].as_array().unwrap();
        got.extend(entries.iter().map(|e| e["seq"].as_u64().unwrap()));
        if entries.len() < 1000 {
            return Ok(got);
        }
    }
}

/// Every acknowledged message is in every recipient's mailbox exactly once, in log order
/// (read through the gateway on `port`), within 30 s. Returns the number of mailbox entries
/// checked.
pub async fn assert_delivered(map: &ShardMap, port: u16, acked: &[Acked]) -> usize {
    let mut want: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in acked {
        for u in &m.to {
            let s = map.route(u).shard;
            want.entry(u.clone()).or_default().push(m.offsets[&s]);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (u, seqs) in &want {
        let mut want_set: Vec<u64> = seqs.clone();
        want_set.sort_unstable();
        loop {
            let got = match read_mailbox(port, u) {
                Ok(got) => got,
                // a 5xx says "retry" (e.g. the first read on a connection to a restarted Redis)
                Err((status, _)) if status >= 500 && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err((status, body)) => panic!(
                    "{u}: mailbox read {status}: {body}\nthe log of the node on {port}:\n{}",
                    node_log_tail(port)
                ),
            };
            assert!(
                got.windows(2).all(|w| w[0] < w[1]),
                "{u}: not in order or repeated: {got:?}"
            );
            if got == want_set {
                break;
            }
            let missing: Vec<&u64> = want_set.iter().filter(|s| !got.contains(s)).collect();
            let extra: Vec<&u64> = got.iter().filter(|s| !want_set.contains(s)).collect();
            assert!(
                extra.is_empty(),
                "{u}: entries never acknowledged: {extra:?}"
            );
            assert!(
                Instant::now() < deadline,
                "{u}: acknowledged but not delivered: {missing:?}\nthe log of the node on {port}:\n{}",
                node_log_tail(port)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let entries = want.values().map(Vec::len).sum::<usize>();
    println!(
        "{} acknowledged messages, {entries} mailbox entries checked",
        acked.len(),
    );
    entries
}

/// The [`sender`] running over the gateways in `live`, until [`Traffic::finish`].
pub struct Traffic {
    live: Arc<Mutex<Vec<u16>>>,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    tx: std::thread::JoinHandle<()>,
}

impl Traffic {
    pub fn start(ports: Vec<u16>) -> Traffic {
        let live = Arc::new(Mutex::new(ports));
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let tx = sender(live.clone(), stop.clone(), acked.clone());
        Traffic {
            live,
            stop,
            acked,
            tx,
        }
    }

    /// Sends no more through `port` (its node is about to go).
    pub fn drop_port(&self, port: u16) {
        self.live.lock().unwrap().retain(|&p| p != port);
    }

    /// Sends through `port` too.
    pub fn add_port(&self, port: u16) {
        self.live.lock().unwrap().push(port);
    }

    /// Messages acknowledged so far.
    pub fn acked(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    /// Stops sending; then more than `at_least` messages were acknowledged and every one is
    /// delivered (read through the gateway on `port`). Returns (messages, mailbox entries).
    pub async fn finish(self, map: &ShardMap, port: u16, at_least: usize) -> (usize, usize) {
        self.stop.store(true, Ordering::SeqCst);
        self.tx.join().unwrap();
        let acked = std::mem::take(&mut *self.acked.lock().unwrap());
        assert!(
            acked.len() > at_least,
            "only {} messages acknowledged",
            acked.len()
        );
        let entries = assert_delivered(map, port, &acked).await;
        (acked.len(), entries)
    }
}

/// A file for the stderr of a node serving on `port` (created anew; under the system's temp
/// dir), so that a failed assertion can show what the node said ([`node_log_tail`]).
pub fn node_log(port: u16) -> std::fs::File {
    let dir = std::env::temp_dir().join("tidemark-test-nodes");
    std::fs::create_dir_all(&dir).expect("node log dir");
    std::fs::File::create(dir.join(format!("{port}.log"))).expect("node log file")
}

/// The last 40 lines of what the node on `port` logged to [`node_log`] (redis-rs' cluster client
/// lines left out), or a note that there is none (a node started without it).
pub fn node_log_tail(port: u16) -> String {
    let path = std::env::temp_dir()
        .join("tidemark-test-nodes")
        .join(format!("{port}.log"));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            // redis-rs' reconnect warnings during a failover run to hundreds of lines and
            // would push out the node's own (ADR-0059's cause was one line among them)
            let (noise, lines): (Vec<&str>, Vec<&str>) = text
                .lines()
                .partition(|l| l.contains("redis::cluster_handling"));
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            if noise.is_empty() {
                tail
            } else {
                format!(
                    "({} lines of redis-rs' cluster client left out)\n{tail}",
                    noise.len()
                )
            }
        }
        Err(e) => format!("({}: {e})", path.display()),
    }
}
