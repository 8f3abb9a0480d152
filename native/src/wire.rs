//! An event's hashes off the wire without a Python int per hash. `decode_batch` (schemas/events.py)
//! leaves each event's `hashes` undecoded (msgspec.Raw: the bytes of its msgpack array) and
//! `unpack_hashes` reads those bytes into a HashArray (packed u64s) that the compiled fold and the
//! mask maps read in place. A decoded list of ~20 hashes costs ~20 int objects to make (a 23-hash
//! batch decoded in ~1.15 us with them, ~0.85 without), and the fold a cache line each to read back.
//!
//! Only what msgspec would have accepted for `list[BlockHash]` is taken (an array of ints >= 0 in
//! any msgpack int form); anything else raises msgspec.ValidationError naming where, as the decoder
//! did. The array's length is checked against the bytes before anything is allocated.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

use crate::HashArray;

/// The msgpack type of a value's first byte, for an error message (msgspec's names).
fn kind(t: u8) -> &'static str {
    match t {
        0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => "int",
        0x80..=0x8f | 0xde | 0xdf => "object",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "None",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bytes",
        0xca | 0xcb => "float",
        _ => "ext",
    }
}

/// The u64s of one msgpack array of non-negative ints; Err((item or None for the array, why)).
pub fn parse(b: &[u8]) -> Result<Vec<u64>, (Option<usize>, String)> {
    let be = |from: usize, n: usize| -> Option<u64> {
        b.get(from..from + n).map(|s| s.iter().fold(0u64, |a, &x| a << 8 | x as u64))
    };
    let truncated = |at: Option<usize>| (at, "Input data was truncated".to_string());
    let t = *b.first().ok_or_else(|| truncated(None))?;
    let (n, mut p) = match t {
        0x90..=0x9f => ((t & 0x0f) as usize, 1),
        0xdc => (be(1, 2).ok_or_else(|| truncated(None))? as usize, 3),
        0xdd => (be(1, 4).ok_or_else(|| truncated(None))? as usize, 5),
        _ => return Err((None, format!("Expected `array`, got `{}`", kind(t)))),
    };
    // every item takes a byte at least: a forged length cannot allocate more than the input holds
    if n > b.len().saturating_sub(p) {
        return Err(truncated(None));
    }
    let mut v = Vec::with_capacity(n);
    for j in 0..n {
        let t = *b.get(p).ok_or_else(|| truncated(Some(j)))?;
        let (x, w) = match t {
            0x00..=0x7f => (Some(t as u64), 0),
            0xcc..=0xcf => (be(p + 1, 1 << (t - 0xcc)), 1 << (t - 0xcc)),
            0xd0..=0xd3 => {
                let w = 1usize << (t - 0xd0);
                match be(p + 1, w) {
                    // a signed form's sign bit: a negative hash, which the schema refuses
                    Some(x) if x >> (8 * w - 1) & 1 == 1 => return Err((Some(j), "Expected `int` >= 0".into())),
                    x => (x, w),
                }
            }
            0xe0..=0xff => return Err((Some(j), "Expected `int` >= 0".into())),
            _ => return Err((Some(j), format!("Expected `int`, got `{}`", kind(t)))),
        };
        v.push(x.ok_or_else(|| truncated(Some(j)))?);
        p += 1 + w;
    }
    if p != b.len() {
        return Err((None, "Input data was not one array".to_string()));
    }
    Ok(v)
}

/// The bytes of a buffer object (msgspec.Raw, bytes, memoryview), borrowed for `f`.
fn with_buffer<R>(ob: &Bound<'_, PyAny>, f: impl FnOnce(&[u8]) -> R) -> PyResult<R> {
    // SAFETY: a simple (contiguous, read-only) buffer request; the view is released after `f`,
    // which only reads it while the GIL is held and the object alive
    unsafe {
        let mut view: ffi::Py_buffer = std::mem::zeroed();
        if ffi::PyObject_GetBuffer(ob.as_ptr(), &mut view, ffi::PyBUF_SIMPLE) != 0 {
            return Err(PyErr::fetch(ob.py()));
        }
        let b = if view.buf.is_null() || view.len <= 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(view.buf as *const u8, view.len as usize)
        };
        let r = f(b);
        ffi::PyBuffer_Release(&mut view);
        Ok(r)
    }
}

/// For each event of `events` whose class is one of `kinds` and whose `hashes` is a `raw` (the
/// msgspec.Raw type): its hashes as a HashArray, in place. `first`: the index of events[0] in its
/// batch (for the error's path). Raises msgspec.ValidationError at the first that is not an array
/// of ints >= 0 (the events before it unpacked).
#[pyfunction]
#[pyo3(signature = (events, kinds, raw, first=0))]
pub fn unpack_hashes(events: &Bound<'_, PyList>, kinds: &Bound<'_, PyTuple>, raw: &Bound<'_, PyType>,
                     first: usize) -> PyResult<()> {
    let py = events.py();
    let name = pyo3::intern!(py, "hashes");
    for (i, ev) in events.iter().enumerate() {
        if !kinds.iter().any(|k| ev.get_type().is(&k)) {
            continue;
        }
        let h = ev.getattr(name)?;
        if !h.get_type().is(raw) {
            continue;  // made in Python (a list), or unpacked already
        }
        match with_buffer(&h, parse)? {
            Ok(v) => ev.setattr(name, HashArray { v })?,
            Err((at, why)) => {
                let at = at.map_or(String::new(), |j| format!("[{j}]"));
                let err = py.import("msgspec")?.getattr("ValidationError")?;
                return Err(PyErr::from_value(err.call1((format!("{why} - at `$.events[{}].hashes{at}`",
                                                                first + i),))?));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn every_int_form_and_the_refusals() {
        let mut b = vec![0x9a, 0x00, 0x7f, 0xcc, 0xff, 0xcd, 0x01, 0x00, 0xce, 0, 1, 0, 0,
                         0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xd0, 0x7f, 0xd1, 0x00, 0x01,
                         0xd2, 0, 0, 0, 2, 0xd3, 0, 0, 0, 0, 0, 0, 0, 3];
        assert_eq!(parse(&b).unwrap(), vec![0, 127, 255, 256, 65536, u64::MAX, 127, 1, 2, 3]);
        b[0] = 0x9b;
        assert!(parse(&b).is_err());  // one item short
        assert_eq!(parse(&[0x91, 0xff]).unwrap_err(), (Some(0), "Expected `int` >= 0".into()));
        assert_eq!(parse(&[0x91, 0xd0, 0x80]).unwrap_err(), (Some(0), "Expected `int` >= 0".into()));
        assert_eq!(parse(&[0x91, 0xc3]).unwrap_err().1, "Expected `int`, got `bool`");
        assert_eq!(parse(&[0xa1, 0x61]).unwrap_err().1, "Expected `array`, got `str`");
        assert!(parse(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());  // a forged length, nothing allocated
        assert_eq!(parse(&[0xdc, 0, 0]).unwrap(), Vec::<u64>::new());
        assert!(parse(&[0x90, 0x00]).is_err());  // more than one value
    }
}
