//! A lookup answer written straight to JSON bytes, for the common shard: one full-attention group in
//! one tier, no shared pools, no group kinds or tiers whose evictions go unreported. kvidx/core/walk.py
//! `kvidx.core.walk.lookup_json` decides when it applies and passes what the walk found; everything per
//! replica (resume point, pending credit, tiers, groups, freshness, price, ranking) is done here, in
//! the order and with the arithmetic of the Python lookup (`kvidx.core.walk.lookup`, `Pricer`), which stays
//! the reference: tests/unit/index_service/test_answer_json.py compares the two on random shards.

use pyo3::prelude::*;
use pyo3::ffi;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyType};

use crate::layout::Layout;
use crate::Depths;

struct Row<'py> {
    name: Bound<'py, PyString>,
    dp_rank: i64,
    cached: i64,
    tier_tokens: i64,
    resumable: i64,
    fa_hit: i64,
    blocks: i64,
    pending: i64,
    inflight: i64,
    freshness: Option<(f64, f64)>,
    epoch: i64,
    seq: i64,
    seq_gaps: i64,
    prefill: i64,
    prefill_s: f64,
    load_s: f64,
    queue_s: f64,
    total_s: f64,
}

/// Engines never serve the last prompt token from cache and resume at a block boundary
/// (walk.py `resumable`).
fn resumable(cached: i64, n_tokens: i64, block: i64) -> i64 {
    if n_tokens <= 1 || block <= 0 {
        return 0;
    }
    (cached.min(n_tokens - 1)).div_euclid(block) * block
}

/// A walk's depth of `slot` (MaskMap.walk's Depths, or a dict from the Python walk), 0 if absent.
fn get_i64(d: Option<&Bound<'_, PyAny>>, slot: i64) -> PyResult<i64> {
    let Some(d) = d else { return Ok(0) };
    if let Ok(x) = d.cast::<Depths>() {
        return Ok(x.get().depth(slot) as i64);
    }
    match d.cast::<PyDict>()?.get_item(slot)? {
        Some(v) => v.extract(),
        None => Ok(0),
    }
}

/// The replica state fields the answer reads, in the order of the indices below.
const R_NAMES: [&str; 13] = ["slot", "block_size", "recompute", "unit", "group_blocks", "batches", "engine_ts",
                             "applied_ts", "replica", "dp_rank", "epoch", "seq", "seq_gaps"];
const SLOT: usize = 0;
const BLOCK_SIZE: usize = 1;
const RECOMPUTE: usize = 2;
const UNIT: usize = 3;
const GROUP_BLOCKS: usize = 4;
const BATCHES: usize = 5;
const ENGINE_TS: usize = 6;
const APPLIED_TS: usize = 7;
const REPLICA: usize = 8;
const DP_RANK: usize = 9;
const EPOCH: usize = 10;
const SEQ: usize = 11;
const SEQ_GAPS: usize = 12;

/// Where kvidx.core.shard.ReplicaState keeps the fields an answer reads (layout.rs): a replica's
/// dozen fields, 64 replicas a lookup, by attribute lookup were ~40 % of the answer's time.
#[pyclass(frozen)]
pub struct ReplicaFields {
    layout: Layout,
}

#[pymethods]
impl ReplicaFields {
    #[new]
    fn new(replica_state: &Bound<'_, PyType>) -> PyResult<Self> {
        Ok(ReplicaFields { layout: Layout::of(replica_state, &R_NAMES)? })
    }
}

/// A replica state's fields: at their offsets when it is exactly the class of `fields`, else (any
/// other object, or no `fields`) by attribute lookup.
struct Reader<'a> {
    fields: Option<&'a ReplicaFields>,
}

impl Reader<'_> {
    fn get<'py>(&self, st: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        if let Some(f) = self.fields {
            if f.layout.is(st.as_ptr()) {
                // SAFETY: `st` is exactly the layout's class; the slot holds an object or null
                let p = unsafe { f.layout.get(st.as_ptr(), i) };
                if !p.is_null() {
                    // SAFETY: a live object in the slot, taken as a new reference
                    return Ok(unsafe { Bound::from_borrowed_ptr(st.py(), p) });
                }
            }
        }
        st.getattr(PyString::intern(st.py(), R_NAMES[i]))
    }

    /// Field `i` converted by the C API's `conv` (which returns `failed` with an exception set on error).
    fn conv<T: Copy + PartialEq>(&self, st: &Bound<'_, PyAny>, i: usize,
                                 conv: unsafe extern "C" fn(*mut ffi::PyObject) -> T, failed: T) -> PyResult<T> {
        let v = self.get(st, i)?;
        // SAFETY: the GIL is held and `v` is owned until the end of the call
        let x = unsafe { conv(v.as_ptr()) };
        if x == failed && PyErr::occurred(st.py()) {
            return Err(PyErr::fetch(st.py()));
        }
        Ok(x)
    }

    fn int(&self, st: &Bound<'_, PyAny>, i: usize) -> PyResult<i64> {
        self.conv(st, i, ffi::PyLong_AsLongLong, -1)
    }

    fn float(&self, st: &Bound<'_, PyAny>, i: usize) -> PyResult<f64> {
        self.conv(st, i, ffi::PyFloat_AsDouble, -1.0)
    }
}

/// Python's float(int(x * 1e6)) / 1e3: milliseconds, truncated to the microsecond.
fn ms(seconds: f64) -> f64 {
    ((seconds * 1e6).trunc() as i64) as f64 / 1e3
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0..=0x1f => out.extend_from_slice(format!("\\u{:04x}", b).as_bytes()),
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

fn push_int(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// Floats as Python's repr writes them (ryu), the last few remembered: an answer's prices repeat
/// across replicas with the same hit (and 0.0 is most of them), so most are copied, not formatted.
struct Floats {
    bits: [u64; 8],
    text: [[u8; 24]; 8],
    len: [u8; 8],
    next: usize,
}

impl Floats {
    fn new() -> Self {
        Floats { bits: [u64::MAX; 8], text: [[0; 24]; 8], len: [0; 8], next: 0 }
    }

    fn push(&mut self, out: &mut Vec<u8>, v: f64) {
        let b = v.to_bits();
        if b == 0 {
            out.extend_from_slice(b"0.0");
            return;
        }
        if let Some(i) = self.bits.iter().position(|&x| x == b) {
            out.extend_from_slice(&self.text[i][..self.len[i] as usize]);
            return;
        }
        let mut buf = ryu::Buffer::new();
        let t = buf.format(v).as_bytes();
        out.extend_from_slice(t);
        if t.len() <= 24 {
            let i = self.next;
            self.next = (i + 1) % 8;
            self.bits[i] = b;
            self.text[i][..t.len()].copy_from_slice(t);
            self.len[i] = t.len() as u8;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (model, n_tokens, block_size, states, hits, with_pending, inflight, group, kind, tier,
                    now, pending_block_size, per_token, load_cost, rank, top_k, tails=None, fields=None,
                    priced=true))]
pub fn lookup_json<'py>(
    py: Python<'py>,
    model: &str,
    n_tokens: i64,
    block_size: i64,
    states: &Bound<'py, PyList>,
    hits: &Bound<'py, PyAny>,
    with_pending: Option<&Bound<'py, PyAny>>,
    inflight: Option<&Bound<'py, PyDict>>,
    group: i64,
    kind: &str,
    tier: &str,
    now: f64,
    pending_block_size: i64,
    per_token: f64,
    load_cost: f64,
    rank: bool,
    top_k: Option<usize>,
    tails: Option<&Bound<'py, PyDict>>,
    fields: Option<&Bound<'py, ReplicaFields>>,
    priced: bool,  // false: no `price` (the in-process lookup's unpriced answers, kvidx.index.lookup)
) -> PyResult<(Bound<'py, PyBytes>, i64, usize, i64)> {
    let bs = block_size;
    let rd = Reader { fields: fields.map(|f| f.get()) };
    let mut rows: Vec<Row<'py>> = Vec::with_capacity(states.len());
    for st in states.iter() {
        if st.is_none() {
            continue;
        }
        let slot: i64 = rd.int(&st, SLOT)?;
        let ebs0: i64 = rd.int(&st, BLOCK_SIZE)?;
        let recompute: i64 = rd.int(&st, RECOMPUTE)?;
        let unit: i64 = rd.int(&st, UNIT)?;
        let nb = get_i64(Some(hits), slot)?;
        // tokens of the partial block after the whole ones (walk.py tail_hits: partial-block keys)
        let held = nb * bs + get_i64(tails.map(|d| d.as_any()), slot)?;
        let n_eff = n_tokens - (recompute - 1);
        // the resume point (walk.py resume_points, one full-attention group): token-granular reuse
        // (unit 1) at any token below the last, else at the engine's block size
        let top = if held > 0 {
            resumable(held.min(n_eff), n_eff, if unit == 1 { 1 } else if ebs0 != 0 { ebs0 } else { bs })
        } else {
            0
        };
        let mut pending = 0;
        if with_pending.is_some() {
            let w = get_i64(with_pending, slot)?;
            if w > nb {
                let ebs = if ebs0 != 0 { ebs0 } else { pending_block_size };
                pending = (resumable((w * bs).min(n_eff), n_eff, ebs) - top).max(0);
            }
        }
        let group_blocks = rd.get(&st, GROUP_BLOCKS)?;
        let blocks: i64 = match group_blocks.cast::<PyDict>()?.get_item(group)? {
            Some(v) => v.extract()?,
            None => 0,
        };
        let batches: i64 = rd.int(&st, BATCHES)?;
        let freshness = if batches > 0 {
            let ets: f64 = rd.float(&st, ENGINE_TS)?;
            let ats: f64 = rd.float(&st, APPLIED_TS)?;
            Some((ms(now - ets), ms(ats - ets)))
        } else {
            None
        };
        rows.push(Row {
            name: rd.get(&st, REPLICA)?.cast_into::<PyString>()?,
            dp_rank: rd.int(&st, DP_RANK)?,
            cached: held.min(n_tokens),
            tier_tokens: held,
            resumable: top + pending,
            fa_hit: top,
            blocks,
            pending,
            inflight: get_i64(inflight.map(|d| d.as_any()), slot)?,
            freshness,
            epoch: rd.int(&st, EPOCH)?,
            seq: rd.int(&st, SEQ)?,
            seq_gaps: rd.int(&st, SEQ_GAPS)?,
            prefill: 0,
            prefill_s: 0.0,
            load_s: 0.0,
            queue_s: 0.0,
            total_s: 0.0,
        });
    }
    rows.sort_by(|a, b| b.resumable.cmp(&a.resumable)); // stable: slot order among equals
    if let (Some(k), false) = (top_k, rank) {
        rows.truncate(k);
    }
    for r in rows.iter_mut().filter(|_| priced || rank) {  // unpriced and unranked: no price needed
        // the prefix price (kvidx/core/price.py Pricer), in its operation order
        r.load_s = if r.resumable > 0 && r.tier_tokens > 0 {
            r.tier_tokens.min(r.resumable) as f64 * load_cost
        } else {
            0.0
        };
        r.prefill = n_tokens - r.resumable;
        r.prefill_s = r.prefill as f64 * per_token;
        r.queue_s = r.inflight as f64 * per_token;
        r.total_s = r.queue_s + r.load_s + r.prefill_s;
    }
    if rank {
        rows.sort_by(|a, b| a.total_s.partial_cmp(&b.total_s).unwrap_or(std::cmp::Ordering::Equal));
        if let Some(k) = top_k {
            rows.truncate(k);
        }
    }
    let mut out: Vec<u8> = Vec::with_capacity(128 + rows.len() * 560);
    let mut floats = Floats::new();
    out.extend_from_slice(b"{\"model\":");
    push_str(&mut out, model);
    out.extend_from_slice(b",\"prompt_tokens\":");
    push_int(&mut out, n_tokens);
    out.extend_from_slice(b",\"block_size\":");
    push_int(&mut out, bs);
    out.extend_from_slice(b",\"replicas\":[");
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"replica\":");
        push_str(&mut out, r.name.to_str()?);
        out.extend_from_slice(b",\"dp_rank\":");
        push_int(&mut out, r.dp_rank);
        out.extend_from_slice(b",\"cached_tokens\":");
        push_int(&mut out, r.cached);
        out.extend_from_slice(b",\"tiers\":[");
        if r.tier_tokens > 0 {
            out.extend_from_slice(b"{\"tier\":");
            push_str(&mut out, tier);
            out.extend_from_slice(b",\"tokens\":");
            push_int(&mut out, r.tier_tokens);
            out.push(b'}');
        }
        out.extend_from_slice(b"],\"resumable_tokens\":");
        push_int(&mut out, r.resumable);
        out.extend_from_slice(b",\"full_attention_hit_tokens\":");
        push_int(&mut out, r.fa_hit);
        out.extend_from_slice(b",\"groups\":[{\"group\":");
        push_int(&mut out, group);
        out.extend_from_slice(b",\"kind\":");
        push_str(&mut out, kind);
        out.extend_from_slice(b",\"hit_tokens\":");
        push_int(&mut out, r.fa_hit);
        out.extend_from_slice(b",\"blocks\":");
        push_int(&mut out, r.blocks);
        out.extend_from_slice(b"}],\"pending_tokens\":");
        push_int(&mut out, r.pending);
        out.extend_from_slice(b",\"inflight_prefill_tokens\":");
        push_int(&mut out, r.inflight);
        out.extend_from_slice(b",\"upper_bound\":false,\"upper_bound_groups\":[],\"freshness\":{\"last_event_age_ms\":");
        match r.freshness {
            Some((age, lag)) => {
                floats.push(&mut out, age);
                out.extend_from_slice(b",\"apply_lag_ms\":");
                floats.push(&mut out, lag);
            }
            None => out.extend_from_slice(b"null,\"apply_lag_ms\":null"),
        }
        out.extend_from_slice(b",\"epoch\":");
        push_int(&mut out, r.epoch);
        out.extend_from_slice(b",\"seq\":");
        push_int(&mut out, r.seq);
        out.extend_from_slice(b",\"seq_gaps\":");
        push_int(&mut out, r.seq_gaps);
        // the clock the ages start on (schemas.answers.Freshness.age_clock)
        out.extend_from_slice(b",\"age_clock\":\"engine\"}");
        if priced {
            out.extend_from_slice(b",\"price\":{\"prefill_tokens\":");
            push_int(&mut out, r.prefill);
            out.extend_from_slice(b",\"prefill_s\":");
            floats.push(&mut out, r.prefill_s);
            out.extend_from_slice(b",\"load_s\":");
            floats.push(&mut out, r.load_s);
            out.extend_from_slice(b",\"queue_s\":");
            floats.push(&mut out, r.queue_s);
            out.extend_from_slice(b",\"total_s\":");
            floats.push(&mut out, r.total_s);
            out.push(b'}');
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    let best = rows.first().map(|r| r.resumable).unwrap_or(0);
    let cached = rows.iter().map(|r| r.cached).max().unwrap_or(0);
    Ok((PyBytes::new(py, &out), best, rows.len(), cached))
}
