//! A stream passed through end to end on loopback: an upstream sending its events in pieces
//! cut anywhere, the gateway passing each on whole, keeping the bytes for the control and
//! holding the last event back until the control says what ends the stream.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gateway::checks::{Hosts, LOOPBACK_HOSTS};
use gateway::sse::Strip;
use gateway::{
    Call, Config, Control, Finished, Gateway, Prepared, Reply, Sent, Streamed, Streaming, Upstream,
};

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
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || answer(stream));
        }
    });
    addr
}

fn answer(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    let mut length = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
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
        Prepared::Forward {
            path: "/v1/chat/completions".into(),
            body: call.body,
            headers: vec![("content-type".into(), "application/json".into())],
            ticket: (),
            stream: Some(Streaming {
                headers: vec![(
                    Bytes::from_static(b"content-type"),
                    Bytes::from_static(b"text/event-stream"),
                )],
                anthropic: false,
                strip: Strip {
                    token_ids: true,
                    logprobs: false,
                },
            }),
        }
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

    fn record(&self, (): &()) {}
    fn dropped(&self, (): &(), _: &'static str) {}
    fn sent(&self, (): &(), _: Sent) {}
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
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: format!("http://{}", upstream()),
        backend: "127.0.0.1:9".parse().unwrap(),
        hosts: Hosts::only(LOOPBACK_HOSTS.iter().map(|h| (*h).to_string())),
        open_mode: true,
        max_body_bytes: 1 << 20,
        body_timeout: Duration::from_secs(5),
        body_timeout_text: "5".into(),
        upstream_timeout: Duration::from_secs(5),
        stream_keepalive: Duration::from_secs(5),
        fast: false,
        ack_queue: 16,
        workers: 1,
        forward_only: false,
    };
    let mut gateway = Gateway::start(config, control).unwrap();
    let body = r#"{"messages": [], "stream": true}"#;
    let mut client = TcpStream::connect(gateway.local_addr()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n\
         content-type: application/json\r\nauthorization: Bearer k\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    gateway.stop(Duration::from_secs(1));
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
