//! What reading a server frame costs the client, in isolation: the two frames every message
//! brings a client (the sender's `send_ack`, the recipient's `deliver`), as the server writes
//! them, read by the one-pass read (first) and by the full parse alone (as before it): the time
//! per read and the heap allocations per read (a count: the same on a busy machine).
//!
//! `cargo run --release -p tidemark-client --example incoming_cost` (the binary's allocator is
//! the system's here, with a counter around it).

use tidemark_client::client::__read_server_frame;

#[path = "../../protocol/examples/common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::per_call;

fn main() {
    let frames = [
        (
            "send_ack",
            r#"{"type":"send_ack","id":"m123456","offsets":{"12":3471}}"#,
        ),
        (
            "deliver",
            r#"{"type":"deliver","seq":3471,"from":"u000123","body":"i:123456","sent_at_us":1764489600000000}"#,
        ),
    ];
    let n = 1_000_000u32;
    for round in 1..=3 {
        for (way, full) in [("one-pass", false), ("full parse", true)] {
            let mut line = format!("round {round}, {way}:");
            for (name, text) in frames {
                let (ns, allocs, reallocs) = per_call(n, || {
                    let ok = __read_server_frame(std::hint::black_box(text), full);
                    assert!(std::hint::black_box(ok), "a valid frame");
                });
                line += &format!(
                    " {name} {ns:.0} ns, {allocs:.1} allocations + {reallocs:.1} reallocations;"
                );
            }
            println!("{line}");
        }
    }
}
