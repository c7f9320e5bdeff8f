//! The server's errors: [`ServerError`] for starting and stopping, and
//! [`ApiError`], the one JSON error body (`{"error": "..."}` plus details)
//! every failed request gets, with the status code the library error maps
//! to. It must never answer with a non-JSON body or drop the cause's words.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use shardq_core::producer::ProduceError;
use shardq_core::reshard::ReshardError;
use shardq_core::{ErrorKind, QueueError};
use shardq_deploy::DeployError;
use thiserror::Error;

/// Errors starting or running a server.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The configuration is refused (addresses, tokens, limits).
    #[error("{0}")]
    Config(String),
    /// The deployment could not be opened.
    #[error(transparent)]
    Deploy(#[from] DeployError),
    /// Listening or serving failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl ServerError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ServerError::Config(_) => ErrorKind::BadInput,
            ServerError::Deploy(e) => e.kind(),
            ServerError::Io { .. } => ErrorKind::Internal,
        }
    }
}

/// A failed request: a status and a JSON body with at least `error`.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// The message.
    pub message: String,
    /// More fields of the body (lists of stale receipts, placed jobs...).
    pub extra: Map<String, Value>,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            extra: Map::new(),
        }
    }

    /// 400: bad input, nothing was stored.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// 409: a stale receipt, a shard not owned here, a busy operation.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }

    /// 500: something the server did not expect.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// 503: try again later.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// Adds a field to the body.
    pub fn with(mut self, field: &str, value: Value) -> ApiError {
        self.extra.insert(field.to_string(), value);
        self
    }
}

impl IntoResponse for ApiError {
    /// The body, with the credentials of any URL in its text masked
    /// ([`shardq_core::secret::redact`]): no error a store gave names a
    /// password to a client, whatever built its words.
    fn into_response(self) -> Response {
        let mut body = self.extra;
        for v in body.values_mut() {
            if let Value::String(s) = v {
                if let std::borrow::Cow::Owned(r) = shardq_core::secret::redact(s) {
                    *s = r;
                }
            }
        }
        body.insert(
            "error".into(),
            Value::String(shardq_core::secret::redacted(&self.message)),
        );
        body.entry("kind")
            .or_insert_with(|| Value::from(status_kind(self.status)));
        let retry_after = body.get("retry_after_s").and_then(Value::as_u64);
        let mut response = (self.status, axum::Json(Value::Object(body))).into_response();
        if let Some(s) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(s),
            );
        }
        response
    }
}

/// The `kind` of an error body that no library error gave one: every error
/// body carries a kind, so a client decides without reading the words.
/// The library kinds ([`ErrorKind::name`]) for the statuses they map to,
/// and `unauthorized`, `forbidden`, `not_found` for the server's own.
pub fn status_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        408 | 425 | 429 | 503 => ErrorKind::Retryable.name(),
        409 => ErrorKind::Conflict.name(),
        400..=499 => ErrorKind::BadInput.name(),
        _ => ErrorKind::Internal.name(),
    }
}

/// The status of an error of `kind`: the one mapping from a library
/// error to HTTP ([`ErrorKind::http_status`]).
pub fn kind_status(kind: ErrorKind) -> StatusCode {
    StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The status a queue error maps to.
pub fn queue_status(e: &QueueError) -> StatusCode {
    kind_status(e.kind())
}

impl ApiError {
    /// The error of a library failure of `kind`: its status, its message,
    /// and `"kind"` in the body so that a client decides without reading
    /// the words.
    pub fn of_kind(kind: ErrorKind, message: String) -> ApiError {
        ApiError::new(kind_status(kind), message).with("kind", Value::from(kind.name()))
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> ApiError {
        ApiError::of_kind(e.kind(), e.to_string())
    }
}

impl From<ReshardError> for ApiError {
    fn from(e: ReshardError) -> ApiError {
        ApiError::of_kind(e.kind(), e.to_string())
    }
}

impl From<DeployError> for ApiError {
    fn from(e: DeployError) -> ApiError {
        ApiError::of_kind(e.kind(), e.to_string())
    }
}

impl From<ProduceError> for ApiError {
    fn from(e: ProduceError) -> ApiError {
        ApiError::of_kind(e.kind(), e.to_string())
    }
}

/// A blocking task that did not finish (it panicked or was cancelled).
pub fn join_error(e: tokio::task::JoinError) -> ApiError {
    ApiError::internal(format!("the request's worker thread failed: {e}"))
}

/// The body of a refusal listing receipts, e.g. for the 409 of an ack.
pub fn listed(message: String, fields: Value) -> ApiError {
    let mut e = ApiError::conflict(message);
    if let Value::Object(m) = fields {
        e.extra = m;
    }
    e
}

/// `{"error": ...}` as a value, for bodies built by hand.
pub fn error_value(message: &str) -> Value {
    json!({ "error": message })
}
