//! The part of Istio's `VirtualService` and `DestinationRule`
//! (`networking.istio.io/v1`) that decides retries, timeouts, weights and
//! ejection, read from and written to YAML. Fields Keel does not reason
//! about are kept where a resource is re-emitted and ignored otherwise.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::duration::IstioDuration;
use crate::error::MeshError;

/// Istio's networking API version Keel writes.
pub const API_VERSION: &str = "networking.istio.io/v1";

/// A resource's name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// A `VirtualService`: how calls to some hosts are routed, timed out and
/// retried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualService {
    /// [`API_VERSION`] (any `networking.istio.io` version is read).
    pub api_version: String,
    /// `VirtualService`.
    pub kind: String,
    /// Its name.
    pub metadata: Metadata,
    /// Its routes.
    pub spec: VirtualServiceSpec,
}

/// A `VirtualService`'s `spec`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualServiceSpec {
    /// The hosts it applies to.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// HTTP routes, first match wins.
    #[serde(default)]
    pub http: Vec<HttpRoute>,
}

/// One HTTP route.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRoute {
    /// The route's name, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What a request must match (any entry).
    #[serde(default, rename = "match", skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<HttpMatch>,
    /// The limit on the whole call, retries included (none: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<IstioDuration>,
    /// Retries (none: Istio's default policy, see [`HttpRetry::istio_default`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<HttpRetry>,
    /// Where requests go, by weight.
    #[serde(default)]
    pub route: Vec<RouteDestination>,
    /// Fault injection, kept as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<serde_json::Value>,
}

/// A request match; only the method matters to Keel's checks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpMatch {
    /// The method, if the match names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<StringMatch>,
    /// Every other condition, kept as written.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// An exact, prefix or regex string match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StringMatch {
    /// Equal to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    /// Starting with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Matching this regular expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
}

/// A route's retry policy. Istio's `attempts` counts the retries after the
/// first try, so a call is tried `attempts + 1` times.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRetry {
    /// Retries after the first try.
    #[serde(default)]
    pub attempts: u32,
    /// The limit on each try, the first included (none: the route's
    /// timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_try_timeout: Option<IstioDuration>,
    /// When to retry, comma-separated Envoy conditions (none: Istio's
    /// default conditions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_on: Option<String>,
}

/// The conditions Istio retries on when a route names none.
pub const ISTIO_DEFAULT_RETRY_ON: &str =
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes";

impl HttpRetry {
    /// The policy Istio applies to a route without `retries`: 2 retries on
    /// its default conditions, no per-try limit.
    pub fn istio_default() -> Self {
        Self {
            attempts: 2,
            per_try_timeout: None,
            retry_on: Some(ISTIO_DEFAULT_RETRY_ON.to_owned()),
        }
    }

    /// Tries in all, the first included.
    pub fn tries(&self) -> u32 {
        self.attempts.saturating_add(1)
    }

    /// The conditions retried on, one by one.
    pub fn conditions(&self) -> Vec<&str> {
        self.retry_on
            .as_deref()
            .unwrap_or(ISTIO_DEFAULT_RETRY_ON)
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect()
    }
}

/// A destination and its share of the requests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDestination {
    /// Where.
    pub destination: Destination,
    /// Percent of the route's requests (none: all, for a lone destination).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// A host, optionally one subset of it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Destination {
    /// The service's host.
    pub host: String,
    /// A subset named in the host's `DestinationRule`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subset: Option<String>,
    /// The port, kept as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<serde_json::Value>,
}

/// A `DestinationRule`: how a host's endpoints are balanced and ejected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DestinationRule {
    /// [`API_VERSION`].
    pub api_version: String,
    /// `DestinationRule`.
    pub kind: String,
    /// Its name.
    pub metadata: Metadata,
    /// Its policy.
    pub spec: DestinationRuleSpec,
}

/// A `DestinationRule`'s `spec`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DestinationRuleSpec {
    /// The host it applies to.
    pub host: String,
    /// The policy for every subset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_policy: Option<TrafficPolicy>,
    /// Named subsets (versions), each possibly with a policy of its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subsets: Vec<Subset>,
}

/// A named subset of a host's endpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Subset {
    /// Its name, as routes refer to it.
    pub name: String,
    /// The endpoints' labels, kept as written.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Its own policy, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_policy: Option<TrafficPolicy>,
}

/// Balancing, connection pool and outlier detection.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TrafficPolicy {
    /// The balancer, kept as written (e.g. `{simple: LEAST_REQUEST}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancer: Option<serde_json::Value>,
    /// Connection pool limits, kept as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_pool: Option<serde_json::Value>,
    /// Ejection of failing endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetection>,
}

/// Ejection of endpoints that keep failing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OutlierDetection {
    /// 5xx answers in a row that eject an endpoint.
    #[serde(
        default,
        rename = "consecutive5xxErrors",
        skip_serializing_if = "Option::is_none"
    )]
    pub consecutive_5xx_errors: Option<u32>,
    /// How often endpoints are evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<IstioDuration>,
    /// How long a first ejection lasts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_ejection_time: Option<IstioDuration>,
    /// The share of endpoints that may be ejected at once, in percent
    /// (Istio's default: 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ejection_percent: Option<u32>,
}

/// One resource of a file, as far as Keel reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Resource {
    /// A `VirtualService`.
    VirtualService(VirtualService),
    /// A `DestinationRule`.
    DestinationRule(DestinationRule),
    /// Any other kind (a `Deployment`, a `Gateway`), not checked.
    Other {
        /// Its kind.
        kind: String,
    },
}

impl Resource {
    /// `Kind/name`, for messages.
    pub fn describe(&self) -> String {
        match self {
            Self::VirtualService(vs) => format!("VirtualService/{}", vs.metadata.name),
            Self::DestinationRule(dr) => format!("DestinationRule/{}", dr.metadata.name),
            Self::Other { kind } => kind.clone(),
        }
    }
}

/// Every resource of a YAML file (documents separated by `---`).
pub fn parse(yaml: &str) -> Result<Vec<Resource>, MeshError> {
    let documents: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(yaml).map_err(|e| MeshError::Yaml(e.to_string()))?;
    documents.into_iter().map(resource).collect()
}

fn resource(document: serde_json::Value) -> Result<Resource, MeshError> {
    let kind = document
        .get("kind")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let invalid = |e: serde_json::Error| MeshError::Invalid {
        kind: kind.clone(),
        reason: e.to_string(),
    };
    Ok(match kind.as_str() {
        "VirtualService" => {
            Resource::VirtualService(serde_json::from_value(document).map_err(invalid)?)
        }
        "DestinationRule" => {
            Resource::DestinationRule(serde_json::from_value(document).map_err(invalid)?)
        }
        _ => Resource::Other { kind },
    })
}

/// `resources` as YAML documents separated by `---`.
pub fn to_yaml(resources: &[Resource]) -> Result<String, MeshError> {
    let mut out = String::new();
    for resource in resources {
        let yaml = match resource {
            Resource::VirtualService(vs) => serde_saphyr::to_string(vs),
            Resource::DestinationRule(dr) => serde_saphyr::to_string(dr),
            Resource::Other { .. } => continue,
        }
        .map_err(|e| MeshError::Yaml(e.to_string()))?;
        if !out.is_empty() {
            out.push_str("---\n");
        }
        out.push_str(&yaml);
    }
    Ok(out)
}
