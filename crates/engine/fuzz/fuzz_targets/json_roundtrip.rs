//! Parse, write, parse again: writing the second value gives the same bytes, and the value is
//! the same (floats by their bits) unless a string holds a high surrogate right before a low
//! one: written as two escapes, those read back joined, in `json.loads` as here.
#![no_main]

use engine::json::{parse, to_json, Value, DEFAULT_MAX_DEPTH};
use libfuzzer_sys::fuzz_target;

/// Generalized UTF-8 of a high surrogate (`ED A0..AF ..`) followed by a low one (`ED B0..BF ..`).
fn joins(bytes: &[u8]) -> bool {
    bytes.windows(6).any(|w| {
        w[0] == 0xED
            && (0xA0..=0xAF).contains(&w[1])
            && w[3] == 0xED
            && (0xB0..=0xBF).contains(&w[4])
    })
}

fn has_joining_pair(value: &Value) -> bool {
    match value {
        Value::Str(s) => joins(s.bytes()),
        Value::Array(items) => items.iter().any(has_joining_pair),
        Value::Object(members) => members
            .iter()
            .any(|(k, v)| joins(k.bytes()) || has_joining_pair(v)),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = parse(data, DEFAULT_MAX_DEPTH) else {
        return;
    };
    let text = to_json(&value);
    let again = parse(&text, DEFAULT_MAX_DEPTH).expect("written JSON parses");
    assert_eq!(to_json(&again), text, "writing is not stable");
    if !has_joining_pair(&value) {
        assert!(again == value, "round trip changed the value");
    }
});
