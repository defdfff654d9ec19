//! Fuzz target: the client-input parsers (`parse_client_frame`, the HTTP body and query
//! parsers) on arbitrary input must never panic, every accepted input must survive a
//! serialise/parse round trip unchanged, and every rejection must name its code consistently
//! and echo only a valid client id. The checks are `tidemark_protocol::fuzzing::check`, which
//! the corpus replay (`tests/fuzz_corpus.rs`) and the property tests run too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidemark_protocol::fuzzing::check;
use tidemark_protocol::Limits;

fuzz_target!(|data: &[u8]| {
    if let Err(broken) = check(data, &Limits::default()) {
        panic!("{broken}");
    }
});
