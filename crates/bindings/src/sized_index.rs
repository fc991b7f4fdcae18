//! `SizedIndex`: the engine's token index (turn numbers under 64-bit keys, each with a
//! length, found by a range of lengths), for a graph's linker.

use std::sync::{Mutex, MutexGuard, PoisonError};

use engine::sized_index::{self, Needed};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Turn numbers under 64-bit keys, each filed with a length; a key of more than `small`
/// turns holds them by length, a large length group by content digest (see
/// `engine::sized_index`).
///
/// The content functions are Python callables, called with nothing held: filing asks the
/// index what it needs, computes it, then files (asking again if the index changed
/// meanwhile).
#[pyclass(frozen, module = "rollout_store._core")]
pub struct SizedIndex {
    inner: Mutex<sized_index::SizedIndex>,
}

impl SizedIndex {
    /// The index; every change finishes its checks before it changes anything, so a
    /// poisoned lock is taken over. No Python code runs while it is held.
    fn index(&self) -> MutexGuard<'_, sized_index::SizedIndex> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A length bound from Python: lengths are `u32`, so a larger low bound admits none.
fn low_bound(low: u64) -> Option<u32> {
    u32::try_from(low).ok()
}

#[pymethods]
impl SizedIndex {
    #[new]
    #[pyo3(signature = (small = 8))]
    fn new(small: usize) -> Self {
        Self {
            inner: Mutex::new(sized_index::SizedIndex::new(small)),
        }
    }

    /// File turn `item` under `key` with `length`. `content(turn)`, if given, is the content
    /// digest (a 64-bit int) a large length group holds turns by; called only when needed.
    #[pyo3(signature = (key, item, length, content = None))]
    fn add(
        &self,
        key: u64,
        item: u32,
        length: u32,
        content: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let Some(content) = content else {
            // with no digests given, filing never needs them: never stale
            let _ = self.index().add(key, item, length, &[]);
            return Ok(());
        };
        loop {
            let needed = self.index().content_needed(key, length);
            let digests: Vec<u64> = match needed {
                Needed::Nothing => Vec::new(),
                Needed::New => vec![content.call1((item,))?.extract()?],
                Needed::Members(members) => members
                    .into_iter()
                    .chain([item])
                    .map(|member| content.call1((member,))?.extract())
                    .collect::<PyResult<_>>()?,
            };
            if self.index().add(key, item, length, &digests).is_ok() {
                return Ok(());
            }
        }
    }

    /// File turn `item` under each of `keys` with `length`, no content digests (a root
    /// under its prompt's heads and blocks): one call for them all.
    fn add_all(&self, keys: Vec<u64>, item: u32, length: u32) {
        let mut index = self.index();
        for key in keys {
            // with no digests given, filing never needs them: never stale
            let _ = index.add(key, item, length, &[]);
        }
    }

    /// Take turn `item`, filed with `length`, from under each of `keys`; how many held it.
    fn remove_all(&self, keys: Vec<u64>, item: u32, length: u32) -> usize {
        let mut index = self.index();
        keys.into_iter()
            .filter(|&key| index.remove(key, item, length))
            .count()
    }

    /// Take turn `item`, filed with `length`, from under `key`; whether it was there.
    fn remove(&self, key: u64, item: u32, length: u32) -> bool {
        self.index().remove(key, item, length)
    }

    /// The turns under `key` that may have a length in `[low, high)`: every turn of a key of
    /// few (the caller checks each), the groups in range of a large one.
    #[pyo3(signature = (key, low = 0, high = u64::MAX))]
    fn members(&self, key: u64, low: u64, high: u64) -> Vec<u32> {
        let mut out = Vec::new();
        if let Some(low) = low_bound(low) {
            self.index().members(key, low, high, &mut out);
        }
        out
    }

    /// `members`, but of a group held by content only the turns whose digest is
    /// `content_at(length)` (a 64-bit int; the caller still checks each).
    fn exact(
        &self,
        key: u64,
        low: u64,
        high: u64,
        content_at: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let Some(low) = low_bound(low) else {
            return Ok(Vec::new());
        };
        let lengths = self.index().content_lengths(key, low, high);
        let digests = lengths
            .iter()
            .map(|&length| Ok((length, content_at.call1((length,))?.extract::<u64>()?)))
            .collect::<PyResult<Vec<(u32, u64)>>>()?;
        let digest_at = |length: u32| {
            digests
                .iter()
                .find(|(l, _)| *l == length)
                .map(|&(_, digest)| digest)
        };
        let mut out = Vec::new();
        self.index().exact(key, low, high, &digest_at, &mut out);
        Ok(out)
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        key.extract::<u64>()
            .is_ok_and(|key| self.index().contains_key(key))
    }

    /// Keys that hold a turn.
    fn __len__(&self) -> usize {
        self.index().len()
    }

    /// Every key with its turns, as `(key, [turn, ...])` (in no set order of keys).
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let entries: Vec<(u64, Vec<u32>)> = self.index().iter().collect();
        PyList::new(py, entries)
    }

    /// Turns handed out by `members` and `exact` so far (what tests hold to bounds).
    #[getter]
    fn visited(&self) -> u64 {
        self.index().visited()
    }

    /// Bytes of heap the index holds (what `tracemalloc` does not see).
    #[getter]
    fn nbytes(&self) -> usize {
        self.index().nbytes()
    }
}
