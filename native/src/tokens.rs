//! Token ids of a JSON lookup body, parsed straight to packed little-endian uint32: a 13k-token prompt
//! otherwise costs ~13k Python ints to decode and pack (most of a token lookup's CPU). Strict: a plain
//! JSON array of non-negative integers below 2**32 and whitespace; anything else is None, and the
//! service decodes the body the ordinary way (so a bad body gets the ordinary error).
//!
//! `split_token_ids` takes the whole body: the array is cut out of the object here, so no JSON
//! decoder walks the tokens at all (a decoder skipping them as raw text costs more than parsing them).

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

#[inline(always)]
fn ws(b: u8) -> bool {
    b == b' ' || b == b'\n' || b == b'\r' || b == b'\t'
}

#[inline(always)]
fn skip_ws(raw: &[u8], mut i: usize) -> usize {
    while i < raw.len() && ws(raw[i]) {
        i += 1;
    }
    i
}

/// The JSON array of token ids at raw[i] (after whitespace) appended to `out` as little-endian
/// uint32s: the index just past its ']', or None for anything but such an array.
fn read_ids(raw: &[u8], i: usize, out: &mut Vec<u8>) -> Option<usize> {
    let n = raw.len();
    let mut i = skip_ws(raw, i);
    if raw.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(raw, i + 1);
    if raw.get(i) == Some(&b']') {
        return Some(i + 1); // an empty array
    }
    loop {
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
        // then "," (most often followed by one space) or "]"
        let mut c = *raw.get(i)?;
        if ws(c) {
            i = skip_ws(raw, i);
            c = *raw.get(i)?;
        }
        match c {
            b',' => {
                i += 1;
                if raw.get(i).is_some_and(|&b| ws(b)) {
                    i = skip_ws(raw, i);
                }
            }
            b']' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// Past the JSON string starting at raw[i] (its opening quote), or None if it does not end.
fn skip_string(raw: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < raw.len() {
        match raw[i] {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    None
}

/// Past the JSON value at raw[i], loosely: where it ends, not whether it is valid (the decoder that
/// reads the rest of the body checks that).
fn skip_value(raw: &[u8], mut i: usize) -> Option<usize> {
    match *raw.get(i)? {
        b'"' => skip_string(raw, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            while i < raw.len() {
                match raw[i] {
                    b'"' => {
                        i = skip_string(raw, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let start = i;
            while i < raw.len() && !matches!(raw[i], b',' | b'}' | b']') && !ws(raw[i]) {
                i += 1;
            }
            (i > start).then_some(i)
        }
    }
}

/// A JSON object body with a "token_ids" array of uint32s, split in two: (the object without that
/// member, the ids packed as little-endian uint32), or None (no such member, given twice, null, not
/// such an array, a key with an escape, or not an object) for the ordinary decode. The other members are copied as they
/// are; the caller decodes them (so a bad member still gets the ordinary error).
#[pyfunction]
pub fn split_token_ids<'py>(py: Python<'py>, raw: &[u8]) -> Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    const KEY: &[u8] = b"\"token_ids\"";
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'{') {
        return None;
    }
    let mut rest: Vec<u8> = Vec::with_capacity(256);
    rest.push(b'{');
    let mut ids: Option<Vec<u8>> = None;
    i = skip_ws(raw, i + 1);
    if raw.get(i) != Some(&b'}') {
        loop {
            let key = i;
            if raw.get(i) != Some(&b'"') {
                return None;
            }
            let key_end = skip_string(raw, i)?;
            if raw[key..key_end].contains(&b'\\') {
                return None; // an escaped key may spell token_ids: the decoder reads such bodies whole
            }
            i = skip_ws(raw, key_end);
            if raw.get(i) != Some(&b':') {
                return None;
            }
            if &raw[key..key_end] == KEY {
                if ids.is_some() {
                    return None;
                }
                let mut out = Vec::with_capacity(raw.len() / 2);
                i = read_ids(raw, i + 1, &mut out)?;
                ids = Some(out);
            } else {
                i = skip_value(raw, skip_ws(raw, i + 1))?;
                if rest.len() > 1 {
                    rest.push(b',');
                }
                rest.extend_from_slice(&raw[key..i]);
            }
            i = skip_ws(raw, i);
            match raw.get(i) {
                Some(b',') => i = skip_ws(raw, i + 1),
                Some(b'}') => break,
                _ => return None,
            }
        }
    }
    if skip_ws(raw, i + 1) != raw.len() {
        return None;
    }
    rest.push(b'}');
    let ids = ids?;
    Some((PyBytes::new(py, &rest), PyBytes::new(py, &ids)))
}
