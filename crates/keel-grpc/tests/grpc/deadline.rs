//! The deadline on the wire: sent, tightened, enforced on both sides, and
//! bad metadata refused or ignored without a panic.

use std::time::Duration;

use keel_core::{Deadline, TraceParent};
use keel_grpc::client::PropagationLayer;
use keel_lifecycle::Drain;
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;

use crate::support::{Server, ask};

fn remaining_ms(response: &tonic::Response<tonic_health::pb::HealthCheckResponse>) -> u64 {
    response
        .metadata()
        .get("x-remaining-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn the_callers_deadline_crosses_the_wire_and_the_server_sees_it_tightened() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let channel = tower::ServiceBuilder::new()
        .layer(PropagationLayer::new())
        .service(server.channel().await);
    let mut client = HealthClient::new(channel);

    let caller = TraceParent::new_root();
    let vendors = keel_core::trace::TraceState::from_values(["rojo=00f067aa0ba902b7"])
        .unwrap()
        .unwrap();
    let response =
        caller
            .scope(vendors.scope(
                Deadline::after(Duration::from_millis(800)).scope(client.check(ask("echo"))),
            ))
            .await
            .unwrap();
    assert_eq!(
        response.metadata().get("x-tracestate").unwrap(),
        "rojo=00f067aa0ba902b7",
        "the tracestate crossed the wire"
    );
    let left = remaining_ms(&response);
    assert!((500..800).contains(&left), "the server saw {left} ms left");
    assert_eq!(
        response.metadata().get("x-trace-id").unwrap(),
        caller.trace_id_hex().as_str(),
        "the handler ran in the caller's trace"
    );

    // Without a deadline in scope the server's cap applies.
    let response = client.check(ask("echo")).await.unwrap();
    assert!(remaining_ms(&response) > 9_000);
}

#[tokio::test]
async fn a_slow_handler_is_deadline_exceeded_for_a_plain_client_and_a_keel_one() {
    // Any gRPC client: the server's cap (100 ms) is tighter than the
    // caller's 1 s, so the server's answer is what the caller reads (a
    // plain tonic client's own timer says CANCELLED).
    let capped = Server::start(Duration::from_millis(100), &Drain::new()).await;
    let mut plain = HealthClient::new(capped.channel().await);
    let mut request = ask("slow");
    request.set_timeout(Duration::from_secs(1));
    let status = plain.check(request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("deadline passed"),
        "{}",
        status.message()
    );

    // A Keel client, from the deadline in scope: whichever side's timer
    // ends the call, the caller reads DEADLINE_EXCEEDED.
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let mut keel = HealthClient::new(
        tower::ServiceBuilder::new()
            .layer(PropagationLayer::new())
            .service(server.channel().await),
    );
    for _ in 0..5 {
        let status = Deadline::after(Duration::from_millis(150))
            .scope(keel.check(ask("slow")))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    }

    // The servers dropped the handlers rather than finishing late work.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(capped.calls() + server.calls(), 6);
    assert_eq!(
        capped.finished() + server.finished(),
        0,
        "late work was abandoned"
    );
}

#[tokio::test]
async fn too_little_time_is_refused_before_the_work_starts() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let mut plain = HealthClient::new(server.channel().await);

    let mut request = ask("needs-50ms");
    request.set_timeout(Duration::from_millis(30));
    let status = plain.check(request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(
        status.message().contains("not started"),
        "{}",
        status.message()
    );
    assert_eq!(server.finished(), 0);

    let mut request = ask("needs-50ms");
    request.set_timeout(Duration::from_secs(1));
    plain.check(request).await.unwrap();
    assert_eq!(server.finished(), 1);

    // The Keel client does not even send with less than 50 ms left.
    let mut keel = HealthClient::new(
        tower::ServiceBuilder::new()
            .layer(PropagationLayer::new())
            .service(server.channel().await),
    );
    let status = Deadline::after(Duration::from_millis(20))
        .scope(keel.check(ask("echo")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(server.calls(), 2, "nothing was sent");
}

#[tokio::test]
async fn bad_metadata_is_refused_or_ignored_never_a_panic() {
    let server = Server::start(Duration::from_secs(5), &Drain::new()).await;
    let mut plain = HealthClient::new(server.channel().await);

    for bad in ["soon", "1x", "123456789S", "-5m", ""] {
        let mut request = ask("echo");
        request
            .metadata_mut()
            .insert("grpc-timeout", bad.parse().unwrap());
        let status = plain.check(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}: {status:?}");
        assert!(
            status.message().contains("grpc-timeout"),
            "{bad:?}: {}",
            status.message()
        );
    }
    assert_eq!(server.calls(), 0, "no handler ran on a malformed timeout");

    // Absurd but well-formed: capped at the server's maximum.
    let mut request = ask("echo");
    request
        .metadata_mut()
        .insert("grpc-timeout", "99999999H".parse().unwrap());
    let response = plain.check(request).await.unwrap();
    assert!(remaining_ms(&response) <= 5_000);

    // A malformed traceparent starts a new trace; the call succeeds.
    let mut request = ask("echo");
    request
        .metadata_mut()
        .insert("traceparent", "00-not-a-trace-01".parse().unwrap());
    let response = plain.check(request).await.unwrap();
    let trace = response
        .metadata()
        .get("x-trace-id")
        .unwrap()
        .to_str()
        .unwrap();
    assert_eq!(trace.len(), 32);
}
