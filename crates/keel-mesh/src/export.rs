//! Keel's policy for a dependency as the Istio resources that do the same
//! in the sidecar, so a team moves a policy between the app and the mesh
//! without re-deriving the numbers.

use keel_policy::balance::BalanceConfig;

use crate::duration::IstioDuration;
use crate::error::MeshError;
use crate::istio::{
    API_VERSION, Destination, DestinationRule, DestinationRuleSpec, HttpRetry, HttpRoute, Metadata,
    OutlierDetection, Resource, RouteDestination, Subset, TrafficPolicy, VirtualService,
    VirtualServiceSpec,
};
use crate::policy::{DependencyPolicy, Policies, SubsetPolicy};

/// Conditions the exported retry fires on when the calls are not
/// idempotent: only failures that prove the request never reached the
/// upstream, as Keel's own retry does without `retry_outcome_unknown`.
pub const NEVER_ARRIVED: &str = "connect-failure,refused-stream";

/// Conditions added when Keel's policy says the calls are idempotent
/// (`retry_outcome_unknown`): failures after which the work may have been
/// done.
pub const MAY_HAVE_ARRIVED: &str = "reset,5xx";

/// The resources for dependency `name` of `policies`: a `VirtualService`
/// with its timeout, retries and (when Keel splits its calls) the subsets'
/// weights, and a `DestinationRule` with its balancer's outlier ejection
/// (when Keel balances it) and the subsets' pod labels.
pub fn export(policies: &Policies, name: &str) -> Result<Vec<Resource>, MeshError> {
    let policy = policies
        .dependencies
        .get(name)
        .ok_or_else(|| MeshError::UnknownDependency(name.to_owned()))?;
    policy
        .pipeline
        .clone()
        .build(name)
        .map_err(|e| MeshError::Policy {
            dependency: name.to_owned(),
            reason: e.to_string(),
        })?;
    let weights = percentages(name, &policy.subsets)?;
    let mut resources = vec![Resource::VirtualService(virtual_service(
        name, policy, &weights,
    ))];
    if policy.balance.is_some() || !policy.subsets.is_empty() {
        resources.push(Resource::DestinationRule(destination_rule(name, policy)));
    }
    Ok(resources)
}

/// Keel's relative weights as Istio's percentages, which must add up to
/// 100: each rounded down, and the points left over given to the largest
/// remainders (so 2:1 is 67 and 33, never 66 and 33).
fn percentages(name: &str, subsets: &[SubsetPolicy]) -> Result<Vec<u32>, MeshError> {
    if subsets.is_empty() {
        return Ok(Vec::new());
    }
    let total: u64 = subsets.iter().map(|s| u64::from(s.weight)).sum();
    if total == 0 {
        return Err(MeshError::Policy {
            dependency: name.to_owned(),
            reason: "subsets: at least one needs a weight above 0".to_owned(),
        });
    }
    let exact: Vec<u64> = subsets.iter().map(|s| u64::from(s.weight) * 100).collect();
    let mut shares: Vec<u32> = exact.iter().map(|e| (e / total) as u32).collect();
    let mut by_remainder: Vec<usize> = (0..subsets.len()).collect();
    by_remainder.sort_by_key(|&i| std::cmp::Reverse(exact[i] % total));
    let left = 100 - shares.iter().sum::<u32>();
    for &i in by_remainder.iter().take(left as usize) {
        shares[i] += 1;
    }
    Ok(shares)
}

/// A Kubernetes name for `name`: lowercase letters, digits and `-`.
fn resource_name(name: &str) -> String {
    let cleaned: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    cleaned.trim_matches('-').to_owned()
}

/// The route's destinations: the host, or one per subset with its share.
fn destinations(policy: &DependencyPolicy, weights: &[u32]) -> Vec<RouteDestination> {
    let to = |subset: Option<&SubsetPolicy>, weight| RouteDestination {
        destination: Destination {
            host: policy.host.clone(),
            subset: subset.map(|s| s.name.clone()),
            ..Destination::default()
        },
        weight,
    };
    if policy.subsets.is_empty() {
        return vec![to(None, None)];
    }
    policy
        .subsets
        .iter()
        .zip(weights)
        .map(|(subset, &weight)| to(Some(subset), Some(weight)))
        .collect()
}

fn virtual_service(name: &str, policy: &DependencyPolicy, weights: &[u32]) -> VirtualService {
    let pipeline = &policy.pipeline;
    // Retries are always written: Istio retries a route without them twice.
    let retries = match &pipeline.retry {
        Some(retry) => HttpRetry {
            attempts: retry.max_attempts.get() - 1,
            per_try_timeout: pipeline
                .attempt_timeout
                .as_ref()
                .map(|t| IstioDuration(t.timeout)),
            retry_on: Some(if retry.retry_outcome_unknown {
                format!("{NEVER_ARRIVED},{MAY_HAVE_ARRIVED}")
            } else {
                NEVER_ARRIVED.to_owned()
            }),
        },
        None => HttpRetry::default(),
    };
    VirtualService {
        api_version: API_VERSION.to_owned(),
        kind: "VirtualService".to_owned(),
        metadata: Metadata {
            name: resource_name(name),
            namespace: None,
        },
        spec: VirtualServiceSpec {
            hosts: vec![policy.host.clone()],
            http: vec![HttpRoute {
                timeout: pipeline
                    .total_timeout
                    .as_ref()
                    .map(|t| IstioDuration(t.timeout)),
                retries: Some(retries),
                route: destinations(policy, weights),
                ..HttpRoute::default()
            }],
        },
    }
}

fn destination_rule(name: &str, policy: &DependencyPolicy) -> DestinationRule {
    DestinationRule {
        api_version: API_VERSION.to_owned(),
        kind: "DestinationRule".to_owned(),
        metadata: Metadata {
            name: resource_name(name),
            namespace: None,
        },
        spec: DestinationRuleSpec {
            host: policy.host.clone(),
            traffic_policy: policy.balance.as_ref().map(traffic_policy),
            subsets: policy
                .subsets
                .iter()
                .map(|subset| Subset {
                    name: subset.name.clone(),
                    labels: subset.selector(),
                    traffic_policy: None,
                })
                .collect(),
        },
    }
}

fn traffic_policy(balance: &BalanceConfig) -> TrafficPolicy {
    // Envoy has no peak-EWMA balancer; least-request is its nearest, and
    // the exact match for Keel's least-request strategy.
    let simple = "LEAST_REQUEST";
    let outlier = (balance.max_ejection_percent > 0).then(|| OutlierDetection {
        consecutive_5xx_errors: Some(balance.consecutive_failures),
        interval: Some(IstioDuration(balance.interval)),
        base_ejection_time: Some(IstioDuration(balance.base_ejection_time)),
        max_ejection_percent: Some(u32::from(balance.max_ejection_percent)),
    });
    TrafficPolicy {
        load_balancer: Some(serde_json::json!({ "simple": simple })),
        connection_pool: None,
        outlier_detection: outlier,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(weights: &[u32]) -> Vec<u32> {
        let subsets: Vec<_> = weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| SubsetPolicy {
                name: format!("s{i}"),
                weight,
                labels: Default::default(),
            })
            .collect();
        percentages("d", &subsets).unwrap()
    }

    #[test]
    fn weights_become_percentages_that_add_up_to_100() {
        assert_eq!(shares(&[95, 5]), [95, 5]);
        assert_eq!(shares(&[1, 1, 1]), [34, 33, 33]);
        assert_eq!(shares(&[3, 0]), [100, 0]);
        assert_eq!(shares(&[u32::MAX, u32::MAX, 1]), [50, 50, 0]);
        for weights in [[7, 11, 13], [1, 2, 997], [5, 5, 90]] {
            assert_eq!(shares(&weights).iter().sum::<u32>(), 100, "{weights:?}");
        }
    }
}
