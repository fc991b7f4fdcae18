//! Arbitrary bytes into the packed-value reader: a value or an error, never a panic; what
//! reads packs back to bytes that read as the same value.
#![no_main]

use engine::packed::{to_packed, unpack};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = unpack(data) {
        let packed = to_packed(&value);
        let again = unpack(&packed).expect("a packing reads back");
        assert_eq!(to_packed(&again), packed);
    }
});
