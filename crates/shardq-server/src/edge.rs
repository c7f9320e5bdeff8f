//! What every request passes before its route: the checks that keep a web
//! page in a browser on the same host from using the API (cross-site
//! requests and DNS rebinding), and the headers every answer carries.
//!
//! * A request whose `Host` (or absolute-form target) is not one this
//!   server answers to is refused (421), and one that gives `Host`,
//!   `Origin`, `Sec-Fetch-Site` or `Content-Type` twice is refused (400): on a loopback listener, `127.0.0.1`, `localhost` and `[::1]`
//!   with the listening port, the listening address itself, and any
//!   `--allowed-host`; on an unspecified address (`0.0.0.0`, which needs
//!   tokens) only the allowed hosts, or any host when none is given.
//! * A request that may change something (any method but GET, HEAD and
//!   OPTIONS) is refused (403) when its `Origin` is not this server's own
//!   or its `Sec-Fetch-Site` says another site sent it, and (415) when its
//!   `Content-Type` is not `application/json`, even with an empty body: a
//!   page can send `text/plain` or no type across sites without asking.
//! * Every answer says `X-Content-Type-Options: nosniff`, `X-Frame-Options:
//!   DENY`, `Referrer-Policy: no-referrer` and a `Content-Security-Policy`
//!   that allows only this server's own scripts and styles and no framing.
//!
//! This module must never read a body or decide a request's role.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The dashboard's and the API's content security policy.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// The hosts a server answers to. See the module docs.
#[derive(Debug, Clone)]
pub struct Hosts {
    /// Lower-case `host:port` values accepted; `None` accepts any.
    allowed: Option<Vec<String>>,
}

impl Hosts {
    /// The hosts of a server listening on `listen`, plus `extra` (each
    /// `host` or `host:port`; a bare host takes the listening port).
    pub fn new(listen: SocketAddr, extra: &[String]) -> Hosts {
        let port = listen.port();
        let with_port = |h: &str| {
            let h = h.trim().to_ascii_lowercase();
            if h.ends_with(']') || !h.contains(':') {
                format!("{h}:{port}")
            } else {
                h
            }
        };
        let mut allowed: Vec<String> = extra.iter().map(|h| with_port(h)).collect();
        let ip = listen.ip();
        if ip.is_unspecified() {
            if allowed.is_empty() {
                return Hosts { allowed: None };
            }
        } else {
            allowed.push(listen.to_string());
            if ip.is_loopback() {
                for h in ["127.0.0.1", "localhost", "[::1]"] {
                    allowed.push(format!("{h}:{port}"));
                }
            }
        }
        // A client may leave out the port when it is the scheme's default.
        if port == 80 {
            let bare: Vec<String> = allowed
                .iter()
                .filter_map(|h| h.strip_suffix(":80").map(str::to_string))
                .collect();
            allowed.extend(bare);
        }
        allowed.sort();
        allowed.dedup();
        Hosts {
            allowed: Some(allowed),
        }
    }

    fn accepts(&self, host: &str) -> bool {
        match &self.allowed {
            None => true,
            Some(list) => list.iter().any(|h| h.eq_ignore_ascii_case(host)),
        }
    }
}

/// Middleware: the checks of the module docs, then the route, then the
/// headers.
pub async fn check(State(hosts): State<Arc<Hosts>>, request: Request, next: Next) -> Response {
    let mut response = match refuse(&hosts, &request) {
        Some(e) => e.into_response(),
        None => next.run(request).await,
    };
    let h = response.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    response
}

fn refuse(hosts: &Hosts, request: &Request) -> Option<ApiError> {
    let headers = request.headers();
    // A header that says who sent the request must be said once: with two,
    // a proxy and this server could each read a different one.
    for name in [
        header::HOST,
        header::ORIGIN,
        HeaderName::from_static("sec-fetch-site"),
        header::CONTENT_TYPE,
    ] {
        if headers.get_all(&name).iter().count() > 1 {
            return Some(ApiError::bad(format!(
                "the {name} header is given more than once; give it once"
            )));
        }
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let Some(host) = host else {
        return Some(ApiError::bad(
            "missing Host header: send `Host: ADDRESS:PORT` (HTTP/1.1 requires it)",
        ));
    };
    // An absolute-form target (`POST http://name/path`) names the host
    // too, and takes precedence over the header (RFC 9112 3.2.2).
    let named = [Some(host), request.uri().authority().map(|a| a.as_str())];
    for h in named.into_iter().flatten() {
        if !hosts.accepts(h) {
            return Some(ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "Host {} is not an address of this server; connect to its listening address, or start it with --allowed-host NAME",
                    crate::api::shown_str(h)
                ),
            ));
        }
    }
    let method = request.method();
    if method == Method::GET || method == Method::HEAD || method == Method::OPTIONS {
        return None;
    }
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        if !(site.eq_ignore_ascii_case("same-origin") || site.eq_ignore_ascii_case("none")) {
            return Some(ApiError::new(
                StatusCode::FORBIDDEN,
                format!("cross-site request refused (Sec-Fetch-Site: {site:?}): {method} is only taken from this server's own pages and from clients outside a browser"),
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let own = origin
            .strip_prefix("http://")
            .is_some_and(|rest| rest.eq_ignore_ascii_case(host));
        if !own {
            return Some(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "cross-origin request refused: Origin {} is not this server (http://{host})",
                    crate::api::shown_str(origin)
                ),
            ));
        }
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json);
    if !json {
        let got = headers
            .get(header::CONTENT_TYPE)
            .map(|v| format!("{:?}", v.to_str().unwrap_or("(not text)")))
            .unwrap_or_else(|| "none".into());
        return Some(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("{method} {}: Content-Type is {got}; send `Content-Type: application/json` (with a JSON body, `{{}}` when there is nothing to say)", request.uri().path()),
        ));
    }
    None
}

/// `application/json`, with parameters (`; charset=utf-8`) or not.
fn is_json(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_a_loopback_listener() {
        let h = Hosts::new("127.0.0.1:7070".parse().unwrap(), &[]);
        for ok in [
            "127.0.0.1:7070",
            "localhost:7070",
            "LOCALHOST:7070",
            "[::1]:7070",
        ] {
            assert!(h.accepts(ok), "{ok}");
        }
        for bad in [
            "127.0.0.1:7071",
            "evil.example:7070",
            "localhost",
            "127.0.0.1",
        ] {
            assert!(!h.accepts(bad), "{bad}");
        }
        let h = Hosts::new(
            "127.0.0.1:7070".parse().unwrap(),
            &["queue.internal".into()],
        );
        assert!(h.accepts("queue.internal:7070"));
        let any = Hosts::new("0.0.0.0:7070".parse().unwrap(), &[]);
        assert!(any.accepts("anything:1"));
        let named = Hosts::new("0.0.0.0:80".parse().unwrap(), &["q.example".into()]);
        assert!(named.accepts("q.example") && named.accepts("q.example:80"));
        assert!(!named.accepts("other.example"));
    }

    #[test]
    fn json_content_types() {
        for (v, want) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
            ("application/jsonx", false),
        ] {
            assert_eq!(is_json(v), want, "{v}");
        }
    }
}
