//! The client's side of mTLS against Keel's own server over loopback: the
//! client presents its certificate, the server sees its identity, and a
//! rotated certificate is presented once connections recycle, with no new
//! client built by hand.

use std::time::Duration;

use axum::Router;
use axum::extract::Extension;
use axum::routing::get;
use keel_client::identity::IdentityFiles;
use keel_client::{ConnectionRecycling, PropagatingClient};
use keel_http::health::{Drain, DrainServe};
use keel_http::tls::{ClientAuth, PeerIdentity, TlsFiles, TlsListener};
use keel_testkit::tls::{TestCa, dns, uri};

async fn whoami(Extension(peer): Extension<PeerIdentity>) -> String {
    peer.uris().join(",")
}

/// A server that requires a certificate of `clients`; its port.
async fn serve(dir: &std::path::Path, server_ca: &TestCa, clients: &TestCa) -> u16 {
    let (cert, key) = server_ca.server(vec![dns("localhost")]);
    std::fs::write(dir.join("server.pem"), cert).unwrap();
    std::fs::write(dir.join("server-key.pem"), key).unwrap();
    std::fs::write(dir.join("clients-ca.pem"), clients.pem()).unwrap();
    let tls = TlsFiles::new(dir.join("server.pem"), dir.join("server-key.pem"))
        .client_ca(dir.join("clients-ca.pem"), ClientAuth::Required)
        .load()
        .unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let app = Router::new().route("/whoami", get(whoami));
    let drain = Drain::builder().build().unwrap();
    tokio::spawn(async move { drain.serve(TlsListener::new(tcp, tls), app).await });
    port
}

fn write_identity(dir: &std::path::Path, ca: &TestCa, name: &str) {
    let (cert, key) = ca.client(vec![uri(name)]);
    std::fs::write(dir.join("me.pem"), cert).unwrap();
    std::fs::write(dir.join("me-key.pem"), key).unwrap();
}

async fn whoami_from(client: &PropagatingClient, port: u16) -> String {
    let request = client
        .inner()
        .get(format!("https://localhost:{port}/whoami"));
    client.send(request).await.unwrap().text().await.unwrap()
}

#[tokio::test]
async fn the_client_presents_its_certificate_and_picks_up_a_rotated_one() {
    let recorder = keel_testkit::metrics::MetricsRecorder::global();
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, clients) = (TestCa::new("server ca"), TestCa::new("client ca"));
    let port = serve(dir.path(), &server_ca, &clients).await;
    std::fs::write(dir.path().join("server-ca.pem"), server_ca.pem()).unwrap();
    write_identity(dir.path(), &clients, "spiffe://keel.local/orders/v1");

    let files = IdentityFiles::new(dir.path().join("me.pem"), dir.path().join("me-key.pem"))
        .server_ca(dir.path().join("server-ca.pem"));
    let client = PropagatingClient::with_identity(
        files,
        // Every call gets fresh connections, so each reads the files.
        ConnectionRecycling::after(Duration::from_secs(3600)).or_after_requests(1),
        |builder| builder.resolve("localhost", ([127, 0, 0, 1], 0).into()),
    )
    .unwrap();
    assert_eq!(
        whoami_from(&client, port).await,
        "spiffe://keel.local/orders/v1"
    );

    write_identity(dir.path(), &clients, "spiffe://keel.local/orders/v2");
    // The pool retires after one call: the next but one uses the new files.
    whoami_from(&client, port).await;
    assert_eq!(
        whoami_from(&client, port).await,
        "spiffe://keel.local/orders/v2"
    );

    // Broken files keep the last good identity, counted.
    std::fs::write(dir.path().join("me.pem"), "garbage").unwrap();
    for _ in 0..3 {
        assert_eq!(
            whoami_from(&client, port).await,
            "spiffe://keel.local/orders/v2"
        );
    }
    assert!(recorder.counter("keel_client_identity_reloads_total,outcome=failed") >= 2);
}

#[test]
fn files_that_do_not_load_are_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let err = PropagatingClient::with_identity(
        IdentityFiles::new(&missing, dir.path().join("key.pem")),
        ConnectionRecycling::default(),
        |builder| builder,
    )
    .unwrap_err();
    assert_eq!(err.path, missing);
}
