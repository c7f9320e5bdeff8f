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

/// A token as the server keeps it: its BLAKE2b-256 digest, so that
/// comparing a presented token takes the same time whatever its length or
/// how much of it matches.
type TokenDigest = [u8; 32];

fn digest(token: &[u8]) -> TokenDigest {
    use blake2::digest::{Update, VariableOutput};
    let mut h = blake2::Blake2bVar::new(32).expect("32 is a valid BLAKE2b output size");
    h.update(token);
    let mut out = [0u8; 32];
    h.finalize_variable(&mut out)
        .expect("the buffer has the requested size");
    out
}

/// Who made a request: the number of its token in the tokens file
/// ([`ANONYMOUS`] without authentication). Handlers find it in the
/// request's extensions and bound per-token resources with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Principal(pub u32);

/// The principal of every request of a server without tokens.
pub const ANONYMOUS: Principal = Principal(u32::MAX);

/// The tokens a server accepts.
#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<(TokenDigest, BTreeSet<Role>)>,
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
        let mut entries: Vec<(TokenDigest, BTreeSet<Role>)> = Vec::new();
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
            let d = digest(token.as_bytes());
            if entries.iter().any(|(t, _)| *t == d) {
                return Err(format!(
                    "{origin} line {n}: the same token appears on an earlier line"
                ));
            }
            entries.push((d, set));
        }
        if entries.is_empty() {
            return Err(format!("{origin} holds no token"));
        }
        Ok(Tokens { entries })
    }

    /// Reads a tokens file. A file that other users may write is refused:
    /// group- or world-writable, owned by another user (but root), or in a
    /// directory every user can write without the sticky bit. Whoever can
    /// write it can give themselves any role.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)
            .map_err(|e| format!("reading tokens file {}: {e}", path.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o022 != 0 {
            return Err(format!(
                "tokens file {} has mode {mode:03o}: other users can write it and give themselves any role; run `chmod 600 {}`",
                path.display(),
                path.display()
            ));
        }
        {
            use std::os::unix::fs::MetadataExt;
            let me = rustix::process::geteuid().as_raw();
            if meta.uid() != me && meta.uid() != 0 {
                return Err(format!(
                    "tokens file {} belongs to user id {}, not to this server's ({me}) nor root: its owner can give themselves any role; `chown` it to the user the server runs as",
                    path.display(),
                    meta.uid()
                ));
            }
            let dir = path
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            if let Ok(d) = std::fs::metadata(dir) {
                let dmode = d.permissions().mode();
                if dmode & 0o002 != 0 && dmode & 0o1000 == 0 {
                    return Err(format!(
                        "tokens file {} is in {}, which every user can write (mode {:03o}, no sticky bit): anyone can replace the file; move it to a directory only its owner writes",
                        path.display(),
                        dir.display(),
                        dmode & 0o777
                    ));
                }
            }
        }
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

    /// The roles of `token`, if it is known.
    pub fn roles(&self, token: &[u8]) -> Option<&BTreeSet<Role>> {
        self.find(token).map(|(_, r)| r)
    }

    /// The principal and roles of `token`. Compares digests (so neither
    /// the length nor a prefix of a token shows in the timing), every
    /// entry in full, without stopping early.
    fn find(&self, token: &[u8]) -> Option<(Principal, &BTreeSet<Role>)> {
        let d = digest(token);
        let mut found = None;
        for (n, (t, roles)) in self.entries.iter().enumerate() {
            if constant_time_eq(t, &d) {
                found = Some((Principal(n as u32), roles));
            }
        }
        found
    }
}

fn constant_time_eq(a: &TokenDigest, b: &TokenDigest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization` header value: the scheme `Bearer` in
/// any case (RFC 9110 makes it case-insensitive), one or more spaces.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim();
    (!token.is_empty()).then_some(token)
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
pub async fn require(State(guard): State<Guard>, mut request: Request, next: Next) -> Response {
    let Some(tokens) = &guard.tokens else {
        request.extensions_mut().insert(ANONYMOUS);
        return next.run(request).await;
    };
    let header_value = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(token) = header_value.and_then(bearer_token) else {
        return unauthorized("missing bearer token: send `Authorization: Bearer TOKEN`");
    };
    let Some((principal, roles)) = tokens.find(token.as_bytes()) else {
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
    request.extensions_mut().insert(principal);
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

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for (value, want) in [
            ("Bearer abc", Some("abc")),
            ("bearer abc", Some("abc")),
            ("BEARER   abc ", Some("abc")),
            ("Basic abc", None),
            ("Bearer", None),
            ("Bearer    ", None),
            ("Bearerabc", None),
        ] {
            assert_eq!(bearer_token(value), want, "{value:?}");
        }
    }

    #[test]
    fn a_tokens_file_in_a_directory_everyone_writes_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        let path = open.join("tokens");
        std::fs::write(&path, "0123456789abcdef admin\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        for (mode, ok) in [(0o755, true), (0o777, false), (0o1777, true)] {
            std::fs::set_permissions(&open, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = Tokens::load(&path);
            assert_eq!(r.is_ok(), ok, "directory mode {mode:o}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains("every user can write"), "{e}");
            }
        }
    }

    #[test]
    fn a_tokens_file_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, "0123456789abcdef admin\n").unwrap();
        for (mode, ok) in [(0o600, true), (0o644, true), (0o620, false), (0o666, false)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = Tokens::load(&path);
            assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
            if let Err(e) = r {
                assert!(
                    e.contains(&format!("{mode:03o}")) && e.contains("chmod 600"),
                    "{e}"
                );
                assert!(!e.contains("0123456789abcdef"), "{e}");
            }
        }
    }
}
