//! Weighted subsets of a dependency's endpoints, each balanced by load.
//!
//! A dependency that runs on several hosts, or is mid-way through a canary
//! release, has more than one place to send a call. Its endpoints are
//! grouped in **subsets** (`stable` and `canary`, `v1` and `v2`), each with
//! a weight. Every attempt first draws a subset in proportion to the
//! weights (95 and 5 send about 5% of the calls to the second), then an
//! endpoint inside it with keel-policy's [`Balancer`]: power of two choices
//! by peak-EWMA latency, with outlier ejection capped below 100%, so a slow
//! or failing host gets less traffic without the subset ever being emptied.
//!
//! Because each attempt draws again, a retry usually lands elsewhere. A
//! subset of weight 0 gets no calls (a drained version); at least one
//! subset must have a weight.
//!
//! A subset marked [`canary`](SubsetConfig::canary) is labelled
//! `track="canary"` on `/metrics`, the others `track="baseline"`: each
//! attempt is counted in `keel_client_subset_attempt_duration_seconds` by
//! `dependency`, `subset`, `track` and `outcome`, which gives both the
//! error rate and the latency of every subset, and the shipped alert
//! `KeelCanaryErrorRateAboveBaseline` compares the two tracks.

use std::sync::Arc;

use keel_core::{Name, Rejected};
use keel_policy::ConfigError;
use keel_policy::balance::{BalanceConfig, Balancer, Picked};
use serde::{Deserialize, Serialize};

/// One subset of a dependency's endpoints, as read from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsetConfig {
    /// The subset's name (`stable`, `v2`), a label on its metrics.
    pub name: String,
    /// Its share of the calls, relative to the other subsets' weights: 95
    /// and 5 send about 5% of the calls to the second. 0 sends it none.
    pub weight: u32,
    /// Whether it is the canary whose error rate is compared with the
    /// baseline's (default `false`).
    #[serde(default)]
    pub canary: bool,
    /// Its endpoints' base URLs (`http://10.0.0.1:8080`); at least one.
    pub endpoints: Vec<String>,
}

impl SubsetConfig {
    /// A baseline subset named `name` over `endpoints`, with `weight`.
    pub fn new<S: Into<String>>(
        name: impl Into<String>,
        weight: u32,
        endpoints: impl IntoIterator<Item = S>,
    ) -> Self {
        Self {
            name: name.into(),
            weight,
            canary: false,
            endpoints: endpoints.into_iter().map(Into::into).collect(),
        }
    }

    /// Marks the subset as the canary.
    #[must_use]
    pub fn canary(mut self) -> Self {
        self.canary = true;
        self
    }
}

/// The endpoint an attempt was sent to: its base URL and its subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    base: Arc<str>,
    subset: Name,
    canary: bool,
}

impl Endpoint {
    /// The base URL, without a trailing `/`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `path` (which should start with `/`) on this endpoint.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The subset it belongs to.
    pub fn subset(&self) -> Name {
        self.subset
    }

    /// Whether its subset is the canary.
    pub fn is_canary(&self) -> bool {
        self.canary
    }

    /// The `track` label: `canary` or `baseline`.
    pub(crate) fn track(&self) -> &'static str {
        if self.canary { "canary" } else { "baseline" }
    }
}

/// The subsets of one dependency and their balancers.
#[derive(Debug, Clone)]
pub(crate) struct Routes {
    subsets: Arc<[Subset]>,
    total_weight: u64,
    dependency: Name,
}

#[derive(Debug)]
struct Subset {
    weight: u64,
    balancer: Balancer<Endpoint>,
}

impl Routes {
    /// Validates `subsets` and builds a balancer per subset from `balance`.
    pub(crate) fn build(
        dependency: Name,
        subsets: &[SubsetConfig],
        balance: &BalanceConfig,
    ) -> Result<Self, ConfigError> {
        let mut built = Vec::with_capacity(subsets.len());
        for (i, config) in subsets.iter().enumerate() {
            validate(config, &subsets[..i])?;
            let subset = Name::from(config.name.as_str());
            let balancer = balance
                .clone()
                .build(Name::from(format!("{dependency}/{subset}")))?;
            for url in &config.endpoints {
                balancer.insert(Endpoint {
                    base: Arc::from(url.trim_end_matches('/')),
                    subset,
                    canary: config.canary,
                });
            }
            built.push(Subset {
                weight: u64::from(config.weight),
                balancer,
            });
        }
        let total_weight = built.iter().map(|s| s.weight).sum();
        ConfigError::ensure(
            total_weight > 0,
            "subsets",
            "at least one subset needs a weight above 0, or no call has anywhere to go",
        )?;
        Ok(Self {
            subsets: built.into(),
            total_weight,
            dependency,
        })
    }

    /// One endpoint for one attempt: a subset by weight, then an endpoint
    /// in it by load.
    pub(crate) fn pick(&self) -> Result<Picked<Endpoint>, Rejected> {
        let mut ticket = fastrand::u64(..self.total_weight);
        for subset in self.subsets.iter() {
            if ticket < subset.weight {
                return subset.balancer.pick();
            }
            ticket -= subset.weight;
        }
        Err(Rejected::NoEndpoint {
            name: self.dependency,
        })
    }

    /// Each subset's balancer, for operators.
    pub(crate) fn balancers(&self) -> impl Iterator<Item = &Balancer<Endpoint>> {
        self.subsets.iter().map(|s| &s.balancer)
    }
}

fn validate(config: &SubsetConfig, earlier: &[SubsetConfig]) -> Result<(), ConfigError> {
    ConfigError::ensure(!config.name.is_empty(), "subsets.name", "must not be empty")?;
    ConfigError::ensure(
        earlier.iter().all(|e| e.name != config.name),
        "subsets.name",
        "must be unique: two subsets of one name would share its metrics",
    )?;
    ConfigError::ensure(
        !config.endpoints.is_empty(),
        "subsets.endpoints",
        "needs at least one endpoint",
    )?;
    for url in &config.endpoints {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| ConfigError::new("subsets.endpoints", format!("`{url}`: {e}")))?;
        ConfigError::ensure(
            matches!(parsed.scheme(), "http" | "https") && parsed.host().is_some(),
            "subsets.endpoints",
            "must be http:// or https:// URLs with a host",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(subsets: &[SubsetConfig]) -> Result<Routes, ConfigError> {
        Routes::build(Name::from("payments"), subsets, &BalanceConfig::default())
    }

    #[test]
    fn bad_subsets_are_refused() {
        let good = SubsetConfig::new("stable", 95, ["http://127.0.0.1:1"]);
        let cases = [
            vec![SubsetConfig::new("stable", 0, ["http://127.0.0.1:1"])],
            vec![SubsetConfig::new("stable", 1, Vec::<String>::new())],
            vec![SubsetConfig::new("stable", 1, ["ftp://127.0.0.1:1"])],
            vec![SubsetConfig::new("stable", 1, ["not a url"])],
            vec![SubsetConfig::new("", 1, ["http://127.0.0.1:1"])],
            vec![good.clone(), good.clone()],
        ];
        for case in cases {
            assert!(routes(&case).is_err(), "{case:?} was accepted");
        }
        assert!(routes(&[good, SubsetConfig::new("v2", 0, ["http://h:2"])]).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn calls_split_by_weight_and_zero_weight_gets_none() {
        let routes = routes(&[
            SubsetConfig::new("stable", 90, ["http://a:1", "http://b:1"]),
            SubsetConfig::new("v2", 10, ["http://c:1/"]).canary(),
            SubsetConfig::new("drained", 0, ["http://d:1"]),
        ])
        .unwrap();
        let mut canary = 0;
        for _ in 0..10_000 {
            let picked = routes.pick().unwrap();
            let endpoint = picked.endpoint().clone();
            picked.success();
            assert_ne!(endpoint.subset(), Name::from("drained"));
            if endpoint.is_canary() {
                assert_eq!(endpoint.url("/x"), "http://c:1/x");
                canary += 1;
            }
        }
        // 10% of 10,000 draws: 1,000 ± 5 standard deviations (30 each).
        assert!(
            (850..=1150).contains(&canary),
            "{canary} went to the canary"
        );
    }
}
