//! Shared by the store tests that run against a real redis-server.

#![allow(dead_code)]

use std::future::Future;
use std::ops::{Deref, DerefMut};

use redis::aio::ConnectionManager;
use tidemark_redis_proc::RedisProcess;

/// A fresh redis-server, a raw connection to it, and the stores a test connected to it
/// (reached through the deref: `e.core`, `e.v2`, …).
pub struct Env<S> {
    pub redis: RedisProcess,
    pub raw: ConnectionManager,
    stores: S,
}

/// Starts a redis-server (see scripts/install-redis.sh) and connects `stores(url)` to it.
pub async fn env<S, Fut>(stores: impl FnOnce(String) -> Fut) -> Env<S>
where
    Fut: Future<Output = S>,
{
    let redis = RedisProcess::start().expect("redis-server (scripts/install-redis.sh)");
    let client = redis::Client::open(redis.url()).unwrap();
    let raw = ConnectionManager::new(client).await.unwrap();
    let stores = stores(redis.url()).await;
    Env { redis, raw, stores }
}

impl<S> Deref for Env<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.stores
    }
}

impl<S> DerefMut for Env<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.stores
    }
}

/// `EVALSHA` calls the redis-server has served since the last `CONFIG RESETSTAT` (or its
/// start).
pub async fn evalsha_calls(raw: &mut ConnectionManager) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(raw)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .map(|r| r.split(',').next().unwrap().parse().unwrap())
        .unwrap_or(0)
}

/// `CONFIG RESETSTAT`: the command counts start again from zero.
pub async fn reset_stats(raw: &mut ConnectionManager) {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(raw)
        .await
        .unwrap();
}

/// `SCRIPT FLUSH`: the next `EVALSHA` of every script gets NOSCRIPT.
pub async fn script_flush(raw: &mut ConnectionManager) {
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(raw)
        .await
        .unwrap();
}

/// A 3+3 Redis Cluster with a short node timeout, or `None` (the test is skipped) when
/// redis-server or redis-cli is missing.
pub fn cluster() -> Option<tidemark_redis_proc::RedisCluster> {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return None;
    }
    Some(
        tidemark_redis_proc::RedisCluster::start(tidemark_redis_proc::ClusterOptions {
            node_timeout_ms: 1000,
            ..tidemark_redis_proc::ClusterOptions::default()
        })
        .expect("start a 3+3 Redis Cluster"),
    )
}

/// Sends signal `sig` (`STOP`, `CONT`, …) to process `pid`, with `kill`.
pub fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}
