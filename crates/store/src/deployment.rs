//! The deployment's identity, kept in every Redis instance it uses, so that a process started
//! with another shard count or other instance tables is refused before it writes anything.
//!
//! ```text
//! tidemark:deployment   hash, one per instance (core and mailbox), written once
//!   version   "1" | "2" | "3"    2: created by code that claims every message id, so that a
//!                                one-shard send's claim may be its only dedupe record
//!                                (ADR-0040); code that knows only "1" refuses "2".
//!                                3: also created by code that reads packed log records,
//!                                which are then written (ADR-0055); older code refuses it
//!   shards    decimal u32        S, fixed when the deployment is created
//!   role      "core" | "mailbox" which pool this instance belongs to
//!   index     decimal            its position in that pool
//!   holds     ranges "a-b,c,…"   the shards whose keys live on this instance (sorted)
//!   tables    16 hex digits      xxh3-64 of both shard → instance tables (every instance of
//!                                a deployment has the same value)
//! ```
//!
//! Invariants: written only when absent (a Lua step: `HSET` if `EXISTS` is 0); the only
//! rewrite is `tidemark upgrade`'s raise of `version` from 2 to 3 (ADR-0056: a
//! compare-and-set, [`raise_version_at`]), never lowered; a process compares all fields but
//! `holds` (which follows from them) with what its topology says, and refuses any difference. Before the first write on an
//! instance that already holds watermarks (a deployment created before identities existed)
//! those are checked against `holds`: a `wm:{s}` this instance should not have is refused too.
//!
//! The watermark layout is not part of the identity: it is recorded per shard in `wm:{s}`
//! itself and checked there (old code refuses newer data, ADR-0015).

use std::collections::BTreeMap;

use redis::aio::ConnectionLike;

use crate::error::{Error, Result};

/// The key of the identity hash on a single instance.
pub const KEY: &str = "tidemark:deployment";

/// The key of the identity hash of pool `role` at `url`: [`KEY`] on a single instance;
/// `tidemark:deployment:core` / `…:mailbox` on a Redis Cluster, which is one instance of its
/// pool and may be both pools' (ADR-0032).
pub fn key(url: &str, role: Role) -> String {
    if crate::endpoint::is_cluster(url) {
        format!("{KEY}:{}", role.as_str())
    } else {
        KEY.to_string()
    }
}
/// The identity version new deployments are created with: one-key claims (ADR-0040) and
/// packed log records (ADR-0055).
pub const VERSION_CURRENT: u32 = 3;
/// The versions this code reads: 1 (before ADR-0040), 2 (before ADR-0055) and 3.
const VERSIONS: [u32; 3] = [1, 2, 3];
/// The one version `tidemark upgrade` raises, to [`VERSION_CURRENT`] (ADR-0056). Version 3
/// only allows packed log records, which every process that reads version 3 reads; version 1
/// cannot become 2 by a flag: its logs may hold dedupe records without a claim (ADR-0040).
pub const VERSION_UPGRADABLE: u32 = 2;

/// Which pool an instance belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Commit side: dispatch logs.
    Core,
    /// Materialize side: watermarks and mailboxes.
    Mailbox,
}

impl Role {
    /// `core` or `mailbox`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Core => "core",
            Role::Mailbox => "mailbox",
        }
    }
}

/// What one instance records about the deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The identity's version: [`VERSION_CURRENT`] for a deployment this code creates; an
    /// older one keeps its own (it says which records may exist in it, ADR-0040).
    pub version: u32,
    /// Shard count S.
    pub shards: u32,
    /// The pool of this instance.
    pub role: Role,
    /// Its position in the pool.
    pub index: usize,
    /// Shards whose keys live on this instance, sorted.
    pub holds: Vec<u32>,
    /// Fingerprint of both tables.
    pub tables: String,
}

/// Fingerprint of the shard → instance tables of both pools.
pub fn tables_fingerprint(core_table: &[usize], mailbox_table: &[usize]) -> String {
    let mut bytes = Vec::with_capacity((core_table.len() + mailbox_table.len()) * 4 + 2);
    for t in [core_table, mailbox_table] {
        for &i in t {
            bytes.extend_from_slice(&(i as u32).to_be_bytes());
        }
        bytes.push(b'|');
    }
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// `[0,1,2,5,7,8]` → `"0-2,5,7-8"`.
pub fn format_ranges(shards: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < shards.len() {
        let start = shards[i];
        let mut end = start;
        while i + 1 < shards.len() && shards[i + 1] == end + 1 {
            i += 1;
            end = shards[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// The inverse of [`format_ranges`]; `None` when malformed.
pub fn parse_ranges(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    if s.is_empty() {
        return Some(out);
    }
    for part in s.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

impl Identity {
    fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("version", self.version.to_string()),
            ("shards", self.shards.to_string()),
            ("role", self.role.as_str().to_string()),
            ("index", self.index.to_string()),
            ("holds", format_ranges(&self.holds)),
            ("tables", self.tables.clone()),
        ]
    }

    fn from_fields(m: &BTreeMap<String, String>) -> Option<Identity> {
        let version: u32 = m.get("version")?.parse().ok()?;
        if !VERSIONS.contains(&version) || m.get("version")? != &version.to_string() {
            return None;
        }
        Some(Identity {
            version,
            shards: m.get("shards")?.parse().ok()?,
            role: match m.get("role")?.as_str() {
                "core" => Role::Core,
                "mailbox" => Role::Mailbox,
                _ => return None,
            },
            index: m.get("index")?.parse().ok()?,
            holds: parse_ranges(m.get("holds")?)?,
            tables: m.get("tables")?.clone(),
        })
    }

    /// Whether a one-shard send's id claim may also be its dedupe record (ADR-0040): only in a
    /// deployment created by code that claims every id (version 2), where no dedupe record
    /// without a claim can exist and no process that knows only version 1 runs.
    pub fn one_key_claims(&self) -> bool {
        self.version >= 2
    }

    /// Whether log records are written in the packed form (ADR-0055): only in a deployment
    /// created by code that reads them (version 3), which code that cannot refuses to run
    /// (an unknown version), so no process in it misreads a record. A deployment created
    /// before keeps the six-field form, which every version reads.
    pub fn packed_records(&self) -> bool {
        self.version >= 3
    }

    /// What differs between `self` (recorded) and `want` (this process), in words; empty when
    /// they agree. The version is not compared: it belongs to the deployment.
    pub fn differences(&self, want: &Identity) -> Vec<String> {
        let mut d = Vec::new();
        if self.shards != want.shards {
            d.push(format!(
                "it was created with {} shards, this process has {}",
                self.shards, want.shards
            ));
        }
        if self.role != want.role || self.index != want.index {
            d.push(format!(
                "it is {} instance {}, this process uses it as {} instance {}",
                self.role.as_str(),
                self.index,
                want.role.as_str(),
                want.index
            ));
        }
        if d.is_empty() && self.tables != want.tables {
            d.push(
                "its shard → instance tables differ from this process's (core_of_shard / \
                 mailbox_of_shard, or the order of the instance lists)"
                    .to_string(),
            );
        }
        d
    }
}

/// A connection to the instance at `url` for the functions below (the library's default
/// multiplexed connection).
pub async fn connect(url: &str) -> Result<crate::endpoint::Conn> {
    crate::endpoint::connect(url, crate::endpoint::ConnectOptions::default()).await
}

/// Reads the identity recorded on the instance (None when there is none).
pub async fn read(conn: &mut impl ConnectionLike) -> Result<Option<Identity>> {
    read_at(conn, KEY).await
}

/// [`read`] of the identity at `key` ([`key`]).
pub async fn read_at(conn: &mut impl ConnectionLike, key: &str) -> Result<Option<Identity>> {
    let m: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query_async(conn).await?;
    if m.is_empty() {
        return Ok(None);
    }
    Identity::from_fields(&m)
        .map(Some)
        .ok_or_else(|| Error::UnexpectedReply {
            script: "tidemark:deployment",
            detail: format!("unreadable identity {m:?}"),
        })
}

/// Writes `id` unless an identity exists; returns the identity now recorded.
pub async fn record_if_absent(conn: &mut impl ConnectionLike, id: &Identity) -> Result<Identity> {
    record_if_absent_at(conn, KEY, id).await
}

/// [`record_if_absent`] at `key` ([`key`]).
pub async fn record_if_absent_at(
    conn: &mut impl ConnectionLike,
    key: &str,
    id: &Identity,
) -> Result<Identity> {
    let script = redis::Script::new(
        "if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HSET', KEYS[1], unpack(ARGV)) end \
         return 1",
    );
    let mut inv = script.key(key);
    for (k, v) in id.fields() {
        inv.arg(k).arg(v);
    }
    let _: i64 = inv.invoke_async(conn).await?;
    read_at(conn, key)
        .await?
        .ok_or_else(|| Error::UnexpectedReply {
            script: "tidemark:deployment",
            detail: "identity missing after write".into(),
        })
}

/// What [`raise_version_at`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Raise {
    /// The version was `from` and is `to` now.
    Raised,
    /// Nothing written: the version is not `from`; what it is ("" when the identity or its
    /// version is absent). A second run finds `to` here.
    Found(String),
}

/// Raises the identity version at `key` from `from` to `to` if it is `from` (one
/// `raise_version.lua` step, a compare-and-set; ADR-0056).
pub async fn raise_version_at(
    conn: &mut impl ConnectionLike,
    key: &str,
    from: u32,
    to: u32,
) -> Result<Raise> {
    static RAISE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(include_str!("redis/lua/deployment/raise_version.lua"))
    });
    let (raised, now): (i64, String) = RAISE.key(key).arg(from).arg(to).invoke_async(conn).await?;
    Ok(if raised == 1 {
        Raise::Raised
    } else {
        Raise::Found(now)
    })
}

/// [`raise_version_at`] from [`VERSION_UPGRADABLE`] to [`VERSION_CURRENT`] on every instance,
/// core pool first, each at its identity key; what each found, in that order. Checks no
/// process: callers check first (`tidemark upgrade`) or own the instances (`up --upgrade`).
pub async fn raise_every_instance(
    core: &[String],
    mailbox: &[String],
) -> Result<Vec<(Role, usize, Raise)>> {
    let mut out = Vec::new();
    for (role, urls) in [(Role::Core, core), (Role::Mailbox, mailbox)] {
        for (index, url) in urls.iter().enumerate() {
            let mut conn = connect(url).await?;
            let found = raise_version_at(
                &mut conn,
                &key(url, role),
                VERSION_UPGRADABLE,
                VERSION_CURRENT,
            )
            .await?;
            out.push((role, index, found));
        }
    }
    Ok(out)
}

/// Shards that have a `wm:{s}` key on the instance (SCAN; one pass over the keyspace).
pub async fn watermark_shards(conn: &mut impl ConnectionLike) -> Result<Vec<u32>> {
    let mut scan = crate::scan::KeyScan::new("wm:{*}");
    let mut shards = Vec::new();
    while let Some(batch) = scan.next_batch::<String>(conn).await? {
        shards.extend(batch.iter().filter_map(|k| {
            k.strip_prefix("wm:{")
                .and_then(|r| r.strip_suffix('}'))
                .and_then(|n| n.parse::<u32>().ok())
        }));
    }
    shards.sort_unstable();
    shards.dedup();
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_round_trip() {
        for v in [
            vec![],
            vec![0],
            vec![0, 1, 2, 5, 7, 8],
            vec![3, 9, 10, 11, 40],
        ] {
            let s = format_ranges(&v);
            assert_eq!(parse_ranges(&s), Some(v.clone()), "{s}");
        }
        assert_eq!(format_ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(parse_ranges("3-1"), None);
        assert_eq!(parse_ranges("x"), None);
    }

    #[test]
    fn fingerprint_depends_on_both_tables() {
        let a = tables_fingerprint(&[0, 0, 1, 1], &[0, 0, 0, 0]);
        assert_eq!(a.len(), 16);
        assert_ne!(a, tables_fingerprint(&[0, 1, 0, 1], &[0, 0, 0, 0]));
        assert_ne!(a, tables_fingerprint(&[0, 0, 0, 0], &[0, 0, 1, 1]));
    }

    #[test]
    fn versions_1_to_3_are_read_and_others_refused() {
        let m = |v: &str| -> BTreeMap<String, String> {
            [
                ("version", v),
                ("shards", "4"),
                ("role", "core"),
                ("index", "0"),
                ("holds", "0-3"),
                ("tables", "0000000000000000"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        };
        let one = Identity::from_fields(&m("1")).unwrap();
        assert_eq!(one.version, 1);
        assert!(!one.one_key_claims());
        assert!(!one.packed_records());
        let two = Identity::from_fields(&m("2")).unwrap();
        assert!(two.one_key_claims());
        assert!(!two.packed_records());
        let three = Identity::from_fields(&m("3")).unwrap();
        assert!(three.one_key_claims());
        assert!(three.packed_records());
        assert!(
            one.differences(&two).is_empty(),
            "the version is the deployment's"
        );
        for bad in ["4", "0", "02", "03", "", "x"] {
            assert!(Identity::from_fields(&m(bad)).is_none(), "{bad:?}");
        }
        // what is written is read back the same
        let written: BTreeMap<String, String> = two
            .fields()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(Identity::from_fields(&written), Some(two));
    }
}
