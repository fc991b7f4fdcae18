//! An https upstream on loopback: a rustls server with a certificate of a test CA
//! (`tests/data`, made with trustme, valid until the year 3000; test-only keys), called by
//! the gateway with `SSL_CERT_FILE` naming that CA, then naming another one.
//!
//! (Its own test binary: it sets `SSL_CERT_FILE` in the process's environment.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gateway::checks::{Hosts, LOOPBACK_HOSTS};
use gateway::{
    Call, Config, Control, Finished, Gateway, Prepared, Reply, Sent, Streamed, Upstream,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const ANSWER: &str = r#"{"choices": [{"message": {"role": "assistant", "content": "over TLS"}}]}"#;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A loopback https server answering every request with `ANSWER`.
fn upstream() -> SocketAddr {
    let certs = CertificateDer::pem_file_iter(data("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(data("server-key.pem")).unwrap();
    #[allow(deprecated)] // the gateway's own provider
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let config = config.clone();
            std::thread::spawn(move || answer(stream, config));
        }
    });
    addr
}

fn answer(stream: TcpStream, config: Arc<rustls::ServerConfig>) {
    let connection = rustls::ServerConnection::new(config).unwrap();
    let mut tls = rustls::StreamOwned::new(connection, stream);
    let mut request = Vec::new();
    let mut byte = [0u8; 1];
    while !request.ends_with(b"\r\n\r\n") {
        // a client that refuses the certificate ends here
        if tls.read(&mut byte).unwrap_or(0) == 0 {
            return;
        }
        request.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&request).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0; length];
    tls.read_exact(&mut body).unwrap();
    let reply = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{ANSWER}",
        ANSWER.len()
    );
    let _ = tls.write_all(reply.as_bytes());
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

/// A control answering with the upstream's body, or with why there is none (502).
struct Plain;

impl Control for Plain {
    type Ticket = ();

    fn prepare(&self, call: Call) -> Prepared<()> {
        Prepared::Forward {
            path: "/v1/chat/completions".into(),
            body: call.body,
            headers: vec![("content-type".into(), "application/json".into())],
            ticket: (),
            stream: None,
        }
    }

    fn finish(&self, (): &(), upstream: Upstream) -> Finished {
        let (status, body) = match upstream.error {
            Some(error) => (502, Bytes::from(error)),
            None => (upstream.status, upstream.body),
        };
        let length = Bytes::from(body.len().to_string());
        Finished {
            reply: Reply {
                status,
                headers: vec![(Bytes::from_static(b"content-length"), length)],
                chunks: vec![body],
                stream: false,
            },
            ..Finished::default()
        }
    }

    fn finish_stream(&self, (): &(), _: Streamed) -> Finished {
        Finished::default()
    }
    fn record(&self, (): &()) {}
    fn dropped(&self, (): &(), _: &'static str) {}
    fn sent(&self, (): &(), _: Sent) {}
}

fn config(upstream: SocketAddr) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: format!("https://{upstream}"),
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
    }
}

fn call_through(upstream: SocketAddr) -> (u16, String) {
    let mut gateway = Gateway::start(config(upstream), Plain).unwrap();
    let body = r#"{"messages": []}"#;
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
    let status = answer[9..12].parse().unwrap();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

#[test]
fn an_https_upstream_is_trusted_by_the_roots_of_ssl_cert_file_only() {
    let upstream = upstream();
    std::env::remove_var("SSL_CERT_DIR");
    std::env::set_var("SSL_CERT_FILE", data("ca.pem"));
    assert_eq!(call_through(upstream), (200, ANSWER.to_string()));
    std::env::set_var("SSL_CERT_FILE", data("other-ca.pem"));
    let (status, body) = call_through(upstream);
    assert_eq!(status, 502);
    assert!(
        body.starts_with("TLS handshake failed (invalid peer certificate"),
        "{body}"
    );
    // a file of no certificate: the gateway does not start
    std::env::set_var("SSL_CERT_FILE", data("server-key.pem"));
    let Err(refused) = Gateway::start(config(upstream), Plain) else {
        panic!("a gateway started with no root certificate");
    };
    let message = refused.to_string();
    assert!(
        message.starts_with("no TLS root certificate could be read from SSL_CERT_FILE"),
        "{message}"
    );
}
