//! What `serve` and `up` refuse before anything starts: `--dev-auth` on an address others can
//! reach, and `serve` without a token secret. The binary prints a refusal as `error: <why>`
//! and exits 2 (nothing was started), and a warning as it is.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use tidemark_protocol::secret::{self, SECRET_ENV_VAR};

/// `--dev-auth` trusts `?user=NAME` from anyone who reaches the listener: refused (`Err`) on a
/// non-loopback address unless `public` (`--dev-auth-public`) says so, then with a warning
/// (`Ok(Some(_))`). `Ok(None)`: nothing to say.
pub fn check_dev_auth(
    dev_auth: bool,
    public: bool,
    listen: SocketAddr,
) -> Result<Option<String>, String> {
    let loopback = match listen.ip() {
        IpAddr::V4(ip) => ip.is_loopback(),
        IpAddr::V6(ip) => ip
            .to_ipv4_mapped()
            .map_or(ip.is_loopback(), |v4| v4.is_loopback()),
    };
    if !dev_auth || loopback {
        return Ok(None);
    }
    if !public {
        return Err(format!(
            "--dev-auth on {listen}, which is not a loopback address, would let anyone who can \
             reach it act as any user; listen on 127.0.0.1 (or [::1]), or add --dev-auth-public \
             to accept that"
        ));
    }
    Ok(Some(format!(
        "warning: --dev-auth-public: {listen} accepts ?user=NAME without a token; anyone who \
         can reach it can read and send as any user"
    )))
}

/// The token secret of `serve`: from `secret_file`, else the environment variable
/// [`SECRET_ENV_VAR`]. None only with `dev_auth`; a secret that cannot be used, or none
/// without `dev_auth`, is refused (`Err`, the reason).
pub fn serve_secret(secret_file: Option<&Path>, dev_auth: bool) -> Result<Option<Vec<u8>>, String> {
    let secret = secret::load_optional(secret_file, SECRET_ENV_VAR)
        .map_err(|e| e.to_string())?
        .map(|s| s.into_bytes());
    if secret.is_none() && !dev_auth {
        return Err(format!(
            "no token secret: give --secret-file or {SECRET_ENV_VAR} (or --dev-auth)"
        ));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_auth_only_on_loopback_unless_public() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        for addr in ["127.0.0.1:1", "[::1]:1", "[::ffff:127.0.0.1]:1"] {
            assert_eq!(check_dev_auth(true, false, at(addr)), Ok(None), "{addr}");
        }
        for addr in ["0.0.0.0:1", "[::]:1", "10.0.0.1:1", "[::ffff:10.0.0.1]:1"] {
            assert_eq!(check_dev_auth(false, false, at(addr)), Ok(None), "{addr}");
            let refusal = check_dev_auth(true, false, at(addr)).unwrap_err();
            assert!(refusal.contains("not a loopback address"), "{refusal}");
            let warning = check_dev_auth(true, true, at(addr)).unwrap().unwrap();
            assert!(
                warning.starts_with("warning: --dev-auth-public"),
                "{warning}"
            );
        }
    }
}
