//! What parsing a client frame costs, in isolation: `parse_client_frame` on the two frames
//! every message brings (the sender's `send`, the recipient's `ack`), as the load generator
//! writes them. Issue 15 lists "fewer allocations in frame parsing (borrowed serde
//! structs)" as an idea to weigh; this gives the figures it was weighed by (ADR-0050): the
//! time per parse, and the heap allocations per parse (a count: the same on a busy machine).
//!
//! `cargo run --release -p tidemark-protocol --example parse_cost` (the binary's allocator is
//! the system's here, not the server's mimalloc, with a counter around it).

use std::time::Instant;

use tidemark_protocol::{parse_client_frame, Limits};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::counts;

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
            let (a0, r0) = counts();
            let t = Instant::now();
            for _ in 0..n {
                let frame = parse_client_frame(std::hint::black_box(text), &limits);
                std::hint::black_box(frame.expect("a valid frame"));
            }
            let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
            let allocs = (counts().0 - a0) as f64 / f64::from(n);
            let reallocs = (counts().1 - r0) as f64 / f64::from(n);
            line += &format!(
                " {name} {ns:.0} ns, {allocs:.1} allocations + {reallocs:.1} reallocations;"
            );
        }
        println!("{line}");
    }
}
