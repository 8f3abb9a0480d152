//! kvidx_native: kvidx's hot data structure, the mask map (canonical block hash -> slot bitmask),
//! and canonical block hashing, for kvidx/core/maskmap.py (whose `PyMaskMap` is the pure-Python
//! reference of the same API; tests/unit/core/test_maskmap.py checks that they agree).
//!
//! Layout (memory is the budget): masks.rs. A fleet of up to 64 replicas has one hash table
//! (table.rs: u64 -> u64, 16-byte slots, open addressing) whose value is the mask; a wider one keeps
//! the holder set of a block few replicas hold inline in that value (one slot, one probe, at any
//! fleet size) and the rest as one table per 64-bit word of the mask.
//!
//! The batched operations (store, remove, masks, walk) read the hashes of a list or tuple in place
//! and keep the memory busy ahead of the work (`Hashes::run`): the int objects of the hashes
//! 2 * AHEAD ahead and the buckets of those AHEAD ahead are loaded while a hash is worked on, so the
//! cache misses of an event (~20 hashes, buckets all over a table of megabytes) overlap instead of
//! following one another.

mod conductor;
mod credits;
mod answer;
mod fold;
mod front;
mod layout;
mod masks;
mod order;
mod recency;
mod table;
mod tokens;
mod wire;

use num_bigint::BigUint;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyMemoryView, PySlice, PyTuple};
use masks::Masks;
use table::{mix, unmix};
use twox_hash::XxHash3_64;
use std::sync::Arc;
use parking_lot::RwLock;

// Every key below is a *mixed* hash (table::mix of the block hash): mixed once where it comes from
// Python, unmixed where it goes back.

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

/// `h`'s mask as a Python int, None if absent.
#[inline]
fn get_py<'py>(m: &Masks, py: Python<'py>, h: u64) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(v) = m.value(h) else { return Ok(None) };
    if m.narrow().is_some() {
        return Ok(Some(v.into_pyobject(py)?.into_any()));
    }
    Ok(Some(mask_to_py(py, &m.words_of(h, v))?))
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

/// Every hash of a list, tuple or other iterable of ints, mixed (an error at the first that is not a u64).
/// The int objects are loaded ahead of their conversion (Hashes::run): a batch decoded long before
/// its fold, or pre-built, has them cold.
pub(crate) fn mixed_of(ob: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    match mixed_prefix(ob)? {
        (v, None) => Ok(v),
        (_, Some(e)) => Err(e),
    }
}

/// The hashes up to the first that is not a u64 (all of them if none), mixed, and that one's error:
/// a batched call does its work on those before it and then raises, as a plain loop would.
pub(crate) fn mixed_prefix(ob: &Bound<'_, PyAny>) -> PyResult<(Vec<u64>, Option<PyErr>)> {
    let hs = Hashes::of(ob)?;
    if let Hashes::Vec(v, err) = hs {
        return Ok((v, err.into_inner()));
    }
    let mut out = Vec::with_capacity(hs.len());
    let err = hs.run(0, &mut out, |_, _| {}, |out, _, h| {
        out.push(h);
        Ok(true)
    }).err();
    Ok((out, err))
}

/// Runs `f(state, h)` on each of `ms` in order, calling `pf(state, h)` on each AHEAD before (its
/// buckets start loading: the cache misses of a window overlap).
#[inline(always)]
pub(crate) fn prefetched<S>(ms: &[u64], st: &mut S, pf: impl Fn(&S, u64), mut f: impl FnMut(&mut S, u64)) {
    for &h in ms.iter().take(AHEAD) {
        pf(st, h);
    }
    for (i, &h) in ms.iter().enumerate() {
        if let Some(&a) = ms.get(i + AHEAD) {
            pf(st, a);
        }
        f(st, h);
    }
}

/// A fast hasher for maps keyed by mixed hashes (already spread: one multiply is enough).
#[derive(Default, Clone, Copy)]
pub(crate) struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    #[inline(always)]
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    #[inline(always)]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
}

pub(crate) type FxMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<Fx>>;

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
    // depth of slot i (0: absent; a present slot has depth >= 1) where the slots are dense; else
    // empty, and `sorted` holds (slot, depth) by slot: a walk's cost follows the replicas it finds,
    // not the fleet's highest slot
    by_slot: Vec<u32>,
    sorted: Vec<(u32, u32)>,
}

impl Depths {
    fn new(pairs: &[(usize, usize)]) -> Self {
        let order: Vec<(u32, u32)> = pairs.iter().map(|&(s, k)| (s as u32, k as u32)).collect();
        let top = pairs.iter().map(|p| p.0 + 1).max().unwrap_or(0);
        if top <= 64 || top <= 8 * pairs.len() {
            let mut by_slot = vec![0u32; top];
            for &(s, k) in pairs {
                by_slot[s] = k as u32;
            }
            return Depths { order, by_slot, sorted: Vec::new() };
        }
        let mut sorted = order.clone();
        sorted.sort_unstable();
        Depths { order, by_slot: Vec::new(), sorted }
    }

    #[inline]
    pub fn depth(&self, slot: i64) -> u32 {
        if slot < 0 || slot > u32::MAX as i64 {
            return 0;
        }
        if self.sorted.is_empty() {
            return self.by_slot.get(slot as usize).copied().unwrap_or(0);
        }
        match self.sorted.binary_search_by_key(&(slot as u32), |p| p.0) {
            Ok(i) => self.sorted[i].1,
            Err(_) => 0,
        }
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
#[derive(Default)]
pub struct MaskMap {
    // shared with the lookup front's threads (front.rs), which read it without the GIL
    pub(crate) m: Shared,
}

/// A map's masks behind a readers-writer lock: the fold writes under the GIL, the front's threads
/// read without it. Never taken twice by one thread (a waiting writer would block the second read).
pub type Shared = Arc<RwLock<Masks>>;

impl Clone for MaskMap {
    fn clone(&self) -> Self {
        MaskMap { m: Arc::new(RwLock::new(self.m.read().clone())) }
    }
}

impl MaskMap {
    /// Sets bit `s` on every mixed hash of `ms`; how many did not have it (the compiled fold's store,
    /// on hashes it converted once).
    pub(crate) fn store_ms(&self, ms: &[u64], s: usize) -> usize {
        let mut st = (&mut *self.m.write(), 0usize);
        prefetched(ms, &mut st, |st, h| st.0.prefetch(h, s), |st, h| st.1 += st.0.set_bit(h, s) as usize);
        st.1
    }

    /// `store_ms` into this map and into `union` (another map) in one pass: both maps' buckets load
    /// together, so the union's misses overlap the tier's instead of following them. How many
    /// were new in this map.
    pub(crate) fn store_ms_with(&self, union: &MaskMap, ms: &[u64], s: usize) -> usize {
        if Arc::ptr_eq(&self.m, &union.m) {
            return self.store_ms(ms, s);
        }
        let mut st = (&mut *self.m.write(), &mut *union.m.write(), 0usize);
        prefetched(ms, &mut st, |st, h| {
            st.0.prefetch(h, s);
            st.1.prefetch(h, s);
        }, |st, h| {
            st.2 += st.0.set_bit(h, s) as usize;
            st.1.set_bit(h, s);
        });
        st.2
    }

    /// Clears bit `s` on every mixed hash of `ms` that has it; how many had it. Those that no map of
    /// `others` holds at `s` are cleared in `union` too (`remove` with hashes converted once). One
    /// pass: every map's bucket of a hash loads AHEAD hashes before its turn, so the misses of the
    /// tier, the other tiers and the union overlap instead of following one another.
    pub(crate) fn remove_ms(&self, ms: &[u64], s: usize, others: &[PyRef<'_, MaskMap>], union: Option<&MaskMap>)
                            -> usize {
        let same = |a: &MaskMap, b: &MaskMap| Arc::ptr_eq(&a.m, &b.m);  // one lock
        // the union as this map: cleared already; the union among the others: it holds every bit it
        // had, so nothing is retracted from it
        let union = union.filter(|u| !same(u, self) && !others.iter().any(|o| same(o, u)));
        let mut distinct: Vec<&MaskMap> = Vec::with_capacity(others.len());
        if union.is_some() {
            for o in others {  // this map is not another tier (its bit is going), nor is a map twice
                if !same(o, self) && !distinct.iter().any(|d| same(d, o)) {
                    distinct.push(o);
                }
            }
        }
        let gs: Vec<_> = distinct.iter().map(|o| o.m.read()).collect();
        let mut me = self.m.write();
        let mut un = union.map(|u| u.m.write());
        let mut st = (&mut *me, un.as_deref_mut(), 0usize);
        prefetched(ms, &mut st, |st, h| {
            st.0.prefetch(h, s);
            if let Some(u) = &st.1 {
                u.prefetch(h, s);
                gs.iter().for_each(|o| o.prefetch(h, s));
            }
        }, |st, h| {
            if st.0.clear_bit(h, s) {
                st.2 += 1;
                if let Some(u) = st.1.as_deref_mut() {
                    if !gs.iter().any(|o| o.has_bit(h, s)) {
                        u.clear_bit(h, s);
                    }
                }
            }
        });
        st.2
    }

    /// Appends stored key `k` (value `v`) in `export`'s layout of `words` words a mask; an error
    /// naming the words needed if its mask needs more.
    #[inline]
    fn put(m: &Masks, k: u64, v: u64, words: usize, keys: &mut Vec<u8>, masks: &mut Vec<u8>) -> PyResult<()> {
        keys.extend_from_slice(&unmix(k).to_le_bytes());
        if m.narrow().is_some() {
            masks.extend_from_slice(&v.to_le_bytes());
            masks.resize(masks.len() + 8 * (words - 1), 0);
            return Ok(());
        }
        Self::put_mask(m, &m.words_of(k, v), words, masks)
    }

    /// Appends a mask's words, padded to `words`; the error of `export` if it needs more.
    fn put_mask(m: &Masks, mw: &[u64], words: usize, masks: &mut Vec<u8>) -> PyResult<()> {
        if mw.len() > words {
            let need = m.entries().map(|(k, v)| m.words_of(k, v).len()).max().unwrap_or(1);
            return Err(PyValueError::new_err(format!("a mask needs {need} words, more than {words}")));
        }
        for w in 0..words {
            masks.extend_from_slice(&mw.get(w).copied().unwrap_or(0).to_le_bytes());
        }
        Ok(())
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
            self.m.write().insert(h, &m);
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
            if let Some(m) = get_py(&self.m.read(), py, k)? {
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
            if let Some(m) = get_py(&self.m.read(), py, k)? {
                return Ok(m);
            }
        }
        Err(PyKeyError::new_err(h.clone().unbind()))
    }

    fn __setitem__(&mut self, h: &Bound<'_, PyAny>, mask: &Bound<'_, PyAny>) -> PyResult<()> {
        let h = mix(u64_of(h)?);
        let m = mask_from_py(mask)?;
        self.m.write().insert(h, &m);
        Ok(())
    }

    fn __delitem__(&mut self, h: &Bound<'_, PyAny>) -> PyResult<()> {
        match key_of(h).and_then(|k| self.m.write().remove(k)) {
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
        match key_of(h).and_then(|k| self.m.write().remove(k)) {
            Some(m) => mask_to_py(py, &m),
            None if default.len() == 1 => default.get_item(0),
            None => Err(PyKeyError::new_err(h.clone().unbind())),
        }
    }

    fn __len__(&self) -> usize {
        self.m.read().len()
    }

    fn __contains__(&self, h: &Bound<'_, PyAny>) -> bool {
        key_of(h).is_some_and(|k| self.m.read().contains(k))
    }

    /// Equal to a mask map or a mapping with the same hashes and masks (as a dict is).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = other.py();
        if let Ok(o) = other.cast::<MaskMap>() {
            let o = o.try_borrow()?;
            if Arc::ptr_eq(&self.m, &o.m) {
                return Ok(true);
            }
        }
        if !other.hasattr("items")? || other.len()? != self.m.read().len() {
            return Ok(false);
        }
        for (h, mask) in self.items(py)?.iter().map(|t| t.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>())
            .collect::<PyResult<Vec<_>>>()? {
            match other.get_item(&h) {
                Ok(v) if v.eq(&mask)? => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.keys(py)?.into_any().try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("MaskMap(<{} entries>)", self.m.read().len())
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.m.read().entries().map(|(k, _)| unmix(k)))
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = self.m.read();
        if m.narrow().is_some() {
            return PyList::new(py, m.entries().map(|(_, v)| v));
        }
        let out = PyList::empty(py);
        for (k, _) in m.entries() {
            out.append(get_py(&m, py, k)?)?;
        }
        Ok(out)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = self.m.read();
        let out = PyList::empty(py);
        for (k, _) in m.entries() {
            out.append(PyTuple::new(py, [unmix(k).into_pyobject(py)?.into_any(),
                                         get_py(&m, py, k)?.unwrap()])?)?;
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
        *self.m.write() = Masks::default();
    }

    // ---- batched ------------------------------------------------------------------------------
    // Each loads the buckets of the hashes AHEAD of the one it works on (Hashes::run).

    /// Sets bit `slot` on every hash; how many did not have it.
    fn store(&mut self, hashes: &Bound<'_, PyAny>, slot: i64) -> PyResult<usize> {
        let s = slot_of(slot)?;
        let (ms, err) = mixed_prefix(hashes)?;
        let new = self.store_ms(&ms, s);
        err.map_or(Ok(new), Err)
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
        let others = others.iter().map(|o| o.try_borrow()).collect::<Result<Vec<_>, _>>()?;
        let union = union.as_ref().map(|u| u.try_borrow()).transpose()?;
        let (ms, err) = mixed_prefix(hashes)?;
        let gone = slf.try_borrow()?.remove_ms(&ms, s, &others, union.as_deref());
        err.map_or(Ok(gone), Err)
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    fn clear_slot(&mut self, slot: i64) -> PyResult<usize> {
        Ok(self.m.write().clear_slot(slot_of(slot)?))
    }

    /// The hashes whose mask lacks bit `slot` (absent ones included), in order.
    fn lacking<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>, slot: i64) -> PyResult<Bound<'py, PyList>> {
        let s = slot_of(slot)?;
        let hs = Hashes::of(hashes)?;
        let guard = self.m.read();
        let m = &*guard;
        let mut at = Vec::new();  // the run's keys are the map's own: the caller's hashes by index
        hs.run(0, &mut at, |_, h| m.prefetch(h, s), |o, i, h| {
            if !m.has_bit(h, s) {
                o.push(i);
            }
            Ok(true)
        })?;
        let out = PyList::empty(py);
        for i in at {
            out.append(hashes.get_item(i)?)?;
        }
        Ok(out)
    }

    /// The mask of every hash (0 for an absent one).
    fn masks<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let hs = Hashes::of(hashes)?;
        let guard = self.m.read();
        let m = &*guard;
        if let Some(t) = m.narrow() {
            let mut out = Vec::with_capacity(hs.len());
            hs.run(0, &mut out, |_, h| t.prefetch(h), |o, _, h| {
                o.push(t.get(h).unwrap_or(0));
                Ok(true)
            })?;
            return PyList::new(py, out);
        }
        let out = PyList::empty(py);
        hs.run(0, &mut (), |_, h| m.prefetch(h, 0), |_, _, h| {
            match get_py(m, py, h)? {
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
        let guard = self.m.read();
        let m = &*guard;
        // the walk first, then the dict: (slot, depth) in the order the reference inserts them
        let mut out: Vec<(usize, usize)> = Vec::new();
        if let Some(t) = m.narrow() {
            let mut alive = t.get(first).unwrap_or(0);
            out.reserve_exact(alive.count_ones() as usize);
            if alive != 0 {
                hs.run(1, &mut alive, |_, h| t.prefetch(h), |alive, i, h| {
                    let x = t.get(h).unwrap_or(0) & *alive;
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
        // a wide map: the same walk over words (only the words still alive are looked up)
        let Some(mut alive) = m.words(first) else { return Ok(Depths::new(&out)) };
        out.reserve_exact(alive.iter().map(|a| a.count_ones() as usize).sum());
        let mut before = alive.clone();
        hs.run(1, &mut alive, |alive, h| m.prefetch_alive(h, alive), |alive, i, h| {
            before.copy_from_slice(alive);
            let any = m.and_into(h, alive);
            for (w, (b, a)) in before.iter().zip(alive.iter()).enumerate() {
                let mut lost = b & !a;
                while lost != 0 {
                    out.push((64 * w + lost.trailing_zeros() as usize, i));
                    lost &= lost - 1;
                }
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
        let me = me.m.read();
        let o = other.try_borrow_mut()?;
        let mut o = o.m.write();
        if me.narrow().is_some() && o.narrow().is_some() {
            o.reserve(me.len());
            for (k, v) in me.entries() {
                o.or_in(k, &[v]);
            }
            return Ok(());
        }
        for (k, v) in me.entries() {
            o.or_in(k, &me.words_of(k, v));
        }
        Ok(())
    }

    // ---- snapshot -----------------------------------------------------------------------------
    /// (keys, masks): the keys as little-endian u64s and the masks as `words` little-endian u64
    /// words each, in the same order (snapshot.py `_pack_masks`); ValueError if a mask needs more.
    fn export<'py>(&self, py: Python<'py>, words: i64) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let words = words_arg(words)?;
        let m = self.m.read();
        let n = m.len();
        let mut keys = Vec::with_capacity(n * 8);
        let mut masks = Vec::with_capacity(n * 8 * words);
        for (k, v) in m.entries() {
            Self::put(&m, k, v, words, &mut keys, &mut masks)?;
        }
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &masks)))
    }

    /// `export` of the keys whose segment (the top `bits` bits of their stored form, table::mix) is
    /// in [first, last), in stored order: the pieces of a snapshot's base (snapshot.py).
    fn export_segments<'py>(&self, py: Python<'py>, first: u64, last: u64, bits: u32, words: i64)
                            -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let words = words_arg(words)?;
        if !(1..=32).contains(&bits) || first >= last || last > 1u64 << bits {
            return Err(PyValueError::new_err(format!(
                "segments [{first}, {last}) of 2**{bits}: need 1 <= bits <= 32 and first < last <= 2**bits")));
        }
        let shift = 64 - bits;
        let hi = if last == 1u64 << bits { None } else { Some(last << shift) };
        let (mut keys, mut masks) = (Vec::new(), Vec::new());
        let m = self.m.read();
        for (k, v) in m.range(first << shift, hi) {
            Self::put(&m, k, v, words, &mut keys, &mut masks)?;
        }
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &masks)))
    }

    /// The masks of `keys` (little-endian u64s) in `export`'s layout, all-zero for an absent key.
    fn export_keys<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>, words: i64) -> PyResult<Bound<'py, PyBytes>> {
        let words = words_arg(words)?;
        with_bytes(keys, |kb| {
            if kb.len() % 8 != 0 {
                return Err(PyValueError::new_err(format!("{} key bytes are not n keys of 8 bytes", kb.len())));
            }
            let n = kb.len() / 8;
            let mut masks = Vec::with_capacity(n * 8 * words);
            let m = self.m.read();
            for i in 0..n {
                let k = mix(read_u64(kb, i));
                match m.value(k) {
                    Some(v) => Self::put_mask(&m, &m.words_of(k, v), words, &mut masks)?,
                    None => masks.resize(masks.len() + 8 * words, 0),
                }
            }
            Ok(PyBytes::new(py, &masks))
        })
    }

    /// Sets the masks of entries in `export`'s layout, replacing what was there (an all-zero mask
    /// deletes the key): a snapshot delta's changes.
    fn assign(&mut self, keys: &Bound<'_, PyAny>, masks: &Bound<'_, PyAny>, words: i64) -> PyResult<()> {
        let words = words_arg(words)?;
        let mut guard = self.m.write();
        let m = &mut *guard;
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
        let mut guard = self.m.write();
        let m = &mut *guard;
        with_bytes(keys, |kb| {
            with_bytes(masks, |mb| {
                check_layout(kb, mb, words)?;
                let n = kb.len() / 8;
                if m.is_empty() {
                    // a fresh map (a restore): what it will hold and a fifth more, so the live shard's
                    // next stores do not start with a rebuild of the whole table (at 3/5 full, the
                    // first insert would grow it: a ~6 ms stall at 1M entries, bench_fold)
                    m.reserve(n + n / 5);
                }
                let mut mask = vec![0u64; words];
                for i in 0..n {
                    let k = mix(read_u64(kb, i));
                    if words == 1 {
                        m.or_in(k, &[read_u64(mb, i)]);
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
        self.m.write().reserve(n);
    }

    /// An estimate of the heap bytes held (table capacities, not just the live entries).
    fn memory_bytes(&self) -> usize {
        self.m.read().memory_bytes()
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
        let run = || chain_blocks(b, step, parent);
        Ok(if b.len() >= 1 << 16 { py.detach(run) } else { run() })
    })
}

/// The hashes of `b`'s whole `step`-byte blocks, each seeded by the one before (`parent` first).
pub fn chain_blocks(b: &[u8], step: usize, parent: u64) -> Vec<u64> {
    let mut h = parent;
    b.chunks_exact(step).map(|c| {
        h = XxHash3_64::oneshot_with_seed(h, c);
        h
    }).collect()
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
    m.add_class::<fold::ShardFold>()?;
    m.add_class::<answer::ReplicaFields>()?;
    m.add_class::<front::LookupFront>()?;
    m.add_function(wrap_pyfunction!(chain, m)?)?;
    m.add_function(wrap_pyfunction!(chain_array, m)?)?;
    m.add_function(wrap_pyfunction!(wire::unpack_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(answer::lookup_json, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::split_token_ids, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::token_reader, m)?)?;
    m.add_class::<credits::Credits>()?;
    m.add_class::<recency::Recency>()?;
    Ok(())
}
