//! `loads` and `dumps`: the engine's exact JSON on Python objects.
//!
//! `loads` builds Python objects straight from the engine's parser (no tree in between);
//! `dumps` walks Python objects in the order json's C encoder checks their types and writes
//! with the engine's writers.

use std::collections::HashMap;
use std::ffi::c_char;

use engine::json::{self as ej, Failure, Key, Sink, Str};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::packed::{item_pair, ITEMS_PAIRS};
use crate::DecodeError;

/// Keys up to this many bytes are shared within one document, as `json.loads`' memo shares them.
const SHARED_KEY_LEN: usize = 64;

/// Builds Python objects for the parser.
struct PySink<'py> {
    py: Python<'py>,
    keys: HashMap<Box<[u8]>, Bound<'py, PyAny>>,
}

impl<'py> PySink<'py> {
    fn str(&self, s: Str<'_>) -> PyResult<Bound<'py, PyAny>> {
        if s.bytes.is_ascii() {
            let len = isize::try_from(s.bytes.len())?;
            // SAFETY: PyUnicode_New gives a new ASCII str of `len` code units (NULL with an
            // exception set on failure), written in full here before anyone else sees it.
            unsafe {
                let ptr = ffi::PyUnicode_New(len, 127);
                if !ptr.is_null() {
                    let data = ffi::PyUnicode_DATA(ptr).cast::<u8>();
                    std::ptr::copy_nonoverlapping(s.bytes.as_ptr(), data, s.bytes.len());
                }
                return Bound::from_owned_ptr_or_err(self.py, ptr);
            }
        }
        if let Some(text) = s.as_str() {
            return Ok(PyString::new(self.py, text).into_any());
        }
        // a lone surrogate: Python decodes it back with surrogatepass
        let len = isize::try_from(s.bytes.len())?;
        // SAFETY: the pointer and length describe a live byte slice; the result is a new
        // reference or NULL with an exception set, which from_owned_ptr_or_err handles.
        unsafe {
            let ptr = ffi::PyUnicode_DecodeUTF8(
                s.bytes.as_ptr().cast::<c_char>(),
                len,
                c"surrogatepass".as_ptr(),
            );
            Bound::from_owned_ptr_or_err(self.py, ptr)
        }
    }
}

impl<'py> Sink for PySink<'py> {
    type Value = Bound<'py, PyAny>;
    type Error = PyErr;

    fn null(&mut self) -> PyResult<Self::Value> {
        Ok(self.py.None().into_bound(self.py))
    }

    fn bool(&mut self, value: bool) -> PyResult<Self::Value> {
        Ok(PyBool::new(self.py, value).to_owned().into_any())
    }

    fn int(&mut self, value: i64) -> PyResult<Self::Value> {
        Ok(value.into_pyobject(self.py)?.into_any())
    }

    fn big_int(&mut self, text: &str) -> PyResult<Self::Value> {
        // int(text), as json.loads does: beyond the process's int digit limit it raises
        // ValueError, exactly as json.loads would
        self.py.get_type::<PyInt>().call1((text,))
    }

    fn float(&mut self, value: f64) -> PyResult<Self::Value> {
        Ok(PyFloat::new(self.py, value).into_any())
    }

    fn string(&mut self, value: Str<'_>) -> PyResult<Self::Value> {
        self.str(value)
    }

    fn array(&mut self, items: Vec<Self::Value>) -> PyResult<Self::Value> {
        Ok(PyList::new(self.py, items)?.into_any())
    }

    fn object(&mut self, members: Vec<(Key<'_>, Self::Value)>) -> PyResult<Self::Value> {
        let dict = PyDict::new(self.py);
        for (key, value) in members {
            let key = key.as_str();
            if key.bytes.len() > SHARED_KEY_LEN {
                dict.set_item(self.str(key)?, value)?;
            } else if let Some(shared) = self.keys.get(key.bytes) {
                dict.set_item(shared, value)?;
            } else {
                let made = self.str(key)?;
                dict.set_item(&made, value)?;
                self.keys.insert(key.bytes.into(), made);
            }
        }
        Ok(dict.into_any())
    }
}

/// The value `json.loads(data)` gives, built by the engine.
#[pyfunction]
#[pyo3(signature = (data, /, *, max_depth = ej::DEFAULT_MAX_DEPTH))]
pub fn loads<'py>(py: Python<'py>, data: &[u8], max_depth: usize) -> PyResult<Bound<'py, PyAny>> {
    let mut sink = PySink {
        py,
        keys: HashMap::new(),
    };
    ej::parse_with(data, max_depth, &mut sink).map_err(|failure| match failure {
        Failure::Sink(err) => err,
        Failure::Syntax(e) => {
            let err = DecodeError::new_err(e.to_string());
            if let Err(set) = err.value(py).setattr("offset", e.offset) {
                return set;
            }
            err
        }
    })
}

/// Python str storage as code points, written escaped.
fn write_pystr(s: &Bound<'_, PyString>, out: &mut Vec<u8>) -> PyResult<()> {
    let ptr = s.as_ptr();
    // SAFETY: `s` is a live str; its canonical storage (kind, data, length) is read under the
    // GIL and not kept past this call.
    unsafe {
        let len = usize::try_from(ffi::PyUnicode_GET_LENGTH(ptr))?;
        let data = ffi::PyUnicode_DATA(ptr);
        if ffi::PyUnicode_IS_ASCII(ptr) != 0 {
            let bytes = std::slice::from_raw_parts(data.cast::<u8>(), len);
            ej::write_str(
                Str {
                    bytes,
                    surrogates: false,
                },
                out,
            );
            return Ok(());
        }
        match ffi::PyUnicode_KIND(ptr) {
            1 => {
                let units = std::slice::from_raw_parts(data.cast::<u8>(), len);
                ej::write_code_points(units.iter().map(|&u| u32::from(u)), out);
            }
            2 => {
                let units = std::slice::from_raw_parts(data.cast::<u16>(), len);
                ej::write_code_points(units.iter().map(|&u| u32::from(u)), out);
            }
            _ => {
                let units = std::slice::from_raw_parts(data.cast::<u32>(), len);
                ej::write_code_points(units.iter().copied(), out);
            }
        }
    }
    Ok(())
}

/// `int.__repr__(value)`: decimal digits (a subclass's own repr is not used, as in json).
fn write_pyint(value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    if let Ok(small) = value.extract::<i64>() {
        ej::write_int(small, out);
        return Ok(());
    }
    let py = value.py();
    let text = py
        .get_type::<PyInt>()
        .getattr(pyo3::intern!(py, "__repr__"))?
        .call1((value,))?;
    out.extend_from_slice(text.cast::<PyString>()?.to_str()?.as_bytes());
    Ok(())
}

struct Writer {
    out: Vec<u8>,
    max_depth: usize,
    /// containers being written, outermost first
    open: Vec<usize>,
}

impl Writer {
    fn value(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        if obj.is_none() {
            ej::write_null(&mut self.out);
        } else if let Ok(b) = obj.cast_exact::<PyBool>() {
            ej::write_bool(b.is_true(), &mut self.out);
        } else if let Ok(s) = obj.cast::<PyString>() {
            write_pystr(s, &mut self.out)?;
        } else if obj.is_instance_of::<PyInt>() {
            write_pyint(obj, &mut self.out)?;
        } else if let Ok(f) = obj.cast::<PyFloat>() {
            ej::write_float(f.value(), &mut self.out);
        } else if let Ok(list) = obj.cast_exact::<PyList>() {
            self.array(obj, list.iter())?;
        } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
            self.array(obj, tuple.iter())?;
        } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
            // a subclass: json.dumps writes what iterating it yields
            let items: Vec<_> = obj.try_iter()?.collect::<PyResult<_>>()?;
            self.array(obj, items.into_iter())?;
        } else if let Ok(dict) = obj.cast_exact::<PyDict>() {
            self.object(obj, dict.iter())?;
        } else if let Ok(dict) = obj.cast::<PyDict>() {
            // a subclass: json.dumps writes one holding nothing as {}, else what its own
            // items() yields
            let mut members = Vec::new();
            if dict.len() > 0 {
                for pair in dict
                    .call_method0(pyo3::intern!(dict.py(), "items"))?
                    .try_iter()?
                {
                    members
                        .push(item_pair(&pair?).ok_or_else(|| PyValueError::new_err(ITEMS_PAIRS))?);
                }
            }
            self.object(obj, members.into_iter())?;
        } else {
            let name = obj.get_type().name()?;
            return Err(PyTypeError::new_err(format!(
                "Object of type {name} is not JSON serializable"
            )));
        }
        Ok(())
    }

    fn array<'py>(
        &mut self,
        obj: &Bound<'py, PyAny>,
        items: impl Iterator<Item = Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        self.enter(obj)?;
        self.out.push(b'[');
        for (i, item) in items.enumerate() {
            if i > 0 {
                self.out.extend_from_slice(b", ");
            }
            self.value(&item)?;
        }
        self.out.push(b']');
        self.open.pop();
        Ok(())
    }

    fn object<'py>(
        &mut self,
        obj: &Bound<'py, PyAny>,
        members: impl Iterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    ) -> PyResult<()> {
        self.enter(obj)?;
        self.out.push(b'{');
        for (i, (key, item)) in members.enumerate() {
            if i > 0 {
                self.out.extend_from_slice(b", ");
            }
            self.key(&key)?;
            self.out.extend_from_slice(b": ");
            self.value(&item)?;
        }
        self.out.push(b'}');
        self.open.pop();
        Ok(())
    }

    /// A dict key as json writes it: str as is; float, bool, None and int as their JSON text
    /// in quotes.
    fn key(&mut self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(s) = key.cast::<PyString>() {
            return write_pystr(s, &mut self.out);
        }
        let mut text = Vec::new();
        if let Ok(f) = key.cast::<PyFloat>() {
            ej::write_float(f.value(), &mut text);
        } else if let Ok(b) = key.cast_exact::<PyBool>() {
            ej::write_bool(b.is_true(), &mut text);
        } else if key.is_none() {
            ej::write_null(&mut text);
        } else if key.is_instance_of::<PyInt>() {
            write_pyint(key, &mut text)?;
        } else {
            let name = key.get_type().name()?;
            return Err(PyTypeError::new_err(format!(
                "keys must be str, int, float, bool or None, not {name}"
            )));
        }
        self.out.push(b'"');
        self.out.extend_from_slice(&text);
        self.out.push(b'"');
        Ok(())
    }

    fn enter(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = obj.as_ptr() as usize;
        if self.open.len() >= self.max_depth {
            // only a structure this deep can be circular: look for the cycle now
            if self.open.contains(&id) {
                return Err(PyValueError::new_err("Circular reference detected"));
            }
            return Err(PyValueError::new_err(format!(
                "nesting deeper than {} levels",
                self.max_depth
            )));
        }
        self.open.push(id);
        Ok(())
    }
}

/// `json.dumps(obj)` for JSON values (dict, list, tuple, str, int, float, bool, None).
#[pyfunction]
#[pyo3(signature = (obj, /, *, max_depth = ej::DEFAULT_MAX_DEPTH))]
pub fn dumps(obj: &Bound<'_, PyAny>, max_depth: usize) -> PyResult<String> {
    let mut writer = Writer {
        out: Vec::new(),
        max_depth,
        open: Vec::new(),
    };
    writer.value(obj)?;
    // the writers emit ASCII only
    String::from_utf8(writer.out).map_err(|e| PyValueError::new_err(e.to_string()))
}
