//! TLS for the gateway's listener (`--tls-cert`, `--tls-key`; ADR-0027): one certificate
//! chain and key, loaded from PEM files before anything starts, served with rustls (`ring`
//! provider, TLS 1.2 and 1.3, ALPN `http/1.1`).
//!
//! The handshake itself runs in each connection's task ([`super::listener`]), bounded by the
//! header-read timeout, after the connection has taken its slot under the connection cap.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Why a certificate or key could not be used. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("TLS {what} {}: cannot read it: {source}", path.display())]
    Read {
        /// "certificate" or "key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no usable PEM certificate (or private key).
    #[error("TLS {what} {}: {reason}", path.display())]
    Pem {
        /// "certificate" or "key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The key is not the certificate's, or rustls refuses the pair.
    #[error("TLS key {} does not fit certificate {}: {reason}", key.display(), cert.display())]
    Mismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
}

impl TlsError {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "tls_unreadable",
            TlsError::Pem { .. } => "tls_bad_pem",
            TlsError::Mismatch { .. } => "tls_key_mismatch",
        }
    }
}

/// A loaded certificate and key, ready to accept TLS connections. Cheap to clone.
#[derive(Clone)]
pub struct TlsConfig {
    acceptor: TlsAcceptor,
    cert: PathBuf,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// Loads a PEM certificate chain (leaf first) from `cert` and a PEM private key (PKCS#8,
    /// PKCS#1 or SEC1) from `key`, and checks that the key belongs to the leaf certificate.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<TlsConfig, TlsError> {
        let read = |what, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let cert_pem = read("certificate", cert)?;
        let key_pem = read("key", key)?;
        let pem_err = |what, path: &Path, reason: String| TlsError::Pem {
            what,
            path: path.to_path_buf(),
            reason,
        };
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err("certificate", cert, format!("not valid PEM ({e})")))?;
        if chain.is_empty() {
            return Err(pem_err(
                "certificate",
                cert,
                "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
            ));
        }
        let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            let reason = match e {
                rustls::pki_types::pem::Error::NoItemsFound => {
                    "holds no PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)".into()
                }
                e => format!("not valid PEM ({e})"),
            };
            pem_err("key", key, reason)
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Mismatch {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                reason: e.to_string(),
            })?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(|e| TlsError::Mismatch {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                reason: e.to_string(),
            })?;
        // the gateway speaks HTTP/1.1 only (WebSocket upgrades included)
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsConfig {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            cert: cert.to_path_buf(),
        })
    }

    /// The acceptor the listener runs handshakes with.
    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}
