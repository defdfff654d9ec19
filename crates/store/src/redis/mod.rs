//! Everything that touches Redis bytes: the watermark codec, the scripts, the store.

pub mod dlog;
pub mod lease;
pub mod replicas;
pub mod scripts;
pub mod store;
pub mod watermark;
