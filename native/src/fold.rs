//! The shard's fold of a batch, compiled (`Folder`): kvidx/core/shard.py `ModelShard.apply` is this
//! fold, which hands a batch to the shard's Python fold (`fold_reference`, the reference) only when it
//! declines it.
//!
//! Folded here: stores and removals of whole blocks, partial-block keys and router keys, in groups and
//! tiers the shard already has. The rarer events keep one piece of Python each, called where the Python
//! fold calls it: copies (`ModelShard._copied`), a replica's or a tier's clear (`_clear`,
//! `_clear_tier`: the counts so far are written first and read again after), a host queue
//! (`_host_queue`, `_host_tier`), a lookahead change (`_lookahead_changed`). A shard that keeps pending
//! credit or eviction foresight (a service following routes) keeps them compiled for a model with one
//! full-attention group (`Routes`: `Credits.confirm_ms`, `Recency.stored_ms` / `removed_ms` /
//! `settle_one`), and otherwise calls the shard's hooks (`_stored_hooks`, `_removed_hooks`,
//! `Foresight.settle`: a hybrid model's pooled order). Declined, before anything changes: a new
//! replica's first batch, a store into a group or tier the shard does not have yet, an epoch beyond the
//! clock's skew, a field of another type than the schema's (counted by reason: `declines`). The state a
//! batch leaves is the same either way: tests/unit/core/test_native_fold.py folds random streams both
//! ways, routes and lookups interleaved, and compares every field, every map, the journal, the pending
//! credit and every order.
//!
//! Why it reads fields by offset: per batch (one engine event of ~20 blocks, the common case) the
//! Python fold spent as long on its bookkeeping (the duplicate check, the counts, the replica's
//! fields) as the maps on their hashes, and the C API's attribute lookup is slower than the
//! interpreter's own (measured: this fold through getattr/setattr was 1.3x slower than the Python
//! one). It reads the structs' fields at their slot offsets (layout.rs), and the shard's, its
//! foresight's and its pending credit's the same way (`__slots__` classes: a dozen reads a batch, which
//! as instance-dict probes were a third of a one-block batch's fixed cost: 900 -> 590 ns).

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::types::{PyDict, PyList, PyTuple, PyType, PyWeakrefMethods, PyWeakrefReference};

use crate::credits::Credits;
use crate::layout::Layout;
use crate::recency::Recency;
use crate::{mixed_of, prefetched, Fx, HashArray, MaskMap};

/// Starts loading what `p` points at (a field just read; may be null).
#[inline(always)]
fn warm<T>(p: *const T) {
    if !p.is_null() {
        crate::table::prefetch(p);
    }
}

/// The items array of `list` if it is exactly a non-empty list (its header loaded), else null.
/// SAFETY: `list` is null or a live object; the GIL is held.
#[inline(always)]
unsafe fn items_of(list: *mut ffi::PyObject) -> *mut *mut ffi::PyObject {
    if list.is_null() || ffi::PyList_CheckExact(list) == 0 || ffi::PyList_GET_SIZE(list) == 0 {
        return std::ptr::null_mut();
    }
    (*(list as *mut ffi::PyListObject)).ob_item
}

/// Item 0 of `list` if it is exactly a non-empty list, else null (see `items_of`).
/// SAFETY: as `items_of`.
#[inline(always)]
unsafe fn first_item(list: *mut ffi::PyObject) -> *mut ffi::PyObject {
    let items = items_of(list);
    if items.is_null() { items as *mut ffi::PyObject } else { *items }
}

/// A field that is True (a bool; anything else counts as not plain: the caller declines).
#[inline(always)]
unsafe fn flag(p: *mut ffi::PyObject) -> Option<bool> {
    if p == ffi::Py_True() {
        Some(true)
    } else if p == ffi::Py_False() {
        Some(false)
    } else {
        None
    }
}

// field indices, in the order of the names given to Layout::of
const B_NAMES: [&str; 15] = ["epoch", "seq", "part", "events", "host_tier_blocks", "lookahead_tokens",
                             "replica_group", "recompute_tokens", "block_size", "engine_ts", "relay_ts",
                             "external_after_local", "replica", "dp_rank", "copies_removed"];
const B_EPOCH: usize = 0;
const B_SEQ: usize = 1;
const B_PART: usize = 2;
const B_EVENTS: usize = 3;
const B_HOST_TIER: usize = 4;
const B_LOOKAHEAD: usize = 5;
const B_GROUP: usize = 6;
const B_RECOMPUTE: usize = 7;
const B_BLOCK_SIZE: usize = 8;
const B_ENGINE_TS: usize = 9;
const B_RELAY_TS: usize = 10;
const B_EXTERNAL_AFTER_LOCAL: usize = 11;
const B_REPLICA: usize = 12;
const B_DP_RANK: usize = 13;
const B_COPIES_REMOVED: usize = 14;

const S_NAMES: [&str; 22] = ["slot", "epoch", "seq", "part", "duplicates", "seq_gaps", "host_tier", "lookahead",
                             "blocks", "group_blocks", "unit", "group", "recompute", "block_size", "engine_ts",
                             "relay_ts", "applied_ts", "batches", "external_after_local", "removed", "tails",
                             "router_keys"];
const S_SLOT: usize = 0;
const S_EPOCH: usize = 1;
const S_SEQ: usize = 2;
const S_PART: usize = 3;
const S_DUPLICATES: usize = 4;
const S_SEQ_GAPS: usize = 5;
const S_HOST_TIER: usize = 6;
const S_LOOKAHEAD: usize = 7;
const S_BLOCKS: usize = 8;
const S_GROUP_BLOCKS: usize = 9;
const S_UNIT: usize = 10;
const S_GROUP: usize = 11;
const S_RECOMPUTE: usize = 12;
const S_BLOCK_SIZE: usize = 13;
const S_ENGINE_TS: usize = 14;
const S_RELAY_TS: usize = 15;
const S_APPLIED_TS: usize = 16;
const S_BATCHES: usize = 17;
const S_EXTERNAL_AFTER_LOCAL: usize = 18;
const S_REMOVED: usize = 19;
const S_TAILS: usize = 20;
const S_ROUTER_KEYS: usize = 21;

// BlocksStored and BlocksRemoved share these first six; BlocksStored adds the last two
const E_NAMES: [&str; 8] = ["tier", "group", "hashes", "tail", "router_keys", "engine_hashes", "copy", "block_size"];
const E_TIER: usize = 0;
const E_GROUP: usize = 1;
const E_HASHES: usize = 2;
const E_TAIL: usize = 3;
const E_ROUTER_KEYS: usize = 4;
const E_COPY: usize = 6;
const E_BLOCK_SIZE: usize = 7;

// kvidx.core.shard.ModelShard, kvidx.core.foresight.Foresight, kvidx.core.pending.PendingCredits: `__slots__`
// classes, their fields read at the slots' offsets (a dozen a batch: no dict probe, no getattr)
const SH_NAMES: [&str; 10] = ["replicas", "groups", "pending", "foresight", "host_orders", "journal",
                              "pool_readers", "blocks_applied", "tail_keys", "by_slot"];
const SH_REPLICAS: usize = 0;
const SH_GROUPS: usize = 1;
const SH_PENDING: usize = 2;
const SH_FORESIGHT: usize = 3;
const SH_HOST_ORDERS: usize = 4;
const SH_JOURNAL: usize = 5;
const SH_POOL_READERS: usize = 6;
const SH_BLOCKS_APPLIED: usize = 7;
const SH_TAIL_KEYS: usize = 8;
const SH_BY_SLOT: usize = 9;

const F_NAMES: [&str; 5] = ["active", "slots", "grown", "pooled", "version"];
const F_ACTIVE: usize = 0;
const F_SLOTS: usize = 1;
const F_GROWN: usize = 2;
const F_POOLED: usize = 3;
const F_VERSION: usize = 4;

const P_NAMES: [&str; 3] = ["masks", "window_masks", "_blocks"];
const P_MASKS: usize = 0;
const P_WINDOW_MASKS: usize = 1;
const P_BLOCKS: usize = 2;

const C_NAMES: [&str; 1] = ["tier"];  // ReplicaCleared
const C_TIER: usize = 0;

const G_NAMES: [&str; 3] = ["tiers", "any", "kind"];
const G_TIERS: usize = 0;
const G_ANY: usize = 1;
const G_KIND: usize = 2;

/// What an event's keys are: blocks, partial-block keys (BlocksStored.tail) or router keys (counted
/// apart, no routes' hooks).
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Blocks,
    Tails,
    Router,
}

/// What an event does.
#[derive(Clone, Copy, PartialEq)]
enum Op {
    Store,
    Remove,
    Copy,  // held blocks stored again (BlocksStored.copy): the shard's `_copied`
    Clear,  // ReplicaCleared: the shard's `_clear` or `_clear_tier` (its tier in `tid`)
}

/// Why the compiled fold handed a batch to the Python fold (counted per reason: `Folder.declines`).
#[derive(Clone, Copy)]
#[repr(u8)]
enum Why {
    NewReplica,
    NewGroupOrTier,
    FutureEpoch,
    Other,  // a field of another type than the schema's (e.g. a reference map): never from a decoded batch
}

const WHY: [&str; 4] = ["new_replica", "new_group_or_tier", "future_epoch", "other"];

/// One event of the batch, read by the check pass and used by the apply pass.
struct Step<'py> {
    op: Op,
    event: Bound<'py, PyAny>,
    gid: Bound<'py, PyAny>,
    tid: Bound<'py, PyAny>,  // a clear's: its tier name ("" for the whole replica)
    hashes: Bound<'py, PyAny>,  // a list or a HashArray
    ms: Vec<u64>,  // the hashes, mixed (converted once for every map and the routes' side)
    keys: Keys,
    // None: a removal from a group or tier the shard never had (a no-op, not counted)
    target: Option<(Bound<'py, PyDict>, Bound<'py, MaskMap>, Bound<'py, PyAny>)>,  // (tiers, map, any)
    group: Option<Bound<'py, PyAny>>,  // the GroupIndex, for the routes' hooks
    block_size: i64,
}

/// Everything a batch reads and writes, read and checked before anything changes. The objects
/// written into the replica are owned here: Python code that may run during the fold (a finalizer
/// run by an allocation, a rare event's Python method) cannot free them under it.
struct Plan<'py> {
    steps: Vec<Step<'py>>,
    fields: [Bound<'py, PyAny>; 7],  // epoch, seq, part, replica_group, recompute_tokens, engine_ts, relay_ts
    block_size: Option<Bound<'py, PyAny>>,  // the engine's block size, when the batch names one
    host_tier: Option<Bound<'py, PyAny>>,  // the batch's host tier, when it differs from the replica's
    lookahead: Option<i64>,  // the batch's lookahead, when it differs from the replica's
    external_after_local: Option<i64>,  // the batch's, when above the replica's (a sticky trait)
    slot: i64,
    seq_gaps: Option<i64>,  // the replica's new count, when the batch skipped some
    batches: i64,  // the replica's new count
}

/// The replica's counts when the batch (or the clear in it) began, and the changes of the events
/// folded since: written to the replica at the batch's end, before a clear (which the shard's Python
/// does), and also when an event fails (the Python fold has counted the events before it by then).
struct Counts<'py> {
    base_blocks: i64,
    base_removed: i64,
    base_unit: i64,
    group_blocks: Bound<'py, PyDict>,
    blocks: i64,
    removed: i64,
    tails: i64,
    router_keys: i64,
    unit: i64,
    applied: usize,
    groups: Vec<(Bound<'py, PyAny>, i64)>,  // group -> change of live entries, in first-change order
}

/// The routes' side of a shard that keeps pending credit or eviction foresight: compiled where it can
/// be (`native`), else the shard's Python hooks (`ModelShard._stored_hooks`, `_removed_hooks`,
/// `Foresight.settle`) called where the Python fold calls them, so both keep the same state.
struct Hooks<'py> {
    shard: &'py Bound<'py, PyAny>,
    st: &'py Bound<'py, PyAny>,
    foresight: Bound<'py, PyAny>,
    native: Option<Routes<'py>>,
}

/// The routes' side kept compiled (a full-attention group, compiled credits, per-group foresight):
/// the hooks' work done here, without a Python frame per event (the hooks are its reference).
struct Routes<'py> {
    credits: Bound<'py, Credits>,
    slots: Bound<'py, PyDict>,  // Foresight.slots
    grown: Bound<'py, PyList>,  // Foresight.grown
    active: bool,  // Foresight.active
    deepest_first: bool,  // the replica is not a shared pool
    bumps: std::cell::Cell<i64>,  // changes to add to Foresight.version at the batch's end
}

impl<'py> Routes<'py> {
    /// `ModelShard._stored_hooks` for a store of whole blocks: confirmed, no longer pending there; in
    /// the replica's eviction order (Foresight.stored; `held`: its live blocks in the group before).
    fn stored(&self, h: &Hooks<'py>, slot: usize, s: &Step<'py>, held: i64) -> PyResult<()> {
        let py = self.slots.py();
        self.credits.try_borrow_mut()?.confirm_ms(py, slot, &s.ms)?;
        if !self.active || s.ms.is_empty() {
            return Ok(());
        }
        let key = PyTuple::new(py, [slot.into_pyobject(py)?.into_any(), s.gid.clone()])?;
        let r = match self.slots.get_item(&key)? {
            Some(r) => r,
            None => h.foresight.call_method1(intern!(py, "recency"), (&key, held))?,
        };
        let Ok(rn) = r.cast::<Recency>() else {  // a reference order (set by a test): its own method
            h.foresight.call_method1(intern!(py, "stored"), (slot, &s.gid, &s.hashes, self.deepest_first, held))?;
            return Ok(());
        };
        rn.try_borrow_mut()?.stored_ms(py, &s.ms, self.deepest_first)?;
        self.grown.append(&r)?;
        self.bumps.set(self.bumps.get() + 1);
        Ok(())
    }

    /// `ModelShard._removed_hooks`: the blocks gone from every tier leave the eviction order
    /// (Foresight.removed).
    fn removed(&self, h: &Hooks<'py>, slot: usize, s: &Step<'py>, tiers: bool, any: &Bound<'py, PyAny>)
               -> PyResult<()> {
        let py = self.slots.py();
        let key = PyTuple::new(py, [slot.into_pyobject(py)?.into_any(), s.gid.clone()])?;
        let Some(r) = self.slots.get_item(&key)? else { return Ok(()) };
        let Ok(rn) = r.cast::<Recency>() else {
            h.shard.call_method1(intern!(py, "_removed_hooks"), (h.st, &s.gid, s.group.as_ref(), &s.hashes))?;
            return Ok(());
        };
        let lacking;
        let ms: &[u64] = if tiers {  // only those no tier holds there any more
            let a = any.cast::<MaskMap>()?.try_borrow()?;
            let mut st = (&*a.m.read(), Vec::new());
            prefetched(&s.ms, &mut st, |st, x| st.0.prefetch(x, slot), |st, x| {
                if !st.0.has_bit(x, slot) {
                    st.1.push(x);
                }
            });
            lacking = st.1;
            &lacking
        } else {
            &s.ms
        };
        if ms.is_empty() {
            return Ok(());
        }
        rn.try_borrow_mut()?.removed_ms(py, ms)?;
        self.bumps.set(self.bumps.get() + 1);
        Ok(())
    }

    /// The batch's end: `Foresight.settle` (per-group orders: each grown slot's peak), and the
    /// version its changes bumped.
    fn settle(&self, foresight: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = self.slots.py();
        if !self.slots.is_empty() && !self.grown.is_empty() {
            if self.grown.iter().all(|r| r.cast::<Recency>().is_ok()) {
                for r in self.grown.iter() {
                    r.cast::<Recency>()?.try_borrow_mut()?.settle_one(py, false)?;
                }
                self.grown.del_slice(0, self.grown.len())?;
            } else {
                foresight.call_method0(intern!(py, "settle"))?;
            }
        }
        Ok(())
    }

    /// Foresight.version bumped once per change, as the Python fold does (written when the events
    /// are, also when one fails).
    fn flush_version(&self, layout: &Layout, foresight: &Bound<'py, PyAny>) -> PyResult<()> {
        if self.bumps.get() != 0 {
            let v: i64 = layout.field(foresight, F_VERSION)?.extract()?;
            layout.set_field_int(foresight, F_VERSION, v + self.bumps.replace(0))?;
        }
        Ok(())
    }
}

// bounds within which the fold's arithmetic cannot overflow (a batch or replica beyond them: declined)
const BIG: i64 = 1 << 62;

#[pyclass(name = "Folder", module = "kvidx_native", frozen)]
pub struct Folder {
    batch: Layout,  // schemas.events.EventBatch
    replica: Layout,  // kvidx.core.shard.ReplicaState
    stored: Layout,  // schemas.events.BlocksStored
    removed: Layout,  // schemas.events.BlocksRemoved
    cleared: Layout,  // schemas.events.ReplicaCleared
    group: Layout,  // kvidx.core.shard.GroupIndex
    shard: Layout,  // kvidx.core.shard.ModelShard
    foresight: Layout,  // kvidx.core.foresight.Foresight
    pending: Layout,  // kvidx.core.pending.PendingCredits
    tier_ids: Py<PyDict>,  // tier name -> id
    last_tier: Py<PyAny>,  // the id of an unknown tier name
    max_skew_ms: i64,  // kvidx.core.shard.MAX_EPOCH_SKEW_MS
    full_kinds: Py<PyAny>,  // kvidx.core.walk.FULL_KINDS
    folded: AtomicU64,
    declines: [AtomicU64; WHY.len()],
    why: AtomicU8,  // the reason of the decline in hand (set where it is decided)
}

#[inline(always)]
fn exact_int(p: *mut ffi::PyObject) -> bool {
    // SAFETY: a null check, then a type check of a live object
    !p.is_null() && unsafe { ffi::PyLong_CheckExact(p) } != 0
}

#[inline(always)]
fn exact_float(p: *mut ffi::PyObject) -> bool {
    // SAFETY: a null check, then a type check of a live object
    !p.is_null() && unsafe { ffi::PyFloat_CheckExact(p) } != 0
}


impl Folder {
    /// Declines the batch for `why` (counted by `apply`).
    fn no<T>(&self, why: Why) -> PyResult<Option<T>> {
        self.why.store(why as u8, Ordering::Relaxed);
        Ok(None)
    }

    /// The check pass over the events: their steps, or None (decline). Only exact lists, ints and
    /// strs are taken, so no Python code runs while they are read (a rare event's is called by the
    /// apply pass, as the Python fold calls it).
    fn steps<'py>(&self, groups: &Bound<'py, PyDict>, events: &Bound<'py, PyList>)
                  -> PyResult<Option<Vec<Step<'py>>>> {
        let py = groups.py();
        let tier_ids = self.tier_ids.bind(py);
        let mut steps = Vec::with_capacity(events.len());
        for ev in events.iter() {
            let p = ev.as_ptr();
            if self.cleared.is(p) {
                // SAFETY: `ev` is exactly a ReplicaCleared; its field is null- and type-checked before use
                let tier = unsafe {
                    let t = self.cleared.get(p, C_TIER);
                    if t.is_null() || ffi::PyUnicode_CheckExact(t) == 0 {
                        return self.no(Why::Other);
                    }
                    Bound::from_borrowed_ptr(py, t)
                };
                steps.push(Step { op: Op::Clear, event: ev.clone(), gid: py.None().into_bound(py), tid: tier,
                                  hashes: PyList::empty(py).into_any(), ms: Vec::new(), keys: Keys::Blocks, target: None,
                                  group: None, block_size: 0 });
                continue;
            }
            let store = self.stored.is(p);
            if !store && !self.removed.is(p) {
                return self.no(Why::Other);
            }
            let layout = if store { &self.stored } else { &self.removed };
            // SAFETY: `ev` is exactly of the layout's class; each field is null- and type-checked and
            // taken as an owned reference before it is used
            let (gid, tier, hashes, block_size, keys, copy) = unsafe {
                let (Some(tail), Some(router)) = (flag(layout.get(p, E_TAIL)), flag(layout.get(p, E_ROUTER_KEYS)))
                else {
                    return self.no(Why::Other);
                };
                let keys = if tail { Keys::Tails } else if router { Keys::Router } else { Keys::Blocks };
                let copy = if store {
                    match flag(layout.get(p, E_COPY)) {
                        Some(c) => c,
                        None => return self.no(Why::Other),
                    }
                } else {
                    false
                };
                let (g, t, h) = (layout.get(p, E_GROUP), layout.get(p, E_TIER), layout.get(p, E_HASHES));
                // a list (an event made in Python) or a HashArray (one decoded: schemas/events.py)
                if !exact_int(g) || t.is_null() || ffi::PyUnicode_CheckExact(t) == 0 || h.is_null()
                    || (ffi::PyList_CheckExact(h) == 0
                        && !Bound::from_borrowed_ptr(py, h).is_exact_instance_of::<HashArray>()) {
                    return self.no(Why::Other);
                }
                let bs = if store {
                    match layout.int(p, E_BLOCK_SIZE) {
                        Some(v) if (0..BIG).contains(&v) => v,
                        _ => return self.no(Why::Other),
                    }
                } else {
                    0
                };
                (Bound::from_borrowed_ptr(py, g), Bound::from_borrowed_ptr(py, t),
                 Bound::from_borrowed_ptr(py, h), bs, keys, copy)
            };
            let tid = match tier_ids.get_item(&tier)? {
                Some(t) => t,
                None => self.last_tier.bind(py).clone(),
            };
            if copy {  // no map changes: the shard's `_copied` (a group it never had is fine)
                steps.push(Step { op: Op::Copy, event: ev.clone(), gid, tid, hashes, ms: Vec::new(), keys,
                                  target: None, group: None, block_size });
                continue;
            }
            let mut target = None;
            let group = groups.get_item(&gid)?;
            if let Some(g) = &group {
                if !self.group.is(g.as_ptr()) {
                    return self.no(Why::Other);
                }
                // SAFETY: `g` is exactly a GroupIndex; its fields are null-checked and owned before use
                let (tiers, any) = unsafe {
                    let (t, a) = (self.group.get(g.as_ptr(), G_TIERS), self.group.get(g.as_ptr(), G_ANY));
                    if t.is_null() || a.is_null() || ffi::PyDict_CheckExact(t) == 0 {
                        return self.no(Why::Other);
                    }
                    (Bound::from_borrowed_ptr(py, t).cast_into::<PyDict>()?, Bound::from_borrowed_ptr(py, a))
                };
                if let Some(m) = tiers.get_item(&tid)? {
                    let Ok(m) = m.cast_into::<MaskMap>() else { return self.no(Why::Other) };  // a reference map
                    if any.cast::<MaskMap>().is_err() {
                        return self.no(Why::Other);
                    }
                    target = Some((tiers, m, any));
                }
            }
            if store && target.is_none() {
                return self.no(Why::NewGroupOrTier);  // made by the Python fold
            }
            let Ok(ms) = mixed_of(&hashes) else { return self.no(Why::Other) };  // raised there
            steps.push(Step { op: if store { Op::Store } else { Op::Remove }, event: ev.clone(), gid, tid, hashes, ms,
                              keys, target, group, block_size });
        }
        Ok(Some(steps))
    }

    /// The check pass: the plan of a batch that is not a redelivery, or None (decline).
    /// `epoch`, `seq`: the batch's; `s_epoch`, `s_seq`: the replica's.
    unsafe fn plan<'py>(&self, groups: &Bound<'py, PyDict>, b: *mut ffi::PyObject, s: *mut ffi::PyObject,
                        now: &Bound<'py, PyAny>, (epoch, seq, s_epoch, s_seq): (i64, i64, i64, i64))
                        -> PyResult<Option<(Plan<'py>, Counts<'py>)>> {
        let py = groups.py();
        let (b_, r_) = (&self.batch, &self.replica);
        let events = b_.get(b, B_EVENTS);
        let ev = first_item(events);  // the first event's hashes list, loading (see try_apply)
        let hashes = if ev.is_null() {
            std::ptr::null_mut()
        } else if self.stored.is(ev) {
            self.stored.get(ev, E_HASHES)
        } else if self.removed.is(ev) {
            self.removed.get(ev, E_HASHES)
        } else {
            std::ptr::null_mut()
        };
        warm(hashes);
        let pair = |bi: usize, si: usize| match (b_.int(b, bi), r_.int(s, si)) {
            (Some(x), Some(y)) => Some((x, y)),
            _ => None,
        };
        let (Some((host_tier, s_host_tier)), Some((lookahead, s_lookahead)), Some((eal, s_eal))) =
            (pair(B_HOST_TIER, S_HOST_TIER), pair(B_LOOKAHEAD, S_LOOKAHEAD),
             pair(B_EXTERNAL_AFTER_LOCAL, S_EXTERNAL_AFTER_LOCAL))
        else {
            return self.no(Why::Other);
        };
        if !exact_float(now.as_ptr()) {
            return self.no(Why::Other);
        }
        let ints = [B_EPOCH, B_SEQ, B_PART, B_GROUP, B_RECOMPUTE];
        let floats = [B_ENGINE_TS, B_RELAY_TS];
        if !ints.iter().all(|&i| exact_int(b_.get(b, i))) || !floats.iter().all(|&i| exact_float(b_.get(b, i))) {
            return self.no(Why::Other);
        }
        let fields = [B_EPOCH, B_SEQ, B_PART, B_GROUP, B_RECOMPUTE, B_ENGINE_TS, B_RELAY_TS]
            .map(|i| Bound::from_borrowed_ptr(py, b_.get(b, i)));
        let bs = b_.get(b, B_BLOCK_SIZE);
        let block_size = match b_.int(b, B_BLOCK_SIZE) {
            Some(0) => None,
            Some(v) if v > 0 => Some(Bound::from_borrowed_ptr(py, bs)),
            _ => return self.no(Why::Other),
        };
        let (Some(slot), Some(gaps), Some(batches)) = (r_.int(s, S_SLOT), r_.int(s, S_SEQ_GAPS), r_.int(s, S_BATCHES))
        else {
            return self.no(Why::Other);
        };
        if [gaps, batches].iter().any(|v| !(-BIG..BIG).contains(v)) {
            return self.no(Why::Other);
        }
        let Some(counts) = self.counts(py, s)? else { return self.no(Why::Other) };
        if events.is_null() || ffi::PyList_CheckExact(events) == 0 {
            return self.no(Why::Other);
        }
        let events = Bound::from_borrowed_ptr(py, events).cast_into::<PyList>()?;
        warm(items_of(hashes));
        let Some(steps) = self.steps(groups, &events)? else {
            return Ok(None);
        };
        let seq_gaps = (epoch == s_epoch && seq > s_seq + 1).then(|| gaps + seq - s_seq - 1);
        if seq_gaps.is_some_and(|g| g >= BIG) {
            return self.no(Why::Other);
        }
        let host_tier = (host_tier != s_host_tier).then(|| Bound::from_borrowed_ptr(py, b_.get(b, B_HOST_TIER)));
        let lookahead = (lookahead != s_lookahead).then_some(lookahead);
        let plan = Plan { steps, fields, block_size, host_tier, lookahead, external_after_local: (eal > s_eal).then_some(eal),
                          slot, seq_gaps, batches: batches + 1 };
        Ok(Some((plan, counts)))
    }

    /// The replica's counts as they are now, none changed yet; None if one is out of bounds or of
    /// another type.
    /// SAFETY: `s` must be exactly a ReplicaState and the GIL held.
    unsafe fn counts<'py>(&self, py: Python<'py>, s: *mut ffi::PyObject) -> PyResult<Option<Counts<'py>>> {
        let r_ = &self.replica;
        let (Some(blocks), Some(removed), Some(unit), Some(tails), Some(router)) =
            (r_.int(s, S_BLOCKS), r_.int(s, S_REMOVED), r_.int(s, S_UNIT), r_.int(s, S_TAILS), r_.int(s, S_ROUTER_KEYS))
        else {
            return Ok(None);
        };
        let gb = r_.get(s, S_GROUP_BLOCKS);
        if [blocks, removed, tails, router].iter().any(|v| !(-BIG..BIG).contains(v)) || gb.is_null()
            || ffi::PyDict_CheckExact(gb) == 0 {
            return Ok(None);
        }
        let group_blocks = Bound::from_borrowed_ptr(py, gb).cast_into::<PyDict>()?;
        Ok(Some(Counts { base_blocks: blocks, base_removed: removed, base_unit: unit, group_blocks, blocks: 0,
                         removed: 0, tails: 0, router_keys: 0, unit, applied: 0, groups: Vec::new() }))
    }

    /// The apply pass, event by event in the Python fold's order (a removal's journal entry before
    /// it, a store's after it); stops at an event that fails, as the Python fold does.
    #[allow(clippy::too_many_arguments)]
    fn run_steps<'py>(&self, shard: &Bound<'py, PyAny>, st: &Bound<'py, PyAny>, journal: &Bound<'py, PyAny>,
                      host_orders: &Bound<'py, PyAny>, plan: &Plan<'py>, c: &mut Counts<'py>,
                      hooks: Option<&Hooks<'py>>) -> PyResult<()> {
        let py = journal.py();
        let touched = if journal.is_none() { None } else { Some(journal.getattr(pyo3::intern!(py, "touched"))?) };
        let touch = |s: &Step<'py>| -> PyResult<()> {  // ChangeJournal.touch
            if let Some(t) = &touched {
                let t = t.cast::<PyDict>()?;
                let key = PyTuple::new(py, [&s.gid, &s.tid])?;
                match t.get_item(&key)? {
                    Some(lists) => lists.cast::<PyList>()?.append(&s.hashes)?,
                    None => t.set_item(key, PyList::new(py, [&s.hashes])?)?,
                }
            }
            Ok(())
        };
        // the replica's host queue (TensorRT-LLM), where kept: the shard's `_host_queue`
        let host_queue = |s: &Step<'py>| -> PyResult<()> {
            if s.keys == Keys::Blocks && host_orders.is_truthy()? {
                shard.call_method1(intern!(py, "_host_queue"), (st, &s.tid, &s.event))?;
            }
            Ok(())
        };
        let slot = plan.slot as usize;
        for s in &plan.steps {
            match s.op {
                Op::Copy => {
                    shard.call_method1(intern!(py, "_copied"), (st, &s.gid, &s.hashes))?;
                    continue;
                }
                Op::Clear => {  // the counts so far go to the replica, the shard's Python clears it
                    self.write_counts(shard, st.as_ptr(), c)?;
                    if s.tid.is_truthy()? {
                        shard.call_method1(intern!(py, "_clear_tier"), (st, &s.tid))?;
                    } else {
                        shard.call_method1(intern!(py, "_clear"), (st,))?;
                    }
                    // SAFETY: `st` is exactly a ReplicaState (checked by fold_batch)
                    *c = unsafe { self.counts(py, st.as_ptr())? }
                        .ok_or_else(|| PyValueError::new_err("a replica's counts out of range after a clear"))?;
                    continue;
                }
                Op::Store | Op::Remove => {}
            }
            let Some((tiers, d, any)) = &s.target else { continue };
            let keyed = |c: &mut Counts<'py>, n: i64| match s.keys {  // partial-block and router keys
                Keys::Tails => c.tails += n,
                Keys::Router => c.router_keys += n,
                Keys::Blocks => {}
            };
            let n: i64 = if s.op == Op::Store {
                // the tier's map and the group's union in one pass (the Python fold stores the union
                // after the host queue and the journal: neither reads a map); a group of one tier
                // shares its map with the union, which store_ms_with sees
                let union = any.cast::<MaskMap>()?.try_borrow()?;
                let new = d.try_borrow()?.store_ms_with(&union, &s.ms, slot);
                host_queue(s)?;
                touch(s)?;
                if s.keys != Keys::Blocks {
                    keyed(c, new as i64);
                    c.applied += s.ms.len();
                    continue;
                }
                if let (Some(h), Some(g)) = (hooks, &s.group) {
                    // the live blocks before this event: the replica's, as the Python fold counts them
                    let in_group = c.groups.iter().find(|x| x.0.is(&s.gid) || x.0.eq(&s.gid).unwrap_or(false))
                        .map_or(0, |x| x.1);
                    let before: i64 = match c.group_blocks.get_item(&s.gid)? {
                        Some(v) => v.extract()?,
                        None => 0,
                    };
                    match &h.native {
                        Some(r) => r.stored(h, slot, s, before + in_group)?,
                        None => {
                            h.shard.call_method1(intern!(py, "_stored_hooks"), (h.st, &s.gid, g, &s.hashes,
                                                 c.base_blocks + c.blocks, before + in_group))?;
                        }
                    }
                }
                if s.block_size != 0 && (c.unit == 0 || s.block_size < c.unit) {
                    c.unit = s.block_size;
                }
                new as i64
            } else {
                touch(s)?;
                host_queue(s)?;
                let gone = if tiers.len() == 1 {  // the map is its own union
                    d.try_borrow()?.remove_ms(&s.ms, slot, &[], None)
                } else {  // retract from the union only where no other tier still holds the block
                    let mut others = Vec::with_capacity(tiers.len());
                    for (t, m) in tiers.iter() {
                        if !t.eq(&s.tid)? {
                            others.push(m.cast_into::<MaskMap>()?);
                        }
                    }
                    let others = others.iter().map(|m| m.try_borrow()).collect::<Result<Vec<_>, _>>()?;
                    let any = any.cast::<MaskMap>()?.try_borrow()?;
                    d.try_borrow()?.remove_ms(&s.ms, slot, &others, Some(&any))
                } as i64;
                if s.keys != Keys::Blocks {
                    keyed(c, -gone);
                    c.applied += s.ms.len();
                    continue;
                }
                c.removed += gone;
                if let (Some(h), Some(g)) = (hooks, &s.group) {
                    if gone != 0 && self.foresight.field(&h.foresight, F_SLOTS)?.is_truthy()? {
                        match &h.native {
                            Some(r) => r.removed(h, slot, s, tiers.len() > 1, any)?,
                            None => {
                                h.shard.call_method1(intern!(py, "_removed_hooks"), (h.st, &s.gid, g, &s.hashes))?;
                            }
                        }
                    }
                }
                -gone
            };
            if n != 0 {
                c.blocks += n;
                match c.groups.iter_mut().find(|x| x.0.is(&s.gid) || x.0.eq(&s.gid).unwrap_or(false)) {
                    Some(x) => x.1 += n,
                    None => c.groups.push((s.gid.clone(), n)),
                }
            }
            c.applied += s.ms.len();
        }
        Ok(())
    }

    /// The counts of the events folded since `c` was read, into the replica and the shard.
    fn write_counts(&self, shard: &Bound<'_, PyAny>, st: *mut ffi::PyObject, c: &Counts<'_>) -> PyResult<()> {
        // SAFETY: `st` is exactly a ReplicaState; only ints are written
        unsafe {
            if c.blocks != 0 {
                self.replica.set_int(st, S_BLOCKS, c.base_blocks + c.blocks)?;
            }
            if c.removed != 0 {
                self.replica.set_int(st, S_REMOVED, c.base_removed + c.removed)?;
            }
            if c.unit != c.base_unit {
                self.replica.set_int(st, S_UNIT, c.unit)?;
            }
            for (i, delta) in [(S_TAILS, c.tails), (S_ROUTER_KEYS, c.router_keys)] {
                if delta != 0 {
                    let cur = self.replica.int(st, i).unwrap_or(0);
                    self.replica.set_int(st, i, cur + delta)?;
                }
            }
        }
        if c.tails != 0 {
            let t: i64 = self.shard.field(shard, SH_TAIL_KEYS)?.extract()?;
            self.shard.set_field_int(shard, SH_TAIL_KEYS, t + c.tails)?;
        }
        for (gid, delta) in &c.groups {
            let cur: i64 = match c.group_blocks.get_item(gid)? {
                Some(v) => v.extract()?,
                None => 0,
            };
            c.group_blocks.set_item(gid, cur + delta)?;
        }
        if c.applied != 0 {
            let a: i64 = self.shard.field(shard, SH_BLOCKS_APPLIED)?.extract()?;
            self.shard.set_field_int(shard, SH_BLOCKS_APPLIED, a + c.applied as i64)?;
        }
        Ok(())
    }

    /// The fold of one batch without the reference: Some(done) if it folded it (or counted a
    /// redelivery), None if declined (nothing changed; the reason in `why`): a new replica, a store
    /// into a group or tier the shard does not have yet, an epoch beyond the clock's skew, or a field
    /// of another type than the schema's.
    fn try_apply<'py>(&self, shard: &Bound<'py, PyAny>, batch: &Bound<'py, PyAny>, now: &Bound<'py, PyAny>,
                      cache: Option<&ReplicaCache>) -> PyResult<Option<bool>> {
        let py = shard.py();
        let b = batch.as_ptr();
        if !self.batch.is(b) {
            return self.no(Why::Other);
        }
        // A batch that waited in a queue is cold: the loads along its chain of objects (events list,
        // its items, the event, its hashes list, their items) start a step ahead of their use, each
        // overlapping the work between (measured at 2,048 replicas: ~5 % of the ingest pass)
        // SAFETY: `batch` is exactly an EventBatch; fields are only read (and null-checked) here, the
        // events list held (owned) while it is
        let events = unsafe {
            let events = self.batch.get(b, B_EVENTS);
            warm(events);
            for i in [B_SEQ, B_ENGINE_TS, B_RELAY_TS] {  // ints and floats the plan checks and keeps
                warm(self.batch.get(b, i));
            }
            warm(self.batch.get(b, B_REPLICA));
            (!events.is_null()).then(|| Bound::from_borrowed_ptr(py, events))
        };
        let events = events.as_ref().map_or(std::ptr::null_mut(), |e| e.as_ptr());
        let latest = wall_epoch_ms().saturating_add(self.max_skew_ms);
        // SAFETY: `batch` is exactly an EventBatch; the fields are null-checked before use
        let (epoch, replica, dp_rank) = unsafe {
            (self.batch.int(b, B_EPOCH), self.batch.get(b, B_REPLICA), self.batch.get(b, B_DP_RANK))
        };
        if replica.is_null() || dp_rank.is_null() {
            return self.no(Why::Other);
        }
        if epoch.is_none_or(|e| e > latest) {
            return self.no(Why::FutureEpoch);  // refused (counted and logged) by the reference
        }
        let Ok(replicas) = self.shard.field(shard, SH_REPLICAS)?.cast_into::<PyDict>() else {
            return self.no(Why::Other);
        };
        // SAFETY: two live fields of the batch (null-checked), read before anything else runs
        let Some(st) = (unsafe { self.state_of(shard, &replicas, replica, dp_rank, cache) })? else {
            return self.no(Why::NewReplica);
        };
        let s = st.as_ptr();
        if !self.replica.is(s) {
            return self.no(Why::Other);
        }
        // SAFETY: `st` is exactly a ReplicaState, `events` a live field of the batch (null-checked)
        unsafe {
            warm(items_of(events));
            // the changing fields' objects: the fold reads some, and replacing each drops its old
            // value (a write to that object: a cold float or int a fleet's batches apart)
            for i in [S_SEQ, S_BLOCKS, S_BATCHES, S_GROUP_BLOCKS, S_ENGINE_TS, S_RELAY_TS, S_APPLIED_TS] {
                warm(self.replica.get(s, i));
            }
        }
        // SAFETY: `st` is exactly a ReplicaState
        if unsafe { self.replica.int(s, S_EPOCH) }.is_none_or(|e| e > latest) {
            return self.no(Why::FutureEpoch);  // another clock's epoch: the reference resets it
        }
        let Ok(groups) = self.shard.field(shard, SH_GROUPS)?.cast_into::<PyDict>() else {
            return self.no(Why::Other);
        };
        let pending = self.shard.field(shard, SH_PENDING)?;
        let foresight = self.shard.field(shard, SH_FORESIGHT)?;
        // a mask map's emptiness read in place (its __len__ through Python costs a call per batch)
        let held = |m: Bound<'py, PyAny>| -> PyResult<bool> {
            match m.cast::<MaskMap>() {
                Ok(mm) => Ok(!mm.try_borrow()?.m.read().is_empty()),
                Err(_) => m.is_truthy(),
            }
        };
        let routes = self.foresight.field(&foresight, F_ACTIVE)?.is_truthy()?
            || self.foresight.field(&foresight, F_SLOTS)?.is_truthy()?
            || held(self.pending.field(&pending, P_MASKS)?)?
            || held(self.pending.field(&pending, P_WINDOW_MASKS)?)?;
        // SAFETY: a live field of the batch (null-checked); the event's layout is checked before the read
        unsafe {
            let ev = first_item(events);
            warm(ev);
        }
        let hooks = if routes {
            let native = self.routes(shard, &groups, &pending, &foresight, b)?;
            Some(Hooks { shard, st: &st, foresight, native })
        } else {
            None
        };
        self.fold_batch(shard, &groups, batch, &st, now, hooks.as_ref())
    }

    /// The routes' side compiled, where it can be (else the hooks are called): the model's one group
    /// of a full-attention kind, compiled pending credit, per-group (not pooled) foresight.
    fn routes<'py>(&self, shard: &Bound<'py, PyAny>, groups: &Bound<'py, PyDict>, pending: &Bound<'py, PyAny>,
                   foresight: &Bound<'py, PyAny>, b: *mut ffi::PyObject) -> PyResult<Option<Routes<'py>>> {
        let py = shard.py();
        if groups.len() != 1 {
            return Ok(None);
        }
        let Some(g) = groups.values().iter().next() else { return Ok(None) };
        // SAFETY: `g` is checked to be exactly a GroupIndex before its field is read
        let kind = unsafe {
            if !self.group.is(g.as_ptr()) || self.group.get(g.as_ptr(), G_KIND).is_null() {
                return Ok(None);
            }
            Bound::from_borrowed_ptr(py, self.group.get(g.as_ptr(), G_KIND))
        };
        if !self.full_kinds.bind(py).contains(kind)? || self.foresight.field(foresight, F_POOLED)?.is_truthy()? {
            return Ok(None);
        }
        let Ok(credits) = self.pending.field(pending, P_BLOCKS)?.cast_into::<Credits>() else { return Ok(None) };
        let (Ok(slots), Ok(grown)) = (self.foresight.field(foresight, F_SLOTS)?.cast_into::<PyDict>(),
                                      self.foresight.field(foresight, F_GROWN)?.cast_into::<PyList>())
        else {
            return Ok(None);
        };
        // SAFETY: `b` is exactly an EventBatch; the field is null-checked before use
        let replica = unsafe { self.batch.get(b, B_REPLICA) };
        if replica.is_null() {
            return Ok(None);
        }
        let pools = self.shard.field(shard, SH_POOL_READERS)?;
        // SAFETY: a live field of the batch
        let deepest_first = !pools.contains(unsafe { Bound::from_borrowed_ptr(py, replica) })?;
        Ok(Some(Routes { credits, slots, grown, active: self.foresight.field(foresight, F_ACTIVE)?.is_truthy()?,
                         deepest_first, bumps: std::cell::Cell::new(0) }))
    }

    /// The fold of a batch into replica `st` (see try_apply): Some(True) folded, Some(False) a
    /// redelivery (st.duplicates counted), None: declined, nothing changed. An event that fails
    /// raises after the counts of those before it are written, as the Python fold leaves them.
    fn fold_batch<'py>(&self, shard: &Bound<'py, PyAny>, groups: &Bound<'py, PyDict>, batch: &Bound<'py, PyAny>,
                       st: &Bound<'py, PyAny>, now: &Bound<'py, PyAny>, hooks: Option<&Hooks<'py>>)
                       -> PyResult<Option<bool>> {
        let py = shard.py();
        let (b, s) = (batch.as_ptr(), st.as_ptr());
        let (b_, r_) = (&self.batch, &self.replica);
        // SAFETY: `batch` and `st` are exactly of their layouts' classes (try_apply); the GIL is held
        let (plan, mut counts) = unsafe {
            let order = |l: &Layout, o, i: [usize; 3]| match (l.int(o, i[0]), l.int(o, i[1]), l.int(o, i[2])) {
                (Some(x), Some(y), Some(z)) if [x, y, z].iter().all(|v| (-BIG..BIG).contains(v)) => Some((x, y, z)),
                _ => None,
            };
            let (Some((epoch, seq, part)), Some((s_epoch, s_seq, s_part))) =
                (order(b_, b, [B_EPOCH, B_SEQ, B_PART]), order(r_, s, [S_EPOCH, S_SEQ, S_PART]))
            else {
                return self.no(Why::Other);
            };
            // (epoch, seq, part) <= the replica's: a redelivery
            if epoch <= s_epoch && (epoch < s_epoch || seq < s_seq || (seq == s_seq && part <= s_part)) {
                let Some(d) = r_.int(s, S_DUPLICATES).filter(|d| *d < BIG) else { return self.no(Why::Other) };
                r_.set_int(s, S_DUPLICATES, d + 1)?;
                return Ok(Some(false));
            }
            match self.plan(groups, b, s, now, (epoch, seq, s_epoch, s_seq))? {
                Some(p) => p,
                None => return Ok(None),
            }
        };
        // from here on the batch is folded
        let host_orders = self.shard.field(shard, SH_HOST_ORDERS)?;
        if let Some(blocks) = &plan.host_tier {  // the replica's host queue starts or stops (TensorRT-LLM)
            shard.call_method1(intern!(py, "_host_tier"), (st, blocks))?;
        }
        let journal = self.shard.field(shard, SH_JOURNAL)?;
        let done = self.run_steps(shard, st, &journal, &host_orders, &plan, &mut counts, hooks);
        self.write_counts(shard, s, &counts)?;
        if let Some(Hooks { native: Some(r), foresight, .. }) = hooks {
            r.flush_version(&self.foresight, foresight)?;
        }
        done?;
        if let Some(h) = hooks {  // the batch's end: copies' evictions uncounted, the orders it grew settle
            let slots = self.foresight.field(&h.foresight, F_SLOTS)?;
            // SAFETY: `batch` is exactly an EventBatch; the field is null-checked before use
            let copies = unsafe { b_.get(b, B_COPIES_REMOVED) };
            if !copies.is_null() && slots.is_truthy()? {
                // SAFETY: a live field of the batch
                let copies = unsafe { Bound::from_borrowed_ptr(py, copies) };
                if copies.is_truthy()? {
                    for item in copies.call_method0(intern!(py, "items"))?.try_iter()? {
                        let (gid, hashes): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
                        h.foresight.call_method1(intern!(py, "uncopied"), (plan.slot, gid, hashes))?;
                    }
                }
            }
            match &h.native {
                Some(r) => r.settle(&h.foresight)?,
                None => {
                    if slots.is_truthy()? && self.foresight.field(&h.foresight, F_GROWN)?.is_truthy()? {
                        h.foresight.call_method0(intern!(py, "settle"))?;
                    }
                }
            }
        }
        // SAFETY: `st` is exactly a ReplicaState; the values written are the batch's, owned by the plan
        // and checked to be ints and floats, and `now` (a float)
        unsafe {
            if let Some(g) = plan.seq_gaps {
                r_.set_int(s, S_SEQ_GAPS, g)?;
            }
            for (i, field) in [S_EPOCH, S_SEQ, S_PART, S_GROUP, S_RECOMPUTE, S_ENGINE_TS, S_RELAY_TS]
                .into_iter().zip(&plan.fields) {
                r_.set_borrowed(s, i, field.as_ptr());
            }
            if let Some(x) = plan.external_after_local {
                r_.set_int(s, S_EXTERNAL_AFTER_LOCAL, x)?;
            }
            if let Some(bs) = &plan.block_size {
                r_.set_borrowed(s, S_BLOCK_SIZE, bs.as_ptr());
            }
            r_.set_borrowed(s, S_APPLIED_TS, now.as_ptr());
            r_.set_int(s, S_BATCHES, plan.batches)?;
            if let Some(x) = plan.lookahead {  // the model's lookahead follows its replicas'
                r_.set_int(s, S_LOOKAHEAD, x)?;
                shard.call_method0(intern!(py, "_lookahead_changed"))?;
            }
        }
        Ok(Some(true))
    }
}

/// The epoch clock every writer stamps batches with (kvidx.core.shard.wall_epoch): wall-clock ms.
fn wall_epoch_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[pymethods]
impl Folder {
    /// Folder(EventBatch, ReplicaState, BlocksStored, BlocksRemoved, ReplicaCleared, GroupIndex,
    /// ModelShard, Foresight, PendingCredits, TIER_IDS, last tier id, MAX_EPOCH_SKEW_MS, FULL_KINDS)
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(batch: &Bound<'_, PyType>, replica: &Bound<'_, PyType>, stored: &Bound<'_, PyType>,
           removed: &Bound<'_, PyType>, cleared: &Bound<'_, PyType>, group: &Bound<'_, PyType>,
           shard: &Bound<'_, PyType>, foresight: &Bound<'_, PyType>, pending: &Bound<'_, PyType>,
           tier_ids: Py<PyDict>, last_tier: Py<PyAny>, max_skew_ms: i64, full_kinds: Py<PyAny>) -> PyResult<Self> {
        Ok(Folder {
            batch: Layout::of(batch, &B_NAMES)?,
            replica: Layout::of(replica, &S_NAMES)?,
            stored: Layout::of(stored, &E_NAMES)?,
            removed: Layout::of(removed, &E_NAMES[..6])?,
            cleared: Layout::of(cleared, &C_NAMES)?,
            group: Layout::of(group, &G_NAMES)?,
            shard: Layout::of(shard, &SH_NAMES)?,
            foresight: Layout::of(foresight, &F_NAMES)?,
            pending: Layout::of(pending, &P_NAMES)?,
            tier_ids,
            last_tier,
            max_skew_ms,
            full_kinds,
            folded: AtomicU64::new(0),
            declines: Default::default(),
            why: AtomicU8::new(Why::Other as u8),
        })
    }

    /// apply(shard, batch, now) -> bool: `ModelShard.apply` compiled. A batch it does not decline (see
    /// try_apply) is folded here; any other is handed to the shard's `fold_reference`, the Python fold.
    fn apply(&self, shard: &Bound<'_, PyAny>, batch: &Bound<'_, PyAny>, now: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.apply_with(shard, batch, now, None)
    }

    /// bind(shard) -> ShardFold, whose `apply(batch, now)` is `self.apply(shard, batch, now)`: the
    /// shard's own `apply` (it holds the shard weakly: no cycle through the shard's attribute).
    fn bind(slf: &Bound<'_, Self>, shard: &Bound<'_, PyAny>) -> PyResult<ShardFold> {
        Ok(ShardFold { folder: slf.clone().unbind(), shard: PyWeakrefReference::new(shard)?.unbind(),
                       replicas: ReplicaCache::default() })
    }

    /// Batches this folder took (redeliveries included) and declined (left to the Python fold).
    #[getter]
    fn folded(&self) -> u64 {
        self.folded.load(Ordering::Relaxed)
    }

    #[getter]
    fn declined(&self) -> u64 {
        self.declines.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    /// The batches declined, by reason: new_replica (its first batch makes it), new_group_or_tier (a
    /// store into one the shard does not have yet), future_epoch (refused, or another clock's epoch
    /// reset), other (a field of another type than the schema's).
    #[getter]
    fn declines<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, n) in WHY.iter().zip(&self.declines) {
            d.set_item(*name, n.load(Ordering::Relaxed))?;
        }
        Ok(d)
    }
}

impl Folder {
    /// `apply`, with the bound shard's replica cache (ShardFold's) where there is one.
    fn apply_with(&self, shard: &Bound<'_, PyAny>, batch: &Bound<'_, PyAny>, now: &Bound<'_, PyAny>,
                  cache: Option<&ReplicaCache>) -> PyResult<bool> {
        self.why.store(Why::Other as u8, Ordering::Relaxed);
        if let Some(done) = self.try_apply(shard, batch, now, cache)? {
            self.folded.fetch_add(1, Ordering::Relaxed);
            return Ok(done);
        }
        self.declines[self.why.load(Ordering::Relaxed) as usize].fetch_add(1, Ordering::Relaxed);
        shard.call_method1(intern!(shard.py(), "fold_reference"), (batch, now))?.extract()
    }

    /// The state of replica (`replica`, `dp_rank`) in the shard's `replicas`, or None: from `cache`
    /// where it has the key, else from the dict (and then into the cache).
    /// SAFETY: `replica` and `dp_rank` are live objects (a batch's fields) while this runs.
    unsafe fn state_of<'py>(&self, shard: &Bound<'py, PyAny>, replicas: &Bound<'py, PyDict>,
                            replica: *mut ffi::PyObject, dp_rank: *mut ffi::PyObject,
                            cache: Option<&ReplicaCache>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = shard.py();
        let by_slot = match cache {
            Some(_) => self.shard.field(shard, SH_BY_SLOT)?.cast_into_exact::<PyList>().ok(),
            None => None,
        };
        let mut key = None;
        if let (Some(c), Some(l)) = (cache, &by_slot) {
            if let Some(k) = CacheKey::of(py, replica, dp_rank) {
                if let Some(st) = c.get(l, &k) {
                    return Ok(Some(Bound::from_borrowed_ptr(py, st)));
                }
                key = Some(k);
            }
        }
        let k = PyTuple::new(py, [Bound::from_borrowed_ptr(py, replica), Bound::from_borrowed_ptr(py, dp_rank)])?;
        let found = replicas.get_item(k)?;
        if let (Some(st), Some(c), Some(k)) = (&found, cache, key) {
            if self.replica.is(st.as_ptr()) {
                if let Some(slot) = self.replica.int(st.as_ptr(), S_SLOT) {
                    c.put(k, slot, st);
                }
            }
        }
        Ok(found)
    }
}

/// Names up to this many bytes of UTF-8 are cached (longer ones: the dict alone).
const NAME: usize = 28;

/// A batch's replica key as the cache holds it: its name's UTF-8 (copied: the dict's lookup may run
/// Python code), its rank and their hash (never 0: 0 marks an empty entry).
struct CacheKey {
    h: u64,
    rank: i64,
    len: u32,
    name: [u8; NAME],
}

impl CacheKey {
    /// The key of an exact str of at most NAME bytes and an exact int of 64 bits; None for anything
    /// else (looked up in the dict alone, with the dict's own equality).
    /// SAFETY: both are live objects.
    unsafe fn of(py: Python<'_>, replica: *mut ffi::PyObject, dp_rank: *mut ffi::PyObject) -> Option<Self> {
        if ffi::PyUnicode_CheckExact(replica) == 0 || ffi::PyLong_CheckExact(dp_rank) == 0
            || ffi::PyUnicode_GetLength(replica) > NAME as ffi::Py_ssize_t  // (more bytes than characters)
        {
            return None;
        }
        let mut n: ffi::Py_ssize_t = 0;
        let p = ffi::PyUnicode_AsUTF8AndSize(replica, &mut n);
        if p.is_null() {
            PyErr::take(py);  // a lone surrogate: the dict decides
            return None;
        }
        let rank = ffi::PyLong_AsLongLong(dp_rank);
        if rank == -1 && PyErr::take(py).is_some() {
            return None;
        }
        let n = n as usize;
        if n > NAME {
            return None;
        }
        let mut name = [0u8; NAME];
        name[..n].copy_from_slice(std::slice::from_raw_parts(p as *const u8, n));
        let mut f = Fx::default();
        for w in name.chunks_exact(4).take(n.div_ceil(4)) {
            f.write_u32(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        }
        f.write_u64(((n as u64) << 32) ^ rank as u64);
        Some(CacheKey { h: f.finish() | 1, rank, len: n as u32, name })
    }
}

#[repr(C, align(64))]
struct Cached {
    key: CacheKey,
    slot: i64,
    state: Option<Py<PyAny>>,  // held: its address is no other object's while it is here
}

/// A shard's replica states by (name, rank), ahead of its `replicas` dict: that lookup built a tuple,
/// hashed the freshly decoded name and compared it with the dict's key tuple and name, two objects a
/// fleet's batches cold (perf at 2,048 replicas, bench/peers w2048: ~15 % of the ingest pass). One
/// 64-byte entry a replica, open addressing; made on the dict's hits only (at most one per replica
/// the shard has had). An entry is used only while `by_slot[slot]` is still its state: the shard keeps
/// `by_slot` and `replicas` in step (a state joins or leaves both: ModelShard.replica, absorb, a
/// snapshot's restore), so that is what the dict holds for the key. A stale entry (its state merged
/// over by `absorb`) keeps that state alive until its key comes again and replaces it.
#[derive(Default)]
pub struct ReplicaCache(Mutex<(Vec<Cached>, usize)>);  // (entries: 0 or a power of two, used)

impl ReplicaCache {
    /// SAFETY: `by_slot` is a live list; the GIL is held.
    unsafe fn get(&self, by_slot: &Bound<'_, PyList>, k: &CacheKey) -> Option<*mut ffi::PyObject> {
        let t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = Self::find(&t.0, k)?;
        let e = &t.0[i];
        let st = e.state.as_ref()?.as_ptr();
        let l = by_slot.as_ptr();
        let live = usize::try_from(e.slot).is_ok_and(|s| {
            s < ffi::PyList_GET_SIZE(l) as usize && ffi::PyList_GET_ITEM(l, s as ffi::Py_ssize_t) == st
        });
        live.then_some(st)
    }

    /// The entry of `k`, or the empty one where it would go; None if there are no entries.
    fn find(t: &[Cached], k: &CacheKey) -> Option<usize> {
        if t.is_empty() {
            return None;
        }
        let mask = t.len() - 1;
        let mut i = k.h as usize & mask;
        loop {
            let e = &t[i].key;
            if e.h == 0 || (e.h == k.h && e.rank == k.rank && e.len == k.len && e.name == k.name) {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// (An entry whose state is not at its slot is never used: `get` checks every hit.)
    fn put(&self, k: CacheKey, slot: i64, st: &Bound<'_, PyAny>) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if 2 * (t.1 + 1) > t.0.len() {  // at most half full
            let n = (2 * t.0.len()).max(16);
            let old = std::mem::replace(&mut t.0, (0..n).map(|_| Cached::empty()).collect());
            for e in old.into_iter().filter(|e| e.key.h != 0) {
                let i = Self::find(&t.0, &e.key).expect("a table with room");
                t.0[i] = e;
            }
        }
        let i = Self::find(&t.0, &k).expect("a table with room");
        if t.0[i].key.h == 0 {
            t.1 += 1;
        }
        let old = std::mem::replace(&mut t.0[i], Cached { key: k, slot, state: Some(st.clone().unbind()) });
        drop(t);
        drop(old);  // (a stale state freed after the lock: freeing runs no code of ours under it)
    }
}

impl Cached {
    fn empty() -> Self {
        Cached { key: CacheKey { h: 0, rank: 0, len: 0, name: [0; NAME] }, slot: -1, state: None }
    }
}

/// A shard's compiled `apply` (Folder.bind), with the shard's replica cache.
#[pyclass(name = "ShardFold", module = "kvidx_native", frozen)]
pub struct ShardFold {
    folder: Py<Folder>,
    shard: Py<PyWeakrefReference>,
    replicas: ReplicaCache,
}

#[pymethods]
impl ShardFold {
    /// apply(batch, now) -> bool: ModelShard.apply (Folder.apply on the bound shard).
    fn apply(&self, py: Python<'_>, batch: &Bound<'_, PyAny>, now: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Some(shard) = self.shard.bind(py).upgrade() else {
            return Err(pyo3::exceptions::PyReferenceError::new_err("the shard of this fold is gone"));
        };
        self.folder.get().apply_with(&shard, batch, now, Some(&self.replicas))
    }
}
