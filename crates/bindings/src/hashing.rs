//! `Blake3`: a BLAKE3 state over packed request prefixes, which `Packer.hash_prefix` fills
//! from Python messages (through the engine's `PrefixHasher`) and the request store goes on
//! feeding.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::DETACH_FROM;

/// A BLAKE3 state: `update` with bytes-like objects, `copy`, `digest` (32 bytes).
#[pyclass(frozen, module = "rollout_store._core")]
pub struct Blake3 {
    // about 1.9 KB owning no heap, inside the Python object the interpreter allocates:
    // `tracemalloc` counts it, so there is no `nbytes` to add for it
    inner: Mutex<blake3::Hasher>,
}

impl Blake3 {
    pub(crate) fn from_state(state: blake3::Hasher) -> Self {
        Self {
            inner: Mutex::new(state),
        }
    }

    /// The state; a panic while it was held left the hasher consistent (BLAKE3's updates
    /// are not interrupted halfway by anything that panics), so a poisoned lock is taken over.
    fn state(&self) -> MutexGuard<'_, blake3::Hasher> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl Blake3 {
    #[new]
    #[pyo3(signature = (data = None))]
    fn new(py: Python<'_>, data: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let hasher = Self::from_state(blake3::Hasher::new());
        if let Some(data) = data {
            hasher.update(py, data)?;
        }
        Ok(hasher)
    }

    /// Feed the bytes of a contiguous bytes-like object (bytes, a memoryview of bytes).
    fn update(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = PyBuffer::<u8>::get(data)?;
        if !buffer.is_c_contiguous() {
            return Err(PyBufferError::new_err(
                "Blake3.update needs a contiguous buffer",
            ));
        }
        // SAFETY: a contiguous buffer of `len_bytes` bytes, held (with the object) until the
        // end of this call; the library passes only bytes and views of bytes (immutable)
        let bytes = unsafe {
            std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
        };
        if bytes.len() >= DETACH_FROM {
            // the lock is taken without the GIL: a thread waiting for it holds no GIL
            py.detach(|| {
                self.state().update(bytes);
            });
        } else {
            self.state().update(bytes);
        }
        Ok(())
    }

    /// A state of its own that has seen what this one has.
    fn copy(&self) -> Self {
        Self::from_state(self.state().clone())
    }

    /// The digest of everything fed so far (the state goes on).
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.state().finalize().as_bytes())
    }
}
