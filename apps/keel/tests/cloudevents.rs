//! Keel's events read by the official CloudEvents SDK: webhooks in
//! structured and binary mode (an endpoint's `format`), signed as Standard
//! Webhooks in every format, and the event log as a CloudEvents batch (long
//! poll) and as CloudEvents in an SSE stream, all from a real `keel serve`.

mod common;

use axum::body::Bytes;
use axum::http::HeaderMap;
use cloudevents::{AttributesReader, Data, Event};
use common::{ACME_KEY, Received, Server, eventually, ok_receiver, order, placed_id, serve};
use keel_webhooks::WebhookReceiver;
use keel_webhooks::signing::Secret;
use serde_json::{Value, json};

/// Registers an endpoint in `format`; returns its signing secret.
async fn endpoint(http: &reqwest::Client, s: &Server, url: &str, format: &str) -> Secret {
    let created: Value = http
        .post(format!("{}/webhook-endpoints", s.url))
        .bearer_auth(ACME_KEY)
        .json(&json!({"url": url, "format": format, "eventTypes": ["order.completed"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(created["format"], format);
    Secret::parse(created["secret"].as_str().unwrap()).unwrap()
}

/// The first request `received` got, once it got one, checked against the
/// Standard Webhooks signature of `secret`.
async fn first_signed(received: &Received, secret: &Secret) -> (HeaderMap, Bytes) {
    eventually("a delivery", || async { !received.lock().is_empty() }).await;
    let (headers, body) = received.lock()[0].clone();
    WebhookReceiver::new([secret.clone()])
        .verify(&headers, &body)
        .expect("signed as Standard Webhooks over the body sent");
    (headers, body)
}

fn data(event: &Event) -> Value {
    match event.data() {
        Some(Data::Json(json)) => json.clone(),
        Some(Data::Binary(bytes)) => serde_json::from_slice(bytes).unwrap(),
        Some(Data::String(text)) => serde_json::from_str(text).unwrap(),
        None => Value::Null,
    }
}

fn assert_order_completed(event: &Event, order: &str) {
    assert_eq!(event.ty(), "order.completed");
    assert_eq!(event.source().to_string(), "/keel/shop/orders");
    assert_eq!(event.id(), format!("{order}:completed"));
    assert!(event.time().is_some(), "time is set");
    assert_eq!(data(event)["orderId"], order);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_in_every_format_and_the_event_log_read_as_cloudevents_by_the_sdk() {
    let s = serve(&["--allow-loopback-webhooks"]);
    let http = reqwest::Client::new();
    let (standard_url, standard) = ok_receiver().await;
    let (structured_url, structured) = ok_receiver().await;
    let (binary_url, binary) = ok_receiver().await;
    let standard_secret = endpoint(&http, &s, &standard_url, "standard-webhooks").await;
    let structured_secret = endpoint(&http, &s, &structured_url, "cloudevents-structured").await;
    let binary_secret = endpoint(&http, &s, &binary_url, "cloudevents-binary").await;

    let order = placed_id(&http, &s, "ce-1", &order("ce")).await;

    let (headers, body) = first_signed(&standard, &standard_secret).await;
    assert_eq!(headers["content-type"], "application/json");
    let plain: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(plain["type"], "order.completed");
    assert_eq!(plain["data"]["orderId"], order);
    assert!(plain["timestamp"].as_str().is_some());

    let (headers, body) = first_signed(&structured, &structured_secret).await;
    assert_eq!(headers["content-type"], "application/cloudevents+json");
    let event = cloudevents::binding::http::to_event(&headers, body.to_vec())
        .expect("the SDK reads structured mode");
    assert_order_completed(&event, &order);

    let (headers, body) = first_signed(&binary, &binary_secret).await;
    assert!(headers.contains_key("ce-id"), "attributes are headers");
    let event = cloudevents::binding::http::to_event(&headers, body.to_vec())
        .expect("the SDK reads binary mode");
    assert_order_completed(&event, &order);

    // The event log: a long poll's batch, and an SSE stream.
    let polled = http
        .get(format!("{}/updates?customerId=ce&after=0", s.url))
        .header("accept", "application/cloudevents-batch+json")
        .send()
        .await
        .unwrap();
    assert_eq!(
        polled.headers()["content-type"],
        "application/cloudevents-batch+json"
    );
    let cursor = polled.headers()["keel-cursor"].to_str().unwrap().to_owned();
    let batch: Vec<Event> = polled.json().await.expect("the SDK reads a batch");
    assert_eq!(batch[0].ty(), "order.placed");
    assert_eq!(batch[0].id(), "customer:ce/1");
    assert_eq!(data(&batch[0])["orderId"], order);
    assert_eq!(cursor, batch.len().to_string());

    let mut stream = http
        .get(format!("{}/stream?customerId=ce&format=cloudevents", s.url))
        .send()
        .await
        .unwrap();
    let mut text = String::new();
    let line = loop {
        let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&chunk));
        // A whole `data:` line, not one cut at a chunk's end.
        if let Some(start) = text.find("data: ")
            && let Some(len) = text[start..].find('\n')
        {
            break text[start + "data: ".len()..start + len].to_owned();
        }
    };
    let event: Event = serde_json::from_str(&line).expect("the SDK reads an SSE event");
    assert_eq!(event.id(), "customer:ce/1");
    assert_eq!(event.ty(), "order.placed");
}

/// "Fetch, don't trust": a thin endpoint gets the signed event with `data`
/// cut to its ids, nothing of the order itself, and fetches the order from
/// the API by its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thin_endpoint_gets_ids_only_and_fetches_the_order() {
    let s = serve(&["--allow-loopback-webhooks"]);
    let http = reqwest::Client::new();
    let (url, received) = ok_receiver().await;
    let secret = endpoint(&http, &s, &url, "standard-webhooks-thin").await;
    let placed = placed_id(&http, &s, "thin-1", &order("thin")).await;
    let (headers, body) = first_signed(&received, &secret).await;
    assert_eq!(headers["content-type"], "application/json");
    let thin: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(thin["type"], "order.completed");
    let data = thin["data"].as_object().unwrap();
    assert!(
        data.keys()
            .all(|k| k == "id" || k.ends_with("Id") || k.ends_with("_id")),
        "ids only: {data:?}"
    );
    let order_id = data["orderId"].as_str().unwrap();
    assert_eq!(order_id, placed);
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("tea") && !text.contains("900"),
        "no item, no amount: {text}"
    );
    let fetched: Value = http
        .get(format!("{}/orders/{order_id}", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        fetched["status"], "completed",
        "the receiver fetches the current state"
    );
    assert_eq!(fetched["totalCents"], 900);
}
