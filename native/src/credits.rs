//! Pending credit's bookkeeping (kvidx/core/pending.py `_Credits`), compiled: a route adds a count per
//! (block, slot) and the slot's bit to the block's mask; an engine's store of the block confirms it
//! there (the count and the bit go). The Python loops are the reference (`_Credits.add`, `confirm`,
//! used where this module is not built; tests/unit/core/test_pending.py runs both). The dicts stay
//! Python's: lookups read the masks as they always did.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyTuple};

/// add(refs, masks, slot, hashes): for each hash, refs[(h, slot)] += 1 and masks[h] |= 1 << slot.
#[pyfunction]
pub fn credits_add(refs: &Bound<'_, PyDict>, masks: &Bound<'_, PyDict>, slot: &Bound<'_, PyInt>,
                   hashes: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = refs.py();
    let bit = 1i64.into_pyobject(py)?.lshift(slot)?;
    for h in hashes.try_iter()? {
        let h = h?;
        let key = PyTuple::new(py, [h.as_any(), slot.as_any()])?;
        let n: i64 = match refs.get_item(&key)? {
            Some(v) => v.extract()?,
            None => 0,
        };
        refs.set_item(key, n + 1)?;
        let m = match masks.get_item(&h)? {
            Some(v) => v.bitor(&bit)?,
            None => bit.clone(),
        };
        masks.set_item(h, m)?;
    }
    Ok(())
}

/// confirm(refs, masks, slot, hashes): each hash with a live count on `slot` is no longer pending
/// there: its count goes, and its bit (the mask goes when no slot is left).
#[pyfunction]
pub fn credits_confirm(refs: &Bound<'_, PyDict>, masks: &Bound<'_, PyDict>, slot: &Bound<'_, PyInt>,
                       hashes: &Bound<'_, PyAny>) -> PyResult<()> {
    drop_counts(refs, masks, slot, hashes, false)
}

/// release(refs, masks, slot, hashes): one route crediting each hash on `slot` expired: its count
/// drops by one, and at zero the count and the bit go (`_Credits.drop(h, slot, 1)` for each).
#[pyfunction]
pub fn credits_release(refs: &Bound<'_, PyDict>, masks: &Bound<'_, PyDict>, slot: &Bound<'_, PyInt>,
                       hashes: &Bound<'_, PyAny>) -> PyResult<()> {
    drop_counts(refs, masks, slot, hashes, true)
}

/// Drops each hash's count on `slot` (one route's with `one`, else all of them); a count gone takes
/// the slot's bit from the hash's mask.
fn drop_counts(refs: &Bound<'_, PyDict>, masks: &Bound<'_, PyDict>, slot: &Bound<'_, PyInt>,
               hashes: &Bound<'_, PyAny>, one: bool) -> PyResult<()> {
    let py = refs.py();
    let mut keep: Option<Bound<'_, PyAny>> = None;  // ~(1 << slot), made on the first count gone
    for h in hashes.try_iter()? {
        let h = h?;
        let key = PyTuple::new(py, [h.as_any(), slot.as_any()])?;
        let Some(r) = refs.get_item(&key)? else { continue };
        if one {
            let r: i64 = r.extract()?;
            if r > 1 {
                refs.set_item(key, r - 1)?;
                continue;
            }
        } else if !r.is_truthy()? {
            continue;
        }
        refs.del_item(key)?;
        let keep = match &keep {
            Some(k) => k,
            None => keep.insert(1i64.into_pyobject(py)?.lshift(slot)?.bitnot()?),
        };
        if let Some(m) = masks.get_item(&h)? {
            let left = m.bitand(keep)?;
            if left.is_truthy()? {
                masks.set_item(h, left)?;
            } else {
                masks.del_item(h)?;
            }
        }
    }
    Ok(())
}
