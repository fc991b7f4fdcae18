//! Frames of format version 1: kind, length, checksum, payload, each bound only by its own
//! checksum.
//!
//! A frame is the kind (1 byte), the payload length (4 bytes LE), xxh3-64 of the payload
//! seeded with `kind << 32 | length` (8 bytes LE), then the payload. Version 1 is read, and
//! written only to extend a version-1 log. With no marker and no chain, damage cannot be
//! resynced past: [`intact_end_after`] only tells damage followed by intact records from a
//! torn last write, in time linear in the damaged bytes.
//!
//! The reader shares version 2's shapes ([`Frame`], [`Scan`], [`Damage`]): a version-1 frame
//! has chain value 0 and is never escaped.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use super::frames::{
    u32_at, u64_at, Counters, Damage, DamageKind, EncodeError, Frame, Scan, Stop, DIGEST_SIZE,
};

/// The magic a version-1 file starts with.
pub const MAGIC_V1: &[u8; 8] = b"RLSTORE\x00";
/// Kind, payload length, checksum.
pub const HEADER_SIZE_V1: usize = 13;
/// The header's fields as a Python `struct` format (the library reads headers with it).
pub const HEADER_LAYOUT_V1: &str = "<BIQ";
/// The largest kind a version-1 file holds (`end`).
pub const MAX_KIND_V1: u8 = 4;
/// The largest payload a version-1 frame holds.
pub const MAX_PAYLOAD_V1: usize = u32::MAX as usize;
/// A blob payload is the msgpack array `[digest (bin 16), text (bin)]`: this prefix, the
/// digest, the text's `bin` header, then the text.
pub const BLOB_PREFIX_V1: [u8; 3] = [0x92, 0xC4, DIGEST_SIZE as u8];
/// What [`intact_end_after`] may hash before it takes the damage as followed by records:
/// this many times the bytes after it, plus a constant.
const HASH_BUDGET: (u64, u64) = (2, 1 << 20);

/// The checksum of a version-1 frame: xxh3-64 of the payload seeded with kind and length.
pub fn checksum(kind: u8, payload: &[u8]) -> u64 {
    xxh3_64_with_seed(payload, seed(kind, payload.len()))
}

fn seed(kind: u8, length: usize) -> u64 {
    u64::from(kind) << 32 | length as u64
}

fn header(kind: u8, length: u32, value: u64) -> [u8; HEADER_SIZE_V1] {
    let mut out = [0u8; HEADER_SIZE_V1];
    out[0] = kind;
    out[1..5].copy_from_slice(&length.to_le_bytes());
    out[5..].copy_from_slice(&value.to_le_bytes());
    out
}

/// The version-1 frame of a record of `kind`.
///
/// # Errors
/// [`EncodeError::RecordTooLarge`] when the payload exceeds [`MAX_PAYLOAD_V1`].
pub fn encode_frame(kind: u8, payload: &[u8]) -> Result<Vec<u8>, EncodeError> {
    let length =
        u32::try_from(payload.len()).map_err(|_| EncodeError::RecordTooLarge(payload.len()))?;
    let mut out = Vec::with_capacity(HEADER_SIZE_V1 + payload.len());
    out.extend_from_slice(&header(kind, length, checksum(kind, payload)));
    out.extend_from_slice(payload);
    Ok(out)
}

/// msgpack's `bin` header for `n` bytes, in its smallest form.
fn bin_header(n: usize, out: &mut Vec<u8>) {
    if let Ok(n) = u8::try_from(n) {
        out.extend_from_slice(&[0xC4, n]);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xC5);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xC6);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

/// The start of a version-1 blob frame of `kind`: its header and the payload up to the text,
/// which follows as given (it is hashed here, never copied).
///
/// # Errors
/// [`EncodeError::StringTooLarge`] when the payload exceeds [`MAX_PAYLOAD_V1`].
pub fn encode_blob_frame(
    kind: u8,
    digest: &[u8; DIGEST_SIZE],
    text: &[u8],
) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(HEADER_SIZE_V1 + BLOB_PREFIX_V1.len() + DIGEST_SIZE + 5);
    out.extend_from_slice(&[0; HEADER_SIZE_V1]);
    out.extend_from_slice(&BLOB_PREFIX_V1);
    out.extend_from_slice(digest);
    bin_header(text.len(), &mut out);
    let size = out.len() - HEADER_SIZE_V1 + text.len();
    let length = u32::try_from(size).map_err(|_| EncodeError::StringTooLarge(text.len()))?;
    let mut hasher = Xxh3::with_seed(seed(kind, size));
    hasher.update(&out[HEADER_SIZE_V1..]);
    hasher.update(text);
    out[..HEADER_SIZE_V1].copy_from_slice(&header(kind, length, hasher.digest()));
    Ok(out)
}

/// The frame at `offset` verified by its checksum: (kind, end of its payload).
fn check(data: &[u8], offset: usize, counters: &mut Counters) -> Result<(u8, usize), DamageKind> {
    if data.len().saturating_sub(offset) < HEADER_SIZE_V1 {
        return Err(DamageKind::HeaderCut);
    }
    let kind = data[offset];
    let length = u32_at(data, offset + 1);
    let expected = u64_at(data, offset + 5);
    let start = offset + HEADER_SIZE_V1;
    if length as usize > data.len() - start {
        return Err(DamageKind::PayloadCut {
            present: data.len() - start,
            length,
        });
    }
    let end = start + length as usize;
    counters.hashed_bytes += u64::from(length);
    let actual = checksum(kind, &data[start..end]);
    if actual != expected {
        return Err(DamageKind::Checksum { expected, actual });
    }
    Ok((kind, end))
}

/// Reads every version-1 frame from `start` (numbered from `record`) to the end of `data` or
/// to the first damage, whose `torn` says whether it is a torn tail ([`intact_end_after`]).
/// Kinds are not checked here: the reader of records refuses the ones it does not know.
pub fn scan(data: &[u8], start: usize, record: u64, counters: &mut Counters) -> Scan {
    let mut out = Scan {
        frames: Vec::new(),
        offset: start,
        chain: 0,
        record,
        stop: None,
    };
    while out.offset < data.len() {
        let offset = out.offset;
        match check(data, offset, counters) {
            Ok((kind, end)) => {
                out.frames.push(Frame {
                    kind,
                    offset,
                    start: offset + HEADER_SIZE_V1,
                    end,
                    record: out.record,
                    chain: 0,
                    unescaped: None,
                });
                out.offset = end;
                out.record += 1;
            }
            Err(kind) => {
                let torn =
                    kind == DamageKind::HeaderCut || !intact_end_after(data, offset, counters);
                out.stop = Some(Stop {
                    damage: Damage {
                        kind,
                        offset,
                        record: out.record,
                    },
                    resync: None,
                    torn,
                });
                break;
            }
        }
    }
    out
}

/// The offset from which `data` holds only zero bytes to its end (at least `from`).
fn zeros_from(data: &[u8], from: usize) -> usize {
    let from = from.min(data.len());
    data[from..]
        .iter()
        .rposition(|&b| b != 0)
        .map_or(from, |at| from + at + 1)
}

/// Whether intact records follow the damaged version-1 frame at `start`: whether the file
/// ends with a frame whose checksum holds (zero bytes may follow it) that starts after
/// `start`. If not, the damage is a torn last write (a cut, garbage or zeros to the end).
///
/// Linear in the bytes after `start`: each offset is looked at once, and only a frame that
/// would end at the end of the data (or where only zeros follow) is hashed. A tail crafted to
/// hold more such candidates than a bounded multiple of its size is taken as followed by
/// records (so repair refuses rather than cut what might be intact).
pub fn intact_end_after(data: &[u8], start: usize, counters: &mut Counters) -> bool {
    let size = data.len();
    let first = start.saturating_add(1);
    let Some(last) = size.checked_sub(HEADER_SIZE_V1) else {
        return false;
    };
    if first > last {
        return false;
    }
    let zeros = zeros_from(data, first);
    let mut budget = HASH_BUDGET.0 * (size - start) as u64 + HASH_BUDGET.1;
    counters.searched_bytes += (last + 1 - first) as u64;
    for pos in first..=last {
        let kind = data[pos];
        if kind > MAX_KIND_V1 {
            continue;
        }
        let length = u64::from(u32_at(data, pos + 1));
        let end = (pos + HEADER_SIZE_V1) as u64 + length;
        if end < zeros as u64 || end > size as u64 {
            continue;
        }
        counters.candidates += 1;
        if length > budget {
            return true;
        }
        budget -= length;
        counters.hashed_bytes += length;
        let payload = &data[pos + HEADER_SIZE_V1..end as usize];
        if checksum(kind, payload) == u64_at(data, pos + 5) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::frames::blob_digest;

    /// Frames written by the library's Python version-1 encoder: a header, a value, a blob, a
    /// turn, an empty value and a turn.
    const PYTHON_FRAMES: &str = "000b00000008152a52cc8161566865616465722069642d30020900000037ca164b75e5e52776616c7565206f6e6501450000005702314fd6175d0c92c410d9bf4a46e3b7e76d929852aa39fe465bc43061206c6f6e6720737472696e6720c3a961206c6f6e6720737472696e6720c3a961206c6f6e6720737472696e6720c3a90311000000224dacaa15eebbd87475726e200001020304207265636f72640200000000e48fdb63bbebd1630304000000caa26e055028c6da6c617374";
    /// The first 40 bytes of the Python encoder's blob frame of 300 bytes `x` (a 16-bit
    /// `bin` header) under the digest of the blob above.
    const PYTHON_BLOB_300: &str =
        "0142010000ca08da9fa515e96a92c410d9bf4a46e3b7e76d929852aa39fe465bc5012c7878787878";
    const BLOB: u8 = 1;
    const LOG: &[u8] = include_bytes!("../../../../tests/data/v1_log.rls");
    const SNAPSHOT: &[u8] = include_bytes!("../../../../tests/data/v1_snapshot.rls");

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    fn blob_text() -> Vec<u8> {
        "a long string \u{e9}".repeat(3).into_bytes()
    }

    fn records() -> Vec<(u8, Vec<u8>)> {
        vec![
            (0, b"header id-0".to_vec()),
            (2, b"value one".to_vec()),
            (BLOB, blob_text()),
            (3, b"turn \x00\x01\x02\x03\x04 record".to_vec()),
            (2, Vec::new()),
            (3, b"last".to_vec()),
        ]
    }

    /// The records as frames, and every frame's offset.
    fn build() -> (Vec<u8>, Vec<usize>) {
        let (mut out, mut offsets) = (Vec::new(), Vec::new());
        for (kind, payload) in records() {
            offsets.push(out.len());
            if kind == BLOB {
                let head = encode_blob_frame(kind, &blob_digest(&payload), &payload).unwrap();
                out.extend_from_slice(&head);
                out.extend_from_slice(&payload);
            } else {
                out.extend_from_slice(&encode_frame(kind, &payload).unwrap());
            }
        }
        (out, offsets)
    }

    fn read(data: &[u8]) -> Scan {
        scan(data, 0, 0, &mut Counters::default())
    }

    fn torn(data: &[u8]) -> bool {
        read(data).stop.expect("damage").torn
    }

    #[test]
    fn checksum_matches_the_python_library() {
        // xxhash.xxh3_64_intdigest(b"abc", seed=3 << 32 | 3)
        assert_eq!(checksum(3, b"abc"), 10_921_337_902_345_325_344);
    }

    #[test]
    fn writes_what_the_python_encoder_wrote() {
        assert_eq!(build().0, unhex(PYTHON_FRAMES));
        let digest = blob_digest(&blob_text());
        let text = [b'x'; 300];
        let mut frame = encode_blob_frame(BLOB, &digest, &text).unwrap();
        frame.extend_from_slice(&text);
        assert_eq!(frame[..40], unhex(PYTHON_BLOB_300)[..]);
    }

    #[test]
    fn reads_frames_the_python_encoder_wrote() {
        let data = unhex(PYTHON_FRAMES);
        let got = read(&data);
        assert!(got.stop.is_none());
        assert_eq!((got.offset, got.record), (data.len(), 6));
        let payloads: Vec<(u8, Vec<u8>)> = got
            .frames
            .iter()
            .map(|f| {
                let p = f.payload(&data);
                let p = if f.kind == BLOB { &p[21..] } else { p };
                (f.kind, p.to_vec())
            })
            .collect();
        assert_eq!(payloads, records());
        let blob = &got.frames[2];
        assert_eq!(
            blob.payload(&data)[3..3 + DIGEST_SIZE],
            blob_digest(&blob_text())
        );
    }

    #[test]
    fn reads_the_version_1_fixtures_whole() {
        // the kinds the library's Python reader read from them
        let log = [0, 1, 1, 1, 2, 2, 2, 3, 1, 1, 2, 3, 3, 3];
        let snapshot = [0, 1, 1, 1, 2, 2, 2, 3, 1, 1, 2, 3, 1, 1, 2, 3, 3, 3, 3, 4];
        for (file, kinds) in [(LOG, &log[..]), (SNAPSHOT, &snapshot[..])] {
            assert_eq!(&file[..8], MAGIC_V1);
            let mut counters = Counters::default();
            let got = scan(file, MAGIC_V1.len(), 0, &mut counters);
            assert!(got.stop.is_none());
            assert_eq!(got.offset, file.len());
            let read: Vec<u8> = got.frames.iter().map(|f| f.kind).collect();
            assert_eq!(read, kinds);
            let payloads: usize = got.frames.iter().map(|f| f.end - f.start).sum();
            assert_eq!(counters.hashed_bytes, payloads as u64);
            assert_eq!(payloads + got.frames.len() * HEADER_SIZE_V1 + 8, file.len());
        }
    }

    #[test]
    fn every_flipped_bit_is_damage_at_its_frame() {
        let (data, offsets) = build();
        for pos in 0..data.len() {
            let mut changed = data.clone();
            changed[pos] ^= 1 << (pos % 8);
            let frame = *offsets.iter().rev().find(|&&o| o <= pos).unwrap();
            let got = read(&changed);
            let stop = got.stop.expect("damage found");
            // a length made shorter may leave a frame that checks out only by chance: never here
            assert_eq!(stop.damage.offset, frame, "{pos}");
            assert_eq!(
                got.frames.len(),
                offsets.iter().position(|&o| o == frame).unwrap()
            );
        }
    }

    #[test]
    fn damage_kinds_messages_and_torn_tails() {
        let (data, offsets) = build();
        let cut = read(&data[..data.len() - 2]).stop.unwrap();
        assert_eq!(
            cut.damage.kind,
            DamageKind::PayloadCut {
                present: 2,
                length: 4
            }
        );
        assert_eq!(
            (cut.damage.offset, cut.damage.record, cut.torn, cut.resync),
            (offsets[5], 5, true, None)
        );
        let header_cut = read(&data[..offsets[1] + 3]).stop.unwrap();
        assert_eq!(header_cut.damage.kind, DamageKind::HeaderCut);
        assert!(header_cut.torn);
        assert_eq!(
            header_cut.damage.kind.to_string(),
            "file ends inside a frame header"
        );
        // damage in the middle, the last frame intact: not a torn tail
        let mut middle = data.clone();
        middle[offsets[1] + HEADER_SIZE_V1] ^= 1;
        let stop = read(&middle).stop.unwrap();
        assert!(matches!(stop.damage.kind, DamageKind::Checksum { .. }));
        assert!(stop
            .damage
            .kind
            .to_string()
            .starts_with("record checksum mismatch: expected 0x"));
        assert!(!stop.torn);
        // zeros after the last frame (a preallocated tail) still leave it intact at the end
        let mut zeros = middle.clone();
        zeros.extend_from_slice(&[0; 100]);
        assert!(!torn(&zeros));
        // garbage or zeros to the end after damage: torn
        let mut garbage = data[..offsets[4] + 3].to_vec();
        garbage.extend_from_slice(&[0xFF; 50]);
        assert!(torn(&garbage));
        let mut zeroed = data[..offsets[4]].to_vec();
        zeroed.extend_from_slice(&[0; 64]);
        assert!(torn(&zeroed));
    }

    #[test]
    fn intact_end_after_hashes_only_frames_that_end_the_file() {
        let (data, offsets) = build();
        let mut counters = Counters::default();
        assert!(intact_end_after(&data, offsets[1], &mut counters));
        assert_eq!(counters.candidates, 1);
        assert_eq!(counters.hashed_bytes, 4);
        assert!(!intact_end_after(
            &data,
            offsets[5],
            &mut Counters::default()
        ));
        assert!(!intact_end_after(
            &data,
            data.len(),
            &mut Counters::default()
        ));
        assert!(!intact_end_after(&[], 0, &mut Counters::default()));
    }

    #[test]
    fn a_tail_crafted_with_many_candidates_is_bounded() {
        // frame headers every 13 bytes, each claiming to end at the end of the data
        let n = 1 << 12;
        let mut tail = vec![0xFF; n * HEADER_SIZE_V1];
        for i in 0..n {
            let at = i * HEADER_SIZE_V1;
            let remaining = (tail.len() - at - HEADER_SIZE_V1) as u32;
            tail[at..at + HEADER_SIZE_V1].copy_from_slice(&header(4, remaining, 0));
        }
        let (mut data, _) = build();
        let damaged = data.len();
        data.push(1); // a frame of kind 1 cut after its kind
        data.extend_from_slice(&tail);
        let mut counters = Counters::default();
        let got = scan(&data, 0, 0, &mut counters);
        let stop = got.stop.unwrap();
        assert_eq!(stop.damage.offset, damaged);
        assert!(!stop.torn); // taken as followed by records
        let budget = 2 * (data.len() - damaged) as u64 + (1 << 20);
        assert!(counters.hashed_bytes <= damaged as u64 + budget);
        assert!(counters.hashed_bytes > (1 << 20)); // the budget was spent
    }

    #[test]
    fn work_is_linear_in_the_damaged_bytes() {
        let mut per_byte = Vec::new();
        for size in [16usize << 10, 128 << 10] {
            let (mut data, _) = build();
            // plausible headers of kind 0 everywhere, none ending at the end
            data.extend(std::iter::repeat_n(0u8, size));
            data.push(0xFF);
            let mut counters = Counters::default();
            assert!(torn(&data[..]));
            scan(&data, 0, 0, &mut counters);
            per_byte.push((counters.hashed_bytes + counters.searched_bytes) * 1000 / size as u64);
        }
        assert!(per_byte[1] <= per_byte[0] + 100, "{per_byte:?}");
        assert!(per_byte[1] <= 3000, "{per_byte:?}");
    }

    #[test]
    fn bin_headers_take_the_smallest_form() {
        for (n, head) in [
            (255usize, vec![0xC4, 0xFF]),
            (256, vec![0xC5, 0x01, 0x00]),
            (65_536, vec![0xC6, 0, 1, 0, 0]),
        ] {
            let mut out = Vec::new();
            bin_header(n, &mut out);
            assert_eq!(out, head, "{n}");
        }
    }

    #[test]
    fn header_layouts_match_their_sizes() {
        fn size(layout: &str) -> usize {
            let (mut total, mut count) = (0, String::new());
            for c in layout.chars().skip(1) {
                if c.is_ascii_digit() {
                    count.push(c);
                    continue;
                }
                let n = count.parse().unwrap_or(1);
                count.clear();
                total += n * match c {
                    's' | 'B' => 1,
                    'I' => 4,
                    'Q' => 8,
                    _ => panic!("unexpected format character {c}"),
                };
            }
            total
        }
        assert_eq!(size(HEADER_LAYOUT_V1), HEADER_SIZE_V1);
        assert_eq!(
            size(super::super::frames::HEADER_LAYOUT),
            super::super::frames::HEADER_SIZE
        );
    }
}
