//! `Blake3`: a BLAKE3 state over packed request prefixes: a raw tip's (the request table goes
//! on from it, `RequestTable.find_after`) and the digest of a raw text's bytes.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use engine::digest::State;

use crate::packed::ascii_bytes;

use crate::DETACH_FROM;

/// Pieces of a hollowed text shorter than this are hashed gathered (`update_hollow`).
const GATHER_BELOW: usize = 1 << 14;

/// A BLAKE3 state: `update` with bytes-like objects, `copy`, `digest` (32 bytes).
#[pyclass(frozen, module = "rollout_store._core")]
pub struct Blake3 {
    // the engine's compact state: its chaining values and last chunk on the heap, which
    // `tracemalloc` does not see (`nbytes` says how much)
    inner: Mutex<State>,
}

impl Blake3 {
    pub(crate) fn from_state(state: State) -> Self {
        Self {
            inner: Mutex::new(state),
        }
    }

    /// A copy of the state (what the engine goes on hashing from).
    pub(crate) fn snapshot(&self) -> State {
        self.state().clone()
    }

    /// The state; a panic while it was held left the hasher consistent (BLAKE3's updates
    /// are not interrupted halfway by anything that panics), so a poisoned lock is taken over.
    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl Blake3 {
    #[new]
    #[pyo3(signature = (data = None))]
    fn new(py: Python<'_>, data: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let hasher = Self::from_state(State::new());
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

    /// Feed `data[start:end]` but its holes, when each hole `(hole_start, hole_end, text)`
    /// of `holes` (in order, inside that range) holds exactly the UTF-8 of its `str`; else
    /// False, and nothing is fed. An ASCII text is compared in place (no copy of it).
    fn update_hollow(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyBytes>,
        start: usize,
        end: usize,
        holes: &Bound<'_, PyList>,
    ) -> PyResult<bool> {
        let bytes = data.as_bytes();
        if start > end || end > bytes.len() {
            return Err(PyValueError::new_err(
                "Blake3.update_hollow: the range is outside the data",
            ));
        }
        let mut spans = Vec::with_capacity(holes.len() + 1);
        let mut at = start;
        for hole in holes.iter() {
            let (hole_start, hole_end, text): (usize, usize, Bound<'_, PyString>) =
                hole.extract()?;
            if hole_start < at
                || hole_end < hole_start
                || hole_end > end
                || !holds_text(&bytes[hole_start..hole_end], &text)
            {
                return Ok(false);
            }
            spans.push(at..hole_start);
            at = hole_end;
        }
        spans.push(at..end);
        let size: usize = spans.iter().map(ExactSizeIterator::len).sum();
        let feed = || {
            let mut state = self.state();
            // short pieces (the text between long strings) gathered into one update: BLAKE3
            // hashes a run of whole chunks at once, a short update chunk by chunk
            let mut short = Vec::new();
            for span in spans {
                let piece = &bytes[span];
                if piece.len() < GATHER_BELOW {
                    short.extend_from_slice(piece);
                    continue;
                }
                if !short.is_empty() {
                    state.update(&short);
                    short.clear();
                }
                state.update(piece);
            }
            state.update(&short);
        };
        if size >= DETACH_FROM {
            py.detach(feed);
        } else {
            feed();
        }
        Ok(true)
    }

    /// A state of its own that has seen what this one has.
    fn copy(&self) -> Self {
        Self::from_state(self.state().clone())
    }

    /// The digest of everything fed so far (the state goes on).
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.state().digest())
    }

    /// Bytes of heap the state holds (what `tracemalloc` does not see).
    #[getter]
    fn nbytes(&self) -> usize {
        self.state().nbytes()
    }
}

/// Whether `span` is exactly the UTF-8 of `text` (an ASCII text compared in place; another
/// encoded first, and never equal with a lone surrogate).
fn holds_text(span: &[u8], text: &Bound<'_, PyString>) -> bool {
    if let Some(ascii) = ascii_bytes(text) {
        return ascii == span;
    }
    text.encode_utf8().is_ok_and(|utf8| utf8.as_bytes() == span)
}

/// Token ids as native-endian u32 (an `array('I')`'s bytes) read from `text`, a JSON array
/// of ints in [0, 2**32) as JSON writes them; else None (decode it as `json.loads` would).
/// The GIL is released for texts from `DETACH_FROM` bytes.
#[pyfunction]
pub fn json_u32_ids<'py>(py: Python<'py>, text: &[u8]) -> Option<Bound<'py, PyBytes>> {
    let packed = if text.len() >= DETACH_FROM {
        py.detach(|| engine::json::u32_ids(text))
    } else {
        engine::json::u32_ids(text)
    };
    packed.map(|out| PyBytes::new(py, &out))
}

/// `(start, end, ids)`: where the last top-level member `key` (written without escapes) of
/// the JSON object `text` holds its array of ids, packed as `json_u32_ids` packs them; None
/// when it holds anything else, or is missing, or `text` is not an object the scan can
/// follow. The other members are skipped, not checked: decode `text` with that span put out
/// of the way, which checks them. The GIL is released for texts from `DETACH_FROM` bytes.
#[pyfunction]
pub fn json_member_ids<'py>(
    py: Python<'py>,
    text: &[u8],
    key: &str,
) -> Option<(usize, usize, Bound<'py, PyBytes>)> {
    let found = if text.len() >= DETACH_FROM {
        py.detach(|| engine::json::member_ids(text, key.as_bytes()))
    } else {
        engine::json::member_ids(text, key.as_bytes())
    };
    found.map(|f| (f.start, f.end, PyBytes::new(py, &f.packed)))
}

/// The top-level fields of a JSON object text as `(key, start, end)` (each value's byte
/// range), in the text's order, a repeated key each time; None when the text is not one
/// object or a key is written with an escape. The structure is followed, the tokens are not
/// checked: the capture server's data plane hands these to `split_body` for a body its full
/// decode found valid strict UTF-8.
#[pyfunction]
pub fn json_fields(text: &[u8]) -> Option<Vec<(String, usize, usize)>> {
    engine::json::scan::fields(text).map(|found| {
        found
            .into_iter()
            .map(|(key, start, end)| (key.to_string(), start, end))
            .collect()
    })
}

/// Token ids as native-endian u32 (an `array('I')`'s bytes) when `ids` holds only exact
/// ints in [0, 2**32); else None (a bool, an int subclass, anything else: the caller's own
/// checks say what it is). One pass, no list of checked ids made.
#[pyfunction]
pub fn u32_ids<'py>(py: Python<'py>, ids: &Bound<'py, PyList>) -> Option<Bound<'py, PyBytes>> {
    let list = ids.as_ptr();
    let int_t = &raw mut ffi::PyLong_Type;
    let mut fits = true;
    let packed = PyBytes::new_with(py, ids.len() * 4, |out| {
        for (slot, i) in out.chunks_exact_mut(4).zip(0..) {
            // SAFETY: `i` is below the list's length, which nothing changes meanwhile (no
            // Python code runs: an exact int converts without any); the item is borrowed
            let item = unsafe { ffi::PyList_GET_ITEM(list, i) };
            // SAFETY: a live object's type pointer, compared only
            if unsafe { ffi::Py_TYPE(item) } != int_t {
                fits = false;
                break;
            }
            // SAFETY: an exact int (an error, for a negative or too large one, is cleared below)
            let Ok(value) = u32::try_from(unsafe { ffi::PyLong_AsUnsignedLong(item) }) else {
                fits = false;
                break;
            };
            slot.copy_from_slice(&value.to_ne_bytes());
        }
        Ok(())
    });
    if !fits {
        drop(PyErr::take(py));
        return None;
    }
    packed.ok()
}
