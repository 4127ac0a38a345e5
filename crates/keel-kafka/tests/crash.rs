//! The Kafka broker killed (`SIGKILL`: nothing flushed, nothing said to
//! clients) and started again while a publisher and a consumer run, on a
//! tansu of the test's own.

mod common;

use std::sync::Arc;

use parking_lot::Mutex;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_loses_and_duplicates_nothing() {
    let Some((broker, tansu)) = common::private_broker().await else {
        return;
    };
    let tansu = Arc::new(Mutex::new(tansu));
    let crash = {
        let tansu = tansu.clone();
        move || tansu.lock().crash()
    };
    let publish_errors =
        keel_testkit::broker_suite::an_outage_under_load_loses_nothing(Arc::new(broker), crash)
            .await;
    eprintln!("publish retries across the crash: {publish_errors}");
}
