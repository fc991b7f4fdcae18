//! The data plane end to end on loopback: a stub upstream and a stub control plane (plain
//! HTTP/1.1 over std sockets), the gateway between them, calls made with raw requests.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gateway::{
    Call, Config, Control, Finished, Gateway, Prepared, Reply, Sent, Streamed, Upstream,
};

mod common;

/// A loopback HTTP/1.1 server answering every request with `answer` (or, for `None`, the
/// request's own body); counts the requests.
fn stub(answer: Option<&'static str>) -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let addr = common::serve(move |stream| serve_stub(stream, answer, &counted));
    (addr, hits)
}

fn serve_stub(stream: TcpStream, answer: Option<&str>, hits: &AtomicUsize) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    while let Some(body) = common::read_request(&mut reader) {
        hits.fetch_add(1, Ordering::SeqCst);
        let reply = answer.map_or(body, |a| a.as_bytes().to_vec());
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            reply.len()
        );
        if out.write_all(head.as_bytes()).is_err() || out.write_all(&reply).is_err() {
            return;
        }
    }
}

/// One request on a fresh connection: the status and the body.
fn call(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    common::status_and_body(&common::exchange(addr, head, body))
}

fn model_call(addr: SocketAddr, key: &str, body: &str) -> (u16, String) {
    call(addr, &common::model_head(key), body.as_bytes())
}

/// A control plane that forwards every call to the upstream as it came, answers with the
/// upstream's body, and panics on a body holding "boom"; the turns and timelines of the
/// session `busy` names are set aside (as a session whose graph an export holds).
#[derive(Default)]
struct Echo {
    recorded: Mutex<Vec<String>>,
    sent: AtomicUsize,
    busy: Mutex<Option<&'static str>>,
    dropped: Mutex<Vec<(String, &'static str)>>,
}

/// Whether `ticket` is of the session `busy` names.
fn of(busy: Option<&str>, ticket: &str) -> bool {
    busy.is_some_and(|session| ticket.starts_with(&format!("{session}:")))
}

/// The gateway's handle on the shared [`Echo`].
struct Probe(Arc<Echo>);

impl Control for Probe {
    type Ticket = String;

    fn prepare(&self, call: Call) -> Prepared<String> {
        let body = String::from_utf8(call.body.to_vec()).unwrap();
        assert!(!body.contains("boom"), "a bug in the control plane");
        let ticket = format!("{}:{body}", call.session.as_deref().unwrap_or_default());
        common::forward(call, ticket, None)
    }

    fn finish(&self, _: &String, upstream: Upstream) -> Finished {
        let length = upstream.body.len().to_string();
        Finished {
            reply: Reply {
                status: upstream.status,
                headers: vec![(Bytes::from_static(b"content-length"), Bytes::from(length))],
                chunks: vec![upstream.body],
                stream: false,
            },
            queue: true,
            timed: true,
            release: false,
        }
    }

    fn finish_stream(&self, _: &String, _: Streamed) -> Finished {
        Finished::default()
    }

    fn record(&self, tickets: &[&String]) -> Vec<usize> {
        assert!(
            !tickets.iter().any(|t| t.contains("panic-in-record")),
            "a bug in the control plane's recording"
        );
        let mut recorded = self.0.recorded.lock().unwrap();
        let busy = *self.0.busy.lock().unwrap(); // (once: a session is busy for all its turns)
        let mut held = Vec::new();
        for (i, ticket) in tickets.iter().enumerate() {
            if of(busy, ticket) {
                held.push(i);
            } else {
                recorded.push((*ticket).clone());
            }
        }
        held
    }

    fn dropped(&self, ticket: &String, why: &'static str) {
        self.0.dropped.lock().unwrap().push((ticket.clone(), why));
    }

    fn sent(&self, ticket: &String, _: Sent) -> bool {
        if of(*self.0.busy.lock().unwrap(), ticket) {
            return false;
        }
        self.0.sent.fetch_add(1, Ordering::SeqCst);
        true
    }
}

struct Setup {
    gateway: Gateway<Probe>,
    control: Arc<Echo>,
    upstream_hits: Arc<AtomicUsize>,
    addr: SocketAddr,
}

fn setup() -> Setup {
    let (upstream, upstream_hits) = stub(None);
    let (backend, _) = stub(Some(r#"{"status":"ok"}"#));
    let control = Arc::new(Echo::default());
    let config = Config {
        backend,
        open_mode: false,
        fast: true,
        ..common::config(format!("http://{upstream}"))
    };
    let gateway = Gateway::start(config, Probe(control.clone())).unwrap();
    gateway.set_key(b"key-a", "a", None);
    let addr = gateway.local_addr();
    Setup {
        gateway,
        control,
        upstream_hits,
        addr,
    }
}

const BODY: &str = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;

#[test]
fn a_known_key_goes_upstream_and_its_turn_is_recorded() {
    let mut s = setup();
    assert_eq!(model_call(s.addr, "key-a", BODY), (200, BODY.to_string()));
    assert!(s.gateway.settle(Duration::from_secs(5)));
    assert_eq!(
        *s.control.recorded.lock().unwrap(),
        vec![format!("a:{BODY}")]
    );
    s.gateway.stop(Duration::from_secs(5));
    assert_eq!(s.control.sent.load(Ordering::SeqCst), 1);
}

fn body(text: &str) -> String {
    format!(r#"{{"messages": [{{"role": "user", "content": "{text}"}}]}}"#)
}

#[test]
fn a_busy_sessions_turns_are_set_aside_in_order_and_hold_up_no_other() {
    let mut s = setup();
    s.gateway.set_key(b"key-b", "b", None);
    *s.control.busy.lock().unwrap() = Some("a");
    for text in ["a1", "a2"] {
        assert_eq!(model_call(s.addr, "key-a", &body(text)).0, 200);
    }
    assert_eq!(model_call(s.addr, "key-b", &body("b1")).0, 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.control.recorded.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        *s.control.recorded.lock().unwrap(),
        vec![format!("b:{}", body("b1"))]
    );
    // the two set aside still wait: counted in the queue and waited for
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.gateway.pending() != 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(s.gateway.pending(), 2);
    assert!(!s.gateway.settle(Duration::from_millis(100)));
    assert_eq!(model_call(s.addr, "key-a", &body("a3")).0, 200);
    *s.control.busy.lock().unwrap() = None;
    assert!(s.gateway.settle(Duration::from_secs(5)));
    let recorded = s.control.recorded.lock().unwrap().clone();
    let expected: Vec<String> = [("b", "b1"), ("a", "a1"), ("a", "a2"), ("a", "a3")]
        .iter()
        .map(|(session, text)| format!("{session}:{}", body(text)))
        .collect();
    assert_eq!(recorded, expected);
    s.gateway.stop(Duration::from_secs(5));
    assert_eq!(s.control.sent.load(Ordering::SeqCst), 4); // each timeline, set aside or not
    assert!(s.control.dropped.lock().unwrap().is_empty());
}

#[test]
fn a_stop_reports_the_turns_still_set_aside_dropped() {
    let mut s = setup();
    s.gateway.set_key(b"key-b", "b", None);
    *s.control.busy.lock().unwrap() = Some("a");
    assert_eq!(model_call(s.addr, "key-a", &body("a1")).0, 200);
    assert_eq!(model_call(s.addr, "key-b", &body("b1")).0, 200);
    s.gateway.stop(Duration::from_millis(200));
    assert_eq!(
        *s.control.recorded.lock().unwrap(),
        vec![format!("b:{}", body("b1"))]
    );
    assert_eq!(
        *s.control.dropped.lock().unwrap(),
        vec![(format!("a:{}", body("a1")), "shutdown")]
    );
    assert!(s.gateway.settle(Duration::ZERO));
}

#[test]
fn a_panic_while_recording_reports_its_turns_dropped_and_the_recorder_goes_on() {
    let mut s = setup();
    assert_eq!(model_call(s.addr, "key-a", &body("panic-in-record")).0, 200);
    assert!(s.gateway.settle(Duration::from_secs(5)));
    assert_eq!(
        *s.control.dropped.lock().unwrap(),
        vec![(format!("a:{}", body("panic-in-record")), "record_error")]
    );
    assert_eq!(model_call(s.addr, "key-a", &body("after")).0, 200);
    assert!(s.gateway.settle(Duration::from_secs(5)));
    assert_eq!(
        *s.control.recorded.lock().unwrap(),
        vec![format!("a:{}", body("after"))]
    );
    s.gateway.stop(Duration::from_secs(5));
}

#[test]
fn unknown_and_removed_keys_are_refused_before_the_upstream() {
    let s = setup();
    let (status, body) = model_call(s.addr, "key-b", BODY);
    assert_eq!(status, 401);
    assert!(body.contains("\"type\":\"authentication_error\""), "{body}");
    assert!(s.gateway.remove_key(b"key-a"));
    assert_eq!(model_call(s.addr, "key-a", BODY).0, 401);
    assert_eq!(s.upstream_hits.load(Ordering::SeqCst), 0);
}

#[test]
fn foreign_hosts_and_non_json_bodies_are_refused() {
    let s = setup();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: evil.example\r\n\
                content-type: application/json\r\nauthorization: Bearer key-a";
    let (status, body) = call(s.addr, head, BODY.as_bytes());
    assert_eq!(status, 403);
    assert!(
        body.contains("does not answer the Host 'evil.example'"),
        "{body}"
    );
    let head = "POST /v1/messages HTTP/1.1\r\nhost: localhost:1\r\n\
                content-type: text/plain\r\nx-api-key: key-a";
    let (status, body) = call(s.addr, head, BODY.as_bytes());
    assert_eq!(status, 415);
    assert!(body.starts_with("{\"type\":\"error\""), "{body}");
    assert_eq!(s.upstream_hits.load(Ordering::SeqCst), 0);
}

#[test]
fn deep_and_large_bodies_never_reach_the_upstream() {
    let s = setup();
    let deep = format!(
        r#"{{"messages": [{{"role": "user"}}], "tools": {}1{}}}"#,
        "[".repeat(600),
        "]".repeat(600)
    );
    let (status, body) = model_call(s.addr, "key-a", &deep);
    assert_eq!(status, 400);
    assert!(
        body.contains("tools nests deeper than 500 levels"),
        "{body}"
    );
    let large = format!(r#"{{"x": "{}"}}"#, "a".repeat(2 << 20));
    let (status, body) = model_call(s.addr, "key-a", &large);
    assert_eq!(status, 413);
    assert!(body.contains("over the limit of 1048576 bytes"), "{body}");
    assert_eq!(s.upstream_hits.load(Ordering::SeqCst), 0);
}

#[test]
fn a_panic_answers_500_and_the_server_goes_on() {
    let s = setup();
    let (status, body) = model_call(s.addr, "key-a", r#"{"boom": 1}"#);
    assert_eq!((status, body.as_str()), (500, "Internal Server Error"));
    assert_eq!(model_call(s.addr, "key-a", BODY), (200, BODY.to_string()));
}

#[test]
fn other_routes_go_to_the_control_plane() {
    let s = setup();
    let (status, body) = call(s.addr, "GET /health HTTP/1.1\r\nhost: 127.0.0.1", b"");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    assert_eq!(s.upstream_hits.load(Ordering::SeqCst), 0);
}

/// A control plane whose call with a body holding "first" finishes only once another call
/// has finished (as a call continuing a stream waits for the stream's turn), and says so in
/// `waits`.
#[derive(Default)]
struct Ordered {
    others_finished: Mutex<usize>,
    changed: std::sync::Condvar,
}

struct OrderedProbe(Arc<Ordered>);

impl Control for OrderedProbe {
    type Ticket = bool;

    fn waits(&self, first: &bool) -> bool {
        *first
    }

    fn prepare(&self, call: Call) -> Prepared<bool> {
        let first = call.body.windows(5).any(|w| w == b"first");
        common::forward(call, first, None)
    }

    fn finish(&self, first: &bool, upstream: Upstream) -> Finished {
        let mut finished = self.0.others_finished.lock().unwrap();
        if *first {
            let (after, _) = self
                .0
                .changed
                .wait_timeout_while(finished, Duration::from_secs(10), |n| *n == 0)
                .unwrap();
            finished = after;
        } else {
            *finished += 1;
            self.0.changed.notify_all();
        }
        let status = if *finished > 0 { upstream.status } else { 504 };
        Finished {
            reply: Reply {
                status,
                headers: Vec::new(),
                chunks: vec![upstream.body],
                stream: false,
            },
            ..Finished::default()
        }
    }

    fn finish_stream(&self, _: &bool, _: Streamed) -> Finished {
        Finished::default()
    }

    fn record(&self, _: &[&bool]) -> Vec<usize> {
        Vec::new()
    }

    fn dropped(&self, _: &bool, _: &'static str) {}

    fn sent(&self, _: &bool, _: Sent) -> bool {
        true
    }
}

#[test]
fn a_call_that_waits_for_another_holds_up_no_caller_thread() {
    let (upstream, _) = stub(None);
    let config = Config {
        callers: 1,
        ..common::config(format!("http://{upstream}"))
    };
    let gateway = Gateway::start(config, OrderedProbe(Arc::default())).unwrap();
    let addr = gateway.local_addr();
    let waiting =
        std::thread::spawn(move || model_call(addr, "any", r#"{"messages": [], "first": 1}"#));
    std::thread::sleep(Duration::from_millis(200)); // its finish waits by now
    assert_eq!(model_call(addr, "any", BODY).0, 200);
    let (status, _) = waiting.join().unwrap();
    assert_eq!(status, 200, "the waiting call never saw the other finish");
}

/// A control plane whose `prepare` takes a while, counting the calls it makes.
#[derive(Default)]
struct SlowPrepare {
    prepared: AtomicUsize,
}

struct SlowProbe(Arc<SlowPrepare>);

impl Control for SlowProbe {
    type Ticket = u8;

    fn prepare(&self, call: Call) -> Prepared<u8> {
        self.0.prepared.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
        common::forward(call, 0, None)
    }

    fn finish(&self, _: &u8, upstream: Upstream) -> Finished {
        Finished {
            reply: Reply {
                status: upstream.status,
                headers: Vec::new(),
                chunks: vec![upstream.body],
                stream: false,
            },
            ..Finished::default()
        }
    }

    fn finish_stream(&self, _: &u8, _: Streamed) -> Finished {
        Finished::default()
    }

    fn record(&self, _: &[&u8]) -> Vec<usize> {
        Vec::new()
    }

    fn dropped(&self, _: &u8, _: &'static str) {}

    fn sent(&self, _: &u8, _: Sent) -> bool {
        true
    }
}

#[test]
fn a_stopping_gateway_makes_none_of_the_calls_queued_for_its_cut_calls() {
    let (upstream, _) = stub(None);
    let control = Arc::new(SlowPrepare::default());
    let mut gateway = Gateway::start(
        common::config(format!("http://{upstream}")),
        SlowProbe(control.clone()),
    )
    .unwrap();
    gateway.set_key(b"key-a", "a", None);
    let addr = gateway.local_addr();
    let calls: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || model_call(addr, "key-a", BODY)))
        .collect();
    std::thread::sleep(Duration::from_millis(200)); // one prepare begun, three queued
    gateway.stop(Duration::from_secs(1));
    for call in calls {
        let _ = call.join();
    }
    assert_eq!(control.prepared.load(Ordering::SeqCst), 1);
}
