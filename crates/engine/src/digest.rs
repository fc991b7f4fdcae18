//! Digests of packed request prefixes: BLAKE3 over the plain packings of a request's messages,
//! fed in pieces whose sizes let BLAKE3 run at full speed, and the compact BLAKE3 state the
//! graph keeps between turns.
//!
//! A stored request is found by the BLAKE3 digest of its messages' packings (its first 8
//! bytes the index key, all 32 confirm the match: BLAKE3 collisions cannot be crafted, so a
//! digest match stands for a byte comparison). BLAKE3 hashes fastest on updates of many whole
//! 1 KiB chunks starting at a multiple of their count, so [`PrefixHasher`] holds packed bytes
//! back until a multiple of [`ALIGN`] can go at once; the digest is that of the bytes fed,
//! whatever the pieces.
//!
//! A state kept to go on from later (a tip's) is a [`State`]: `blake3::Hasher` holds room for
//! the chaining values of a 2^54-chunk input inline (about 1.9 KB whatever was hashed); a
//! `State` holds the chaining values its input has (one per set bit of its chunk count) and
//! the bytes of its last chunk, and builds the tree with the crate's `hazmat` functions, as
//! `Hasher` does.

use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};

/// A BLAKE3 chunk's bytes.
const CHUNK: usize = blake3::CHUNK_LEN;

/// A BLAKE3 state that keeps only what its input needs (see the module): the chaining values
/// of its complete subtrees (one per set bit of its chunk count once input follows them; the
/// last one pushed is merged only then, so no root is merged early), and the bytes of its
/// current chunk, which is not hashed until input follows it (it may be the root).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct State {
    stack: Vec<[u8; 32]>,
    /// chunks whose chaining values are in `stack` (merged or not)
    chunks: u64,
    /// the current chunk's bytes (at most a chunk)
    tail: Vec<u8>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("len", &self.len())
            .field("stack", &self.stack.len())
            .finish_non_exhaustive()
    }
}

impl State {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes hashed so far.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.chunks * CHUNK as u64 + self.tail.len() as u64
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of heap the state holds.
    #[must_use]
    pub fn nbytes(&self) -> usize {
        self.stack.capacity() * 32 + self.tail.capacity()
    }

    /// The chaining value of a subtree of whole chunks (`data`) starting at chunk `at`.
    fn subtree(at: u64, data: &[u8]) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new();
        hasher.set_input_offset(at * CHUNK as u64);
        hasher.update(data);
        hasher.finalize_non_root()
    }

    /// Merge the stack down to one chaining value per set bit of `chunks` (`Hasher`'s lazy
    /// merge: what is pushed next is not merged before input follows it).
    fn merge(&mut self, chunks: u64) {
        let keep = chunks.count_ones() as usize;
        while self.stack.len() > keep {
            let right = self.stack.pop().unwrap_or_default();
            let left = self.stack.pop().unwrap_or_default();
            self.stack
                .push(merge_subtrees_non_root(&left, &right, Mode::Hash));
        }
    }

    fn push(&mut self, cv: [u8; 32], at: u64) {
        self.merge(at);
        // (grown one at a time: a kept state holds no spare room)
        self.stack.reserve_exact(1);
        self.stack.push(cv);
    }

    /// Feed `input`.
    pub fn update(&mut self, mut input: &[u8]) {
        if !self.tail.is_empty() {
            let take = (CHUNK - self.tail.len()).min(input.len());
            self.tail.reserve_exact(take);
            self.tail.extend_from_slice(&input[..take]);
            input = &input[take..];
            if input.is_empty() {
                return;
            }
            // a full chunk with input after it: not the root
            let cv = Self::subtree(self.chunks, &self.tail);
            self.push(cv, self.chunks);
            self.chunks += 1;
            self.tail = Vec::new();
        }
        while input.len() > CHUNK {
            // the largest power-of-two run of chunks that divides the chunks so far (as
            // `Hasher::update` takes them: a wide one hashed at full speed)
            let mut size = 1usize << (usize::BITS - 1 - input.len().leading_zeros());
            while (size as u64 / CHUNK as u64 - 1) & self.chunks != 0 {
                size /= 2;
            }
            let n = (size / CHUNK) as u64;
            if self.chunks == 0 && size == input.len() {
                // the whole input so far, which may stay the whole: its root is the parent of
                // its halves, pushed apart (merged once input follows them, as a non-root)
                let half = size / 2;
                let left = Self::subtree(0, &input[..half]);
                let right = Self::subtree(n / 2, &input[half..size]);
                self.push(left, 0);
                self.push(right, n / 2);
            } else {
                // a subtree with input before or after it: never the root
                let cv = Self::subtree(self.chunks, &input[..size]);
                self.push(cv, self.chunks);
            }
            self.chunks += n;
            input = &input[size..];
        }
        if !input.is_empty() {
            self.tail = input.to_vec();
            // input follows what is on the stack: none of it is the root
            self.merge(self.chunks);
        }
    }

    /// The digest of everything fed (the state goes on).
    #[must_use]
    pub fn digest(&self) -> [u8; 32] {
        if self.stack.is_empty() {
            return *blake3::hash(&self.tail).as_bytes();
        }
        let mut at = self.stack.len();
        let mut cv = if self.tail.is_empty() {
            // the last subtree pushed (two are, at least: see `update`)
            at -= 1;
            self.stack[at]
        } else {
            Self::subtree(self.chunks, &self.tail)
        };
        while at > 1 {
            at -= 1;
            cv = merge_subtrees_non_root(&self.stack[at], &cv, Mode::Hash);
        }
        *merge_subtrees_root(&self.stack[0], &cv, Mode::Hash).as_bytes()
    }
}

/// Updates are multiples of this many bytes (but the last).
pub const ALIGN: usize = 1 << 16;

/// A BLAKE3 state fed packed bytes in aligned pieces.
#[derive(Clone, Default)]
pub struct PrefixHasher {
    hasher: State,
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
    pub fn resume(state: State, fed: u64) -> Self {
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
            return self.hasher.digest();
        }
        let mut last = self.hasher.clone();
        last.update(&self.pending);
        last.digest()
    }

    /// The digest of everything fed, the bytes held back hashed first: for digests at many
    /// points of one stream (each costs a finalization, not a copy of the state and a second
    /// hashing of what was held back).
    pub fn digest_here(&mut self) -> [u8; 32] {
        if !self.pending.is_empty() {
            self.hasher.update(&self.pending);
            self.pending.clear();
        }
        self.hasher.digest()
    }

    /// The BLAKE3 state that has seen everything fed, holding no pending buffer (what a tip
    /// keeps between turns).
    pub fn finish(mut self) -> State {
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

    /// Sizes around chunk and subtree edges, and a few large ones.
    fn edges() -> Vec<usize> {
        let mut sizes = vec![0, 1, 63, 64, 65, 1000];
        for k in 0..8 {
            let n = CHUNK << k;
            sizes.extend([n - 1, n, n + 1, n + 31, 3 * n - 7]);
        }
        sizes.extend([200 * 1024 + 17, 3 * ALIGN + 1]);
        sizes
    }

    #[test]
    fn a_state_digests_as_blake3_whatever_the_pieces() {
        for size in edges() {
            let data = sample(size);
            let whole = digest(&data);
            let mut once = State::new();
            once.update(&data);
            assert_eq!(once.digest(), whole, "{size} at once");
            assert_eq!(once.len(), size as u64);
            for step in [
                1usize,
                5,
                100,
                1023,
                1024,
                1025,
                4096,
                7777,
                ALIGN,
                2 * ALIGN + 1024,
            ] {
                let mut state = State::new();
                for (i, piece) in data.chunks(step).enumerate() {
                    state.update(piece);
                    if i % 97 == 0 {
                        let so_far = ((i + 1) * step).min(size);
                        assert_eq!(state.digest(), digest(&data[..so_far]), "{size}/{step}");
                    }
                }
                assert_eq!(state.digest(), whole, "{size} in pieces of {step}");
            }
        }
    }

    #[test]
    fn a_state_copied_anywhere_goes_on_alone() {
        let data = sample(5 * CHUNK * 8 + 333);
        let mut state = State::new();
        let mut copies = Vec::new();
        for (i, piece) in data.chunks(1500).enumerate() {
            state.update(piece);
            copies.push(((i + 1) * 1500, state.clone()));
        }
        for (at, mut copy) in copies {
            let at = at.min(data.len());
            assert_eq!(copy.digest(), digest(&data[..at]));
            copy.update(&data[at..]);
            assert_eq!(copy.digest(), digest(&data), "resumed at {at}");
        }
    }

    #[test]
    fn a_state_holds_a_chaining_value_a_set_bit_and_at_most_a_chunk() {
        let data = sample(215 * CHUNK + 500);
        let mut state = State::new();
        for piece in data.chunks(3000) {
            state.update(piece);
        }
        assert!(state.tail.len() <= CHUNK);
        assert!(state.stack.len() <= 215u64.count_ones() as usize + 1);
        assert!(state.nbytes() <= 10 * 32 + CHUNK, "{}", state.nbytes());
        assert_eq!(State::new().digest(), digest(b""));
    }

    #[test]
    fn drain_empties_the_buffer_and_keeps_its_capacity() {
        let mut buffer = sample(3000);
        let mut h = PrefixHasher::new();
        h.drain(&mut buffer);
        assert!(buffer.is_empty() && buffer.capacity() >= 3000);
        assert_eq!(h.digest(), digest(&sample(3000)));
        assert_eq!(PrefixHasher::new().digest(), digest(b""));
        assert_eq!(h.finish().digest(), digest(&sample(3000)));
    }
}
