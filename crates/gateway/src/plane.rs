//! The data plane: a hyper listener on the public port, a pooled upstream client, a reverse
//! proxy to the control plane and one recorder thread, all owned by a [`Gateway`].
//!
//! A model call (`POST /v1/chat/completions`, `POST /v1/messages`) passes the gate (`Host`,
//! `Origin`, `Content-Type`, its key against the [`KeyTable`]), its body is read (size bound,
//! time bound) and depth-checked, then the [`Control`] (the Python control plane, through the
//! bindings) prepares the upstream call or refuses it (a call of the direct lane, which the
//! control would send as it came, goes upstream first: [`crate::direct`]); the call goes
//! upstream through the pooled client; the control finishes it (records the turn with
//! `--ack durable`, or hands it back to be queued with `--ack fast`) and gives the reply. A
//! streaming call's upstream is called streaming: its events are passed on as they arrive,
//! its bytes kept, its last event held back until the control has made (and recorded or
//! queued) the turn of them (`finish_stream`). The upstream client speaks `http://` and
//! `https://` (rustls). Every other request is proxied, streamed both ways, to the control
//! plane's own listener on loopback.
//!
//! The control's calls may block (they take the GIL): they run on the gateway's caller
//! threads (`callers` of them), one call after another, in batches the control may run
//! under one hold of its lock ([`Control::batch`]); threads that each took the GIL for one
//! call would spend more on passing it between them than on the calls. A call that must
//! first wait for another one's end ([`Control::waits`]) runs on tokio's blocking pool
//! instead, where its wait holds up no other call. A panic in a call answers that call 500
//! while the server goes on. Recording with `--ack fast` and every call's timeline go
//! through one channel to the recorder thread, in the order the calls were answered; the
//! queue of turns not yet recorded is bounded (`ack_queue`), a turn past it is dropped and
//! reported to the control, as one the recorder could not record in time when the gateway
//! stops. A turn the control cannot record without waiting (its session's graph held by
//! another thread: an export being read) is set aside by the recorder, which goes on with
//! the others and hands it back, before the later ones, every [`ASIDE_RETRY`] and with each
//! batch; a timeline likewise.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpSocket;
use tokio::runtime::Runtime;

use crate::checks::{self, Hosts};
use crate::depth;
use crate::direct;
use crate::keys::{Handle, KeyTable};
use crate::ledger::{Answered, Ledger};
use crate::sse::{self, Splitter, Strip};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Out = BoxBody<Bytes, BoxError>;

/// The comment a stream waiting for its upstream is kept alive with.
const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

/// Seconds an idle pooled connection is kept: dropped before a uvicorn upstream (`vLLM`,
/// `SGLang`) closes it at 5 s, since reusing one it is closing fails the call.
const POOL_IDLE: Duration = Duration::from_secs(2);

/// What the gateway is started with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where the public listener binds (port 0 picks a free one).
    pub listen: SocketAddr,
    /// The upstream's base, `http://host:port[/prefix]` or `https://...` (no trailing
    /// slash).
    pub upstream: String,
    /// The control plane's own listener (loopback).
    pub backend: SocketAddr,
    pub hosts: Hosts,
    /// Keys that name no session may record (`--open`): the control plane resolves them.
    pub open_mode: bool,
    pub max_body_bytes: u64,
    pub body_timeout: Duration,
    /// `body_timeout` as the refusal names it (`f"{seconds:g}"`).
    pub body_timeout_text: String,
    pub upstream_timeout: Duration,
    /// How long a streaming client waits before its stream begins with keep-alive comments
    /// (then a failure arrives as an error event).
    pub stream_keepalive: Duration,
    /// `--ack fast`: turns are recorded after the reply, through the bounded queue.
    pub fast: bool,
    pub ack_queue: usize,
    pub workers: usize,
    /// Threads the control's calls run on (see the module's note): one when a call never
    /// waits on I/O, more when it may (a log synced per turn, a store over the network).
    pub callers: usize,
    /// A floor for benchmarks: a model call that passes the gate goes upstream as it came
    /// and its answer comes back as it came; no key, no control plane, nothing recorded.
    pub forward_only: bool,
    /// The model calls sent upstream with no `prepare` first (see [`crate::direct`]): with
    /// `--ack fast` answered and queued by the gateway, with `--ack durable` prepared and
    /// finished in one run of the control's calls once the answer is in; `None`: every call
    /// is prepared by the control before it goes upstream.
    pub direct: Option<DirectLane>,
}

/// How the data plane sends a call of the direct lane upstream (see [`crate::direct`]).
#[derive(Clone, Debug, Default)]
pub struct DirectLane {
    /// The server asks for token ids and logprobs (and takes them out of the reply).
    pub capture_tokens: bool,
    /// The control plane's digit limit for ints (0: none).
    pub max_digits: usize,
    /// The headers of the upstream call, as the control plane sends them, for Chat
    /// Completions and for Anthropic's messages: a name with no value is the call's own
    /// (its first value, if it has one).
    pub chat_headers: Vec<(String, Option<String>)>,
    pub messages_headers: Vec<(String, Option<String>)>,
    /// The ack ledger a call's line goes to before its reply (none: the server keeps no
    /// data directory, and no line; or `--ack durable`, which writes none).
    pub ledger: Option<Arc<Ledger>>,
}

impl DirectLane {
    fn route(&self, anthropic: bool) -> direct::Route {
        if anthropic {
            direct::Route::Messages
        } else {
            direct::Route::Chat {
                capture_tokens: self.capture_tokens,
            }
        }
    }

    /// The upstream body's tail of a call that takes the lane ([`direct::upstream_tail`]).
    fn tail(
        &self,
        raw: &[u8],
        checked: &depth::Checked,
        fields: Option<&[(String, usize, usize)]>,
        anthropic: bool,
    ) -> Option<(usize, Vec<u8>)> {
        let route = self.route(anthropic);
        direct::upstream_tail(raw, checked, fields, route, self.max_digits)
    }

    /// The upstream call's headers for a call with these `headers` (names lowercased), as
    /// the control plane makes them (a value of the call's is read as Latin-1).
    fn headers(&self, anthropic: bool, headers: &[(String, Bytes)]) -> Vec<(String, String)> {
        let template = if anthropic {
            &self.messages_headers
        } else {
            &self.chat_headers
        };
        template
            .iter()
            .filter_map(|(name, value)| match value {
                Some(value) => Some((name.clone(), value.clone())),
                None => headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| (name.clone(), v.iter().map(|&b| char::from(b)).collect())),
            })
            .collect()
    }
}

/// A call of the direct lane whose complete answer is one JSON object: the reply is made of
/// its bytes, its ledger line written, and its turn queued for the recorder, where the
/// control is told of it (see [`Control::direct`]).
#[derive(Debug)]
pub struct Direct {
    pub call: Call,
    /// What became of its ledger line.
    pub line: Answered,
    /// The upstream's answer, as it came (the reply has the capture fields taken out).
    pub answer: Bytes,
    /// Microseconds since the call was received: sent upstream, first byte, last byte.
    pub upstream_sent: u32,
    pub first_byte: u32,
    pub last_byte: u32,
}

/// A model call that passed the gate, for the control to prepare.
#[derive(Debug)]
pub struct Call {
    pub anthropic: bool,
    /// The session the key opens, when the key table knows it.
    pub session: Option<String>,
    /// The control's handle of that session, given with its key (see [`Handle`]).
    pub handle: Option<Handle>,
    /// The key sent (the control resolves an unknown one in open mode).
    pub key: Option<String>,
    /// The request's headers, names lowercased, values as sent.
    pub headers: Vec<(String, Bytes)>,
    pub body: Bytes,
    /// What the depth check's reading of the body found: the control need not check it again.
    pub checked: depth::Checked,
    /// The body's top-level fields (key, value's byte range), in its order, when the depth
    /// check read it whole as strict UTF-8 (`engine::json::scan::fields`): the control need
    /// not split it again.
    pub fields: Option<Vec<(String, usize, usize)>>,
    /// Microseconds since the Unix epoch when the request arrived.
    pub received_us: u64,
}

/// An answer made by the control: status, headers, and the chunks of the body (one for a
/// plain reply, the events of a replayed stream).
#[derive(Debug, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(Bytes, Bytes)>,
    pub chunks: Vec<Bytes>,
    /// The chunks are stream events (each stamped as it goes out).
    pub stream: bool,
}

/// What the control made of a call: a refusal, or the upstream call to make.
pub enum Prepared<T> {
    Refuse(Reply),
    Forward {
        path: String,
        /// The body sent is the call's own body up to `head`, then `body` (`head` 0: `body`
        /// alone): a large body is not copied by the control to have fields added.
        head: usize,
        body: Bytes,
        headers: Vec<(String, String)>,
        ticket: T,
        /// A streaming call: how its stream is answered.
        stream: Option<Streaming>,
    },
}

/// How a streaming call's stream is answered: the upstream is called streaming, and when it
/// answers with events they are passed on as they arrive.
#[derive(Clone, Debug, Default)]
pub struct Streaming {
    /// The headers the stream is answered with.
    pub headers: Vec<(Bytes, Bytes)>,
    /// An Anthropic Messages stream (it ends with `message_stop`, not `[DONE]`).
    pub anthropic: bool,
    /// The capture fields to take out of each event (the client did not ask for them).
    pub strip: Strip,
}

/// A stream the upstream sent (or began to), for the control to make its turn of.
#[derive(Debug, Default)]
pub struct Streamed {
    /// Its bytes, as they came.
    pub events: Bytes,
    /// Why it did not end with its last event: `"timeout"` (nothing came for
    /// `upstream_timeout`), `"unfinished"` (it ended before its last event), `"abandoned"`
    /// (its client left before the upstream answered: the call was dropped, nothing is to
    /// be sent), or the kind of failure that broke it off.
    pub error: Option<String>,
    /// Microseconds since the call was received: sent upstream, first byte of the stream,
    /// last byte.
    pub upstream_sent: u32,
    pub first_byte: u32,
    pub last_byte: u32,
}

/// The upstream's answer to a call (or why there is none), with the call's stamps.
#[derive(Debug, Default)]
pub struct Upstream {
    /// 0 when the upstream did not answer (`error` says why).
    pub status: u16,
    /// `"timeout"`, or the kind of failure that kept the call from the upstream.
    pub error: Option<String>,
    pub content_type: Option<Bytes>,
    pub retry_after: Option<Bytes>,
    pub body: Bytes,
    /// Microseconds since the call was received: sent upstream, first byte, last byte.
    pub upstream_sent: u32,
    pub first_byte: u32,
    pub last_byte: u32,
    /// The reply's stream had begun (with keep-alive comments) before the upstream
    /// answered: a failure is to be an event of it.
    pub started: bool,
}

/// What the control made of the upstream's answer.
#[derive(Debug, Default)]
pub struct Finished {
    pub reply: Reply,
    /// `--ack fast`: the turn is to be recorded through the queue.
    pub queue: bool,
    /// The call's timeline is to be recorded once the reply is sent.
    pub timed: bool,
    /// A passed-through stream: the events held back (its last one) are to be sent, before
    /// the reply's own chunks.
    pub release: bool,
}

/// The stamps of a reply once it is sent.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sent {
    /// Microseconds since the call was received.
    pub reply_sent: u32,
    pub chunks: u32,
    pub max_chunk_gap: u32,
}

/// The control plane, as the data plane calls it. Its calls may block.
pub trait Control: Send + Sync + 'static {
    /// What a call carries from `prepare` to its recording.
    type Ticket: Send + Sync + 'static;
    /// Run `work`, a run of the control's calls one after another (the bindings take the
    /// GIL once for all of them).
    fn batch(&self, work: &mut dyn FnMut()) {
        work();
    }
    /// Run `work`, the whole life of one of the gateway's threads that call the control
    /// (a caller thread, the recorder): what the control needs set up once per thread
    /// rather than per call (the bindings keep the thread's interpreter state for its life).
    fn thread(&self, work: &mut (dyn FnMut() + Send)) {
        work();
    }
    /// Whether the call's `finish` (or `finish_stream`) would first wait for another call's
    /// end; asked right before it, in the same batch.
    fn waits(&self, _ticket: &Self::Ticket) -> bool {
        false
    }
    fn prepare(&self, call: Call) -> Prepared<Self::Ticket>;
    /// `prepare` for a call of the direct lane once its answer is in: the session its key
    /// opened once its body was read (its handle's) stays the call's, deleted since or not,
    /// as a call prepared then keeps it in its plan.
    fn prepare_late(&self, call: Call) -> Prepared<Self::Ticket> {
        self.prepare(call)
    }
    /// The ticket of a call of the direct lane, answered (its reply made of the answer's
    /// bytes, its ledger line written): made with no call into the control (the control
    /// reads it first on the recorder thread, in `record`, `dropped` or `sent`); `None`: the
    /// control has no direct lane, and prepares and finishes every call.
    fn direct(&self, _direct: Direct) -> Option<Self::Ticket> {
        None
    }
    /// The recorder took these turns (first in their order, before `record`): the control
    /// makes its own of those of the direct lane now, so that a call answered before is
    /// known to it once [`Queued::handed_through`] says so.
    fn adopt(&self, _tickets: &[&Self::Ticket]) {}
    fn finish(&self, ticket: &Self::Ticket, upstream: Upstream) -> Finished;
    /// The end of a stream passed through: its turn made of its events and recorded
    /// (`--ack durable`) or queued (`--ack fast`), then its held-back last event released;
    /// or, when it broke off or cannot be recorded, the error event that ends it.
    fn finish_stream(&self, ticket: &Self::Ticket, streamed: Streamed) -> Finished;
    /// Record turns queued with `--ack fast`, in their order: those queued meanwhile come
    /// together, so that a session's log can be synced once for them (the control counts
    /// a failure itself). Returns the indices of the tickets it did not record because
    /// recording them would wait (their session busy elsewhere): the recorder hands them
    /// back later, in their order, before any later ticket.
    fn record(&self, tickets: &[&Self::Ticket]) -> Vec<usize>;
    /// A queued turn that will not be recorded, and why (`queue_full`, `shutdown`).
    fn dropped(&self, ticket: &Self::Ticket, why: &'static str);
    /// The reply of a timed call was sent; false when recording its timeline would wait
    /// (as for `record`): the recorder calls again later.
    fn sent(&self, ticket: &Self::Ticket, sent: Sent) -> bool;
}

/// What became of a call of the direct lane prepared once its answer was in.
enum Late<T> {
    Refused(Reply),
    Finished(T, Finished),
    /// Its `finish` must first wait for another call's end.
    Waits(T, Upstream),
    /// Prepared as a stream, which no call of the lane is.
    Stream,
}

enum Job<T> {
    Record(Arc<T>),
    Sent(Arc<T>, Sent),
}

/// One of the control's calls, for a caller thread.
type Work<C> = Box<dyn FnOnce(&C) + Send>;

/// The turns queued: those waiting for the recorder (what the bound counts, as the Python
/// server's queue does), and those not yet recorded, the one being recorded too (what
/// `settle` waits for).
#[derive(Default)]
struct Pending {
    counts: Mutex<Counts>,
    changed: Condvar,
    /// Turns sent to the recorder, in the order it takes them (counted as each is sent).
    sent: std::sync::atomic::AtomicU64,
    /// Turns the recorder has handed to the control once (`Control::adopt`): those of the
    /// direct lane are known to the control from then on.
    handed: std::sync::atomic::AtomicU64,
}

#[derive(Clone, Copy, Default)]
struct Counts {
    waiting: usize,
    unfinished: usize,
}

impl Pending {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One more turn queued, unless `bound` are waiting.
    fn add(&self, bound: usize) -> bool {
        let mut counts = self.counts();
        if counts.waiting >= bound {
            return false;
        }
        counts.waiting += 1;
        counts.unfinished += 1;
        true
    }

    /// The recorder took a turn.
    fn taken(&self) {
        let mut counts = self.counts();
        counts.waiting = counts.waiting.saturating_sub(1);
    }

    /// The recorder set a turn aside: it waits again (and counts in the bound).
    fn set_aside(&self) {
        self.counts().waiting += 1;
    }

    /// A turn queued is recorded (or dropped).
    fn done(&self) {
        let mut counts = self.counts();
        counts.unfinished = counts.unfinished.saturating_sub(1);
        self.changed.notify_all();
    }
}

/// The gateway's queue of turns (`--ack fast`), apart from the gateway: whoever holds the
/// gateway to set a key or stop it is not held up by a wait for the queue to empty.
#[derive(Clone)]
pub struct Queued(Arc<Pending>);

impl Queued {
    /// Turns queued and waiting for the recorder.
    pub fn waiting(&self) -> usize {
        self.0.counts().waiting
    }

    /// Whether the recorder has handed the first `sent` turns to the control (see
    /// [`Gateway::turns_sent`]).
    pub fn handed_through(&self, sent: u64) -> bool {
        self.0.handed.load(Ordering::Acquire) >= sent
    }

    /// Wait (at most `timeout`) until every queued turn is recorded or dropped; whether it
    /// was.
    pub fn settle(&self, timeout: Duration) -> bool {
        let counts = self.0.counts();
        let (counts, _) = self
            .0
            .changed
            .wait_timeout_while(counts, timeout, |c| c.unfinished > 0)
            .unwrap_or_else(PoisonError::into_inner);
        counts.unfinished == 0
    }
}

struct Shared<C: Control> {
    config: Config,
    control: Arc<C>,
    keys: RwLock<KeyTable>,
    open_mode: AtomicBool,
    client: Client<HttpsConnector<HttpConnector>, Out>,
    jobs: Mutex<Option<mpsc::Sender<Job<C::Ticket>>>>,
    /// The caller threads' queue (`None` once stopping).
    calls: Mutex<Option<mpsc::Sender<Work<C>>>>,
    pending: Arc<Pending>,
    /// When the recorder is to stop recording (set by `stop`).
    deadline: Mutex<Option<Instant>>,
    /// Per session, its streams passing through whose turn is not queued yet, as the control
    /// keeps them ([`Gateway::stream_begun`]): the direct lane leaves that session's calls
    /// to `waits`.
    streams: Mutex<std::collections::HashMap<String, usize>>,
}

/// The data plane: its runtime, listener, upstream client and recorder thread. Dropping it
/// stops it (`stop` says how long the queued turns may take).
pub struct Gateway<C: Control> {
    shared: Arc<Shared<C>>,
    runtime: Option<Runtime>,
    accepting: Option<tokio::task::JoinHandle<()>>,
    recorder: Option<JoinHandle<()>>,
    callers: Vec<JoinHandle<()>>,
    local: SocketAddr,
}

/// A body's top-level fields (key, value's byte range), as `Call::fields` holds them.
fn fields(raw: &[u8]) -> Option<Vec<(String, usize, usize)>> {
    engine::json::scan::fields(raw).map(|found| {
        found
            .into_iter()
            .map(|(key, start, end)| (key.to_string(), start, end))
            .collect()
    })
}

/// The body sent upstream: the call's own `sent[..head]`, then `body` (see
/// `Prepared::Forward`); `None` for a `head` past its end.
fn upstream_body(sent: &Bytes, head: usize, body: Bytes) -> Option<Bytes> {
    if head == 0 {
        return Some(body);
    }
    let lead = sent.get(..head)?;
    let mut joined = BytesMut::with_capacity(head + body.len());
    joined.extend_from_slice(lead);
    joined.extend_from_slice(&body);
    Some(joined.freeze())
}

fn micros_since(t0: Instant) -> u32 {
    u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX - 1)
}

fn full(body: impl Into<Bytes>) -> Out {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
}

fn json_reply(status: u16, body: String, close: bool) -> Response<Out> {
    let mut response = Response::new(full(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if close {
        headers.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

fn refused(anthropic: bool, status: u16, reason: &str) -> Response<Out> {
    json_reply(
        status,
        checks::error_body(anthropic, status, reason),
        status == 408,
    )
}

fn internal_error() -> Response<Out> {
    let mut response = Response::new(full("Internal Server Error"));
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn header_text(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    headers.get(name).map(|v| checks::latin1(v.as_bytes()))
}

/// A streaming call's upstream, once it answered: its event stream (and when the call went
/// upstream), or any other answer, read whole (or why there is none).
enum Opened {
    Events(Incoming, u32),
    Answer(Upstream),
}

/// An event stream to pass on, and its call.
struct Pumped<T> {
    body: Incoming,
    streaming: Streaming,
    ticket: Arc<T>,
    t0: Instant,
    upstream_sent: u32,
}

/// An event stream on its way to the client: its bytes kept, split into events, each passed
/// on (the capture fields the client did not ask for taken out) until the last, which is
/// held back with what follows it.
struct Passage<T> {
    streaming: Streaming,
    feed: tokio::sync::mpsc::Sender<Piece<T>>,
    splitter: Splitter,
    kept: Vec<Bytes>,
    held: Vec<Bytes>,
    /// The stream's last event came.
    ended: bool,
    /// The client is still there.
    client: bool,
}

impl<T> Passage<T> {
    fn new(streaming: Streaming, feed: tokio::sync::mpsc::Sender<Piece<T>>) -> Self {
        Self {
            streaming,
            feed,
            splitter: Splitter::default(),
            kept: Vec::new(),
            held: Vec::new(),
            ended: false,
            client: true,
        }
    }

    async fn send(&mut self, chunk: Bytes) {
        if self.client {
            self.client = self.feed.send(Piece::Chunk(chunk)).await.is_ok();
        }
    }

    async fn event(&mut self, event: Bytes) {
        self.ended |= sse::is_last(&event, self.streaming.anthropic);
        let out = sse::strip(event, self.streaming.strip);
        if self.ended {
            self.held.push(out);
        } else {
            self.send(out).await;
        }
    }

    async fn data(&mut self, data: Bytes) {
        let events = self.splitter.push(&data);
        self.kept.push(data);
        for event in events {
            self.event(event).await;
        }
    }

    /// The stream's end: an event it cut off counts only as (or after) its last one (as it
    /// came: a client ignores it too).
    async fn end(&mut self) {
        let rest = self.splitter.rest();
        if !rest.is_empty() && (self.ended || sse::is_last(&rest, self.streaming.anthropic)) {
            self.event(rest).await;
        }
    }
}

/// Where a reply reports that it was sent, and for which call.
type Done<C> = (Arc<Shared<C>>, Arc<<C as Control>::Ticket>);

/// What feeds a stream begun before its call was answered: chunks, then the call's ticket
/// when its timeline is to be recorded.
enum Piece<T> {
    Chunk(Bytes),
    Timed(Arc<T>),
}

/// The reply's body: its chunks (or those a begun stream is fed), each stamped as it goes
/// out when they are stream events, and the recorder told when the last one went.
struct ReplyBody<C: Control> {
    chunks: VecDeque<Bytes>,
    feed: Option<tokio::sync::mpsc::Receiver<Piece<C::Ticket>>>,
    stream: bool,
    t0: Instant,
    sent: Sent,
    last_chunk: u32,
    done: Option<Done<C>>,
    /// Where a fed stream reports it was sent, once it knows it is timed.
    shared: Option<Arc<Shared<C>>>,
}

impl<C: Control> Body for ReplyBody<C> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        while this.chunks.is_empty() {
            let Some(feed) = this.feed.as_mut() else {
                break;
            };
            match feed.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Piece::Chunk(chunk))) => this.chunks.push_back(chunk),
                Poll::Ready(Some(Piece::Timed(ticket))) => {
                    this.done = this.shared.clone().map(|shared| (shared, ticket));
                }
                Poll::Ready(None) => this.feed = None,
            }
        }
        if let Some(chunk) = this.chunks.pop_front() {
            if this.stream {
                let now = micros_since(this.t0);
                if this.sent.chunks > 0 {
                    this.sent.max_chunk_gap = this
                        .sent
                        .max_chunk_gap
                        .max(now.saturating_sub(this.last_chunk));
                }
                this.sent.chunks += 1;
                this.last_chunk = now;
            }
            if this.chunks.is_empty() && this.feed.is_none() {
                this.finished();
            }
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        this.finished();
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.feed.is_none() && self.done.is_none()
    }
}

impl<C: Control> ReplyBody<C> {
    /// The last chunk is handed to the connection: the reply is sent.
    fn finished(&mut self) {
        if let Some((shared, ticket)) = self.done.take() {
            self.sent.reply_sent = micros_since(self.t0);
            shared.send(Job::Sent(ticket, self.sent));
        }
    }
}

impl<C: Control> Shared<C> {
    fn send(&self, job: Job<C::Ticket>) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let turn = matches!(job, Job::Record(_));
        let sent = jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if sent && turn {
            // (under the lock: the count follows the order the recorder takes them in)
            self.pending.sent.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Run one of the control's calls on a caller thread; `None` if it panicked or the
    /// gateway is stopping.
    async fn call<R: Send + 'static>(
        &self,
        work: impl FnOnce(&C) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let work: Work<C> = Box::new(move |control| {
            // a call whose caller is gone (its runtime shut down: the gateway stopping) is
            // answered to no one: not made
            if !tx.is_closed() {
                let _ = tx.send(work(control));
            }
        });
        let sent = {
            let calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
            calls.as_ref().is_some_and(|tx| tx.send(work).is_ok())
        };
        if !sent {
            return None;
        }
        rx.await.ok()
    }

    /// The control's `finish` or `finish_stream` (`work`) of a call: on a caller thread, or
    /// on tokio's blocking pool when it must first wait for another call's end.
    async fn finish_call<A: Send + 'static>(
        &self,
        ticket: &Arc<C::Ticket>,
        argument: A,
        work: fn(&C, &C::Ticket, A) -> Finished,
    ) -> Option<Finished> {
        let held = ticket.clone();
        let first = self
            .call(move |c| {
                if c.waits(&held) {
                    Err(argument)
                } else {
                    Ok(work(c, &held, argument))
                }
            })
            .await?;
        match first {
            Ok(finished) => Some(finished),
            Err(argument) => self.finish_blocking(ticket, argument, work).await,
        }
    }

    /// `work` (the control's `finish` or `finish_stream`) on tokio's blocking pool, where
    /// its wait for another call's end holds up no other call.
    async fn finish_blocking<A: Send + 'static>(
        &self,
        ticket: &Arc<C::Ticket>,
        argument: A,
        work: fn(&C, &C::Ticket, A) -> Finished,
    ) -> Option<Finished> {
        let control = self.control.clone();
        let held = ticket.clone();
        tokio::task::spawn_blocking(move || work(&control, &held, argument))
            .await
            .ok()
    }

    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<Out> {
        let path = request.uri().path();
        let anthropic = path == "/v1/messages";
        let model =
            request.method() == Method::POST && (anthropic || path == "/v1/chat/completions");
        let headers = request.headers();
        let hosts = headers.get_all(HOST).iter().count();
        let refusal = checks::repeated(hosts, headers.get_all(CONTENT_TYPE).iter().count())
            .or_else(|| {
                // (a model call's gate says so itself; another request would reach the app
                // with the Host the plane's client gives it)
                (hosts == 0 && !model)
                    .then(|| checks::refusal(&self.config.hosts, None, None, None))
                    .flatten()
            });
        if let Some((status, reason)) = refusal {
            if model || path.starts_with("/v1/") {
                return refused(anthropic, status, &reason);
            }
            let mut body = String::from("{\"error\":");
            checks::json_str(&reason, &mut body);
            body.push('}');
            return json_reply(status, body, false);
        }
        if model {
            // a panic in the call answers it 500; the connection and the server go on
            let task = tokio::spawn(self.clone().model_call(request, anthropic));
            return task.await.unwrap_or_else(|_| internal_error());
        }
        self.proxy(request).await
    }

    async fn read_body(
        &self,
        body: Incoming,
        declared: Option<&HeaderValue>,
    ) -> Result<Bytes, Option<(u16, String)>> {
        let limit = self.config.max_body_bytes;
        if let Some(value) = declared {
            let text = checks::latin1(value.as_bytes());
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Some((400, "Content-Length is not a number".into())));
            }
            if text.parse::<u64>().map_or(true, |n| n > limit) {
                return Err(Some((
                    413,
                    format!("the body of {text} bytes is over the limit of {limit} bytes"),
                )));
            }
        }
        let read = async {
            let mut body = body;
            let mut parts = Vec::new();
            let mut size = 0u64;
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else {
                    return Err(None); // the client left mid-body: no one to answer
                };
                if let Ok(data) = frame.into_data() {
                    size += data.len() as u64;
                    if size > limit {
                        return Err(Some((
                            413,
                            format!("the body is over the limit of {limit} bytes"),
                        )));
                    }
                    parts.push(data);
                }
            }
            Ok(if parts.len() == 1 {
                parts.pop().unwrap_or_default()
            } else {
                Bytes::from(parts.concat())
            })
        };
        match tokio::time::timeout(self.config.body_timeout, read).await {
            Ok(result) => result,
            Err(_) => Err(Some((
                408,
                format!(
                    "the body did not arrive within {} s (--body-timeout)",
                    self.config.body_timeout_text
                ),
            ))),
        }
    }

    /// Whether `session` has a stream passing through whose turn is not queued yet.
    fn streaming(&self, session: &str) -> bool {
        self.streams().get(session).is_some_and(|&n| n > 0)
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, usize>> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session `key` opens and the control's handle of it, when the key table knows it.
    /// Whether the key table knows `key`.
    fn knows(&self, key: Option<&str>) -> bool {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        key.is_some_and(|k| keys.lookup(k.as_bytes()).is_some())
    }

    fn opened(&self, key: Option<&str>) -> (Option<String>, Option<Handle>) {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        match key.and_then(|k| keys.lookup(k.as_bytes())) {
            Some(opened) => (Some(opened.session.to_string()), opened.handle),
            None => (None, None),
        }
    }

    async fn model_call(
        self: Arc<Self>,
        request: Request<Incoming>,
        anthropic: bool,
    ) -> Response<Out> {
        let t0 = Instant::now();
        let received_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let (parts, body) = request.into_parts();
        let headers = &parts.headers;
        let host = header_text(headers, &HOST);
        let origin = header_text(headers, &http::header::ORIGIN);
        let kind = header_text(headers, &CONTENT_TYPE);
        if let Some((status, reason)) = checks::refusal(
            &self.config.hosts,
            host.as_deref(),
            origin.as_deref(),
            kind.as_deref(),
        ) {
            return refused(anthropic, status, &reason);
        }
        if self.config.forward_only {
            return self.forwarded(body, anthropic, t0).await;
        }
        let key = checks::api_key(
            header_text(headers, &http::header::AUTHORIZATION).as_deref(),
            header_text(headers, &HeaderName::from_static("x-api-key")).as_deref(),
        );
        if !self.knows(key.as_deref()) && !self.open_mode.load(Ordering::Relaxed) {
            return refused(
                anthropic,
                401,
                "unknown API key: create a session with POST /sessions and use its api_key",
            );
        }
        let raw = match self.read_body(body, headers.get(CONTENT_LENGTH)).await {
            Ok(raw) => raw,
            Err(Some((status, reason))) => return refused(anthropic, status, &reason),
            Err(None) => return json_reply(400, String::new(), true),
        };
        let checked = match depth::check(&raw, anthropic) {
            Ok(checked) => checked,
            Err(field) => return refused(anthropic, 400, &depth::reason(&field)),
        };
        // the session the key opens once the body is in, where `prepare` would ask (a session
        // deleted, or made again under the key, while the body came is not the call's)
        let (session, handle) = self.opened(key.as_deref());
        let fields = if checked.utf8 { fields(&raw) } else { None };
        let direct = match &self.config.direct {
            Some(lane) if handle.is_some() => {
                lane.tail(&raw, &checked, fields.as_deref(), anthropic)
            }
            _ => None,
        };
        let sent = raw.clone(); // (shared, not copied: the upstream body may begin with it)
        let call = Call {
            anthropic,
            session,
            handle,
            key,
            headers: headers
                .iter()
                .map(|(n, v)| (n.as_str().to_string(), Bytes::copy_from_slice(v.as_bytes())))
                .collect(),
            body: raw,
            checked,
            fields,
            received_us,
        };
        if let Some((head, tail)) = direct {
            return self.direct(call, &sent, head, tail, t0).await;
        }
        let Some(prepared) = self.call(move |c| c.prepare(call)).await else {
            return internal_error();
        };
        let (path, content, upstream_headers, ticket, stream) = match prepared {
            Prepared::Refuse(reply) => return self.reply(reply, t0, None),
            Prepared::Forward {
                path,
                head,
                body,
                headers,
                ticket,
                stream,
            } => {
                let Some(content) = upstream_body(&sent, head, body) else {
                    return internal_error();
                };
                (path, content, headers, Arc::new(ticket), stream)
            }
        };
        if let Some(streaming) = stream {
            return self
                .streamed(path, content, upstream_headers, streaming, ticket, t0)
                .await;
        }
        let answer = self.upstream(&path, content, &upstream_headers, t0).await;
        self.finish(answer, ticket, t0).await
    }

    /// A call of the direct lane: sent upstream as it is (`sent[..own]`, then `tail`). With
    /// `--ack fast`, a complete answer that is one JSON object is replied to from its bytes
    /// and its ticket queued ([`Control::direct`]); any other answer, a call the lane's own
    /// checks take back, and every call of `--ack durable` (whose reply waits for its turn
    /// on disk) is prepared and finished once its answer is in ([`Self::finish_late`]).
    async fn direct(
        self: &Arc<Self>,
        call: Call,
        sent: &Bytes,
        own: usize,
        tail: Vec<u8>,
        t0: Instant,
    ) -> Response<Out> {
        let Some(lane) = &self.config.direct else {
            return internal_error();
        };
        let Some(content) = upstream_body(sent, own, Bytes::from(tail)) else {
            return internal_error();
        };
        let route = lane.route(call.anthropic);
        let headers = lane.headers(call.anthropic, &call.headers);
        let answer = self.upstream(route.path(), content, &headers, t0).await;
        if !self.config.fast {
            return self.finish_late(call, answer, t0).await;
        }
        let strip = route.strip();
        let made = (answer.error.is_none() && (200..300).contains(&answer.status))
            .then(|| sse::answer_reply(&answer.body, strip))
            .flatten()
            .map(|reply| match reply {
                std::borrow::Cow::Borrowed(_) => answer.body.clone(),
                std::borrow::Cow::Owned(reply) => Bytes::from(reply),
            });
        let Some(reply) = made else {
            return self.finish_late(call, answer, t0).await;
        };
        // the lane's own checks, where `prepare` and `waits` would have taken the call: a
        // session with a stream not ended (its turn queued after this one's would be out
        // of order) or a server stopping (its ledger closed) has it finished as any call
        let Some(handle) = call.handle.clone() else {
            return self.finish_late(call, answer, t0).await;
        };
        let session = call.session.clone().unwrap_or_default();
        if self.streaming(&session) {
            return self.finish_late(call, answer, t0).await;
        }
        // its place in the queue first: a call that finds the queue full goes the prepared
        // way (its drop counted there), so no line is written for a turn that is not queued
        if !self.pending.add(self.config.ack_queue) {
            return self.finish_late(call, answer, t0).await;
        }
        let ledger_line = match &lane.ledger {
            Some(ledger) => ledger.answered(&session, &handle.alive),
            None => Answered::Written(0),
        };
        if ledger_line == Answered::Closed {
            self.pending.taken();
            self.pending.done();
            return self.finish_late(call, answer, t0).await;
        }
        let direct = Direct {
            call,
            line: ledger_line,
            answer: answer.body.clone(),
            upstream_sent: answer.upstream_sent,
            first_byte: answer.first_byte,
            last_byte: answer.last_byte,
        };
        // (from the line to the queue, nothing waits: a stop cannot cut the call between)
        let ticket = self.control.direct(direct).map(Arc::new);
        if !ticket
            .as_ref()
            .is_some_and(|t| self.send(Job::Record(t.clone())))
        {
            // (no control of the lane, or a queue closed by an abandoned gateway: its line
            // is counted at the next start, as an abandoned gateway's queued turns are)
            self.pending.taken();
            self.pending.done();
            return internal_error();
        }
        let reply = Reply {
            status: 200,
            headers: vec![
                (
                    Bytes::from_static(b"content-length"),
                    Bytes::from(reply.len().to_string()),
                ),
                (
                    Bytes::from_static(b"content-type"),
                    Bytes::from_static(b"application/json"),
                ),
            ],
            chunks: vec![reply],
            stream: false,
        };
        // (its timeline recorded once the reply is sent, as a queued call's is)
        self.reply(reply, t0, ticket)
    }

    /// A call the upstream answered before the control prepared it (the direct lane): it is
    /// prepared now (a refusal is its reply), then finished with that answer in the same run
    /// of the control's calls (one hold of the GIL), or on the blocking pool when its
    /// `finish` must first wait.
    async fn finish_late(
        self: &Arc<Self>,
        call: Call,
        answer: Upstream,
        t0: Instant,
    ) -> Response<Out> {
        let late = self
            .call(move |c| match c.prepare_late(call) {
                Prepared::Refuse(reply) => Late::Refused(reply),
                // (a call of the lane names no `stream`: its plan is never a stream's)
                Prepared::Forward {
                    ticket,
                    stream: None,
                    ..
                } => {
                    if c.waits(&ticket) {
                        Late::Waits(ticket, answer)
                    } else {
                        let finished = c.finish(&ticket, answer);
                        Late::Finished(ticket, finished)
                    }
                }
                Prepared::Forward { .. } => Late::Stream,
            })
            .await;
        match late {
            Some(Late::Refused(reply)) => self.reply(reply, t0, None),
            Some(Late::Finished(ticket, finished)) => {
                self.finished(Arc::new(ticket), finished, t0).await
            }
            Some(Late::Waits(ticket, answer)) => {
                let ticket = Arc::new(ticket);
                match self.finish_blocking(&ticket, answer, C::finish).await {
                    Some(finished) => self.finished(ticket, finished, t0).await,
                    None => internal_error(),
                }
            }
            Some(Late::Stream) | None => internal_error(),
        }
    }

    /// A streaming call: the upstream is called streaming. Events it answers with are passed
    /// on as they arrive ([`Self::pump`]); any other answer (an error status, a body that is
    /// not an event stream) is finished as a call that does not stream, its stream replayed
    /// by the control. A call still waiting after `stream_keepalive` begins its stream with
    /// keep-alive comments ([`Self::kept_alive`]).
    async fn streamed(
        self: &Arc<Self>,
        path: String,
        content: Bytes,
        upstream_headers: Vec<(String, String)>,
        streaming: Streaming,
        ticket: Arc<C::Ticket>,
        t0: Instant,
    ) -> Response<Out> {
        let shared = self.clone();
        let mut call =
            tokio::spawn(async move { shared.open(&path, content, &upstream_headers, t0).await });
        let opened = match tokio::time::timeout(self.config.stream_keepalive, &mut call).await {
            Ok(opened) => opened.unwrap_or_else(|_| Opened::Answer(lost())),
            Err(_) => return self.kept_alive(call, streaming, ticket, t0),
        };
        match opened {
            Opened::Answer(answer) => self.finish(answer, ticket, t0).await,
            Opened::Events(body, upstream_sent) => {
                let (feed, receiver) = tokio::sync::mpsc::channel(16);
                let begun = begun(&streaming);
                let pumped = Pumped {
                    body,
                    streaming,
                    ticket,
                    t0,
                    upstream_sent,
                };
                tokio::spawn(self.clone().pump(pumped, feed));
                self.reply_fed(begun, t0, None, Some(receiver))
            }
        }
    }

    /// The rest of a call whose upstream answered: the control's reply, its turn queued.
    async fn finish(
        self: &Arc<Self>,
        answer: Upstream,
        ticket: Arc<C::Ticket>,
        t0: Instant,
    ) -> Response<Out> {
        let Some(finished) = self.finish_call(&ticket, answer, C::finish).await else {
            return internal_error();
        };
        self.finished(ticket, finished, t0).await
    }

    /// The reply of a call the control finished: its turn queued first (`--ack fast`), its
    /// timeline recorded once the reply is sent.
    async fn finished(
        self: &Arc<Self>,
        ticket: Arc<C::Ticket>,
        finished: Finished,
        t0: Instant,
    ) -> Response<Out> {
        if let Err(why) = self.queue_if(finished.queue, &ticket) {
            let held = ticket.clone();
            if self.call(move |c| c.dropped(&held, why)).await.is_none() {
                return internal_error();
            }
        }
        let done = finished.timed.then_some(ticket);
        self.reply(finished.reply, t0, done)
    }

    /// A streaming call still waiting after `stream_keepalive`: its stream begins now with
    /// a keep-alive comment, one more each `stream_keepalive`, then the upstream's events
    /// (or the control's, or its error event). A client that leaves before the upstream
    /// answers abandons the call.
    fn kept_alive(
        self: &Arc<Self>,
        mut call: tokio::task::JoinHandle<Opened>,
        streaming: Streaming,
        ticket: Arc<C::Ticket>,
        t0: Instant,
    ) -> Response<Out> {
        let (feed, receiver) = tokio::sync::mpsc::channel(16);
        let shared = self.clone();
        let begun = begun(&streaming);
        tokio::spawn(async move {
            let opened = loop {
                if feed
                    .send(Piece::Chunk(Bytes::from_static(KEEP_ALIVE)))
                    .await
                    .is_err()
                {
                    call.abort(); // the client left before the answer
                    let abandoned = Streamed {
                        error: Some("abandoned".into()),
                        ..Streamed::default()
                    };
                    let _ = shared
                        .finish_call(&ticket, abandoned, C::finish_stream)
                        .await;
                    return;
                }
                let waited = tokio::time::timeout(shared.config.stream_keepalive, &mut call).await;
                if let Ok(opened) = waited {
                    break opened.unwrap_or_else(|_| Opened::Answer(lost()));
                }
            };
            let answer = match opened {
                Opened::Answer(answer) => answer,
                Opened::Events(body, upstream_sent) => {
                    let pumped = Pumped {
                        body,
                        streaming,
                        ticket,
                        t0,
                        upstream_sent,
                    };
                    return shared.pump(pumped, feed).await;
                }
            };
            let answer = Upstream {
                started: true,
                ..answer
            };
            let Some(finished) = shared.finish_call(&ticket, answer, C::finish).await else {
                return;
            };
            shared.ended(finished, Vec::new(), &feed, ticket).await;
        });
        self.reply_fed(begun, t0, None, Some(receiver))
    }

    /// What follows a stream's control call: its turn queued (`--ack fast`), the events held
    /// back released (when the control says so), the control's chunks, and the ticket, when
    /// the call is timed, for the reply body to report it sent.
    async fn ended(
        &self,
        finished: Finished,
        held: Vec<Bytes>,
        feed: &tokio::sync::mpsc::Sender<Piece<C::Ticket>>,
        ticket: Arc<C::Ticket>,
    ) {
        if let Err(why) = self.queue_if(finished.queue, &ticket) {
            let held = ticket.clone();
            let _ = self.call(move |c| c.dropped(&held, why)).await;
        }
        let released = if finished.release { held } else { Vec::new() };
        for chunk in released.into_iter().chain(finished.reply.chunks) {
            if feed.send(Piece::Chunk(chunk)).await.is_err() {
                return;
            }
        }
        if finished.timed {
            let _ = feed.send(Piece::Timed(ticket)).await;
        }
    }

    /// Pass an upstream's event stream on as it arrives, event by event (the capture fields
    /// the client did not ask for taken out), keeping its bytes; at its end the control
    /// makes the turn of them. The stream's last event (`[DONE]`, `message_stop`) is held
    /// back until the turn is recorded (`--ack durable`) or queued (`--ack fast`): a client
    /// that has it finds its turn in an export. Until the stream's first
    /// byte the client gets keep-alive comments each `stream_keepalive`; after it, a gap of
    /// `upstream_timeout` breaks the stream off. A client that leaves does not stop the
    /// call: the stream is read to its end and recorded, as a call that does not stream is.
    async fn pump(
        self: Arc<Self>,
        pumped: Pumped<C::Ticket>,
        feed: tokio::sync::mpsc::Sender<Piece<C::Ticket>>,
    ) {
        let Pumped {
            mut body,
            streaming,
            ticket,
            t0,
            upstream_sent,
        } = pumped;
        let mut passage = Passage::new(streaming, feed);
        let mut first_byte = 0u32;
        let mut error: Option<String> = None;
        let waiting_since = Instant::now();
        loop {
            let left = self
                .config
                .upstream_timeout
                .saturating_sub(waiting_since.elapsed());
            let wait = if first_byte == 0 {
                left.min(self.config.stream_keepalive)
            } else {
                self.config.upstream_timeout
            };
            match tokio::time::timeout(wait, body.frame()).await {
                Err(_) if first_byte == 0 && !left.is_zero() && wait < left => {
                    passage.send(Bytes::from_static(KEEP_ALIVE)).await;
                }
                Err(_) => {
                    error = Some("timeout".into());
                    break;
                }
                Ok(None) => break,
                Ok(Some(Err(failure))) => {
                    error = Some(failure_kind(&failure));
                    break;
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() && first_byte == 0 {
                            first_byte = micros_since(t0).max(1);
                        }
                        passage.data(data).await;
                    }
                    if passage.ended {
                        // the turn is complete: what the upstream may still send is read
                        // (its connection back to the pool) but waited for by no one
                        let timeout = self.config.upstream_timeout;
                        tokio::spawn(tokio::time::timeout(timeout, async move {
                            while let Some(Ok(_)) = body.frame().await {}
                        }));
                        break;
                    }
                }
            }
        }
        passage.end().await;
        if passage.ended {
            error = None; // whatever came after the last event is nothing to the turn
        } else if error.is_none() {
            error = Some("unfinished".into());
        }
        let streamed = Streamed {
            events: Bytes::from(passage.kept.concat()),
            error,
            upstream_sent,
            first_byte,
            last_byte: micros_since(t0),
        };
        let Some(finished) = self.finish_call(&ticket, streamed, C::finish_stream).await else {
            return;
        };
        let held = std::mem::take(&mut passage.held);
        self.ended(finished, held, &passage.feed, ticket).await;
    }

    /// A call forwarded as it came, answered as the upstream answered (`forward_only`).
    async fn forwarded(&self, body: Incoming, anthropic: bool, t0: Instant) -> Response<Out> {
        let raw = match self.read_body(body, None).await {
            Ok(raw) => raw,
            Err(Some((status, reason))) => return refused(anthropic, status, &reason),
            Err(None) => return json_reply(400, String::new(), true),
        };
        let path = if anthropic {
            "/v1/messages"
        } else {
            "/v1/chat/completions"
        };
        let headers = [("content-type".to_string(), "application/json".to_string())];
        let answer = self.upstream(path, raw, &headers, t0).await;
        if answer.error.is_some() {
            return refused(anthropic, 502, "the upstream cannot be reached");
        }
        let mut response = Response::new(full(answer.body));
        *response.status_mut() = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK);
        if let Some(kind) = answer.content_type {
            if let Ok(kind) = HeaderValue::from_maybe_shared(kind) {
                response.headers_mut().insert(CONTENT_TYPE, kind);
            }
        }
        response
    }

    /// Queue a turn for the recorder (when the control says to); else why it is dropped:
    /// `shutdown` once a stop closed the queue (full or not), `queue_full` otherwise.
    fn queue_if(&self, queue: bool, ticket: &Arc<C::Ticket>) -> Result<(), &'static str> {
        if !queue {
            return Ok(());
        }
        if !self.pending.add(self.config.ack_queue) {
            let closed = self
                .jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_none();
            return Err(if closed { "shutdown" } else { "queue_full" });
        }
        if self.send(Job::Record(ticket.clone())) {
            return Ok(());
        }
        self.pending.taken();
        self.pending.done();
        Err("shutdown")
    }

    fn reply(
        self: &Arc<Self>,
        reply: Reply,
        t0: Instant,
        done: Option<Arc<C::Ticket>>,
    ) -> Response<Out> {
        self.reply_fed(reply, t0, done, None)
    }

    fn reply_fed(
        self: &Arc<Self>,
        reply: Reply,
        t0: Instant,
        done: Option<Arc<C::Ticket>>,
        feed: Option<tokio::sync::mpsc::Receiver<Piece<C::Ticket>>>,
    ) -> Response<Out> {
        let body = ReplyBody {
            chunks: reply.chunks.into(),
            shared: feed.is_some().then(|| self.clone()),
            feed,
            stream: reply.stream,
            t0,
            sent: Sent::default(),
            last_chunk: 0,
            done: done.map(|ticket| (self.clone(), ticket)),
        };
        let mut response = Response::new(body.boxed());
        *response.status_mut() =
            StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = response.headers_mut();
        for (name, value) in reply.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&name),
                HeaderValue::from_maybe_shared(value),
            ) {
                headers.append(name, value);
            }
        }
        response
    }

    /// The upstream's whole answer to a call (or why there is none).
    async fn upstream(
        &self,
        path: &str,
        content: Bytes,
        headers: &[(String, String)],
        t0: Instant,
    ) -> Upstream {
        match self.call_upstream(path, content, headers, t0, false).await {
            Opened::Answer(answer) => answer,
            Opened::Events(..) => lost(),
        }
    }

    /// A streaming call's upstream: its event stream once its head arrived, or any other
    /// answer read whole.
    async fn open(
        &self,
        path: &str,
        content: Bytes,
        headers: &[(String, String)],
        t0: Instant,
    ) -> Opened {
        self.call_upstream(path, content, headers, t0, true).await
    }

    async fn call_upstream(
        &self,
        path: &str,
        content: Bytes,
        headers: &[(String, String)],
        t0: Instant,
        events: bool,
    ) -> Opened {
        let mut answer = Upstream::default();
        let uri = format!("{}{}", self.config.upstream, path);
        let mut request = Request::post(uri);
        for (name, value) in headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let Ok(request) = request.body(full(content)) else {
            answer.error = Some("InvalidURL".into());
            return Opened::Answer(answer);
        };
        answer.upstream_sent = micros_since(t0);
        let deadline = tokio::time::Instant::now() + self.config.upstream_timeout;
        let response = match tokio::time::timeout_at(deadline, self.client.request(request)).await {
            Err(_) => {
                answer.error = Some("timeout".into());
                return Opened::Answer(answer);
            }
            Ok(Err(error)) => {
                answer.error = Some(failure_kind(&error));
                return Opened::Answer(answer);
            }
            Ok(Ok(response)) => response,
        };
        let first_byte = micros_since(t0);
        let (parts, body) = response.into_parts();
        if events && parts.status.is_success() && is_event_stream(&parts.headers) {
            return Opened::Events(body, answer.upstream_sent);
        }
        match tokio::time::timeout_at(deadline, body.collect()).await {
            Err(_) => answer.error = Some("timeout".into()),
            Ok(Err(error)) => answer.error = Some(failure_kind(&error)),
            Ok(Ok(body)) => {
                answer.status = parts.status.as_u16();
                answer.content_type = parts
                    .headers
                    .get(CONTENT_TYPE)
                    .map(|v| Bytes::copy_from_slice(v.as_bytes()));
                answer.retry_after = parts
                    .headers
                    .get(http::header::RETRY_AFTER)
                    .map(|v| Bytes::copy_from_slice(v.as_bytes()));
                answer.first_byte = first_byte;
                answer.last_byte = micros_since(t0);
                answer.body = body.to_bytes();
            }
        }
        Opened::Answer(answer)
    }

    /// Everything but the model calls: to the control plane's listener and back, streamed.
    async fn proxy(&self, request: Request<Incoming>) -> Response<Out> {
        let (mut parts, body) = request.into_parts();
        let target = parts
            .uri
            .path_and_query()
            .map_or("/", http::uri::PathAndQuery::as_str);
        let Ok(uri) = format!("http://{}{}", self.config.backend, target).parse::<Uri>() else {
            return json_reply(
                400,
                "{\"error\":\"the request's target is not a path\"}".into(),
                false,
            );
        };
        parts.uri = uri;
        strip_hop_headers(&mut parts.headers);
        let request = Request::from_parts(parts, body.map_err(BoxError::from).boxed());
        match self.client.request(request).await {
            Ok(response) => {
                let (mut parts, body) = response.into_parts();
                let close = parts
                    .headers
                    .get(http::header::CONNECTION)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
                strip_hop_headers(&mut parts.headers);
                if close {
                    parts
                        .headers
                        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
                }
                Response::from_parts(parts, body.map_err(BoxError::from).boxed())
            }
            Err(_) => json_reply(
                502,
                "{\"error\":\"the server's control plane cannot be reached\"}".into(),
                false,
            ),
        }
    }
}

/// The reply a streaming call's stream begins with: its headers, no chunk yet.
fn begun(streaming: &Streaming) -> Reply {
    Reply {
        status: 200,
        headers: streaming.headers.clone(),
        chunks: Vec::new(),
        stream: true,
    }
}

/// The answer of an upstream call whose task was lost (it panicked).
fn lost() -> Upstream {
    Upstream {
        error: Some("ServerDisconnectedError".into()),
        ..Upstream::default()
    }
}

fn strip_hop_headers(headers: &mut HeaderMap) {
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|kind| {
        let kind = kind.as_bytes();
        kind.len() >= 17 && kind[..17].eq_ignore_ascii_case(b"text/event-stream")
    })
}

/// The kind of failure that kept a call from the upstream (or broke its stream off), named
/// as the Python server's client names it; a TLS failure says what TLS refused.
fn failure_kind(error: &(dyn std::error::Error + 'static)) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return format!("TLS handshake failed ({tls})");
        }
        // an io::Error's source is its inner error's source: its inner error is looked at
        source = match error
            .downcast_ref::<io::Error>()
            .and_then(io::Error::get_ref)
        {
            Some(inner) => Some(inner),
            None => error.source(),
        };
    }
    if let Some(error) = error.downcast_ref::<hyper_util::client::legacy::Error>() {
        if error.is_connect() {
            return "ClientConnectorError".into();
        }
    }
    "ServerDisconnectedError".into()
}

/// The TLS settings of the upstream client: rustls with ring; the roots are the system's
/// (`SSL_CERT_FILE` and `SSL_CERT_DIR` as OpenSSL reads them), or Mozilla's bundled roots
/// when the system has none and neither variable is set. Roots are loaded only for an
/// `https://` upstream.
fn tls_config(https: bool) -> io::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    if https {
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        if roots.is_empty() {
            let chosen: Vec<&str> = ["SSL_CERT_FILE", "SSL_CERT_DIR"]
                .into_iter()
                .filter(|name| std::env::var_os(name).is_some())
                .collect();
            if !chosen.is_empty() {
                let why: Vec<String> = native.errors.iter().map(ToString::to_string).collect();
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "no TLS root certificate could be read from {} ({}): point {it} at PEM \
                         certificates, or unset {it} to use the system's roots",
                        chosen.join(" and "),
                        if why.is_empty() {
                            "no certificate in it".to_string()
                        } else {
                            why.join("; ")
                        },
                        it = if chosen.len() > 1 { "them" } else { "it" },
                    ),
                ));
            }
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        }
    }
    // ring, not aws-lc-rs: no C toolchain beyond cc and no cmake in the build; its lack of
    // post-quantum key exchange is rustls's reason to deprecate it
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl<C: Control> Gateway<C> {
    /// Bind the listener and start serving.
    ///
    /// # Errors
    /// The listener cannot bind, the upstream is not an `http://` or `https://` URL, or the
    /// runtime or the recorder thread cannot start.
    pub fn start(config: Config, control: C) -> io::Result<Self> {
        let https = config.upstream.starts_with("https://");
        if !https && !config.upstream.starts_with("http://") {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the upstream must be an http:// or https:// URL, not {:?}",
                    config.upstream
                ),
            ));
        }
        let tls = tls_config(https)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.workers.max(1))
            .thread_name("rollout-store-gateway")
            .enable_io()
            .enable_time()
            .build()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(TokioTimer::new())
            .build(connector);
        let (tx, rx) = mpsc::channel();
        let (calls_tx, calls_rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            open_mode: AtomicBool::new(config.open_mode),
            config,
            control: Arc::new(control),
            keys: RwLock::new(KeyTable::new()),
            streams: Mutex::new(std::collections::HashMap::new()),
            client,
            jobs: Mutex::new(Some(tx)),
            calls: Mutex::new(Some(calls_tx)),
            pending: Arc::default(),
            deadline: Mutex::new(None),
        });
        let listener = runtime.block_on(async {
            let listen = shared.config.listen;
            let socket = if listen.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            };
            socket.set_reuseaddr(true)?;
            socket.bind(listen)?;
            socket.listen(2048)
        })?;
        let local = listener.local_addr()?;
        let (recorder, callers) = spawn_threads(&shared, rx, calls_rx)?;
        let serving = shared.clone();
        let header_timeout = shared.config.body_timeout;
        let accepting = runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let shared = serving.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(shared.handle(request).await) }
                    });
                    // a request's head must arrive within the body's time too (a client
                    // dripping header lines held its connection open for good)
                    let _ = http1::Builder::new()
                        .keep_alive(true)
                        .timer(TokioTimer::new())
                        .header_read_timeout(header_timeout)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self {
            shared,
            runtime: Some(runtime),
            accepting: Some(accepting),
            recorder: Some(recorder),
            callers,
            local,
        })
    }

    /// Where the listener is bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Let `key` open `session`, with the control's `object` of it (none: its calls are
    /// never sent by the direct lane).
    pub fn set_key(
        &self,
        key: &[u8],
        session: &str,
        object: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) {
        self.keys().insert(key, session, object);
    }

    /// Forget `key` (its session deleted: no ledger line of the direct lane names it from
    /// now on); whether it was known.
    pub fn remove_key(&self, key: &[u8]) -> bool {
        let Some(alive) = self.keys().remove(key) else {
            return false;
        };
        match self
            .shared
            .config
            .direct
            .as_ref()
            .and_then(|l| l.ledger.as_ref())
        {
            Some(ledger) => ledger.retire(&alive),
            None => alive.store(false, Ordering::Release),
        }
        true
    }

    /// A stream of `session` passes through, its turn not queued yet (the control's count:
    /// the direct lane leaves the session's calls to `waits` meanwhile).
    pub fn stream_begun(&self, session: &str) {
        *self
            .shared
            .streams()
            .entry(session.to_string())
            .or_default() += 1;
    }

    /// One such stream's turn is queued (or let go).
    pub fn stream_ended(&self, session: &str) {
        let mut streams = self.shared.streams();
        if let Some(n) = streams.get_mut(session) {
            *n -= 1;
            if *n == 0 {
                streams.remove(session);
            }
        }
    }

    fn keys(&self) -> std::sync::RwLockWriteGuard<'_, KeyTable> {
        self.shared
            .keys
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub fn set_open_mode(&self, open: bool) {
        self.shared.open_mode.store(open, Ordering::Relaxed);
    }

    /// Turns queued and waiting for the recorder.
    pub fn pending(&self) -> usize {
        self.queued().waiting()
    }

    /// Wait (at most `timeout`) until every queued turn is recorded or dropped; whether it
    /// was.
    pub fn settle(&self, timeout: Duration) -> bool {
        self.queued().settle(timeout)
    }

    /// The queue of turns, to be read and waited for apart from the gateway.
    pub fn queued(&self) -> Queued {
        Queued(self.shared.pending.clone())
    }

    /// The turns sent to the recorder so far: once [`Queued::handed_through`] that many,
    /// every call answered before now is known to the control (the direct lane's too).
    pub fn turns_sent(&self) -> u64 {
        let _jobs = self
            .shared
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.shared.pending.sent.load(Ordering::Relaxed)
    }

    /// Stop without waiting for anything: for a process whose control can no longer be
    /// called (an interpreter finalizing), where the threads that call it could not end.
    /// No new connection, calls in flight cut; the runtime, the caller threads and the
    /// recorder are let go unjoined; the queued turns are neither recorded nor reported (a
    /// control that keeps a ledger of the turns it answered counts them at its next start).
    pub fn abandon(&mut self) {
        if let Some(accepting) = self.accepting.take() {
            accepting.abort();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        self.shared
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.callers.clear();
        self.shared
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.recorder.take();
    }

    /// Stop: no new connection, calls in flight cut (the control's calls they queued not
    /// made; those begun end, waited for on the blocking pool for at most `drain`, a second
    /// at least), the queued turns recorded for at most `drain` (the rest reported dropped,
    /// those set aside too), the caller threads and the recorder joined.
    pub fn stop(&mut self, drain: Duration) {
        if let Some(accepting) = self.accepting.take() {
            accepting.abort();
        }
        if let Some(runtime) = self.runtime.take() {
            // a `finish` still running there has put its turn in the control's ledger: the
            // control counts it at its stop once it has returned, so it is waited for
            runtime.shutdown_timeout(drain.max(Duration::from_secs(1)));
        }
        self.shared
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        for caller in self.callers.drain(..) {
            let _ = caller.join();
        }
        *self
            .shared
            .deadline
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + drain);
        self.shared
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(recorder) = self.recorder.take() {
            let _ = recorder.join();
        }
    }
}

impl<C: Control> Drop for Gateway<C> {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// The threads that call the control: the recorder (its jobs from `jobs`) and the caller
/// threads (their work from `calls`), each run inside the control's [`Control::thread`].
fn spawn_threads<C: Control>(
    shared: &Arc<Shared<C>>,
    jobs: mpsc::Receiver<Job<C::Ticket>>,
    calls: mpsc::Receiver<Work<C>>,
) -> io::Result<(JoinHandle<()>, Vec<JoinHandle<()>>)> {
    let recorder = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("rollout-store-recorder".into())
            .spawn(move || {
                let control = shared.control.clone();
                control.thread(&mut move || record_loop(&shared, &jobs));
            })?
    };
    let calls = Arc::new(Mutex::new(calls));
    let callers = (0..shared.config.callers.max(1))
        .map(|_| {
            let control = shared.control.clone();
            let calls = calls.clone();
            std::thread::Builder::new()
                .name("rollout-store-caller".into())
                .spawn(move || control.thread(&mut || call_loop(&*control, &calls)))
        })
        .collect::<io::Result<Vec<_>>>()?;
    Ok((recorder, callers))
}

/// A caller thread: the control's calls, as they come, those queued meanwhile in one batch.
/// The queue is shared by the caller threads; one waits on it while the others work.
fn call_loop<C: Control>(control: &C, calls: &Mutex<mpsc::Receiver<Work<C>>>) {
    loop {
        let first = calls.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(first) = first else {
            return;
        };
        let mut next = Some(first);
        control.batch(&mut || {
            while let Some(work) = next.take() {
                let _ = catch_unwind(AssertUnwindSafe(|| work(control)));
                // a queue another thread waits on ends the batch: never wait for it here
                next = calls.try_lock().ok().and_then(|rx| rx.try_recv().ok());
            }
        });
    }
}

/// What the recorder set aside, in order: turns and timelines the control could not record
/// without waiting.
struct Aside<T> {
    turns: Vec<Arc<T>>,
    sent: Vec<(Arc<T>, Sent)>,
}

impl<T> Aside<T> {
    fn is_empty(&self) -> bool {
        self.turns.is_empty() && self.sent.is_empty()
    }
}

/// How often the recorder hands back what it set aside, when no new job comes.
pub const ASIDE_RETRY: Duration = Duration::from_millis(20);

/// The recorder: the jobs queued meanwhile (at most `RECORD_GROUP`), their turns recorded
/// together, then their timelines, one job at a time otherwise: each call into the control
/// takes the GIL for itself, so that the caller threads (whose calls a reply waits for) win
/// it between them. What the control sets aside goes first in the next batch, which comes
/// with the next job or after [`ASIDE_RETRY`]; once the gateway stops, until the drain's
/// deadline, after which it is reported dropped.
fn record_loop<C: Control>(shared: &Shared<C>, jobs: &mpsc::Receiver<Job<C::Ticket>>) {
    let mut aside = Aside {
        turns: Vec::new(),
        sent: Vec::new(),
    };
    loop {
        let first = if aside.is_empty() {
            match jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        } else {
            match jobs.recv_timeout(ASIDE_RETRY) {
                Ok(job) => Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(ASIDE_RETRY);
                    None
                }
            }
        };
        let mut batch: Vec<_> = first.into_iter().collect();
        while !batch.is_empty() && batch.len() < RECORD_GROUP {
            let Ok(job) = jobs.try_recv() else {
                break;
            };
            batch.push(job);
        }
        record_batch(shared, batch, &mut aside);
    }
}

/// Jobs the recorder takes at once, at most.
const RECORD_GROUP: usize = 64;

fn record_batch<C: Control>(
    shared: &Shared<C>,
    batch: Vec<Job<C::Ticket>>,
    aside: &mut Aside<C::Ticket>,
) {
    let late = shared
        .deadline
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .is_some_and(|at| Instant::now() > at);
    let control = &shared.control;
    // the turns set aside are tried again first: they count in the bound meanwhile, or
    // the calls answered during the try would take their places and more than the bound
    // would wait
    let mut turns = std::mem::take(&mut aside.turns);
    let retried = turns.len();
    let handed = batch.iter().filter(|j| matches!(j, Job::Record(_))).count() as u64;
    let mut sent = std::mem::take(&mut aside.sent);
    for job in batch {
        match job {
            Job::Record(ticket) => {
                shared.pending.taken();
                turns.push(ticket);
            }
            // a timeline comes after its turn's job: recorded after the turns, it still is
            Job::Sent(ticket, stamps) => sent.push((ticket, stamps)),
        }
    }
    if !turns.is_empty() {
        let tickets: Vec<&C::Ticket> = turns.iter().map(|t| &**t).collect();
        // the new turns, told of first (the direct lane's calls become known to the
        // control here): what `handed_through` counts
        let _ = catch_unwind(AssertUnwindSafe(|| control.adopt(&tickets[retried..])));
        shared.pending.handed.fetch_add(handed, Ordering::Release);
        let held = catch_unwind(AssertUnwindSafe(|| {
            if late {
                for ticket in &tickets {
                    control.dropped(ticket, "shutdown");
                }
                Vec::new()
            } else {
                control.record(&tickets)
            }
        }))
        .unwrap_or_else(|_| {
            // a panic in the control: none of these turns is known to be recorded, and
            // each is reported dropped (counted), never let go unsaid
            for ticket in &tickets {
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    control.dropped(ticket, "record_error");
                }));
            }
            Vec::new()
        });
        let mut kept = vec![false; turns.len()];
        for i in held {
            if let Some(k) = kept.get_mut(i) {
                *k = true;
            }
        }
        for (k, (ticket, kept)) in turns.into_iter().zip(kept).enumerate() {
            let again = k < retried;
            if kept {
                if !again {
                    shared.pending.set_aside();
                }
                aside.turns.push(ticket);
            } else {
                if again {
                    shared.pending.taken();
                }
                shared.pending.done();
            }
        }
    }
    if !late {
        for (ticket, stamps) in sent {
            let done = catch_unwind(AssertUnwindSafe(|| control.sent(&ticket, stamps)));
            if matches!(done, Ok(false)) {
                aside.sent.push((ticket, stamps));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A control that is never called: the queue's own answers are tested.
    struct Idle;

    impl Control for Idle {
        type Ticket = ();

        fn prepare(&self, _: Call) -> Prepared<()> {
            unreachable!()
        }
        fn finish(&self, (): &(), _: Upstream) -> Finished {
            unreachable!()
        }
        fn finish_stream(&self, (): &(), _: Streamed) -> Finished {
            unreachable!()
        }
        fn record(&self, _: &[&()]) -> Vec<usize> {
            Vec::new()
        }
        fn dropped(&self, (): &(), _: &'static str) {}
        fn sent(&self, (): &(), _: Sent) -> bool {
            true
        }
    }

    #[test]
    fn a_turn_not_queued_is_dropped_for_shutdown_once_a_stop_closed_the_queue() {
        let config = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstream: "http://127.0.0.1:9".into(),
            backend: "127.0.0.1:9".parse().unwrap(),
            hosts: crate::checks::Hosts::any(),
            open_mode: true,
            max_body_bytes: 1 << 20,
            body_timeout: Duration::from_secs(5),
            body_timeout_text: "5".into(),
            upstream_timeout: Duration::from_secs(5),
            stream_keepalive: Duration::from_secs(5),
            fast: true,
            ack_queue: 1,
            workers: 1,
            callers: 1,
            forward_only: false,
            direct: None,
        };
        let mut gateway = Gateway::start(config, Idle).unwrap();
        let shared = gateway.shared.clone();
        let ticket = Arc::new(());
        assert_eq!(shared.queue_if(false, &ticket), Ok(()));
        assert!(shared.pending.add(1)); // the bound taken: the queue is full
        assert_eq!(shared.queue_if(true, &ticket), Err("queue_full"));
        shared.pending.taken();
        shared.pending.done();
        // the stop closes the queue (as `stop` does, after the calls in flight were cut)
        let jobs = shared.jobs.lock().unwrap().take();
        assert_eq!(shared.queue_if(true, &ticket), Err("shutdown"));
        assert!(shared.pending.add(1));
        assert_eq!(shared.queue_if(true, &ticket), Err("shutdown"));
        shared.pending.taken();
        shared.pending.done();
        drop(jobs);
        gateway.stop(Duration::from_secs(1));
        assert_eq!(shared.pending.counts().unfinished, 0);
    }

    #[test]
    fn a_tls_failure_is_named_however_deep_it_is_wrapped() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let wrapped = io::Error::other(io::Error::new(io::ErrorKind::InvalidData, tls));
        assert_eq!(
            failure_kind(&wrapped),
            "TLS handshake failed (invalid peer certificate: UnknownIssuer)"
        );
        let plain = io::Error::other("connection reset");
        assert_eq!(failure_kind(&plain), "ServerDisconnectedError");
    }
}
