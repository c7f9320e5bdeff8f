//! Bearer tokens and roles. A tokens file holds one `TOKEN ROLE[,ROLE...]`
//! per line (`#` starts a comment); a request names its token in
//! `Authorization: Bearer TOKEN` and each path needs one role. This module
//! must never log, echo or return a token, and never read one from the
//! command line.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Shortest token accepted, in bytes: a guessable token is no protection.
pub const TOKEN_BYTES_MIN: usize = 16;
/// Largest tokens file read, in bytes.
pub const TOKENS_FILE_BYTES_MAX: u64 = 1 << 20;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Enqueue (`POST /v1/jobs`).
    Produce,
    /// Claim, ack, fail, extend.
    Work,
    /// Status, keys, dead-letter lists, rebalance progress.
    Read,
    /// Dead-letter retry and purge, resharding.
    Admin,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 4] = [Role::Produce, Role::Work, Role::Read, Role::Admin];

    /// The role's name in tokens files.
    pub fn name(self) -> &'static str {
        match self {
            Role::Produce => "produce",
            Role::Work => "work",
            Role::Read => "read",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role {s:?}: expected produce, work, read or admin"))
    }
}

/// The tokens a server accepts.
#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<(Vec<u8>, BTreeSet<Role>)>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokens({} entries)", self.entries.len())
    }
}

impl Tokens {
    /// Parses a tokens file's text; `origin` names it in errors. Errors name
    /// the line, never the token.
    pub fn parse(text: &str, origin: &str) -> Result<Tokens, String> {
        let mut entries: Vec<(Vec<u8>, BTreeSet<Role>)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let n = i + 1;
            let mut parts = line.split_whitespace();
            let (Some(token), Some(roles), None) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(format!(
                    "{origin} line {n}: expected `TOKEN ROLE[,ROLE...]` (two fields)"
                ));
            };
            if token.len() < TOKEN_BYTES_MIN {
                return Err(format!(
                    "{origin} line {n}: the token is {} bytes, at least {TOKEN_BYTES_MIN} are required",
                    token.len()
                ));
            }
            let mut set = BTreeSet::new();
            for r in roles.split(',').filter(|r| !r.is_empty()) {
                set.insert(
                    r.parse::<Role>()
                        .map_err(|e| format!("{origin} line {n}: {e}"))?,
                );
            }
            if set.is_empty() {
                return Err(format!("{origin} line {n}: no role given"));
            }
            if entries.iter().any(|(t, _)| t == token.as_bytes()) {
                return Err(format!(
                    "{origin} line {n}: the same token appears on an earlier line"
                ));
            }
            entries.push((token.as_bytes().to_vec(), set));
        }
        if entries.is_empty() {
            return Err(format!("{origin} holds no token"));
        }
        Ok(Tokens { entries })
    }

    /// Reads a tokens file.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let meta = std::fs::metadata(path)
            .map_err(|e| format!("reading tokens file {}: {e}", path.display()))?;
        if meta.len() > TOKENS_FILE_BYTES_MAX {
            return Err(format!(
                "tokens file {} is {} bytes, over {TOKENS_FILE_BYTES_MAX}",
                path.display(),
                meta.len()
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading tokens file {}: {e}", path.display()))?;
        Tokens::parse(&text, &format!("tokens file {}", path.display()))
    }

    /// The roles of `token`, if it is known. Compares every entry in full,
    /// without stopping early, so timing does not reveal a prefix.
    pub fn roles(&self, token: &[u8]) -> Option<&BTreeSet<Role>> {
        let mut found = None;
        for (t, roles) in &self.entries {
            if constant_time_eq(t, token) {
                found = Some(roles);
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a route's guard checks: the server's tokens (`None`: no
/// authentication, loopback only) and the role the route needs.
#[derive(Clone)]
pub struct Guard {
    /// Accepted tokens.
    pub tokens: Option<Arc<Tokens>>,
    /// The role the route needs.
    pub role: Role,
}

/// Middleware: 401 without a known bearer token, 403 without the role.
pub async fn require(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Some(tokens) = &guard.tokens else {
        return next.run(request).await;
    };
    let header_value = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(token) = header_value.and_then(|v| v.strip_prefix("Bearer ")) else {
        return unauthorized("missing bearer token: send `Authorization: Bearer TOKEN`");
    };
    let Some(roles) = tokens.roles(token.trim().as_bytes()) else {
        return unauthorized("unknown bearer token");
    };
    if !roles.contains(&guard.role) {
        let have: Vec<&str> = roles.iter().map(|r| r.name()).collect();
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "{} {} needs role {:?}; this token has {:?}",
                request.method(),
                request.uri().path(),
                guard.role.name(),
                have
            ),
        )
        .into_response();
    }
    next.run(request).await
}

fn unauthorized(message: &str) -> Response {
    let mut r = ApiError::new(StatusCode::UNAUTHORIZED, message).into_response();
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file_errors_name_the_line_not_the_token() {
        let t = Tokens::parse(
            "# comment\n0123456789abcdef produce,work\n\nfedcba9876543210 admin # ops\n",
            "f",
        )
        .unwrap();
        assert!(t.roles(b"0123456789abcdef").unwrap().contains(&Role::Work));
        assert!(t.roles(b"0123456789abcdeX").is_none());
        assert!(t.roles(b"fedcba9876543210").unwrap().contains(&Role::Admin));
        let e = Tokens::parse("short read\n", "f").unwrap_err();
        assert!(e.contains("line 1") && !e.contains("short"), "{e}");
        let e = Tokens::parse("0123456789abcdef root\n", "f").unwrap_err();
        assert!(e.contains("\"root\"") && !e.contains("0123"), "{e}");
        assert!(Tokens::parse("# nothing\n", "f").is_err());
        assert!(Tokens::parse("0123456789abcdef\n", "f").is_err());
    }
}
