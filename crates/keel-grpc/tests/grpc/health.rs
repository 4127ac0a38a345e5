//! `grpc.health.v1` follows Keel's readiness and drain; reflection lists it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_grpc::health::GrpcHealth;
use keel_lifecycle::{Drain, Health};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test]
async fn health_follows_readiness_and_turns_not_serving_the_moment_the_drain_starts() {
    let drain = Drain::builder()
        .lb_notice(Duration::from_secs(30))
        .build()
        .unwrap();
    let store_up = Arc::new(AtomicBool::new(true));
    let up = Arc::clone(&store_up);
    let health = Health::builder()
        .drain(&drain)
        .ready_check("store", move || {
            let up = up.load(Ordering::SeqCst);
            async move { if up { Ok(()) } else { Err("store down") } }
        })
        .build()
        .unwrap();
    let (service, task) = GrpcHealth::new(&health)
        .service("shipping.v1.Shipping")
        .check_every(Duration::from_millis(50))
        .start()
        .await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reflection = keel_grpc::reflection::reflection_service(&[]).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .add_service(reflection)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel.clone());
    let status = |name: &str| {
        let mut client = client.clone();
        let request = HealthCheckRequest {
            service: name.to_owned(),
        };
        async move { client.check(request).await.unwrap().into_inner().status() }
    };
    assert_eq!(status("").await, ServingStatus::Serving);
    assert_eq!(status("shipping.v1.Shipping").await, ServingStatus::Serving);

    store_up.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(status("").await, ServingStatus::NotServing);
    store_up.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(status("shipping.v1.Shipping").await, ServingStatus::Serving);

    drain.trigger();
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .expect("the health task saw the drain at once")
        .unwrap();
    assert_eq!(status("").await, ServingStatus::NotServing);
    assert_eq!(
        status("shipping.v1.Shipping").await,
        ServingStatus::NotServing
    );
    let unknown = client
        .check(HealthCheckRequest {
            service: "nobody.v1.Nothing".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // Reflection lists the services a generic tool can call.
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("not a service list");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
}
