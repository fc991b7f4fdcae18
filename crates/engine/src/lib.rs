//! `rollout_store`'s engine: the data a recording holds, with no Python in it.
//!
//! - [`content`]: each distinct byte string once, keyed by xxh3-128 and confirmed byte for byte;
//! - [`digest`]: BLAKE3 digests of packed request prefixes, fed in aligned pieces;
//! - [`file`]: rollout files (the frames of format version 2);
//! - [`json`]: exact JSON, parsed as `json.loads` parses bytes and written as `json.dumps`
//!   writes;
//! - [`link_key`]: the loose key that links a response to its inexact echo;
//! - [`key_index`]: 64-bit keys to values in insertion order, held compactly, and to the
//!   numbers filed under them (the content tables' index);
//! - [`packed`]: the packed form of recorded values (msgpack and the library's extension
//!   types), written and read back;
//! - [`packed_check`]: a stored packed value checked without building it (what a loader trusts);
//! - [`requests`]: a graph's filed requests as rows, and the one base-finder;
//! - [`sized_index`]: a graph's token indexes, turns under keys found by a range of lengths.

pub mod content;
pub mod digest;
pub mod file;
pub mod json;
pub mod key_index;
pub mod link_key;
pub mod packed;
pub mod packed_check;
pub mod requests;
pub mod sized_index;
