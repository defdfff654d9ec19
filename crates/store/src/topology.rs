//! The deployment's topology, validated once into a [`ShardMap`]: the one place where a
//! recipient is routed to its shard, lane and Redis instances.
//!
//! A [`Topology`] is what the operator writes (or `tidemark up` generates): how many shards,
//! which layout is written, the core and mailbox pools and, optionally, the static
//! shard → instance tables (ADR-0014: instance counts are capacity parameters; shards are
//! assigned by a table in the config, never by a hash ring). [`Topology::validate`] checks it
//! once and returns a [`ShardMap`]; everything that routes, connects or iterates shards
//! receives the map, never the raw counts.
//!
//! ```toml
//! shards = 64
//! layout = "packed-v2"
//! core = ["redis://127.0.0.1:7001/"]
//! mailbox = ["redis://127.0.0.1:7002/", "redis://127.0.0.1:7003/"]
//! # optional explicit tables (one entry per shard: the instance index);
//! # default: contiguous ranges, shard s -> instance s * n / shards
//! # core_of_shard = [0, 0, …]
//! # mailbox_of_shard = [0, 1, …]
//! ```
//!
//! Routing ([`ShardMap::route`]): one stable 64-bit hash (xxh3) of the recipient id,
//!
//! ```text
//! h     = xxh3_64(utf8 bytes of the id)
//! shard = h % S                    (S = shards, 1..=65536)
//! lane  = (h >> 32) % 64           (LANES)
//! core, mailbox = the tables' entries for `shard`
//! ```
//!
//! The hash and both formulas are part of the stored data's meaning (mailbox keys and lane
//! watermarks depend on them): they never change for an existing deployment.

use std::sync::Arc;

use crate::redis::watermark::{Layout, LANES};
use serde::{Deserialize, Serialize};

/// Errors of configuration.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("config: cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// TOML syntax or types.
    #[error("config: {0}")]
    Parse(#[from] toml::de::Error),
    /// A semantic problem (empty pool, table of the wrong length, index out of range…).
    #[error("config: {0}")]
    Invalid(String),
}

/// A deployment's topology. Unknown keys in the file are errors (a misspelt table would
/// otherwise be silently ignored).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Number of shards S (fixed when the deployment is created).
    pub shards: u32,
    /// The watermark layout new writes use.
    #[serde(default = "default_layout")]
    pub layout: Layout,
    /// Core Redis instances (dispatch logs).
    pub core: Vec<String>,
    /// Mailbox Redis instances (watermarks and mailboxes).
    pub mailbox: Vec<String>,
    /// The core pool as one Redis Cluster, by its seed nodes (`redis://…` URLs or
    /// `HOST:PORT`), instead of `core` (ADR-0032). Validation turns it into the single core
    /// instance `cluster:<seeds>` ([`crate::endpoint`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_cluster: Option<Vec<String>>,
    /// The mailbox pool as one Redis Cluster (may be the same cluster as the core pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mailbox_cluster: Option<Vec<String>>,
    /// Explicit shard → core instance table.
    #[serde(default)]
    pub core_of_shard: Option<Vec<usize>>,
    /// Explicit shard → mailbox instance table.
    #[serde(default)]
    pub mailbox_of_shard: Option<Vec<usize>>,
    /// Static ownership (ADR-0015): shard → the node id that owns it. With it, `serve
    /// --node-id ID` owns exactly ID's shards and a replacement starts with the same id (it
    /// fences the old one by epoch); without it, nodes share the shards with leases
    /// (ADR-0030). Not part of the deployment's identity: owners may change between starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_of_shard: Option<Vec<String>>,
}

fn default_layout() -> Layout {
    Layout::PackedV2
}

fn range_table(shards: u32, n: usize) -> Vec<usize> {
    (0..shards as usize)
        .map(|s| s * n / shards as usize)
        .collect()
}

impl Topology {
    /// A topology with default (contiguous range) tables.
    pub fn new(shards: u32, layout: Layout, core: Vec<String>, mailbox: Vec<String>) -> Self {
        Topology {
            shards,
            layout,
            core,
            mailbox,
            core_cluster: None,
            mailbox_cluster: None,
            core_of_shard: None,
            mailbox_of_shard: None,
            owner_of_shard: None,
        }
    }

    /// One core and one mailbox instance holding every shard (`tidemark up`'s default, tools
    /// pointed at single instances, tests).
    pub fn single(shards: u32, layout: Layout, core: &str, mailbox: &str) -> Self {
        Topology::new(
            shards,
            layout,
            vec![core.to_string()],
            vec![mailbox.to_string()],
        )
    }

    /// Reads a TOML file (syntax and types; [`Topology::validate`] checks the rest).
    pub fn from_file(path: &std::path::Path) -> Result<Topology, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Ok(toml::from_str(&text)?)
    }

    /// Checks pools and tables and returns the map everything else routes with. A pool given
    /// as a cluster (`core_cluster`, `mailbox_cluster`) becomes one instance of that pool.
    pub fn validate(&self) -> Result<ShardMap, TopologyError> {
        let mut t = self.clone();
        for (name, cluster, pool) in [
            ("core", t.core_cluster.take(), &mut t.core),
            ("mailbox", t.mailbox_cluster.take(), &mut t.mailbox),
        ] {
            if let Some(seeds) = cluster {
                if !pool.is_empty() {
                    return Err(TopologyError::Invalid(format!(
                        "{name} and {name}_cluster are both given: a pool is either instances \
                         or one cluster"
                    )));
                }
                let seeds: Vec<String> = seeds
                    .iter()
                    .map(|s| crate::endpoint::seed_url(s.trim(), None))
                    .collect();
                if seeds.is_empty() {
                    return Err(TopologyError::Invalid(format!(
                        "{name}_cluster names no seed node"
                    )));
                }
                *pool = vec![crate::endpoint::cluster_endpoint(&seeds)];
            }
        }
        t.validated()
    }

    fn validated(self) -> Result<ShardMap, TopologyError> {
        if self.shards == 0 || self.shards > 65_536 {
            return Err(TopologyError::Invalid("shards must be 1..=65536".into()));
        }
        if self.core.is_empty() || self.mailbox.is_empty() {
            return Err(TopologyError::Invalid(
                "need at least one core and one mailbox instance".into(),
            ));
        }
        for (name, table, n) in [
            ("core_of_shard", &self.core_of_shard, self.core.len()),
            (
                "mailbox_of_shard",
                &self.mailbox_of_shard,
                self.mailbox.len(),
            ),
        ] {
            if let Some(t) = table {
                if t.len() != self.shards as usize {
                    return Err(TopologyError::Invalid(format!(
                        "{name} has {} entries, expected one per shard ({})",
                        t.len(),
                        self.shards
                    )));
                }
                if let Some(bad) = t.iter().find(|&&i| i >= n) {
                    return Err(TopologyError::Invalid(format!(
                        "{name} names instance {bad}, but only {n} are configured"
                    )));
                }
            }
        }
        if let Some(owners) = &self.owner_of_shard {
            if owners.len() != self.shards as usize {
                return Err(TopologyError::Invalid(format!(
                    "owner_of_shard has {} entries, expected one per shard ({})",
                    owners.len(),
                    self.shards
                )));
            }
            if let Some(bad) = owners
                .iter()
                .find(|id| crate::redis::lease::check_node_id(id).is_err())
            {
                return Err(TopologyError::Invalid(format!(
                    "owner_of_shard names {bad:?}: node ids are 1..=128 characters of \
                     A-Z a-z 0-9 - _ ."
                )));
            }
        }
        let core_of = self
            .core_of_shard
            .clone()
            .unwrap_or_else(|| range_table(self.shards, self.core.len()));
        let mailbox_of = self
            .mailbox_of_shard
            .clone()
            .unwrap_or_else(|| range_table(self.shards, self.mailbox.len()));
        Ok(ShardMap(Arc::new(Inner {
            topology: self,
            core_of,
            mailbox_of,
        })))
    }
}

/// Where a recipient's mailbox lives: everything [`ShardMap::route`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    /// Shard `0..S`.
    pub shard: u32,
    /// Lane `0..64` within the shard's watermark.
    pub lane: usize,
    /// Index of the shard's core instance (its dispatch log) in [`ShardMap::core_urls`].
    pub core: usize,
    /// Index of the shard's mailbox instance in [`ShardMap::mailbox_urls`].
    pub mailbox: usize,
}

/// A validated topology: routing and the shard → instance tables, computed once. Cheap to
/// clone (shared); built only by [`Topology::validate`], so holding one means the tables are
/// consistent with the pools.
#[derive(Debug, Clone)]
pub struct ShardMap(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    topology: Topology,
    core_of: Vec<usize>,
    mailbox_of: Vec<usize>,
}

impl ShardMap {
    /// Routes recipient (or sender) `user`: the only place routing is computed.
    pub fn route(&self, user: &str) -> Route {
        let h = xxhash_rust::xxh3::xxh3_64(user.as_bytes());
        let shard = (h % u64::from(self.0.topology.shards)) as u32;
        Route {
            shard,
            lane: ((h >> 32) % LANES as u64) as usize,
            core: self.0.core_of[shard as usize],
            mailbox: self.0.mailbox_of[shard as usize],
        }
    }

    /// Number of shards S.
    pub fn shards(&self) -> u32 {
        self.0.topology.shards
    }

    /// Every shard, `0..S`.
    pub fn all_shards(&self) -> std::ops::Range<u32> {
        0..self.shards()
    }

    /// The layout new writes use.
    pub fn layout(&self) -> Layout {
        self.0.topology.layout
    }

    /// Core instance URLs (index = instance).
    pub fn core_urls(&self) -> &[String] {
        &self.0.topology.core
    }

    /// Mailbox instance URLs (index = instance).
    pub fn mailbox_urls(&self) -> &[String] {
        &self.0.topology.mailbox
    }

    /// The core instance index of `shard`.
    pub fn core_of(&self, shard: u32) -> usize {
        self.0.core_of[shard as usize]
    }

    /// The mailbox instance index of `shard`.
    pub fn mailbox_of(&self, shard: u32) -> usize {
        self.0.mailbox_of[shard as usize]
    }

    /// The core instance index of every shard (index = shard).
    pub fn core_table(&self) -> &[usize] {
        &self.0.core_of
    }

    /// The mailbox instance index of every shard (index = shard).
    pub fn mailbox_table(&self) -> &[usize] {
        &self.0.mailbox_of
    }

    /// The shards whose log is on core instance `index`, ascending.
    pub fn shards_on_core(&self, index: usize) -> Vec<u32> {
        self.all_shards()
            .filter(|&s| self.core_of(s) == index)
            .collect()
    }

    /// The shards whose watermark and mailboxes are on mailbox instance `index`, ascending.
    pub fn shards_on_mailbox(&self, index: usize) -> Vec<u32> {
        self.all_shards()
            .filter(|&s| self.mailbox_of(s) == index)
            .collect()
    }

    /// `shard` if it exists, else an error naming the deployment's range.
    pub fn check_shard(&self, shard: u32) -> Result<u32, TopologyError> {
        if shard < self.shards() {
            Ok(shard)
        } else {
            Err(TopologyError::Invalid(format!(
                "shard {shard} does not exist: the deployment has {} shards (0..={})",
                self.shards(),
                self.shards() - 1
            )))
        }
    }

    /// The static owner table, if the topology has one (see [`Topology::owner_of_shard`]).
    pub fn owner_table(&self) -> Option<&[String]> {
        self.0.topology.owner_of_shard.as_deref()
    }

    /// The shards the owner table gives to `node` (empty without a table or for an unknown
    /// node).
    pub fn shards_of_node(&self, node: &str) -> Vec<u32> {
        match self.owner_table() {
            Some(t) => self
                .all_shards()
                .filter(|&s| t[s as usize] == node)
                .collect(),
            None => Vec::new(),
        }
    }

    /// The topology this map was validated from (to write it back as TOML).
    pub fn topology(&self) -> &Topology {
        &self.0.topology
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/examples/tidemark.toml` is a valid file (every key known, tables consistent).
    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../../docs/examples/tidemark.toml");
        let t: Topology = toml::from_str(text).unwrap();
        let map = t.validate().unwrap();
        assert_eq!(map.shards(), 8);
        assert_eq!(map.mailbox_table(), &[0, 0, 0, 0, 1, 1, 1, 1]);
        // and every field of Topology appears in it
        for key in [
            "shards",
            "layout",
            "core",
            "mailbox",
            "core_of_shard",
            "mailbox_of_shard",
            "owner_of_shard",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{key} ="))),
                "{key} missing from the example"
            );
        }
    }

    #[test]
    fn parses_and_defaults_tables() {
        let t: Topology = toml::from_str(
            r#"shards = 4
core = ["redis://a/"]
mailbox = ["redis://b/", "redis://c/"]"#,
        )
        .unwrap();
        let map = t.validate().unwrap();
        assert_eq!(t.layout, Layout::PackedV2);
        assert_eq!(map.mailbox_table(), &[0, 0, 1, 1]);
        assert_eq!(map.core_table(), &[0, 0, 0, 0]);
        assert_eq!(map.shards_on_mailbox(1), vec![2, 3]);
        let bad = Topology {
            mailbox_of_shard: Some(vec![0, 5, 0, 0]),
            ..t
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn routes_are_stable_in_range_and_follow_the_tables() {
        let t = Topology::new(
            7,
            Layout::PackedV2,
            vec!["redis://c/".into()],
            vec!["redis://a/".into(), "redis://b/".into()],
        );
        let map = t.validate().unwrap();
        // the hash is part of the stored data's meaning: pin one value
        let h = xxhash_rust::xxh3::xxh3_64(b"alice");
        let a = map.route("alice");
        assert_eq!(u64::from(a.shard), h % 7);
        assert_eq!(a.lane as u64, (h >> 32) % 64);
        assert_eq!(a, map.route("alice"));
        for i in 0..1000 {
            let r = map.route(&format!("u{i}"));
            assert!(r.shard < 7 && r.lane < 64);
            assert_eq!(r.core, 0);
            assert_eq!(r.mailbox, map.mailbox_of(r.shard));
        }
        assert!(map.check_shard(6).is_ok());
        assert!(map.check_shard(7).is_err());
    }
}
