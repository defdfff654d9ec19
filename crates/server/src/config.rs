//! Deployment topology: how many shards, which layout is written, and the static
//! shard → instance tables (ADR-0014: instance counts are capacity parameters; shards are
//! assigned by a table in the config, never by a hash ring).
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

use serde::{Deserialize, Serialize};
use tidemark_store::redis::watermark::Layout;

/// Errors of configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
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
    /// Explicit shard → core instance table.
    #[serde(default)]
    pub core_of_shard: Option<Vec<usize>>,
    /// Explicit shard → mailbox instance table.
    #[serde(default)]
    pub mailbox_of_shard: Option<Vec<usize>>,
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
            core_of_shard: None,
            mailbox_of_shard: None,
        }
    }

    /// Reads and validates a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Topology, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let t: Topology = toml::from_str(&text)?;
        t.validate()?;
        Ok(t)
    }

    /// Checks pools and tables.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.shards == 0 || self.shards > 65_536 {
            return Err(ConfigError::Invalid("shards must be 1..=65536".into()));
        }
        if self.core.is_empty() || self.mailbox.is_empty() {
            return Err(ConfigError::Invalid(
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
                    return Err(ConfigError::Invalid(format!(
                        "{name} has {} entries, expected one per shard ({})",
                        t.len(),
                        self.shards
                    )));
                }
                if let Some(bad) = t.iter().find(|&&i| i >= n) {
                    return Err(ConfigError::Invalid(format!(
                        "{name} names instance {bad}, but only {n} are configured"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The core instance index of every shard.
    pub fn core_table(&self) -> Vec<usize> {
        self.core_of_shard
            .clone()
            .unwrap_or_else(|| range_table(self.shards, self.core.len()))
    }

    /// The mailbox instance index of every shard.
    pub fn mailbox_table(&self) -> Vec<usize> {
        self.mailbox_of_shard
            .clone()
            .unwrap_or_else(|| range_table(self.shards, self.mailbox.len()))
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
        t.validate().unwrap();
        assert_eq!(t.shards, 8);
        assert_eq!(t.mailbox_table(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
        // and every field of Topology appears in it
        for key in [
            "shards",
            "layout",
            "core",
            "mailbox",
            "core_of_shard",
            "mailbox_of_shard",
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
        t.validate().unwrap();
        assert_eq!(t.layout, Layout::PackedV2);
        assert_eq!(t.mailbox_table(), vec![0, 0, 1, 1]);
        assert_eq!(t.core_table(), vec![0, 0, 0, 0]);
        let bad = Topology {
            mailbox_of_shard: Some(vec![0, 5, 0, 0]),
            ..t
        };
        assert!(bad.validate().is_err());
    }
}
