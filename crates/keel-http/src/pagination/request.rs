//! [`PageRequest`] (the extractor), [`Page`] (the response) and their
//! configuration, [`Pagination`].

use axum::Json;
use axum::extract::{FromRef, FromRequestParts, Query};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::cursor::{Cursor, CursorCodec, CursorError};
use crate::problem::Problem;

/// The page size when the request names none: 20.
pub const DEFAULT_LIMIT: u32 = 20;

/// The largest page size a request may ask for: 100.
pub const DEFAULT_MAX_LIMIT: u32 = 100;

/// The query parameter carrying the cursor.
pub const CURSOR_PARAM: &str = "cursor";

/// The query parameter carrying the page size.
pub const LIMIT_PARAM: &str = "limit";

/// How lists are paginated: the cursor codec and the page-size bounds.
/// Put it in your router state (anything it can be taken from with
/// [`FromRef`]) so [`PageRequest`] can be extracted. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Pagination {
    codec: CursorCodec,
    default_limit: u32,
    max_limit: u32,
}

impl Pagination {
    /// Pagination with `codec`, pages of [`DEFAULT_LIMIT`] up to
    /// [`DEFAULT_MAX_LIMIT`].
    pub fn new(codec: CursorCodec) -> Self {
        Self {
            codec,
            default_limit: DEFAULT_LIMIT,
            max_limit: DEFAULT_MAX_LIMIT,
        }
    }

    /// Sets the page size without `limit` and the largest `limit` allowed.
    /// Refused unless `1 <= default <= max`.
    pub fn with_limits(mut self, default: u32, max: u32) -> Result<Self, InvalidLimits> {
        if default == 0 || default > max {
            return Err(InvalidLimits { default, max });
        }
        self.default_limit = default;
        self.max_limit = max;
        Ok(self)
    }

    /// The cursor codec.
    pub fn codec(&self) -> &CursorCodec {
        &self.codec
    }

    /// The page size without `limit`.
    pub fn default_limit(&self) -> u32 {
        self.default_limit
    }

    /// The largest `limit` allowed.
    pub fn max_limit(&self) -> u32 {
        self.max_limit
    }

    /// Reads a page request from a URI's query (`limit`, `cursor`), for the
    /// list named `scope`. What the [`PageRequest`] extractor does, for
    /// callers that build the scope themselves.
    pub fn parse<S, I>(
        &self,
        uri: &axum::http::Uri,
        scope: String,
    ) -> Result<PageRequest<S, I>, PageRejection>
    where
        S: DeserializeOwned,
        I: DeserializeOwned,
    {
        let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(uri)
            .map_err(|e| PageRejection::InvalidQuery(e.body_text()))?;
        let mut limit = None;
        let mut cursor = None;
        for (name, value) in pairs {
            let slot = match name.as_str() {
                LIMIT_PARAM => &mut limit,
                CURSOR_PARAM => &mut cursor,
                _ => continue,
            };
            if slot.replace(value).is_some() {
                return Err(PageRejection::InvalidQuery(format!(
                    "`{name}` is given more than once"
                )));
            }
        }
        let limit = limit
            .map(|raw| {
                raw.trim()
                    .parse::<i64>()
                    .map_err(|_| PageRejection::InvalidLimit {
                        value: raw.chars().take(32).collect(),
                    })
            })
            .transpose()?;
        self.request(scope, limit, cursor.as_deref())
    }

    /// A page request for the list named `scope` (see [`list_scope`]) from
    /// a limit and a cursor that came some other way than a query string
    /// (a GraphQL connection's `first` and `after`), under the same rules:
    /// the limit within `1..=max`, the cursor signed for this scope.
    pub fn request<S, I>(
        &self,
        scope: String,
        limit: Option<i64>,
        cursor: Option<&str>,
    ) -> Result<PageRequest<S, I>, PageRejection>
    where
        S: DeserializeOwned,
        I: DeserializeOwned,
    {
        let limit = match limit {
            None => self.default_limit,
            Some(asked) => {
                if asked < 1 || asked > i64::from(self.max_limit) {
                    return Err(PageRejection::LimitOutOfRange {
                        limit: asked,
                        max: self.max_limit,
                    });
                }
                u32::try_from(asked).unwrap_or(self.max_limit)
            }
        };
        let after = match cursor {
            None | Some("") => None,
            Some(raw) => Some(
                self.codec
                    .decode::<Cursor<S, I>>(&scope, raw)
                    .map_err(PageRejection::InvalidCursor)?,
            ),
        };
        Ok(PageRequest {
            limit,
            after,
            codec: self.codec.clone(),
            scope,
        })
    }
}

/// Page-size bounds that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("page size bounds need 1 <= default ({default}) <= max ({max})")]
pub struct InvalidLimits {
    /// The default given.
    pub default: u32,
    /// The maximum given.
    pub max: u32,
}

/// The scope of a request's cursors: its path and its other query
/// parameters (sorted), so a cursor only works on the listing it came from,
/// with the same filters and sort.
fn scope_of(parts: &Parts) -> String {
    let pairs = Query::<Vec<(String, String)>>::try_from_uri(&parts.uri)
        .map(|Query(pairs)| pairs)
        .unwrap_or_default();
    list_scope(parts.uri.path(), pairs)
}

/// The scope cursors of a list are bound to: its path and its filters
/// (the query parameters other than `cursor` and `limit`), in any order.
/// A cursor made for one scope is refused by any other; another API over
/// the same list (GraphQL) that names the same path and filters shares the
/// REST cursors.
pub fn list_scope(path: &str, filters: impl IntoIterator<Item = (String, String)>) -> String {
    let mut pairs: Vec<(String, String)> = filters
        .into_iter()
        .filter(|(name, _)| name != CURSOR_PARAM && name != LIMIT_PARAM)
        .collect();
    pairs.sort();
    let mut scope = path.to_owned();
    for (name, value) in pairs {
        scope.push('\n');
        scope.push_str(&name);
        scope.push('=');
        scope.push_str(&value);
    }
    scope
}

/// A request for one page of a keyset-paginated list, from the query
/// string: `?limit=20&cursor=...`.
///
/// `limit` defaults to 20 and must be 1 to 100 ([`Pagination`] sets both);
/// `cursor` is the `nextCursor` of the previous page. Every violation is a
/// `400` problem ([`PageRejection`]). The cursor is bound to the request's
/// path and its other query parameters: one issued for `/orders?status=open`
/// is refused by `/customers` and by `/orders?status=paid`.
///
/// `S` and `I` are the types of the sort key and the id.
#[derive(Debug, Clone)]
pub struct PageRequest<S, I> {
    limit: u32,
    after: Option<Cursor<S, I>>,
    codec: CursorCodec,
    scope: String,
}

impl<S, I> PageRequest<S, I> {
    /// The page size asked for.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// How many rows to fetch: `limit + 1`. The extra row tells whether
    /// there is a next page without a second query (see [`Page`]).
    pub fn fetch_limit(&self) -> u32 {
        self.limit.saturating_add(1)
    }

    /// The position to seek past; `None` on the first page.
    pub fn after(&self) -> Option<&Cursor<S, I>> {
        self.after.as_ref()
    }

    /// The scope cursors of this request are bound to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The page from the rows fetched with [`fetch_limit`](Self::fetch_limit)
    /// (in list order), where `position` gives a row's sort key and id.
    pub fn page<T>(
        &self,
        mut rows: Vec<T>,
        position: impl Fn(&T) -> Cursor<S, I>,
    ) -> Result<Page<T>, CursorError>
    where
        S: Serialize,
        I: Serialize,
    {
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let more = rows.len() > limit;
        rows.truncate(limit);
        let next_cursor = match rows.last() {
            Some(last) if more => Some(self.codec.encode(&self.scope, &position(last))?),
            _ => None,
        };
        Ok(Page {
            items: rows,
            next_cursor,
        })
    }
}

impl<St, S, I> FromRequestParts<St> for PageRequest<S, I>
where
    Pagination: FromRef<St>,
    St: Send + Sync,
    S: DeserializeOwned + Send,
    I: DeserializeOwned + Send,
{
    type Rejection = PageRejection;

    async fn from_request_parts(parts: &mut Parts, state: &St) -> Result<Self, Self::Rejection> {
        let pagination = Pagination::from_ref(state);
        let scope = scope_of(parts);
        pagination.parse(&parts.uri, scope)
    }
}

/// One page of a list: `{"items": [...], "nextCursor": "..." | null}`.
///
/// `nextCursor` is `null` on the last page, *including* a last page that
/// happens to be full. The common `len(rows) == limit` rule hands out a
/// cursor on a full last page, which costs the client one more request for
/// an empty page; fetching `limit + 1` rows
/// ([`PageRequest::fetch_limit`]) answers "is there more?" for free.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Page<T> {
    /// The rows of this page, in list order.
    pub items: Vec<T>,
    /// The cursor of the next page; `None` at the end.
    pub next_cursor: Option<String>,
}

impl<T: Serialize> IntoResponse for Page<T> {
    fn into_response(self) -> Response {
        Json(self).into_response()
    }
}

impl IntoResponse for CursorError {
    /// Only an encoding failure reaches a response this way (a bug in the
    /// position type): `500`. Decoding failures are [`PageRejection`]s.
    fn into_response(self) -> Response {
        match self {
            Self::Encode(_) => Problem::internal(&self).into_response(),
            other => PageRejection::InvalidCursor(other).into_response(),
        }
    }
}

/// Why a [`PageRequest`] could not be extracted: always `400`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PageRejection {
    /// The query string does not parse, or repeats a parameter.
    #[error("invalid query string: {0}")]
    InvalidQuery(String),
    /// `limit` is not an integer.
    #[error("invalid limit {value:?}: give a whole number")]
    InvalidLimit {
        /// The value given (at most 32 characters of it).
        value: String,
    },
    /// `limit` is outside `1..=max`.
    #[error("limit {limit} is out of range: use 1 to {max}")]
    LimitOutOfRange {
        /// The limit given.
        limit: i64,
        /// The largest allowed.
        max: u32,
    },
    /// The cursor is not one this server issued for this list.
    #[error(
        "invalid cursor: {0}; use the nextCursor of the previous page, or omit it to start over"
    )]
    InvalidCursor(CursorError),
}

impl PageRejection {
    /// The `400` problem for this refusal (counted), for any API that
    /// reports it: the REST extractor, a GraphQL error's extensions.
    pub fn problem(&self) -> Problem {
        metrics::counter!("keel_pagination_rejected_total", "reason" => self.kind()).increment(1);
        tracing::debug!(reason = self.kind(), error = %self, "page request refused");
        Problem::new(StatusCode::BAD_REQUEST, self.to_string())
            .typed(&format!("pagination:{}", self.kind()))
    }

    /// A short name for metrics and the problem type.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidQuery(_) => "invalid-query",
            Self::InvalidLimit { .. } | Self::LimitOutOfRange { .. } => "invalid-limit",
            Self::InvalidCursor(_) => "invalid-cursor",
        }
    }
}

impl IntoResponse for PageRejection {
    fn into_response(self) -> Response {
        self.problem().into_response()
    }
}
