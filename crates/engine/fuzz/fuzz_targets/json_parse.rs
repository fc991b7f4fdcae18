//! Arbitrary bytes into the parser: it returns a value or an error, never panics.
#![no_main]

use engine::json::{parse, to_json, DEFAULT_MAX_DEPTH};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = parse(data, DEFAULT_MAX_DEPTH) {
        // whatever parses can be written
        let _ = to_json(&value);
    }
});
