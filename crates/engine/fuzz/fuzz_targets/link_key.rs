//! Arbitrary bytes as packed messages through the loose link key: it never panics, a key is
//! the same each time it is taken, and `echoes` says what the two keys say. The input is a
//! response and a message split at the first 0xc1 byte (never a msgpack type), or one
//! packing that is both.
#![no_main]

use engine::link_key::{echoes, link_key};
use libfuzzer_sys::fuzz_target;

const DIGITS: usize = 4300;

fuzz_target!(|data: &[u8]| {
    let (response, message) = match data.iter().position(|&b| b == 0xc1) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, data),
    };
    let key = link_key(message, false, DIGITS);
    assert_eq!(key, link_key(message, false, DIGITS));
    let as_response = link_key(response, true, DIGITS);
    let echoed = echoes(response, message, DIGITS);
    match (as_response, key) {
        (Ok(r), Ok(m)) => assert_eq!(echoed, Ok(matches!((r, m), (Some(r), Some(m)) if r == m))),
        _ => assert!(echoed.is_err()),
    }
});
