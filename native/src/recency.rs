//! One (replica slot, KV-cache group) of eviction foresight, compiled (`Recency`): its blocks in
//! eviction order (order.rs), those routed but not reported yet, their extra copies, and what the
//! slot showed of its capacity. kvidx/core/foresight.py `PyRecency` is the reference (the same
//! methods; a pooled slot keeps that one: its keys are wider than 64 bits). The compiled fold
//! (fold.rs) calls `stored_ms`, `removed_ms` and `settle_one` with the hashes it already holds
//! mixed: no Python frame per event.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::order::Order;
use crate::table::unmix;
use crate::{mixed_of, FxMap};

#[pyclass(name = "Recency", module = "kvidx_native")]
pub struct Recency {
    #[pyo3(get)]
    order: Py<Order>,
    unconfirmed: FxMap<u64, f64>,  // mixed hash -> the latest expiry of the routes adding it
    copies: FxMap<u64, i64>,  // mixed hash -> extra physical copies
    markers: FxMap<u64, i64>,  // marker (mixed) -> transient blocks
    #[pyo3(get, set)]
    peak: i64,
    #[pyo3(get, set)]
    full: bool,
    #[pyo3(get, set)]
    evicting: bool,
    #[pyo3(get, set)]
    untrusted: i64,
    #[pyo3(get, set)]
    extra: i64,
    #[pyo3(get, set)]
    transient: i64,
}

fn dict_of<'py, V: IntoPyObject<'py> + Copy>(py: Python<'py>, m: &FxMap<u64, V>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in m {
        d.set_item(unmix(*k), *v)?;
    }
    Ok(d)
}

impl Recency {
    fn release_ms(&mut self, ms: &[u64]) {
        if self.markers.is_empty() {
            return;
        }
        for m in ms {
            if let Some(c) = self.markers.remove(m) {
                self.transient -= c;
            }
        }
    }

    fn held_in(&self, order: &Order) -> i64 {
        order.len() as i64 - self.unconfirmed.len() as i64 + self.extra
    }

    /// The engine reported these blocks (PyRecency.stored).
    pub(crate) fn stored_ms(&mut self, py: Python<'_>, ms: &[u64], deepest_first: bool) -> PyResult<()> {
        if !self.unconfirmed.is_empty() {  // routed blocks keep the place the route gave them
            for m in ms {
                self.unconfirmed.remove(m);
            }
        }
        self.release_ms(ms);
        self.order.bind(py).try_borrow_mut()?.append_ms(ms, deepest_first, false);
        Ok(())
    }

    /// These blocks left the slot (PyRecency.removed).
    pub(crate) fn removed_ms(&mut self, py: Python<'_>, ms: &[u64]) -> PyResult<()> {
        let gone = self.order.bind(py).try_borrow_mut()?.discard_ms(ms);
        if self.untrusted != 0 {
            self.untrusted = (self.untrusted - (ms.len() - gone) as i64).max(0);
        }
        if !self.unconfirmed.is_empty() {
            for m in ms {
                self.unconfirmed.remove(m);
            }
        }
        self.release_ms(ms);
        if !self.copies.is_empty() {  // the last copy went: any extra ones left uncounted go with it
            for m in ms {
                self.extra -= self.copies.remove(m).unwrap_or(0);
            }
        }
        self.full = true;
        self.evicting = true;
        Ok(())
    }

    /// At a batch's end (PyRecency.settle).
    pub(crate) fn settle_one(&mut self, py: Python<'_>, pooled: bool) -> PyResult<()> {
        let held = self.held_in(&*self.order.bind(py).try_borrow()?);
        if held > self.peak || (self.evicting && pooled) {
            self.peak = held;
        }
        self.evicting = false;
        Ok(())
    }
}

#[pymethods]
impl Recency {
    #[new]
    #[pyo3(signature = (untrusted=0))]
    fn new(py: Python<'_>, untrusted: i64) -> PyResult<Self> {
        Ok(Recency {
            order: Py::new(py, Order::new())?,
            unconfirmed: FxMap::default(),
            copies: FxMap::default(),
            markers: FxMap::default(),
            peak: 0,
            full: false,
            evicting: false,
            untrusted,
            extra: 0,
            transient: 0,
        })
    }

    /// hash -> the latest expiry of the routes adding it (a copy: for tests and debugging).
    #[getter]
    fn unconfirmed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dict_of(py, &self.unconfirmed)
    }

    #[getter]
    fn copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dict_of(py, &self.copies)
    }

    #[getter]
    fn markers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dict_of(py, &self.markers)
    }

    fn overflow(&self, py: Python<'_>) -> PyResult<i64> {
        if !self.full || self.untrusted > 0 || (self.unconfirmed.is_empty() && self.transient == 0) {
            return Ok(0);
        }
        let n = self.order.bind(py).try_borrow()?.len() as i64;
        Ok((n + self.extra + self.transient - self.peak).max(0))
    }

    fn release(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.release_ms(&mixed_of(keys)?);
        Ok(())
    }

    fn held(&self, py: Python<'_>) -> PyResult<i64> {
        Ok(self.held_in(&*self.order.bind(py).try_borrow()?))
    }

    fn stored(&mut self, py: Python<'_>, hashes: &Bound<'_, PyAny>, deepest_first: bool) -> PyResult<()> {
        self.stored_ms(py, &mixed_of(hashes)?, deepest_first)
    }

    fn removed(&mut self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        self.removed_ms(py, &mixed_of(hashes)?)
    }

    fn copied(&mut self, py: Python<'_>, hashes: &Bound<'_, PyAny>, deepest_first: bool) -> PyResult<()> {
        let mut order = self.order.bind(py).try_borrow_mut()?;
        let run: Vec<u64> = mixed_of(hashes)?.into_iter().filter(|m| order.has(*m)).collect();
        for m in &run {
            *self.copies.entry(*m).or_insert(0) += 1;
        }
        self.extra += run.len() as i64;
        order.touch_ms(&run, deepest_first);
        Ok(())
    }

    fn uncopied(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        for m in mixed_of(hashes)? {
            if let Some(c) = self.copies.get_mut(&m) {
                self.extra -= 1;
                if *c > 1 {
                    *c -= 1;
                } else {
                    self.copies.remove(&m);
                }
            }
        }
        Ok(())
    }

    /// A route (PyRecency.routed): the incoming blocks not already reported here, now unconfirmed.
    #[pyo3(signature = (touched, incoming, expires, deepest_first, transient=0))]
    fn routed<'py>(&mut self, py: Python<'py>, touched: &Bound<'py, PyAny>, incoming: &Bound<'py, PyAny>,
                   expires: f64, deepest_first: bool, transient: i64) -> PyResult<Bound<'py, PyList>> {
        let (touched, incoming) = (mixed_of(touched)?, mixed_of(incoming)?);
        let mut order = self.order.bind(py).try_borrow_mut()?;
        if self.untrusted != 0 {  // held blocks the order had not seen: known now
            let unseen = touched.iter().filter(|m| !order.has(**m)).count() as i64;
            self.untrusted = (self.untrusted - unseen).max(0);
        }
        let new: Vec<u64> = incoming.iter().copied()
            .filter(|m| self.unconfirmed.contains_key(m) || !order.has(*m)).collect();
        let all: Vec<u64> = touched.iter().chain(&incoming).copied().collect();
        order.append_ms(&all, deepest_first, true);
        for m in &new {
            let t = self.unconfirmed.entry(*m).or_insert(0.0);
            *t = t.max(expires);
        }
        if let (Some(first), true) = (new.first(), transient > 0) {
            *self.markers.entry(*first).or_insert(0) += transient;
            self.transient += transient;
        }
        PyList::new(py, new.iter().map(|m| unmix(*m)))
    }

    /// A route's unconfirmed blocks whose expiry passed leave the order.
    fn expire(&mut self, py: Python<'_>, hashes: &Bound<'_, PyAny>, now: f64) -> PyResult<()> {
        let mut gone = Vec::new();
        for m in mixed_of(hashes)? {
            if self.unconfirmed.get(&m).is_some_and(|t| *t <= now) {
                self.unconfirmed.remove(&m);
                gone.push(m);
            }
        }
        self.release_ms(&gone);
        self.order.bind(py).try_borrow_mut()?.discard_ms(&gone);
        Ok(())
    }

    fn settle(&mut self, py: Python<'_>, pooled: bool) -> PyResult<()> {
        self.settle_one(py, pooled)
    }

    /// The held blocks in-flight prefills taking `room` will evict, oldest first.
    fn doomed<'py>(&self, py: Python<'py>, room: i64) -> PyResult<Bound<'py, PyList>> {
        let mut room = room;
        let mut out = Vec::new();
        if room > 0 {
            self.order.bind(py).try_borrow()?.each_oldest(|m| {
                if self.unconfirmed.contains_key(&m) {
                    return true;  // routed blocks are not held yet
                }
                room -= 1 + self.copies.get(&m).copied().unwrap_or(0);
                if room < 0 {
                    return false;
                }
                out.push(unmix(m));
                room != 0
            });
        }
        PyList::new(py, out)
    }
}
