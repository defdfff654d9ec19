//! The client commands: `tidemark token` and `tidemark secret gen` (bearer tokens and their
//! secret), `tidemark send` and `tidemark tail` (one connection to the gateway). Argument
//! parsing and printing only; the work is `tidemark_client` and `tidemark_protocol::secret`.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use super::exit::refuse;

#[derive(Subcommand)]
pub enum SecretCmd {
    /// Write a new token secret (32 random bytes as 64 hex digits, mode 0600) to a file that
    /// does not exist yet; give it to `serve --secret-file` and `token --secret-file`.
    Gen {
        /// The file to create (never overwritten).
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

#[derive(Args)]
pub struct TokenArgs {
    /// The user the token names (1..=128 bytes, no control character); with --admin,
    /// `admin` unless given.
    #[arg(long, required_unless_present = "admin")]
    user: Option<String>,
    /// An admin token: it may also read the operator's endpoint (GET /v1/admin/status, the
    /// /ops view). Give it to operators only.
    #[arg(long)]
    admin: bool,
    /// Lifetime: whole seconds with an optional unit, e.g. 3600, 90s, 15m, 24h, 7d (not 0).
    #[arg(long, default_value = "24h", value_parser = tidemark_client::parse_ttl)]
    ttl: std::time::Duration,
    /// File holding the secret (else env TIDEMARK_TOKEN_SECRET).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
}

#[derive(Args, Clone)]
pub struct ClientAuthArgs {
    /// Gateway WebSocket URL.
    #[arg(long, default_value = "ws://127.0.0.1:7400/v1/ws")]
    url: String,
    /// Bearer token.
    #[arg(long, env = "TIDEMARK_TOKEN", conflicts_with = "dev_user")]
    token: Option<String>,
    /// Connect as this user without a token (server must run with --dev-auth).
    #[arg(long, alias = "user")]
    dev_user: Option<String>,
}

#[derive(Args)]
pub struct SendArgs {
    #[command(flatten)]
    auth: ClientAuthArgs,
    /// Recipients (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', required = true)]
    to: Vec<String>,
    /// Client message id (default: generated). Resending with the same id is deduplicated.
    #[arg(long)]
    id: Option<String>,
    /// Message body.
    body: String,
}

#[derive(Args)]
pub struct TailArgs {
    #[command(flatten)]
    auth: ClientAuthArgs,
    /// Restart the stream after this seq (default: after the last acked one).
    #[arg(long)]
    after: Option<u64>,
    /// When the server goes away, stop (exit 0) instead of reconnecting.
    #[arg(long)]
    no_reconnect: bool,
    /// Give up reconnecting (exit non-zero) after this long without a connection, e.g. 30s,
    /// 5m.
    #[arg(long, default_value = "2m", value_parser = tidemark_client::parse_ttl)]
    give_up_after: std::time::Duration,
    /// Acknowledge each delivered message (lets the server trim the mailbox).
    #[arg(long)]
    ack: bool,
}

fn client_auth(a: &ClientAuthArgs) -> anyhow::Result<tidemark_client::Auth> {
    match (&a.token, &a.dev_user) {
        (Some(t), _) => Ok(tidemark_client::Auth::Token(t.clone())),
        (None, Some(u)) => Ok(tidemark_client::Auth::DevUser(u.clone())),
        (None, None) => anyhow::bail!("give --token (or TIDEMARK_TOKEN) or --dev-user NAME"),
    }
}

/// Runs `tidemark token`.
pub fn token(a: TokenArgs) -> anyhow::Result<ExitCode> {
    let user = a.user.unwrap_or_else(|| "admin".to_string());
    if !tidemark_protocol::is_valid_user_id(&user) {
        anyhow::bail!("--user must be 1..=128 bytes without control characters");
    }
    let secret = match tidemark_client::read_secret(
        a.secret_file.as_deref(),
        tidemark_client::SECRET_ENV_VAR,
    ) {
        Ok(s) => s,
        Err(e) => return Ok(refuse(e)),
    };
    match tidemark_client::make_token_with(&secret, &user, a.ttl, a.admin) {
        Ok(t) => println!("{t}"),
        Err(e) => return Ok(refuse(e)),
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `tidemark send`.
pub async fn send(a: SendArgs) -> anyhow::Result<ExitCode> {
    let auth = client_auth(&a.auth)?;
    let id = a.id.unwrap_or_else(tidemark_client::new_message_id);
    let offsets =
        tidemark_client::send_once(&a.auth.url, &auth, a.to, a.body, Some(id.clone())).await?;
    let list: Vec<String> = offsets
        .iter()
        .map(|(s, o)| format!("shard {s} offset {o}"))
        .collect();
    println!("sent {id}: {}", list.join(", "));
    Ok(ExitCode::SUCCESS)
}

/// Runs `tidemark tail`.
pub async fn tail(a: TailArgs) -> anyhow::Result<ExitCode> {
    let auth = client_auth(&a.auth)?;
    let reconnect = (!a.no_reconnect).then_some(tidemark_client::Reconnect {
        give_up_after: a.give_up_after,
    });
    tidemark_client::tail_with(
        &a.auth.url,
        &auth,
        a.after,
        a.ack,
        reconnect,
        |e| println!("{}", tidemark_client::format_entry(e)),
        |line| eprintln!("tail: {line}"),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `tidemark secret …`.
pub fn secret(cmd: SecretCmd) -> anyhow::Result<ExitCode> {
    let SecretCmd::Gen { out } = cmd;
    if out.exists() {
        return Ok(refuse(format!(
            "{} exists; a secret file is never overwritten (tokens signed with it would stop \
             working): choose another path or remove it first",
            out.display()
        )));
    }
    tidemark_protocol::secret::load_or_create(&out)?;
    println!("wrote a new token secret to {} (mode 0600)", out.display());
    Ok(ExitCode::SUCCESS)
}
