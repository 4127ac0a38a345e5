//! The history as the admin API answers it: column-wise, one array of
//! times and one array per measure, ready to plot.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use super::Resolution;
use super::series::{Ring, SubjectKind};

/// `GET /admin/api/history`'s query: `resolution=fine|coarse` (default
/// fine), and optionally `kind` (`consumer_group`, `dependency`, `outbox`,
/// `order`) and `name` to read one subject.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HistoryQuery {
    /// Which ring to read.
    #[serde(default, deserialize_with = "resolution")]
    pub resolution: Resolution,
    /// Only subjects of this kind.
    #[serde(default, deserialize_with = "kind")]
    pub kind: Option<SubjectKind>,
    /// Only the subject with this name.
    pub name: Option<String>,
}

impl HistoryQuery {
    /// Every subject at `resolution`.
    pub fn all(resolution: Resolution) -> Self {
        Self {
            resolution,
            ..Self::default()
        }
    }

    /// One subject at fine resolution.
    pub fn subject(kind: SubjectKind, name: &str) -> Self {
        Self {
            kind: Some(kind),
            name: Some(name.to_owned()),
            ..Self::default()
        }
    }

    pub(crate) fn matches(&self, kind: SubjectKind, name: &str) -> bool {
        self.kind.is_none_or(|k| k == kind) && self.name.as_deref().is_none_or(|n| n == name)
    }
}

fn resolution<'de, D: Deserializer<'de>>(d: D) -> Result<Resolution, D::Error> {
    match String::deserialize(d)?.as_str() {
        "fine" => Ok(Resolution::Fine),
        "coarse" => Ok(Resolution::Coarse),
        other => Err(serde::de::Error::custom(format!(
            "unknown resolution `{other}` (fine or coarse)"
        ))),
    }
}

fn kind<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SubjectKind>, D::Error> {
    let name = String::deserialize(d)?;
    SubjectKind::parse(&name).map(Some).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "unknown kind `{name}` (consumer_group, dependency, outbox or order)"
        ))
    })
}

/// The history at one resolution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryJson {
    /// `fine` or `coarse`.
    pub resolution: &'static str,
    /// Seconds between points.
    pub interval_seconds: f64,
    /// Every subject kept, by kind then name.
    pub subjects: Vec<SubjectJson>,
    /// Subjects the latest sample saw but could not keep, past the bound
    /// on subjects.
    pub dropped_subjects: u64,
}

/// One subject's points, column-wise: `at[i]` is when the values at `i`
/// of every series were taken. A value is `null` where the interval had
/// nothing to measure (no call to take a percentile of).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubjectJson {
    /// What the subject is.
    pub kind: SubjectKind,
    /// The group's, dependency's or outbox's name.
    pub name: String,
    /// Unix milliseconds of each point, oldest first.
    pub at: Vec<u64>,
    /// One array per measure of the kind, by the measure's name.
    pub series: BTreeMap<&'static str, Vec<Option<f64>>>,
}

impl SubjectJson {
    pub(crate) fn new(kind: SubjectKind, name: &str, ring: &Ring) -> Self {
        let at = ring.points().map(|p| p.at_ms).collect();
        let series = kind
            .measures()
            .iter()
            .enumerate()
            .map(|(i, measure)| {
                let values = ring
                    .points()
                    .map(|p| Some(p.values[i]).filter(|v| v.is_finite()))
                    .collect();
                (measure.as_str(), values)
            })
            .collect();
        Self {
            kind,
            name: name.to_owned(),
            at,
            series,
        }
    }

    /// The series of `measure`, `None` where unknown (empty if the kind
    /// has no such measure).
    pub fn values(&self, measure: super::Measure) -> &[Option<f64>] {
        self.series
            .get(measure.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}
