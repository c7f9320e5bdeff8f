//! Extractors that turn every bad request into the server's JSON error:
//! [`JsonBody`] (size limit, JSON syntax, field types, unknown fields, each
//! message naming the field path), [`PathParam`] and [`QueryParams`]. They
//! must never let axum's plain-text rejections through.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body; an empty body reads as `{}`.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            let status = r.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    status,
                    format!("request body is over the server's limit: {}", r.body_text()),
                )
            } else {
                ApiError::new(
                    status,
                    format!("reading the request body: {}", r.body_text()),
                )
            }
        })?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        // The common case parses once, untracked; only a body that fails is
        // parsed again with path tracking, for the error to name the field.
        if let Ok(value) = serde_json::from_slice::<T>(text) {
            return Ok(JsonBody(value));
        }
        let mut de = serde_json::Deserializer::from_slice(text);
        let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." || path.is_empty() {
                ApiError::bad(format!("invalid JSON body: {inner}"))
            } else {
                ApiError::bad(format!("invalid JSON body: field `{path}`: {inner}"))
            }
        })?;
        de.end()
            .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?;
        Ok(JsonBody(value))
    }
}

/// One path segment.
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(v) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::bad(format!("path: {}", r.body_text())))?;
        Ok(PathParam(v))
    }
}

/// Query-string parameters.
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(v) = Query::<T>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::bad(format!("query string: {}", r.body_text())))?;
        Ok(QueryParams(v))
    }
}
