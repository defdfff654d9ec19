//! `bench relay`, the yardstick of the socket work: a send is acked and delivered to the
//! connected recipient with increasing seqs, a malformed frame gets the gateway's `error`
//! frame, and `/metrics` counts what `bench load --target` reads.

use std::time::Duration;

use tidemark_bench::relay::run_relay;
use tidemark_client::{Auth, Client, Event};
use tokio::sync::oneshot;

async fn metrics(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_is_acked_and_relayed_to_the_recipient() {
    let (tx, rx) = oneshot::channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(run_relay(
        "127.0.0.1:0".parse().unwrap(),
        move |a| {
            let _ = tx.send(a);
        },
        async move { stopped.cancelled().await },
    ));
    let addr = rx.await.unwrap();
    let url = format!("ws://{addr}/v1/ws");
    let alice = Client::connect(&url, &Auth::DevUser("alice".into()))
        .await
        .unwrap();
    let mut bob = Client::connect(&url, &Auth::DevUser("bob".into()))
        .await
        .unwrap();
    let to = vec!["bob".to_owned()];
    for i in 1..=3u64 {
        let offsets = alice
            .handle()
            .send_and_wait(
                &format!("m{i}"),
                &to,
                &format!("hi {i}"),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(offsets.values().copied().collect::<Vec<_>>(), [i]);
        let ev = tokio::time::timeout(Duration::from_secs(5), bob.next_event())
            .await
            .unwrap();
        match ev {
            Some(Event::Deliver(e)) => {
                assert_eq!(
                    (e.seq, e.from.as_str(), e.body.clone()),
                    (i, "alice", format!("hi {i}"))
                );
            }
            other => panic!("{other:?}"),
        }
    }
    // the gateway's parser: a malformed frame is answered with its error code
    bob.handle()
        .send_raw_text("{\"type\":\"nope\"}")
        .await
        .unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), bob.next_event())
        .await
        .unwrap();
    assert!(
        matches!(&ev, Some(Event::Error { code, .. }) if code == "unknown_type"),
        "{ev:?}"
    );
    let m = metrics(addr).await;
    assert!(m.contains("tidemark_commits_total 3\n"), "{m}");
    assert!(m.contains("tidemark_relay_dropped_total 0\n"), "{m}");
    assert!(m.contains("process_cpu_seconds_total "), "{m}");
    stop.cancel();
    drop((alice, bob));
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
