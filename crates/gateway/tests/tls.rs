//! An https upstream on loopback: a rustls server with a certificate of a test CA
//! (`tests/data`, made with trustme, valid until the year 3000; test-only keys), called by
//! the gateway with `SSL_CERT_FILE` naming that CA, then naming another one.
//!
//! (Its own test binary: it sets `SSL_CERT_FILE` in the process's environment.)

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use gateway::{
    Call, Config, Control, Finished, Gateway, Prepared, Reply, Sent, Streamed, Upstream,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

mod common;

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
    common::serve(move |stream| answer(stream, config.clone()))
}

fn answer(stream: TcpStream, config: Arc<rustls::ServerConfig>) {
    let connection = rustls::ServerConnection::new(config).unwrap();
    let mut tls = rustls::StreamOwned::new(connection, stream);
    // a client that refuses the certificate ends here
    if common::read_request(&mut BufReader::new(&mut tls)).is_none() {
        return;
    }
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
        common::forward(call, (), None)
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
    fn record(&self, _: &[&()]) -> Vec<usize> {
        Vec::new()
    }
    fn dropped(&self, (): &(), _: &'static str) {}
    fn sent(&self, (): &(), _: Sent) -> bool {
        true
    }
}

fn config(upstream: SocketAddr) -> Config {
    common::config(format!("https://{upstream}"))
}

fn call_through(upstream: SocketAddr) -> (u16, String) {
    let answer = common::call_through(config(upstream), Plain, r#"{"messages": []}"#);
    common::status_and_body(&answer)
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
