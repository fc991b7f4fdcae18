//! `KeyIndex`: the engine's insertion-ordered map from 64-bit keys to Python objects (a
//! graph's request index), with the parts of a `dict`'s interface the graph uses.

use std::sync::{Mutex, MutexGuard, PoisonError};

use engine::key_index;
use pyo3::exceptions::{PyKeyError, PyOverflowError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// 64-bit keys (ints from 0 to 2**64 - 1) to objects, in the order keys were first set;
/// about a third of the memory a `dict` of such keys takes (no int object per key).
#[pyclass(frozen, module = "rollout_store._core")]
pub struct KeyIndex {
    inner: Mutex<key_index::KeyIndex<Py<PyAny>>>,
}

impl KeyIndex {
    /// The index; a panic while it was held left it consistent (an insertion changes nothing
    /// before its last fallible step), so a poisoned lock is taken over. No Python code runs
    /// while it is held (objects are only increfed under it; replaced ones are dropped after).
    fn index(&self) -> MutexGuard<'_, key_index::KeyIndex<Py<PyAny>>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value under `key` (None: absent, or `key` is no 64-bit key).
    fn lookup(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> Option<Py<PyAny>> {
        let key = key.extract::<u64>().ok()?;
        self.index().get(key).map(|value| value.clone_ref(py))
    }

    /// Every (key, value), in order, taken under the lock (Python objects are made after).
    fn entries(&self, py: Python<'_>) -> Vec<(u64, Py<PyAny>)> {
        self.index()
            .iter()
            .map(|(key, value)| (key, value.clone_ref(py)))
            .collect()
    }
}

#[pymethods]
impl KeyIndex {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(key_index::KeyIndex::new()),
        }
    }

    /// The value under `key`, or `default` (a key that is not a 64-bit int is never there).
    #[pyo3(signature = (key, default = None))]
    fn get(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        default: Option<Py<PyAny>>,
    ) -> Option<Py<PyAny>> {
        self.lookup(py, key).or(default)
    }

    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.lookup(py, key)
            .ok_or_else(|| PyKeyError::new_err(key.clone().unbind()))
    }

    /// Set `key`'s value (a new key goes last; a replaced value keeps its place).
    fn __setitem__(&self, key: u64, value: Py<PyAny>) -> PyResult<()> {
        let replaced = self.index().insert(key, value);
        // the replaced value is dropped here, with the lock let go (its release may run code)
        replaced
            .map(drop)
            .map_err(|full| PyOverflowError::new_err(full.to_string()))
    }

    /// Take `key` out (`KeyError` when it is not there): the key set last at once, any
    /// other in time linear in the keys.
    fn __delitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let removed = key
            .extract::<u64>()
            .ok()
            .and_then(|k| self.index().remove(k));
        // the value is dropped here, with the lock let go
        match removed {
            Some(value) => {
                drop(value);
                Ok(())
            }
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        key.extract::<u64>()
            .is_ok_and(|key| self.index().contains_key(key))
    }

    fn __len__(&self) -> usize {
        self.index().len()
    }

    /// The keys, in order (a list).
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let keys: Vec<u64> = self.index().iter().map(|(key, _)| key).collect();
        PyList::new(py, keys)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.keys(py)?.try_iter().map(Bound::into_any)
    }

    /// The values, in order (a list).
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let values: Vec<Py<PyAny>> = self
            .index()
            .values()
            .map(|value| value.clone_ref(py))
            .collect();
        PyList::new(py, values)
    }

    /// The (key, value) pairs, in order (a list of tuples).
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let pairs = self
            .entries(py)
            .into_iter()
            .map(|(key, value)| {
                PyTuple::new(
                    py,
                    [key.into_pyobject(py)?.into_any(), value.into_bound(py)],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, pairs)
    }

    /// The value under the key set last (None: empty), what `next(reversed(d.values()))`
    /// gives for a `dict`, without a list of every value.
    fn last(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.index().last().map(|value| value.clone_ref(py))
    }

    /// Bytes of heap the index holds (what `tracemalloc` does not see).
    #[getter]
    fn nbytes(&self) -> usize {
        self.index().nbytes()
    }

    // the garbage collector sees the values, so a cycle through the index is collected; the
    // lock is never held while Python code runs, so it is free here (if not, nothing is
    // visited: the values then count as referenced from outside, and stay)
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Ok(index) = self.inner.try_lock() {
            for value in index.values() {
                visit.call(value)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let taken = std::mem::take(&mut *self.index());
        drop(taken); // with the lock let go
    }
}

/// 64-bit keys to the numbers filed under them (ints below 2**32, each key's in filing
/// order): a content table's index, with no Python object an entry.
#[pyclass(frozen, module = "rollout_store._core")]
pub struct KeyNumbers {
    inner: Mutex<key_index::KeyNumbers>,
}

impl KeyNumbers {
    /// The index; a panic while it was held left it consistent (an addition changes nothing
    /// before its last fallible step), so a poisoned lock is taken over.
    fn index(&self) -> MutexGuard<'_, key_index::KeyNumbers> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl KeyNumbers {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(key_index::KeyNumbers::new()),
        }
    }

    /// File `number` under `key`, after the numbers filed there before.
    fn add(&self, key: u64, number: u32) -> PyResult<()> {
        self.index()
            .add(key, number)
            .map_err(|full| PyOverflowError::new_err(full.to_string()))
    }

    /// The numbers under `key`: None (none, or `key` is no 64-bit int), the one number, or a
    /// tuple of them in filing order (what `engine.index.index_members` reads).
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let Ok(key) = key.extract::<u64>() else {
            return Ok(py.None().into_bound(py));
        };
        // (the numbers copied under the lock: no Python object is made while it is held)
        let found = self.index().get(key).map(|(first, more)| {
            let mut numbers = Vec::with_capacity(1 + more.len());
            numbers.push(first);
            numbers.extend_from_slice(more);
            numbers
        });
        match found {
            None => Ok(py.None().into_bound(py)),
            Some(numbers) if numbers.len() == 1 => Ok(numbers[0].into_pyobject(py)?.into_any()),
            Some(numbers) => Ok(PyTuple::new(py, numbers)?.into_any()),
        }
    }

    /// Take `number` out from under `key` if it is the number filed there last (a rolled-back
    /// addition); whether it was.
    fn pop_last(&self, key: u64, number: u32) -> bool {
        self.index().pop_last(key, number)
    }

    /// How many keys.
    fn __len__(&self) -> usize {
        self.index().len()
    }

    /// Bytes of heap the index holds (what `tracemalloc` does not see).
    #[getter]
    fn nbytes(&self) -> usize {
        self.index().nbytes()
    }
}
