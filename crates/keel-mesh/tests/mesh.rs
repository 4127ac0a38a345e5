//! `check` on the catalogue's Istio resources, on a sound version of them
//! and on deliberately broken ones; `check` against Keel's own policies;
//! `export` of a policy, read back and checked.

use keel_mesh::{Policies, Report, Resource, Rule, Severity, check, export, parse, to_yaml};

fn fixture(name: &str) -> Vec<Resource> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    parse(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn rules(report: &Report) -> Vec<(Severity, Rule, String)> {
    report
        .findings
        .iter()
        .map(|f| (f.severity, f.rule, f.place.clone()))
        .collect()
}

fn policies(toml: &str) -> Policies {
    toml::from_str(toml).unwrap()
}

#[test]
fn the_catalogues_retries_cannot_fit_its_timeout_as_istio_counts_them() {
    let report = check(&fixture("catalogue.yaml"), &Policies::default());
    let fit = report.of(Rule::RetriesFitTimeout);
    assert_eq!(fit.len(), 1, "{report:#?}");
    assert_eq!(fit[0].place, "VirtualService/orders http[0]");
    // `attempts: 2` are two retries: three tries of 700 ms and up to
    // 100 ms of back-off are 2.2 s, more than 2 s.
    assert!(fit[0].message.contains("3 tries"), "{}", fit[0].message);
    assert!(fit[0].message.contains("2.2s"), "{}", fit[0].message);
    assert!(
        fit[0].message.contains("`perTryTimeout` to 633ms"),
        "{}",
        fit[0].message
    );
    // It also retries POSTs on 5xx and reset (and the chaos routes, on
    // Istio's default retries, POSTs answered 503), and names subsets its
    // DestinationRule does not define.
    let writes = report.of(Rule::RetryNonIdempotent);
    assert_eq!(writes.len(), 3, "{report:#?}");
    assert!(
        writes[0].message.contains("`5xx,reset`"),
        "{}",
        writes[0].message
    );
    assert!(
        writes[1].message.contains("Istio's default"),
        "{}",
        writes[1].message
    );
    assert_eq!(report.of(Rule::UnknownSubset).len(), 2);
    // The chaos route's catch-all has no timeout.
    let no_timeout = report.of(Rule::RouteWithoutTimeout);
    assert_eq!(no_timeout.len(), 2, "{report:#?}");
    assert!(
        no_timeout
            .iter()
            .all(|f| f.place.starts_with("VirtualService/pricing-chaos"))
    );
    assert!(report.has_errors());
}

#[test]
fn a_sound_configuration_passes() {
    let report = check(&fixture("sound.yaml"), &Policies::default());
    assert!(report.findings.is_empty(), "{report:#?}");
}

#[test]
fn each_deliberate_fault_is_named() {
    let report = check(&fixture("broken.yaml"), &Policies::default());
    let found = rules(&report);
    let expect = [
        (
            Severity::Error,
            Rule::RetriesFitTimeout,
            "VirtualService/payments http[0]",
        ),
        (
            Severity::Error,
            Rule::Weights,
            "VirtualService/payments http[0]",
        ),
        (
            Severity::Error,
            Rule::UnknownSubset,
            "VirtualService/payments http[0]",
        ),
        (
            Severity::Error,
            Rule::EjectionCap,
            "DestinationRule/payments",
        ),
        (
            Severity::Warning,
            Rule::RetryNonIdempotent,
            "VirtualService/payments http[0]",
        ),
        (
            Severity::Warning,
            Rule::RouteWithoutTimeout,
            "VirtualService/payments http[1]",
        ),
        (
            Severity::Warning,
            Rule::RetryNonIdempotent,
            "VirtualService/payments http[1]",
        ),
    ];
    for (severity, rule, place) in expect {
        assert!(
            found.contains(&(severity, rule, place.to_owned())),
            "missing {rule:?} at {place}: {found:#?}"
        );
    }
    assert_eq!(found.len(), expect.len(), "{found:#?}");
    let fit = &report.of(Rule::RetriesFitTimeout)[0].message;
    assert!(
        fit.contains("4 tries"),
        "three retries after the first: {fit}"
    );
    // Errors come first.
    assert!(
        report.findings[..4]
            .iter()
            .all(|f| f.severity == Severity::Error)
    );
}

#[test]
fn a_route_restricted_to_idempotent_methods_may_retry_on_5xx() {
    let yaml = r#"
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: catalog }
spec:
  hosts: [catalog]
  http:
    - match: [{ method: { exact: GET } }, { method: { exact: HEAD } }]
      timeout: 3s
      retries: { attempts: 2, perTryTimeout: 900ms, retryOn: "5xx,reset" }
      route: [{ destination: { host: catalog } }]
"#;
    let report = check(&parse(yaml).unwrap(), &Policies::default());
    assert!(report.findings.is_empty(), "{report:#?}");
}

const KEEL_RETRIES: &str = r#"
[dependencies.orders]
host = "orders.internal"
[dependencies.orders.pipeline]
total_timeout = { timeout = "8s" }
attempt_timeout = { timeout = "2500ms" }
retry = { max_attempts = 3 }
"#;

#[test]
fn keel_and_the_mesh_retrying_one_dependency_multiply_their_tries() {
    let report = check(&fixture("sound.yaml"), &policies(KEEL_RETRIES));
    let multiply = report.of(Rule::RetriesMultiply);
    assert_eq!(multiply.len(), 1, "{report:#?}");
    assert!(
        multiply[0].message.contains("up to 6 calls"),
        "{}",
        multiply[0].message
    );
    let disagree = report.of(Rule::TimeoutsDisagree);
    assert_eq!(
        disagree.len(),
        1,
        "Keel gives an attempt 2.5 s, the mesh ends it at 2 s"
    );
    assert!(!report.has_errors());
}

#[test]
fn keels_own_invalid_policy_is_an_error() {
    let invalid = r#"
[dependencies.orders]
host = "orders.internal"
[dependencies.orders.pipeline]
total_timeout = { timeout = "1s" }
attempt_timeout = { timeout = "900ms" }
retry = { max_attempts = 3 }
"#;
    let report = check(&[], &policies(invalid));
    assert_eq!(report.of(Rule::PolicyInvalid).len(), 1, "{report:#?}");
    assert!(report.has_errors());
}

const MOVABLE: &str = r#"
[dependencies.orders]
host = "orders.internal"
[dependencies.orders.pipeline]
total_timeout = { timeout = "2s" }
attempt_timeout = { timeout = "600ms" }
retry = { max_attempts = 3 }
[dependencies.orders.balance]
max_ejection_percent = 50
consecutive_failures = 5
"#;

#[test]
fn an_exported_policy_reads_back_and_passes_once_keel_stops_retrying() {
    let keel = policies(MOVABLE);
    let resources = export(&keel, "orders").unwrap();
    let yaml = to_yaml(&resources).unwrap();
    let read_back = parse(&yaml).unwrap();
    assert_eq!(read_back, resources, "{yaml}");
    assert!(yaml.contains("perTryTimeout: 600ms"), "{yaml}");
    assert!(
        yaml.contains("attempts: 2"),
        "three tries are two retries: {yaml}"
    );
    let Resource::VirtualService(vs) = &read_back[0] else {
        panic!("a VirtualService first: {read_back:#?}");
    };
    let retries = vs.spec.http[0].retries.as_ref().unwrap();
    assert_eq!(retries.conditions(), ["connect-failure", "refused-stream"]);
    assert!(yaml.contains("maxEjectionPercent: 50"), "{yaml}");
    assert!(yaml.contains("LEAST_REQUEST"), "{yaml}");

    let mut moved = keel.clone();
    moved.dependencies.get_mut("orders").unwrap().pipeline.retry = None;
    let report = check(&read_back, &moved);
    assert!(report.findings.is_empty(), "{report:#?}");
    // Left in Keel as well, the retry multiplies.
    let both = check(&read_back, &keel);
    assert_eq!(both.of(Rule::RetriesMultiply).len(), 1);
}

#[test]
fn a_policy_without_retries_exports_retries_turned_off() {
    let keel = policies(
        r#"
[dependencies.ledger]
host = "ledger"
[dependencies.ledger.pipeline]
total_timeout = { timeout = "500ms" }
"#,
    );
    let yaml = to_yaml(&export(&keel, "ledger").unwrap()).unwrap();
    assert!(
        yaml.contains("attempts: 0"),
        "Istio's default would retry twice: {yaml}"
    );
    assert!(yaml.contains("timeout: 500ms"), "{yaml}");
    assert!(
        !yaml.contains("DestinationRule"),
        "Keel does not balance it: {yaml}"
    );
}

#[test]
fn keels_rule_ignores_back_off_so_a_policy_on_the_edge_exports_a_finding() {
    // Keel's pipeline accepts 2 × 1 s in 2 s; Envoy waits up to 25 ms
    // between the tries, so the mesh's version does not fit.
    let keel = policies(
        r#"
[dependencies.edge]
host = "edge"
[dependencies.edge.pipeline]
total_timeout = { timeout = "2s" }
attempt_timeout = { timeout = "1s" }
retry = { max_attempts = 2 }
"#,
    );
    let resources = export(&keel, "edge").unwrap();
    let report = check(&resources, &Policies::default());
    assert_eq!(report.of(Rule::RetriesFitTimeout).len(), 1, "{report:#?}");
}

#[test]
fn unreadable_input_is_a_typed_error() {
    assert!(matches!(
        parse("kind: [unclosed"),
        Err(keel_mesh::MeshError::Yaml(_))
    ));
    let bad = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: x}\nspec:\n  http:\n    - timeout: soon\n";
    let err = parse(bad).unwrap_err();
    assert!(err.to_string().contains("VirtualService"), "{err}");
    assert!(matches!(
        export(&Policies::default(), "nope"),
        Err(keel_mesh::MeshError::UnknownDependency(_))
    ));
}

#[test]
fn tries_without_a_limit_of_their_own_are_a_warning_as_in_keels_pipeline() {
    // Keel accepts a retry under a total timeout with no attempt timeout;
    // exported, its tries have no `perTryTimeout`: a hung one takes all.
    let keel = policies(
        r#"
[dependencies.search]
host = "search"
[dependencies.search.pipeline]
total_timeout = { timeout = "1s" }
retry = { max_attempts = 3 }
"#,
    );
    let report = check(&export(&keel, "search").unwrap(), &Policies::default());
    let fit = report.of(Rule::RetriesFitTimeout);
    assert_eq!(fit.len(), 1, "{report:#?}");
    assert_eq!(fit[0].severity, Severity::Warning);
    assert!(
        fit[0].message.contains("at most 300ms"),
        "{}",
        fit[0].message
    );
    assert!(!report.has_errors());
}

#[test]
fn weights_that_overflow_do_not_wrap_around_to_100() {
    let yaml = r#"
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: wrap }
spec:
  hosts: [wrap]
  http:
    - timeout: 1s
      retries: { attempts: 0 }
      route:
        - { destination: { host: wrap }, weight: 4294967295 }
        - { destination: { host: wrap }, weight: 101 }
"#;
    let report = check(&parse(yaml).unwrap(), &Policies::default());
    assert_eq!(report.of(Rule::Weights).len(), 1, "{report:#?}");
}

#[test]
fn keels_canary_exports_as_weighted_subsets_that_pass_the_check() {
    let keel = policies(
        r#"
[dependencies.payments]
host = "payments.shop.svc.cluster.local"
[dependencies.payments.pipeline]
total_timeout = { timeout = "2s" }
[[dependencies.payments.subsets]]
name = "stable"
weight = 2
[[dependencies.payments.subsets]]
name = "v2"
weight = 1
labels = { track = "canary" }
"#,
    );
    let resources = export(&keel, "payments").unwrap();
    let yaml = to_yaml(&resources).unwrap();
    let read_back = parse(&yaml).unwrap();
    assert_eq!(read_back, resources, "{yaml}");
    let Resource::VirtualService(vs) = &read_back[0] else {
        panic!("a VirtualService first: {read_back:#?}");
    };
    let split: Vec<_> = vs.spec.http[0]
        .route
        .iter()
        .map(|d| (d.destination.subset.clone().unwrap(), d.weight.unwrap()))
        .collect();
    // 2:1 as percentages that add up to 100: the leftover point goes to
    // the larger remainder.
    assert_eq!(split, [("stable".to_owned(), 67), ("v2".to_owned(), 33)]);
    let Resource::DestinationRule(dr) = &read_back[1] else {
        panic!("a DestinationRule second: {read_back:#?}");
    };
    assert_eq!(dr.spec.subsets[0].labels["version"], "stable");
    assert_eq!(dr.spec.subsets[1].labels["track"], "canary");
    assert!(
        dr.spec.traffic_policy.is_none(),
        "Keel does not balance it: {yaml}"
    );

    // Moved into the mesh, the split passes the mesh's own rules...
    let mut moved = keel.clone();
    moved
        .dependencies
        .get_mut("payments")
        .unwrap()
        .subsets
        .clear();
    let report = check(&read_back, &moved);
    assert!(report.findings.is_empty(), "{report:#?}");
    // ...and left in Keel as well, the shares multiply.
    let both = check(&read_back, &keel);
    assert_eq!(both.of(Rule::SplitsMultiply).len(), 1, "{both:#?}");
}

#[test]
fn subsets_without_any_weight_are_refused_by_export() {
    let keel = policies(
        r#"
[dependencies.payments]
host = "payments"
[[dependencies.payments.subsets]]
name = "stable"
weight = 0
"#,
    );
    assert!(export(&keel, "payments").is_err());
}
