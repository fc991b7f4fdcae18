//! The version-1 frame reader never panics: any bytes are read in order to the end or to the
//! first damage, which is told a torn tail or not, with hashing bounded by a multiple of the
//! input; every frame it reads is one the encoder writes byte for byte.

#![no_main]

use engine::file::frames::{Counters, DamageKind};
use engine::file::frames_v1::{encode_frame, scan};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut counters = Counters::default();
    let got = scan(data, 0, 0, &mut counters);
    let mut at = 0;
    for (number, frame) in got.frames.iter().enumerate() {
        assert_eq!((frame.offset, frame.record), (at, number as u64));
        let stored = &data[frame.offset..frame.end];
        assert_eq!(
            encode_frame(frame.kind, frame.payload(data)).unwrap(),
            stored
        );
        at = frame.end;
    }
    assert_eq!(got.offset, at);
    match &got.stop {
        None => assert_eq!(at, data.len()),
        Some(stop) => {
            assert_eq!(stop.damage.offset, at);
            assert!(stop.resync.is_none());
            if stop.damage.kind == DamageKind::HeaderCut {
                assert!(stop.torn);
            }
        }
    }
    // each frame's payload once, and what telling damage from a torn tail may hash
    let bound = 3 * data.len() as u64 + (1 << 20);
    assert!(counters.hashed_bytes <= bound);
});
