//! Tidemark's service: the materializers that copy dispatch logs into mailboxes, the gateway
//! that clients talk to, and the code that runs them together (`tidemark serve`, `tidemark up`).

pub mod gateway;
pub mod health;
pub mod materializer;
pub mod ownership;
pub mod run;
pub mod supervise;
pub mod telemetry;
