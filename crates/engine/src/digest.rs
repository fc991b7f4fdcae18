//! Digests of packed request prefixes: BLAKE3 over the plain packings of a request's messages,
//! fed in pieces whose sizes let BLAKE3 run at full speed.
//!
//! A stored request is found by the BLAKE3 digest of its messages' packings (its first 8
//! bytes the index key, all 32 confirm the match: BLAKE3 collisions cannot be crafted, so a
//! digest match stands for a byte comparison). BLAKE3 hashes fastest on updates of many whole
//! 1 KiB chunks starting at a multiple of their count, so [`PrefixHasher`] holds packed bytes
//! back until a multiple of [`ALIGN`] can go at once; the digest is that of the bytes fed,
//! whatever the pieces.

/// Updates are multiples of this many bytes (but the last).
pub const ALIGN: usize = 1 << 16;

/// A BLAKE3 state fed packed bytes in aligned pieces.
#[derive(Clone, Default)]
pub struct PrefixHasher {
    hasher: blake3::Hasher,
    /// fed but not yet hashed: less than `ALIGN` bytes unless a large piece is on its way
    pending: Vec<u8>,
    fed: u64,
}

impl PrefixHasher {
    pub fn new() -> Self {
        Self::default()
    }

    /// A hasher that goes on from `state`, a state [`finish`](Self::finish) gave after
    /// `fed` bytes.
    pub fn resume(state: blake3::Hasher, fed: u64) -> Self {
        Self {
            hasher: state,
            pending: Vec::new(),
            fed,
        }
    }

    /// Bytes fed so far.
    pub fn fed(&self) -> u64 {
        self.fed
    }

    /// Feeds `data` (hashed now where it completes an aligned piece, else held back).
    pub fn update(&mut self, mut data: &[u8]) {
        self.fed += data.len() as u64;
        if !self.pending.is_empty() {
            let need = ALIGN - self.pending.len();
            if data.len() < need {
                self.pending.extend_from_slice(data);
                return;
            }
            self.pending.extend_from_slice(&data[..need]);
            self.hasher.update(&self.pending);
            self.pending.clear();
            data = &data[need..];
        }
        let cut = data.len() - data.len() % ALIGN;
        if cut > 0 {
            self.hasher.update(&data[..cut]);
        }
        self.pending.extend_from_slice(&data[cut..]);
    }

    /// Feeds the bytes of `buffer` and empties it, keeping its capacity (the packer's buffer
    /// is filled and drained this way).
    pub fn drain(&mut self, buffer: &mut Vec<u8>) {
        self.update(buffer);
        buffer.clear();
    }

    /// The digest of everything fed (the state goes on).
    pub fn digest(&self) -> [u8; 32] {
        if self.pending.is_empty() {
            return *self.hasher.finalize().as_bytes();
        }
        let mut last = self.hasher.clone();
        last.update(&self.pending);
        *last.finalize().as_bytes()
    }

    /// The digest of everything fed, the bytes held back hashed first: for digests at many
    /// points of one stream (each costs a finalization, not a copy of the state and a second
    /// hashing of what was held back).
    pub fn digest_here(&mut self) -> [u8; 32] {
        if !self.pending.is_empty() {
            self.hasher.update(&self.pending);
            self.pending.clear();
        }
        *self.hasher.finalize().as_bytes()
    }

    /// The BLAKE3 state that has seen everything fed, holding no pending buffer (a state
    /// kept between turns is BLAKE3's own, about 2 KB).
    pub fn finish(mut self) -> blake3::Hasher {
        self.hasher.update(&self.pending);
        self.hasher
    }
}

/// The BLAKE3 digest of `data` at once.
pub fn digest(data: &[u8]) -> [u8; 32] {
    *blake3::hash(data).as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn pieces_of_any_size_give_the_digest_of_the_whole() {
        let data = sample(5 * ALIGN + 1234);
        let whole = digest(&data);
        for step in [1usize, 7, 1000, ALIGN - 1, ALIGN, ALIGN + 3, 3 * ALIGN] {
            let mut h = PrefixHasher::new();
            for piece in data.chunks(step.max(1)) {
                h.update(piece);
            }
            assert_eq!(h.digest(), whole, "pieces of {step}");
            assert_eq!(h.fed(), data.len() as u64);
        }
    }

    #[test]
    fn a_digest_midway_leaves_the_state_going_on() {
        let data = sample(ALIGN + 100);
        let mut h = PrefixHasher::new();
        h.update(&data[..ALIGN / 2]);
        assert_eq!(h.digest(), digest(&data[..ALIGN / 2]));
        let copy = h.clone();
        h.update(&data[ALIGN / 2..]);
        assert_eq!(h.digest(), digest(&data));
        assert_eq!(copy.digest(), digest(&data[..ALIGN / 2]));
    }

    #[test]
    fn a_finished_state_resumed_goes_on_as_the_whole() {
        let data = sample(3 * ALIGN + 77);
        let mut h = PrefixHasher::new();
        h.update(&data[..ALIGN + 5]);
        let mut resumed = PrefixHasher::resume(h.finish(), (ALIGN + 5) as u64);
        resumed.update(&data[ALIGN + 5..]);
        assert_eq!(resumed.digest(), digest(&data));
        assert_eq!(resumed.fed(), data.len() as u64);
    }

    #[test]
    fn digests_here_and_there_are_those_of_the_bytes_so_far() {
        let data = sample(2 * ALIGN + 999);
        let mut h = PrefixHasher::new();
        for (i, piece) in data.chunks(777).enumerate() {
            h.update(piece);
            let so_far = ((i + 1) * 777).min(data.len());
            if i % 3 == 0 {
                assert_eq!(h.digest_here(), digest(&data[..so_far]));
            } else {
                assert_eq!(h.digest(), digest(&data[..so_far]));
            }
        }
        assert_eq!(h.fed(), data.len() as u64);
    }

    #[test]
    fn drain_empties_the_buffer_and_keeps_its_capacity() {
        let mut buffer = sample(3000);
        let mut h = PrefixHasher::new();
        h.drain(&mut buffer);
        assert!(buffer.is_empty() && buffer.capacity() >= 3000);
        assert_eq!(h.digest(), digest(&sample(3000)));
        assert_eq!(PrefixHasher::new().digest(), digest(b""));
        assert_eq!(h.finish().finalize().as_bytes(), &digest(&sample(3000)));
    }
}
