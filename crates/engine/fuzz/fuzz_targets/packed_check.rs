//! Arbitrary bytes into the stored-value check: a verdict, never a panic. A value it passes
//! with no blob reference, echo or extension type reads back (the plain reader refuses only
//! keys that are not strings, which recorded values may hold), and the blob references it
//! lists are blob references.
#![no_main]

use engine::packed::unpack;
use engine::packed_check::{check, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, data)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        n_blobs: u64::from(flags & 3),
        max_depth: 1 + usize::from(flags >> 2 & 15) * 40,
        echo_ok: flags & 64 != 0,
        record: flags & 128 != 0,
        max_containers: (flags & 128 != 0).then_some(usize::from(flags & 63)),
    };
    if let Ok(found) = check(data, limits, &mut |index| index == 1) {
        for &at in &found.blob_refs {
            let at = at as usize;
            assert_eq!(data[at..at + 2], [0xD6, 0x04]);
        }
        let plain = found.blob_refs.is_empty() && found.echoes == 0 && !found.special;
        if plain && !limits.record {
            if let Err(err) = unpack(data) {
                assert_eq!(err.reason, "a dict key that is not a string", "{err}");
            }
        }
    }
});
