//! JSON request bodies whose every refusal is a problem: `415` for another
//! media type, `413` past the body limit, `400` for malformed JSON, `422`
//! for JSON that does not fit the type.
//!
//! axum's own `Json` answers its rejections in plain text; a client of a
//! problem+json API must not have to parse two error formats.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;

use super::Problem;

/// A JSON request body, read as `T`, refused with a [`Problem`].
///
/// The body limit is axum's (`DefaultBodyLimit`, 2 MiB unless changed); a
/// larger body is a `413` problem.
///
/// ```
/// use axum::{Router, routing::post};
/// use keel_http::problem::JsonBody;
///
/// #[derive(serde::Deserialize)]
/// struct NewOrder { sku: String, quantity: u32 }
///
/// async fn place(JsonBody(order): JsonBody<NewOrder>) -> String {
///     format!("{} x {}", order.quantity, order.sku)
/// }
///
/// let app: Router = Router::new().route("/orders", post(place));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        let headers = req.headers().clone();
        ensure_json(&headers)?;
        let body = Bytes::from_request(req, state)
            .await
            .map_err(|e| Problem::new(e.status(), e.body_text()).typed("unreadable_body"))?;
        parse_json(&headers, &body).map(Self)
    }
}

/// Reads `body` as JSON `T`, for a handler that also needs the raw bytes
/// (to fingerprint or verify them): the same refusals as [`JsonBody`].
pub fn parse_json<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, Problem> {
    ensure_json(headers)?;
    serde_json::from_slice(body).map_err(|e| {
        if e.is_data() {
            Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("the body does not fit the schema: {e}"),
            )
            .typed("invalid_body")
        } else {
            Problem::bad_request(format!("malformed JSON: {e}")).typed("malformed_json")
        }
    })
}

/// `application/json`, or any `+json` type, with or without parameters.
fn ensure_json(headers: &HeaderMap) -> Result<(), Problem> {
    let media = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|t| t.trim().to_ascii_lowercase());
    match media {
        Some(t)
            if t == "application/json"
                || (t.starts_with("application/") && t.ends_with("+json")) =>
        {
            Ok(())
        }
        _ => Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send JSON (Content-Type: application/json)",
        )
        .typed("unsupported_media_type")),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;

    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Order {
        #[allow(dead_code, reason = "read only to check the type")]
        quantity: u32,
    }

    async fn extract(content_type: Option<&str>, body: &'static str) -> Result<u32, Problem> {
        let mut request = Request::post("/");
        if let Some(t) = content_type {
            request = request.header(header::CONTENT_TYPE, t);
        }
        let request = request.body(Body::from(body)).unwrap();
        JsonBody::<Order>::from_request(request, &())
            .await
            .map(|JsonBody(o)| o.quantity)
    }

    #[tokio::test]
    async fn every_refusal_is_a_problem_with_its_status() {
        let json = Some("application/json; charset=utf-8");
        assert_eq!(extract(json, r#"{"quantity": 2}"#).await.unwrap(), 2);
        assert_eq!(
            extract(Some("application/merge-patch+json"), r#"{"quantity": 3}"#)
                .await
                .unwrap(),
            3
        );
        let cases = [
            (None, "{}", 415, "unsupported_media_type"),
            (
                Some("text/plain"),
                r#"{"quantity": 2}"#,
                415,
                "unsupported_media_type",
            ),
            (json, r#"{"quantity": "#, 400, "malformed_json"),
            (json, r#"{"quantity": -1}"#, 422, "invalid_body"),
        ];
        for (content_type, body, status, kind) in cases {
            let problem = extract(content_type, body).await.unwrap_err();
            assert_eq!(problem.status, status, "{content_type:?} {body}");
            assert_eq!(problem.kind, format!("urn:keel:problem:{kind}"));
        }
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_a_413_problem() {
        use axum::extract::DefaultBodyLimit;
        use axum::routing::post;
        use tower::ServiceExt;

        async fn take(JsonBody(_): JsonBody<serde_json::Value>) {}
        let app = axum::Router::new()
            .route("/", post(take))
            .layer(DefaultBodyLimit::max(16));
        let request = Request::post("/")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(format!("[{}]", "1,".repeat(20) + "1")))
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            super::super::PROBLEM_JSON
        );
    }
}
