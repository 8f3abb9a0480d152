//! A replica's blocks in the order its engine will evict them, oldest first (eviction foresight:
//! kvidx/core/foresight.py, whose `PyOrder` is the pure-Python reference of the same API, a dict;
//! tests/unit/core/test_foresight.py checks that they agree). A doubly linked list over a slab of
//! nodes, indexed by the mask map's hash table (mixed hash -> node): appending, moving and
//! discarding a hash are O(1) with no object per hash; ~40 bytes per block.

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::table::{mix, unmix, Table};
use crate::{mixed_of, prefetched, u64_of};

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    m: u64, // the mixed hash
    prev: u32,
    next: u32,
}

#[pyclass(name = "Order", module = "kvidx_native")]
#[derive(Default)]
pub struct Order {
    index: Table,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Order {
    fn unlink(&mut self, i: u32) {
        let n = self.nodes[i as usize];
        if n.prev != NIL {
            self.nodes[n.prev as usize].next = n.next;
        } else {
            self.head = n.next;
        }
        if n.next != NIL {
            self.nodes[n.next as usize].prev = n.prev;
        } else {
            self.tail = n.prev;
        }
    }

    fn push_back(&mut self, i: u32) {
        let tail = self.tail;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = tail;
            n.next = NIL;
        }
        if tail != NIL {
            self.nodes[tail as usize].next = i;
        } else {
            self.head = i;
        }
        self.tail = i;
    }

    /// Puts `m` at the tail: a new hash unless `only_present`; a present one moved there if `move_`.
    /// True if it was added.
    fn put(&mut self, m: u64, move_: bool, only_present: bool) -> bool {
        if let Some(i) = self.index.get(m) {
            if move_ && i as u32 != self.tail {
                self.unlink(i as u32);
                self.push_back(i as u32);
            }
            return false;
        }
        if only_present {
            return false;
        }
        let node = Node { m, prev: NIL, next: NIL };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.insert(m, i as u64);
        self.push_back(i);
        self.len += 1;
        true
    }

    /// Appends the mixed hashes `ms` not present (in reverse with `reverse`); present ones move to
    /// the tail with `move_`. How many were added.
    pub(crate) fn append_ms(&mut self, ms: &[u64], reverse: bool, move_: bool) -> usize {
        let mut added = 0;
        self.each_prefetched(ms, reverse, |o, m| added += o.put(m, move_, false) as usize);
        added
    }

    /// Moves the present mixed hashes to the tail (in reverse with `reverse`).
    pub(crate) fn touch_ms(&mut self, ms: &[u64], reverse: bool) {
        self.each_prefetched(ms, reverse, |o, m| {
            o.put(m, true, true);
        });
    }

    /// Removes the present mixed hashes; how many were.
    pub(crate) fn discard_ms(&mut self, ms: &[u64]) -> usize {
        let mut gone = 0;
        self.each_prefetched(ms, false, |o, m| {
            if let Some(i) = o.index.remove(m) {
                o.unlink(i as u32);
                o.free.push(i as u32);
                o.len -= 1;
                gone += 1;
            }
        });
        if self.len == 0 && gone != 0 {  // give the memory back with the last block
            self.nodes = Vec::new();
            self.free = Vec::new();
        }
        gone
    }

    /// `f` on each of `ms` (reversed with `reverse`), the index's buckets loaded ahead.
    fn each_prefetched(&mut self, ms: &[u64], reverse: bool, f: impl FnMut(&mut Self, u64)) {
        if reverse {
            let rev: Vec<u64> = ms.iter().rev().copied().collect();
            prefetched(&rev, self, |o, m| o.index.prefetch(m), f);
        } else {
            prefetched(ms, self, |o, m| o.index.prefetch(m), f);
        }
    }

    pub(crate) fn has(&self, m: u64) -> bool {
        self.index.get(m).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The mixed hashes, oldest first, for as long as `f` wants more.
    pub(crate) fn each_oldest(&self, mut f: impl FnMut(u64) -> bool) {
        let mut i = self.head;
        while i != NIL {
            let n = self.nodes[i as usize];
            if !f(n.m) {
                return;
            }
            i = n.next;
        }
    }
}

#[pymethods]
impl Order {
    #[new]
    pub(crate) fn new() -> Self {
        Order { head: NIL, tail: NIL, ..Default::default() }
    }

    /// Appends the hashes not present at the tail (in reverse with `reverse`); with `move_existing`,
    /// present ones move to the tail too (in the same run). How many were added.
    #[pyo3(signature = (hashes, reverse=false, move_existing=false))]
    fn append(&mut self, hashes: &Bound<'_, PyAny>, reverse: bool, move_existing: bool) -> PyResult<usize> {
        Ok(self.append_ms(&mixed_of(hashes)?, reverse, move_existing))
    }

    /// Moves the present hashes to the tail (in reverse with `reverse`); absent ones are ignored.
    #[pyo3(signature = (hashes, reverse=false))]
    fn touch(&mut self, hashes: &Bound<'_, PyAny>, reverse: bool) -> PyResult<()> {
        self.touch_ms(&mixed_of(hashes)?, reverse);
        Ok(())
    }

    /// Removes the present hashes; how many were.
    fn discard(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.discard_ms(&mixed_of(hashes)?))
    }

    /// The `k` oldest hashes, oldest first.
    fn head<'py>(&self, py: Python<'py>, k: usize) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::with_capacity(k.min(self.len));
        let mut i = self.head;
        while i != NIL && out.len() < k {
            let n = self.nodes[i as usize];
            out.push(unmix(n.m));
            i = n.next;
        }
        PyList::new(py, out)
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __contains__(&self, h: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.index.get(mix(u64_of(h)?)).is_some())
    }
}
