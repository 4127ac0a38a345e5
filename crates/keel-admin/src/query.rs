//! The admin API's list filters, as they arrive in query strings, and their
//! checks: an unknown status, key or a limit out of range is a `400` that
//! names the valid values, never an empty list that looks like good news.

use chrono::TimeDelta;
use keel_store::{DeadLetterFilter, DeadLetterStatus, ParkedFilter, SagaFilter, SagaStatus};
#[cfg(feature = "webhooks")]
use keel_store::{DeliveryFilter, DeliveryStatus};
use serde::{Deserialize, Serialize};

use super::AdminError;

/// How many items a list returns without `limit`: 100.
pub const DEFAULT_LIMIT: usize = 100;
/// The largest `limit` accepted: 1000.
pub const MAX_LIMIT: usize = 1000;

/// `GET /admin/api/dead-letters` filters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterQuery {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this error kind (`permanent`, `too_many_attempts`, ...).
    pub kind: Option<String>,
    /// `pending` (default), `replayed`, `discarded` or `any`.
    pub status: Option<String>,
    /// At most this many (default [`DEFAULT_LIMIT`], at most [`MAX_LIMIT`]).
    pub limit: Option<String>,
}

impl DeadLetterQuery {
    /// The store filter, or a `400` saying what is wrong.
    pub fn filter(&self) -> Result<DeadLetterFilter, AdminError> {
        let status = match self.status.as_deref() {
            None | Some("") => Some(DeadLetterStatus::Pending),
            Some("any") => None,
            Some(s) => Some(DeadLetterStatus::parse(s).ok_or_else(|| {
                AdminError::bad_request(format!(
                    "unknown dead-letter status `{s}`: use pending, replayed, discarded or any"
                ))
            })?),
        };
        Ok(DeadLetterFilter {
            topic: non_empty(&self.topic),
            error_kind: non_empty(&self.kind),
            status,
            limit: Some(limit(self.limit.as_deref())?),
        })
    }

    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(topic) = non_empty(&self.topic) {
            parts.push(format!("topic={topic}"));
        }
        if let Some(kind) = non_empty(&self.kind) {
            parts.push(format!("kind={kind}"));
        }
        if parts.is_empty() {
            "all pending".to_owned()
        } else {
            parts.join(",")
        }
    }
}

/// `GET /admin/api/outbox/parked` filters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParkedQuery {
    /// Only this topic.
    pub topic: Option<String>,
    /// At most this many (default [`DEFAULT_LIMIT`], at most [`MAX_LIMIT`]).
    pub limit: Option<String>,
}

impl ParkedQuery {
    /// The store filter, or a `400` saying what is wrong.
    pub fn filter(&self) -> Result<ParkedFilter, AdminError> {
        Ok(ParkedFilter {
            topic: non_empty(&self.topic),
            limit: Some(limit(self.limit.as_deref())?),
        })
    }
}

/// `GET /admin/api/sagas` filters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SagaQuery {
    /// `running`, `compensating`, `completed`, `compensated`, `stuck` or
    /// `cancelled` (default: any).
    pub status: Option<String>,
    /// Only sagas unchanged for at least this many seconds.
    pub idle_secs: Option<String>,
    /// At most this many (default [`DEFAULT_LIMIT`], at most [`MAX_LIMIT`]).
    pub limit: Option<String>,
}

impl SagaQuery {
    /// Sagas in `status`.
    pub fn status(status: SagaStatus) -> Self {
        Self {
            status: Some(status.as_str().to_owned()),
            ..Self::default()
        }
    }

    /// The store filter, or a `400` saying what is wrong.
    pub fn filter(&self) -> Result<SagaFilter, AdminError> {
        let status = match non_empty(&self.status) {
            None => None,
            Some(s) => Some(SagaStatus::parse(&s).ok_or_else(|| {
                AdminError::bad_request(format!(
                    "unknown saga status `{s}`: use running, compensating, completed, \
                     compensated, stuck or cancelled"
                ))
            })?),
        };
        let updated_before = match non_empty(&self.idle_secs) {
            None => None,
            Some(s) => {
                let secs: i64 = s
                    .parse()
                    .ok()
                    .filter(|n| (0..=10 * 365 * 86_400).contains(n))
                    .ok_or_else(|| {
                        AdminError::bad_request(format!(
                            "idle_secs `{s}` is not a number of seconds between 0 and ten years"
                        ))
                    })?;
                Some(keel_core::clock::utc_now() - TimeDelta::seconds(secs))
            }
        };
        Ok(SagaFilter {
            status,
            updated_before,
            limit: Some(limit(self.limit.as_deref())?),
        })
    }
}

#[cfg(feature = "webhooks")]
/// `GET /admin/api/webhook-deliveries` filters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliveryQuery {
    /// Only this endpoint's.
    pub endpoint: Option<String>,
    /// `pending`, `succeeded`, `failed` or `disabled` (default: any).
    pub status: Option<String>,
    /// Only this event's.
    pub event: Option<String>,
    /// Only deliveries with a smaller id (paging, newest first).
    pub before: Option<String>,
    /// At most this many (default [`DEFAULT_LIMIT`], at most [`MAX_LIMIT`]).
    pub limit: Option<String>,
}

#[cfg(feature = "webhooks")]
impl DeliveryQuery {
    /// The store filter, or a `400` saying what is wrong.
    pub fn filter(&self) -> Result<DeliveryFilter, AdminError> {
        let status = match non_empty(&self.status) {
            None => None,
            Some(s) => Some(DeliveryStatus::parse(&s).ok_or_else(|| {
                AdminError::bad_request(format!(
                    "unknown delivery status `{s}`: use pending, succeeded, failed or disabled"
                ))
            })?),
        };
        let before_id = match non_empty(&self.before) {
            None => None,
            Some(s) => Some(s.parse().map_err(|_| {
                AdminError::bad_request(format!("before `{s}` is not a delivery id"))
            })?),
        };
        Ok(DeliveryFilter {
            endpoint_id: non_empty(&self.endpoint),
            event_id: non_empty(&self.event),
            status,
            before_id,
            limit: Some(limit(self.limit.as_deref())?),
            ..DeliveryFilter::default()
        })
    }
}

fn non_empty(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

fn limit(value: Option<&str>) -> Result<usize, AdminError> {
    match value.filter(|v| !v.is_empty()) {
        None => Ok(DEFAULT_LIMIT),
        Some(v) => v
            .parse()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                AdminError::bad_request(format!(
                    "limit `{v}` must be a whole number from 1 to {MAX_LIMIT}"
                ))
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_default_sensibly_and_refuse_nonsense() {
        let f = DeadLetterQuery::default().filter().unwrap();
        assert_eq!(f.status, Some(DeadLetterStatus::Pending));
        assert_eq!(f.limit, Some(DEFAULT_LIMIT));
        let any = DeadLetterQuery {
            status: Some("any".into()),
            ..Default::default()
        };
        assert_eq!(any.filter().unwrap().status, None);
        for bad in ["0", "-1", "1001", "ten"] {
            let q = DeadLetterQuery {
                limit: Some(bad.into()),
                ..Default::default()
            };
            assert!(
                matches!(q.filter(), Err(AdminError::BadRequest(_))),
                "{bad}"
            );
        }
        let q = SagaQuery {
            status: Some("sleeping".into()),
            ..Default::default()
        };
        assert!(q.filter().unwrap_err().to_string().contains("stuck"));
        #[cfg(feature = "webhooks")]
        {
            let q = DeliveryQuery {
                before: Some("x".into()),
                ..Default::default()
            };
            assert!(matches!(q.filter(), Err(AdminError::BadRequest(_))));
        }
        assert_eq!(
            SagaQuery::status(SagaStatus::Stuck)
                .filter()
                .unwrap()
                .status,
            Some(SagaStatus::Stuck)
        );
    }
}
