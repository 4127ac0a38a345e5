//! The claim check on S3 and S3-compatible stores.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{ClientConfigKey, RetryConfig};

use super::{ClaimCheck, ClaimCheckError, DEFAULT_PREFIX};

impl ClaimCheck {
    /// A claim check on the S3 bucket `url` names (`s3://bucket`, or
    /// `s3://bucket/folder` to keep the objects under `folder/claims`).
    ///
    /// Credentials, region and endpoint come from the environment as the
    /// AWS tools read them (`AWS_ACCESS_KEY_ID`, `AWS_REGION`,
    /// `AWS_ENDPOINT`, ...), then from `options`, object_store's
    /// configuration keys (`aws_endpoint`, `aws_region`, `aws_allow_http`
    /// for a test server on loopback, `timeout`, ...). Unlike object_store's
    /// defaults (ten retries over up to three minutes), a request here is
    /// tried at most four times within 10 s, each connection attempt
    /// within 5 s and each request within 60 s: a producer blocked on a
    /// dead store must learn it in seconds. The bucket must exist: a claim
    /// check never creates or configures one. Give the bucket a lifecycle
    /// rule no shorter than the claims' lifetime, or run the sweeper.
    #[cfg_attr(docsrs, doc(cfg(feature = "claim-check-s3")))]
    pub fn s3<I, K, V>(url: &str, options: I) -> Result<Self, ClaimCheckError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: Into<String>,
    {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| ClaimCheckError::Invalid(format!("`{url}` is not an s3:// URL")))?;
        let (bucket, folder) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(ClaimCheckError::Invalid(format!("`{url}` names no bucket")));
        }
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(RetryConfig {
                max_retries: 3,
                retry_timeout: Duration::from_secs(10),
                ..RetryConfig::default()
            })
            // Set key by key: replacing the client options would drop the
            // ones the environment gave (AWS_ALLOW_HTTP, a proxy).
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                "5s",
            )
            .with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), "60s");
        for (key, value) in options {
            let key = key.as_ref();
            let parsed: AmazonS3ConfigKey = key
                .parse()
                .map_err(|e| ClaimCheckError::Invalid(format!("S3 option `{key}`: {e}")))?;
            builder = builder.with_config(parsed, value);
        }
        let store = builder.build().map_err(ClaimCheckError::Store)?;
        let folder = folder.trim_matches('/');
        let prefix = if folder.is_empty() {
            DEFAULT_PREFIX.to_owned()
        } else {
            format!("{folder}/{DEFAULT_PREFIX}")
        };
        Self::new(Arc::new(store), format!("s3://{bucket}")).with_prefix(&prefix)
    }
}
