//! Credentials kept out of everything a person or a client can read.
//!
//! A store URL may carry a password (`redis://:PW@host/0`,
//! `redis://user:PW@host/0`). Every error, log line, HTTP answer, metric
//! label and dashboard field that names a URL shows it through
//! [`redact`], which keeps the user name and replaces the password (or a
//! lone userinfo, which Redis reads as a password) with [`MASK`]. The
//! server also passes every error body through it, so text that a library
//! below built from a raw URL is caught at the edge too.
//!
//! The rule, for each `scheme://` in the text: the authority runs to the
//! first `/`, `?`, `#`, whitespace, quote, `<`, `>` or `)`; if it holds an
//! `@`, everything before the last `@` is the userinfo. `user:pw` becomes
//! `user:***`, `:pw` becomes `:***`, a userinfo without `:` becomes `***`.

use std::borrow::Cow;

/// What a password is replaced with.
pub const MASK: &str = "***";

/// `text` with the credentials of every URL in it replaced by [`MASK`].
/// Text without `://` is returned as it is, without a copy.
pub fn redact(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut changed = false;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | '"' | '\'' | '<' | '>' | ')' | '`')
                    || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(userinfo_end) => {
                let userinfo = &authority[..userinfo_end];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon + 1]);
                        out.push_str(MASK);
                    }
                    None => out.push_str(MASK),
                }
                out.push_str(&authority[userinfo_end..]);
                changed = true;
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(text)
    }
}

/// [`redact`] as an owned string.
pub fn redacted(text: &str) -> String {
    redact(text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        let cases = [
            (
                "redis://:s3cret@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("redis://app:s3cret@h:1/2", "redis://app:***@h:1/2"),
            ("redis://s3cret@h:1", "redis://***@h:1"),
            (
                "redis+cluster://:pw@a:1,b:2",
                "redis+cluster://:***@a:1,b:2",
            ),
            (
                "shard \"s1\" at redis://:pw@h:1/0: refused; also redis://h:2/0",
                "shard \"s1\" at redis://:***@h:1/0: refused; also redis://h:2/0",
            ),
            (
                "{\"url\":\"redis://u:p@x:1\"}",
                "{\"url\":\"redis://u:***@x:1\"}",
            ),
            ("redis://h:1/0", "redis://h:1/0"),
            ("no url here", "no url here"),
            ("ends with ://", "ends with ://"),
            ("redis://:p@ss@h:1", "redis://:***@h:1"),
        ];
        for (input, want) in cases {
            assert_eq!(redact(input), want, "{input}");
            assert!(!redact(input).contains("s3cret"), "{input}");
        }
    }

    #[test]
    fn text_without_credentials_is_not_copied() {
        assert!(matches!(redact("redis://h:1/0 and more"), Cow::Borrowed(_)));
    }
}
