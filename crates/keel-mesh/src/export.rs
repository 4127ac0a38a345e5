//! Keel's policy for a dependency as the Istio resources that do the same
//! in the sidecar, so a team moves a policy between the app and the mesh
//! without re-deriving the numbers.

use keel_policy::balance::BalanceConfig;

use crate::duration::IstioDuration;
use crate::error::MeshError;
use crate::istio::{
    API_VERSION, Destination, DestinationRule, DestinationRuleSpec, HttpRetry, HttpRoute, Metadata,
    OutlierDetection, Resource, RouteDestination, TrafficPolicy, VirtualService,
    VirtualServiceSpec,
};
use crate::policy::{DependencyPolicy, Policies};

/// Conditions the exported retry fires on when the calls are not
/// idempotent: only failures that prove the request never reached the
/// upstream, as Keel's own retry does without `retry_outcome_unknown`.
pub const NEVER_ARRIVED: &str = "connect-failure,refused-stream";

/// Conditions added when Keel's policy says the calls are idempotent
/// (`retry_outcome_unknown`): failures after which the work may have been
/// done.
pub const MAY_HAVE_ARRIVED: &str = "reset,5xx";

/// The resources for dependency `name` of `policies`: a `VirtualService`
/// with its timeout and retries, and a `DestinationRule` with its
/// balancer's outlier ejection (when Keel balances it).
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
    let mut resources = vec![Resource::VirtualService(virtual_service(name, policy))];
    if let Some(balance) = &policy.balance {
        resources.push(Resource::DestinationRule(destination_rule(
            name,
            &policy.host,
            balance,
        )));
    }
    Ok(resources)
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

fn virtual_service(name: &str, policy: &DependencyPolicy) -> VirtualService {
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
                route: vec![RouteDestination {
                    destination: Destination {
                        host: policy.host.clone(),
                        ..Destination::default()
                    },
                    weight: None,
                }],
                ..HttpRoute::default()
            }],
        },
    }
}

fn destination_rule(name: &str, host: &str, balance: &BalanceConfig) -> DestinationRule {
    // Envoy has no peak-EWMA balancer; least-request is its nearest, and
    // the exact match for Keel's least-request strategy.
    let simple = "LEAST_REQUEST";
    let outlier = (balance.max_ejection_percent > 0).then(|| OutlierDetection {
        consecutive_5xx_errors: Some(balance.consecutive_failures),
        interval: Some(IstioDuration(balance.interval)),
        base_ejection_time: Some(IstioDuration(balance.base_ejection_time)),
        max_ejection_percent: Some(u32::from(balance.max_ejection_percent)),
    });
    DestinationRule {
        api_version: API_VERSION.to_owned(),
        kind: "DestinationRule".to_owned(),
        metadata: Metadata {
            name: resource_name(name),
            namespace: None,
        },
        spec: DestinationRuleSpec {
            host: host.to_owned(),
            traffic_policy: Some(TrafficPolicy {
                load_balancer: Some(serde_json::json!({ "simple": simple })),
                connection_pool: None,
                outlier_detection: outlier,
            }),
            subsets: Vec::new(),
        },
    }
}
