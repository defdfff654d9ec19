//! The token secret: the one loader used by `serve`, `up`, `token` and the client helpers.
//!
//! A secret comes from a file (`--secret-file`, or `up`'s `<data dir>/token.secret`) or from
//! the environment variable [`SECRET_ENV_VAR`]. Either way the same rule applies: leading and
//! trailing ASCII whitespace is trimmed, and what is left must be at least
//! [`MIN_SECRET_BYTES`] bytes, else the secret is refused with a [`SecretError`] — an empty or
//! short key would let anyone who guesses it mint a token for any user. A variable that is set
//! but empty is an error, never "no secret".
//!
//! [`load_or_create`] is `up`'s form: it reads an existing file under the same rule (it never
//! overwrites one), or creates it with mode 0600 holding 32 random bytes in hex.
//!
//! This is the only part of the crate that touches the file system.

use std::fmt;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The environment variable holding the token secret when no secret file is given.
pub const SECRET_ENV_VAR: &str = "TIDEMARK_TOKEN_SECRET";

/// Shortest secret accepted, in bytes after trimming (the HMAC-SHA256 block of entropy a
/// freshly generated secret has: 32 random bytes, written as 64 hex digits).
pub const MIN_SECRET_BYTES: usize = 32;

/// Why a secret was refused. Codes (`code()`): `secret_unreadable`, `secret_missing`,
/// `secret_too_short`, `secret_create`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The secret file exists but could not be read. Code `secret_unreadable`.
    #[error("cannot read the token secret file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
    /// Neither a secret file nor the environment variable was given. Code `secret_missing`.
    #[error("no token secret: give a secret file or set the environment variable {env_var}")]
    Missing {
        /// The variable looked at.
        env_var: String,
    },
    /// The secret is shorter than [`MIN_SECRET_BYTES`] after trimming (empty included). Code
    /// `secret_too_short`.
    #[error(
        "the token secret from {source_name} is {len} bytes after trimming whitespace; at least \
         {min} are required (generate one with: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
        min = MIN_SECRET_BYTES
    )]
    TooShort {
        /// Where it came from (`secret file PATH` or `$VAR`).
        source_name: String,
        /// Its length after trimming.
        len: usize,
    },
    /// A new secret file could not be created. Code `secret_create`.
    #[error("cannot create the token secret file {path}: {reason}")]
    Create {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
}

impl SecretError {
    /// The stable code string.
    pub fn code(&self) -> &'static str {
        match self {
            SecretError::Unreadable { .. } => "secret_unreadable",
            SecretError::Missing { .. } => "secret_missing",
            SecretError::TooShort { .. } => "secret_too_short",
            SecretError::Create { .. } => "secret_create",
        }
    }
}

/// A token secret that passed the rule above. Its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSecret(Vec<u8>);

impl TokenSecret {
    /// Trims `raw` and checks its length; `source_name` names it in the error.
    pub fn new(raw: &[u8], source_name: &str) -> Result<Self, SecretError> {
        let trimmed = raw.trim_ascii();
        if trimmed.len() < MIN_SECRET_BYTES {
            return Err(SecretError::TooShort {
                source_name: source_name.to_string(),
                len: trimmed.len(),
            });
        }
        Ok(TokenSecret(trimmed.to_vec()))
    }

    /// The key bytes (trimmed).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The key bytes (trimmed).
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for TokenSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenSecret({} bytes)", self.0.len())
    }
}

/// Reads the secret from `secret_file` when given (an unreadable file is an error, no
/// fallback), else from the environment variable `env_var` (normally [`SECRET_ENV_VAR`]).
pub fn load(secret_file: Option<&Path>, env_var: &str) -> Result<TokenSecret, SecretError> {
    match load_optional(secret_file, env_var)? {
        Some(s) => Ok(s),
        None => Err(SecretError::Missing {
            env_var: env_var.to_string(),
        }),
    }
}

/// Like [`load`], but `Ok(None)` when neither a file is given nor the variable is set (a
/// gateway that accepts no tokens). A variable set to an empty value is still an error.
pub fn load_optional(
    secret_file: Option<&Path>,
    env_var: &str,
) -> Result<Option<TokenSecret>, SecretError> {
    match secret_file {
        Some(path) => read_file(path).map(Some),
        None => match std::env::var_os(env_var) {
            Some(v) => TokenSecret::new(v.as_encoded_bytes(), &format!("${env_var}")).map(Some),
            None => Ok(None),
        },
    }
}

fn read_file(path: &Path) -> Result<TokenSecret, SecretError> {
    let bytes = std::fs::read(path).map_err(|e| SecretError::Unreadable {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    TokenSecret::new(&bytes, &format!("secret file {}", path.display()))
}

/// Reads the secret file at `path`, or, when it does not exist, creates it (mode 0600, never
/// replacing a file that appears meanwhile) holding 32 random bytes as 64 hex digits. An
/// existing file is never rewritten: an empty or short one is refused like any other secret.
pub fn load_or_create(path: &Path) -> Result<TokenSecret, SecretError> {
    if path.exists() {
        return read_file(path);
    }
    let create = |e: std::io::Error| SecretError::Create {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let mut raw = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .map_err(create)?;
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(f) => f,
        // another process created it meanwhile: use theirs
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return read_file(path),
        Err(e) => return Err(create(e)),
    };
    f.write_all(hex.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(create)?;
    TokenSecret::new(hex.as_bytes(), "a new secret")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const GOOD: &str = "0123456789abcdef0123456789abcdef";

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tidemark-secret-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn trims_and_checks_length() {
        let s = TokenSecret::new(format!(" \t{GOOD}\r\n").as_bytes(), "x").unwrap();
        assert_eq!(s.as_bytes(), GOOD.as_bytes());
        for raw in [
            "",
            " ",
            "\n\n",
            " \t\r\n ",
            &GOOD[1..],
            &format!(" {} ", &GOOD[1..]),
        ] {
            let e = TokenSecret::new(raw.as_bytes(), "src").unwrap_err();
            assert_eq!(e.code(), "secret_too_short", "{raw:?}");
            assert!(e.to_string().contains("src"), "{e}");
        }
        // inner whitespace is part of the key
        let s = TokenSecret::new(format!("{} {}", &GOOD[..16], &GOOD[16..]).as_bytes(), "x");
        assert_eq!(s.unwrap().as_bytes().len(), 33);
        assert!(!format!("{:?}", TokenSecret::new(GOOD.as_bytes(), "x").unwrap()).contains(GOOD));
    }

    #[test]
    fn sources() {
        let dir = tmp("sources");
        let file = dir.join("secret");
        std::fs::write(&file, format!("{GOOD}\n")).unwrap();
        // unique variable names: tests run in parallel threads
        let var = "TIDEMARK_SECRET_TEST_A";
        std::env::set_var(var, format!("{GOOD}-env\n"));
        assert_eq!(load(Some(&file), var).unwrap().as_bytes(), GOOD.as_bytes());
        assert_eq!(
            load(None, var).unwrap().as_bytes(),
            format!("{GOOD}-env").as_bytes()
        );
        let e = load(Some(&dir.join("missing")), var).unwrap_err();
        assert_eq!(e.code(), "secret_unreadable");
        assert!(e.to_string().contains("missing"), "{e}");

        let unset = "TIDEMARK_SECRET_TEST_UNSET";
        assert_eq!(load(None, unset).unwrap_err().code(), "secret_missing");
        assert!(load_optional(None, unset).unwrap().is_none());

        let empty = "TIDEMARK_SECRET_TEST_EMPTY";
        std::env::set_var(empty, "");
        assert_eq!(
            load_optional(None, empty).unwrap_err().code(),
            "secret_too_short"
        );
        std::fs::write(&file, " \n\t ").unwrap();
        assert_eq!(
            load_optional(Some(&file), var).unwrap_err().code(),
            "secret_too_short"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_or_create_makes_a_private_file_and_never_rewrites_one() {
        let dir = tmp("create");
        let path = dir.join("token.secret");
        let first = load_or_create(&path).unwrap();
        assert_eq!(first.as_bytes().len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create(&path).unwrap(), first);
        std::fs::write(&path, "").unwrap();
        assert_eq!(
            load_or_create(&path).unwrap_err().code(),
            "secret_too_short"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
