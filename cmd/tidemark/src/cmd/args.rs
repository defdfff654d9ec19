//! Flag groups shared by several commands (flattened into each with `#[command(flatten)]`),
//! so a flag means the same and reads the same wherever it appears.

use clap::Args;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{Topology, TopologyError};

/// The Redis instances of a running deployment: URL lists (or a Redis Cluster per pool) and a
/// shard count, or a TOML file.
#[derive(Args)]
pub struct InstancesArgs {
    /// Core Redis URLs (comma-separated; else --core-cluster or --config).
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["config", "core_cluster"])]
    pub core: Vec<String>,
    /// Mailbox Redis URLs (comma-separated; else --mailbox-cluster or --config).
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["config", "mailbox_cluster"])]
    pub mailbox: Vec<String>,
    /// The core pool is a Redis Cluster: seed nodes, HOST:PORT or redis:// URLs
    /// (comma-separated). A HOST:PORT takes its password from --redis-password.
    #[arg(long, value_delimiter = ',', conflicts_with = "core")]
    pub core_cluster: Vec<String>,
    /// The mailbox pool is a Redis Cluster (may be the core's): seed nodes, as --core-cluster.
    #[arg(long, value_delimiter = ',', conflicts_with = "mailbox")]
    pub mailbox_cluster: Vec<String>,
    /// Password for --core-cluster/--mailbox-cluster seeds given as HOST:PORT.
    #[arg(long, env = "TIDEMARK_REDIS_PASSWORD", hide_env_values = true)]
    pub redis_password: Option<String>,
    /// Shards of the deployment.
    #[arg(long, required_unless_present = "config")]
    pub shards: Option<u32>,
    /// TOML deployment file (shards, layout, instances or clusters, static shard tables).
    #[arg(long, conflicts_with_all = ["core", "mailbox", "shards", "core_cluster", "mailbox_cluster"])]
    pub config: Option<std::path::PathBuf>,
}

impl InstancesArgs {
    /// The topology: the file's, or the URL lists with default tables and `layout`.
    pub fn topology(&self, layout: Layout) -> Result<Topology, TopologyError> {
        match &self.config {
            Some(path) => Topology::from_file(path),
            None => {
                let mut t = Topology::new(
                    self.shards.expect("clap requires --shards"),
                    layout,
                    self.core.clone(),
                    self.mailbox.clone(),
                );
                let pw = self.redis_password.as_deref();
                let seeds = |items: &[String]| -> Option<Vec<String>> {
                    (!items.is_empty()).then(|| {
                        items
                            .iter()
                            .map(|i| tidemark_store::endpoint::seed_url(i, pw))
                            .collect()
                    })
                };
                t.core_cluster = seeds(&self.core_cluster);
                t.mailbox_cluster = seeds(&self.mailbox_cluster);
                Ok(t)
            }
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

/// Where the report of an engine benchmark (`bench catchup`, `bench commit`) goes.
#[derive(Args)]
pub struct EngineReportArgs {
    /// A label kept in the JSON report.
    #[arg(long)]
    pub label: Option<String>,
    /// Write the JSON report (`{"runs":[…]}`) here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// With --json: add the run to the file's runs instead of replacing the file.
    #[arg(long, requires = "json")]
    pub append: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl EngineReportArgs {
    /// Writes `report` to `--json` (added to its runs with `--append`), if given.
    pub fn write<T: serde::Serialize>(&self, report: &T) -> anyhow::Result<()> {
        if let Some(path) = &self.json {
            tidemark_bench::engine::write_runs(path, report, self.append)?;
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }
}
