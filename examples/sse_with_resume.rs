//! Server-Sent Events with resume: a client that drops its connection and
//! comes back with `Last-Event-ID` gets exactly what it missed.
//!
//! Every event is first appended to the user's stream in the event log (a
//! seq per stream), and the SSE route only reads the log after a cursor.
//! The client reads two events, drops the connection (a train tunnel), two
//! more are published while it is away, and it reconnects with the id of
//! the last event it saw: it receives the two it missed, then a live one,
//! with no gap and no duplicate.
//!
//! Run: `cargo run -p keel-examples --example sse_with_resume`

use std::time::Duration;

use axum::Router;
use axum::http::request::Parts;
use keel_realtime::{EventLog, Realtime, StreamId};
use keel_sqlite::SqliteStore;

/// One SSE frame's `id` and `data`.
#[derive(Debug)]
struct Frame {
    id: String,
    data: String,
}

/// Reads frames from an SSE response until `count` events arrived.
async fn read_frames(response: &mut reqwest::Response, count: usize) -> anyhow::Result<Vec<Frame>> {
    let mut buffer = String::new();
    let mut frames = Vec::new();
    while frames.len() < count {
        let chunk = tokio::time::timeout(Duration::from_secs(5), response.chunk())
            .await??
            .ok_or_else(|| anyhow::anyhow!("the stream ended"))?;
        buffer.push_str(std::str::from_utf8(&chunk)?);
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
            };
            if let (Some(id), Some(data)) = (field("id:"), field("data:")) {
                frames.push(Frame { id, data });
            }
        }
    }
    Ok(frames)
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

    let client = reqwest::Client::new();
    let mut first = client.get(&url).header("x-user", "42").send().await?;
    let seen = read_frames(&mut first, 2).await?;
    println!("first connection: {seen:?}");
    drop(first);

    publish(3).await?;
    publish(4).await?;
    let last_id = &seen.last().expect("two frames").id;
    let mut resumed = client
        .get(&url)
        .header("x-user", "42")
        .header("last-event-id", last_id)
        .send()
        .await?;
    let missed = read_frames(&mut resumed, 2).await?;
    println!("resumed after {last_id}: {missed:?}");
    publish(5).await?;
    let live = read_frames(&mut resumed, 1).await?;
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

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_to_the_end() {
        super::run().await.expect("the example runs");
    }
}
