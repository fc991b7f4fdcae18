//! `DataPlane`: the gateway crate's data plane, owned (and stopped) by a Python object, its
//! control plane called back through the GIL. Argument conversion only.

use std::borrow::Cow;
use std::net::ToSocketAddrs;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use gateway::checks::Hosts;
use gateway::sse::Strip;
use gateway::{
    Answered, Call, Config, Control, Direct, DirectLane, Finished, Gateway, Ledger, Prepared,
    Queued, Reply, Sent, Streamed, Streaming, Upstream,
};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyTuple};

/// The Python control plane, as the gateway calls it.
struct PyControl {
    control: Py<PyAny>,
}

fn server_error() -> Reply {
    Reply {
        status: 500,
        headers: vec![(
            Bytes::from_static(b"content-type"),
            Bytes::from_static(b"text/plain; charset=utf-8"),
        )],
        chunks: vec![Bytes::from_static(b"Internal Server Error")],
        stream: false,
    }
}

/// A reply as the control plane gives it: status, headers, the body's chunks, streamed.
type PyReply = (u16, Vec<(Vec<u8>, Vec<u8>)>, Vec<Vec<u8>>, bool);

/// A streaming call as the control plane prepares it: its stream's headers, whether it is
/// Anthropic's, and whether its events lose their token ids and their logprobs.
type PyStreaming = (Vec<(Vec<u8>, Vec<u8>)>, bool, bool, bool);

fn reply_of(value: &Bound<'_, PyAny>) -> PyResult<Reply> {
    let (status, headers, chunks, stream): PyReply = value.extract()?;
    Ok(Reply {
        status,
        headers: headers
            .into_iter()
            .map(|(n, v)| (Bytes::from(n), Bytes::from(v)))
            .collect(),
        chunks: chunks.into_iter().map(Bytes::from).collect(),
        stream,
    })
}

/// What `finish` or `finish_stream` answered, `(reply, queue, timed)`; a stream's answer
/// also says whether its held-back last event is released (`stream`).
fn finished_of(out: &Bound<'_, PyAny>, stream: bool) -> PyResult<Finished> {
    Ok(Finished {
        reply: reply_of(&out.get_item(0)?)?,
        queue: out.get_item(1)?.extract()?,
        timed: out.get_item(2)?.extract()?,
        release: stream && out.get_item(3)?.extract()?,
    })
}

fn bytes_or_none<'py>(py: Python<'py>, value: Option<&Bytes>) -> Option<Bound<'py, PyBytes>> {
    value.map(|v| PyBytes::new(py, v))
}

/// The upstream headers of a route as the control plane makes them: a name with no value is
/// the call's own.
type PyHeaders = Vec<(String, Option<String>)>;

/// `--ack fast`'s direct lane as the control plane gives it: `(capture_tokens, max_digits,
/// Chat Completions headers, Anthropic headers, ledger)`.
type PyDirectLane = (bool, usize, PyHeaders, PyHeaders, Option<Py<PyLedger>>);

/// A call's arguments as `prepare` and `answered` take them (`answered` adds the answer and
/// its stamps), in `prepare`'s order.
type CallArgs<'py> = (
    bool,
    Option<String>,
    Option<String>,
    Vec<(String, Bound<'py, PyBytes>)>,
    Bound<'py, PyBytes>,
    u64,
    bool,
    bool,
    bool,
    Option<Vec<(String, usize, usize)>>,
    Option<usize>,
);

fn call_args<'py>(py: Python<'py>, call: &Call) -> CallArgs<'py> {
    let headers = call
        .headers
        .iter()
        .map(|(n, v)| (n.clone(), PyBytes::new(py, v)))
        .collect();
    (
        call.anthropic,
        call.session.clone(),
        call.key.clone(),
        headers,
        PyBytes::new(py, &call.body),
        call.received_us,
        call.checked.depth,
        call.checked.shape,
        call.checked.utf8,
        call.fields.clone(),
        call.checked.digits,
    )
}

/// What a call carries between the gateway's calls of the control: the control's object of
/// it (a prepared call's, made by `prepare`), or, for a call of the direct lane, what the
/// control makes it of (`adopt`), on the thread that first needs it (the recorder's).
pub struct Ticket {
    object: OnceLock<Option<Py<PyAny>>>,
    direct: Mutex<Option<Direct>>,
}

impl Ticket {
    fn prepared(object: Py<PyAny>) -> Self {
        Self {
            object: OnceLock::from(Some(object)),
            direct: Mutex::new(None),
        }
    }

    /// The control's object of the call: adopted first if it is the direct lane's; `None`
    /// when the control made none of it (it counted its turn as dropped).
    fn object(&self, py: Python<'_>, control: &PyControl) -> Option<Py<PyAny>> {
        if let Some(object) = self.object.get() {
            return object.as_ref().map(|o| o.clone_ref(py));
        }
        let taken = self
            .direct
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let adopted = taken.and_then(|direct| control.adopt(py, &direct));
        let object = self.object.get_or_init(|| adopted);
        object.as_ref().map(|o| o.clone_ref(py))
    }
}

impl PyControl {
    /// The control's object of a call of the direct lane (`adopt`: its plan made, its turn
    /// told of); `None` when the control counted it as dropped instead (or failed to).
    fn adopt(&self, py: Python<'_>, direct: &Direct) -> Option<Py<PyAny>> {
        let session = direct
            .call
            .handle
            .as_ref()
            .and_then(|h| h.object.downcast_ref::<Py<PyAny>>())
            .map(|s| s.clone_ref(py));
        let (line, entry) = match direct.line {
            Answered::Written(entry) => ("written", entry),
            Answered::Retired => ("retired", 0),
            Answered::Failed | Answered::Closed => ("failed", 0),
        };
        let args = call_args(py, &direct.call);
        let stamps = (direct.upstream_sent, direct.first_byte, direct.last_byte);
        let answer = PyBytes::new(py, &direct.answer);
        self.control
            .call_method1(py, "adopt", (args, session, answer, stamps, line, entry))
            .map_or_else(
                |error| {
                    error.print(py);
                    None
                },
                |out| (!out.is_none(py)).then_some(out),
            )
    }

    /// The control's `prepare`; `late`: a call of the direct lane, answered already, whose
    /// session is the one its key opened once its body was read (`held=`, its handle's
    /// object).
    fn try_prepare(&self, py: Python<'_>, call: &Call, late: bool) -> PyResult<Prepared<Ticket>> {
        let arrived_in = late
            .then_some(call.handle.as_ref())
            .flatten()
            .and_then(|h| h.object.downcast_ref::<Py<PyAny>>())
            .map(|s| s.clone_ref(py));
        let out = match arrived_in {
            Some(session) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("held", session)?;
                self.control
                    .call_method(py, "prepare", call_args(py, call), Some(&kwargs))?
            }
            None => self
                .control
                .call_method1(py, "prepare", call_args(py, call))?,
        };
        let out = out.bind(py).cast::<PyTuple>()?.clone();
        let ticket = out.get_item(0)?;
        if ticket.is_none() {
            return Ok(Prepared::Refuse(reply_of(&out.get_item(1)?)?));
        }
        let path: String = out.get_item(1)?.extract()?;
        // the body is sent from the Python bytes themselves (not a copy of them), after the
        // call's own body up to `head`
        let (head, body): (usize, PyBackedBytes) = out.get_item(2)?.extract()?;
        let headers: Vec<(String, String)> = out.get_item(3)?.extract()?;
        let stream: Option<PyStreaming> = out.get_item(4)?.extract()?;
        Ok(Prepared::Forward {
            path,
            head,
            body: Bytes::from_owner(body),
            headers,
            ticket: Ticket::prepared(ticket.unbind()),
            stream: stream.map(|(headers, anthropic, token_ids, logprobs)| Streaming {
                headers: headers
                    .into_iter()
                    .map(|(n, v)| (Bytes::from(n), Bytes::from(v)))
                    .collect(),
                anthropic,
                strip: Strip {
                    token_ids,
                    logprobs,
                },
            }),
        })
    }

    fn try_finish_stream(
        &self,
        py: Python<'_>,
        ticket: &Py<PyAny>,
        streamed: &Streamed,
    ) -> PyResult<Finished> {
        let out = self.control.call_method1(
            py,
            "finish_stream",
            (
                ticket.clone_ref(py),
                PyBytes::new(py, &streamed.events),
                streamed.error.clone(),
                (
                    streamed.upstream_sent,
                    streamed.first_byte,
                    streamed.last_byte,
                ),
            ),
        )?;
        finished_of(out.bind(py), true)
    }

    fn try_finish(&self, py: Python<'_>, ticket: &Py<PyAny>, up: &Upstream) -> PyResult<Finished> {
        let out = self.control.call_method1(
            py,
            "finish",
            (
                ticket.clone_ref(py),
                up.status,
                up.error.clone(),
                bytes_or_none(py, up.content_type.as_ref()),
                bytes_or_none(py, up.retry_after.as_ref()),
                PyBytes::new(py, &up.body),
                (up.upstream_sent, up.first_byte, up.last_byte),
                up.started,
            ),
        )?;
        finished_of(out.bind(py), false)
    }
}

/// The control's object of a prepared call (every ticket `finish` and `waits` see).
fn prepared(ticket: &Ticket) -> &Py<PyAny> {
    match ticket.object.get() {
        Some(Some(object)) => object,
        // (a direct lane's call is never finished: it was answered)
        _ => unreachable!("a call of the direct lane is never finished"),
    }
}

impl Control for PyControl {
    type Ticket = Ticket;

    fn batch(&self, work: &mut dyn FnMut()) {
        Python::attach(|_| work());
    }

    /// The thread is attached once, for its life, and lets the GIL go at once: each later
    /// `attach` only takes the GIL, where a thread attached per call would make and free
    /// an interpreter thread state (and its frame stack's mapping) every time.
    fn thread(&self, work: &mut (dyn FnMut() + Send)) {
        Python::attach(|py| py.detach(work));
    }

    fn waits(&self, ticket: &Ticket) -> bool {
        Python::attach(|py| {
            self.control
                .call_method1(py, "waits", (prepared(ticket).clone_ref(py),))
                .and_then(|out| out.extract(py))
                .unwrap_or_else(|error| {
                    error.print(py);
                    false
                })
        })
    }

    fn prepare(&self, call: Call) -> Prepared<Ticket> {
        Python::attach(|py| {
            self.try_prepare(py, &call, false).unwrap_or_else(|error| {
                error.print(py);
                Prepared::Refuse(server_error())
            })
        })
    }

    fn prepare_late(&self, call: Call) -> Prepared<Ticket> {
        Python::attach(|py| {
            self.try_prepare(py, &call, true).unwrap_or_else(|error| {
                error.print(py);
                Prepared::Refuse(server_error())
            })
        })
    }

    fn direct(&self, direct: Direct) -> Option<Ticket> {
        Some(Ticket {
            object: OnceLock::new(),
            direct: Mutex::new(Some(direct)),
        })
    }

    fn finish(&self, ticket: &Ticket, upstream: Upstream) -> Finished {
        Python::attach(|py| {
            self.try_finish(py, prepared(ticket), &upstream)
                .unwrap_or_else(|error| {
                    error.print(py);
                    Finished {
                        reply: server_error(),
                        ..Finished::default()
                    }
                })
        })
    }

    fn finish_stream(&self, ticket: &Ticket, streamed: Streamed) -> Finished {
        Python::attach(|py| {
            self.try_finish_stream(py, prepared(ticket), &streamed)
                .unwrap_or_else(|error| {
                    error.print(py);
                    Finished::default()
                })
        })
    }

    fn adopt(&self, tickets: &[&Ticket]) {
        if tickets.iter().any(|t| t.object.get().is_none()) {
            Python::attach(|py| {
                for ticket in tickets {
                    drop(ticket.object(py, self));
                }
            });
        }
    }

    fn record(&self, tickets: &[&Ticket]) -> Vec<usize> {
        Python::attach(|py| {
            // (a call of the direct lane the control made nothing of is done: counted)
            let (at, calls): (Vec<usize>, Vec<Py<PyAny>>) = tickets
                .iter()
                .enumerate()
                .filter_map(|(i, t)| t.object(py, self).map(|o| (i, o)))
                .unzip();
            if calls.is_empty() {
                return Vec::new();
            }
            // the indices set aside (a list; anything else: none), as `tickets` number them
            match self.control.call_method1(py, "record", (calls,)) {
                Ok(held) => held
                    .extract::<Vec<usize>>(py)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|i| at.get(i).copied())
                    .collect(),
                Err(error) => {
                    error.print(py);
                    Vec::new()
                }
            }
        })
    }

    fn dropped(&self, ticket: &Ticket, why: &'static str) {
        Python::attach(|py| {
            let Some(object) = ticket.object(py, self) else {
                return;
            };
            if let Err(error) = self.control.call_method1(py, "dropped", (object, why)) {
                error.print(py);
            }
        });
    }

    fn sent(&self, ticket: &Ticket, sent: Sent) -> bool {
        Python::attach(|py| {
            let Some(object) = ticket.object(py, self) else {
                return true;
            };
            let args = (object, sent.reply_sent, sent.chunks, sent.max_chunk_gap);
            // false: to be called again (anything else: done)
            match self.control.call_method1(py, "sent", args) {
                Ok(done) => done.extract(py).unwrap_or(true),
                Err(error) => {
                    error.print(py);
                    true
                }
            }
        })
    }
}

/// The data plane: the model routes served by hyper on a runtime of its own, the rest
/// proxied to the control plane's listener; the control plane's callbacks (`prepare`,
/// `adopt`, `waits`, `finish`, `finish_stream`, `record`, `dropped`, `sent`) are methods of
/// `control` (`record` returns the indices of the calls it set aside, `sent` False to be
/// called again). `stop` ends it.
/// `callers`: threads the callbacks run on (one when a callback never waits on I/O).
/// `forward_only`: a floor for benchmarks (calls go upstream and come back as they came,
/// with no key, no callback and nothing recorded).
/// `direct`: `--ack fast`'s direct lane, `(capture_tokens, max_digits, Chat Completions
/// headers, Anthropic headers, ledger)` (a header with no value: the call's own): the model
/// calls sent upstream and answered with no callback, their
/// ack ledger line written (to `ledger`, the control plane's, unless None) before the reply;
/// the recorder hands each to the control's `adopt` first (None: every call is prepared).
#[pyclass(frozen, module = "rollout_store._core")]
pub struct DataPlane {
    gateway: Mutex<Option<Gateway<PyControl>>>,
    /// Its queue of turns, waited for (`settle`) without holding `gateway`, which a key's
    /// change takes with the GIL held.
    queued: Queued,
    port: u16,
}

impl Drop for DataPlane {
    /// A data plane let go unstopped stops with the GIL let go: its threads hold their
    /// interpreter state for life (`PyControl::thread`) and take the GIL once more to end.
    /// Let go while the interpreter finalizes (alive at exit), it is abandoned: its threads
    /// could never take the GIL again, and waiting for them would hang the exit.
    fn drop(&mut self) {
        let taken = self
            .gateway
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(mut gateway) = taken else {
            return;
        };
        // SAFETY: reads the runtime's flag, which finalization clears before it frees objects
        if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
            gateway.abandon();
        } else {
            Python::attach(|py| py.detach(move || gateway.stop(Duration::from_secs(10))));
        }
    }
}

impl DataPlane {
    fn with<R>(&self, work: impl FnOnce(&Gateway<PyControl>) -> R) -> PyResult<R> {
        let gateway = self.gateway.lock().unwrap_or_else(PoisonError::into_inner);
        gateway
            .as_ref()
            .map(work)
            .ok_or_else(|| PyRuntimeError::new_err("the data plane is stopped"))
    }
}

fn seconds(value: f64, name: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!("{name} must be a positive number of seconds"))
        })
}

#[pymethods]
impl DataPlane {
    #[new]
    #[pyo3(signature = (
        control, *, host, port, backend_port, upstream, hosts, open_mode, max_body_bytes,
        body_timeout, body_timeout_text, upstream_timeout, stream_keepalive, fast, ack_queue, workers = 2,
        callers = 1, forward_only = false, direct = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control: Py<PyAny>,
        host: &str,
        port: u16,
        backend_port: u16,
        upstream: &str,
        hosts: Option<Vec<String>>,
        open_mode: bool,
        max_body_bytes: u64,
        body_timeout: f64,
        body_timeout_text: &str,
        upstream_timeout: f64,
        stream_keepalive: f64,
        fast: bool,
        ack_queue: usize,
        workers: usize,
        callers: usize,
        forward_only: bool,
        direct: Option<PyDirectLane>,
    ) -> PyResult<Self> {
        let listen = (host.trim_start_matches('[').trim_end_matches(']'), port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| PyOSError::new_err(format!("no address for {host:?}")))?;
        let config = Config {
            listen,
            upstream: upstream.trim_end_matches('/').to_string(),
            backend: ([127, 0, 0, 1], backend_port).into(),
            hosts: hosts.map_or_else(Hosts::any, Hosts::only),
            open_mode,
            max_body_bytes,
            body_timeout: seconds(body_timeout, "body_timeout")?,
            body_timeout_text: body_timeout_text.to_string(),
            upstream_timeout: seconds(upstream_timeout, "upstream_timeout")?,
            stream_keepalive: seconds(stream_keepalive, "stream_keepalive")?,
            fast,
            ack_queue: ack_queue.max(1),
            workers,
            callers,
            forward_only,
            direct: direct.map(
                |(capture_tokens, max_digits, chat, messages, ledger)| DirectLane {
                    capture_tokens,
                    max_digits,
                    chat_headers: chat,
                    messages_headers: messages,
                    ledger: ledger.map(|l| l.get().inner.clone()),
                },
            ),
        };
        let gateway = py.detach(|| Gateway::start(config, PyControl { control }))?;
        let port = gateway.local_addr().port();
        Ok(Self {
            queued: gateway.queued(),
            gateway: Mutex::new(Some(gateway)),
            port,
        })
    }

    /// The port the listener is bound to.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Let `key` (UTF-8 bytes) open the session `session_id`; `session`: the control's
    /// object of it, which a call of the direct lane holds until it is answered (None: the
    /// session's calls are all prepared).
    #[pyo3(signature = (key, session_id, session = None))]
    fn set_key(&self, key: &[u8], session_id: &str, session: Option<Py<PyAny>>) -> PyResult<()> {
        let object = session.map(|s| Arc::new(s) as Arc<dyn std::any::Any + Send + Sync>);
        self.with(|g| g.set_key(key, session_id, object))
    }

    /// A stream of `session_id` passes through, its turn not queued yet: the direct lane
    /// leaves the session's calls to `waits` until `stream_ended`.
    fn stream_begun(&self, session_id: &str) -> PyResult<()> {
        self.with(|g| g.stream_begun(session_id))
    }

    /// One such stream's turn is queued, or let go.
    fn stream_ended(&self, session_id: &str) -> PyResult<()> {
        self.with(|g| g.stream_ended(session_id))
    }

    /// Forget `key`; whether it was known.
    fn remove_key(&self, key: &[u8]) -> PyResult<bool> {
        self.with(|g| g.remove_key(key))
    }

    /// The turns sent to the recorder so far (see `handed_through`).
    fn turns_sent(&self) -> PyResult<u64> {
        self.with(Gateway::turns_sent)
    }

    /// Whether the recorder has handed the first `sent` turns to the control: every call
    /// answered before `turns_sent` said `sent` is known to it (the direct lane's adopted).
    fn handed_through(&self, sent: u64) -> bool {
        self.queued.handed_through(sent)
    }

    /// Turns queued (`fast`) and waiting for the recorder.
    fn pending(&self) -> PyResult<usize> {
        self.with(|_| self.queued.waiting())
    }

    /// Wait at most `timeout` seconds until every queued turn is recorded or dropped;
    /// whether it was.
    fn settle(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = Duration::try_from_secs_f64(timeout.max(0.0)).unwrap_or(Duration::ZERO);
        self.with(|_| ())?;
        Ok(py.detach(|| self.queued.settle(timeout)))
    }

    /// Stop serving; the queued turns are recorded for at most `drain` seconds (the rest are
    /// reported dropped). Stopping twice does nothing.
    #[pyo3(signature = (drain = 10.0))]
    fn stop(&self, py: Python<'_>, drain: f64) {
        let drain = Duration::try_from_secs_f64(drain.max(0.0)).unwrap_or(Duration::ZERO);
        let taken = self
            .gateway
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut gateway) = taken {
            py.detach(move || gateway.stop(drain));
        }
    }
}

/// The upstream body of a model call the data plane's direct lane sends by itself (`--ack
/// fast`), as `(head, tail)`: the body's own `body[:head]`, then `tail`; None when the
/// control plane prepares the call (`gateway::direct::body_tail`; `anthropic`: a
/// `/v1/messages` call). For tests: the lane must send what the control plane's
/// `upstream_parts` makes of the body.
#[pyfunction]
#[pyo3(signature = (body, capture_tokens, max_digits, anthropic = false))]
pub fn direct_tail<'py>(
    py: Python<'py>,
    body: &[u8],
    capture_tokens: bool,
    max_digits: usize,
    anthropic: bool,
) -> Option<(usize, Bound<'py, PyBytes>)> {
    let route = if anthropic {
        gateway::direct::Route::Messages
    } else {
        gateway::direct::Route::Chat { capture_tokens }
    };
    gateway::direct::body_tail(body, route, max_digits)
        .map(|(head, tail)| (head, PyBytes::new(py, &tail)))
}

/// The first field (in the body's order) of a model call's body that nests deeper than it
/// may, by name, as the data plane's depth check judges it before anything else of the body
/// (`gateway::depth::too_deep`); None when none does, or the check leaves the body to the
/// control plane. For the Python server to refuse such a body for that reason first, as
/// the data plane does. The GIL is released for bodies from `DETACH_FROM` bytes.
#[pyfunction]
pub fn body_too_deep(py: Python<'_>, body: &[u8], anthropic: bool) -> Option<String> {
    if body.len() >= crate::DETACH_FROM {
        py.detach(|| gateway::depth::too_deep(body, anthropic))
    } else {
        gateway::depth::too_deep(body, anthropic)
    }
}

/// The reply to a complete answer the upstream sent with a 2xx status
/// (`gateway::sse::answer_reply`): `answer` itself when neither `token_ids` nor `logprobs`
/// is to be taken out, else the answer with those capture fields taken out as a streamed
/// chunk's are, written compactly; None when `answer` is not surely a JSON object that
/// `json.loads` reads (`engine::json::reads_as_object`), or a key of the fields looked at
/// is escaped: decode it then. Both
/// planes' replies are made here, so they send the same bytes. The GIL is released for
/// answers from `DETACH_FROM` bytes.
#[pyfunction]
pub fn answer_reply<'py>(
    py: Python<'py>,
    answer: &Bound<'py, PyBytes>,
    token_ids: bool,
    logprobs: bool,
) -> Option<Bound<'py, PyBytes>> {
    let text = answer.as_bytes();
    let strip = Strip {
        token_ids,
        logprobs,
    };
    let made = |text| {
        gateway::sse::answer_reply(text, strip).map(|out| match out {
            Cow::Borrowed(_) => None,
            Cow::Owned(out) => Some(out),
        })
    };
    let made = if text.len() >= crate::DETACH_FROM {
        py.detach(|| made(text))
    } else {
        made(text)
    }?;
    Some(match made {
        None => answer.clone(),
        Some(out) => PyBytes::new(py, &out),
    })
}

/// The `--ack fast` ledger's file: the one appender of the control plane's lines and of the
/// data plane's direct lane (`gateway::ledger::Ledger`), one `write` a line.
#[pyclass(frozen, name = "Ledger", module = "rollout_store._core")]
pub struct PyLedger {
    inner: Arc<Ledger>,
}

#[pymethods]
impl PyLedger {
    #[new]
    fn new() -> Self {
        Self {
            inner: Arc::new(Ledger::new()),
        }
    }

    /// Open `path` for appending (created 0600 if missing), unless a file is open already,
    /// `header` written first (no line of the direct lane comes before it).
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a path as an owned PathBuf
    fn open(&self, path: std::path::PathBuf, header: &[u8]) -> PyResult<()> {
        Ok(self.inner.open(&path, header)?)
    }

    /// Whether a file is open.
    #[getter]
    fn is_open(&self) -> bool {
        self.inner.is_open()
    }

    /// Let the file go.
    fn close(&self) {
        self.inner.close();
    }

    /// Append `data` (whole lines) in one `write`; `OSError` when no file is open or the
    /// write fails.
    fn append(&self, data: &[u8]) -> PyResult<()> {
        Ok(self.inner.append(data)?)
    }

    /// Put `fresh` (the rewritten ledger, synced whole) in place of `path` and append to it
    /// from now on, the direct lane's lines not applied yet appended to it first (a deleted
    /// session's not).
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a path as an owned PathBuf
    fn replace(&self, fresh: std::path::PathBuf, path: std::path::PathBuf) -> PyResult<()> {
        Ok(self.inner.replace(&fresh, &path)?)
    }

    /// The direct lane's line `entry` (the number `adopt` was given with it) is known to the
    /// control plane.
    fn applied(&self, entry: u64) {
        self.inner.applied(entry);
    }

    /// The direct lane's lines the control plane does not know yet.
    #[getter]
    fn unapplied(&self) -> usize {
        self.inner.unapplied()
    }
}
