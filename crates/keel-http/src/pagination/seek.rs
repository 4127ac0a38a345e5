//! The SQL of a keyset seek: `WHERE (sort, id) < (?, ?) ORDER BY sort DESC,
//! id DESC`, for either direction.

use serde::{Deserialize, Serialize};

/// The direction a list is sorted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Oldest (smallest) first; the next page is `> cursor`.
    Asc,
    /// Newest (largest) first; the next page is `< cursor`. The usual
    /// order of feeds and order histories.
    #[default]
    Desc,
}

impl Order {
    /// The other direction (to page backwards: seek the reversed order from
    /// the first row shown, then reverse the rows).
    pub fn reverse(self) -> Self {
        match self {
            Self::Asc => Self::Desc,
            Self::Desc => Self::Asc,
        }
    }

    /// The comparison that finds the rows after a cursor.
    pub fn operator(self) -> &'static str {
        match self {
            Self::Asc => ">",
            Self::Desc => "<",
        }
    }

    /// `ASC` or `DESC`.
    pub fn keyword(self) -> &'static str {
        match self {
            Self::Asc => "ASC",
            Self::Desc => "DESC",
        }
    }
}

/// A column name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a plain column name (letters, digits, `_`, optionally `table.`): seek columns \
     are pasted into SQL, so they must come from code, never from a request"
)]
pub struct InvalidColumn(pub String);

/// The SQL for seeking past a [`Cursor`](super::Cursor) on a `(sort, id)`
/// key, which must be backed by an index on `(sort, id)` (or `(sort DESC,
/// id DESC)`) so the database seeks instead of scanning.
///
/// Never `OFFSET`: an offset makes the database count and discard every row
/// before the page, and shifts under inserts so a client sees a row twice
/// or never. A seek costs the same on page 1 and page 10,000,
/// and rows inserted meanwhile never shift the rows after the cursor.
///
/// ```
/// use keel_http::pagination::{Order, Seek};
///
/// let seek = Seek::new("created_at", "id", Order::Desc)?;
/// assert_eq!(seek.predicate("?1", "?2"), "(created_at, id) < (?1, ?2)");
/// assert_eq!(seek.order_by(), "created_at DESC, id DESC");
/// let sql = format!(
///     "SELECT id, created_at FROM orders WHERE {} ORDER BY {} LIMIT ?3",
///     seek.predicate("?1", "?2"),
///     seek.order_by(),
/// );
/// # let _ = sql;
/// # Ok::<(), keel_http::pagination::InvalidColumn>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seek {
    sort: String,
    id: String,
    order: Order,
}

impl Seek {
    /// A seek on `sort_column` then `id_column`, in `order`. Refuses names
    /// that are not plain identifiers (they are pasted into SQL).
    pub fn new(sort_column: &str, id_column: &str, order: Order) -> Result<Self, InvalidColumn> {
        Ok(Self {
            sort: identifier(sort_column)?,
            id: identifier(id_column)?,
            order,
        })
    }

    /// The direction.
    pub fn order(&self) -> Order {
        self.order
    }

    /// The same seek in the other direction.
    pub fn reversed(&self) -> Self {
        Self {
            order: self.order.reverse(),
            ..self.clone()
        }
    }

    /// The row-value predicate, `(sort, id) < (p1, p2)` (or `>` ascending),
    /// with your driver's placeholders for the cursor's sort key and id.
    /// Row values work on SQLite (3.15+), PostgreSQL and MySQL, and
    /// PostgreSQL uses an index on `(sort, id)` for them directly.
    pub fn predicate(&self, sort_placeholder: &str, id_placeholder: &str) -> String {
        format!(
            "({}, {}) {} ({sort_placeholder}, {id_placeholder})",
            self.sort,
            self.id,
            self.order.operator()
        )
    }

    /// The same predicate without row values, `(sort < p1 OR (sort = p1
    /// AND id < p2))`, for databases without them. `sort_placeholder`
    /// appears twice, so use numbered placeholders (`?1`, `$1`).
    pub fn predicate_expanded(&self, sort_placeholder: &str, id_placeholder: &str) -> String {
        let op = self.order.operator();
        format!(
            "({sort} {op} {sort_placeholder} OR ({sort} = {sort_placeholder} AND {id} {op} \
             {id_placeholder}))",
            sort = self.sort,
            id = self.id,
        )
    }

    /// The `ORDER BY` list: `sort DESC, id DESC` (or ascending).
    pub fn order_by(&self) -> String {
        let dir = self.order.keyword();
        format!("{} {dir}, {} {dir}", self.sort, self.id)
    }
}

fn identifier(name: &str) -> Result<String, InvalidColumn> {
    let plain = |part: &str| {
        let mut chars = part.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let ok = match name.split_once('.') {
        Some((table, column)) => plain(table) && plain(column),
        None => plain(name),
    };
    if ok {
        Ok(name.to_owned())
    } else {
        Err(InvalidColumn(name.to_owned()))
    }
}
