//! Flag groups shared by several commands (flattened into each with `#[command(flatten)]`),
//! so a flag means the same and reads the same wherever it appears.

use clap::Args;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{Topology, TopologyError};

/// The Redis instances of a running deployment: URL lists and a shard count, or a TOML file.
#[derive(Args)]
pub struct InstancesArgs {
    /// Core Redis URLs (comma-separated; else --config).
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    pub core: Vec<String>,
    /// Mailbox Redis URLs (comma-separated; else --config).
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    pub mailbox: Vec<String>,
    /// Shards of the deployment.
    #[arg(long, required_unless_present = "config")]
    pub shards: Option<u32>,
    /// TOML deployment file (shards, layout, instances, static shard tables).
    #[arg(long, conflicts_with_all = ["core", "mailbox", "shards"])]
    pub config: Option<std::path::PathBuf>,
}

impl InstancesArgs {
    /// The topology: the file's, or the URL lists with default tables and `layout`.
    pub fn topology(&self, layout: Layout) -> Result<Topology, TopologyError> {
        match &self.config {
            Some(path) => Topology::from_file(path),
            None => Ok(Topology::new(
                self.shards.expect("clap requires --shards"),
                layout,
                self.core.clone(),
                self.mailbox.clone(),
            )),
        }
    }
}

/// The size of a local deployment (`up`, `bench load` without --target).
#[derive(Args, Clone)]
pub struct LocalSizeArgs {
    /// Local deployment: mailbox Redis instances.
    #[arg(long, default_value_t = 1)]
    pub mailbox: usize,
    /// Local deployment: core Redis instances.
    #[arg(long, default_value_t = 1)]
    pub core: usize,
    /// Local deployment: shards (fixed for a data dir).
    #[arg(long, default_value_t = 64)]
    pub shards: u32,
}
