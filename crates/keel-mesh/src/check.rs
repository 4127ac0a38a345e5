//! The rules Keel's pipeline enforces in process, applied to a mesh's
//! resources, and the places where the mesh and Keel disagree.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use keel_policy::pipeline::attempts_fit;

use crate::istio::{DestinationRule, HttpRetry, HttpRoute, Resource, TrafficPolicy};
use crate::policy::{Policies, same_host};

/// How bad a finding is: an error makes `keel mesh check` fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Worth a look; the configuration works as written.
    Warning,
    /// The configuration cannot do what it says.
    Error,
}

/// Which rule a finding comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Tries × per-try timeout + the waits between them must fit in the
    /// route's timeout (a warning when tries have no limit of their own).
    RetriesFitTimeout,
    /// A route without a timeout holds its caller as long as it hangs.
    RouteWithoutTimeout,
    /// A retry condition that fires after the work may have been done,
    /// on a route that also carries non-idempotent methods.
    RetryNonIdempotent,
    /// Outlier detection may eject every endpoint.
    EjectionCap,
    /// A route's weights do not add up to 100.
    Weights,
    /// A route names a subset its host's `DestinationRule` lacks.
    UnknownSubset,
    /// Keel and the mesh both retry one dependency: the tries multiply.
    RetriesMultiply,
    /// Keel and the mesh both split one dependency's calls by weight: a
    /// canary's share is the product of the two.
    SplitsMultiply,
    /// Keel waits longer than the mesh lets a call run.
    TimeoutsDisagree,
    /// Keel's own policy for the dependency does not build.
    PolicyInvalid,
}

impl Rule {
    /// The rule's stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RetriesFitTimeout => "retries-fit-timeout",
            Self::RouteWithoutTimeout => "route-without-timeout",
            Self::RetryNonIdempotent => "retry-non-idempotent",
            Self::EjectionCap => "ejection-cap",
            Self::Weights => "weights",
            Self::UnknownSubset => "unknown-subset",
            Self::RetriesMultiply => "retries-multiply",
            Self::SplitsMultiply => "splits-multiply",
            Self::TimeoutsDisagree => "timeouts-disagree",
            Self::PolicyInvalid => "policy-invalid",
        }
    }
}

/// One thing found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Error or warning.
    pub severity: Severity,
    /// The rule.
    pub rule: Rule,
    /// Where: `VirtualService/orders http[0]`, or the dependency.
    pub place: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let severity = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(
            f,
            "{severity}[{}] {}: {}",
            self.rule.as_str(),
            self.place,
            self.message
        )
    }
}

/// Everything `check` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Errors first, then warnings, each in file order.
    pub findings: Vec<Finding>,
}

impl Report {
    /// Whether any finding is an error.
    pub fn has_errors(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }

    /// The findings of `rule`.
    pub fn of(&self, rule: Rule) -> Vec<&Finding> {
        self.findings.iter().filter(|f| f.rule == rule).collect()
    }

    fn push(&mut self, severity: Severity, rule: Rule, place: &str, message: String) {
        self.findings.push(Finding {
            severity,
            rule,
            place: place.to_owned(),
            message,
        });
    }
}

/// Envoy's retry back-off: before retry `n` it waits a random time up to
/// `(2ⁿ − 1) × 25 ms`, at most 250 ms (Istio sets no other). The longest
/// the waits of `retries` retries can add up to.
pub fn envoy_backoff(retries: u32) -> Duration {
    const BASE: Duration = Duration::from_millis(25);
    const MAX: Duration = Duration::from_millis(250);
    (1..=retries.min(32))
        .map(|n| BASE.saturating_mul((1u32 << n.min(31)) - 1).min(MAX))
        .sum()
}

/// Retry conditions that fire after the upstream may have done the work:
/// a retry then repeats a write unless the request is idempotent.
const AFTER_THE_WORK: &[&str] = &[
    "5xx",
    "gateway-error",
    "reset",
    "retriable-4xx",
    "retriable-status-codes",
    "unavailable",
    "deadline-exceeded",
    "internal",
];

const IDEMPOTENT_METHODS: &[&str] = &["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"];

/// Checks `resources` against Keel's rules, and against `policies` (Keel's
/// own settings per dependency, may be empty).
pub fn check(resources: &[Resource], policies: &Policies) -> Report {
    let mut report = Report::default();
    let subsets = subsets_by_host(resources);
    for resource in resources {
        match resource {
            Resource::VirtualService(vs) => {
                for (i, route) in vs.spec.http.iter().enumerate() {
                    let place = format!("{} http[{i}]", resource.describe());
                    check_route(&place, route, &subsets, policies, &mut report);
                }
            }
            Resource::DestinationRule(dr) => check_rule(&resource.describe(), dr, &mut report),
            Resource::Other { .. } => {}
        }
    }
    for (name, policy) in &policies.dependencies {
        if let Err(e) = policy.pipeline.clone().build(name.as_str()) {
            let place = format!("Keel policy `{name}`");
            report.push(Severity::Error, Rule::PolicyInvalid, &place, e.to_string());
        }
    }
    report
        .findings
        .sort_by_key(|f| std::cmp::Reverse(f.severity));
    report
}

/// The subsets each `DestinationRule` in the files defines, by host.
fn subsets_by_host(resources: &[Resource]) -> BTreeMap<String, Vec<String>> {
    let mut by_host: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for resource in resources {
        if let Resource::DestinationRule(dr) = resource {
            let names = dr.spec.subsets.iter().map(|s| s.name.clone());
            by_host
                .entry(dr.spec.host.clone())
                .or_default()
                .extend(names);
        }
    }
    by_host
}

fn check_route(
    place: &str,
    route: &HttpRoute,
    subsets: &BTreeMap<String, Vec<String>>,
    policies: &Policies,
    report: &mut Report,
) {
    let retry = route
        .retries
        .clone()
        .unwrap_or_else(HttpRetry::istio_default);
    let timeout = route.timeout.map(|t| t.0).filter(|t| !t.is_zero());
    check_fit(place, route, &retry, timeout, report);
    check_idempotence(place, route, &retry, report);
    check_destinations(place, route, subsets, report);
    // A canary's subsets are one dependency to Keel: compared once.
    let mut compared = Vec::new();
    for destination in &route.route {
        if let Some((name, policy)) = policies.for_host(&destination.destination.host)
            && !compared.contains(&name)
        {
            compared.push(name);
            check_against_keel(place, name, policy, &retry, timeout, report);
            if route.route.len() > 1 && !policy.subsets.is_empty() {
                let message = format!(
                    "Keel splits the calls to `{name}` between its subsets and the sidecar splits                      each of them again: a canary's share is the product of the two weights;                      let one layer split (`keel mesh export` moves Keel's subsets into the mesh)"
                );
                report.push(Severity::Warning, Rule::SplitsMultiply, place, message);
            }
        }
    }
}

fn check_fit(
    place: &str,
    route: &HttpRoute,
    retry: &HttpRetry,
    timeout: Option<Duration>,
    report: &mut Report,
) {
    let default_note = if route.retries.is_none() {
        " (Istio retries a route without `retries` twice; write `retries: {attempts: 0}` to \
         turn that off)"
    } else {
        ""
    };
    let Some(timeout) = timeout else {
        let message = format!(
            "no timeout: the {} tries may hang as long as the upstream does, holding the caller \
             until its own deadline; set the route's `timeout` to the most the caller can \
             wait{default_note}",
            retry.tries()
        );
        report.push(Severity::Warning, Rule::RouteWithoutTimeout, place, message);
        return;
    };
    let backoff = envoy_backoff(retry.attempts);
    let Some(per_try) = retry.per_try_timeout.map(|t| t.0) else {
        // As in Keel's pipeline without an attempt timeout: retries after
        // fast failures still fit, but a hung try takes the whole budget.
        if retry.attempts > 0 {
            let fits = timeout.saturating_sub(backoff) / retry.tries();
            let message = format!(
                "no `perTryTimeout`: a try that hangs takes the whole {timeout:?} and leaves no \
                 time for the {} retries; set `perTryTimeout` to at most {:?}{default_note}",
                retry.attempts,
                whole_millis(fits),
            );
            report.push(Severity::Warning, Rule::RetriesFitTimeout, place, message);
        }
        return;
    };
    if let Err(e) = attempts_fit(retry.tries(), per_try, backoff, timeout) {
        let message = format!(
            "{} tries ({} retries: Istio's `attempts` counts the retries after the first try) \
             of {per_try:?} plus up to {backoff:?} of Envoy's back-off need {:?}, more than the \
             route's timeout of {timeout:?}: the last tries are cut short; lower `perTryTimeout` \
             to {:?} or the attempts, or raise the timeout{default_note}",
            retry.tries(),
            retry.attempts,
            e.needed,
            whole_millis(e.longest_fitting_attempt()),
        );
        report.push(Severity::Error, Rule::RetriesFitTimeout, place, message);
    }
}

/// `d` rounded down to whole milliseconds, as a setting would be written.
fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn check_idempotence(place: &str, route: &HttpRoute, retry: &HttpRetry, report: &mut Report) {
    if retry.attempts == 0 {
        return;
    }
    let risky: Vec<&str> = retry
        .conditions()
        .into_iter()
        .filter(|c| AFTER_THE_WORK.contains(c))
        .collect();
    let idempotent_only = !route.matches.is_empty()
        && route.matches.iter().all(|m| {
            m.method
                .as_ref()
                .and_then(|method| method.exact.as_deref())
                .is_some_and(|method| IDEMPOTENT_METHODS.contains(&method))
        });
    if risky.is_empty() || idempotent_only {
        return;
    }
    let whose = if route.retries.is_none() {
        "Istio's default retries, on a route without `retries`,"
    } else {
        "the route's retries"
    };
    let message = format!(
        "{whose} fire on `{}`, after the upstream may have done the work, and the route also \
         carries POST and PATCH: a retried write happens twice unless it is idempotent; match \
         only idempotent methods here, retry only on `connect-failure,refused-stream`, or make \
         the writes idempotent (an Idempotency-Key the upstream deduplicates on)",
        risky.join(",")
    );
    report.push(Severity::Warning, Rule::RetryNonIdempotent, place, message);
}

fn check_destinations(
    place: &str,
    route: &HttpRoute,
    subsets: &BTreeMap<String, Vec<String>>,
    report: &mut Report,
) {
    if route.route.len() > 1 {
        let sum: u64 = route
            .route
            .iter()
            .map(|d| u64::from(d.weight.unwrap_or(0)))
            .sum();
        if sum != 100 {
            let message =
                format!("the destinations' weights add up to {sum}, not 100: Istio refuses it");
            report.push(Severity::Error, Rule::Weights, place, message);
        }
    }
    for d in &route.route {
        let (host, Some(subset)) = (&d.destination.host, &d.destination.subset) else {
            continue;
        };
        let defined = subsets
            .iter()
            .find(|(h, _)| same_host(h, host))
            .map(|(_, names)| names);
        if defined.is_some_and(|names| !names.contains(subset)) {
            let message = format!(
                "subset `{subset}` of `{host}` is not defined by its DestinationRule: requests \
                 routed to it fail"
            );
            report.push(Severity::Error, Rule::UnknownSubset, place, message);
        }
    }
}

fn check_against_keel(
    place: &str,
    name: &str,
    policy: &crate::policy::DependencyPolicy,
    retry: &HttpRetry,
    timeout: Option<Duration>,
    report: &mut Report,
) {
    let (keel, mesh) = (policy.tries(), retry.tries());
    if keel > 1 && mesh > 1 {
        let message = format!(
            "Keel tries `{name}` {keel} times and the sidecar tries each of those {mesh} times: \
             up to {} calls per request, each adding load to a dependency already failing; let \
             one layer retry (`keel mesh export` moves Keel's retry into the mesh, or set \
             `retries: {{attempts: 0}}` here)",
            keel * mesh
        );
        report.push(Severity::Warning, Rule::RetriesMultiply, place, message);
    }
    // Each of Keel's attempts is one request through the sidecar: what it
    // may take is the attempt timeout, else the total.
    let pipeline = &policy.pipeline;
    let keel_attempt = (pipeline.attempt_timeout.as_ref())
        .or(pipeline.total_timeout.as_ref())
        .map(|t| t.timeout);
    if let (Some(keel_attempt), Some(mesh_timeout)) = (keel_attempt, timeout)
        && keel_attempt > mesh_timeout
    {
        let message = format!(
            "Keel gives each attempt at `{name}` up to {keel_attempt:?} but the sidecar ends \
             the request at {mesh_timeout:?} with a 504: the mesh's timeout, not Keel's, decides \
             when an attempt fails; make the mesh's timeout at least Keel's attempt timeout"
        );
        report.push(Severity::Warning, Rule::TimeoutsDisagree, place, message);
    }
}

fn check_rule(place: &str, dr: &DestinationRule, report: &mut Report) {
    let mut policies: Vec<(String, &TrafficPolicy)> = Vec::new();
    if let Some(p) = &dr.spec.traffic_policy {
        policies.push((place.to_owned(), p));
    }
    for subset in &dr.spec.subsets {
        if let Some(p) = &subset.traffic_policy {
            policies.push((format!("{place} subset {}", subset.name), p));
        }
    }
    for (where_, policy) in policies {
        let cap = policy
            .outlier_detection
            .as_ref()
            .and_then(|o| o.max_ejection_percent);
        if cap.is_some_and(|c| c >= 100) {
            let message = "`maxEjectionPercent: 100` lets outlier detection eject every \
                 endpoint: during an outage of the whole dependency every backend looks \
                 unhealthy, and a degraded service becomes a total outage; keep it at 50 or \
                 below (Keel's balancer refuses 100)"
                .to_owned();
            report.push(Severity::Error, Rule::EjectionCap, &where_, message);
        }
    }
}
