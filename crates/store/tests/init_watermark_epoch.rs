//! ADR-0110: `init_watermark.lua` forced over an existing watermark never moves the shard's
//! epoch back: it writes the larger of the epoch asked for and the old epoch + 1, so every
//! owner of the old watermark is fenced. Against a real redis-server.

use std::time::Duration;

use tidemark_redis_proc::{resp, RedisProcess};
use tidemark_store::redis::store::{Fence, MailboxStore};
use tidemark_store::redis::watermark::Layout;

fn raw(p: &RedisProcess, args: &[&str]) -> resp::Value {
    let mut c = resp::Conn::connect(p.addr(), None, Duration::from_secs(5)).unwrap();
    c.call(args).unwrap()
}

#[tokio::test]
async fn a_forced_init_never_moves_an_epoch_back() {
    let p = RedisProcess::start().unwrap();
    let mut store = MailboxStore::connect(&p.url(), Layout::PackedV2)
        .await
        .unwrap();
    let s = 0;
    store
        .init_watermark(s, Layout::PackedV2, 1, 0, false)
        .await
        .unwrap();
    // two owners claimed it: epoch 3, the second one running
    assert_eq!(store.claim(s).await.unwrap(), 2);
    assert_eq!(store.claim(s).await.unwrap(), 3);

    // `wm init --force` with its default --epoch 1: 4, not 1
    store
        .init_watermark(s, Layout::PackedV2, 1, 0, true)
        .await
        .unwrap();
    let wm = store.read_watermark(s).await.unwrap();
    assert_eq!(wm.epoch, 4, "the epoch went back");
    assert_eq!(wm.lanes.min_present_w(), Some(0));
    // the owner of epoch 3 is fenced: its compare-and-set finds 4
    assert!(
        matches!(
            store.fence_epoch(s, 3, 4).await.unwrap(),
            Fence::Lost { .. }
        ),
        "the old owner's epoch still holds"
    );

    // an epoch asked for above the old one is written as given
    store
        .init_watermark(s, Layout::PackedV1, 10, 0, true)
        .await
        .unwrap();
    let wm = store.read_watermark(s).await.unwrap();
    assert_eq!((wm.epoch, wm.layout), (10, Layout::PackedV1));

    // exact above 2^53 (no float rounding in the script)
    let big = "9007199254740993";
    raw(&p, &["HSET", "wm:{0}", "wm_epoch", big]);
    store
        .init_watermark(s, Layout::PackedV2, 1, 0, true)
        .await
        .unwrap();
    assert_eq!(
        store.read_watermark(s).await.unwrap().epoch,
        9_007_199_254_740_994
    );
    // one below u64::MAX: raised to it; at u64::MAX: refused, the watermark left as it is
    raw(&p, &["HSET", "wm:{0}", "wm_epoch", "18446744073709551614"]);
    store
        .init_watermark(s, Layout::PackedV2, 1, 0, true)
        .await
        .unwrap();
    assert_eq!(store.read_watermark(s).await.unwrap().epoch, u64::MAX);
    assert!(store
        .init_watermark(s, Layout::PackedV2, 1, 0, true)
        .await
        .is_err());
    assert_eq!(store.read_watermark(s).await.unwrap().epoch, u64::MAX);

    // an epoch that is no number (a corrupt watermark), or a key that is no hash: nothing to
    // compare, the epoch asked for is written
    raw(&p, &["HSET", "wm:{0}", "wm_epoch", "x7"]);
    store
        .init_watermark(s, Layout::PackedV2, 5, 0, true)
        .await
        .unwrap();
    assert_eq!(store.read_watermark(s).await.unwrap().epoch, 5);
    raw(&p, &["DEL", "wm:{0}"]);
    raw(&p, &["SET", "wm:{0}", "not a hash"]);
    store
        .init_watermark(s, Layout::PackedV2, 6, 0, true)
        .await
        .unwrap();
    assert_eq!(store.read_watermark(s).await.unwrap().epoch, 6);

    // without force: refused, the epoch kept; a new shard gets the epoch asked for
    assert!(store
        .init_watermark(s, Layout::PackedV2, 1, 0, false)
        .await
        .is_err());
    assert_eq!(store.read_watermark(s).await.unwrap().epoch, 6);
    store
        .init_watermark(1, Layout::PackedV2, 7, 0, true)
        .await
        .unwrap();
    assert_eq!(store.read_watermark(1).await.unwrap().epoch, 7);
}
