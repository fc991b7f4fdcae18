//! Whether a text is a JSON object `json.loads` reads, told by one pass over its bytes that
//! builds nothing and converts no number: for a reply made of an answer's own bytes before
//! anything decodes it. Conservative: a text it is unsure of (not strict UTF-8, nested past
//! the library's depth bound, an int whose digits Python may refuse) is not one, and its
//! caller decodes it to find out.

use memchr::memchr2;

use super::parse::DEFAULT_MAX_DEPTH;

/// Ints of more digits are left to the decoder (Python refuses ints past its digit limit,
/// 4300 by default; a server may set a lower one).
const MAX_INT_DIGITS: usize = 18;

/// Whether `text` is, surely, one JSON object `json.loads` reads (whitespace around it
/// allowed): strict UTF-8 (no BOM, no surrogate), nested at most `DEFAULT_MAX_DEPTH`
/// deep, every int of at most 18 digits. `false` for every other text, some of which
/// `json.loads` reads.
#[must_use]
pub fn reads_as_object(text: &[u8]) -> bool {
    if std::str::from_utf8(text).is_err() {
        return false;
    }
    let mut check = Check { b: text, i: 0 };
    check.ws();
    if check.b.get(check.i) != Some(&b'{') || check.value(0).is_none() {
        return false;
    }
    check.ws();
    check.i == text.len()
}

struct Check<'a> {
    b: &'a [u8],
    i: usize,
}

impl Check<'_> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn next(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.b[self.i..]
            .starts_with(word)
            .then(|| self.i += word.len())
    }

    /// The value at `i`, `depth` containers deep; `i` then past it.
    fn value(&mut self, depth: usize) -> Option<()> {
        match self.next()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'N' => self.literal(b"NaN"),
            b'I' => self.literal(b"Infinity"),
            b'-' if self.b.get(self.i + 1) == Some(&b'I') => self.literal(b"-Infinity"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        self.items(depth, b'}', |this| {
            if this.next()? != b'"' {
                return None;
            }
            this.string()?;
            this.ws();
            if this.next()? != b':' {
                return None;
            }
            this.i += 1;
            this.ws();
            this.value(depth)
        })
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        self.items(depth, b']', |this| this.value(depth))
    }

    /// A container's items (`item` reads one, from its first byte), separated by commas,
    /// up to its `close` byte; the opening byte at `i`. One loop for objects and arrays.
    fn items(
        &mut self,
        depth: usize,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        if depth > DEFAULT_MAX_DEPTH {
            return None;
        }
        self.i += 1;
        self.ws();
        if self.next()? == close {
            self.i += 1;
            return Some(());
        }
        loop {
            item(self)?;
            self.ws();
            match self.next()? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                byte if byte == close => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string (`json.loads`' strict grammar: no control character in it, only its
    /// escapes; a `\u` escape of any four hex digits, a lone surrogate too).
    fn string(&mut self) -> Option<()> {
        let mut j = self.i + 1;
        loop {
            let at = j + memchr2(b'"', b'\\', self.b.get(j..)?)?;
            if self.b[j..at].iter().any(|&c| c < 0x20) {
                return None;
            }
            if self.b[at] == b'"' {
                self.i = at + 1;
                return Some(());
            }
            j = match *self.b.get(at + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => at + 2,
                b'u' => {
                    let hex = self.b.get(at + 2..at + 6)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    at + 6
                }
                _ => return None,
            };
        }
    }

    /// A number: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, as `json.loads` reads
    /// one (what follows it is the caller's to judge).
    fn number(&mut self) -> Option<()> {
        if self.next() == Some(b'-') {
            self.i += 1;
        }
        let start = self.i;
        match self.next()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let int_digits = self.i - start;
        let mut int = true;
        if self.next() == Some(b'.') && self.b.get(self.i + 1).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
            self.digits();
            int = false;
        }
        if matches!(self.next(), Some(b'e' | b'E')) {
            let mut k = self.i + 1;
            if matches!(self.b.get(k), Some(b'+' | b'-')) {
                k += 1;
            }
            if self.b.get(k).is_some_and(u8::is_ascii_digit) {
                self.i = k;
                self.digits();
                int = false;
            }
        }
        (!int || int_digits <= MAX_INT_DIGITS).then_some(())
    }

    fn digits(&mut self) {
        while self.next().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse, Value};
    use super::*;

    #[test]
    fn objects_json_loads_reads_are_told() {
        for text in [
            "{}",
            " {\"a\": 1} \n",
            "{\"a\": [1, -0, 0.5, -1.5e-3, 1E+2, 2e400, true, false, null, NaN, Infinity, -Infinity]}",
            "{\"s\": \"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\ud800 caf\u{e9} \u{7f}\"}",
            "{\"a\": {\"b\": [{}, []]}, \"a\": 2}",
            "{\"n\": 123456789012345678}",
        ] {
            assert!(reads_as_object(text.as_bytes()), "{text:?}");
            assert!(matches!(parse(text.as_bytes(), DEFAULT_MAX_DEPTH), Ok(Value::Object(_))));
        }
    }

    #[test]
    fn what_json_loads_refuses_or_is_no_object_is_not_one() {
        for text in [
            "",
            "[]",
            "1",
            "\"{}\"",
            "{",
            "{\"a\": 1",
            "{\"a\": 1,}",
            "{\"a\" 1}",
            "{a: 1}",
            "{\"a\": tru}",
            "{\"a\": nan}",
            "{\"a\": -NaN}",
            "{\"a\": 01}",
            "{\"a\": 1.}",
            "{\"a\": .5}",
            "{\"a\": 1e}",
            "{\"a\": +1}",
            "{\"a\": -}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": \"\\x\"}",
            "{\"a\": \"\\u12\"}",
            "{\"a\": \"open}",
            "{\"a\": 1} {}",
            "{\"a\": 1} x",
            "{\"a\": [1 2]}",
            "\u{feff}{}",
        ] {
            assert!(!reads_as_object(text.as_bytes()), "{text:?}");
        }
        assert!(!reads_as_object(b"{\"a\": \"\xff\"}"));
        assert!(!reads_as_object(b"{\"a\": \"\xed\xa0\x80\"}")); // (a surrogate: left to the decoder)
        assert!(!reads_as_object(b"{\"n\": 1234567890123456789}"));
        let deep = |n: usize| format!("{{\"a\": {}1{}}}", "[".repeat(n), "]".repeat(n));
        assert!(reads_as_object(deep(DEFAULT_MAX_DEPTH - 1).as_bytes()));
        assert!(!reads_as_object(deep(DEFAULT_MAX_DEPTH).as_bytes()));
    }

    #[test]
    fn every_cut_of_an_object_agrees_with_the_parser() {
        let text =
            "{\"a\": [1, -2.5e3, \"x\\\"y\\u00e9\", {\"b\": null}], \"c\": true, \"d\": NaN}";
        for end in 0..=text.len() {
            let cut = &text.as_bytes()[..end];
            let parsed = matches!(parse(cut, DEFAULT_MAX_DEPTH), Ok(Value::Object(_)));
            assert_eq!(reads_as_object(cut), parsed, "{:?}", &text[..end]);
        }
    }
}
