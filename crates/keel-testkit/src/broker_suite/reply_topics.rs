//! Request-reply's reply topics clean up after themselves: a requester that
//! crashes leaves its topic to the sweep, one that stops cleanly deletes it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keel_core::clock;
use keel_messaging::reply::{IncomingRequest, Request, Requester, Responder};
use keel_store::broker::{Broker, SubscribeOptions};
use tokio::sync::oneshot;

use super::support::{PATIENCE, unique_topic};

/// The reply topic expiry of the scenario.
const EXPIRY: Duration = Duration::from_secs(2);

/// A requester's listener, running until stopped or aborted.
struct Running {
    requester: Requester,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_requester(broker: Arc<dyn Broker>) -> Running {
    let listener = Requester::builder(broker)
        .default_timeout(Duration::from_millis(1500))
        .poll_wait(Duration::from_millis(100))
        .reply_topic_expiry(EXPIRY)
        .build()
        .await
        .expect("build a requester");
    let requester = listener.requester();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(listener.run(async {
        let _ = stopped.await;
    }));
    Running {
        requester,
        stop,
        task,
    }
}

async fn call(requester: &Requester, topic: &str) {
    let reply = requester
        .call(Request::new(topic, "sku-1"))
        .await
        .expect("a reply");
    assert_eq!(reply.payload, Bytes::from_static(b"quote"));
}

/// A requester process crashes (its listener task aborted: no clean
/// shutdown) and restarts: after the expiry the broker holds only the new
/// process's reply topic, and once that one stops cleanly, none.
/// `reply_topics` lists the reply topics the broker still holds, by name
/// (as the backend stores them: topic rows, streams).
pub async fn a_restarted_requester_leaves_nothing_behind<B, F, Fut>(broker: B, reply_topics: F)
where
    B: Broker,
    F: Fn() -> Fut,
    Fut: Future<Output = Vec<String>>,
{
    let broker: Arc<dyn Broker> = Arc::new(broker);
    let topic = unique_topic("pricing");
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new(&topic, "pricing"))
        .build(|_req: IncomingRequest| async {
            Ok::<_, std::io::Error>(Bytes::from_static(b"quote"))
        });
    let (stop_responder, responder_stopped) = oneshot::channel::<()>();
    let responder = tokio::spawn(responder.run(async {
        let _ = responder_stopped.await;
    }));

    let crashed = start_requester(broker.clone()).await;
    call(&crashed.requester, &topic).await;
    let crashed_topic = crashed.requester.reply_topic().to_owned();
    crashed.task.abort();
    let _ = crashed.task.await;
    assert!(
        reply_topics().await.contains(&crashed_topic),
        "a crashed requester's topic waits for its expiry"
    );

    let restarted = start_requester(broker.clone()).await;
    call(&restarted.requester, &topic).await;
    let live = vec![restarted.requester.reply_topic().to_owned()];
    let deadline = clock::now() + PATIENCE * 3;
    loop {
        let left = reply_topics().await;
        if left == live {
            break;
        }
        assert!(
            clock::now() < deadline,
            "reply topics left behind: {left:?}"
        );
        tokio::time::sleep(EXPIRY / 4).await;
    }
    call(&restarted.requester, &topic).await;

    let _ = restarted.stop.send(());
    restarted.task.await.expect("the listener stopped");
    assert_eq!(
        reply_topics().await,
        Vec::<String>::new(),
        "a clean shutdown deletes its reply topic"
    );
    let _ = stop_responder.send(());
    responder
        .await
        .expect("the responder stopped")
        .expect("ran");
}
