//! `KeyNumbers`: the engine's index of 64-bit keys to the numbers filed under them (the blob
//! tables' and the memory store's index of their contents).

use std::sync::{Mutex, MutexGuard, PoisonError};

use engine::key_index;
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

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

    /// The numbers of each key under which several are filed, each key's as a tuple in
    /// filing order (the keys in no set order): a table's contents that share a key.
    fn shared<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        // (copied under the lock: no Python object is made while it is held)
        let groups: Vec<Vec<u32>> = self
            .index()
            .shared()
            .map(|(first, more)| std::iter::once(first).chain(more.iter().copied()).collect())
            .collect();
        PyList::new(
            py,
            groups
                .into_iter()
                .map(|numbers| PyTuple::new(py, numbers))
                .collect::<PyResult<Vec<_>>>()?,
        )
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
