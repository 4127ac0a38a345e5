//! Service-to-service identity over real TLS on loopback, with
//! certificates the test makes: a required client certificate refuses
//! strangers at the handshake, an optional one leaves public routes open
//! while an allow-list guards a route group by the peer's names, and a new
//! client CA is taken from its file without a restart.
#![cfg(all(feature = "tls", feature = "health"))]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use axum::extract::Extension;
use axum::routing::get;
use keel_http::health::{Drain, DrainServe};
use keel_http::tls::{
    ClientAuth, PeerIdentity, RequirePeerLayer, ServerTls, TlsFiles, TlsListener,
};
use keel_testkit::tls::{TestCa as Ca, dns, uri};
use rcgen::SanType;

const BILLING: &str = "spiffe://keel.local/billing";

/// The server's files, signed by the server CA, with `client_ca`'s PEM as
/// the CA clients are checked against.
struct ServerFiles {
    dir: tempfile::TempDir,
    server_ca: Ca,
}

impl ServerFiles {
    fn new(client_ca: &Ca) -> Self {
        let server_ca = Ca::new("server ca");
        let (cert, key) = server_ca.server(vec![dns("localhost")]);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cert.pem"), cert).unwrap();
        std::fs::write(dir.path().join("key.pem"), key).unwrap();
        std::fs::write(dir.path().join("clients.pem"), client_ca.pem()).unwrap();
        Self { dir, server_ca }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn files(&self, auth: ClientAuth) -> TlsFiles {
        TlsFiles::new(self.path("cert.pem"), self.path("key.pem"))
            .client_ca(self.path("clients.pem"), auth)
    }

    /// A client that trusts the server, presenting `identity` if any.
    fn client(&self, identity: Option<reqwest::Identity>) -> reqwest::Client {
        let root = reqwest::Certificate::from_pem(self.server_ca.pem().as_bytes()).unwrap();
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(root)
            .resolve("localhost", SocketAddr::from(([127, 0, 0, 1], 0)));
        if let Some(identity) = identity {
            builder = builder.identity(identity);
        }
        builder.build().unwrap()
    }
}

/// A client certificate of `ca` for `sans`, as reqwest presents it.
fn identity(ca: &Ca, sans: Vec<SanType>) -> reqwest::Identity {
    let (cert, key) = ca.client(sans);
    reqwest::Identity::from_pem(format!("{cert}{key}").as_bytes()).unwrap()
}

/// Who the server saw: the peer's names, or `anonymous`.
async fn whoami(peer: Option<Extension<PeerIdentity>>) -> String {
    match peer {
        Some(Extension(peer)) => [peer.uris(), peer.dns_names()].concat().join(","),
        None => "anonymous".to_owned(),
    }
}

/// `/whoami` open to every client that finished the handshake, `/admin`
/// only to billing, served by Keel's server over `tls`.
async fn serve(tls: impl Into<ServerTls>) -> u16 {
    let admin = Router::new()
        .route("/admin", get(|| async { "admin" }))
        .layer(RequirePeerLayer::new([BILLING, "ops.keel.local"]));
    let app = Router::new().route("/whoami", get(whoami)).merge(admin);
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let listener = TlsListener::new(tcp, tls.into());
    let drain = Drain::builder().build().unwrap();
    tokio::spawn(async move { drain.serve(listener, app).await });
    port
}

async fn get_text(
    client: &reqwest::Client,
    port: u16,
    path: &str,
) -> reqwest::Result<(u16, String)> {
    let response = client
        .get(format!("https://localhost:{port}{path}"))
        .send()
        .await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

#[tokio::test]
async fn a_required_client_certificate_keeps_strangers_out_at_the_handshake() {
    let clients = Ca::new("client ca");
    let stranger_ca = Ca::new("someone else's ca");
    let files = ServerFiles::new(&clients);
    let port = serve(files.files(ClientAuth::Required).load().unwrap()).await;

    let billing = files.client(Some(identity(&clients, vec![uri(BILLING)])));
    let (status, body) = get_text(&billing, port, "/whoami").await.unwrap();
    assert_eq!((status, body.as_str()), (200, BILLING));

    for (who, client) in [
        ("no certificate", files.client(None)),
        (
            "a certificate another CA signed",
            files.client(Some(identity(&stranger_ca, vec![uri(BILLING)]))),
        ),
    ] {
        let refused = get_text(&client, port, "/whoami").await;
        assert!(refused.is_err(), "{who} was let in: {refused:?}");
    }
}

#[tokio::test]
async fn an_allow_list_guards_a_route_group_by_the_peers_names() {
    let recorder = keel_testkit::metrics::MetricsRecorder::global();
    let clients = Ca::new("client ca");
    let files = ServerFiles::new(&clients);
    let port = serve(files.files(ClientAuth::Optional).load().unwrap()).await;

    let anonymous = files.client(None);
    let billing = files.client(Some(identity(&clients, vec![uri(BILLING)])));
    let ops = files.client(Some(identity(&clients, vec![dns("OPS.keel.local")])));
    let orders = files.client(Some(identity(
        &clients,
        vec![uri("spiffe://keel.local/orders"), dns("orders.keel.local")],
    )));

    // Public routes stay open to a client without a certificate.
    let (status, body) = get_text(&anonymous, port, "/whoami").await.unwrap();
    assert_eq!((status, body.as_str()), (200, "anonymous"));

    let (status, body) = get_text(&anonymous, port, "/admin").await.unwrap();
    assert_eq!(status, 403);
    assert!(
        body.contains("urn:keel:problem:client_certificate_required"),
        "{body}"
    );

    let (status, body) = get_text(&orders, port, "/admin").await.unwrap();
    assert_eq!(status, 403);
    assert!(body.contains("urn:keel:problem:peer_not_allowed"), "{body}");
    assert!(body.contains("spiffe://keel.local/orders"), "{body}");

    // By URI (a SPIFFE ID), and by DNS name whatever its case.
    assert_eq!(get_text(&billing, port, "/admin").await.unwrap().0, 200);
    assert_eq!(get_text(&ops, port, "/admin").await.unwrap().0, 200);
    assert_eq!(
        recorder.counter("keel_http_peer_refused_total,reason=peer_not_allowed"),
        1
    );
}

#[tokio::test]
async fn a_new_client_ca_is_taken_from_its_file_without_a_restart() {
    let recorder = keel_testkit::metrics::MetricsRecorder::global();
    let old_ca = Ca::new("old client ca");
    let new_ca = Ca::new("new client ca");
    let files = ServerFiles::new(&old_ca);
    let tls =
        ServerTls::watching(files.files(ClientAuth::Required), Duration::from_millis(50)).unwrap();
    let port = serve(tls.clone()).await;
    let old_client = files.client(Some(identity(&old_ca, vec![uri(BILLING)])));
    let new_client = files.client(Some(identity(&new_ca, vec![uri(BILLING)])));
    assert_eq!(get_text(&old_client, port, "/whoami").await.unwrap().0, 200);
    assert!(get_text(&new_client, port, "/whoami").await.is_err());

    // A broken file is refused and the last good configuration stays.
    std::fs::write(files.path("clients.pem"), "not a certificate").unwrap();
    assert!(tls.reload().is_err());
    assert_eq!(
        recorder.counter("keel_http_tls_reloads_total,outcome=failed"),
        1
    );
    let fresh_old_client = files.client(Some(identity(&old_ca, vec![uri(BILLING)])));
    assert_eq!(
        get_text(&fresh_old_client, port, "/whoami")
            .await
            .unwrap()
            .0,
        200
    );

    // The rotation: the watcher notices the new CA by itself.
    std::fs::write(files.path("clients.pem"), new_ca.pem()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = files.client(Some(identity(&new_ca, vec![uri(BILLING)])));
        if let Ok((200, _)) = get_text(&fresh, port, "/whoami").await {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new CA was never loaded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recorder.counter("keel_http_tls_reloads_total,outcome=ok") >= 1);
    let fresh_old_client = files.client(Some(identity(&old_ca, vec![uri(BILLING)])));
    assert!(
        get_text(&fresh_old_client, port, "/whoami").await.is_err(),
        "a client of the retired CA is refused on a new connection"
    );
}
