//! kvidx_native: kvidx's hot data structure, the mask map (canonical block hash -> slot bitmask),
//! and canonical block hashing, for kvidx/core/maskmap.py (whose `PyMaskMap` is the pure-Python
//! reference of the same API; tests/unit/core/test_maskmap.py checks that they agree).
//!
//! Layout (memory is the budget): one `HashMap<u64, u64>` per 64-bit word of the masks. Word 0
//! (slots 0..63) of every entry is stored inline as the value of the first table (16 bytes a bucket
//! plus a control byte), which is also the key set. Word w >= 1 (slots 64w..64w+63) is in table w,
//! only for the entries with a bit there, so a fleet of more than 64 replicas works at no cost to
//! the small ones, and a wide entry costs one more (key, word) bucket per word it uses, no heap
//! block of its own. Invariants: a hash is in the map iff it is a key of `lo` (its word 0 may be 0
//! when only high bits are set); the `hi` tables hold no 0 words and the last one is never empty;
//! no entry has an all-zero mask.
//!
//! The keys are canonical block hashes (xxh3-64 output: already uniformly random), so the tables use
//! hashbrown's default hasher (foldhash, seeded per process: one folded multiply per key), not SipHash.

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use num_bigint::BigUint;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyTuple};
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Clone, Default)]
struct Masks {
    lo: HashMap<u64, u64>,
    hi: Vec<HashMap<u64, u64>>,  // hi[w - 1]: word w of the entries that have a bit in it
}

impl Masks {
    #[inline]
    fn word(&self, h: u64, w: usize) -> u64 {
        let t = if w == 0 { Some(&self.lo) } else { self.hi.get(w - 1) };
        t.and_then(|t| t.get(&h)).copied().unwrap_or(0)
    }

    #[inline]
    fn in_hi(&self, h: u64) -> bool {
        self.hi.iter().any(|t| t.contains_key(&h))
    }

    fn trim_hi(&mut self) {
        while self.hi.last().is_some_and(HashMap::is_empty) {
            self.hi.pop();
        }
    }

    /// The words of `h`'s mask (trimmed: no trailing 0 word past the first), None if absent.
    fn words(&self, h: u64) -> Option<Vec<u64>> {
        let lo = *self.lo.get(&h)?;
        let mut out = vec![lo];
        for t in &self.hi {
            out.push(t.get(&h).copied().unwrap_or(0));
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
    #[inline]
    fn set_bit(&mut self, h: u64, slot: usize) -> bool {
        let (w, b) = (slot / 64, 1u64 << (slot % 64));
        let v = self.lo.entry(h).or_insert(0);
        let v = if w == 0 {
            v
        } else {
            if self.hi.len() < w {
                self.hi.resize_with(w, HashMap::new);
            }
            self.hi[w - 1].entry(h).or_insert(0)
        };
        let new = *v & b == 0;
        *v |= b;
        new
    }

    /// Clears bit `slot` of `h`'s mask, deleting the entry when nothing is left; true if it was set.
    #[inline]
    fn clear_bit(&mut self, h: u64, slot: usize) -> bool {
        let (w, b) = (slot / 64, 1u64 << (slot % 64));
        if w == 0 {
            let Entry::Occupied(mut e) = self.lo.entry(h) else { return false };  // one probe
            let v = e.get_mut();
            if *v & b == 0 {
                return false;
            }
            *v &= !b;
            if *v == 0 && !self.hi.iter().any(|t| t.contains_key(&h)) {
                e.remove();
            }
            return true;
        }
        let Some(t) = self.hi.get_mut(w - 1) else { return false };
        let Some(v) = t.get_mut(&h) else { return false };
        if *v & b == 0 {
            return false;
        }
        *v &= !b;
        if *v == 0 {
            t.remove(&h);
            if self.lo.get(&h) == Some(&0) && !self.in_hi(h) {
                self.lo.remove(&h);
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
            self.hi.resize_with(n - 1, HashMap::new);
        }
        for (i, t) in self.hi.iter_mut().enumerate() {
            match words.get(i + 1).copied().unwrap_or(0) {
                0 => {
                    t.remove(&h);
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
        *self.lo.entry(h).or_insert(0) |= words[0];
        for (i, &x) in words.iter().enumerate().skip(1) {
            if x != 0 {
                if self.hi.len() < i {
                    self.hi.resize_with(i, HashMap::new);
                }
                *self.hi[i - 1].entry(h).or_insert(0) |= x;
            }
        }
    }

    fn remove(&mut self, h: u64) -> Option<Vec<u64>> {
        let lo = self.lo.remove(&h)?;
        let mut out = vec![lo];
        if !self.hi.is_empty() {
            for t in self.hi.iter_mut() {
                out.push(t.remove(&h).unwrap_or(0));
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
                *v != 0 || hi.iter().any(|t| t.contains_key(k))
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
                emptied.push(*k);
            }
            *v != 0
        });
        for k in emptied {
            if self.lo.get(&k) == Some(&0) && !self.in_hi(k) {
                self.lo.remove(&k);
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
            + self.hi.capacity() * std::mem::size_of::<HashMap<u64, u64>>()
            + self.hi.iter().map(HashMap::allocation_size).sum::<usize>()
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
        if self.hi.is_empty() {
            return match self.lo.get(&h) {
                Some(lo) => Ok(Some(lo.into_pyobject(py)?.into_any())),
                None => Ok(None),
            };
        }
        let Some(&lo) = self.lo.get(&h) else { return Ok(None) };
        if self.hi.len() > 3 {
            return Ok(Some(mask_to_py(py, &self.words(h).unwrap_or_default())?));
        }
        let mut buf = [lo, 0, 0, 0];  // no allocation for masks of up to 256 slots
        let mut n = 1;
        for (i, t) in self.hi.iter().enumerate() {
            if let Some(&x) = t.get(&h) {
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
    #[cfg(all(not(windows), target_pointer_width = "64"))]
    {
        // SAFETY: `ob` is a live object and the GIL is held; the error indicator is checked as the C
        // API asks (the value -1 as unsigned is both a valid result and the error marker)
        let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLong(ob.as_ptr()) };
        if v == std::os::raw::c_ulong::MAX {
            if let Some(e) = PyErr::take(ob.py()) {
                return Err(e);
            }
        }
        Ok(v as u64)
    }
    #[cfg(not(all(not(windows), target_pointer_width = "64")))]
    {
        ob.extract::<u64>()
    }
}

/// A key that can be in the map (a u64), or None for anything else (never present).
#[inline]
fn key_of(ob: &Bound<'_, PyAny>) -> Option<u64> {
    if ob.is_instance_of::<PyInt>() {
        u64_of(ob).ok()
    } else {
        None
    }
}

/// Calls `f` on each hash of a list, tuple or other iterable of ints.
#[inline]
fn for_each_hash(hashes: &Bound<'_, PyAny>, mut f: impl FnMut(u64)) -> PyResult<()> {
    if let Ok(list) = hashes.cast::<PyList>() {
        for item in list.iter() {
            f(u64_of(&item)?);
        }
    } else if let Ok(tup) = hashes.cast::<PyTuple>() {
        for item in tup.iter() {
            f(u64_of(&item)?);
        }
    } else {
        for item in hashes.try_iter()? {
            f(u64_of(&item?)?);
        }
    }
    Ok(())
}

fn hashes_vec(hashes: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(hashes.len().unwrap_or(0));
    for_each_hash(hashes, |h| out.push(h))?;
    Ok(out)
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
            let h = u64_of(&h)?;
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
        let h = u64_of(h)?;
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
        key_of(h).is_some_and(|k| self.m.lo.contains_key(&k))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.keys(py)?.into_any().try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("MaskMap(<{} entries>)", self.m.lo.len())
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.m.lo.keys())
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        if self.m.hi.is_empty() {
            return PyList::new(py, self.m.lo.values());
        }
        let out = PyList::empty(py);
        for k in self.m.lo.keys() {
            out.append(self.m.get_py(py, *k)?)?;
        }
        Ok(out)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for k in self.m.lo.keys() {
            out.append(PyTuple::new(py, [k.into_pyobject(py)?.into_any(), self.m.get_py(py, *k)?.unwrap()])?)?;
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
    /// Sets bit `slot` on every hash; how many did not have it.
    fn store(&mut self, hashes: &Bound<'_, PyAny>, slot: i64) -> PyResult<usize> {
        let s = slot_of(slot)?;
        let mut new = 0;
        let m = &mut self.m;
        for_each_hash(hashes, |h| new += m.set_bit(h, s) as usize)?;
        Ok(new)
    }

    /// Clears bit `slot` on every hash that has it here (an entry goes when its mask becomes 0);
    /// how many had it. For each of those hashes, if no map of `others` has the bit, clears it in
    /// `union` too (the "any tier" map: retract only when the last tier drops it).
    #[pyo3(signature = (hashes, slot, others=None, union=None))]
    fn remove(slf: &Bound<'_, Self>, hashes: &Bound<'_, PyAny>, slot: i64, others: Option<&Bound<'_, PyAny>>,
              union: Option<Bound<'_, MaskMap>>) -> PyResult<usize> {
        let s = slot_of(slot)?;
        let union = union.filter(|u| !u.is(slf));  // clearing self again changes nothing
        let others: Vec<Bound<'_, MaskMap>> = match (&union, others) {
            (Some(_), Some(o)) => o.extract()?,
            _ => Vec::new(),
        };
        let mut gone = 0;
        let mut dropped = Vec::new();
        {
            let mut me = slf.try_borrow_mut()?;
            let keep = union.is_some();
            for_each_hash(hashes, |h| {
                if me.m.clear_bit(h, s) {
                    gone += 1;
                    if keep {
                        dropped.push(h);
                    }
                }
            })?;
        }
        if let Some(u) = union {
            if !others.is_empty() {
                let os = others.iter().map(|o| o.try_borrow()).collect::<Result<Vec<_>, _>>()?;
                dropped.retain(|&h| !os.iter().any(|o| o.m.has_bit(h, s)));
            }
            let mut um = u.try_borrow_mut()?;
            for h in dropped {
                um.m.clear_bit(h, s);
            }
        }
        Ok(gone)
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    fn clear_slot(&mut self, slot: i64) -> PyResult<usize> {
        Ok(self.m.clear_slot(slot_of(slot)?))
    }

    /// The mask of every hash (0 for an absent one).
    fn masks<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let hs = hashes_vec(hashes)?;
        if self.m.hi.is_empty() {
            return PyList::new(py, hs.iter().map(|h| self.m.lo.get(h).copied().unwrap_or(0)));
        }
        let out = PyList::empty(py);
        for h in hs {
            match self.m.get_py(py, h)? {
                Some(m) => out.append(m)?,
                None => out.append(0u64)?,
            }
        }
        Ok(out)
    }

    /// The AND-walk (kvidx/core/walk.py `_walk`): slot -> how many leading hashes it holds, for
    /// every slot holding hashes[0].
    fn walk<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let owned;
        let list = match hashes.cast::<PyList>() {
            Ok(l) => l.clone(),
            Err(_) => {
                owned = PyList::new(py, hashes_vec(hashes)?)?;
                owned
            }
        };
        let n = list.len();
        if n == 0 {
            return Ok(out);
        }
        let at = |i: usize| -> PyResult<u64> { u64_of(&list.get_item(i)?) };
        if self.m.hi.is_empty() {
            let mut alive = self.m.lo.get(&at(0)?).copied().unwrap_or(0);
            let mut i = 1;
            while alive != 0 && i < n {
                let m = self.m.lo.get(&at(i)?).copied().unwrap_or(0) & alive;
                if m != alive {
                    let mut lost = alive & !m;
                    while lost != 0 {
                        out.set_item(lost.trailing_zeros(), i)?;
                        lost &= lost - 1;
                    }
                    alive = m;
                }
                i += 1;
            }
            while alive != 0 {
                out.set_item(alive.trailing_zeros(), n)?;
                alive &= alive - 1;
            }
            return Ok(out);
        }
        // wide masks: the same walk over words (only the words still alive are looked up)
        let first = at(0)?;
        let Some(mut alive) = self.m.words(first) else { return Ok(out) };
        let mut i = 1;
        let mut any = true;
        while any && i < n {
            let h = at(i)?;
            any = false;
            for (w, a) in alive.iter_mut().enumerate() {
                if *a == 0 {
                    continue;
                }
                let m = self.m.word(h, w) & *a;
                let mut lost = *a & !m;
                while lost != 0 {
                    out.set_item(64 * w + lost.trailing_zeros() as usize, i)?;
                    lost &= lost - 1;
                }
                *a = m;
                any |= m != 0;
            }
            i += 1;
        }
        for (w, a) in alive.iter().enumerate() {
            let mut a = *a;
            while a != 0 {
                out.set_item(64 * w + a.trailing_zeros() as usize, n)?;
                a &= a - 1;
            }
        }
        Ok(out)
    }

    /// ORs every entry of self into `other` (the union of tiers).
    fn or_into(slf: &Bound<'_, Self>, other: &Bound<'_, MaskMap>) -> PyResult<()> {
        if other.is(slf) {
            return Ok(());
        }
        let me = slf.try_borrow()?;
        let mut o = other.try_borrow_mut()?;
        for (&k, &lo) in &me.m.lo {
            *o.m.lo.entry(k).or_insert(0) |= lo;
        }
        if o.m.hi.len() < me.m.hi.len() {
            o.m.hi.resize_with(me.m.hi.len(), HashMap::new);
        }
        for (t, ot) in me.m.hi.iter().zip(o.m.hi.iter_mut()) {
            for (&k, &x) in t {
                *ot.entry(k).or_insert(0) |= x;
            }
        }
        Ok(())
    }

    // ---- snapshot -----------------------------------------------------------------------------
    /// (keys, masks): the keys as little-endian u64s and the masks as `words` little-endian u64
    /// words each, in the same order (snapshot.py `_pack_masks`); ValueError if a mask needs more.
    fn export<'py>(&self, py: Python<'py>, words: i64) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        if words < 1 {
            return Err(PyValueError::new_err(format!("words must be >= 1, not {words}")));
        }
        let words = words as usize;
        let need = self.m.width();
        if need > words {
            return Err(PyValueError::new_err(format!("a mask needs {need} words, more than {words}")));
        }
        let n = self.m.lo.len();
        let mut keys = Vec::with_capacity(n * 8);
        let mut masks = Vec::with_capacity(n * 8 * words);
        for (&k, &lo) in &self.m.lo {
            keys.extend_from_slice(&k.to_le_bytes());
            masks.extend_from_slice(&lo.to_le_bytes());
            for w in 1..words {
                masks.extend_from_slice(&self.m.word(k, w).to_le_bytes());
            }
        }
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &masks)))
    }

    /// ORs in the entries of `export`'s layout (a zero mask adds nothing).
    fn load(&mut self, keys: &Bound<'_, PyAny>, masks: &Bound<'_, PyAny>, words: i64) -> PyResult<()> {
        if words < 1 {
            return Err(PyValueError::new_err(format!("words must be >= 1, not {words}")));
        }
        let words = words as usize;
        let m = &mut self.m;
        with_bytes(keys, |kb| {
            with_bytes(masks, |mb| {
                if kb.len() % 8 != 0 || mb.len() != kb.len() * words {
                    return Err(PyValueError::new_err(format!(
                        "{} key bytes and {} mask bytes are not n keys of 8 bytes and n masks of {} bytes",
                        kb.len(), mb.len(), 8 * words)));
                }
                let n = kb.len() / 8;
                if m.lo.is_empty() {
                    m.lo.reserve(n);  // a fresh map (a restore): exactly what it will hold
                }
                let mut mask = vec![0u64; words];
                for i in 0..n {
                    let k = read_u64(kb, i);
                    if words == 1 {
                        let lo = read_u64(mb, i);
                        if lo != 0 {
                            *m.lo.entry(k).or_insert(0) |= lo;
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

    /// An estimate of the heap bytes held (table capacities, not just the live entries).
    fn memory_bytes(&self) -> usize {
        self.m.memory_bytes()
    }
}

/// Canonical hashes of the full blocks of `packed` (little-endian uint32 tokens), chained from
/// `parent`: kvidx.core.hashing.chain without extra keys.
#[pyfunction]
fn chain<'py>(py: Python<'py>, packed: &Bound<'py, PyAny>, block_size: i64, parent: u64
) -> PyResult<Bound<'py, PyList>> {
    if block_size < 1 {
        return Err(PyValueError::new_err(format!("block_size must be >= 1, not {block_size}")));
    }
    let step = block_size as usize * 4;
    let out = with_bytes(packed, |b| {
        let run = || {
            let mut h = parent;
            b.chunks_exact(step).map(|c| {
                h = xxh3_64_with_seed(c, h);
                h
            }).collect::<Vec<u64>>()
        };
        Ok(if b.len() >= 1 << 16 { py.detach(run) } else { run() })
    })?;
    PyList::new(py, out)
}

#[pymodule]
fn kvidx_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MaskMap>()?;
    m.add_function(wrap_pyfunction!(chain, m)?)?;
    Ok(())
}
