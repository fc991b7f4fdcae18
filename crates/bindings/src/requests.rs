//! `RequestTable`: the engine's request table and its one base-finder (see the engine's
//! `requests`), for requests given as plain packings or as the raw JSON text of their
//! messages.

use std::sync::{Mutex, MutexGuard, PoisonError};

use engine::requests::{self, Found, PackedRun, RawError, RawFound, Requests, DIGEST_SIZE};
use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyList, PyString};

use crate::hashing::Blake3;
use crate::packed::{Packed, Packer};
use crate::{DecodeError, Unconfirmed, DETACH_FROM};
use engine::content::content_key;
use engine::digest::State;

/// A boundary `prefixes` answers: `(len, digest, turns)`.
type PrefixTuple<'py> = (usize, Bound<'py, PyBytes>, Vec<u32>);

/// The depth a text of messages may nest to by default: each message a value nested as
/// deep as `Packer` takes one (`MAX_DEPTH`), their array one level more (as the capture
/// server's depth check counts a body's messages).
const MESSAGES_MAX_DEPTH: usize = crate::packed::MAX_DEPTH + 1;

/// What `find` answers: `(base, base_len, echo, digest)`.
type FoundTuple<'py> = (Option<u32>, usize, bool, Bound<'py, PyBytes>);

/// Strings of this many code points or more are a decoded tip's holes by default (the
/// graph's default share threshold: longer strings are its blobs, held once already):
/// compared with a re-sent request's, not hashed again.
const HOLE_MIN: usize = 1024;

/// Decoded tips a table keeps, the oldest dropped first (the graph's `MAX_TIPS`).
const MAX_TIPS: usize = 64;

/// A conversation's latest decoded request that holds long strings. A request that re-sends
/// its messages is known to by the hollow packing of those (each long string a hole) and by
/// its long strings compared one by one, so the packings' BLAKE3 state is taken from here
/// and only its new messages are hashed.
struct DecodedTip {
    turn: u32,
    n_rest: usize,
    /// the xxh3 of its last message's plain packing (a filter: the tip confirms)
    last_key: u128,
    /// the BLAKE3 state of its messages' hollow packings, and its digest
    hollow: State,
    hollow_digest: [u8; DIGEST_SIZE],
    /// its long strings, in order (the graph's blob table holds them: no copy)
    strings: Vec<Py<PyString>>,
    /// the BLAKE3 state of its messages' plain packings, and their byte count
    packings: State,
    fed: u64,
}

impl DecodedTip {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        Self {
            turn: self.turn,
            n_rest: self.n_rest,
            last_key: self.last_key,
            hollow: self.hollow.clone(),
            hollow_digest: self.hollow_digest,
            strings: self.strings.iter().map(|s| s.clone_ref(py)).collect(),
            packings: self.packings.clone(),
            fed: self.fed,
        }
    }
}

/// The tip a request found by `find_messages(..., tip=True)` leaves once it is filed: a
/// `DecodedTip` but for its turn, and which tips it replaces.
struct TipParts {
    n_rest: usize,
    last_key: u128,
    hollow: State,
    strings: Vec<Py<PyString>>,
    /// where the strings of its new messages begin in `strings` (those before are the tip
    /// it continued, adopted then: see `PendingTip::adopt`)
    own_from: usize,
    packings: State,
    fed: u64,
    /// the tip it continued, and its base: both give way to it
    gone: Option<u32>,
    base: Option<u32>,
}

impl TipParts {
    /// The tip a request of `n_rest` messages leaves: the tip it `continued` (if any) and its
    /// new messages' hollow packing (`new`; None: they hold no long string, so their plain
    /// packing `plain` is their hollow one). Its packings' state is set by `with_packings`.
    fn after(
        continued: Option<DecodedTip>,
        new: Option<Packed>,
        plain: &[u8],
        n_rest: usize,
        last_key: Option<u128>,
        base: Option<u32>,
    ) -> Self {
        let gone = continued.as_ref().map(|tip| tip.turn);
        let (mut hollow, mut strings, continued_key) = match continued {
            Some(tip) => (tip.hollow, tip.strings, tip.last_key),
            None => (State::new(), Vec::new(), 0),
        };
        let own_from = strings.len();
        match new {
            Some(new) => {
                hollow.update(&new.buffer);
                strings.extend(new.holes);
            }
            None => {
                hollow.update(plain);
            }
        }
        Self {
            n_rest,
            last_key: last_key.unwrap_or(continued_key),
            hollow,
            strings,
            own_from,
            packings: State::new(),
            fed: 0,
            gone,
            base,
        }
    }

    fn with_packings(mut self, packings: State, fed: u64) -> Self {
        self.packings = packings;
        self.fed = fed;
        self
    }
}

/// The decoded tip a request leaves, handed to `RequestTable.file` with the request (kept
/// then) or let go. Taken once.
#[pyclass(frozen, module = "rollout_store._core")]
pub struct PendingTip {
    parts: Mutex<Option<TipParts>>,
    n_rest: usize,
}

#[pymethods]
impl PendingTip {
    /// The message count of the request it is the tip of.
    #[getter]
    fn n_rest(&self) -> usize {
        self.n_rest
    }

    /// Hold the graph's own object of each long string of the request's new messages:
    /// `canonical(s)` answers the string equal to `s` that the graph holds already (its blob
    /// table's, or a memory store's that graphs share), or None. The request's own objects
    /// are fresh ones when it was decoded from its own text: a tip holding them would keep
    /// a copy of a string every conversation of the graph (or of the store) shares.
    fn adopt(&self, py: Python<'_>, canonical: &Bound<'_, PyAny>) -> PyResult<()> {
        let taken = self
            .parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(mut parts) = taken else {
            return Ok(());
        };
        // (no lock held while Python runs; the parts are put back whatever it raised)
        let own_from = parts.own_from;
        let result = parts.strings[own_from..].iter_mut().try_for_each(|string| {
            let found = canonical.call1((string.clone_ref(py),))?;
            if let Ok(found) = found.cast_exact::<PyString>() {
                if !found.is(&*string) && found.as_any().eq(string.bind(py))? {
                    *string = found.clone().unbind();
                }
            }
            Ok(())
        });
        parts.own_from = parts.strings.len();
        *self.parts.lock().unwrap_or_else(PoisonError::into_inner) = Some(parts);
        result
    }

    /// The long strings the tip holds, in order (for tests: whose objects they are).
    fn strings(&self, py: Python<'_>) -> Vec<Py<PyString>> {
        self.parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|parts| parts.strings.iter().map(|s| s.clone_ref(py)).collect())
            .unwrap_or_default()
    }
}

/// Whether two lists of strings hold equal strings, in order.
fn same_strings(py: Python<'_>, a: &[Py<PyString>], b: &[Py<PyString>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.is(y) || PyAnyMethods::eq(x.bind(py).as_any(), y.bind(py)).unwrap_or(false)
        })
}

/// A graph's filed requests and the base-finder: `find` the longest filed request a request
/// starts with (the first filed of twins), `file` a request under its digest.
#[pyclass(frozen, module = "rollout_store._core")]
pub struct RequestTable {
    inner: Mutex<Requests>,
    /// decoded tips, oldest first (see `DecodedTip`); never held while Python runs
    tips: Mutex<Vec<DecodedTip>>,
    /// requests filed that were read from a decoded tip on (for tests and figures)
    tip_hits: std::sync::atomic::AtomicU64,
    /// strings of this many code points or more are a decoded tip's holes
    hole_min: usize,
    /// the bytes the last request walked packed to (the next one's buffer is made as large)
    packed_hint: std::sync::atomic::AtomicUsize,
}

impl RequestTable {
    /// The table; a panic while it was held left it consistent (filing changes nothing before
    /// its last fallible step), so a poisoned lock is taken over.
    fn table(&self) -> MutexGuard<'_, Requests> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn tips(&self) -> MutexGuard<'_, Vec<DecodedTip>> {
        self.tips.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The tip `messages` re-sends, if any: the newest whose last message packs alike, whose
    /// hollow packing is theirs and whose long strings equal theirs.
    fn tip_of(
        &self,
        py: Python<'_>,
        packer: &mut Packer,
        messages: &Bound<'_, PyList>,
    ) -> PyResult<Option<DecodedTip>> {
        let n = messages.len();
        let heads: Vec<(u32, usize, u128)> = self
            .tips()
            .iter()
            .rev()
            .filter(|tip| tip.n_rest > 0 && tip.n_rest <= n)
            .map(|tip| (tip.turn, tip.n_rest, tip.last_key))
            .collect();
        let mut last_keys: Vec<(usize, u128)> = Vec::new();
        for (turn, n_rest, last_key) in heads {
            let key = if let Some(&(_, key)) = last_keys.iter().find(|(at, _)| *at == n_rest) {
                key
            } else {
                let last =
                    packer.pack_range(py, messages, n_rest - 1..n_rest, usize::MAX, false, 0)?;
                let key = content_key(&last.buffer);
                last_keys.push((n_rest, key));
                key
            };
            if key != last_key {
                continue;
            }
            let Some(tip) = self
                .tips()
                .iter()
                .find(|tip| tip.turn == turn)
                .map(|tip| tip.clone_ref(py))
            else {
                continue; // (dropped meanwhile)
            };
            let hollow = packer.pack_range(py, messages, 0..n_rest, self.hole_min, true, 0)?;
            // (a walk that ran a subclass's Python code stands for no packing but its own)
            if !hollow.called
                && *blake3::hash(&hollow.buffer).as_bytes() == tip.hollow_digest
                && same_strings(py, &hollow.holes, &tip.strings)
            {
                return Ok(Some(tip));
            }
        }
        Ok(None)
    }

    /// Find the base of a request given as Python values (see `find_messages`), from the tip
    /// it re-sends if any; with `tip`, also work out the tip it would leave (`None` when it
    /// leaves none); with `file`, file it as that turn (with its response's packing) and keep
    /// that tip. `(first, plains, found)` and the tip.
    fn walk_request<'py>(
        &self,
        py: Python<'py>,
        packer: &Bound<'py, Packer>,
        messages: &Bound<'py, PyList>,
        refuted: &[u32],
        tip: bool,
        file: Option<(u32, Option<&[u8]>)>,
    ) -> PyResult<(RawTuple<'py>, Option<TipParts>)> {
        let n = messages.len();
        let mut packer = packer.borrow_mut();
        let continued = self.tip_of(py, &mut packer, messages)?;
        let first = continued.as_ref().map_or(0, |tip| tip.n_rest);
        // room for what the last request packed to, and a little more (a conversation's next
        // request re-sends it): one buffer, not one a doubling
        let hint = self.packed_hint.load(std::sync::atomic::Ordering::Relaxed);
        let plain = packer.pack_range(
            py,
            messages,
            first..n,
            self.hole_min,
            false,
            hint + hint / 16 + 1024,
        )?;
        self.packed_hint
            .store(plain.buffer.len(), std::sync::atomic::Ordering::Relaxed);
        let mut start = 0;
        let plains: Vec<&[u8]> = plain
            .ends
            .iter()
            .map(|&end| {
                let piece = &plain.buffer[start..end];
                start = end;
                piece
            })
            .collect();
        // the new messages' hollow packing, for the tip this request leaves: none from a walk
        // that ran a subclass's Python code, whose second walk may see other values than the
        // plain walk hashed (a later request compared with them would get the wrong packings)
        let keeps_tip = tip && !plain.called && (continued.is_some() || plain.long_seen);
        let new_hollow = if keeps_tip && plain.long_seen {
            Some(packer.pack_range(
                py,
                messages,
                first..n,
                self.hole_min,
                true,
                plain.buffer.len(),
            )?)
        } else {
            None
        };
        drop(packer);
        let resume = continued
            .as_ref()
            .map(|tip| (tip.packings.clone(), tip.fed, tip.n_rest));
        let (found, packings, fed) = self
            .with_table(py, plain.buffer.len(), |table| {
                let run = PackedRun {
                    buffer: &plain.buffer,
                    ends: &plain.ends,
                };
                let (found, packings, fed) = table.find_resumed(resume, &run, refuted);
                if let Some((turn, response)) = file {
                    if found.ask.is_none() {
                        table.file(turn, n, found.digest, response)?;
                    }
                }
                Ok((found, packings, fed))
            })
            .map_err(|err: requests::FileError| file_error(&err))?;
        let found_tuple = found_tuple(py, &found)?;
        let parts = (keeps_tip && found.ask.is_none()).then(|| {
            let last_key = plains.last().map(|last| content_key(last));
            TipParts::after(
                continued,
                new_hollow,
                &plain.buffer,
                n,
                last_key,
                found.base,
            )
            .with_packings(packings, fed)
        });
        let parts = match (parts, file) {
            (Some(parts), Some((turn, _))) => {
                self.keep_tip(turn, parts);
                None
            }
            (parts, _) => parts,
        };
        let base_len = found.base_len;
        let kept = PyList::new(
            py,
            plains[base_len - first..]
                .iter()
                .map(|p| PyBytes::new(py, p)),
        )?;
        Ok(((base_len, kept, found_tuple), parts))
    }

    /// Keep the tip a request filed as `turn` leaves; the tip it continued (and its base's,
    /// if that is one) gives way to it, as a raw tip does: a conversation keeps one.
    fn keep_tip(&self, turn: u32, parts: TipParts) {
        if parts.gone.is_some() {
            self.tip_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut tips = self.tips();
        tips.retain(|tip| Some(tip.turn) != parts.gone && Some(tip.turn) != parts.base);
        if tips.len() >= MAX_TIPS {
            tips.remove(0);
        }
        let hollow_digest = parts.hollow.digest();
        tips.push(DecodedTip {
            turn,
            n_rest: parts.n_rest,
            last_key: parts.last_key,
            hollow: parts.hollow,
            hollow_digest,
            strings: parts.strings,
            packings: parts.packings,
            fed: parts.fed,
        });
    }

    /// `work` on the table over `size` bytes (a text, packings), the GIL released when they
    /// are many (reading and hashing them is pure Rust work). The lock is taken and let go
    /// with the GIL released: held while waiting for the GIL, it would deadlock with a thread
    /// that holds the GIL and waits for it. It is held for all of `work`: a request found for
    /// filing is filed before any other turn, or what it found could miss a turn filed
    /// before it.
    fn with_table<T: Send>(
        &self,
        py: Python<'_>,
        size: usize,
        work: impl FnOnce(&mut Requests) -> T + Send,
    ) -> T {
        if size >= DETACH_FROM {
            py.detach(|| work(&mut self.table()))
        } else {
            work(&mut self.table())
        }
    }
}

/// The most digits `json.loads` converts to an int now (0: no limit).
fn max_digits(py: Python<'_>) -> PyResult<usize> {
    py.import("sys")?
        .call_method0("get_int_max_str_digits")?
        .extract()
}

/// The bytes of a list of `bytes`, borrowed (no copy).
fn backed(plains: &Bound<'_, PyList>) -> PyResult<Vec<PyBackedBytes>> {
    plains
        .iter()
        .map(|plain| plain.extract().map_err(PyErr::from))
        .collect()
}

/// A request digest given from Python.
fn digest_arg(digest: &[u8]) -> PyResult<[u8; DIGEST_SIZE]> {
    digest.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "a request digest is {DIGEST_SIZE} bytes, not {}",
            digest.len()
        ))
    })
}

fn file_error(err: &requests::FileError) -> PyErr {
    match err {
        requests::FileError::Full => PyOverflowError::new_err(err.to_string()),
        _ => PyValueError::new_err(err.to_string()),
    }
}

/// What was found, or `Unconfirmed` when the base is undecided (see `Found::ask`).
fn found_tuple<'py>(py: Python<'py>, found: &Found) -> PyResult<FoundTuple<'py>> {
    if let Some(ask) = found.ask {
        return Err(Unconfirmed::new_err((
            format!(
                "the request may extend turn {}, read by its key alone: compare its {} \
                 messages, then confirm or refute it",
                ask.turn, ask.len
            ),
            ask.turn,
            ask.len,
            PyBytes::new(py, &ask.digest).unbind(),
        )));
    }
    Ok((
        found.base,
        found.base_len,
        found.echo,
        PyBytes::new(py, &found.digest),
    ))
}

/// A `RawError` as the exception `json.loads` (or the library) raises for it.
fn raw_error(py: Python<'_>, err: &RawError) -> PyErr {
    match err {
        RawError::Syntax(e) => {
            let exc = DecodeError::new_err(e.to_string());
            if let Err(set) = exc.value(py).setattr("offset", e.offset) {
                return set;
            }
            exc
        }
        RawError::NotArray => PyValueError::new_err(format!("request_messages: {err}")),
        RawError::Digits { .. } => PyValueError::new_err(err.to_string()),
    }
}

/// An exception for a filing refused (`Undecided`: as `find` raises it).
fn add_file_error(py: Python<'_>, raw: &RawFound, err: &requests::FileError) -> PyErr {
    match err {
        requests::FileError::Undecided(_) => match found_tuple(py, &raw.found) {
            Err(undecided) => undecided,
            Ok(_) => file_error(err),
        },
        _ => file_error(err),
    }
}

/// Why `add_json` filed nothing: its text, or the filing (with what was read).
enum AddError {
    Read(RawError),
    File(Box<RawFound>, requests::FileError),
}

/// `(first, plains, found)` of a raw text read by the table.
type RawTuple<'py> = (usize, Bound<'py, PyList>, FoundTuple<'py>);

/// `find_tipped`'s answer: `find_messages`'s and the tip.
type TippedTuple<'py> = (
    usize,
    Bound<'py, PyList>,
    FoundTuple<'py>,
    Option<Bound<'py, PendingTip>>,
);

fn raw_tuple<'py>(py: Python<'py>, raw: &RawFound) -> PyResult<RawTuple<'py>> {
    let found = found_tuple(py, &raw.found)?;
    let plains = PyList::new(py, raw.plains.iter().map(|p| PyBytes::new(py, p)))?;
    Ok((raw.first, plains, found))
}

#[pymethods]
impl RequestTable {
    #[new]
    #[pyo3(signature = (*, hole_min = HOLE_MIN))]
    fn new(hole_min: usize) -> Self {
        Self {
            hole_min: hole_min.max(1),
            inner: Mutex::new(Requests::new()),
            tips: Mutex::new(Vec::new()),
            tip_hits: std::sync::atomic::AtomicU64::new(0),
            packed_hint: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// `(base, base_len, echo, digest)` for a request whose non-system messages pack as
    /// `plains`: the filed turn it extends (None: none) and its message count, whether the
    /// message after those has the xxh3 of that turn's response (confirm it with the bytes),
    /// and the request's digest.
    /// `Unconfirmed` when it may extend a turn filed by its key alone (`file_key`) and not
    /// in `refuted`.
    #[pyo3(signature = (plains, *, refuted = Vec::new()))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    fn find<'py>(
        &self,
        py: Python<'py>,
        plains: &Bound<'py, PyList>,
        refuted: Vec<u32>,
    ) -> PyResult<FoundTuple<'py>> {
        let plains = backed(plains)?;
        let size = plains.iter().map(|plain| plain.len()).sum();
        let found = self.with_table(py, size, |table| table.find_past(&plains, &refuted));
        found_tuple(py, &found)
    }

    /// `find` for a request whose first `first` messages are known to be those of a filed
    /// request whose packings `state` has hashed (a raw tip's), the others packing as
    /// `plains`: only those are hashed. No base shorter than `first` messages is looked for.
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    #[pyo3(signature = (state, first, plains, *, refuted = Vec::new()))]
    fn find_after<'py>(
        &self,
        py: Python<'py>,
        state: &Bound<'py, Blake3>,
        first: usize,
        plains: &Bound<'py, PyList>,
        refuted: Vec<u32>,
    ) -> PyResult<FoundTuple<'py>> {
        let plains = backed(plains)?;
        let size = plains.iter().map(|plain| plain.len()).sum();
        let resume = Some((state.get().snapshot(), 0, first));
        let (found, _, _) = self.with_table(py, size, |table| {
            table.find_resumed(resume, &plains[..], &refuted)
        });
        found_tuple(py, &found)
    }

    /// `(first, plains, (base, base_len, echo, digest))` for a request whose non-system
    /// messages are `messages` (Python values), packed by `packer` (a plain one: no
    /// `intern`) in one walk with no `bytes` object a message: `plains` are the packings of
    /// messages `first` on (the base's message count: the messages a stored tail holds).
    /// Raises what `Packer.pack` raises for a message it refuses (the path starts with its
    /// index), and `Unconfirmed` as `find`.
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    #[pyo3(signature = (packer, messages, *, refuted = Vec::new()))]
    fn find_messages<'py>(
        &self,
        py: Python<'py>,
        packer: &Bound<'py, Packer>,
        messages: &Bound<'py, PyList>,
        refuted: Vec<u32>,
    ) -> PyResult<RawTuple<'py>> {
        Ok(self
            .walk_request(py, packer, messages, &refuted, false, None)?
            .0)
    }

    /// `find_messages`, and the decoded tip the request would leave (see `add_messages`),
    /// for `file` to keep when the request is filed: `(first, plains, found, tip)`, the tip
    /// None when it leaves none.
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    #[pyo3(signature = (packer, messages, *, refuted = Vec::new()))]
    fn find_tipped<'py>(
        &self,
        py: Python<'py>,
        packer: &Bound<'py, Packer>,
        messages: &Bound<'py, PyList>,
        refuted: Vec<u32>,
    ) -> PyResult<TippedTuple<'py>> {
        let ((first, plains, found), parts) =
            self.walk_request(py, packer, messages, &refuted, true, None)?;
        let tip = parts
            .map(|parts| {
                Bound::new(
                    py,
                    PendingTip {
                        n_rest: parts.n_rest,
                        parts: Mutex::new(Some(parts)),
                    },
                )
            })
            .transpose()?;
        Ok((first, plains, found, tip))
    }

    /// `find_messages`, then `file` the request as turn `turn` (with its response's plain
    /// packing). A request holding strings of `hole_min` code points or more becomes its
    /// conversation's decoded tip: a later request that re-sends it is known by comparing
    /// those strings (not hashing them again) and only its new messages are hashed. Nothing
    /// is filed when it raises.
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    #[pyo3(signature = (turn, packer, messages, response = None, *, refuted = Vec::new()))]
    fn add_messages<'py>(
        &self,
        py: Python<'py>,
        turn: u32,
        packer: &Bound<'py, Packer>,
        messages: &Bound<'py, PyList>,
        response: Option<&[u8]>,
        refuted: Vec<u32>,
    ) -> PyResult<RawTuple<'py>> {
        Ok(self
            .walk_request(py, packer, messages, &refuted, true, Some((turn, response)))?
            .0)
    }

    /// Let go of the decoded tips: they only spare a later request hashing what it re-sends.
    fn drop_tips(&self) {
        // (taken out under the lock, let go after it: a string's last reference may run
        // Python code, which must not run under the lock)
        let tips = std::mem::take(&mut *self.tips());
        drop(tips);
    }

    /// Decoded tips kept (see `add_messages`).
    #[getter]
    fn decoded_tips(&self) -> usize {
        self.tips().len()
    }

    /// The long strings the decoded tips hold, oldest tip first (for tests: whose objects
    /// they are).
    fn tip_strings(&self, py: Python<'_>) -> Vec<Py<PyString>> {
        self.tips()
            .iter()
            .flat_map(|tip| tip.strings.iter().map(|s| s.clone_ref(py)))
            .collect()
    }

    /// Requests filed by `add_messages` that were read from a decoded tip on (their long
    /// strings compared, only their new messages hashed).
    #[getter]
    fn decoded_tip_hits(&self) -> u64 {
        self.tip_hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `(first, plains, (base, base_len, echo, digest))` for a request given as the JSON text
    /// of its non-system messages (an array), read as `json.loads` reads it: `plains` are the
    /// packings of messages `first` on (those before are the raw tip's it re-sends, not read
    /// again). `DecodeError` for text that is not JSON or nests deeper than `max_depth` (by
    /// default each message as deep as the graph takes a value), `ValueError` for one that
    /// is not an array or holds an int `json.loads` refuses.
    #[pyo3(signature = (text, /, *, max_depth = MESSAGES_MAX_DEPTH, refuted = Vec::new()))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    fn find_json<'py>(
        &self,
        py: Python<'py>,
        text: &[u8],
        max_depth: usize,
        refuted: Vec<u32>,
    ) -> PyResult<RawTuple<'py>> {
        let max_digits = max_digits(py)?;
        let raw = self
            .with_table(py, text.len(), |table| {
                table.find_raw_past(text, max_depth, max_digits, &refuted)
            })
            .map_err(|err| raw_error(py, &err))?;
        raw_tuple(py, &raw)
    }

    /// `find_json`, then `file` the request as turn `turn` (with its response's plain
    /// packing): it becomes its conversation's raw tip, the one a text re-sending it is read
    /// from. Nothing is filed when it raises.
    #[pyo3(signature = (
        turn, text, response = None, *, max_depth = MESSAGES_MAX_DEPTH, refuted = Vec::new()
    ))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a list as an owned Vec
    fn add_json<'py>(
        &self,
        py: Python<'py>,
        turn: u32,
        text: &[u8],
        response: Option<&[u8]>,
        max_depth: usize,
        refuted: Vec<u32>,
    ) -> PyResult<RawTuple<'py>> {
        let max_digits = max_digits(py)?;
        let raw = self.with_table(py, text.len(), |table| {
            let raw = table
                .find_raw_past(text, max_depth, max_digits, &refuted)
                .map_err(AddError::Read)?;
            match table.file_raw(turn, &raw, response) {
                Ok(()) => Ok(raw),
                Err(err) => Err(AddError::File(Box::new(raw), err)),
            }
        });
        let raw = raw.map_err(|err| match err {
            AddError::Read(err) => raw_error(py, &err),
            AddError::File(raw, err) => add_file_error(py, &raw, &err),
        })?;
        raw_tuple(py, &raw)
    }

    /// The stored tail of a request whose messages pack as `plains`, found to extend a
    /// request of `base_len` messages (`echo`: the next is its response): an array header,
    /// then the packings after the base's, the first as the echo placeholder if it is one.
    #[staticmethod]
    fn tail<'py>(
        py: Python<'py>,
        plains: &Bound<'py, PyList>,
        base_len: usize,
        echo: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let plains = backed(plains)?;
        if base_len > plains.len() || (echo && base_len == plains.len()) {
            return Err(PyValueError::new_err(format!(
                "a base of {base_len} messages{} in a request of {}",
                if echo { " and an echo" } else { "" },
                plains.len()
            )));
        }
        let found = Found {
            base: None,
            base_len,
            echo,
            digest: [0; DIGEST_SIZE],
            ask: None,
        };
        Ok(PyBytes::new(py, &Requests::tail(&plains, &found)))
    }

    /// File turn `turn`'s request of `n_rest` messages under its 32-byte `digest`, with its
    /// response's plain packing (None: no response). Turns are filed in increasing order;
    /// `ValueError` otherwise, and nothing changes.
    #[pyo3(signature = (turn, n_rest, digest, response = None, *, tip = None))]
    fn file(
        &self,
        turn: u32,
        n_rest: usize,
        digest: &[u8],
        response: Option<&[u8]>,
        tip: Option<&Bound<'_, PendingTip>>,
    ) -> PyResult<()> {
        let digest = digest_arg(digest)?;
        if let Some(tip) = tip {
            if tip.get().n_rest != n_rest {
                return Err(PyValueError::new_err(format!(
                    "the tip is of a request of {} messages, not {n_rest}",
                    tip.get().n_rest
                )));
            }
        }
        self.table()
            .file(turn, n_rest, digest, response)
            .map_err(|err| file_error(&err))?;
        let parts = tip.and_then(|tip| {
            tip.get()
                .parts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        });
        if let Some(parts) = parts {
            self.keep_tip(turn, parts);
        }
        Ok(())
    }

    /// File turn `turn`'s request of `n_rest` messages by its 8-byte index `key` alone (a turn
    /// read from a file, whose record names that key), with its response's plain packing:
    /// unconfirmed until `confirm` (`find` raises `Unconfirmed` where it may be a base).
    #[pyo3(signature = (turn, n_rest, key, response = None))]
    fn file_key(
        &self,
        turn: u32,
        n_rest: usize,
        key: u64,
        response: Option<&[u8]>,
    ) -> PyResult<()> {
        self.table()
            .file_key(turn, n_rest, key, response)
            .map_err(|err| file_error(&err))
    }

    /// Confirm a turn filed by its key: its request's bytes were found equal to those of a
    /// request whose digest is `digest` (as `Unconfirmed` gives it). True: confirmed (or so
    /// already); False: `digest` is not under its key, or it is confirmed with another, and
    /// nothing changes; None: not filed.
    fn confirm(&self, turn: u32, digest: &[u8]) -> PyResult<Option<bool>> {
        let digest = digest_arg(digest)?;
        Ok(self.table().confirm(turn, &digest))
    }

    /// Turns filed by their key and not confirmed yet.
    #[getter]
    fn unconfirmed(&self) -> usize {
        self.table().unconfirmed()
    }

    /// Every boundary of a request whose non-system messages pack as `plains` where it
    /// extends filed turns, longest first: `(len, digest, turns)`, the turns in filing order
    /// (a turn filed by its key alone is named where its key and count are met: compare the
    /// bytes), at most `most` of them (None: all).
    #[pyo3(signature = (plains, *, most = None))]
    fn prefixes<'py>(
        &self,
        py: Python<'py>,
        plains: &Bound<'py, PyList>,
        most: Option<usize>,
    ) -> PyResult<Vec<PrefixTuple<'py>>> {
        let plains = backed(plains)?;
        let found = self
            .table()
            .prefixes_most(&plains, most.unwrap_or(usize::MAX));
        Ok(found
            .into_iter()
            .map(|p| (p.len, PyBytes::new(py, &p.digest), p.turns))
            .collect())
    }

    /// The index key of every prefix of a request whose messages pack as `plains`
    /// (`keys[m]`: of its first `m` messages).
    #[staticmethod]
    fn keys(plains: &Bound<'_, PyList>) -> PyResult<Vec<u64>> {
        Ok(Requests::keys(&backed(plains)?))
    }

    /// Note that a filed turn has a child (False: it is not filed).
    fn note_child(&self, turn: u32) -> bool {
        self.table().note_child(turn)
    }

    /// Whether a filed turn has a child (None: not filed).
    fn has_children(&self, turn: u32) -> Option<bool> {
        self.table().has_children(turn)
    }

    /// The turns filed under the index key `key` (a digest's first 8 bytes, little-endian,
    /// or the key a turn was filed by alone), in filing order.
    fn filed_under(&self, key: u64) -> Vec<u32> {
        self.table().filed_under(key)
    }

    /// The digest of a filed turn's request (None: not filed, or filed by its key alone and
    /// not confirmed).
    fn digest<'py>(&self, py: Python<'py>, turn: u32) -> Option<Bound<'py, PyBytes>> {
        self.table()
            .digest(turn)
            .map(|digest| PyBytes::new(py, &digest))
    }

    /// The message count of a filed turn's request (None: not filed).
    fn n_rest(&self, turn: u32) -> Option<usize> {
        self.table().n_rest(turn)
    }

    /// Whether `packed` may be a filed turn's response: it has the xxh3 the row keeps
    /// (None: not filed; False: not, or no response). Confirm with the bytes.
    fn echoes(&self, turn: u32, packed: &[u8]) -> Option<bool> {
        self.table().echoes(turn, packed)
    }

    /// Raw texts filed that were read from a tip on (only their new messages read).
    #[getter]
    fn raw_tip_hits(&self) -> u64 {
        self.table().raw_tip_hits()
    }

    fn __len__(&self) -> usize {
        self.table().len()
    }

    /// Bytes the table holds, spare capacity included (what `tracemalloc` cannot see).
    #[getter]
    fn nbytes(&self) -> usize {
        let tips: usize = self
            .tips()
            .iter()
            .map(|tip| {
                std::mem::size_of::<DecodedTip>()
                    + tip.strings.capacity() * 8
                    + tip.hollow.nbytes()
                    + tip.packings.nbytes()
            })
            .sum();
        self.table().nbytes() + tips
    }
}

/// Whether the message whose plain packing is `message` echoes, loosely, the response whose
/// plain packing is `response` (their link keys equal, as the library's `response_link_key`
/// and `link_key` compare in Python); None where bytes cannot tell (a NaN, a text part whose
/// text is not a string, a packing that is not plain): Python decides then.
#[pyfunction]
pub fn link_echoes(py: Python<'_>, response: &[u8], message: &[u8]) -> PyResult<Option<bool>> {
    Ok(engine::link_key::echoes(response, message, max_digits(py)?).ok())
}
