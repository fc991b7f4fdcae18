//! Frames of format version 2: a sync marker, escaped payloads and a checksum chain.
//!
//! Every frame is the 5-byte sync marker, a kind byte, the payload length on disk (4 bytes
//! LE), the chain value of the frame before it (8 bytes LE) and its own chain value (8 bytes
//! LE), then the payload. A frame's chain value is xxh3-64 of its payload seeded with xxh3-64
//! of its kind byte, length and predecessor's value, so each frame is bound to everything
//! before it (the header frame carries a random file id: frames cannot move between files).
//!
//! The marker's first four bytes ([`ESCAPE`]) never occur in UTF-8 text; a payload that holds
//! them is written escaped (each occurrence followed by a zero byte, the kind's high bit set),
//! so the marker never occurs inside a payload and no content can pass for a frame boundary.
//! After damage the next frame is found by searching for the marker: a candidate's payload
//! must hold no marker and hash to its chain value, so candidates' payloads never overlap and
//! resync is linear in the damaged bytes.
//!
//! A blob frame's payload is a 16-byte xxh3-128 digest and the text; its chain value hashes
//! the digest, and the text is hashed once, for the digest.
//!
//! Between the last frame that verifies and the next one, [`read_gap`] says what the damaged
//! bytes held: one frame whose header alone was hit (rebuilt from its neighbours and verified
//! by its chain value), frames whose headers still link from one chain value to the other
//! (their kinds are known), or unknown.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use xxhash_rust::xxh3::{xxh3_128, xxh3_64, xxh3_64_with_seed};

/// The magic a version-2 file starts with.
pub const MAGIC_V2: &[u8; 8] = b"RLSTORE\x02";
/// Bytes valid UTF-8 never holds (F5-FF), the first one not repeated: occurrences cannot
/// overlap, and a blob's text never needs escaping.
pub const ESCAPE: [u8; 4] = [0xFE, 0xF7, 0xFB, 0xFD];
/// The marker every frame starts with.
pub const SYNC: [u8; 5] = [0xFE, 0xF7, 0xFB, 0xFD, 0x02];
/// Kind bit: the payload is escaped on disk.
pub const ESCAPED: u8 = 0x80;
/// Sync, kind, length on disk, previous chain value, chain value.
pub const HEADER_SIZE: usize = 26;
/// The header's fields as a Python `struct` format (the library reads headers with it).
pub const HEADER_LAYOUT: &str = "<5sBIQQ";
/// The largest payload a frame holds on disk.
pub const MAX_PAYLOAD: usize = (1 << 31) - 1;
/// A blob payload's leading xxh3-128 digest.
pub const DIGEST_SIZE: usize = 16;

/// The 16-byte digest of a blob's text: xxh3-128, big-endian (`xxhash.xxh3_128_digest`).
pub fn blob_digest(text: &[u8]) -> [u8; DIGEST_SIZE] {
    xxh3_128(text).to_be_bytes()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

/// `payload` with a zero byte after each occurrence of [`ESCAPE`].
pub fn escape(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    let mut rest = payload;
    while let Some(at) = find(rest, &ESCAPE) {
        out.extend_from_slice(&rest[..at + ESCAPE.len()]);
        out.push(0);
        rest = &rest[at + ESCAPE.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// `stored` with the zero byte after each occurrence of [`ESCAPE`] removed (borrowed when
/// there is none).
pub fn unescape(stored: &[u8]) -> Cow<'_, [u8]> {
    const PAIR: [u8; 5] = [0xFE, 0xF7, 0xFB, 0xFD, 0x00];
    let Some(first) = find(stored, &PAIR) else {
        return Cow::Borrowed(stored);
    };
    let mut out = Vec::with_capacity(stored.len());
    let mut rest = stored;
    let mut at = Some(first);
    while let Some(i) = at {
        out.extend_from_slice(&rest[..i + ESCAPE.len()]);
        rest = &rest[i + PAIR.len()..];
        at = find(rest, &PAIR);
    }
    out.extend_from_slice(rest);
    Cow::Owned(out)
}

/// The chain value of a frame: `hashed` is its unescaped payload (a blob's: its digest).
pub fn chain_value(kind_byte: u8, length: u32, prev: u64, hashed: &[u8]) -> u64 {
    let mut link = [0u8; 13];
    link[0] = kind_byte;
    link[1..5].copy_from_slice(&length.to_le_bytes());
    link[5..].copy_from_slice(&prev.to_le_bytes());
    xxh3_64_with_seed(hashed, xxh3_64(&link))
}

fn header(kind_byte: u8, length: u32, prev: u64, value: u64) -> [u8; HEADER_SIZE] {
    let mut out = [0u8; HEADER_SIZE];
    out[..5].copy_from_slice(&SYNC);
    out[5] = kind_byte;
    out[6..10].copy_from_slice(&length.to_le_bytes());
    out[10..18].copy_from_slice(&prev.to_le_bytes());
    out[18..].copy_from_slice(&value.to_le_bytes());
    out
}

/// A record the writer refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodeError {
    /// A record of this many bytes on disk.
    RecordTooLarge(usize),
    /// A blob's text of this many bytes.
    StringTooLarge(usize),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RecordTooLarge(n) => {
                write!(f, "a record of {n} bytes is larger than a frame can hold")
            }
            Self::StringTooLarge(n) => {
                write!(f, "a string of {n} bytes is larger than a frame can hold")
            }
        }
    }
}

impl std::error::Error for EncodeError {}

/// The frame of a record of `kind` after the frame valued `prev`, and its chain value.
///
/// # Errors
/// [`EncodeError::RecordTooLarge`] when the payload on disk exceeds [`MAX_PAYLOAD`].
pub fn encode_frame(kind: u8, payload: &[u8], prev: u64) -> Result<(Vec<u8>, u64), EncodeError> {
    let (stored, kind_byte) = if find(payload, &ESCAPE).is_some() {
        (Cow::Owned(escape(payload)), kind | ESCAPED)
    } else {
        (Cow::Borrowed(payload), kind)
    };
    if stored.len() > MAX_PAYLOAD {
        return Err(EncodeError::RecordTooLarge(stored.len()));
    }
    let length = stored.len() as u32;
    let value = chain_value(kind_byte, length, prev, payload);
    let mut out = Vec::with_capacity(HEADER_SIZE + stored.len());
    out.extend_from_slice(&header(kind_byte, length, prev, value));
    out.extend_from_slice(&stored);
    Ok((out, value))
}

/// A blob frame as written: a header followed by the digest and the text as given (the text
/// is never copied), or, when the digest holds [`ESCAPE`], the whole escaped frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlobFrame {
    Parts([u8; HEADER_SIZE]),
    Whole(Vec<u8>),
}

/// The frame of a blob (`digest`, then `text`, which is UTF-8 and never holds [`ESCAPE`])
/// after the frame valued `prev`, and its chain value.
///
/// # Errors
/// [`EncodeError::StringTooLarge`] when the payload exceeds [`MAX_PAYLOAD`].
pub fn encode_blob_frame(
    kind: u8,
    digest: &[u8],
    text: &[u8],
    prev: u64,
) -> Result<(BlobFrame, u64), EncodeError> {
    if find(digest, &ESCAPE).is_some() {
        // rare (about 13 in 2**32 digests): the payload is escaped
        let mut payload = Vec::with_capacity(digest.len() + text.len());
        payload.extend_from_slice(digest);
        payload.extend_from_slice(text);
        let stored = escape(&payload);
        if stored.len() > MAX_PAYLOAD {
            return Err(EncodeError::StringTooLarge(text.len()));
        }
        let kind_byte = kind | ESCAPED;
        let length = stored.len() as u32;
        let value = chain_value(kind_byte, length, prev, digest);
        let mut out = Vec::with_capacity(HEADER_SIZE + stored.len());
        out.extend_from_slice(&header(kind_byte, length, prev, value));
        out.extend_from_slice(&stored);
        return Ok((BlobFrame::Whole(out), value));
    }
    let size = digest.len() + text.len();
    if size > MAX_PAYLOAD {
        return Err(EncodeError::StringTooLarge(text.len()));
    }
    let length = size as u32;
    let value = chain_value(kind, length, prev, digest);
    Ok((BlobFrame::Parts(header(kind, length, prev, value)), value))
}

/// Which record kinds a reader knows and which of them are blobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kinds {
    /// Bit `k` set: kind `k` is a blob (a digest, then the text).
    pub digest: u128,
    /// The largest kind known (at most 127).
    pub max: u8,
}

impl Kinds {
    fn is_blob(self, kind_byte: u8) -> bool {
        self.digest >> (kind_byte & 0x7F) & 1 == 1
    }
}

/// Work done while scanning, so tests can check it grows linearly with the input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub hashed_bytes: u64,
    pub searched_bytes: u64,
    pub candidates: u64,
}

/// What is wrong with a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DamageKind {
    HeaderCut,
    NoMarker,
    UnknownKind(u8),
    /// The payload the header names runs past the end: `present` of `length` bytes.
    PayloadCut {
        present: usize,
        length: u32,
    },
    MarkerInside,
    BlobShort,
    /// The payload does not hash to the chain value the header names.
    Checksum {
        expected: u64,
        actual: u64,
    },
    /// A blob's text does not hash to its digest.
    BlobDigest {
        expected: [u8; DIGEST_SIZE],
        actual: [u8; DIGEST_SIZE],
    },
    /// A frame that verifies by itself but does not name the frame before it.
    OutOfPlace,
}

/// The first frame that does not verify: what is wrong, its offset and record number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    pub kind: DamageKind,
    pub offset: usize,
    pub record: u64,
}

impl fmt::Display for DamageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HeaderCut => f.write_str("file ends inside a frame header"),
            Self::NoMarker => f.write_str("no frame marker where a frame must start"),
            Self::UnknownKind(k) => write!(f, "unknown record kind {k}"),
            Self::PayloadCut { present, length } => {
                write!(
                    f,
                    "file ends inside a record: {present} of {length} bytes present"
                )
            }
            Self::MarkerInside => {
                f.write_str("a frame marker inside a record (records run into each other)")
            }
            Self::BlobShort => f.write_str("blob record shorter than its digest"),
            Self::Checksum { expected, actual } => write!(
                f,
                "record checksum mismatch: expected {expected:#x}, got {actual:#x}"
            ),
            Self::BlobDigest { expected, actual } => {
                f.write_str("blob checksum mismatch: expected ")?;
                hex(f, expected)?;
                f.write_str(", got ")?;
                hex(f, actual)
            }
            Self::OutOfPlace => f.write_str(
                "record out of place: it does not follow the record before it \
                 (frames reordered, duplicated, dropped or taken from another file)",
            ),
        }
    }
}

fn hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

/// One verified frame: where it is and its chain value. `unescaped` holds the payload when it
/// was escaped on disk; otherwise the payload is `data[start..end]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub offset: usize,
    pub start: usize,
    pub end: usize,
    pub record: u64,
    pub chain: u64,
    pub unescaped: Option<Vec<u8>>,
}

impl Frame {
    /// The frame's unescaped payload.
    pub fn payload<'a>(&'a self, data: &'a [u8]) -> &'a [u8] {
        self.unescaped
            .as_deref()
            .unwrap_or(&data[self.start..self.end])
    }
}

struct Head {
    kind_byte: u8,
    length: u32,
    prev: u64,
    chain: u64,
    start: usize,
}

pub(crate) fn u32_at(data: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn u64_at(data: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"))
}

/// The header at `offset`: whole, starting with the marker, of a known kind, naming a payload
/// the data holds.
fn read_header(data: &[u8], offset: usize, kinds: Kinds) -> Result<Head, DamageKind> {
    if data.len().saturating_sub(offset) < HEADER_SIZE {
        return Err(DamageKind::HeaderCut);
    }
    if data[offset..offset + SYNC.len()] != SYNC {
        return Err(DamageKind::NoMarker);
    }
    let kind_byte = data[offset + 5];
    if kind_byte & 0x7F > kinds.max {
        return Err(DamageKind::UnknownKind(kind_byte & 0x7F));
    }
    let length = u32_at(data, offset + 6);
    let start = offset + HEADER_SIZE;
    if length as usize > data.len() - start {
        return Err(DamageKind::PayloadCut {
            present: data.len() - start,
            length,
        });
    }
    Ok(Head {
        kind_byte,
        length,
        prev: u64_at(data, offset + 10),
        chain: u64_at(data, offset + 18),
        start,
    })
}

/// The frame at `offset` verified by itself (not against its predecessor), and the chain
/// value it names for its predecessor. `whole`: search a blob's text for the marker too
/// (resync needs it to stay linear; in order, the loader's UTF-8 check of the text stands
/// for it).
fn check(
    data: &[u8],
    offset: usize,
    record: u64,
    kinds: Kinds,
    whole: bool,
    counters: &mut Counters,
) -> Result<(Frame, u64), DamageKind> {
    let head = read_header(data, offset, kinds)?;
    let start = head.start;
    let end = start + head.length as usize;
    let is_blob = kinds.is_blob(head.kind_byte);
    let searched = if whole || !is_blob {
        end
    } else {
        end.min(start + DIGEST_SIZE + SYNC.len())
    };
    counters.searched_bytes += (searched - start) as u64;
    if find(&data[start..searched], &SYNC).is_some() {
        return Err(DamageKind::MarkerInside);
    }
    let stored = &data[start..end];
    let unescaped = if head.kind_byte & ESCAPED == 0 {
        None
    } else {
        Some(unescape(stored).into_owned())
    };
    let payload = unescaped.as_deref().unwrap_or(stored);
    if is_blob && payload.len() < DIGEST_SIZE {
        return Err(DamageKind::BlobShort);
    }
    let hashed = if is_blob {
        &payload[..DIGEST_SIZE]
    } else {
        payload
    };
    counters.hashed_bytes += payload.len() as u64;
    let actual = chain_value(head.kind_byte, head.length, head.prev, hashed);
    if actual != head.chain {
        return Err(DamageKind::Checksum {
            expected: head.chain,
            actual,
        });
    }
    if is_blob {
        check_digest(payload)?;
    }
    let frame = Frame {
        kind: head.kind_byte & 0x7F,
        offset,
        start,
        end,
        record,
        chain: head.chain,
        unescaped,
    };
    Ok((frame, head.prev))
}

/// A blob's text must hash to the digest its payload starts with.
fn check_digest(payload: &[u8]) -> Result<(), DamageKind> {
    let (stored, text) = payload.split_at(DIGEST_SIZE);
    let actual = blob_digest(text);
    if actual == stored {
        Ok(())
    } else {
        Err(DamageKind::BlobDigest {
            expected: stored.try_into().expect("16 bytes"),
            actual,
        })
    }
}

/// The offset of the first whole frame that verifies by itself and starts after `after`, or
/// None. Linear in `data.len() - after`: a candidate is a marker whose payload holds no
/// other marker, so the payloads hashed never overlap.
pub fn next_frame(
    data: &[u8],
    after: usize,
    kinds: Kinds,
    counters: &mut Counters,
) -> Option<usize> {
    let mut pos = after.saturating_add(1);
    let finder = memchr::memmem::Finder::new(&SYNC);
    loop {
        if pos > data.len() {
            return None;
        }
        let Some(at) = finder.find(&data[pos..]) else {
            counters.searched_bytes += (data.len() - pos) as u64;
            return None;
        };
        let found = pos + at;
        counters.searched_bytes += at as u64;
        counters.candidates += 1;
        if check(data, found, 0, kinds, true, counters).is_ok() {
            return Some(found);
        }
        pos = found + 1;
    }
}

/// Where a scan in order stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stop {
    pub damage: Damage,
    /// Where the next whole frame starts (None: none does, or the format has no resync).
    pub resync: Option<usize>,
    /// Whether the damage is a torn tail: no intact frame follows it.
    pub torn: bool,
}

/// The frames of a file from `start` in order, each verified and bound to the one before
/// it (`chain`: the value the first one must name; `record`: its number).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    pub frames: Vec<Frame>,
    /// Where the frame after the last one read starts, the chain value it must name and its
    /// record number.
    pub offset: usize,
    pub chain: u64,
    pub record: u64,
    /// The first damage, if the scan did not reach the end.
    pub stop: Option<Stop>,
}

/// Reads every frame from `start` to the end of `data` or to the first damage.
pub fn scan(
    data: &[u8],
    start: usize,
    chain: u64,
    record: u64,
    kinds: Kinds,
    counters: &mut Counters,
) -> Scan {
    let mut out = Scan {
        frames: Vec::new(),
        offset: start,
        chain,
        record,
        stop: None,
    };
    while out.offset < data.len() {
        let offset = out.offset;
        let checked = match check(data, offset, out.record, kinds, false, counters) {
            Ok((_, prev)) if prev != out.chain => Err(DamageKind::OutOfPlace),
            Ok((frame, _)) => Ok(frame),
            Err(kind) => Err(kind),
        };
        match checked {
            Ok(frame) => {
                out.offset = frame.end;
                out.chain = frame.chain;
                out.record += 1;
                out.frames.push(frame);
            }
            Err(kind) => {
                let resync = next_frame(data, offset, kinds, counters);
                out.stop = Some(Stop {
                    damage: Damage {
                        kind,
                        offset,
                        record: out.record,
                    },
                    resync,
                    torn: resync.is_none(),
                });
                break;
            }
        }
    }
    out
}

/// Damaged bytes `[start, end)` between the last frame that verifies and the next one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gap {
    pub start: usize,
    pub end: usize,
    /// The kinds of the frames lost there, in order, where their headers still link the chain
    /// value before the damage to the one after it; None when that cannot be told.
    pub kinds: Option<Vec<u8>>,
    /// The one frame there, whole: only its header was damaged, rebuilt from its neighbours
    /// and verified by its chain value.
    pub repaired: Option<Frame>,
}

/// What the damaged bytes `[start, end)` held: `prev` is the chain value of the frame before
/// them (0 before the header), `end` the offset of the next frame that verifies by itself,
/// `record` the number the first damaged frame has.
///
/// # Panics
/// When `end` is not the offset of a whole frame header in `data`.
pub fn read_gap(
    data: &[u8],
    start: usize,
    end: usize,
    prev: u64,
    record: u64,
    kinds: Kinds,
    counters: &mut Counters,
) -> Gap {
    let after = u64_at(data, end + 10); // the chain value the frame at `end` names
    if let Some(frame) = rebuilt(data, start..end, (prev, after), record, kinds, counters) {
        return Gap {
            start,
            end,
            kinds: Some(Vec::new()),
            repaired: Some(frame),
        };
    }
    let mut lost = Vec::new();
    let (mut pos, mut chain) = (start, prev);
    while pos < end && end - pos >= HEADER_SIZE {
        let kind_byte = data[pos + 5];
        let next = pos + HEADER_SIZE + u32_at(data, pos + 6) as usize;
        if data[pos..pos + SYNC.len()] != SYNC
            || kind_byte & 0x7F > kinds.max
            || u64_at(data, pos + 10) != chain
            || next > end
        {
            break;
        }
        lost.push(kind_byte & 0x7F);
        chain = u64_at(data, pos + 18);
        pos = next;
    }
    if pos == end && chain == after {
        return Gap {
            start,
            end,
            kinds: Some(lost),
            repaired: None,
        };
    }
    if end - start >= HEADER_SIZE {
        // one frame whose neighbours vouch for both its chain fields, its marker or length
        // hit as well as its payload: its kind byte is all that is left to go by
        let kind_byte = data[start + 5];
        if u64_at(data, start + 10) == prev
            && u64_at(data, start + 18) == after
            && kind_byte & 0x7F <= kinds.max
        {
            return Gap {
                start,
                end,
                kinds: Some(vec![kind_byte & 0x7F]),
                repaired: None,
            };
        }
    }
    Gap {
        start,
        end,
        kinds: None,
        repaired: None,
    }
}

/// The frame `[start, end)` if its payload is intact: marker, length and chain fields as its
/// neighbours give them (`links`: the chain value before it, its own), and the kind that
/// makes its payload hash to its value (the one its header names tried first). Hashes the
/// payload at most twice per kind.
fn rebuilt(
    data: &[u8],
    Range { start, end }: Range<usize>,
    (prev, value): (u64, u64),
    record: u64,
    kinds: Kinds,
    counters: &mut Counters,
) -> Option<Frame> {
    if end < start + HEADER_SIZE {
        return None;
    }
    let stored = &data[start + HEADER_SIZE..end];
    if find(stored, &SYNC).is_some() {
        return None;
    }
    let length = u32::try_from(stored.len()).ok()?;
    let named = data[start + SYNC.len()];
    let mut order: Vec<u8> = Vec::with_capacity(2 * (usize::from(kinds.max) + 1));
    if named & 0x7F <= kinds.max {
        order.push(named);
    }
    for flag in [0, ESCAPED] {
        for kind in 0..=kinds.max {
            if kind | flag != named {
                order.push(kind | flag);
            }
        }
    }
    let unescaped = unescape(stored);
    for kind_byte in order {
        let payload: &[u8] = if kind_byte & ESCAPED == 0 {
            stored
        } else {
            &unescaped
        };
        let is_blob = kinds.is_blob(kind_byte);
        if is_blob && payload.len() < DIGEST_SIZE {
            continue;
        }
        let hashed = if is_blob {
            &payload[..DIGEST_SIZE]
        } else {
            payload
        };
        counters.hashed_bytes += hashed.len() as u64;
        if chain_value(kind_byte, length, prev, hashed) != value {
            continue;
        }
        counters.hashed_bytes += (payload.len() - hashed.len()) as u64;
        if is_blob && check_digest(payload).is_err() {
            return None;
        }
        return Some(Frame {
            kind: kind_byte & 0x7F,
            offset: start,
            start: start + HEADER_SIZE,
            end,
            record,
            chain: value,
            unescaped: (kind_byte & ESCAPED != 0).then(|| payload.to_vec()),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOB: u8 = 1;
    const KINDS: Kinds = Kinds {
        digest: 1 << BLOB,
        max: 4,
    };

    /// Frames written by the library's earlier Python encoder: a header, a value, a blob, an
    /// escaped turn, an empty value and a turn.
    const PYTHON_FRAMES: &str = "fef7fbfd02000b00000000000000000000004405329397efc8016865616465722069642d30fef7fbfd0202090000004405329397efc80182ed1abd94f9993476616c7565206f6e65fef7fbfd02014000000082ed1abd94f999348cdac69f334c16fad9bf4a46e3b7e76d929852aa39fe465b61206c6f6e6720737472696e6720c3a961206c6f6e6720737472696e6720c3a961206c6f6e6720737472696e6720c3a9fef7fbfd02831d0000008cdac69f334c16fa6e8957fcf6c0fe107475726e20fef7fbfd00207769746820fef7fbfd000220696e73696465fef7fbfd0202000000006e8957fcf6c0fe10910d631794a9f1a0fef7fbfd020304000000910d631794a9f1a0ea927849557d851c6c617374";
    const PYTHON_LAST_CHAIN: u64 = 0x1c85_7d55_4978_92ea;

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    fn records() -> Vec<(u8, Vec<u8>)> {
        let mut turn = b"turn ".to_vec();
        turn.extend_from_slice(&ESCAPE);
        turn.extend_from_slice(b" with ");
        turn.extend_from_slice(&SYNC);
        turn.extend_from_slice(b" inside");
        vec![
            (0, b"header id-0".to_vec()),
            (2, b"value one".to_vec()),
            (BLOB, "a long string \u{e9}".repeat(3).into_bytes()),
            (3, turn),
            (2, Vec::new()),
            (3, b"last".to_vec()),
        ]
    }

    /// The records as frames, and every frame's offset.
    fn build(records: &[(u8, Vec<u8>)]) -> (Vec<u8>, Vec<usize>, u64) {
        let (mut out, mut offsets, mut chain) = (Vec::new(), Vec::new(), 0);
        for (kind, payload) in records {
            offsets.push(out.len());
            if *kind == BLOB {
                let (frame, value) =
                    encode_blob_frame(*kind, &blob_digest(payload), payload, chain).unwrap();
                match frame {
                    BlobFrame::Parts(head) => {
                        out.extend_from_slice(&head);
                        out.extend_from_slice(&blob_digest(payload));
                        out.extend_from_slice(payload);
                    }
                    BlobFrame::Whole(bytes) => out.extend_from_slice(&bytes),
                }
                chain = value;
            } else {
                let (frame, value) = encode_frame(*kind, payload, chain).unwrap();
                out.extend_from_slice(&frame);
                chain = value;
            }
        }
        (out, offsets, chain)
    }

    fn read(data: &[u8]) -> Scan {
        scan(data, 0, 0, 0, KINDS, &mut Counters::default())
    }

    #[test]
    fn hashes_match_the_python_library() {
        assert_eq!(xxh3_64_with_seed(b"abc", 12345), 8_178_084_933_791_286_736);
        assert_eq!(
            blob_digest(b"abc").to_vec(),
            unhex("06b05ab6733a618578af5f94892f3950")
        );
    }

    #[test]
    fn writes_what_the_python_encoder_wrote() {
        let (data, _, chain) = build(&records());
        assert_eq!(data, unhex(PYTHON_FRAMES));
        assert_eq!(chain, PYTHON_LAST_CHAIN);
    }

    #[test]
    fn reads_frames_the_python_encoder_wrote() {
        let data = unhex(PYTHON_FRAMES);
        let got = read(&data);
        assert!(got.stop.is_none());
        assert_eq!(got.chain, PYTHON_LAST_CHAIN);
        assert_eq!(got.offset, data.len());
        let payloads: Vec<(u8, Vec<u8>)> = got
            .frames
            .iter()
            .map(|f| {
                let p = f.payload(&data);
                let p = if f.kind == BLOB { &p[DIGEST_SIZE..] } else { p };
                (f.kind, p.to_vec())
            })
            .collect();
        assert_eq!(payloads, records());
        assert!(got.frames[3].unescaped.is_some());
        assert_eq!(data.windows(5).filter(|w| *w == SYNC).count(), 6);
    }

    #[test]
    fn escape_round_trips() {
        let mut tricky = ESCAPE.to_vec();
        tricky.extend_from_slice(&ESCAPE);
        tricky.push(0);
        tricky.extend_from_slice(&ESCAPE[..3]);
        let stored = escape(&tricky);
        assert_eq!(stored.windows(4).filter(|w| *w == ESCAPE).count(), 2);
        assert!(find(&stored, &SYNC).is_none());
        assert_eq!(unescape(&stored).as_ref(), tricky.as_slice());
        assert!(matches!(unescape(b"plain"), Cow::Borrowed(_)));
    }

    #[test]
    fn every_flipped_bit_is_damage_at_or_before_its_frame() {
        let (data, offsets, _) = build(&records());
        for pos in 0..data.len() {
            let mut changed = data.clone();
            changed[pos] ^= 1 << (pos % 8);
            let stop = read(&changed).stop.expect("damage found");
            let frame = offsets.iter().rev().find(|&&o| o <= pos).unwrap();
            assert!(stop.damage.offset <= *frame, "{pos}");
        }
    }

    #[test]
    fn a_swapped_frame_is_out_of_place_and_resync_finds_the_next() {
        let (data, offsets, _) = build(&records());
        let mut swapped = data[..offsets[1]].to_vec();
        swapped.extend_from_slice(&data[offsets[2]..offsets[3]]);
        swapped.extend_from_slice(&data[offsets[1]..offsets[2]]);
        swapped.extend_from_slice(&data[offsets[3]..]);
        let stop = read(&swapped).stop.unwrap();
        assert_eq!(stop.damage.kind, DamageKind::OutOfPlace);
        assert_eq!((stop.damage.offset, stop.damage.record), (offsets[1], 1));
        assert_eq!(stop.resync, Some(offsets[1] + offsets[3] - offsets[2]));
    }

    #[test]
    fn damage_kinds_and_messages() {
        let (data, offsets, _) = build(&records());
        let cut = read(&data[..data.len() - 2]).stop.unwrap();
        assert_eq!(
            cut.damage.kind,
            DamageKind::PayloadCut {
                present: 2,
                length: 4
            }
        );
        assert_eq!(cut.resync, None);
        assert_eq!(
            cut.damage.kind.to_string(),
            "file ends inside a record: 2 of 4 bytes present"
        );
        let header_cut = read(&data[..offsets[1] + 3]).stop.unwrap();
        assert_eq!(header_cut.damage.kind, DamageKind::HeaderCut);
        let mut text = data.clone();
        text[offsets[3] - 1] ^= 1; // the blob's last byte
        let blob = read(&text).stop.unwrap();
        assert!(matches!(blob.damage.kind, DamageKind::BlobDigest { .. }));
        assert!(blob
            .damage
            .kind
            .to_string()
            .starts_with("blob checksum mismatch: expected "));
        assert_eq!(
            (blob.damage.offset, blob.resync),
            (offsets[2], Some(offsets[3]))
        );
        let mut kind = data.clone();
        kind[offsets[1] + 5] = 9;
        assert_eq!(
            read(&kind).stop.unwrap().damage.kind,
            DamageKind::UnknownKind(9)
        );
    }

    #[test]
    fn a_payload_holding_a_whole_frame_is_no_boundary() {
        let (fake, _) = encode_frame(3, b"I look like a turn", 0).unwrap();
        let mut turn = b"tool output: ".to_vec();
        turn.extend_from_slice(&fake);
        turn.extend_from_slice(&b" more output ".repeat(50));
        let mut recs = records();
        recs.push((3, turn.clone()));
        let (data, offsets, _) = build(&recs);
        let whole = read(&data);
        assert!(whole.stop.is_none());
        assert_eq!(whole.frames.last().unwrap().payload(&data), turn.as_slice());
        let cut = &data[..data.len() - 40];
        let stop = read(cut).stop.unwrap();
        assert_eq!(stop.resync, None);
        assert_eq!(
            next_frame(
                cut,
                *offsets.last().unwrap(),
                KINDS,
                &mut Counters::default()
            ),
            None
        );
    }

    #[test]
    fn resync_work_is_linear_in_the_damaged_bytes() {
        let (data, _, _) = build(&records());
        let mut per_byte = Vec::new();
        for size in [16usize << 10, 128 << 10] {
            let mut garbage = data.clone();
            while garbage.len() < data.len() + size {
                garbage.extend_from_slice(&SYNC);
            }
            let mut counters = Counters::default();
            assert_eq!(
                next_frame(&garbage, data.len() - 1, KINDS, &mut counters),
                None
            );
            // work per damaged byte, in thousandths
            per_byte.push((counters.hashed_bytes + counters.searched_bytes) * 1000 / size as u64);
        }
        assert!(per_byte[1] * 10 <= per_byte[0] * 11 + 100, "{per_byte:?}");
        assert!(per_byte[1] <= 8000);
    }

    #[test]
    fn each_stored_byte_is_hashed_once_in_order() {
        let (data, _, _) = build(&records());
        let mut counters = Counters::default();
        let got = scan(&data, 0, 0, 0, KINDS, &mut counters);
        let total: usize = got.frames.iter().map(|f| f.payload(&data).len()).sum();
        assert_eq!(counters.hashed_bytes, total as u64);
    }

    #[test]
    fn a_frame_whose_header_alone_was_hit_is_rebuilt() {
        let (data, offsets, _) = build(&records());
        for at in [offsets[3] + 1, offsets[3] + 5, offsets[3] + 7] {
            let mut changed = data.clone();
            changed[at] ^= 0x40;
            let got = read(&changed);
            let stop = got.stop.unwrap();
            assert_eq!(stop.resync, Some(offsets[4]));
            let gap = read_gap(
                &changed,
                got.offset,
                offsets[4],
                got.chain,
                got.record,
                KINDS,
                &mut Counters::default(),
            );
            let frame = gap.repaired.expect("rebuilt");
            assert_eq!((frame.kind, frame.record, frame.offset), (3, 3, offsets[3]));
            assert_eq!(frame.payload(&changed), records()[3].1.as_slice());
        }
    }

    #[test]
    fn gaps_whose_headers_link_name_their_kinds() {
        let (data, offsets, _) = build(&records());
        let mut changed = data.clone();
        changed[offsets[1] + HEADER_SIZE + 2] ^= 1; // the value's payload
        changed[offsets[2] + HEADER_SIZE + 30] ^= 1; // the blob's text
        let got = read(&changed);
        assert_eq!(got.stop.as_ref().unwrap().resync, Some(offsets[3]));
        let gap = read_gap(
            &changed,
            got.offset,
            offsets[3],
            got.chain,
            got.record,
            KINDS,
            &mut Counters::default(),
        );
        assert_eq!(gap.kinds, Some(vec![2, BLOB]));
        assert!(gap.repaired.is_none());
        let mut lost = data[..offsets[1]].to_vec();
        lost.extend_from_slice(&[0x55; 40]);
        lost.extend_from_slice(&data[offsets[3]..]);
        let got = read(&lost);
        let gap = read_gap(
            &lost,
            got.offset,
            offsets[1] + 40,
            got.chain,
            got.record,
            KINDS,
            &mut Counters::default(),
        );
        assert_eq!(gap.kinds, None);
    }

    #[test]
    fn an_escaped_blob_digest_is_chained_over_the_digest() {
        // a digest holding the marker's bytes, as about 13 in 2**32 digests do
        let mut digest = [1u8; DIGEST_SIZE];
        digest[6..10].copy_from_slice(&ESCAPE);
        let (frame, chain) = encode_blob_frame(BLOB, &digest, b"text", 7).unwrap();
        let BlobFrame::Whole(bytes) = frame else {
            panic!("escaped blob frames are written whole");
        };
        assert_eq!(bytes[5], BLOB | ESCAPED);
        assert_eq!(chain, u64_at(&bytes, 18));
        let mut payload = digest.to_vec();
        payload.extend_from_slice(b"text");
        assert_eq!(unescape(&bytes[HEADER_SIZE..]).as_ref(), payload.as_slice());
        let value = chain_value(
            BLOB | ESCAPED,
            (bytes.len() - HEADER_SIZE) as u32,
            7,
            &digest,
        );
        assert_eq!(value, chain);
    }

    #[test]
    fn too_large_records_are_refused() {
        assert_eq!(
            EncodeError::RecordTooLarge(5).to_string(),
            "a record of 5 bytes is larger than a frame can hold"
        );
    }

    #[test]
    fn a_blob_whose_real_digest_holds_the_escape_bytes_reads_back() {
        let text = b"a blob whose digest is unlucky 39074337"; // found by search
        let digest = blob_digest(text);
        assert!(find(&digest, &ESCAPE).is_some());
        let (BlobFrame::Whole(data), chain) = encode_blob_frame(BLOB, &digest, text, 0).unwrap()
        else {
            panic!("escaped blob frames are written whole");
        };
        let got = read(&data);
        assert!(got.stop.is_none());
        assert_eq!(got.frames[0].chain, chain);
        assert_eq!(&got.frames[0].payload(&data)[DIGEST_SIZE..], text);
    }

    #[test]
    fn rebuilding_a_frame_hashes_it_a_bounded_number_of_times() {
        let (data, offsets, _) = build(&records());
        let mut changed = data.clone();
        changed[offsets[3] + 5] = 0x7F; // the escaped turn's kind byte: every kind is tried
        let got = read(&changed);
        let mut counters = Counters::default();
        let end = got.stop.unwrap().resync.unwrap();
        let gap = read_gap(
            &changed,
            got.offset,
            end,
            got.chain,
            got.record,
            KINDS,
            &mut counters,
        );
        let frame = gap.repaired.expect("rebuilt");
        assert_eq!(
            (frame.kind, frame.offset, frame.end),
            (3, offsets[3], offsets[4])
        );
        let stored = (offsets[4] - offsets[3] - HEADER_SIZE) as u64;
        assert!(counters.hashed_bytes <= 2 * (u64::from(KINDS.max) + 1) * stored);
    }
}
