//! Streams end with a status, never a reset: at the deadline, and when the
//! server drains.

use std::time::Duration;

use keel_grpc::client::PropagationLayer;
use keel_lifecycle::Drain;
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;

use crate::support::{Server, ask};

#[tokio::test]
async fn a_stream_open_at_its_deadline_ends_with_deadline_exceeded() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let mut plain = HealthClient::new(server.channel().await);
    let mut request = ask("stream");
    request.set_timeout(Duration::from_millis(300));
    let mut stream = plain.watch(request).await.unwrap().into_inner();
    let mut messages = 0;
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => messages += 1,
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(messages >= 3, "messages before the deadline: {messages}");

    // The Keel client cuts a stream at its own deadline the same way.
    let mut keel = HealthClient::new(
        tower::ServiceBuilder::new()
            .layer(PropagationLayer::new())
            .service(server.channel().await),
    );
    let status = keel_core::Deadline::after(Duration::from_millis(300))
        .scope(async {
            let mut stream = keel.watch(ask("stream")).await?.into_inner();
            while stream.message().await?.is_some() {}
            Ok::<(), tonic::Status>(())
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
}

#[tokio::test]
async fn a_drain_ends_open_streams_resumably_and_the_server_stops_in_time() {
    let drain = Drain::builder()
        .lb_notice(Duration::from_millis(100))
        .drain_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let server = Server::start(Duration::from_secs(30), &drain).await;
    let mut client = HealthClient::new(server.channel().await);
    let mut streams = Vec::new();
    for _ in 0..3 {
        streams.push(client.watch(ask("stream")).await.unwrap().into_inner());
    }
    for stream in &mut streams {
        assert!(stream.message().await.unwrap().is_some());
    }

    drain.trigger();
    for stream in &mut streams {
        let status = loop {
            match stream.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => break status,
            }
        };
        // UNAVAILABLE: transient, the client reconnects and resumes.
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("resume"), "{}", status.message());
    }
    let stopped = tokio::time::timeout(Duration::from_secs(3), server.task).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "graceful shutdown finished well within the drain timeout: {stopped:?}"
    );
}
