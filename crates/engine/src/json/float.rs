//! Floats written as Python's `float.__repr__` writes them (what `json.dumps` prints).
//!
//! `ryu` finds the shortest digits that read back to the same double; the layout is Python's:
//! positional notation when the decimal exponent is in `-4..16`, else `d.ddde+XX` with at least
//! two exponent digits; `.0` on integral positional values; `NaN`, `Infinity`, `-Infinity`.

/// Append `json.dumps(value)` for a float.
pub fn write_float(value: f64, out: &mut Vec<u8>) {
    if value.is_nan() {
        out.extend_from_slice(b"NaN");
        return;
    }
    if value.is_infinite() {
        out.extend_from_slice(if value > 0.0 {
            b"Infinity"
        } else {
            b"-Infinity"
        });
        return;
    }
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(value).as_bytes();
    let (negative, text) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    // ryu writes "d.ddd", "ddd.d", "0.000ddd" or "d.ddde-7": read off digits and point
    let (mantissa, exponent) = match text.iter().position(|&c| c == b'e') {
        Some(e) => (&text[..e], parse_exponent(&text[e + 1..])),
        None => (text, 0),
    };
    let mut digits: Vec<u8> = Vec::with_capacity(20);
    let mut int_len: i32 = 0;
    let mut seen_point = false;
    for &c in mantissa {
        if c == b'.' {
            seen_point = true;
        } else {
            digits.push(c);
            if !seen_point {
                int_len += 1;
            }
        }
    }
    // value = 0.DIGITS * 10^point
    let mut point = int_len + exponent;
    let leading = digits.iter().take_while(|&&d| d == b'0').count();
    digits.drain(..leading);
    point -= i32::try_from(leading).unwrap_or(0);
    while digits.last() == Some(&b'0') {
        digits.pop();
    }
    if negative {
        out.push(b'-');
    }
    if digits.is_empty() {
        out.extend_from_slice(b"0.0");
        return;
    }
    let sci = point - 1;
    if !(-4..16).contains(&sci) {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        out.push(if sci < 0 { b'-' } else { b'+' });
        let magnitude = sci.unsigned_abs();
        if magnitude < 10 {
            out.push(b'0');
        }
        out.extend_from_slice(magnitude.to_string().as_bytes());
    } else if point <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', point.unsigned_abs() as usize));
        out.extend_from_slice(&digits);
    } else {
        let point = point.unsigned_abs() as usize;
        if point >= digits.len() {
            out.extend_from_slice(&digits);
            out.extend(std::iter::repeat_n(b'0', point - digits.len()));
            out.extend_from_slice(b".0");
        } else {
            out.extend_from_slice(&digits[..point]);
            out.push(b'.');
            out.extend_from_slice(&digits[point..]);
        }
    }
}

fn parse_exponent(text: &[u8]) -> i32 {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, text),
    };
    let magnitude = digits
        .iter()
        .fold(0i32, |acc, &d| acc * 10 + i32::from(d - b'0'));
    if negative {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::write_float;

    fn repr(value: f64) -> String {
        let mut out = Vec::new();
        write_float(value, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn matches_python_repr() {
        // each expected string is Python's repr() of the same float
        let cases: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (-1.5, "-1.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123_456_789_012_345_680.0, "1.2345678901234568e+17"),
            (9_999_999_999_999_998.0, "9999999999999998.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (0.000_123, "0.000123"),
            (1.5e-7, "1.5e-07"),
            (1e22, "1e+22"),
            (1e100, "1e+100"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (f64::MIN_POSITIVE, "2.2250738585072014e-308"),
            (123.456, "123.456"),
            (100.0, "100.0"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for &(value, expected) in cases {
            assert_eq!(repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn reads_back_to_the_same_bits() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let value = f64::from_bits(x);
            if value.is_finite() {
                let text = repr(value);
                assert_eq!(text.parse::<f64>().unwrap().to_bits(), x, "{text}");
            }
        }
    }
}
