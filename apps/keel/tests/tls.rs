//! `keel serve` over HTTPS with a self-signed certificate from files: it
//! says `https://` when listening, answers an order and the probes over
//! TLS to a client that trusts the certificate (with HSTS, and `Secure`
//! session cookies), admits to the admin API only the client certificates
//! `--admin-peers` names, and refuses to start with a certificate it cannot
//! use.

mod common;

use std::process::Command;

use common::{order, serve};

fn self_signed(dir: &std::path::Path) -> (String, String, String) {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let pem = certified.cert.pem();
    std::fs::write(&cert, &pem).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let path = |p: std::path::PathBuf| p.to_str().unwrap().to_owned();
    (path(cert), path(key), pem)
}

#[tokio::test]
async fn serve_answers_https_with_the_configured_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, pem) = self_signed(dir.path());
    let s = serve(&["--tls-cert", &cert, "--tls-key", &key]);
    assert!(s.url.starts_with("https://127.0.0.1:"), "{}", s.url);
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap())
        .build()
        .unwrap();
    for probe in ["/livez", "/readyz"] {
        let r = client
            .get(format!("{}{probe}", s.url))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{probe}: {}", r.status());
        assert_eq!(
            r.headers()["strict-transport-security"],
            "max-age=31536000",
            "HSTS on every answer of Keel's own TLS"
        );
    }
    // No forwarded header says HTTPS, but the connection is: the session
    // cookie must not travel over plain HTTP later.
    let login = client
        .post(format!("{}/admin/api/login", s.url))
        .send()
        .await
        .unwrap();
    assert!(login.status().is_success(), "{}", login.status());
    let cookie = login.headers()["set-cookie"].to_str().unwrap();
    assert!(cookie.contains("; Secure"), "{cookie}");
    let r = client
        .post(format!("{}/orders", s.url))
        .header("idempotency-key", "tls-1")
        .json(&order("tls"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "an order over TLS: {}", r.status());
    let plain = s.url.replacen("https://", "http://", 1);
    assert!(
        reqwest::get(format!("{plain}/livez")).await.is_err(),
        "no plain HTTP on the TLS port"
    );
}

#[tokio::test]
async fn admin_peers_admit_only_the_named_client_certificates() {
    use keel_testkit::tls::{TestCa, dns, uri};

    let dir = tempfile::tempdir().unwrap();
    let (cert, key, pem) = self_signed(dir.path());
    let clients = TestCa::new("client ca");
    let ca = dir.path().join("clients.pem");
    std::fs::write(&ca, clients.pem()).unwrap();
    let s = serve(&[
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        ca.to_str().unwrap(),
        "--admin-peers",
        "spiffe://keel.local/ops,oncall.keel.local",
    ]);
    let client = |sans| {
        let builder = reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap());
        match sans {
            Some(sans) => {
                let (cert, key) = clients.client(sans);
                let identity = reqwest::Identity::from_pem(format!("{cert}{key}").as_bytes());
                builder.identity(identity.unwrap())
            }
            None => builder,
        }
        .build()
        .unwrap()
    };
    let summary = format!("{}/admin/api/summary", s.url);
    let anonymous = client(None);
    // Public routes stay open without a certificate...
    let r = anonymous
        .get(format!("{}/livez", s.url))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    // ...the admin API does not.
    for (who, caller, problem) in [
        ("anonymous", &anonymous, "client_certificate_required"),
        (
            "orders",
            &client(Some(vec![uri("spiffe://keel.local/orders")])),
            "peer_not_allowed",
        ),
    ] {
        let r = caller.get(&summary).send().await.unwrap();
        assert_eq!(r.status(), 403, "{who}");
        let body = r.text().await.unwrap();
        assert!(body.contains(problem), "{who}: {body}");
    }
    for sans in [
        vec![uri("spiffe://keel.local/ops")],
        vec![dns("oncall.keel.local")],
    ] {
        let r = client(Some(sans)).get(&summary).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
}

#[test]
fn a_certificate_it_cannot_use_is_refused_before_starting() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, _, _) = self_signed(dir.path());
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("KEEL_ADMIN_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success(), "serve {args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = refused(&["--tls-cert", &cert, "--tls-key", "/nonexistent/key.pem"]);
    assert!(said.contains("/nonexistent/key.pem"), "{said}");
    let said = refused(&["--tls-cert", &cert]);
    assert!(said.contains("tls-key"), "{said}");
    let said = refused(&["--admin-peers", "spiffe://keel.local/ops"]);
    assert!(said.contains("tls-client-ca"), "{said}");
}
