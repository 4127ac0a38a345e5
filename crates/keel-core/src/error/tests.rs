use super::*;

#[derive(Debug, thiserror::Error)]
#[error("outer")]
struct Outer(#[source] std::io::Error);

#[test]
fn classify_walks_causes() {
    let err = Outer(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    assert_eq!(classify(&err), ErrorClass::OutcomeUnknown);
    assert_eq!(report(&err), "outer: connection reset");
}

#[test]
fn a_classified_error_is_reported_once_and_its_cause_stays_findable() {
    let err = Classified::permanent(Rejected::DeadlineExceeded);
    assert_eq!(report(&err), Rejected::DeadlineExceeded.to_string());
    assert!(find_cause::<Rejected>(&err).is_some());
}

#[derive(Debug, thiserror::Error)]
#[error("something nobody foresaw")]
struct Unforeseen;

#[test]
fn errors_nobody_classified_are_unclassified_and_count_against_the_dependency() {
    assert_eq!(classify(&std::fmt::Error), ErrorClass::Unclassified);
    let boxed: BoxError = Box::new(Unforeseen);
    assert_eq!(boxed.class(), ErrorClass::Unclassified);
    assert!(ErrorClass::Unclassified.is_dependency_failure());
    // The caller's own fault, said so, is not held against the dependency.
    let invalid = Classified::permanent(Unforeseen);
    assert_eq!(classify(&invalid), ErrorClass::Permanent);
    assert!(!ErrorClass::Permanent.is_dependency_failure());
}

#[test]
fn io_errors_say_what_their_kind_says_and_look_through_other() {
    use std::io::{Error, ErrorKind};
    assert_eq!(
        Error::from(ErrorKind::NotFound).class(),
        ErrorClass::Permanent
    );
    assert_eq!(
        Error::from(ErrorKind::InvalidData).class(),
        ErrorClass::Permanent
    );
    // `Other` says nothing: the wrapped error decides, or nobody did.
    assert_eq!(Error::other(Unforeseen).class(), ErrorClass::Unclassified);
    assert_eq!(
        Error::other(Classified::retryable(Unforeseen)).class(),
        ErrorClass::Retryable
    );
    let wrapped = Outer(Error::other(Classified::permanent(Unforeseen)));
    assert_eq!(classify(&wrapped), ErrorClass::Permanent);
}

#[tokio::test(start_paused = true)]
async fn refusals_are_not_dependency_failures() {
    let r = Rejected::circuit_open("payments", Duration::from_secs(3));
    assert_eq!(r.class(), ErrorClass::Rejected);
    assert!(!r.class().is_dependency_failure());
    assert_eq!(r.retry_after(), Some(Duration::from_secs(3)));
    assert!(r.to_string().contains("payments"));
    // The wait is as of when it is asked for, down to zero.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(r.retry_after(), Some(Duration::from_secs(1)));
    assert!(r.to_string().contains("for 1s more"), "{r}");
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(r.retry_after(), Some(Duration::ZERO));
    let timeout = Rejected::Timeout {
        name: "payments".into(),
        after: Duration::from_millis(5),
    };
    assert!(timeout.class().is_dependency_failure());
}

#[test]
fn boxed_policy_errors_are_classified() {
    let err = PolicyError::<BoxError>::Rejected(Rejected::DeadlineExceeded).into_box_error();
    assert_eq!(err.class(), ErrorClass::Rejected);
    let nested: PolicyError<PolicyError<std::io::Error>> =
        PolicyError::Inner(PolicyError::Inner(std::io::ErrorKind::TimedOut.into()));
    assert_eq!(nested.flatten().class(), ErrorClass::OutcomeUnknown);
}
