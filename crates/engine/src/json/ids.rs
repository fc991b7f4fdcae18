//! Token ids as an engine writes them (a JSON array of ints), read straight into packed u32s:
//! a long context's ids never become one interpreter object each.

use super::scan::{skip_space, string_end, value_end};

/// The ids of `text` as native-endian u32 (an `array('I')`'s bytes) when it is a JSON array
/// of ints in [0, 2**32), each written as JSON writes an int (no sign, fraction, exponent or
/// leading zero), with JSON whitespace around the tokens; else `None` (the caller decodes it
/// as `json.loads` would, and gets its values or its error).
#[must_use]
pub fn u32_ids(text: &[u8]) -> Option<Vec<u8>> {
    let (packed, end) = ids_at(text, skip_space(text, 0))?;
    (skip_space(text, end) == text.len()).then_some(packed)
}

/// Where a top-level member's array of ids is in an object's text, and the ids packed.
#[derive(Debug, PartialEq, Eq)]
pub struct MemberIds {
    /// Where the array begins and ends in the text.
    pub start: usize,
    pub end: usize,
    /// The ids as `u32_ids` packs them.
    pub packed: Vec<u8>,
}

/// The member `key` (written without escapes) of the JSON object `text`, read as `u32_ids`
/// reads ids, when the object's last member of that key holds such an array; `None` when it
/// does not, when a key of the object is written with an escape (it may stand for `key`), or
/// when `text` is not one object whose structure the scan can follow: the caller decodes it.
/// The other members are skipped, not checked: the caller decodes the text with that array
/// put out of the way, which checks them.
#[must_use]
pub fn member_ids(text: &[u8], key: &[u8]) -> Option<MemberIds> {
    let mut i = skip_space(text, 0);
    if text.get(i) != Some(&b'{') {
        return None;
    }
    let mut found = None;
    i = skip_space(text, i + 1);
    if text.get(i) == Some(&b'}') {
        return None;
    }
    loop {
        if text.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(text, i)?;
        let name = &text[i + 1..key_end - 1];
        if name.contains(&b'\\') {
            return None;
        }
        let ours = name == key;
        i = skip_space(text, key_end);
        if text.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_space(text, i + 1);
        let end = if ours {
            // the last member of the key wins (as json.loads keeps it): a later one that is
            // not an array of ids leaves nothing found
            let ids = ids_at(text, start);
            let end = match &ids {
                Some((_, end)) => *end,
                None => value_end(text, start)?,
            };
            found = ids.map(|(packed, _)| MemberIds { start, end, packed });
            end
        } else {
            value_end(text, start)?
        };
        i = skip_space(text, end);
        match text.get(i)? {
            b',' => i = skip_space(text, i + 1),
            b'}' => return found,
            _ => return None,
        }
    }
}

/// The ids of the array at `i` and where it ends.
fn ids_at(text: &[u8], mut i: usize) -> Option<(Vec<u8>, usize)> {
    if text.get(i) != Some(&b'[') {
        return None;
    }
    // about the count of ids written as "151643, " (more is grown into)
    let mut out = Vec::with_capacity((text.len() - i) / 2);
    i = skip_space(text, i + 1);
    if text.get(i) == Some(&b']') {
        return Some((out, i + 1));
    }
    loop {
        let (value, end) = int(text, i)?;
        out.extend_from_slice(&value.to_ne_bytes());
        i = end;
        if text.get(i) == Some(&b',') {
            i += 1; // the common spelling, "1,2" or "1, 2"
            if text.get(i) == Some(&b' ') {
                i += 1;
            }
            i = skip_space(text, i);
            continue;
        }
        i = skip_space(text, i);
        match text.get(i)? {
            b',' => i = skip_space(text, i + 1),
            b']' => return Some((out, i + 1)),
            _ => return None,
        }
    }
}

/// The int at `i` (digits only, no leading zero) and where it ends; `None` past 2**32 - 1.
fn int(text: &[u8], i: usize) -> Option<(u32, usize)> {
    let mut value = 0u64;
    let mut j = i;
    while let Some(&byte) = text.get(j) {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        if j - i == 10 {
            return None; // more digits than 32 bits hold
        }
        value = value * 10 + u64::from(digit);
        j += 1;
    }
    let n = j - i;
    if n == 0 || (n > 1 && text[i] == b'0') {
        return None; // no digit, or a leading zero (not JSON)
    }
    // a fraction or an exponent makes it a float
    if matches!(text.get(j), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    Some((u32::try_from(value).ok()?, j))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(text: &str) -> Option<Vec<u32>> {
        u32_ids(text.as_bytes()).map(|out| {
            out.chunks_exact(4)
                .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
                .collect()
        })
    }

    #[test]
    fn arrays_of_ids_are_read() {
        assert_eq!(ids("[]"), Some(vec![]));
        assert_eq!(ids(" [ ] \n"), Some(vec![]));
        assert_eq!(ids("[0]"), Some(vec![0]));
        assert_eq!(ids("[1,2, 3 ,\n4]"), Some(vec![1, 2, 3, 4]));
        assert_eq!(ids("\t[4294967295]\r\n"), Some(vec![u32::MAX]));
    }

    #[test]
    fn a_members_ids_are_found_where_they_are() {
        let text = br#"{"a": "x\"}", "ids": [1, 2], "b": [{"ids": [9]}, "]"], "c": 1.5}"#;
        let found = member_ids(text, b"ids").unwrap();
        assert_eq!(&text[found.start..found.end], b"[1, 2]");
        assert_eq!(found.packed, u32_ids(b"[1,2]").unwrap());
        // the last member of the key wins
        let text = br#"{"ids": [1], "x": {}, "ids": [3]}"#;
        let found = member_ids(text, b"ids").unwrap();
        assert_eq!(&text[found.start..found.end], b"[3]");
        for text in [
            &br#"{"ids": [1], "ids": null}"#[..],
            br#"{"ids": [1.5]}"#,
            br#"{"id\u0073": [1]}"#,
            br#"{"ids": [1], "id\u0073": null}"#,
            br#"{"x": [1]}"#,
            br"{}",
            br"[1]",
            br#"{"ids": [1], "x": "#,
            br#"{"x": "unterminated, "ids": [1]}"#,
        ] {
            assert_eq!(
                member_ids(text, b"ids"),
                None,
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }

    #[test]
    fn anything_else_is_left_to_the_decoder() {
        for text in [
            "",
            "[",
            "]",
            "[1",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[01]",
            "[00]",
            "[-1]",
            "[-0]",
            "[1.0]",
            "[1e3]",
            "[1E3]",
            "[4294967296]",
            "[99999999999999999999]",
            "[true]",
            "[null]",
            "[\"1\"]",
            "[[1]]",
            "{}",
            "1",
            "[1] x",
            "[1]]",
            "[1]\u{a0}",
            "\u{feff}[1]",
            "[1\u{0}]",
        ] {
            assert_eq!(ids(text), None, "{text:?}");
        }
    }
}
