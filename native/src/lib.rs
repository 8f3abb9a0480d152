//! kvidx_native: kvidx's hot data structure, the mask map (canonical block hash -> slot bitmask),
//! and canonical block hashing, for kvidx/core/maskmap.py (whose `PyMaskMap` is the pure-Python
//! reference of the same API; tests/unit/core/test_maskmap.py checks that they agree).
//!
//! Layout (memory is the budget): one hash table (table.rs: u64 -> u64, 16-byte slots, open
//! addressing) per 64-bit word of the masks. Word 0 (slots 0..63) of every entry is stored inline as
//! the value of the first table, which is also the key set. Word w >= 1 (slots 64w..64w+63) is in
//! table w, only for the entries with a bit there, so a fleet of more than 64 replicas works at no
//! cost to the small ones, and a wide entry costs one more (key, word) slot per word it uses, no
//! heap block of its own. Invariants: a hash is in the map iff it is a key of `lo` (its word 0 may
//! be 0 when only high bits are set); the `hi` tables hold no 0 words and the last one is never
//! empty; no entry has an all-zero mask.
//!
//! The batched operations (store, remove, masks, walk) read the hashes of a list or tuple in place
//! and keep the memory busy ahead of the work (`Hashes::run`): the int objects of the hashes
//! 2 * AHEAD ahead and the buckets of those AHEAD ahead are loaded while a hash is worked on, so the
//! cache misses of an event (~20 hashes, buckets all over a table of megabytes) overlap instead of
//! following one another.

mod answer;
mod fold;
mod layout;
mod order;
mod table;
mod tokens;

use num_bigint::BigUint;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyMemoryView, PySlice, PyTuple};
use table::{mix, unmix, Table};
use twox_hash::XxHash3_64;

// Every key below is a *mixed* hash (table::mix of the block hash): mixed once where it comes from
// Python, unmixed where it goes back.

#[derive(Clone, Default)]
struct Masks {
    lo: Table,
    hi: Vec<Table>,  // hi[w - 1]: word w of the entries that have a bit in it
}

impl Masks {
    #[inline]
    fn word(&self, h: u64, w: usize) -> u64 {
        let t = if w == 0 { Some(&self.lo) } else { self.hi.get(w - 1) };
        t.and_then(|t| t.get(h)).unwrap_or(0)
    }

    #[inline]
    fn in_hi(&self, h: u64) -> bool {
        self.hi.iter().any(|t| t.contains(h))
    }

    fn trim_hi(&mut self) {
        while self.hi.last().is_some_and(Table::is_empty) {
            self.hi.pop();
        }
    }

    /// Starts loading what `set_bit`/`clear_bit` of word `w` will read for `h`.
    #[inline(always)]
    fn prefetch(&self, h: u64, w: usize) {
        self.lo.prefetch(h);
        if w > 0 {
            if let Some(t) = self.hi.get(w - 1) {
                t.prefetch(h);
            }
        }
    }

    /// The words of `h`'s mask (trimmed: no trailing 0 word past the first), None if absent.
    fn words(&self, h: u64) -> Option<Vec<u64>> {
        let lo = self.lo.get(h)?;
        let mut out = vec![lo];
        for t in &self.hi {
            out.push(t.get(h).unwrap_or(0));
        }
        while out.len() > 1 && out.last() == Some(&0) {
            out.pop();
        }
        Some(out)
    }

    #[inline]
    fn has_bit(&self, h: u64, slot: usize) -> bool {
        self.word(h, slot / 64) >> (slot % 64) & 1 != 0
    }

    /// Sets bit `slot` of `h`'s mask; true if it was not set.
    #[inline(always)]
    fn set_bit(&mut self, h: u64, w: usize, b: u64) -> bool {
        if w == 0 {
            let (pos, new) = self.lo.get_or_insert(h, b);
            if new {
                return true;
            }
            let v = self.lo.value_mut(pos);
            let new = *v & b == 0;
            *v |= b;
            return new;
        }
        self.lo.get_or_insert(h, 0);
        if self.hi.len() < w {
            self.hi.resize_with(w, Table::default);
        }
        let t = &mut self.hi[w - 1];
        let (pos, new) = t.get_or_insert(h, b);
        if new {
            return true;
        }
        let v = t.value_mut(pos);
        let new = *v & b == 0;
        *v |= b;
        new
    }

    /// Clears bit `slot` of `h`'s mask, deleting the entry when nothing is left; true if it was set.
    #[inline(always)]
    fn clear_bit(&mut self, h: u64, w: usize, b: u64) -> bool {
        if w == 0 {
            let Some(pos) = self.lo.find(h) else { return false };  // one probe
            let v = self.lo.value_mut(pos);
            if *v & b == 0 {
                return false;
            }
            *v &= !b;
            if *v == 0 && !self.hi.iter().any(|t| t.contains(h)) {
                self.lo.remove_at(pos);
            }
            return true;
        }
        let Some(t) = self.hi.get_mut(w - 1) else { return false };
        let Some(pos) = t.find(h) else { return false };
        let v = t.value_mut(pos);
        if *v & b == 0 {
            return false;
        }
        *v &= !b;
        if *v == 0 {
            t.remove_at(pos);
            if self.lo.get(h) == Some(0) && !self.in_hi(h) {
                self.lo.remove(h);
            }
            self.trim_hi();
        }
        true
    }

    /// Sets (replaces) `h`'s mask; `words` must not be all 0.
    fn insert(&mut self, h: u64, words: &[u64]) {
        self.lo.insert(h, words[0]);
        let n = words.iter().rposition(|&x| x != 0).unwrap_or(0) + 1;
        if self.hi.len() + 1 < n {
            self.hi.resize_with(n - 1, Table::default);
        }
        for (i, t) in self.hi.iter_mut().enumerate() {
            match words.get(i + 1).copied().unwrap_or(0) {
                0 => {
                    t.remove(h);
                }
                x => {
                    t.insert(h, x);
                }
            }
        }
        self.trim_hi();
    }

    /// ORs `words` into `h`'s mask; nothing for an all-zero mask.
    fn or_in(&mut self, h: u64, words: &[u64]) {
        if words.iter().all(|&x| x == 0) {
            return;
        }
        let (pos, _) = self.lo.get_or_insert(h, 0);
        *self.lo.value_mut(pos) |= words[0];
        for (i, &x) in words.iter().enumerate().skip(1) {
            if x != 0 {
                if self.hi.len() < i {
                    self.hi.resize_with(i, Table::default);
                }
                let t = &mut self.hi[i - 1];
                let (pos, _) = t.get_or_insert(h, 0);
                *t.value_mut(pos) |= x;
            }
        }
    }

    fn remove(&mut self, h: u64) -> Option<Vec<u64>> {
        let lo = self.lo.remove(h)?;
        let mut out = vec![lo];
        if !self.hi.is_empty() {
            for t in self.hi.iter_mut() {
                out.push(t.remove(h).unwrap_or(0));
            }
            while out.len() > 1 && out.last() == Some(&0) {
                out.pop();
            }
            self.trim_hi();
        }
        Some(out)
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    fn clear_slot(&mut self, slot: usize) -> usize {
        let (w, b) = (slot / 64, 1u64 << (slot % 64));
        let mut n = 0;
        if w == 0 {
            let hi = &self.hi;
            self.lo.retain(|k, v| {
                if *v & b == 0 {
                    return true;
                }
                n += 1;
                *v &= !b;
                *v != 0 || hi.iter().any(|t| t.contains(k))
            });
            return n;
        }
        let Some(t) = self.hi.get_mut(w - 1) else { return 0 };
        let mut emptied = Vec::new();
        t.retain(|k, v| {
            if *v & b == 0 {
                return true;
            }
            n += 1;
            *v &= !b;
            if *v == 0 {
                emptied.push(k);
            }
            *v != 0
        });
        for k in emptied {
            if self.lo.get(k) == Some(0) && !self.in_hi(k) {
                self.lo.remove(k);
            }
        }
        self.trim_hi();
        n
    }

    /// Words needed for the widest mask.
    fn width(&self) -> usize {
        1 + self.hi.len()
    }

    fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.lo.allocation_size()
            + self.hi.capacity() * std::mem::size_of::<Table>()
            + self.hi.iter().map(Table::allocation_size).sum::<usize>()
    }
}

// ---- conversions ------------------------------------------------------------------------------

fn slot_of(slot: i64) -> PyResult<usize> {
    usize::try_from(slot).map_err(|_| PyValueError::new_err(format!("slot must be >= 0, not {slot}")))
}

/// A Python int as the words of a non-zero mask: ValueError for 0 or a negative int, TypeError for
/// a non-int.
fn mask_from_py(ob: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if !ob.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "a mask is an int, not {}",
            ob.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        )));
    }
    let bad = || PyValueError::new_err("a mask is a positive int (bit i: slot i); never 0: delete the entry");
    if let Ok(v) = u64_of(ob) {
        return if v == 0 { Err(bad()) } else { Ok(vec![v]) };
    }
    if let Ok(v) = ob.extract::<u128>() {
        return Ok(vec![v as u64, (v >> 64) as u64]);
    }
    let big: BigUint = ob.extract().map_err(|_| bad())?;
    Ok(big.to_u64_digits())
}

/// A mask's words as a Python int.
fn mask_to_py<'py>(py: Python<'py>, words: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    match words {
        [lo] => Ok(lo.into_pyobject(py)?.into_any()),
        [lo, hi] => Ok(((*hi as u128) << 64 | *lo as u128).into_pyobject(py)?.into_any()),
        _ => {
            let digits = words.iter().flat_map(|w| [*w as u32, (*w >> 32) as u32]).collect();
            Ok(BigUint::new(digits).into_pyobject(py)?.into_any())
        }
    }
}

impl Masks {
    /// `h`'s mask as a Python int (word 0 straight from the table where no entry is wide).
    #[inline]
    fn get_py<'py>(&self, py: Python<'py>, h: u64) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(lo) = self.lo.get(h) else { return Ok(None) };
        if self.hi.is_empty() {
            return Ok(Some(lo.into_pyobject(py)?.into_any()));
        }
        if self.hi.len() > 3 {
            return Ok(Some(mask_to_py(py, &self.words(h).unwrap_or_default())?));
        }
        let mut buf = [lo, 0, 0, 0];  // no allocation for masks of up to 256 slots
        let mut n = 1;
        for (i, t) in self.hi.iter().enumerate() {
            if let Some(x) = t.get(h) {
                buf[i + 1] = x;
                n = i + 2;
            }
        }
        Ok(Some(mask_to_py(py, &buf[..n])?))
    }
}

/// An int as a u64 (OverflowError if negative or too big, TypeError if not an int).
/// CPython 3.11's PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray for every int above
/// 2**30 (every block hash): PyLong_AsUnsignedLong (64 bits where `long` is) reads the digits directly.
#[inline]
fn u64_of(ob: &Bound<'_, PyAny>) -> PyResult<u64> {
    // SAFETY: `ob` is a live object and the GIL is held
    unsafe { u64_of_ptr(ob.py(), ob.as_ptr()) }
}

/// `u64_of` of a borrowed object pointer.
/// SAFETY: `ob` must be a live object and the GIL held.
#[inline(always)]
unsafe fn u64_of_ptr(py: Python<'_>, ob: *mut ffi::PyObject) -> PyResult<u64> {
    #[cfg(all(not(windows), target_pointer_width = "64"))]
    {
        // the error indicator is checked as the C API asks (the value -1 as unsigned is both a
        // valid result and the error marker)
        let v = ffi::PyLong_AsUnsignedLong(ob);
        if v == std::os::raw::c_ulong::MAX {
            if let Some(e) = PyErr::take(py) {
                return Err(e);
            }
        }
        Ok(v as u64)
    }
    #[cfg(not(all(not(windows), target_pointer_width = "64")))]
    {
        Bound::from_borrowed_ptr(py, ob).extract::<u64>()
    }
}

/// A key that can be in the map (a u64, mixed), or None for anything else (never present).
#[inline]
fn key_of(ob: &Bound<'_, PyAny>) -> Option<u64> {
    if ob.is_instance_of::<PyInt>() {
        u64_of(ob).ok().map(mix)
    } else {
        None
    }
}

/// The hashes of a batched call: a list or tuple read in place (item by item, as they are used),
/// or any other iterable of ints converted up front.
enum Hashes<'a, 'py> {
    List(&'a Bound<'py, PyList>),
    Tuple(&'a Bound<'py, PyTuple>),
    Vec(Vec<u64>, std::cell::Cell<Option<PyErr>>),  // mixed; the iterable's error after them
}

/// How many hashes ahead of the one in hand the batched operations start loading buckets: the
/// cache misses of a window overlap instead of following one another.
const AHEAD: usize = 16;
/// How many hashes ahead the int objects of a list or tuple start loading (they may be cold, as
/// in a replay of pre-built events): their values are needed AHEAD hashes ahead.
const OBJ_AHEAD: usize = 2 * AHEAD;

impl<'a, 'py> Hashes<'a, 'py> {
    fn of(ob: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(l) = ob.cast::<PyList>() {
            return Ok(Hashes::List(l));
        }
        if let Ok(t) = ob.cast::<PyTuple>() {
            return Ok(Hashes::Tuple(t));
        }
        if let Ok(a) = ob.cast::<HashArray>() {
            return Ok(Hashes::Vec(a.get().v.iter().map(|&h| mix(h)).collect(), None.into()));
        }
        let mut out = Vec::with_capacity(ob.len().unwrap_or(0));
        for item in ob.try_iter()? {
            match item.and_then(|h| u64_of(&h)) {
                Ok(h) => out.push(mix(h)),
                Err(e) => return Ok(Hashes::Vec(out, Some(e).into())),  // raised where it was
            }
        }
        Ok(Hashes::Vec(out, None.into()))
    }

    /// Hash i (mixed): None past the end (the list's length now: it is read in place), Err if
    /// item i is not a u64.
    #[inline(always)]
    fn get(&self, i: usize) -> Option<PyResult<u64>> {
        // SAFETY: the GIL is held; the index is checked against the current size and the borrowed
        // item is converted before anything else can run
        unsafe {
            let (py, ob) = match self {
                Hashes::List(l) => {
                    if i >= ffi::PyList_GET_SIZE(l.as_ptr()) as usize {
                        return None;
                    }
                    (l.py(), ffi::PyList_GET_ITEM(l.as_ptr(), i as ffi::Py_ssize_t))
                }
                Hashes::Tuple(t) => {
                    if i >= ffi::PyTuple_GET_SIZE(t.as_ptr()) as usize {
                        return None;
                    }
                    (t.py(), ffi::PyTuple_GET_ITEM(t.as_ptr(), i as ffi::Py_ssize_t))
                }
                Hashes::Vec(v, err) => {
                    return match v.get(i) {
                        Some(&h) => Some(Ok(h)),
                        None if i == v.len() => err.take().map(Err),
                        None => None,
                    };
                }
            };
            Some(u64_of_ptr(py, ob).map(mix))
        }
    }

    /// Starts loading the int object of item i (read in place), if there is one.
    #[inline(always)]
    fn prefetch_item(&self, i: usize) {
        // SAFETY: the GIL is held; the index is checked against the current size; a prefetch never
        // faults
        unsafe {
            let ob = match self {
                Hashes::List(l) if i < ffi::PyList_GET_SIZE(l.as_ptr()) as usize => {
                    ffi::PyList_GET_ITEM(l.as_ptr(), i as ffi::Py_ssize_t)
                }
                Hashes::Tuple(t) if i < ffi::PyTuple_GET_SIZE(t.as_ptr()) as usize => {
                    ffi::PyTuple_GET_ITEM(t.as_ptr(), i as ffi::Py_ssize_t)
                }
                _ => return,
            };
            // the header and the digits (an int of 64 bits: 36 bytes, maybe over two lines)
            table::prefetch(ob as *const u8);
            table::prefetch((ob as *const u8).wrapping_add(32));
        }
    }

    /// Starts loading the item pointers from..from+n (the list's or tuple's array of them).
    #[inline(always)]
    fn prefetch_items(&self, from: usize, n: usize) {
        // SAFETY: the GIL is held; the array pointer and size are read from a live list or tuple; a
        // prefetch never faults
        unsafe {
            let (base, size) = match self {
                Hashes::List(l) => ((*(l.as_ptr() as *mut ffi::PyListObject)).ob_item as *const u8,
                                    ffi::PyList_GET_SIZE(l.as_ptr()) as usize),
                Hashes::Tuple(t) => (std::ptr::addr_of!((*(t.as_ptr() as *mut ffi::PyTupleObject)).ob_item)
                                         as *const u8, ffi::PyTuple_GET_SIZE(t.as_ptr()) as usize),
                Hashes::Vec(..) => return,
            };
            let end = size.min(from + n);
            let mut j = from;
            while j < end {
                table::prefetch(base.wrapping_add(8 * j));
                j += 8;  // a cache line of pointers
            }
            if from < end {
                table::prefetch(base.wrapping_add(8 * (end - 1)));
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Hashes::List(l) => l.len(),
            Hashes::Tuple(t) => t.len(),
            Hashes::Vec(v, _) => v.len(),
        }
    }

    /// Runs `f(state, i, h)` on hashes `from`.. in order while it returns true, calling
    /// `pf(state, h)` on each hash AHEAD hashes before. A hash that is not a u64 is an error once
    /// `f` has had all those before it (and wants more), as a plain loop would be.
    #[inline(always)]
    fn run<S>(&self, from: usize, st: &mut S, pf: impl Fn(&S, u64),
              mut f: impl FnMut(&mut S, usize, u64) -> PyResult<bool>) -> PyResult<()> {
        let mut ring = [0u64; AHEAD];
        let mut end = usize::MAX;  // the first index past the usable hashes
        let mut err = None;
        let mut fetch = |st: &S, j: usize, ring: &mut [u64; AHEAD], end: &mut usize| {
            match self.get(j) {
                Some(Ok(h)) => {
                    ring[j % AHEAD] = h;
                    pf(st, h);
                }
                Some(Err(e)) => {
                    err = Some(e);
                    *end = j;
                }
                None => *end = j,
            }
        };
        self.prefetch_items(from, OBJ_AHEAD + AHEAD);
        for j in from..from + OBJ_AHEAD {
            self.prefetch_item(j);
        }
        for j in from..from + AHEAD {
            fetch(st, j, &mut ring, &mut end);
            if end != usize::MAX {
                break;
            }
        }
        let mut i = from;
        while i < end {
            let h = ring[i % AHEAD];
            if end == usize::MAX {
                self.prefetch_item(i + OBJ_AHEAD);
                fetch(st, i + AHEAD, &mut ring, &mut end);
            }
            if !f(st, i, h)? {
                return Ok(());
            }
            i += 1;
        }
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The AND-walk's answer (MaskMap.walk): slot -> leading hashes held, a read-only mapping built
/// without a Python object per slot (a 64-entry dict costs more than the walk itself). Iterates in
/// the order the reference's dict would (maskmap.walk_masks); equal to a dict with the same items.
#[pyclass(name = "Depths", module = "kvidx_native", frozen, mapping)]
pub struct Depths {
    pub order: Vec<(u32, u32)>,  // (slot, depth), as the reference inserts them
    pub by_slot: Vec<u32>,       // depth of slot i (0: absent; a present slot has depth >= 1)
}

impl Depths {
    fn new(pairs: &[(usize, usize)]) -> Self {
        let top = pairs.iter().map(|p| p.0 + 1).max().unwrap_or(0);
        let mut by_slot = vec![0u32; top];
        for &(s, k) in pairs {
            by_slot[s] = k as u32;
        }
        Depths { order: pairs.iter().map(|&(s, k)| (s as u32, k as u32)).collect(), by_slot }
    }

    #[inline]
    pub fn depth(&self, slot: i64) -> u32 {
        if slot < 0 { 0 } else { self.by_slot.get(slot as usize).copied().unwrap_or(0) }
    }

    fn slot_key(key: &Bound<'_, PyAny>) -> Option<i64> {
        if key.is_instance_of::<pyo3::types::PyBool>() {
            return None;
        }
        key.cast::<PyInt>().ok().and_then(|k| k.extract::<i64>().ok())
    }
}

#[pymethods]
impl Depths {
    fn __len__(&self) -> usize {
        self.order.len()
    }

    fn __getitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        match Self::slot_key(key).map(|s| self.depth(s)) {
            Some(d) if d > 0 => Ok(d),
            _ => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        Self::slot_key(key).is_some_and(|s| self.depth(s) > 0)
    }

    #[pyo3(signature = (key, default=None))]
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>, default: Option<Bound<'py, PyAny>>
    ) -> PyResult<Bound<'py, PyAny>> {
        match Self::slot_key(key).map(|s| self.depth(s)) {
            Some(d) if d > 0 => Ok(d.into_pyobject(py)?.into_any()),
            _ => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.order.iter().map(|p| p.0))
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.order.iter().map(|p| p.1))
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.order.iter().copied())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.keys(py)?.into_any().try_iter().map(|i| i.into_any())
    }

    /// The answer as a plain dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for &(s, k) in &self.order {
            d.set_item(s, k)?;
        }
        Ok(d)
    }

    fn __eq__<'py>(&self, py: Python<'py>, other: &Bound<'py, PyAny>) -> PyResult<bool> {
        if let Ok(o) = other.cast::<Depths>() {
            let o = o.get();
            return Ok(self.order.len() == o.order.len() && self.order.iter().all(|&(s, k)| o.depth(s as i64) == k));
        }
        if other.cast::<PyDict>().is_ok() || other.hasattr("items")? {
            return self.to_dict(py)?.eq(other);
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let items: Vec<String> = self.order.iter().map(|(s, k)| format!("{s}: {k}")).collect();
        format!("Depths({{{}}})", items.join(", "))
    }
}

/// Runs `f` on the bytes of a bytes-like object (bytes without a copy; bytearray, memoryview ...).
fn with_bytes<R>(ob: &Bound<'_, PyAny>, f: impl FnOnce(&[u8]) -> PyResult<R>) -> PyResult<R> {
    if let Ok(b) = ob.cast::<PyBytes>() {
        return f(b.as_bytes());
    }
    // any other buffer (bytearray, memoryview, an array): one copy
    let copy = PyMemoryView::from(ob)?.call_method0("tobytes")?;
    f(copy.cast::<PyBytes>()?.as_bytes())
}

/// `words` of a load or an assign: >= 1.
fn words_arg(words: i64) -> PyResult<usize> {
    if words < 1 {
        return Err(PyValueError::new_err(format!("words must be >= 1, not {words}")));
    }
    Ok(words as usize)
}

fn check_layout(kb: &[u8], mb: &[u8], words: usize) -> PyResult<()> {
    if kb.len() % 8 != 0 || mb.len() != kb.len() * words {
        return Err(PyValueError::new_err(format!(
            "{} key bytes and {} mask bytes are not n keys of 8 bytes and n masks of {} bytes",
            kb.len(), mb.len(), 8 * words)));
    }
    Ok(())
}

#[inline]
fn read_u64(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap())
}

// ---- the Python class -------------------------------------------------------------------------

/// Canonical block hash (u64) -> slot bitmask (a positive int: bit i set = replica slot i holds the
/// block). Dict-like, plus the batched operations of the shard's fold and lookup walk.
#[pyclass(name = "MaskMap", module = "kvidx_native")]
#[derive(Clone, Default)]
struct MaskMap {
    m: Masks,
}

impl MaskMap {
    /// `words` of an export, checked: >= 1 and enough for the widest mask.
    fn export_words(&self, words: i64) -> PyResult<usize> {
        let need = self.m.width();
        words_arg(words)?;
        if need > words as usize {
            return Err(PyValueError::new_err(format!("a mask needs {need} words, more than {words}")));
        }
        Ok(words as usize)
    }

    /// Appends stored key `k` (word 0: `lo`) in `export`'s layout.
    #[inline]
    fn put(&self, k: u64, lo: u64, words: usize, keys: &mut Vec<u8>, masks: &mut Vec<u8>) {
        keys.extend_from_slice(&unmix(k).to_le_bytes());
        masks.extend_from_slice(&lo.to_le_bytes());
        for w in 1..words {
            masks.extend_from_slice(&self.m.word(k, w).to_le_bytes());
        }
    }

    fn items_from(&mut self, pairs: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = pairs.py();
        let iter = if let Ok(d) = pairs.cast::<PyDict>() {
            d.items().into_any().try_iter()?
        } else if let Ok(m) = pairs.cast::<MaskMap>() {
            let items = m.borrow().items(py)?;
            items.into_any().try_iter()?
        } else if pairs.hasattr("items")? {
            pairs.call_method0("items")?.try_iter()?
        } else {
            pairs.try_iter()?
        };
        for item in iter {
            let (h, mask): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
            let h = mix(u64_of(&h)?);
            let m = mask_from_py(&mask)?;
            self.m.insert(h, &m);
        }
        Ok(())
    }
}

#[pymethods]
impl MaskMap {
    #[new]
    #[pyo3(signature = (pairs=None))]
    fn new(pairs: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut s = MaskMap::default();
        if let Some(p) = pairs {
            s.items_from(p)?;
        }
        Ok(s)
    }

    // ---- dict-like ----------------------------------------------------------------------------
    /// get(h) -> mask or 0; get(h, default) -> mask or default.
    #[pyo3(signature = (h, *default))]
    fn get<'py>(&self, py: Python<'py>, h: &Bound<'py, PyAny>, default: &Bound<'py, PyTuple>
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(k) = key_of(h) {
            if let Some(m) = self.m.get_py(py, k)? {
                return Ok(m);
            }
        }
        match default.len() {
            0 => Ok(0u64.into_pyobject(py)?.into_any()),
            1 => default.get_item(0),
            n => Err(PyTypeError::new_err(format!("get expected at most 2 arguments, got {}", 1 + n))),
        }
    }

    fn __getitem__<'py>(&self, py: Python<'py>, h: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(k) = key_of(h) {
            if let Some(m) = self.m.get_py(py, k)? {
                return Ok(m);
            }
        }
        Err(PyKeyError::new_err(h.clone().unbind()))
    }

    fn __setitem__(&mut self, h: &Bound<'_, PyAny>, mask: &Bound<'_, PyAny>) -> PyResult<()> {
        let h = mix(u64_of(h)?);
        let m = mask_from_py(mask)?;
        self.m.insert(h, &m);
        Ok(())
    }

    fn __delitem__(&mut self, h: &Bound<'_, PyAny>) -> PyResult<()> {
        match key_of(h).and_then(|k| self.m.remove(k)) {
            Some(_) => Ok(()),
            None => Err(PyKeyError::new_err(h.clone().unbind())),
        }
    }

    /// pop(h) -> mask, KeyError if absent; pop(h, default) -> mask or default.
    #[pyo3(signature = (h, *default))]
    fn pop<'py>(&mut self, py: Python<'py>, h: &Bound<'py, PyAny>, default: &Bound<'py, PyTuple>
    ) -> PyResult<Bound<'py, PyAny>> {
        if default.len() > 1 {
            return Err(PyTypeError::new_err(format!("pop expected at most 2 arguments, got {}",
                                                    1 + default.len())));
        }
        match key_of(h).and_then(|k| self.m.remove(k)) {
            Some(m) => mask_to_py(py, &m),
            None if default.len() == 1 => default.get_item(0),
            None => Err(PyKeyError::new_err(h.clone().unbind())),
        }
    }

    fn __len__(&self) -> usize {
        self.m.lo.len()
    }

    fn __contains__(&self, h: &Bound<'_, PyAny>) -> bool {
        key_of(h).is_some_and(|k| self.m.lo.contains(k))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.keys(py)?.into_any().try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("MaskMap(<{} entries>)", self.m.lo.len())
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.m.lo.iter().map(|(k, _)| unmix(k)))
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        if self.m.hi.is_empty() {
            return PyList::new(py, self.m.lo.iter().map(|(_, v)| v));
        }
        let out = PyList::empty(py);
        for (k, _) in self.m.lo.iter() {
            out.append(self.m.get_py(py, k)?)?;
        }
        Ok(out)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (k, _) in self.m.lo.iter() {
            out.append(PyTuple::new(py, [unmix(k).into_pyobject(py)?.into_any(),
                                         self.m.get_py(py, k)?.unwrap()])?)?;
        }
        Ok(out)
    }

    /// Sets (replaces) each (hash, mask) of an iterable of pairs or a mapping.
    fn update(slf: &Bound<'_, Self>, pairs: &Bound<'_, PyAny>) -> PyResult<()> {
        if pairs.is(slf) {
            return Ok(());
        }
        slf.try_borrow_mut()?.items_from(pairs)
    }

    fn copy(&self) -> Self {
        self.clone()
    }

    fn __copy__(&self) -> Self {
        self.clone()
    }

    #[pyo3(signature = (_memo=None))]
    fn __deepcopy__(&self, _memo: Option<&Bound<'_, PyAny>>) -> Self {
        self.clone()
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyList>,))> {
        let items = slf.borrow().items(slf.py())?;
        Ok((slf.get_type().into_any(), (items,)))
    }

    fn clear(&mut self) {
        self.m = Masks::default();
    }

    // ---- batched ------------------------------------------------------------------------------
    // Each loads the buckets of the hashes AHEAD of the one it works on (Hashes::run).

    /// Sets bit `slot` on every hash; how many did not have it.
    fn store(&mut self, hashes: &Bound<'_, PyAny>, slot: i64) -> PyResult<usize> {
        let s = slot_of(slot)?;
        let (w, b) = (s / 64, 1u64 << (s % 64));
        let hs = Hashes::of(hashes)?;
        let mut st = (&mut self.m, 0usize);
        hs.run(0, &mut st, |st, h| st.0.prefetch(h, w), |st, _, h| {
            st.1 += st.0.set_bit(h, w, b) as usize;
            Ok(true)
        })?;
        Ok(st.1)
    }

    /// Clears bit `slot` on every hash that has it here (an entry goes when its mask becomes 0);
    /// how many had it. For each of those hashes, if no map of `others` has the bit, clears it in
    /// `union` too (the "any tier" map: retract only when the last tier drops it).
    #[pyo3(signature = (hashes, slot, others=None, union=None))]
    fn remove(slf: &Bound<'_, Self>, hashes: &Bound<'_, PyAny>, slot: i64, others: Option<&Bound<'_, PyAny>>,
              union: Option<Bound<'_, MaskMap>>) -> PyResult<usize> {
        let s = slot_of(slot)?;
        let (w, b) = (s / 64, 1u64 << (s % 64));
        let union = union.filter(|u| !u.is(slf));  // clearing self again changes nothing
        let others: Vec<Bound<'_, MaskMap>> = match (&union, others) {
            (Some(_), Some(o)) => o.extract()?,
            _ => Vec::new(),
        };
        let hs = Hashes::of(hashes)?;
        let mut dropped = Vec::new();
        let gone = {
            let mut me = slf.try_borrow_mut()?;
            let keep = union.is_some();
            let mut st = (&mut me.m, 0usize, &mut dropped);
            hs.run(0, &mut st, |st, h| st.0.prefetch(h, w), |st, _, h| {
                if st.0.clear_bit(h, w, b) {
                    st.1 += 1;
                    if keep {
                        st.2.push(h);
                    }
                }
                Ok(true)
            })?;
            st.1
        };
        if let Some(u) = union {
            if !others.is_empty() {
                let os = others.iter().map(|o| o.try_borrow()).collect::<Result<Vec<_>, _>>()?;
                let held = |h: u64| os.iter().any(|o| o.m.has_bit(h, s));
                if dropped.len() <= 4 * AHEAD {
                    for &h in &dropped {
                        for o in &os {
                            o.m.prefetch(h, w);
                        }
                    }
                }
                dropped.retain(|&h| !held(h));
            }
            let mut um = u.try_borrow_mut()?;
            let hs = Hashes::Vec(dropped, Default::default());
            hs.run(0, &mut um.m, |m, h| m.prefetch(h, w), |m, _, h| {
                m.clear_bit(h, w, b);
                Ok(true)
            })?;
        }
        Ok(gone)
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    fn clear_slot(&mut self, slot: i64) -> PyResult<usize> {
        Ok(self.m.clear_slot(slot_of(slot)?))
    }

    /// The mask of every hash (0 for an absent one).
    fn masks<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let hs = Hashes::of(hashes)?;
        let m = &self.m;
        if m.hi.is_empty() {
            let mut out = Vec::with_capacity(hs.len());
            hs.run(0, &mut out, |_, h| m.lo.prefetch(h), |o, _, h| {
                o.push(m.lo.get(h).unwrap_or(0));
                Ok(true)
            })?;
            return PyList::new(py, out);
        }
        let out = PyList::empty(py);
        hs.run(0, &mut (), |_, h| m.prefetch(h, 1), |_, _, h| {
            match m.get_py(py, h)? {
                Some(x) => out.append(x)?,
                None => out.append(0u64)?,
            }
            Ok(true)
        })?;
        Ok(out)
    }

    /// The AND-walk (kvidx/core/walk.py `_walk`): slot -> how many leading hashes it holds, for
    /// every slot holding hashes[0]. Hash 0 is looked up alone (most walks stop there); then the
    /// walk loads buckets AHEAD of where it is.
    fn walk(&self, hashes: &Bound<'_, PyAny>) -> PyResult<Depths> {
        let hs = Hashes::of(hashes)?;
        let first = match hs.get(0) {
            None => return Ok(Depths::new(&[])),
            Some(h) => h?,
        };
        let n = hs.len();
        let m = &self.m;
        // the walk first, then the dict: (slot, depth) in the order the reference inserts them
        let mut out: Vec<(usize, usize)> = Vec::new();
        if m.hi.is_empty() {
            let mut alive = m.lo.get(first).unwrap_or(0);
            out.reserve_exact(alive.count_ones() as usize);
            if alive != 0 {
                hs.run(1, &mut alive, |_, h| m.lo.prefetch(h), |alive, i, h| {
                    let x = m.lo.get(h).unwrap_or(0) & *alive;
                    let mut lost = *alive & !x;
                    while lost != 0 {
                        out.push((lost.trailing_zeros() as usize, i));
                        lost &= lost - 1;
                    }
                    *alive = x;
                    Ok(x != 0)
                })?;
            }
            while alive != 0 {
                out.push((alive.trailing_zeros() as usize, n));
                alive &= alive - 1;
            }
            return Ok(Depths::new(&out));
        }
        // wide masks: the same walk over words (only the words still alive are looked up)
        let Some(mut alive) = m.words(first) else { return Ok(Depths::new(&out)) };
        out.reserve_exact(alive.iter().map(|a| a.count_ones() as usize).sum());
        let pf = |_: &Vec<u64>, h: u64| {
            m.lo.prefetch(h);
            for t in &m.hi {
                t.prefetch(h);
            }
        };
        hs.run(1, &mut alive, pf, |alive, i, h| {
            let mut any = false;
            for (w, a) in alive.iter_mut().enumerate() {
                if *a == 0 {
                    continue;
                }
                let x = m.word(h, w) & *a;
                let mut lost = *a & !x;
                while lost != 0 {
                    out.push((64 * w + lost.trailing_zeros() as usize, i));
                    lost &= lost - 1;
                }
                *a = x;
                any |= x != 0;
            }
            Ok(any)
        })?;
        for (w, a) in alive.iter().enumerate() {
            let mut a = *a;
            while a != 0 {
                out.push((64 * w + a.trailing_zeros() as usize, n));
                a &= a - 1;
            }
        }
        Ok(Depths::new(&out))
    }

    /// ORs every entry of self into `other` (the union of tiers).
    fn or_into(slf: &Bound<'_, Self>, other: &Bound<'_, MaskMap>) -> PyResult<()> {
        if other.is(slf) {
            return Ok(());
        }
        let me = slf.try_borrow()?;
        let mut o = other.try_borrow_mut()?;
        let o = &mut o.m;
        o.lo.reserve(me.m.lo.len().saturating_sub(o.lo.len()));
        for (k, lo) in me.m.lo.iter() {
            let (pos, _) = o.lo.get_or_insert(k, 0);
            *o.lo.value_mut(pos) |= lo;
        }
        if o.hi.len() < me.m.hi.len() {
            o.hi.resize_with(me.m.hi.len(), Table::default);
        }
        for (t, ot) in me.m.hi.iter().zip(o.hi.iter_mut()) {
            for (k, x) in t.iter() {
                let (pos, _) = ot.get_or_insert(k, 0);
                *ot.value_mut(pos) |= x;
            }
        }
        Ok(())
    }

    // ---- snapshot -----------------------------------------------------------------------------
    /// (keys, masks): the keys as little-endian u64s and the masks as `words` little-endian u64
    /// words each, in the same order (snapshot.py `_pack_masks`); ValueError if a mask needs more.
    fn export<'py>(&self, py: Python<'py>, words: i64) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let words = self.export_words(words)?;
        let n = self.m.lo.len();
        let mut keys = Vec::with_capacity(n * 8);
        let mut masks = Vec::with_capacity(n * 8 * words);
        for (k, lo) in self.m.lo.iter() {
            self.put(k, lo, words, &mut keys, &mut masks);
        }
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &masks)))
    }

    /// `export` of the keys whose segment (the top `bits` bits of their stored form, table::mix) is
    /// in [first, last), in stored order: the pieces of a snapshot's base (snapshot.py).
    fn export_segments<'py>(&self, py: Python<'py>, first: u64, last: u64, bits: u32, words: i64)
                            -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let words = self.export_words(words)?;
        if !(1..=32).contains(&bits) || first >= last || last > 1u64 << bits {
            return Err(PyValueError::new_err(format!(
                "segments [{first}, {last}) of 2**{bits}: need 1 <= bits <= 32 and first < last <= 2**bits")));
        }
        let shift = 64 - bits;
        let hi = if last == 1u64 << bits { None } else { Some(last << shift) };
        let (mut keys, mut masks) = (Vec::new(), Vec::new());
        for (k, lo) in self.m.lo.range(first << shift, hi) {
            self.put(k, lo, words, &mut keys, &mut masks);
        }
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &masks)))
    }

    /// The masks of `keys` (little-endian u64s) in `export`'s layout, all-zero for an absent key.
    fn export_keys<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>, words: i64) -> PyResult<Bound<'py, PyBytes>> {
        let words = self.export_words(words)?;
        with_bytes(keys, |kb| {
            if kb.len() % 8 != 0 {
                return Err(PyValueError::new_err(format!("{} key bytes are not n keys of 8 bytes", kb.len())));
            }
            let n = kb.len() / 8;
            let mut masks = Vec::with_capacity(n * 8 * words);
            for i in 0..n {
                let k = mix(read_u64(kb, i));
                for w in 0..words {
                    masks.extend_from_slice(&self.m.word(k, w).to_le_bytes());
                }
            }
            Ok(PyBytes::new(py, &masks))
        })
    }

    /// Sets the masks of entries in `export`'s layout, replacing what was there (an all-zero mask
    /// deletes the key): a snapshot delta's changes.
    fn assign(&mut self, keys: &Bound<'_, PyAny>, masks: &Bound<'_, PyAny>, words: i64) -> PyResult<()> {
        let words = words_arg(words)?;
        let m = &mut self.m;
        with_bytes(keys, |kb| {
            with_bytes(masks, |mb| {
                check_layout(kb, mb, words)?;
                let mut mask = vec![0u64; words];
                for i in 0..kb.len() / 8 {
                    let k = mix(read_u64(kb, i));
                    for (w, x) in mask.iter_mut().enumerate() {
                        *x = read_u64(mb, i * words + w);
                    }
                    if mask.iter().all(|&x| x == 0) {
                        m.remove(k);
                    } else {
                        m.insert(k, &mask);
                    }
                }
                Ok(())
            })
        })
    }

    /// ORs in the entries of `export`'s layout (a zero mask adds nothing).
    fn load(&mut self, keys: &Bound<'_, PyAny>, masks: &Bound<'_, PyAny>, words: i64) -> PyResult<()> {
        let words = words_arg(words)?;
        let m = &mut self.m;
        with_bytes(keys, |kb| {
            with_bytes(masks, |mb| {
                check_layout(kb, mb, words)?;
                let n = kb.len() / 8;
                if m.lo.is_empty() {
                    m.lo.reserve(n);  // a fresh map (a restore): exactly what it will hold
                }
                let mut mask = vec![0u64; words];
                for i in 0..n {
                    let k = mix(read_u64(kb, i));
                    if words == 1 {
                        let lo = read_u64(mb, i);
                        if lo != 0 {
                            let (pos, _) = m.lo.get_or_insert(k, 0);
                            *m.lo.value_mut(pos) |= lo;
                        }
                        continue;
                    }
                    for (w, x) in mask.iter_mut().enumerate() {
                        *x = read_u64(mb, i * words + w);
                    }
                    m.or_in(k, &mask);
                }
                Ok(())
            })
        })
    }

    /// Makes room for `n` entries in all without growing (a rebuild that knows its size: keys loaded
    /// in stored order would otherwise crowd the low buckets of a table sized for fewer).
    fn reserve(&mut self, n: usize) {
        let have = self.m.lo.len();
        self.m.lo.reserve(n.saturating_sub(have));
    }

    /// An estimate of the heap bytes held (table capacities, not just the live entries).
    fn memory_bytes(&self) -> usize {
        self.m.memory_bytes()
    }
}

/// Canonical block hashes as u64s, without a Python int per hash (`chain_array`, what the lookup
/// service hashes prompts into): a read-only sequence whose items are made only when read; the mask
/// map's batched operations (walk, masks, ...) read it directly. Slices are lists.
#[pyclass(name = "HashArray", module = "kvidx_native", frozen, sequence)]
pub struct HashArray {
    pub v: Vec<u64>,
}

#[pymethods]
impl HashArray {
    fn __len__(&self) -> usize {
        self.v.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(s) = key.cast::<PySlice>() {
            let ix = s.indices(self.v.len() as isize)?;
            let picked = (0..ix.slicelength).map(|k| self.v[(ix.start + k as isize * ix.step) as usize]);
            return Ok(PyList::new(py, picked)?.into_any());
        }
        let i: isize = key.extract()?;
        let n = self.v.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(PyIndexError::new_err("HashArray index out of range"));
        }
        Ok(self.v[j as usize].into_pyobject(py)?.into_any())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.tolist(py)?.into_any().try_iter().map(|i| i.into_any())
    }

    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.v)
    }

    /// Equal to another HashArray or any sequence of the same ints (a list from the reference).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        if let Ok(o) = other.cast::<HashArray>() {
            return o.get().v == self.v;
        }
        other.extract::<Vec<u64>>().is_ok_and(|o| o == self.v)
    }

    fn __repr__(&self) -> String {
        format!("HashArray({:?})", self.v)
    }
}

fn chain_vec(py: Python<'_>, packed: &Bound<'_, PyAny>, block_size: i64, parent: u64) -> PyResult<Vec<u64>> {
    if block_size < 1 {
        return Err(PyValueError::new_err(format!("block_size must be >= 1, not {block_size}")));
    }
    let step = block_size as usize * 4;
    with_bytes(packed, |b| {
        let run = || {
            let mut h = parent;
            b.chunks_exact(step).map(|c| {
                h = XxHash3_64::oneshot_with_seed(h, c);
                h
            }).collect::<Vec<u64>>()
        };
        Ok(if b.len() >= 1 << 16 { py.detach(run) } else { run() })
    })
}

/// Canonical hashes of the full blocks of `packed` (little-endian uint32 tokens), chained from
/// `parent`: kvidx.core.hashing.chain without extra keys.
#[pyfunction]
fn chain<'py>(py: Python<'py>, packed: &Bound<'py, PyAny>, block_size: i64, parent: u64
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, chain_vec(py, packed, block_size, parent)?)
}

/// `chain` as a HashArray: no Python int per hash.
#[pyfunction]
fn chain_array(py: Python<'_>, packed: &Bound<'_, PyAny>, block_size: i64, parent: u64) -> PyResult<HashArray> {
    Ok(HashArray { v: chain_vec(py, packed, block_size, parent)? })
}

#[pymodule]
fn kvidx_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MaskMap>()?;
    m.add_class::<Depths>()?;
    m.add_class::<order::Order>()?;
    m.add_class::<HashArray>()?;
    m.add_class::<fold::Folder>()?;
    m.add_class::<answer::ReplicaFields>()?;
    m.add_function(wrap_pyfunction!(chain, m)?)?;
    m.add_function(wrap_pyfunction!(chain_array, m)?)?;
    m.add_function(wrap_pyfunction!(answer::lookup_json, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::split_token_ids, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::token_reader, m)?)?;
    Ok(())
}
