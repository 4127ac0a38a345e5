//! The shipping service over loopback with tonic's client: resume without
//! gap or duplicate, the client stream's summary, acknowledgements both
//! ways, and refusals with the codes a client of any language can act on.

use std::time::Duration;

use keel_sqlite::SqliteStore;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Code;
use tonic::transport::Channel;

use super::pb::shipping_client::ShippingClient;
use super::pb::{
    ClientMsg, CreateShipmentRequest, EventAck, GetShipmentRequest, Scan, ShipmentEvent,
    WatchShipmentRequest, client_msg, server_msg, shipment,
};
use super::{CourierPace, GrpcAccess, ShippingService, serve};
use crate::shop::db::ShopDb;

struct Running {
    client: ShippingClient<Channel>,
    store: SqliteStore,
    _stop: watch::Sender<bool>,
}

async fn start(pace: CourierPace) -> Running {
    start_with(pace, GrpcAccess::default()).await.0
}

async fn start_with(pace: CourierPace, access: GrpcAccess) -> (Running, std::net::SocketAddr) {
    let store = SqliteStore::open_in_memory().await.expect("store");
    store.migrate_shop().await.expect("shop tables");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (stop, stopped) = watch::channel(false);
    let addr = serve(
        listener,
        ShippingService::new(store.clone(), pace),
        access,
        stopped,
    )
    .await
    .expect("serve");
    let client = ShippingClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let running = Running {
        client,
        store,
        _stop: stop,
    };
    (running, addr)
}

fn create(order: &str, key: &str) -> CreateShipmentRequest {
    CreateShipmentRequest {
        order_id: order.to_owned(),
        request_id: key.to_owned(),
    }
}

fn scan(shipment: &str, id: &str) -> Scan {
    Scan {
        shipment_id: shipment.to_owned(),
        scan_id: id.to_owned(),
        location: format!("depot {id}"),
    }
}

/// Ships `order` under its saga step's key; the shipment's id.
async fn ship(client: &mut ShippingClient<Channel>, order: &str) -> String {
    client
        .create_shipment(create(order, &format!("{order}:schedule_shipment")))
        .await
        .unwrap()
        .into_inner()
        .id
}

/// A shipment for `order`, and a `Sync` call open on it: the sender of
/// client messages and the server's stream.
async fn shipment_in_sync(
    client: &mut ShippingClient<Channel>,
    order: &str,
) -> (
    String,
    tokio::sync::mpsc::Sender<ClientMsg>,
    tonic::Streaming<super::pb::ServerMsg>,
) {
    let id = ship(client, order).await;
    let (send, outgoing) = tokio::sync::mpsc::channel(8);
    let incoming = client
        .sync(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .unwrap()
        .into_inner();
    (id, send, incoming)
}

const SLOW: CourierPace = CourierPace {
    to_transit: Duration::from_millis(100),
    to_delivered: Duration::from_millis(600),
};

#[tokio::test]
async fn a_watch_dropped_mid_way_resumes_after_the_last_sequence_seen() {
    let Running {
        mut client, _stop, ..
    } = start(SLOW).await;
    let shipment = client
        .create_shipment(create("o-1", "o-1:schedule_shipment"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(shipment.status(), shipment::Status::Picked);

    let watch = |after| WatchShipmentRequest {
        id: shipment.id.clone(),
        after_sequence: after,
    };
    let mut seen: Vec<ShipmentEvent> = Vec::new();
    let mut first = client.watch_shipment(watch(0)).await.unwrap().into_inner();
    while seen.len() < 2 {
        seen.push(first.message().await.unwrap().expect("an event"));
    }
    drop(first);
    // Events happen while nobody watches.
    let scans = tokio_stream::iter(vec![scan(&shipment.id, "s-1"), scan(&shipment.id, "s-2")]);
    client.upload_scans(scans).await.unwrap();

    let last = seen.last().unwrap().sequence;
    let mut resumed = client
        .watch_shipment(watch(last))
        .await
        .unwrap()
        .into_inner();
    while let Some(event) = resumed.message().await.unwrap() {
        seen.push(event);
    }
    let sequences: Vec<u64> = seen.iter().map(|e| e.sequence).collect();
    let expected: Vec<u64> = (1..=sequences.len() as u64).collect();
    assert_eq!(sequences, expected, "no gap, no duplicate");
    assert_eq!(seen.len(), 5, "picked, in transit, two scans, delivered");
    assert_eq!(seen.last().unwrap().status(), shipment::Status::Delivered);
    assert!(
        seen.iter()
            .all(|e| e.status() != shipment::Status::Unspecified)
    );
    let now = client
        .get_shipment(GetShipmentRequest {
            id: shipment.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(now.last_sequence, 5);

    // A watch of a delivered shipment replays and ends at once.
    let mut again = client.watch_shipment(watch(3)).await.unwrap().into_inner();
    assert_eq!(again.message().await.unwrap().unwrap().sequence, 4);
    assert_eq!(again.message().await.unwrap().unwrap().sequence, 5);
    assert!(again.message().await.unwrap().is_none());
}

#[tokio::test]
async fn uploaded_scans_are_summarised_once_the_client_stream_ends() {
    let Running {
        mut client, _stop, ..
    } = start(SLOW).await;
    let id = ship(&mut client, "o-2").await;
    let scans = vec![
        scan(&id, "a"),
        scan(&id, "b"),
        scan(&id, "a"),
        scan("shp-nobody", "c"),
        scan(&id, ""),
    ];
    let summary = client
        .upload_scans(tokio_stream::iter(scans))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            summary.received,
            summary.applied,
            summary.duplicates,
            summary.refused
        ),
        (5, 2, 1, 2)
    );
}

#[tokio::test]
async fn sync_acknowledges_every_scan_and_sends_the_events_they_made() {
    let Running {
        mut client, _stop, ..
    } = start(SLOW).await;
    let (id, send, mut incoming) = shipment_in_sync(&mut client, "o-3").await;
    let message = |kind| ClientMsg { kind: Some(kind) };
    send.send(message(client_msg::Kind::Scan(scan(&id, "x-1"))))
        .await
        .unwrap();
    send.send(message(client_msg::Kind::Scan(scan(&id, "x-1"))))
        .await
        .unwrap();
    let mut acks = Vec::new();
    let mut events = Vec::new();
    while acks.len() < 2 {
        match incoming.message().await.unwrap().unwrap().kind.unwrap() {
            server_msg::Kind::ScanAck(ack) => acks.push((ack.scan_id, ack.applied)),
            server_msg::Kind::Event(event) => {
                send.send(message(client_msg::Kind::Ack(EventAck {
                    shipment_id: event.shipment_id.clone(),
                    sequence: event.sequence,
                })))
                .await
                .unwrap();
                events.push(event);
            }
        }
    }
    assert_eq!(
        acks,
        vec![("x-1".to_owned(), true), ("x-1".to_owned(), false)],
        "the duplicate is acknowledged too, so the client stops sending it"
    );
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].location, "depot x-1");
    drop(send);
    assert!(
        incoming.message().await.unwrap().is_none(),
        "ends with the client"
    );
}

#[tokio::test]
async fn creating_twice_ships_once_and_bad_calls_get_their_codes() {
    let Running {
        mut client,
        store,
        _stop,
    } = start(CourierPace::default()).await;
    let first = client
        .create_shipment(create("o-4", "o-4:schedule_shipment"))
        .await
        .unwrap()
        .into_inner();
    let again = client
        .create_shipment(create("o-4", "o-4:schedule_shipment"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.id, again.id);
    assert_eq!(again.last_sequence, 1, "nothing scheduled twice");
    let audit = store.audit().await.unwrap();
    let shipped = audit
        .effects
        .iter()
        .filter(|e| e.order_id == "o-4" && e.step == "schedule_shipment")
        .count();
    assert_eq!(shipped, 1);

    let refused = client.create_shipment(create("", "k")).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    let mut late = tonic::Request::new(create("o-5", "o-5:schedule_shipment"));
    late.set_timeout(Duration::from_millis(20));
    let refused = client.create_shipment(late).await.unwrap_err();
    assert_eq!(refused.code(), Code::DeadlineExceeded, "{refused:?}");
    let missing = client
        .get_shipment(GetShipmentRequest {
            id: "shp-nobody".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let nothing = client
        .watch_shipment(WatchShipmentRequest {
            id: String::new(),
            after_sequence: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(nothing.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn stopping_shipping_ends_open_streams_with_a_status_to_resume_from() {
    let Running {
        mut client, _stop, ..
    } = start(SLOW).await;
    let (id, send, mut incoming) = shipment_in_sync(&mut client, "o-6").await;
    send.send(ClientMsg {
        kind: Some(client_msg::Kind::Scan(scan(&id, "y-1"))),
    })
    .await
    .unwrap();
    assert!(incoming.message().await.unwrap().is_some());

    _stop.send(true).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match incoming.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the open stream ended promptly");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    drop(send);
}

#[tokio::test]
async fn a_watch_resumed_at_the_delivery_ends_at_once() {
    let fast = CourierPace {
        to_transit: Duration::from_millis(10),
        to_delivered: Duration::from_millis(10),
    };
    let Running {
        mut client, _stop, ..
    } = start(fast).await;
    let id = ship(&mut client, "o-7").await;
    let delivered = loop {
        let now = client
            .get_shipment(GetShipmentRequest { id: id.clone() })
            .await
            .unwrap()
            .into_inner();
        if now.status() == shipment::Status::Delivered {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for after in [delivered.last_sequence, delivered.last_sequence + 5] {
        let mut stream = client
            .watch_shipment(WatchShipmentRequest {
                id: id.clone(),
                after_sequence: after,
            })
            .await
            .unwrap()
            .into_inner();
        let end = tokio::time::timeout(Duration::from_secs(1), stream.message()).await;
        assert!(
            matches!(end, Ok(Ok(None))),
            "after {after}: nothing more will come, so the stream ends: {end:?}"
        );
    }
}

#[tokio::test]
async fn without_the_token_shipping_answers_unauthenticated_and_health_still_answers() {
    let access = GrpcAccess {
        token: Some("grpc-token-grpc-token".to_owned()),
        ..GrpcAccess::default()
    };
    let (mut running, addr) = start_with(CourierPace::default(), access).await;
    let refused = running
        .client
        .create_shipment(create("o-auth", "k-auth"))
        .await
        .expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let mut request = tonic::Request::new(create("o-auth", "k-auth"));
    request.metadata_mut().insert(
        "authorization",
        "Bearer grpc-token-grpc-token".parse().unwrap(),
    );
    running
        .client
        .create_shipment(request)
        .await
        .expect("with the token");
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("probes carry no token");
    assert_eq!(status.into_inner().status, 1, "SERVING");
}

#[tokio::test]
async fn silent_connections_and_an_address_past_its_share_are_closed() {
    use tokio::io::AsyncReadExt;
    let access = GrpcAccess {
        limits: keel_http::health::ConnectionLimits::new()
            .header_read_timeout(std::time::Duration::from_millis(500))
            .max_connections(8)
            .max_connections_per_address(3),
        ..GrpcAccess::default()
    };
    // The test's own client holds one of the address's three.
    let (_running, addr) = start_with(CourierPace::default(), access).await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let closed = |mut stream: tokio::net::TcpStream, within: u64| async move {
        let mut buf = [0u8; 64];
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(within);
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0) | Err(_)) => return true,
                // The server's settings frame: keep reading.
                Ok(Ok(_)) => {}
            }
        }
    };
    let past_share = silent.pop().unwrap();
    assert!(
        closed(past_share, 300).await,
        "past the address's share: closed at once"
    );
    for stream in silent {
        assert!(
            closed(stream, 3_000).await,
            "no preface within 500 ms: closed"
        );
    }
}
