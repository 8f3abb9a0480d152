//! Token ids of a JSON lookup body, parsed straight to packed little-endian uint32: a 13k-token prompt
//! otherwise costs ~13k Python ints to decode and pack (most of a token lookup's CPU). Strict: a plain
//! JSON array of non-negative integers below 2**32 and whitespace; anything else is None, and the
//! service decodes the body the ordinary way (so a bad body gets the ordinary error).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

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
        let mut v: u64 = 0;
        while i < n && raw[i].is_ascii_digit() {
            v = v * 10 + (raw[i] - b'0') as u64;
            if v > u32::MAX as u64 {
                return None;
            }
            i += 1;
        }
        let len = i - start;
        if len == 0 || (len > 1 && raw[start] == b'0') {
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
