//! [`AllowedHosts`]: the `Host` header values a listener answers to.

use axum::http::{HeaderMap, header};

/// A host pattern could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a host name: write `name`, `name:port`, `1.2.3.4:port` or `[::1]:port`")]
pub struct InvalidHost(pub String);

/// The names (`host` or `host:port`) a listener answers to; a name without
/// a port matches it on any port. Matching ignores case.
///
/// The default, [`loopback`](Self::loopback), answers to `localhost`,
/// `127.0.0.1` and `[::1]` on any port: enough for a server on loopback,
/// and never a name an attacker's DNS can point at it.
///
/// ```
/// use axum::http::{HeaderMap, HeaderValue, header};
/// use keel_http::access::AllowedHosts;
///
/// let hosts = AllowedHosts::loopback().with(["shop.example:8443"]).unwrap();
/// let mut headers = HeaderMap::new();
/// headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
/// assert!(hosts.allows_request(&headers));
/// headers.insert(header::HOST, HeaderValue::from_static("rebind.evil.example:8080"));
/// assert!(!hosts.allows_request(&headers));
/// assert!(hosts.allows_origin("https://shop.example:8443"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts {
    patterns: Vec<(String, Option<String>)>,
    any: bool,
}

impl Default for AllowedHosts {
    fn default() -> Self {
        Self::loopback()
    }
}

impl AllowedHosts {
    /// `localhost`, `127.0.0.1` and `[::1]`, on any port.
    pub fn loopback() -> Self {
        Self {
            patterns: ["localhost", "127.0.0.1", "[::1]"]
                .into_iter()
                .map(|h| (h.to_owned(), None))
                .collect(),
            any: false,
        }
    }

    /// Every `Host`. Only behind a proxy that checks it already.
    pub fn any() -> Self {
        Self {
            patterns: Vec::new(),
            any: true,
        }
    }

    /// These names as well (`*` alone allows every name).
    pub fn with<I, T>(mut self, hosts: I) -> Result<Self, InvalidHost>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        for host in hosts {
            let host = host.as_ref().trim();
            if host == "*" {
                self.any = true;
                continue;
            }
            let (name, port) = split(host).ok_or_else(|| InvalidHost(host.to_owned()))?;
            self.patterns.push((name, port));
        }
        Ok(self)
    }

    /// Whether `host` (a `Host` header value) is allowed.
    pub fn allows(&self, host: &str) -> bool {
        if self.any {
            return true;
        }
        let Some((name, port)) = split(host) else {
            return false;
        };
        self.patterns
            .iter()
            .any(|(n, p)| *n == name && (p.is_none() || *p == port))
    }

    /// Whether the request's `Host` is allowed (a request without one is
    /// not, unless every host is).
    pub fn allows_request(&self, headers: &HeaderMap) -> bool {
        match headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
            Some(host) => self.allows(host),
            None => self.any,
        }
    }

    /// Whether `origin` (`scheme://host[:port]`) names an allowed host.
    pub fn allows_origin(&self, origin: &str) -> bool {
        origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|authority| !authority.contains('/') && self.allows(authority))
    }

    /// The patterns, for logs.
    pub fn describe(&self) -> String {
        if self.any {
            return "*".to_owned();
        }
        let names: Vec<String> = self
            .patterns
            .iter()
            .map(|(n, p)| match p {
                Some(p) => format!("{n}:{p}"),
                None => n.clone(),
            })
            .collect();
        names.join(", ")
    }
}

/// `host[:port]` into the lower-cased name and the port.
fn split(host: &str) -> Option<(String, Option<String>)> {
    let host = host.trim().to_ascii_lowercase();
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?.to_owned()),
        };
        (format!("[{inside}]"), port)
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name.to_owned(), Some(port.to_owned())),
            None => (host.clone(), None),
        }
    };
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.[]:_".contains(&b));
    let port_ok = port
        .as_ref()
        .is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    (name_ok && port_ok).then_some((name, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_match_on_any_port_and_nothing_else_does() {
        let hosts = AllowedHosts::loopback();
        for host in ["127.0.0.1:8080", "LOCALHOST:1", "localhost", "[::1]:9"] {
            assert!(hosts.allows(host), "{host}");
        }
        for host in [
            "rebind.evil.example",
            "127.0.0.1.evil.example:8080",
            "localhost:80:80",
            "",
            "[::1",
        ] {
            assert!(!hosts.allows(host), "{host}");
        }
        assert!(
            !hosts.allows_request(&HeaderMap::new()),
            "no Host, no entry"
        );
    }

    #[test]
    fn a_pattern_with_a_port_matches_only_that_port() {
        let hosts = AllowedHosts::loopback()
            .with(["shop.example:8443"])
            .unwrap();
        assert!(hosts.allows("shop.example:8443"));
        assert!(!hosts.allows("shop.example:8444"));
        assert!(!hosts.allows("shop.example"));
        assert!(hosts.allows_origin("https://shop.example:8443"));
        assert!(!hosts.allows_origin("null"));
        assert!(!hosts.allows_origin("https://shop.example:8443/path"));
        assert!(AllowedHosts::loopback().with(["bad host"]).is_err());
        assert!(AllowedHosts::loopback().with(["*"]).unwrap().allows("x"));
    }
}
