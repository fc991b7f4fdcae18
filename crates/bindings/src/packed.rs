//! Recorded values on Python objects: `Packer` validates a value and packs it (long strings
//! handed to the graph's blob table as references), `unpack` rebuilds one.
//!
//! The walk accepts what the library records: dict, list, tuple, str, int, float, bool and
//! None, their subclasses read as the base type, dict keys of str, int, float, bool or None.
//! A bad value raises `RefusedValue(message, path)`, the path inside the value where it is
//! (`.content[1].image_url`); the path is assembled only while the error propagates, so valid
//! input pays nothing for it.

use std::collections::HashMap;
use std::ffi::c_char;

use engine::packed as ep;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};

use crate::{RefusedValue, DETACH_FROM};

/// Containers nested deeper than this are refused (`json.dumps` itself fails near 1000).
pub const MAX_DEPTH: usize = 500;

const TOO_MANY_DIGITS: &str = "an int with more digits than Python writes as text \
    (sys.get_int_max_str_digits()): json.dumps cannot write it either";
const CYCLE: &str = "reference cycle (a container contains itself)";

/// A refused value: the message and the path pieces met while unwinding, innermost first.
struct Bad {
    message: String,
    trail: Vec<String>,
    /// for a cycle: how many of the outermost pieces name the place where it closes
    keep: Option<usize>,
}

enum Fail {
    Bad(Box<Bad>),
    Py(PyErr),
}

impl From<PyErr> for Fail {
    fn from(err: PyErr) -> Self {
        Fail::Py(err)
    }
}

/// What `json.dumps` says of a dict subclass whose `items()` yields other than 2-tuples.
pub(crate) const ITEMS_PAIRS: &str = "items must return 2-tuples";

/// A member yielded by a dict subclass's `items()`: a tuple of two, as `json.dumps` takes it.
pub(crate) fn item_pair<'py>(
    pair: &Bound<'py, PyAny>,
) -> Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let pair = pair.cast::<PyTuple>().ok()?;
    if pair.len() != 2 {
        return None;
    }
    Some((pair.get_item(0).ok()?, pair.get_item(1).ok()?))
}

fn bad(message: String) -> Fail {
    Fail::Bad(Box::new(Bad {
        message,
        trail: Vec::new(),
        keep: None,
    }))
}

/// Adds a path piece to a refusal on its way out.
fn within(fail: Fail, piece: impl FnOnce() -> PyResult<String>) -> Fail {
    match fail {
        Fail::Bad(mut b) => match piece() {
            Ok(p) => {
                b.trail.push(p);
                Fail::Bad(b)
            }
            Err(err) => Fail::Py(err),
        },
        py @ Fail::Py(_) => py,
    }
}

/// Validates and packs values for one graph (not shared between threads: the graph uses it
/// under its lock).
#[pyclass(module = "rollout_store._core")]
pub struct Packer {
    /// `blobs.intern`, or None: every string inline (the canonical plain packing)
    intern: Option<Py<PyAny>>,
    threshold: Option<usize>,
    ext_type: Py<PyType>,
    #[pyo3(get)]
    last_special: bool,
    #[pyo3(get)]
    last_refs: bool,
    #[pyo3(get)]
    last_longest: usize,
    /// a buffer kept from one packing to the next while it stays small
    buffer: Vec<u8>,
}

/// A packing buffer larger than this is not kept between packings.
const KEEP_BUFFER: usize = 1 << 12;

// (its flags are independent facts the walk notes as it goes, no state machine)
#[allow(clippy::struct_excessive_bools)]
struct Walk<'p> {
    intern: Option<&'p Bound<'p, PyAny>>,
    threshold: Option<usize>,
    ext_type: &'p Bound<'p, PyType>,
    out: Vec<u8>,
    special: bool,
    refs: bool,
    longest: usize,
    /// containers being walked, outermost first (for the cycle report)
    open: Vec<usize>,
    /// strings of this many code points or more are long (see `holes`, `long_seen`)
    hole_min: usize,
    /// a hollow walk: each long string written as a hole (`EXT_HOLE` and its length) and
    /// kept here, in order, to be compared rather than hashed
    holes: Option<Vec<Py<PyString>>>,
    /// a plain walk met a long string
    long_seen: bool,
    /// a subclass was read through its own Python code (a dict's `items()`, a list's or
    /// tuple's iteration), which another walk of the same value may see answer otherwise
    called: bool,
}

/// A hole in a hollow packing (see `Walk::holes`): a code no plain packing holds.
const EXT_HOLE: i8 = 6;

/// What `Packer::pack_range` wrote: the packings one after the other, where each ends, the
/// long strings of a hollow walk, and whether a plain walk met one.
pub(crate) struct Packed {
    pub buffer: Vec<u8>,
    pub ends: Vec<usize>,
    pub holes: Vec<Py<PyString>>,
    pub long_seen: bool,
    /// the walk read a subclass through its own Python code (see `Walk::called`)
    pub called: bool,
}

#[pymethods]
impl Packer {
    /// `intern`: the blob table's `packer_intern` (str -> the blob's number << 1 | whether it
    /// holds lone surrogates), or None for plain packings; `threshold`: strings of this many
    /// code points or more go there.
    #[new]
    #[pyo3(signature = (intern, threshold))]
    fn new(py: Python<'_>, intern: Option<Py<PyAny>>, threshold: Option<usize>) -> PyResult<Self> {
        let ext_type = py
            .import(intern!(py, "msgpack"))?
            .getattr(intern!(py, "ExtType"))?
            .cast_into::<PyType>()?
            .unbind();
        Ok(Self {
            threshold: if intern.is_some() { threshold } else { None },
            intern,
            ext_type,
            last_special: false,
            last_refs: false,
            last_longest: 0,
            buffer: Vec::new(),
        })
    }

    /// The packing of `value`; `last_special` then tells whether it holds a tuple, a big int
    /// or a lone surrogate. `RefusedValue(message, path)` for a bad value; exceptions of
    /// `intern` pass through.
    fn pack<'py>(
        &mut self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.pack_inner(py, value, false)
    }

    /// Tests only: `pack`, then a Rust panic before anything is returned (blobs interned by
    /// the walk stay interned: the caller's rollback must undo them).
    fn _pack_then_panic<'py>(
        &mut self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.pack_inner(py, value, true)
    }

    /// Let the kept buffer go.
    fn release(&mut self) {
        self.buffer = Vec::new();
    }

    // the garbage collector sees `intern` (a bound method of the blob table), so a cycle
    // through a packer is collected
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Some(intern) = &self.intern {
            visit.call(intern)?;
        }
        visit.call(&self.ext_type)
    }

    fn __clear__(&mut self) {
        self.intern = None;
    }
}

impl Packer {
    /// The packings of `messages[range]`, one after the other in one buffer, with the offset
    /// where each ends: no `bytes` object a message (the caller makes those it keeps).
    /// `hollow`: each string of `hole_min` code points or more written as a hole and kept
    /// (`Packed::holes`), else only noted (`Packed::long_seen`). `last_*` then tell of a
    /// plain walk's messages (those of `range` alone). Raises what `pack` raises (the path
    /// names the message: `[i]...`); `ValueError` for a packer that interns long strings.
    /// `capacity`: the bytes the packings are expected to take (a buffer grown by doubling
    /// would copy a large request's packings several times over).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pack_range(
        &mut self,
        py: Python<'_>,
        messages: &Bound<'_, PyList>,
        range: std::ops::Range<usize>,
        hole_min: usize,
        hollow: bool,
        capacity: usize,
    ) -> PyResult<Packed> {
        if self.intern.is_some() {
            return Err(PyValueError::new_err(
                "messages are found by their plain packings: a packer without intern",
            ));
        }
        let mut walk = self.walk(py, Vec::with_capacity(capacity));
        walk.hole_min = hole_min;
        walk.holes = hollow.then(Vec::new);
        let mut ends = Vec::with_capacity(range.len());
        for i in range {
            let message = messages.get_item(i)?;
            walk.value(&message, 1)
                .map_err(|fail| into_py_err(within(fail, || Ok(format!("[{i}]")))))?;
            ends.push(walk.out.len());
        }
        let holes = walk.holes.take();
        let (long_seen, called) = (walk.long_seen, walk.called);
        let outcome = walk.finish();
        if !hollow {
            self.last_special = outcome.special;
            self.last_refs = outcome.refs;
            self.last_longest = outcome.longest;
        }
        Ok(Packed {
            buffer: outcome.out,
            ends,
            holes: holes.unwrap_or_default(),
            long_seen,
            called,
        })
    }

    /// A walk with this packer's settings, writing into `buffer` (its kept one: see `keep`).
    fn walk<'a>(&'a self, py: Python<'a>, buffer: Vec<u8>) -> Walk<'a> {
        Walk::new(
            self.intern.as_ref().map(|i| i.bind(py)),
            self.threshold,
            self.ext_type.bind(py),
            buffer,
        )
    }

    fn pack_inner<'py>(
        &mut self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
        panic: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let buffer = std::mem::take(&mut self.buffer);
        let mut walk = self.walk(py, buffer);
        walk.value(value, 0).map_err(into_py_err)?;
        assert!(!panic, "a panic for tests, after the walk");
        let packed = PyBytes::new(py, &walk.out);
        self.keep(walk.finish());
        Ok(packed)
    }

    /// What a walk found (`last_*`), and its buffer while it stays small.
    fn keep(&mut self, outcome: Outcome) {
        self.last_special = outcome.special;
        self.last_refs = outcome.refs;
        self.last_longest = outcome.longest;
        if outcome.out.capacity() <= KEEP_BUFFER {
            self.buffer = outcome.out;
        }
    }
}

/// What a finished walk found, with its buffer (the walk's borrows of the packer end).
struct Outcome {
    special: bool,
    refs: bool,
    longest: usize,
    out: Vec<u8>,
}

/// A refusal as the exception Python sees: `RefusedValue(message, path)`.
fn into_py_err(fail: Fail) -> PyErr {
    match fail {
        Fail::Py(err) => err,
        Fail::Bad(b) => {
            let Bad {
                message,
                mut trail,
                keep,
            } = *b;
            if let Some(keep) = keep {
                trail.drain(..trail.len().saturating_sub(keep));
            }
            let path: String = trail.iter().rev().map(String::as_str).collect();
            RefusedValue::new_err((message, path))
        }
    }
}

fn type_of(obj: &Bound<'_, PyAny>) -> *mut ffi::PyTypeObject {
    // SAFETY: a live object's type pointer, compared only
    unsafe { ffi::Py_TYPE(obj.as_ptr()) }
}

impl<'p> Walk<'p> {
    fn new(
        intern: Option<&'p Bound<'p, PyAny>>,
        threshold: Option<usize>,
        ext_type: &'p Bound<'p, PyType>,
        mut out: Vec<u8>,
    ) -> Self {
        out.clear();
        Self {
            intern,
            threshold,
            ext_type,
            out,
            special: false,
            refs: false,
            longest: 0,
            open: Vec::new(),
            hole_min: usize::MAX,
            holes: None,
            long_seen: false,
            called: false,
        }
    }

    fn finish(self) -> Outcome {
        Outcome {
            special: self.special,
            refs: self.refs,
            longest: self.longest,
            out: self.out,
        }
    }
}

impl Walk<'_> {
    fn value(&mut self, v: &Bound<'_, PyAny>, depth: usize) -> Result<(), Fail> {
        let ty = type_of(v);
        // addresses of the interpreter's static type objects, compared only
        let (str_t, bool_t, float_t, int_t) = (
            &raw mut ffi::PyUnicode_Type,
            &raw mut ffi::PyBool_Type,
            &raw mut ffi::PyFloat_Type,
            &raw mut ffi::PyLong_Type,
        );
        if ty == str_t {
            return self.string(v.cast::<PyString>().map_err(PyErr::from)?);
        }
        if v.is_none() {
            ep::write_nil(&mut self.out);
        } else if ty == bool_t {
            ep::write_bool(v.is_truthy()?, &mut self.out);
        } else if ty == float_t {
            // SAFETY: an exact float
            ep::write_float(unsafe { ffi::PyFloat_AS_DOUBLE(v.as_ptr()) }, &mut self.out);
        } else if ty == int_t {
            self.integer(v)?;
        } else if ty == self.ext_type.as_type_ptr() {
            return Err(bad(
                "value of type ExtType cannot be represented in JSON".into()
            ));
        } else if let Ok(dict) = v.cast::<PyDict>() {
            self.enter(v, depth)?;
            self.dict(dict, depth + 1)?;
            self.open.pop();
        } else if let Ok(list) = v.cast::<PyList>() {
            let exact = v.is_exact_instance_of::<PyList>();
            self.sequence(v, exact.then(|| (list.iter(), list.len())), false, depth)?;
        } else if let Ok(tuple) = v.cast::<PyTuple>() {
            let exact = v.is_exact_instance_of::<PyTuple>();
            self.sequence(v, exact.then(|| (tuple.iter(), tuple.len())), true, depth)?;
        } else if v.is_instance_of::<PyString>() {
            let exact = exact_str(v)?;
            return self.string(&exact);
        } else if v.is_instance_of::<PyInt>() {
            let exact = exact_int(v)?;
            self.integer(&exact)?;
        } else if let Ok(f) = v.cast::<pyo3::types::PyFloat>() {
            ep::write_float(f.value(), &mut self.out);
        } else {
            return Err(bad(not_json(v)?));
        }
        Ok(())
    }

    /// Checks before a container at `depth` is walked.
    fn enter(&mut self, v: &Bound<'_, PyAny>, depth: usize) -> Result<(), Fail> {
        if depth >= MAX_DEPTH {
            // only a structure this deep can be circular: report where the cycle closes
            let open = &self.open;
            for cut in 0..open.len() {
                if open[..cut].contains(&open[cut]) {
                    return Err(Fail::Bad(Box::new(Bad {
                        message: CYCLE.into(),
                        trail: Vec::new(),
                        keep: Some(cut),
                    })));
                }
            }
            return Err(bad(format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        self.open.push(v.as_ptr() as usize);
        Ok(())
    }

    /// A list or tuple at `depth`: an exact one by `exact` (its items and their number), a
    /// subclass by what iterating it yields.
    fn sequence<'py>(
        &mut self,
        v: &Bound<'py, PyAny>,
        exact: Option<(impl Iterator<Item = Bound<'py, PyAny>>, usize)>,
        tuple: bool,
        depth: usize,
    ) -> Result<(), Fail> {
        self.enter(v, depth)?;
        if let Some((items, n)) = exact {
            self.items(items, n, tuple, depth + 1)?;
        } else {
            self.called = true;
            let items: Vec<_> = v.try_iter()?.collect::<PyResult<_>>()?;
            let n = items.len();
            self.items(items.into_iter(), n, tuple, depth + 1)?;
        }
        self.open.pop();
        Ok(())
    }

    fn items<'py>(
        &mut self,
        items: impl Iterator<Item = Bound<'py, PyAny>>,
        n: usize,
        tuple: bool,
        depth: usize,
    ) -> Result<(), Fail> {
        if tuple {
            self.special = true;
            ep::write_array_header(n + 1, &mut self.out);
            ep::write_tuple_mark(&mut self.out);
        } else {
            ep::write_array_header(n, &mut self.out);
        }
        let mut count = 0;
        for (i, item) in items.enumerate() {
            self.value(&item, depth)
                .map_err(|fail| within(fail, || Ok(format!("[{i}]"))))?;
            count += 1;
        }
        if count != n {
            return Err(PyRuntimeError::new_err("list changed size during iteration").into());
        }
        Ok(())
    }

    fn dict(&mut self, dict: &Bound<'_, PyDict>, depth: usize) -> Result<(), Fail> {
        if dict.is_exact_instance_of::<PyDict>() {
            // walked in place: nothing the walk calls (the blob table's `intern`) changes a
            // caller's dict, and a change by another thread ends in PyO3's size check
            ep::write_map_header(dict.len(), &mut self.out);
            for (k, item) in dict.iter() {
                self.key(&k)?;
                self.value(&item, depth)
                    .map_err(|fail| within(fail, || key_piece(&k)))?;
            }
            return Ok(());
        }
        if dict.len() == 0 {
            // json.dumps writes a subclass holding nothing as {} without asking its items()
            ep::write_map_header(0, &mut self.out);
            return Ok(());
        }
        let members: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = {
            // a subclass is read through its own items(), as json.dumps reads it
            self.called = true;
            let mut members = Vec::new();
            for pair in dict.call_method0(intern!(dict.py(), "items"))?.try_iter()? {
                members.push(item_pair(&pair?).ok_or_else(|| bad(ITEMS_PAIRS.into()))?);
            }
            members
        };
        ep::write_map_header(members.len(), &mut self.out);
        for (k, item) in &members {
            self.key(k)?;
            self.value(item, depth)
                .map_err(|fail| within(fail, || key_piece(k)))?;
        }
        Ok(())
    }

    fn key(&mut self, k: &Bound<'_, PyAny>) -> Result<(), Fail> {
        if let Ok(s) = k.cast_exact::<PyString>() {
            if let Some(ascii) = ascii_bytes(s) {
                ep::write_str(ascii, &mut self.out);
                return Ok(());
            }
            return self.string(s);
        }
        if k.is_instance_of::<PyString>() {
            return self.string(&exact_str(k)?);
        }
        if k.is_none() {
            ep::write_nil(&mut self.out);
        } else if let Ok(b) = k.cast_exact::<pyo3::types::PyBool>() {
            ep::write_bool(b.is_true(), &mut self.out);
        } else if k.is_instance_of::<PyInt>() {
            self.integer(&exact_int(k)?)?;
        } else if let Ok(f) = k.cast::<pyo3::types::PyFloat>() {
            ep::write_float(f.value(), &mut self.out);
        } else {
            let name = k.get_type().name()?;
            return Err(bad(format!(
                "dict key of type {name} (JSON keys are str, int, float, bool, None)"
            )));
        }
        Ok(())
    }

    /// An exact int: its smallest msgpack form, or `EXT_BIGINT` beyond 64 bits.
    fn integer(&mut self, n: &Bound<'_, PyAny>) -> Result<(), Fail> {
        if let Ok(small) = n.extract::<i64>() {
            ep::write_int(small, &mut self.out);
        } else if let Ok(big) = n.extract::<u64>() {
            ep::write_uint(big, &mut self.out);
        } else {
            let text = match n.str() {
                Ok(text) => text,
                Err(err) if err.is_instance_of::<PyValueError>(n.py()) => {
                    return Err(bad(TOO_MANY_DIGITS.into()))
                }
                Err(err) => return Err(err.into()),
            };
            self.special = true;
            ep::write_ext(ep::EXT_BIGINT, text.to_str()?.as_bytes(), &mut self.out);
        }
        Ok(())
    }

    /// An exact str: a blob reference when long, else inline (`EXT_SURROGATE` with a lone
    /// surrogate).
    fn string(&mut self, s: &Bound<'_, PyString>) -> Result<(), Fail> {
        // SAFETY: a live exact str
        let len = usize::try_from(unsafe { ffi::PyUnicode_GET_LENGTH(s.as_ptr()) }).unwrap_or(0);
        if let (Some(threshold), Some(intern)) = (self.threshold, self.intern) {
            if len >= threshold {
                // the blob's number and whether it holds lone surrogates, as one int
                let reference: u64 = intern.call1((s,))?.extract()?;
                let index = u32::try_from(reference >> 1)
                    .map_err(|_| PyValueError::new_err("a blob number beyond 32 bits"))?;
                if reference & 1 == 1 {
                    self.special = true; // its plain packing is an EXT_SURROGATE
                }
                self.refs = true;
                self.longest = self.longest.max(len);
                ep::write_blob_ref(index, &mut self.out);
                return Ok(());
            }
        }
        if len >= self.hole_min {
            if let Some(holes) = &mut self.holes {
                holes.push(s.clone().unbind());
                let len = u32::try_from(len).unwrap_or(u32::MAX);
                ep::write_ext(EXT_HOLE, &len.to_le_bytes(), &mut self.out);
                return Ok(());
            }
            self.long_seen = true;
        }
        if let Some(ascii) = ascii_bytes(s) {
            ep::write_str(ascii, &mut self.out);
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(len * 2);
        let surrogates = utf8_of(s, &mut bytes);
        if surrogates {
            self.special = true;
            ep::write_ext(ep::EXT_SURROGATE, &bytes, &mut self.out);
        } else {
            ep::write_str(&bytes, &mut self.out);
        }
        Ok(())
    }
}

/// An ASCII str's bytes (its storage), or None.
pub(crate) fn ascii_bytes<'a>(s: &'a Bound<'_, PyString>) -> Option<&'a [u8]> {
    let ptr = s.as_ptr();
    // SAFETY: a live str: its ASCII storage is its bytes, valid while `s` is borrowed (a str
    // never changes)
    unsafe {
        if ffi::PyUnicode_IS_ASCII(ptr) == 0 {
            return None;
        }
        let len = usize::try_from(ffi::PyUnicode_GET_LENGTH(ptr)).ok()?;
        Some(std::slice::from_raw_parts(
            ffi::PyUnicode_DATA(ptr).cast::<u8>(),
            len,
        ))
    }
}

/// Generalized UTF-8 of a str (every code point on its own: `surrogatepass`) into `out`;
/// whether it holds a surrogate.
pub(crate) fn utf8_of(s: &Bound<'_, PyString>, out: &mut Vec<u8>) -> bool {
    let ptr = s.as_ptr();
    let mut surrogates = false;
    let mut push = |cp: u32| {
        if let Some(c) = char::from_u32(cp) {
            let mut buf = [0; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        } else {
            surrogates = true;
            out.extend_from_slice(&[
                0xE0 | (cp >> 12) as u8,
                0x80 | ((cp >> 6) & 0x3F) as u8,
                0x80 | (cp & 0x3F) as u8,
            ]);
        }
    };
    // SAFETY: a live str's canonical storage, read under the GIL
    unsafe {
        let len = usize::try_from(ffi::PyUnicode_GET_LENGTH(ptr)).unwrap_or(0);
        let data = ffi::PyUnicode_DATA(ptr);
        match ffi::PyUnicode_KIND(ptr) {
            1 => std::slice::from_raw_parts(data.cast::<u8>(), len)
                .iter()
                .for_each(|&u| push(u32::from(u))),
            2 => std::slice::from_raw_parts(data.cast::<u16>(), len)
                .iter()
                .for_each(|&u| push(u32::from(u))),
            _ => std::slice::from_raw_parts(data.cast::<u32>(), len)
                .iter()
                .for_each(|&u| push(u)),
        }
    }
    surrogates
}

/// `str.__str__(v)`: the exact str a subclass holds.
fn exact_str<'py>(v: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    // SAFETY: a new reference or NULL with an exception set
    unsafe {
        Bound::from_owned_ptr_or_err(v.py(), ffi::PyUnicode_FromObject(v.as_ptr()))?
            .cast_into::<PyString>()
            .map_err(PyErr::from)
    }
}

/// `operator.index(v)`: the exact int an int subclass holds.
fn exact_int<'py>(v: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a new reference or NULL with an exception set
    unsafe { Bound::from_owned_ptr_or_err(v.py(), ffi::PyNumber_Index(v.as_ptr())) }
}

/// The path piece of dict key `k`: `.name` for an identifier, else `[repr]`.
fn key_piece(k: &Bound<'_, PyAny>) -> PyResult<String> {
    if k.is_instance_of::<PyString>()
        && k.call_method0(intern!(k.py(), "isidentifier"))?
            .is_truthy()?
    {
        return Ok(format!(".{}", k.str()?.to_str()?));
    }
    Ok(format!("[{}]", k.repr()?.to_str()?))
}

/// Why `v` is refused, and what to pass instead (for the objects people pass by mistake).
fn not_json(v: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = v.py();
    let t = v.get_type();
    let name = t.name()?;
    let callable = |attr: &Bound<'_, PyString>| -> PyResult<bool> {
        Ok(match v.getattr(attr) {
            Ok(a) => a.is_callable(),
            Err(_) => false,
        })
    };
    if callable(intern!(py, "model_dump"))? {
        return Ok(format!(
            "a pydantic model ({name}) is not a JSON value: pass what the SDK would send, \
             `value.model_dump(mode=\"json\", exclude_unset=True)`"
        ));
    }
    if callable(intern!(py, "dict"))? && t.hasattr(intern!(py, "__fields__"))? {
        return Ok(format!(
            "a pydantic model ({name}) is not a JSON value: pass `json.loads(value.json())`"
        ));
    }
    let module: String = t.getattr(intern!(py, "__module__"))?.str()?.extract()?;
    if module.split('.').next() == Some("numpy") {
        let ndim = match v.getattr(intern!(py, "ndim")) {
            Ok(n) => n.gt(0)?,
            Err(_) => false,
        };
        if ndim {
            return Ok(format!(
                "a numpy array ({name}) is not a JSON value: pass `value.tolist()`"
            ));
        }
        return Ok(format!(
            "a numpy value ({name}) is not a JSON value: pass `value.item()`"
        ));
    }
    if t.hasattr(intern!(py, "__dataclass_fields__"))? {
        return Ok(format!(
            "a dataclass ({name}) is not a JSON value: pass `dataclasses.asdict(value)`"
        ));
    }
    Ok(format!(
        "value of type {name} cannot be represented in JSON"
    ))
}

// ---------------------------------------------------------------------------- rebuild

/// Keys up to this many bytes are made once per rebuilt value and shared.
const SHARED_KEY_LEN: usize = 64;
/// Digits one `int()` call converts: below the lowest limit Python allows.
const CHUNK_DIGITS: usize = 600;

struct Rebuild<'py, 'a> {
    py: Python<'py>,
    blob: &'a Bound<'py, PyAny>,
    echo: Option<&'a Bound<'py, PyAny>>,
    keys: HashMap<&'a [u8], Bound<'py, PyAny>>,
}

fn damaged(e: &ep::UnpackError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

impl<'py, 'a> Rebuild<'py, 'a> {
    fn item(&mut self, reader: &mut ep::Reader<'a>, depth: usize) -> PyResult<Bound<'py, PyAny>> {
        let at = reader.pos();
        let py = self.py;
        Ok(match reader.next_item().map_err(|e| damaged(&e))? {
            ep::Item::Nil => py.None().into_bound(py),
            ep::Item::Bool(b) => pyo3::types::PyBool::new(py, b).to_owned().into_any(),
            ep::Item::Int(n) => n.into_pyobject(py)?.into_any(),
            ep::Item::UInt(n) => n.into_pyobject(py)?.into_any(),
            ep::Item::Float(f) => pyo3::types::PyFloat::new(py, f).into_any(),
            ep::Item::Str(bytes) => new_str(py, bytes)?,
            ep::Item::Bin(bytes) => PyBytes::new(py, bytes).into_any(),
            ep::Item::Ext(code, payload) => self.ext(code, payload, at)?,
            ep::Item::Array(n) => {
                if depth >= ep::MAX_UNPACK_DEPTH {
                    return Err(PyValueError::new_err(format!(
                        "nested too deeply (at byte {at})"
                    )));
                }
                let mut items = Vec::with_capacity(n);
                let mut tuple = false;
                for i in 0..n {
                    if i == 0 && reader.peek_is_tuple_mark() {
                        reader.next_item().map_err(|e| damaged(&e))?;
                        tuple = true;
                        continue;
                    }
                    items.push(self.item(reader, depth + 1)?);
                }
                if tuple {
                    PyTuple::new(py, items)?.into_any()
                } else {
                    PyList::new(py, items)?.into_any()
                }
            }
            ep::Item::Map(n) => {
                if depth >= ep::MAX_UNPACK_DEPTH {
                    return Err(PyValueError::new_err(format!(
                        "nested too deeply (at byte {at})"
                    )));
                }
                let dict = PyDict::new(py);
                for _ in 0..n {
                    let key = self.key(reader, depth)?;
                    let value = self.item(reader, depth + 1)?;
                    dict.set_item(key, value)?;
                }
                dict.into_any()
            }
        })
    }

    fn key(&mut self, reader: &mut ep::Reader<'a>, depth: usize) -> PyResult<Bound<'py, PyAny>> {
        let mut ahead = reader.clone();
        if let Ok(ep::Item::Str(bytes)) = ahead.next_item() {
            if bytes.len() <= SHARED_KEY_LEN {
                *reader = ahead;
                if let Some(shared) = self.keys.get(bytes) {
                    return Ok(shared.clone());
                }
                let made = new_str(self.py, bytes)?;
                self.keys.insert(bytes, made.clone());
                return Ok(made);
            }
        }
        self.item(reader, depth + 1)
    }

    fn ext(&mut self, code: i8, payload: &[u8], at: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        match code {
            ep::EXT_BLOB if payload.len() <= 8 => {
                let mut index = [0u8; 8];
                index[8 - payload.len()..].copy_from_slice(payload);
                self.blob.call1((u64::from_be_bytes(index),))
            }
            ep::EXT_BIGINT => big_int(py, payload),
            ep::EXT_SURROGATE => decode_utf8(py, payload, c"surrogatepass"),
            ep::EXT_ECHO if self.echo.is_some() => self
                .echo
                .map_or_else(|| Ok(py.None().into_bound(py)), PyAnyMethods::call0),
            _ => Err(PyValueError::new_err(format!(
                "unknown extension type {code} (at byte {at})"
            ))),
        }
    }
}

/// The int an `EXT_BIGINT` payload spells, whatever `sys.get_int_max_str_digits()` is: in
/// pieces of at most `CHUNK_DIGITS` digits (a file written where the limit was raised reads
/// as it was written).
fn big_int<'py>(py: Python<'py>, text: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let int = py.get_type::<PyInt>();
    if text.len() <= CHUNK_DIGITS {
        return int.call1((PyBytes::new(py, text),));
    }
    if !ep::is_decimal(text) {
        return Err(PyValueError::new_err(
            "a big int that is not a decimal number",
        ));
    }
    let (negative, digits) = match text.strip_prefix(b"-") {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let mut value = int.call1((0,))?;
    for chunk in digits.chunks(CHUNK_DIGITS) {
        let scale = 10u8.into_pyobject(py)?.pow(chunk.len(), py.None())?;
        value = value
            .mul(scale)?
            .add(int.call1((PyBytes::new(py, chunk),))?)?;
    }
    if negative {
        value = value.neg()?;
    }
    Ok(value)
}

fn decode_utf8<'py>(
    py: Python<'py>,
    bytes: &[u8],
    errors: &std::ffi::CStr,
) -> PyResult<Bound<'py, PyAny>> {
    let len = isize::try_from(bytes.len())?;
    // SAFETY: the pointer and length describe a live byte slice; the result is a new
    // reference or NULL with an exception set
    unsafe {
        let ptr = ffi::PyUnicode_DecodeUTF8(bytes.as_ptr().cast::<c_char>(), len, errors.as_ptr());
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}

/// A str from UTF-8 bytes (ASCII written straight into a new str).
fn new_str<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    if bytes.is_ascii() {
        let len = isize::try_from(bytes.len())?;
        // SAFETY: PyUnicode_New gives a new ASCII str of `len` code units (NULL with an
        // exception set on failure), written in full here before anyone else sees it.
        unsafe {
            let ptr = ffi::PyUnicode_New(len, 127);
            if !ptr.is_null() {
                let data = ffi::PyUnicode_DATA(ptr).cast::<u8>();
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), data, bytes.len());
            }
            return Bound::from_owned_ptr_or_err(py, ptr);
        }
    }
    decode_utf8(py, bytes, c"strict")
}

#[pyfunction]
#[pyo3(signature = (data, blob, echo = None))]
pub fn unpack<'py>(
    py: Python<'py>,
    data: &[u8],
    blob: &Bound<'py, PyAny>,
    echo: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut rebuild = Rebuild {
        py,
        blob,
        echo,
        keys: HashMap::new(),
    };
    let mut reader = ep::Reader::new(data);
    let value = rebuild.item(&mut reader, 0)?;
    if !reader.at_end() {
        return Err(PyValueError::new_err(format!(
            "{} bytes after the value",
            data.len() - reader.pos()
        )));
    }
    Ok(value)
}

/// Check one stored packed value without building it (see the engine's `packed_check`):
/// `(top_items, special, echoes, blob_refs)`, `blob_refs` the offsets of the blob references
/// as native-endian u32 (an `array('I')`'s bytes). `blob_surrogates(index)` tells whether a
/// blob holds a lone surrogate. `ValueError` naming what is wrong and its byte offset.
#[pyfunction]
#[pyo3(signature = (data, n_blobs, max_depth, *, blob_surrogates = None, echo_ok = false, record = false, max_containers = None))]
#[allow(clippy::too_many_arguments)]
pub fn check_packed<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    n_blobs: u64,
    max_depth: usize,
    blob_surrogates: Option<&Bound<'py, PyAny>>,
    echo_ok: bool,
    record: bool,
    max_containers: Option<usize>,
) -> PyResult<(i64, bool, u32, Bound<'py, PyBytes>)> {
    let buffer = pyo3::buffer::PyBuffer::<u8>::get(data)
        .map_err(|_| PyValueError::new_err("a packed value must be bytes"))?;
    if !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err("a packed value must be bytes"));
    }
    // SAFETY: a contiguous buffer of `len_bytes` bytes, held until the end of this call; the
    // library passes bytes and views of bytes (immutable)
    let bytes =
        unsafe { std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes()) };
    let limits = engine::packed_check::Limits {
        n_blobs,
        max_depth,
        echo_ok,
        record,
        max_containers,
    };
    let mut failed: Option<PyErr> = None;
    let result = match blob_surrogates {
        Some(ask) => engine::packed_check::check(bytes, limits, &mut |index| match ask
            .call1((index,))
            .and_then(|answer| answer.is_truthy())
        {
            Ok(answer) => answer,
            Err(err) => {
                failed.get_or_insert(err);
                false
            }
        }),
        None if buffer.readonly() && bytes.len() >= DETACH_FROM => {
            py.detach(|| engine::packed_check::check(bytes, limits, &mut |_| false))
        }
        None => engine::packed_check::check(bytes, limits, &mut |_| false),
    };
    if let Some(err) = failed {
        return Err(err);
    }
    let found = result.map_err(|err| PyValueError::new_err(err.to_string()))?;
    let refs: Vec<u8> = found
        .blob_refs
        .iter()
        .flat_map(|offset| offset.to_ne_bytes())
        .collect();
    Ok((
        found.top_items,
        found.special,
        found.echoes,
        PyBytes::new(py, &refs),
    ))
}

/// The plain packing of a stored packed value: each blob reference (at the offsets `refs`
/// gives, as `check_packed` found them: native-endian u32s) replaced by the plain packing of
/// its string, `blob(index)`, as `Packer(None, None)` packs a str (`EXT_SURROGATE` with a
/// lone surrogate); the bytes between are kept as they are. `ValueError` when an offset is
/// not a blob reference's (out of order, past the end, another type).
#[pyfunction]
pub fn splice<'py>(
    py: Python<'py>,
    data: &[u8],
    refs: &[u8],
    blob: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    if refs.len() % 4 != 0 {
        return Err(PyValueError::new_err(
            "splice: refs must be u32 offsets (an array('I')'s bytes)",
        ));
    }
    let mut out = Vec::with_capacity(data.len());
    let mut pos = 0;
    let mut scratch = Vec::new();
    for chunk in refs.chunks_exact(4) {
        let at = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) as usize;
        let reference = data.get(at..at + 6).filter(|_| at >= pos);
        let Some(&[0xd6, code, a, b, c, d]) = reference else {
            return Err(PyValueError::new_err(format!(
                "splice: no blob reference at byte {at}"
            )));
        };
        if code != ep::EXT_BLOB.to_ne_bytes()[0] {
            return Err(PyValueError::new_err(format!(
                "splice: no blob reference at byte {at}"
            )));
        }
        out.extend_from_slice(&data[pos..at]);
        let string = blob.call1((u32::from_be_bytes([a, b, c, d]),))?;
        let string = string.cast_into::<PyString>().map_err(PyErr::from)?;
        if let Some(ascii) = ascii_bytes(&string) {
            ep::write_str(ascii, &mut out);
        } else {
            scratch.clear();
            if utf8_of(&string, &mut scratch) {
                ep::write_ext(ep::EXT_SURROGATE, &scratch, &mut out);
            } else {
                ep::write_str(&scratch, &mut out);
            }
        }
        pos = at + 6;
    }
    out.extend_from_slice(&data[pos..]);
    Ok(PyBytes::new(py, &out))
}
