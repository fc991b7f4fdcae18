//! A stream passed through end to end on loopback: an upstream sending its events in pieces
//! cut anywhere, the gateway passing each on whole, keeping the bytes for the control and
//! holding the last event back until the control says what ends the stream.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gateway::sse::Strip;
use gateway::{Call, Control, Finished, Prepared, Reply, Sent, Streamed, Streaming, Upstream};

mod common;

/// The upstream's stream, in the pieces it is sent in (cut inside events and lines).
const PIECES: [&str; 4] = [
    "data: {\"n\": 1, \"prompt_token_ids\": [1]",
    "}\n\ndata: {\"n\": 2}\n",
    "\ndata: [DO",
    "NE]\n\n",
];

/// A loopback upstream answering each request with `PIECES` as an event stream, one HTTP
/// chunk a piece.
fn upstream() -> SocketAddr {
    common::serve(answer)
}

fn answer(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    if common::read_request(&mut reader).is_none() {
        return;
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                transfer-encoding: chunked\r\n\r\n";
    let _ = out.write_all(head.as_bytes());
    for piece in PIECES {
        let chunk = format!("{:x}\r\n{piece}\r\n", piece.len());
        let _ = out.write_all(chunk.as_bytes());
        let _ = out.flush();
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = out.write_all(b"0\r\n\r\n");
}

/// A control that asks for every call's stream and, at its end, releases the held-back last
/// event (`release`) or ends the stream with an error event of its own; it keeps what each
/// stream's end brought it.
struct Streams {
    release: bool,
    streamed: Arc<Mutex<Vec<Kept>>>,
}

/// A stream's bytes and why it did not end with its last event.
type Kept = (Bytes, Option<String>);

impl Control for Streams {
    type Ticket = ();

    fn prepare(&self, call: Call) -> Prepared<()> {
        let stream = Streaming {
            headers: vec![(
                Bytes::from_static(b"content-type"),
                Bytes::from_static(b"text/event-stream"),
            )],
            anthropic: false,
            strip: Strip {
                token_ids: true,
                logprobs: false,
            },
        };
        common::forward(call, (), Some(stream))
    }

    fn finish(&self, (): &(), _: Upstream) -> Finished {
        Finished::default()
    }

    fn finish_stream(&self, (): &(), streamed: Streamed) -> Finished {
        self.streamed
            .lock()
            .unwrap()
            .push((streamed.events, streamed.error));
        let chunks = if self.release {
            Vec::new()
        } else {
            vec![Bytes::from_static(
                b"data: {\"error\": \"not recorded\"}\n\n",
            )]
        };
        Finished {
            reply: Reply {
                chunks,
                ..Reply::default()
            },
            release: self.release,
            ..Finished::default()
        }
    }

    fn record(&self, _: &[&()]) -> Vec<usize> {
        Vec::new()
    }
    fn dropped(&self, (): &(), _: &'static str) {}
    fn sent(&self, (): &(), _: Sent) -> bool {
        true
    }
}

/// The body of a chunked answer.
fn unchunked(mut data: &str) -> String {
    let mut body = String::new();
    loop {
        let (size, rest) = data.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size, 16).unwrap();
        if size == 0 {
            return body;
        }
        body.push_str(&rest[..size]);
        data = &rest[size + 2..];
    }
}

fn streamed_call(release: bool) -> (String, Vec<Kept>) {
    let streamed = Arc::new(Mutex::new(Vec::new()));
    let control = Streams {
        release,
        streamed: streamed.clone(),
    };
    let config = common::config(format!("http://{}", upstream()));
    let answer = common::call_through(config, control, r#"{"messages": [], "stream": true}"#);
    let (head, chunks) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let kept = streamed.lock().unwrap().clone();
    (unchunked(chunks), kept)
}

#[test]
fn each_event_is_passed_on_whole_and_the_control_gets_the_streams_bytes() {
    let (body, streamed) = streamed_call(true);
    // the capture field taken out, the rest as the upstream sent it
    assert_eq!(
        body,
        "data: {\"n\": 1}\n\ndata: {\"n\": 2}\n\ndata: [DONE]\n\n"
    );
    assert_eq!(streamed.len(), 1);
    assert_eq!(streamed[0].0, Bytes::from(PIECES.concat()));
    assert_eq!(streamed[0].1, None);
}

#[test]
fn the_last_event_waits_for_the_control_which_may_end_the_stream_otherwise() {
    let (body, streamed) = streamed_call(false);
    assert_eq!(
        body,
        "data: {\"n\": 1}\n\ndata: {\"n\": 2}\n\ndata: {\"error\": \"not recorded\"}\n\n"
    );
    assert_eq!(streamed.len(), 1);
}
