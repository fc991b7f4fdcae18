//! Parse, write, parse again: the second value equals the first (floats by their bits), and
//! writing it again gives the same bytes.
#![no_main]

use engine::json::{parse, to_json, DEFAULT_MAX_DEPTH};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = parse(data, DEFAULT_MAX_DEPTH) else {
        return;
    };
    let text = to_json(&value);
    let again = parse(&text, DEFAULT_MAX_DEPTH).expect("written JSON parses");
    assert!(again == value, "round trip changed the value");
    assert_eq!(to_json(&again), text, "writing is not stable");
});
