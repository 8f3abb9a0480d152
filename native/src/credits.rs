//! Pending credit's bookkeeping (kvidx/core/pending.py `_Credits`, the pure-Python reference),
//! compiled (`Credits`): a route adds a count per (block, slot) and the slot's bit to the block's
//! mask; an engine's store of the block confirms it there (the count and the bit go); an expired
//! route takes one count. The masks are a mask map (lookups read them as they read the index's);
//! the counts a map of their own. The compiled fold (fold.rs) confirms a store's blocks with
//! `confirm_ms`, on the hashes it already holds mixed. tests/unit/core/test_pending_native.py runs
//! both ways.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::table::unmix;
use crate::{mixed_of, slot_of, FxMap, MaskMap};

#[pyclass(name = "Credits", module = "kvidx_native")]
pub struct Credits {
    /// block hash -> the slots it is pending on
    #[pyo3(get)]
    masks: Py<MaskMap>,
    refs: FxMap<(u64, u32), u32>,  // (mixed hash, slot) -> live routes crediting it
}

impl Credits {
    fn slot32(slot: i64) -> PyResult<u32> {
        u32::try_from(slot_of(slot)?).map_err(|_| pyo3::exceptions::PyValueError::new_err("slot out of range"))
    }

    /// Drops each hash's count on `slot` (one route's with `one`, else all of them); a count gone takes
    /// the slot's bit from the hash's mask.
    fn drop_counts(&mut self, py: Python<'_>, slot: u32, ms: &[u64], one: bool) -> PyResult<()> {
        if self.refs.is_empty() {
            return Ok(());
        }
        let masks = self.masks.bind(py).try_borrow()?;
        let mut guard = None;
        for &m in ms {
            let Some(r) = self.refs.get_mut(&(m, slot)) else { continue };
            if one && *r > 1 {
                *r -= 1;
                continue;
            }
            self.refs.remove(&(m, slot));
            guard.get_or_insert_with(|| masks.m.write()).clear_bit(m, slot as usize);
        }
        Ok(())
    }

    /// The engine stored these blocks (mixed) on `slot`: no longer pending there.
    pub(crate) fn confirm_ms(&mut self, py: Python<'_>, slot: usize, ms: &[u64]) -> PyResult<()> {
        match u32::try_from(slot) {
            Ok(s) => self.drop_counts(py, s, ms, false),
            Err(_) => Ok(()),  // no route credits a slot past u32
        }
    }
}

#[pymethods]
impl Credits {
    #[new]
    fn new(py: Python<'_>) -> PyResult<Self> {
        Ok(Credits { masks: Py::new(py, MaskMap::default())?, refs: FxMap::default() })
    }

    /// (hash, slot) -> live routes crediting it (a copy: for tests and debugging).
    #[getter]
    fn refs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for ((m, s), n) in &self.refs {
            d.set_item(PyTuple::new(py, [unmix(*m), *s as u64])?, *n)?;
        }
        Ok(d)
    }

    /// A route credits these blocks on `slot`: a count each, and the slot's bit.
    fn add(&mut self, py: Python<'_>, slot: i64, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = Self::slot32(slot)?;
        let ms = mixed_of(hashes)?;
        if ms.is_empty() {
            return Ok(());
        }
        let masks = self.masks.bind(py).try_borrow()?;
        let mut guard = masks.m.write();
        for m in ms {
            *self.refs.entry((m, s)).or_insert(0) += 1;
            guard.set_bit(m, s as usize);
        }
        Ok(())
    }

    /// The engine stored these blocks on `slot`: each live count there goes, and its bit.
    fn confirm(&mut self, py: Python<'_>, slot: i64, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = Self::slot32(slot)?;
        self.drop_counts(py, s, &mixed_of(hashes)?, false)
    }

    /// One route crediting each of these blocks on `slot` expired.
    fn release(&mut self, py: Python<'_>, slot: i64, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = Self::slot32(slot)?;
        self.drop_counts(py, s, &mixed_of(hashes)?, true)
    }
}
