//! kvidx_native: kvidx's hot data structure, the mask map (canonical block hash -> slot bitmask),
//! and canonical block hashing, for kvidx/core/maskmap.py (whose `PyMaskMap` is the pure-Python
//! reference of the same API; tests/unit/core/test_maskmap.py checks that they agree).
//!
//! Layout (memory is the budget): word 0 of every mask (slots 0..63) is stored inline, as the value
//! of one `HashMap<u64, u64>` (16 bytes a bucket plus a control byte). Words 1.. (slots >= 64) live
//! in a side map used only by the hashes that have such bits, so a fleet of more than 64 replicas
//! works at no cost to the small ones. Invariant: a hash is in the map iff it is a key of `lo` (its
//! word 0 may be 0 when only high bits are set); a `hi` vector is never empty and its last word is
//! never 0; no entry has an all-zero mask.
//!
//! The keys are canonical block hashes (xxh3-64 output: already uniformly random), so the tables use
//! hashbrown's default hasher (foldhash, seeded per process: one folded multiply per key), not SipHash.

use hashbrown::HashMap;
use num_bigint::BigUint;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyTuple};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A mask as words: word 0 inline, then the trimmed high words (empty for a mask below 2**64).
struct Mask {
    lo: u64,
    hi: Vec<u64>,
}

#[derive(Clone, Default)]
struct Masks {
    lo: HashMap<u64, u64>,
    hi: HashMap<u64, Vec<u64>>,
}

#[inline]
fn trim(v: &mut Vec<u64>) {
    while v.last() == Some(&0) {
        v.pop();
    }
}

impl Masks {
    #[inline]
    fn hi_of(&self, h: u64) -> Option<&Vec<u64>> {
        if self.hi.is_empty() {
            None
        } else {
            self.hi.get(&h)
        }
    }

    #[inline]
    fn has_bit(&self, h: u64, slot: usize) -> bool {
        if slot < 64 {
            self.lo.get(&h).is_some_and(|v| v >> slot & 1 != 0)
        } else {
            let w = slot / 64 - 1;
            self.hi_of(h).is_some_and(|v| v.get(w).is_some_and(|x| x >> (slot % 64) & 1 != 0))
        }
    }

    /// Sets bit `slot` of `h`'s mask; true if it was not set.
    #[inline]
    fn set_bit(&mut self, h: u64, slot: usize) -> bool {
        if slot < 64 {
            let b = 1u64 << slot;
            let v = self.lo.entry(h).or_insert(0);
            let new = *v & b == 0;
            *v |= b;
            new
        } else {
            self.lo.entry(h).or_insert(0);
            let w = slot / 64 - 1;
            let b = 1u64 << (slot % 64);
            let v = self.hi.entry(h).or_default();
            if v.len() <= w {
                v.resize(w + 1, 0);
            }
            let new = v[w] & b == 0;
            v[w] |= b;
            new
        }
    }

    /// Clears bit `slot` of `h`'s mask, deleting the entry when nothing is left; true if it was set.
    #[inline]
    fn clear_bit(&mut self, h: u64, slot: usize) -> bool {
        if slot < 64 {
            let b = 1u64 << slot;
            match self.lo.get_mut(&h) {
                Some(v) if *v & b != 0 => {
                    *v &= !b;
                    if *v == 0 && (self.hi.is_empty() || !self.hi.contains_key(&h)) {
                        self.lo.remove(&h);
                    }
                    true
                }
                _ => false,
            }
        } else {
            let w = slot / 64 - 1;
            let b = 1u64 << (slot % 64);
            let Some(v) = self.hi.get_mut(&h) else { return false };
            if v.get(w).is_none_or(|x| x & b == 0) {
                return false;
            }
            v[w] &= !b;
            trim(v);
            if v.is_empty() {
                self.hi.remove(&h);
                if self.lo.get(&h) == Some(&0) {
                    self.lo.remove(&h);
                }
            }
            true
        }
    }

    fn insert(&mut self, h: u64, m: Mask) {
        self.lo.insert(h, m.lo);
        if m.hi.is_empty() {
            if !self.hi.is_empty() {
                self.hi.remove(&h);
            }
        } else {
            self.hi.insert(h, m.hi);
        }
    }

    /// ORs `lo` and `hi` (trimmed or with trailing zeros) into `h`'s mask; nothing for a zero mask.
    fn or_in(&mut self, h: u64, lo: u64, hi: &[u64]) {
        let n = hi.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1);
        if lo == 0 && n == 0 {
            return;
        }
        *self.lo.entry(h).or_insert(0) |= lo;
        if n > 0 {
            let v = self.hi.entry(h).or_default();
            if v.len() < n {
                v.resize(n, 0);
            }
            for (a, b) in v.iter_mut().zip(&hi[..n]) {
                *a |= b;
            }
        }
    }

    fn remove(&mut self, h: u64) -> Option<Mask> {
        let lo = self.lo.remove(&h)?;
        let hi = if self.hi.is_empty() { None } else { self.hi.remove(&h) };
        Some(Mask { lo, hi: hi.unwrap_or_default() })
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    fn clear_slot(&mut self, slot: usize) -> usize {
        let mut n = 0;
        if slot < 64 {
            let b = 1u64 << slot;
            let hi = &self.hi;
            self.lo.retain(|k, v| {
                if *v & b == 0 {
                    return true;
                }
                n += 1;
                *v &= !b;
                *v != 0 || (!hi.is_empty() && hi.contains_key(k))
            });
        } else {
            let w = slot / 64 - 1;
            let b = 1u64 << (slot % 64);
            let mut emptied = Vec::new();
            self.hi.retain(|k, v| {
                if v.get(w).is_none_or(|x| x & b == 0) {
                    return true;
                }
                n += 1;
                v[w] &= !b;
                trim(v);
                if v.is_empty() {
                    emptied.push(*k);
                    return false;
                }
                true
            });
            for k in emptied {
                if self.lo.get(&k) == Some(&0) {
                    self.lo.remove(&k);
                }
            }
        }
        n
    }

    fn width(&self) -> usize {
        1 + self.hi.values().map(Vec::len).max().unwrap_or(0)
    }

    fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.lo.allocation_size()
            + self.hi.allocation_size()
            + self.hi.values().map(|v| v.capacity() * 8).sum::<usize>()
    }
}

// ---- conversions ------------------------------------------------------------------------------

fn slot_of(slot: i64) -> PyResult<usize> {
    usize::try_from(slot).map_err(|_| PyValueError::new_err(format!("slot must be >= 0, not {slot}")))
}

/// A Python int as a non-zero mask: ValueError for 0 or a negative int, TypeError for a non-int.
fn mask_from_py(ob: &Bound<'_, PyAny>) -> PyResult<Mask> {
    if let Ok(v) = ob.extract::<u64>() {
        if v == 0 {
            return Err(PyValueError::new_err("a mask is never 0 (delete the entry instead)"));
        }
        return Ok(Mask { lo: v, hi: Vec::new() });
    }
    if !ob.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "a mask is an int, not {}",
            ob.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        )));
    }
    let big: BigUint = ob
        .extract()
        .map_err(|_| PyValueError::new_err("a mask is a positive int (bit i: slot i)"))?;
    let mut words = big.to_u64_digits();
    let lo = words[0];
    words.remove(0);
    Ok(Mask { lo, hi: words })
}

fn mask_to_py<'py>(py: Python<'py>, lo: u64, hi: Option<&Vec<u64>>) -> PyResult<Bound<'py, PyAny>> {
    match hi {
        None => Ok(lo.into_pyobject(py)?.into_any()),
        Some(hi) => {
            let mut digits = Vec::with_capacity(2 + 2 * hi.len());
            for w in std::iter::once(&lo).chain(hi.iter()) {
                digits.push(*w as u32);
                digits.push((*w >> 32) as u32);
            }
            Ok(BigUint::new(digits).into_pyobject(py)?.into_any())
        }
    }
}

fn mask_obj<'py>(py: Python<'py>, m: &Mask) -> PyResult<Bound<'py, PyAny>> {
    mask_to_py(py, m.lo, if m.hi.is_empty() { None } else { Some(&m.hi) })
}

/// A key that can be in the map (a u64), or None for anything else (never present).
#[inline]
fn key_of(ob: &Bound<'_, PyAny>) -> Option<u64> {
    ob.extract::<u64>().ok()
}

/// Calls `f` on each hash of a list, tuple or other iterable of ints.
#[inline]
fn for_each_hash(hashes: &Bound<'_, PyAny>, mut f: impl FnMut(u64)) -> PyResult<()> {
    if let Ok(list) = hashes.cast::<PyList>() {
        for item in list.iter() {
            f(item.extract::<u64>()?);
        }
    } else if let Ok(tup) = hashes.cast::<PyTuple>() {
        for item in tup.iter() {
            f(item.extract::<u64>()?);
        }
    } else {
        for item in hashes.try_iter()? {
            f(item?.extract::<u64>()?);
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
            let (h, mask): (u64, Bound<'_, PyAny>) = item?.extract()?;
            let m = mask_from_py(&mask)?;
            self.m.insert(h, m);
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
            if let Some(&lo) = self.m.lo.get(&k) {
                return mask_to_py(py, lo, self.m.hi_of(k));
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
            if let Some(&lo) = self.m.lo.get(&k) {
                return mask_to_py(py, lo, self.m.hi_of(k));
            }
        }
        Err(PyKeyError::new_err(h.clone().unbind()))
    }

    fn __setitem__(&mut self, h: u64, mask: &Bound<'_, PyAny>) -> PyResult<()> {
        let m = mask_from_py(mask)?;
        self.m.insert(h, m);
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
            Some(m) => mask_obj(py, &m),
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
        for (k, &lo) in &self.m.lo {
            out.append(mask_to_py(py, lo, self.m.hi_of(*k))?)?;
        }
        Ok(out)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (k, &lo) in &self.m.lo {
            let t = PyTuple::new(py, [k.into_pyobject(py)?.into_any(), mask_to_py(py, lo, self.m.hi_of(*k))?])?;
            out.append(t)?;
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
            match self.m.lo.get(&h) {
                Some(&lo) => out.append(mask_to_py(py, lo, self.m.hi_of(h))?)?,
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
        let at = |i: usize| -> PyResult<u64> { list.get_item(i)?.extract::<u64>() };
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
        // wide masks: the same walk over words
        let words_of = |h: u64, into: &mut Vec<u64>| {
            into.iter_mut().for_each(|w| *w = 0);
            if let Some(&lo) = self.m.lo.get(&h) {
                into[0] = lo;
                if let Some(hi) = self.m.hi_of(h) {
                    for (i, w) in hi.iter().enumerate().take(into.len() - 1) {
                        into[i + 1] = *w;
                    }
                }
            }
        };
        let first = at(0)?;
        let nw = 1 + self.m.hi_of(first).map_or(0, Vec::len);
        let mut alive = vec![0u64; nw];
        words_of(first, &mut alive);
        let mut cur = vec![0u64; nw];
        let mut any = alive.iter().any(|&w| w != 0);
        let mut i = 1;
        while any && i < n {
            words_of(at(i)?, &mut cur);
            any = false;
            for (w, (a, c)) in alive.iter_mut().zip(&cur).enumerate() {
                let m = *c & *a;
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
            match me.m.hi_of(k) {
                None => *o.m.lo.entry(k).or_insert(0) |= lo,
                Some(hi) => o.m.or_in(k, lo, hi),
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
            let hi = self.m.hi_of(k).map_or(&[][..], Vec::as_slice);
            for w in 0..words - 1 {
                masks.extend_from_slice(&hi.get(w).copied().unwrap_or(0).to_le_bytes());
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
                let mut hi = vec![0u64; words - 1];
                for i in 0..n {
                    let k = read_u64(kb, i);
                    let lo = read_u64(mb, i * words);
                    if words == 1 {
                        if lo != 0 {
                            *m.lo.entry(k).or_insert(0) |= lo;
                        }
                        continue;
                    }
                    for (w, x) in hi.iter_mut().enumerate() {
                        *x = read_u64(mb, i * words + 1 + w);
                    }
                    m.or_in(k, lo, &hi);
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
