//! A claim check on S3: a 12 MiB document travels as a claim of a few
//! hundred bytes, comes back verified, and outlives the broker's retention.
//!
//! The producer's envelope would be far over the broker's size limit, so
//! `check_in` puts its data in the bucket (in parts, above 8 MiB) and the
//! message carries only the claim: where, how big, and its SHA-256. The
//! consumer's `check_out` fetches it and refuses anything that does not
//! match. The sweeper deletes old objects, but never one a message still on
//! the broker may claim (`outliving` the broker's retention).
//!
//! Run: `AWS_ENDPOINT=http://127.0.0.1:9000 AWS_ALLOW_HTTP=true
//! AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=us-east-1
//! S3_BUCKET=s3://my-bucket cargo run -p keel-examples --example
//! claim_check_on_s3` (objects go under a fresh folder of the bucket).

use std::time::Duration;

use keel_messaging::broker::MessageRetention;
use keel_messaging::claim_check::ClaimCheck;
use keel_store::envelope::Envelope;

async fn run(bucket: &str, options: &[(&str, &str)]) -> anyhow::Result<()> {
    let folder = format!("{bucket}/keel-example-{}", keel_core::id::new_id().simple());
    let week = MessageRetention::For(Duration::from_secs(7 * 86_400));
    let claims = ClaimCheck::s3(&folder, options.iter().map(|(k, v)| (*k, v.to_string())))?
        // A claim stays fetchable while the broker keeps its message, and
        // an hour more for a relay that was behind.
        .outliving(week, Duration::from_secs(3_600));

    let scan = "x".repeat(12 << 20);
    let mut envelope = Envelope::new("/services/scanner", "scans.completed.v1");
    envelope.data = Some(serde_json::json!({ "pages": scan }));
    let sent = claims.check_in(envelope).await?;
    let claim = serde_json::to_string(sent.data.as_ref().expect("the claim"))?;
    println!("on the broker: a claim of {} bytes: {claim}", claim.len());
    assert!(
        claim.len() < 512,
        "the message carries the claim, not the bytes"
    );

    let received = claims.check_out(sent).await?;
    let pages = received.data.as_ref().and_then(|d| d["pages"].as_str());
    assert_eq!(pages.map(str::len), Some(12 << 20));
    println!("the consumer got the 12 MiB back, its SHA-256 checked");

    // A sweep told to delete everything keeps what the broker may still hold.
    let everything = keel_core::clock::utc_now() + chrono::Duration::hours(1);
    let swept = claims.sweep(everything).await?;
    assert_eq!(swept, 0);
    println!("a sweep of everything deleted {swept}: the message may still be on the broker");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let bucket = std::env::var("S3_BUCKET").unwrap_or_else(|_| "s3://keel".into());
    run(&bucket, &[]).await
}

#[cfg(test)]
mod tests {
    use keel_testkit::services::{self, ServerLock, Service};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_to_the_end_on_the_test_server() {
        // Skipped without scripts/services.sh; in CI a missing server fails.
        let Some(endpoint) = services::s3_url() else {
            return;
        };
        let _up = ServerLock::shared(Service::S3);
        let options = [
            ("aws_endpoint", endpoint.as_str()),
            ("aws_allow_http", "true"),
            ("aws_region", "us-east-1"),
            ("aws_access_key_id", "keel"),
            ("aws_secret_access_key", "keel"),
        ];
        super::run("s3://keel-test", &options)
            .await
            .expect("the example runs");
    }
}
