//! `rollout_store`'s engine: the data a recording holds, with no Python in it.
//!
//! - [`content`]: each distinct byte string once, keyed by xxh3-128 and confirmed byte for byte;
//! - [`json`]: exact JSON, parsed as `json.loads` parses bytes and written as `json.dumps`
//!   writes.

pub mod content;
pub mod json;
