//! Keel's own policies for the dependencies a service calls, with the mesh
//! host each is called at: what `check` compares the mesh with and what
//! `export` translates.

use std::collections::BTreeMap;

use keel_policy::balance::BalanceConfig;
use keel_policy::pipeline::PipelineConfig;
use serde::{Deserialize, Serialize};

/// Every dependency's policy, by the dependency's name (as a file:
/// `[dependencies.NAME]` tables with `host`, `pipeline` and `balance`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policies {
    /// The dependencies.
    #[serde(default)]
    pub dependencies: BTreeMap<String, DependencyPolicy>,
}

/// One dependency: where the mesh knows it, and Keel's policies for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DependencyPolicy {
    /// The mesh host its calls go to (`orders.internal`).
    pub host: String,
    /// Keel's pipeline for its calls (timeouts, retry, breaker, ...).
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// Keel's balancer over its endpoints, if Keel balances them.
    #[serde(default)]
    pub balance: Option<BalanceConfig>,
    /// Keel's weighted subsets of its endpoints (a baseline and a canary),
    /// if Keel splits its calls.
    #[serde(default)]
    pub subsets: Vec<SubsetPolicy>,
}

/// One of Keel's weighted subsets, as the mesh knows it: the pods labelled
/// `version: <name>`, unless `labels` says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsetPolicy {
    /// The subset's name (Keel's `SubsetConfig::name`).
    pub name: String,
    /// Its share of the calls, relative to the others' (95 and 5).
    pub weight: u32,
    /// The pod labels that select it (default `version: <name>`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl SubsetPolicy {
    /// The labels that select the subset's pods.
    pub fn selector(&self) -> BTreeMap<String, String> {
        if self.labels.is_empty() {
            BTreeMap::from([("version".to_owned(), self.name.clone())])
        } else {
            self.labels.clone()
        }
    }
}

impl DependencyPolicy {
    /// Tries Keel makes per call, the first included.
    pub fn tries(&self) -> u32 {
        self.pipeline
            .retry
            .as_ref()
            .map_or(1, |r| r.max_attempts.get())
    }
}

impl Policies {
    /// The dependency called at `host` (`orders` matches
    /// `orders.shop.svc.cluster.local` and the other way round).
    pub fn for_host(&self, host: &str) -> Option<(&str, &DependencyPolicy)> {
        self.dependencies
            .iter()
            .find(|(_, p)| same_host(&p.host, host))
            .map(|(name, p)| (name.as_str(), p))
    }
}

/// Whether two host names name one service: equal, or one the other's
/// first labels (a short name and its cluster-qualified form).
pub fn same_host(a: &str, b: &str) -> bool {
    let qualifies = |short: &str, long: &str| {
        long.strip_prefix(short)
            .is_some_and(|rest| rest.starts_with('.'))
    };
    a == b || qualifies(a, b) || qualifies(b, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_short_and_qualified_names() {
        assert!(same_host("orders", "orders.shop.svc.cluster.local"));
        assert!(same_host("orders.internal", "orders.internal"));
        assert!(!same_host("orders", "orders-v2.internal"));
        assert!(!same_host("order", "orders.internal"));
    }
}
