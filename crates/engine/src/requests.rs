//! The request table: each filed request of a graph as a row of numbers, the index that finds
//! rows by their digest, and the one base-finder.
//!
//! A request's non-system messages arrive as their plain packings (the engine's canonical
//! packing, every string inline: what `Packer(None, None)` writes for a Python value, and
//! what the JSON transcoder writes for a raw text). A request re-sends an earlier one and adds
//! a few messages, so it is stored as that earlier request, its *base*, plus a tail. The base
//! is the longest filed request whose messages are exactly the request's first ones: found by
//! the BLAKE3 digest of the packings at each message boundary where some filed request ends
//! (the lengths index says where), longest first, in the one index (the digest's first 8
//! bytes to rows; the full 32 bytes confirm, since BLAKE3 collisions cannot be crafted and a
//! digest match stands for a byte comparison). Of requests filed alike (twins: a retry, the
//! samples of a group) the first filed is the base. The message right after the base's is an
//! *echo* when it is exactly the base's response: the tail keeps a placeholder for it. A row
//! keeps its response as the xxh3 of its packing (the graph keeps the bytes): an echo found
//! by it is a candidate the caller confirms by comparing the bytes, since xxh3 collisions can
//! be crafted.
//!
//! A raw text of messages (the JSON array a harness or a capture server sends) is read as
//! `json.loads` reads it and transcoded straight into plain packings, with no Python object
//! between. Most re-send the text of the conversation's latest raw turn and add a few items:
//! that turn is a *raw tip*, which keeps the BLAKE3 digest of its text up to its last item and
//! the BLAKE3 state of its packings there. A text whose bytes up to a tip's end hash to that
//! digest holds the tip's messages, byte for byte, so only its new items are read and packed,
//! and its packings' digests go on from the tip's state. The base is then found exactly as for
//! any request, in the same index: a tip saves reading, never decides.
//!
//! A row costs its digest, its message count and its response's xxh3: no object per request.

use crate::digest::{PrefixHasher, State};
use crate::json::{self as ej, ParseError};
use crate::packed::{to_packed, write_array_header, EXT_ECHO};
use xxhash_rust::xxh3::xxh3_64;

/// A turn's number in its graph (its index there).
pub type TurnNo = u32;

/// Bytes of a request digest (BLAKE3).
pub const DIGEST_SIZE: usize = 32;

/// The packing of the echo placeholder: an ext of type `EXT_ECHO` with no payload, as msgpack
/// writes it (`ext 8`, length 0).
#[allow(clippy::cast_sign_loss)]
pub const ECHO_PACKED: [u8; 3] = [0xc7, 0x00, EXT_ECHO as u8];

/// Raw tips kept (the latest raw turn of each conversation, the oldest let go first).
pub const MAX_RAW_TIPS: usize = 64;

/// Bytes at the start of a text whose xxh3 picks the tips worth a BLAKE3 of the text.
const RAW_HEAD: usize = 4096;

/// JSON's whitespace.
fn is_ws(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\r' | b'\n')
}

/// Where the last item of a JSON array text ends (before its closing bracket and the
/// whitespace around it), or None when the text does not end with a bracket after an item.
fn raw_end(text: &[u8]) -> Option<usize> {
    let mut end = text.len();
    while end > 0 && is_ws(text[end - 1]) {
        end -= 1;
    }
    if end < 2 || text[end - 1] != b']' {
        return None;
    }
    end -= 1;
    while end > 0 && is_ws(text[end - 1]) {
        end -= 1;
    }
    (end > 1 && text[end - 1] != b'[').then_some(end)
}

/// The latest raw turn of a conversation: what a text that re-sends it needs to skip it.
#[derive(Clone)]
struct RawTip {
    turn: TurnNo,
    /// where its last item ends in its text
    end: usize,
    /// xxh3 of its text's first `min(RAW_HEAD, end)` bytes
    head: u64,
    /// BLAKE3 of its text up to `end`
    text_digest: [u8; DIGEST_SIZE],
    /// the BLAKE3 state of its messages' packings, and how many bytes they are
    packings: State,
    packed: u64,
    n_rest: usize,
    /// the most digits of any int beyond 64 bits its messages hold
    digits: usize,
    /// how deep its text nests (its array 1): a text read with a lower bound is read whole,
    /// so that it is refused as reading it whole refuses it
    depth: usize,
}

impl std::fmt::Debug for RawTip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTip")
            .field("turn", &self.turn)
            .field("end", &self.end)
            .field("n_rest", &self.n_rest)
            .finish_non_exhaustive()
    }
}

/// Why a raw text of messages is not one `json.loads` reads as an array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawError {
    /// not JSON, or nested deeper than the bound (offset in the text)
    Syntax(ParseError),
    /// JSON, but not an array
    NotArray,
    /// an int of more digits than the limit given (`json.loads` refuses it)
    Digits { digits: usize, limit: usize },
}

impl std::fmt::Display for RawError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RawError::Syntax(e) => e.fmt(f),
            RawError::NotArray => f.write_str("expected a JSON array of messages"),
            RawError::Digits { digits, limit } => write!(
                f,
                "Exceeds the limit ({limit} digits) for integer string conversion: value has \
                 {digits} digits; use sys.set_int_max_str_digits() to increase the limit"
            ),
        }
    }
}

impl std::error::Error for RawError {}

/// Builds a text's values as [`ej::ValueBuilder`] does, refusing an int of more digits than
/// `limit` (0: none) where `json.loads` converts it, and keeping the most digits of any: a
/// repeated key's replaced value included, which the values built no longer hold but
/// `json.loads` converts (and refuses) all the same.
struct Digits {
    limit: usize,
    most: usize,
}

fn built(value: Result<ej::Value, std::convert::Infallible>) -> Result<ej::Value, RawError> {
    value.map_err(|never| match never {})
}

impl ej::Sink for Digits {
    type Value = ej::Value;
    type Error = RawError;

    fn null(&mut self) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.null())
    }

    fn bool(&mut self, value: bool) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.bool(value))
    }

    fn int(&mut self, value: i64) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.int(value))
    }

    fn big_int(&mut self, text: &str) -> Result<ej::Value, RawError> {
        let digits = text.trim_start_matches('-').len();
        if self.limit > 0 && digits > self.limit {
            return Err(RawError::Digits {
                digits,
                limit: self.limit,
            });
        }
        self.most = self.most.max(digits);
        built(ej::ValueBuilder.big_int(text))
    }

    fn float(&mut self, value: f64) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.float(value))
    }

    fn string(&mut self, value: ej::Str<'_>) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.string(value))
    }

    fn array(&mut self, items: Vec<ej::Value>) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.array(items))
    }

    fn object(&mut self, members: Vec<(ej::Key<'_>, ej::Value)>) -> Result<ej::Value, RawError> {
        built(ej::ValueBuilder.object(members))
    }
}

/// `text` read as `json.loads` reads it, ints over `max_digits` refused where it meets them,
/// and the most digits of any int it holds.
fn read_digits(
    text: &[u8],
    max_depth: usize,
    max_digits: usize,
) -> Result<(ej::Value, usize), RawError> {
    let mut sink = Digits {
        limit: max_digits,
        most: 0,
    };
    let value = ej::parse_with(text, max_depth, &mut sink).map_err(|failure| match failure {
        ej::Failure::Syntax(e) => RawError::Syntax(e),
        ej::Failure::Sink(e) => e,
    })?;
    Ok((value, sink.most))
}

/// How deep the containers of a UTF-8 JSON text the parser has read nest (its brackets
/// outside strings): as the parser's bound counts, a repeated key's replaced value included.
fn nesting(text: &[u8]) -> usize {
    let (mut depth, mut deepest, mut i) = (0usize, 0usize, 0);
    while i < text.len() {
        match text[i] {
            b'"' => {
                i = ej::scan::string_end(text, i).unwrap_or(text.len());
                continue;
            }
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    deepest
}

/// A raw text read for filing: its messages' packings from `first` on (those before are a
/// tip's, not read again), the base found, and what its own tip needs.
#[derive(Debug)]
pub struct RawFound {
    /// messages before this one were not read (they are the tip's)
    pub first: usize,
    /// the packings of messages `first..`
    pub plains: Vec<Vec<u8>>,
    pub found: Found,
    /// the tip it continued, if any
    tip: Option<TurnNo>,
    /// where its last item ends, and BLAKE3 of its text up to there (None: no tip of its own)
    text: Option<(usize, [u8; DIGEST_SIZE], u64)>,
    packings: State,
    packed: u64,
    n_rest: usize,
    digits: usize,
    depth: usize,
}

/// The index key of a digest: its first 8 bytes, little-endian (what the Python side's
/// `digest_key` gives).
pub fn digest_key(digest: &[u8; DIGEST_SIZE]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// Room for a quarter more when `rows` is full, where a `Vec` would double: a graph's rows
/// are most of what it keeps beyond its content, and a row is copied once per growth only.
fn grow<T>(rows: &mut Vec<T>) {
    if rows.len() == rows.capacity() {
        rows.reserve_exact((rows.len() / 4).max(8));
    }
}

/// The key a response's packing is kept by in its row (0 stands for no response, so a
/// packing whose xxh3 is 0 is kept as 1: an echo found by it is confirmed by the caller).
pub fn response_key(packed: &[u8]) -> u64 {
    xxh3_64(packed).max(1)
}

/// The message counts some filed request has: the boundaries worth a digest. A bitmap below
/// `BITMAP_COUNTS` (16 KiB at most), a sorted list above: a count a row may name (up to
/// `u32::MAX`) never makes the bitmap that long.
#[derive(Debug, Default)]
struct Lengths {
    words: Vec<u64>,
    large: Vec<usize>,
}

const BITMAP_COUNTS: usize = 1 << 17;

/// Boundaries a request's base is looked for at first, longest first, while bases are met
/// below the longest (see `find_from`); else the longest alone.
const WINDOW: usize = 4;

/// Finds that look at `WINDOW` boundaries first after one met its base below the longest.
const WIDE_FINDS: u32 = 64;

impl Lengths {
    fn mark(&mut self, n: usize) {
        if n >= BITMAP_COUNTS {
            if let Err(at) = self.large.binary_search(&n) {
                self.large.insert(at, n);
            }
            return;
        }
        let word = n / 64;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (n % 64);
    }

    fn has(&self, n: usize) -> bool {
        if n >= BITMAP_COUNTS {
            return self.large.binary_search(&n).is_ok();
        }
        self.words
            .get(n / 64)
            .is_some_and(|word| word >> (n % 64) & 1 == 1)
    }

    fn nbytes(&self) -> usize {
        self.words.capacity() * 8 + self.large.capacity() * std::mem::size_of::<usize>()
    }
}

/// A request's packings, one a message: separate byte strings, or one buffer with the offset
/// where each ends ([`PackedRun`]), whose runs of messages are then hashed in one update
/// rather than copied piece by piece into the hasher's pending bytes.
pub trait Packings {
    /// Messages.
    fn count(&self) -> usize;
    /// The packing of message `i`.
    fn item(&self, i: usize) -> &[u8];
    /// Feed the packings of messages `range` to `hasher`.
    fn feed(&self, hasher: &mut PrefixHasher, range: std::ops::Range<usize>) {
        for i in range {
            hasher.update(self.item(i));
        }
    }
}

impl<P: AsRef<[u8]>> Packings for [P] {
    fn count(&self) -> usize {
        self.len()
    }

    fn item(&self, i: usize) -> &[u8] {
        self[i].as_ref()
    }
}

/// Packings written one after the other into one buffer, with the offset where each ends.
pub struct PackedRun<'a> {
    pub buffer: &'a [u8],
    pub ends: &'a [usize],
}

impl PackedRun<'_> {
    fn start(&self, i: usize) -> usize {
        if i == 0 {
            0
        } else {
            self.ends[i - 1]
        }
    }
}

impl Packings for PackedRun<'_> {
    fn count(&self) -> usize {
        self.ends.len()
    }

    fn item(&self, i: usize) -> &[u8] {
        &self.buffer[self.start(i)..self.ends[i]]
    }

    fn feed(&self, hasher: &mut PrefixHasher, range: std::ops::Range<usize>) {
        if !range.is_empty() {
            hasher.update(&self.buffer[self.start(range.start)..self.ends[range.end - 1]]);
        }
    }
}

/// A filed request: 36 bytes.
#[derive(Clone, Copy, Debug)]
struct Row {
    /// its request's digest; of an unconfirmed row, its key's 8 bytes then zeros
    digest: [u8; DIGEST_SIZE],
    /// its message count (below `MAX_N_REST`) and the flags above it
    count: u32,
}

/// A row's digest is known (unset: a row read from a file by its key, see `file_key`).
const CONFIRMED: u32 = 1 << 31;
/// Some turn is a row's child (a twin's continuation may move under a later twin).
const HAS_CHILDREN: u32 = 1 << 30;
/// More messages than a row counts.
const MAX_N_REST: usize = 1 << 30;

impl Row {
    fn n_rest(self) -> usize {
        (self.count & (HAS_CHILDREN - 1)) as usize
    }

    fn confirmed(self) -> bool {
        self.count & CONFIRMED != 0
    }

    fn has_children(self) -> bool {
        self.count & HAS_CHILDREN != 0
    }
}

/// What the base-finder meets at a boundary: a confirmed row, or an unconfirmed one to ask
/// about.
enum Met {
    Row(usize),
    Ask(TurnNo),
}

/// The rows by their digests' keys: an open-addressing table whose slots hold a row number
/// plus one (0: empty), one slot a key, the key read from the row's digest (its first 8
/// bytes, an unconfirmed row's key too). The rows under one key are a ring in `next` (each
/// row's next under its key, the last's the first): the slot names the last filed, so a row
/// is added under its key in constant time, and the rows are met from the first filed on.
/// A row costs 4 bytes in `next` and its key's slot's share of the spare room; a thousand
/// samples of one request are one slot and one ring.
#[derive(Debug, Default)]
struct RowIndex {
    slots: Vec<u32>,
    next: Vec<u32>,
    keys: usize,
}

impl RowIndex {
    /// The smallest table (a power of two).
    const MIN_SLOTS: usize = 8;

    /// The slot a key's probe sequence starts at (the key is a digest's bytes: uniform).
    #[allow(clippy::cast_possible_truncation)]
    fn start(&self, key: u64) -> usize {
        (key as usize) & (self.slots.len() - 1)
    }

    /// The slot holding `key` (the last row filed under it), or the empty slot it would go.
    fn slot_of(&self, key: u64, rows: &[Row]) -> usize {
        let mask = self.slots.len() - 1;
        let mut at = self.start(key);
        loop {
            let slot = self.slots[at];
            if slot == 0 || digest_key(&rows[(slot - 1) as usize].digest) == key {
                return at;
            }
            at = (at + 1) & mask;
        }
    }

    /// The rows filed under `key`, in filing order.
    fn under<'a>(&'a self, key: u64, rows: &[Row]) -> impl Iterator<Item = u32> + 'a {
        let last = if self.slots.is_empty() {
            None
        } else {
            let slot = self.slots[self.slot_of(key, rows)];
            (slot != 0).then(|| slot - 1)
        };
        let first = last.map(|last| self.next[last as usize]);
        let mut at = first;
        std::iter::from_fn(move || {
            let row = at?;
            at = (Some(row) != last).then(|| self.next[row as usize]);
            Some(row)
        })
    }

    /// File row `row` (its digest already in `rows`, after every row before it: each row is
    /// filed once, in order) under its key.
    fn insert(&mut self, row: u32, rows: &[Row]) -> Result<(), FileError> {
        let slot = row.checked_add(1).ok_or(FileError::Full)?;
        if (self.keys + 1) * 4 > self.slots.len() * 3 {
            self.grow(rows);
        }
        let at = self.slot_of(digest_key(&rows[row as usize].digest), rows);
        let last = self.slots[at];
        grow(&mut self.next);
        if last == 0 {
            self.next.push(row); // a ring of one
            self.keys += 1;
        } else {
            let last = (last - 1) as usize;
            self.next.push(self.next[last]); // after the last: the first comes next
            self.next[last] = row;
        }
        self.slots[at] = slot;
        Ok(())
    }

    /// Twice the slots, each key's slot placed again (its ring unchanged).
    fn grow(&mut self, rows: &[Row]) {
        let size = (self.slots.len() * 2).max(Self::MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![0; size]);
        for slot in old.into_iter().filter(|&slot| slot != 0) {
            let at = self.slot_of(digest_key(&rows[(slot - 1) as usize].digest), rows);
            self.slots[at] = slot;
        }
    }

    fn nbytes(&self) -> usize {
        self.slots.capacity() * 4 + self.next.capacity() * 4
    }
}

/// A boundary of a request where filed requests end, and the filed turns there that the
/// request extends, in filing order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefix {
    /// messages before the boundary
    pub len: usize,
    pub digest: [u8; DIGEST_SIZE],
    pub turns: Vec<TurnNo>,
}

/// A row read from a file, known by its request's key alone, that a request may extend: the
/// base-finder cannot decide before the caller compares the bytes and confirms or refutes it
/// (a key of 8 bytes can be made to collide).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask {
    pub turn: TurnNo,
    /// the boundary where it would be the base (its message count)
    pub len: usize,
    /// the request's digest at that boundary (what `confirm` takes when the bytes agree)
    pub digest: [u8; DIGEST_SIZE],
}

/// What the base-finder found for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    /// the filed request it extends (the longest; the first filed of twins), if any
    pub base: Option<TurnNo>,
    /// the base's message count (0 without a base)
    pub base_len: usize,
    /// the message right after the base's packs with the xxh3 of the base's response (the
    /// caller confirms it is exactly that response by comparing the bytes)
    pub echo: bool,
    /// the digest of the whole request
    pub digest: [u8; DIGEST_SIZE],
    /// an unconfirmed row met before any base (longest first, in filing order): while it is
    /// set, `base` is undecided and the request must not be filed
    pub ask: Option<Ask>,
}

impl Found {
    /// The length of the filed request met: the base's, or the unconfirmed row's.
    fn met_len(&self) -> usize {
        self.ask.as_ref().map_or(self.base_len, |ask| ask.len)
    }
}

/// Why a request cannot be filed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileError {
    /// the table holds as many rows as it can number
    Full,
    /// a turn is filed once, and after every turn filed before it
    Order { turn: TurnNo, last: Option<TurnNo> },
    /// a request of more messages than a row can count
    TooLong(usize),
    /// its base is undecided: an unconfirmed row must be confirmed or refuted first
    Undecided(TurnNo),
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::Full => f.write_str("the request table is full"),
            FileError::Order { turn, last } => match last {
                Some(last) => write!(
                    f,
                    "turn {turn} is filed after turn {last}: turns are filed in order, once"
                ),
                None => write!(f, "turn {turn} cannot be filed"),
            },
            FileError::TooLong(n) => write!(f, "a request of {n} messages cannot be filed"),
            FileError::Undecided(turn) => write!(
                f,
                "the request may extend turn {turn}, read by its key alone: confirm or refute it first"
            ),
        }
    }
}

impl std::error::Error for FileError {}

/// A graph's filed requests: rows, the index by digest key and the lengths index.
#[derive(Debug, Default)]
pub struct Requests {
    rows: Vec<Row>,
    /// the turn of each row (rows are filed in turn order, so this is increasing)
    turns: Vec<TurnNo>,
    index: RowIndex,
    lengths: Lengths,
    /// each row's response's `response_key` (0: none), from the first row filed with one
    /// (a graph files none: it confirms echoes with the bytes it holds)
    responses: Vec<u64>,
    /// the latest raw turns, oldest first
    raw_tips: Vec<RawTip>,
    /// texts read from a tip on (for tests and figures)
    raw_tip_hits: u64,
    /// rows filed by their key alone, not yet confirmed
    unconfirmed: usize,
    /// finds left that take digests at `WINDOW` boundaries first (see `find_from`)
    wide: std::cell::Cell<u32>,
}

impl Requests {
    pub fn new() -> Self {
        Self::default()
    }

    /// Filed requests.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows filed under one key, in filing order.
    fn rows_of(&self, key: u64) -> impl Iterator<Item = u32> + '_ {
        self.index.under(key, &self.rows)
    }

    /// The row of a filed turn (None: not filed).
    fn row_of(&self, turn: TurnNo) -> Option<&Row> {
        let at = self.turns.binary_search(&turn).ok()?;
        Some(&self.rows[at])
    }

    /// The message count a filed turn's request has (None: not filed).
    pub fn n_rest(&self, turn: TurnNo) -> Option<usize> {
        self.row_of(turn).map(|row| row.n_rest())
    }

    /// The digest of a filed turn's request (None: not filed, or not confirmed).
    pub fn digest(&self, turn: TurnNo) -> Option<[u8; DIGEST_SIZE]> {
        self.row_of(turn)
            .filter(|row| row.confirmed())
            .map(|row| row.digest)
    }

    /// Rows filed by their key alone and not confirmed yet.
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed
    }

    /// Confirm an unconfirmed row: the caller compared its request's bytes with a request
    /// whose digest is `digest` and found them equal. Some(true): confirmed (or confirmed
    /// already with this digest); Some(false): the digest is not under the row's key, or the
    /// row is confirmed with another, and nothing changes; None: not filed.
    pub fn confirm(&mut self, turn: TurnNo, digest: &[u8; DIGEST_SIZE]) -> Option<bool> {
        let at = self.turns.binary_search(&turn).ok()?;
        let row = &mut self.rows[at];
        if row.confirmed() {
            return Some(row.digest == *digest);
        }
        if row.digest[..8] != digest[..8] {
            return Some(false);
        }
        row.digest = *digest;
        row.count |= CONFIRMED;
        self.unconfirmed -= 1;
        Some(true)
    }

    /// The turns filed under the index key `key` (their digests' first 8 bytes, or the key
    /// a turn was filed by alone), in filing order.
    pub fn filed_under(&self, key: u64) -> Vec<TurnNo> {
        self.rows_of(key)
            .map(|row| self.turns[row as usize])
            .collect()
    }

    /// Whether a filed turn has a child (None: not filed).
    pub fn has_children(&self, turn: TurnNo) -> Option<bool> {
        self.row_of(turn).map(|row| row.has_children())
    }

    /// Note that a filed turn has a child; false when it is not filed.
    pub fn note_child(&mut self, turn: TurnNo) -> bool {
        let Ok(at) = self.turns.binary_search(&turn) else {
            return false;
        };
        self.rows[at].count |= HAS_CHILDREN;
        true
    }

    /// Every boundary of a request whose messages pack as `plains` where it extends filed
    /// turns, longest first, with those turns in filing order: what linking asks of each
    /// boundary (the message parent, the twins), in one pass over the packings. A turn filed
    /// by its key alone is named where its key is met: the caller compares the bytes.
    pub fn prefixes<P: AsRef<[u8]>>(&self, plains: &[P]) -> Vec<Prefix> {
        self.prefixes_most(plains, usize::MAX)
    }

    /// [`Requests::prefixes`] naming at most `most` turns at a boundary (the first filed):
    /// a boundary of a thousand twins costs no list of a thousand.
    pub fn prefixes_most<P: AsRef<[u8]>>(&self, plains: &[P], most: usize) -> Vec<Prefix> {
        let mut hasher = PrefixHasher::new();
        let mut found = Vec::new();
        for n in 0..=plains.len() {
            if n > 0 {
                hasher.update(plains[n - 1].as_ref());
            }
            if !self.lengths.has(n) {
                continue;
            }
            let digest = hasher.digest_here();
            let turns: Vec<TurnNo> = self
                .rows_of(digest_key(&digest))
                .filter(|&row| {
                    let row = &self.rows[row as usize];
                    // an unconfirmed row by its key and count: the caller compares bytes
                    if row.confirmed() {
                        row.digest == digest
                    } else {
                        row.n_rest() == n
                    }
                })
                .take(most)
                .map(|row| self.turns[row as usize])
                .collect();
            if !turns.is_empty() {
                found.push(Prefix {
                    len: n,
                    digest,
                    turns,
                });
            }
        }
        found.reverse();
        found
    }

    /// The index key of every prefix of a request whose messages pack as `plains`: `keys[m]`
    /// is that of its first `m` messages (a root is filed under its shorter prefixes' keys,
    /// for a turn it continues that arrives late).
    pub fn keys<P: AsRef<[u8]>>(plains: &[P]) -> Vec<u64> {
        let mut hasher = PrefixHasher::new();
        let mut keys = Vec::with_capacity(plains.len() + 1);
        keys.push(digest_key(&hasher.digest_here()));
        for plain in plains {
            hasher.update(plain.as_ref());
            keys.push(digest_key(&hasher.digest_here()));
        }
        keys
    }

    /// Whether `packed` may be a filed turn's response: its xxh3 is the one the row keeps
    /// (None: not filed; false: no response). The caller confirms with the bytes.
    pub fn echoes(&self, turn: TurnNo, packed: &[u8]) -> Option<bool> {
        let at = self.turns.binary_search(&turn).ok()?;
        let response = self.responses.get(at).copied().unwrap_or(0);
        Some(response != 0 && response == response_key(packed))
    }

    /// The base of a request whose messages pack as `plains`, and its digest; or an
    /// unconfirmed row to confirm or refute first (`Found::ask`).
    pub fn find<P: AsRef<[u8]>>(&self, plains: &[P]) -> Found {
        self.find_past(plains, &[])
    }

    /// [`Requests::find`], passing over the unconfirmed rows in `refuted` (the caller
    /// compared their bytes and found them to differ).
    pub fn find_past<P: AsRef<[u8]>>(&self, plains: &[P], refuted: &[TurnNo]) -> Found {
        let mut hasher = PrefixHasher::new();
        self.find_from(&mut hasher, 0, plains, refuted)
    }

    /// [`Requests::find_past`] for a request whose first `first` messages are known to be
    /// those of a filed request whose packings BLAKE3 `state` has seen (`fed` bytes: a tip's
    /// state), the others packing as `plains`: only those are hashed. With `None`, every
    /// message is in `plains`. Also gives the state that has seen the packings of them all
    /// and its byte count (what a tip of this request keeps).
    pub fn find_resumed<Q: Packings + ?Sized>(
        &self,
        resume: Option<(State, u64, usize)>,
        plains: &Q,
        refuted: &[TurnNo],
    ) -> (Found, State, u64) {
        let (mut hasher, first) = match resume {
            Some((state, fed, first)) => (PrefixHasher::resume(state, fed), first),
            None => (PrefixHasher::new(), 0),
        };
        let found = self.find_from(&mut hasher, first, plains, refuted);
        let fed = hasher.fed();
        (found, hasher.finish(), fed)
    }

    /// The base of a request whose first `first` messages `hasher` has seen (their packings)
    /// and whose others pack as `plains`; `hasher` then has seen them all. A base shorter
    /// than `first` messages is not looked for: the caller knows one of `first` is filed.
    ///
    /// Digests are taken only where some filed request ends (the lengths index), and first
    /// only at the longest such boundary below the request's own length: a digest ends
    /// BLAKE3's bulk hashing of the packings there (the piece of a chunk before it is hashed
    /// on its own, a chunk at a time), and a re-sent request's base is mostly the turn just
    /// before. A graph whose bases are met below it (rollouts of other lengths filed in one
    /// graph) has the `WINDOW` longest taken first, for the next `WIDE_FINDS` finds. Only
    /// when none of those is a base are the packings hashed again for the boundaries below.
    fn find_from<Q: Packings + ?Sized>(
        &self,
        hasher: &mut PrefixHasher,
        first: usize,
        plains: &Q,
        refuted: &[TurnNo],
    ) -> Found {
        let n = first + plains.count();
        // every boundary below the request's own length where some filed request ends,
        // longest first (its own length's digest is the whole request's, always taken)
        let marked: Vec<usize> = (first..n)
            .rev()
            .filter(|&at| self.lengths.has(at))
            .collect();
        let wide = self.wide.get();
        let width = if wide > 0 {
            self.wide.set(wide - 1);
            WINDOW
        } else {
            1
        };
        let (window, below) = marked.split_at(marked.len().min(width));
        let start = (!below.is_empty()).then(|| hasher.clone());
        let mut digests = Self::digests_at(hasher, first, plains, plains.count(), window);
        let digest = hasher.digest_here();
        if self.lengths.has(n) {
            digests.push((n, digest));
        }
        if let Some(found) = self.first_met(&digests, plains, first, n, digest, refuted) {
            if window.len() > 1 && found.met_len() < window[0] {
                self.wide.set(WIDE_FINDS);
            }
            return found;
        }
        if let Some(mut again) = start {
            let upto = below[0] - first;
            let mut digests = Self::digests_at(&mut again, first, plains, upto, below);
            digests.push((below[0], again.digest_here()));
            if let Some(found) = self.first_met(&digests, plains, first, n, digest, refuted) {
                self.wide.set(WIDE_FINDS);
                return found;
            }
        }
        Found {
            base: None,
            base_len: 0,
            echo: false,
            digest,
            ask: None,
        }
    }

    /// The digests at `boundaries` (longest first) of the stream `hasher` has seen up to
    /// message `first`, then the packings of messages `..upto` of `plains`: shortest first,
    /// those at `first + upto` and beyond excluded (the caller takes that one from the
    /// hasher, which has then seen them all). The packings between two boundaries go in one
    /// feed.
    fn digests_at<Q: Packings + ?Sized>(
        hasher: &mut PrefixHasher,
        first: usize,
        plains: &Q,
        upto: usize,
        boundaries: &[usize],
    ) -> Vec<(usize, [u8; DIGEST_SIZE])> {
        let mut digests = Vec::with_capacity(boundaries.len());
        let mut fed = 0;
        for &at in boundaries.iter().rev() {
            let i = at - first;
            if i >= upto {
                break;
            }
            plains.feed(hasher, fed..i);
            fed = i;
            digests.push((at, hasher.digest_here()));
        }
        plains.feed(hasher, fed..upto);
        digests
    }

    /// The base met first among `digests` (shortest first), checked longest first, for a
    /// request of `n` messages whose digest is `digest`.
    fn first_met<Q: Packings + ?Sized>(
        &self,
        digests: &[(usize, [u8; DIGEST_SIZE])],
        plains: &Q,
        first: usize,
        n: usize,
        digest: [u8; DIGEST_SIZE],
        refuted: &[TurnNo],
    ) -> Option<Found> {
        for &(at, ref prefix) in digests.iter().rev() {
            let Some(met) = self.met(prefix, at, refuted) else {
                continue;
            };
            return Some(match met {
                Met::Ask(turn) => Found {
                    base: None,
                    base_len: 0,
                    echo: false,
                    digest,
                    ask: Some(Ask {
                        turn,
                        len: at,
                        digest: *prefix,
                    }),
                },
                Met::Row(row) => {
                    let response = self.responses.get(row).copied().unwrap_or(0);
                    let echo = at < n
                        && response != 0
                        && response == response_key(plains.item(at - first));
                    Found {
                        base: Some(self.turns[row]),
                        base_len: at,
                        echo,
                        digest,
                        ask: None,
                    }
                }
            });
        }
        None
    }

    /// Read the raw JSON text of a request's non-system messages (an array) as `json.loads`
    /// reads it, from the latest raw tip it re-sends if any, and find its base. `max_digits`:
    /// the most digits an int may have (0: no limit), as the process's `json.loads` allows.
    ///
    /// # Errors
    /// [`RawError`]: text `json.loads` refuses, or not an array.
    pub fn find_raw(
        &self,
        text: &[u8],
        max_depth: usize,
        max_digits: usize,
    ) -> Result<RawFound, RawError> {
        self.find_raw_past(text, max_depth, max_digits, &[])
    }

    /// [`Requests::find_raw`], passing over the unconfirmed rows in `refuted`.
    ///
    /// # Errors
    /// As [`Requests::find_raw`].
    pub fn find_raw_past(
        &self,
        text: &[u8],
        max_depth: usize,
        max_digits: usize,
        refuted: &[TurnNo],
    ) -> Result<RawFound, RawError> {
        let end = raw_end(text);
        // a tip nested deeper than this read allows is not read from: its text is refused
        let tip = end
            .and_then(|_| self.raw_tip_of(text))
            .filter(|(tip, _)| tip.depth <= max_depth);
        if let Some((tip, text_hasher)) = tip {
            // the text after the tip's items: `, item, ... ]` (or `]`: no new item)
            let after = &text[tip.end..];
            let skip = after.iter().take_while(|&&b| is_ws(b)).count();
            let new_items = if after.get(skip) == Some(&b',') {
                let mut rest = Vec::with_capacity(after.len() - skip);
                rest.push(b'[');
                rest.extend_from_slice(&after[skip + 1..]);
                match read_digits(&rest, max_depth, max_digits) {
                    Ok((ej::Value::Array(items), digits)) if !items.is_empty() => {
                        Some((items, digits, nesting(&rest)))
                    }
                    _ => None, // read whole below: its error is the text's own
                }
            } else if end == Some(tip.end) {
                Some((Vec::new(), 0, 0)) // its closing bracket: the tip's messages again
            } else {
                None
            };
            if let Some((items, digits, depth)) = new_items {
                // the tip's ints come first in the text: json.loads meets them first
                if max_digits > 0 && tip.digits > max_digits {
                    return Err(RawError::Digits {
                        digits: tip.digits,
                        limit: max_digits,
                    });
                }
                let (digits, depth) = (tip.digits.max(digits), tip.depth.max(depth));
                let plains: Vec<Vec<u8>> = items.iter().map(to_packed).collect();
                let mut hasher = PrefixHasher::resume(tip.packings.clone(), tip.packed);
                let found = self.find_from(&mut hasher, tip.n_rest, &plains[..], refuted);
                let end = end.unwrap_or(tip.end);
                let mut text_hasher = text_hasher;
                text_hasher.update(&text[tip.end..end]);
                let head = xxh3_64(&text[..end.min(RAW_HEAD)]);
                let packed = hasher.fed();
                return Ok(RawFound {
                    first: tip.n_rest,
                    n_rest: tip.n_rest + plains.len(),
                    plains,
                    found,
                    tip: Some(tip.turn),
                    text: Some((end, *text_hasher.finalize().as_bytes(), head)),
                    packings: hasher.finish(),
                    packed,
                    digits,
                    depth,
                });
            }
        }
        let (value, digits) = read_digits(text, max_depth, max_digits)?;
        let ej::Value::Array(items) = value else {
            return Err(RawError::NotArray);
        };
        let plains: Vec<Vec<u8>> = items.iter().map(to_packed).collect();
        let mut hasher = PrefixHasher::new();
        let found = self.find_from(&mut hasher, 0, &plains[..], refuted);
        // a tip of its own only for a plain UTF-8 text (one a later text can extend byte for
        // byte): it starts with its bracket, after whitespace at most
        let utf8 = text.iter().find(|&&b| !is_ws(b)) == Some(&b'[');
        let own = end.filter(|_| utf8).map(|end| {
            let head = xxh3_64(&text[..end.min(RAW_HEAD)]);
            (end, crate::digest::digest(&text[..end]), head)
        });
        // (only a tip needs it, and only a UTF-8 text is one)
        let depth = if own.is_some() { nesting(text) } else { 0 };
        let packed = hasher.fed();
        Ok(RawFound {
            first: 0,
            n_rest: plains.len(),
            plains,
            found,
            tip: None,
            text: own,
            packings: hasher.finish(),
            packed,
            digits,
            depth,
        })
    }

    /// The tip whose text `text` extends (the longest), and a BLAKE3 state that has seen
    /// `text` up to that tip's end.
    fn raw_tip_of(&self, text: &[u8]) -> Option<(&RawTip, blake3::Hasher)> {
        let mut best: Option<(&RawTip, blake3::Hasher)> = None;
        // the text's head hashed once for each length a tip's head has (mostly RAW_HEAD)
        let mut heads: Vec<(usize, u64)> = Vec::new();
        for tip in self.raw_tips.iter().rev() {
            if tip.end > text.len() || best.as_ref().is_some_and(|(b, _)| b.end >= tip.end) {
                continue;
            }
            let next = text[tip.end..].iter().find(|&&b| !is_ws(b));
            if !matches!(next, Some(b',' | b']')) {
                continue;
            }
            let size = tip.end.min(RAW_HEAD);
            let head = if let Some(&(_, head)) = heads.iter().find(|(at, _)| *at == size) {
                head
            } else {
                let head = xxh3_64(&text[..size]);
                heads.push((size, head));
                head
            };
            if head != tip.head {
                continue;
            }
            let mut hasher = blake3::Hasher::new();
            hasher.update(&text[..tip.end]);
            if *hasher.finalize().as_bytes() == tip.text_digest {
                best = Some((tip, hasher));
            }
        }
        best
    }

    /// File turn `turn`'s raw request as `find_raw` read it, with its response's plain
    /// packing; it becomes its conversation's raw tip (in place of the tip it continued).
    ///
    /// # Errors
    /// As [`Requests::file`]; nothing changes then.
    pub fn file_raw(
        &mut self,
        turn: TurnNo,
        raw: &RawFound,
        response: Option<&[u8]>,
    ) -> Result<(), FileError> {
        if let Some(ask) = raw.found.ask {
            return Err(FileError::Undecided(ask.turn));
        }
        self.file(turn, raw.n_rest, raw.found.digest, response)?;
        if raw.tip.is_some() {
            self.raw_tip_hits += 1;
        }
        if let Some(continued) = raw.tip {
            self.raw_tips.retain(|tip| tip.turn != continued);
        }
        if let Some((end, text_digest, head)) = raw.text {
            if self.raw_tips.len() >= MAX_RAW_TIPS {
                self.raw_tips.remove(0);
            }
            self.raw_tips.push(RawTip {
                turn,
                end,
                head,
                text_digest,
                packings: raw.packings.clone(),
                packed: raw.packed,
                n_rest: raw.n_rest,
                digits: raw.digits,
                depth: raw.depth,
            });
        }
        Ok(())
    }

    /// Raw texts filed that were read from a tip on.
    pub fn raw_tip_hits(&self) -> u64 {
        self.raw_tip_hits
    }

    /// The first row filed under `digest`'s key (a prefix of `len` messages) that is either
    /// confirmed with that digest or unconfirmed with that message count and not refuted.
    fn met(&self, digest: &[u8; DIGEST_SIZE], len: usize, refuted: &[TurnNo]) -> Option<Met> {
        self.rows_of(digest_key(digest))
            .map(|row| row as usize)
            .find_map(|at| {
                let row = &self.rows[at];
                if row.confirmed() {
                    (row.digest == *digest).then_some(Met::Row(at))
                } else {
                    let turn = self.turns[at];
                    (row.n_rest() == len && !refuted.contains(&turn)).then_some(Met::Ask(turn))
                }
            })
    }

    /// The stored tail of a request found as `found`: an array header of the messages after
    /// the base's, then their packings (the first as the echo placeholder when it is one).
    pub fn tail<P: AsRef<[u8]>>(plains: &[P], found: &Found) -> Vec<u8> {
        let rest = &plains[found.base_len..];
        let size: usize = rest.iter().map(|p| p.as_ref().len()).sum();
        let mut tail = Vec::with_capacity(size + 5);
        write_array_header(rest.len(), &mut tail);
        let mut rest = rest.iter();
        if found.echo {
            rest.next();
            tail.extend_from_slice(&ECHO_PACKED);
        }
        for plain in rest {
            tail.extend_from_slice(plain.as_ref());
        }
        tail
    }

    /// File turn `turn`'s request (`n_rest` messages, digest `digest`) and its response's
    /// plain packing, if any. Turns are filed in increasing order; nothing changes on error.
    ///
    /// # Errors
    /// [`FileError`]: a turn out of order, a request too long to count, a full table.
    pub fn file(
        &mut self,
        turn: TurnNo,
        n_rest: usize,
        digest: [u8; DIGEST_SIZE],
        response: Option<&[u8]>,
    ) -> Result<(), FileError> {
        self.push(turn, n_rest, digest, true, response)
    }

    /// File turn `turn`'s request by its key alone (a turn read from a file, whose record
    /// names its request's 8-byte key): unconfirmed until `confirm`, asked of by `find` at a
    /// boundary of its message count whose key it has.
    ///
    /// # Errors
    /// As [`Requests::file`].
    pub fn file_key(
        &mut self,
        turn: TurnNo,
        n_rest: usize,
        key: u64,
        response: Option<&[u8]>,
    ) -> Result<(), FileError> {
        let mut digest = [0u8; DIGEST_SIZE];
        digest[..8].copy_from_slice(&key.to_le_bytes());
        self.push(turn, n_rest, digest, false, response)?;
        self.unconfirmed += 1;
        Ok(())
    }

    fn push(
        &mut self,
        turn: TurnNo,
        n_rest: usize,
        digest: [u8; DIGEST_SIZE],
        confirmed: bool,
        response: Option<&[u8]>,
    ) -> Result<(), FileError> {
        let last = self.turns.last().copied();
        if last.is_some_and(|last| turn <= last) {
            return Err(FileError::Order { turn, last });
        }
        if n_rest >= MAX_N_REST {
            return Err(FileError::TooLong(n_rest));
        }
        #[allow(clippy::cast_possible_truncation)] // (below MAX_N_REST)
        let count = n_rest as u32 | if confirmed { CONFIRMED } else { 0 };
        let row = u32::try_from(self.rows.len())
            .ok()
            .filter(|&row| row < u32::MAX)
            .ok_or(FileError::Full)?;
        if let Some(packed) = response {
            self.responses.resize(self.rows.len(), 0);
            self.responses.push(response_key(packed));
        } else if !self.responses.is_empty() {
            self.responses.push(0);
        }
        grow(&mut self.rows);
        grow(&mut self.turns);
        self.rows.push(Row { digest, count });
        if let Err(full) = self.index.insert(row, &self.rows) {
            self.rows.pop();
            self.responses.truncate(self.rows.len());
            return Err(full);
        }
        self.turns.push(turn);
        self.lengths.mark(n_rest);
        Ok(())
    }

    /// Bytes of heap the table holds (rows, index, lengths, responses, with their spare
    /// capacity); not the table's own fields, which live where it does (inside its Python
    /// object, which the interpreter allocates and counts).
    pub fn nbytes(&self) -> usize {
        let responses = self.responses.capacity() * 8;
        self.rows.capacity() * std::mem::size_of::<Row>()
            + self.turns.capacity() * std::mem::size_of::<TurnNo>()
            + self.index.nbytes()
            + responses
            + self.lengths.nbytes()
            + self.raw_tips.capacity() * std::mem::size_of::<RawTip>()
            + self
                .raw_tips
                .iter()
                .map(|tip| tip.packings.nbytes())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::digest;

    fn msg(text: &str) -> Vec<u8> {
        let mut out = Vec::new();
        crate::packed::write_str(text.as_bytes(), &mut out);
        out
    }

    fn conv(texts: &[&str]) -> Vec<Vec<u8>> {
        texts.iter().map(|t| msg(t)).collect()
    }

    /// Find and file, as a graph's add does; returns what was found.
    fn add(table: &mut Requests, turn: TurnNo, plains: &[Vec<u8>], response: &str) -> Found {
        let found = table.find(plains);
        table
            .file(turn, plains.len(), found.digest, Some(&msg(response)))
            .unwrap();
        found
    }

    /// A table where turns 0 and 1 were read from a file by their keys (turn 1's request
    /// extends turn 0's), then turn 2 added with a request of its own.
    fn loaded() -> (Requests, [Vec<Vec<u8>>; 2]) {
        let first = conv(&["u1"]);
        let second = conv(&["u1", "a1", "u2"]);
        let mut table = Requests::new();
        for (turn, plains) in [&first, &second].into_iter().enumerate() {
            let key = digest_key(&digest(&plains.concat()));
            table
                .file_key(turn as TurnNo, plains.len(), key, Some(&msg("a")))
                .unwrap();
        }
        add(&mut table, 2, &conv(&["x"]), "y");
        (table, [first, second])
    }

    #[test]
    fn a_row_filed_by_its_key_is_asked_about_before_it_is_a_base() {
        let (mut table, [first, second]) = loaded();
        assert_eq!((table.unconfirmed(), table.digest(1)), (2, None));
        let request = conv(&["u1", "a1", "u2", "a2", "u3"]);
        let found = table.find(&request);
        let ask = found.ask.unwrap();
        assert_eq!((found.base, ask.turn, ask.len), (None, 1, 3));
        assert_eq!(ask.digest, digest(&second.concat()));
        // refuted (its bytes differ after all): the shorter row is asked about next
        let found = table.find_past(&request, &[1]);
        assert_eq!(found.ask.map(|ask| (ask.turn, ask.len)), Some((0, 1)));
        assert_eq!(found.ask.unwrap().digest, digest(&first.concat()));
        // confirmed: it is the base, found by its digest from then on
        assert_eq!(table.confirm(1, &ask.digest), Some(true));
        let found = table.find(&request);
        assert_eq!((found.base, found.base_len, found.ask), (Some(1), 3, None));
        assert_eq!(
            (table.unconfirmed(), table.digest(1)),
            (1, Some(ask.digest))
        );
        // a request that is no prefix of a loaded one asks nothing
        assert_eq!(table.find(&conv(&["x", "y", "z"])).ask, None);
        assert_eq!(table.find(&conv(&["x", "y", "z"])).base, Some(2));
    }

    #[test]
    fn a_confirmation_must_name_the_rows_key() {
        let (mut table, [first, _]) = loaded();
        let other = digest(&conv(&["u9"]).concat());
        assert_eq!(table.confirm(0, &other), Some(false));
        assert_eq!((table.unconfirmed(), table.digest(0)), (2, None));
        assert_eq!(table.confirm(7, &other), None);
        let right = digest(&first.concat());
        assert_eq!(table.confirm(0, &right), Some(true));
        assert_eq!(table.confirm(0, &right), Some(true));
        assert_eq!(table.confirm(0, &other), Some(false));
        assert_eq!((table.unconfirmed(), table.digest(0)), (1, Some(right)));
        // a confirmed row with another digest under the same key is no base of it
        assert_eq!(table.find(&first).base, Some(0));
    }

    #[test]
    fn an_unconfirmed_row_filed_before_a_twin_is_asked_about_first() {
        let (mut table, [first, _]) = loaded();
        // a twin of turn 0, added after it was read: turn 0, filed first, would be the base
        add(&mut table, 3, &first, "a");
        let request = conv(&["u1", "b", "u2"]);
        assert_eq!(table.find(&request).ask.map(|ask| ask.turn), Some(0));
        assert_eq!(table.find_past(&request, &[0]).base, Some(3));
        // prefixes name the unconfirmed row too, where its key and count are met (the caller
        // compares its bytes), in filing order
        let prefixes = table.prefixes(&request);
        assert_eq!(prefixes.len(), 1);
        assert_eq!(prefixes[0].turns, vec![0, 3]);
        assert_eq!(table.prefixes(&conv(&["u9", "c"])).len(), 0);
    }

    #[test]
    fn a_raw_text_is_not_filed_while_its_base_is_undecided() {
        let (mut table, [_, second]) = loaded();
        let text = br#"["u1","a1","u2","a2"]"#;
        let read = table.find_raw(text, 100, 0).unwrap();
        assert_eq!(read.found.ask.map(|ask| ask.turn), Some(1));
        let before = table.len();
        assert_eq!(table.file_raw(4, &read, None), Err(FileError::Undecided(1)));
        assert_eq!(table.len(), before);
        table.confirm(1, &digest(&second.concat())).unwrap();
        let read = table.find_raw(text, 100, 0).unwrap();
        assert_eq!((read.found.base, read.found.ask), (Some(1), None));
        table.file_raw(4, &read, None).unwrap();
    }

    #[test]
    fn a_base_below_the_longest_boundaries_is_found_by_hashing_again() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&["a"]), "r");
        add(&mut table, 1, &conv(&["a", "b", "c"]), "r");
        for (turn, len) in (2..).zip(4..=9) {
            let other: Vec<String> = (0..len).map(|i| format!("o{len}.{i}")).collect();
            let other: Vec<&str> = other.iter().map(String::as_str).collect();
            add(&mut table, turn, &conv(&other), "r");
        }
        // boundaries 9, 8, 7 and 6 are hashed for first: none is a base
        let request = conv(&["a", "b", "c", "x", "y", "z", "w", "v", "u"]);
        let found = table.find(&request);
        assert_eq!((found.base, found.base_len), (Some(1), 3));
        assert_eq!(found.digest, digest(&request.concat()));
        assert_eq!(table.find(&request[..2]).base, Some(0));
        // and one in the window still is, with its digest as before
        let found = table.find(&conv(&[
            "o9.0", "o9.1", "o9.2", "o9.3", "o9.4", "o9.5", "o9.6", "o9.7", "o9.8", "n",
        ]));
        assert_eq!((found.base, found.base_len), (Some(7), 9));
    }

    #[test]
    fn the_digest_is_that_of_the_packings_one_after_the_other() {
        let plains = conv(&["a", "bb", "ccc"]);
        let found = Requests::new().find(&plains);
        assert_eq!(found.digest, digest(&plains.concat()));
        assert_eq!(found.base, None);
        assert_eq!(Requests::new().find::<Vec<u8>>(&[]).digest, digest(b""));
    }

    #[test]
    fn a_request_extends_the_longest_filed_request_it_starts_with() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&["u1"]), "a1");
        add(&mut table, 1, &conv(&["u1", "a1", "u2"]), "a2");
        add(&mut table, 2, &conv(&["x"]), "y");
        let found = table.find(&conv(&["u1", "a1", "u2", "a2", "u3"]));
        assert_eq!(found.base, Some(1));
        assert_eq!(found.base_len, 3);
        assert!(found.echo);
        // a branch from the first turn
        let found = table.find(&conv(&["u1", "other", "u2"]));
        assert_eq!(
            (found.base, found.base_len, found.echo),
            (Some(0), 1, false)
        );
        // nothing in common
        assert_eq!(table.find(&conv(&["z"])).base, None);
        // a request that starts like a filed one but diverges inside its messages
        assert_eq!(table.find(&conv(&["u1x"])).base, None);
    }

    #[test]
    fn of_twins_the_first_filed_is_the_base_and_a_retry_extends_its_twin() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&["p"]), "r0");
        let retry = add(&mut table, 1, &conv(&["p"]), "r1");
        assert_eq!(
            (retry.base, retry.base_len, retry.echo),
            (Some(0), 1, false)
        );
        add(&mut table, 2, &conv(&["p"]), "r2");
        // the second sample continued: the base is still the first filed, no echo of it
        let found = table.find(&conv(&["p", "r1", "q"]));
        assert_eq!((found.base, found.echo), (Some(0), false));
        let found = table.find(&conv(&["p", "r0", "q"]));
        assert_eq!((found.base, found.echo), (Some(0), true));
    }

    #[test]
    fn the_tail_holds_the_messages_after_the_base_with_the_echo_as_a_placeholder() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&["u1"]), "a1");
        let plains = conv(&["u1", "a1", "u2"]);
        let found = table.find(&plains);
        let tail = Requests::tail(&plains, &found);
        let mut expected = vec![0x92];
        expected.extend_from_slice(&ECHO_PACKED);
        expected.extend_from_slice(&msg("u2"));
        assert_eq!(tail, expected);
        let root = Requests::new().find(&plains);
        let mut whole = vec![0x93];
        whole.extend_from_slice(&plains.concat());
        assert_eq!(Requests::tail(&plains, &root), whole);
    }

    #[test]
    fn an_empty_request_is_a_base_of_every_request() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&[]), "r");
        let found = table.find(&conv(&["r", "x"]));
        assert_eq!((found.base, found.base_len, found.echo), (Some(0), 0, true));
    }

    #[test]
    fn a_key_collision_is_told_apart_by_the_whole_digest() {
        let mut table = Requests::new();
        let plains = conv(&["a"]);
        let real = table.find(&plains).digest;
        let mut forged = real;
        forged[31] ^= 1; // same key, another digest
        table.file(0, 1, forged, None).unwrap();
        assert_eq!(table.find(&plains).base, None);
        table.file(1, 1, real, None).unwrap();
        assert_eq!(table.find(&plains).base, Some(1));
    }

    #[test]
    fn turns_are_filed_in_order_once_and_a_refusal_changes_nothing() {
        let mut table = Requests::new();
        add(&mut table, 3, &conv(&["a"]), "b");
        let before = table.find(&conv(&["a", "b"]));
        let err = table.file(3, 1, [0; 32], None).unwrap_err();
        assert_eq!(
            err,
            FileError::Order {
                turn: 3,
                last: Some(3)
            }
        );
        assert!(err.to_string().contains("in order"));
        assert_eq!(table.len(), 1);
        assert_eq!(table.find(&conv(&["a", "b"])), before);
        assert_eq!(table.n_rest(3), Some(1));
        assert_eq!(table.n_rest(2), None);
        assert_eq!(table.echoes(3, &msg("b")), Some(true));
        assert_eq!(table.echoes(3, &msg("c")), Some(false));
        assert_eq!(table.echoes(2, &msg("b")), None);
    }

    #[test]
    fn a_row_keeps_its_response_by_its_xxh3_and_no_response_echoes_nothing() {
        let mut table = Requests::new();
        let long = "x".repeat(1 << 21);
        add(&mut table, 0, &conv(&["a"]), &long);
        table
            .file(1, 1, Requests::find(&table, &conv(&["b"])).digest, None)
            .unwrap();
        assert_eq!(table.echoes(0, &msg(&long)), Some(true));
        assert_eq!(table.echoes(1, &msg("")), Some(false));
        assert_eq!(table.echoes(1, &[]), Some(false));
        // no packing is kept: the row's bytes do not grow with its response
        assert!(table.nbytes() < 4096, "{}", table.nbytes());
        assert_eq!(response_key(b""), xxh3_64(b"").max(1));
    }

    #[test]
    fn a_base_met_below_the_longest_boundary_widens_the_first_look() {
        // one conversation (1, 3, 5 messages): each request's base is the longest boundary
        let mut table = Requests::new();
        let mut a = conv(&["a0"]);
        for turn in 0..3 {
            if turn > 0 {
                a.extend(conv(&["ra", "a"]));
            }
            add(&mut table, turn, &a, "ra");
        }
        assert_eq!(
            table.wide.get(),
            0,
            "each met the longest boundary below it"
        );
        // another of 6 messages; a's next request (7): the longest boundary below it is
        // b's, its base a's own (5): found past the first look, which looks wider from then on
        let b = conv(&["b0", "rb", "b1", "rb", "b2", "rb"]);
        add(&mut table, 3, &b, "rb");
        a.extend(conv(&["ra", "a"]));
        let found = add(&mut table, 4, &a, "ra");
        assert_eq!((found.base, found.base_len), (Some(2), 5));
        assert_eq!(table.wide.get(), WIDE_FINDS);
        // a wide look that meets the longest boundary counts down, one that meets below it
        // starts again
        let mut next = a.clone();
        next.extend(conv(&["ra", "a"]));
        assert_eq!(table.find(&next).base, Some(4));
        assert_eq!(table.wide.get(), WIDE_FINDS - 1);
        let mut b_next = b.clone();
        b_next.extend(conv(&["b3"]));
        assert_eq!(table.find(&b_next).base, Some(3));
        assert_eq!(table.wide.get(), WIDE_FINDS - 2, "6 is the longest below 7");
        let mut short = a[..5].to_vec();
        short.extend(conv(&["ra", "other", "x", "y"]));
        assert_eq!(table.find(&short).base, Some(2)); // 7 and 6 are not its
        assert_eq!(table.wide.get(), WIDE_FINDS);
        // the base is the same whichever look found it
        for wide in [0, WIDE_FINDS] {
            table.wide.set(wide);
            assert_eq!(table.find(&short).base, Some(2));
            assert_eq!(table.find(&next).base, Some(4));
        }
    }

    #[test]
    fn a_table_counts_the_heap_it_holds_not_its_own_fields() {
        // its fields live inside its Python object, which the interpreter counts
        let mut table = Requests::new();
        assert_eq!(table.nbytes(), 0);
        add(&mut table, 0, &conv(&["a"]), "b");
        let rows = table.rows.capacity() * std::mem::size_of::<Row>();
        assert!(rows > 0 && table.nbytes() >= rows, "{}", table.nbytes());
    }

    #[test]
    fn the_base_is_the_longest_of_many_branches() {
        // a brute-force check: every prefix that is a filed request, longest wins, first filed
        let mut table = Requests::new();
        let mut filed: Vec<Vec<Vec<u8>>> = Vec::new();
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for turn in 0..300u32 {
            let plains: Vec<Vec<u8>> = if filed.is_empty() || next() % 5 == 0 {
                conv(&["root"])
            } else {
                let from = &filed[(next() % filed.len() as u64) as usize];
                let keep = (next() % (from.len() as u64 + 1)) as usize;
                let mut p = from[..keep].to_vec();
                for _ in 0..(next() % 3) {
                    p.push(msg(&format!("m{}", next() % 4)));
                }
                p
            };
            let found = table.find(&plains);
            let expected = (0..=plains.len()).rev().find_map(|n| {
                filed
                    .iter()
                    .position(|f| f.as_slice() == &plains[..n])
                    .map(|t| (t as u32, n))
            });
            assert_eq!(
                found.base.map(|b| (b, found.base_len)),
                expected,
                "turn {turn}"
            );
            table.file(turn, plains.len(), found.digest, None).unwrap();
            filed.push(plains);
        }
    }

    fn json_conv(texts: &[&str]) -> String {
        let items: Vec<String> = texts
            .iter()
            .map(|t| format!("{{\"role\": \"user\", \"content\": \"{t}\"}}"))
            .collect();
        format!("[{}]", items.join(", "))
    }

    fn packed_items(text: &str) -> Vec<Vec<u8>> {
        match ej::parse(text.as_bytes(), 100).unwrap() {
            ej::Value::Array(items) => items.iter().map(to_packed).collect(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_raw_text_is_read_from_its_tip_and_finds_what_its_packings_find() {
        let mut raw = Requests::new();
        let mut decoded = Requests::new();
        let mut texts = vec!["a".to_string()];
        for turn in 0..20u32 {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let text = json_conv(&refs);
            let read = raw.find_raw(text.as_bytes(), 100, 4300).unwrap();
            let plains = packed_items(&text);
            let found = decoded.find(&plains);
            assert_eq!(read.found, found, "turn {turn}");
            assert_eq!(read.plains, plains[read.first..], "turn {turn}");
            if turn > 0 {
                assert_eq!(
                    read.first,
                    plains.len() - 1,
                    "turn {turn}: read from its tip"
                );
            }
            let response = msg(&format!("r{turn}"));
            raw.file_raw(turn, &read, Some(&response)).unwrap();
            decoded
                .file(turn, plains.len(), found.digest, Some(&response))
                .unwrap();
            texts.push(format!("u{turn}"));
        }
        assert_eq!(raw.raw_tip_hits(), 19);
        assert_eq!(raw.raw_tips.len(), 1);
    }

    #[test]
    fn a_text_that_only_looks_like_its_tip_is_read_whole() {
        let mut table = Requests::new();
        let first = json_conv(&["a", "b"]);
        let read = table.find_raw(first.as_bytes(), 100, 0).unwrap();
        table.file_raw(0, &read, None).unwrap();
        // the same text again: the tip's messages, a twin
        let again = table
            .find_raw(format!("{first}  \n").as_bytes(), 100, 0)
            .unwrap();
        assert_eq!(
            (again.first, again.found.base, again.found.base_len),
            (2, Some(0), 2)
        );
        // an item that goes on past the tip's end is no new item
        let longer = first.replace("\"b\"}]", "\"b\", \"x\": 1}]");
        let read = table.find_raw(longer.as_bytes(), 100, 0).unwrap();
        assert_eq!((read.first, read.found.base), (0, None));
        // not JSON after the tip: the whole text's own error
        let broken = first.replace('}', "},");
        let err = table.find_raw(broken.as_bytes(), 100, 0).unwrap_err();
        assert!(matches!(err, RawError::Syntax(_)), "{err}");
        let bad_tail = format!("{}, nope]", &first[..first.len() - 1]);
        let err = table.find_raw(bad_tail.as_bytes(), 100, 0).unwrap_err();
        let RawError::Syntax(e) = err else {
            panic!("{err}")
        };
        assert_eq!(e.offset, first.len() + 1, "the offset is in the whole text");
        assert_eq!(table.raw_tip_hits(), 0);
    }

    #[test]
    fn a_raw_text_that_is_no_array_or_holds_too_many_digits_is_refused() {
        let table = Requests::new();
        assert_eq!(
            table.find_raw(b"{}", 100, 0).unwrap_err(),
            RawError::NotArray
        );
        let big = format!("[{}]", "7".repeat(5000));
        let err = table.find_raw(big.as_bytes(), 100, 4300).unwrap_err();
        assert_eq!(
            err,
            RawError::Digits {
                digits: 5000,
                limit: 4300
            }
        );
        assert!(err.to_string().contains("Exceeds the limit (4300 digits)"));
        assert!(table.find_raw(big.as_bytes(), 100, 0).is_ok());
    }

    #[test]
    fn a_tip_remembers_the_digits_of_what_it_holds() {
        let mut table = Requests::new();
        let first = format!("[{}]", "7".repeat(50));
        let read = table.find_raw(first.as_bytes(), 100, 0).unwrap();
        table.file_raw(0, &read, None).unwrap();
        let next = format!("[{}, 1]", "7".repeat(50));
        let err = table.find_raw(next.as_bytes(), 100, 40).unwrap_err();
        assert_eq!(
            err,
            RawError::Digits {
                digits: 50,
                limit: 40
            }
        );
    }

    #[test]
    fn a_tip_nested_deeper_than_a_later_bound_is_refused_as_read_whole() {
        let mut table = Requests::new();
        let deep = format!("[{}{}]", "[".repeat(40), "]".repeat(40));
        let read = table.find_raw(deep.as_bytes(), 100, 0).unwrap();
        table.file_raw(0, &read, None).unwrap();
        let next = format!("{}, 1]", &deep[..deep.len() - 1]);
        for text in [&deep, &next] {
            let whole = Requests::new()
                .find_raw(text.as_bytes(), 20, 0)
                .unwrap_err();
            assert_eq!(table.find_raw(text.as_bytes(), 20, 0).unwrap_err(), whole);
            assert_eq!(table.find_raw(text.as_bytes(), 41, 0).unwrap().first, 1);
            let err = table.find_raw(text.as_bytes(), 40, 0).unwrap_err();
            assert!(matches!(err, RawError::Syntax(_)), "{err}");
        }
        // a text read from the tip keeps its depth for the texts read from it in turn
        let read = table.find_raw(next.as_bytes(), 100, 0).unwrap();
        table.file_raw(1, &read, None).unwrap();
        let last = format!("{}, 2]", &next[..next.len() - 1]);
        assert!(table.find_raw(last.as_bytes(), 20, 0).is_err());
        assert_eq!(table.find_raw(last.as_bytes(), 41, 0).unwrap().first, 2);
    }

    #[test]
    fn a_repeated_keys_replaced_value_counts_as_json_loads_reads_it() {
        // json.loads converts (and refuses) the int a repeated key replaces, and nests into
        // the value it replaces, though the dict it builds keeps neither
        let big = format!(r#"[{{"a": {}, "a": 1}}]"#, "7".repeat(50));
        let err = Requests::new()
            .find_raw(big.as_bytes(), 100, 40)
            .unwrap_err();
        assert_eq!(
            err,
            RawError::Digits {
                digits: 50,
                limit: 40
            }
        );
        // the int before a fault is refused first, as json.loads meets it first
        let faulty = format!("[{}, }}", "7".repeat(50));
        let err = Requests::new()
            .find_raw(faulty.as_bytes(), 100, 40)
            .unwrap_err();
        assert!(matches!(err, RawError::Digits { .. }), "{err}");
        // a tip read without a limit, or under a higher bound, keeps both for later reads
        let deep = format!(
            r#"[{{"a": {}1{}, "a": 1}}]"#,
            "[".repeat(30),
            "]".repeat(30)
        );
        for (first, max_depth, max_digits) in [(&big, 100, 40), (&deep, 20, 0)] {
            let mut table = Requests::new();
            let read = table.find_raw(first.as_bytes(), 100, 0).unwrap();
            table.file_raw(0, &read, None).unwrap();
            let next = format!("{}, 1]", &first[..first.len() - 1]);
            let whole = Requests::new()
                .find_raw(next.as_bytes(), max_depth, max_digits)
                .unwrap_err();
            assert_eq!(
                table
                    .find_raw(next.as_bytes(), max_depth, max_digits)
                    .unwrap_err(),
                whole
            );
        }
    }

    #[test]
    fn raw_tips_are_bounded_and_the_oldest_goes_first() {
        let mut table = Requests::new();
        for turn in 0..(MAX_RAW_TIPS as u32 + 5) {
            let text = json_conv(&[&format!("conversation {turn}")]);
            let read = table.find_raw(text.as_bytes(), 100, 0).unwrap();
            table.file_raw(turn, &read, None).unwrap();
        }
        assert_eq!(table.raw_tips.len(), MAX_RAW_TIPS);
        assert_eq!(table.raw_tips[0].turn, 5);
        let old = format!(
            "{}, 1]",
            &json_conv(&["conversation 0"]).trim_end_matches(']')
        );
        assert_eq!(table.find_raw(old.as_bytes(), 100, 0).unwrap().first, 0);
        let kept = format!(
            "{}, 1]",
            &json_conv(&["conversation 9"]).trim_end_matches(']')
        );
        assert_eq!(table.find_raw(kept.as_bytes(), 100, 0).unwrap().first, 1);
    }

    #[test]
    fn prefixes_are_every_boundary_with_the_turns_there_longest_first() {
        let mut table = Requests::new();
        add(&mut table, 0, &conv(&["a"]), "r");
        add(&mut table, 1, &conv(&["a", "r", "b"]), "s");
        add(&mut table, 2, &conv(&["a"]), "r2");
        add(&mut table, 3, &conv(&["x"]), "y");
        let plains = conv(&["a", "r", "b", "s", "c"]);
        let found = table.prefixes(&plains);
        let shape: Vec<(usize, Vec<TurnNo>)> =
            found.iter().map(|p| (p.len, p.turns.clone())).collect();
        assert_eq!(shape, vec![(3, vec![1]), (1, vec![0, 2])]);
        assert_eq!(found[0].digest, digest(&plains[..3].concat()));
        assert_eq!(table.find(&plains).base, Some(found[0].turns[0]));
        let keys = Requests::keys(&plains);
        assert_eq!(keys.len(), 6);
        assert_eq!(keys[3], digest_key(&digest(&plains[..3].concat())));
        assert_eq!(keys[0], digest_key(&digest(b"")));
    }

    #[test]
    fn thousands_of_twins_are_filed_under_one_key_in_order() {
        let mut table = Requests::new();
        for turn in 0..5000 {
            add(
                &mut table,
                turn,
                &conv(&["the same prompt"]),
                &format!("sample {turn}"),
            );
        }
        let prefixes = table.prefixes(&conv(&["the same prompt", "sample 7"]));
        assert_eq!(prefixes.len(), 1);
        assert_eq!(prefixes[0].turns, (0..5000).collect::<Vec<_>>());
        let found = table.find(&conv(&["the same prompt", "sample 0"]));
        assert_eq!((found.base, found.echo), (Some(0), true));
    }

    #[test]
    fn a_count_past_the_bitmap_is_kept_in_a_list() {
        let mut table = Requests::new();
        let digest = [7u8; DIGEST_SIZE];
        table.file(0, MAX_N_REST - 1, digest, None).unwrap();
        table
            .file(1, BITMAP_COUNTS, [8u8; DIGEST_SIZE], None)
            .unwrap();
        table.file(2, 3, [9u8; DIGEST_SIZE], None).unwrap();
        assert!(table.nbytes() < 1 << 16, "{}", table.nbytes());
        assert!(table.lengths.has(MAX_N_REST - 1));
        assert!(table.lengths.has(BITMAP_COUNTS) && table.lengths.has(3));
        assert!(!table.lengths.has(BITMAP_COUNTS + 1) && !table.lengths.has(4));
        assert_eq!(table.n_rest(0), Some(MAX_N_REST - 1));
        // a count a row cannot hold beside its flags is refused, and nothing changes
        let err = table.file(3, MAX_N_REST, [10u8; DIGEST_SIZE], None);
        assert_eq!(err, Err(FileError::TooLong(MAX_N_REST)));
        assert_eq!((table.len(), table.n_rest(3)), (3, None));
    }

    #[test]
    fn a_turn_with_a_child_is_noted() {
        let mut table = Requests::new();
        add(&mut table, 4, &conv(&["a"]), "r");
        assert_eq!(table.has_children(4), Some(false));
        assert!(table.note_child(4));
        assert_eq!(table.has_children(4), Some(true));
        assert!(!table.note_child(5));
        assert_eq!(table.has_children(5), None);
    }
}
