//! HTTPS with a self-signed certificate: a client that trusts it is
//! answered, one that does not is refused, a client that connects and
//! never says hello neither blocks the others nor stays for ever, and a
//! bad certificate or key is a clear error naming the file.
#![cfg(feature = "tls")]

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use keel_http::tls::{TlsError, TlsListener, server_config};
use keel_testkit::metrics::MetricsRecorder;
use tokio::io::AsyncReadExt;

struct Pem {
    dir: tempfile::TempDir,
    cert: String,
}

impl Pem {
    fn cert_path(&self) -> std::path::PathBuf {
        self.dir.path().join("cert.pem")
    }

    fn key_path(&self) -> std::path::PathBuf {
        self.dir.path().join("key.pem")
    }
}

fn self_signed() -> Pem {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = certified.cert.pem();
    std::fs::write(dir.path().join("cert.pem"), &cert).unwrap();
    std::fs::write(
        dir.path().join("key.pem"),
        certified.signing_key.serialize_pem(),
    )
    .unwrap();
    Pem { dir, cert }
}

/// Serves a hello route over TLS; returns its address.
async fn serve(pem: &Pem, handshake_timeout: Duration) -> std::net::SocketAddr {
    let config = server_config(pem.cert_path(), pem.key_path()).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = TlsListener::new(tcp, config).handshake_timeout(handshake_timeout);
    let app = Router::new().route("/hello", get(|| async { "hello over tls" }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn trusting(pem: &Pem) -> reqwest::Client {
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pem.cert.as_bytes()).unwrap())
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_client_that_trusts_the_certificate_is_answered_and_others_are_refused() {
    let pem = self_signed();
    let addr = serve(&pem, Duration::from_secs(10)).await;
    let url = format!("https://{addr}/hello");
    let body = trusting(&pem)
        .get(&url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "hello over tls");
    assert!(
        reqwest::get(&url).await.is_err(),
        "an unknown certificate is not trusted"
    );
    assert!(
        reqwest::get(format!("http://{addr}/hello")).await.is_err(),
        "plain HTTP gets no answer"
    );
}

#[tokio::test]
async fn a_client_that_never_says_hello_blocks_nobody_and_is_closed() {
    let recorder = MetricsRecorder::global();
    let pem = self_signed();
    let addr = serve(&pem, Duration::from_millis(300)).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = tokio::time::timeout(
        Duration::from_secs(5),
        trusting(&pem).get(format!("https://{addr}/hello")).send(),
    )
    .await
    .expect("another client's handshake is not held up")
    .unwrap()
    .text()
    .await
    .unwrap();
    assert_eq!(body, "hello over tls");
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("the silent connection is closed after the handshake timeout");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "closed, not answered: {read:?}"
    );
    assert_eq!(
        recorder.counter("keel_http_tls_handshake_failures_total,reason=timeout"),
        1
    );
}

#[tokio::test]
async fn one_address_that_never_starts_tls_holds_only_its_share_of_the_handshakes() {
    let pem = self_signed();
    let config = server_config(pem.cert_path(), pem.key_path()).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = TlsListener::new(tcp, config)
        .max_handshakes(4)
        .max_handshakes_per_address(2);
    let app = Router::new().route("/hello", get(|| async { "hello over tls" }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let from = |octet: u8| async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(([127, 0, 0, octet], 0).into()).unwrap();
        socket.connect(addr).await.unwrap()
    };
    // Four silent connections from one address: without a share they
    // would fill every handshake slot for the 10 s timeout.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(from(5).await);
    }
    let mut buf = [0u8; 16];
    let beyond = tokio::time::timeout(Duration::from_secs(2), silent[3].read(&mut buf))
        .await
        .expect("a connection past the address's share is closed at once");
    assert!(matches!(beyond, Ok(0) | Err(_)), "{beyond:?}");
    let other = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pem.cert.as_bytes()).unwrap())
        .local_address(std::net::IpAddr::from([127, 0, 0, 6]))
        .build()
        .unwrap();
    let body = tokio::time::timeout(
        Duration::from_secs(5),
        other.get(format!("https://{addr}/hello")).send(),
    )
    .await
    .expect("another address is handshaken at once")
    .unwrap()
    .text()
    .await
    .unwrap();
    assert_eq!(body, "hello over tls");
}

#[test]
fn a_missing_empty_or_mismatched_file_is_an_error_naming_it() {
    let pem = self_signed();
    let other = self_signed();
    let missing = pem.dir.path().join("nope.pem");
    let err = server_config(&missing, pem.key_path()).unwrap_err();
    assert!(
        matches!(err, TlsError::File { ref path, .. } if *path == missing),
        "{err}"
    );

    let empty = pem.dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let err = server_config(&empty, pem.key_path()).unwrap_err();
    assert!(err.to_string().contains("no PEM certificate"), "{err}");

    let err = server_config(pem.cert_path(), pem.cert_path()).unwrap_err();
    assert!(
        matches!(err, TlsError::File { .. }),
        "a certificate is no key: {err}"
    );

    let err = server_config(pem.cert_path(), other.key_path()).unwrap_err();
    assert!(
        matches!(err, TlsError::Refused(_)),
        "another certificate's key: {err}"
    );
}
