//! File frames for the file layer: the encoders of versions 2 and 1, and `FrameScan`, which
//! verifies the frames of a file with the GIL released and then hands them out one by one.
//!
//! Damage is handed back as plain values (`FrameScan.damage`, `FrameTooLarge`'s message):
//! `rollout_store.files.framing` raises the library's errors from them.

use engine::file::frames::{self as ef, BlobFrame, Counters, DamageKind, Frame, Kinds, Scan};
use engine::file::frames_v1 as v1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PySlice, PyString, PyTuple};

use crate::packed::{ascii_bytes, utf8_of};
use crate::{FrameTooLarge, DETACH_FROM};

fn kinds(digest_kinds: u128, max_kind: u8) -> Kinds {
    Kinds {
        digest: digest_kinds,
        max: max_kind.min(0x7F),
    }
}

fn too_large(error: ef::EncodeError) -> PyErr {
    FrameTooLarge::new_err(error.to_string())
}

/// The chain value of a frame (`hashed`: its unescaped payload, a blob's: its digest).
#[pyfunction]
pub fn frame_chain_value(kind_byte: u8, length: u32, prev: u64, hashed: &[u8]) -> u64 {
    ef::chain_value(kind_byte, length, prev, hashed)
}

/// (frame bytes, its chain value) for a record of `kind` after the frame valued `prev`.
#[pyfunction]
pub fn encode_frame<'py>(
    py: Python<'py>,
    kind: u8,
    payload: &[u8],
    prev: u64,
) -> PyResult<(Bound<'py, PyBytes>, u64)> {
    let encoded = if payload.len() >= DETACH_FROM {
        py.detach(|| ef::encode_frame(kind, payload, prev))
    } else {
        ef::encode_frame(kind, payload, prev)
    };
    let (frame, value) = encoded.map_err(too_large)?;
    Ok((PyBytes::new(py, &frame), value))
}

/// A blob frame as parts (header, digest, text) and its chain value; a whole escaped frame
/// when the digest holds the escape bytes. The text is never copied: a `bytes` of UTF-8 is
/// the part itself, an ASCII `str` is its storage (`AsciiText`); any other `str` is encoded
/// with `surrogatepass` into a new `bytes`.
#[pyfunction]
pub fn encode_blob_frame<'py>(
    py: Python<'py>,
    kind: u8,
    digest: &Bound<'py, PyBytes>,
    data: &Bound<'py, PyAny>,
    prev: u64,
) -> PyResult<(Bound<'py, PyList>, u64)> {
    let text = Text::of(data)?;
    let (frame, value) =
        ef::encode_blob_frame(kind, digest.as_bytes(), text.bytes(), prev).map_err(too_large)?;
    let parts = match frame {
        BlobFrame::Parts(header) => PyList::new(
            py,
            [
                PyBytes::new(py, &header).into_any(),
                digest.clone().into_any(),
                text.into_part(py)?,
            ],
        )?,
        BlobFrame::Whole(bytes) => PyList::new(py, [PyBytes::new(py, &bytes)])?,
    };
    Ok((parts, value))
}

/// A blob's text as a frame holds it: the object's own bytes, or its UTF-8 made anew.
enum Text<'a, 'py> {
    Borrowed(&'a Bound<'py, PyAny>, &'a [u8]),
    Encoded(Vec<u8>),
}

impl<'a, 'py> Text<'a, 'py> {
    fn of(data: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(bytes) = data.cast::<PyBytes>() {
            return Ok(Self::Borrowed(data, bytes.as_bytes()));
        }
        let text = data.cast::<PyString>()?;
        if let Some(ascii) = ascii_bytes(text) {
            return Ok(Self::Borrowed(data, ascii));
        }
        let mut out = Vec::new();
        utf8_of(text, &mut out);
        Ok(Self::Encoded(out))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Self::Borrowed(_, bytes) => bytes,
            Self::Encoded(bytes) => bytes,
        }
    }

    fn into_part(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Self::Borrowed(object, _) => match object.cast::<PyString>() {
                Ok(text) => Bound::new(
                    py,
                    AsciiText {
                        text: text.clone().unbind(),
                    },
                )?
                .into_any(),
                Err(_) => object.clone(),
            },
            Self::Encoded(bytes) => PyBytes::new(py, &bytes).into_any(),
        })
    }
}

/// A blob's ASCII text as a frame's part: the str's own storage (which is its UTF-8) as a
/// read-only buffer, so `os.writev` and `bytes.join` take it where the text would otherwise
/// be encoded into a copy first.
#[pyclass(frozen, module = "rollout_store._core")]
pub struct AsciiText {
    text: Py<PyString>,
}

#[pymethods]
impl AsciiText {
    fn __len__(&self, py: Python<'_>) -> usize {
        ascii_bytes(self.text.bind(py)).map_or(0, <[u8]>::len)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, ascii_bytes(self.text.bind(py)).unwrap_or_default())
    }

    /// # Safety
    /// `view` is the buffer the interpreter asks this object to fill.
    unsafe fn __getbuffer__(
        slf: &Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let text = slf.get().text.bind(slf.py());
        let bytes = ascii_bytes(text).unwrap_or_default();
        let len = pyo3::ffi::Py_ssize_t::try_from(bytes.len())?;
        // SAFETY: the view holds a reference to this object, which holds the str: its
        // storage lives, unchanged (a str never changes), as long as the view
        let filled = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr().cast_mut().cast(),
                len,
                1,
                flags,
            )
        };
        if filled == 0 {
            Ok(())
        } else {
            Err(PyErr::fetch(slf.py()))
        }
    }
}

/// The version-1 frame of a record of `kind` (to extend a version-1 log).
#[pyfunction]
pub fn encode_frame_v1<'py>(
    py: Python<'py>,
    kind: u8,
    payload: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let encoded = if payload.len() >= DETACH_FROM {
        py.detach(|| v1::encode_frame(kind, payload))
    } else {
        v1::encode_frame(kind, payload)
    };
    Ok(PyBytes::new(py, &encoded.map_err(too_large)?))
}

/// A version-1 blob frame as parts: its header and payload up to the text, then the text
/// (as `encode_blob_frame` holds it).
#[pyfunction]
pub fn encode_blob_frame_v1<'py>(
    py: Python<'py>,
    kind: u8,
    digest: &[u8],
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let digest: &[u8; ef::DIGEST_SIZE] = digest.try_into().map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "a blob digest is {} bytes, not {}",
            ef::DIGEST_SIZE,
            digest.len()
        ))
    })?;
    let text = Text::of(data)?;
    let bytes = text.bytes();
    let head = if bytes.len() >= DETACH_FROM {
        py.detach(|| v1::encode_blob_frame(kind, digest, bytes))
    } else {
        v1::encode_blob_frame(kind, digest, bytes)
    }
    .map_err(too_large)?;
    PyList::new(
        py,
        [PyBytes::new(py, &head).into_any(), text.into_part(py)?],
    )
}

/// `(intact, hashed bytes, searched bytes, candidates)`: whether the version-1 file `data`
/// ends with an intact frame that starts after the damaged one at `start`, found with the
/// GIL released.
#[pyfunction]
pub fn intact_end_after_v1(py: Python<'_>, data: &[u8], start: usize) -> (bool, u64, u64, u64) {
    let mut counters = Counters::default();
    let intact = py.detach(|| v1::intact_end_after(data, start, &mut counters));
    (
        intact,
        counters.hashed_bytes,
        counters.searched_bytes,
        counters.candidates,
    )
}

/// `(offset or None, hashed bytes, searched bytes, candidates)`: the first whole frame that
/// verifies by itself after `after`, found with the GIL released.
#[pyfunction]
pub fn next_frame(
    py: Python<'_>,
    data: &[u8],
    after: usize,
    digest_kinds: u128,
    max_kind: u8,
) -> (Option<usize>, u64, u64, u64) {
    let mut counters = Counters::default();
    let found =
        py.detach(|| ef::next_frame(data, after, kinds(digest_kinds, max_kind), &mut counters));
    (
        found,
        counters.hashed_bytes,
        counters.searched_bytes,
        counters.candidates,
    )
}

/// The frame tuple Python reads: (kind, payload, offset, record, end, chain); the payload a
/// memoryview of `data` or, for an escaped frame, of its unescaped bytes.
fn frame_tuple<'py>(
    py: Python<'py>,
    view: &Bound<'py, PyAny>,
    frame: &Frame,
) -> PyResult<Bound<'py, PyTuple>> {
    let payload = match &frame.unescaped {
        Some(bytes) => PyMemoryView::from(&PyBytes::new(py, bytes).into_any())?.into_any(),
        // offsets inside a bytes object, which holds at most isize::MAX bytes
        None => view.get_item(PySlice::new(
            py,
            isize::try_from(frame.start).unwrap_or(isize::MAX),
            isize::try_from(frame.end).unwrap_or(isize::MAX),
            1,
        ))?,
    };
    (
        frame.kind,
        payload,
        frame.offset,
        frame.record,
        frame.end,
        frame.chain,
    )
        .into_pyobject(py)
}

/// `(start, end, kinds or None, repaired frame tuple or None, hashed bytes)`: what the
/// damaged bytes `[start, end)` held (`prev`: the chain value before them, `record`: the
/// number of the first damaged frame), found with the GIL released.
#[pyfunction]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn read_gap<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    start: usize,
    end: usize,
    prev: u64,
    record: u64,
    digest_kinds: u128,
    max_kind: u8,
) -> PyResult<(
    usize,
    usize,
    Option<Vec<u8>>,
    Option<Bound<'py, PyTuple>>,
    u64,
)> {
    let bytes = data.as_bytes();
    if start > end
        || end
            .checked_add(ef::HEADER_SIZE)
            .is_none_or(|e| e > bytes.len())
    {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "read_gap: `end` must be the offset of a whole frame header after `start`",
        ));
    }
    let mut counters = Counters::default();
    let gap = py.detach(|| {
        ef::read_gap(
            bytes,
            start,
            end,
            prev,
            record,
            kinds(digest_kinds, max_kind),
            &mut counters,
        )
    });
    let repaired = match &gap.repaired {
        Some(frame) => {
            let view = PyMemoryView::from(data.as_any())?.into_any();
            Some(frame_tuple(py, &view, frame)?)
        }
        None => None,
    };
    Ok((
        gap.start,
        gap.end,
        gap.kinds,
        repaired,
        counters.hashed_bytes,
    ))
}

/// The frames of a file from `start`, verified in order with the GIL released when the scan
/// is made (version 2: each bound to the one before it; `FrameScan.v1`: version 1, each by
/// its own checksum); iterating yields them as (kind, payload, offset, record, end, chain)
/// and stops at the end or at the first damage, which `damage` then describes.
#[pyclass(module = "rollout_store._core")]
pub struct FrameScan {
    view: Py<PyAny>,
    scan: Scan,
    next: usize,
    counters: Counters,
}

impl FrameScan {
    /// The frames `scan` finds in `data` (run with the GIL released), handed out from the
    /// first.
    fn scanned(
        py: Python<'_>,
        data: &Bound<'_, PyBytes>,
        scan: impl FnOnce(&[u8], &mut Counters) -> Scan + Send,
    ) -> PyResult<Self> {
        let bytes = data.as_bytes();
        let mut counters = Counters::default();
        let scan = py.detach(|| scan(bytes, &mut counters));
        let view = PyMemoryView::from(data.as_any())?.into_any().unbind();
        Ok(Self {
            view,
            scan,
            next: 0,
            counters,
        })
    }
}

#[pymethods]
impl FrameScan {
    #[new]
    #[pyo3(signature = (data, start, chain, record, digest_kinds, max_kind))]
    fn new(
        py: Python<'_>,
        data: &Bound<'_, PyBytes>,
        start: usize,
        chain: u64,
        record: u64,
        digest_kinds: u128,
        max_kind: u8,
    ) -> PyResult<Self> {
        Self::scanned(py, data, |bytes, counters| {
            ef::scan(
                bytes,
                start,
                chain,
                record,
                kinds(digest_kinds, max_kind),
                counters,
            )
        })
    }

    /// The frames of a version-1 file from `start` (numbered from `record`), each verified
    /// by its checksum (chain values 0); at damage, `torn` says whether it is a torn tail.
    #[staticmethod]
    #[pyo3(signature = (data, start, record))]
    fn v1(py: Python<'_>, data: &Bound<'_, PyBytes>, start: usize, record: u64) -> PyResult<Self> {
        Self::scanned(py, data, |bytes, counters| {
            v1::scan(bytes, start, record, counters)
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(frame) = self.scan.frames.get(self.next) else {
            return Ok(None);
        };
        self.next += 1;
        frame_tuple(py, self.view.bind(py), frame).map(Some)
    }

    /// Where the frame after the last one read starts.
    #[getter]
    fn offset(&self) -> usize {
        self.scan.offset
    }

    /// The chain value the frame at `offset` must name.
    #[getter]
    fn chain(&self) -> u64 {
        self.scan.chain
    }

    /// The record number of the frame at `offset`.
    #[getter]
    fn records(&self) -> u64 {
        self.scan.record
    }

    /// None, or `(message, offset, record, checksum)` of the first damaged frame; `checksum`
    /// is None or `(what, expected, actual)` for a checksum that does not match (ints for a
    /// record's chain value, bytes for a blob's digest).
    #[getter]
    #[allow(clippy::type_complexity)]
    fn damage<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(String, usize, u64, Option<Bound<'py, PyTuple>>)>> {
        let Some(stop) = &self.scan.stop else {
            return Ok(None);
        };
        let damage = &stop.damage;
        let checksum = match &damage.kind {
            DamageKind::Checksum { expected, actual } => {
                Some(("record", *expected, *actual).into_pyobject(py)?)
            }
            DamageKind::BlobDigest { expected, actual } => Some(
                ("blob", PyBytes::new(py, expected), PyBytes::new(py, actual)).into_pyobject(py)?,
            ),
            _ => None,
        };
        Ok(Some((
            damage.kind.to_string(),
            damage.offset,
            damage.record,
            checksum,
        )))
    }

    /// Where the next whole frame after the damage starts (None: a torn tail, or no damage).
    #[getter]
    fn resync(&self) -> Option<usize> {
        self.scan.stop.as_ref().and_then(|s| s.resync)
    }

    /// Whether the damage is a torn tail: no intact frame follows it (False: no damage).
    #[getter]
    fn torn(&self) -> bool {
        self.scan.stop.as_ref().is_some_and(|s| s.torn)
    }

    /// `(hashed bytes, searched bytes, candidates)`: the work the scan did.
    #[getter]
    fn counters(&self) -> (u64, u64, u64) {
        (
            self.counters.hashed_bytes,
            self.counters.searched_bytes,
            self.counters.candidates,
        )
    }
}
