//! ADR-0110, through the commands' own argument parsing and exit statuses, against real
//! redis-servers: `wm init --force` under a live owner, `status` with a shard whose watermark
//! cannot be read, and a `wm:{s}` key that is not a hash.

use std::process::ExitCode;

use clap::Parser;
use tidemark_redis_proc::{resp, RedisProcess};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

use super::exit::{EXIT_CORRUPT, EXIT_REFUSED};
use super::status::StatusArgs;
use super::wm::WmCmd;

#[derive(Parser)]
struct Wm {
    #[command(subcommand)]
    cmd: WmCmd,
}

#[derive(Parser)]
struct Status {
    #[command(flatten)]
    args: StatusArgs,
}

async fn wm(args: &[&str]) -> ExitCode {
    let cmd = Wm::try_parse_from(std::iter::once("wm").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .cmd;
    super::wm::run(cmd).await.unwrap()
}

fn raw(p: &RedisProcess, args: &[&str]) -> resp::Value {
    let mut c = resp::Conn::connect(p.addr(), None, std::time::Duration::from_secs(5)).unwrap();
    c.call(args).unwrap()
}

async fn epoch(store: &mut MailboxStore, shard: u32) -> u64 {
    store.read_watermark(shard).await.unwrap().epoch
}

#[tokio::test]
async fn wm_init_force_is_refused_under_a_live_owner() {
    let p = RedisProcess::start().unwrap();
    let url = p.url();
    assert_eq!(
        wm(&["init", "--redis", &url, "--shards", "2"]).await,
        ExitCode::SUCCESS
    );
    let mut store = MailboxStore::connect(&url, Layout::PackedV2).await.unwrap();
    // shard 0 runs: claimed (epoch 2), its owner mark fresh
    let e = store.claim(0).await.unwrap();
    store.refresh_owner_marks(&[(0, e)]).await.unwrap();
    let force = ["init", "--redis", &url, "--shards", "2", "--force"];
    assert_eq!(wm(&force).await, ExitCode::from(EXIT_REFUSED));
    // nothing written, on either shard
    assert_eq!(epoch(&mut store, 0).await, 2);
    let lanes = store.read_watermark(0).await.unwrap().lanes;
    assert_eq!(lanes.min_present_w(), Some(0));
    assert_eq!(epoch(&mut store, 1).await, 1);

    // fenced (another claim: epoch 3), that owner can no longer write: --force goes on,
    // above the shard's epoch
    assert_eq!(store.claim(0).await.unwrap(), 3);
    assert_eq!(wm(&force).await, ExitCode::SUCCESS);
    assert_eq!(epoch(&mut store, 0).await, 4);
    assert_eq!(epoch(&mut store, 1).await, 2);

    // a live owner again: --force-offline overwrites anyway (still above its epoch)
    store.refresh_owner_marks(&[(0, 4)]).await.unwrap();
    assert_eq!(wm(&force).await, ExitCode::from(EXIT_REFUSED));
    let offline = [&force[..], &["--force-offline"]].concat();
    assert_eq!(wm(&offline).await, ExitCode::SUCCESS);
    assert_eq!(epoch(&mut store, 0).await, 5);
}

async fn status(core: &RedisProcess, mailbox: &RedisProcess) -> ExitCode {
    let (c, m) = (core.url(), mailbox.url());
    let args = ["status", "--core", &c, "--mailbox", &m, "--shards", "2"];
    let a = Status::try_parse_from(args).unwrap().args;
    super::status::run(a).await.unwrap()
}

#[tokio::test]
async fn status_and_wm_exit_3_on_a_watermark_that_cannot_be_read() {
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let url = mailbox.url();
    assert_eq!(
        wm(&["init", "--redis", &url, "--shards", "2"]).await,
        ExitCode::SUCCESS
    );
    assert_eq!(status(&core, &mailbox).await, ExitCode::SUCCESS);
    // corrupt (a short blob): the line says `error: …`, and the exit status says so too
    raw(&mailbox, &["HSET", "wm:{1}", "wm_blob", "short"]);
    assert_eq!(status(&core, &mailbox).await, ExitCode::from(EXIT_CORRUPT));
    // missing
    raw(&mailbox, &["DEL", "wm:{1}"]);
    assert_eq!(status(&core, &mailbox).await, ExitCode::from(EXIT_CORRUPT));
    // not a hash: corrupt, for status, verify and inspect alike (not a failed command)
    raw(&mailbox, &["SET", "wm:{1}", "not a hash"]);
    assert_eq!(status(&core, &mailbox).await, ExitCode::from(EXIT_CORRUPT));
    assert_eq!(
        wm(&["verify", "--redis", &url]).await,
        ExitCode::from(EXIT_CORRUPT)
    );
    assert_eq!(
        wm(&["inspect", "--redis", &url, "--shard", "1"]).await,
        ExitCode::from(EXIT_CORRUPT)
    );
    // the other shard still reads
    assert_eq!(
        wm(&["inspect", "--redis", &url, "--shard", "0"]).await,
        ExitCode::SUCCESS
    );
}
