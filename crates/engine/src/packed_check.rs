//! Checking a stored packed value without building it: what a file's loader trusts.
//!
//! [`check`] walks the msgpack bytes of one value and refuses anything the library could not
//! hand back as JSON later: malformed or trailing bytes, nesting deeper than the limit, bytes
//! (JSON has none), containers or markers as dict keys, a tuple marker anywhere but first in
//! an array, unknown extension types, blob references out of range, big ints that are not
//! decimal numbers and strings that would not decode. It allocates nothing per item (a
//! container's count is checked against the bytes left before anything is read, and the open
//! containers are a stack bounded by the depth limit), and it records where blob references
//! are, so a value's plain packing is spliced from bytes instead of decoded.
//!
//! In record mode it checks one of a file's own records instead: bytes are allowed, extension
//! types are not, strings are not decoded (ids may hold lone surrogates), and at most a given
//! number of containers may open, so decoding the record afterwards stays bounded.

use std::fmt;

use crate::packed::{is_decimal, EXT_BIGINT, EXT_BLOB, EXT_ECHO, EXT_SURROGATE, EXT_TUPLE};

/// What a value may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// blob references must be below this
    pub n_blobs: u64,
    /// containers nest at most this deep
    pub max_depth: usize,
    /// echo placeholders are allowed (not as dict keys)
    pub echo_ok: bool,
    /// a file's own record rather than a JSON value
    pub record: bool,
    /// at most this many containers may open
    pub max_containers: Option<usize>,
}

/// What [`check`] found in one value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// items of the top-level array, or -1 if the value is not an array
    pub top_items: i64,
    /// a tuple, a big int, a lone surrogate, or a reference to a blob holding one
    pub special: bool,
    pub echoes: u32,
    /// the byte offsets of the blob references, in order
    pub blob_refs: Vec<u32>,
}

/// Why bytes are not a value the library stores, and the offset of the item where that was
/// found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckError {
    pub offset: usize,
    pub message: String,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (at byte {})", self.message, self.offset)
    }
}

impl std::error::Error for CheckError {}

fn refuse(offset: usize, message: impl Into<String>) -> CheckError {
    CheckError {
        offset,
        message: message.into(),
    }
}

/// One open container: items still to read there (a map counts keys and values).
struct Open {
    left: usize,
    map: bool,
}

struct Walk<'a, 'f> {
    data: &'a [u8],
    limits: Limits,
    containers: Option<usize>,
    found: Found,
    /// whether blob `index` holds a lone surrogate
    surrogates: &'f mut dyn FnMut(u32) -> bool,
}

/// Check one packed value (see the module documentation). `surrogates(index)` tells whether
/// blob `index` holds a lone surrogate (a value referring to one is special).
///
/// # Errors
/// A [`CheckError`] naming what is wrong and the offset of the item.
pub fn check(
    data: &[u8],
    limits: Limits,
    surrogates: &mut dyn FnMut(u32) -> bool,
) -> Result<Found, CheckError> {
    let mut walk = Walk {
        data,
        limits,
        containers: limits.max_containers,
        found: Found {
            top_items: -1,
            ..Found::default()
        },
        surrogates,
    };
    walk.run()?;
    Ok(walk.found)
}

/// What an item's first bytes say: where the next item starts, or a container to open
/// (its item count, whether a map, where its items start).
enum Step {
    Next(usize),
    Open(usize, bool, usize),
}

impl Walk<'_, '_> {
    fn run(&mut self) -> Result<(), CheckError> {
        let mut stack: Vec<Open> = Vec::new();
        let mut current = Open {
            left: 1,
            map: false,
        };
        let mut first = false; // the next item is the first of an array
        let mut pos = 0;
        loop {
            while current.left == 0 {
                let Some(outer) = stack.pop() else {
                    return self.finish(pos);
                };
                current = outer;
            }
            let key = current.map && current.left & 1 == 0;
            current.left -= 1;
            let at = pos;
            let was_first = std::mem::take(&mut first);
            match self.item(at, key, was_first)? {
                Step::Next(next) => pos = next,
                Step::Open(n, map, start) => {
                    let items = self.enter(at, key, n, map, start, stack.len())?;
                    pos = start;
                    first = items > 0 && !map; // an empty one has no first item
                    if items > 0 {
                        stack.push(std::mem::replace(&mut current, Open { left: items, map }));
                    }
                }
            }
        }
    }

    /// The end of the top value: nothing may follow it.
    fn finish(&self, pos: usize) -> Result<(), CheckError> {
        if pos == self.data.len() {
            Ok(())
        } else {
            Err(refuse(
                pos,
                format!("{} bytes after the value", self.data.len() - pos),
            ))
        }
    }

    /// The item at `at` (a dict key if `key`; an array's first item if `first`).
    fn item(&mut self, at: usize, key: bool, first: bool) -> Result<Step, CheckError> {
        let data = self.data;
        let b = *data
            .get(at)
            .ok_or_else(|| refuse(at, "the value is cut short"))?;
        Ok(match b {
            0x00..=0x7F | 0xE0..=0xFF | 0xC0 | 0xC2 | 0xC3 => Step::Next(at + 1),
            0xA0..=0xBF => Step::Next(self.string(at, 1, usize::from(b & 0x1F))?),
            0x80..=0x8F => Step::Open(usize::from(b & 0x0F), true, at + 1),
            0x90..=0x9F => Step::Open(usize::from(b & 0x0F), false, at + 1),
            0xDC | 0xDE => Step::Open(self.length(at, 2)?, b == 0xDE, at + 3),
            0xDD | 0xDF => Step::Open(self.length(at, 4)?, b == 0xDF, at + 5),
            0xCA..=0xD3 => {
                let size = match b {
                    0xCC | 0xD0 => 2,
                    0xCD | 0xD1 => 3,
                    0xCA | 0xCE | 0xD2 => 5,
                    _ => 9,
                };
                if at + size > data.len() {
                    return Err(refuse(at, "a number runs past the end"));
                }
                Step::Next(at + size)
            }
            0xD9..=0xDB => {
                let width = 1 << (b - 0xD9);
                let n = self.length(at, width)?;
                Step::Next(self.string(at, 1 + width, n)?)
            }
            0xC4..=0xC6 => {
                if !self.limits.record {
                    return Err(refuse(at, "bytes, which JSON cannot carry"));
                }
                let width = 1 << (b - 0xC4);
                let n = self.length(at, width)?;
                Step::Next(self.string(at, 1 + width, n)?)
            }
            0xC7..=0xC9 | 0xD4..=0xD8 => Step::Next(self.ext(b, at, key, first)?),
            _ => return Err(refuse(at, format!("type byte {b:#04x} is not msgpack"))),
        })
    }

    /// Checks before a container at `at` of `n` items (pairs for a map), its items from
    /// `start`, inside `depth` open ones, is entered: the items to read there.
    fn enter(
        &mut self,
        at: usize,
        key: bool,
        n: usize,
        map: bool,
        start: usize,
        depth: usize,
    ) -> Result<usize, CheckError> {
        if key {
            return Err(refuse(at, "a container as a dict key"));
        }
        let items = if map { n.saturating_mul(2) } else { n };
        if items > self.data.len().saturating_sub(start) {
            return Err(refuse(
                at,
                "a container claims more items than bytes are left",
            ));
        }
        if depth >= self.limits.max_depth {
            return Err(refuse(
                at,
                format!("nesting deeper than {} levels", self.limits.max_depth),
            ));
        }
        if let Some(budget) = self.containers.as_mut() {
            if *budget == 0 {
                return Err(refuse(at, "more containers than the record can hold"));
            }
            *budget -= 1;
        }
        if depth == 0 && !map {
            self.found.top_items = i64::try_from(n).unwrap_or(i64::MAX);
        }
        Ok(items)
    }

    /// A length field of `width` bytes after the type byte at `at`.
    fn length(&self, at: usize, width: usize) -> Result<usize, CheckError> {
        let field = self
            .data
            .get(at + 1..at + 1 + width)
            .ok_or_else(|| refuse(at, "the value is cut short"))?;
        Ok(field
            .iter()
            .fold(0usize, |n, &byte| (n << 8) | usize::from(byte)))
    }

    /// A string (or bytes) of `n` bytes after a header of `header` bytes at `at`: the position
    /// after it. A JSON value's strings must be UTF-8.
    fn string(&self, at: usize, header: usize, n: usize) -> Result<usize, CheckError> {
        let start = at + header;
        let end = start
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| refuse(at, "a string runs past the end"))?;
        if !self.limits.record && std::str::from_utf8(&self.data[start..end]).is_err() {
            return Err(refuse(at, "a string that is not UTF-8"));
        }
        Ok(end)
    }

    /// An extension type (only those the library writes, where it writes them).
    fn ext(&mut self, b: u8, at: usize, key: bool, first: bool) -> Result<usize, CheckError> {
        let (n, start) = if (0xD4..=0xD8).contains(&b) {
            (1usize << (b - 0xD4), at + 2) // fixext
        } else {
            let width = 1 << (b - 0xC7);
            (self.length(at, width)?, at + 2 + width)
        };
        let end = start
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| refuse(at, "an extension runs past the end"))?;
        if self.limits.record {
            return Err(refuse(at, "an extension type is not allowed in a record"));
        }
        let code = i8::from_be_bytes([self.data[start - 1]]);
        let payload = &self.data[start..end];
        let found = &mut self.found;
        match code {
            EXT_BLOB => {
                let index = (payload.len() <= 8).then(|| {
                    payload
                        .iter()
                        .fold(0u64, |index, &byte| (index << 8) | u64::from(byte))
                });
                match index {
                    // The splicers read a reference at its offset as `D6 04` and four bytes,
                    // the only form any version writes; another form of it is refused.
                    Some(_) if b != 0xD6 => {
                        return Err(refuse(
                            at,
                            "a blob reference not written as a 4-byte fixext",
                        ))
                    }
                    Some(index) if index < self.limits.n_blobs => {
                        found.blob_refs.push(u32::try_from(at).unwrap_or(u32::MAX));
                        if (self.surrogates)(index as u32) {
                            found.special = true;
                        }
                    }
                    Some(index) => {
                        return Err(refuse(
                            at,
                            format!(
                                "blob reference {index} out of range ({} blobs)",
                                self.limits.n_blobs
                            ),
                        ))
                    }
                    None => {
                        return Err(refuse(
                            at,
                            format!(
                                "a blob reference of {} bytes is out of range",
                                payload.len()
                            ),
                        ))
                    }
                }
            }
            EXT_TUPLE if n == 0 && first && !key => found.special = true,
            EXT_ECHO if n == 0 && self.limits.echo_ok && !key => found.echoes += 1,
            EXT_BIGINT if n > 0 => {
                if !is_decimal(payload) {
                    return Err(refuse(at, "a big int that is not a decimal number"));
                }
                found.special = true;
            }
            EXT_SURROGATE => {
                if !utf8_with_surrogates(payload) {
                    return Err(refuse(at, "a string that is not UTF-8"));
                }
                found.special = true;
            }
            _ => {
                return Err(refuse(
                    at,
                    format!("extension type {code} is not allowed here"),
                ))
            }
        }
        Ok(end)
    }
}

/// Whether `bytes` decode as UTF-8 where encoded surrogates (`ED A0..BF 80..BF`) are allowed
/// too (Python's "surrogatepass").
pub fn utf8_with_surrogates(mut bytes: &[u8]) -> bool {
    loop {
        match std::str::from_utf8(bytes) {
            Ok(_) => return true,
            Err(err) => {
                let at = err.valid_up_to();
                match bytes.get(at..at + 3) {
                    Some([0xED, 0xA0..=0xBF, 0x80..=0xBF]) => bytes = &bytes[at + 3..],
                    _ => return false,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(n_blobs: u64) -> Limits {
        Limits {
            n_blobs,
            max_depth: 500,
            echo_ok: false,
            record: false,
            max_containers: None,
        }
    }

    fn checked(data: &[u8], n_blobs: u64) -> Result<Found, CheckError> {
        check(data, limits(n_blobs), &mut |_| false)
    }

    #[test]
    fn stored_values_pass_with_what_they_hold() {
        // [{"a": [1, 2.5, None, True]}, "x", blob 1, (tuple)]
        let mut data = vec![0x94, 0x81, 0xA1, b'a', 0x94, 0x01, 0xCB];
        data.extend_from_slice(&2.5f64.to_be_bytes());
        data.extend_from_slice(&[0xC0, 0xC3, 0xA1, b'x', 0xD6, 0x04, 0, 0, 0, 1]);
        data.extend_from_slice(&[0x91, 0xC7, 0x00, 0x01]);
        let found = checked(&data, 2).unwrap();
        assert_eq!(found.top_items, 4);
        assert!(found.special);
        assert_eq!(found.blob_refs, vec![19]);
        let with_surrogate = check(&data, limits(2), &mut |index| index == 1).unwrap();
        assert!(with_surrogate.special);
        assert_eq!(checked(&[0x81, 0xA1, b'a', 0x01], 0).unwrap().top_items, -1);
    }

    #[test]
    fn refusals_name_what_and_where() {
        let cases: &[(&[u8], &str, usize)] = &[
            (b"\xc4\x01x", "bytes, which JSON cannot carry", 0),
            (b"\x81\x90\x01", "a container as a dict key", 1),
            (
                b"\x92\x01\xc7\x00\x01",
                "extension type 1 is not allowed here",
                2,
            ),
            (
                b"\xd6\x04\x00\x00\x00\x09",
                "blob reference 9 out of range (1 blobs)",
                0,
            ),
            (
                b"\xc7\x04\x04\x00\x00\x00\x00",
                "a blob reference not written as a 4-byte fixext",
                0,
            ),
            (
                b"\xc7\x03\x02abc",
                "a big int that is not a decimal number",
                0,
            ),
            (b"\xc1", "type byte 0xc1 is not msgpack", 0),
            (b"\x01\x02", "1 bytes after the value", 1),
            (
                b"\xdd\xff\xff\xff\xff",
                "a container claims more items than bytes are left",
                0,
            ),
            (b"\xa3ab", "a string runs past the end", 0),
            (b"\x92\xa1\xc3\xa1\xa9", "a string that is not UTF-8", 1),
            (b"\x91\xdc\x00", "the value is cut short", 1),
            (b"\xcb\x00", "a number runs past the end", 0),
        ];
        for &(data, message, offset) in cases {
            let err = checked(data, 1).unwrap_err();
            assert_eq!(
                (err.message.as_str(), err.offset),
                (message, offset),
                "{data:?}"
            );
        }
    }

    #[test]
    fn depth_and_containers_are_bounded() {
        let mut ok = vec![0x91; 499];
        ok.push(0x90);
        assert!(checked(&ok, 0).is_ok());
        let mut deep = vec![0x91; 500];
        deep.push(0x90);
        assert_eq!(
            checked(&deep, 0).unwrap_err().message,
            "nesting deeper than 500 levels"
        );
        let record = Limits {
            record: true,
            max_containers: Some(2),
            ..limits(0)
        };
        let data = b"\x93\xc4\x01\xff\xa2\xed\xb0\x91\x91\x01";
        assert_eq!(
            check(data, record, &mut |_| false).unwrap_err().message,
            "more containers than the record can hold"
        );
        let roomy = Limits {
            max_containers: Some(3),
            ..record
        };
        assert!(check(data, roomy, &mut |_| false).is_ok());
    }

    #[test]
    fn surrogates_pass_only_where_written_so() {
        assert!(utf8_with_surrogates(b"a\xed\xa0\x80b\xc3\xa9"));
        assert!(!utf8_with_surrogates(b"\xed\xa0"));
        assert!(!utf8_with_surrogates(b"\xff"));
        assert!(checked(b"\xc7\x03\x03\xed\xb0\x80", 0).unwrap().special);
    }
}
