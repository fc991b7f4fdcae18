//! The text encoding of JSON bytes, found and decoded as `json.loads` does: `detect_encoding`
//! (UTF-8 with or without a BOM, UTF-16 and UTF-32 by BOM or by zero bytes), then decoding with
//! `surrogatepass`, so surrogate code points in the input are kept.

use std::borrow::Cow;

use super::parse::{ErrorKind, ParseError};

/// Input bytes as generalized UTF-8 text.
#[derive(Debug)]
pub struct Text<'a> {
    /// the text: the input itself when it was UTF-8
    pub bytes: Cow<'a, [u8]>,
    /// whether any surrogate code point occurs in it
    pub surrogates: bool,
    /// bytes of the input before `bytes` starts (a UTF-8 BOM), added to error offsets
    pub skipped: usize,
}

#[derive(Clone, Copy)]
enum Encoding {
    Utf8,
    Utf8Sig,
    Utf16 { little: bool, bom: bool },
    Utf32 { little: bool, bom: bool },
}

/// `json.detect_encoding`.
fn detect(b: &[u8]) -> Encoding {
    if b.starts_with(&[0, 0, 0xFE, 0xFF]) {
        return Encoding::Utf32 {
            little: false,
            bom: true,
        };
    }
    if b.starts_with(&[0xFF, 0xFE, 0, 0]) {
        return Encoding::Utf32 {
            little: true,
            bom: true,
        };
    }
    if b.starts_with(&[0xFE, 0xFF]) {
        return Encoding::Utf16 {
            little: false,
            bom: true,
        };
    }
    if b.starts_with(&[0xFF, 0xFE]) {
        return Encoding::Utf16 {
            little: true,
            bom: true,
        };
    }
    if b.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return Encoding::Utf8Sig;
    }
    if b.len() >= 4 {
        if b[0] == 0 {
            return if b[1] == 0 {
                Encoding::Utf32 {
                    little: false,
                    bom: false,
                }
            } else {
                Encoding::Utf16 {
                    little: false,
                    bom: false,
                }
            };
        }
        if b[1] == 0 {
            return if b[2] != 0 || b[3] != 0 {
                Encoding::Utf16 {
                    little: true,
                    bom: false,
                }
            } else {
                Encoding::Utf32 {
                    little: true,
                    bom: false,
                }
            };
        }
    } else if b.len() == 2 {
        if b[0] == 0 {
            return Encoding::Utf16 {
                little: false,
                bom: false,
            };
        }
        if b[1] == 0 {
            return Encoding::Utf16 {
                little: true,
                bom: false,
            };
        }
    }
    Encoding::Utf8
}

/// Decode JSON input bytes as `json.loads` does before scanning.
///
/// # Errors
/// Bytes that are not valid in the detected encoding, at the offset of the first bad one.
pub fn decode_text(input: &[u8]) -> Result<Text<'_>, ParseError> {
    match detect(input) {
        Encoding::Utf8 => check_utf8(input, 0),
        Encoding::Utf8Sig => check_utf8(&input[3..], 3),
        Encoding::Utf16 { little, bom } => utf16(input, little, if bom { 2 } else { 0 }),
        Encoding::Utf32 { little, bom } => utf32(input, little, if bom { 4 } else { 0 }),
    }
}

/// UTF-8 as Python's decoder with `surrogatepass` reads it: strict UTF-8, plus the three-byte
/// forms of surrogate code points (`ED A0..BF 80..BF`).
fn check_utf8(bytes: &[u8], skipped: usize) -> Result<Text<'_>, ParseError> {
    let mut surrogates = false;
    let mut at = 0;
    loop {
        match std::str::from_utf8(&bytes[at..]) {
            Ok(_) => break,
            Err(e) => {
                let bad = at + e.valid_up_to();
                if bytes.len() >= bad + 3
                    && bytes[bad] == 0xED
                    && (0xA0..=0xBF).contains(&bytes[bad + 1])
                    && (0x80..=0xBF).contains(&bytes[bad + 2])
                {
                    surrogates = true;
                    at = bad + 3;
                } else {
                    return Err(ParseError::new(ErrorKind::InvalidUtf8, skipped + bad));
                }
            }
        }
    }
    Ok(Text {
        bytes: Cow::Borrowed(bytes),
        surrogates,
        skipped,
    })
}

/// Append code point `c` (a surrogate too) in generalized UTF-8.
pub(crate) fn push_code_point(out: &mut Vec<u8>, c: u32) {
    if c < 0x80 {
        out.push(c as u8);
    } else if c < 0x800 {
        out.extend_from_slice(&[0xC0 | (c >> 6) as u8, 0x80 | (c & 0x3F) as u8]);
    } else if c < 0x1_0000 {
        out.extend_from_slice(&[
            0xE0 | (c >> 12) as u8,
            0x80 | ((c >> 6) & 0x3F) as u8,
            0x80 | (c & 0x3F) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xF0 | (c >> 18) as u8,
            0x80 | ((c >> 12) & 0x3F) as u8,
            0x80 | ((c >> 6) & 0x3F) as u8,
            0x80 | (c & 0x3F) as u8,
        ]);
    }
}

fn is_surrogate(c: u32) -> bool {
    (0xD800..=0xDFFF).contains(&c)
}

/// UTF-16 with `surrogatepass`: pairs are joined, lone surrogate units kept.
fn utf16(input: &[u8], little: bool, start: usize) -> Result<Text<'static>, ParseError> {
    let body = &input[start..];
    if body.len() % 2 != 0 {
        return Err(ParseError::new(ErrorKind::InvalidUtf16, input.len() - 1));
    }
    let unit = |i: usize| -> u32 {
        let pair = [body[2 * i], body[2 * i + 1]];
        u32::from(if little {
            u16::from_le_bytes(pair)
        } else {
            u16::from_be_bytes(pair)
        })
    };
    let n = body.len() / 2;
    let mut out = Vec::with_capacity(n);
    let mut surrogates = false;
    let mut i = 0;
    while i < n {
        let u = unit(i);
        i += 1;
        if (0xD800..0xDC00).contains(&u) && i < n {
            let low = unit(i);
            if (0xDC00..0xE000).contains(&low) {
                i += 1;
                push_code_point(&mut out, 0x1_0000 + ((u - 0xD800) << 10) + (low - 0xDC00));
                continue;
            }
        }
        surrogates |= is_surrogate(u);
        push_code_point(&mut out, u);
    }
    Ok(Text {
        bytes: Cow::Owned(out),
        surrogates,
        skipped: 0,
    })
}

/// UTF-32 with `surrogatepass`: every unit one code point, surrogates kept, none above U+10FFFF.
fn utf32(input: &[u8], little: bool, start: usize) -> Result<Text<'static>, ParseError> {
    let body = &input[start..];
    if body.len() % 4 != 0 {
        return Err(ParseError::new(
            ErrorKind::InvalidUtf32,
            input.len() - body.len() % 4,
        ));
    }
    let mut out = Vec::with_capacity(body.len() / 4);
    let mut surrogates = false;
    for (i, chunk) in body.chunks_exact(4).enumerate() {
        let quad = [chunk[0], chunk[1], chunk[2], chunk[3]];
        let c = if little {
            u32::from_le_bytes(quad)
        } else {
            u32::from_be_bytes(quad)
        };
        if c > 0x10_FFFF {
            return Err(ParseError::new(ErrorKind::InvalidUtf32, start + 4 * i));
        }
        surrogates |= is_surrogate(c);
        push_code_point(&mut out, c);
    }
    Ok(Text {
        bytes: Cow::Owned(out),
        surrogates,
        skipped: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_kept_borrowed_and_bom_skipped() {
        let t = decode_text(b"[1]").unwrap();
        assert!(matches!(t.bytes, Cow::Borrowed(b"[1]")));
        let t = decode_text(b"\xEF\xBB\xBF[1]").unwrap();
        assert_eq!(&*t.bytes, b"[1]");
        assert_eq!(t.skipped, 3);
    }

    #[test]
    fn raw_surrogate_bytes_pass_and_bad_utf8_fails_at_its_offset() {
        let t = decode_text(b"\"\xED\xA0\x80\"").unwrap();
        assert!(t.surrogates);
        let e = decode_text(b"[\"\xFF\"]").unwrap_err();
        assert_eq!((e.kind, e.offset), (ErrorKind::InvalidUtf8, 2));
    }

    #[test]
    fn utf16_and_utf32_detected_as_json_does() {
        let le: Vec<u8> = "[\"\u{1F600}\"]"
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(
            &*decode_text(&le).unwrap().bytes,
            "[\"\u{1F600}\"]".as_bytes()
        );
        let mut be = vec![0xFE, 0xFF];
        be.extend("[1]".encode_utf16().flat_map(u16::to_be_bytes));
        assert_eq!(&*decode_text(&be).unwrap().bytes, b"[1]");
        let le32: Vec<u8> = "[2]"
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect();
        assert_eq!(&*decode_text(&le32).unwrap().bytes, b"[2]");
        // a lone surrogate unit in UTF-16 is kept
        let lone: Vec<u8> = [0x22u16, 0xD800, 0x22]
            .iter()
            .flat_map(|u| u.to_le_bytes())
            .collect();
        let t = decode_text(&lone).unwrap();
        assert!(t.surrogates);
        assert_eq!(&*t.bytes, b"\"\xED\xA0\x80\"");
        assert_eq!(
            decode_text(b"[\x80]").unwrap_err().kind,
            ErrorKind::InvalidUtf8
        );
        assert_eq!(
            decode_text(&[0x31, 0, 0, 0, 0]).unwrap_err().kind,
            ErrorKind::InvalidUtf32
        );
    }
}
