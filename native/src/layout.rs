//! Where a msgspec Struct or a `__slots__` class keeps its fields: slots of object pointers at fixed
//! offsets, given by the class's member descriptors. `Layout::of` takes them from there once; every
//! object is checked to be of exactly that class before it is read (`field`: of that class or a
//! subclass, which keeps its slots' offsets; anything else by getattr). The C API's attribute lookup
//! (the type's MRO, then the descriptor) is slower than the interpreter's own specialised access:
//! the compiled fold (fold.rs) and the lookup answer (answer.rs) read their fields this way.

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};

/// The C layout of a member descriptor (CPython's PyMemberDescrObject, every version >= 3.8).
#[repr(C)]
struct MemberDescr {
    common: ffi::PyDescrObject,
    member: *mut ffi::PyMemberDef,
}

/// Where a class keeps its fields (slots of object pointers).
pub(crate) struct Layout {
    ty: Py<PyType>,
    offsets: Vec<isize>,
    names: Vec<Py<PyString>>,  // for `field`'s getattr on objects of other classes
}

impl Layout {
    pub(crate) fn of(ty: &Bound<'_, PyType>, names: &[&str]) -> PyResult<Self> {
        let mut offsets = Vec::with_capacity(names.len());
        let interned = names.iter().map(|n| PyString::intern(ty.py(), n).unbind()).collect();
        for name in names {
            let d = ty.getattr(*name)?;
            // SAFETY: the type of `d` is checked to be the member descriptor type before it is read
            let off = unsafe {
                if ffi::Py_TYPE(d.as_ptr()) != std::ptr::addr_of_mut!(ffi::PyMemberDescr_Type) {
                    return Err(PyTypeError::new_err(format!("{}.{name} is not a slot", ty.name()?)));
                }
                let m = (*(d.as_ptr() as *mut MemberDescr)).member;
                if (*m).type_code != ffi::Py_T_OBJECT_EX {
                    return Err(PyTypeError::new_err(format!("{}.{name} is not an object slot", ty.name()?)));
                }
                (*m).offset
            };
            offsets.push(off);
        }
        Ok(Layout { ty: ty.clone().unbind(), offsets, names: interned })
    }

    #[inline(always)]
    pub(crate) fn is(&self, ob: *mut ffi::PyObject) -> bool {
        // SAFETY: `ob` is a live object
        unsafe { ffi::Py_TYPE(ob) == self.ty.as_ptr() as *mut ffi::PyTypeObject }
    }

    /// `ob` is of this class or a subclass (whose instances keep the class's slots where they are).
    #[inline(always)]
    fn has_slots(&self, ob: &Bound<'_, PyAny>) -> bool {
        // SAFETY: `ob` is a live object, the type a live type object
        self.is(ob.as_ptr())
            || unsafe { ffi::PyType_IsSubtype(ffi::Py_TYPE(ob.as_ptr()), self.ty.as_ptr().cast()) != 0 }
    }

    /// `ob.<name i>`: read at its slot where `ob` has this class's slots, else by getattr.
    #[inline(always)]
    pub(crate) fn field<'py>(&self, ob: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        if self.has_slots(ob) {
            // SAFETY: `ob` has this class's slots (has_slots); a set slot is a live object it holds
            let p = unsafe { self.get(ob.as_ptr(), i) };
            if !p.is_null() {
                // SAFETY: as above; a new reference is taken while `ob` holds it
                return Ok(unsafe { Bound::from_borrowed_ptr(ob.py(), p) });
            }
        }
        ob.getattr(self.names[i].bind(ob.py()))
    }

    /// `ob.<name i> = v`: at its slot where `ob` has this class's slots, else by setattr.
    pub(crate) fn set_field_int(&self, ob: &Bound<'_, PyAny>, i: usize, v: i64) -> PyResult<()> {
        if self.has_slots(ob) {
            // SAFETY: `ob` has this class's slots (has_slots); an int is written
            return unsafe { self.set_int(ob.as_ptr(), i, v) };
        }
        ob.setattr(self.names[i].bind(ob.py()), v)
    }

    /// Field `i` of `ob` (borrowed; null if unset). `ob` must be of this class (`is`), or, for a
    /// `__slots__` class, of a subclass (`has_slots`).
    #[inline(always)]
    pub(crate) unsafe fn get(&self, ob: *mut ffi::PyObject, i: usize) -> *mut ffi::PyObject {
        *((ob as *mut u8).offset(self.offsets[i]) as *mut *mut ffi::PyObject)
    }

    /// Sets field `i` of `ob` to `v` (a new reference, taken). Only for ints and floats: a msgspec
    /// Struct's own setattr also re-tracks it for the garbage collector when given a container.
    #[inline(always)]
    pub(crate) unsafe fn set(&self, ob: *mut ffi::PyObject, i: usize, v: *mut ffi::PyObject) {
        let p = (ob as *mut u8).offset(self.offsets[i]) as *mut *mut ffi::PyObject;
        let old = *p;
        *p = v;
        ffi::Py_XDECREF(old);
    }

    #[inline(always)]
    pub(crate) unsafe fn set_borrowed(&self, ob: *mut ffi::PyObject, i: usize, v: *mut ffi::PyObject) {
        ffi::Py_INCREF(v);
        self.set(ob, i, v);
    }

    #[inline(always)]
    pub(crate) unsafe fn set_int(&self, ob: *mut ffi::PyObject, i: usize, v: i64) -> PyResult<()> {
        let n = ffi::PyLong_FromLongLong(v);
        if n.is_null() {
            return Err(PyErr::fetch(Python::assume_attached()));
        }
        self.set(ob, i, n);
        Ok(())
    }

    /// Field `i` as an i64, if it is an int that fits.
    #[inline(always)]
    pub(crate) unsafe fn int(&self, ob: *mut ffi::PyObject, i: usize) -> Option<i64> {
        int_of(self.get(ob, i))
    }
}

#[inline(always)]
unsafe fn int_of(p: *mut ffi::PyObject) -> Option<i64> {
    if p.is_null() || ffi::PyLong_CheckExact(p) == 0 {
        return None;
    }
    let mut overflow = 0;
    let v = ffi::PyLong_AsLongLongAndOverflow(p, &mut overflow);
    if overflow != 0 || (v == -1 && !ffi::PyErr_Occurred().is_null()) {
        ffi::PyErr_Clear();
        return None;
    }
    Some(v)
}
