//! Leader election on etcd, fenced where the work lands.
//!
//! Two processes (here, two tasks) campaign in one election with
//! `keel_etcd::EtcdElection`. One leads and writes under its fencing token
//! (its leader key's create revision); the other's campaign waits. The
//! leader resigns, the other wins with a higher token, and from then on the
//! resource refuses the first one's writes: a late write from a deposed
//! leader changes nothing.
//!
//! Run: `ETCD_URL=http://127.0.0.1:2379 cargo run -p keel-examples
//! --example election_on_etcd` (its election is named `keel-example/...`).

use std::time::Duration;

use keel_etcd::EtcdElection;
use keel_messaging::fence::{FenceGate, FencingToken};

async fn run(url: &str) -> anyhow::Result<()> {
    let name = format!("keel-example/{}", keel_core::id::new_id().simple());
    let election = EtcdElection::builder([url], name)
        .ttl(Duration::from_secs(2))
        .build()
        .await?;
    // The resource the leader writes to keeps the newest token it saw.
    let report = FenceGate::new();

    let a = election.campaign("pod-a").await?;
    let a_token = FencingToken::new(a.token());
    report.admit(a_token)?;
    println!("pod-a leads with token {}", a.token());

    let contender = election.clone();
    let b = tokio::spawn(async move { contender.campaign("pod-b").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b.is_finished(), "pod-b waits while pod-a leads");
    println!("pod-b's campaign waits");

    a.resign().await?;
    let b = b.await??;
    report.admit(FencingToken::new(b.token()))?;
    println!("pod-a resigned; pod-b leads with token {}", b.token());

    let stale = report
        .admit(a_token)
        .expect_err("a deposed leader's write is refused");
    println!("pod-a's late write refused: {stale}");
    b.resign().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("ETCD_URL").unwrap_or_else(|_| "http://127.0.0.1:2379".into());
    run(&url).await
}

#[cfg(test)]
mod tests {
    use keel_testkit::services::{self, ServerLock, Service};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_to_the_end_on_the_test_server() {
        // Skipped without scripts/services.sh; in CI a missing server fails.
        let Some(url) = services::etcd_url() else {
            return;
        };
        let _up = ServerLock::shared(Service::Etcd);
        super::run(&url).await.expect("the example runs");
    }
}
