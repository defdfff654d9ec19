//! What parsing a client frame costs, in isolation: `parse_client_frame` on the two frames
//! every message brings (the sender's `send`, the recipient's `ack`), as the load generator
//! writes them. Issue 15 lists "fewer allocations in frame parsing (borrowed serde
//! structs)" as an idea to weigh; this gives the figures it was weighed by (ADR-0050): the
//! time per parse, and the heap allocations per parse (a count: the same on a busy machine).
//!
//! `cargo run --release -p tidemark-protocol --example parse_cost` (the binary's allocator is
//! the system's here, not the server's mimalloc, with a counter around it).

use tidemark_protocol::{parse_client_frame, Limits};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::per_call;

fn main() {
    let limits = Limits::default();
    let frames = [
        (
            "send",
            r#"{"type":"send","id":"m123456","to":["u000123"],"body":"i:123456"}"#,
        ),
        ("ack", r#"{"type":"ack","seq":3471}"#),
    ];
    let n = 1_000_000u32;
    for round in 1..=3 {
        let mut line = format!("round {round}:");
        for (name, text) in frames {
            let (ns, allocs, reallocs) = per_call(n, || {
                let frame = parse_client_frame(std::hint::black_box(text), &limits);
                std::hint::black_box(frame.expect("a valid frame"));
            });
            line += &format!(
                " {name} {ns:.0} ns, {allocs:.1} allocations + {reallocs:.1} reallocations;"
            );
        }
        println!("{line}");
    }
}
