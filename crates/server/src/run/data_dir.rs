//! The data dir of `tidemark up`: private permissions (0700, files 0600), the Redis
//! password and the token secret it creates once and reuses.

use std::path::{Path, PathBuf};

use tidemark_protocol::secret::TokenSecret;
use tidemark_store::topology::TopologyError;

use super::Error;

/// The token secret's file name in a data dir.
pub const TOKEN_SECRET_FILE: &str = "token.secret";

/// One path whose mode [`prepare_data_dir`] tightened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tightened {
    /// The file or directory.
    pub path: PathBuf,
    /// Its permission bits before.
    pub from: u32,
    /// Its permission bits now (group and other bits cleared).
    pub to: u32,
}

impl std::fmt::Display for Tightened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:04o} -> {:04o}",
            self.path.display(),
            self.from,
            self.to
        )
    }
}

/// Makes `data_dir` private: creates it with mode 0700 when missing; when it exists, removes
/// every group and other permission bit from it and from everything inside it (the secrets,
/// the deployment file, each instance's directory, AOF files and logs), without following
/// symbolic links. Returns what it changed (empty for a dir that was already private) so the
/// caller can say so; each change is also logged. A path that cannot be changed (another
/// owner) is an error naming the command that fixes it.
pub fn prepare_data_dir(data_dir: &Path) -> Result<Vec<Tightened>, Error> {
    use std::os::unix::fs::PermissionsExt;
    if !data_dir.exists() {
        tidemark_redis_proc::create_private_dir(data_dir)?;
        return Ok(Vec::new());
    }
    let mut changed = Vec::new();
    let mut stack = vec![data_dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            continue;
        }
        if meta.is_dir() {
            for e in std::fs::read_dir(&path)? {
                stack.push(e?.path());
            }
        }
        let from = meta.permissions().mode() & 0o7777;
        if from & 0o077 == 0 {
            continue;
        }
        let to = from & !0o077;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(to)).map_err(|e| {
            TopologyError::Invalid(format!(
                "{} is mode {from:04o} and cannot be made private ({e}); fix it with: \
                 chmod -R go-rwx {}",
                path.display(),
                data_dir.display()
            ))
        })?;
        let t = Tightened { path, from, to };
        tracing::warn!(change = %t, "data dir: removed group/other access");
        changed.push(t);
    }
    changed.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(changed)
}

/// Writes `contents` to a new or existing file with mode 0600.
pub(super) fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents)?;
    f.sync_all()
}

/// The password file's name in a data dir.
pub const REDIS_PASSWORD_FILE: &str = "redis.pass";

/// The password of `up`'s redis-servers: `<data_dir>/redis.pass` (whitespace trimmed),
/// created when missing (mode 0600, 32 random bytes as 64 hex digits) and reused by every
/// later `up` of the data dir. A file that holds no usable password (1..=512 of
/// `A-Z a-z 0-9 - . _ ~`) is refused.
pub fn load_or_create_redis_password(data_dir: &Path) -> Result<String, Error> {
    use std::io::Read;
    let path = data_dir.join(REDIS_PASSWORD_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let p = text.trim();
            if !tidemark_redis_proc::valid_password(p) {
                return Err(TopologyError::Invalid(format!(
                    "{} holds no usable redis password (1..=512 characters of A-Z a-z 0-9 - . _ \
                     ~); remove it and the next `up` creates a new one",
                    path.display()
                ))
                .into());
            }
            Ok(p.to_string())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tidemark_redis_proc::create_private_dir(data_dir)?;
            let mut raw = [0u8; 32];
            std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
            let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
            write_private(&path, hex.as_bytes())?;
            Ok(hex)
        }
        Err(e) => Err(e.into()),
    }
}

/// The token secret of a data dir: `<data_dir>/token.secret`, read under the loader's rule
/// (at least 32 bytes after trimming; an empty or short file is refused, never rewritten) or
/// created (mode 0600, 32 random bytes in hex) when missing.
pub fn load_or_create_secret(data_dir: &Path) -> Result<TokenSecret, Error> {
    tidemark_redis_proc::create_private_dir(data_dir)?;
    Ok(tidemark_protocol::secret::load_or_create(
        &data_dir.join(TOKEN_SECRET_FILE),
    )?)
}

/// The lock file's name in a data dir (ADR-0109).
pub const UP_LOCK_FILE: &str = "up.lock";

/// The exclusive lock of one `tidemark up` on its data dir: an `flock` on
/// `<data_dir>/up.lock`, held while this value lives (the kernel drops it when the process
/// ends, however it ends). Two `up`s on one data dir would start two redis-servers appending
/// to the same AOF files; the second is refused before it touches anything.
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
    dir: PathBuf,
}

impl DataDirLock {
    /// The data dir locked.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Takes [`DataDirLock`] on `data_dir` (created private when missing), without waiting:
/// [`Error::DataDirLocked`] when another process holds it.
pub fn lock_data_dir(data_dir: &Path) -> Result<DataDirLock, Error> {
    use std::os::unix::fs::OpenOptionsExt;
    tidemark_redis_proc::create_private_dir(data_dir)?;
    let path = data_dir.join(UP_LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)?;
    match file.try_lock() {
        Ok(()) => Ok(DataDirLock {
            _file: file,
            dir: data_dir.to_path_buf(),
        }),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::DataDirLocked {
            dir: data_dir.to_path_buf(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(e.into()),
    }
}
