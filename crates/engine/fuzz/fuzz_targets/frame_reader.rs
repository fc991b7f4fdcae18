//! The frame reader never panics: any bytes are read in order, resynced past damage and
//! their damaged stretches classified, or refused with a `Damage`.

#![no_main]

use engine::file::frames::{read_gap, scan, Counters, Kinds};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let kinds = Kinds {
        digest: 1 << 1 | u128::from(first & 1) << 4,
        max: first >> 1 & 0x0F,
    };
    let mut counters = Counters::default();
    let (mut offset, mut chain, mut record) = (0, 0, 0);
    loop {
        let got = scan(data, offset, chain, record, kinds, &mut counters);
        let Some(stop) = got.stop else {
            break;
        };
        let Some(resync) = stop.resync else {
            break;
        };
        assert!(resync > got.offset);
        let gap = read_gap(
            data,
            got.offset,
            resync,
            got.chain,
            got.record,
            kinds,
            &mut Counters::default(),
        );
        if let Some(frame) = &gap.repaired {
            let _ = frame.payload(data);
        }
        offset = resync;
        chain = u64::from_le_bytes(data[resync + 10..resync + 18].try_into().unwrap());
        record = got.record + 1;
    }
    assert!(counters.hashed_bytes <= 4 * data.len() as u64 + 64);
});
