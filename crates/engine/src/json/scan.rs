//! Following a JSON text's structure without reading its tokens: where a string or a value
//! ends, past the whitespace, an object's members. For scans that look for one member (the
//! data plane's capture fields, an answer's token ids) and leave checking the rest to a full
//! decode, and for the top-level fields of a text a full decode has checked already.

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

/// One member of an object: where its key begins, its key's text, where its value begins
/// and ends.
#[derive(Debug, PartialEq, Eq)]
pub struct Member<'a> {
    pub key_start: usize,
    pub key: &'a [u8],
    pub value_start: usize,
    pub value_end: usize,
}

/// The members of the object at `i` (in the text's order, a repeated key each time) and
/// where it ends; `None` when there is no object there.
#[must_use]
pub fn object(text: &[u8], i: usize) -> Option<(Vec<Member<'_>>, usize)> {
    if text.get(i) != Some(&b'{') {
        return None;
    }
    let mut members = Vec::new();
    let mut j = skip_space(text, i + 1);
    if text.get(j) == Some(&b'}') {
        return Some((members, j + 1));
    }
    loop {
        let key_start = j;
        let key_end = string_end(text, j).filter(|_| text.get(j) == Some(&b'"'))?;
        j = skip_space(text, key_end);
        if text.get(j) != Some(&b':') {
            return None;
        }
        let value_start = skip_space(text, j + 1);
        let end = value_end(text, value_start)?;
        members.push(Member {
            key_start,
            key: &text[key_start + 1..key_end - 1],
            value_start,
            value_end: end,
        });
        j = skip_space(text, end);
        match text.get(j)? {
            b',' => j = skip_space(text, j + 1),
            b'}' => return Some((members, j + 1)),
            _ => return None,
        }
    }
}

/// The top-level fields of a UTF-8 JSON object text that a full decode found valid: each
/// member's key and its value's byte range, in the text's order (a repeated key each time);
/// `None` when the text is not one object (with whitespace around it) or a key is written
/// with an escape (its text is not its value).
#[must_use]
pub fn fields(text: &[u8]) -> Option<Vec<(&str, usize, usize)>> {
    let (members, end) = object(text, skip_space(text, 0))?;
    if skip_space(text, end) != text.len() {
        return None;
    }
    members
        .into_iter()
        .map(|m| {
            let key = std::str::from_utf8(m.key)
                .ok()
                .filter(|k| !k.contains('\\'))?;
            Some((key, m.value_start, m.value_end))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_the_top_level_members_in_order() {
        let text = br#" {"a": [1, {"b": "}"}], "c" :"x\"y", "a": null} "#;
        let found = fields(text).unwrap();
        let spans: Vec<(&str, &[u8])> = found.iter().map(|&(k, s, e)| (k, &text[s..e])).collect();
        assert_eq!(
            spans,
            vec![
                ("a", &br#"[1, {"b": "}"}]"#[..]),
                ("c", &br#""x\"y""#[..]),
                ("a", &b"null"[..])
            ]
        );
        assert_eq!(fields(b"{}").unwrap(), vec![]);
    }

    #[test]
    fn no_fields_for_an_escaped_key_or_what_is_not_one_object() {
        assert_eq!(fields(br#"{"a\u0062": 1}"#), None);
        assert_eq!(fields(br#"{"a": 1} x"#), None);
        assert_eq!(fields(b"[1]"), None);
        assert_eq!(fields(br#"{"a": 1"#), None);
    }
}
