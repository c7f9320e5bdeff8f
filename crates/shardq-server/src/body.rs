//! Extractors that turn every bad request into the server's JSON error:
//! [`JsonBody`] (size limit, JSON syntax, field types, unknown fields, each
//! message naming the field path), [`PathParam`] and [`QueryParams`]. They
//! must never let axum's plain-text rejections through.
//!
//! A body must arrive within its [`BodyReadTimeout`] (408 past it), and a
//! list in a body is a [`BoundedVec`], refused while it is parsed once it
//! holds more than its bound: a 16 MiB body of tiny items never becomes
//! millions of values in memory.

use std::marker::PhantomData;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body: a JSON object (anything else is refused with a
/// 400 naming it); an empty body reads as `{}`.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        // The body's bytes are reserved in the server's budget before it
        // is read, and given back once it is parsed.
        let _reserved = match req.extensions().get::<BodyBudget>() {
            Some(budget) => Some(budget.reserve(&req)?),
            None => None,
        };
        let timeout = req
            .extensions()
            .get::<BodyReadTimeout>()
            .map(|t| t.0)
            .unwrap_or(Duration::from_millis(
                crate::limits::BODY_READ_TIMEOUT_MS_DEFAULT,
            ));
        let read = tokio::time::timeout(timeout, Bytes::from_request(req, state))
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {} ms",
                        timeout.as_millis()
                    ),
                )
            })?;
        let bytes = read.map_err(|r| {
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
        // Every route's body is a JSON object: serde would read an array
        // into a struct by position (`[3, "5/s"]` as a policy), so anything
        // else is refused before it is parsed.
        let first = text.iter().find(|b| !b.is_ascii_whitespace());
        if first != Some(&b'{') {
            let shown = String::from_utf8_lossy(&text[..text.len().min(40)]).into_owned();
            return Err(ApiError::bad(format!(
                "invalid JSON body: expected a JSON object ({{...}}), got {shown:?}"
            )));
        }
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

/// The bytes of request bodies being read at once, over every request,
/// and their bound (a request extension set by the router).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    max: usize,
    /// What a body of unknown length (chunked) is counted as: the largest
    /// body.
    unknown: usize,
}

/// Bytes of a [`BodyBudget`] held by one request until dropped.
#[derive(Debug)]
pub struct Reserved {
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    bytes: usize,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.in_flight
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::SeqCst);
    }
}

impl BodyBudget {
    /// A budget of `max` bytes counted in `in_flight`; a body of unknown
    /// length counts as `body_bytes_max`.
    pub fn new(
        in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        max: usize,
        body_bytes_max: usize,
    ) -> BodyBudget {
        BodyBudget {
            in_flight,
            max,
            unknown: body_bytes_max,
        }
    }

    /// Reserves the body of `req` (its `Content-Length`, else the largest
    /// body); refused with 503 and `Retry-After` when it does not fit.
    pub fn reserve(&self, req: &Request) -> Result<Reserved, ApiError> {
        use std::sync::atomic::Ordering;
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let bytes = declared.unwrap_or(self.unknown).min(self.unknown);
        let mut now = self.in_flight.load(Ordering::SeqCst);
        loop {
            if now + bytes > self.max && bytes > 0 {
                return Err(ApiError::unavailable(format!(
                    "the server is reading {now} bytes of request bodies, and a body of {bytes} \
                     more is over its budget of {} bytes: retry shortly",
                    self.max
                ))
                .with("retry_after_s", serde_json::json!(1)));
            }
            match self.in_flight.compare_exchange(
                now,
                now + bytes,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    return Ok(Reserved {
                        in_flight: self.in_flight.clone(),
                        bytes,
                    })
                }
                Err(seen) => now = seen,
            }
        }
    }
}

/// Longest time a request body may take to arrive (a request extension
/// set by the router).
#[derive(Debug, Clone, Copy)]
pub struct BodyReadTimeout(pub Duration);

/// A JSON array of at most `N` items: the parse stops at item `N + 1`
/// with an error naming the bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedVec<T, const N: usize>(pub Vec<T>);

impl<T, const N: usize> BoundedVec<T, N> {
    /// The items.
    pub fn into_inner(self) -> Vec<T> {
        self.0
    }
}

impl<'de, T: serde::Deserialize<'de>, const N: usize> serde::Deserialize<'de> for BoundedVec<T, N> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Items<T, const N: usize>(PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>, const N: usize> serde::de::Visitor<'de> for Items<T, N> {
            type Value = BoundedVec<T, N>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "an array of at most {N} items")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(N).min(1024));
                while let Some(item) = seq.next_element::<T>()? {
                    if out.len() == N {
                        return Err(serde::de::Error::custom(format!(
                            "more than {N} items; send at most {N} per request"
                        )));
                    }
                    out.push(item);
                }
                Ok(BoundedVec(out))
            }
        }
        d.deserialize_seq(Items::<T, N>(PhantomData))
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
