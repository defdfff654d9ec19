//! Certificate and key files for the TLS tests, and a client that trusts them. Shared by
//! `crates/server/tests` and `cmd/tidemark/tests` (the latter includes this file by path).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::CertificateDer;

/// A self-signed certificate for `names`, written as PEM files into `dir`; returns (cert
/// path, key path, the certificate to trust).
pub fn self_signed(dir: &Path, names: &[&str]) -> (PathBuf, PathBuf, CertificateDer<'static>) {
    let names = names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let ck = rcgen::generate_simple_self_signed(names).expect("rcgen");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key, ck.cert.der().clone())
}

/// Files in a temporary directory for the "unusable certificate or key" checks: a good
/// certificate and key, the key of another certificate, a path that does not exist and a file
/// of garbage.
pub struct TlsFiles {
    pub dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The certificate, to trust.
    pub ca: CertificateDer<'static>,
    pub other_key: PathBuf,
    pub missing: PathBuf,
    pub garbage: PathBuf,
    _other: tempfile::TempDir,
}

impl TlsFiles {
    /// A certificate for `names`; `garbage` is the garbage file's text.
    pub fn new(names: &[&str], garbage: &str) -> TlsFiles {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca) = self_signed(dir.path(), names);
        let other = tempfile::tempdir().unwrap();
        let (_, other_key, _) = self_signed(other.path(), names);
        let missing = dir.path().join("missing.pem");
        let garbage_file = dir.path().join("garbage.pem");
        std::fs::write(&garbage_file, garbage).unwrap();
        TlsFiles {
            dir,
            cert,
            key,
            ca,
            other_key,
            missing,
            garbage: garbage_file,
            _other: other,
        }
    }
}

/// A TLS client configuration that trusts only `ca`.
pub fn client_config(ca: &CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}
