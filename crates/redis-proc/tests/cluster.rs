//! The local Redis Cluster harness against real redis-server processes: start with a password,
//! slots, failover after `kill -9`, resharding (redis-cli and slot by slot under traffic),
//! restart from a base directory, and no server left behind. Timings are printed
//! (`cargo test -p tidemark-redis-proc --test cluster -- --nocapture`).

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tidemark_redis_proc::resp::{Conn, Value};
use tidemark_redis_proc::{
    key_slot, redis_cli_available, redis_server_available, ClusterOptions, RedisCluster, Role,
};

const PASS: &str = "cluster-test_pass.0123456789";

/// `None` (with a notice on stderr) when redis-server or redis-cli is missing;
/// scripts/install-redis.sh (run by scripts/test.sh, hence CI) installs both.
fn start(test: &str, opts: ClusterOptions) -> Option<RedisCluster> {
    if !redis_server_available() || !redis_cli_available() {
        eprintln!(
            "SKIPPED {test}: needs redis-server and redis-cli on PATH (scripts/install-redis.sh)"
        );
        return None;
    }
    let t = Instant::now();
    let n = opts.node_count();
    let c = RedisCluster::start(opts).expect("cluster starts");
    eprintln!(
        "timing {test}: {n}-node cluster {} in {:?}",
        if c.reused_existing() {
            "restarted"
        } else {
            "created"
        },
        t.elapsed()
    );
    Some(c)
}

fn bulk(v: &str) -> Value {
    Value::Bulk(v.as_bytes().to_vec())
}

fn gone(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn password_cluster_serves_keys_on_the_owner_of_their_slot() {
    let Some(c) = start(
        "password_cluster",
        ClusterOptions {
            requirepass: Some(PASS.into()),
            node_timeout_ms: 2000,
            ..Default::default()
        },
    ) else {
        return;
    };
    // 3 primaries, each with one replica (whose sync finished: start waited for it)
    let primaries = c.primaries();
    assert_eq!(primaries.len(), 3, "{:?}", c.nodes());
    assert_eq!(c.replicas().len(), 3);
    for &p in &primaries {
        assert_eq!(
            c.replicas_of(p).len(),
            1,
            "replicas of {p}: {:?}",
            c.nodes()
        );
        assert!(!c.slots_of(p).is_empty());
    }
    let total: usize = primaries.iter().map(|&p| c.slots_of(p).len()).sum();
    assert_eq!(total, 16384);
    for n in c.nodes() {
        assert_eq!(
            n.url,
            format!("redis://:{PASS}@127.0.0.1:{}/", n.port),
            "{n:?}"
        );
        assert!(n.port < 55536);
        assert_ne!(n.role, Role::Down);
        // the password is on no command line
        let pid = c.process(n.index).pid().unwrap();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains(PASS));
    }
    assert_eq!(c.seeds().len(), 6);
    assert!(c.display_seeds().iter().all(|s| !s.contains(PASS)));
    // no password, no service
    let mut anon = Conn::connect(c.addr(0), None, Duration::from_secs(2)).unwrap();
    assert!(
        matches!(anon.call(&["GET", "x"]).unwrap(), Value::Error(e) if e.starts_with("NOAUTH"))
    );
    assert!(Conn::connect(c.addr(0), Some("wrong"), Duration::from_secs(2)).is_err());

    // key_slot agrees with CLUSTER KEYSLOT
    let mut keys: Vec<Vec<u8>> = [
        "wm:{7}",
        "dlog:{12}",
        "wm:{7}:extra",
        "mbx:42",
        "{user1000}.following",
        "foo{}{bar}",
        "foo{{bar}}zap",
        "foo{bar}{zap}",
        "{",
        "}{x}",
        "123456789",
        "",
    ]
    .iter()
    .map(|k| k.as_bytes().to_vec())
    .collect();
    keys.push(vec![0xff, 0x00, b'{', 0x01, 0x80, b'}', 0x7f]);
    keys.extend((0..40).map(|i| format!("k{i}").into_bytes()));
    let mut conn = c.conn(0).unwrap();
    for k in &keys {
        let got = conn.call(&[&b"CLUSTER"[..], b"KEYSLOT", k]).unwrap();
        assert_eq!(got, Value::Int(key_slot(k) as i64), "key {k:?}");
    }

    // SET/GET on the owner; other primaries redirect to it
    for k in ["wm:{7}", "dlog:{12}", "mbx:42"] {
        let owner = c.primary_of_slot(key_slot(k.as_bytes())).unwrap();
        assert!(c.call(owner, &["SET", k, "v1"]).unwrap().is_ok());
        assert_eq!(c.call(owner, &["GET", k]).unwrap(), bulk("v1"));
        let other = primaries.iter().copied().find(|&p| p != owner).unwrap();
        assert_eq!(
            c.call(other, &["GET", k]).unwrap(),
            Value::Error(format!(
                "MOVED {} 127.0.0.1:{}",
                key_slot(k.as_bytes()),
                c.port(owner)
            ))
        );
        assert_eq!(c.call_routed(&["GET", k]).unwrap(), bulk("v1"));
        // redis-cli -c follows the redirect (password from the environment)
        let out = Command::new("redis-cli")
            .env("REDISCLI_AUTH", PASS)
            .args(["-c", "-p", &c.port(other).to_string(), "SET", k, "v2"])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK", "{out:?}");
        assert_eq!(c.call(owner, &["GET", k]).unwrap(), bulk("v2"));
    }

    // dropping kills and reaps every node and removes the temporary directory
    let pids: Vec<u32> = (0..c.node_count())
        .map(|i| c.process(i).pid().unwrap())
        .collect();
    let base = c.base_dir().to_path_buf();
    drop(c);
    for pid in pids {
        assert!(gone(pid), "redis-server {pid} survived the drop");
    }
    assert!(!base.exists());
}

#[test]
fn kill9_of_a_primary_fails_over_and_keeps_acknowledged_writes() {
    let Some(mut c) = start(
        "failover",
        ClusterOptions {
            requirepass: Some(PASS.into()),
            node_timeout_ms: 1000,
            ..Default::default()
        },
    ) else {
        return;
    };
    let slot = key_slot(b"wm:{7}");
    let old = c.primary_of_slot(slot).unwrap();
    let replicas = c.replicas_of(old);
    assert_eq!(replicas.len(), 1);
    let mut conn = c.conn(old).unwrap();
    for i in 0..200 {
        let k = format!("wm:{{7}}:{i}");
        assert!(conn.call(&["SET", &k, &i.to_string()]).unwrap().is_ok());
    }
    // acknowledged by the replica before the primary dies
    assert_eq!(conn.call(&["WAIT", "1", "1000"]).unwrap(), Value::Int(1));
    drop(conn);

    let t = Instant::now();
    c.kill9(old).unwrap();
    assert_eq!(c.role(old), Role::Down);
    let new = c.wait_failover(old).unwrap();
    eprintln!(
        "timing failover: kill -9 of a primary to a consistent cluster (node timeout 1000 ms) in {:?}",
        t.elapsed()
    );
    assert_eq!(new, replicas[0]);
    assert_eq!(c.role(new), Role::Primary);
    assert_eq!(c.primary_of_slot(slot), Some(new));
    assert_eq!(c.primaries().len(), 3);
    for i in 0..200 {
        let k = format!("wm:{{7}}:{i}");
        assert_eq!(
            c.call(new, &["GET", &k]).unwrap(),
            bulk(&i.to_string()),
            "{k}"
        );
    }
    assert_eq!(c.call_routed(&["GET", "wm:{7}:199"]).unwrap(), bulk("199"));

    // the old primary comes back as a replica of its replacement, and syncs
    let t = Instant::now();
    c.restart(old).unwrap();
    eprintln!(
        "timing failover: old primary rejoined as a replica in {:?}",
        t.elapsed()
    );
    assert_eq!(c.role(old), Role::Replica { primary: Some(new) });
    assert_eq!(c.replicas_of(new), vec![old]);
    assert!(c.call(new, &["SET", "wm:{7}:after", "x"]).unwrap().is_ok());
    assert_eq!(c.call(new, &["WAIT", "1", "1000"]).unwrap(), Value::Int(1));
    assert!(c.wait_failover(old).is_err(), "node {old} runs again");
}

/// One key per slot, for the first `n` slots of `slots` that some `k:{i}` maps to.
fn keys_for_slots(slots: &[u16], n: usize) -> Vec<(String, u16)> {
    let wanted: std::collections::HashSet<u16> = slots.iter().copied().collect();
    let mut found: HashMap<u16, String> = HashMap::new();
    for i in 0..200_000u32 {
        let k = format!("k:{{{i}}}");
        let s = key_slot(k.as_bytes());
        if wanted.contains(&s) {
            found.entry(s).or_insert(k);
        }
    }
    let mut out: Vec<(String, u16)> = slots
        .iter()
        .filter_map(|s| Some((found.get(s)?.clone(), *s)))
        .collect();
    out.truncate(n);
    out
}

#[test]
fn reshard_and_move_slot_carry_their_keys() {
    let Some(c) = start(
        "reshard",
        ClusterOptions {
            replicas_per_primary: 0,
            requirepass: Some(PASS.into()),
            node_timeout_ms: 2000,
            ..Default::default()
        },
    ) else {
        return;
    };
    let a = c.primary_of_slot(0).unwrap();
    let primaries = c.primaries();
    let b = primaries.iter().copied().find(|&p| p != a).unwrap();
    // a key in each of a's first 400 slots (redis-cli takes a source's slots in order)
    let a_slots = c.slots_of(a);
    let keys = keys_for_slots(&a_slots, 400);
    assert!(keys.len() > 350, "{}", keys.len());
    let mut conn = c.conn(a).unwrap();
    for (k, _) in &keys {
        assert!(conn.call(&["SET", k, k]).unwrap().is_ok());
    }
    drop(conn);

    let t = Instant::now();
    let moved = c.reshard(a, b, 200).unwrap();
    eprintln!(
        "timing reshard: 200 slots ({} keys) with redis-cli in {:?}",
        keys.iter().filter(|(_, s)| moved.contains(s)).count(),
        t.elapsed()
    );
    assert_eq!(moved.len(), 200);
    let mut on_b = 0;
    for (k, s) in &keys {
        let owner = if moved.contains(s) { b } else { a };
        assert_eq!(c.primary_of_slot(*s), Some(owner), "slot {s}");
        assert_eq!(c.call(owner, &["GET", k]).unwrap(), bulk(k), "{k}");
        if owner == b {
            on_b += 1;
            assert!(
                matches!(c.call(a, &["GET", k]).unwrap(), Value::Error(e) if e.starts_with("MOVED"))
            );
        }
    }
    assert!(on_b > 150, "only {on_b} keys moved");
    assert_eq!(c.slots_of(a).len() + 200, a_slots.len());

    // one slot, while a client writes keys of that slot
    let slot = key_slot(b"wm:{7}");
    let from = c.primary_of_slot(slot).unwrap();
    let to = primaries.iter().copied().find(|&p| p != from).unwrap();
    let mut conn = c.conn(from).unwrap();
    for i in 0..1000 {
        let k = format!("wm:{{7}}:{i}");
        assert!(conn.call(&["SET", &k, &i.to_string()]).unwrap().is_ok());
    }
    drop(conn);
    let stop = AtomicBool::new(false);
    let acked = Mutex::new(Vec::<String>::new());
    let failures = Mutex::new(Vec::<String>::new());
    let t = Instant::now();
    let moved_keys = std::thread::scope(|s| {
        s.spawn(|| {
            let mut j = 0;
            while !stop.load(Ordering::Relaxed) {
                let k = format!("wm:{{7}}:w{j}");
                match c.call_routed(&["SET", &k, &k]) {
                    Ok(v) if v.is_ok() => acked.lock().unwrap().push(k.clone()),
                    other => failures.lock().unwrap().push(format!("SET {k}: {other:?}")),
                }
                // an older key, wherever it is now
                let old = format!("wm:{{7}}:{}", j % 1000);
                match c.call_routed(&["GET", &old]) {
                    Ok(v) if v == bulk(&(j % 1000).to_string()) => {}
                    other => failures
                        .lock()
                        .unwrap()
                        .push(format!("GET {old}: {other:?}")),
                }
                j += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(100));
        let r = c.move_slot(slot, to);
        stop.store(true, Ordering::Relaxed);
        r
    })
    .unwrap();
    let acked = acked.into_inner().unwrap();
    let failures = failures.into_inner().unwrap();
    eprintln!(
        "timing move_slot: 1 slot ({moved_keys} keys) under traffic ({} writes) in {:?}",
        acked.len(),
        t.elapsed()
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert!(!acked.is_empty());
    assert!(moved_keys >= 1000, "{moved_keys}");
    assert_eq!(c.primary_of_slot(slot), Some(to));
    assert_eq!(
        c.call(to, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .unwrap(),
        Value::Int(1000 + acked.len() as i64)
    );
    for k in &acked {
        assert_eq!(c.call(to, &["GET", k]).unwrap(), bulk(k));
    }
    assert_eq!(c.call(to, &["GET", "wm:{7}:999"]).unwrap(), bulk("999"));
    assert_eq!(c.move_slot(slot, to).unwrap(), 0, "already there");
}

#[test]
fn restart_from_base_dir_reuses_ports_ids_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ClusterOptions {
        base_dir: Some(dir.path().join("cluster")),
        requirepass: Some(PASS.into()),
        appendonly: true,
        appendfsync: "always".into(),
        node_timeout_ms: 2000,
        ..Default::default()
    };
    let Some(c) = start("restart_from_base_dir", opts.clone()) else {
        return;
    };
    assert!(!c.reused_existing());
    let ports: Vec<u16> = (0..c.node_count()).map(|i| c.port(i)).collect();
    let ids: Vec<String> = (0..c.node_count())
        .map(|i| c.node_id(i).to_string())
        .collect();
    for k in ["wm:{7}", "dlog:{12}", "mbx:1"] {
        let owner = c.primary_of_slot(key_slot(k.as_bytes())).unwrap();
        assert!(c.call(owner, &["SET", k, k]).unwrap().is_ok());
    }
    let addrs: Vec<_> = (0..c.node_count()).map(|i| c.addr(i)).collect();
    drop(c);
    for a in &addrs {
        assert!(Conn::connect(*a, Some(PASS), Duration::from_millis(200)).is_err());
    }

    let c = start("restart_from_base_dir", opts.clone()).unwrap();
    assert!(c.reused_existing());
    assert_eq!(
        (0..c.node_count()).map(|i| c.port(i)).collect::<Vec<_>>(),
        ports
    );
    assert_eq!(
        (0..c.node_count())
            .map(|i| c.node_id(i).to_string())
            .collect::<Vec<_>>(),
        ids
    );
    assert_eq!(c.primaries().len(), 3);
    assert_eq!(c.replicas().len(), 3);
    for k in ["wm:{7}", "dlog:{12}", "mbx:1"] {
        assert_eq!(c.call_routed(&["GET", k]).unwrap(), bulk(k), "{k}");
    }
    // another size, or other ports, for the same directory: refused before anything starts
    for other in [
        ClusterOptions {
            primaries: 4,
            ..opts.clone()
        },
        ClusterOptions {
            ports: Some(vec![21001, 21002, 21003, 21004, 21005, 21006]),
            ..opts.clone()
        },
    ] {
        assert_eq!(
            RedisCluster::start(other).err().unwrap().code(),
            "bad_cluster_options"
        );
    }
}

#[test]
fn a_panicking_test_leaves_no_server_behind_even_a_paused_one() {
    if !redis_server_available() || !redis_cli_available() {
        eprintln!("SKIPPED no_server_behind: needs redis-server and redis-cli on PATH");
        return;
    }
    let pids = Mutex::new(Vec::new());
    let r = std::panic::catch_unwind(|| {
        let mut c = RedisCluster::start(ClusterOptions {
            replicas_per_primary: 0,
            ..Default::default()
        })
        .unwrap();
        *pids.lock().unwrap() = (0..c.node_count())
            .map(|i| c.process(i).pid().unwrap())
            .collect();
        c.pause(1).unwrap();
        assert_eq!(c.role(1), Role::Down);
        c.resume(1).unwrap();
        c.wait_consistent().unwrap();
        c.pause(2).unwrap();
        panic!("a test fails with a paused node");
    });
    assert!(r.is_err());
    let pids = pids.into_inner().unwrap();
    assert_eq!(pids.len(), 3);
    for pid in pids {
        assert!(gone(pid), "redis-server {pid} survived the panic");
    }
}
