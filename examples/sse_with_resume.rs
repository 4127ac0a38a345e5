//! Server-Sent Events with resume: a client that drops its connection and
//! comes back with `Last-Event-ID` gets exactly what it missed.
//!
//! Every event is first appended to the user's stream in the event log (a
//! seq per stream), and the SSE route only reads the log after a cursor.
//! The client (keel-client's `SseClient`, which also reconnects by itself
//! when a connection drops) reads two events and goes away, saving the id of
//! the last one; two more are published while it is away, and a new client
//! resumes from the saved id (`Last-Event-ID`): it receives the two it
//! missed, then a live one, with no gap and no duplicate.
//!
//! Run: `cargo run -p keel-examples --example sse_with_resume`

use std::time::Duration;

use axum::Router;
use axum::http::request::Parts;
use keel_client::{PropagatingClient, SseClient, SseEvent};
use keel_realtime::{EventLog, Realtime, StreamId};
use keel_sqlite::SqliteStore;

/// The next `count` events of `events`.
async fn take(events: &mut SseClient, count: usize) -> anyhow::Result<Vec<SseEvent>> {
    let mut taken = Vec::new();
    while taken.len() < count {
        taken.push(tokio::time::timeout(Duration::from_secs(5), events.next()).await??);
    }
    Ok(taken)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    let store = SqliteStore::open_in_memory().await?;
    let log = EventLog::new(store);
    // The application's auth says which stream a request may read; here a
    // header stands in for the session.
    let authenticate = |parts: &Parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?;
        StreamId::new(format!("user:{user}")).ok()
    };
    let realtime = Realtime::builder(log.clone(), authenticate).build()?;
    let app: Router = Router::new().route("/stream", realtime.sse());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/stream", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let stream = StreamId::new("user:42")?;
    let publish = |n: u32| {
        let (log, stream) = (log.clone(), stream.clone());
        async move {
            let data = serde_json::json!({"order": "A-4471", "update": n});
            log.publish(&stream, "order.updated", &data).await
        }
    };
    publish(1).await?;
    publish(2).await?;

    // The session header on every request of this client.
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("x-user", "42".parse()?);
    let client = PropagatingClient::new(
        reqwest::Client::builder()
            .default_headers(headers)
            .build()?,
    );
    let mut first = SseClient::builder(&client, url.parse()?).build();
    let seen = take(&mut first, 2).await?;
    println!("first connection: {seen:?}");
    // The client goes away (a train tunnel, a restart) and saves its place.
    let last_id = first.last_event_id().unwrap_or_default().to_owned();
    drop(first);

    publish(3).await?;
    publish(4).await?;
    let mut resumed = SseClient::builder(&client, url.parse()?)
        .last_event_id(&last_id)
        .build();
    let missed = take(&mut resumed, 2).await?;
    println!("resumed after {last_id}: {missed:?}");
    publish(5).await?;
    let live = take(&mut resumed, 1).await?;
    println!("live: {live:?}");

    let updates: Vec<&str> = seen
        .iter()
        .chain(&missed)
        .chain(&live)
        .map(|f| f.data.as_str())
        .collect();
    anyhow::ensure!(
        updates.len() == 5 && (1..=5).all(|n| updates[n - 1].contains(&format!("\"update\":{n}"))),
        "every update once, in order: {updates:?}"
    );
    println!("every update arrived once, in order");
    Ok(())
}

keel_examples::runs_to_the_end_test!();
