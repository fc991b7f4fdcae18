//! Following a JSON text's structure without reading its tokens: where a string or a value
//! ends, past the whitespace. For scans that look for one member (the data plane's capture
//! fields, an answer's token ids) and leave checking the rest to a full decode.

use memchr::memchr2;

/// Where the JSON string at `i` (its opening quote) ends, past its closing quote; `None`
/// when it does not end.
#[must_use]
pub fn string_end(text: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += memchr2(b'"', b'\\', text.get(j..)?)?;
        if text[j] == b'"' {
            return Some(j + 1);
        }
        j += 2; // an escape: the escaped byte is not the end
    }
}

/// Where the JSON value at `i` ends (its structure followed, its tokens not checked); `None`
/// when it does not.
#[must_use]
pub fn value_end(text: &[u8], i: usize) -> Option<usize> {
    match *text.get(i)? {
        b'"' => string_end(text, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *text.get(j)? {
                    b'"' => {
                        j = string_end(text, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let rest = &text[i..];
            let n = rest
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n'))
                .unwrap_or(rest.len());
            (n > 0).then_some(i + n)
        }
    }
}

/// The first byte at or after `i` that is not JSON whitespace.
#[must_use]
pub fn skip_space(text: &[u8], mut i: usize) -> usize {
    while matches!(text.get(i), Some(b' ' | b'\t' | b'\r' | b'\n')) {
        i += 1;
    }
    i
}
