//! Arbitrary bytes into the token id readers and the top-level field scan: they never panic,
//! and what they read is what the full parser reads there (an array of those ints; each
//! field's last value).
#![no_main]

use engine::json::scan::fields;
use engine::json::{member_ids, parse, u32_ids, Value, DEFAULT_MAX_DEPTH};
use libfuzzer_sys::fuzz_target;

fn ids_of(packed: &[u8]) -> Vec<i64> {
    packed
        .chunks_exact(4)
        .map(|c| i64::from(u32::from_ne_bytes(c.try_into().unwrap())))
        .collect()
}

fn agrees(text: &[u8], packed: &[u8]) {
    let Ok(Value::Array(items)) = parse(text, DEFAULT_MAX_DEPTH) else {
        panic!("ids read from text the parser does not read as an array");
    };
    let ints: Vec<i64> = items
        .iter()
        .map(|v| match v {
            Value::Int(i) => *i,
            _ => panic!("ids read from an array of something else"),
        })
        .collect();
    assert_eq!(ints, ids_of(packed));
}

fuzz_target!(|data: &[u8]| {
    if let Some(packed) = u32_ids(data) {
        agrees(data, &packed);
    }
    if let Some(found) = member_ids(data, b"ids") {
        agrees(&data[found.start..found.end], &found.packed);
    }
    if let (Some(found), Ok(Value::Object(members))) =
        (fields(data), parse(data, DEFAULT_MAX_DEPTH))
    {
        // the parser keeps each key once, at its first place, with its last value
        let mut last: Vec<(&str, usize, usize)> = Vec::new();
        for (key, start, end) in found {
            match last.iter_mut().find(|(k, _, _)| *k == key) {
                Some(place) => *place = (key, start, end),
                None => last.push((key, start, end)),
            }
        }
        assert_eq!(last.len(), members.len());
        for ((key, start, end), (name, value)) in last.into_iter().zip(&members) {
            assert_eq!(key.as_bytes(), name.bytes());
            assert_eq!(
                parse(&data[start..end], DEFAULT_MAX_DEPTH).ok().as_ref(),
                Some(value)
            );
        }
    }
});
