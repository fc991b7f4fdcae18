//! The compact BLAKE3 state (`digest::State`) over any input fed in any pieces: its digest at
//! every piece, and a copy's that goes on from any piece, are BLAKE3's of the bytes so far.
//! The input: a repeat count, eight piece sizes (around chunk and subtree edges), then the
//! bytes repeated that many times (up to 256 KiB from a 4 KiB input).
#![no_main]

use engine::digest::State;
use libfuzzer_sys::fuzz_target;

const CHUNK: usize = 1024;

fn piece(code: u8) -> usize {
    let n = usize::from(code >> 2);
    match code & 3 {
        0 => n,
        1 => CHUNK * n,
        2 => (CHUNK * n).saturating_sub(1),
        _ => CHUNK * n + 1,
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let times = usize::from(data[0] % 64) + 1;
    let sizes: Vec<usize> = data[1..9].iter().map(|&c| piece(c)).collect();
    let input = data[9..].repeat(times);
    let mut state = State::new();
    let mut copy: Option<(usize, State)> = None;
    let mut at: usize = 0;
    for (i, size) in sizes.into_iter().chain([usize::MAX]).enumerate() {
        let end = at.saturating_add(size).min(input.len());
        state.update(&input[at..end]);
        at = end;
        assert_eq!(state.digest(), *blake3::hash(&input[..at]).as_bytes());
        assert_eq!(state.len(), at as u64);
        if i == usize::from(data[0] >> 6) {
            copy = Some((at, state.clone()));
        }
    }
    if let Some((from, mut copy)) = copy {
        copy.update(&input[from..]);
        assert_eq!(copy.digest(), state.digest());
    }
});
