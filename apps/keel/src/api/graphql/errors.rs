//! Errors as GraphQL errors that carry Keel's error classes: the same
//! problem a REST route would answer (one place where errors become
//! statuses, [`Problem`]), in the error's `extensions`.

use async_graphql::{Error, ErrorExtensions, ServerError, Value};
use keel_core::{Classify, ErrorClass};
use keel_http::pagination::PageRejection;
use keel_http::problem::Problem;
use keel_store::StoreError;

/// `extensions.type` of an error in the query itself (it does not parse,
/// or breaks a limit).
pub const INVALID_QUERY: &str = "graphql:invalid_query";

fn class_name(class: ErrorClass) -> String {
    serde_json::to_value(class)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "unclassified".to_owned())
}

/// The GraphQL error for `problem`, of `class`: `extensions` has `class`,
/// `type`, `status` and, when the client should come back, `retryAfterMs`.
pub(super) fn problem_error(problem: &Problem, class: ErrorClass) -> Error {
    let message = problem
        .detail
        .clone()
        .unwrap_or_else(|| problem.title.clone());
    Error::new(message).extend_with(|_, extensions| {
        extensions.set("class", class_name(class));
        extensions.set("type", problem.kind.clone());
        extensions.set("status", i64::from(problem.status));
        if let Some(after) = problem.retry_after {
            extensions.set(
                "retryAfterMs",
                i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
            );
        }
    })
}

/// A store failure, as `Problem::from_store` reports it.
pub(super) fn store_error(error: &StoreError) -> Error {
    problem_error(&Problem::from_store(error), error.class())
}

/// A refused page request (bad cursor, `first` out of range).
pub(super) fn page_error(rejection: &PageRejection) -> Error {
    problem_error(&rejection.problem(), ErrorClass::Permanent)
}

/// Gives an error async-graphql raised itself (the query does not parse,
/// is too deep or too complex, names an unknown field) the same
/// extensions: permanent, `400`.
pub(super) fn classify_query_error(error: &mut ServerError) {
    if error
        .extensions
        .as_ref()
        .is_some_and(|e| e.get("class").is_some())
    {
        return;
    }
    let extensions = error.extensions.get_or_insert_with(Default::default);
    extensions.set("class", class_name(ErrorClass::Permanent));
    extensions.set("type", Value::from(INVALID_QUERY));
    extensions.set("status", 400_i64);
}
