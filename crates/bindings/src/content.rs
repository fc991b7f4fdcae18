//! `ContentTable`: the engine's content table behind a lock, shared by Python threads.

use std::sync::{Mutex, MutexGuard, PoisonError};

use engine::content::{self, ContentError, Handle};
use pyo3::exceptions::{PyKeyError, PyOverflowError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::DETACH_FROM;

/// Distinct byte strings, each stored once: xxh3-128 keys, every hit confirmed by comparing
/// the bytes, reference counted.
#[pyclass(frozen, module = "rollout_store._core")]
pub struct ContentTable {
    inner: Mutex<content::ContentTable>,
}

fn to_py(error: ContentError) -> PyErr {
    match error {
        ContentError::UnknownHandle(_) => PyKeyError::new_err(error.to_string()),
        ContentError::Full => PyOverflowError::new_err(error.to_string()),
    }
}

impl ContentTable {
    /// The entry equal to `data`; a large body is hashed with the GIL released.
    fn lookup(&self, py: Python<'_>, data: &[u8]) -> Option<Handle> {
        if data.len() >= DETACH_FROM {
            let key = py.detach(|| content::content_key(data));
            self.table().find_keyed(key, data)
        } else {
            self.table().find(data)
        }
    }

    /// The table; a panic while it was held left it consistent (the engine changes nothing
    /// before its last fallible step), so a poisoned lock is taken over.
    fn table(&self) -> MutexGuard<'_, content::ContentTable> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl ContentTable {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(content::ContentTable::new()),
        }
    }

    /// Store `data` once (or take one more reference) and return its handle.
    fn intern(&self, py: Python<'_>, data: &[u8]) -> PyResult<u32> {
        let handle = if data.len() >= DETACH_FROM {
            py.detach(|| {
                let key = content::content_key(data);
                self.table().intern_keyed(key, data)
            })
        } else {
            self.table().intern(data)
        };
        handle.map(|h| h.0).map_err(to_py)
    }

    /// The bytes under `handle` (`KeyError` when it names no content).
    fn get<'py>(&self, py: Python<'py>, handle: u32) -> PyResult<Bound<'py, PyBytes>> {
        let table = self.table();
        let bytes = table
            .get(Handle(handle))
            .ok_or_else(|| to_py(ContentError::UnknownHandle(Handle(handle))))?;
        Ok(PyBytes::new(py, bytes))
    }

    /// The handle of the content equal to `data`, or None.
    fn find(&self, py: Python<'_>, data: &[u8]) -> Option<u32> {
        self.lookup(py, data).map(|h| h.0)
    }

    /// Drop one reference to `handle`; the content goes with its last reference.
    fn release(&self, handle: u32) -> PyResult<()> {
        self.table().release(Handle(handle)).map_err(to_py)
    }

    /// References held on `handle` (0 when it names no content).
    fn refcount(&self, handle: u32) -> u32 {
        self.table().refcount(Handle(handle))
    }

    fn __len__(&self) -> usize {
        self.table().len()
    }

    fn __contains__(&self, py: Python<'_>, data: &[u8]) -> bool {
        self.lookup(py, data).is_some()
    }

    /// Bytes of content held, each distinct string once.
    #[getter]
    fn content_bytes(&self) -> usize {
        self.table().content_bytes()
    }

    /// Bytes the engine holds for the table (content, slots and index), which `tracemalloc`
    /// does not see.
    #[getter]
    fn nbytes(&self) -> usize {
        self.table().nbytes()
    }

    /// Tests only: look `data` up with the lock held, then panic before storing it.
    fn _panic_for_tests(&self, data: &[u8]) {
        let table = self.table();
        let found = table.find(data);
        panic!("panic for tests (found: {found:?})");
    }
}
