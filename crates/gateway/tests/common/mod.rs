//! What the gateway's loopback tests share: a stub server's accept loop and request reader,
//! the gateway's test configuration, the control's plain forward, and a raw client call.

// each test binary builds this module and uses its own part of it
#![allow(dead_code)]

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use gateway::checks::{Hosts, LOOPBACK_HOSTS};
use gateway::{Call, Config, Control, Gateway, Prepared, Streaming};

/// The head of a model call with `key` (no connection or length headers).
pub fn model_head(key: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n\
         content-type: application/json\r\nauthorization: Bearer {key}"
    )
}

/// A loopback server handing each connection, on a thread of its own, to `serve`.
pub fn serve<F>(serve: F) -> SocketAddr
where
    F: Fn(TcpStream) + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let serve = serve.clone();
            std::thread::spawn(move || serve(stream));
        }
    });
    addr
}

/// The body of the next request on `reader` (its length from `content-length`), or `None`
/// when the connection ends first.
pub fn read_request(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut length = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
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
    Some(body)
}

/// A gateway on a free loopback port in open mode, acknowledging in line, calling
/// `upstream` (a base URL), with no control plane listening behind it.
pub fn config(upstream: String) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream,
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
        callers: 1,
        forward_only: false,
        direct: None,
    }
}

/// A call forwarded to the upstream's chat completions as it came.
pub fn forward<T>(call: Call, ticket: T, stream: Option<Streaming>) -> Prepared<T> {
    Prepared::Forward {
        path: "/v1/chat/completions".into(),
        head: 0,
        body: call.body,
        headers: vec![("content-type".into(), "application/json".into())],
        ticket,
        stream,
    }
}

/// One request on a fresh connection to `addr`: the whole answer as it came.
pub fn exchange(addr: SocketAddr, head: &str, body: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!(
        "{head}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    // a refusal may come (and the connection close) before the whole body is sent
    let _ = stream.write_all(body);
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// One model call of `body` through a gateway started for it with `config` and `control`
/// (stopped after): the whole answer as it came.
pub fn call_through<C: Control>(config: Config, control: C, body: &str) -> String {
    let mut gateway = Gateway::start(config, control).unwrap();
    let answer = exchange(gateway.local_addr(), &model_head("k"), body.as_bytes());
    gateway.stop(Duration::from_secs(1));
    answer
}

/// An answer's status and body.
pub fn status_and_body(answer: &str) -> (u16, String) {
    let status = answer[9..12].parse().unwrap();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}
