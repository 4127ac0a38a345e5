//! List queries with only the conditions a filter sets.
//!
//! Each combination of conditions is its own statement text, so each can
//! use its index and is prepared and cached on its own; an unset condition
//! costs nothing (no `$1 IS NULL OR ...`, which also needs a type cast on
//! PostgreSQL).

use crate::dialect::Value;

/// The `WHERE` clause and parameters of a list query, built condition by
/// condition.
#[derive(Debug, Default)]
pub struct Filter<'a> {
    conditions: Vec<String>,
    params: Vec<Value<'a>>,
}

impl<'a> Filter<'a> {
    /// No conditions yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `<left> $n` (for example `"topic ="`) with `value` as `$n`, if
    /// the filter sets it.
    pub fn and<V: Into<Value<'a>>>(&mut self, left: &str, value: Option<V>) -> &mut Self {
        if let Some(value) = value {
            let placeholder = self.param(value);
            self.conditions.push(format!("{left} {placeholder}"));
        }
        self
    }

    /// Adds `<column> IN ($n, $n+1, ...)` with one parameter per value (a
    /// batch lookup by keys); no values is a condition no row meets.
    pub fn and_in<V: Into<Value<'a>>>(
        &mut self,
        column: &str,
        values: impl IntoIterator<Item = V>,
    ) -> &mut Self {
        let placeholders: Vec<String> = values.into_iter().map(|v| self.param(v)).collect();
        self.conditions.push(if placeholders.is_empty() {
            "1 = 0".to_owned()
        } else {
            format!("{column} IN ({})", placeholders.join(", "))
        });
        self
    }

    /// Adds a parameter that is not a condition (a limit) and returns its
    /// placeholder.
    pub fn param(&mut self, value: impl Into<Value<'a>>) -> String {
        self.params.push(value.into());
        format!("${}", self.params.len())
    }

    /// `WHERE c1 AND c2 ...`, or nothing.
    pub fn where_clause(&self) -> String {
        if self.conditions.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", self.conditions.join(" AND "))
        }
    }

    /// The parameters, in placeholder order.
    pub fn params(&self) -> &[Value<'a>] {
        &self.params
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_set_conditions_are_written_and_numbered_in_order() {
        let mut filter = Filter::new();
        filter
            .and("topic =", Some("orders"))
            .and("status =", None::<&str>)
            .and("id <", Some(7_i64));
        let limit = filter.param(100_i64);
        assert_eq!(filter.where_clause(), "WHERE topic = $1 AND id < $2");
        assert_eq!(limit, "$3");
        assert_eq!(
            filter.params(),
            &[
                Value::from("orders"),
                Value::from(7_i64),
                Value::from(100_i64)
            ]
        );
        assert_eq!(Filter::new().where_clause(), "");
    }

    #[test]
    fn a_key_list_is_one_placeholder_per_key_and_an_empty_one_matches_nothing() {
        let mut filter = Filter::new();
        filter.and("kind =", Some("order")).and_in("id", ["a", "b"]);
        assert_eq!(filter.where_clause(), "WHERE kind = $1 AND id IN ($2, $3)");
        let mut empty = Filter::new();
        empty.and_in("id", Vec::<&str>::new());
        assert_eq!(empty.where_clause(), "WHERE 1 = 0");
    }
}
