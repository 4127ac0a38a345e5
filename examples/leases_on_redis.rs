//! Leader election on a Redis the service already runs, fenced where the
//! work lands.
//!
//! Two processes (here, two tasks) campaign for the lease `nightly-report`
//! with keel-messaging's `LeaseLock`, on `keel_redis::RedisLeases`. One
//! wins and writes under its lease's fencing token; the other waits. When
//! the winner stops renewing (it is paused, or dies), its lease runs out
//! and the other takes over with a higher token, and from then on the
//! resource refuses the first one's writes even if it wakes up still
//! believing it leads: a Redis lease is a lease, not a lock, and the token
//! is what makes it safe.
//!
//! Run: `REDIS_URL=redis://127.0.0.1:6379 cargo run -p keel-examples
//! --example leases_on_redis` (its keys live under `keel-example:`).

use std::time::Duration;

use keel_messaging::fence::FenceGate;
use keel_messaging::lease::LeaseLock;
use keel_redis::RedisLeases;

async fn run(url: &str) -> anyhow::Result<()> {
    let prefix = format!("keel-example:{}:", keel_core::id::new_id().simple());
    let redis = RedisLeases::builder(url).key_prefix(prefix).build()?;
    let ttl = Duration::from_millis(500);
    let pod_a = LeaseLock::new(redis.clone(), "nightly-report", "pod-a", ttl);
    let pod_b = LeaseLock::new(redis, "nightly-report", "pod-b", ttl);
    // The resource the leader writes to keeps the newest token it saw.
    let report = FenceGate::new();

    let a = pod_a.try_acquire().await?.expect("the lease was free");
    report.admit(a.token())?;
    println!("pod-a leads with token {}", a.token().as_i64());
    assert!(pod_b.try_acquire().await?.is_none(), "one leader at a time");
    println!("pod-b waits: pod-a's lease is running");

    // pod-a stops renewing (a long GC pause); its lease runs out.
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let b = pod_b.try_acquire().await?.expect("the lease ran out");
    report.admit(b.token())?;
    println!("pod-b took over with token {}", b.token().as_i64());

    // pod-a wakes up and writes as if it still led: refused.
    let stale = report
        .admit(a.token())
        .expect_err("a deposed leader's write is refused");
    println!("pod-a's late write refused: {stale}");
    assert!(pod_a.renew(&a).await?.is_none(), "and pod-a learns it lost");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    run(&url).await
}

#[cfg(test)]
mod tests {
    use keel_testkit::services::{self, ServerLock, Service};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_to_the_end_on_the_test_server() {
        // Skipped without scripts/services.sh; in CI a missing server fails.
        let Some(url) = services::redis_url() else {
            return;
        };
        let _up = ServerLock::shared(Service::Redis);
        super::run(&url).await.expect("the example runs");
    }
}
