//! Token ids of a JSON lookup body, parsed straight to packed little-endian uint32: a 13k-token prompt
//! otherwise costs ~13k Python ints to decode and pack (most of a token lookup's CPU). Strict: a plain
//! JSON array of non-negative integers below 2**32 and whitespace; anything else is None, and the
//! service decodes the body the ordinary way (so a bad body gets the ordinary error).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The 1-7 digit number at `raw[i..]` read 8 bytes at a time (SWAR; most token ids are 3-6 digits):
/// (value, digits), or None where fewer than 8 bytes are left or all 8 are digits (the byte loop
/// reads those).
#[inline(always)]
fn digits8(raw: &[u8], i: usize) -> Option<(u64, usize)> {
    let chunk = u64::from_le_bytes(raw.get(i..i + 8)?.try_into().ok()?);
    let x = chunk ^ 0x3030_3030_3030_3030; // a digit byte becomes its value 0..9
    // the high bit of each byte that is not a digit (a carry out of such a byte can only flag the
    // bytes after it, so the first flagged byte is right)
    let nondigit = (x.wrapping_add(0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
    if nondigit == 0 {
        return None;
    }
    let len = (nondigit.trailing_zeros() / 8) as usize;
    if len == 0 {
        return Some((0, 0));
    }
    // the digits in the high bytes, leading zeros below: then pairs, fours, eights
    let mut d = x << (8 * (8 - len));
    d = (d * 10) + (d >> 8);
    d = (((d & 0x0000_00FF_0000_00FF).wrapping_mul(100 + (1_000_000 << 32)))
        + (((d >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32)))) >> 32;
    Some((d, len))
}

#[pyfunction]
pub fn parse_token_ids<'py>(py: Python<'py>, raw: &[u8]) -> Option<Bound<'py, PyBytes>> {
    let ws = |b: u8| b == b' ' || b == b'\n' || b == b'\r' || b == b'\t';
    let mut i = 0;
    let n = raw.len();
    while i < n && ws(raw[i]) {
        i += 1;
    }
    if i >= n || raw[i] != b'[' {
        return None;
    }
    i += 1;
    let mut out: Vec<u8> = Vec::with_capacity(n / 2);
    let mut first = true;
    loop {
        while i < n && ws(raw[i]) {
            i += 1;
        }
        if i >= n {
            return None;
        }
        if raw[i] == b']' && first {
            i += 1; // an empty array
            break;
        }
        if raw[i] == b']' {
            i += 1;
            break;
        }
        if !first {
            if raw[i] != b',' {
                return None;
            }
            i += 1;
            while i < n && ws(raw[i]) {
                i += 1;
            }
        }
        // an integer: no sign, no leading zeros (JSON), no fraction or exponent (that is a float)
        let start = i;
        let v = match digits8(raw, i) {
            Some((v, len)) => {
                i += len;
                v
            }
            None => {
                let mut v: u64 = 0;
                while i < n && raw[i].is_ascii_digit() && i - start < 11 {
                    v = v * 10 + (raw[i] - b'0') as u64;
                    i += 1;
                }
                v
            }
        };
        let len = i - start;
        if len == 0 || len > 10 || v > u32::MAX as u64 || (len > 1 && raw[start] == b'0') {
            return None;
        }
        out.extend_from_slice(&(v as u32).to_le_bytes());
        first = false;
    }
    while i < n && ws(raw[i]) {
        i += 1;
    }
    if i != n {
        return None;
    }
    Some(PyBytes::new(py, &out))
}
